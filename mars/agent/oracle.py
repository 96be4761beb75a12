"""Scripted policies that drive the real protocol: the ground-truth oracle and the no-tool baseline.

What it does
    :func:`oracle_policy` returns, for one question, a ``policy(dialogue) -> str`` for
    :class:`~mars.agent.backends.ScriptedBackend` that plays the SAME protocol a model plays, with real tool calls,
    using the world's ground truth to decide what to do:

    - perception: ``image_zoom_in`` on the target emblem's box (relative 0..1000 coordinates of image 0, with a
      margin of :data:`ZOOM_MARGIN` of the box side), then ``<answer>`` the attribute from the truth;
    - search: ``image_search(img_idx=0)``, then ``text_search("<true name> <fact keyword>")``, then ``<answer>``
      the fact READ from the text_search observation (the first 4-digit number / the true city or founder found in
      a snippet whose title is the entity's name), falling back to the truth when no snippet has it;
    - multi-hop: zoom on the target box (the crop becomes image 1), ``image_search(img_idx=1)``, ``text_search``,
      ``<answer>`` as above.

    Multiple-choice answers are the option letter. The policy decides from the number of assistant turns so far,
    so a failed tool call does not derail it. Note that the oracle queries text search with the TRUE name, so its
    accuracy does not depend on image search; :func:`image_search_hits` measures how often image search actually
    returned the right entity (top-1 and top-k), the skill a model has to rely on.

    :func:`no_tool_policy` answers at once without tools: ``A`` for multiple choice, a fixed year / city / name /
    colour / shape / letter / pattern otherwise (near chance).

    :func:`scripted_backend` routes each dialogue of a batch to its question's policy (by question text; questions
    sharing a text are told apart by a 16x16 thumbnail of image 0).

Command
    ``python -m mars.agent.oracle --world-dir DIR --index-dir DIR [--n-per-type 30] [--seed 0]`` builds questions
    for an existing world (the world stage's output directory) and index (the index stage's), runs the oracle and
    the no-tool policy through :func:`~mars.agent.engine.run_episodes` with a real ToolBox, and prints accuracy per
    question type (plus image-search hit rates). Search images are written to ``--questions-dir`` (default: a
    temporary directory).

Deviation
    The paper's cold-start trajectories come from a strong model (an imperfect teacher); this oracle is perfect by
    construction. The imperfect SFT teacher, with a skill knob (wrong cell / near-miss query some share of the
    time), is :mod:`mars.agent.teacher` (docs/training.md, SFT).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image

from mars.agent.backends import ScriptedBackend
from mars.agent.engine import EngineConfig, Trajectory, run_episodes
from mars.agent.protocol import content_text, format_answer, format_tool_call
from mars.world.questions import asked_attribute, attribute_value

__all__ = [
    "World",
    "ZOOM_MARGIN",
    "zone_zoom_box",
    "image_search_hits",
    "no_tool_policy",
    "oracle_policy",
    "scripted_backend",
    "accuracy_by_type",
    "main",
]

ZOOM_MARGIN = 0.5  # the zoom box extends the target box by this share of its longer side on every side
FACT_KEYWORD = {"founded_year": "founded", "city": "city", "founder": "founder"}
_YEAR_RE = re.compile(r"\b(\d{4})\b")


@dataclass
class World:
    """What the oracle needs from a world: entities by id, each scene's target truth row and its other emblems."""

    entities: dict[str, dict]
    targets: dict[str, dict]
    others: dict[str, list[dict]] = field(default_factory=dict)

    @classmethod
    def from_tables(cls, tables: Any) -> World:
        ents = {r["entity_id"]: r for r in tables.entities.to_pylist()}
        truth = tables.world_truth.to_pylist()
        targets = {r["scene_id"]: r for r in truth if r["is_target"]}
        others: dict[str, list[dict]] = {}
        for r in truth:
            if not r["is_target"]:
                others.setdefault(r["scene_id"], []).append(r)
        return cls(ents, targets, others)

    @classmethod
    def from_dir(cls, world_dir: str | Path) -> World:
        return cls.from_tables(load_world_tables(world_dir))


@dataclass
class _Tables:
    entities: Any
    world_truth: Any
    raw_images: Any
    gallery: Any


