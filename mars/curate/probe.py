"""Per-file analysis for image curation: header checks, safe decode, hashes, quality.

:func:`probe_file` looks at one raw image and returns a small :class:`ProbeResult` (never
pixels), either accepted (with sha256, oriented size, source mode, perceptual hash,
quality score and an optional RGB derivative) or rejected with one reason code:

``missing``            the file does not exist (not in the brief's list; a stale raw table), or
                       is a symlink whose target does not exist
``not_a_file``         a directory or another non-regular file (FIFO, socket, device); never opened
``empty_file``         0 bytes
``not_an_image``       PIL cannot identify the file, it has no known image signature and its name
                       has an image extension (:data:`IMAGE_EXTENSIONS`)
``unsupported_extension``  the same, for a name without an image extension (``notes.txt``); a real
                       image is judged by its content whatever its name
``decompression_bomb`` declared width*height above ``max_pixels``; detected from the header
                       only: ``Image.MAX_IMAGE_PIXELS`` is set to ``max_pixels`` around the
                       open, ``DecompressionBombWarning`` is turned into an error, both it and
                       ``DecompressionBombError`` are caught, and width*height is checked
                       again before anything is loaded. The detail cites the declared size,
                       re-read from the header with PIL's limit lifted (still no decode).
``low_resolution``     short side < ``min_short_side`` or pixels < ``min_pixels``
``bad_aspect``         long side / short side > ``max_aspect``
``truncated``          decoding ran out of data (PIL's "image file is truncated", EOFError).
                       ``ImageFile.LOAD_TRUNCATED_IMAGES`` is asserted False at every probe.
``corrupt``            any other decode failure, or a known image signature PIL cannot parse
``low_quality``        quality score below ``quality_threshold``
(a note's reason)      a reject note (:func:`write_reject_note`): a small text file a source leaves in
                       the raw pool in place of an entry it did not copy, rejected with the note's
                       reason and detail. The folder source leaves ``symlink_outside_folder`` (a link
                       out of its folder, never followed), ``not_a_file`` (a FIFO, an empty directory
                       with an image name), ``missing`` (a broken link) and ``unreadable`` (a file it
                       could not read)

A symlink in the raw pool is followed (a DVC cache may link the pool's files there).

Order of work (the speed trick versus the naive "load everything at full size" baseline):
1. ``Image.open`` reads the header only; size, mode and (for JPEG) EXIF orientation come
   from it. The bounds are symmetric in width/height, so orientation does not affect them.
2. Only files that pass are decoded. A plain RGB JPEG without EXIF rotation is decoded
   with ``Image.draft("L", ...)``: libjpeg scales the DCT by 1/2, 1/4 or 1/8 and emits only
   the luma channel, which still walks the whole entropy-coded stream, so truncation and
   corruption are detected, at a fraction of the cost. Other files are fully decoded (they
   must be, to check integrity and, when needed, to write the derivative), then shrunk
   with ``Image.reduce`` before any further work.
3. Hash and quality are computed on a grayscale analysis copy whose long side is exactly
   :data:`ANALYSIS_LONG_SIDE` pixels (area resampling), so scores do not depend on the
   source resolution or on the decode path.

Quality score: variance of the 4-neighbour Laplacian of the analysis copy (0-255 gray
levels). Flat, blank or heavily blurred images score near 0; scenes with edges or texture
score in the hundreds. The default threshold is deliberately low so only near-blank
images are rejected.

Conversions to RGB (and then a derivative is written): CMYK and other colour modes via
PIL; 16/32-bit integer modes by scaling 0..65535 to 0..255 (PIL's own conversion clips);
``F`` by min-max normalisation; P with transparency, LA, PA and RGBA by compositing over
white; 1 and L by channel replication. EXIF orientations 2-8 are applied (the same
transposes as ``ImageOps.exif_transpose``, after the RGB conversion) and the reported
width/height are after orientation. The derivative is ``<image_id>.jpg`` (JPEG q92, for
lossy sources) or ``<image_id>.png`` (lossless sources, compress level 1), written
atomically (temp file in the same directory, then ``os.replace``). When no conversion is needed, no derivative is written.

Run through :func:`mars.curate.pool.curate_pool`; tests: ``python -m pytest tests/curate``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageFile, UnidentifiedImageError

from mars.curate.hashing import phash, sha256_file
from mars.data.io import plain_file_mode
from mars.data.suites import REJECT_REASONS

ANALYSIS_LONG_SIDE = 256
"""Long side, in pixels, of the grayscale copy used for the phash and the quality score."""

ORIENTATION_TAG = 0x0112

# Reasons a probe can give (the dedup pass adds exact_duplicate / near_duplicate; download_failed comes from
# the URL source's failures, mars.curate.download.failures_as_rejects).
REASONS: tuple[str, ...] = tuple(
    r for r in REJECT_REASONS if not r.endswith("_duplicate") and r != "download_failed"
)

IMAGE_EXTENSIONS: frozenset[str] = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif"})
"""Names that promise an image (any case): a non-image under such a name is ``not_an_image``, under another
name ``unsupported_extension``."""

REJECT_NOTE_MAGIC = b"MARS-REJECT-NOTE\n"
"""First line of a reject note (:func:`write_reject_note`)."""
_NOTE_MAX_BYTES = 64 * 1024

# Formats recognised by sniff_format and the extension each is stored under.
_MAGIC: tuple[tuple[str, str], ...] = (
    ("JPEG", ".jpg"),
    ("PNG", ".png"),
    ("GIF", ".gif"),
    ("WEBP", ".webp"),
    ("BMP", ".bmp"),
    ("TIFF", ".tif"),
)

_LOSSY_FORMATS = frozenset({"JPEG", "MPO", "WEBP"})

# EXIF orientation -> the transpose that makes the image upright (as ImageOps.exif_transpose).
_TRANSPOSE: dict[int, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def sniff_format(head: bytes) -> str | None:
    """Image format named by the magic bytes at the start of a file, or None.

    Knows JPEG, PNG, GIF, WEBP, BMP and TIFF (both byte orders).
    """
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "GIF"
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head.startswith(b"BM") and len(head) >= 14:
        return "BMP"
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return "TIFF"
    return None


def extension_for(fmt: str) -> str:
    """File extension (with dot) used for a format returned by :func:`sniff_format`."""
    for name, ext in _MAGIC:
        if name == fmt:
            return ext
    raise KeyError(f"no extension for format {fmt!r}; known: {[n for n, _ in _MAGIC]}")


@dataclass(frozen=True)
class ProbeLimits:
    """Acceptance bounds for one file (see the module docstring for each reason)."""

    min_short_side: int = 1024
    min_pixels: int = 2_000_000
    max_aspect: float = 3.0
    max_pixels: int = 100_000_000
    quality_threshold: float = 5.0


@dataclass(frozen=True)
class ProbeResult:
    """What a probe learns about one file: small, picklable, no pixels."""

    image_id: str
    path: str
    reason: str | None = None  # None: accepted
    detail: str = ""
    sha256: str | None = None
    width: int | None = None  # after EXIF orientation
    height: int | None = None
    mode: str | None = None  # PIL mode of the source file
    format: str | None = None
    phash: str | None = None
    quality: float | None = None
    derivative: str | None = None  # file name inside the derivative directory
    nbytes: int | None = None  # file size (a tie-break between duplicates)

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def pixels(self) -> int:
        return (self.width or 0) * (self.height or 0)


class _Reject(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@contextlib.contextmanager
def _pixel_limit(max_pixels: int | None) -> Iterator[None]:
    """Set PIL's decompression-bomb limit and make its warning an error, then restore."""
    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = old


