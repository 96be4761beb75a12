"""perception_by_attribute: perception accuracy split by the emblem attribute a question asks about."""

from __future__ import annotations

import pyarrow as pa

from mars.eval.run import perception_by_attribute
from mars.world.questions import FRAMED_SUBJECT, PERCEPTION_QUESTIONS, asked_attribute


def _q(qid: str, qtype: str, text: str) -> dict:
    return {"question_id": qid, "type": qtype, "question": text}


def test_asked_attribute_reads_the_wording():
    for key, template in PERCEPTION_QUESTIONS.items():
        assert asked_attribute(template.format(subject=FRAMED_SUBJECT) + "\nA. x\nAnswer with the option's letter.") \
            == key
        assert asked_attribute(template.format(subject="this emblem")) == key  # the captions' subject
    assert asked_attribute("In which year was the organisation with this emblem founded? Answer with the "
                           "option's letter.") is None


def test_perception_accuracy_by_attribute_per_run():
    colour = PERCEPTION_QUESTIONS["colour"].format(subject=FRAMED_SUBJECT)
    shape = PERCEPTION_QUESTIONS["shape"].format(subject=FRAMED_SUBJECT)
    questions = {"c1": _q("c1", "perception", colour), "c2": _q("c2", "perception", colour + " Answer with one word."),
                 "s1": _q("s1", "perception", shape), "m1": _q("m1", "multi-hop", "Who founded the organisation?")}
    rows = [
        {"question_id": "c1", "model": "sft", "workflow": "agentic", "correct": True},
        {"question_id": "c2", "model": "sft", "workflow": "agentic", "correct": False},
        {"question_id": "s1", "model": "sft", "workflow": "agentic", "correct": True},
        {"question_id": "m1", "model": "sft", "workflow": "agentic", "correct": True},  # not perception: left out
        {"question_id": "zz", "model": "sft", "workflow": "agentic", "correct": True},  # unknown question: left out
        {"question_id": "c1", "model": "no-tool", "workflow": "direct", "correct": False},
        {"question_id": "m1", "model": "rl", "workflow": "agentic", "correct": True},  # no perception rows at all
    ]
    got = perception_by_attribute(pa.Table.from_pylist(rows), questions)
    # sft: colour 1 of 2, shape 1 of 1; no-tool: colour 0 of 1; rl has no perception episode
    assert got == {"sft/agentic": {"perception_by_attribute": {"colour": 0.5, "shape": 1.0}},
                   "no-tool/direct": {"perception_by_attribute": {"colour": 0.0}}}
