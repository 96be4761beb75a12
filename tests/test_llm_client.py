"""The OpenAI-compatible chat client (mars.llm_client) against a real scripted server on 127.0.0.1, and what a
failing endpoint means for each of its callers: the judge, the rollout backend, the summariser.

The server is the web tests' ``FakeAPI`` (a threaded ``http.server``): each test scripts its answers (status,
body, delay, headers) and reads back the requests it received. Backoffs are 0.01 s so the file stays fast.
"""

from __future__ import annotations

import doctest
import logging
import socket
import time

import httpx
import pytest

import mars.llm_client as llm_mod
from mars.agent.backends import OpenAIBackend
from mars.llm_client import ChatClient, LLMError
from mars.rl.judge import JudgeUnavailable, LLMJudge
from mars.tools.text_index import TextHit
from mars.tools.web import OpenAISummarizer, WebSearchError
from tests.tools.test_web import FakeAPI, chat_answer

PATH = "/v1/chat/completions"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.0}
SECRET = "sk-test-SECRET-llm-client-0123456789"


def vllm_answer(content: str) -> dict:
    """A chat completion with vLLM's extra fields: stop_reason and token_ids per choice."""
    ans = chat_answer(content)
    ans["choices"][0].update(stop_reason="</answer>", token_ids=[11, 12, 13])
    return ans


@pytest.fixture()
def api():
    srv = FakeAPI()
    yield srv
    srv.close()


def client(api: FakeAPI, **kw) -> ChatClient:
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 5.0)
    return ChatClient(f"{api.url}/v1", **kw)


def dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def test_doctests():
    assert doctest.testmod(llm_mod).failed == 0


# --- the client ------------------------------------------------------------------------------------------


def test_503_then_200_is_retried_and_keeps_the_servers_extra_fields(api):
    api.on(PATH, (503, {"error": "overloaded"}), (200, vllm_answer("<answer>1900")))
    with client(api, retries=2) as llm:
        data = llm.complete({**BODY, "logprobs": True, "seed": 3, "return_tokens_as_token_ids": True, "top_k": 5})
        assert (llm.calls, llm.failures, llm.retries_done) == (1, 0, 1)
    choice = data["choices"][0]
    assert choice["message"]["content"] == "<answer>1900"
    assert choice["stop_reason"] == "</answer>" and choice["token_ids"] == [11, 12, 13]
    assert len(api.paths(PATH)) == 2
    sent = api.paths(PATH)[-1][2]  # OpenAI's fields and vLLM's extra_body, side by side in one JSON body
    assert sent["model"] == "m" and sent["max_tokens"] == 8 and sent["logprobs"] is True and sent["seed"] == 3
    assert sent["return_tokens_as_token_ids"] is True and sent["top_k"] == 5


def test_always_failing_exhausts_the_retries_with_a_one_line_error(api):
    api.on(PATH, (503, {"error": "overloaded"}))
    llm = client(api, retries=2, name="judge")
    t0 = time.perf_counter()
    with pytest.raises(LLMError) as ei:
        llm.complete(BODY)
    elapsed = time.perf_counter() - t0
    msg = str(ei.value)
    assert msg.startswith(f"judge at {api.url}/v1/chat/completions failed after 3 attempt(s): HTTP 503")
    assert "\n" not in msg and ei.value.status == 503 and not ei.value.refused
    assert len(api.paths(PATH)) == 3 and (llm.calls, llm.failures, llm.retries_done) == (1, 1, 2)
    assert elapsed < 1.0  # backoff_s 0.01 is used, not the openai package's own 0.5 s doubling


def test_backoff_s_sets_the_waits(api):
    api.on(PATH, (500, b"down"), (500, b"down"), (200, chat_answer("ok")))
    t0 = time.perf_counter()
    assert client(api, retries=2, backoff_s=0.2).text(BODY) == "ok"
    assert time.perf_counter() - t0 >= 0.2 + 0.4 - 0.02  # 0.2 * 2**0 + 0.2 * 2**1


