"""Localisation drills: new scenes whose red frame lies in the cell the teacher's zoom chooses."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from mars.agent.protocol import parse_turn
from mars.synth.locate import locate_dialogues, located_cell, zoom_cell, zooms_on_scene
from mars.world.generate import WorldSpec
from mars.world.scenes import CUE_COLOUR
from mars.world.questions import (ATTRIBUTES, FRAMED_SUBJECT, MULTIHOP_SUBJECT, PERCEPTION_QUESTIONS, asked_attribute,
                                  asked_attributes)


def _red_cell(image, rows: int, cols: int) -> tuple[int, int]:
    """The grid cell holding most pure-red (cue) pixels of a drawn scene."""
    a = np.asarray(image)
    red = np.all(a == np.array(CUE_COLOUR, dtype=a.dtype), axis=-1)  # [H, W]
    h, w = red.shape
    counts = {(r, c): int(red[r * h // rows:(r + 1) * h // rows, c * w // cols:(c + 1) * w // cols].sum())
              for r in range(rows) for c in range(cols)}
    return max(counts, key=counts.get)


def test_zoom_cell_reads_a_zoom_call_and_treats_anything_else_as_no_cell():
    from mars.agent.protocol import format_tool_call, parse_turn

    def cell(name, args):
        return zoom_cell(parse_turn(format_tool_call(name, args, "look")), 2, 2)

    assert cell("image_zoom_in", {"bbox_2d": [650, 150, 850, 350], "img_idx": 0}) == (0, 1)
    assert cell("image_zoom_in", {"bbox_2d": [650, 650, 850, 850]}) == (1, 1)  # img_idx defaults to 0
    assert cell("image_zoom_in", {"bbox_2d": [650, 650, 850, 850], "img_idx": 1}) is None  # a crop, not the scene
    assert cell("image_zoom_in", {"bbox_2d": [650, "x", 850, 850]}) is None  # malformed box: a miss
    assert cell("image_zoom_in", {"bbox_2d": [650]}) is None
    assert cell("image_zoom_in", {"img_idx": 0}) is None
    assert cell("text_search", {"query": "Larus Shipyard year"}) is None
    assert zoom_cell(parse_turn("<answer>C</answer>"), 2, 2) is None
    # a zoom on the scene even when its box is malformed (evaluate counts it as the first zoom, and a miss)
    assert zooms_on_scene(parse_turn(format_tool_call("image_zoom_in", {"bbox_2d": [650]}, "look")))
    assert not zooms_on_scene(parse_turn(format_tool_call("image_zoom_in", {"bbox_2d": [1, 2, 3, 4], "img_idx": 1},
                                                          "look")))
    assert not zooms_on_scene(parse_turn(format_tool_call("text_search", {"query": "x"}, "look")))


def test_located_cell_maps_zoom_centres_to_cells():
    # 2x2 grid on the 0..1000 grid: centre (250, 250) is the top-left cell, (750, 750) the bottom-right one,
    # (750, 250) is row 0, column 1; the edge 1000 stays in the last cell
    assert located_cell([149, 150, 351, 350], 2, 2) == (0, 0)
    assert located_cell([650, 650, 850, 850], 2, 2) == (1, 1)
    assert located_cell([650, 150, 850, 350], 2, 2) == (0, 1)
    assert located_cell([900, 900, 1000, 1000], 2, 2) == (1, 1)
    assert located_cell([0, 600, 300, 1000], 3, 3) == (2, 0)


# how each question template starts -> the word the zoom's think names it by (ATTRIBUTE_WORDS, FACT_WORDS)
_ASKED = {"What colour": "fill colour", "What shape": "shape", "Which letter": "letter", "Which pattern": "pattern",
          "In which year": "founding year", "In which city": "city", "Who founded": "founder"}


@pytest.mark.parametrize("rows,cols", [(2, 2), (3, 3)])
def test_drills_zoom_on_the_framed_cell(rows, cols):
    scene = WorldSpec(grid_rows=rows, grid_cols=cols).scene_config()
    drills = locate_dialogues(scene, n=24, seed=0, system="SYSTEM")
    assert len(drills) == 24
    cells = Counter()
    for system, user, assistant in drills:
        assert system == {"role": "system", "content": "SYSTEM"}
        image, question = user["content"][0]["image"], user["content"][1]["text"]
        assert max(image.size) in range(448, 673) and min(image.size) >= 224
        assert FRAMED_SUBJECT in question or MULTIHOP_SUBJECT in question
        turn = parse_turn(assistant["content"])
        assert turn.well_formed and turn.tool_name == "image_zoom_in", assistant["content"]
        # the think and the label name the plan by question type: answer what the zoom shows, or search for it
        perception = FRAMED_SUBJECT in question
        assert turn.arguments["img_idx"] == 0
        assert turn.arguments["label"] == ("framed region" if perception else "emblem to search")
        assert ("search" in turn.think) != perception, assistant["content"]
        asked = next(w for start, w in _ASKED.items() if question.startswith(start))
        assert asked in turn.think, (question, turn.think)
        box = turn.arguments["bbox_2d"]
        cell = located_cell(box, rows, cols)
        assert cell == _red_cell(image, rows, cols)
        # the zoom is the cell's central target_zone share (0.4 by default): 1000/cols * 0.4 wide, up to a pixel of
        # rounding at each end and the floor/ceil to the grid (one pixel of a 448-px side is 2.2 units): <= 8
        assert abs((box[2] - box[0]) - 1000 / cols * scene.target_zone) <= 8
        cells[cell] += 1
    assert len(cells) >= min(4, rows * cols) - 1  # the framed cell varies (24 draws over 4 or 9 cells)
    kinds = Counter(FRAMED_SUBJECT in u["content"][1]["text"] for _, u, _ in drills)
    assert kinds[True] >= 4 and kinds[False] >= 4  # perception and multi-hop wordings both occur


def test_drills_are_seeded_new_scenes_and_fail_clearly():
    scene = WorldSpec().scene_config()
    a = locate_dialogues(scene, n=4, seed=3)
    b = locate_dialogues(scene, n=4, seed=3)
    c = locate_dialogues(scene, n=4, seed=4)
    pixels = lambda ds: [np.asarray(d[0]["content"][0]["image"]).tobytes() for d in ds]  # noqa: E731
    assert pixels(a) == pixels(b) and pixels(a) != pixels(c)
    assert len(set(pixels(a))) == 4  # every drill draws a new scene
    assert a[0][0]["role"] == "user"  # no system prompt unless given
    assert locate_dialogues(scene, n=0) == []
    with pytest.raises(ValueError, match=">= 0"):
        locate_dialogues(scene, n=-1)
    with pytest.raises(ValueError, match="mcq_share"):
        locate_dialogues(scene, n=1, mcq_share=1.5)


def test_drills_ask_only_the_given_attributes():
    """The perception drills ask what the synthesized questions ask (sft passes asked_attributes of its questions)."""
    scene = WorldSpec().scene_config()
    rows = [{"type": "perception", "question": PERCEPTION_QUESTIONS[a].format(subject=FRAMED_SUBJECT)}
            for a in ("glyph", "shape", "glyph")] + [{"type": "search", "question": "Which city is it in?"}]
    assert asked_attributes(rows) == ("shape", "glyph")  # ATTRIBUTES order, each once
    assert asked_attributes(rows[3:]) is None
    drills = locate_dialogues(scene, n=40, seed=1, perception_share=1.0, attributes=asked_attributes(rows))
    asked = Counter(asked_attribute(u["content"][1]["text"]) for u, _ in drills)
    assert set(asked) == {"shape", "glyph"} and min(asked.values()) >= 10, asked  # 40 draws over 2 attributes
    everything = locate_dialogues(scene, n=40, seed=1, perception_share=1.0)
    assert set(Counter(asked_attribute(u["content"][1]["text"]) for u, _ in everything)) == set(ATTRIBUTES)
    for bad in ((), ("colour", "size")):
        with pytest.raises(ValueError, match="non-empty subset"):
            locate_dialogues(scene, n=1, attributes=bad)
