"""The one retry policy of the pipeline's HTTP calls: what is retried, how long to wait, how many attempts.

What it does
    A call is retried when it failed for a reason that may go away: a network error (connection refused, a
    timeout, a dropped connection), HTTP 5xx or HTTP 429. Any other 4xx is the request's fault and is not
    retried. A call makes at most ``1 + retries`` attempts; after attempt ``k`` (0-based) it waits
    ``backoff_s * 2**k`` seconds, or the server's ``Retry-After`` (seconds or an HTTP date) when that is longer,
    capped at :data:`MAX_RETRY_AFTER_S`.

    :func:`retrying` builds this policy as a ``tenacity.Retrying`` for the httpx callers: image downloads
    (:mod:`mars.curate.download`), the tool-service client (:mod:`mars.tools.service`) and the Serper search
    (:mod:`mars.tools.web`). An exception is transient when it carries ``retryable=True`` (the callers' own
    failure types), or is an ``httpx.TransportError``, or an ``httpx.HTTPStatusError`` with a transient status;
    its wait honours a ``retry_after`` attribute or the response's ``Retry-After`` header. The OpenAI-compatible
    endpoints are retried by the ``openai`` package with the same waits (:func:`backoff_delay`; see
    :mod:`mars.llm_client`).

How to run
    >>> backoff_delay(2, 0.5)
    2.0
    >>> backoff_delay(0, 0.5, retry_after=3.0)
    3.0
    >>> backoff_delay(0, 0.5, retry_after=3600.0)
    30.0

    Python::

        page = retrying(retries=3, backoff_s=0.5)(client.get, url)   # raises the last error when all fail
"""

from __future__ import annotations

import email.utils
import math
import time
from typing import Any, Callable

import httpx
import tenacity

__all__ = ["MAX_RETRY_AFTER_S", "backoff_delay", "describe", "is_transient", "retry_after_s", "retryable_status",
           "retrying"]

MAX_RETRY_AFTER_S = 30.0  # the longest Retry-After honoured


def retryable_status(status: int) -> bool:
    """Whether an HTTP status is worth retrying: 429 or 5xx.

    >>> [retryable_status(s) for s in (200, 400, 404, 429, 500, 503)]
    [False, False, False, True, True, True]
    """
    return status == 429 or status >= 500


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (``None`` when absent or unreadable): a number of seconds or an HTTP date.

    >>> retry_after_s("1.5"), retry_after_s(None), retry_after_s("soon")
    (1.5, None, None)
    >>> retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT")  # in the past
    0.0
    """
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def backoff_delay(attempt: int, backoff_s: float, retry_after: float | None = None) -> float:
    """Seconds to wait after the failed attempt ``attempt`` (0-based): ``backoff_s * 2**attempt``, or the server's
    ``retry_after`` when longer, capped at :data:`MAX_RETRY_AFTER_S`."""
    delay = backoff_s * 2.0 ** min(attempt, 60)
    if retry_after is not None and math.isfinite(retry_after) and retry_after > 0:
        delay = max(delay, min(retry_after, MAX_RETRY_AFTER_S))
    return delay


def is_transient(exc: BaseException) -> bool:
    """Whether a failed attempt is worth retrying (see the module docstring)."""
    flag = getattr(exc, "retryable", None)
    if isinstance(flag, bool):
        return flag
    if isinstance(exc, httpx.HTTPStatusError):
        return retryable_status(exc.response.status_code)
    return isinstance(exc, httpx.TransportError)


def describe(exc: BaseException, body_chars: int = 200) -> str:
    """One line for a failed attempt: ``HTTP <status>: <start of the body>`` or ``<ErrorType>: <message>``."""
    if isinstance(exc, httpx.HTTPStatusError):
        try:
            detail = " ".join(exc.response.text.split())
        except httpx.ResponseNotRead:
            detail = ""
        if len(detail) > body_chars:
            detail = detail[: max(0, body_chars - 3)].rstrip() + "..."
        return f"HTTP {exc.response.status_code}" + (f": {detail}" if detail else "")
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _retry_after_of(exc: BaseException | None) -> float | None:
    value = getattr(exc, "retry_after", None)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(exc, httpx.HTTPStatusError):
        return retry_after_s(exc.response.headers.get("retry-after"))
    return None


class _wait_backoff(tenacity.wait.wait_base):
    """tenacity's wait for :func:`backoff_delay`, reading the failed attempt's Retry-After."""

    def __init__(self, backoff_s: float) -> None:
        self.backoff_s = backoff_s

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        exc = outcome.exception() if outcome is not None and outcome.failed else None
        return backoff_delay(retry_state.attempt_number - 1, self.backoff_s, _retry_after_of(exc))


def retrying(
    retries: int,
    backoff_s: float,
    *,
    before_sleep: Callable[[tenacity.RetryCallState], Any] | None = None,
) -> tenacity.Retrying:
    """The policy as a ``tenacity.Retrying``: at most ``1 + retries`` attempts of a call, transient failures
    retried after :func:`backoff_delay`, the last exception re-raised as it is. ``before_sleep(retry_state)`` runs
    before each wait (to count or log retries)."""
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an integer >= 0, got {retries!r}")
    if not (isinstance(backoff_s, (int, float)) and math.isfinite(backoff_s) and backoff_s >= 0):
        raise ValueError(f"backoff_s must be a number >= 0, got {backoff_s!r}")
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(1 + retries),
        wait=_wait_backoff(float(backoff_s)),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=before_sleep,
        reraise=True,
    )
