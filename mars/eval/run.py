"""Evaluation runs: benchmark questions through the shared engine, one result row per sample, resumable.

What it does
    :func:`engine_question` turns a BENCH_QUESTIONS row into the engine's question dict (image decoded lazily,
    per chunk, so a benchmark of 4K scenes never sits decoded in memory at once).
    :func:`evaluate_model` plays every question ``k`` times (Avg@k; sample 0 is Pass@1) for one model and
    workflow through :func:`mars.agent.engine.run_episodes` in chunks of ``chunk_size`` episodes, scores each
    episode with the shared rule judge (or an LLM judge, re-judging the extracted answer), and appends every
    finished chunk to a :class:`ResultStore` (one parquet file per chunk, written atomically). Samples already in
    the store are skipped, so an interrupted evaluation continues where it stopped and a rerun with the same
    inputs re-scores nothing; every sample is scored exactly once.
    :func:`result_rows` builds RESULTS rows; :func:`summarize` the metrics (accuracy per benchmark, model/workflow,
    question type, category and difficulty; tool calls per episode) and :func:`plot_rows` the tables behind
    ``dvc plots show``. :func:`first_zoom_framed` measures localisation on the generated world's scenes: the
    share of scene episodes whose first zoom centres in the framed cell (chance: one cell of the grid).
    :func:`search_chain` follows the search and multi-hop episodes step by step (is the first image search's top-1
    title the right organisation, does the next text query copy that title, does its result hold the answer, and is
    the answer then right), so ``dvc metrics show`` says which link of the chain fails.
    :func:`perception_by_attribute` splits perception accuracy by the attribute asked (colour, shape, letter,
    pattern), so it says which one the policy reads. :func:`answer_form` splits accuracy into open and
    multiple-choice questions and counts bare option letters, so a score made of guessed letters shows.

Workflows
    ``agentic``: the three tools and the protocol's system prompt (the ``agent`` params section).
    ``direct``: no tools; a plain system prompt asking for ``<answer>`` in one turn (the paper's direct-answer
    rows).

Run the tests: ``.venv/bin/python -m pytest tests/eval -q``.
"""

from __future__ import annotations

import io
import logging
import string
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import pyarrow as pa
from PIL import Image
from tqdm import tqdm

from mars.agent.engine import EngineConfig, PolicyBackend, Trajectory, messages_to_json, run_episodes
from mars.data.io import ChunkStore
from mars.data.schemas import RESULTS
from mars.errors import EndpointDown

__all__ = ["ResultStore", "engine_question", "evaluate_model", "result_rows", "summarize", "plot_rows",
           "first_zoom_framed", "perception_by_attribute", "search_chain", "answer_form", "WORKFLOWS"]
log = logging.getLogger(__name__)
WORKFLOWS = ("agentic", "direct")
_TOOL_COLS = {"image_zoom_in": "n_zoom", "text_search": "n_text_search", "image_search": "n_image_search"}


class ResultStore(ChunkStore):
    """Result rows of finished samples, appended chunk by chunk under ``root/<run key>/chunk-*.parquet``."""

    def __init__(self, root: str | Path, key: str):
        super().__init__(root, key, RESULTS)

    def done(self) -> set[str]:
        return set(self.table().column("sample_id").to_pylist())


def engine_question(row: dict) -> dict:
    """A BENCH_QUESTIONS row as the engine's question dict (image decoded from its bytes)."""
    with Image.open(io.BytesIO(row["images"][0])) as im:
        image = im.convert("RGB")
    answers = list(row["answers"])
    return {"question_id": row["id"], "question": row["question"], "answer": answers[0], "aliases": answers[1:],
            "choices": row.get("choices"), "image": image}


def _png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def result_rows(trajs: Sequence[Trajectory], rows: Sequence[dict], ks: Sequence[int], *, model: str, workflow: str,
                seed: int, temperature: float, latencies: Sequence[float]) -> list[dict]:
    """RESULTS rows for episodes ``trajs`` of benchmark ``rows`` (sample index ``ks``)."""
    out = []
    for t, r, k, lat in zip(trajs, rows, ks, latencies):
        counts = {c: 0 for c in _TOOL_COLS.values()}
        for call in t.tool_calls:
            col = _TOOL_COLS.get(call.get("name"))
            if col:
                counts[col] += 1
        out.append(dict(
            sample_id=f"{r['benchmark']}/{r['id']}/{model}/{workflow}/{k}",
            benchmark=r["benchmark"], question_id=r["id"], model=model, workflow=workflow, sample_idx=k,
            seed=seed, temperature=float(temperature), question=r["question"], gold=list(r["answers"]),
            prediction=t.answer, correct=bool(t.correct), score=1.0 if t.correct else 0.0, judge=t.judge,
            category=r.get("category"), difficulty=r.get("difficulty"), type=r.get("type"),
            finish_reason=t.finish_reason, turns=t.n_turns, tool_errors=t.n_tool_errors,
            format_errors=t.n_format_errors, tokens=int(t.n_generated_tokens), latency_s=float(lat),
            messages_json=messages_to_json(t.messages, t.images), images=[_png(im) for im in t.images], **counts,
        ))
    return out


