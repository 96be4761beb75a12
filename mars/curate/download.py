"""The "urls" image source: download a URL list into a content-addressed raw pool.

:func:`download_urls` fetches each URL with a bounded thread pool sharing one
``httpx.Client`` (thread-safe) and returns ``(raw_images, failures)``: rows of the
``RAW_IMAGES`` schema (``source="urls"``) for stored images, sorted by ``image_id``, and
rows of the ``download_failures`` artifact (:data:`mars.data.schemas.DOWNLOAD_FAILURES`:
``url``, ``reason``, ``detail``) in input order.
Every input URL is in exactly one of the two tables, except that a URL whose content is
byte-identical to an earlier URL's lands in ``failures`` with reason ``duplicate_content``
(the content is stored once, under the first URL in input order, and RAW_IMAGES has no URL
column to record both).

Rules, with their failure reasons:

- only ``http``/``https`` URLs are requested (``bad_scheme``, no request made; a string
  httpx cannot parse is ``bad_url``);
- redirects are followed by hand, at most ``max_redirects`` (5) hops
  (``too_many_redirects``), and only to http/https targets (``bad_redirect``);
- connect errors, timeouts (``timeout_s`` for connect, read, write and pool), transport
  errors, HTTP 5xx and 429 are retried ``retries`` times (so ``1 + retries`` attempts) with
  exponential backoff ``backoff_s * 2**attempt`` (a longer ``Retry-After``, in seconds or an
  HTTP date, is honoured, capped at 30 s): the policy of :func:`mars.retry.retrying`; other
  4xx are not retried. Exhausted: ``timeout``, ``connect_error``, ``network_error`` or
  ``http_status`` (detail: the status line and attempt count);
- the body must be at most ``max_bytes``: refused up front when ``Content-Length``
  declares more, otherwise aborted while streaming as soon as the count exceeds it
  (``too_large``);
- ``Content-Type`` must be ``image/*`` (``bad_content_type``, checked before the body is
  read) and the first bytes must be a JPEG, PNG, GIF, WEBP, BMP or TIFF signature
  (``bad_magic``; an empty body is ``empty_body``);
- the body streams to a temp file in ``raw_dir`` while being hashed, and is then renamed
  (``os.replace``, atomic) to ``<sha256><ext>`` where ``ext`` comes from the magic bytes;
  ``image_id = "u-" + sha256[:16]``. Content already present is not written again.

:func:`failures_as_rejects` turns the failures into rows of the curate stage's ``rejects``
table, so every URL ends in ``curated`` or ``rejects`` with a reason: ``bad_magic`` and
``bad_content_type`` become ``not_an_image``, ``empty_body`` ``empty_file``, ``duplicate_content``
``exact_duplicate``, every other failure ``download_failed`` (the detail starts with the download
reason; the ``path`` column holds the URL).

Example::

    raw, failures = download_urls(["https://example.org/a.jpg"], Path("data/raw"))

Tests: ``python -m pytest tests/curate/test_download.py`` (a real local HTTP server).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import httpx
import pyarrow as pa
from tqdm import tqdm

from mars.curate.probe import extension_for, sniff_format
from mars.data.io import plain_file_mode
from mars.data.schemas import DOWNLOAD_FAILURES as FAILURES
from mars.data.schemas import RAW_IMAGES, REJECTS
from mars.retry import retry_after_s, retrying

ALLOWED_SCHEMES = frozenset({"http", "https"})
MAX_REDIRECTS = 5
_REDIRECT_CODES = frozenset({301, 302, 303, 307, 308})
_MAGIC_BYTES = 16


@dataclass(frozen=True)
class _Stored:
    url: str
    sha256: str
    path: str
    nbytes: int


class _Fail(Exception):
    def __init__(self, reason: str, detail: str, retryable: bool = False, retry_after: float | None = None) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.retryable = retryable
        self.retry_after = retry_after


def _check_scheme(url: httpx.URL, reason: str) -> None:
    if url.scheme not in ALLOWED_SCHEMES:
        raise _Fail(reason, f"scheme {url.scheme or '(none)'!r} not allowed in {str(url)!r}; only http/https")
    if not url.host:
        raise _Fail(reason, f"no host in {str(url)!r}")


class _Downloader:
    def __init__(
        self,
        client: httpx.Client,
        raw_dir: Path,
        timeout: httpx.Timeout,
        retries: int,
        backoff_s: float,
        max_bytes: int,
    ) -> None:
        self.client = client
        self.raw_dir = raw_dir
        self.timeout = timeout
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def fetch(self, url: str) -> _Stored:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError, ValueError) as e:
            raise _Fail("bad_url", f"cannot parse {url!r}: {e}") from None
        _check_scheme(parsed, "bad_scheme")
        try:
            return retrying(self.retries, self.backoff_s)(self._attempt, parsed, url)
        except _Fail as f:
            if not f.retryable:
                raise
            raise _Fail(f.reason, f"{f.detail} (after {1 + self.retries} attempts)") from None

    def _attempt(self, start: httpx.URL, original: str) -> _Stored:
        url = start
        for _hop in range(MAX_REDIRECTS + 1):
            try:
                with self.client.stream("GET", url, timeout=self.timeout, follow_redirects=False) as resp:
                    if resp.status_code in _REDIRECT_CODES:
                        location = resp.headers.get("location")
                        if not location:
                            raise _Fail("http_status", f"{resp.status_code} redirect without Location from {url}")
                        try:
                            nxt = url.join(location)
                        except (httpx.InvalidURL, ValueError) as e:
                            raise _Fail("bad_redirect", f"unparseable Location {location!r}: {e}") from None
                        _check_scheme(nxt, "bad_redirect")
                        url = nxt
                        continue
                    return self._accept(resp, original)
            except httpx.TimeoutException as e:
                raise _Fail("timeout", f"{type(e).__name__} after {self.timeout.read}s at {url}", retryable=True) from None
            except httpx.ConnectError as e:
                raise _Fail("connect_error", f"{e} ({url})", retryable=True) from None
            except httpx.TransportError as e:
                raise _Fail("network_error", f"{type(e).__name__}: {e} ({url})", retryable=True) from None
        raise _Fail("too_many_redirects", f"more than {MAX_REDIRECTS} redirects starting at {original}")

    def _accept(self, resp: httpx.Response, original: str) -> _Stored:
        code = resp.status_code
        if code >= 400 or code < 200:
            retryable = code >= 500 or code == 429
            raise _Fail(
                "http_status",
                f"{code} {resp.reason_phrase} from {resp.url}",
                retryable=retryable,
                retry_after=retry_after_s(resp.headers.get("retry-after")) if retryable else None,
            )
        ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
        if not ctype.startswith("image/"):
            raise _Fail("bad_content_type", f"Content-Type {ctype or '(none)'!r} is not image/* ({resp.url})")
        declared = resp.headers.get("content-length")
        if declared is not None:
            try:
                n_declared = int(declared)
            except ValueError:
                n_declared = -1
            if n_declared > self.max_bytes:
                raise _Fail("too_large", f"Content-Length {n_declared} > max {self.max_bytes} bytes")

        self.raw_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.raw_dir, prefix=".download-", suffix=".part")
        h = hashlib.sha256()
        head = b""
        total = 0
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in resp.iter_bytes():
                    total += len(chunk)
                    if total > self.max_bytes:
                        raise _Fail("too_large", f"body exceeded {self.max_bytes} bytes while streaming (aborted)")
                    if len(head) < _MAGIC_BYTES:
                        head += chunk[: _MAGIC_BYTES - len(head)]
                    h.update(chunk)
                    f.write(chunk)
                os.fchmod(f.fileno(), plain_file_mode())  # as a plain write, not mkstemp's 0600
            if total == 0:
                raise _Fail("empty_body", f"Content-Type {ctype!r} but the body is empty (0 bytes)")
            fmt = sniff_format(head)
            if fmt is None:
                raise _Fail("bad_magic", f"Content-Type {ctype!r} but body starts with {head[:8]!r}")
            sha = h.hexdigest()
            name = sha + extension_for(fmt)
            final = self.raw_dir / name
            with self._lock:
                if final.exists():
                    os.unlink(tmp)
                else:
                    os.replace(tmp, final)
            return _Stored(url=original, sha256=sha, path=name, nbytes=total)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def download_urls(
    urls: list[str],
    raw_dir: Path,
    *,
    concurrency: int = 8,
    timeout_s: float = 10.0,
    retries: int = 3,
    backoff_s: float = 0.5,
    max_bytes: int = 50_000_000,
    client: httpx.Client | None = None,
    progress: bool = True,
) -> tuple[pa.Table, pa.Table]:
    """Download ``urls`` into ``raw_dir``; return ``(raw_images, failures)`` (see module doc)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    raw_dir = Path(raw_dir)
    raw_dir.mkdir(parents=True, exist_ok=True)
    timeout = httpx.Timeout(timeout_s)
    own = client is None
    http = client or httpx.Client(
        timeout=timeout,
        follow_redirects=False,
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
    )
    dl = _Downloader(http, raw_dir, timeout, retries, backoff_s, max_bytes)
    outcomes: dict[int, _Stored | _Fail] = {}
    try:
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="download") as ex:
            futures = {ex.submit(dl.fetch, u): i for i, u in enumerate(urls)}
            with tqdm(total=len(urls), desc="download", unit="url", disable=not progress) as bar:
                for fut in as_completed(futures):
                    i = futures[fut]
                    try:
                        outcomes[i] = fut.result()
                    except _Fail as f:
                        outcomes[i] = f
                    except Exception as e:  # a bug or an unexpected library error: record, go on
                        outcomes[i] = _Fail("error", f"{type(e).__name__}: {e}")
                    bar.update(1)
    finally:
        if own:
            http.close()

    raw_rows: dict[str, dict[str, object]] = {}
    first_url: dict[str, str] = {}
    failures: list[dict[str, str]] = []
    for i, url in enumerate(urls):
        out = outcomes[i]
        if isinstance(out, _Fail):
            failures.append({"url": url, "reason": out.reason, "detail": out.detail})
            continue
        image_id = "u-" + out.sha256[:16]
        if out.sha256 in first_url:
            failures.append(
                {
                    "url": url,
                    "reason": "duplicate_content",
                    "detail": f"same bytes as {first_url[out.sha256]} (stored once as {out.path}, {image_id})",
                }
            )
            continue
        first_url[out.sha256] = url
        raw_rows[image_id] = {
            "image_id": image_id,
            "path": out.path,
            "source": "urls",
            "scene_id": None,
            "planted_case": None,
            "expected_reason": None,
            "bytes": out.nbytes,
            "sha256": out.sha256,
        }
    raw = pa.Table.from_pylist([raw_rows[k] for k in sorted(raw_rows)], schema=RAW_IMAGES)
    fails = pa.Table.from_pylist(failures, schema=FAILURES)
    assert raw.num_rows + fails.num_rows == len(urls), "every URL must be accounted for once"
    return raw, fails


