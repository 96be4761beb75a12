"""Advantage estimators for the RL stage: GRPO group z-scores and the batch-normalised "BN" variant.

SenseNova-MARS (arXiv 2512.24330) trains with BN-GSPO: each prompt is rolled out ``G`` times, every trajectory's
scalar reward is turned into a group-relative advantage (GRPO z-score inside its group), and the advantages of the
whole batch are then normalised once more to mean 0 / standard deviation 1 before the GSPO sequence-level clipped
loss (:func:`mars.rl.losses.policy_loss` with ``level="sequence"``) consumes them.

All functions are pure torch: 1-D tensors in, 1-D float32 tensors out, no global state, plain float arguments.
Shapes: ``N = B * G`` trajectories; ``rewards`` and ``group_ids`` are ``[N]``.

* :func:`group_advantages` -- ``A = (r - mean_g(r)) / (std_g(r) + eps)`` with the *unbiased* (Bessel) std of the
  group; groups of one are rejected (``G >= 2``); a degenerate group (all rewards equal) gives exactly 0.
* :func:`batch_normalize` -- ``A' = (A - mean(A)) / (std_pop(A) + eps)`` over *all* trajectories, degenerate
  groups included, population std, float32. :func:`batch_scale` returns ``1 / (std_pop + eps)`` for monitoring.
* :func:`compute_advantages` -- dispatch on ``estimator``: ``"grpo"`` (group z-score), ``"bn"`` (group then
  batch), ``"none"`` (reward minus group mean, Dr.GRPO style, no std division).

Deviations from the paper / notes:

* The paper does not say which std it uses. We use the unbiased std inside a group (what GRPO implementations such
  as TRL / verl's ``torch.std`` compute) and the population std for the batch step (the batch is large and the
  result then has population std exactly 1).
* The batch step keeps degenerate groups (their advantage 0 is part of the batch statistics), as the paper
  normalises "over the batch"; filtering them out first would be a different estimator.
* The released MARS training script runs neither the batch step nor GSPO (it uses plain GRPO); we implement the
  paper's BN-GSPO, and ``"grpo"`` / ``"none"`` remain available for ablations.
* The ``eps`` values (1e-6 in the group step, 1e-9 in the batch step) are our choice; they only matter when a std is
  (close to) 0.
* ``"none"`` also requires ``G >= 2``: a group of one has no baseline but itself, which is almost always a bug
  upstream (a mis-grouped batch).

Run the tests with ``.venv/bin/python -m pytest tests/rl -q``.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["ESTIMATORS", "batch_normalize", "batch_scale", "compute_advantages", "group_advantages"]

ESTIMATORS: tuple[str, ...] = ("grpo", "bn", "none")


def _as_rewards(rewards: torch.Tensor | Sequence[float]) -> torch.Tensor:
    r = torch.as_tensor(rewards)
    if r.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(r.shape)}")
    if r.is_complex():
        raise ValueError("rewards must be real numbers")
    r = r.detach().to(torch.float32)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards must all be finite")
    return r


def _group_stats(
    rewards: torch.Tensor | Sequence[float], group_ids: torch.Tensor | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate and return ``(r [N] f32, inverse [N] long, counts [K] f32, mean_per_member [N] f32)``."""
    r = _as_rewards(rewards)
    g = torch.as_tensor(group_ids, device=r.device)
    if g.dim() != 1 or g.shape[0] != r.shape[0]:
        raise ValueError(f"group_ids must be 1-D with the length of rewards ({r.shape[0]}), got shape {tuple(g.shape)}")
    if g.dtype.is_floating_point or g.is_complex() or g.dtype == torch.bool:
        raise ValueError(f"group_ids must be integer labels, got dtype {g.dtype}")
    uniq, inverse, counts = torch.unique(g, return_inverse=True, return_counts=True)  # [K], [N], [K]
    if counts.numel() and int(counts.min()) < 2:
        lonely = uniq[counts < 2].tolist()
        raise ValueError(f"every group needs G >= 2 members; groups with one member: {lonely}")
    counts_f = counts.to(torch.float32)  # [K]
    sums = torch.zeros(uniq.shape[0], dtype=torch.float32, device=r.device).index_add_(0, inverse, r)  # [K]
    mean = (sums / counts_f)[inverse]  # [N], each member's group mean
    return r, inverse, counts_f, mean