def _rejudge(trajs: list[Trajectory], qs: list[dict], judge: Callable[[str, str, list[str]], Any]) -> None:
    """Replace rule verdicts with an LLM judge's (it sees only the extracted answer)."""
    for t, q in zip(trajs, qs):
        if t.answer is None:
            continue
        res = judge(q["question"], t.answer, [q["answer"], *q["aliases"]])
        t.correct, t.judge = bool(res.correct), f"{res.judge}:{res.method}"


def evaluate_model(
    bench: Sequence[dict],
    backend_factory: Callable[[], PolicyBackend],
    toolbox: Any,
    cfg: EngineConfig,
    store: ResultStore,
    *,
    model: str,
    workflow: str,
    k: int = 1,
    seed: int = 0,
    chunk_size: int = 32,
    question_hook: Callable[[dict, dict], dict] | None = None,
    judge: Callable[[str, str, list[str]], Any] | None = None,
) -> int:
    """Score every (question, sample) of ``bench`` not yet in ``store``; returns how many were scored now.

    ``question_hook(bench_row, engine_question)`` may add fields a scripted policy needs (the oracle's truth).
    """
    if workflow not in WORKFLOWS:
        raise ValueError(f"workflow must be one of {WORKFLOWS}, got {workflow!r}")
    if workflow == "direct":
        cfg = replace(cfg, max_turns=1, prompt="direct")
    done = store.done()
    todo = [(r, s) for s in range(k) for r in bench
            if f"{r['benchmark']}/{r['id']}/{model}/{workflow}/{s}" not in done]
    if not todo:
        return 0
    backend = backend_factory()
    bar = tqdm(total=len(todo), desc=f"eval {model}/{workflow}", unit="sample", leave=False)
    for start in range(0, len(todo), chunk_size):
        part = todo[start : start + chunk_size]
        qs = []
        for r, _ in part:
            q = engine_question(r)
            qs.append(question_hook(r, q) if question_hook else q)
        t0 = time.perf_counter()
        trajs = run_episodes(qs, backend, toolbox, cfg, seed=seed + 1000 * part[0][1] + start, image_root=None)
        lat = (time.perf_counter() - t0) / len(part)
        failed = [t for t in trajs if t.finish_reason == "backend_error"]
        if failed:  # the policy's endpoint failed after its retries: a wrong answer it did not give is no score
            errors = getattr(backend, "errors", None) or ["no detail"]
            bar.close()
            raise EndpointDown(f"policy endpoint of {model}/{workflow}: {len(failed)} of {len(trajs)} episodes of a "
                               f"chunk ended in a backend error after retries ({errors[-1]}); that chunk was not "
                               f"stored (the {len(store.done())} samples stored before it are kept): check the server, then "
                               "rerun to score the rest")
        if judge is not None:
            _rejudge(trajs, qs, judge)
        store.append(result_rows(trajs, [r for r, _ in part], [s for _, s in part], model=model, workflow=workflow,
                                 seed=seed, temperature=cfg.temperature, latencies=[lat] * len(part)))
        bar.update(len(part))
    bar.close()
    return len(todo)


def _acc(rows: list[dict]) -> float:
    return round(sum(r["correct"] for r in rows) / len(rows), 4) if rows else 0.0


def summarize(results: pa.Table) -> dict:
    """Nested metrics: benchmark -> "model/workflow" -> accuracy, pass@1, by type/category/difficulty, tools."""
    rows = results.to_pylist()
    out: dict = {}
    for bench in sorted({r["benchmark"] for r in rows}):
        out[bench] = {}
        b = [r for r in rows if r["benchmark"] == bench]
        for mw in sorted({(r["model"], r["workflow"]) for r in b}):
            rs = [r for r in b if (r["model"], r["workflow"]) == mw]
            entry: dict = {"accuracy": _acc(rs), "pass@1": _acc([r for r in rs if r["sample_idx"] == 0]),
                           "n": len(rs)}
            for key in ("type", "category", "difficulty"):
                vals = sorted({r[key] for r in rs if r[key] is not None})
                if vals and not (key == "category" and vals == sorted({r["type"] for r in rs if r["type"]})):
                    entry[f"by_{key}"] = {v: _acc([r for r in rs if r[key] == v]) for v in vals}
            entry["tool_calls"] = {c: round(sum(r[c] for r in rs) / len(rs), 3) for c in _TOOL_COLS.values()}
            entry["well_formed"] = round(sum(r["format_errors"] == 0 and r["finish_reason"] == "answer"
                                             for r in rs) / len(rs), 4)
            out[bench][f"{mw[0]}/{mw[1]}"] = entry
    return out


