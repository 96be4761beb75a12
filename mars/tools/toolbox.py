"""The agent's three tools in one in-process :class:`ToolBox`, shared by SFT data generation, RL and evaluation.

What it does
    ``ToolBox.call(name, arguments, images) -> Observation`` runs one tool call and NEVER raises:

    - ``image_zoom_in(bbox_2d, label, img_idx)`` crops ``images[img_idx]`` at ``bbox_2d`` and resizes the
      crop with Qwen's :func:`~mars.tools.imaging.smart_resize` (``factor``, ``min_pixels``, ``max_pixels``
      of :class:`ToolConfig`). With ``coords="relative"`` (default) the box is on a 0..1000 grid mapped onto
      that image's width and height; with ``coords="absolute"`` it is in pixels of that image. The pixel box
      is ``floor(x1), floor(y1), ceil(x2), ceil(y2)`` clamped to the image (so it always covers the asked
      region and is at least 1 px). The text names the index the crop gets: ``len(images)``.
    - ``text_search(query)`` returns the top ``text_k`` documents of the :class:`~mars.tools.text_index.TextIndex`
      as numbered ``[i] <title>: <snippet>`` lines (snippets cut to ``max_snippet_chars``, the whole text to
      ``max_output_chars``); no hit is a normal observation ``No results for "..."``.
    - ``image_search(img_idx)`` searches ``images[img_idx]`` in the :class:`~mars.tools.image_index.ImageIndex`
      and returns the top ``image_k`` titles (``[i] <title>``) plus their gallery images as thumbnails (long
      side ``thumb_size``), naming the indices the thumbnails get.

    ``images`` are the dialogue's images AS SHOWN TO THE POLICY (already smart_resized; index 0 is the
    original), so boxes refer to what the model saw. ``arguments`` is a dict (a JSON string holding an
    object is accepted too, as in OpenAI tool calls). Every bad call -- unknown tool, arguments that are not
    an object, missing / extra / mistyped arguments, a bbox that is not 4 finite numbers in range with
    x1 < x2 and y1 < y2, a box too thin to resize (aspect ratio >= 200), an img_idx out of range, an
    empty / whitespace / oversized query or label, an index that is not configured -- returns an
    Observation whose ``error`` and ``text`` say what was wrong and how to fix it, e.g.
    ``image_zoom_in: bbox_2d x2 (120) must be > x1 (300)``. Any unexpected exception becomes
    ``internal tool error: ...``.

    An optional :class:`~mars.tools.cache.ToolCache` is consulted around the live call (after argument
    validation, before the backend): its key covers the tool, the normalised arguments, the digest of the
    image the call reads, the ToolConfig and (image tools) ``len(images)``. Validation and internal errors
    are never cached. In ``replay`` mode a ToolBox needs no index at all.

Deviation from the paper
    MARS's tools are web text search, web reverse image search and a crop tool. Ours search an offline,
    generated world (docs/design.md, The embedded default world): BM25 over the world corpus and exact nearest
    neighbours over the emblem gallery. Boxes use relative 0..1000 coordinates, as Qwen2.5-VL grounding and
    the reference release do (``coords="absolute"`` for pixels).

How to run
    >>> box = ToolBox.from_dirs(Path("data/index"), Path("data/world/gallery"), ToolConfig())
    >>> obs = box.call("image_zoom_in", {"bbox_2d": [0, 0, 500, 500], "label": "top-left", "img_idx": 0}, [img])
    >>> obs.ok, obs.text, obs.images[0].size
    >>> box.call("text_search", {"query": "Ornil Press founded"}, images=[img])
"""

from __future__ import annotations

import json
import math
import numbers
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from PIL import Image

from mars.tools.base import IMAGE_SEARCH, TEXT_SEARCH, TOOL_ARGS, TOOL_NAMES, ZOOM, Observation
from mars.tools.cache import ToolCache, canonical_json
from mars.tools.imaging import smart_resize

__all__ = ["ToolBox", "ToolConfig", "ToolError", "zoom_text"]

REL_MAX = 1000  # the relative grid: 0..1000
MAX_ASPECT = 200  # smart_resize refuses aspect ratios >= 200
MAX_LABEL_CHARS = 100  # labels are echoed in the observation text up to this length
_HUGE = 10**15  # numbers beyond this are never printed in full


