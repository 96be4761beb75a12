"""Typed parquet I/O and atomic file writes.

Every artifact has one pyarrow schema in :mod:`mars.data.schemas`. :func:`write_table`
checks a table against it (column names, order, types and non-null columns) and writes
atomically: a temp file in the destination directory, fsync, then ``os.replace``, so a
crash or a failed check never leaves a half-written or clobbered output. :func:`atomic_dir`
does the same for a whole output directory and first tidies what killed runs left beside it
(:func:`sweep_stale_dirs`: their staging directories, and a backup of the previous output put
back if a kill fell between the two renames).
Atomic writes honour the umask like a plain ``open()`` / ``mkdir()``: files land with mode
``0o666 & ~umask``, directories with ``0o777 & ~umask`` (:func:`current_umask`,
:func:`plain_file_mode`), not the 0600 of the temp file they start as.
:func:`read_table` checks what it reads and fails with an :class:`ArtifactReadError` (a
:class:`SchemaError`, and an expected error that ends a stage with its message alone) that
names the file, the column, the expected and the found type, the schema, and the stage to rerun.

Stages use polars for frames: :func:`read_frame` / :func:`write_frame` wrap the same
checks around ``polars.DataFrame``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from mars.errors import StageError

if TYPE_CHECKING:  # polars is imported lazily: not every caller needs it
    import polars as pl

log = logging.getLogger(__name__)


class SchemaError(ValueError):
    """A table or parquet file does not match its artifact schema."""


class ArtifactReadError(StageError, SchemaError):
    """:func:`read_table`: a file on disk is missing, unreadable or does not match its schema (written by another
    version of the code). An expected error: it ends a stage with its message alone, where a table our own code
    builds wrong (a plain :class:`SchemaError` on write) is a bug and keeps its traceback."""


_UMASK_LOCK = threading.Lock()
# a write that failed for want of room: the error names the file being written
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


def current_umask() -> int:
    """The process's umask, read without changing it where possible.

    Linux reports it in ``/proc/self/status`` (``Umask:`` line, kernel 4.7+). Elsewhere it is read the only
    portable way, ``os.umask`` twice, under a lock so two of our threads never interleave; for the instant it is
    set, it is 0o077 (restrictive), so a file another thread creates meanwhile is never more open than intended.
    """
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    with _UMASK_LOCK:
        old = os.umask(0o077)
        os.umask(old)
    return old


def plain_file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file: ``0o666 & ~umask``."""
    return 0o666 & ~current_umask()


