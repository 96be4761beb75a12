"""Web backends for ``text_search``: Serper (Google) search over httpx and an optional summariser LLM.

What it does
    :class:`SerperSearch` answers ``search(query, k) -> list[TextHit]`` from the `Serper
    <https://serper.dev>`_ Google search API: ``POST {base_url}/search`` with ``{"q": query, "num": k}`` and
    the API key in the ``X-API-KEY`` header, read from the environment variable ``api_key_env``
    (``SERPER_API_KEY``) at each call. The JSON answer is mapped to :class:`~mars.tools.text_index.TextHit`:

    - ``answerBox`` (if any) first: ``doc_id`` = its link (or ``serper:answerBox``), title = its title
      (or ``"Answer"``), text = its ``answer`` and/or ``snippet``, score 2.0;
    - ``knowledgeGraph`` (if any) next: title, text = ``type``, ``description`` and the ``attributes``
      as ``key: value`` pairs, ``doc_id`` = its ``descriptionLink``/``website`` (or ``serper:knowledgeGraph``),
      score 1.5;
    - ``organic`` results: ``TextHit(doc_id=link, entity_id="", title, text=snippet, score=1/position)``.

    Results are best first, duplicates (same link) dropped, at most ``k`` in all (the boxes count toward
    ``k``: they are the most informative hits; ``include_boxes=False`` keeps only organic results).

    :class:`OpenAISummarizer` asks an OpenAI-compatible ``POST {base_url}/chat/completions`` endpoint (vLLM,
    an API model) to summarise the snippets for the query: the numbered ``[i] title: text`` snippets are cut
    to ``max_chars`` characters of input, the answer (``<think>`` blocks removed) to ``max_chars`` characters
    of output. The request goes through :class:`mars.llm_client.ChatClient` (the ``openai`` package). The key
    (``Authorization: Bearer``) comes from ``api_key_env`` at each call; ``api_key_env=None`` sends the
    placeholder ``EMPTY`` (a local vLLM server).

    :class:`WebTextSearch` puts both behind the :class:`~mars.tools.text_index.TextIndex` interface
    (``search(query, k)``), so ``ToolBox(text_index=WebTextSearch(...), ...)`` serves ``text_search`` from
    the web. With a summariser it returns a synthetic hit titled ``"Summary"`` first, followed by the top
    ``k - 1`` pages (the summary covers all ``k`` fetched pages); if the summariser fails, the pages are
    returned without a summary (logged and counted in ``summary_failures``). ToolBox cuts every snippet to
    ``ToolConfig.max_snippet_chars`` (300), so raise it to show long summaries in full.

    Network rules (the policy of :mod:`mars.retry`, as for :class:`mars.tools.service.RemoteToolBox`): a
    timeout per attempt (``timeout_s``); network errors (connection refused, timeouts, dropped connections),
    HTTP 5xx and 429 are retried ``retries`` times with exponential backoff ``backoff_s * 2**attempt`` (a
    longer ``Retry-After`` is honoured up to 30 s); any other 4xx raises :class:`WebSearchError` at once
    (401/403 name the key's environment variable). Serper is retried by :func:`mars.retry.retrying`, the
    summariser by the ``openai`` package with the same waits. A missing key raises
    :class:`MissingAPIKeyError` naming the variable. The counters ``calls``, ``failures`` and
    ``retries_done`` are kept on each backend. The key is never logged and never put in an error message
    (every message is scrubbed of it, even if a server echoes it back).
    An empty query raises ``ValueError``. Inside ToolBox, any of these exceptions becomes an
    ``internal tool error: ...`` observation, never a crash.

Deviation from the paper
    The MARS reference searches the live web with Serper and condenses pages with a summariser LLM. The
    default pipeline here stays OFFLINE: ``text_search`` is BM25 over the generated world corpus
    (:mod:`mars.tools.text_index`), which is reproducible and needs no key or network. This module is the
    scale-up path (docs/design.md, The scale path: a web search API through httpx); pair it with a
    :class:`~mars.tools.cache.ToolCache` (content-addressed, keyed on the query) so reruns replay results
    instead of paying for them. Serper returns snippets, not page text: we summarise the snippets (the
    reference can also fetch pages).

How to run
    >>> import os; os.environ["SERPER_API_KEY"] = "..."
    >>> web = WebTextSearch(SerperSearch(), OpenAISummarizer("http://127.0.0.1:8000/v1", "Qwen2.5-7B-Instruct",
    ...                                                      api_key_env=None))
    >>> web.search("Velmora Observatory founded", k=5)
    >>> box = ToolBox(text_index=web, image_index=None, gallery_dir=None, cfg=ToolConfig(max_snippet_chars=1000))
    >>> box.call("text_search", {"query": "Velmora Observatory founded"}, images=[])
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from typing import Any

import httpx

from mars.errors import StageError
from mars.llm_client import ChatClient, LLMError
from mars.retry import describe, retryable_status, retrying
from mars.tools.text_index import TextHit

__all__ = ["MissingAPIKeyError", "OpenAISummarizer", "SerperSearch", "WebSearchError", "WebTextSearch"]

log = logging.getLogger(__name__)

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


class WebSearchError(StageError, RuntimeError):
    """A web backend call failed (HTTP error, network error after retries, unreadable answer)."""


class MissingAPIKeyError(WebSearchError):
    """The environment variable holding the API key is unset or empty."""


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - 3)].rstrip() + "..."


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class _Backend:
    """Shared by both backends: argument checks, key lookup, scrubbing."""

    _what = "web backend"

    def __init__(self, base_url: str, api_key_env: str | None, timeout_s: float, retries: int,
                 backoff_s: float) -> None:
        if not isinstance(base_url, str) or not base_url.strip():
            raise ValueError(f"{type(self).__name__}: base_url must be a non-empty URL, got {base_url!r}")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"{type(self).__name__}: timeout_s must be a positive number, got {timeout_s!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"{type(self).__name__}: retries must be an integer >= 0, got {retries!r}")
        if not (isinstance(backoff_s, (int, float)) and backoff_s >= 0 and math.isfinite(backoff_s)):
            raise ValueError(f"{type(self).__name__}: backoff_s must be a number >= 0, got {backoff_s!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key_env = api_key_env
        self.timeout_s = float(timeout_s)
        self.retries = retries

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:  # never shows the key (it is not stored anyway)
        return f"{type(self).__name__}(base_url={self.base_url!r}, api_key_env={self.api_key_env!r})"

    def _key(self) -> str | None:
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env, "").strip()
        if not key:
            raise MissingAPIKeyError(
                f"{self._what}: the environment variable {self.api_key_env} is not set; export your API key in "
                f"{self.api_key_env} to use it (the default pipeline is offline and needs no key)"
            )
        return key

    def _key_hint(self, status: int | None) -> str:
        if status in (401, 403) and self.api_key_env:
            return f" (check the API key in {self.api_key_env})"
        return ""

    @staticmethod
    def _scrub(message: str, key: str | None) -> str:
        if key:
            message = message.replace(key, "***")
        return message


class SerperSearch(_Backend):
    """Google search through Serper, answering ``search(query, k)`` with TextHits (see the module docstring)."""

    _what = "Serper search"

    def __init__(
        self,
        api_key_env: str = "SERPER_API_KEY",
        base_url: str = "https://google.serper.dev",
        *,
        k: int = 5,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        client: httpx.Client | None = None,
        include_boxes: bool = True,
        max_query_chars: int = 2048,
    ) -> None:
        if not isinstance(api_key_env, str) or not api_key_env:
            raise ValueError(f"SerperSearch: api_key_env must name an environment variable, got {api_key_env!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"SerperSearch: k must be a positive integer, got {k!r}")
        super().__init__(base_url, api_key_env, timeout_s, retries, backoff_s)
        self.backoff_s = float(backoff_s)
        self.k = k
        self.include_boxes = include_boxes
        self.max_query_chars = max_query_chars
        self._own_client = client is None
        self._client = client if client is not None else httpx.Client(timeout=self.timeout_s)
        self._lock = threading.Lock()
        self.calls = 0
        self.failures = 0
        self.retries_done = 0

    def close(self) -> None:
        """Close the httpx client if this backend created it."""
        if self._own_client:
            self._client.close()

    def _post(self, path: str, body: dict, headers: dict[str, str], key: str | None) -> Any:
        """POST ``body`` to ``base_url + path`` under :func:`mars.retry.retrying`; return the decoded JSON answer."""
        url = f"{self.base_url}{path}"

        def attempt() -> httpx.Response:
            resp = self._client.post(url, json=body, headers=headers, timeout=self.timeout_s)
            resp.raise_for_status()
            return resp

        def before_sleep(state: Any) -> None:
            with self._lock:
                self.retries_done += 1
            log.warning("%s: %s failed (%s); retry %d/%d in %.2fs", self._what, url,
                        self._scrub(describe(state.outcome.exception()), key), state.attempt_number, self.retries,
                        state.next_action.sleep)

        def fail(message: str) -> WebSearchError:
            with self._lock:
                self.calls += 1
                self.failures += 1
            return WebSearchError(self._scrub(message, key))

        try:
            resp = retrying(self.retries, self.backoff_s, before_sleep=before_sleep)(attempt)
        except httpx.HTTPStatusError as exc:
            status = exc.response.status_code
            if retryable_status(status):
                raise fail(f"{self._what}: {url} failed after {self.retries + 1} attempt(s): {describe(exc)}") \
                    from None
            raise fail(f"{self._what}: {url} refused the request with {describe(exc)}{self._key_hint(status)}") \
                from None
        except httpx.TransportError as exc:  # connect errors, timeouts, dropped connections
            raise fail(f"{self._what}: {url} failed after {self.retries + 1} attempt(s): {describe(exc)}") from None
        try:
            data = resp.json()
        except ValueError:
            raise fail(f"{self._what}: {url} answered HTTP {resp.status_code} with a body that is not JSON: "
                       f"{_cut(_one_line(resp.text), 200)!r}") from None
        with self._lock:
            self.calls += 1
        return data

    def search(self, query: str, k: int | None = None) -> list[TextHit]:
        """The top ``k`` (default ``self.k``) web results for ``query``, best first."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("SerperSearch.search: query must be a non-empty string")
        k = self.k if k is None else k
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"SerperSearch.search: k must be a positive integer, got {k!r}")
        query = _cut(_one_line(query), self.max_query_chars)
        key = self._key()
        data = self._post("/search", {"q": query, "num": k}, {"X-API-KEY": key}, key)
        return self.parse(data, k, self.include_boxes)

    @staticmethod
    def parse(data: Any, k: int, include_boxes: bool = True) -> list[TextHit]:
        """Map a Serper JSON answer to at most ``k`` TextHits, best first (see the module docstring)."""
        if not isinstance(data, dict):
            raise WebSearchError(f"Serper search: expected a JSON object, got {type(data).__name__}")
        hits: list[TextHit] = []
        seen: set[str] = set()

        def add(doc_id: str, title: str, text: str, score: float) -> None:
            if doc_id in seen or not (title or text):
                return
            seen.add(doc_id)
            hits.append(TextHit(doc_id=doc_id, entity_id="", title=title, text=text, score=score))

        def s(d: dict, name: str) -> str:
            v = d.get(name)
            return _one_line(v) if isinstance(v, (str, int, float)) and not isinstance(v, bool) else ""

        if include_boxes:
            box = data.get("answerBox")
            if isinstance(box, dict):
                parts = [p for p in (s(box, "answer"), s(box, "snippet")) if p]
                if len(parts) == 2 and parts[0] in parts[1]:
                    parts = parts[1:]
                add(s(box, "link") or "serper:answerBox", s(box, "title") or "Answer", " ".join(parts), 2.0)
            kg = data.get("knowledgeGraph")
            if isinstance(kg, dict):
                parts = [p for p in (s(kg, "type"), s(kg, "description")) if p]
                attrs = kg.get("attributes")
                if isinstance(attrs, dict):
                    parts += [f"{_one_line(a)}: {_one_line(v)}" for a, v in attrs.items()
                              if isinstance(v, (str, int, float))]
                text = ". ".join(p.rstrip(".") for p in parts) + ("." if parts else "")
                doc = s(kg, "descriptionLink") or s(kg, "website") or "serper:knowledgeGraph"
                add(doc, s(kg, "title") or "Knowledge graph", text, 1.5)
        organic = data.get("organic")
        if isinstance(organic, list):
            rows = []
            for i, r in enumerate(organic):
                if not isinstance(r, dict):
                    continue
                pos = r.get("position")
                if isinstance(pos, bool) or not isinstance(pos, (int, float)) or not pos >= 1 \
                        or not math.isfinite(pos):
                    pos = i + 1
                rows.append((float(pos), i, r))
            rows.sort(key=lambda t: (t[0], t[1]))
            for pos, i, r in rows:
                add(s(r, "link") or f"serper:organic:{i}", s(r, "title"), s(r, "snippet"), 1.0 / pos)
        return hits[:k]


