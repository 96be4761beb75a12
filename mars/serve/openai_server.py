"""``mars serve``: an OpenAI-compatible chat-completions server for a local checkpoint.

Serves a checkpoint directory (``mars.model.build.load_checkpoint``: the pipeline's own tiny
model, or a local Qwen2.5-VL) so that the ``openai`` rollout backend, LLM judges and every
other HTTP client have a real peer here; on GPU machines vLLM's server speaks the same
protocol and replaces it.

- ``GET /v1/models``: the one served model.
- ``POST /v1/reload``: ``{"path": DIR}`` swaps in the checkpoint at DIR (the RL stage's weight refresh).
- ``POST /v1/chat/completions``: OpenAI chat messages (``system``/``user``/``assistant``/``tool``;
  content a string or parts ``{"type": "text"}`` / ``{"type": "image_url", "image_url":
  {"url": "data:image/...;base64,..."}}``), ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``
  (absent: ``</tool_call>``, ``</answer>``; ``[]``: none), ``logprobs``, ``return_tokens_as_token_ids``,
  ``stream``, ``stream_options.include_usage``; other fields are ignored. Answers ``chat.completion`` JSON with
  ``usage`` (``prompt_tokens``: the rendered prompt's tokens, image tokens included; ``completion_tokens``: the
  generated ids, a closing ``<|im_end|>`` included) and, when asked, per-token ``logprobs.content``: every
  sampled token with its log-probability at the sampling temperature (vLLM's ``--logprobs-mode
  processed_logprobs``), named ``token_id:N`` with ``return_tokens_as_token_ids`` (as vLLM does), so a client
  recovers the exact ids. Like vLLM, the matched stop string is not part of the returned text (its tokens are in
  ``logprobs``) and the choice names it in ``stop_reason`` (null when none matched), so a client restores the
  tag the model wrote, not the one it opened.

  With ``"stream": true`` the answer is server-sent events as OpenAI sends them (``data: {chunk}\n\n`` ...
  ``data: [DONE]\n\n``, each chunk a ``chat.completion.chunk`` with ``choices[0].delta``), but NOT incremental:
  the generation runs to its end first, then one chunk carries the role, the whole content (and its logprobs),
  one more the ``finish_reason``, and with ``stream_options.include_usage`` a last one the usage.

Refused before any work, each with a 4xx status and the OpenAI error body ``{"error": {"message": ...,
"type": "invalid_request_error", "code": status}}`` (:mod:`mars.serve.guard`; limits in :class:`Limits`):
a body over ``max_body_bytes`` (413, read and dropped); bad JSON, a body that is not an object, a field of the
wrong type (strict: no ``"1"`` for a number, no ``NaN``), no or empty ``messages``, ``max_tokens`` < 1,
``temperature`` outside [0, 2], ``top_p`` outside (0, 1], a ``seed`` outside torch's 64-bit range, more than 16
stop strings or one empty or over 256 characters, ``n`` != 1, ``top_logprobs`` > 0 (400); a role or content
part the server does not know; an image that is not a ``data:image/...;base64,`` URL (``http://``, ``file://``:
this server has no network access and reads no files), whose data exceed ``max_image_bytes``, which is not
PNG/JPEG/GIF/WEBP/BMP, or whose DECLARED canvas exceeds ``max_image_pixels`` (``max_request_pixels`` for all
images of a request), checked on the header before decoding (a decompression bomb is never decoded); text
beyond 16 characters per token of the context; a prompt plus ``max_tokens`` longer than the model's context
(``max_model_len``, default its ``max_position_embeddings``), as vLLM refuses it. Without ``max_tokens`` the
completion gets ``min(256, what the context leaves)``. An unexpected failure is a 500 with
``"type": "server_error"`` and the traceback in the server log.

Deviations: streaming is not incremental (above), ``n`` must be 1, no ``top_logprobs``, and requests are served
one at a time (a lock around the model; images are decoded inside it, so at most one request's pixels are in
memory); remote image URLs are refused (no network): send images as data URLs.

Run: ``mars serve --checkpoint data/sft/checkpoint [--host 127.0.0.1] [--port 8000] [--max-model-len N]``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from mars.serve.guard import (
    RequestError,
    b64_bytes,
    cut,
    install_error_handlers,
    load_rgb,
    open_image,
    parse_json,
    post_body,
)

__all__ = ["ChatRequest", "Limits", "RequestError", "create_app", "load_backend", "main", "to_internal"]

DEFAULT_STOP = ("</tool_call>", "</answer>")
DEFAULT_MAX_TOKENS = 256
DEFAULT_CONTEXT = 32768  # when the model's config names no max_position_embeddings
CHARS_PER_TOKEN = 16  # text longer than this many characters per token of context is refused untokenised
MAX_STOPS, MAX_STOP_CHARS = 16, 256

StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (see the module docstring)."""

    max_body_bytes: int = 32 * 2**20
    max_image_bytes: int = 16 * 2**20  # one image's file (its data URL is 4/3 of this in base64)
    max_image_pixels: int = 4096 * 4096  # one image's declared canvas
    max_request_pixels: int = 4 * 4096 * 4096  # all images of a request
    max_model_len: int | None = None  # prompt + completion tokens; None: the model's max_position_embeddings


