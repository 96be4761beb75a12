"""Localisation drills: new scenes whose red frame lies in the cell the teacher's zoom chooses."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from mars.agent.protocol import parse_turn
from mars.train.locate import locate_dialogues, located_cell, zoom_cell, zooms_on_scene
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


def test_answered_drills_are_whole_perception_episodes_about_the_target():
    """sft.locate_answers: a perception drill goes on to the zoom's observation, worded as the real zoom tool words
    it, with a crop of the framed emblem, and the teacher's answer: the value its think states, shown in the crop."""
    from mars.agent.config import AgentParams
    from mars.tools.toolbox import ToolBox
    from mars.world.emblems import COLOUR_NAMES

    scene = WorldSpec().scene_config()
    plain = locate_dialogues(scene, n=24, seed=5, system="S")
    drills = locate_dialogues(scene, n=24, seed=5, system="S", answer_share=1.0)
    pixels = lambda ds: [np.asarray(d[1]["content"][0]["image"]).tobytes() for d in ds]  # noqa: E731
    assert pixels(drills) == pixels(plain)  # the same scenes: the answers draw from a stream of their own
    tools = ToolBox(None, None, None, AgentParams().tools())  # the zoom needs no index
    answered = 0
    for d, p in zip(drills, plain):
        question = d[1]["content"][1]["text"]
        if MULTIHOP_SUBJECT in question:
            assert d == p  # a multi-hop drill stops at its zoom
            continue
        answered += 1
        assert [m["role"] for m in d] == ["system", "user", "assistant", "user", "assistant"]
        zoom = parse_turn(d[2]["content"])
        # the observation text is what the zoom tool writes for this call on this scene
        obs = tools.call("image_zoom_in", zoom.arguments, [d[1]["content"][0]["image"]])
        assert obs.error is None
        assert d[3]["content"][0]["text"] == f"<tool_response>\n{obs.text}\n</tool_response>"
        crop = d[3]["content"][1]["image"]
        assert max(crop.size) <= 448
        attr = asked_attribute(question)
        reply = parse_turn(d[4]["content"])
        assert reply.action == "answer" and reply.well_formed
        value = re.search(r"(?:: | is )(\w+)\.", reply.think).group(1)  # the value the teacher's think states
        if "\nA. " in question:  # multiple choice: the letter of the value stated in the think
            letter = reply.answer
            assert f"\n{letter}. {value}\n" in question and f"That is option {letter}." in reply.think
        else:
            assert reply.answer == value
        if attr == "colour":  # the crop shows the stated fill colour
            rgb = {v: k for k, v in COLOUR_NAMES.items()}[value]  # "#rrggbb"
            target = tuple(int(rgb[i:i + 2], 16) for i in (1, 3, 5))
            assert (np.abs(np.asarray(crop).astype(int) - target).sum(-1) < 30).sum() > 20
    assert answered >= 6
    with pytest.raises(ValueError, match="answer_share"):
        locate_dialogues(scene, n=1, answer_share=2.0)


def test_held_out_reads_end_at_the_crop_and_keep_the_teachers_answer():
    """probes/probe_block.py --read: n answered perception drills cut before the answer, with the answer kept."""
    from mars.train.locate import held_out_reads

    scene = WorldSpec().scene_config()
    prompts, answers = held_out_reads(scene, 10, seed=7, system="S", attributes=["colour", "glyph"])
    assert len(prompts) == len(answers) == 10
    full = [d for d in locate_dialogues(scene, n=10, seed=7, system="S", attributes=["colour", "glyph"],
                                        perception_share=1.0, answer_share=1.0) if len(d) == 5]
    assert [p for p in prompts[:len(full)]] == [d[:-1] for d in full]  # the same draw, cut before the answer
    for p, a in zip(prompts, answers):
        assert [m["role"] for m in p] == ["system", "user", "assistant", "user"]
        assert p[-1]["content"][1]["type"] == "image"  # the crop is in the prompt
        assert asked_attribute(p[1]["content"][1]["text"]) in ("colour", "glyph")
        assert a in ATTRIBUTES["colour"] or a in ATTRIBUTES["glyph"] or a in "ABCD"


def test_held_out_reads_with_mcq_share_zero_ask_open_questions_only():
    """The localisation check's reads (``mcq_share`` 0): every answer is the value read from the crop, never an
    option's letter; the default mixes both forms."""
    from mars.train.locate import held_out_reads

    scene = WorldSpec().scene_config()
    _, open_answers = held_out_reads(scene, 12, seed=7, system="S", attributes=["colour"], mcq_share=0.0)
    assert len(open_answers) == 12 and all(a in ATTRIBUTES["colour"] for a in open_answers)
    _, mixed = held_out_reads(scene, 12, seed=7, system="S", attributes=["colour"])
    assert any(a in "ABCD" for a in mixed) and any(a in ATTRIBUTES["colour"] for a in mixed)


def test_drills_and_their_reads_colour_new_emblems_with_the_scenes_schemes():
    """sft.emblem_colours = world: with the world's colour schemes in the scene knobs, every emblem a drill draws
    (the framed target and the clutter around it) is coloured with one of them, and the open colour reads the block's
    check asks name only their fills; without schemes the drills draw the whole palette."""
    from dataclasses import replace

    from mars.train.captions import zoom_crop
    from mars.train.locate import held_out_reads
    from mars.world.emblems import COLOUR_NAMES, PALETTE

    # navy on white; yellow on black with purple
    schemes = ((PALETTE[0], PALETTE[14], None), (PALETTE[6], PALETTE[13], PALETTE[10]))
    scene = replace(WorldSpec().scene_config(), schemes=schemes)
    _, answers = held_out_reads(scene, 24, seed=3, system="S", attributes=["colour"], mcq_share=0.0)
    assert set(answers) == {"navy", "yellow"}, Counter(answers)
    # the answered drills' crops draw their target with zoom_crop on the same scene: a fresh emblem is a scheme's
    for i in range(20):
        _, spec = zoom_crop(scene, np.random.default_rng([9, i]), max_side=64)
        assert (spec["fill"], spec["border"], spec["accent"]) in schemes
    _, palette = held_out_reads(WorldSpec().scene_config(), 24, seed=3, system="S", attributes=["colour"],
                                mcq_share=0.0)
    assert len(set(palette)) >= 8 and set(palette) <= set(COLOUR_NAMES.values())  # 24 draws of 16 colours
    # the scenes' clutter too: a drawn scene holds the framed emblem and others, all in the schemes' colours, so no
    # pixel of the palette's other strong colours (gold, orange, green) is drawn at emblem size
    drills = locate_dialogues(scene, n=6, seed=4, perception_share=0.0)
    for d in drills:
        a = np.asarray(d[0]["content"][0]["image"].convert("RGB")).astype(int)
        for name in ("gold", "orange", "green"):
            rgb = {v: k for k, v in COLOUR_NAMES.items()}[name]
            target = np.array([int(rgb[i:i + 2], 16) for i in (1, 3, 5)])
            assert (np.abs(a - target).sum(-1) < 12).sum() < 20, name
