"""Difficulty mining: keep questions by how often a policy solves them (the paper's data filter).

What it does
    :func:`pass_rates` plays every question ``k`` times through the shared rollout engine
    (:func:`mars.agent.engine.stream_episodes`: the ``k`` episodes of a question are queued together, at most
    ``max_live_episodes`` in play, so memory stays flat however many questions there are) and counts the correct
    episodes of each. A question's count is final once its ``k`` episodes have finished; counts are appended to a
    :class:`~mars.data.io.ChunkStore` (PASS_COUNTS rows) every ``flush_every`` questions or ``flush_s`` seconds,
    so a killed run resumes with the questions it had not finished. A progress bar shows episodes played and the
    pass-count histogram so far.
    :func:`keep_band` keeps the rows whose count lies in ``[min_pass, max_pass]``; the paper keeps questions solved
    at most once in 8 for its cold-start data (``k=8, min_pass=0, max_pass=1``). :func:`histogram` and
    :func:`band_metrics` summarise a pass-count table per split and type.
    :func:`mining_backend` opens the policy: a local checkpoint (:class:`mars.agent.hf_backend.HFBackend`) or an
    OpenAI-compatible endpoint (:class:`mars.agent.backends.OpenAIBackend`, e.g. the base model behind vLLM or
    ``mars serve``); :func:`mining_key` names the run, so a changed checkpoint, endpoint or param never resumes
    from another run's counts.

Deviation
    The paper mines with its own strong model; here the policy is whatever backend is passed (a checkpoint, an
    endpoint, or a scripted policy). A resumed run samples its remaining questions with the seeds a fresh run
    would give its first ones (greedy mining is unaffected).

Run (the synthesize stage's SFT filter, on the default world after ``make repro``)::

    dvc exp run -S synthesize.mine_checkpoint=$PWD/data/sft/model -S 'synthesize.mine_splits=[rl]' \\
        -S synthesize.mine_min_pass=1 -S synthesize.mine_max_pass=6 synthesize
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from tqdm import tqdm

from mars.agent.engine import EngineConfig, PolicyBackend, stream_episodes
from mars.data.io import ChunkStore
from mars.data.schemas import PASS_COUNTS
from mars.errors import MissingInputError

__all__ = ["pass_rates", "keep_band", "histogram", "band_metrics", "mining_backend", "mining_key", "mine"]
log = logging.getLogger(__name__)


def pass_rates(
    questions: Sequence[dict],
    backend: PolicyBackend,
    toolbox: Any,
    cfg: EngineConfig,
    *,
    k: int,
    seed: int = 0,
    image_root: str | Path | None = None,
    store: ChunkStore | None = None,
    flush_every: int = 64,
    flush_s: float = 60.0,
    progress: bool = True,
) -> dict[str, int]:
    """Correct episodes out of ``k`` for each question id (questions need ``question_id``, ``split``, ``type``).

    With a ``store`` (schema PASS_COUNTS), questions it already counts are not played again, and new counts are
    appended as they become final."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    done: dict[str, int] = {}
    if store is not None:
        for r in store.table().to_pylist():
            if r["k"] == k:
                done[r["question_id"]] = r["passes"]
    todo = [q for q in questions if str(q["question_id"]) not in done]
    if done:
        log.info("mining: %d of %d questions counted by an earlier run, %d to play", len(questions) - len(todo),
                 len(questions), len(todo))
    wins: Counter[int] = Counter()
    seen: Counter[int] = Counter()
    hist: Counter[int] = Counter(done.values())
    pending: list[dict] = []
    last = time.monotonic()

    def flush() -> None:
        nonlocal pending, last
        if store is not None and pending:
            store.append(pending)
        pending, last = [], time.monotonic()

    episodes: Iterable[dict] = (q for q in todo for _ in range(k))  # lazily: a question's k episodes together
    bar = tqdm(total=len(todo) * k, desc="mining", unit="episode", disable=not progress)
    try:
        for idx, traj in stream_episodes(episodes, backend, toolbox, cfg, seed=seed, image_root=image_root):
            qi = idx // k
            seen[qi] += 1
            wins[qi] += bool(traj.correct)
            if seen[qi] == k:
                q = todo[qi]
                done[str(q["question_id"])] = wins[qi]
                hist[wins[qi]] += 1
                pending.append(dict(question_id=str(q["question_id"]), split=str(q["split"]), type=str(q["type"]),
                                    k=k, passes=wins.pop(qi)))
                del seen[qi]
                if len(pending) >= flush_every or time.monotonic() - last >= flush_s:
                    flush()
            bar.update(1)
            bar.set_postfix_str(" ".join(f"{p}/{k}:{hist[p]}" for p in sorted(hist)), refresh=False)
        flush()
    finally:
        bar.close()
    return {str(q["question_id"]): done[str(q["question_id"])] for q in questions}


def keep_band(rows: Sequence[dict], passes: dict[str, int], min_pass: int, max_pass: int) -> list[dict]:
    """Rows whose pass count is within ``[min_pass, max_pass]`` (rows without a count are kept)."""
    if min_pass > max_pass:
        raise ValueError(f"min_pass ({min_pass}) must be <= max_pass ({max_pass})")
    return [r for r in rows if r["question_id"] not in passes or min_pass <= passes[r["question_id"]] <= max_pass]


