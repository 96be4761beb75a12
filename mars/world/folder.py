"""Use a folder of the user's own images as the raw image pool (instead of the generated world).

:func:`ingest_folder` hands every entry of the folder to curation, unfiltered: whether a file
really is an image is curation's business (:mod:`mars.curate.probe`), so a text file named
``.jpg``, a ``.txt``, an empty file, a truncated JPEG or a decompression bomb is copied in as it
is and curation rejects it with a reason. It walks the folder recursively in sorted order and
returns one RAW_IMAGES row (``source="folder"``) per entry, keeping its relative path:

- a regular file, of any name or size, is copied into the raw pool directory;
- a symlink to a regular file inside the folder is copied as that file; any other symlink is not
  followed: a link out of the folder, a broken link and a link to a directory are each replaced
  by a reject note (:func:`mars.curate.probe.write_reject_note`) that curation turns into a
  reject (``symlink_outside_folder``, ``missing``, ``not_a_file``), so nothing outside the folder
  is ever read;
- a directory is walked; one whose name looks like an image (``d.jpg``) is also an entry, which
  curation rejects as ``not_a_file``;
- a FIFO, socket or device is never opened (a note: ``not_a_file``); a file that cannot be read
  gets a note too (``unreadable``).

Nothing here refuses the pool for one bad file; only a folder that does not exist, is not a
directory or holds no entry at all fails, with one line saying which.

Run ``python -m mars.world.folder SRC_DIR RAW_DIR`` to ingest a folder and print the table.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from mars.curate.hashing import sha256_file
from mars.curate.probe import IMAGE_EXTENSIONS, write_reject_note
from mars.data.schemas import RAW_IMAGES
from mars.errors import InputError

SOURCE = "folder"
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

__all__ = ["IMAGE_EXTENSIONS", "SOURCE", "check_folder", "image_id_for", "ingest_folder", "list_entries"]


def image_id_for(rel_path: str) -> str:
    """Stable image id of a file: ``"f-"`` + the first 12 hex digits of sha256 of its relative path."""
    return "f-" + hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:12]


def list_entries(src_dir: Path) -> list[str]:
    """Relative POSIX paths of every entry under ``src_dir`` that becomes a raw row, sorted: every
    non-directory (files of any name, symlinks, FIFOs, ...) and every directory with an image-like name.
    Directories are walked; symlinked directories are not."""
    out: list[str] = []

    def walk(directory: Path, prefix: str) -> None:
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            rel = prefix + entry.name
            if entry.is_dir(follow_symlinks=False):
                if Path(entry.name).suffix.lower() in IMAGE_EXTENSIONS:
                    out.append(rel)
                walk(Path(entry.path), rel + "/")
            else:
                out.append(rel)

    walk(src_dir, "")
    return sorted(out)


def _is_inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _place(src: Path, real_src: str, rel: str, raw: Path, has_children: bool) -> None:
    """Put entry ``rel`` of ``src`` into the raw pool ``raw``: its bytes, or a reject note saying why not."""
    path, dest = src / rel, raw / rel
    note: tuple[str, str] | None = None
    try:
        st = path.lstat()
    except FileNotFoundError:  # removed since the folder was listed
        write_reject_note(dest, "missing", f"{rel} was listed but is gone")
        return
    if stat.S_ISLNK(st.st_mode):
        link, target = os.readlink(path), os.path.realpath(path)
        if not _is_inside(target, real_src):
            to = link if link == target else f"{link} ({target})"
            note = ("symlink_outside_folder", f"{rel} is a symlink to {to}, outside the folder {real_src}; "
                                              "not followed")
        elif not os.path.exists(target):
            note = ("missing", f"broken symlink: {rel} -> {link} does not exist")
        elif not os.path.isfile(target):
            note = ("not_a_file", f"{rel} is a symlink to a directory or special file ({link}); not followed")
    elif stat.S_ISDIR(st.st_mode):
        if has_children:  # its files are entries of their own; the directory stays a directory
            dest.mkdir(parents=True, exist_ok=True)
            return
        note = ("not_a_file", f"{rel} is an empty directory, not an image file")
    elif not stat.S_ISREG(st.st_mode):
        note = ("not_a_file", f"{rel} is not a regular file (mode {stat.filemode(st.st_mode)}); not opened")
    if note is None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if os.path.realpath(path) == os.path.realpath(dest):
            return
        try:
            shutil.copyfile(path, dest)
            return
        except OSError as e:
            note = ("unreadable", f"{rel} could not be read: {type(e).__name__}: {e.strerror or e}")
    write_reject_note(dest, *note)


def check_folder(src_dir: str | Path) -> list[str]:
    """:func:`list_entries` of ``src_dir``, or an :class:`~mars.errors.InputError` (a ValueError) naming the
    folder when it does not exist, is not a directory, or holds no entry."""
    src = Path(src_dir)
    if not src.exists():
        raise InputError(f"image folder {str(src)!r} does not exist; set world.folder to a directory of images")
    if not src.is_dir():
        raise InputError(f"image folder {str(src)!r} is not a directory; set world.folder to a directory of images")
    entries = list_entries(src)
    if not entries:
        raise InputError(f"image folder {str(src)!r} is empty: no files in it or its sub-folders; "
                         "put images in it or set world.folder to another directory")
    return entries


def ingest_folder(src_dir: str | Path, raw_dir: str | Path) -> pa.Table:
    """Copy every entry of ``src_dir`` into ``raw_dir`` (same relative paths; see the module doc) and return
    their RAW_IMAGES rows, sorted by path.

    Raises :class:`~mars.errors.InputError` (a ValueError) naming the folder when it does not exist, is not a
    directory, or holds no entry."""
    src, raw = Path(src_dir), Path(raw_dir)
    entries = check_folder(src)
    real_src = os.path.realpath(src)
    raw.mkdir(parents=True, exist_ok=True)
    parents = {rel.rsplit("/", 1)[0] for rel in entries if "/" in rel}
    has_children = {p for rel in parents for p in _ancestors(rel)}
    rows: list[dict[str, Any]] = []
    for rel in entries:
        _place(src, real_src, rel, raw, rel in has_children)
        dest = raw / rel
        is_file = dest.is_file()
        rows.append(dict(image_id=image_id_for(rel), path=rel, source=SOURCE, scene_id=None, planted_case=None,
                         expected_reason=None, bytes=dest.stat().st_size if is_file else 0,
                         sha256=sha256_file(dest) if is_file else _EMPTY_SHA256))
    return pa.Table.from_pylist(rows, schema=RAW_IMAGES)


def _ancestors(rel_dir: str) -> list[str]:
    parts = rel_dir.split("/")
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m mars.world.folder SRC_DIR RAW_DIR")
    print(ingest_folder(sys.argv[1], sys.argv[2]))
