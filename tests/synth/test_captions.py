"""Gallery captions (the vision warm-up of the SFT mix): right answers, both formats, held-out entities never used."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from PIL import Image

from mars.agent.protocol import parse_turn
from mars.synth.captions import caption_dialogues
from mars.world.generate import WorldSpec, generate_world
from mars.world.emblems import COLOUR_NAMES


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("captions")
    tables = generate_world(WorldSpec.smoke(n_scenes=0, planted=False), root / "raw", root / "gallery", progress=False)
    gallery = tables.gallery.to_pylist()
    entities = tables.entities.to_pylist()
    by_pixels = {}
    for r in gallery:
        with Image.open(root / "gallery" / r["path"]) as im:
            by_pixels[hashlib.sha1(np.asarray(im.convert("RGB")).tobytes()).hexdigest()] = r["entity_id"]
    return root, gallery, entities, by_pixels


def _entity(image: Image.Image, by_pixels: dict) -> str:
    return by_pixels[hashlib.sha1(np.asarray(image).tobytes()).hexdigest()]


def test_captions_ask_about_the_rendered_emblem_and_answer_right(world):
    root, gallery, entities, by_pixels = world
    specs = {e["entity_id"]: json.loads(e["emblem"]) for e in entities if e["emblem"]}
    held_out = sorted(specs)[:3]
    dialogues = caption_dialogues(gallery, entities, root / "gallery", n=60, seed=0, exclude_entities=held_out)
    assert len(dialogues) == 60
    seen_attrs, n_mcq = set(), 0
    for user, assistant in dialogues:
        assert user["role"] == "user" and assistant["role"] == "assistant"
        image, text = user["content"][0]["image"], user["content"][1]["text"]
        ent = _entity(image, by_pixels)
        assert ent not in held_out
        turn = parse_turn(assistant["content"])
        assert turn.action == "answer" and turn.well_formed
        attr = ("colour" if text.startswith("What colour") else "shape" if text.startswith("What shape")
                else "glyph" if text.startswith("Which letter") else "pattern")
        assert "this emblem" in text and "red frame" not in text
        seen_attrs.add(attr)
        truth = COLOUR_NAMES[specs[ent]["fill"]] if attr == "colour" else str(specs[ent][attr])
        if "\nA. " in text:  # multiple choice: the answer is the letter of the true value
            n_mcq += 1
            options = dict(line.split(". ", 1) for line in text.splitlines()[1:5])
            assert options[turn.answer] == truth
        else:
            assert turn.answer == truth
    assert seen_attrs == {"colour", "shape", "glyph", "pattern"}
    assert 15 <= n_mcq <= 45  # mcq_share 0.5 of 60
    # every eligible rendering is used once before any repeats
    used = [_entity(u["content"][0]["image"], by_pixels) for u, _ in dialogues]
    eligible = [r for r in gallery if r["entity_id"] not in held_out and r["entity_id"] in specs]
    assert len(set(map(id, (u["content"][0]["image"] for u, _ in dialogues)))) == min(60, len(eligible))
    assert set(used) <= {r["entity_id"] for r in eligible}


def test_captions_are_seeded_and_fail_clearly(world):
    root, gallery, entities, _ = world
    a = caption_dialogues(gallery, entities, root / "gallery", n=10, seed=1)
    b = caption_dialogues(gallery, entities, root / "gallery", n=10, seed=1)
    c = caption_dialogues(gallery, entities, root / "gallery", n=10, seed=2)
    texts = lambda ds: [(u["content"][1]["text"], x["content"]) for u, x in ds]  # noqa: E731
    assert texts(a) == texts(b) and texts(a) != texts(c)
    assert caption_dialogues(gallery, entities, root / "gallery", n=0) == []
    with pytest.raises(ValueError, match="no gallery rendering left"):
        caption_dialogues(gallery, entities, root / "gallery", n=5, exclude_entities={e["entity_id"] for e in entities})
    with pytest.raises(ValueError, match=">= 0"):
        caption_dialogues(gallery, entities, root / "gallery", n=-1)


def test_zoom_captions_show_a_new_emblem_at_the_zooms_scale():
    from mars.synth.captions import ZOOM_LONG_SIDE, zoom_captions
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
    from mars.synth.captions import zoom_captions
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

    from mars.synth.captions import zoom_captions
    from mars.world.emblems import PALETTE

    scene = replace(WorldSpec().scene_config(), schemes=((PALETTE[2], PALETTE[13], None),
                                                         (PALETTE[9], PALETTE[14], PALETTE[6])))  # sky, maroon
    dialogues = zoom_captions(scene, n=40, seed=1, mcq_share=0.0, attributes=("colour",), max_side=64)
    counts = Counter(parse_turn(a["content"]).answer for _, a in dialogues)
    assert set(counts) == {"sky", "maroon"} and min(counts.values()) >= 12, counts  # 40 draws of 2
    free = zoom_captions(WorldSpec().scene_config(), n=40, seed=1, mcq_share=0.0, attributes=("colour",),
                         max_side=64)
    assert len({parse_turn(a["content"]).answer for _, a in free}) >= 10  # 40 draws of the palette's 16
