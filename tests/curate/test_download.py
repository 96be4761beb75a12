"""Tests of mars.curate.download against a real HTTP server on 127.0.0.1.

A ``ThreadingHTTPServer`` (port 0) in a background thread serves good images, slow,
flaky, missing, oversized, mislabelled and redirecting routes; the downloader runs with
tiny timeouts and backoffs so the file finishes in a few seconds.
Run: ``python -m pytest tests/curate/test_download.py -q``.
"""

from __future__ import annotations

import hashlib
import io
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from mars.curate.download import FAILURES, download_urls, failure_id, failures_as_rejects
from mars.data.schemas import RAW_IMAGES, REJECTS

TIMEOUT_S = 1.0  # a good image on 127.0.0.1 took over 0.3 s once on a loaded 2-core machine (a flaky failure)
MAX_BYTES = 200_000


def _image_bytes(fmt: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    im = Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8))
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


GOOD_PNG = _image_bytes("PNG", 1)
GOOD_JPEG = _image_bytes("JPEG", 2)
OTHER_PNG = _image_bytes("PNG", 3)
FLAKY_PNG = _image_bytes("PNG", 4)


class _Handler(BaseHTTPRequestHandler):
    hits: Counter[str] = Counter()
    lock = threading.Lock()

    def log_message(self, format: str, *args: object) -> None:  # silence stderr
        pass

    def _send(self, code: int, body: bytes, ctype: str = "image/png", length: int | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str, code: int = 302) -> None:
        self.send_response(code)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: C901 - a route table
        with self.lock:
            self.hits[self.path] += 1
            n = self.hits[self.path]
        try:
            if self.path in ("/good.png", "/copy-of-good.png"):
                self._send(200, GOOD_PNG, "image/png")
            elif self.path == "/good.jpg":
                self._send(200, GOOD_JPEG, "image/jpeg; charset=binary")
            elif self.path == "/other.png":
                self._send(200, OTHER_PNG, "image/png")
            elif self.path == "/slow.png":
                time.sleep(TIMEOUT_S * 3)
                self._send(200, GOOD_PNG)
            elif self.path == "/flaky.png":
                if n <= 2:
                    self._send(503, b"busy", "text/plain")
                else:
                    self._send(200, FLAKY_PNG)
            elif self.path == "/always-503.png":
                self._send(503, b"busy", "text/plain")
            elif self.path == "/missing.png":
                self._send(404, b"not found", "text/plain")
            elif self.path == "/stream-huge.png":
                # no Content-Length: HTTP/1.0 body delimited by connection close
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                self.wfile.write(GOOD_PNG[:16])
                chunk = b"\x00" * 16384
                for _ in range(4 * MAX_BYTES // len(chunk)):
                    self.wfile.write(chunk)
            elif self.path == "/declared-huge.png":
                self._send(200, GOOD_PNG, "image/png", length=10 * MAX_BYTES)
            elif self.path == "/empty.png":
                self._send(200, b"", "image/png")
            elif self.path == "/fake.png":
                self._send(200, b"<html><body>not an image</body></html>", "image/png")
            elif self.path == "/page.html":
                self._send(200, b"<html><body>hello</body></html>", "text/html")
            elif self.path == "/redirect":
                self._redirect("/hop")
            elif self.path == "/hop":
                self._redirect(f"http://127.0.0.1:{self.server.server_address[1]}/other.png", 301)
            elif self.path == "/redirect-ftp":
                self._redirect("ftp://127.0.0.1/secret.png")
            elif self.path == "/redirect-file":
                self._redirect("file:///etc/passwd")
            elif self.path == "/loop":
                self._redirect("/loop")
            else:
                self._send(404, b"no route", "text/plain")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client aborted (size cap): expected


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Counter[str]]]:
    _Handler.hits = Counter()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", _Handler.hits
    finally:
        httpd.shutdown()
        httpd.server_close()


ROUTES_OK = ["/good.png", "/good.jpg", "/flaky.png", "/redirect"]