def group_advantages(
    rewards: torch.Tensor | Sequence[float], group_ids: torch.Tensor | Sequence[int], eps: float = 1e-6
) -> torch.Tensor:
    """GRPO group z-score ``(r - mean_g) / (std_g + eps)`` with the unbiased std of each group.

    ``rewards`` [N] (any real dtype), ``group_ids`` [N] integer labels (any values, any order, unequal sizes allowed)
    -> [N] float32. Every group needs at least two members (ValueError otherwise); a group whose rewards are all
    equal gets advantage 0.

    >>> a = group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([5, 5, 9, 9]))
    >>> [round(x, 4) for x in a.tolist()]  # group 5: mean 0.5, unbiased std sqrt(0.5); group 9 degenerate
    [0.7071, -0.7071, 0.0, 0.0]
    """
    r, inverse, counts, mean = _group_stats(rewards, group_ids)
    dev = r - mean  # [N]
    sq = torch.zeros_like(counts).index_add_(0, inverse, dev * dev)  # [K], two-pass sum of squares
    std = torch.sqrt(sq / (counts - 1.0))[inverse]  # [N], unbiased (Bessel) std of the member's group
    return dev / (std + float(eps))


def _as_advantages(advantages: torch.Tensor | Sequence[float]) -> torch.Tensor:
    a = torch.as_tensor(advantages)
    if a.dim() != 1 or a.shape[0] == 0:
        raise ValueError(f"advantages must be a non-empty 1-D tensor [N], got shape {tuple(a.shape)}")
    return a.to(torch.float32)


def batch_normalize(advantages: torch.Tensor | Sequence[float], eps: float = 1e-9) -> torch.Tensor:
    """Whiten over the whole batch: ``(A - mean(A)) / (std_pop(A) + eps)``, population std, float32.

    ``advantages`` [N] -> [N] float32. All trajectories count, zeros of degenerate groups included. If every
    advantage is equal the result is all zeros.

    >>> batch_normalize(torch.tensor([1.0, 3.0])).tolist()
    [-1.0, 1.0]
    """
    a = _as_advantages(advantages)
    mean = a.mean()
    std = torch.sqrt(((a - mean) ** 2).mean())  # population std (divide by N)
    return (a - mean) / (std + float(eps))


def batch_scale(advantages: torch.Tensor | Sequence[float], eps: float = 1e-9) -> float:
    """The factor :func:`batch_normalize` multiplies by, ``1 / (std_pop(A) + eps)``, as a python float (monitoring).

    With equal group sizes, group z-scores have batch mean 0, so ``batch_normalize(A) == A * batch_scale(A)``.

    >>> batch_scale(torch.tensor([1.0, 3.0]))
    1.0
    """
    a = _as_advantages(advantages).detach()
    std = torch.sqrt(((a - a.mean()) ** 2).mean())
    return float(1.0 / (std + float(eps)))


def compute_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[int],
    estimator: str,
    *,
    group_eps: float = 1e-6,
    batch_eps: float = 1e-9,
) -> torch.Tensor:
    """Advantages [N] float32 by ``estimator``: ``"grpo"``, ``"bn"`` (paper's BN-GSPO) or ``"none"``.

    * ``"grpo"``: :func:`group_advantages` (``group_eps``).
    * ``"bn"``: :func:`batch_normalize` (``batch_eps``) of the group advantages.
    * ``"none"``: ``r - mean_g(r)`` (Dr.GRPO: no std division); groups still need ``G >= 2``.

    >>> compute_advantages([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], "none").tolist()
    [0.5, -0.5, 0.0, 0.0]
    """
    if estimator == "grpo":
        return group_advantages(rewards, group_ids, eps=group_eps)
    if estimator == "bn":
        return batch_normalize(group_advantages(rewards, group_ids, eps=group_eps), eps=batch_eps)
    if estimator == "none":
        r, _, _, mean = _group_stats(rewards, group_ids)
        return r - mean
    raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
