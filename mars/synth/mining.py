"""Difficulty mining: keep questions by how often the current policy solves them (the paper's data filter).

What it does
    :func:`pass_rates` plays every question ``k`` times through the shared rollout engine
    (:func:`mars.agent.engine.run_episodes`, each question repeated ``k`` times in one batch, sampled with the
    engine config's temperature) and returns, per question id, the number of correct episodes.
    :func:`keep_band` keeps the rows whose count lies in ``[min_pass, max_pass]``; the paper keeps questions solved
    at most once in 8 for its cold-start data (``k=8, min_pass=0, max_pass=1``).

Deviation
    The paper mines with its own strong model; here the policy is whatever backend is passed (a checkpoint through
    :class:`mars.agent.hf_backend.HFBackend`, an endpoint through the ``openai`` backend, or a scripted policy).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from mars.agent.engine import EngineConfig, PolicyBackend, run_episodes

__all__ = ["pass_rates", "keep_band"]


def pass_rates(
    questions: Sequence[dict],
    backend: PolicyBackend,
    toolbox: Any,
    cfg: EngineConfig,
    *,
    k: int,
    seed: int = 0,
    image_root: str | Path | None = None,
) -> dict[str, int]:
    """Correct episodes out of ``k`` for each question id."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    repeated = [q for q in questions for _ in range(k)]
    trajs = run_episodes(repeated, backend, toolbox, cfg, seed=seed, image_root=image_root)
    wins = Counter(t.question_id for t in trajs if t.correct)
    return {str(q["question_id"]): wins.get(str(q["question_id"]), 0) for q in questions}


def keep_band(rows: Sequence[dict], passes: dict[str, int], min_pass: int, max_pass: int) -> list[dict]:
    """Rows whose pass count is within ``[min_pass, max_pass]`` (rows without a count are kept)."""
    if min_pass > max_pass:
        raise ValueError(f"min_pass ({min_pass}) must be <= max_pass ({max_pass})")
    return [r for r in rows if r["question_id"] not in passes or min_pass <= passes[r["question_id"]] <= max_pass]
