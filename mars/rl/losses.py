"""Policy-gradient losses for the RL stage: PPO/GRPO token-level and GSPO sequence-level clipped objectives.

SenseNova-MARS (arXiv 2512.24330) optimises BN-GSPO: batch-normalised group advantages
(:mod:`mars.rl.advantages`) fed to the GSPO loss (Zheng et al., "Group Sequence Policy Optimization").
Everything here is a pure torch function on float32 math (inputs are upcast; gradients flow back to ``logp``).

Shapes: ``N`` trajectories, ``T`` token positions. ``logp``, ``old_logp``, ``ref_logp``, ``mask``: ``[N, T]``;
``advantages``: ``[N]``. ``mask`` is nonzero exactly on model-generated tokens (prompt, tool outputs and padding are
0) and is treated as boolean. Values of ``logp`` / ``old_logp`` / ``ref_logp`` at ``mask == 0`` may be anything,
inf/NaN included: they are replaced with ``torch.where`` *before* any arithmetic, so they never reach the loss or
the gradient (the gradient at those positions is exactly 0).

:func:`policy_loss` ``level``:

* ``"token"`` (PPO/GRPO): ``ratio_t = exp(logp_t - old_logp_t)``; per-token loss
  ``max(-A * ratio_t, -A * clip(ratio_t, 1 - clip_low, 1 + clip_high))``; token mean over the whole batch,
  ``sum(loss * mask) / sum(mask)``.
* ``"sequence"`` (GSPO): ``s_i = exp(mean_{t in y_i}(logp - old_logp))`` (length-normalised over the model tokens of
  ``y_i``); token form ``s_it = sg[s_i] * exp(logp_t - sg[logp_t])`` (value ``s_i``, gradient
  ``s_i * grad logp_t``); the same clipped per-token loss with ``A_i``; each sequence's masked token mean, then the
  mean over sequences with at least one model token (empty sequences are excluded, never NaN).

Micro-batching / gradient accumulation. By default the loss is normalised by the micro-batch's own count (tokens for
``"token"``, non-empty sequences for ``"sequence"``). To accumulate exactly the full-batch gradient over
micro-batches either

* pass ``normalizer=loss_normalizer(full_mask, level)`` (the *full* batch's count) to every micro-batch call and
  sum the losses, or
* multiply each default-normalised micro-batch loss by ``microbatch_weight(micro_mask, level, total)`` with
  ``total = loss_normalizer(full_mask, level)`` (= ``n_tokens_micro / n_tokens_total`` or
  ``n_seq_micro / n_seq_total``) and sum.

Both give ``sum(micro gradients) == full-batch gradient`` up to float rounding.

Stats (python floats, detached): ``loss``; ``clip_frac`` (share of masked tokens for ``"token"``, of non-empty
sequences for ``"sequence"``, whose ratio was clipped *in the direction that zeroes the gradient*: ``A > 0`` and
ratio ``> 1 + clip_high``, or ``A < 0`` and ratio ``< 1 - clip_low``), ``clip_frac_high`` / ``clip_frac_low`` (the two
halves), ``ratio_mean`` / ``ratio_min`` / ``ratio_max`` (over tokens resp. sequences), ``approx_kl`` (the k3
estimator ``exp(d) - 1 - d`` with ``d = logp - old_logp``, i.e. an unbiased estimate of KL(old || new) from samples
of the old policy, token mean over masked tokens at both levels), ``n_tokens``, ``n_seqs`` (sequences with >= 1
model token). A batch without model tokens reports 0.0 for the ratio / KL stats.

Deviations from the papers / notes:

* Clip ranges are plain parameters: the GSPO paper clips sequence ratios at about ``3e-4`` / ``4e-4``, the MARS paper
  reports ``0.2`` / ``0.28`` (clip-higher style asymmetry); pick them in ``params.yaml``.
* The released MARS training script runs neither the batch-normalisation step nor GSPO (plain GRPO, token level);
  we implement the paper's BN-GSPO and keep ``"token"`` for ablations.
* No log-ratio clamping: a huge log ratio overflows ``exp`` exactly as in the reference implementations; use
  ``approx_kl`` / ``ratio_max`` to watch for it.
* :func:`kl_penalty` is provided for a reference-model KL term; the paper's objective (like GSPO's) uses no KL
  term, so the trainer should default its coefficient to 0.

Run the tests with ``.venv/bin/python -m pytest tests/rl -q``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "LEVELS",
    "entropy_from_logits",
    "kl_penalty",
    "loss_normalizer",
    "masked_mean",
    "microbatch_weight",
    "policy_loss",
]

LEVELS: tuple[str, ...] = ("token", "sequence")


def _check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"unknown policy loss level {level!r}; valid: {', '.join(LEVELS)}")


def _bool_mask(mask: torch.Tensor, shape: torch.Size | None = None) -> torch.Tensor:
    m = torch.as_tensor(mask)
    if shape is not None and m.shape != shape:
        raise ValueError(f"mask shape {tuple(m.shape)} does not match {tuple(shape)}")
    return m.detach() != 0


def _clean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """float32 copy of ``x`` with 0 wherever ``m`` is False (no NaN/inf can leak, gradient 0 there)."""
    return torch.where(m, x.to(torch.float32), torch.zeros((), dtype=torch.float32, device=x.device))


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero (float32); garbage under ``mask == 0`` is ignored.

    ``dim=None`` reduces everything to a scalar; otherwise reduces ``dim``. Where there is no masked entry the result
    is 0 (not NaN), still attached to ``x``'s graph.

    >>> masked_mean(torch.tensor([[1.0, 3.0, float("nan")]]), torch.tensor([[1, 1, 0]])).item()
    2.0
    >>> masked_mean(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1, 0], [0, 0]]), dim=1).tolist()
    [1.0, 0.0]
    """
    m = _bool_mask(mask)
    if m.shape != x.shape:
        m = m.expand_as(x)
    xs = _clean(x, m)
    if dim is None:
        return xs.sum() / m.sum().clamp(min=1).to(torch.float32)
    return xs.sum(dim) / m.sum(dim).clamp(min=1).to(torch.float32)