def load_world_tables(world_dir: str | Path) -> _Tables:
    """The world stage's tables from ``world_dir`` (schema-checked)."""
    from mars.data.io import read_table
    from mars.data.schemas import ENTITIES, GALLERY, RAW_IMAGES, WORLD_TRUTH

    d = Path(world_dir)
    return _Tables(
        entities=read_table(d / "entities.parquet", ENTITIES),
        world_truth=read_table(d / "world_truth.parquet", WORLD_TRUTH),
        raw_images=read_table(d / "raw_images.parquet", RAW_IMAGES),
        gallery=read_table(d / "gallery.parquet", GALLERY),
    )


# ------------------------------------------------------------------------------------------------ helpers


def _question_kind(q: dict) -> str:
    """Which attribute or fact a question asks (colour / shape / glyph / pattern / founded_year / city / founder)."""
    attr = asked_attribute(q["question"])
    if attr is not None:
        return attr
    text = q["question"].lower()
    if "which year" in text or "founded?" in text:
        return "founded_year"
    if "which city" in text:
        return "city"
    return "founder"


def _choices(q: dict) -> dict[str, str] | None:
    c = q.get("choices")
    if isinstance(c, str):
        c = json.loads(c)
    return c or None


def final_turn(q: dict, value: str, think: str) -> str:
    """The final assistant turn answering ``value`` after ``think``: the option letter when question ``q`` has
    choices and one of them is ``value`` (case and spaces ignored), else ``value`` itself."""
    choices = _choices(q)
    if choices:
        letter = next((k for k, v in choices.items() if str(v).strip().lower() == str(value).strip().lower()), None)
        if letter is not None:
            return format_answer(letter, think + f" That is option {letter}.")
    return format_answer(str(value), think)


def _n_assistant(dialogue: list[dict]) -> int:
    return sum(1 for m in dialogue if m["role"] == "assistant")


def _last_user_text(dialogue: list[dict]) -> str:
    for m in reversed(dialogue):
        if m["role"] == "user":
            return content_text(m["content"])
    return ""


def snippets_about(observation: str, name: str) -> list[str]:
    """The snippets of a text_search observation (lines ``[i] title: snippet``) whose title is ``name``."""
    out = []
    for line in observation.splitlines():
        m = re.match(r"\[\d+\]\s*(.*?):\s(.*)", line)
        if m and (m.group(1) == name or m.group(1).startswith(name + " - ")):
            out.append(m.group(2))
    return out


def read_fact(observation: str, name: str, fact: str, truth: str) -> tuple[str, bool]:
    """The fact as read from a text_search observation (lines ``[i] title: snippet``) about ``name``.

    Returns ``(value, from_observation)``; the truth when no snippet titled with the name states it."""
    for snippet in snippets_about(observation, name):
        if fact == "founded_year":
            y = _YEAR_RE.search(snippet)
            if y:
                return y.group(1), True
        elif re.search(r"\b" + re.escape(truth) + r"\b", snippet):
            return truth, True
    return truth, False


def zoom_box(truth_row: dict, margin: float = ZOOM_MARGIN) -> list[int]:
    """The target's box with a margin, in relative 0..1000 coordinates of the scene."""
    W, H = truth_row["scene_width"], truth_row["scene_height"]
    x0, y0, x1, y1 = truth_row["x0"], truth_row["y0"], truth_row["x1"], truth_row["y1"]
    pad = margin * max(x1 - x0, y1 - y0)
    box = [
        max(0, int(np.floor((x0 - pad) * 1000 / W))),
        max(0, int(np.floor((y0 - pad) * 1000 / H))),
        min(1000, int(np.ceil((x1 + pad) * 1000 / W))),
        min(1000, int(np.ceil((y1 + pad) * 1000 / H))),
    ]
    return box


def zone_zoom_box(truth_row: dict, cell: tuple[int, int] | None = None) -> list[int]:
    """The central ``target_zone`` share of a grid cell (default: the target's) in relative 0..1000 coordinates.

    The world places the target inside this box (:func:`mars.world.scenes.zone_box`), so zooming on the framed
    cell's zone is a choice among ``grid_rows * grid_cols`` fixed boxes: what a tiny model can learn, unlike
    regressing the emblem's exact box from pixels (docs/design.md, The embedded default world).
    """
    from mars.world.scenes import zone_box

    W, H = truth_row["scene_width"], truth_row["scene_height"]
    row, col = cell if cell is not None else (truth_row["cell_row"], truth_row["cell_col"])
    x0, y0, x1, y1 = zone_box(W, H, truth_row["grid_rows"], truth_row["grid_cols"], row, col,
                              float(truth_row.get("target_zone", 1.0)))
    return [int(np.floor(x0 * 1000 / W)), int(np.floor(y0 * 1000 / H)),
            min(1000, int(np.ceil(x1 * 1000 / W))), min(1000, int(np.ceil(y1 * 1000 / H)))]


