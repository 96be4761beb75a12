"""The one client of the pipeline's OpenAI-compatible chat endpoints, on the ``openai`` package.

What it does
    :class:`ChatClient` sends ``POST {base_url}/chat/completions`` through ``openai.OpenAI`` for every LLM the
    pipeline talks to: the rollout and teacher policy (:class:`mars.agent.backends.OpenAIBackend`), the LLM judge
    (:class:`mars.rl.judge.LLMJudge`), LLM question synthesis (:class:`mars.synth.llm.LLMSynthesizer`) and the
    web summariser (:class:`mars.tools.web.OpenAISummarizer`); the caller decides what a failed request means
    for it (an error Generation, :class:`~mars.rl.judge.JudgeUnavailable`, an ``endpoint_error`` reject, a
    page list without a summary).

    - :meth:`ChatClient.complete` takes a request body as a dict: the fields ``chat.completions.create`` knows
      (``model``, ``messages``, ``max_tokens``, ``logprobs``, ``seed``, ``stop``, ...) go as its arguments and
      any other key (vLLM's ``return_tokens_as_token_ids``, ``top_k``, ...) in ``extra_body``. It returns the
      answer as a dict that keeps the fields a server adds beyond OpenAI's schema (vLLM's ``stop_reason`` and
      ``token_ids`` per choice). :meth:`ChatClient.text` returns ``choices[0].message.content`` alone.
    - Retries are the ``openai`` package's (``max_retries = retries``): network errors, timeouts, 408, 409,
      429 and 5xx, with the waits of :mod:`mars.retry` (``backoff_s * 2**k``, a longer ``Retry-After`` honoured
      up to 30 s). Any other 4xx fails at once.
    - A request that still fails raises :class:`LLMError`, one line naming the endpoint, the HTTP status or the
      network error, and the number of attempts; so does an answer that is not a chat completion.
    - ``max_response_bytes`` (32 MiB; ``None``: no cap) bounds an answer's body: one declared larger
      (``Content-Length``) is refused before it is read, one streamed past the cap (chunked, or an endless body a
      read timeout never ends) is cut there. Either raises :class:`LLMError` at once, not retried (the same
      request would get the same body). A 50 MB answer read whole costs about 1.7x its size in memory.
    - ``timeout_s`` bounds each attempt (connect, read, write, pool). ``api_key`` is sent as
      ``Authorization: Bearer``; without one the placeholder ``"EMPTY"`` is sent (a local vLLM or ``mars serve``
      server ignores it), never the environment's ``OPENAI_API_KEY``. ``headers`` of one request override it.
    - Counters, safe across threads: ``calls`` (requests asked for), ``failures`` (of them, the ones that raised)
      and ``retries_done`` (retries over all requests). One client is shared by a caller's thread pool.

How to run
    Python::

        with ChatClient("http://127.0.0.1:8000/v1", timeout_s=30, retries=2) as llm:
            reply = llm.text({"model": "Qwen/Qwen2.5-VL-7B-Instruct",
                              "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16})

    Tests (real servers on 127.0.0.1): ``.venv/bin/python -m pytest tests/test_llm_client.py -q``.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import threading
import time
from typing import Any, Mapping

import httpx

from mars.errors import StageError
from mars.retry import backoff_delay, retry_after_s

__all__ = ["ChatClient", "LLMError", "message_text"]

log = logging.getLogger(__name__)


class LLMError(StageError, RuntimeError):
    """A chat request failed: refused, still failing after the retries, or answered with no chat completion.

    ``status`` is the last HTTP status (``None`` for a network error or an unreadable answer); ``refused`` is
    true for a 4xx that was not retried (the request's fault: a bad key, a bad model name, a bad body)."""

    def __init__(self, message: str, *, status: int | None = None, refused: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.refused = refused


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def message_text(data: Any, where: str = "the endpoint") -> str:
    """``choices[0].message.content`` of a chat completion as text (content parts joined; ``None`` -> ``""``).

    >>> message_text({"choices": [{"message": {"content": "Yes"}}]})
    'Yes'
    >>> message_text({"choices": [{"message": {"content": [{"type": "text", "text": "a"}, {"text": "b"}]}}]})
    'a b'
    """
    try:
        content = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise LLMError(f"{where} answered without choices[0].message.content: "
                       f"{_one_line(json.dumps(data, default=str))!r}") from None
    if content is None:
        return ""
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else json.dumps(content)


@functools.cache
def _sdk() -> tuple[type, frozenset[str]]:
    """The ``openai.OpenAI`` subclass and the arguments ``chat.completions.create`` takes, on first use (importing
    ``openai`` takes a second or two, which every process that imports the judge or the engine would pay)."""
    import openai
    from openai.resources.chat.completions import Completions

    class _OpenAI(openai.OpenAI):
        """``openai.OpenAI`` whose waits between retries are :mod:`mars.retry`'s, counted and logged by its
        :class:`ChatClient` (the package's own wait is 0.5 s doubling, with no knob)."""

        _owner: ChatClient

        def _sleep_for_retry(self, *, retries_taken: int, max_retries: int, response: Any = None, **_: Any) -> None:
            self._owner._wait_before_retry(retries_taken, max_retries, response)

    # any other key of a request body travels in extra_body
    create_args = frozenset(inspect.signature(Completions.create).parameters) - {
        "self", "extra_headers", "extra_query", "extra_body", "timeout", "stream", "stream_options"}
    return _OpenAI, create_args


MAX_RESPONSE_BYTES = 32 * 2**20  # the default cap on an answer's body


@functools.cache
def _too_large() -> type:
    """The error a capped body raises inside the HTTP client: an ``openai.OpenAIError``, which the ``openai``
    package passes on without retrying; :meth:`ChatClient.complete` turns it into an :class:`LLMError`."""
    import openai

    class ResponseTooLarge(openai.OpenAIError):
        def __init__(self, message: str, status: int) -> None:
            super().__init__(message)
            self.status = status

    return ResponseTooLarge


@functools.cache
def _capped_stream(base: type) -> type:
    """A ``SyncByteStream`` (of ``base``: httpx's or httpx2's, as the response's) that raises past ``cap`` bytes."""

    class CappedStream(base):
        def __init__(self, inner: Any, cap: int, status: int) -> None:
            self.inner, self.cap, self.status, self.seen = inner, cap, status, 0

        def __iter__(self):
            for chunk in self.inner:
                self.seen += len(chunk)
                if self.seen > self.cap:
                    raise _too_large()(f"a body over max_response_bytes ({self.cap:,} bytes; cut at "
                                       f"{self.seen:,})", self.status)
                yield chunk

        def close(self) -> None:
            self.inner.close()

    return CappedStream


class ChatClient:
    """An OpenAI-compatible ``/chat/completions`` endpoint with retries and counters (see the module docstring).

    ``http_client`` (an ``httpx.Client``) shares a connection pool; it is then not closed by :meth:`close`.
    ``name`` is how errors and logs call the endpoint ("judge", "summariser", ...). ``max_response_bytes`` caps
    an answer's body (see the module docstring; on a shared ``http_client`` only the requests to ``base_url``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        http_client: httpx.Client | None = None,
        name: str = "LLM endpoint",
        max_response_bytes: int | None = MAX_RESPONSE_BYTES,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.strip():
            raise ValueError(f"{name}: base_url must be a non-empty URL such as http://127.0.0.1:8000/v1, "
                             f"got {base_url!r}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"{name}: timeout_s must be a positive number, got {timeout_s!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"{name}: retries must be an integer >= 0, got {retries!r}")
        if not (isinstance(backoff_s, (int, float)) and math.isfinite(backoff_s) and backoff_s >= 0):
            raise ValueError(f"{name}: backoff_s must be a number >= 0, got {backoff_s!r}")
        if max_response_bytes is not None and (isinstance(max_response_bytes, bool)
                                               or not isinstance(max_response_bytes, int) or max_response_bytes < 1):
            raise ValueError(f"{name}: max_response_bytes must be an integer >= 1 or None, got {max_response_bytes!r}")
        self.max_response_bytes = max_response_bytes
        self.base_url = base_url.strip().rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.name = name
        self._own_client = http_client is None
        sdk_client, self._create_args = _sdk()
        self._hooked = http_client
        if http_client is None:
            import openai

            http_client = openai.DefaultHttpxClient()  # the client the package makes itself, with our hook
        http_client.event_hooks = {**http_client.event_hooks,
                                   "response": [*http_client.event_hooks.get("response", []), self._cap_response]}
        self._openai = sdk_client(base_url=self.base_url, api_key=api_key or "EMPTY", timeout=self.timeout_s,
                                  max_retries=retries, http_client=http_client)
        self._openai._owner = self
        self._lock = threading.Lock()
        self.calls = 0
        self.failures = 0
        self.retries_done = 0

    def close(self) -> None:
        """Close the connection pool if this client created it."""
        if self._own_client:
            self._openai.close()
        elif self._hooked is not None:  # a shared pool outlives this client: take our hook off it
            hooks = self._hooked.event_hooks
            self._hooked.event_hooks = {**hooks, "response": [h for h in hooks.get("response", [])
                                                              if h != self._cap_response]}
            self._hooked = None

    def __enter__(self) -> ChatClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:  # never shows the key
        return f"ChatClient({self.base_url!r}, name={self.name!r}, retries={self.retries})"

    def _cap_response(self, response: Any) -> None:
        """httpx response hook: refuse a body declared over ``max_response_bytes``, cut one streamed past it."""
        cap = self.max_response_bytes
        if cap is None or not str(response.request.url).startswith(self.base_url + "/"):
            return
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise _too_large()(f"a body over max_response_bytes ({cap:,} bytes; Content-Length {int(declared):,})",
                               response.status_code)
        base = next((c for c in type(response.stream).__mro__ if c.__name__ == "SyncByteStream"), None)
        if base is not None:  # a body already in memory (a test transport) has nothing left to cap
            response.stream = _capped_stream(base)(response.stream, cap, response.status_code)

    def _wait_before_retry(self, retries_taken: int, max_retries: int, response: httpx.Response | None) -> None:
        retry_after = retry_after_s(response.headers.get("retry-after")) if response is not None else None
        delay = backoff_delay(retries_taken, self.backoff_s, retry_after)
        with self._lock:
            self.retries_done += 1
        why = f"HTTP {response.status_code}" if response is not None else "network error or timeout"
        log.warning("%s: %s failed (%s); retry %d/%d in %.2fs", self.name, self.url, why, retries_taken + 1,
                    max_retries, delay)
        time.sleep(delay)

    def _error(self, exc: Exception) -> LLMError:
        import openai

        request = getattr(exc, "request", None)
        try:
            attempts = int(request.headers.get("x-stainless-retry-count", "0")) + 1
        except (AttributeError, TypeError, ValueError):
            attempts = 1
        where = f"{self.name} at {self.url}"
        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            detail = _one_line(exc.response.text)
            line = f"HTTP {status}" + (f": {detail}" if detail else "")
            if status < 500 and status not in (408, 409, 429):
                return LLMError(f"{where} refused the request with {line}", status=status, refused=True)
            return LLMError(f"{where} failed after {attempts} attempt(s): {line}", status=status)
        if isinstance(exc, openai.APITimeoutError):
            return LLMError(f"{where} failed after {attempts} attempt(s): Timeout: no answer within "
                            f"{self.timeout_s:g}s (timeout_s)")
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__
            reason = f"{type(cause).__name__}: {cause}" if cause is not None else f"{type(exc).__name__}: {exc}"
            return LLMError(f"{where} failed after {attempts} attempt(s): {_one_line(reason)}; "
                            f"is the server running?")
        return LLMError(f"{where} answered with no readable chat completion: {type(exc).__name__}: "
                        f"{_one_line(str(exc))}")

    def complete(self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None) -> dict:
        """Send one chat request; the answer as a dict, the server's extra fields kept. Raises :class:`LLMError`."""
        if "model" not in body or "messages" not in body:
            raise ValueError(f"{self.name}: a chat request needs 'model' and 'messages', got keys {sorted(body)}")
        import openai

        args = {k: v for k, v in body.items() if k in self._create_args}
        extra = {k: v for k, v in body.items() if k not in self._create_args}
        with self._lock:
            self.calls += 1
        try:
            try:
                answer = self._openai.chat.completions.create(**args, extra_body=extra or None,
                                                              extra_headers=dict(headers) if headers else None)
            except openai.APIError as exc:
                raise self._error(exc) from None
            except _too_large() as exc:
                raise LLMError(f"{self.name} at {self.url} answered HTTP {exc.status} with {exc}; not retried",
                               status=exc.status) from None
            except json.JSONDecodeError as exc:
                raise LLMError(f"{self.name} at {self.url} answered with a body that is not JSON: {exc}") from None
            if not hasattr(answer, "to_dict"):
                raise LLMError(f"{self.name} at {self.url} answered with a body that is not JSON: "
                               f"{_one_line(answer)!r}")
            return answer.to_dict()
        except LLMError:
            with self._lock:
                self.failures += 1
            raise

    def text(self, body: Mapping[str, Any], *, headers: Mapping[str, str] | None = None) -> str:
        """Send one chat request; ``choices[0].message.content`` (see :func:`message_text`). Raises :class:`LLMError`,
        also when the answer has no such field."""
        data = self.complete(body, headers=headers)
        try:
            return message_text(data, f"{self.name} at {self.url}")
        except LLMError:
            with self._lock:
                self.failures += 1
            raise