def loss_normalizer(mask: torch.Tensor, level: str) -> float:
    """What :func:`policy_loss` divides by: number of model tokens (``"token"``) or of sequences with at least one
    model token (``"sequence"``) in ``mask`` [N, T]. Compute it on the *full* batch for gradient accumulation.

    >>> m = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    >>> loss_normalizer(m, "token"), loss_normalizer(m, "sequence")
    (3.0, 2.0)
    """
    _check_level(level)
    m = _bool_mask(mask)
    if m.dim() != 2:
        raise ValueError(f"mask must be [N, T], got shape {tuple(m.shape)}")
    if level == "token":
        return float(m.sum())
    return float(m.any(dim=1).sum())


def microbatch_weight(mask: torch.Tensor, level: str, total: float) -> float:
    """Weight of a micro-batch's default-normalised loss in an accumulated full-batch loss.

    ``loss_normalizer(mask, level) / total`` with ``total = loss_normalizer(full_mask, level)``; summing
    ``weight * policy_loss(micro...)`` over micro-batches reproduces the full-batch loss and gradient.

    >>> microbatch_weight(torch.tensor([[1, 1, 0]]), "token", 8.0)
    0.25
    """
    if not (isinstance(total, (int, float)) and math.isfinite(total) and total > 0):
        raise ValueError(f"total must be a positive number, got {total!r}")
    return loss_normalizer(mask, level) / float(total)


