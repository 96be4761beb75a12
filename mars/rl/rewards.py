"""Trajectory rewards: answer reward plus format reward (docs/design.md, Rewards and the judge).

``reward = weights.answer * correct + weights.format * format_ok``; the paper uses 1.0 and 0.5, so a trajectory
scores 0, 0.5, 1.0 or 1.5. ``correct`` comes from :func:`mars.rl.judge.judge_answer`; ``format_ok`` (a plain bool,
from :func:`mars.agent.protocol.format_ok`) says that a final answer exists, every assistant turn parsed without a
single format error, and no tool call failed because of the model (bad bbox, img_idx out of range, ...;
infrastructure failures such as a search backend timing out are not the model's fault and must not be counted in
``tool_errors``).

Deviation from the paper: the format reward is all-or-nothing per trajectory (no partial credit per turn), and it is
independent of correctness (a correct answer in a malformed trajectory gets 1.0, not 1.5), as the paper's sum implies.

Run the tests with ``.venv/bin/python -m pytest tests/rl -q``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RewardBreakdown", "RewardWeights", "compute_reward"]


@dataclass(frozen=True)
class RewardWeights:
    """Weights of the two reward components (paper: answer 1.0, format 0.5)."""

    answer: float = 1.0
    format: float = 0.5

    def __post_init__(self) -> None:
        for name in ("answer", "format"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"reward weight {name} must be a finite number, got {v!r}")


@dataclass(frozen=True)
class RewardBreakdown:
    answer: float
    format: float
    total: float
    correct: bool
    well_formed: bool


def compute_reward(correct: bool, format_ok: bool, weights: RewardWeights = RewardWeights()) -> RewardBreakdown:
    """Answer reward plus format reward.

    >>> compute_reward(True, True)  # 1.0 * 1 + 0.5 * 1
    RewardBreakdown(answer=1.0, format=0.5, total=1.5, correct=True, well_formed=True)
    >>> compute_reward(False, True).total  # 1.0 * 0 + 0.5 * 1
    0.5
    >>> compute_reward(True, False).total  # 1.0 * 1 + 0.5 * 0
    1.0
    >>> compute_reward(False, False, RewardWeights(answer=2.0, format=0.25)).total
    0.0
    """
    c, f = bool(correct), bool(format_ok)
    a = weights.answer * float(c)
    fm = weights.format * float(f)
    return RewardBreakdown(answer=a, format=fm, total=a + fm, correct=c, well_formed=f)