class StreamOptions(BaseModel):
    include_usage: bool | None = None


class ChatRequest(BaseModel):
    """Body of ``POST /v1/chat/completions`` (validated in strict JSON mode; unknown fields are ignored)."""

    model_config = ConfigDict(allow_inf_nan=False)

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # torch.manual_seed's range
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool | None = False  # vLLM's extension: each logprobs token as "token_id:N"
    n: int | None = Field(1, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class ReloadRequest(BaseModel):
    path: str = Field(min_length=1, max_length=4096)


def _open_data_url(url: str, limits: Limits, what: str):
    if not url.startswith("data:"):
        raise RequestError(f"{what}: only data: URLs are accepted for images (this server has no network access "
                           f"and reads no files), got {cut(url, 60)!r}")
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:image/") or not head.endswith(";base64"):
        raise RequestError(f"{what}: an image must be a data URL 'data:image/<type>;base64,<data>', "
                           f"got {cut(head, 60)!r}")
    return open_image(b64_bytes(payload, limits.max_image_bytes, f"{what} image"), limits.max_image_pixels,
                      f"{what} image")


def to_internal(messages: list[dict[str, Any]], limits: Limits = Limits(),
                max_text_chars: int | None = None) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the message format of :mod:`mars.model.chat`, images decoded to RGB.

    Raises :class:`RequestError` for anything it cannot serve (see the module docstring); every image is checked
    (data URL, bytes, declared pixels, the request's total) before the first one is decoded.
    """
    out: list[dict[str, Any]] = []
    pending: list[tuple[dict[str, Any], str]] = []  # image items still holding a lazily opened image
    chars = pixels = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}].role must be system, user, assistant or tool, got {cut(repr(role), 60)}")
        content = m.get("content")
        if content is None or isinstance(content, str):
            chars += len(content or "")
            out.append({"role": role, "content": content or ""})
        elif not isinstance(content, list):
            raise RequestError(f"messages[{i}].content must be a string or a list of parts")
        else:
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise RequestError(f"{where}.text must be a string")
                    chars += len(text)
                    parts.append({"type": "text", "text": text})
                elif kind == "image_url":
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str):
                        raise RequestError(f"{where}.image_url must be {{\"url\": \"data:image/...;base64,...\"}}")
                    im = _open_data_url(url, limits, where)
                    pixels += im.size[0] * im.size[1]
                    if pixels > limits.max_request_pixels:
                        raise RequestError(f"the images of this request declare more than {limits.max_request_pixels}"
                                           " pixels in all (not decoded)")
                    item = {"type": "image", "image": im}
                    pending.append((item, f"{where} image"))
                    parts.append(item)
                else:
                    raise RequestError(f"{where}.type must be text or image_url, got {cut(repr(kind), 60)}")
            out.append({"role": role, "content": parts})
        if max_text_chars is not None and chars > max_text_chars:
            raise RequestError(f"the messages hold more than {max_text_chars} characters of text, more than the "
                               "model's context can take")
    for item, what in pending:
        item["image"] = load_rgb(item["image"], what)
    return out


def context_length(backend) -> int:
    """The backend model's context in tokens (``max_position_embeddings`` of its text config)."""
    cfg = backend.model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    n = getattr(text, "max_position_embeddings", None)
    return int(n) if n else DEFAULT_CONTEXT


def prompt_token_count(backend, dialogue: list[dict[str, Any]]) -> int:
    """Tokens of the prompt the backend renders for ``dialogue`` (image tokens and generation prompt included)."""
    from mars.model.chat import render

    return len(render(dialogue, backend.processor, add_generation_prompt=True).input_ids)


def load_backend(path: str, device: str = "cpu"):
    """An HFBackend over the checkpoint directory ``path``."""
    from mars.agent.hf_backend import HFBackend
    from mars.model.build import load_checkpoint

    model, _, processor = load_checkpoint(path, device=device)
    return HFBackend(model, processor, device=device)


def _sse(chunks: list[dict[str, Any]]) -> list[str]:
    return [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]


def create_app(backend, model_name: str, loader=load_backend, limits: Limits = Limits()):
    """The FastAPI app serving ``backend`` (an :class:`~mars.agent.hf_backend.HFBackend`).

    ``POST /v1/reload`` with ``{"path": DIR}`` swaps in the checkpoint at ``DIR`` (``loader(DIR)``) between
    requests: how the RL stage refreshes the policy's weights on the server after each update.
    """
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI(title="MARS OpenAI-compatible server", redirect_slashes=False)
    install_error_handlers(app)
    lock = threading.Lock()
    state = {"backend": backend, "reloads": 0}

    def reload_now(body: bytes) -> dict[str, Any]:
        path = parse_json(ReloadRequest, body).path
        try:
            new = loader(path)
        except Exception as exc:  # a missing or broken checkpoint is the caller's error
            raise RequestError(f"cannot load {cut(path, 300)}: {type(exc).__name__}: {cut(str(exc), 300)}") from None
        with lock:
            state["backend"] = new
            state["reloads"] += 1
            return {"status": "ok", "path": path, "reloads": state["reloads"]}

    post_body(app, "/v1/reload", reload_now, 64 * 2**10)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "mars"}]}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    def complete(body: bytes) -> dict[str, Any] | StreamingResponse:
        req = parse_json(ChatRequest, body)
        if req.n not in (None, 1):
            raise RequestError("only n=1 is supported")
        if req.top_logprobs:
            raise RequestError("top_logprobs is not supported: logprobs gives each sampled token's log-probability")
        requested = req.max_completion_tokens or req.max_tokens
        stop = DEFAULT_STOP if req.stop is None else (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
        with lock:
            backend = state["backend"]
            max_len = limits.max_model_len or context_length(backend)
            if 4 * len(req.messages) + 3 > max_len:  # every message renders to >= 4 tokens
                raise RequestError(f"{len(req.messages)} messages cannot fit this model's context of {max_len} tokens")
            dialogue = to_internal(req.messages, limits, max_text_chars=CHARS_PER_TOKEN * max_len)
            prompt_tokens = prompt_token_count(backend, dialogue)
            room = max_len - prompt_tokens
            if room < (requested or 1):
                raise RequestError(f"this model's maximum context length is {max_len} tokens; the messages take "
                                   f"{prompt_tokens}" + (f" and max_tokens asks for {requested} more" if requested
                                                         else ", leaving no room for a completion"))
            max_new = requested or min(DEFAULT_MAX_TOKENS, room)
            gen = backend.generate(
                [dialogue], max_new_tokens=max_new, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed, stop=stop,
            )[0]
            tok = backend.tokenizer
        text, matched = gen.text, None
        for s in stop:  # like vLLM: the matched stop string is not returned, but named in ``stop_reason``
            if gen.finish_reason == "stop" and text.endswith(s):
                text, matched = text[: -len(s)], s
                break
        logprobs = None
        if req.logprobs:
            name = (lambda t: f"token_id:{t}") if req.return_tokens_as_token_ids else (lambda t: tok.decode([t]))
            logprobs = {"content": [{"token": name(t), "logprob": lp} for t, lp in zip(gen.token_ids, gen.logprobs)]}
        n_out = len(gen.token_ids or [])
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens + n_out}
        head = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_name}
        if not req.stream:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": gen.finish_reason, "stop_reason": matched}
            if logprobs is not None:
                choice["logprobs"] = logprobs
            return {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
        chunk = {**head, "object": "chat.completion.chunk"}
        events = [
            {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "logprobs": logprobs,
                                   "finish_reason": None}]},
            {**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": gen.finish_reason,
                                   "stop_reason": matched}]},
        ]
        if req.stream_options is not None and req.stream_options.include_usage:
            events.append({**chunk, "choices": [], "usage": usage})
        return StreamingResponse(iter(_sse(events)), media_type="text/event-stream")

    post_body(app, "/v1/chat/completions", complete, limits.max_body_bytes)

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    ap = argparse.ArgumentParser(prog="mars serve", description="OpenAI-compatible server for a local checkpoint.")
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory (model, tokenizer, processor)")
    ap.add_argument("--model-name", default=None, help="name reported by /v1/models (default: the directory name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="prompt + completion tokens (default: the model's max_position_embeddings)")
    ap.add_argument("--max-image-pixels", type=int, default=Limits.max_image_pixels,
                    help="the largest declared canvas of one image (default: %(default)s)")
    ns = ap.parse_args(argv)
    name = ns.model_name or ns.checkpoint.rstrip("/").rsplit("/", 1)[-1]
    limits = Limits(max_model_len=ns.max_model_len, max_image_pixels=ns.max_image_pixels,
                    max_request_pixels=max(Limits.max_request_pixels, ns.max_image_pixels))
    app = create_app(load_backend(ns.checkpoint, ns.device), name, lambda p: load_backend(p, ns.device), limits)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