class OpenAISummarizer(_Backend):
    """Summarise search snippets for a query with an OpenAI-compatible chat model (see the module docstring)."""

    _what = "summariser"

    SYSTEM = (
        "You condense web search results. Using only the numbered snippets, write a short factual summary "
        "of what they say that is relevant to the query: names, dates, places, numbers. Do not add facts that "
        "are not in the snippets; if they do not answer the query, say so."
    )

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key_env: str | None = "OPENAI_API_KEY",
        timeout_s: float = 30.0,
        retries: int = 2,
        max_chars: int = 2000,
        client: httpx.Client | None = None,
        *,
        backoff_s: float = 0.5,
        temperature: float = 0.0,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"OpenAISummarizer: model must be a non-empty string, got {model!r}")
        if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 20:
            raise ValueError(f"OpenAISummarizer: max_chars must be an integer >= 20, got {max_chars!r}")
        super().__init__(base_url, api_key_env, timeout_s, retries, backoff_s)
        self.model = model
        self.max_chars = max_chars
        self.temperature = temperature
        self.llm = ChatClient(self.base_url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                              http_client=client, name="summariser")

    def close(self) -> None:
        """Close the client's connection pool if this backend created it."""
        self.llm.close()

    @property
    def backoff_s(self) -> float:
        return self.llm.backoff_s

    @backoff_s.setter
    def backoff_s(self, value: float) -> None:
        self.llm.backoff_s = float(value)

    @property
    def calls(self) -> int:
        return self.llm.calls

    @property
    def failures(self) -> int:
        return self.llm.failures

    @property
    def retries_done(self) -> int:
        return self.llm.retries_done

    def prompt(self, query: str, pages: list[TextHit]) -> str:
        """The user message: the query and the numbered snippets, cut to ``max_chars`` characters."""
        head = f"Query: {_cut(_one_line(query), 500)}\n\nSnippets:\n"
        body = "\n".join(f"[{i}] {_one_line(p.title)}: {_one_line(p.text)}" for i, p in enumerate(pages, 1))
        return head + _cut(body, max(20, self.max_chars - len(head)))

    def request(self, query: str, pages: list[TextHit]) -> dict:
        """The JSON body sent to ``/chat/completions``."""
        return {
            "model": self.model,
            "messages": [{"role": "system", "content": self.SYSTEM},
                         {"role": "user", "content": self.prompt(query, pages)}],
            "temperature": self.temperature,
            # ~4 characters per token; the answer is cut to max_chars characters anyway
            "max_tokens": max(16, self.max_chars // 3),
        }

    def summarize(self, query: str, pages: list[TextHit]) -> str:
        """A summary of ``pages`` for ``query``, at most ``max_chars`` characters ("" when there are no pages)."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("OpenAISummarizer.summarize: query must be a non-empty string")
        if not pages:
            return ""
        key = self._key()
        headers = {"Authorization": f"Bearer {key}"} if key else None
        try:
            content = self.llm.text(self.request(query, pages), headers=headers)
        except LLMError as exc:
            hint = self._key_hint(exc.status) if exc.refused else ""
            raise WebSearchError(self._scrub(f"{exc}{hint}", key)) from None
        text = _THINK.sub("", content).strip()
        return _cut(text, self.max_chars)


class WebTextSearch:
    """Web search (plus an optional summary) behind ToolBox's text-index interface ``search(query, k)``."""

    def __init__(self, search: SerperSearch, summarizer: OpenAISummarizer | None = None) -> None:
        if not callable(getattr(search, "search", None)):
            raise TypeError(f"WebTextSearch: search must have a search(query, k) method, got {type(search).__name__}")
        self.searcher = search
        self.summarizer = summarizer
        self.summary_failures = 0

    def search(self, query: str, k: int = 5) -> list[TextHit]:
        """At most ``k`` hits, best first; with a summariser the first is the synthetic ``"Summary"`` hit."""
        hits = self.searcher.search(query, k)
        if self.summarizer is None or not hits:
            return hits
        try:
            summary = self.summarizer.summarize(query, hits)
        except WebSearchError as exc:
            self.summary_failures += 1
            log.warning("web text search: no summary (%s); returning the pages alone", exc)
            return hits
        if not summary:
            return hits
        top = max(h.score for h in hits)
        first = TextHit(doc_id=f"summary:{_cut(_one_line(query), 200)}", entity_id="", title="Summary",
                        text=summary, score=top + 1.0)
        return [first, *hits[: max(0, k - 1)]]

    def close(self) -> None:
        self.searcher.close()
        if self.summarizer is not None:
            self.summarizer.close()