def _declared_size(path: Path) -> tuple[int, int] | None:
    """Width and height declared in the header, read with PIL's limit lifted (no decode)."""
    try:
        with _pixel_limit(None), Image.open(path) as im:
            return im.size
    except Exception:
        return None


def write_reject_note(path: Path, reason: str, detail: str) -> None:
    """Leave a reject note at ``path``: it stands in the raw pool for an entry a source did not copy, and
    curation rejects it with ``reason`` and ``detail`` (:func:`probe_file`). ``reason`` must be a reject reason
    (:data:`mars.data.suites.REJECT_REASONS`)."""
    if reason not in REJECT_REASONS:
        raise ValueError(f"reject note for {path}: reason {reason!r} is not one of {REJECT_REASONS}")
    path.parent.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"reason": reason, "detail": detail}, ensure_ascii=True, sort_keys=True).encode()
    path.write_bytes(REJECT_NOTE_MAGIC + body[: _NOTE_MAX_BYTES - 100] + b"\n")


def read_reject_note(path: Path) -> tuple[str, str] | None:
    """``(reason, detail)`` of a reject note, or None when ``path`` is not one."""
    with open(path, "rb") as f:
        if f.read(len(REJECT_NOTE_MAGIC)) != REJECT_NOTE_MAGIC:
            return None
        data = f.read(_NOTE_MAX_BYTES)
    try:
        note = json.loads(data)
        reason, detail = str(note["reason"]), str(note["detail"])
    except (ValueError, KeyError, TypeError):
        return None
    return (reason, detail) if reason in REJECT_REASONS else None


