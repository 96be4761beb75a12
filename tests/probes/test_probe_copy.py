"""probes/probe_copy.py's pure parts: the three prompts of an answer turn and how a generated turn is scored."""

from __future__ import annotations

import importlib.util
import json

from PIL import Image

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("probe_copy", REPO / "probes" / "probe_copy.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)

OBS = "<tool_response>\n[1] Aster Guild: Founded by Ivo Brand in 1776.\n</tool_response>"
QUESTION = "Who founded the organisation with this emblem? Answer with the founder's full name."


def dialogue() -> list[dict]:
    img = Image.new("RGB", (8, 8))
    return [
        {"role": "system", "content": "SYSTEM"},
        {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": "<think>search</think>\n<tool_call>\n{}\n</tool_call>"},
        {"role": "user", "content": [{"type": "text", "text": OBS}, {"type": "image", "image": img}]},
        {"role": "assistant", "content": "<think>The snippet about Aster Guild gives Ivo Brand.</think>\n"
                                         "<answer>Ivo Brand</answer>"},
    ]


def test_contexts_keep_the_episode_drop_its_images_or_make_a_drill():
    d = dialogue()
    c = probe.contexts(d, QUESTION)
    assert set(c) == set(probe.CONTEXTS)
    assert c["episode"] == d[:-1]  # everything before the teacher's answer turn, images included
    assert [m["role"] for m in c["no images"]] == ["system", "user", "assistant", "user"]
    kinds = [p.get("type") for m in c["no images"] if isinstance(m["content"], list) for p in m["content"]]
    assert kinds == ["text", "text"]  # the two images left out, every text kept
    assert c["drill"] == [{"role": "user", "content": [{"type": "text", "text": f"{OBS}\n{QUESTION}"}]}]
    assert len(d[1]["content"]) == 2  # the teacher's dialogue itself is not changed


def test_score_judges_the_value_and_the_answers_form():
    open_q = {"answer": "Ivo Brand", "aliases": [], "choices": None}
    mc = {"answer": "1776", "aliases": ["B"], "choices": json.dumps({"A": "1650", "B": "1776", "C": "1800"})}
    right = "<think>The snippet about Aster Guild gives Ivo Brand.</think>\n<answer>Ivo Brand</answer>"
    assert probe.score(right, open_q) == (True, True, True)
    drift = "<think>The snippet about Aster Guild gives Ivo Brand.</think>\n<answer>Ivo Brant</answer>"
    assert probe.score(drift, open_q) == (False, True, True)  # the value was written, then copied wrong
    letter = "<think>The snippet about Aster Guild gives Ivo Brand. That is option B.</think>\n<answer>B</answer>"
    assert probe.score(letter, open_q) == (False, True, False)  # a letter for an open question
    assert probe.score("<think>gives 1776. That is option B.</think>\n<answer>B</answer>", mc) == (True, True, True)
    assert probe.score("<think>gives 1766.</think>\n<answer>1766</answer>", mc) == (False, False, False)
    assert probe.score("no tags at all", open_q) == (False, False, False)
