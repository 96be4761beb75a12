"""answer_form: accuracy split into open and multiple-choice questions, and the share answered with a bare letter."""

from __future__ import annotations

import json

import pyarrow as pa

from mars.eval.run import answer_form

CHOICES = json.dumps({"A": "1849", "B": "1711", "C": "1776", "D": "1772"})
QUESTIONS = {"o1": {"choices": None, "answer": "1776"}, "o2": {"choices": "", "answer": "Stirex"},
             "o3": {"choices": None, "answer": "Deci Quominol"}, "g1": {"choices": None, "answer": "K"},
             "c1": {"choices": CHOICES, "answer": "1776"}, "c2": {"choices": CHOICES, "answer": "1711"}}


def _row(qid: str, model: str, prediction: str | None, correct: bool, workflow: str = "agentic") -> dict:
    return {"question_id": qid, "model": model, "workflow": workflow, "prediction": prediction, "correct": correct}


def test_open_and_choice_accuracy_and_letter_shares_per_run():
    rows = [
        _row("o1", "sft", "1776", True),
        _row("o2", "sft", "C", False),  # a letter for an open question: always wrong
        _row("o3", "sft", None, False),  # no answer at all: neither right nor a letter
        _row("g1", "sft", "K", True),  # a glyph question: its letter answer is the value, not an option letter
        _row("c1", "sft", "(C)", True),  # a letter, right
        _row("c2", "sft", "B.", False),  # a letter, wrong
        _row("c1", "no-tool", "A", False, "direct"),
        _row("zz", "sft", "A", True),  # not a pipeline question (a benchmark's): left out
    ]
    got = answer_form(pa.Table.from_pylist(rows), QUESTIONS)
    # sft: open 2 right of 4 ("" choices counts as open); of the 3 open questions whose answer is not a letter, one
    # answered with a letter; choice 1 of 2, both letters; no-tool has only a choice question: no open keys
    assert got == {
        "sft/agentic": {"by_form": {"choice": 0.5, "open": 0.5}, "letter_on_choice": 1.0, "letter_on_open": 0.3333},
        "no-tool/direct": {"by_form": {"choice": 0.0}, "letter_on_choice": 1.0},
    }
    # a run whose open questions are all glyph questions has no letter_on_open share
    glyph = answer_form(pa.Table.from_pylist([_row("g1", "rl", "K", True)]), QUESTIONS)
    assert glyph == {"rl/agentic": {"by_form": {"open": 1.0}}}


def test_a_value_or_a_sentence_is_not_a_letter():
    rows = [_row("c1", "rl", p, False) for p in ("1776", "C 1776", "Answer: C", "AB", "E", "")]
    # only a whole answer that is one option letter A-D, as the rule judge reads it, counts
    assert answer_form(pa.Table.from_pylist(rows), QUESTIONS)["rl/agentic"]["letter_on_choice"] == 0.0
    rows = [_row("c1", "rl", p, False) for p in ("c", " [D] ", "(a).", "1772")]
    assert answer_form(pa.Table.from_pylist(rows), QUESTIONS)["rl/agentic"]["letter_on_choice"] == 0.75
