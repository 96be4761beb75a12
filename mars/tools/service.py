"""The tool service: a FastAPI server over a :class:`~mars.tools.toolbox.ToolBox` and its httpx client.

Many rollout workers can share one search service: ``mars serve-tools`` (127.0.0.1 by
default) serves ``POST /v1/tools/{name}`` with ``{"arguments": {...}, "images": {<index>: <base64
PNG>}, "n_images": n}`` (of the dialogue's images as shown to the policy, only the one the
call references travels; a list of all of them is accepted too) and answers ``{"text",
"error", "images", "latency_s"}``; ``GET /health`` says it is up. A malformed call is
answered with an error observation, never an HTTP error, as the in-process ToolBox does.

:class:`RemoteToolBox` has the ToolBox's ``call(name, arguments, images)`` interface with
timeouts, bounded concurrency (a semaphore) and retries: network errors, timeouts, HTTP 5xx
and 429 are retried ``retries`` times with exponential backoff ``backoff_s * 2**attempt`` (a
longer ``Retry-After`` honoured up to 30 s), the policy of :func:`mars.retry.retrying`; other
4xx and unreadable answers are not retried. A backend that stays down yields error
observations and a failure counter; once at least ``min_calls`` calls were made and the share
of failed ones exceeds ``max_failure_rate``, the next call raises :class:`ToolServiceDown`
with a clear message, so a run stops instead of training on garbage (the reference release
does the same for its judge and search).

Run: ``mars serve-tools --index-dir data/index --gallery-dir data/world/gallery [--port 8765]``.
"""

from __future__ import annotations

import argparse
import base64
import io
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from PIL import Image
from pydantic import BaseModel

from mars.retry import describe, retrying
from mars.tools.base import Observation

log = logging.getLogger(__name__)


class ToolServiceDown(RuntimeError):
    """The tool service failed too often; the run must stop."""


def encode_image(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_image(data: str) -> Image.Image:
    with Image.open(io.BytesIO(base64.b64decode(data, validate=True))) as im:
        im.load()
        return im.convert("RGB")


def observation_json(obs: Observation) -> dict[str, Any]:
    return {
        "text": obs.text,
        "error": obs.error,
        "images": [encode_image(im) for im in obs.images],
        "latency_s": obs.latency_s,
    }


class CallRequest(BaseModel):
    """Body of ``POST /v1/tools/{name}``."""

    arguments: Any = None
    # every dialogue image as a list, or only the referenced ones as {index: image} with n_images
    images: list[str] | dict[int, str] = []
    n_images: int | None = None


def create_app(toolbox, max_images: int = 64, max_image_bytes: int = 8_000_000):
    """The FastAPI app serving ``toolbox``."""
    from fastapi import FastAPI

    app = FastAPI(title="MARS tool service")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/tools/{name}")
    def call(name: str, req: CallRequest) -> dict[str, Any]:
        sent = dict(enumerate(req.images)) if isinstance(req.images, list) else dict(req.images)
        n = req.n_images if req.n_images is not None else len(sent)
        if n > max_images or len(sent) > n or any(not 0 <= i < n for i in sent):
            msg = f"bad image list: {len(sent)} image(s) sent for n_images={n} (at most {max_images})"
            return observation_json(Observation(text=msg, error=msg))
        images: list = [None] * n  # the tools read only the image their arguments reference
        for i, data in sent.items():
            try:
                if len(data) > max_image_bytes * 4 // 3 + 4:
                    raise ValueError(f"larger than {max_image_bytes} bytes")
                images[i] = decode_image(data)
            except Exception as exc:  # a bad upload is the caller's error, answered as data
                msg = f"image {i} is not a base64 PNG/JPEG: {exc}"
                return observation_json(Observation(text=msg, error=msg))
        return observation_json(toolbox.call(name, req.arguments, images))

    return app


@dataclass
class RemoteToolBox:
    """``ToolBox.call`` over HTTP, with timeouts, bounded concurrency, retries and a failure budget."""

    base_url: str
    timeout_s: float = 30.0
    concurrency: int = 16
    retries: int = 2
    backoff_s: float = 0.5
    max_failure_rate: float = 0.2
    min_calls: int = 20
    calls: int = 0
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._client = httpx.Client(
            base_url=self.base_url.rstrip("/"),
            timeout=self.timeout_s,
            limits=httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency),
        )

    def close(self) -> None:
        self._client.close()

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        """One attempt: POST ``body``, the decoded JSON answer; HTTP errors raised for :func:`mars.retry.retrying`."""
        resp = self._client.post(path, json=body)
        resp.raise_for_status()
        return resp.json()

    def _check_budget(self) -> None:
        with self._lock:
            if self.calls >= self.min_calls and self.failures / self.calls > self.max_failure_rate:
                raise ToolServiceDown(
                    f"tool service at {self.base_url} failed {self.failures} of {self.calls} calls "
                    f"(> {self.max_failure_rate:.0%}); is `mars serve-tools` running? Stopping the run."
                )

    def call(self, name: str, arguments: Any, images: list[Image.Image]) -> Observation:
        self._check_budget()
        idx = arguments.get("img_idx") if isinstance(arguments, dict) else None
        if type(idx) is int and 0 <= idx < len(images):  # send only the image the call reads
            sent: Any = {idx: encode_image(images[idx])}
        elif isinstance(arguments, dict) and "img_idx" not in arguments:
            sent = {}
        else:  # anything unusual: send everything and let the ToolBox judge the call
            sent = [encode_image(im) for im in images]
        body = {"arguments": arguments, "images": sent, "n_images": len(images)}
        start = time.perf_counter()
        with self._slots:
            try:
                data = retrying(self.retries, self.backoff_s)(self._post, f"/v1/tools/{name}", body)
                obs = Observation(
                    text=data["text"],
                    images=[decode_image(x) for x in data.get("images", [])],
                    error=data.get("error"),
                    latency_s=time.perf_counter() - start,
                )
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                last = describe(exc)
            else:
                with self._lock:
                    self.calls += 1
                return obs
        with self._lock:
            self.calls += 1
            self.failures += 1
        msg = f"tool service unavailable ({name}): {last}"
        log.warning(msg)
        return Observation(text=msg, error="service_unavailable", latency_s=time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from mars.tools.toolbox import ToolBox, ToolConfig

    ap = argparse.ArgumentParser(prog="mars serve-tools", description="Serve the agent's tools over HTTP.")
    ap.add_argument("--index-dir", type=Path, required=True, help="the index stage's output (data/index)")
    ap.add_argument("--gallery-dir", type=Path, required=True, help="the world's gallery (data/world/gallery)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765)
    ns = ap.parse_args(argv)
    toolbox = ToolBox.from_dirs(ns.index_dir, ns.gallery_dir, ToolConfig())
    uvicorn.run(create_app(toolbox), host=ns.host, port=ns.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