def test_download_urls_end_to_end(server: tuple[str, Counter[str]], tmp_path: Path) -> None:
    base, hits = server
    urls = [base + p for p in ROUTES_OK] + [
        base + "/copy-of-good.png",
        base + "/slow.png",
        base + "/missing.png",
        base + "/always-503.png",
        base + "/stream-huge.png",
        base + "/declared-huge.png",
        base + "/fake.png",
        base + "/empty.png",
        base + "/page.html",
        base + "/redirect-ftp",
        base + "/redirect-file",
        base + "/loop",
        "ftp://127.0.0.1/x.png",
        "file:///etc/passwd",
        "http://127.0.0.1:1/refused.png",  # nothing listens on port 1
    ]
    raw_dir = tmp_path / "raw"
    t0 = time.perf_counter()
    raw, failures = download_urls(
        urls,
        raw_dir,
        concurrency=8,
        timeout_s=TIMEOUT_S,
        retries=2,
        backoff_s=0.01,
        max_bytes=MAX_BYTES,
        progress=False,
    )
    elapsed = time.perf_counter() - t0
    assert raw.schema.equals(RAW_IMAGES) and failures.schema.equals(FAILURES)
    assert raw.num_rows + failures.num_rows == len(urls)

    # successes: content-addressed, one row per distinct content
    contents = {GOOD_PNG: ".png", GOOD_JPEG: ".jpg", FLAKY_PNG: ".png", OTHER_PNG: ".png"}
    expect_rows = sorted(
        ("u-" + hashlib.sha256(b).hexdigest()[:16], hashlib.sha256(b).hexdigest() + ext, len(b))
        for b, ext in contents.items()
    )
    got_rows = sorted(zip(raw.column("image_id").to_pylist(), raw.column("path").to_pylist(), raw.column("bytes").to_pylist(), strict=True))
    assert got_rows == expect_rows
    assert set(raw.column("source").to_pylist()) == {"urls"}
    assert raw.column("image_id").to_pylist() == sorted(raw.column("image_id").to_pylist())
    for row in raw.to_pylist():
        data = (raw_dir / row["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == row["sha256"]
    stored = sorted(p.name for p in raw_dir.iterdir())
    assert stored == sorted(r[1] for r in expect_rows)  # duplicate stored once, no temp files left

    reasons = {row["url"][len(base):] if row["url"].startswith(base) else row["url"]: row for row in failures.to_pylist()}
    want = {
        "/copy-of-good.png": "duplicate_content",
        "/slow.png": "timeout",
        "/missing.png": "http_status",
        "/always-503.png": "http_status",
        "/stream-huge.png": "too_large",
        "/declared-huge.png": "too_large",
        "/fake.png": "bad_magic",
        "/empty.png": "empty_body",
        "/page.html": "bad_content_type",
        "/redirect-ftp": "bad_redirect",
        "/redirect-file": "bad_redirect",
        "/loop": "too_many_redirects",
        "ftp://127.0.0.1/x.png": "bad_scheme",
        "file:///etc/passwd": "bad_scheme",
        "http://127.0.0.1:1/refused.png": "connect_error",
    }
    assert {k: v["reason"] for k, v in reasons.items()} == want
    assert [r["url"] for r in failures.to_pylist()] == [u for u in urls if (u[len(base):] if u.startswith(base) else u) in want]
    assert "404" in reasons["/missing.png"]["detail"]
    assert "503" in reasons["/always-503.png"]["detail"] and "after 3 attempts" in reasons["/always-503.png"]["detail"]
    assert "Content-Length" in reasons["/declared-huge.png"]["detail"]
    assert "streaming" in reasons["/stream-huge.png"]["detail"]
    assert "/good.png" in reasons["/copy-of-good.png"]["detail"]

    # retry policy, seen from the server side
    assert hits["/flaky.png"] == 3  # two 503s, then success
    assert hits["/always-503.png"] == 3  # 1 + retries
    assert hits["/missing.png"] == 1  # 4xx: no retry
    assert hits["/slow.png"] == 3  # timeouts are retried
    assert hits["/loop"] == 6  # first request + 5 redirects followed
    assert hits["/declared-huge.png"] == 1 and hits["/page.html"] == 1
    assert "/secret.png" not in hits
    assert elapsed < 10.0


def test_uses_a_given_client_and_never_follows_redirects_itself(server: tuple[str, Counter[str]], tmp_path: Path) -> None:
    base, _ = server
    with httpx.Client(follow_redirects=True) as client:
        raw, failures = download_urls(
            [base + "/redirect-file", base + "/good.jpg"], tmp_path, client=client, timeout_s=TIMEOUT_S, progress=False
        )
        assert not client.is_closed  # the caller's client is left open
    assert failures.column("reason").to_pylist() == ["bad_redirect"]
    assert raw.num_rows == 1 and raw.column("path").to_pylist()[0].endswith(".jpg")


def test_rerun_is_idempotent(server: tuple[str, Counter[str]], tmp_path: Path) -> None:
    base, _ = server
    a, _ = download_urls([base + "/good.png"], tmp_path, timeout_s=TIMEOUT_S, progress=False)
    b, _ = download_urls([base + "/good.png"], tmp_path, timeout_s=TIMEOUT_S, progress=False)
    assert a.equals(b)
    assert len(list(tmp_path.iterdir())) == 1


def test_argument_checks(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        download_urls([], tmp_path, concurrency=0)
    raw, failures = download_urls([], tmp_path, progress=False)
    assert raw.num_rows == 0 and failures.num_rows == 0


def test_downloaded_files_get_the_mode_of_a_plain_write(server: tuple[str, Counter[str]], tmp_path: Path) -> None:
    import os
    import stat

    base, _ = server
    old = os.umask(0o027)
    try:
        raw, _ = download_urls([base + "/good.png"], tmp_path, timeout_s=TIMEOUT_S, progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / raw.column("path")[0].as_py()).stat().st_mode) == 0o640


def test_failures_become_rejects_with_curations_reasons() -> None:
    """Every failed URL becomes a reject row (path: the URL; detail: the download reason first); a URL listed
    twice gets a second id."""
    failures = pa.Table.from_pylist([
        {"url": "http://a/x.png", "reason": "bad_magic", "detail": "body starts with b'<html>'"},
        {"url": "http://a/y.png", "reason": "bad_content_type", "detail": "Content-Type 'text/html'"},
        {"url": "http://a/e.png", "reason": "empty_body", "detail": "0 bytes"},
        {"url": "http://a/c.png", "reason": "duplicate_content", "detail": "same bytes as http://a/g.png"},
        {"url": "http://a/m.png", "reason": "http_status", "detail": "404 Not Found"},
        {"url": "http://a/m.png", "reason": "timeout", "detail": "ReadTimeout"},
        {"url": "ftp://a/z.png", "reason": "bad_scheme", "detail": "scheme 'ftp' not allowed"},
    ], schema=FAILURES)
    rejects = failures_as_rejects(failures)
    assert rejects.schema.equals(REJECTS)
    rows = {r["image_id"]: r for r in rejects.to_pylist()}
    assert list(rows) == sorted(rows) and len(rows) == 7
    by_url = {(r["path"], r["detail"].split(":")[0]): r["reason"] for r in rows.values()}
    assert by_url == {
        ("http://a/x.png", "bad_magic"): "not_an_image",
        ("http://a/y.png", "bad_content_type"): "not_an_image",
        ("http://a/e.png", "empty_body"): "empty_file",
        ("http://a/c.png", "duplicate_content"): "exact_duplicate",
        ("http://a/m.png", "http_status"): "download_failed",
        ("http://a/m.png", "timeout"): "download_failed",
        ("ftp://a/z.png", "bad_scheme"): "download_failed",
    }
    assert rows[failure_id("http://a/m.png")]["detail"] == "http_status: 404 Not Found"
    assert rows[failure_id("http://a/m.png", 2)]["detail"] == "timeout: ReadTimeout"
    assert failure_id("http://a/m.png").startswith("u-url-") and failure_id("http://a/m.png", 2).endswith("-2")
