"""LLM-backed question synthesis for real images: ask any OpenAI-compatible endpoint for a search question.

What it does
    For every item ``{"id", "image_path", "caption"}`` (``image_path`` relative to ``image_root``) one request goes to
    ``POST {base_url}/chat/completions`` with :data:`SYNTH_PROMPT` as the system message and a user message holding
    the image (a PNG data URL, via :func:`mars.agent.backends.to_openai_messages`) and the caption. The model must
    reply with ONE question that needs identifying what is in the image and then searching for a fact about it,
    as JSON inside ``<qa>...</qa>``. :func:`parse_reply` parses and validates the reply; an unusable reply is
    rejected with one of the fixed reasons in :data:`PARSE_REASONS` (see :func:`parse_reply` for each). Accepted
    items become rows of the ``QUESTIONS`` schema (:mod:`mars.data.schemas`): ``type="search"``,
    ``question_id=f"llm-{id}"``, ``scene_id=None``, ``entity_id=id``, ``difficulty`` 0/1/2 from easy/medium/hard,
    ``split="unassigned"`` (the stage assigns splits). A question that repeats an earlier accepted one (normalised)
    is rejected as ``"duplicate"``, an image that cannot be read as ``"image_error"`` and a request that still fails
    after the retries as ``"endpoint_error"`` (:data:`REJECT_REASONS` lists all). Nothing is raised per item;
    but when more than ``max_failure_rate`` of the requests fail the run stops with a :class:`RuntimeError` naming
    the endpoint and the count (as soon as the outcome is certain, so a dead endpoint does not wait for every item).

    Transport: requests run concurrently in a thread pool bounded by ``concurrency`` over one shared
    :class:`mars.llm_client.ChatClient` (the ``openai`` package: network errors, timeouts, 5xx and 429 retried
    ``max_retries`` times with exponential backoff ``backoff_s * 2**k``; other 4xx not retried; a reply with no
    chat completion is an ``endpoint_error``). Each request carries ``seed = seed + crc32(id)`` so reruns are
    reproducible where the server honours seeds (vLLM, OpenAI).

Deviations
    The paper synthesised questions with a strong proprietary model and then had humans check them; here any
    OpenAI-compatible endpoint (a hosted API, ``vllm serve``, our own ``mars.serve``) is used and the human check
    is replaced by the rule-based validation of :func:`parse_reply` plus de-duplication. Images are shrunk to at
    most ``max_image_side`` pixels on the long side before encoding.

How to run
    Python::

        with LLMSynthesizer("http://127.0.0.1:8000/v1", "Qwen/Qwen2.5-VL-72B-Instruct") as synth:
            rows, rejects = synth.synthesize(items, image_root=Path("data/curated"))

    Tests (they start a real OpenAI-compatible server on 127.0.0.1): ``.venv/bin/python -m pytest tests/synth -q``.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps
from tqdm import tqdm

from mars.agent.backends import to_openai_messages
from mars.errors import EndpointDown
from mars.llm_client import ChatClient, LLMError
from mars.rl.judge import normalize_answer

__all__ = [
    "DIFFICULTY_LEVELS",
    "LLMSynthesizer",
    "PARSE_REASONS",
    "REJECT_REASONS",
    "SYNTH_PROMPT",
    "parse_reply",
]

SYNTH_PROMPT = (
    "You write questions for training a visual search agent. You are given an image and its caption.\n"
    "Write ONE question about the image that can only be answered by first identifying what is shown in the image "
    "(the specific landmark, object, artwork, organisation, species, person, ...) and then searching for a fact "
    "about it (for example when it was built, who made it, where it is, how tall it is). The question must refer "
    "to the subject only through the image (\"this building\", \"the animal in the picture\") and must not name it "
    "or contain the answer. The answer must be short (a name, a number, a date or a few words) and unambiguous.\n"
    "Reply ONLY with a JSON object inside <qa>...</qa> tags, nothing else:\n"
    '<qa>{"question": "...", "answer": "...", "aliases": ["other accepted forms of the answer"], '
    '"difficulty": "easy" | "medium" | "hard"}</qa>'
)

DIFFICULTY_LEVELS: dict[str, int] = {"easy": 0, "medium": 1, "hard": 2}

PARSE_REASONS: tuple[str, ...] = (
    "no_qa_block",  # neither a complete <qa>...</qa> block nor a fenced ```json block
    "bad_json",  # the block is not valid JSON, or not a JSON object
    "missing_field",  # question, answer or difficulty absent (or null)
    "bad_field",  # a field of the wrong type (question not a string, aliases not strings, answer a bool/list ...)
    "empty_answer",  # the answer is blank (or only punctuation/articles)
    "answer_too_long",  # more than max_answer_words words or max_answer_chars characters
    "question_too_short",  # fewer than min_question_words words
    "question_too_long",  # more than max_question_chars characters
    "not_a_question",  # does not end with "?"
    "bad_difficulty",  # difficulty not one of easy / medium / hard
    "answer_in_question",  # the answer (or an alias) appears in the question, normalised, as whole words
    "answer_in_caption",  # the answer appears in the caption: identification alone answers it, no search needed
)
REJECT_REASONS: tuple[str, ...] = PARSE_REASONS + ("duplicate", "image_error", "endpoint_error")

_QA_RE = re.compile(r"<qa>(.*?)</qa>", re.IGNORECASE | re.DOTALL)
_FENCE_RE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n?(.*?)```", re.IGNORECASE | re.DOTALL)
_REPLY_KEEP = 500  # characters of a rejected reply kept in the rejects


def _contains_words(haystack: str, needle: str) -> bool:
    """``needle`` occurs in ``haystack`` as whole words, both normalised with :func:`normalize_answer`."""
    n, h = normalize_answer(needle), normalize_answer(haystack)
    return bool(n) and f" {n} " in f" {h} "


def _parse(
    text: str,
    caption: str,
    *,
    max_answer_words: int = 8,
    max_answer_chars: int = 80,
    min_question_words: int = 5,
    max_question_chars: int = 500,
) -> tuple[dict | None, str | None, str]:
    """:func:`parse_reply` plus a human-readable detail for the rejects table."""
    text = "" if text is None else str(text)
    m = _QA_RE.search(text)
    block = m.group(1) if m else None
    if block is None:
        f = _FENCE_RE.search(text)
        if f is None:
            unclosed = "<qa>" in text.lower()
            return None, "no_qa_block", "unclosed <qa> tag (reply truncated?)" if unclosed else "no <qa> block"
        block = f.group(1)
    block = block.strip()
    f = _FENCE_RE.fullmatch(block)  # a fenced block inside the <qa> tags
    if f is not None:
        block = f.group(1).strip()
    try:
        obj = json.loads(block)
    except ValueError as exc:
        return None, "bad_json", f"{type(exc).__name__}: {exc}"
    if not isinstance(obj, dict):
        return None, "bad_json", f"a JSON {type(obj).__name__}, not an object"
    missing = [k for k in ("question", "answer", "difficulty") if obj.get(k) is None]
    if missing:
        return None, "missing_field", f"missing {', '.join(missing)}"
    question, answer, aliases = obj["question"], obj["answer"], obj.get("aliases")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)  # a year or a count given as a JSON number
    if not isinstance(question, str) or not isinstance(answer, str):
        kinds = f"{type(question).__name__}/{type(answer).__name__}"
        return None, "bad_field", f"question/answer must be strings, got {kinds}"
    if aliases is None:
        aliases = []
    elif isinstance(aliases, (str, int, float)) and not isinstance(aliases, bool):
        aliases = [aliases]
    if not isinstance(aliases, list) or not all(
        isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in aliases
    ):
        return None, "bad_field", f"aliases must be a list of strings, got {aliases!r}"[:200]
    question, answer = " ".join(question.split()), " ".join(answer.split())
    if not normalize_answer(answer):
        return None, "empty_answer", f"answer {answer!r}"
    if len(answer.split()) > max_answer_words or len(answer) > max_answer_chars:
        sizes = f"{len(answer.split())} words, {len(answer)} chars"
        return None, "answer_too_long", f"{sizes} (max {max_answer_words} words, {max_answer_chars} chars)"
    if len(question.split()) < min_question_words:
        return None, "question_too_short", f"{len(question.split())} words (min {min_question_words})"
    if len(question) > max_question_chars:
        return None, "question_too_long", f"{len(question)} chars (max {max_question_chars})"
    if not question.endswith("?"):
        return None, "not_a_question", f"does not end with '?': {question[-40:]!r}"
    level = DIFFICULTY_LEVELS.get(str(obj["difficulty"]).strip().lower())
    if level is None:
        return None, "bad_difficulty", f"difficulty {obj['difficulty']!r}"[:200]
    kept: list[str] = []
    seen = {normalize_answer(answer)}
    for a in (" ".join(str(a).split()) for a in aliases):
        na = normalize_answer(a)
        if na and na not in seen:
            seen.add(na)
            kept.append(a)
    for a in [answer] + kept:
        if _contains_words(question, a):
            return None, "answer_in_question", f"{a!r} occurs in the question"
    if caption and _contains_words(caption, answer):
        return None, "answer_in_caption", f"{answer!r} occurs in the caption"
    return {"question": question, "answer": answer, "aliases": kept, "difficulty": level}, None, ""


def parse_reply(text: str, caption: str, **limits: int) -> tuple[dict | None, str | None]:
    """Parse and validate one model reply: ``(item, None)`` or ``(None, reason)``, reason in :data:`PARSE_REASONS`.

    The first complete ``<qa>...</qa>`` block is read (a fenced ```` ```json ```` block inside it is unwrapped);
    without one, the first fenced ```` ``` ```` / ```` ```json ```` block is the fallback. ``item`` is
    ``{"question", "answer", "aliases", "difficulty"}`` with whitespace collapsed, a numeric answer as a string,
    aliases de-duplicated (normalised, the answer itself dropped) and difficulty as 0/1/2. Checks run in the
    order of :data:`PARSE_REASONS`; ``limits`` overrides ``max_answer_words`` (8), ``max_answer_chars`` (80),
    ``min_question_words`` (5) and ``max_question_chars`` (500).

    >>> parse_reply('<qa>{"question": "In which year was this tower completed?", "answer": 1889, '
    ...             '"difficulty": "Medium"}</qa>', "a tower at night")
    ({'question': 'In which year was this tower completed?', 'answer': '1889', 'aliases': [], 'difficulty': 1}, None)
    >>> parse_reply("Sure! Here is a question.", "x")
    (None, 'no_qa_block')
    """
    item, reason, _ = _parse(text, caption, **limits)
    return item, reason


class LLMSynthesizer:
    """Synthesises search questions for real images with a model on an OpenAI-compatible endpoint.

    ``base_url`` is the API root (e.g. ``http://127.0.0.1:8000/v1``); the API key is read from the environment
    variable ``api_key_env`` (the placeholder key ``EMPTY`` when it is unset). ``max_retries`` extra attempts follow
    the first on network errors, timeouts (``timeout_s`` per attempt), 5xx and 429. ``limits`` are passed to
    :func:`parse_reply`.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str = "OPENAI_API_KEY",
        timeout_s: float = 60,
        max_retries: int = 2,
        temperature: float = 0.7,
        max_tokens: int = 512,
        concurrency: int = 4,
        max_failure_rate: float = 0.5,
        max_image_side: int = 1024,
        max_caption_chars: int = 2000,
        seed: int | None = 0,
        backoff_s: float = 0.5,
        progress: bool = True,
        limits: dict[str, int] | None = None,
    ) -> None:
        if concurrency < 1 or max_retries < 0 or not 0.0 <= max_failure_rate <= 1.0:
            raise ValueError(
                f"need concurrency >= 1, max_retries >= 0 and 0 <= max_failure_rate <= 1, "
                f"got {concurrency}, {max_retries}, {max_failure_rate}"
            )
        self.model = model
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.concurrency = int(concurrency)
        self.max_failure_rate = float(max_failure_rate)
        self.max_image_side = int(max_image_side)
        self.max_caption_chars = int(max_caption_chars)
        self.seed = seed
        self.progress = progress
        self.limits = dict(limits or {})
        self.llm = ChatClient(base_url, api_key=os.environ.get(api_key_env) or None, timeout_s=timeout_s,
                              retries=max_retries, backoff_s=backoff_s, name="synthesis endpoint")
        self.url = self.llm.url

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> LLMSynthesizer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _load_image(self, path: Path) -> Image.Image:
        with Image.open(path) as im:
            im = ImageOps.exif_transpose(im)
            im = im.convert("RGB")
        if max(im.size) > self.max_image_side:
            im.thumbnail((self.max_image_side, self.max_image_side))
        return im

    def body(self, image: Image.Image, caption: str, item_id: str) -> dict:
        """The request body for one item."""
        caption = " ".join(str(caption or "").split())[: self.max_caption_chars]
        dialogue = [
            {"role": "system", "content": SYNTH_PROMPT},
            {"role": "user", "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": f"Caption: {caption}"},
            ]},
        ]
        body: dict[str, Any] = {
            "model": self.model,
            "messages": to_openai_messages(dialogue),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.seed is not None:
            body["seed"] = (int(self.seed) + zlib.crc32(str(item_id).encode("utf-8"))) % 2**31
        return body

    def _one(self, item: dict, image_root: Path) -> dict:
        """One item -> ``{"id", "item"?, "reason"?, "detail", "reply"}`` (never raises for endpoint trouble)."""
        iid = str(item["id"])
        try:
            image = self._load_image(image_root / item["image_path"])
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            return {"id": iid, "reason": "image_error", "detail": f"{type(exc).__name__}: {exc}"[:500], "reply": ""}
        try:
            reply = self.llm.text(self.body(image, item.get("caption", ""), iid))
        except LLMError as exc:
            return {"id": iid, "reason": "endpoint_error", "detail": str(exc)[:500], "reply": ""}
        parsed, reason, detail = _parse(reply, str(item.get("caption") or ""), **self.limits)
        return {"id": iid, "item": parsed, "reason": reason, "detail": detail, "reply": reply[:_REPLY_KEEP]}

    def synthesize(self, items: list[dict], image_root: str | Path = ".") -> tuple[list[dict], list[dict]]:
        """``(accepted QUESTIONS rows, rejects {"id", "reason", "detail", "reply"})``, both in input order.

        Raises :class:`RuntimeError` when more than ``max_failure_rate`` of the requests end in ``endpoint_error``
        (image errors are not requests), and :class:`ValueError` on repeated item ids.
        """
        image_root = Path(image_root)
        ids = [str(it["id"]) for it in items]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"item ids must be unique, repeated: {dup[:10]}")
        results: dict[int, dict] = {}
        failed = no_request = 0
        bar = tqdm(total=len(items), desc=f"synthesize[{self.model}]", unit="img", disable=not self.progress)
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, max(1, len(items))))
        try:
            pending = {pool.submit(self._one, it, image_root): i for i, it in enumerate(items)}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    i = pending.pop(fut)
                    results[i] = fut.result()
                    failed += results[i]["reason"] == "endpoint_error"
                    no_request += results[i]["reason"] == "image_error"
                    bar.update(1)
                n_requests = len(items) - no_request  # an upper bound until every item is done
                if failed and failed > self.max_failure_rate * n_requests:  # cannot end under the limit any more
                    for fut in pending:
                        fut.cancel()
                    example = next(r["detail"] for r in results.values() if r["reason"] == "endpoint_error")
                    raise EndpointDown(
                        f"synthesis endpoint {self.url} (model {self.model}) failed {failed} of {n_requests} "
                        f"requests, more than the allowed {self.max_failure_rate:.0%}"
                        f"{' (stopped early)' if pending else ''}; e.g. {example}"
                    )
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            bar.close()

        rows: list[dict] = []
        rejects: list[dict] = []
        seen: dict[str, str] = {}
        for i, it in enumerate(items):
            r = results[i]
            parsed = r.get("item")
            if parsed is not None:
                key = normalize_answer(parsed["question"])
                if key in seen:
                    r = {**r, "reason": "duplicate", "detail": f"same question as item {seen[key]}"}
                    parsed = None
                else:
                    seen[key] = r["id"]
            if parsed is None:
                rejects.append({"id": r["id"], "reason": r["reason"], "detail": r["detail"], "reply": r["reply"]})
                continue
            rows.append({
                "question_id": f"llm-{r['id']}",
                "type": "search",
                "scene_id": None,
                "image_path": str(it["image_path"]),
                "question": parsed["question"],
                "answer": parsed["answer"],
                "aliases": parsed["aliases"],
                "choices": None,
                "entity_id": r["id"],
                "difficulty": parsed["difficulty"],
                "split": "unassigned",
            })
        return rows, rejects