def first_zoom_framed(results: pa.Table, scene_of: dict[str, str | None], truth: dict[str, dict]) -> dict:
    """Localisation per ``"model/workflow"``: ``{"first_zoom_framed": share, "scene_episodes": n}``.

    ``scene_of`` maps a question id to its scene id (None for questions without a scene); ``truth`` maps a scene
    id to its target's WORLD_TRUTH row (grid and framed cell). Over the result rows of questions with a scene, the
    share whose first ``image_zoom_in`` on the scene (``img_idx`` 0) has a relative (0..1000) ``bbox_2d`` whose
    centre lies in the framed cell (:func:`mars.train.locate.located_cell`). An episode with no such zoom, or
    whose first one is malformed, counts as a miss. Runs without scene episodes are left out."""
    import json

    from mars.agent.protocol import parse_turn
    from mars.train.locate import zoom_cell, zooms_on_scene

    counts: dict[str, list[int]] = {}
    for r in results.to_pylist():
        scene = scene_of.get(r["question_id"])
        if scene is None:
            continue
        t = truth[scene]
        c = counts.setdefault(f"{r['model']}/{r['workflow']}", [0, 0])
        c[1] += 1
        for m in json.loads(r["messages_json"] or "[]"):
            if m["role"] != "assistant" or not isinstance(m["content"], str):
                continue
            turn = parse_turn(m["content"])
            if not zooms_on_scene(turn):
                continue
            # a malformed box (cell None) is the model's miss, not a crash
            c[0] += zoom_cell(turn, int(t["grid_rows"]), int(t["grid_cols"])) == (t["cell_row"], t["cell_col"])
            break
    return {mw: {"first_zoom_framed": round(hit / n, 4), "scene_episodes": n} for mw, (hit, n) in counts.items()}


def perception_by_attribute(results: pa.Table, questions: dict[str, dict]) -> dict:
    """Perception accuracy per asked attribute, per ``"model/workflow"``: ``{"perception_by_attribute": {"colour":
    share correct, ...}}`` over the result rows of perception questions (``questions``: question id -> QUESTIONS
    row; the attribute from the question's wording, :func:`mars.world.questions.asked_attribute`). Runs without
    perception questions are left out."""
    from mars.world.questions import asked_attribute

    counts: dict[str, dict[str, list[int]]] = {}
    for r in results.to_pylist():
        q = questions.get(r["question_id"])
        attr = asked_attribute(q["question"]) if q is not None and q.get("type") == "perception" else None
        if attr is None:
            continue
        c = counts.setdefault(f"{r['model']}/{r['workflow']}", {}).setdefault(attr, [0, 0])
        c[0] += bool(r["correct"])
        c[1] += 1
    return {mw: {"perception_by_attribute": {a: round(hit / n, 4) for a, (hit, n) in sorted(by.items())}}
            for mw, by in counts.items()}


def answer_form(results: pa.Table, questions: dict[str, dict]) -> dict:
    """Accuracy by the question's answer form, per ``"model/workflow"``, over the result rows of the pipeline's
    questions (``questions``: question id -> QUESTIONS row; a non-empty ``choices`` makes it multiple choice):
    ``{"by_form": {"open": share correct, "choice": share correct}, "letter_on_open": share of the open questions
    answered with a bare option letter (always wrong: they list no options; questions whose answer is itself a letter,
    an emblem's glyph, are left out of this share), "letter_on_choice": share of the multiple-choice ones answered with
    one}``. A multiple-choice question can be answered right by a guessed letter (one in four here), an open one only by
    the value read and written, so the open share is the cleaner measure of reading (docs/findings.md). A bare letter is
    one the rule judge reads as the whole answer (:func:`mars.rl.judge.bare_choice`, A-D). A form without questions in
    the run is left out; so is a run without any."""
    from mars.rl.judge import bare_choice

    counts: dict[str, dict[str, list[int]]] = {}
    for r in results.to_pylist():
        q = questions.get(r["question_id"])
        if q is None:
            continue
        form = "choice" if q.get("choices") else "open"
        c = counts.setdefault(f"{r['model']}/{r['workflow']}", {}).setdefault(form, [0, 0, 0, 0])
        c[0] += bool(r["correct"])
        c[1] += 1
        if form == "open" and bare_choice(q.get("answer"), string.ascii_uppercase):
            continue  # a glyph: a letter is the right form here
        c[2] += bare_choice(r.get("prediction")) is not None
        c[3] += 1
    return {mw: {"by_form": {f: round(right / n, 4) for f, (right, n, _, _) in sorted(by.items())},
                 **{f"letter_on_{f}": round(letters / m, 4) for f, (_, _, letters, m) in sorted(by.items()) if m}}
            for mw, by in counts.items()}