class ToolError(Exception):
    """A bad call; the message is shown to the model."""


@dataclass(frozen=True)
class ToolConfig:
    """Tool behaviour knobs (see the module docstring)."""

    coords: Literal["relative", "absolute"] = "relative"
    factor: int = 28
    min_pixels: int = 56 * 56
    max_pixels: int = 224 * 224
    text_k: int = 3
    max_snippet_chars: int = 300
    max_output_chars: int = 2000
    image_k: int = 5
    thumb_size: int = 64
    max_query_chars: int = 512

    def __post_init__(self) -> None:
        if self.coords not in ("relative", "absolute"):
            raise ValueError(f"ToolConfig.coords must be 'relative' or 'absolute', got {self.coords!r}")
        for name in ("factor", "min_pixels", "max_pixels", "text_k", "max_snippet_chars", "max_output_chars",
                     "image_k", "thumb_size", "max_query_chars"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ToolConfig.{name} must be a positive integer, got {v!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"ToolConfig.min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        if self.max_output_chars < 20:
            raise ValueError(f"ToolConfig.max_output_chars must be >= 20, got {self.max_output_chars}")


def _short(value: Any, limit: int = 60) -> str:
    """A short, safe rendering of any value for an error message."""
    try:
        if isinstance(value, bool) or value is None:
            return repr(value)
        if isinstance(value, int):
            return str(value) if abs(value) < _HUGE else ("a huge number" if value > 0 else "a huge negative number")
        if isinstance(value, float):
            return repr(value) if math.isfinite(value) else str(value)
        if isinstance(value, str):
            s = value if len(value) <= limit else value[:limit] + f"... ({len(value)} chars)"
            return json.dumps(s, ensure_ascii=False)
        r = repr(value)
    except Exception:  # repr of pathological objects (deep nesting, huge ints inside containers)
        return f"a {type(value).__name__}"
    return r if len(r) <= limit else r[:limit] + "..."


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, numbers.Integral):
        return "an integer"
    if isinstance(value, numbers.Real):
        return "a number"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _num(v: float) -> str:
    """Format a validated coordinate: integers without a decimal point, others with up to 2 decimals."""
    return str(int(v)) if float(v).is_integer() else f"{v:.2f}".rstrip("0").rstrip(".")


def zoom_text(label: str, img_idx: int, bbox_2d, crop_idx: int) -> str:
    """The zoom tool's observation text: what was zoomed (``label``, "the region" when empty), on which image, the
    box as called (``bbox_2d``), and the index the crop gets among the episode's images (``crop_idx``)."""
    box = ", ".join(_num(v) for v in bbox_2d)
    return f"Zoomed in on {label or 'the region'} (image {img_idx}, box [{box}]); the crop is image {crop_idx}."


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - 3)].rstrip() + "..."


