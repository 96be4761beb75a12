"""Tests of the turn protocol: formatters, the tolerant parser, every error code, and a seeded fuzz run."""

from __future__ import annotations

import doctest
import json
import math
import random
import re

import pytest

import mars.agent.protocol as protocol
from mars.agent.protocol import (
    ERROR_CODES,
    TOOL_NAMES,
    FormatError,
    ParsedTurn,
    format_answer,
    format_error_observation,
    format_tool_call,
    format_tool_response,
    parse_turn,
    system_prompt,
)


def codes(t: ParsedTurn) -> set[str]:
    return {e.code for e in t.errors}


def test_doctests():
    res = doctest.testmod(protocol)
    assert res.attempted > 0 and res.failed == 0


# ------------------------------------------------------------------------------------------- round trips

ROUND_TRIP_CALLS = [
    ("image_zoom_in", {"bbox_2d": [10, 20, 500, 640], "label": "the red frame", "img_idx": 0}),
    ("image_search", {"img_idx": 2}),
    ("text_search", {"query": "Aster Guild founding year"}),
    ("text_search", {"query": "unicode: Zürich 東京 \u00e9\u0301 🚀 and \"quotes\" and \\ backslash"}),
    ("text_search", {"query": "tags as data: <answer>x</answer> <think> </tool_call> <tool_call>"}),
    ("text_search", {"query": "", "nested": {"a": [1, 2.5, None, True, {"b": -3e-5}], "big": 10**300}}),
    ("image_search", {}),
]


@pytest.mark.parametrize("name,args", ROUND_TRIP_CALLS)
def test_tool_call_round_trip(name, args):
    text = format_tool_call(name, args, "I should look closer.\nSecond line.")
    t = parse_turn(text)
    assert t.well_formed, t.errors
    assert (t.action, t.tool_name, t.arguments, t.answer) == ("tool_call", name, args, None)
    assert t.think == "I should look closer.\nSecond line."


@pytest.mark.parametrize("answer", ["1987", "Paris", "B", "the Aster Guild, founded by Ada Lovelace", "42 km²", "東京"])
def test_answer_round_trip(answer):
    t = parse_turn(format_answer(answer, "The snippet says so."))
    assert t.well_formed, t.errors
    assert (t.action, t.answer, t.tool_name, t.arguments, t.think) == ("answer", answer, None, None, "The snippet says so.")


def test_formatters_reject_what_would_not_round_trip():
    with pytest.raises(ValueError):
        format_answer("x </answer> y", "t")
    with pytest.raises(ValueError):
        format_answer("  ", "t")
    with pytest.raises(ValueError):
        format_tool_call("text_search", {"query": "q"}, "thinking <answer>")
    with pytest.raises(ValueError):
        format_tool_call("text_search", {"x": float("nan")}, "t")
    with pytest.raises(ValueError):
        format_tool_response("x", n_images=-1)


def test_empty_think_is_allowed():
    t = parse_turn("<think></think><answer>x</answer>")
    assert t.well_formed and t.think == ""


def test_tolerated_variants():
    # whitespace around blocks, a fenced JSON payload, arguments sent as a JSON string (OpenAI style)
    fenced = '\n <think>a</think>\n\n<tool_call>\n```json\n{"name": "image_search", "arguments": {"img_idx": 1}}\n```\n</tool_call>\n '
    t = parse_turn(fenced)
    assert t.well_formed and t.arguments == {"img_idx": 1}
    as_string = '<think>a</think><tool_call>{"name": "text_search", "arguments": "{\\"query\\": \\"q\\"}"}</tool_call>'
    t = parse_turn(as_string)
    assert t.well_formed and t.arguments == {"query": "q"}
    no_args = '<think>a</think><tool_call>{"name": "image_search"}</tool_call>'
    t = parse_turn(no_args)
    assert t.well_formed and t.arguments == {}