# download failure reason -> curation's reject reason (others: download_failed)
FAILURE_REASONS_AS_REJECTS = {
    "bad_magic": "not_an_image",
    "bad_content_type": "not_an_image",
    "empty_body": "empty_file",
    "duplicate_content": "exact_duplicate",
}


def failure_id(url: str, occurrence: int = 1) -> str:
    """Image id of a URL that did not become a raw image: ``"u-url-"`` + sha256(url)[:12], and ``-<n>`` for the
    n-th listing (n >= 2) of the same URL. Distinct from the ``"u-"`` + content-hash ids of stored images."""
    base = "u-url-" + hashlib.sha256(url.encode("utf-8")).hexdigest()[:12]
    return base if occurrence == 1 else f"{base}-{occurrence}"


def failures_as_rejects(failures: pa.Table) -> pa.Table:
    """Rows of the ``rejects`` artifact (:data:`~mars.data.schemas.REJECTS`) for download failures (module doc):
    ``path`` is the URL, ``detail`` starts with the download reason. Sorted by image_id."""
    seen: dict[str, int] = {}
    rows = []
    for f in failures.to_pylist():
        seen[f["url"]] = seen.get(f["url"], 0) + 1
        rows.append({
            "image_id": failure_id(f["url"], seen[f["url"]]),
            "path": f["url"],
            "reason": FAILURE_REASONS_AS_REJECTS.get(f["reason"], "download_failed"),
            "detail": f"{f['reason']}: {f['detail']}",
        })
    return pa.Table.from_pylist(sorted(rows, key=lambda r: r["image_id"]), schema=REJECTS)