def _head(path: Path, n: int = 16) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def _fmt_px(n: int) -> str:
    return f"{n:,} px"


def _is_truncation(exc: BaseException) -> bool:
    if isinstance(exc, EOFError):
        return True
    msg = str(exc).lower()
    return "truncated" in msg or "premature end" in msg or "unexpected end" in msg


def _orientation(im: Image.Image) -> int:
    try:
        value = im.getexif().get(ORIENTATION_TAG, 1)
        value = int(value)
    except Exception:
        return 1
    return value if 1 <= value <= 8 else 1


def _check_bounds(width: int, height: int, lim: ProbeLimits) -> None:
    pixels = width * height
    if pixels > lim.max_pixels:
        raise _Reject(
            "decompression_bomb",
            f"declared {width}x{height} = {_fmt_px(pixels)} > max {_fmt_px(lim.max_pixels)} "
            "(not decoded)",
        )
    short, long = min(width, height), max(width, height)
    if short < lim.min_short_side:
        raise _Reject(
            "low_resolution", f"short side {short} < {lim.min_short_side} ({width}x{height})"
        )
    if pixels < lim.min_pixels:
        raise _Reject(
            "low_resolution",
            f"{width}x{height} = {_fmt_px(pixels)} < min {_fmt_px(lim.min_pixels)}",
        )
    if short <= 0 or long / short > lim.max_aspect:
        raise _Reject(
            "bad_aspect",
            f"aspect {long / max(short, 1):.2f} > {lim.max_aspect:.2f} ({width}x{height})",
        )


def to_rgb(im: Image.Image) -> Image.Image:
    """Convert a decoded image of any PIL mode to RGB (alpha composited over white)."""
    mode = im.mode
    if mode == "RGB":
        return im
    if mode == "P":
        if "transparency" in im.info:
            return _over_white(im.convert("RGBA"))
        return im.convert("RGB")
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        return _over_white(im.convert("RGBA"))
    if mode.startswith("I;16") or mode == "I":
        arr = np.asarray(im).astype(np.float64)
        hi = float(arr.max()) if arr.size else 0.0
        if mode.startswith("I;16") or 255.0 < hi <= 65535.0:
            arr = arr / 257.0
        elif hi > 65535.0:
            arr = arr * (255.0 / hi)
        gray = np.clip(np.rint(arr), 0, 255).astype(np.uint8)
        return Image.fromarray(gray, mode="L").convert("RGB")
    if mode == "F":
        arr = np.asarray(im).astype(np.float64)
        lo, hi = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
        scaled = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
        return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), mode="L").convert(
            "RGB"
        )
    return im.convert("RGB")  # 1, L, CMYK, YCbCr, LAB, HSV, ...


def _over_white(rgba: Image.Image) -> Image.Image:
    out = Image.new("RGB", rgba.size, (255, 255, 255))
    out.paste(rgba, mask=rgba.getchannel("A"))
    return out