def test_tool_names_argument():
    text = format_tool_call("calculator", {"expr": "1+1"}, "t")
    assert codes(parse_turn(text)) == {"unknown_tool"}
    t = parse_turn(text, tool_names=["calculator"])
    assert t.well_formed and t.tool_name == "calculator"


def test_tool_response_and_error_observation():
    assert format_tool_response("hello", n_images=2) == "<tool_response>\nhello\n</tool_response>"
    errs = parse_turn('<answer>x</answer> trailing').errors
    obs = format_error_observation(errs)
    assert obs.startswith("<tool_response>") and obs.endswith("</tool_response>")
    for e in errs:
        assert f"- {e.code}: {e.message}" in obs
    assert "<think>" in obs and "<tool_call>" in obs and "<answer>" in obs
    # the observation itself is not a parseable action (a model echoing it gets no credit)
    assert not parse_turn(obs).well_formed


def test_system_prompt_renders_tools_one_json_per_line():
    schemas = [
        {
            "type": "function",
            "function": {
                "name": n,
                "description": f"The {n} tool.",
                "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
            },
        }
        for n in TOOL_NAMES
    ]
    p = system_prompt(schemas)
    block = p.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    lines = block.split("\n")
    assert [json.loads(line) for line in lines] == schemas
    assert "<think>" in p and "<answer>" in p and "<tool_call>" in p and "<tool_response>" in p
    # a bare function dict is wrapped into OpenAI format
    assert json.loads(system_prompt([schemas[0]["function"]]).split("<tools>\n")[1].split("\n</tools>")[0]) == schemas[0]
    with pytest.raises(ValueError):
        system_prompt([{"type": "function", "function": {"description": "no name"}}])


# ------------------------------------------------------------------------------------------- error codes

GOOD_CALL = '{"name": "text_search", "arguments": {"query": "q"}}'
ERROR_CASES = {
    "empty": (" \n\t ", {"empty"}),
    "no_action": ("<think>hmm, I am not sure</think>", {"no_action"}),
    "missing_think": ("<answer>1987</answer>", {"missing_think"}),
    "unclosed_tag": ("<think>a</think><answer>1987", {"unclosed_tag"}),
    "bad_json": ('<think>a</think><tool_call>{"name": "text_search", "arguments": {"query": }}</tool_call>', {"bad_json"}),
    "not_an_object": ('<think>a</think><tool_call>["text_search", {"query": "q"}]</tool_call>', {"not_an_object"}),
    "missing_name": ('<think>a</think><tool_call>{"arguments": {"query": "q"}}</tool_call>', {"missing_name"}),
    "unknown_tool": ('<think>a</think><tool_call>{"name": "web_browse", "arguments": {}}</tool_call>', {"unknown_tool"}),
    "bad_arguments": ('<think>a</think><tool_call>{"name": "text_search", "arguments": ["q"]}</tool_call>', {"bad_arguments"}),
    "multiple_actions": (f"<think>a</think><tool_call>{GOOD_CALL}</tool_call>\n<answer>x</answer>", {"multiple_actions"}),
    "empty_answer": ("<think>a</think><answer>   </answer>", {"empty_answer"}),
    "text_after_action": ("<think>a</think><answer>x</answer> I hope this helps!", {"text_after_action"}),
    "nested_tag": ("<think>a</think><answer>x <think>y</think></answer>", {"nested_tag"}),
    "stray_text": ("Sure! <think>a</think><answer>x</answer>", {"stray_text"}),
}


def test_every_code_has_a_case():
    assert set(ERROR_CASES) == set(ERROR_CODES)


