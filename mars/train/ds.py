"""DeepSpeed ZeRO-2 / ZeRO-3 behind the :class:`mars.train.optim.TorchStepper` interface.

What it does
    :class:`DeepSpeedStepper` wraps a model in a ``deepspeed`` engine with ZeRO stage ``cfg.deepspeed_stage`` (2 or
    3) and exposes what the trainers use: ``module``, ``backward(loss)``, ``step() -> grad norm``, ``zero_grad()``,
    ``lrs()``, ``state_dict()`` / ``load_state_dict()``, plus ``save(dir)`` / ``load(dir)`` (DeepSpeed checkpoints).
    The optimizer is a plain ``torch.optim.AdamW`` over :func:`mars.train.optim.param_groups` (per-group learning
    rates and weight decay, same betas and eps as ``TorchStepper``), the schedule a ``LambdaLR`` of
    :func:`mars.train.optim.lr_lambda` that the engine steps after each optimizer update, and clipping DeepSpeed's
    ``gradient_clipping = cfg.clip_norm`` (global L2 norm over all partitions, as ``clip_grad_norm_``).
    ``make_stepper`` in :mod:`mars.train.optim` builds it when ``cfg.deepspeed_stage`` is 2 or 3.

Semantics of backward / step
    As with ``TorchStepper``: ``step()`` applies ONE optimizer update over the sum of the gradients of every
    ``backward(loss)`` since the last ``step()`` (the trainers accumulate themselves: they scale their losses and
    call ``backward`` several times). DeepSpeed's own accumulation is not used: the config has
    ``gradient_accumulation_steps = 1`` and ``backward`` never rescales the loss (``scale_wrt_gas=False``).
    With ``gradient_accumulation_steps = 1`` every ``engine.backward`` is a boundary, and ZeRO-2 then keeps only the
    last backward's gradients (measured on a toy model: two backwards gave norm 1.90 instead of 2.62). So the first ``backward`` after
    a step opens DeepSpeed's ``engine.coalesce_grad_reduction()`` block (grads accumulate locally on the params, no
    reduction), and ``step()`` closes it (one reduction pass over the accumulated grads into the ZeRO partitions)
    and calls ``engine.step()`` (clip, AdamW, schedule). The same path serves ZeRO-2 and ZeRO-3.
    ``step`` returns the global gradient norm before clipping (``engine.get_global_grad_norm()``).
    Measured on the tiny Qwen-VL, CPU, two backwards per step, two steps: ZeRO-2 weights within 4e-7 of
    ``TorchStepper``'s (lr 2e-3 / 1e-2), ZeRO-3 within 5e-5 (not pinned down; ZeRO-3 reduces its norm in float64
    and sums in another order, and Adam amplifies last-bit differences where |grad| is near eps).

Deviations from ``TorchStepper``
    * ``step()`` with no ``backward`` since the last step only steps the schedule and returns 0.0 (``TorchStepper``'s
      AdamW skips every parameter then too, and its norm is 0); DeepSpeed's step counter does not advance.
    * Precision: fp32 (bf16/fp16 off), so on CPU the update equals ``TorchStepper``'s to float rounding. On GPU,
      the same fp32 config runs; switching to bf16 is a config change in :meth:`DeepSpeedStepper.ds_config`.
    * ZeRO-3 partitions the parameters: outside ``forward`` ``p.data`` is empty. Read or write weights inside
      ``deepspeed.zero.GatheredParameters(params, modifier_rank=0)``, or save with ``save(dir)`` /
      ``engine.save_16bit_model``. ZeRO-2 leaves the module's parameters whole (views into a flat buffer);
      ``model.state_dict()`` / ``load_state_dict()`` work as usual.
    * ``state_dict()`` is the ZeRO optimizer's own (partitioned) state of THIS rank plus the scheduler's; it loads
      back only with the same stage and world size. ``load_state_dict`` keeps the module's current weights as the
      fp32 master copy (``load_from_fp32_weights=False``), so restore the model weights FIRST, then the stepper.
      ``save(dir)`` / ``load(dir)`` (``engine.save_checkpoint`` / ``load_checkpoint``: module, optimizer, schedule
      in one directory, resharded by DeepSpeed's tools) are the multi-rank path. ``TorchStepper`` has no
      ``save``/``load``; the trainers resume through ``state_dict``.
    * ``zero_grad()`` discards the gradients of the backwards since the last step (it closes the coalescing block
      first, so no half-accumulated reduction state is left).

How to run
    CPU, one process (tests, laptops): just build it; with no CUDA it sets ``DS_ACCELERATOR=cpu`` (before
    ``deepspeed`` is first imported), and with no process group it starts a one-rank ``gloo`` group on
    127.0.0.1 at a free port (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK=0``, ``WORLD_SIZE=1``, ``LOCAL_RANK=0``).
    With one rank it also disables DeepSpeed's shared-memory CPU all-reduce op, which would otherwise be
    JIT-compiled (about 80 s, needs a C++ compiler) and does nothing for one rank; nothing else is compiled
    (torch AdamW, not DeepSpeedCPUAdam, and ``zero_force_ds_cpu_optimizer: false``).
    Several GPUs: ``deepspeed --num_gpus N -m mars.cli ...`` or ``torchrun --nproc_per_node N -m mars.cli ...``:
    the launcher sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_*`` and the engine starts ``nccl``.
    Environment: ``DS_ACCELERATOR`` (``cpu`` | ``cuda``; default: cuda when available), ``DS_BUILD_OPS=0`` at
    install time (no prebuilt ops; the Makefile sets it), ``MARS_DS_SHM=1`` to keep the shm op on one CPU rank.
    Install: ``DS_BUILD_OPS=0 pip install --no-build-isolation -c requirements.lock deepspeed==0.19.8`` (the
    Makefile's setup does it; build isolation would fetch a CUDA torch).

Run the tests: ``.venv/bin/python -m pytest tests/train/test_deepspeed.py -q``.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch

from mars.train.optim import OptimConfig, lr_lambda, param_groups

__all__ = ["DeepSpeedStepper", "ensure_process_group"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group() -> None:
    """Start a one-rank gloo group on localhost unless a launcher (or the caller) already started one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        backend = "nccl" if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu" else "gloo"
        dist.init_process_group(backend)
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)


