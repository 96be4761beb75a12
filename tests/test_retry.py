"""The one retry policy (mars.retry) against a real scripted server on 127.0.0.1: directly over httpx, and through
the tool-service client (RemoteToolBox). Downloads and the Serper search are covered in their own test files.

The server is the web tests' ``FakeAPI``; backoffs are 0.01 s so the file stays fast.
"""

from __future__ import annotations

import doctest
import time

import httpx
import pytest

import mars.retry as retry_mod
from mars.retry import backoff_delay, describe, is_transient, retrying
from mars.tools.service import RemoteToolBox
from tests.tools.test_web import FakeAPI

TOOL = "/v1/tools/text_search"
OBSERVATION = {"text": "[1] Velmora: founded 1872.", "error": None, "images": [], "latency_s": 0.0}


@pytest.fixture()
def api():
    srv = FakeAPI()
    yield srv
    srv.close()


def post(client: httpx.Client, url: str) -> httpx.Response:
    resp = client.post(url, json={})
    resp.raise_for_status()
    return resp


def test_doctests():
    res = doctest.testmod(retry_mod)
    assert res.attempted >= 5 and res.failed == 0


def test_delays():
    assert [backoff_delay(k, 0.5) for k in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_delay(0, 0.5, retry_after=0.1) == 0.5  # a shorter Retry-After does not cut the backoff
    assert backoff_delay(0, 0.0, retry_after=float("inf")) == 0.0
    with pytest.raises(ValueError, match="retries"):
        retrying(-1, 0.5)
    with pytest.raises(ValueError, match="backoff_s"):
        retrying(1, -0.5)


def test_503_then_200_is_retried(api):
    api.on("/x", (503, {"message": "busy"}), (200, {"ok": True}))
    with httpx.Client(timeout=5) as c:
        resp = retrying(2, 0.01)(post, c, f"{api.url}/x")
    assert resp.json() == {"ok": True} and len(api.paths("/x")) == 2


def test_always_failing_reraises_the_last_error_after_one_plus_retries(api):
    api.on("/x", (500, {"message": "down"}))
    seen = []
    with httpx.Client(timeout=5) as c, pytest.raises(httpx.HTTPStatusError) as ei:
        retrying(2, 0.01, before_sleep=lambda s: seen.append(s.attempt_number))(post, c, f"{api.url}/x")
    assert len(api.paths("/x")) == 3 and seen == [1, 2]
    assert describe(ei.value) == 'HTTP 500: {"message": "down"}'


@pytest.mark.parametrize("status,transient", [(400, False), (404, False), (429, True), (502, True)])
def test_what_is_retried(api, status, transient):
    api.on("/x", (status, {"message": "no"}), (200, {"ok": True}))
    with httpx.Client(timeout=5) as c:
        if transient:
            assert retrying(1, 0.01)(post, c, f"{api.url}/x").json() == {"ok": True}
        else:
            with pytest.raises(httpx.HTTPStatusError) as ei:
                retrying(3, 0.01)(post, c, f"{api.url}/x")
            assert not is_transient(ei.value)
    assert len(api.paths("/x")) == (2 if transient else 1)


def test_retry_after_is_honoured(api):
    api.on("/x", (503, b"busy", 0.0, {"Retry-After": "0.3"}), (200, {"ok": True}))
    t0 = time.perf_counter()
    with httpx.Client(timeout=5) as c:
        retrying(1, 0.01)(post, c, f"{api.url}/x")
    assert time.perf_counter() - t0 >= 0.29


def test_timeouts_are_retried(api):
    api.on("/x", (200, {"ok": True}, 1.0, {}))
    t0 = time.perf_counter()
    with httpx.Client(timeout=0.2) as c, pytest.raises(httpx.ReadTimeout):
        retrying(1, 0.01)(post, c, f"{api.url}/x")
    assert time.perf_counter() - t0 < 0.9 and len(api.paths("/x")) == 2


# --- the tool-service client --------------------------------------------------------------------------------


def test_tool_client_503_then_200(api):
    api.on(TOOL, (503, b"busy"), (200, OBSERVATION))
    remote = RemoteToolBox(api.url, retries=2, backoff_s=0.01, timeout_s=5)
    obs = remote.call("text_search", {"query": "velmora"}, [])
    assert obs.error is None and obs.text == OBSERVATION["text"]
    assert (remote.calls, remote.failures) == (1, 0) and len(api.paths(TOOL)) == 2
    api.on(TOOL, (429, b"slow down"), (200, OBSERVATION))  # 429 is retried too
    assert remote.call("text_search", {"query": "velmora"}, []).error is None and len(api.paths(TOOL)) == 4


@pytest.mark.parametrize("step,requests,detail", [
    ((503, {"message": "busy"}), 3, 'HTTP 503: {"message": "busy"}'),  # 1 + 2 retries
    ((200, OBSERVATION, 1.0, {}), 3, "ReadTimeout"),
    ((400, {"message": "bad call"}), 1, "HTTP 400"),  # the call's fault: not retried
    ((200, {"no": "text"}), 1, "KeyError"),  # an unreadable answer: not retried
])
def test_tool_client_failures_are_counted_observations(api, step, requests, detail):
    api.on(TOOL, step)
    remote = RemoteToolBox(api.url, retries=2, backoff_s=0.01, timeout_s=0.2)
    obs = remote.call("text_search", {"query": "velmora"}, [])
    assert obs.error == "service_unavailable" and detail in obs.text and "\n" not in obs.text
    assert (remote.calls, remote.failures) == (1, 1) and len(api.paths(TOOL)) == requests