def test_client_errors_are_not_retried(api):
    api.on(PATH, (400, {"error": {"message": "unknown model"}}))
    llm = client(api, retries=3)
    with pytest.raises(LLMError, match="refused the request with HTTP 400.*unknown model") as ei:
        llm.complete(BODY)
    assert ei.value.refused and ei.value.status == 400 and len(api.paths(PATH)) == 1 and llm.retries_done == 0


def test_429_retry_after_is_honoured(api):
    api.on(PATH, (429, {"error": "slow down"}, 0.0, {"Retry-After": "0.3"}), (200, chat_answer("ok")))
    t0 = time.perf_counter()
    assert client(api, retries=1).text(BODY) == "ok"
    assert time.perf_counter() - t0 >= 0.29 and len(api.paths(PATH)) == 2


def test_timeout_is_honoured_and_retried(api):
    api.on(PATH, (200, chat_answer("late"), 1.0, {}))
    llm = client(api, retries=1, timeout_s=0.2)
    t0 = time.perf_counter()
    with pytest.raises(LLMError, match=r"failed after 2 attempt\(s\): Timeout: no answer within 0.2s"):
        llm.complete(BODY)
    assert time.perf_counter() - t0 < 0.9  # did not wait for the slow handler
    assert len(api.paths(PATH)) == 2


def test_timeout_then_fast_answer_succeeds(api):
    api.on(PATH, (200, chat_answer("late"), 1.0, {}), (200, chat_answer("fast")))
    assert client(api, retries=1, timeout_s=0.2).text(BODY) == "fast"


def test_connection_refused():
    llm = ChatClient(dead_url(), retries=1, backoff_s=0.01, timeout_s=2)
    with pytest.raises(LLMError, match=r"failed after 2 attempt\(s\): ConnectError.*is the server running"):
        llm.complete(BODY)
    assert llm.retries_done == 1 and llm.failures == 1


def test_answers_that_are_not_chat_completions(api):
    llm = client(api, retries=2)
    api.on(PATH, (200, b"{not json"))
    with pytest.raises(LLMError, match="not JSON"):
        llm.complete(BODY)
    api.on(PATH, (200, {"object": "chat.completion", "choices": []}))
    with pytest.raises(LLMError, match=r"without choices\[0\]\.message\.content"):
        llm.text(BODY)
    assert len(api.paths(PATH)) == 2 and llm.failures == 2  # a bad answer is not retried
    api.on(PATH, (200, chat_answer(None)))
    assert llm.text(BODY) == ""


def test_keys_headers_and_a_shared_pool(api, monkeypatch, caplog):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    api.on(PATH, (503, b"busy"), (200, chat_answer("ok")))
    with caplog.at_level(logging.DEBUG):
        assert client(api, api_key=SECRET).text(BODY) == "ok"
    assert api.requests[-1][1]["authorization"] == f"Bearer {SECRET}"
    assert SECRET not in caplog.text and "retry 1/2" in caplog.text
    assert client(api).text(BODY) == "ok"  # no key: the placeholder, never the environment's key
    assert api.requests[-1][1]["authorization"] == "Bearer EMPTY"
    assert client(api, api_key=SECRET).text(BODY, headers={"Authorization": "Bearer other"}) == "ok"
    assert api.requests[-1][1]["authorization"] == "Bearer other"
    with httpx.Client() as pool:
        with client(api, http_client=pool) as llm:
            assert llm.text(BODY) == "ok"
        assert not pool.is_closed
    assert SECRET not in repr(client(api, api_key=SECRET))


