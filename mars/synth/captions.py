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

Zoom captions
    :func:`zoom_captions` writes the same kind of question about a NEW random emblem (one of no entity) shown as the
    zoom tool shows the target: the central ``target_zone`` of a framed cell of a full-size scene, a calm smooth
    background with the scene's noise, the emblem at the scene's scale (``emblem_frac`` of the short side), so the
    vision tower learns to read an emblem at the size a zoom gives it (a gallery rendering fills its image; the
    emblem in a zone crop covers a fraction of it). The crop is drawn directly (the zone is kept free of clutter by
    the world, :func:`mars.world.scenes.draw_clutter`), so no 4K scene is rendered (0.2 s each); crops longer
    than ``max_side`` (448 px, twice the view) are scaled down, as the processor would. :func:`zoom_crop` draws one
    such crop with its emblem spec (also the images of the sft stage's vision pre-training,
    :mod:`mars.train.vision`). Measured (README): 1,000
    of them in phase 1 did not raise perception measurably (the first zoom, which they do not teach, was at
    chance); 2,000 in the localisation block, with the first zoom right in 70-99% of test scenes, neither (reading
    after a right zoom stayed near the multiple-choice guess), so ``sft.pretrain_zoom_captions`` is 0 by default.

How to run (Python)::

    dialogues = caption_dialogues(read_table(world / "gallery.parquet", GALLERY).to_pylist(),
                                  read_table(world / "entities.parquet", ENTITIES).to_pylist(),
                                  world / "gallery", n=600, seed=0, exclude_entities={"e0001"})
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from mars.agent.protocol import format_answer
from mars.agent.teacher import ATTRIBUTE_WORDS, THINK
from mars.world.emblems import random_emblem, render_emblem
from mars.world.questions import (ATTRIBUTES, FRAMED_SUBJECT, PERCEPTION_QUESTIONS, attribute_value, check_attributes,
                                  question_text)
from mars.world.scenes import SceneConfig, add_tiled_noise, background, scene_size, zone_box

__all__ = ["CAPTION_SUBJECT", "ZOOM_LONG_SIDE", "caption_dialogues", "zoom_captions", "zoom_crop"]

CAPTION_SUBJECT = "this emblem"
ZOOM_LONG_SIDE = 448  # zoom captions are kept at about twice the policy's 224-px view (as the localisation drills)
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
        text, reply = _attribute_qa(specs[row["entity_id"]], CAPTION_SUBJECT, _THINK, rng, mcq_share)
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


def zoom_captions(scene: SceneConfig, *, n: int, seed: int = 0, mcq_share: float = 0.5,
                  max_side: int = ZOOM_LONG_SIDE, attributes: Sequence[str] | None = None) -> list[list[dict]]:
    """``n`` dialogues ``[user: a zone crop + perception question, assistant: the teacher's answer]`` about new random
    emblems drawn at the scale of a zoom on ``scene``'s target zone (module docstring, "Zoom captions"); a crop
    longer than ``max_side`` pixels is scaled down to it (the processor shrinks it to the policy's view anyway).
    ``attributes``: what the questions may ask (keys of :data:`~mars.world.questions.ATTRIBUTES`, all by default);
    an emblem with none of them (no glyph for a letter-only draw) is drawn again."""
    if n < 0:
        raise ValueError(f"the number of zoom captions must be >= 0, got {n}")
    attributes = check_attributes(attributes)
    if not 0.0 <= mcq_share <= 1.0:
        raise ValueError(f"mcq_share must be in [0, 1], got {mcq_share}")
    if max_side < 28:
        raise ValueError(f"max_side must be >= 28 pixels, got {max_side}")
    rng = np.random.default_rng([seed, 43])
    out: list[list[dict]] = []
    for _ in range(n):
        img, spec = zoom_crop(scene, rng, max_side)
        while not any(attribute_value(spec, a) is not None for a in attributes):
            img, spec = zoom_crop(scene, rng, max_side)
        text, reply = _attribute_qa(spec, FRAMED_SUBJECT, THINK["answer_attr"], rng, mcq_share, attributes)
        out.append([
            {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]},
            {"role": "assistant", "content": reply},
        ])
    return out


def zoom_crop(scene: SceneConfig, rng: np.random.Generator, max_side: int = ZOOM_LONG_SIDE,
              spec: dict | None = None) -> tuple[Image.Image, dict]:
    """``(crop, emblem spec)``: a NEW random emblem (in one of ``scene.schemes`` when it has them; or the emblem
    ``spec`` given) drawn as a zoom on ``scene``'s target zone shows it (module docstring, "Zoom captions"), scaled
    down to ``max_side`` pixels on its long side when longer."""
    w, h = scene_size(rng, scene.long_side_min, scene.long_side_max, scene.grid_rows, scene.grid_cols)
    x0, y0, x1, y1 = zone_box(w, h, scene.grid_rows, scene.grid_cols, 0, 0, scene.target_zone)
    zw, zh = x1 - x0, y1 - y0
    # the scene's background is a few blotches across the whole scene: draw it small, crop the zone, upsample
    k = 16
    small = background(rng, max(1, w // k), max(1, h // k))
    crop = small.crop((x0 // k, y0 // k, max(x0 // k + 1, x1 // k), max(y0 // k + 1, y1 // k)))
    img = add_tiled_noise(crop.resize((zw, zh), Image.Resampling.BILINEAR), rng, int(rng.integers(2, 7)))
    spec = random_emblem(rng, scene.schemes) if spec is None else spec
    size_px = max(12, int(round(scene.emblem_frac * min(w, h) * rng.uniform(0.85, 1.15))))
    emblem = render_emblem(spec, size_px, float(rng.uniform(-20, 20)))
    ex, ey = max(0, zw - emblem.width), max(0, zh - emblem.height)
    img.paste(emblem, (int(rng.integers(0, ex + 1)), int(rng.integers(0, ey + 1))), emblem)
    if max(zw, zh) > max_side:  # a 4K scene's zone is ~1 MB of pixels; 2,000 of them held 2 GB (README)
        f = max_side / max(zw, zh)
        img = img.resize((max(1, round(zw * f)), max(1, round(zh * f))), Image.Resampling.LANCZOS)
    return img, spec


def _attribute_qa(spec: dict, subject: str, wordings: tuple[str, ...], rng: np.random.Generator, mcq_share: float,
                  attributes: Sequence[str] | None = None) -> tuple[str, str]:
    """(question, reply) about one random attribute of an emblem ``spec`` (among ``attributes``, all by default):
    open or multiple choice, the reply in the protocol's final-turn format with one of ``wordings`` (``{kind}``,
    ``{value}``) as its thought."""
    attrs = [a for a in (attributes or ATTRIBUTES) if attribute_value(spec, a) is not None]
    attr = attrs[int(rng.integers(len(attrs)))]
    answer = str(attribute_value(spec, attr))
    base = PERCEPTION_QUESTIONS[attr].format(subject=subject)
    mcq = bool(rng.random() < mcq_share)
    text, choices, aliases = question_text(base, attr, answer, list(ATTRIBUTES[attr]), rng if mcq else None)
    think = wordings[int(rng.integers(len(wordings)))].format(kind=ATTRIBUTE_WORDS.get(attr, attr), value=answer)
    if choices:
        return text, format_answer(aliases[0], f"{think} That is option {aliases[0]}.")
    return text, format_answer(answer, think)