def _analysis_gray(gray: Image.Image) -> Image.Image:
    """Area-resample a grayscale image so its long side is ANALYSIS_LONG_SIDE."""
    w, h = gray.size
    long = max(w, h)
    factor = long // (2 * ANALYSIS_LONG_SIDE)
    if factor >= 2:  # cheap integer box reduction first, exact resize after
        gray = gray.reduce(factor)
        w, h = gray.size
        long = max(w, h)
    if long != ANALYSIS_LONG_SIDE:
        s = ANALYSIS_LONG_SIDE / long
        gray = gray.resize(
            (max(1, round(w * s)), max(1, round(h * s))), Image.Resampling.BOX
        )
    return gray


def quality_score(gray: Image.Image | npt.NDArray[np.generic]) -> float:
    """Variance of the 4-neighbour Laplacian of a grayscale image (0-255 levels)."""
    a = np.asarray(gray, dtype=np.float32)
    if a.ndim != 2 or a.shape[0] < 3 or a.shape[1] < 3:
        return 0.0
    lap = 4.0 * a[1:-1, 1:-1] - a[:-2, 1:-1] - a[2:, 1:-1] - a[1:-1, :-2] - a[1:-1, 2:]
    return float(lap.var(dtype=np.float64))


def safe_name(image_id: str) -> str:
    """A file-name-safe form of ``image_id`` (unchanged when it is already safe)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", image_id)
    if safe != image_id or safe in ("", ".", ".."):
        safe = f"{safe}-{hashlib.sha1(image_id.encode()).hexdigest()[:8]}"
    return safe


def write_derivative(rgb: Image.Image, derivative_dir: Path, image_id: str, lossy: bool) -> str:
    """Write ``rgb`` atomically as ``<image_id>.jpg`` (lossy) or ``.png``; return the name."""
    derivative_dir.mkdir(parents=True, exist_ok=True)
    name = safe_name(image_id) + (".jpg" if lossy else ".png")
    fd, tmp = tempfile.mkstemp(dir=derivative_dir, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if lossy:
                rgb.save(f, format="JPEG", quality=92)
            else:
                rgb.save(f, format="PNG", compress_level=1)
            os.fchmod(f.fileno(), plain_file_mode())  # as a plain write, not mkstemp's 0600
        os.replace(tmp, derivative_dir / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return name


def probe_file(
    path: Path,
    image_id: str,
    derivative_dir: Path | None,
    limits: ProbeLimits = ProbeLimits(),
    *,
    rel_path: str | None = None,
) -> ProbeResult:
    """Analyse one file; see the module docstring. Never raises for a bad file.

    ``rel_path`` is what goes into the result's ``path`` (default: ``str(path)``).
    ``derivative_dir`` None means "do not write derivatives" (``derivative`` stays None).
    A symlink is followed; a source that must not follow links out of its folder leaves a reject note instead
    (:mod:`mars.world.folder`).
    """
    path = Path(path)
    shown = rel_path if rel_path is not None else str(path)
    try:
        _check_entry(path, shown)
        return _probe(path, image_id, shown, derivative_dir, limits)
    except _Reject as r:
        return ProbeResult(image_id=image_id, path=shown, reason=r.reason, detail=r.detail)


def _check_entry(path: Path, shown: str) -> None:
    """Reject what is not a regular, non-empty file before anything opens it."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise _Reject("missing", f"file not found: {shown}") from None
    if stat.S_ISLNK(st.st_mode):
        try:
            st = path.stat()
        except FileNotFoundError:
            raise _Reject("missing", f"broken symlink: {shown} -> {os.readlink(path)} does not exist") from None
    if stat.S_ISDIR(st.st_mode):
        raise _Reject("not_a_file", f"{shown} is a directory, not an image file")
    if not stat.S_ISREG(st.st_mode):
        raise _Reject("not_a_file", f"{shown} is not a regular file (mode {stat.filemode(st.st_mode)}); not opened")
    if st.st_size == 0:
        raise _Reject("empty_file", f"{shown} is empty (0 bytes)")
    note = read_reject_note(path)
    if note is not None:
        raise _Reject(*note)


