"""The agent's turn protocol: prompt rendering, a tolerant turn parser and the formatters a scripted teacher uses.

Conventions (those of the reference release, so released checkpoints keep working; docs/design.md, The agent protocol):

- every assistant turn is ``<think>...</think>`` followed by exactly one action, either
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` or ``<answer>...</answer>``;
- a tool's result comes back in the next user/tool turn as ``<tool_response>...</tool_response>``; any images the
  tool produced (crops, thumbnails) follow as image items of that same message, placed by the chat template, never
  as text placeholders here;
- the system prompt lists the tools in OpenAI function format inside ``<tools>...</tools>``, one JSON per line,
  exactly as Qwen's chat template renders them.

:func:`parse_turn` never raises. It extracts the first complete action even from a messy turn (so a rollout can
choose to be lenient) and reports *every* malformation as a typed :class:`FormatError`; a turn is well formed iff
there are none. The scan is a single left-to-right pass over the protocol tags found by one non-backtracking regex,
and JSON is decoded with the standard library (``RecursionError`` and the int-digit limit are caught), so a 1 MB
adversarial string returns promptly.

What the parser tolerates without an error: whitespace anywhere between blocks (any other text outside the tags is
an error), the JSON of a tool call may be wrapped in whitespace or a Markdown code fence, its
``arguments`` may be a JSON *string* holding an object (as OpenAI APIs send it), and a missing ``arguments`` key means
``{}`` (the tool itself then validates its required arguments). Protocol tags that occur inside JSON strings of a
tool call that parses are data, not nesting.

Deviations from the brief/reference, on purpose:

- one extra error code, ``stray_text``: non-whitespace text outside the tags before the action (the reference's
  format check is an anchored regex, so such a turn is malformed there too);
- ``NaN``/``Infinity`` literals and numbers that overflow a float (``1e400``) are rejected as ``bad_json``: they
  cannot be stored or compared reliably downstream;
- :func:`format_tool_call` escapes a literal ``</tool_call>`` inside argument strings as ``\\u003c/tool_call>``
  (still valid JSON for the same value) so every teacher output round-trips.

Run its tests with ``.venv/bin/python -m pytest tests/agent -q``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Sequence

__all__ = [
    "ACTION_TAGS",
    "ERROR_CODES",
    "FormatError",
    "ParsedTurn",
    "TOOL_NAMES",
    "content_text",
    "format_answer",
    "format_error_observation",
    "format_ok",
    "format_tool_call",
    "format_tool_response",
    "parse_turn",
    "system_prompt",
]

TOOL_NAMES: tuple[str, ...] = ("image_zoom_in", "image_search", "text_search")
ACTION_TAGS: tuple[str, ...] = ("tool_call", "answer")

ERROR_CODES: dict[str, str] = {
    "empty": "the turn is empty",
    "no_action": "the turn has neither a <tool_call> nor an <answer>",
    "missing_think": "the turn does not start with a <think>...</think> block",
    "unclosed_tag": "a tag is opened but never closed, or closed without being opened",
    "bad_json": "the tool call is not valid JSON",
    "not_an_object": "the tool call JSON is not an object",
    "missing_name": "the tool call has no string \"name\"",
    "unknown_tool": "the tool call names a tool that does not exist",
    "bad_arguments": "the tool call's \"arguments\" is not a JSON object",
    "multiple_actions": "the turn has more than one action (one tool call or one answer per turn)",
    "empty_answer": "the <answer> is empty",
    "text_after_action": "there is text after the action",
    "nested_tag": "a protocol tag is nested inside another block",
    "stray_text": "there is text outside the tags before the action",
}

# One alternation of literals: the regex engine cannot backtrack catastrophically on it.
_TAG_RE = re.compile(r"<(/?)(think|tool_call|answer)>")
_FENCE_RE = re.compile(r"\A```[A-Za-z0-9_-]*[ \t]*\n?(.*?)\n?[ \t]*```\Z", re.S)
_MAX_ERROR_DETAIL = 200


@dataclass(frozen=True)
class FormatError:
    """One malformation of a turn: a stable ``code`` (see :data:`ERROR_CODES`) and a human message."""

    code: str
    message: str


@dataclass(frozen=True)
class ParsedTurn:
    """What :func:`parse_turn` extracted from one assistant turn.

    ``action`` is ``"tool_call"`` when a known tool name and an argument object were extracted, ``"answer"`` when a
    non-empty answer was, and ``"invalid"`` otherwise. It can be a usable action even when ``errors`` is non-empty
    (for example a correct tool call with no ``<think>``); ``well_formed`` says whether the turn was perfect.
    """

    think: str | None
    action: Literal["tool_call", "answer", "invalid"]
    tool_name: str | None
    arguments: dict | None
    answer: str | None
    errors: tuple[FormatError, ...]

    @property
    def well_formed(self) -> bool:
        return not self.errors


@dataclass
class _Block:
    name: str
    start: int  # index of the opening tag
    end: int  # index just past the closing tag (or where the block was cut)
    content: str
    closed: bool
    nested: bool  # other protocol tags occurred inside


def _short(s: str, n: int = 60) -> str:
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else s[: n - 3] + "..."


def _scan(text: str) -> tuple[list[_Block], list[tuple[int, str]]]:
    """Split ``text`` into protocol blocks in one pass. Returns (blocks, stray closing tags as (pos, name))."""
    tags = [(m.start(), m.end(), m.group(2), bool(m.group(1))) for m in _TAG_RE.finditer(text)]
    blocks: list[_Block] = []
    stray: list[tuple[int, str]] = []
    i, n = 0, len(tags)
    while i < n:
        start, end, name, closing = tags[i]
        if closing:
            stray.append((start, name))
            i += 1
            continue
        j, nested, cut = i + 1, False, False
        while j < n:
            _, _, jname, jclosing = tags[j]
            if jname == name and jclosing:
                break
            if name == "think" and not jclosing and jname in ACTION_TAGS:
                cut = True  # an action opened inside <think>: end the think here and parse the action
                break
            nested = True
            j += 1
        if j < n and not cut:
            blocks.append(_Block(name, start, tags[j][1], text[end : tags[j][0]], True, nested))
            i = j + 1
        elif cut:
            blocks.append(_Block(name, start, tags[j][0], text[end : tags[j][0]], False, True))
            i = j
        else:
            blocks.append(_Block(name, start, len(text), text[end:], False, nested))
            i = n
    return blocks, stray


class _NonFinite(ValueError):
    pass


def _finite_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise _NonFinite(f"number {_short(s, 30)} overflows a float")
    return v


def _reject_constant(s: str) -> Any:
    raise _NonFinite(f"{s} is not valid JSON")


_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_reject_constant)


def _loads(s: str) -> tuple[Any, str | None, bool]:
    """Decode JSON tolerantly. Returns (value, error message or None, value_found).

    On a strict failure, the first object starting at the first ``{`` is still returned (``value_found``) together
    with the error, so that the caller can extract a tool call from e.g. ``{...} trailing junk``.
    """
    body = s.strip()
    m = _FENCE_RE.match(body)
    if m:
        body = m.group(1).strip()
    try:
        return _DECODER.decode(body), None, True
    except RecursionError:
        return None, "JSON nested too deeply", False
    except (ValueError, TypeError, OverflowError) as e:  # JSONDecodeError, int digit limit, non-finite numbers
        err = f"{type(e).__name__}: {_short(str(e), _MAX_ERROR_DETAIL)}"
    k = body.find("{")
    if k >= 0:
        try:
            value, _ = _DECODER.raw_decode(body, k)
            return value, err, True
        except (RecursionError, ValueError, TypeError, OverflowError):
            pass
    return None, err, False


def _parse_tool_call(
    content: str, tool_names: Iterable[str], errors: list[FormatError], has_inner_tags: bool
) -> tuple[str | None, dict | None]:
    value, err, found = _loads(content)
    if err is not None:
        errors.append(FormatError("bad_json", f"tool call JSON does not parse ({err}): {_short(content.strip())!r}"))
        if has_inner_tags:
            errors.append(FormatError("nested_tag", "protocol tags inside <tool_call> outside of JSON strings"))
        if not found:
            return None, None
    if not isinstance(value, dict):
        errors.append(FormatError("not_an_object", f"tool call JSON is a {type(value).__name__}, not an object"))
        return None, None
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        errors.append(FormatError("missing_name", "tool call has no string \"name\""))
        name = None
    elif name not in tool_names:
        errors.append(FormatError("unknown_tool", f"unknown tool {_short(name)!r}; tools are {', '.join(tool_names)}"))
    if "arguments" in value:
        args: Any = value["arguments"]
    elif "parameters" in value:
        args = value["parameters"]
    else:
        args = {}
    if isinstance(args, str):
        inner, inner_err, _ = _loads(args)
        if inner_err is None and isinstance(inner, dict):
            args = inner
    if not isinstance(args, dict):
        errors.append(FormatError("bad_arguments", f"\"arguments\" must be a JSON object, got {type(args).__name__}"))
        args = None
    return name, args


def parse_turn(text: str, tool_names: Iterable[str] = TOOL_NAMES) -> ParsedTurn:
    """Parse one assistant turn. Never raises; every malformation becomes a :class:`FormatError`.

    >>> t = parse_turn('<think>zoom</think><tool_call>{"name": "text_search", "arguments": {"query": "x"}}</tool_call>')
    >>> (t.well_formed, t.action, t.tool_name, t.arguments)
    (True, 'tool_call', 'text_search', {'query': 'x'})
    >>> [e.code for e in parse_turn('<answer>1990</answer> more').errors]
    ['missing_think', 'text_after_action']
    """
    try:
        return _parse_turn(text, tuple(tool_names))
    except Exception as e:  # defence in depth: the contract is "never raises"
        return ParsedTurn(None, "invalid", None, None, None, (FormatError("bad_json", f"unparseable turn ({type(e).__name__})"),))


def _outside(gap: str) -> bool:
    """Whether a stretch outside the blocks holds text other than whitespace and stray tags (reported apart)."""
    return bool(_TAG_RE.sub("", gap).strip())


def _parse_turn(text: str, tool_names: tuple[str, ...]) -> ParsedTurn:
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    if not text.strip():
        return ParsedTurn(None, "invalid", None, None, None, (FormatError("empty", ERROR_CODES["empty"]),))

    blocks, stray = _scan(text)
    errors: list[FormatError] = []
    actions = [b for b in blocks if b.name in ACTION_TAGS]
    primary = next((b for b in actions if b.closed), actions[0] if actions else None)
    limit = primary.start if primary is not None else len(text)

    # --- think: the first think block before the action
    thinks = [b for b in blocks if b.name == "think" and b.start < limit]
    think: str | None = None
    if not thinks:
        errors.append(FormatError("missing_think", ERROR_CODES["missing_think"]))
        if primary is not None and _outside(text[:limit]):
            errors.append(FormatError("stray_text", f"text before the action: {_short(text[:limit].strip())!r}"))
    else:
        tb = thinks[0]
        think = tb.content.strip()
        if not tb.closed and not tb.nested:
            errors.append(FormatError("unclosed_tag", "<think> is never closed with </think>"))
        if tb.nested:
            errors.append(FormatError("nested_tag", "protocol tags inside <think>...</think>"))
            if not tb.closed:
                errors.append(FormatError("unclosed_tag", "<think> is not closed before the action starts"))
        if len(thinks) > 1:
            errors.append(FormatError("nested_tag", f"{len(thinks)} <think> blocks before the action; use one"))
        if _outside(text[: tb.start]):
            errors.append(FormatError("stray_text", f"text before <think>: {_short(text[: tb.start].strip())!r}"))
        # text between the (last) think block and the action
        gap_start = thinks[-1].end
        if _outside(text[gap_start:limit]):
            errors.append(
                FormatError("stray_text", f"text between </think> and the action: {_short(text[gap_start:limit].strip())!r}")
            )

    for pos, name in stray:
        errors.append(FormatError("unclosed_tag", f"</{name}> at offset {pos} closes nothing"))

    if primary is None:
        errors.append(FormatError("no_action", ERROR_CODES["no_action"]))
        return ParsedTurn(think, "invalid", None, None, None, tuple(errors))

    if not primary.closed:
        errors.append(FormatError("unclosed_tag", f"<{primary.name}> is never closed with </{primary.name}>"))

    # --- everything after the action
    later = [b for b in actions if b.start >= primary.end]
    if later:
        errors.append(
            FormatError("multiple_actions", f"{len(later) + 1} actions in one turn; emit exactly one tool call or answer")
        )
    cursor, leftover = primary.end, False
    for b in later:
        if text[cursor : b.start].strip():
            leftover = True
            break
        cursor = b.end
    if leftover or text[cursor:].strip():
        errors.append(FormatError("text_after_action", ERROR_CODES["text_after_action"]))

    # --- the action itself
    if primary.name == "answer":
        if primary.nested:
            errors.append(FormatError("nested_tag", "protocol tags inside <answer>...</answer>"))
        answer = primary.content.strip()
        if not answer:
            errors.append(FormatError("empty_answer", ERROR_CODES["empty_answer"]))
            return ParsedTurn(think, "invalid", None, None, None, tuple(errors))
        return ParsedTurn(think, "answer", None, None, answer, tuple(errors))

    name, args = _parse_tool_call(primary.content, tool_names, errors, primary.nested)
    usable = name is not None and name in tool_names and args is not None
    return ParsedTurn(think, "tool_call" if usable else "invalid", name, args, None, tuple(errors))


# ----------------------------------------------------------------------------------------------- formatters


def _check_free_of_tags(what: str, s: str) -> None:
    if _TAG_RE.search(s):
        raise ValueError(f"{what} must not contain protocol tags (<think>, <tool_call>, <answer>): {_short(s)!r}")


def format_tool_call(name: str, arguments: dict, think: str) -> str:
    """The assistant turn a scripted teacher emits to call a tool; :func:`parse_turn` round-trips it.

    >>> print(format_tool_call("text_search", {"query": "Aster Guild"}, "Search the name."))
    <think>Search the name.</think>
    <tool_call>
    {"name": "text_search", "arguments": {"query": "Aster Guild"}}
    </tool_call>
    """
    if not isinstance(arguments, dict):
        raise TypeError("arguments must be a dict")
    _check_free_of_tags("think", think)
    payload = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False, allow_nan=False)
    payload = payload.replace("</tool_call>", "\\u003c/tool_call>")  # only ever inside a JSON string
    return f"<think>{think.strip()}</think>\n<tool_call>\n{payload}\n</tool_call>"


def format_answer(answer: str, think: str) -> str:
    """The final assistant turn.

    >>> format_answer("1987", "The snippet says 1987.")
    '<think>The snippet says 1987.</think>\\n<answer>1987</answer>'
    """
    _check_free_of_tags("think", think)
    _check_free_of_tags("answer", answer)
    if not answer.strip():
        raise ValueError("answer must not be empty")
    return f"<think>{think.strip()}</think>\n<answer>{answer.strip()}</answer>"


def format_tool_response(text: str, n_images: int = 0) -> str:
    """The text part of the observation after a tool call.

    The ``n_images`` images the tool returned are *not* represented here: the rollout puts them as image items after
    this text in the same message, and the chat template inserts the vision placeholders. ``n_images`` is only
    validated (it must be >= 0) so that callers state what they attach.

    >>> format_tool_response("1. Aster Guild was founded in 1987.")
    '<tool_response>\\n1. Aster Guild was founded in 1987.\\n</tool_response>'
    """
    if n_images < 0:
        raise ValueError("n_images must be >= 0")
    return f"<tool_response>\n{text}\n</tool_response>"


def content_text(content: Any, sep: str = "\n") -> str:
    """The text of a message's ``content``: the string itself, or its text items joined by ``sep`` (image items
    skipped; None gives "").

    >>> content_text([{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}], " ")
    'a b'
    """
    if isinstance(content, str):
        return content
    return sep.join(p.get("text", "") for p in content or [] if p.get("type") == "text")


_EXPECTED_FORMAT = (
    "Expected format: <think>your reasoning</think> followed by exactly one of\n"
    '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments object>}}\n</tool_call>\n'
    "or <answer>your final answer</answer>, and nothing after it."
)


def format_error_observation(errors: Iterable[FormatError]) -> str:
    """The observation the model sees after a malformed turn: what was wrong, then the expected format.

    >>> print(format_error_observation([FormatError("no_action", "the turn has neither a <tool_call> nor an <answer>")]))
    <tool_response>
    Error: your last turn was malformed.
    - no_action: the turn has neither a <tool_call> nor an <answer>
    Expected format: <think>your reasoning</think> followed by exactly one of
    <tool_call>
    {"name": "<tool name>", "arguments": {<arguments object>}}
    </tool_call>
    or <answer>your final answer</answer>, and nothing after it.
    </tool_response>
    """
    lines = ["Error: your last turn was malformed."]
    seen: set[tuple[str, str]] = set()
    for e in errors:
        key = (e.code, e.message)
        if key not in seen:
            seen.add(key)
            lines.append(f"- {e.code}: {e.message}")
    return format_tool_response("\n".join(lines) + "\n" + _EXPECTED_FORMAT)


def system_prompt(tool_schemas: list[dict]) -> str:
    """The system prompt: the tools (OpenAI function format, one JSON per line inside ``<tools>``) and the protocol.

    >>> schema = {"type": "function", "function": {"name": "text_search", "description": "Search text.",
    ...           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    >>> p = system_prompt([schema])
    >>> '<tools>\\n{"type": "function", "function": {"name": "text_search"' in p
    True
    """
    lines = []
    for s in tool_schemas:
        if not isinstance(s, dict):
            raise TypeError("each tool schema must be a dict")
        if "function" not in s:  # accept a bare {"name", "description", "parameters"}
            s = {"type": "function", "function": s}
        fn = s["function"]
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool schema without a function name: {s!r}")
        lines.append(json.dumps(s, ensure_ascii=False))
    tools = "\n".join(lines)
    return (
        "You are a helpful assistant that answers questions about images. You can think, look closer at the images "
        "and search for information with tools.\n\n"
        "# Tools\n\n"
        "You may call one of the following functions per turn to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{tools}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
        "XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n\n'
        "# Format\n\n"
        "In every turn, first reason inside <think>...</think>, then do exactly one of:\n"
        "- call one tool with <tool_call>...</tool_call>, or\n"
        "- give the final answer with <answer>...</answer>.\n"
        "Write nothing after the tool call or the answer. Tool results come back inside "
        "<tool_response>...</tool_response>, followed by any images the tool returned. Images are numbered from 0 "
        "in the order they appear in the dialogue (img_idx); bounding boxes use a 0..1000 relative grid."
    )


def compact_system_prompt(tool_schemas: list[dict]) -> str:
    """A short system prompt for small models (the embedded default): tool signatures and the turn format only.

    The full prompt (:func:`system_prompt`, the reference's wording with the OpenAI function schemas) is about
    700 tokens of the default tokenizer, which a 1M-parameter model pays on every training sample; this one
    carries the same contract in a few dozen.

    >>> schema = {"type": "function", "function": {"name": "text_search", "description": "Search text.",
    ...           "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
    >>> compact_system_prompt([schema])
    'Tools: text_search(query). Each turn: <think>...</think> then <tool_call>{"name": ..., "arguments": {...}}</tool_call> or <answer>...</answer>.'
    """
    sigs = []
    for s in tool_schemas:
        fn = s.get("function", s) if isinstance(s, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool schema without a function name: {s!r}")
        args = ", ".join((fn.get("parameters") or {}).get("properties", {}))
        sigs.append(f"{fn['name']}({args})")
    return (
        f"Tools: {'; '.join(sigs)}. Each turn: <think>...</think> then "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call> or <answer>...</answer>.'
    )


DIRECT_SYSTEM_PROMPT = (
    "You are a helpful assistant that answers questions about images. Answer directly, without tools: first "
    "reason inside <think>...</think>, then give the final answer inside <answer>...</answer>."
)


def format_ok(turns: Sequence[ParsedTurn], tool_errors: int) -> bool:
    """A final answer exists, every turn is well formed, and no tool call failed because of the model.

    >>> call = parse_turn('<think>look</think><tool_call>{"name": "text_search", "arguments": {"query": "x"}}</tool_call>')
    >>> done = parse_turn('<think>found</think><answer>1987</answer>')
    >>> format_ok([call, done], tool_errors=0)
    True
    >>> format_ok([call, done], tool_errors=1)  # e.g. a bbox outside the image
    False
    >>> format_ok([call], tool_errors=0)  # never answered (ran out of turns)
    False
    >>> format_ok([parse_turn('<answer>1987</answer>')], tool_errors=0)  # no <think>
    False
    >>> format_ok([], tool_errors=0)
    False
    """
    if not turns or tool_errors > 0:
        return False
    if not all(t.well_formed for t in turns):
        return False
    last = turns[-1]
    return last.action == "answer" and bool(last.answer)
