"""Tests of the reward function: golden values derived by hand (paper weights: answer 1.0, format 0.5)."""

from __future__ import annotations

import doctest
import math

import pytest

import mars.rl.rewards as rewards_mod
from mars.agent.protocol import format_answer, format_ok, format_tool_call, parse_turn
from mars.rl.rewards import RewardBreakdown, RewardWeights, compute_reward

CALL = parse_turn(format_tool_call("text_search", {"query": "Aster Guild"}, "search the name"))
ZOOM = parse_turn(format_tool_call("image_zoom_in", {"bbox_2d": [0, 0, 500, 500], "img_idx": 0}, "zoom"))
ANSWER = parse_turn(format_answer("1987", "the snippet says 1987"))
NO_THINK_CALL = parse_turn('<tool_call>{"name": "text_search", "arguments": {"query": "x"}}</tool_call>')
BAD_JSON = parse_turn('<think>a</think><tool_call>{"name": </tool_call>')
TRAILING_ANSWER = parse_turn("<think>a</think><answer>1987</answer> hope that helps")


def test_doctests():
    res = doctest.testmod(rewards_mod)
    assert res.attempted > 0 and res.failed == 0


def test_fixture_turns_are_what_they_claim():
    assert CALL.well_formed and ZOOM.well_formed and ANSWER.well_formed
    assert not NO_THINK_CALL.well_formed and not BAD_JSON.well_formed and not TRAILING_ANSWER.well_formed


@pytest.mark.parametrize(
    "turns,tool_errors,expected",
    [
        ([ZOOM, CALL, ANSWER], 0, True),  # all well formed, ends with an answer
        ([ANSWER], 0, True),  # answering directly is fine for the format reward
        ([ZOOM, CALL, ANSWER], 1, False),  # a model-caused tool error
        ([ZOOM, CALL], 0, False),  # no final answer (turn budget ran out)
        ([NO_THINK_CALL, ANSWER], 0, False),  # one turn without <think>
        ([BAD_JSON, ANSWER], 0, False),  # one tool call did not parse
        ([CALL, TRAILING_ANSWER], 0, False),  # the answer turn has text after it
        ([ANSWER, CALL], 0, False),  # the last turn is not the answer
        ([], 0, False),
    ],
)
def test_format_ok(turns, tool_errors, expected):
    assert format_ok(turns, tool_errors) is expected


@pytest.mark.parametrize(
    "correct,fmt,weights,golden",
    [
        # total = weights.answer * correct + weights.format * format_ok
        (True, True, RewardWeights(), (1.0, 0.5, 1.5)),  # 1.0*1 + 0.5*1 = 1.5
        (True, False, RewardWeights(), (1.0, 0.0, 1.0)),  # 1.0*1 + 0.5*0 = 1.0
        (False, True, RewardWeights(), (0.0, 0.5, 0.5)),  # 1.0*0 + 0.5*1 = 0.5
        (False, False, RewardWeights(), (0.0, 0.0, 0.0)),  # 0 + 0 = 0
        (True, True, RewardWeights(answer=2.0, format=0.25), (2.0, 0.25, 2.25)),  # 2*1 + 0.25*1 = 2.25
        (False, True, RewardWeights(answer=1.0, format=0.0), (0.0, 0.0, 0.0)),  # format reward switched off
    ],
)
def test_compute_reward_golden(correct, fmt, weights, golden):
    r = compute_reward(correct, fmt, weights)
    assert (r.answer, r.format, r.total) == pytest.approx(golden)
    assert r.correct is correct and r.well_formed is fmt
    assert isinstance(r, RewardBreakdown)


def test_end_to_end_episode_reward():
    # a 3-turn episode: zoom, search, answer; judged correct -> 1.0 + 0.5 = 1.5
    turns = [ZOOM, CALL, ANSWER]
    assert compute_reward(True, format_ok(turns, tool_errors=0)).total == 1.5
    # same episode but the answer turn is malformed -> 1.0 + 0 = 1.0
    assert compute_reward(True, format_ok([ZOOM, CALL, TRAILING_ANSWER], tool_errors=0)).total == 1.0


def test_weights_validated():
    with pytest.raises(ValueError):
        RewardWeights(answer=math.nan)
    with pytest.raises(ValueError):
        RewardWeights(format=math.inf)
