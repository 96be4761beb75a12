"""first_zoom_framed: which cell the first zoom on the scene chose, against the world's framed cell."""

from __future__ import annotations

import json

import pyarrow as pa

from mars.agent.protocol import format_answer, format_tool_call
from mars.eval.run import first_zoom_framed


def _row(qid: str, model: str, *turns: str) -> dict:
    msgs = [{"role": "user", "content": [{"type": "image", "ref": 0}, {"type": "text", "text": "?"}]}]
    msgs += [{"role": "assistant", "content": t} for t in turns]
    return {"question_id": qid, "model": model, "workflow": "agentic", "messages_json": json.dumps(msgs)}


def _zoom(box, img_idx: int = 0) -> str:
    return format_tool_call("image_zoom_in", {"bbox_2d": box, "label": "x", "img_idx": img_idx}, "look")


def test_first_zoom_on_the_scene_decides_and_misses_count():
    truth = {"s1": {"grid_rows": 2, "grid_cols": 2, "cell_row": 0, "cell_col": 1}}  # top right
    scene_of = {"q1": "s1", "q2": None}
    top_right, bottom_left = [650, 150, 850, 350], [150, 650, 350, 850]
    rows = [
        _row("q1", "a", _zoom(top_right), format_answer("x", "t")),  # hit
        _row("q1", "a", _zoom(bottom_left), _zoom(top_right)),  # the first zoom decides: miss
        _row("q1", "a", _zoom(top_right, img_idx=1)),  # a zoom on a crop, not the scene, then nothing: miss
        _row("q1", "a", "<think>x</think><tool_call>{bad json</tool_call>", _zoom(top_right)),  # malformed turn
        # is skipped, the next zoom counts: hit
        _row("q1", "a", _zoom([100, "left", 300, 400])),  # a malformed box is a miss, not a crash
        _row("q2", "a", _zoom(top_right)),  # no scene: not counted
        _row("q1", "b", format_answer("x", "t")),  # never zoomed: miss
    ]
    got = first_zoom_framed(pa.Table.from_pylist(rows), scene_of, truth)
    # run a: 2 hits of 5 scene episodes; run b: 0 of 1
    assert got == {"a/agentic": {"first_zoom_framed": 0.4, "scene_episodes": 5},
                   "b/agentic": {"first_zoom_framed": 0.0, "scene_episodes": 1}}
