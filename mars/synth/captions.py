"""Emblem captions: a vision warm-up mixed into the SFT data (``sft.caption_examples``).

What it does
    :func:`caption_dialogues` turns the world's gallery renderings (``world/gallery.parquet``, the images behind
    ``image_search``) into one-turn visual questions about an emblem's shape, letter or pattern, worded like the
    perception questions ("Which letter is drawn on this emblem?"), open or multiple choice, answered in the
    protocol's final-turn format (``<think>...</think>`` then ``<answer>...</answer>``). There is no system prompt
    and no tool: the dialogue teaches the vision tower and the LM to read an emblem, not the agent protocol.
    Entities named by any held-out question (``exclude_entities``: the test split's) are left out, so no test
    answer is ever trained on, and the draw is seeded.

Deviation from the paper (and why)
    The paper's policy starts from Qwen2.5-VL, whose vision encoder already reads shapes and letters; its cold
    start teaches the agent, not the eyes. The embedded default's vision tower is random-init, and the sft split's
    few dozen framed emblems cannot teach it 8 shapes, 7 patterns and 24 letters (perception stayed at chance
    without this; README, SFT notes). The captions stand in for the base model's vision pre-training; they are off
    (``caption_examples: 0``) for a pretrained ``init_checkpoint``.

How to run (Python)::

    dialogues = caption_dialogues(read_table(world / "gallery.parquet", GALLERY).to_pylist(),
                                  read_table(world / "entities.parquet", ENTITIES).to_pylist(),
                                  world / "gallery", n=600, seed=0, exclude_entities={"e0001"})
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from PIL import Image

from mars.agent.protocol import format_answer
from mars.world.questions import ATTRIBUTES, PERCEPTION_QUESTIONS, question_text

__all__ = ["CAPTION_SUBJECT", "caption_dialogues"]

CAPTION_SUBJECT = "this emblem"
_THINK = (
    "The emblem's {kind} is {value}.",
    "I can see the {kind} clearly: {value}.",
    "Looking at the emblem, the {kind} is {value}.",
)


def caption_dialogues(
    gallery: list[dict],
    entities: list[dict],
    gallery_dir: str | Path,
    *,
    n: int,
    seed: int = 0,
    exclude_entities: Iterable[str] = (),
    mcq_share: float = 0.5,
) -> list[list[dict]]:
    """``n`` caption dialogues (``[user: image + question, assistant: answer]``) drawn from ``gallery`` rows.

    ``gallery``: rows of the GALLERY table (``entity_id``, ``path`` relative to ``gallery_dir``); ``entities``:
    rows of ENTITIES (``emblem`` is the emblem spec as JSON). Renderings are drawn without replacement while they
    last (then again, in a new order), each with a random attribute and format.
    """
    if n < 0:
        raise ValueError(f"the number of caption dialogues must be >= 0, got {n}")
    if not 0.0 <= mcq_share <= 1.0:
        raise ValueError(f"mcq_share must be in [0, 1], got {mcq_share}")
    if n == 0:
        return []
    specs = {e["entity_id"]: json.loads(e["emblem"]) for e in entities if e.get("emblem")}
    excluded = set(exclude_entities)
    rows = sorted((r for r in gallery if r["entity_id"] in specs and r["entity_id"] not in excluded),
                  key=lambda r: r["path"])
    if not rows:
        raise ValueError(f"no gallery rendering left for captions ({len(gallery)} rows, {len(excluded)} entities "
                         "excluded); set sft.caption_examples to 0 or generate a larger world")
    root = Path(gallery_dir)
    rng = np.random.default_rng([seed, 31])
    order: list[int] = []
    out: list[list[dict]] = []
    cache: dict[str, Image.Image] = {}
    for _ in range(n):
        if not order:
            order = [int(i) for i in rng.permutation(len(rows))]
        row = rows[order.pop()]
        spec = specs[row["entity_id"]]
        attrs = [a for a in ATTRIBUTES if spec.get(a) is not None]
        attr = attrs[int(rng.integers(len(attrs)))]
        answer = str(spec[attr])
        base = PERCEPTION_QUESTIONS[attr].format(subject=CAPTION_SUBJECT)
        mcq = bool(rng.random() < mcq_share)
        text, choices, aliases = question_text(base, attr, answer, list(ATTRIBUTES[attr]), rng if mcq else None)
        kind = "letter" if attr == "glyph" else attr
        think = _THINK[int(rng.integers(len(_THINK)))].format(kind=kind, value=answer)
        reply = format_answer(aliases[0], f"{think} That is option {aliases[0]}.") if choices else \
            format_answer(answer, think)
        path = row["path"]
        if path not in cache:
            try:
                with Image.open(root / path) as im:
                    cache[path] = im.convert("RGB")
            except OSError as exc:
                raise ValueError(f"gallery image {root / path} is unreadable ({exc}); rerun the world stage") from exc
        out.append([
            {"role": "user", "content": [{"type": "image", "image": cache[path]}, {"type": "text", "text": text}]},
            {"role": "assistant", "content": reply},
        ])
    return out
