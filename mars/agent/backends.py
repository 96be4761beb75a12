"""Policy backends for the rollout engine: any OpenAI-compatible endpoint, and scripted Python policies.

What it does
    - :class:`OpenAIBackend` implements :class:`~mars.agent.engine.PolicyBackend` over ``POST {base_url}/chat/completions``
      (vLLM ``serve``, our own ``mars.serve`` server, hosted API models). Each dialogue of a batch is one request;
      requests run concurrently in a thread pool bounded by ``concurrency`` over one shared
      :class:`mars.llm_client.ChatClient` (the ``openai`` package).
      Images go as ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``; the request
      asks for ``logprobs: true`` and stops at ``</tool_call>`` and ``</answer>``. Servers that strip the matched
      stop string (vLLM, OpenAI) get it re-appended: from ``stop_reason`` when the server names it (vLLM,
      ``mars serve``), otherwise by closing the action tag left open at the end of the text. Per-token
      ``logprobs`` are parsed from ``choices[0].logprobs.content``; ``token_ids`` from ``choices[0].token_ids``
      (newer vLLM with ``return_token_ids``) or from tokens rendered as ``token_id:N`` (vLLM's
      ``return_tokens_as_token_ids``, sent when ``token_ids=True``); otherwise ``None``. vLLM's fields beyond
      OpenAI's schema travel through the client (``extra_body`` out; ``stop_reason`` and ``token_ids`` back).
      Network errors, timeouts (``timeout_s`` per attempt), 429 and 5xx are retried ``retries`` times with
      exponential backoff ``backoff_s * 2**k``; a request that still fails (or is refused with another 4xx, or
      answered with no chat completion) becomes ``Generation("", finish_reason="error")`` (the engine ends that
      episode as ``backend_error``) and its error line is appended to ``self.errors``; a batch never raises.
      Dialogue ``i`` of a batch is sent with ``seed + i`` (so the samples of a GRPO group differ); every image is
      PNG-encoded once and its data URL reused on later turns (a cache keyed by the live image object).
    - :class:`ScriptedBackend` calls ``policy(dialogue) -> str`` per dialogue (no token ids, no logprobs) and
      records the batch size of every call (``self.batch_sizes``), which tests use to check batching.

Deviation
    The reference drives vLLM through its Python API inside the trainer; here every generation server is reached
    over HTTP, so the same code evaluates API models, a local ``vllm serve`` and our own checkpoint server.

How to run (Python)::
        backend = OpenAIBackend("http://127.0.0.1:8000/v1", "Qwen/Qwen2.5-VL-7B-Instruct")
        trajs = run_episodes(questions, backend, toolbox, EngineConfig(), seed=0, image_root=world_dir)
"""

from __future__ import annotations

import base64
import io
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from PIL import Image

from mars.agent.engine import Generation
from mars.llm_client import ChatClient, LLMError

__all__ = ["OpenAIBackend", "ScriptedBackend", "STOP_SEQUENCES", "to_openai_messages", "close_stop"]

STOP_SEQUENCES: tuple[str, ...] = ("</tool_call>", "</answer>")


_URL_CACHE: dict[int, tuple[Any, str]] = {}  # id(image) -> (weakref to it, data URL): each image is encoded once
_URL_LOCK = threading.Lock()
_URL_CACHE_MAX = 4096


def _data_url(im: Image.Image) -> str:
    key = id(im)
    with _URL_LOCK:
        hit = _URL_CACHE.get(key)
        if hit is not None and hit[0]() is im:
            return hit[1]
    buf = io.BytesIO()
    (im if im.mode in ("RGB", "RGBA", "L") else im.convert("RGB")).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    with _URL_LOCK:
        if len(_URL_CACHE) >= _URL_CACHE_MAX:
            for k in [k for k, (ref, _) in _URL_CACHE.items() if ref() is None] or list(_URL_CACHE):
                _URL_CACHE.pop(k, None)
        _URL_CACHE[key] = (weakref.ref(im), url)
    return url


def to_openai_messages(dialogue: list[dict]) -> list[dict]:
    """The engine's messages in the OpenAI chat format (images as PNG data URLs)."""
    out = []
    for m in dialogue:
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    parts.append({"type": "image_url", "image_url": {"url": _data_url(p["image"])}})
                else:
                    parts.append({"type": "text", "text": str(p.get("text", ""))})
            content = parts
        out.append({"role": m["role"], "content": content})
    return out


