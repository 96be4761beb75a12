"""Optimisation shared by SFT and RL: per-module parameter groups, AdamW, warm-up + schedule, clipping, stepping.

What it does
    :func:`param_groups` splits a Qwen-VL model's trainable parameters into the language model and the vision
    tower + projector (``model.visual``, whose ``merger`` is the projector), each with its own learning rate, and
    no weight decay on biases and norms. ``freeze_vision=True`` freezes the vision tower and projector (the paper's
    setting for pretrained checkpoints); the embedded default trains them, since its random-init vision must learn
    the cue (docs/design.md, The embedded default world), at their own rate: the same 2e-3 as the language model
    by default (a higher vision rate, 1e-2, kept the tower at chance on the frame cue: ``probes/probe_locate.py``;
    docs/findings.md).
    :func:`lr_lambda` is linear warm-up then ``constant`` / ``cosine`` / ``linear`` decay to ``min_lr_ratio``.
    :class:`TorchStepper` owns AdamW + LambdaLR + gradient clipping behind the small interface the trainers use
    (``backward``, ``step``, ``zero_grad``, ``state_dict`` / ``load_state_dict``, ``lrs``); the DeepSpeed stepper in
    :mod:`mars.train.ds` implements the same interface.

Run the tests: ``.venv/bin/python -m pytest tests/train -q``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["OptimConfig", "param_groups", "lr_lambda", "TorchStepper", "make_stepper"]


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 2e-3
    vision_lr: float = 2e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20
    schedule: str = "cosine"  # constant | cosine | linear
    min_lr_ratio: float = 0.1
    max_steps: int = 100
    clip_norm: float = 1.0
    freeze_vision: bool = False
    deepspeed_stage: int = 0  # 0 = plain torch; 2 or 3 = DeepSpeed ZeRO stage

    def __post_init__(self) -> None:
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"schedule must be constant, cosine or linear, got {self.schedule!r}")
        if self.lr < 0 or self.vision_lr < 0 or self.max_steps < 1 or self.warmup_steps < 0:  # lr 0: a frozen control
            raise ValueError("need lr >= 0, vision_lr >= 0, max_steps >= 1 and warmup_steps >= 0")
        if self.deepspeed_stage not in (0, 2, 3):
            raise ValueError(f"deepspeed_stage must be 0 (off), 2 or 3, got {self.deepspeed_stage}")


def _is_vision(name: str) -> bool:
    return ".visual." in f".{name}"


def param_groups(model: torch.nn.Module, cfg: OptimConfig) -> list[dict]:
    """AdamW groups: language model / vision tower + projector, each split into decay / no-decay."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        vision = _is_vision(name)
        if vision and cfg.freeze_vision:
            p.requires_grad_(False)
            continue
        if not p.requires_grad:
            continue
        decay = p.dim() >= 2 and "norm" not in name.lower()
        groups.setdefault((vision, decay), []).append(p)
    out = []
    for (vision, decay), params in sorted(groups.items()):
        out.append({
            "params": params,
            "lr": cfg.vision_lr if vision else cfg.lr,
            "weight_decay": cfg.weight_decay if decay else 0.0,
            "name": f"{'vision' if vision else 'language'}{'' if decay else '_no_decay'}",
        })
    if not out:
        raise ValueError("the model has no trainable parameters")
    return out


def lr_lambda(step: int, cfg: OptimConfig) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - cfg.min_lr_ratio) * t
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


class TorchStepper:
    """AdamW, the schedule and gradient clipping on one process."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig):
        self.model, self.cfg = model, cfg
        self.groups = param_groups(model, cfg)
        self.optimizer = torch.optim.AdamW(self.groups, betas=cfg.betas, eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_lambda(s, cfg))
        self.params = [p for g in self.groups for p in g["params"]]

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        """Clip, step optimizer and schedule; returns the gradient norm before clipping."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip_norm if self.cfg.clip_norm > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def lrs(self) -> dict[str, float]:
        return {g["name"]: float(g["lr"]) for g in self.optimizer.param_groups}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def make_stepper(model: torch.nn.Module, cfg: OptimConfig):
    """A :class:`TorchStepper`, or the DeepSpeed one when ``cfg.deepspeed_stage`` is 2 or 3."""
    if cfg.deepspeed_stage:
        from mars.train.ds import DeepSpeedStepper

        return DeepSpeedStepper(model, cfg)
    return TorchStepper(model, cfg)
