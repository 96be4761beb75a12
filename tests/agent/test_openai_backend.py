"""OpenAIBackend against a real OpenAI-compatible HTTP server (FastAPI + uvicorn on 127.0.0.1, in a thread),
end to end through the rollout engine with real tools over the smoke world.

The server plays a scripted model: with no assistant turn yet it calls text_search, then it answers. Like vLLM it
strips the matched stop string (naming it in ``stop_reason`` for some requests and not for others) and returns
per-token logprobs, with tokens rendered as ``token_id:N`` when asked (``return_tokens_as_token_ids``).

Run: ``.venv/bin/python -m pytest tests/agent -q``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import threading

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image

from mars.agent.backends import OpenAIBackend, close_stop
from mars.agent.engine import EngineConfig, run_episodes, trajectories_table
from mars.data.schemas import TRAJECTORIES
from mars.tools.toolbox import ToolBox, ToolConfig
from mars.world.questions import make_questions
from tests.agent.test_engine import build_smoke_world
from tests.conftest import serve_app


class State:
    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.inflight = 0
        self.peak = 0
        self.fail_next = 0
        self.lock = threading.Lock()


def make_app(state: State) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        with state.lock:
            state.requests.append(body)
            state.inflight += 1
            state.peak = max(state.peak, state.inflight)
            failing = state.fail_next > 0
            state.fail_next -= 1 if failing else 0
        try:
            await asyncio.sleep(0.05)
            if failing:
                return JSONResponse({"error": "overloaded"}, status_code=503)
            n_assistant = sum(m["role"] == "assistant" for m in body["messages"])
            if n_assistant == 0:
                text = '<think>search it</think>\n<tool_call>\n{"name": "text_search", "arguments": {"query": "founded"}}\n'
                stop = "</tool_call>"
            else:
                text = "<think>the snippet says so</think>\n<answer>1900"
                stop = "</answer>"
            words = text.split(" ")
            as_ids = bool(body.get("return_tokens_as_token_ids"))
            content = [{"token": f"token_id:{100 + i}" if as_ids else w, "logprob": -0.1 * (i + 1), "bytes": None,
                        "top_logprobs": []} for i, w in enumerate(words)]
            # vLLM names the stop string in stop_reason; some servers do not: both must be re-closed
            stop_reason = stop if body.get("seed", 0) % 2 == 0 else None
            return {
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": {"content": content} if body.get("logprobs") else None,
                    "finish_reason": "stop",
                    "stop_reason": stop_reason,
                }],
            }
        finally:
            with state.lock:
                state.inflight -= 1

    return app


@pytest.fixture(scope="module")
def server():
    state = State()
    with serve_app(make_app(state)) as url:
        yield url, state


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai-world")
    built = build_smoke_world(root)
    built["questions"] = make_questions(built["tables"], built["world"] / "raw", built["world"] / "questions",
                                        seed=0, n_per_type=2).to_pylist()
    built["toolbox"] = ToolBox.from_dirs(built["index"], built["world"] / "gallery", ToolConfig())
    return built


def test_episodes_end_to_end_over_http(server, smoke):
    url, state = server
    state.requests.clear()
    qs = smoke["questions"]
    with OpenAIBackend(url, "scripted-model", api_key="k", concurrency=4, token_ids=True) as backend:
        trajs = run_episodes(qs, backend, smoke["toolbox"], EngineConfig(), seed=0, image_root=smoke["world"])
    assert len(state.requests) == 2 * len(qs) and state.peak >= 2  # concurrent, bounded requests
    first = state.requests[0]
    assert first["stop"] == ["</tool_call>", "</answer>"] and first["logprobs"] is True
    assert first["model"] == "scripted-model" and first["max_tokens"] == 256
    img = first["messages"][1]["content"][0]
    assert img["type"] == "image_url" and img["image_url"]["url"].startswith("data:image/png;base64,")
    decoded = Image.open(io.BytesIO(base64.b64decode(img["image_url"]["url"].split(",", 1)[1])))
    assert decoded.width * decoded.height <= 224 * 224
    for t in trajs:
        assert t.finish_reason == "answer" and t.answer == "1900" and t.n_format_errors == 0
        assert t.n_tool_calls == 1 and t.n_tool_errors == 0 and t.reward_format == 0.5
        assert t.messages[2]["content"].endswith("</tool_call>") and t.messages[4]["content"].endswith("</answer>")
        assert t.token_ids is not None and len(t.token_ids) == len(t.logprobs) > 0
        assert t.token_ids[0] == 100 and t.logprobs[0] == pytest.approx(-0.1)
    table = trajectories_table(trajs)
    assert table.schema.equals(TRAJECTORIES) and table.column("token_ids").null_count == 0


def test_retry_then_success_and_dead_server_is_a_backend_error(server, smoke):
    url, state = server
    state.fail_next = 1
    with OpenAIBackend(url, "m", retries=2, backoff_s=0.01, concurrency=1) as backend:
        trajs = run_episodes(smoke["questions"][:1], backend, smoke["toolbox"], EngineConfig(),
                             image_root=smoke["world"])
        assert trajs[0].finish_reason == "answer" and not backend.errors
        assert trajs[0].token_ids is None and trajs[0].logprobs  # tokens were words: logprobs only
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with OpenAIBackend(dead, "m", retries=1, backoff_s=0.01, timeout_s=2) as backend:
        trajs = run_episodes(smoke["questions"][:2], backend, smoke["toolbox"], EngineConfig(),
                             image_root=smoke["world"])
        assert [t.finish_reason for t in trajs] == ["backend_error"] * 2 and len(backend.errors) == 2


def test_close_stop():
    assert close_stop("<think>a</think><answer>1", "stop") == "<think>a</think><answer>1</answer>"
    assert close_stop("<think>a</think><tool_call>{}", "stop", "</tool_call>").endswith("</tool_call>")
    assert close_stop("<think>a</think><answer>1</answer>", "stop") == "<think>a</think><answer>1</answer>"
    assert close_stop("<think>a</think><answer>1", "length") == "<think>a</think><answer>1"
