"""LLM-backed synthesis: parse_reply for every reject reason, and LLMSynthesizer end to end against a real
OpenAI-compatible server (FastAPI + uvicorn on 127.0.0.1 in a thread, the pattern of
``tests/agent/test_openai_backend.py``) whose canned reply is chosen by the caption in the request.

Run: ``.venv/bin/python -m pytest tests/synth -q``.
"""

from __future__ import annotations

import asyncio
import base64
import doctest
import io
import json
import threading

import pyarrow as pa
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image

import mars.synth.llm as llm
from mars.data.schemas import QUESTIONS
from mars.synth.llm import PARSE_REASONS, REJECT_REASONS, LLMSynthesizer, parse_reply
from tests.conftest import serve_app

CAPTION = "The tall iron lattice tower on the Champ de Mars at dusk"


def qa(question="In which year was the structure in this picture completed?", answer="1889", aliases=("year 1889",),
       difficulty="medium", wrap="qa") -> str:
    obj = {"question": question, "answer": answer, "aliases": list(aliases), "difficulty": difficulty}
    body = json.dumps(obj)
    return f"<qa>{body}</qa>" if wrap == "qa" else f"Here you go:\n```json\n{body}\n```"


# ----------------------------------------------------------------------------------------------- parse_reply


def test_doctests():
    assert doctest.testmod(llm).failed == 0


def test_parse_good_reply():
    item, reason = parse_reply("thinking...\n" + qa() + "\n<qa>{\"ignored\": 1}</qa>", CAPTION)
    assert reason is None
    assert item == {"question": "In which year was the structure in this picture completed?", "answer": "1889",
                    "aliases": ["year 1889"], "difficulty": 1}


def test_parse_tolerance():
    item, _ = parse_reply(qa(wrap="fence", difficulty="HARD"), CAPTION)  # fenced fallback, difficulty any case
    assert item["difficulty"] == 2
    obj = {"question": "Who designed the structure shown in this image?", "answer": "Gustave  Eiffel",
           "aliases": ["Eiffel", "gustave eiffel"], "difficulty": "easy"}
    fenced_inside = "<qa>\n```json\n" + json.dumps(obj) + "\n```\n</qa>"
    item, _ = parse_reply(fenced_inside, CAPTION)
    # whitespace collapsed, an alias equal to the answer (normalised) dropped
    assert item == {"question": "Who designed the structure shown in this image?", "answer": "Gustave Eiffel",
                    "aliases": ["Eiffel"], "difficulty": 0}
    item, _ = parse_reply('<qa>{"question": "How tall is the structure in this photo, in metres?", "answer": 330, '
                          '"difficulty": "medium"}</qa>', CAPTION)  # numeric answer, no aliases
    assert item["answer"] == "330" and item["aliases"] == []
    assert parse_reply(qa(), "")[1] is None  # no caption: nothing to leak into


@pytest.mark.parametrize(
    "reply, reason",
    [
        ("I cannot help with that.", "no_qa_block"),
        ('<qa>{"question": "Which year was this built?", "answer": "1889"', "no_qa_block"),  # unclosed: truncated
        ("<qa>{'question': 'x'}</qa>", "bad_json"),
        ('<qa>{"question": "In which year was this built?", "answer": "1889",}</qa>', "bad_json"),
        ('<qa>["In which year was this built?", "1889"]</qa>', "bad_json"),
        ('<qa>{"question": "In which year was this structure built?", "difficulty": "easy"}</qa>', "missing_field"),
        ('<qa>{"question": "In which year was this structure built?", "answer": "1889"}</qa>', "missing_field"),
        ('<qa>{"question": null, "answer": "1889", "difficulty": "easy"}</qa>', "missing_field"),
        ('<qa>{"question": ["a"], "answer": "1889", "difficulty": "easy"}</qa>', "bad_field"),
        ('<qa>{"question": "In which year was this structure built?", "answer": true, "difficulty": "easy"}</qa>',
         "bad_field"),
        (qa(aliases=[{"x": 1}]), "bad_field"),
        (qa(answer="   "), "empty_answer"),
        (qa(answer="?!"), "empty_answer"),
        (qa(answer="it was completed in the spring of the year 1889 for the fair"), "answer_too_long"),
        (qa(answer="x" * 81), "answer_too_long"),
        (qa(question="When was it built?"), "question_too_short"),
        (qa(question="In which year " + "really " * 100 + "was this built?"), "question_too_long"),
        (qa(question="Name the year in which the structure in this picture was completed."), "not_a_question"),
        (qa(difficulty="extreme"), "bad_difficulty"),
        (qa(difficulty=3), "bad_difficulty"),
        (qa(question="Was the structure in this picture completed in 1889?", answer="1889"), "answer_in_question"),
        (qa(question="Which engineer's company, Eiffel et Cie, built this tower?", answer="eiffel et cie!",
            aliases=()), "answer_in_question"),  # normalised match
        (qa(question="Which company built the structure in this picture in 1889?", answer="Eiffel et Cie",
            aliases=("1889 builders", "1889")), "answer_in_question"),  # via an alias
        (qa(question="On which field in Paris does the structure in this picture stand?", answer="Champ de Mars",
            aliases=()), "answer_in_caption"),
    ],
)
def test_parse_reasons(reply, reason):
    item, got = parse_reply(reply, CAPTION)
    assert item is None and got == reason and got in PARSE_REASONS