@pytest.mark.parametrize("code", sorted(ERROR_CASES))
def test_each_error_code(code):
    text, expected = ERROR_CASES[code]
    t = parse_turn(text)
    assert codes(t) == expected, t.errors
    assert not t.well_formed
    assert all(isinstance(e, FormatError) and e.message for e in t.errors)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("hello", {"missing_think", "no_action"}),
        ("<think>a</think><tool_call>{}</tool_call>", {"missing_name"}),
        ('<think>a</think><tool_call>{"name": 3}</tool_call>', {"missing_name"}),
        ('<think>a</think><tool_call>{"name": "text_search", "arguments": "not json"}</tool_call>', {"bad_arguments"}),
        ('<think>a</think><tool_call>{"name": "text_search", "arguments": "[1]"}</tool_call>', {"bad_arguments"}),
        ('<think>a</think><tool_call>{"name": "text_search", "arguments": {"x": NaN}}</tool_call>', {"bad_json"}),
        ('<think>a</think><tool_call>{"name": "text_search", "arguments": {"x": 1e400}}</tool_call>', {"bad_json"}),
        ('<think>a</think><tool_call>{"name": "text_search", "arguments": {"x": -Infinity}}</tool_call>', {"bad_json"}),
        (f"<think>a</think><tool_call>{GOOD_CALL}</tool_call><tool_call>{GOOD_CALL}</tool_call>", {"multiple_actions"}),
        (f"<think>a</think><tool_call>{GOOD_CALL}</tool_call>\n<tool_response>fake</tool_response>", {"text_after_action"}),
        ("<think>a</think></think><answer>x</answer>", {"unclosed_tag"}),
        ("<think>a</think><think>b</think><answer>x</answer>", {"nested_tag"}),
        ("<think>a</think> so: <answer>x</answer>", {"stray_text"}),
        ("<think>a <answer>x</answer>", {"nested_tag", "unclosed_tag"}),
        ("<think>a</think><answer>x</answer><answer>y</answer> z", {"multiple_actions", "text_after_action"}),
    ],
)
def test_more_malformations(text, expected):
    assert codes(parse_turn(text)) == expected


def test_first_complete_tool_call_from_messy_text():
    messy = (
        "Let me think. <think>I will search the gallery first</think>\n"
        "OK here goes: <tool_call> {\"name\": \"image_search\", \"arguments\": {\"img_idx\": 1}} </tool_call>"
        " and then <tool_call>{\"name\": \"text_search\", \"arguments\": {\"query\": \"b\"}}</tool_call> blah </answer>"
    )
    t = parse_turn(messy)
    assert (t.action, t.tool_name, t.arguments) == ("tool_call", "image_search", {"img_idx": 1})
    assert t.think == "I will search the gallery first"
    assert codes(t) == {"stray_text", "multiple_actions", "text_after_action", "unclosed_tag"}

    # the think is never closed and the call sits inside it: still extracted, both problems reported
    t = parse_turn('<think>zoom on the frame <tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [0, 0, 500, 500]}}</tool_call>')
    assert (t.action, t.tool_name, t.arguments) == ("tool_call", "image_zoom_in", {"bbox_2d": [0, 0, 500, 500]})
    assert codes(t) == {"nested_tag", "unclosed_tag"}

    # trailing garbage after the JSON object inside the tag: the object is still extracted, but it is bad_json
    t = parse_turn(f"<think>a</think><tool_call>{GOOD_CALL} oops}}</tool_call>")
    assert (t.action, t.arguments, codes(t)) == ("tool_call", {"query": "q"}, {"bad_json"})

    # a truncated turn (no closing tag, e.g. cut by a stop sequence) still yields the call, flagged unclosed
    t = parse_turn(f"<think>a</think><tool_call>{GOOD_CALL}")
    assert (t.action, t.tool_name, codes(t)) == ("tool_call", "text_search", {"unclosed_tag"})


def test_non_string_and_weird_inputs():
    for x in [None, 123, b"<answer>x</answer>", "\x00\x01\x02", "\ud800<answer>\udfff</answer>", "<" * 10, "</" * 10]:
        t = parse_turn(x)  # type: ignore[arg-type]
        assert isinstance(t, ParsedTurn) and not t.well_formed and t.errors


# ------------------------------------------------------------------------------------------- fuzz

_TAG = re.compile(r"</?(?:think|tool_call|answer)>")


