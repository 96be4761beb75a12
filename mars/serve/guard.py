"""What the HTTP servers (``mars serve``, ``mars serve-tools``) refuse before doing any work, and how.

- :func:`read_body`: the request body, at most ``max_bytes``. A larger body is read to its end and discarded
  (memory stays at one chunk; the client, still sending, gets the answer instead of a reset connection) and
  refused with HTTP 413.
- :func:`parse_json`: the body validated by a pydantic model in strict JSON mode (no ``"1"`` for an integer,
  no ``NaN``), any JSON error or wrong type refused with HTTP 400 naming the fields, never echoing the input.
- :func:`b64_bytes` / :func:`open_image` / :func:`load_rgb`: base64 text of at most ``max_bytes`` decoded
  bytes; an image opened lazily (header only) in one of :data:`IMAGE_FORMATS` (no decoder that calls out of
  the process, like EPS through Ghostscript), its DECLARED canvas checked against ``max_pixels`` before a
  single pixel is decoded (a PNG declaring 50000x50000 that compresses to a few KB is refused as it is).
- :func:`post_body`: registers a POST route whose handler gets the raw body (read by :func:`read_body`) and runs
  in the thread pool.
- :func:`install_error_handlers`: every refusal (:class:`RequestError`, Starlette's HTTP errors, FastAPI's
  validation errors) answered with its 4xx status and the OpenAI error body
  ``{"error": {"message", "type": "invalid_request_error", "code"}}``; an unexpected exception with 500 and
  ``"type": "server_error"`` (the traceback goes to the server log, not to the client).
"""

import base64
import binascii
import io
from typing import Any, Callable, TypeVar

from PIL import Image
from pydantic import BaseModel, ValidationError

IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")

M = TypeVar("M", bound=BaseModel)


class RequestError(ValueError):
    """A request the server refuses; answered with ``status`` (400 unless said) and this message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(message: str, status: int = 400):
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(message, status), status_code=status)


async def read_body(request, max_bytes: int) -> bytes:
    """The body of ``request``; :class:`RequestError` 413 when it is longer than ``max_bytes`` (read and dropped)."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    over = declared.isdigit() and int(declared) > max_bytes
    chunks: list[bytes] = []
    n = 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if over or n > max_bytes:
                over = True
                chunks.clear()  # keep reading to the end, keep nothing
            else:
                chunks.append(chunk)
    except ClientDisconnect:
        raise RequestError("the client disconnected before sending the whole body") from None
    if over:
        raise RequestError(f"request body of {n} bytes is larger than the limit of {max_bytes} bytes", status=413)
    return b"".join(chunks)


def summarize(errors, limit: int = 5) -> str:
    """``field.path: what is wrong`` for the first ``limit`` validation errors (never the offending input itself)."""
    errors = list(errors)
    parts = []
    for e in errors[:limit]:
        loc = ".".join(cut(str(x), 40) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    more = len(errors) - limit
    return cut("; ".join(parts) + (f" (and {more} more)" if more > 0 else ""), 1000)


def parse_json(model: type[M], body: bytes) -> M:
    """``body`` validated as ``model`` (strict JSON); :class:`RequestError` 400 saying what is wrong."""
    if not body.strip():
        raise RequestError("the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise RequestError(f"invalid request body: {summarize(exc.errors(include_input=False))}") from None


def b64_bytes(text: str, max_bytes: int, what: str) -> bytes:
    """The bytes of base64 ``text``; refused unpacked when they would exceed ``max_bytes``."""
    if len(text) > (max_bytes + 2) // 3 * 4 + 4:
        raise RequestError(f"{what} is larger than the limit of {max_bytes} bytes ({len(text)} base64 characters)")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"{what} is not valid base64: {cut(str(exc), 200)}") from None


def open_image(data: bytes, max_pixels: int, what: str) -> Image.Image:
    """The image in ``data``, opened lazily: header read, canvas checked against ``max_pixels``, nothing decoded."""
    try:
        im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:  # PIL's own guard (above 2 * Image.MAX_IMAGE_PIXELS)
        raise RequestError(f"{what} is refused unread: {cut(str(exc), 200)} (the limit is {max_pixels})") from None
    except Exception as exc:  # PIL's UnidentifiedImageError, DecompressionBombError, truncated headers, ...
        raise RequestError(f"{what} is not a {'/'.join(IMAGE_FORMATS)} image: {cut(str(exc), 200)}") from None
    w, h = im.size
    if w < 1 or h < 1 or w * h > max_pixels:
        im.close()
        raise RequestError(f"{what} declares {w}x{h} = {w * h} pixels; the limit is {max_pixels} (not decoded)")
    return im


def load_rgb(im: Image.Image, what: str) -> Image.Image:
    """Decode a lazily opened image (see :func:`open_image`) to RGB."""
    try:
        im.load()
        return im.convert("RGB")
    except Exception as exc:  # truncated or corrupt data
        raise RequestError(f"{what} cannot be decoded: {cut(str(exc), 200)}") from None
    finally:
        im.close()


def post_body(app, path: str, handler: Callable[..., Any], max_bytes: int) -> None:
    """``POST path`` on ``app``: ``handler(body, **path_params)`` in the thread pool, the body at most ``max_bytes``."""
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request

    async def endpoint(request: Request):  # annotations of this module are evaluated: FastAPI sees the class
        body = await read_body(request, max_bytes)
        return await run_in_threadpool(handler, body, **request.path_params)

    endpoint.__name__ = getattr(handler, "__name__", "endpoint")
    app.post(path)(endpoint)


def install_error_handlers(app) -> None:
    """Answer every refusal and failure of ``app`` with the OpenAI error body (see the module docstring)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestError)
    async def _refused(request, exc: RequestError):
        return error_response(str(exc), exc.status)

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return error_response(f"invalid request: {summarize(exc.errors())}", 400)

    @app.exception_handler(Exception)
    async def _crashed(request, exc: Exception):
        return error_response(f"internal server error ({type(exc).__name__}); see the server log", 500)

