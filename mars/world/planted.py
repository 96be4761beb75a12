"""Curation traps planted in the raw image pool, and the encoders that make them.

Each case has an expected curation outcome (:data:`PLANTED_CASES`: case -> reject reason, or
``None`` for images curation must repair and keep):

==================  ======================  =====================================================
case                expected_reason         what the file is
==================  ======================  =====================================================
low_res             low_resolution          a 320x240 clutter image
bad_aspect          bad_aspect              a 6144x1024 clutter image (6:1)
exact_dup           exact_duplicate         a byte copy of a scene
near_dup_reencode   near_duplicate          a scene re-encoded as JPEG at a lower quality
near_dup_resize     near_duplicate          a scene resized to 90%
near_dup_crop       near_duplicate          a scene with 2% cropped off each side
corrupt             corrupt                 a valid PNG signature and IHDR, then garbage
truncated           truncated               a valid high-resolution JPEG cut in half
not_an_image        not_an_image            a text file named .jpg
low_quality         low_quality             a large, heavily blurred, nearly flat image
bomb                decompression_bomb      a ~200 KB 1-bit PNG whose header declares 40000x40000
exif_rotated        None                    a JPEG stored sideways with EXIF Orientation 6
cmyk                None                    a CMYK JPEG
16bit               None                    a 16-bit grayscale PNG (mode I;16)
palette             None                    a palette PNG (mode P)
alpha               None                    an RGBA PNG
==================  ======================  =====================================================

Near duplicates are never larger (in pixels) than their original, so "keep the largest" keeps
the original. Everything here is a pure function of its inputs; the bomb is written without ever
allocating its canvas.

Try it: ``python -m mars.world.planted`` prints the cases and checks the bomb header.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image, ImageFilter

PLANTED_CASES: dict[str, str | None] = {
    "low_res": "low_resolution",
    "bad_aspect": "bad_aspect",
    "exact_dup": "exact_duplicate",
    "near_dup_reencode": "near_duplicate",
    "near_dup_resize": "near_duplicate",
    "near_dup_crop": "near_duplicate",
    "corrupt": "corrupt",
    "truncated": "truncated",
    "not_an_image": "not_an_image",
    "low_quality": "low_quality",
    "bomb": "decompression_bomb",
    "exif_rotated": None,
    "cmyk": None,
    "16bit": None,
    "palette": None,
    "alpha": None,
}
REPAIRABLE: tuple[str, ...] = tuple(k for k, v in PLANTED_CASES.items() if v is None)
# repairable cases that remain real scenes (their cue survives the conversion): they get a scene_id
SCENE_REPAIRABLE: tuple[str, ...] = ("exif_rotated", "cmyk", "palette", "alpha")
DERIVED: tuple[str, ...] = ("exact_dup", "near_dup_reencode", "near_dup_resize", "near_dup_crop")

LOW_RES_SIZE = (320, 240)
BAD_ASPECT_SIZE = (6144, 1024)
LOW_QUALITY_SIZE = (2400, 1600)
TRUNCATED_SIZE = (2048, 1536)
CORRUPT_SIZE = (2400, 1600)
BOMB_SIZE = (40000, 40000)
EXIF_ORIENTATION_TAG = 0x0112
NEAR_DUP_RESIZE = 0.9
NEAR_DUP_CROP = 0.02
PNG_COMPRESS_LEVEL = 3


def encode(img: Image.Image, fmt: str, quality: int = 90, **kwargs: object) -> bytes:
    """Encode ``img`` as "JPEG" or "PNG" bytes, deterministically (no timestamps, fixed settings)."""
    buf = io.BytesIO()
    if fmt == "JPEG":
        img.save(buf, "JPEG", quality=quality, **kwargs)
    elif fmt == "PNG":
        img.save(buf, "PNG", compress_level=PNG_COMPRESS_LEVEL, **kwargs)
    else:
        raise ValueError(f"unknown format {fmt!r}; expected 'JPEG' or 'PNG'")
    return buf.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data, CRC."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_ihdr(width: int, height: int, bit_depth: int, colour_type: int) -> bytes:
    """The IHDR chunk of a PNG."""
    return png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0))


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bomb_png_bytes(width: int = BOMB_SIZE[0], height: int = BOMB_SIZE[1]) -> bytes:
    """A complete, valid 1-bit grayscale PNG of ``width`` x ``height`` zeros, built by hand.

    All-zero rows compress about 1000:1, so 40000x40000 (1.6 G pixels) is about 200 KB; the
    canvas is never allocated."""
    row = bytes(1 + (width + 7) // 8)  # filter byte 0 + packed bits
    comp = zlib.compressobj(9)
    rows_per_chunk = max(1, (1 << 22) // len(row))
    block = row * rows_per_chunk
    parts = []
    done = 0
    while done < height:
        n = min(rows_per_chunk, height - done)
        parts.append(comp.compress(block if n == rows_per_chunk else row * n))
        done += n
    parts.append(comp.flush())
    return PNG_SIGNATURE + png_ihdr(width, height, 1, 0) + png_chunk(b"IDAT", b"".join(parts)) + png_chunk(b"IEND", b"")


def read_png_size(data: bytes) -> tuple[int, int]:
    """(width, height) declared by a PNG's IHDR, read from bytes without decoding."""
    if data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG with an IHDR chunk")
    return struct.unpack(">II", data[16:24])