def _strict_json(s: str):
    def bad(x):
        raise ValueError(x)

    def flt(x):
        v = float(x)
        if not math.isfinite(v):
            raise ValueError(x)
        return v

    return json.loads(s, parse_constant=bad, parse_float=flt)


def oracle_valid(text: str) -> bool:
    """An independent, strict statement of the protocol (anchored regex + JSON checks), for small strings."""
    m = re.fullmatch(r"\s*<think>(.*?)</think>\s*(?:<tool_call>(.*?)</tool_call>|<answer>(.*?)</answer>)\s*", text, re.S)
    if not m:
        return False
    think, call, answer = m.groups()
    if _TAG.search(think):
        return False
    if answer is not None:
        return bool(answer.strip()) and not _TAG.search(answer)
    if "</tool_call>" in call:
        return False
    body = call.strip()
    fence = re.fullmatch(r"```[A-Za-z0-9_-]*[ \t]*\n?(.*?)\n?[ \t]*```", body, re.S)
    if fence:
        body = fence.group(1).strip()
    try:
        obj = _strict_json(body)
    except (ValueError, RecursionError):
        return False
    if not isinstance(obj, dict) or obj.get("name") not in TOOL_NAMES:
        return False
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = _strict_json(args.strip())
        except (ValueError, RecursionError):
            return False
    return isinstance(args, dict)


FRAGMENTS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<answer>", "</answer>", "<tool_response>", "</tool_response>",
    "<Think>", "< answer>", "<answer", "answer>", "{", "}", "[", "]", '"', "\\", ":", ",", "NaN", "Infinity", "-Infinity",
    "1e400", "-1e400", str(10**400), "10**400", "null", "true", '"name"', '"arguments"', '"text_search"',
    '"image_zoom_in"', '"image_search"', '"bogus_tool"', "```json\n", "```", "\n", " ", "\t", "\x00", "\x1b[31m",
    "\u202e", "\ufeff", "東京", "🚀", "é", "\ud83d", "Answer: B", "1987", "\\u003c/tool_call>", '{"a":' * 5,
]


def _random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([0, -7, 2.5, 10**30, True, None, "", "q", "東京 🚀", "</answer>", "<think>x"])
    if r < 0.65:
        return {rng.choice(["query", "img_idx", "bbox_2d", "label", "k", ""]): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def _valid_turn(rng: random.Random) -> str:
    think = "".join(rng.choice(["look", " ", "zoom", "東京", "🚀", "\n", "1.5", "{", "}", '"', "a"]) for _ in range(rng.randint(0, 12)))
    if rng.random() < 0.5:
        args = _random_value(rng)
        args = args if isinstance(args, dict) else {"x": args}
        return format_tool_call(rng.choice(TOOL_NAMES), args, think)
    ans = rng.choice(["1987", "Paris", "B", "the Aster Guild", "42 km²", "x" * rng.randint(1, 50)])
    return format_answer(ans, think)


def _mutate(rng: random.Random, s: str) -> str:
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        i = rng.randint(0, len(s))
        j = min(len(s), i + rng.randint(1, 20))
        if op == 0:
            s = s[:i] + s[j:]
        elif op == 1:
            s = s[:i] + rng.choice(FRAGMENTS) + s[i:]
        elif op == 2:
            s = s[:i]
        elif op == 3:
            s = s + rng.choice(["", " ", "\n"]) + rng.choice([_valid_turn(rng), rng.choice(FRAGMENTS)])
        elif op == 4:
            s = s[:i] + s[i:j].upper() + s[j:]
        else:
            s = s[:i] + s[i:j] * rng.randint(2, 5) + s[j:]
    return s


def _random_soup(rng: random.Random) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40)))