def _check_inputs(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [N, T], got shape {tuple(logp.shape)}")
    if old_logp.shape != logp.shape:
        raise ValueError(f"old_logp shape {tuple(old_logp.shape)} does not match logp {tuple(logp.shape)}")
    if advantages.shape != (logp.shape[0],):
        raise ValueError(f"advantages must be [N] = [{logp.shape[0]}], got shape {tuple(advantages.shape)}")
    if not logp.dtype.is_floating_point:
        raise ValueError(f"logp must be floating point, got {logp.dtype}")
    return _bool_mask(mask, logp.shape)


def _check_clip(clip_low: float, clip_high: float) -> tuple[float, float]:
    for name, v in (("clip_low", clip_low), ("clip_high", clip_high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if clip_low >= 1:
        raise ValueError(f"clip_low must be < 1 (ratio lower bound 1 - clip_low > 0), got {clip_low!r}")
    return float(clip_low), float(clip_high)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    clip_low: float,
    clip_high: float,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss (to minimise) and detached stats; see the module docstring for the formulas.

    ``logp`` [N, T] (current policy, carries the graph), ``old_logp`` [N, T] (behaviour policy, treated as a
    constant), ``advantages`` [N], ``mask`` [N, T] (nonzero on model tokens). ``level``: ``"token"`` (PPO/GRPO) or
    ``"sequence"`` (GSPO). ``normalizer``: optional divisor replacing the micro-batch's own token / non-empty-sequence
    count (pass :func:`loss_normalizer` of the full batch for exact gradient accumulation).

    >>> lp = torch.zeros(2, 2, requires_grad=True)
    >>> loss, stats = policy_loss(lp, torch.zeros(2, 2), torch.tensor([1.0, -3.0]), torch.ones(2, 2),
    ...                           level="sequence", clip_low=0.2, clip_high=0.28)
    >>> loss.item(), stats["clip_frac"], stats["ratio_mean"]
    (1.0, 0.0, 1.0)
    """
    _check_level(level)
    lo, hi = _check_clip(clip_low, clip_high)
    m = _check_inputs(logp, old_logp, advantages, mask)  # [N, T] bool
    if normalizer is not None and not (
        isinstance(normalizer, (int, float)) and math.isfinite(normalizer) and normalizer > 0
    ):
        raise ValueError(f"normalizer must be a positive number, got {normalizer!r}")

    lp = _clean(logp, m)  # [N, T] f32, 0 off-mask, grad 0 off-mask
    olp = _clean(old_logp.detach(), m)  # [N, T]
    n_tok_row = m.sum(dim=1)  # [N] long, |y_i|
    nonempty = n_tok_row > 0  # [N]
    adv = torch.where(nonempty, advantages.detach().to(torch.float32), torch.zeros((), device=lp.device))  # [N]
    log_ratio = lp - olp  # [N, T], 0 off-mask
    n_tok = int(n_tok_row.sum())
    n_seq = int(nonempty.sum())

    if level == "token":
        ratio = torch.exp(log_ratio)  # [N, T]
        a = adv[:, None]  # [N, 1]
        tok_loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1.0 - lo, 1.0 + hi))  # [N, T]
        denom = float(normalizer) if normalizer is not None else float(max(n_tok, 1))
        loss = torch.where(m, tok_loss, torch.zeros((), device=lp.device)).sum() / denom
        with torch.no_grad():
            r = ratio[m]  # [n_tok]
            a_tok = a.expand_as(ratio)[m]  # [n_tok]
            high = (a_tok > 0) & (r > 1.0 + hi)
            low = (a_tok < 0) & (r < 1.0 - lo)
            count = n_tok
    else:
        len_f = n_tok_row.clamp(min=1).to(torch.float32)  # [N]
        seq_log_ratio = log_ratio.sum(dim=1) / len_f  # [N], mean over model tokens
        s = torch.exp(seq_log_ratio).detach()  # [N], sg[s_i]
        s_tok = s[:, None] * torch.exp(lp - lp.detach())  # [N, T], value s_i, d/dlogp_t = s_i
        a = adv[:, None]  # [N, 1]
        tok_loss = torch.maximum(-a * s_tok, -a * torch.clamp(s_tok, 1.0 - lo, 1.0 + hi))  # [N, T]
        seq_loss = torch.where(m, tok_loss, torch.zeros((), device=lp.device)).sum(dim=1) / len_f  # [N]
        seq_loss = torch.where(nonempty, seq_loss, torch.zeros((), device=lp.device))
        denom = float(normalizer) if normalizer is not None else float(max(n_seq, 1))
        loss = seq_loss.sum() / denom  # 0 with a grad_fn when every sequence is empty
        with torch.no_grad():
            r = s[nonempty]  # [n_seq]
            a_seq = adv[nonempty]
            high = (a_seq > 0) & (r > 1.0 + hi)
            low = (a_seq < 0) & (r < 1.0 - lo)
            count = n_seq

    with torch.no_grad():
        k3 = torch.exp(log_ratio) - 1.0 - log_ratio  # [N, T], 0 off-mask
        c = float(max(count, 1))
        stats = {
            "loss": float(loss.detach()),
            "clip_frac": float((high | low).sum()) / c,
            "clip_frac_high": float(high.sum()) / c,
            "clip_frac_low": float(low.sum()) / c,
            "ratio_mean": float(r.mean()) if count else 0.0,
            "ratio_min": float(r.min()) if count else 0.0,
            "ratio_max": float(r.max()) if count else 0.0,
            "approx_kl": float(k3.sum()) / float(max(n_tok, 1)),
            "n_tokens": float(n_tok),
            "n_seqs": float(n_seq),
        }
    return loss, stats


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(policy || ref): masked token mean of ``exp(ref - logp) - (ref - logp) - 1`` (>= 0).

    ``logp``, ``ref_logp``, ``mask``: [N, T] -> scalar float32 tensor (gradient to ``logp``; ``ref_logp`` is treated
    as a constant). Zero when ``ref_logp == logp``; zero (with a grad_fn) when ``mask`` is empty.

    >>> round(kl_penalty(torch.zeros(1, 2), torch.log(torch.tensor([[2.0, 0.5]])), torch.ones(1, 2)).item(), 6)
    0.25
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp shape {tuple(ref_logp.shape)} does not match logp {tuple(logp.shape)}")
    m = _bool_mask(mask, logp.shape)
    d = _clean(ref_logp.detach(), m) - _clean(logp, m)  # [N, T], 0 off-mask
    k3 = torch.exp(d) - d - 1.0
    return masked_mean(k3, m)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the softmax over the last axis: [N, T, V] -> [N, T], float32 (``-inf`` logits allowed).

    >>> round(entropy_from_logits(torch.zeros(1, 1, 4))[0, 0].item(), 6) == round(math.log(4), 6)
    True
    """
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, T, V]
    p = lp.exp()
    lp_finite = lp.clamp(min=torch.finfo(torch.float32).min)  # -inf -> finite so 0 * lp stays 0 (and its grad)
    return -(p * lp_finite).sum(dim=-1)
