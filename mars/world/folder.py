"""Use a folder of the user's own images as the raw image pool (instead of the generated world).

:func:`ingest_folder` copies every file with an image-like extension (jpg, jpeg, png, webp, bmp,
tif, tiff; any case; recursively, in sorted order) into the raw pool directory, keeping its relative
path, and returns the RAW_IMAGES table (``source="folder"``). Files are copied as they are: whether
they really are images is curation's business.

Run ``python -m mars.world.folder SRC_DIR RAW_DIR`` to ingest a folder and print the table.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from mars.curate.hashing import sha256_file
from mars.data.schemas import RAW_IMAGES

IMAGE_EXTENSIONS: frozenset[str] = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"})
SOURCE = "folder"


def image_id_for(rel_path: str) -> str:
    """Stable image id of a file: ``"f-"`` + the first 12 hex digits of sha256 of its relative path."""
    return "f-" + hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:12]


def list_images(src_dir: Path) -> list[Path]:
    """Files under ``src_dir`` with an image-like extension, sorted by relative POSIX path."""
    files = [p for p in src_dir.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS]
    return sorted(files, key=lambda p: p.relative_to(src_dir).as_posix())


def ingest_folder(src_dir: str | Path, raw_dir: str | Path) -> pa.Table:
    """Copy the images of ``src_dir`` into ``raw_dir`` (same relative paths) and return their
    RAW_IMAGES rows, sorted by path.

    Raises ValueError naming the folder when it does not exist, is not a directory, or holds no
    file with an image extension."""
    src, raw = Path(src_dir), Path(raw_dir)
    exts = ", ".join(sorted(e.lstrip(".") for e in IMAGE_EXTENSIONS))
    if not src.exists():
        raise ValueError(f"image folder {str(src)!r} does not exist; expected a directory of images ({exts})")
    if not src.is_dir():
        raise ValueError(f"image folder {str(src)!r} is not a directory; expected a directory of images ({exts})")
    files = list_images(src)
    if not files:
        raise ValueError(f"image folder {str(src)!r} holds no images; expected files with extensions {exts} "
                         "(searched recursively, any case)")
    rows: list[dict[str, Any]] = []
    for path in files:
        rel = path.relative_to(src).as_posix()
        dest = raw / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path.resolve() != dest.resolve():
            shutil.copyfile(path, dest)
        rows.append(dict(image_id=image_id_for(rel), path=rel, source=SOURCE, scene_id=None, planted_case=None,
                         expected_reason=None, bytes=dest.stat().st_size, sha256=sha256_file(dest)))
    return pa.Table.from_pylist(rows, schema=RAW_IMAGES)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m mars.world.folder SRC_DIR RAW_DIR")
    print(ingest_folder(sys.argv[1], sys.argv[2]))
