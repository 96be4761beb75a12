"""Content-addressed cache of tool results, so tool calls can be recorded once and replayed exactly.

What it does
    :class:`ToolCache` maps a call to its :class:`~mars.tools.base.Observation`. The key
    (:meth:`ToolCache.key`) is the SHA-256 of a canonical JSON document holding the tool name, the
    (validated, normalised) arguments, the SHA-256 of every image the call reads (raw RGB bytes plus size;
    only the referenced image, not the whole dialogue) and a ``context`` dict the caller adds (the
    :class:`~mars.tools.toolbox.ToolBox` puts its :class:`~mars.tools.toolbox.ToolConfig` there, and for
    image tools the number of images in the dialogue, since the text names the indices new images get).

    Modes: ``"off"`` (never read or write), ``"record"`` (every live result is stored; hits are not used),
    ``"replay"`` (only the cache answers; a miss is an error observation ``"cache miss in replay mode for
    ..."`` and the backend is never called), ``"readwrite"`` (hits answer, misses are computed live and
    stored). The ToolBox consults the cache around the live call; argument-validation errors and internal
    errors are never stored.

    On disk the cache is a directory artifact (track it with DVC as a whole)::

        <dir>/entries.jsonl        append-only, one JSON object per line:
                                   {"key", "tool", "arguments", "text", "error", "images": [sha...], "latency_s"}
        <dir>/images/<sha>.png     every returned image as PNG, named by the SHA-256 of its PNG bytes

    Each entry is appended with flush + fsync; image files are written first and atomically
    (:func:`mars.data.io.atomic_write_bytes`), so an entry never points at a half-written image. A truncated
    last line (a crash mid-append) is ignored on load and the next append starts on a fresh line; a corrupt
    line in the middle raises :class:`CacheLoadError` naming the file and the line. A later entry with the
    same key wins. An entry whose image file has gone missing counts as a miss.

    Replayed images are decoded from PNG (lossless), so their pixels equal the recorded ones; they come back
    in RGB mode.

Deviation from the paper
    MARS calls live web APIs whose answers change over time; caching them is how one makes runs repeatable.
    Our backends are offline and deterministic, so the cache mainly saves time (image search embeds the
    query) and lets evaluation run with no index at all (``replay`` with a ToolBox whose indexes are None).

How to run
    >>> cache = ToolCache(Path("data/tool_cache"), mode="readwrite")
    >>> box = ToolBox.from_dirs(Path("data/index"), Path("data/world/gallery"), ToolConfig(), cache=cache)
    >>> box.call("text_search", {"query": "Ornil Press"}, images=[])
    >>> cache.stats   # {'hits': ..., 'misses': ..., 'writes': ...}
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

from PIL import Image

from mars.data.io import atomic_write_bytes
from mars.errors import StageError
from mars.tools.base import Observation

__all__ = ["CACHE_MODES", "CacheLoadError", "CacheMode", "ToolCache", "canonical_json", "image_digest"]

log = logging.getLogger(__name__)

CacheMode = Literal["off", "record", "replay", "readwrite"]
CACHE_MODES: tuple[str, ...] = ("off", "record", "replay", "readwrite")
ENTRIES = "entries.jsonl"
IMAGES = "images"
KEY_VERSION = 1


class CacheLoadError(StageError, ValueError):
    """The cache directory holds a corrupt entries file."""


def canonical_json(obj: Any) -> str:
    """Canonical JSON: sorted keys, no whitespace, UTF-8 kept, NaN/inf refused."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def image_digest(image: Image.Image) -> str:
    """SHA-256 (hex) of an image's size and raw RGB bytes (independent of file format and metadata)."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    h = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


class ToolCache:
    """Tool-result cache in ``directory`` (see the module docstring). Not shared across threads."""

    def __init__(self, directory: str | Path, mode: CacheMode = "readwrite") -> None:
        if mode not in CACHE_MODES:
            raise ValueError(f"cache mode must be one of {CACHE_MODES}, got {mode!r}")
        self.directory = Path(directory)
        self.mode: str = mode
        self.hits = self.misses = self.writes = 0
        self._entries: dict[str, dict] = {}
        self._truncated_at: int | None = None  # byte offset where a truncated last line starts
        self._tail_complete = False
        if mode != "off":
            self._load()

    # --- keys -------------------------------------------------------------------------------

    @staticmethod
    def key(tool: str, arguments: Any, images: list[Image.Image] = (), context: Any = None) -> str:
        """Cache key of a call: SHA-256 over tool, canonical arguments, the read images' digests and context."""
        doc = {
            "v": KEY_VERSION,
            "tool": tool,
            "arguments": arguments,
            "images": [image_digest(im) for im in images],
            "context": context,
        }
        return hashlib.sha256(canonical_json(doc).encode("utf-8")).hexdigest()

    # --- reading ----------------------------------------------------------------------------

    @property
    def reads(self) -> bool:
        return self.mode in ("replay", "readwrite")

    @property
    def writes_enabled(self) -> bool:
        return self.mode in ("record", "readwrite")

    @property
    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "hits": self.hits, "misses": self.misses, "writes": self.writes}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def _load(self) -> None:
        path = self.directory / ENTRIES
        if not path.is_file():
            return
        data = path.read_bytes()
        lines = data.split(b"\n")
        ends_clean = data.endswith(b"\n") or not data
        offset = 0
        for i, raw in enumerate(lines):
            last = i == len(lines) - 1  # only non-empty when the file lacks a final newline
            start, offset = offset, offset + len(raw) + 1
            if not raw.strip():
                continue
            try:
                entry = json.loads(raw.decode("utf-8"))
                if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
                    raise ValueError("not an entry object")
            except (ValueError, UnicodeDecodeError) as exc:
                if last and not ends_clean:
                    log.warning("tool cache %s: ignoring a truncated last line (%d bytes)", path, len(raw))
                    self._truncated_at = start
                    continue
                raise CacheLoadError(f"tool cache file {path} line {i + 1} is corrupt: {exc}") from exc
            self._entries[entry["key"]] = entry
        if not ends_clean and self._truncated_at is None:
            self._truncated_at, self._tail_complete = len(data), True  # complete last entry lacking its newline

    def get(self, key: str) -> Observation | None:
        """The stored observation for ``key`` (images decoded), or None (also if an image file is missing)."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        images = []
        for sha in entry.get("images", []):
            p = self.directory / IMAGES / f"{sha}.png"
            try:
                with Image.open(p) as im:
                    images.append(im.convert("RGB"))
            except (OSError, ValueError):
                log.warning("tool cache %s: image %s of entry %s is missing or unreadable", self.directory, p, key)
                self.misses += 1
                return None
        self.hits += 1
        return Observation(text=entry["text"], images=images, error=entry.get("error"),
                           latency_s=float(entry.get("latency_s", 0.0)))

    # --- writing ----------------------------------------------------------------------------

    def put(self, key: str, tool: str, arguments: Any, obs: Observation) -> None:
        """Store ``obs`` under ``key`` (images first, then the entry line, fsynced). No-op if already stored."""
        if not self.writes_enabled:
            raise RuntimeError(f"tool cache in mode {self.mode!r} does not record")
        if key in self._entries:
            return
        shas = []
        for im in obs.images:
            buf = io.BytesIO()
            (im if im.mode in ("RGB", "L", "RGBA") else im.convert("RGB")).save(buf, format="PNG")
            png = buf.getvalue()
            sha = hashlib.sha256(png).hexdigest()
            p = self.directory / IMAGES / f"{sha}.png"
            if not p.is_file():
                atomic_write_bytes(p, png)
            shas.append(sha)
        entry = {
            "key": key,
            "tool": tool,
            "arguments": arguments,
            "text": obs.text,
            "error": obs.error,
            "images": shas,
            "latency_s": round(float(obs.latency_s), 6),
        }
        line = canonical_json(entry).encode("utf-8") + b"\n"
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / ENTRIES
        prefix = b""
        if self._truncated_at is not None and path.is_file():
            if self._tail_complete:
                prefix = b"\n"  # the last entry lacks its newline: end it, keep it
            else:  # drop the truncated last line (a crash mid-append): one valid entry per line
                with open(path, "r+b") as fh:
                    fh.truncate(self._truncated_at)
                    fh.flush()
                    os.fsync(fh.fileno())
        with open(path, "ab") as fh:
            fh.write(prefix + line)
            fh.flush()
            os.fsync(fh.fileno())
        self._truncated_at = None
        self._entries[key] = entry
        self.writes += 1
