"""``mars serve``: an OpenAI-compatible chat-completions server for a local checkpoint.

Serves a checkpoint directory (``mars.model.build.load_checkpoint``: the pipeline's own tiny
model, or a local Qwen2.5-VL) so that the ``openai`` rollout backend, LLM judges and every
other HTTP client have a real peer here; on GPU machines vLLM's server speaks the same
protocol and replaces it.

- ``GET /v1/models``: the one served model.
- ``POST /v1/reload``: ``{"path": DIR}`` swaps in the checkpoint at DIR (the RL stage's weight refresh).
- ``POST /v1/chat/completions``: OpenAI chat messages (``system``/``user``/``assistant``/``tool``;
  content a string or parts ``{"type": "text"}`` / ``{"type": "image_url", "image_url":
  {"url": "data:image/...;base64,..."}}``), ``max_tokens``, ``temperature``, ``top_p``,
  ``seed``, ``stop``, ``logprobs``, ``return_tokens_as_token_ids``. Answers ``chat.completion``
  JSON with usage and, when asked, per-token ``logprobs.content``: every sampled token with its
  log-probability at the sampling temperature (vLLM's ``--logprobs-mode processed_logprobs``),
  named ``token_id:N`` with ``return_tokens_as_token_ids`` (as vLLM does), so a client recovers
  the exact ids. Like vLLM, the matched stop string is not part of the returned text (its
  tokens are in ``logprobs``).

Deviations: no streaming, ``n`` must be 1, and requests are served one at a time (a lock
around the model); remote image URLs are refused (no network): send images as data URLs.

Run: ``mars serve --checkpoint data/sft/checkpoint [--host 127.0.0.1] [--port 8000]``.
"""

from __future__ import annotations

import argparse
import base64
import io
import threading
import time
import uuid
from typing import Any

from PIL import Image
from pydantic import BaseModel

DEFAULT_STOP = ("</tool_call>", "</answer>")


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    logprobs: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's extension: each logprobs token as "token_id:N"
    n: int = 1


class RequestError(ValueError):
    """A request the server cannot serve; answered with HTTP 400 and this message."""


def _image(url: str) -> Image.Image:
    if not url.startswith("data:"):
        raise RequestError("only data: URLs are accepted for images (this server has no network access)")
    try:
        payload = url.split(",", 1)[1]
        with Image.open(io.BytesIO(base64.b64decode(payload, validate=True))) as im:
            im.load()
            return im.convert("RGB")
    except Exception as exc:
        raise RequestError(f"image_url is not a base64-encoded image: {exc}") from None


def to_internal(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the message format of :mod:`mars.model.chat`."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}].role must be system, user, assistant or tool, got {role!r}")
        content = m.get("content")
        if content is None or isinstance(content, str):
            out.append({"role": role, "content": content or ""})
            continue
        if not isinstance(content, list):
            raise RequestError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                url = part.get("image_url", {})
                parts.append({"type": "image", "image": _image(url.get("url", "") if isinstance(url, dict) else url)})
            else:
                raise RequestError(f"messages[{i}].content[{j}].type must be text or image_url, got {kind!r}")
        out.append({"role": role, "content": parts})
    return out


def load_backend(path: str, device: str = "cpu"):
    """An HFBackend over the checkpoint directory ``path``."""
    from mars.agent.hf_backend import HFBackend
    from mars.model.build import load_checkpoint

    model, _, processor = load_checkpoint(path, device=device)
    return HFBackend(model, processor, device=device)


def create_app(backend, model_name: str, loader=load_backend):
    """The FastAPI app serving ``backend`` (an :class:`~mars.agent.hf_backend.HFBackend`).

    ``POST /v1/reload`` with ``{"path": DIR}`` swaps in the checkpoint at ``DIR`` (``loader(DIR)``) between
    requests: how the RL stage refreshes the policy's weights on the server after each update.
    """
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title="MARS OpenAI-compatible server")
    lock = threading.Lock()
    state = {"backend": backend, "reloads": 0}

    @app.post("/v1/reload")
    def reload(body: dict[str, Any]):
        path = body.get("path")
        if not isinstance(path, str) or not path:
            return JSONResponse({"error": {"message": "body must be {\"path\": \"<checkpoint dir>\"}",
                                           "type": "invalid_request_error"}}, status_code=400)
        try:
            new = loader(path)
        except (FileNotFoundError, OSError, ValueError) as exc:
            return JSONResponse({"error": {"message": f"cannot load {path}: {exc}", "type": "invalid_request_error"}},
                                status_code=400)
        with lock:
            state["backend"] = new
            state["reloads"] += 1
        return {"status": "ok", "path": path, "reloads": state["reloads"]}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "mars"}]}

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest):
        try:
            if req.n != 1:
                raise RequestError("only n=1 is supported")
            dialogue = to_internal(req.messages)
            stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or DEFAULT_STOP)
            max_new = req.max_completion_tokens or req.max_tokens or 256
            if max_new < 1:
                raise RequestError("max_tokens must be >= 1")
        except RequestError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, status_code=400)
        with lock:
            backend = state["backend"]
            gen = backend.generate(
                [dialogue], max_new_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
                seed=req.seed, stop=stop,
            )[0]
        text = gen.text
        for s in stop:  # like vLLM: the matched stop string is not returned
            if gen.finish_reason == "stop" and text.endswith(s):
                text = text[: -len(s)]
                break
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": gen.finish_reason,
        }
        if req.logprobs:
            tok = backend.tokenizer
            name = (lambda t: f"token_id:{t}") if req.return_tokens_as_token_ids else (lambda t: tok.decode([t]))
            choice["logprobs"] = {
                "content": [{"token": name(t), "logprob": lp} for t, lp in zip(gen.token_ids, gen.logprobs)]
            }
        prompt_tokens = int(getattr(gen, "prompt_tokens", 0) or 0)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(gen.token_ids),
                "total_tokens": prompt_tokens + len(gen.token_ids),
            },
        }

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    ap = argparse.ArgumentParser(prog="mars serve", description="OpenAI-compatible server for a local checkpoint.")
    ap.add_argument("--checkpoint", required=True, help="checkpoint directory (model, tokenizer, processor)")
    ap.add_argument("--model-name", default=None, help="name reported by /v1/models (default: the directory name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="cpu")
    ns = ap.parse_args(argv)
    name = ns.model_name or ns.checkpoint.rstrip("/").rsplit("/", 1)[-1]
    app = create_app(load_backend(ns.checkpoint, ns.device), name, lambda p: load_backend(p, ns.device))
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
