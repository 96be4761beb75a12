"""Zoom captions (the localisation block's reading data): a new emblem at a zoom's scale, right answers, both formats."""

from __future__ import annotations

import numpy as np
import pytest

from mars.agent.protocol import parse_turn
from mars.world.emblems import COLOUR_NAMES
from mars.world.generate import WorldSpec


def test_zoom_captions_show_a_new_emblem_at_the_zooms_scale():
    from mars.train.captions import ZOOM_LONG_SIDE, zoom_captions
    from mars.world.emblems import GLYPHS, PATTERNS, SHAPES
    from mars.world.questions import FRAMED_SUBJECT

    scene = WorldSpec().scene_config()
    dialogues = zoom_captions(scene, n=30, seed=0)
    assert len(dialogues) == 30
    values = set(SHAPES) | set(PATTERNS) | set(GLYPHS) | set(COLOUR_NAMES.values())
    formats = set()
    for user, assistant in dialogues:
        image, question = user["content"][0]["image"], user["content"][1]["text"]
        assert FRAMED_SUBJECT in question
        # the crop is the cell's central zone: target_zone of half a side, for scenes of 2048-3840 px on the long
        # side, scaled down to ZOOM_LONG_SIDE (448) when longer
        zone = scene.target_zone / 2
        assert min(zone * 2048 - 1, ZOOM_LONG_SIDE) <= max(image.size) <= min(zone * 3840 + 1, ZOOM_LONG_SIDE)
        turn = parse_turn(assistant["content"])
        assert turn.well_formed and turn.action == "answer", assistant["content"]
        if "\nA. " in question:
            options = dict(line.split(". ", 1) for line in question.splitlines()[1:5])
            assert options[turn.answer] in values
            formats.add("mcq")
        else:
            assert turn.answer in values
            formats.add("open")
        # the emblem (0.05 of the scene's short side, +-15%) covers a few percent of the crop: pixels far from
        # the smooth, slightly noisy background (noise <= 6 per channel) that fills the rest
        a = np.asarray(image).astype(int)  # [H, W, 3]
        bg = np.median(a.reshape(-1, 3), axis=0)
        share = float((np.abs(a - bg).max(-1) > 60).mean())
        assert 0.002 <= share <= 0.3, share
    assert formats == {"mcq", "open"}
    again = zoom_captions(scene, n=3, seed=0)
    assert [np.asarray(d[0]["content"][0]["image"]).tobytes() for d in again] == \
        [np.asarray(d[0]["content"][0]["image"]).tobytes() for d in dialogues[:3]]
    assert zoom_captions(scene, n=0) == []
    with pytest.raises(ValueError, match=">= 0"):
        zoom_captions(scene, n=-2)
    with pytest.raises(ValueError, match="max_side must be >= 28 pixels, got 10"):
        zoom_captions(scene, n=1, max_side=10)
    # a small max_side shrinks every crop to it, the aspect kept
    small = zoom_captions(scene, n=3, seed=0, max_side=64)
    for d, ref in zip(small, dialogues):
        im, big = d[0]["content"][0]["image"], ref[0]["content"][0]["image"]
        assert max(im.size) == 64 and abs(im.size[0] / im.size[1] - big.size[0] / big.size[1]) < 0.05


def test_zoom_captions_ask_only_the_given_attributes():
    from mars.train.captions import zoom_captions
    from mars.world.questions import asked_attribute

    scene = WorldSpec().scene_config()
    for attrs in (("colour",), ("glyph",), ("shape", "pattern")):
        dialogues = zoom_captions(scene, n=12, seed=2, mcq_share=0.0, attributes=attrs, max_side=64)
        asked = {asked_attribute(u["content"][1]["text"]) for u, _ in dialogues}
        assert asked <= set(attrs) and len(asked) == len(attrs), (attrs, asked)
        for _, assistant in dialogues:  # an emblem without a glyph is drawn again, never asked about its letter
            assert parse_turn(assistant["content"]).answer not in ("", "None"), assistant["content"]
    with pytest.raises(ValueError, match="non-empty subset"):
        zoom_captions(scene, n=1, attributes=("size",))


def test_zoom_captions_name_only_the_scenes_scheme_fills():
    """sft.emblem_colours = world: with the world's colour schemes in the scene knobs the captions' new emblems are
    coloured as the world's, so their colour answers are the schemes' fills (two here), each drawn about as often."""
    from collections import Counter
    from dataclasses import replace

    from mars.train.captions import zoom_captions
    from mars.world.emblems import PALETTE

    scene = replace(WorldSpec().scene_config(), schemes=((PALETTE[2], PALETTE[13], None),
                                                         (PALETTE[9], PALETTE[14], PALETTE[6])))  # sky, maroon
    dialogues = zoom_captions(scene, n=40, seed=1, mcq_share=0.0, attributes=("colour",), max_side=64)
    counts = Counter(parse_turn(a["content"]).answer for _, a in dialogues)
    assert set(counts) == {"sky", "maroon"} and min(counts.values()) >= 12, counts  # 40 draws of 2
    free = zoom_captions(WorldSpec().scene_config(), n=40, seed=1, mcq_share=0.0, attributes=("colour",),
                         max_side=64)
    assert len({parse_turn(a["content"]).answer for _, a in free}) >= 10  # 40 draws of the palette's 16