class ToolBox:
    """The agent's tools over a text index, an image index and the gallery directory (any may be None)."""

    def __init__(
        self,
        text_index: Any | None,
        image_index: Any | None,
        gallery_dir: Path | None,
        cfg: ToolConfig | None = None,
        cache: ToolCache | None = None,
    ) -> None:
        self.text_index = text_index
        self.image_index = image_index
        self.gallery_dir = Path(gallery_dir) if gallery_dir is not None else None
        self.cfg = cfg if cfg is not None else ToolConfig()
        self.cache = cache if cache is not None and cache.mode != "off" else None
        self._cfg_context = asdict(self.cfg)

    @classmethod
    def from_dirs(
        cls, index_dir: Path, gallery_dir: Path, cfg: ToolConfig | None = None, cache: ToolCache | None = None
    ) -> ToolBox:
        """Load ``index_dir/text`` and ``index_dir/image`` as the ``index`` stage saves them.

        The image index is loaded with the embedder named in ``index_dir/manifest.json`` (``"embedder"``,
        a :func:`~mars.tools.embedders.load_embedder` spec; ``"color_layout"`` if the manifest lacks it).
        """
        from mars.tools.embedders import load_embedder
        from mars.tools.image_index import ImageIndex
        from mars.tools.text_index import IndexLoadError, TextIndex

        index_dir = Path(index_dir)
        manifest_path = index_dir / "manifest.json"
        if not manifest_path.is_file():
            raise IndexLoadError(f"index directory {index_dir} has no manifest.json (run the index stage first)")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise IndexLoadError(f"index manifest {manifest_path} is unreadable: {exc}") from exc
        spec = manifest.get("embedder", "color_layout") if isinstance(manifest, dict) else "color_layout"
        text = TextIndex.load(index_dir / "text")
        image = ImageIndex.load(index_dir / "image", load_embedder(spec))
        return cls(text, image, Path(gallery_dir), cfg, cache)

    # --- the entry point ----------------------------------------------------------------------

    def call(self, name: Any, arguments: Any, images: list[Image.Image]) -> Observation:
        """Run one tool call; never raises (bad calls and internal failures are error observations)."""
        t0 = time.perf_counter()
        try:
            obs = self._call(name, arguments, images)
        except ToolError as exc:
            obs = self._error(str(exc))
        except Exception as exc:  # anything unexpected: report, never crash the rollout
            try:
                detail = _cut(_one_line(f"{type(exc).__name__}: {exc}"), 300)
            except Exception:
                detail = type(exc).__name__
            obs = self._error(f"internal tool error: {detail}")
        obs.latency_s = time.perf_counter() - t0
        return obs

    @staticmethod
    def _error(message: str) -> Observation:
        return Observation(text=message, images=[], error=message)

    def _call(self, name: Any, arguments: Any, images: list[Image.Image]) -> Observation:
        if not isinstance(name, str) or name not in TOOL_NAMES:
            raise ToolError(f"unknown tool {_short(name)}: use one of {', '.join(TOOL_NAMES)}")
        args = self._arguments(name, arguments)
        if name == ZOOM:
            norm, read = self._check_zoom(args, images)
        elif name == IMAGE_SEARCH:
            norm, read = self._check_image_search(args, images)
        else:
            norm, read = self._check_text_search(args), []
        context: dict[str, Any] = {"cfg": self._cfg_context}
        if name != TEXT_SEARCH:
            context["n_images"] = len(images)
        key = None
        if self.cache is not None:
            key = self.cache.key(name, norm, [images[i] for i in read], context)
            if self.cache.reads:
                hit = self.cache.get(key)
                if hit is not None:
                    return hit
                if self.cache.mode == "replay":
                    raise ToolError(f"cache miss in replay mode for {name} {_cut(canonical_json(norm), 200)}")
        obs = self._live(name, norm, images)
        if key is not None and self.cache.writes_enabled and obs.error is None:
            self.cache.put(key, name, norm, obs)
        return obs

    def _live(self, name: str, norm: dict, images: list[Image.Image]) -> Observation:
        if name == ZOOM:
            return self._zoom(norm, images)
        if name == IMAGE_SEARCH:
            return self._image_search(norm, images)
        return self._text_search(norm)

    # --- argument validation ------------------------------------------------------------------

    @staticmethod
    def _arguments(name: str, arguments: Any) -> dict:
        accepted = TOOL_ARGS[name]
        sig = f"{name}({', '.join(accepted)})"
        if isinstance(arguments, (str, bytes)):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise ToolError(f"{name}: arguments must be a JSON object like {sig}, got a string that is not JSON")
        if not isinstance(arguments, dict):
            raise ToolError(f"{name}: arguments must be a JSON object with keys {sig}, got {_type_name(arguments)}")
        extra = [k for k in arguments if k not in accepted]
        if extra:
            names = ", ".join(sorted(_short(k, 30) for k in extra)[:5])
            raise ToolError(f"{name}: unexpected argument(s) {names}; {name} accepts only {', '.join(accepted)}")
        missing = [k for k in accepted if k not in arguments]
        if missing:
            raise ToolError(f"{name}: missing argument(s) {', '.join(missing)}; call it as {sig}")
        return arguments

    @staticmethod
    def _check_idx(name: str, value: Any, images: list[Image.Image]) -> int:
        n = len(images)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ToolError(f"{name}: img_idx must be an integer image index (0 to {n - 1}), got {_type_name(value)} "
                            f"{_short(value)}")
        value = int(value)
        if n == 0:
            raise ToolError(f"{name}: there is no image in the dialogue to use")
        if value < 0 or value >= n:
            raise ToolError(f"{name}: img_idx {_short(value)} is out of range: the dialogue has {n} image(s), "
                            f"use 0 to {n - 1}")
        return value

    def _check_zoom(self, args: dict, images: list[Image.Image]) -> tuple[dict, list[int]]:
        idx = self._check_idx(ZOOM, args["img_idx"], images)
        label = args["label"]
        if not isinstance(label, str):
            raise ToolError(f"{ZOOM}: label must be a string naming what is in the box, got {_type_name(label)}")
        if len(label) > self.cfg.max_query_chars:
            raise ToolError(f"{ZOOM}: label is too long ({len(label)} chars); use a short name "
                            f"(at most {self.cfg.max_query_chars} chars)")
        label = _cut(_one_line(label), MAX_LABEL_CHARS)
        W, H = images[idx].size
        box = self._check_bbox(args["bbox_2d"], W, H, idx)
        # pixel box: covers the asked region, clamped to the image, at least 1 px (x1 < x2 guarantees it)
        if self.cfg.coords == "relative":
            l, t = math.floor(box[0] * W / REL_MAX), math.floor(box[1] * H / REL_MAX)
            r, b = math.ceil(box[2] * W / REL_MAX), math.ceil(box[3] * H / REL_MAX)
        else:
            l, t, r, b = math.floor(box[0]), math.floor(box[1]), math.ceil(box[2]), math.ceil(box[3])
        l, t = min(max(l, 0), W - 1), min(max(t, 0), H - 1)
        r, b = min(max(r, l + 1), W), min(max(b, t + 1), H)
        cw, ch = r - l, b - t
        if max(cw, ch) / min(cw, ch) >= MAX_ASPECT:
            raise ToolError(f"{ZOOM}: the box is {cw}x{ch} pixels on image {idx}, too thin to zoom in on "
                            f"(aspect ratio must be below {MAX_ASPECT}); use a box closer to a square")
        norm = {"bbox_2d": box, "label": label, "img_idx": idx, "pixel_box": [l, t, r, b]}
        return norm, [idx]

    def _check_bbox(self, bbox: Any, W: int, H: int, idx: int) -> list[float]:
        shape = "[x1, y1, x2, y2]"
        if not isinstance(bbox, (list, tuple)):
            raise ToolError(f"{ZOOM}: bbox_2d must be a list of 4 numbers {shape}, got {_type_name(bbox)}")
        if len(bbox) != 4:
            raise ToolError(f"{ZOOM}: bbox_2d must have exactly 4 numbers {shape}, got {len(bbox)}")
        names = ("x1", "y1", "x2", "y2")
        for n, v in zip(names, bbox):
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ToolError(f"{ZOOM}: bbox_2d {n} must be a number, got {_type_name(v)} {_short(v, 30)}")
            if isinstance(v, float) and not math.isfinite(v):
                raise ToolError(f"{ZOOM}: bbox_2d {n} must be a finite number, got {v}")
        if self.cfg.coords == "relative":
            limits = (REL_MAX, REL_MAX, REL_MAX, REL_MAX)
            where = "the relative grid 0..1000 (0 = left/top edge, 1000 = right/bottom edge of the image)"
        else:
            limits = (W, H, W, H)
            where = f"image {idx}, which is {W}x{H} pixels (x in 0..{W}, y in 0..{H})"
        for n, v, hi in zip(names, bbox, limits):
            if not 0 <= v <= hi:
                raise ToolError(f"{ZOOM}: bbox_2d {n} ({_short(v)}) is outside {where}")
        box = [float(v) for v in bbox]  # safe now: every value is within 0..limit
        if box[2] <= box[0]:
            raise ToolError(f"{ZOOM}: bbox_2d x2 ({_num(box[2])}) must be > x1 ({_num(box[0])}); "
                            f"the box is {shape} with (x1, y1) the top-left corner")
        if box[3] <= box[1]:
            raise ToolError(f"{ZOOM}: bbox_2d y2 ({_num(box[3])}) must be > y1 ({_num(box[1])}); "
                            f"the box is {shape} with (x1, y1) the top-left corner")
        return box

    def _check_image_search(self, args: dict, images: list[Image.Image]) -> tuple[dict, list[int]]:
        idx = self._check_idx(IMAGE_SEARCH, args["img_idx"], images)
        return {"img_idx": idx}, [idx]

    def _check_text_search(self, args: dict) -> dict:
        query = args["query"]
        if not isinstance(query, str):
            raise ToolError(f"{TEXT_SEARCH}: query must be a string of keywords, got {_type_name(query)}")
        if len(query) > self.cfg.max_query_chars:
            raise ToolError(f"{TEXT_SEARCH}: query is too long ({len(query)} chars, at most "
                            f"{self.cfg.max_query_chars}); use a few keywords")
        query = _one_line(query)
        if not query:
            raise ToolError(f"{TEXT_SEARCH}: query is empty; pass a few keywords, e.g. an entity name")
        return {"query": query}

    # --- the tools ------------------------------------------------------------------------------

    def _zoom(self, norm: dict, images: list[Image.Image]) -> Observation:
        idx = norm["img_idx"]
        l, t, r, b = norm["pixel_box"]
        crop = images[idx].crop((l, t, r, b))
        if crop.mode != "RGB":
            crop = crop.convert("RGB")
        h, w = smart_resize(b - t, r - l, self.cfg.factor, self.cfg.min_pixels, self.cfg.max_pixels)
        crop = crop.resize((w, h), Image.Resampling.BICUBIC)
        return Observation(text=zoom_text(norm["label"], idx, norm["bbox_2d"], len(images)), images=[crop])

    def _text_search(self, norm: dict) -> Observation:
        if self.text_index is None:
            raise ToolError(f"{TEXT_SEARCH}: no text index is configured for this tool box")
        query = norm["query"]
        hits = self.text_index.search(query, k=self.cfg.text_k)
        if not hits:
            return Observation(text=f"No results for {_short(query, 100)}.")
        cap = self.cfg.max_output_chars
        lines: list[str] = []
        used = 0
        for i, h in enumerate(hits, 1):
            line = f"[{i}] {_one_line(h.title)}: {_cut(_one_line(h.text), self.cfg.max_snippet_chars)}"
            room = cap - used - (1 if lines else 0)
            if len(line) > room:
                if not lines:
                    lines.append(_cut(line, cap))
                break
            lines.append(line)
            used += len(line) + (1 if len(lines) > 1 else 0)
        return Observation(text="\n".join(lines))

    def _image_search(self, norm: dict, images: list[Image.Image]) -> Observation:
        if self.image_index is None:
            raise ToolError(f"{IMAGE_SEARCH}: no image index is configured for this tool box")
        idx = norm["img_idx"]
        query = images[idx] if images[idx].mode == "RGB" else images[idx].convert("RGB")
        hits = self.image_index.search(query, k=self.cfg.image_k)
        if not hits:
            return Observation(text=f"No similar images found for image {idx}.")
        lines = [f"[{i}] {_cut(_one_line(h.title), 200)}" for i, h in enumerate(hits, 1)]
        thumbs: list[Image.Image] = []
        if self.gallery_dir is not None:
            root = self.gallery_dir.resolve()
            for h in hits:
                p = (root / h.path).resolve()
                if root not in p.parents:
                    raise ValueError(f"gallery path {h.path!r} escapes the gallery directory")
                with Image.open(p) as im:
                    im = im.convert("RGB")
                s = self.cfg.thumb_size / max(im.size)
                size = (max(1, round(im.width * s)), max(1, round(im.height * s)))
                thumbs.append(im.resize(size, Image.Resampling.BICUBIC))
        n = len(images)
        if not thumbs:
            note = "(no thumbnails available)"
        elif len(thumbs) == 1:
            note = f"The thumbnail is image {n}."
        else:
            note = f"Thumbnails [1]-[{len(thumbs)}] are images {n}-{n + len(thumbs) - 1}, in this order."
        text = f"Image search results for image {idx}:\n" + "\n".join(lines) + "\n" + note
        return Observation(text=_cut(text, self.cfg.max_output_chars), images=thumbs)
