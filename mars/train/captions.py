"""Zoom captions: emblems read at the scale a zoom shows them (the sft stage's localisation block).

What it does
    :func:`zoom_captions` writes one-turn visual questions about a NEW random emblem (one of no entity), worded like
    the perception questions ("What colour is the emblem in the framed region?"), open or multiple choice, answered
    in the protocol's final-turn format, on a crop drawn as the zoom tool shows the target: the central
    ``target_zone`` of a framed cell of a full-size scene, a calm smooth background with the scene's noise, the
    emblem at the scene's scale (``emblem_frac`` of the short side). So the vision tower learns to read an emblem at
    the size a zoom gives it. The crop is drawn directly (the world keeps the zone free of clutter,
    :func:`mars.world.scenes.draw_clutter`), so no 4K scene is rendered (0.2 s each); crops longer than
    ``max_side`` (448 px, twice the view) are scaled down, as the processor would. :func:`zoom_crop` draws one such
    crop with its emblem spec (also the images of the sft stage's vision pre-training, :mod:`mars.train.vision`).
    ``sft.pretrain_zoom_captions`` of them join the localisation block; ``sft.locate_frame_captions`` of those its
    first stage (docs/training.md, SFT).

Deviation from the paper (and why)
    The paper's policy starts from Qwen2.5-VL, whose vision encoder already reads shapes, letters and colours; its
    cold start teaches the agent, not the eyes. The embedded default's vision tower is random-init, and the sft
    split's framed emblems are too few to teach it; the captions stand in for the base model's vision pre-training
    and are off (``sft.pretrain_zoom_captions: 0``) for a pretrained ``init_checkpoint``.

How to run (Python)::

    dialogues = zoom_captions(WorldSpec().scene_config(), n=600, seed=0, attributes=["colour"])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image

from mars.agent.protocol import format_answer
from mars.agent.teacher import ATTRIBUTE_WORDS, THINK
from mars.train.data import in_view
from mars.world.emblems import random_emblem, render_emblem
from mars.world.questions import (ATTRIBUTES, FRAMED_SUBJECT, PERCEPTION_QUESTIONS, attribute_value, check_attributes,
                                  question_text)
from mars.world.scenes import SceneConfig, add_tiled_noise, background, scene_size, zone_box

__all__ = ["ZOOM_LONG_SIDE", "zoom_captions", "zoom_crop"]

ZOOM_LONG_SIDE = 448  # zoom captions are kept at about twice the policy's 224-px view (as the localisation drills)


def zoom_captions(scene: SceneConfig, *, n: int, seed: int = 0, mcq_share: float = 0.5,
                  max_side: int = ZOOM_LONG_SIDE, attributes: Sequence[str] | None = None,
                  view: Callable[[Image.Image], Image.Image] | None = None) -> list[list[dict]]:
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
        out.append(in_view([
            {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": text}]},
            {"role": "assistant", "content": reply},
        ], view))
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
    if max(zw, zh) > max_side:  # a 4K scene's zone is ~1 MB of pixels; 2,000 of them held 2 GB
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