def test_every_parse_reason_is_tested():
    cases = next(m for m in test_parse_reasons.pytestmark if m.name == "parametrize").args[1]
    assert {reason for _, reason in cases} == set(PARSE_REASONS)
    assert set(PARSE_REASONS) < set(REJECT_REASONS) and len(set(REJECT_REASONS)) == len(REJECT_REASONS)


def test_whole_words_only():
    # "18" is in "1889" as characters but not as a word: not a leak
    item, reason = parse_reply(qa(question="How many of the 1889 rivets in this picture are visible?", answer="18",
                                  aliases=()), CAPTION)
    assert reason is None and item["answer"] == "18"


# ----------------------------------------------------------------------------------------------- HTTP server

REPLIES = {  # caption keyword -> the model's reply
    "GOOD": qa(),
    "FENCED": qa(question="Who was the chief engineer of the structure shown here?", answer="Gustave Eiffel",
                 aliases=("Eiffel",), difficulty="hard", wrap="fence"),
    "BROKEN": '<qa>{"question": "In which year was this structure built?", "answer": 1889,,}</qa>',
    "LEAK": qa(question="Was the structure in this picture finished in 1889?"),
    "DUP": qa(difficulty="easy"),  # same question as GOOD
    "FLAKY": qa(question="How tall is the structure in this photo, in metres?", answer="330", aliases=("330 m",)),
}


class State:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.calls: dict[str, int] = {}
        self.inflight = self.peak = 0
        self.lock = threading.Lock()


def _caption(body: dict) -> str:
    parts = body["messages"][-1]["content"]
    return next(p["text"] for p in parts if p["type"] == "text")


def make_app(state: State) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        caption = _caption(body)
        key = next((k for k in ("GOOD", "FENCED", "BROKEN", "LEAK", "DUP", "FLAKY", "DOWN") if k in caption), "?")
        with state.lock:
            state.requests.append(body)
            state.headers.append(dict(request.headers))
            state.calls[key] = state.calls.get(key, 0) + 1
            n = state.calls[key]
            state.inflight += 1
            state.peak = max(state.peak, state.inflight)
        try:
            await asyncio.sleep(0.05)
            if key == "DOWN" or (key == "FLAKY" and n == 1):
                return JSONResponse({"error": "overloaded"}, status_code=500)
            return {
                "id": "chatcmpl-test", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": REPLIES[key]}}],
            }
        finally:
            with state.lock:
                state.inflight -= 1

    return app


@pytest.fixture()
def server():
    state = State()
    with serve_app(make_app(state)) as url:
        yield url, state


def make_items(root, keys: list[str]) -> list[dict]:
    (root / "img").mkdir(exist_ok=True)
    items = []
    for i, k in enumerate(keys):
        path = f"img/{i:02d}.jpg"
        if k != "NOIMAGE":
            Image.new("RGB", (200, 100), (10 * i, 100, 200)).save(root / path)
        items.append({"id": f"e{i:02d}", "image_path": path, "caption": f"{k}: an iron tower, photo {i}"})
    return items