def histogram(rows: Sequence[dict], k: int) -> list[dict]:
    """Plot rows ``{split, type, passes, questions}``: how many questions of each split and type were solved
    ``passes`` times out of ``k`` (every count 0..k listed, zeros included)."""
    count = Counter((r["split"], r["type"], int(r["passes"])) for r in rows)
    groups = sorted({(r["split"], r["type"]) for r in rows})
    return [dict(split=s, type=t, passes=p, questions=count[(s, t, p)]) for s, t in groups for p in range(k + 1)]


def band_metrics(rows: Sequence[dict], k: int, min_pass: int, max_pass: int) -> dict:
    """Kept and dropped counts per split and type, the histogram of pass counts 0..k (per split and per type,
    :func:`_counts`), and the degenerate share (the questions every episode of a group gets right or wrong alike:
    no GRPO/GSPO signal) before and after the band."""
    out: dict = {}
    for split in sorted({r["split"] for r in rows}):
        rs = [r for r in rows if r["split"] == split]
        kept = [r for r in rs if min_pass <= r["passes"] <= max_pass]
        entry: dict = {"questions": len(rs), "kept": len(kept), "dropped": len(rs) - len(kept),
                       "degenerate_share": _degenerate(rs, k), "degenerate_share_kept": _degenerate(kept, k),
                       "mean_pass_rate": round(sum(r["passes"] for r in rs) / (k * len(rs)), 4),
                       "histogram": _counts(rs, k)}
        for t in sorted({r["type"] for r in rs}):
            ts = [r for r in rs if r["type"] == t]
            entry[t] = {"kept": sum(min_pass <= r["passes"] <= max_pass for r in ts), "questions": len(ts),
                        "histogram": _counts(ts, k)}
        out[split] = entry
    return out


def _counts(rows: Sequence[dict], k: int) -> dict[str, int]:
    """Questions per pass count, ``{"0": n0, ..., "k": nk}``: a mapping, not a list, because `dvc exp show` drops
    list values and shows a mapping's entries as columns (``histogram.0`` ...)."""
    return {str(p): sum(r["passes"] == p for r in rows) for p in range(k + 1)}


def _degenerate(rows: Sequence[dict], k: int) -> float:
    return round(sum(r["passes"] in (0, k) for r in rows) / len(rows), 4) if rows else 0.0


def mining_backend(checkpoint: str, base_url: str, model: str, agent: Any, label: str) -> PolicyBackend:
    """The policy to mine with: an endpoint when ``base_url`` is set, else the checkpoint directory. ``label``
    names where the checkpoint path came from in errors (e.g. ``synthesize.mine_checkpoint``)."""
    if base_url:
        from mars.agent.backends import OpenAIBackend

        if not model:
            raise ValueError(f"mining endpoint {base_url}: no model name given: name the served model")
        return OpenAIBackend(base_url, model)
    from mars.agent.hf_backend import HFBackend
    from mars.model.build import load_checkpoint

    try:
        model_, _, processor = load_checkpoint(checkpoint)
    except MissingInputError as exc:
        raise MissingInputError(f"{label}: {exc}: a model directory holds config.json, tokenizer.json and "
                                "*.safetensors (e.g. data/sft/model)") from None
    agent.check_processor(processor, checkpoint)
    return HFBackend(model_, processor)


def mining_key(checkpoint: str, base_url: str, model: str, *parts: Any) -> str:
    """A name for a mining run: the policy (an endpoint's URL and model, or the checkpoint's path with the size and
    modification time of each file) and ``parts`` (params, question ids)."""
    from mars.train.checkpoint import fingerprint

    if base_url:
        policy: Any = [base_url, model]
    else:
        root = Path(checkpoint)
        policy = [str(root.resolve())] + [[p.name, p.stat().st_size, p.stat().st_mtime_ns]
                                          for p in sorted(root.iterdir()) if p.is_file()]
    return fingerprint(policy, *[asdict(p) if is_dataclass(p) else p for p in parts])


def mine(
    rows: Sequence[dict],
    agent: Any,
    *,
    checkpoint: str,
    base_url: str,
    model: str,
    k: int,
    temperature: float,
    seed: int,
    image_root: Path,
    index_dir: Path,
    gallery_dir: Path,
    scratch: Path,
    label: str,
    key_parts: Sequence[Any] = (),
    progress: bool = True,
) -> list[dict]:
    """PASS_COUNTS rows of ``rows`` (QUESTIONS rows), played ``k`` times each by the policy of ``checkpoint`` or the
    endpoint (:func:`mining_backend`) under the shared ``agent`` configuration (an
    :class:`~mars.agent.config.AgentParams`) at ``temperature``. Counts are saved under ``scratch/<run key>`` as
    they come, so a rerun after a kill resumes; ``key_parts`` (the stage's code digest) join the key."""
    backend = mining_backend(checkpoint, base_url, model, agent, label)
    key = mining_key(checkpoint, base_url, model, agent, [k, temperature, seed], list(key_parts),
                     [r["question_id"] for r in rows])
    store = ChunkStore(scratch, key, PASS_COUNTS)
    log.info("mining %d questions x %d with %s (counts saved in %s)", len(rows), k,
             base_url or checkpoint, store.dir)
    passes = pass_rates(rows, backend, agent.toolbox(index_dir, gallery_dir), agent.engine(temperature=temperature),
                        k=k, seed=seed, image_root=image_root, store=store, progress=progress)
    return [dict(question_id=r["question_id"], split=r["split"], type=r["type"], k=k, passes=passes[r["question_id"]])
            for r in rows]

