"""Web backends (Serper search, OpenAI-compatible summariser) against real local servers on 127.0.0.1.

A threaded ``http.server`` speaks Serper's and OpenAI's JSON; each test scripts its answers (status, body,
delay) and reads back the requests it received. Only environment variables are monkeypatched.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mars.tools.text_index import TextHit
from mars.tools.toolbox import ToolBox, ToolConfig
from mars.tools.web import MissingAPIKeyError, OpenAISummarizer, SerperSearch, WebSearchError, WebTextSearch

KEY = "sk-test-SECRET-0123456789abcdef"

SERPER_ANSWER = {
    "searchParameters": {"q": "velmora observatory founded", "type": "search", "engine": "google"},
    "answerBox": {
        "title": "Velmora Observatory - Founded",
        "answer": "1872",
        "snippet": "The Velmora Observatory was founded in 1872 by Ardis Kell.",
        "link": "https://example.org/velmora",
    },
    "knowledgeGraph": {
        "title": "Velmora Observatory",
        "type": "Observatory",
        "description": "Astronomical observatory in Ornil.",
        "descriptionLink": "https://en.wikipedia.org/wiki/Velmora_Observatory",
        "attributes": {"Founded": "1872", "Founder": "Ardis Kell"},
    },
    "organic": [
        {"title": "Velmora Observatory - Wikipedia", "link": "https://en.wikipedia.org/wiki/Velmora_Observatory",
         "snippet": "Velmora Observatory is an astronomical observatory in Ornil, founded in 1872.", "position": 1},
        {"title": "History of Velmora", "link": "https://history.example.com/velmora",
         "snippet": "Ardis Kell built the first dome   in 1872.\n", "position": 2,
         "sitelinks": [{"title": "Domes", "link": "https://history.example.com/velmora/domes"}]},
        {"title": "Velmara Press", "link": "https://press.example.com/", "snippet": "A printing house.",
         "position": 3, "date": "Jan 1, 2020"},
    ],
    "peopleAlsoAsk": [{"question": "Who founded Velmora?", "snippet": "Ardis Kell", "title": "x", "link": "y"}],
    "relatedSearches": [{"query": "velmora observatory tours"}],
    "credits": 1,
}


def chat_answer(content: str) -> dict:
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


class FakeAPI:
    """A scripted JSON server: ``script[path]`` is a list of (status, body, delay_s, headers) consumed in
    order (the last entry repeats); ``requests`` records (path, headers, json body) of every request, in the order
    they arrived, and ``answered`` the path of every answer once its delay is over, in that order."""

    def __init__(self) -> None:
        self.script: dict[str, list[tuple[int, object, float, dict]]] = {}
        self.requests: list[tuple[str, dict[str, str], object]] = []
        self.answered: list[str] = []
        self._lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(n)
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = raw
                with api._lock:
                    api.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    steps = api.script.get(self.path) or [(404, {"message": "no such path"}, 0.0, {})]
                    step = steps.pop(0) if len(steps) > 1 else steps[0]
                status, payload, delay, headers = step
                if delay:
                    time.sleep(delay)
                with api._lock:
                    api.answered.append(self.path)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timeout tests)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def on(self, path: str, *steps: tuple) -> None:
        self.script[path] = [tuple(s) + ((0.0, {})[len(s) - 2:]) for s in steps]

    def paths(self, path: str) -> list:
        return [r for r in self.requests if r[0] == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def api():
    srv = FakeAPI()
    yield srv
    srv.close()


@pytest.fixture()
def keys(monkeypatch):
    monkeypatch.setenv("SERPER_API_KEY", KEY)
    monkeypatch.setenv("OPENAI_API_KEY", KEY + "-openai")


def serper(api: FakeAPI, **kw) -> SerperSearch:
    kw.setdefault("backoff_s", 0.01)
    return SerperSearch(base_url=api.url, **kw)


# --- Serper ---------------------------------------------------------------------------------------------


def test_parses_realistic_serper_answer(api, keys):
    api.on("/search", (200, SERPER_ANSWER))
    with serper(api) as s:
        hits = s.search("velmora observatory founded", k=5)
    assert all(isinstance(h, TextHit) for h in hits)
    assert [h.title for h in hits] == ["Velmora Observatory - Founded", "Velmora Observatory",
                                       "History of Velmora", "Velmara Press"]
    ab, kg, h2, h3 = hits
    assert ab.doc_id == "https://example.org/velmora" and ab.score == 2.0
    assert ab.text == "The Velmora Observatory was founded in 1872 by Ardis Kell."  # answer is inside the snippet
    assert kg.doc_id == "https://en.wikipedia.org/wiki/Velmora_Observatory" and kg.score == 1.5
    assert "Observatory. Astronomical observatory in Ornil. Founded: 1872. Founder: Ardis Kell." == kg.text
    # organic #1 has the knowledge graph's link: deduplicated
    assert h2 == TextHit("https://history.example.com/velmora", "", "History of Velmora",
                         "Ardis Kell built the first dome in 1872.", 0.5)
    assert h3.score == pytest.approx(1 / 3) and h3.entity_id == ""
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    # request shape: POST /search, {"q", "num"}, key header
    (path, headers, body), = api.requests
    assert path == "/search" and body == {"q": "velmora observatory founded", "num": 5}
    assert headers["x-api-key"] == KEY and headers["content-type"] == "application/json"


def test_organic_only_and_k_cap(api, keys):
    api.on("/search", (200, SERPER_ANSWER))
    s = serper(api, include_boxes=False)
    hits = s.search("  velmora\n observatory ", k=2)
    assert [h.doc_id for h in hits] == ["https://en.wikipedia.org/wiki/Velmora_Observatory",
                                        "https://history.example.com/velmora"]
    assert [h.score for h in hits] == [1.0, 0.5]
    assert api.requests[-1][2] == {"q": "velmora observatory", "num": 2}
    # missing positions fall back to the order; odd entries are skipped; no results -> []
    assert SerperSearch.parse({"organic": [{"title": "a", "link": "l1", "snippet": "x"}, "junk",
                                           {"title": "b", "link": "l2", "snippet": "y", "position": None}]}, 5) == [
        TextHit("l1", "", "a", "x", 1.0), TextHit("l2", "", "b", "y", 1 / 3)]
    assert SerperSearch.parse({"searchParameters": {}}, 5) == []
    with pytest.raises(WebSearchError):
        SerperSearch.parse(["not", "an", "object"], 5)


def test_missing_key_names_the_variable(api, monkeypatch):
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    s = serper(api)
    with pytest.raises(MissingAPIKeyError, match="SERPER_API_KEY"):
        s.search("anything", 3)
    monkeypatch.setenv("SERPER_API_KEY", "   ")
    with pytest.raises(MissingAPIKeyError, match="SERPER_API_KEY"):
        s.search("anything", 3)
    monkeypatch.setenv("MY_SERPER", KEY)
    api.on("/search", (200, SERPER_ANSWER))
    assert serper(api, api_key_env="MY_SERPER").search("anything", 1)
    assert api.requests[-1][1]["x-api-key"] == KEY


def test_empty_query_is_a_value_error(api, keys):
    s = serper(api)
    for q in ("", "   \n"):
        with pytest.raises(ValueError, match="query"):
            s.search(q, 3)
    with pytest.raises(ValueError, match="k must"):
        s.search("x", 0)
    assert api.requests == []


def test_500_then_success_is_retried(api, keys):
    api.on("/search", (500, {"message": "oops"}), (200, SERPER_ANSWER))
    s = serper(api)
    hits = s.search("velmora", 3)
    assert len(hits) == 3 and len(api.paths("/search")) == 2
    assert (s.calls, s.failures, s.retries_done) == (1, 0, 1)


def test_persistent_5xx_raises_after_retries(api, keys, caplog):
    api.on("/search", (503, {"message": f"overloaded, your key {KEY} is fine"}))
    s = serper(api, retries=2)
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(WebSearchError) as ei:
            s.search("velmora", 3)
    msg = str(ei.value)
    assert "503" in msg and "3 attempt(s)" in msg
    assert len(api.paths("/search")) == 3 and (s.calls, s.failures, s.retries_done) == (1, 1, 2)
    # the server echoed the key back: it is scrubbed from the error and the logs
    assert KEY not in msg and "***" in msg
    assert KEY not in caplog.text and "retry 1/2" in caplog.text


def test_400_is_not_retried(api, keys):
    api.on("/search", (400, {"message": "Query not allowed", "statusCode": 400}))
    s = serper(api, retries=3)
    with pytest.raises(WebSearchError, match="400.*Query not allowed"):
        s.search("velmora", 3)
    assert len(api.paths("/search")) == 1


def test_403_names_the_variable_not_the_key(api, keys):
    api.on("/search", (403, {"message": "Unauthorized."}))
    with pytest.raises(WebSearchError) as ei:
        serper(api).search("velmora", 3)
    assert "SERPER_API_KEY" in str(ei.value) and KEY not in str(ei.value) and "403" in str(ei.value)
    assert len(api.requests) == 1


def test_429_is_retried(api, keys):
    api.on("/search", (429, {"message": "rate limited"}, 0.0, {"Retry-After": "0.05"}),
           (429, {"message": "rate limited"}), (200, SERPER_ANSWER))
    s = serper(api, retries=2)
    t0 = time.perf_counter()
    assert s.search("velmora", 1)[0].title == "Velmora Observatory - Founded"
    assert len(api.paths("/search")) == 3
    assert time.perf_counter() - t0 >= 0.05  # Retry-After honoured


def test_timeout_is_retried_then_raises(api, keys):
    api.on("/search", (200, SERPER_ANSWER, 5.0, {}))
    s = serper(api, timeout_s=0.1, retries=1)
    with pytest.raises(WebSearchError, match="Timeout"):
        s.search("velmora", 3)
    # both attempts were sent, and given up, before the first slow answer was ready: the client did not wait for it
    # (how long giving up takes against waiting: bench/bench_bounds.py)
    assert len(api.paths("/search")) == 2 and api.answered == [] and s.failures == 1


def test_timeout_then_fast_answer_succeeds(api, keys):
    api.on("/search", (200, SERPER_ANSWER, 1.0, {}), (200, SERPER_ANSWER))
    assert len(serper(api, timeout_s=0.2, retries=1).search("velmora", 2)) == 2


def test_connection_refused_is_retried_then_raises(keys):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = SerperSearch(base_url=f"http://127.0.0.1:{port}", retries=1, backoff_s=0.01, timeout_s=2)
    with pytest.raises(WebSearchError, match="ConnectError") as ei:
        s.search("velmora", 3)
    assert KEY not in str(ei.value) and s.retries_done == 1


def test_non_json_answer_raises(api, keys):
    api.on("/search", (200, b"<html>captive portal</html>"))
    with pytest.raises(WebSearchError, match="not JSON"):
        serper(api).search("velmora", 3)


def test_key_not_in_repr(keys):
    s = SerperSearch(base_url="http://127.0.0.1:9")
    assert KEY not in repr(s) and KEY not in repr(vars(s))


# --- summariser -------------------------------------------------------------------------------------------


PAGES = [TextHit(f"https://e.org/{i}", "", f"Page {i}", f"snippet number {i} " + "x" * 300, 1 / (i + 1))
         for i in range(10)]


def test_summarizer_request_shape_and_caps(api, keys):
    long = "<think>private reasoning</think>  " + "Velmora was founded in 1872. " * 50
    api.on("/v1/chat/completions", (200, chat_answer(long)))
    summ = OpenAISummarizer(f"{api.url}/v1", "qwen-test", max_chars=500)
    out = summ.summarize("When was Velmora founded?", PAGES)
    assert len(out) <= 500 and out.startswith("Velmora was founded in 1872.") and out.endswith("...")
    assert "think" not in out
    (path, headers, body), = api.requests
    assert path == "/v1/chat/completions"
    assert headers["authorization"] == f"Bearer {KEY}-openai"
    assert body["model"] == "qwen-test" and body["temperature"] == 0.0 and body["max_tokens"] == 500 // 3
    system, user = body["messages"]
    assert system["role"] == "system" and user["role"] == "user"
    assert user["content"].startswith("Query: When was Velmora founded?\n\nSnippets:\n[1] Page 0: snippet number 0")
    assert len(user["content"]) <= 500  # input capped
    assert "[2] Page 1:" in user["content"] and "[10]" not in user["content"]


def test_summarizer_no_pages_no_call_and_no_key_mode(api, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    summ = OpenAISummarizer(f"{api.url}/v1", "m")
    assert summ.summarize("q", []) == ""
    with pytest.raises(MissingAPIKeyError, match="OPENAI_API_KEY"):
        summ.summarize("q", PAGES[:1])
    api.on("/v1/chat/completions", (200, chat_answer("ok")))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # never sent where api_key_env=None asks for no key
    local = OpenAISummarizer(f"{api.url}/v1", "m", api_key_env=None)  # a local vLLM server: no key
    assert local.summarize("q", PAGES[:1]) == "ok"
    assert api.requests[-1][1]["authorization"] == "Bearer EMPTY"  # the openai package's placeholder


def test_summarizer_retry_rules(api, keys):
    api.on("/v1/chat/completions", (502, b"bad gateway"), (429, {"error": "slow down"}), (200, chat_answer("fine")))
    summ = OpenAISummarizer(f"{api.url}/v1", "m", retries=2, backoff_s=0.01)
    assert summ.summarize("q", PAGES[:2]) == "fine" and summ.retries_done == 2
    api.on("/v1/chat/completions", (401, {"error": {"message": f"bad key {KEY}-openai"}}))
    with pytest.raises(WebSearchError) as ei:
        summ.summarize("q", PAGES[:2])
    assert "OPENAI_API_KEY" in str(ei.value) and KEY not in str(ei.value)
    assert len(api.paths("/v1/chat/completions")) == 4  # 401 not retried
    api.on("/v1/chat/completions", (200, {"choices": []}))
    with pytest.raises(WebSearchError, match="choices"):
        summ.summarize("q", PAGES[:2])


# --- WebTextSearch and ToolBox ---------------------------------------------------------------------------


def test_web_text_search_prepends_summary(api, keys):
    api.on("/search", (200, SERPER_ANSWER))
    api.on("/v1/chat/completions", (200, chat_answer("Founded 1872 by Ardis Kell.")))
    web = WebTextSearch(serper(api), OpenAISummarizer(f"{api.url}/v1", "m"))
    hits = web.search("velmora founded", 3)
    assert len(hits) == 3
    assert hits[0].title == "Summary" and hits[0].text == "Founded 1872 by Ardis Kell." and hits[0].score > 2.0
    assert [h.title for h in hits[1:]] == ["Velmora Observatory - Founded", "Velmora Observatory"]
    # the summary saw all 3 fetched pages
    user = api.paths("/v1/chat/completions")[0][2]["messages"][1]["content"]
    assert "[3] History of Velmora" in user
    # summariser down -> plain pages, counted
    api.on("/v1/chat/completions", (500, b"down"))
    web.summarizer.backoff_s = 0.0
    hits = web.search("velmora founded", 3)
    assert [h.title for h in hits][0] == "Velmora Observatory - Founded" and web.summary_failures == 1
    # no hits -> no summary call
    n = len(api.paths("/v1/chat/completions"))
    api.on("/search", (200, {"organic": []}))
    assert web.search("nothing", 3) == [] and len(api.paths("/v1/chat/completions")) == n


def test_toolbox_text_search_through_local_serper(api, keys):
    api.on("/search", (200, SERPER_ANSWER))
    box = ToolBox(text_index=WebTextSearch(serper(api)), image_index=None, gallery_dir=None, cfg=ToolConfig())
    obs = box.call("text_search", {"query": "Velmora Observatory founded"}, images=[])
    assert obs.ok, obs.text
    assert obs.text.splitlines() == [
        "[1] Velmora Observatory - Founded: The Velmora Observatory was founded in 1872 by Ardis Kell.",
        "[2] Velmora Observatory: Observatory. Astronomical observatory in Ornil. Founded: 1872. Founder: Ardis Kell.",
        "[3] History of Velmora: Ardis Kell built the first dome in 1872.",
    ]
    assert api.requests[-1][2] == {"q": "Velmora Observatory founded", "num": 3}  # ToolConfig.text_k
    # with a summariser: the summary is hit [1]
    api.on("/v1/chat/completions", (200, chat_answer("Velmora Observatory: founded 1872.")))
    box2 = ToolBox(WebTextSearch(serper(api), OpenAISummarizer(f"{api.url}/v1", "m")), None, None, ToolConfig())
    obs = box2.call("text_search", {"query": "Velmora founded"}, images=[])
    assert obs.ok and obs.text.splitlines()[0] == "[1] Summary: Velmora Observatory: founded 1872."
    # backend failures become error observations, never exceptions, and never show the key
    api.on("/search", (500, {"message": f"echo {KEY}"}))
    obs = box.call("text_search", {"query": "Velmora"}, images=[])
    assert not obs.ok and obs.error.startswith("internal tool error: WebSearchError") and KEY not in obs.text
    # a bad call is still rejected before the network
    n = len(api.requests)
    assert not box.call("text_search", {"query": "  "}, images=[]).ok and len(api.requests) == n
