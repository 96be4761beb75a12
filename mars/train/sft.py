"""Supervised fine-tuning on teacher trajectories: next-token loss on model-generated tokens only.

What it does
    :func:`train_sft` trains a Qwen-VL model on pre-rendered trajectories (:mod:`mars.train.data`): batches of
    ``batch_size`` dialogues (of similar length with ``group_batches`` > 1: less padding), ``grad_accum``
    micro-batches per optimizer step, each run as ``length_split`` sub-batches of similar length
    (:func:`mars.train.data.length_chunks`: each pads only to its own longest), the loss summed over tokens whose
    loss mask is 1 (the assistant's own tokens and its ``<|im_end|>``) and divided by their count over the whole
    optimizer batch, so the split leaves the gradient as it was (to float rounding) and only cuts padding; AdamW
    with per-module learning rates, warm-up and schedule, gradient clipping (:mod:`mars.train.optim`; DeepSpeed
    ZeRO-2/3 when ``optim.deepspeed_stage`` asks for it); bf16 autocast when ``precision="bf16"`` and the device
    supports it. Every ``checkpoint_every`` steps it saves model, optimizer, scheduler, RNG states, step and sampler
    position (:mod:`mars.train.checkpoint`); a rerun with the same fingerprint resumes from the newest checkpoint and
    reproduces the uninterrupted loss curve exactly on CPU. With ``compile`` the text decoder layers run through
    ``torch.compile`` during the steps (:class:`mars.model.build.CompiledTextLayers`: faster, the same maths to
    float rounding). An optional stopping check (``until``) is asked after
    each checkpoint: the localisation block stops once its first zoom frames held-out scenes. Curves go to dvclive
    (``dvc plots show``); a tqdm bar shows progress. Returns a summary: steps, final and first losses, tokens/s,
    the share of step time spent collating batches, and peak memory.

Deviation
    The paper fine-tunes Qwen2.5-VL-7B with the vision tower frozen; on the embedded default the random-init
    vision tower and projector train too, with their own, higher learning rate (``optim.freeze_vision`` and
    ``optim.vision_lr``, set by the profile).

Run the tests: ``.venv/bin/python -m pytest tests/train -q``.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mars.model.build import CompiledTextLayers
from mars.model.chat import Rendered
from mars.train.checkpoint import Checkpointer, open_live
from mars.train.data import EpochSampler, collate, label_logits, length_chunks
from mars.train.optim import OptimConfig, make_stepper

__all__ = ["SFTConfig", "train_sft", "token_loss", "peak_rss_mb"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch_size: int = 16
    grad_accum: int = 1
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    precision: str = "fp32"  # fp32 | bf16
    seed: int = 0
    group_batches: int = 1  # length-grouped batches (mars.train.data.EpochSampler); 1 = plain shuffle
    length_split: int = 1  # each micro-batch run as this many sub-batches of similar length (the same gradient)
    compile: bool = False  # the text decoder layers' forward and backward through torch.compile (CompiledTextLayers)

    def __post_init__(self) -> None:
        if min(self.batch_size, self.grad_accum, self.checkpoint_every, self.group_batches, self.length_split) < 1:
            raise ValueError("batch_size, grad_accum, checkpoint_every, group_batches and length_split must be >= 1, "
                             f"got {self.batch_size}, {self.grad_accum}, {self.checkpoint_every}, "
                             f"{self.group_batches}, {self.length_split}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {self.precision!r}")


def _stop(until: Callable[[torch.nn.Module, int], bool] | None, model: torch.nn.Module, step: int) -> bool:
    """``until(model, step)`` with the model in eval mode (False without a check); leaves it in train mode."""
    if until is None:
        return False
    model.eval()
    with torch.no_grad():
        stop = bool(until(model, step))
    model.train()
    return stop


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over positions with a label (logits [..., V], labels [...] with -100 = none)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _autocast(precision: str):
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train_sft(
    model: torch.nn.Module,
    examples: list[Rendered],
    cfg: SFTConfig,
    *,
    pad_id: int,
    ckpt_dir: str | Path,
    live_dir: str | Path | None,
    fp: str,
    on_step: Callable[[int, dict], None] | None = None,
    until: Callable[[torch.nn.Module, int], bool] | None = None,
) -> dict:
    """Train ``model`` in place (see the module docstring); returns the run summary.

    ``until(model, step)``: a stopping check (e.g. :class:`mars.train.locate.LocateCheck`), asked with the model in
    eval mode after each checkpoint before the last step and when resuming from one; training ends when it returns
    True (``stopped_early`` in the summary). A deterministic check keeps a resumed run equal to an uninterrupted one.
    """
    torch.manual_seed(cfg.seed)
    stepper = make_stepper(model, cfg.optim)
    if cfg.compile and cfg.optim.deepspeed_stage:
        log.warning("sft compile is for the plain torch trainer; with DeepSpeed ZeRO-%d the layers run eager",
                    cfg.optim.deepspeed_stage)
    compiled = CompiledTextLayers(model, enabled=cfg.compile and not cfg.optim.deepspeed_stage)
    lengths = [len(e.input_ids) for e in examples]
    sampler = EpochSampler(len(examples), cfg.batch_size * cfg.grad_accum, cfg.seed, lengths=lengths,
                           group_batches=cfg.group_batches)
    history: list[tuple[int, float]] = []
    steps = cfg.optim.max_steps
    ckpt = Checkpointer(ckpt_dir, fp, {"model": model, "stepper": stepper, "sampler": sampler},
                        every=cfg.checkpoint_every, last=steps, keep=cfg.keep_checkpoints, label="SFT")
    start, state = ckpt.resume()
    history = list(state.get("history", history))
    live = open_live(live_dir, start)
    stopped = 0 < start < steps and _stop(until, model, start)  # the check a killed run may not have finished
    model.train()
    t_data = t_total = 0.0
    n_tok_total = 0
    bar = tqdm(range(start, start if stopped else steps), desc="sft", unit="step", initial=start, total=steps,
               leave=False)
    done = start
    for step in bar:
        t0 = time.perf_counter()
        idx = sampler.next()
        micro = [idx[k * cfg.batch_size : (k + 1) * cfg.batch_size] for k in range(cfg.grad_accum)]
        parts = [c for m in micro for c in length_chunks(m, lengths, cfg.length_split)]
        batches = [collate([examples[i] for i in c], pad_id) for c in parts]
        t1 = time.perf_counter()
        n_tok = sum(b.n_tokens for b in batches)
        total = 0.0
        with compiled:  # the backward runs the compiled graphs too, so it stays inside
            for b in batches:
                with _autocast(cfg.precision):
                    logits, labels, _ = label_logits(stepper.module, b)  # [M, V], [M]
                loss = token_loss(logits, labels) / max(n_tok, 1)
                stepper.backward(loss)
                total += float(loss.detach())
        lrs = stepper.lrs()
        grad_norm = stepper.step()
        t2 = time.perf_counter()
        t_data += t1 - t0
        t_total += t2 - t0
        n_tok_total += sum(int(b.inputs["attention_mask"].sum()) for b in batches)
        history.append((step, total))
        bar.set_postfix(loss=f"{total:.3f}")
        row = {"loss": total, "grad_norm": grad_norm, "lr": lrs.get("language", next(iter(lrs.values()))),
               "tokens_per_s": n_tok_total / max(t_total, 1e-9)}
        if live is not None:
            for k, v in row.items():
                live.log_metric(f"train/{k}", v)
            live.next_step()
        if on_step is not None:
            on_step(step, row)
        done = step + 1
        if ckpt.step_done(done, history=history, config=asdict(cfg)) and done < steps and _stop(until, model, done):
            stopped = True
            break
    bar.close()
    if live is not None:
        live.end()
    model.eval()
    losses = [l for _, l in history]
    k = max(1, min(10, len(losses) // 5))
    return {
        "steps": done,
        "stopped_early": stopped,
        "resumed_from": start,
        "loss_first": round(sum(losses[:k]) / k, 5) if losses else None,
        "loss_final": round(sum(losses[-k:]) / k, 5) if losses else None,
        "tokens_per_s": round(n_tok_total / t_total, 1) if t_total else None,
        "data_share": round(t_data / t_total, 4) if t_total else None,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "compiled": compiled.enabled,
        "history": history,
    }