ADVERSARIAL = [
    "[" * 100_000,
    "{" * 100_000,
    '<think>a</think><tool_call>' + "[" * 100_000 + "</tool_call>",
    '<think>a</think><tool_call>{"name": "text_search", "arguments": {"q": ' + "[" * 100_000 + "}}</tool_call>",
    '<think>a</think><tool_call>{"name": "text_search", "arguments": "' + "[" * 100_000 + '"}</tool_call>',
    '<think>a</think><tool_call>{"name": "text_search", "arguments": {"x": ' + str(10**400) + "}}</tool_call>",
    '<think>a</think><tool_call>{"name": "text_search", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>",
    "<think>" * 150_000,
    "</think>" * 120_000,
    "<tool_call>{" * 90_000,
    "<answer>" * 120_000 + "</answer>",
    "<think></think><answer>" + "x" * 1_000_000 + "</answer>",
    "<think>" + "y" * 1_000_000 + "</think><answer>z</answer>",
    "<think></think><tool_call>" + '{"name": "' + "a" * 1_000_000,
    "<" * 1_000_000,
    "<think></think><answer>" + "<thin" * 200_000,
    '{"a":' * 200_000,
    '"' * 1_000_000,
    "\x00" * 1_000_000,
    "🚀" * 300_000,
    "<think>a</think>" + "<tool_call></tool_call>" * 40_000,
    "<think>a</think><answer>x</answer>" + " " * 1_000_000,
]


def test_fuzz_never_raises_and_flags_every_invalid_turn():
    rng = random.Random(20240611)
    inputs: list[tuple[str, str]] = []
    for _ in range(400):
        inputs.append(("valid", _valid_turn(rng)))
    for _ in range(700):
        inputs.append(("mutated", _mutate(rng, _valid_turn(rng))))
    for _ in range(300):
        inputs.append(("soup", _random_soup(rng)))
    for _ in range(100):
        inputs.append(("bytes", "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randint(0, 200)))))
    inputs += [("adversarial", s) for s in ADVERSARIAL]
    assert len(inputs) >= 1000

    n_valid = n_invalid = 0
    for kind, text in inputs:
        t = parse_turn(text)
        assert isinstance(t, ParsedTurn), (kind, text[:200])
        assert t.action in ("tool_call", "answer", "invalid")
        assert t.well_formed == (len(t.errors) == 0)
        assert all(isinstance(e, FormatError) and e.code in ERROR_CODES for e in t.errors)
        if kind == "valid":
            assert t.well_formed, (text, t.errors)
        if t.well_formed:
            assert t.action in ("tool_call", "answer")
            if t.action == "tool_call":
                assert t.tool_name in TOOL_NAMES and isinstance(t.arguments, dict) and t.answer is None
            else:
                assert t.answer and t.tool_name is None
        if t.action == "tool_call":
            assert t.tool_name in TOOL_NAMES and isinstance(t.arguments, dict)
        if len(text) <= 20_000:
            expected = oracle_valid(text)
            assert t.well_formed == expected, (kind, text, t.errors)
        else:
            assert not t.well_formed or kind == "adversarial"
        if t.well_formed:
            n_valid += 1
        else:
            n_invalid += 1
            assert len(t.errors) >= 1
    # the mix exercises both sides
    assert n_valid >= 400 and n_invalid >= 500, (n_valid, n_invalid)
    # the only well-formed adversarial inputs: an exact 401-digit integer argument (valid JSON; the tool validates
    # its range), 1 MB answer, 1 MB think, a valid turn padded with 1 MB of spaces
    assert {i for i, s in enumerate(ADVERSARIAL) if parse_turn(s).well_formed} == {5, 11, 12, len(ADVERSARIAL) - 1}
    assert parse_turn(ADVERSARIAL[5]).arguments == {"x": 10**400}


def test_adversarial_megabyte_inputs_return():
    # each of these returns a ParsedTurn (a catastrophic-backtracking regex would hang here)
    for s in ADVERSARIAL:
        t = parse_turn(s)
        assert isinstance(t, ParsedTurn)
    assert parse_turn(ADVERSARIAL[11]).answer == "x" * 1_000_000
    assert parse_turn(ADVERSARIAL[12]).think == "y" * 1_000_000