def _import_deepspeed():
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


class DeepSpeedStepper:
    """AdamW + schedule + clipping on a DeepSpeed ZeRO-2/3 engine (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig):
        if cfg.deepspeed_stage not in (2, 3):
            raise ValueError(f"DeepSpeedStepper needs deepspeed_stage 2 or 3, got {cfg.deepspeed_stage}")
        ds = _import_deepspeed()
        ensure_process_group()
        import torch.distributed as dist

        if dist.get_world_size() == 1 and os.environ.get("DS_ACCELERATOR") == "cpu" \
                and os.environ.get("MARS_DS_SHM") != "1":
            # Editing the cached dict is the documented way (deepspeed/ops/__init__.py): no shm op, no JIT build.
            ds.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self.cfg, self.stage = cfg, cfg.deepspeed_stage
        self.groups = param_groups(model, cfg)
        optimizer = torch.optim.AdamW(self.groups, betas=cfg.betas, eps=1e-8)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, cfg))
        self.engine, self.optimizer, _, self.scheduler = ds.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config(cfg))
        self.params = [p for g in self.groups for p in g["params"]]
        self._coalesce = None  # the open engine.coalesce_grad_reduction() block, from first backward to step

    @staticmethod
    def ds_config(cfg: OptimConfig) -> dict:
        return {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": float(cfg.clip_norm) if cfg.clip_norm > 0 else 0.0,
            "zero_optimization": {"stage": cfg.deepspeed_stage},
            "zero_force_ds_cpu_optimizer": False,
            "zero_allow_untested_optimizer": True,
            "bf16": {"enabled": False},
            "fp16": {"enabled": False},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def backward(self, loss: torch.Tensor) -> None:
        if self._coalesce is None:
            self._coalesce = self.engine.coalesce_grad_reduction()
            self._coalesce.__enter__()
        self.engine.backward(loss, scale_wrt_gas=False)

    def _reduce(self) -> None:
        """Leave the coalescing block: one ZeRO reduction pass over everything the backwards accumulated."""
        if self._coalesce is not None:
            block, self._coalesce = self._coalesce, None
            block.__exit__(None, None, None)

    def step(self) -> float:
        """Clip, step optimizer and schedule, zero the gradients; returns the gradient norm before clipping."""
        if self._coalesce is None:  # no backward since the last step: like AdamW with no grads, only the schedule
            self.scheduler.step()
            return 0.0
        self._reduce()
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self.engine.zero_grad()
        return float(norm) if norm is not None else float("nan")

    def zero_grad(self) -> None:
        self._reduce()
        self.engine.zero_grad()

    def lrs(self) -> dict[str, float]:
        return {g["name"]: float(g["lr"]) for g in self.optimizer.param_groups}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "stage": self.stage, "world_size": torch.distributed.get_world_size()}

    def load_state_dict(self, state: dict) -> None:
        ws = torch.distributed.get_world_size()
        if state.get("stage") != self.stage or state.get("world_size") != ws:
            raise ValueError(f"state is from ZeRO-{state.get('stage')} on {state.get('world_size')} ranks; this is "
                             f"ZeRO-{self.stage} on {ws}: use save()/load() checkpoints to reshard")
        self.optimizer.load_state_dict([state["optimizer"]], load_optimizer_states=True,
                                       load_from_fp32_weights=False)
        self.scheduler.load_state_dict(state["scheduler"])

    def save(self, directory: str | Path, tag: str = "latest_step") -> None:
        """DeepSpeed checkpoint of module, optimizer and schedule (every rank must call it)."""
        self.engine.save_checkpoint(str(directory), tag=tag)

    def load(self, directory: str | Path, tag: str | None = None) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {directory}")