def _probe(
    path: Path, image_id: str, shown: str, derivative_dir: Path | None, lim: ProbeLimits
) -> ProbeResult:
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES must stay False for curation")

    with _pixel_limit(lim.max_pixels):
        try:
            im = Image.open(path)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            size = _declared_size(path)
            if size is None:
                raise _Reject("decompression_bomb", f"{e} (not decoded)") from None
            w, h = size
            raise _Reject(
                "decompression_bomb",
                f"declared {w}x{h} = {_fmt_px(w * h)} > max {_fmt_px(lim.max_pixels)} "
                "(not decoded)",
            ) from None
        except Exception as e:  # UnidentifiedImageError, SyntaxError, struct.error, OSError, ...
            head = _head(path)  # an unreadable file raises again here: that is not a bad image
            fmt = sniff_format(head)
            if fmt is None and path.suffix.lower() not in IMAGE_EXTENSIONS:
                raise _Reject(
                    "unsupported_extension",
                    f"{path.suffix or '(no extension)'} is not an image extension and PIL cannot identify the "
                    f"content (starts with {head[:8]!r})",
                ) from None
            if fmt is None:
                raise _Reject(
                    "not_an_image", f"PIL cannot identify it; starts with {head[:8]!r}"
                ) from None
            reason = "truncated" if _is_truncation(e) else "corrupt"
            why = "" if isinstance(e, UnidentifiedImageError) else f": {type(e).__name__}: {e}"
            raise _Reject(reason, f"{fmt} signature but PIL cannot parse the header{why}") from None

        with im:
            return _decode_and_measure(im, path, image_id, shown, derivative_dir, lim)


def _decode_and_measure(
    im: ImageFile.ImageFile,
    path: Path,
    image_id: str,
    shown: str,
    derivative_dir: Path | None,
    lim: ProbeLimits,
) -> ProbeResult:
    fmt = im.format or "unknown"
    mode = im.mode
    width, height = im.size
    _check_bounds(width, height, lim)

    # From here on the file is decoded, at reduced size where possible.
    orientation = _orientation(im) if fmt in ("JPEG", "MPO") else None
    fast = fmt in ("JPEG", "MPO") and mode == "RGB" and orientation == 1 and len(im.tile) == 1
    rgb: Image.Image | None = None
    try:
        if fast:
            s = ANALYSIS_LONG_SIDE / max(width, height)
            im.draft("L", (max(1, int(width * s)), max(1, int(height * s))))
            im.load()
            gray = im if im.mode == "L" else im.convert("L")
        else:
            im.load()
            if orientation is None:
                orientation = _orientation(im)
            rgb = to_rgb(im)
            if orientation != 1:
                rgb = rgb.transpose(_TRANSPOSE[orientation])
            factor = max(rgb.size) // (2 * ANALYSIS_LONG_SIDE)
            gray = (rgb.reduce(factor) if factor >= 2 else rgb).convert("L")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _Reject("decompression_bomb", f"{e} (not decoded)") from None
    except Exception as e:  # PIL reports bad data as OSError, SyntaxError, ValueError, ...
        reason = "truncated" if _is_truncation(e) else "corrupt"
        raise _Reject(reason, f"{fmt} decode failed: {type(e).__name__}: {e}") from None

    if orientation is not None and orientation >= 5:
        width, height = height, width
    analysis = _analysis_gray(gray)
    quality = quality_score(analysis)
    if quality < lim.quality_threshold:
        raise _Reject(
            "low_quality",
            f"Laplacian variance {quality:.2f} < {lim.quality_threshold:.2f} (near-blank or blurred)",
        )
    derivative: str | None = None
    if rgb is not None and (mode != "RGB" or orientation != 1) and derivative_dir is not None:
        derivative = write_derivative(rgb, derivative_dir, image_id, fmt in _LOSSY_FORMATS)
    del rgb
    return ProbeResult(
        image_id=image_id,
        path=shown,
        sha256=sha256_file(path),
        width=width,
        height=height,
        mode=mode,
        format=fmt,
        phash=phash(analysis),
        quality=quality,
        derivative=derivative,
        nbytes=path.stat().st_size,
    )
