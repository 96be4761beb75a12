"""The tool service: a FastAPI server over a :class:`~mars.tools.toolbox.ToolBox` and its httpx client.

Many rollout workers can share one search service: ``mars serve-tools`` (127.0.0.1 by
default) serves ``POST /v1/tools/{name}`` with ``{"arguments": {...}, "images": {<index>: <base64
PNG>}, "n_images": n}`` (of the dialogue's images as shown to the policy, only the one the
call references travels; a list of all of them is accepted too) and answers ``{"text",
"error", "images", "latency_s"}``; ``GET /health`` says it is up. A bad tool call (an unknown
tool, wrong or missing arguments, a box out of range: whatever the policy wrote) is answered with
an error observation and HTTP 200, as the in-process ToolBox does. A malformed REQUEST is the
client's bug and is refused with a 4xx and ``{"error": {"message", "type": "invalid_request_error",
"code"}}`` (:mod:`mars.serve.guard`), before any image is decoded: a body over ``max_body_bytes``
(413, read and dropped); bad JSON, an unknown field or one of the wrong type (strict: ``n_images`` an
integer, ``images`` a list of strings or an ``{index: string}`` object); ``n_images`` above ``max_images``;
an image index outside ``0..n_images-1``; an image that is not base64, exceeds ``max_image_bytes``,
is not PNG/JPEG/GIF/WEBP/BMP, or DECLARES more than ``max_image_pixels`` (``max_request_pixels`` for
all images of the request: a decompression bomb is never decoded); arguments whose ``img_idx``
names an image that was not sent. An unexpected failure is a 500 with ``"type": "server_error"``.

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
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from mars.errors import StageError
from mars.retry import describe, retrying
from mars.serve.guard import (
    RequestError,
    b64_bytes,
    install_error_handlers,
    load_rgb,
    open_image,
    parse_json,
    post_body,
)
from mars.tools.base import Observation

log = logging.getLogger(__name__)


class ToolServiceDown(StageError, RuntimeError):
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
    """Body of ``POST /v1/tools/{name}`` (validated in strict JSON mode; an unknown field is an error)."""

    model_config = ConfigDict(extra="forbid")

    arguments: Any = None
    # every dialogue image as a list, or only the referenced ones as {index: image} with n_images
    images: list[str] | dict[int, str] = []
    n_images: int | None = Field(None, ge=0)


def _image_index(arguments: Any) -> int | None:
    """The ``img_idx`` a call's arguments (an object, or a JSON string holding one) name, if an integer."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    idx = arguments.get("img_idx") if isinstance(arguments, dict) else None
    return idx if type(idx) is int else None


def create_app(toolbox, max_images: int = 64, max_image_bytes: int = 8_000_000, max_image_pixels: int = 4096 * 4096,
               max_request_pixels: int = 4 * 4096 * 4096, max_body_bytes: int = 32 * 2**20):
    """The FastAPI app serving ``toolbox`` (the refusals and limits: see the module docstring)."""
    from fastapi import FastAPI

    app = FastAPI(title="MARS tool service", redirect_slashes=False)
    install_error_handlers(app)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    def call(body: bytes, name: str) -> dict[str, Any]:
        req = parse_json(CallRequest, body)
        sent = dict(enumerate(req.images)) if isinstance(req.images, list) else dict(req.images)
        n = req.n_images if req.n_images is not None else len(sent)
        if n > max_images:
            raise RequestError(f"n_images={n}: at most {max_images} images per call")
        outside = sorted(i for i in sent if not 0 <= i < n)
        if outside:
            raise RequestError(f"image index {outside[0]} is outside 0..{n - 1} (n_images={n})")
        opened, pixels = {}, 0
        for i in sorted(sent):  # every image checked (size, format, declared pixels) before any is decoded
            im = open_image(b64_bytes(sent[i], max_image_bytes, f"image {i}"), max_image_pixels, f"image {i}")
            pixels += im.size[0] * im.size[1]
            if pixels > max_request_pixels:
                raise RequestError(f"the images of this call declare more than {max_request_pixels} pixels in all "
                                   "(not decoded)")
            opened[i] = im
        idx = _image_index(req.arguments)
        if idx is not None and 0 <= idx < n and idx not in opened:
            raise RequestError(f"the arguments name img_idx={idx} but image {idx} was not sent")
        images: list = [None] * n  # the tools read only the image their arguments reference
        for i, im in opened.items():
            images[i] = load_rgb(im, f"image {i}")
        return observation_json(toolbox.call(name, req.arguments, images))

    post_body(app, "/v1/tools/{name}", call, max_body_bytes)

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