def test_argument_checks():
    with pytest.raises(ValueError, match="base_url"):
        ChatClient("")
    with pytest.raises(ValueError, match="timeout_s"):
        ChatClient("http://127.0.0.1:1/v1", timeout_s=0)
    with pytest.raises(ValueError, match="retries"):
        ChatClient("http://127.0.0.1:1/v1", retries=-1)
    with pytest.raises(ValueError, match="backoff_s"):
        ChatClient("http://127.0.0.1:1/v1", backoff_s=float("nan"))
    with pytest.raises(ValueError, match="'model' and 'messages'"):
        ChatClient("http://127.0.0.1:1/v1").complete({"messages": []})


# --- what a failing endpoint means for each caller ------------------------------------------------------


@pytest.mark.parametrize("failure", ["503", "timeout"])
def test_judge_raises_judge_unavailable(api, failure):
    api.on(PATH, (503, b"busy") if failure == "503" else (200, chat_answer("<judge>Yes</judge>"), 1.0, {}))
    with LLMJudge(f"{api.url}/v1", "j", retries=1, backoff_s=0.01, timeout_s=0.2) as j:
        with pytest.raises(JudgeUnavailable, match="HTTP 503" if failure == "503" else "Timeout"):
            j.judge("q", "London", ["Paris"])
    assert len(api.paths(PATH)) == 2


def test_judge_503_then_200(api):
    api.on(PATH, (503, b"busy"), (200, chat_answer("<judge>Yes</judge>")))
    with LLMJudge(f"{api.url}/v1", "j", retries=1, backoff_s=0.01) as j:
        assert j.judge("q", "the capital", ["Paris"]).correct


@pytest.mark.parametrize("failure", ["503", "timeout", "400"])
def test_backend_turns_a_failed_request_into_an_error_generation(api, failure):
    step = {"503": (503, b"busy"), "timeout": (200, vllm_answer("late"), 1.0, {}), "400": (400, b"bad")}[failure]
    api.on(PATH, step)
    with OpenAIBackend(f"{api.url}/v1", "m", retries=1, backoff_s=0.01, timeout_s=0.2, concurrency=2) as backend:
        gens = backend.generate([[{"role": "user", "content": "hi"}]] * 2, max_new_tokens=8, temperature=1.0,
                                top_p=1.0, seed=0)
        assert [g.finish_reason for g in gens] == ["error", "error"] and all(g.text == "" for g in gens)
        assert len(backend.errors) == 2 and all("\n" not in e for e in backend.errors)
        assert {"503": "HTTP 503", "timeout": "Timeout", "400": "HTTP 400"}[failure] in backend.errors[0]
    assert len(api.paths(PATH)) == (2 if failure == "400" else 4)  # 1 + 1 retry each; a 400 is not retried


def test_backend_503_then_200_keeps_token_ids(api):
    api.on(PATH, (503, b"busy"), (200, vllm_answer("<answer>1900")))
    with OpenAIBackend(f"{api.url}/v1", "m", retries=1, backoff_s=0.01, token_ids=True) as backend:
        (gen,) = backend.generate([[{"role": "user", "content": "hi"}]], max_new_tokens=8, temperature=1.0,
                                  top_p=1.0, seed=0)
        assert backend.requests == 2 and not backend.errors
    assert gen.finish_reason == "stop" and gen.text == "<answer>1900</answer>" and gen.token_ids == [11, 12, 13]
    assert api.paths(PATH)[-1][2]["return_tokens_as_token_ids"] is True


def test_summariser_failure_is_a_web_search_error_without_the_key(api, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    api.on(PATH, (500, {"error": f"echo {SECRET}"}))
    summ = OpenAISummarizer(f"{api.url}/v1", "m", retries=1, backoff_s=0.01, timeout_s=2)
    with pytest.raises(WebSearchError, match=r"summariser at .* failed after 2 attempt\(s\): HTTP 500") as ei:
        summ.summarize("q", [TextHit("d", "", "t", "x", 1.0)])
    assert SECRET not in str(ei.value) and (summ.calls, summ.failures, summ.retries_done) == (1, 1, 1)