def plain_dir_mode() -> int:
    """The mode a plain ``mkdir`` gives a new directory: ``0o777 & ~umask``."""
    return 0o777 & ~current_umask()


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success fsync it and rename it onto ``path``.

    The file lands with the mode a plain write gives a new file (:func:`plain_file_mode`), whatever the mode
    of the file it replaces. On any exception the temp file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        try:
            yield tmp_path
            with open(tmp_path, "rb") as fh:
                os.fchmod(fh.fileno(), plain_file_mode())
                os.fsync(fh.fileno())
        except OSError as exc:  # a full disk, a size limit: say which file (the previous one is kept)
            if exc.errno not in _WRITE_ERRNOS or str(path) in str(exc):
                raise
            raise OSError(exc.errno, f"{exc.strerror} while writing {path} (the previous file is kept)",
                          str(path)) from exc
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", **kwargs) -> Iterator[IO]:
    """``open()`` for writing that lands atomically (see :func:`atomic_path`)."""
    with atomic_path(path) as tmp, open(tmp, mode, **kwargs) as fh:
        yield fh


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep_stale_dirs(target: str | Path) -> list[tuple[Path, str]]:
    """Tidy what killed runs of :func:`atomic_dir` left beside ``target``; returns ``(path, "removed" | "restored")``
    for each directory it tidied.

    A run killed inside its block (SIGKILL, power loss: no ``finally`` runs) leaves its staging directory
    ``.<name>.tmp-<pid>-<hex>``; one killed between its two renames leaves ``target``'s previous contents in
    ``.<name>.old-<pid>-<hex>`` and no ``target``. For each of those whose process is gone: a staging directory
    is deleted, a backup is renamed back to ``target`` when ``target`` is missing (nothing written is lost) and
    deleted otherwise. Directories of live processes (a concurrent run) are left alone.
    """
    target = Path(target)
    done: list[tuple[Path, str]] = []
    if not target.parent.is_dir():
        return done
    for kind in ("old", "tmp"):  # backups first: a restored target must not be deleted as garbage
        for path in sorted(target.parent.glob(f".{target.name}.{kind}-*")):
            token = path.name[len(f".{target.name}.{kind}-"):]
            pid = token.split("-", 1)[0]
            if not (path.is_dir() and pid.isdigit()) or _pid_alive(int(pid)):
                continue
            if kind == "old" and not target.exists():
                os.replace(path, target)
                done.append((path, "restored"))
            else:
                shutil.rmtree(path, ignore_errors=True)
                done.append((path, "removed"))
    return done


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a fresh directory beside ``target``; on success it replaces ``target`` whole.

    The staging directory lives in ``target``'s parent (same filesystem, so renames are
    atomic). An existing ``target`` is renamed to a backup, the new directory renamed into
    place, then the backup deleted; if the second rename fails the backup is put back. On any
    exception inside the block the staging directory is removed and ``target`` is untouched.
    What killed runs left beside ``target`` is tidied first (:func:`sweep_stale_dirs`). The directory
    gets the mode a plain ``mkdir`` gives (:func:`plain_dir_mode`).
    """
    target = Path(target)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    for path, action in sweep_stale_dirs(target):
        log.info("%s %s, left by a killed run", action, path)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{target}: exists and is not a directory; remove it or choose another path")
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = parent / f".{target.name}.tmp-{token}"
    tmp.mkdir(mode=0o777)  # less the umask, as a plain mkdir
    try:
        yield tmp
        backup: Path | None = None
        if target.exists():
            backup = parent / f".{target.name}.old-{token}"
            os.replace(target, backup)
        try:
            os.replace(tmp, target)
        except BaseException:
            if backup is not None:
                os.replace(backup, target)
            raise
        if backup is not None:
            shutil.rmtree(backup, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_open(path, "wb") as fh:
        fh.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem allows opening directories
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_schema(actual: pa.Schema, expected: pa.Schema, where: str) -> None:
    """Raise :class:`SchemaError` describing the first difference between two schemas."""
    exp_names, act_names = expected.names, actual.names
    missing = [n for n in exp_names if n not in act_names]
    if missing:
        raise SchemaError(
            f"{where}: column '{missing[0]}' is missing (expected type {expected.field(missing[0]).type}); "
            f"found columns {act_names}. Regenerate the file with the stage that writes it."
        )
    extra = [n for n in act_names if n not in exp_names]
    if extra:
        raise SchemaError(f"{where}: unexpected column '{extra[0]}' (expected columns {exp_names}).")
    for field in expected:
        found = actual.field(field.name)
        if pa.types.is_null(found.type) and field.nullable:
            continue  # an all-null column of a nullable field casts to its type
        if not found.type.equals(field.type):
            raise SchemaError(
                f"{where}: column '{field.name}' has type {found.type}, expected {field.type}. "
                f"Cast the column (e.g. polars .cast) or regenerate the file."
            )
    if act_names != exp_names:
        raise SchemaError(f"{where}: columns are in order {act_names}, expected {exp_names}.")


def conform(table: pa.Table, schema: pa.Schema, where: str = "table") -> pa.Table:
    """Check ``table`` against ``schema`` and return it carrying exactly that schema.

    Fails on missing, extra or mistyped columns and on nulls in non-nullable columns.
    """
    check_schema(table.schema, schema, where)
    for field in schema:
        if not field.nullable:
            nulls = table.column(field.name).null_count
            if nulls:
                raise SchemaError(f"{where}: column '{field.name}' must not be null, found {nulls} null value(s).")
    return table.cast(schema) if not table.schema.equals(schema) else table


def write_table(table: pa.Table, path: str | Path, schema: pa.Schema) -> Path:
    """Validate ``table`` against ``schema`` and write it to ``path`` atomically."""
    path = Path(path)
    table = conform(table, schema, f"writing {path}")
    with atomic_path(path, ".parquet") as tmp:
        pq.write_table(table, tmp, compression="zstd")
    return path


# --- read_table's advice: which stage writes a file, and what differs from its schema -----------------------------

STAGES = ("world", "curate", "index", "synthesize", "sft", "mine", "rl", "evaluate")  # dvc.yaml's stages, in order
PRODUCERS = {  # the stage that writes each artifact of mars.data.schemas (dvc.yaml: data/<stage>/<artifact>.parquet)
    "entities": "world", "corpus": "world", "gallery": "world", "raw_images": "world", "world_truth": "world",
    "download_failures": "world", "curated": "curate", "rejects": "curate", "questions": "synthesize",
    "trajectories": "sft", "pass_counts": "mine", "results": "evaluate",
}


def artifact_of(schema: pa.Schema) -> tuple[str, str] | None:
    """``(artifact, constant)`` of a schema of :mod:`mars.data.schemas`, e.g. ``("curated", "CURATED")``."""
    from mars.data import schemas  # pyarrow only: no cycle

    for name, known in schemas.ARTIFACTS.items():
        if known is schema or known.equals(schema):
            const = next((k for k, v in vars(schemas).items() if k.isupper() and v is known), name.upper())
            return name, const
    return None


def producer_of(path: str | Path, artifact: str | None) -> str | None:
    """The stage that writes ``path``: its directory's name when that is a stage (``data/<stage>/...``), else the
    artifact's producer, else None."""
    parent = Path(path).parent.name
    if parent in STAGES:
        return parent
    return PRODUCERS.get(artifact or "")