def search_chain(results: pa.Table, questions: dict[str, dict], names: dict[str, str]) -> dict:
    """The search chain per ``"model/workflow"``, over result rows of search and multi-hop questions.

    ``questions`` maps a question id to its QUESTIONS row (``type``, ``entity_id``, ``answer``: the value, also for
    multiple choice); ``names`` an entity id to its name. Per episode: the first ``image_search`` observation's top-1
    title (without its "logo"/"crest"... suffix), the first ``text_search`` after it (its query and observation).
    Returns ``{"chain_episodes": n, "chain_image_searched": share that reach an image search (a multi-hop policy
    that answers after its zoom as if asked about the emblem never does), "chain_top1_right": share whose top-1
    title is the question's organisation,
    "chain_query_copies_top1": share whose query is that title or starts with it and a space (right or wrong),
    "chain_snippet_has_answer": share whose text-search observation contains the answer (case-insensitive),
    "chain_right_given_snippet": correct among those (None when there are none)}``. An episode that never gets
    that far counts as a miss of the link it did not reach; malformed turns are skipped. Runs without such
    questions are left out."""
    import json

    from mars.agent.protocol import content_text, parse_turn
    from mars.agent.teacher import titles_from_observation

    # [episodes, image searched, top1 right, query copies, snippet has answer, right | snippet]
    counts: dict[str, list[int]] = {}
    for r in results.to_pylist():
        q = questions.get(r["question_id"])
        if q is None or q.get("type") not in ("search", "multi-hop"):
            continue
        c = counts.setdefault(f"{r['model']}/{r['workflow']}", [0, 0, 0, 0, 0, 0])
        top = query = snippet = None
        last = None  # the tool the last assistant turn called
        for m in json.loads(r["messages_json"] or "[]"):
            if m["role"] == "assistant":
                turn = parse_turn(content_text(m["content"]))
                last = turn if turn.action == "tool_call" else None
                continue
            if m["role"] != "user" or last is None:
                continue
            if last.tool_name == "image_search" and top is None:
                titles = titles_from_observation(content_text(m["content"]))
                top = titles[0] if titles else ""
            elif last.tool_name == "text_search" and top is not None and query is None:
                query, snippet = str((last.arguments or {}).get("query", "")).strip(), content_text(m["content"])
                break
            last = None
        answer = str(q["answer"]).lower()
        has = snippet is not None and answer in snippet.lower()
        c[0] += 1
        c[1] += top is not None
        c[2] += bool(top) and top.lower() == str(names.get(q["entity_id"], "")).lower()
        c[3] += bool(top) and query is not None and (query == top or query.startswith(top + " "))
        c[4] += has
        c[5] += has and bool(r["correct"])
    return {mw: {"chain_episodes": n, "chain_image_searched": round(searched / n, 4),
                 "chain_top1_right": round(top1 / n, 4), "chain_query_copies_top1": round(copies / n, 4),
                 "chain_snippet_has_answer": round(has / n, 4),
                 "chain_right_given_snippet": round(right / has, 4) if has else None}
            for mw, (n, searched, top1, copies, has, right) in counts.items()}


def plot_rows(results: pa.Table) -> tuple[list[dict], list[dict]]:
    """(accuracy rows, tool-call rows) for the plots: one row per benchmark x model/workflow (x tool)."""
    summary = summarize(results)
    acc, tools = [], []
    for bench, by in summary.items():
        for mw, e in by.items():
            acc.append({"benchmark": bench, "model": mw, "accuracy": e["accuracy"]})
            for t, v in e["tool_calls"].items():
                tools.append({"benchmark": bench, "model": mw, "tool": t[2:], "calls_per_episode": v})
    return acc, tools