# ------------------------------------------------------------------------------------------------ policies


def oracle_policy(question_row: dict, world: World) -> Callable[[list[dict]], str]:
    """A ground-truth policy for one question (see the module docstring)."""
    q = dict(question_row)
    qtype = q["type"]
    ent = world.entities[q["entity_id"]]
    kind = _question_kind(q)
    name = ent["name"]

    def attribute() -> str:
        return str(attribute_value(json.loads(ent["emblem"]), kind))

    def zoom() -> str:
        box = zoom_box(world.targets[q["scene_id"]])
        return format_tool_call("image_zoom_in", {"bbox_2d": box, "label": "framed emblem", "img_idx": 0},
                                "The emblem inside the red frame is too small to see; zoom in on it.")

    def search_text() -> str:
        return format_tool_call("text_search", {"query": f"{name} {FACT_KEYWORD[kind]}"},
                                f"The image search says this is {name}; look up the fact.")

    def answer_fact(dialogue: list[dict]) -> str:
        value, _ = read_fact(_last_user_text(dialogue), name, kind, str(ent[kind]))
        return final_turn(q, value, f"The snippet about {name} gives {value}.")

    def policy(dialogue: list[dict]) -> str:
        n = _n_assistant(dialogue)
        if qtype == "perception":
            if n == 0:
                return zoom()
            return final_turn(q, attribute(), f"In the crop the emblem's {kind} is {attribute()}.")
        if qtype == "search":
            if n == 0:
                return format_tool_call("image_search", {"img_idx": 0}, "Find out whose emblem this is.")
            if n == 1:
                return search_text()
            return answer_fact(dialogue)
        # multi-hop
        if n == 0:
            return zoom()
        if n == 1:
            return format_tool_call("image_search", {"img_idx": 1}, "Search the crop to identify the emblem.")
        if n == 2:
            return search_text()
        return answer_fact(dialogue)

    return policy


def no_tool_policy(dialogue: list[dict]) -> str:
    """Answer at once, without tools, with a fixed guess (near chance)."""
    text = ""
    for m in dialogue:
        if m["role"] == "user":
            text = content_text(m["content"], " ")
            break
    kind = _question_kind({"question": text})
    if "option's letter" in text:
        guess = "A"
    else:
        guess = {"colour": "blue", "shape": "circle", "glyph": "A", "pattern": "stripes", "founded_year": "1900",
                 "city": "Springfield", "founder": "John Smith"}[kind]
    return format_answer(guess, "I will answer without looking closer.")


def _thumb(im: Image.Image) -> np.ndarray:
    return np.asarray(im.convert("L").resize((16, 16), Image.Resampling.BILINEAR), dtype=np.float32)


def scripted_backend(
    questions: Sequence[dict],
    make_policy: Callable[[dict], Callable[[list[dict]], str]],
    image_root: str | Path | None = None,
) -> ScriptedBackend:
    """A ScriptedBackend that routes each dialogue to ``make_policy(question)`` of the question it is about."""
    by_text: dict[str, list[dict]] = {}
    for q in questions:
        by_text.setdefault(str(q["question"]), []).append(dict(q))
    policies: dict[str, Callable] = {}
    thumbs: dict[str, np.ndarray] = {}

    def thumb_of(q: dict) -> np.ndarray:
        qid = q["question_id"]
        if qid not in thumbs:
            if isinstance(q.get("image"), Image.Image):
                thumbs[qid] = _thumb(q["image"])
            else:
                p = Path(q["image_path"])
                with Image.open(Path(image_root) / p if image_root is not None else p) as im:
                    thumbs[qid] = _thumb(im)
        return thumbs[qid]

    def route(dialogue: list[dict]) -> str:
        first = next(m for m in dialogue if m["role"] == "user")
        text = next(p["text"] for p in first["content"] if p.get("type") == "text")
        cands = by_text[text]
        q = cands[0]
        if len(cands) > 1:
            img = next(p["image"] for p in first["content"] if p.get("type") == "image")
            t = _thumb(img)
            q = min(cands, key=lambda c: float(np.abs(thumb_of(c) - t).mean()))
        qid = q["question_id"]
        if qid not in policies:
            policies[qid] = make_policy(q)
        return policies[qid](dialogue)

    return ScriptedBackend(route)