def test_end_to_end(server, tmp_path, monkeypatch):
    url, state = server
    monkeypatch.setenv("SYNTH_TEST_KEY", "sk-test")
    keys = ["GOOD", "FENCED", "BROKEN", "LEAK", "DUP", "FLAKY", "DOWN", "NOIMAGE"]
    items = make_items(tmp_path, keys)
    with LLMSynthesizer(url, "synth-model", api_key_env="SYNTH_TEST_KEY", max_retries=2, backoff_s=0.01,
                        concurrency=4, max_image_side=64, temperature=0.3, max_tokens=300, progress=False) as s:
        rows, rejects = s.synthesize(items, image_root=tmp_path)

    # accepted rows: QUESTIONS-schema dicts, in input order
    assert [r["question_id"] for r in rows] == ["llm-e00", "llm-e01", "llm-e05"]
    pa.Table.from_pylist(rows, schema=QUESTIONS).validate(full=True)
    good, fenced, flaky = rows
    assert good == {"question_id": "llm-e00", "type": "search", "scene_id": None, "image_path": "img/00.jpg",
                    "question": "In which year was the structure in this picture completed?", "answer": "1889",
                    "aliases": ["year 1889"], "choices": None, "entity_id": "e00", "difficulty": 1,
                    "split": "unassigned"}
    assert fenced["answer"] == "Gustave Eiffel" and fenced["difficulty"] == 2
    assert flaky["answer"] == "330" and state.calls["FLAKY"] == 2  # a 500, retried, then a good reply

    # rejects: one per failing item, in input order, with typed reasons
    assert [(r["id"], r["reason"]) for r in rejects] == [
        ("e02", "bad_json"), ("e03", "answer_in_question"), ("e04", "duplicate"), ("e06", "endpoint_error"),
        ("e07", "image_error"),
    ]
    assert all(r["reason"] in REJECT_REASONS and set(r) == {"id", "reason", "detail", "reply"} for r in rejects)
    by_id = {r["id"]: r for r in rejects}
    assert by_id["e02"]["reply"] == REPLIES["BROKEN"] and by_id["e04"]["detail"].endswith("e00")
    assert "HTTP 500" in by_id["e06"]["detail"] and by_id["e06"]["reply"] == ""
    assert state.calls["DOWN"] == 3 and "NOIMAGE" not in state.calls  # 1 + 2 retries; no request without an image

    # the requests: bounded concurrency, system prompt, the image as a data URL and the caption
    assert len(state.requests) == 10 and 2 <= state.peak <= 4  # 5 + FLAKY twice + DOWN thrice
    assert all(h.get("authorization") == "Bearer sk-test" for h in state.headers)
    first = next(b for b in state.requests if "GOOD" in _caption(b))
    assert first["model"] == "synth-model" and first["temperature"] == 0.3 and first["max_tokens"] == 300
    assert isinstance(first["seed"], int)
    assert first["messages"][0] == {"role": "system", "content": llm.SYNTH_PROMPT}
    img, text = first["messages"][1]["content"]
    assert text == {"type": "text", "text": "Caption: GOOD: an iron tower, photo 0"}
    assert img["type"] == "image_url" and img["image_url"]["url"].startswith("data:image/png;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(img["image_url"]["url"].split(",", 1)[1])))
    assert decoded.size == (64, 32)  # shrunk to max_image_side, aspect kept


def test_failure_rate_stop(server, tmp_path):
    url, state = server
    items = make_items(tmp_path, ["DOWN"] * 10 + ["GOOD"] * 10)
    with LLMSynthesizer(url, "synth-model", max_retries=0, concurrency=1, progress=False) as s:
        with pytest.raises(RuntimeError) as err:
            s.synthesize(items[:10], image_root=tmp_path)
    msg = str(err.value)
    assert url in msg and "failed 6 of 10 requests" in msg and "stopped early" in msg and "HTTP 500" in msg
    assert state.calls["DOWN"] <= 7  # stopped once more than half had failed (one more may be in flight)

    # exactly at the limit is allowed: 2 of 4 failing with max_failure_rate=0.5
    with LLMSynthesizer(url, "m", max_retries=0, concurrency=2, progress=False) as s:
        rows, rejects = s.synthesize(items[8:12], image_root=tmp_path)
    assert [(r["id"], r["reason"]) for r in rejects] == [("e08", "endpoint_error"), ("e09", "endpoint_error"),
                                                          ("e11", "duplicate")]
    assert [r["entity_id"] for r in rows] == ["e10"]
