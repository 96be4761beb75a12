"""Content and perceptual hashes used by image curation.

- :func:`sha256_file` streams a file through SHA-256 in fixed-size chunks (memory stays
  constant whatever the file size); :func:`sha256_bytes` hashes bytes already in memory.
- :func:`phash` is the classic DCT perceptual hash: the image is converted to grayscale,
  area-resampled (``Image.BOX``) to 32x32, transformed with a 2-D orthonormal DCT-II
  (``scipy.fft.dctn``), and the top-left 8x8 block of low frequencies (DC included) is
  compared with its own median; each coefficient above the median is a 1 bit. The 64 bits
  are read row-major, most significant first, and written as 16 lowercase hex digits.
  Callers pass a downscaled copy (see :mod:`mars.curate.probe`): the hash only looks at a
  32x32 thumbnail, so hashing the full-resolution image costs time for nothing.
- :func:`hamming` and :func:`hamming_to_many` count differing bits between hashes
  (``numpy.bitwise_count`` for the vectorised form, a byte table on numpy 1.x).

No command-line entry point; ``python -m pytest tests/curate`` exercises it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image
from scipy.fft import dctn

CHUNK_BYTES = 1 << 20
PHASH_SIZE = 32
PHASH_LOW = 8


def sha256_file(path: Path | str, chunk_size: int = CHUNK_BYTES) -> str:
    """SHA-256 hex digest of the file at ``path``, read in ``chunk_size`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_size)
            if not block:
                break
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes | bytearray | memoryview) -> str:
    """SHA-256 hex digest of ``data``."""
    return hashlib.sha256(data).hexdigest()


def _gray_32(image: Image.Image | npt.NDArray[np.generic]) -> npt.NDArray[np.float64]:
    if isinstance(image, np.ndarray):
        arr = np.asarray(image, dtype=np.float64)
        if arr.ndim == 3:  # RGB(A) array: ITU-R 601-2 luma, as PIL's convert("L")
            arr = arr[..., 0] * 0.299 + arr[..., 1] * 0.587 + arr[..., 2] * 0.114
        image = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), mode="L")
    if image.mode != "L":
        image = image.convert("L")
    small = image.resize((PHASH_SIZE, PHASH_SIZE), Image.Resampling.BOX)
    return np.asarray(small, dtype=np.float64)


def phash_int(image: Image.Image | npt.NDArray[np.generic]) -> int:
    """64-bit DCT perceptual hash of ``image`` as an unsigned integer."""
    coeffs = dctn(_gray_32(image), type=2, norm="ortho")[:PHASH_LOW, :PHASH_LOW]
    bits = (coeffs > np.median(coeffs)).ravel()
    value = 0
    for bit in bits:
        value = (value << 1) | int(bit)
    return value


def phash(image: Image.Image | npt.NDArray[np.generic]) -> str:
    """64-bit DCT perceptual hash of ``image`` as 16 lowercase hex digits."""
    return f"{phash_int(image):016x}"


def phash_to_int(value: str | int) -> int:
    """Parse a 16-hex-digit hash (or pass an int through), checking it fits 64 bits."""
    if isinstance(value, int):
        out = value
    else:
        if len(value) != 16:
            raise ValueError(f"phash must be 16 hex digits, got {value!r}")
        out = int(value, 16)
    if not 0 <= out < 1 << 64:
        raise ValueError(f"phash out of 64-bit range: {value!r}")
    return out


def hamming(a: str | int, b: str | int) -> int:
    """Number of differing bits between two 64-bit hashes (hex strings or ints)."""
    return (phash_to_int(a) ^ phash_to_int(b)).bit_count()


def hashes_to_array(hashes: list[str] | list[int]) -> npt.NDArray[np.uint64]:
    """Pack hashes into a ``uint64`` array for :func:`hamming_to_many`."""
    return np.array([phash_to_int(h) for h in hashes], dtype=np.uint64)


_POPCOUNT8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.int64)


def popcount64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
    """Set bits per element of a uint64 array (``np.bitwise_count`` on numpy >= 2)."""
    x = np.ascontiguousarray(x, dtype=np.uint64)
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x).astype(np.int64)
    return _POPCOUNT8[x.view(np.uint8)].reshape(*x.shape, 8).sum(axis=-1)  # numpy 1.x


def hamming_to_many(h: str | int, others: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
    """Hamming distances from one hash to every hash in ``others`` (a uint64 array)."""
    return popcount64(np.bitwise_xor(others, np.uint64(phash_to_int(h))))