# ------------------------------------------------------------------------------------------------ reporting


def image_search_hits(trajectories: Sequence[Trajectory], questions: Sequence[dict], world: World) -> dict[str, float]:
    """Share of image_search calls whose results name the question's entity first (top-1) / at all (top-k)."""
    names = {q["question_id"]: world.entities[q["entity_id"]]["name"] for q in questions}
    n = top1 = topk = 0
    for t in trajectories:
        name = names.get(t.question_id)
        msgs = t.messages
        for i, m in enumerate(msgs):
            if m["role"] != "assistant" or '"image_search"' not in m["content"] or i + 1 >= len(msgs):
                continue
            obs = _last_user_text(msgs[: i + 2])
            titles = [re.sub(r"^\[\d+\]\s*", "", ln).strip() for ln in obs.splitlines() if re.match(r"\[\d+\]", ln)]
            base = [re.sub(r" (logo|emblem|crest|insignia|badge)$", "", x) for x in titles]
            n += 1
            top1 += bool(base) and base[0] == name
            topk += name in base
    return {"calls": n, "top1": top1 / n if n else 0.0, "topk": topk / n if n else 0.0}


def accuracy_by_type(trajectories: Sequence[Trajectory], questions: Sequence[dict]) -> dict[str, float]:
    types = {q["question_id"]: q["type"] for q in questions}
    acc: dict[str, list[bool]] = {}
    for t in trajectories:
        acc.setdefault(types[t.question_id], []).append(t.correct)
    return {k: sum(v) / len(v) for k, v in acc.items()}


def main(argv: list[str] | None = None) -> int:
    from mars.tools.toolbox import ToolBox, ToolConfig
    from mars.world.questions import make_questions

    ap = argparse.ArgumentParser(prog="python -m mars.agent.oracle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-dir", type=Path, required=True)
    ap.add_argument("--index-dir", type=Path, required=True)
    ap.add_argument("--n-per-type", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--questions-dir", type=Path, default=None, help="where search images go (default: a temp dir)")
    args = ap.parse_args(argv)

    tables = load_world_tables(args.world_dir)
    world = World.from_tables(tables)
    qdir = args.questions_dir or Path(tempfile.mkdtemp(prefix="mars-questions-"))
    qtable = make_questions(tables, args.world_dir / "raw", qdir, seed=args.seed, n_per_type=args.n_per_type,
                            root=args.world_dir)
    questions = qtable.to_pylist()
    toolbox = ToolBox.from_dirs(args.index_dir, args.world_dir / "gallery", ToolConfig())
    cfg = EngineConfig()
    results = {}
    for label, backend in (
        ("oracle", scripted_backend(questions, lambda q: oracle_policy(q, world), args.world_dir)),
        ("no-tool", ScriptedBackend(no_tool_policy)),
    ):
        t0 = time.perf_counter()
        trajs = run_episodes(questions, backend, toolbox, cfg, seed=args.seed, image_root=args.world_dir)
        results[label] = (trajs, time.perf_counter() - t0)
    counts: dict[str, int] = {}
    for q in questions:
        counts[q["type"]] = counts.get(q["type"], 0) + 1
    acc = {k: accuracy_by_type(v[0], questions) for k, v in results.items()}
    print(f"{'type':<12}{'n':>5}{'oracle':>9}{'no-tool':>9}")
    for qt in ("perception", "search", "multi-hop"):
        if qt in counts:
            print(f"{qt:<12}{counts[qt]:>5}{acc['oracle'].get(qt, 0):>9.3f}{acc['no-tool'].get(qt, 0):>9.3f}")
    for label, (trajs, secs) in results.items():
        fmt = sum(t.reward_format > 0 for t in trajs) / len(trajs)
        print(f"{label}: {len(trajs)} episodes in {secs:.1f}s, well-formed {fmt:.3f}, "
              f"mean turns {sum(t.n_turns for t in trajs) / len(trajs):.2f}, "
              f"tool errors {sum(t.n_tool_errors for t in trajs)}")
    hits = image_search_hits(results["oracle"][0], questions, world)
    print(f"oracle image_search: {hits['calls']} calls, right entity top-1 {hits['top1']:.3f}, "
          f"top-k {hits['topk']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