def rerun_hint(path: str | Path, artifact: str | None) -> str:
    stage = producer_of(path, artifact)
    if stage:
        return f"rerun the {stage} stage: dvc repro {stage}"
    return "regenerate the file with the stage or tool that writes it"


def _schema_difference(found: pa.Schema, expected: pa.Schema, what: str) -> str | None:
    """The first difference of a file's schema from ``expected`` (named ``what``), or None when they match."""
    exp_names, act_names = expected.names, found.names
    missing = [n for n in exp_names if n not in act_names]
    if missing:
        return (f"column '{missing[0]}' is missing ({what} has it, type {expected.field(missing[0]).type}; "
                f"the file has columns {act_names})")
    extra = [n for n in act_names if n not in exp_names]
    if extra:
        return f"unexpected column '{extra[0]}' ({what} has columns {exp_names})"
    for field in expected:
        got = found.field(field.name).type
        if pa.types.is_null(got) and field.nullable:
            continue  # an all-null column of a nullable field casts to its type
        if not got.equals(field.type):
            return f"column '{field.name}' has type {got}, expected {field.type} ({what})"
    if act_names != exp_names:
        return f"columns are in order {act_names}, expected {exp_names} ({what})"
    return None


def read_table(path: str | Path, schema: pa.Schema) -> pa.Table:
    """Read a parquet file, failing with an :class:`ArtifactReadError` (a :class:`SchemaError`) that names the
    file, the column, the expected and found types, the schema and the stage to rerun (a file written by another
    version of the code)."""
    path = Path(path)
    known = artifact_of(schema)
    hint = rerun_hint(path, known[0] if known else None)
    if not path.is_file():
        raise ArtifactReadError(f"{path}: file not found; fix the path, or {hint}")
    try:
        found = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ArtifactReadError(f"{path}: not a readable parquet file ({exc}); {hint}") from None
    problem = _schema_difference(found, schema, f"schema {known[1]}" if known else "the expected schema")
    if problem:
        raise ArtifactReadError(f"{path}: {problem}: the file was written by another version of the code; {hint}")
    try:
        table = pq.read_table(path, schema=None)
        return conform(table, schema, str(path))
    except SchemaError as exc:  # nulls in a non-null column
        raise ArtifactReadError(f"{str(exc).rstrip('.')}; {hint}") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise ArtifactReadError(f"{path}: not a readable parquet file ({exc}); {hint}") from None


def read_frame(path: str | Path, schema: pa.Schema) -> "pl.DataFrame":
    """:func:`read_table` as a polars DataFrame."""
    import polars as pl

    return pl.from_arrow(read_table(path, schema))  # type: ignore[return-value]


def write_frame(frame: "pl.DataFrame", path: str | Path, schema: pa.Schema) -> Path:
    """Write a polars DataFrame as the artifact ``schema`` (columns cast to its types)."""
    table = frame.to_arrow()
    if set(table.column_names) == set(schema.names):
        table = table.select(schema.names)
        casted = []
        for field in schema:
            col = table.column(field.name)
            casted.append(col.cast(field.type) if not col.type.equals(field.type) else col)
        table = pa.Table.from_arrays(casted, schema=schema)
    return write_table(table, path, schema)


class ChunkStore:
    """Rows of finished work saved as they come: ``root/<key>/chunk-*.parquet``, each chunk written atomically.

    Long loops (evaluation's samples, difficulty mining's pass counts) append a chunk every so often; a killed run
    keeps every chunk written before the kill, and the rerun reads them back (:meth:`table`) and skips that work.
    ``key`` names the run: callers derive it from everything the rows depend on, so a changed input never resumes
    from another run's rows.
    """

    def __init__(self, root: str | Path, key: str, schema: pa.Schema):
        self.schema = schema
        self.dir = Path(root) / re.sub(r"[^A-Za-z0-9_.-]+", "_", key)
        self.dir.mkdir(parents=True, exist_ok=True)

    def chunks(self) -> list[Path]:
        return sorted(self.dir.glob("chunk-*.parquet"))

    def table(self) -> pa.Table:
        parts = [read_table(p, self.schema) for p in self.chunks()]
        return pa.concat_tables(parts) if parts else self.schema.empty_table()

    def append(self, rows: list[dict]) -> Path:
        path = self.dir / f"chunk-{len(self.chunks()):05d}-{int(time.time() * 1000)}.parquet"
        with atomic_path(path) as tmp:
            pq.write_table(pa.Table.from_pylist(rows, schema=self.schema), tmp)
        return path