def close_stop(text: str, finish_reason: str | None, stop_reason: Any = None) -> str:
    """Re-append the stop string a server stripped. ``stop_reason`` (vLLM) names it when known; otherwise the
    action tag left open at the end of ``text`` is closed. Only when the generation stopped on a stop sequence."""
    if finish_reason != "stop" or any(text.rstrip().endswith(s) for s in STOP_SEQUENCES):
        return text
    if isinstance(stop_reason, str) and stop_reason in STOP_SEQUENCES:
        return text + stop_reason
    for tag in ("tool_call", "answer"):
        if text.rfind(f"<{tag}>") > text.rfind(f"</{tag}>"):
            return text + f"</{tag}>"
    return text


def _parse_token(tok: Any) -> int | None:
    if isinstance(tok, str) and tok.startswith("token_id:"):
        try:
            return int(tok[len("token_id:"):])
        except ValueError:
            return None
    return None


class OpenAIBackend:
    """A :class:`~mars.agent.engine.PolicyBackend` over an OpenAI-compatible ``/chat/completions`` endpoint."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 2,
        concurrency: int = 8,
        *,
        logprobs: bool = True,
        token_ids: bool = False,
        backoff_s: float = 0.5,
        extra_body: dict | None = None,
    ) -> None:
        if concurrency < 1 or retries < 0:
            raise ValueError(f"need concurrency >= 1 and retries >= 0, got {concurrency}, {retries}")
        self.model = model
        self.retries = retries
        self.concurrency = concurrency
        self.logprobs = logprobs
        self.token_ids = token_ids
        self.backoff_s = backoff_s
        self.extra_body = dict(extra_body or {})
        self.llm = ChatClient(base_url, api_key=api_key, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                              name="policy endpoint")
        self.url = self.llm.url
        self._lock = threading.Lock()
        self.errors: list[str] = []

    @property
    def requests(self) -> int:
        """HTTP requests sent, retries included."""
        return self.llm.calls + self.llm.retries_done

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> OpenAIBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _body(self, dialogue: list[dict], max_new_tokens: int, temperature: float, top_p: float, seed: int) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": to_openai_messages(dialogue),
            "max_tokens": int(max_new_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
            "seed": int(seed),
            "stop": list(STOP_SEQUENCES),
        }
        if self.logprobs:
            body["logprobs"] = True
        if self.token_ids:
            body["return_tokens_as_token_ids"] = True
        body.update(self.extra_body)
        return body

    def _one(self, body: dict) -> Generation:
        try:
            return self._parse(self.llm.complete(body))
        except LLMError as exc:
            last = str(exc)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            last = f"{self.url} answered with a bad chat completion: {type(exc).__name__}: {exc}"
        with self._lock:
            self.errors.append(last)
        return Generation(text="", token_ids=None, logprobs=None, finish_reason="error")

    @staticmethod
    def _parse(data: dict) -> Generation:
        choice = data["choices"][0]
        msg = choice.get("message") or {}
        text = msg.get("content") or ""
        finish = choice.get("finish_reason") or "stop"
        text = close_stop(text, finish, choice.get("stop_reason"))
        logprobs = token_ids = None
        lp = choice.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            content = lp["content"]
            logprobs = [float(t["logprob"]) for t in content]
            ids = [_parse_token(t.get("token")) for t in content]
            if content and all(i is not None for i in ids):
                token_ids = ids
        if isinstance(choice.get("token_ids"), list):
            token_ids = [int(i) for i in choice["token_ids"]]
        if token_ids is not None and logprobs is not None and len(token_ids) != len(logprobs):
            token_ids = None  # cannot be aligned (e.g. a stop string re-appended by the server)
        return Generation(text=text, token_ids=token_ids, logprobs=logprobs, finish_reason=finish)

    def generate(
        self, dialogues: list[list[dict]], *, max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[Generation]:
        bodies = [self._body(d, max_new_tokens, temperature, top_p, seed + i) for i, d in enumerate(dialogues)]
        if len(bodies) <= 1:
            return [self._one(b) for b in bodies]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(bodies))) as pool:
            return list(pool.map(self._one, bodies))


class ScriptedBackend:
    """Calls ``policy(dialogue) -> str`` for every dialogue of a batch. No token ids or logprobs.

    An exception in the policy becomes an empty turn (a format error in the engine), never a crash.
    """

    def __init__(self, policy: Callable[[list[dict]], str]) -> None:
        self.policy = policy
        self.batch_sizes: list[int] = []

    @property
    def calls(self) -> int:
        return len(self.batch_sizes)

    def generate(
        self, dialogues: list[list[dict]], *, max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[Generation]:
        self.batch_sizes.append(len(dialogues))
        out = []
        for d in dialogues:
            try:
                text = self.policy(d)
            except Exception as exc:  # a broken script is a broken turn
                text = f"<policy error: {type(exc).__name__}>"
            out.append(Generation(text=str(text), token_ids=None, logprobs=None, finish_reason="stop"))
        return out
