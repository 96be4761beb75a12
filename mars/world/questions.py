"""Questions over the embedded world: perception, search and multi-hop (docs/design.md, The embedded default world).

What it does
    :func:`make_questions` turns a generated world (entities, world truth, raw image pool) into a QUESTIONS table
    (:data:`mars.data.schemas.QUESTIONS`) with three types:

    - ``perception`` (like V* / HR-Bench): the image is a high-resolution scene; the answer is visible in a crop of
      the emblem inside the red frame: its fill ``colour`` (one of 16 named palette colours; V*'s attribute-
      recognition questions ask about colour and material), its ``shape``, its ``letter`` (glyph) or its
      ``pattern``. At the resolution the policy sees the whole scene the emblem is a few pixels, so a zoom is
      needed. The colour is the one attribute the embedded default's random-init vision tower learns to read at the
      zoom's scale in the budget (letters stay at chance, shapes and patterns need emblems about twice as large),
      and the 8-head default's SFT model learns to answer it where a 4-head one did not (docs/findings.md); the
      synthesize stage's ``perception_attributes`` picks which attributes are asked (the colour by default).
    - ``search`` (like MMSearch): the image is one large rendering of an entity's emblem (a fresh gallery-style
      rendering with its own noise, rotation and background, never in the image index); the question asks a fact
      (founding year, city, founder) that only the text corpus holds: image_search, then text_search.
    - ``multi-hop`` (like HR-MMSearch): a scene; a fact about the organisation whose emblem is inside the red frame:
      zoom in, image_search on the crop, then text_search.

    Every type has a multiple-choice variant (4 options A-D, the prompt lists them and asks for the letter;
    ``choices`` holds the JSON ``{"A": ..., ...}``, ``answer`` is the correct option's TEXT and ``aliases`` holds its
    letter) and an open variant (``choices`` null). The ``question`` column is the complete prompt text.

    ``difficulty``: the scene's world-truth difficulty (0 for search images) plus 1 for open variants.
    ``split`` is ``"test"`` for every row unless an ``assign`` function gives each candidate its split (the
    synthesize stage assigns sft/rl/test by scene, see :mod:`mars.synth.splits`).

Images and paths
    ``image_path`` is relative to ``root`` (default: the parent of ``raw_dir``; with the world stage's layout
    that is the world directory, so scene paths read ``raw/<file>``). Search images are written as
    ``<search_dir>/<question_id>.png`` (default ``search_dir``: ``root/questions``), so with defaults they read
    ``questions/<question_id>.png``. :func:`load_question_image` opens one.

Determinism
    The candidates of each type are enumerated in a fixed order, shuffled with ``numpy.random.default_rng([seed,
    stream])`` and the first ``n_per_type`` are kept (fewer when the world has fewer candidates); MCQ options and
    search renderings use their own per-question seeded streams, so the same inputs and seed give equal tables and
    byte-identical images. Only scenes that are ordinary generated scenes (``planted_case`` null) are used.

Deviations
    The paper's questions are human- or model-written over real photos; ours are templated over a generated world
    whose ground truth is known, so a scripted teacher (:mod:`mars.agent.oracle`) can solve them with real tools.

How to run (Python)::
        tables = generate_world(WorldSpec.smoke(), world/"raw", world/"gallery")
        q = make_questions(tables, world/"raw", seed=0, n_per_type=30)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
from PIL import Image

from mars.data.schemas import QUESTIONS
from mars.world.emblems import COLOUR_NAMES, GLYPHS, PATTERNS, SHAPES, render_gallery_image

__all__ = ["QUESTION_TYPES", "FACTS", "ATTRIBUTES", "asked_attribute", "asked_attributes", "attribute_value",
           "check_attributes", "FACT_QUESTIONS", "PERCEPTION_QUESTIONS", "SEARCH_SUBJECT", "make_questions",
           "load_question_image", "question_rows", "question_text"]

QUESTION_TYPES: tuple[str, ...] = ("perception", "search", "multi-hop")
# what a perception question can ask about the framed emblem, and each attribute's values (MCQ options)
ATTRIBUTES: dict[str, tuple[str, ...]] = {"colour": tuple(COLOUR_NAMES.values()), "shape": SHAPES,
                                          "glyph": tuple(GLYPHS), "pattern": PATTERNS}
FACTS: tuple[str, ...] = ("founded_year", "city", "founder")
SEARCH_IMAGE_SIZE = 448
STREAM_SHUFFLE, STREAM_CHOICES, STREAM_RENDER = 21, 22, 23
LETTERS = "ABCD"

PERCEPTION_QUESTIONS = {  # {subject}: "the emblem inside the red frame" in scene questions
    "colour": "What colour is {subject} filled with?",
    "shape": "What shape is {subject}?",
    "glyph": "Which letter is drawn on {subject}?",
    "pattern": "Which pattern is drawn on {subject}?",
}
FRAMED_SUBJECT = "the emblem inside the red frame"
OPEN_HINTS = {
    "colour": "Answer with one word (e.g. blue, orange).",
    "shape": "Answer with one word (e.g. circle, hexagon).",
    "glyph": "Answer with the letter.",
    "pattern": f"Answer with one of: {', '.join(PATTERNS)}.",
    "founded_year": "Answer with the year.",
    "city": "Answer with the city's name.",
    "founder": "Answer with the founder's full name.",
}
FACT_QUESTIONS = {  # {subject}: who the question is about
    "founded_year": "In which year was {subject} founded?",
    "city": "In which city is {subject} based?",
    "founder": "Who founded {subject}?",
}
SEARCH_SUBJECT = "the organisation with this emblem"
MULTIHOP_SUBJECT = "the organisation whose emblem is inside the red frame"


@dataclass(frozen=True)
class _Candidate:
    type: str
    key: str  # "shape" / "glyph" / "pattern" / a fact name
    mcq: bool
    entity_id: str
    scene_id: str | None
    scene_path: str | None  # relative to raw_dir
    difficulty: int


def question_text(base: str, key: str, answer: str, pool: list[str], rng: np.random.Generator | None
                  ) -> tuple[str, dict[str, str] | None, list[str]]:
    """(text, choices or None, aliases) of one question: multiple choice (4 options drawn with ``rng``, the
    answer's letter as alias) when ``rng`` is given and the pool has another value, else open with a hint."""
    choices = _mcq(rng, answer, pool) if rng is not None else None
    if choices is not None and len(choices) < 2:
        choices = None  # a degenerate world (one entity): fall back to the open variant
    if choices is not None:
        letter = next(k for k, v in choices.items() if v == answer)
        return _mcq_text(base, choices), choices, [letter]
    return f"{base} {OPEN_HINTS[key]}", None, []


def _mcq(rng: np.random.Generator, answer: str, pool: list[str]) -> dict[str, str]:
    others = sorted({p for p in pool if p != answer})
    picks = [others[int(i)] for i in rng.choice(len(others), min(3, len(others)), replace=False)]
    options = [answer, *picks]
    order = rng.permutation(len(options))
    return {LETTERS[k]: options[int(i)] for k, i in enumerate(order)}


def _mcq_text(question: str, choices: dict[str, str]) -> str:
    lines = [question] + [f"{k}. {v}" for k, v in choices.items()]
    return "\n".join(lines) + "\nAnswer with the option's letter."


def asked_attribute(question: str) -> str | None:
    """Which attribute (:data:`ATTRIBUTES`) a perception question's text asks about, from the wording of
    :data:`PERCEPTION_QUESTIONS` (any subject); None for other questions."""
    text = question.lower()
    for key, template in PERCEPTION_QUESTIONS.items():
        if template.split("{subject}")[0].lower() in text:
            return key
    return None


def check_attributes(attributes: Sequence[str] | None) -> tuple[str, ...]:
    """``attributes`` as a tuple, checked to be a non-empty subset of :data:`ATTRIBUTES` (all of them for None)."""
    attributes = tuple(ATTRIBUTES if attributes is None else attributes)
    unknown = sorted(set(attributes) - set(ATTRIBUTES))
    if unknown or not attributes:
        raise ValueError(f"perception attributes must be a non-empty subset of {list(ATTRIBUTES)}, got "
                         f"{list(attributes)}" + (f" (unknown: {unknown})" if unknown else ""))
    return attributes


def asked_attributes(rows: Sequence[dict]) -> tuple[str, ...] | None:
    """The attributes the perception questions among ``rows`` (QUESTIONS rows) ask, in :data:`ATTRIBUTES` order;
    None when there are no perception questions."""
    asked = {asked_attribute(r["question"]) for r in rows if r.get("type") == "perception"} - {None}
    return tuple(a for a in ATTRIBUTES if a in asked) or None


def attribute_value(spec: dict, key: str) -> str | None:
    """The answer to a perception question about ``key`` (:data:`ATTRIBUTES`) for an emblem spec: the fill's colour
    name for ``colour``, else the spec's own value (None when the emblem has no glyph or no pattern)."""
    if key not in ATTRIBUTES:
        raise ValueError(f"unknown perception attribute {key!r}; choose from {sorted(ATTRIBUTES)}")
    if key == "colour":
        return COLOUR_NAMES[spec["fill"]]
    value = spec.get(key)
    return None if value is None else str(value)


def _fact(entity: dict, key: str) -> str:
    return str(entity[key])


def question_rows(
    tables: Any,
    raw_dir: str | Path,
    search_dir: str | Path | None = None,
    *,
    seed: int = 0,
    n_per_type: int = 30,
    root: str | Path | None = None,
    assign: Callable[[str, str | None, str], str | None] | None = None,
    per_split: dict[str, int] | None = None,
    attributes: Sequence[str] | None = None,
) -> list[dict]:
    """The rows of :func:`make_questions` as dicts (search images are written as a side effect).

    ``attributes``: what perception questions may ask (a subset of :data:`ATTRIBUTES`, all by default).

    With ``assign(type, scene_id, entity_id) -> split or None`` (None drops the candidate) and ``per_split``
    (the most questions of each type per split), candidates are taken in the same shuffled order until every
    split of a type is full; ``n_per_type`` is then ignored and ``split`` holds the assigned split.
    """
    raw_dir = Path(raw_dir)
    root = Path(root) if root is not None else raw_dir.parent
    search_dir = Path(search_dir) if search_dir is not None else root / "questions"
    if n_per_type < 0:
        raise ValueError(f"n_per_type must be >= 0, got {n_per_type}")
    attributes = check_attributes(attributes)

    entities = {r["entity_id"]: r for r in tables.entities.to_pylist()}
    real = sorted(e for e, r in entities.items() if not r["is_distractor"])
    raw = {r["scene_id"]: r for r in tables.raw_images.to_pylist() if r["scene_id"] and not r["planted_case"]}
    targets = sorted(
        (r for r in tables.world_truth.to_pylist() if r["is_target"] and r["scene_id"] in raw),
        key=lambda r: r["scene_id"],
    )
    fact_pools = {k: sorted({_fact(entities[e], k) for e in real}) for k in FACTS}

    cands: dict[str, list[_Candidate]] = {t: [] for t in QUESTION_TYPES}
    for t in targets:
        spec = json.loads(entities[t["entity_id"]]["emblem"])
        for attr in attributes:
            if attribute_value(spec, attr) is None:
                continue
            for mcq in (True, False):
                cands["perception"].append(_Candidate("perception", attr, mcq, t["entity_id"], t["scene_id"],
                                                      raw[t["scene_id"]]["path"], int(t["difficulty"])))
        for fact in FACTS:
            for mcq in (True, False):
                cands["multi-hop"].append(_Candidate("multi-hop", fact, mcq, t["entity_id"], t["scene_id"],
                                                     raw[t["scene_id"]]["path"], int(t["difficulty"])))
    for e in real:
        for fact in FACTS:
            for mcq in (True, False):
                cands["search"].append(_Candidate("search", fact, mcq, e, None, None, 0))

    rows: list[dict] = []
    for ti, qtype in enumerate(QUESTION_TYPES):
        pool = cands[qtype]
        order = np.random.default_rng([seed, STREAM_SHUFFLE, ti]).permutation(len(pool))
        if assign is None:
            chosen = [(pool[int(i)], "test") for i in order[:n_per_type]]
        else:
            taken: dict[str, int] = {}
            chosen = []
            for i in order:
                c = pool[int(i)]
                split = assign(qtype, c.scene_id, c.entity_id)
                if split is None or taken.get(split, 0) >= (per_split or {}).get(split, 0):
                    continue
                taken[split] = taken.get(split, 0) + 1
                chosen.append((c, split))
        prefix = {"perception": "perc", "search": "srch", "multi-hop": "mhop"}[qtype]
        for k, (c, split) in enumerate(chosen):
            qid = f"{prefix}-{seed}-{k:04d}"
            ent = entities[c.entity_id]
            rng = np.random.default_rng([seed, STREAM_CHOICES, ti, k])
            if qtype == "perception":
                answer = str(attribute_value(json.loads(ent["emblem"]), c.key))
                base, pool_vals = PERCEPTION_QUESTIONS[c.key].format(subject=FRAMED_SUBJECT), list(ATTRIBUTES[c.key])
            else:
                answer = _fact(ent, c.key)
                base = FACT_QUESTIONS[c.key].format(subject=SEARCH_SUBJECT if qtype == "search" else MULTIHOP_SUBJECT)
                pool_vals = fact_pools[c.key]
            text, choices, aliases = question_text(base, c.key, answer, pool_vals, rng if c.mcq else None)
            if qtype == "search":
                search_dir.mkdir(parents=True, exist_ok=True)
                path = search_dir / f"{qid}.png"
                spec = json.loads(ent["emblem"])
                img = render_gallery_image(spec, np.random.default_rng([seed, STREAM_RENDER, k]), SEARCH_IMAGE_SIZE)
                img.save(path, format="PNG")
            else:
                path = raw_dir / c.scene_path
            rows.append(
                dict(
                    question_id=qid,
                    type=qtype,
                    scene_id=c.scene_id,
                    image_path=Path(os.path.relpath(path, root)).as_posix(),
                    question=text,
                    answer=answer,
                    aliases=aliases,
                    choices=json.dumps(choices, sort_keys=True) if choices is not None else None,
                    entity_id=c.entity_id,
                    difficulty=c.difficulty + (0 if choices is not None else 1),
                    split=split,
                )
            )
    return rows


def make_questions(
    tables: Any,
    raw_dir: str | Path,
    search_dir: str | Path | None = None,
    *,
    seed: int = 0,
    n_per_type: int = 30,
    root: str | Path | None = None,
) -> pa.Table:
    """Build up to ``n_per_type`` questions of each type (see the module docstring) as a QUESTIONS table.

    ``tables`` needs ``entities``, ``world_truth`` and ``raw_images`` (a :class:`~mars.world.generate.WorldTables`
    or any object with those pyarrow tables); ``raw_dir`` is the raw pool directory the scene paths are relative
    to; search images are written into ``search_dir``; ``image_path`` is relative to ``root``.
    """
    rows = question_rows(tables, raw_dir, search_dir, seed=seed, n_per_type=n_per_type, root=root)
    return pa.Table.from_pylist(rows, schema=QUESTIONS)


def load_question_image(root: str | Path, image_path: str) -> Image.Image:
    """Open a question's image (RGB) from ``root``/``image_path``."""
    with Image.open(Path(root) / image_path) as im:
        return im.convert("RGB")