def corrupt_png_bytes(rng: np.random.Generator, width: int = CORRUPT_SIZE[0], height: int = CORRUPT_SIZE[1],
                      n_garbage: int = 32768) -> bytes:
    """A valid PNG signature and IHDR (RGB, 8 bit), followed by random garbage."""
    return PNG_SIGNATURE + png_ihdr(width, height, 8, 2) + rng.integers(0, 256, n_garbage, dtype=np.uint8).tobytes()


def truncate(data: bytes, keep: float = 0.5) -> bytes:
    """The first ``keep`` fraction of ``data`` (a file cut short)."""
    return data[: max(1, int(len(data) * keep))]


def not_an_image_bytes(name: str) -> bytes:
    """A small text file (saved with an image extension)."""
    return (f"This is not an image. It is a text note called {name}.\n"
            "It was saved with an image extension by mistake.\n").encode()


def low_quality_image(rng: np.random.Generator, width: int = LOW_QUALITY_SIZE[0],
                      height: int = LOW_QUALITY_SIZE[1]) -> Image.Image:
    """A large, nearly flat image: a few colour blobs, blurred away (no edges, tiny variance)."""
    small = rng.integers(90, 160, (3, 4, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((width // 16, height // 16), Image.Resampling.BILINEAR)
    img = img.filter(ImageFilter.GaussianBlur(12))
    return img.resize((width, height), Image.Resampling.BILINEAR)


def exif_rotated(img: Image.Image, orientation: int = 6) -> tuple[Image.Image, bytes]:
    """Store ``img`` sideways: the pixels to write and the EXIF bytes whose Orientation tag turns
    them back (6: display = stored rotated 90 degrees clockwise; 8: counter-clockwise)."""
    if orientation == 6:
        stored = img.transpose(Image.Transpose.ROTATE_90)
    elif orientation == 8:
        stored = img.transpose(Image.Transpose.ROTATE_270)
    else:
        raise ValueError(f"orientation must be 6 or 8, got {orientation}")
    exif = Image.Exif()
    exif[EXIF_ORIENTATION_TAG] = orientation
    return stored, exif.tobytes()


def to_16bit(img: Image.Image) -> Image.Image:
    """16-bit grayscale (mode I;16) version of an RGB image."""
    grey = np.asarray(img.convert("L"), dtype=np.uint16) * 257
    return Image.fromarray(grey)


def to_palette(img: Image.Image) -> Image.Image:
    """Palette (mode P) version of an RGB image, 256 colours, no dithering."""
    return img.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)


def to_alpha(img: Image.Image) -> Image.Image:
    """RGBA version of an RGB image (opaque, so flattening restores it exactly)."""
    out = img.convert("RGBA")
    return out


def near_dup_resize(img: Image.Image, frac: float = NEAR_DUP_RESIZE) -> Image.Image:
    """``img`` resized to ``frac`` of its size (never larger)."""
    return img.resize((max(1, int(img.width * frac)), max(1, int(img.height * frac))), Image.Resampling.LANCZOS)


def near_dup_crop(img: Image.Image, frac: float = NEAR_DUP_CROP) -> Image.Image:
    """``img`` with ``frac`` of its width/height cut from each side."""
    dx, dy = max(1, int(img.width * frac)), max(1, int(img.height * frac))
    return img.crop((dx, dy, img.width - dx, img.height - dy))


if __name__ == "__main__":
    for case, reason in PLANTED_CASES.items():
        print(f"{case:18s} -> {reason}")
    b = bomb_png_bytes()
    print("bomb:", len(b), "bytes, declares", read_png_size(b))
