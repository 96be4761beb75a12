"""Benchmark loaders: every benchmark file -> one validated BENCH_QUESTIONS table.

What it does
    :func:`load_benchmark` reads a benchmark described by a ``spec`` dict, converts every record into the internal
    question schema :data:`mars.data.schemas.BENCH_QUESTIONS` and validates EVERY record before returning: nothing
    is scored from a half-read or half-broken file. All problems are collected and raised together as one
    :class:`BenchmarkError` whose message lists (up to :data:`MAX_LISTED`) problems, each naming the file, the record
    (index and id when known), the field, what is wrong and how to fix it. Checks: missing required columns (the
    present ones are listed), missing images, bad base64, image bytes PIL cannot decode, image paths escaping their
    root (``../`` or absolute paths outside it; symlinks are resolved), empty answer lists / empty-string answers,
    answer letters outside A-D, malformed ``choices`` JSON, malformed JSON lines, and duplicate ids.

    Common spec keys: ``format`` (required), ``name`` (the ``benchmark`` column; default per format below),
    ``on_error``: ``"raise"`` (default: reject the whole file) or ``"skip"`` (drop bad records, log a warning
    listing them; file-level problems such as a missing column or an empty result still raise).

    Image bytes are kept as the encoded file bytes (PNG/JPEG/...); they are checked with ``Image.open().verify()``
    and then a real ``load()`` (JPEGs at a reduced draft scale, so big images are not fully decoded). Nothing is
    re-encoded: every accepted image is by construction a file PIL reads back.

Formats (``spec["format"]``)
    ``"synth"`` - the synthesized questions parquet (schema :data:`mars.data.schemas.QUESTIONS`).
        keys: ``path``, ``image_root`` (the root ``image_path`` is relative to, see :mod:`mars.world.questions`),
        ``split`` (default ``"test"``; ``None`` or ``"all"`` keeps every split). Default name ``"synth"``.
        id = question_id; answers = [answer] + aliases; category = type = type; difficulty = str(difficulty).
    ``"hr_mmsearch"`` - HR-MMSearch as published on the Hub: a parquet with columns ``sample_id``, ``query``,
        ``query_image`` (raw binary, or the HF image struct ``{"bytes", "path"}``; when ``bytes`` is null the
        ``path`` is read relative to ``image_root``), ``ground_truth`` (string or list of strings), ``difficulty``,
        ``category`` (the last two optional, null when absent). keys: ``path``, optional ``image_root``.
        Default name ``"hr_mmsearch"``.
    ``"manifest"`` - the SenseNova-MARS reference release: a JSON manifest, either ``{name: entry}`` or
        ``[{"name": ..., **entry}]``; entry keys ``root``, ``annotation`` (jsonl), ``length`` (-1/missing = all,
        else the first ``length`` records; fewer records than ``length`` is an error); relative ``root`` and
        ``annotation`` resolve against the manifest's directory. Each jsonl record: ``prompt`` (chat messages
        ``{"role", "content"}``; content a string or a list of ``{"type": "text", "text"}`` parts), ``image`` (a
        path or a list of paths relative to ``root``; absolute paths must lie inside ``root``),
        ``reward_model.ground_truth`` (string or list), optional ``id``, optional ``image_search_title_list`` /
        ``image_search_thumbnail_list`` (thumbnail paths relative to ``root``). keys: ``path``, optional
        ``datasets`` (list of dataset names to load; default all). Default name: the dataset's name (so one
        spec can yield several benchmarks); with an explicit ``name`` and several datasets, ids are prefixed
        ``"<dataset>/"``. id = record ``id`` if present else ``"<dataset>-<line index>"`` (the reference
        inference code's ids). question = text of the first user message with ``<image>`` removed, stripped.
        search_results = JSON ``{"titles": [...], "thumbnails": [base64 of the thumbnail file bytes, ...]}``
        (null when neither list is present; a null thumbnail path stays null).
    ``"hr_bench"`` - HR-Bench style multiple choice: parquet, or TSV when the path ends in ``.tsv``; columns
        ``question``, ``A``, ``B``, ``C``, ``D``, ``answer`` (a letter A-D, case-insensitive), ``category``,
        ``image`` (base64, optionally a ``data:`` URI; raw bytes also accepted in parquet), optional ``index``
        (the id; else the row number). keys: ``path``. Default name ``"hr_bench"``. question = question + lines
        ``"A. ..."``..``"D. ..."`` + ``"Answer with the option's letter."`` (as the synthesized MCQs); choices =
        JSON; answers = [letter, option text].
    ``"table"`` - any parquet or jsonl (by extension: ``.parquet``/``.pq`` or ``.jsonl``/``.json``) with a column
        mapping ``columns: {id?, question, image | images, answer | answers, choices?, category?, difficulty?,
        type?}``. Images: bytes, the HF struct, base64 strings or paths; ``image_encoding`` ``"auto"`` (default:
        strings are paths when ``image_root`` is given, else base64), ``"base64"`` or ``"path"`` (paths relative
        to ``image_root``, default the data file's directory). Answers: a string or a list. Choices: a dict or a
        JSON object string. Default name: the file's stem.

Deviations
    Only the first image of a record is used by the agent engine; the loader keeps (and validates) all of them.
    HR-MMSearch / HR-Bench have no pre-computed image search: ``search_results`` is null there. The reference
    code truncates pre-computed search to 5 results; we keep them all (the tool decides). Empty benchmarks
    (zero records after ``split`` / ``length``) are rejected.

How to run tests::
        .venv/bin/python -m pytest tests/eval/test_loaders.py -q
"""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from mars.data.io import SchemaError, conform, read_table
from mars.data.schemas import BENCH_QUESTIONS, QUESTIONS
from mars.errors import StageError

__all__ = ["BenchmarkError", "Problem", "load_benchmark", "FORMATS", "MAX_LISTED"]

log = logging.getLogger(__name__)

MAX_LISTED = 20
LETTERS = "ABCD"
MCQ_SUFFIX = "Answer with the option's letter."


# --- errors --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a benchmark file. ``index``/``id`` are None for file-level problems."""

    file: str
    index: int | None
    id: str | None
    field: str
    reason: str
    fix: str = ""

    def __str__(self) -> str:
        where = self.file
        if self.index is not None:
            where += f": record {self.index}"
            if self.id is not None:
                where += f" (id {self.id!r})"
        text = f"{where}: field '{self.field}': {self.reason}"
        return f"{text}. Fix: {self.fix}" if self.fix else text


class BenchmarkError(StageError, ValueError):
    """A benchmark file (or spec) is malformed. ``problems`` holds every :class:`Problem` found. An expected error:
    it ends a stage with its message alone."""

    def __init__(self, problems: list[Problem] | Problem, *, n_records: int | None = None):
        self.problems = [problems] if isinstance(problems, Problem) else list(problems)
        files = sorted({p.file for p in self.problems})
        head = f"{', '.join(files)}: {len(self.problems)} problem(s)"
        if n_records is not None:
            head += f" in {n_records} record(s)"
        head += "; the benchmark was rejected as a whole (nothing is scored from a partly valid file)"
        lines = [f"  - {p}" for p in self.problems[:MAX_LISTED]]
        if len(self.problems) > MAX_LISTED:
            lines.append(f"  ... and {len(self.problems) - MAX_LISTED} more")
        super().__init__(head + ":\n" + "\n".join(lines))


def _fail(file: Any, field: str, reason: str, fix: str = "") -> BenchmarkError:
    return BenchmarkError(Problem(str(file), None, None, field, reason, fix))


class _Collector:
    """Collects per-record problems for one load."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []
        self.bad: set[tuple[str, int]] = set()
        self.seen: dict[tuple[str, str], int] = {}

    def register(self, file: Any, index: int, rid: str | None, benchmark: str) -> None:
        """Note a record's id (valid or not); a repeated id within a benchmark is a problem."""
        if rid is None:
            return
        key = (benchmark, rid)
        if key in self.seen:
            self.add(file, index, rid, "id", f"duplicate id (record {self.seen[key]} has the same id in benchmark "
                     f"{benchmark!r})", "ids must be unique within a benchmark; renumber or remove the duplicate")
        else:
            self.seen[key] = index

    def add(self, file: Any, index: int | None, rid: str | None, field: str, reason: str, fix: str = "") -> None:
        self.problems.append(Problem(str(file), index, rid, field, reason, fix))
        if index is not None:
            self.bad.add((str(file), index))


# --- images ----------------------------------------------------------------------------------


def _image_problem(data: bytes) -> str | None:
    """None when ``data`` is an image PIL can open and decode, else the reason."""
    if not data:
        return "image bytes are empty"
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.verify()
        with Image.open(io.BytesIO(data)) as im:
            if im.format == "JPEG":
                im.draft("RGB", (max(1, im.width // 8), max(1, im.height // 8)))
            im.load()
    except Image.UnidentifiedImageError:
        return "image does not decode (not a format PIL recognises, or a corrupt header)"
    except Exception as exc:  # noqa: BLE001 - any decoder failure means "unusable image"
        return f"image does not decode ({type(exc).__name__}: {exc})"
    return None


def _short(value: Any, n: int = 80) -> str:
    """repr() of a value, cut to ``n`` characters (base64 blobs make unreadable messages)."""
    r = repr(value)
    return r if len(r) <= n else r[: n - 3] + "..."


def _b64(text: str) -> bytes:
    """Strict base64 decode (a ``data:...;base64,`` prefix and whitespace allowed)."""
    s = text.strip()
    if s.startswith("data:") and "," in s:
        s = s.split(",", 1)[1]
    s = "".join(s.split())
    return base64.b64decode(s, validate=True)


def _inside(root: Path, rel: str) -> tuple[Path | None, str | None]:
    """Resolve ``rel`` against ``root``; (path, None) when inside root, else (None, reason)."""
    root_r = root.resolve()
    p = Path(rel)
    full = (p if p.is_absolute() else root_r / p).resolve()
    if not full.is_relative_to(root_r):
        kind = "absolute path" if p.is_absolute() else "path"
        shown = str(full) if len(str(full)) <= 120 else str(full)[:117] + "..."
        return None, f"{kind} {_short(rel)} resolves to {shown}, outside the root {root_r}"
    return full, None


class _Record:
    """Validation context for one record: file, index, id and the collector."""

    def __init__(self, col: _Collector, file: Any, index: int, rid: str | None, benchmark: str):
        self.col, self.file, self.index, self.id = col, file, index, rid
        col.register(file, index, rid, benchmark)

    def bad(self, field: str, reason: str, fix: str = "") -> None:
        self.col.add(self.file, self.index, self.id, field, reason, fix)

    # images ---------------------------------------------------------------------------

    def image_from_path(self, field: str, root: Path, rel: Any) -> bytes | None:
        if not isinstance(rel, str) or not rel.strip():
            self.bad(field, f"image path is missing or not a string ({_short(rel)})",
                     "give a path relative to the root")
            return None
        full, why = _inside(root, rel)
        if full is None:
            self.bad(field, f"{why}", "image paths must stay inside the dataset root (no '../', no outside "
                     "absolute paths); move the file under the root or fix the root")
            return None
        if not full.is_file():
            self.bad(field, f"image file {full} not found", "fix the path or the root, or add the missing file")
            return None
        return self.check_bytes(field, full.read_bytes(), f" (file {full})")

    def image_from_b64(self, field: str, text: Any) -> bytes | None:
        if not isinstance(text, str) or not text.strip():
            self.bad(field, "image is missing (empty or null)", "provide the base64-encoded image")
            return None
        try:
            data = _b64(text)
        except (binascii.Error, ValueError) as exc:
            self.bad(field, f"bad base64 ({exc})", "re-encode the image with base64.b64encode")
            return None
        return self.check_bytes(field, data)

    def check_bytes(self, field: str, data: bytes | None, where: str = "") -> bytes | None:
        if data is None:
            self.bad(field, "image is missing (null)", "provide the image")
            return None
        why = _image_problem(bytes(data))
        if why:
            self.bad(field, why + where, "replace it with a valid PNG/JPEG file")
            return None
        return bytes(data)

    def image_any(self, field: str, value: Any, root: Path | None, encoding: str = "auto") -> bytes | None:
        """Bytes, the HF struct ``{"bytes", "path"}``, a base64 string or a path (see module docs)."""
        if value is None:
            self.bad(field, "image is missing (null)", "provide the image")
            return None
        if isinstance(value, dict):
            if value.get("bytes") is not None:
                return self.check_bytes(field, value["bytes"])
            if value.get("path") and root is not None:
                return self.image_from_path(field, root, value["path"])
            self.bad(field, f"image struct has no bytes (path {value.get('path')!r})",
                     "embed the image bytes, or give 'image_root' in the spec so the path can be read")
            return None
        if isinstance(value, (bytes, bytearray, memoryview)):
            return self.check_bytes(field, bytes(value))
        if isinstance(value, str):
            as_path = encoding == "path" or (encoding == "auto" and root is not None and not value.startswith("data:"))
            if as_path:
                if root is None:
                    self.bad(field, "image is a path but no image root is known", "set 'image_root' in the spec")
                    return None
                return self.image_from_path(field, root, value)
            return self.image_from_b64(field, value)
        self.bad(field, f"unsupported image value of type {type(value).__name__}",
                 "use bytes, a base64 string, a path or {'bytes', 'path'}")
        return None

    # answers / choices ------------------------------------------------------------------

    def answers(self, field: str, value: Any) -> list[str] | None:
        if value is None:
            self.bad(field, "answer is missing (null)", "give the gold answer (a string or a list of strings)")
            return None
        items = [value] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else value
        if not isinstance(items, (list, tuple)):
            self.bad(field, f"answer has unsupported type {type(value).__name__}", "use a string or a list of strings")
            return None
        if not items:
            self.bad(field, "answer list is empty", "give at least the gold answer")
            return None
        out: list[str] = []
        for k, a in enumerate(items):
            if a is None or (isinstance(a, str) and not a.strip()) or not isinstance(a, (str, int, float)):
                self.bad(field, f"answer [{k}] is empty or not a string ({_short(a)})", "remove it or fill it in")
                return None
            out.append(str(a).strip())
        return out

    def choices(self, field: str, value: Any) -> str | None | bool:
        """JSON text of the choices, None when absent, False when invalid (already reported)."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        obj = value
        if isinstance(value, str):
            try:
                obj = json.loads(value)
            except json.JSONDecodeError as exc:
                self.bad(field, f"choices is not valid JSON ({exc})", 'use a JSON object like {"A": "...", "B": "..."}')
                return False
        if not isinstance(obj, dict) or not obj or not all(isinstance(v, str) for v in obj.values()):
            self.bad(field, f"choices must be a non-empty object of letter -> option text, got {_short(value)}",
                     'use a JSON object like {"A": "...", "B": "..."}')
            return False
        return json.dumps({str(k): v for k, v in obj.items()}, ensure_ascii=False)


# --- reading helpers -----------------------------------------------------------------------------


def _require_file(path: Any, key: str = "path") -> Path:
    if path is None:
        raise _fail("<spec>", key, f"spec key '{key}' is missing", f"add '{key}' to the benchmark spec")
    p = Path(path)
    if not p.is_file():
        raise _fail(p, key, f"file {p} not found", "fix the path or fetch the benchmark file")
    return p


def _read_parquet(path: Path) -> pa.Table:
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise _fail(path, "<file>", f"not a readable parquet file ({exc})", "re-download or re-export it") from None


def _require_columns(path: Path, present: list[str], required: list[str], hint: str = "") -> None:
    missing = [c for c in required if c not in present]
    if missing:
        raise BenchmarkError([
            Problem(str(path), None, None, c, f"required column '{c}' is missing; present columns: {present}",
                    hint or f"the file must have columns {required}")
            for c in missing
        ])


def _read_jsonl(path: Path, col: _Collector) -> list[tuple[int, dict | None]]:
    out: list[tuple[int, dict | None]] = []
    with open(path, encoding="utf-8") as fh:
        idx = 0
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise ValueError(f"a JSON {type(rec).__name__}, not an object")
            except ValueError as exc:
                col.add(path, idx, None, "<line>", f"line {lineno} is not a JSON object ({exc})",
                        "fix or remove the line")
                rec = None
            out.append((idx, rec))
            idx += 1
    return out


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _id_of(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v)


def _row(rid: str, benchmark: str, question: str, images: list[bytes], answers: list[str], *,
         choices: str | None = None, category: Any = None, difficulty: Any = None, type: Any = None,
         search_results: str | None = None, _file: str = "", _index: int = -1) -> dict:
    return dict(id=rid, benchmark=benchmark, question=question, images=images, answers=answers, choices=choices,
                category=_opt_str(category), difficulty=_opt_str(difficulty), type=_opt_str(type),
                search_results=search_results, _file=_file, _index=_index)


def _finish(rows: list[dict], col: _Collector, on_error: str, files: list[Any], n_records: int) -> pa.Table:
    """Raise (or, with on_error=skip, drop bad records and warn), then build the table."""
    if col.problems:
        if on_error == "raise":
            raise BenchmarkError(col.problems, n_records=n_records)
        log.warning("%s", BenchmarkError(col.problems, n_records=n_records))
        rows = [r for r in rows if (r["_file"], r["_index"]) not in col.bad]
    if not rows:
        raise _fail(", ".join(str(f) for f in files), "<file>", "no valid records to score",
                    "check the split/length/datasets selection and the file contents")
    for r in rows:
        del r["_file"], r["_index"]
    return conform(pa.Table.from_pylist(rows, schema=BENCH_QUESTIONS), BENCH_QUESTIONS, "benchmark table")


# --- formats --------------------------------------------------------------------------------------


def _load_synth(spec: dict, col: _Collector) -> tuple[list[dict], list[Any], int]:
    path = _require_file(spec.get("path"))
    if spec.get("image_root") is None:
        raise _fail(path, "image_root", "spec key 'image_root' is missing",
                    "set it to the root the questions' image_path values are relative to")
    root = Path(spec["image_root"])
    try:
        table = read_table(path, QUESTIONS)
    except SchemaError as exc:
        raise _fail(path, "<schema>", str(exc)) from None  # the message names the stage to rerun
    split = spec.get("split", "test")
    name = spec.get("name") or "synth"
    rows = []
    records = table.to_pylist()
    if split not in (None, "all"):
        present = sorted({r["split"] for r in records})
        records = [(i, r) for i, r in enumerate(records) if r["split"] == split]
        if not records:
            raise _fail(path, "split", f"no questions in split {split!r} (splits present: {present})",
                        "choose a present split, or split: all")
    else:
        records = list(enumerate(records))
    for i, r in records:
        rec = _Record(col, path, i, r["question_id"], name)
        img = rec.image_from_path("image_path", root, r["image_path"])
        answers = rec.answers("answer", r["answer"])
        aliases = rec.answers("aliases", r["aliases"]) if r["aliases"] else []
        answers = None if answers is None or aliases is None else answers + aliases
        choices = rec.choices("choices", r["choices"])
        if not r["question"] or not r["question"].strip():
            rec.bad("question", "question text is empty", "fill in the prompt")
        if img is None or answers is None or choices is False:
            continue
        rows.append(_row(r["question_id"], name, r["question"], [img], answers, choices=choices, category=r["type"],
                         difficulty=r["difficulty"], type=r["type"], _file=str(path), _index=i))
    return rows, [path], len(records)


HR_MMSEARCH_REQUIRED = ["sample_id", "query", "query_image", "ground_truth"]


def _load_hr_mmsearch(spec: dict, col: _Collector) -> tuple[list[dict], list[Any], int]:
    path = _require_file(spec.get("path"))
    table = _read_parquet(path)
    _require_columns(path, table.column_names, HR_MMSEARCH_REQUIRED,
                     f"HR-MMSearch parquet needs {HR_MMSEARCH_REQUIRED} (+ optional difficulty, category)")
    root = Path(spec["image_root"]) if spec.get("image_root") is not None else None
    name = spec.get("name") or "hr_mmsearch"
    rows = []
    records = table.to_pylist()
    for i, r in enumerate(records):
        rid = _id_of(r["sample_id"])
        rec = _Record(col, path, i, rid, name)
        if rid is None:
            rec.bad("sample_id", "sample_id is null", "give every record a unique sample_id")
        q = r["query"]
        if not isinstance(q, str) or not q.strip():
            rec.bad("query", "query text is empty or null", "fill in the question")
        img = rec.image_any("query_image", r["query_image"], root)
        answers = rec.answers("ground_truth", r["ground_truth"])
        if rid is None or img is None or answers is None or not isinstance(q, str) or not q.strip():
            continue
        rows.append(_row(rid, name, q.strip(), [img], answers, category=r.get("category"),
                         difficulty=r.get("difficulty"), _file=str(path), _index=i))
    return rows, [path], len(records)


def _message_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") if isinstance(p, dict) else p for p in content
                 if isinstance(p, str) or (isinstance(p, dict) and p.get("type", "text") == "text")]
        return "".join(str(p) for p in parts)
    return None


def _manifest_entries(path: Path) -> list[tuple[str, dict]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(path, "<file>", f"manifest is not valid JSON ({exc})", "fix the JSON") from None
    if isinstance(data, dict):
        items = list(data.items())
    elif isinstance(data, list):
        items = []
        for k, e in enumerate(data):
            if not isinstance(e, dict) or not e.get("name"):
                raise _fail(path, f"[{k}].name", "list entries must be objects with a 'name'",
                            "add a unique 'name' to every dataset entry")
            items.append((str(e["name"]), e))
    else:
        raise _fail(path, "<file>", f"manifest must be an object or a list, got {type(data).__name__}",
                    "use {name: {root, annotation, length}}")
    names = [n for n, _ in items]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise _fail(path, "name", f"duplicate dataset names {dup}", "give every dataset a unique name")
    for n, e in items:
        if not isinstance(e, dict):
            raise _fail(path, n, "dataset entry is not an object", "use {root, annotation, length}")
        for key in ("root", "annotation"):
            if not isinstance(e.get(key), str) or not e.get(key):
                raise _fail(path, f"{n}.{key}", f"dataset {n!r} has no '{key}'; entry keys: {sorted(e)}",
                            f"add '{key}' (relative paths resolve against {path.parent})")
    return items


def _load_manifest(spec: dict, col: _Collector) -> tuple[list[dict], list[Any], int]:
    path = _require_file(spec.get("path"))
    base = path.parent
    entries = _manifest_entries(path)
    wanted = spec.get("datasets")
    if wanted is not None:
        known = [n for n, _ in entries]
        unknown = [w for w in wanted if w not in known]
        if unknown:
            raise _fail(path, "datasets", f"unknown dataset(s) {unknown}; the manifest has {known}",
                        "fix the spec's 'datasets' list")
        entries = [(n, e) for n, e in entries if n in wanted]
    prefix_ids = bool(spec.get("name")) and len(entries) > 1
    rows, files, total = [], [path], 0
    for dname, entry in entries:
        root = base / entry["root"]
        ann = base / entry["annotation"]
        files.append(ann)
        if not ann.is_file():
            col.add(path, None, None, f"{dname}.annotation", f"annotation file {ann} not found",
                    "fix the path (relative paths resolve against the manifest's directory)")
            continue
        if not root.is_dir():
            col.add(path, None, None, f"{dname}.root", f"root directory {root} not found", "fix the root")
            continue
        length = entry.get("length", -1)
        if length is None:
            length = -1
        if not isinstance(length, int) or isinstance(length, bool) or length < -1:
            col.add(path, None, None, f"{dname}.length", f"length must be -1 or a count >= 0, got {length!r}",
                    "use -1 for all records")
            continue
        records = _read_jsonl(ann, col)
        if length != -1:
            if len(records) < length:
                col.add(path, None, None, f"{dname}.length",
                        f"the manifest says {length} records but {ann} has {len(records)}",
                        "the annotation file looks truncated; re-download it or fix 'length'")
            records = records[:length]
        total += len(records)
        name = spec.get("name") or dname
        for i, r in records:
            if r is None:
                continue
            rid = _id_of(r.get("id")) or f"{dname}-{i}"
            if prefix_ids:
                rid = f"{dname}/{rid}"
            rec = _Record(col, ann, i, rid, name)
            question = None
            prompt = r.get("prompt")
            if not isinstance(prompt, list):
                rec.bad("prompt", f"prompt must be a list of chat messages, got {type(prompt).__name__}",
                        'use [{"role": "user", "content": "<image>..."}]')
            else:
                users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
                text = _message_text(users[0].get("content")) if users else None
                if text is None:
                    rec.bad("prompt", "no user message with text content", "add a user message holding the question")
                else:
                    question = text.replace("<image>", "").strip()
                    if not question:
                        rec.bad("prompt", "the user message has no text besides the <image> placeholder",
                                "put the question text in the user message")
                        question = None
            imgs_val = r.get("image")
            paths = [imgs_val] if isinstance(imgs_val, str) else imgs_val
            images: list[bytes] = []
            if not isinstance(paths, list) or not paths:
                rec.bad("image", f"image is missing ({_short(imgs_val)})",
                        "give a path (or list of paths) relative to root")
            else:
                for k, p in enumerate(paths):
                    b = rec.image_from_path(f"image[{k}]" if len(paths) > 1 else "image", root, p)
                    if b is not None:
                        images.append(b)
            rm = r.get("reward_model")
            gt = rm.get("ground_truth") if isinstance(rm, dict) else None
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                rec.bad("reward_model.ground_truth", "missing", 'add {"reward_model": {"ground_truth": ...}}')
                answers = None
            else:
                answers = rec.answers("reward_model.ground_truth", gt)
            search = _manifest_search(rec, r, root)
            if question is None or answers is None or search is False or not images or len(images) != len(paths):
                continue
            rows.append(_row(rid, name, question, images, answers, search_results=search, _file=str(ann), _index=i))
    return rows, files, total


def _manifest_search(rec: _Record, r: dict, root: Path) -> str | None | bool:
    titles = r.get("image_search_title_list")
    thumbs = r.get("image_search_thumbnail_list")
    if titles is None and thumbs is None:
        return None
    ok = True
    for key, val in (("image_search_title_list", titles), ("image_search_thumbnail_list", thumbs)):
        if val is not None and not isinstance(val, list):
            rec.bad(key, f"must be a list, got {type(val).__name__}", "use a JSON list")
            ok = False
    if not ok:
        return False
    out_thumbs: list[str | None] = []
    for k, p in enumerate(thumbs or []):
        if p is None:
            out_thumbs.append(None)
            continue
        b = rec.image_from_path(f"image_search_thumbnail_list[{k}]", root, p)
        if b is None:
            ok = False
        else:
            out_thumbs.append(base64.b64encode(b).decode("ascii"))
    if not ok:
        return False
    return json.dumps({"titles": [None if t is None else str(t) for t in (titles or [])], "thumbnails": out_thumbs},
                      ensure_ascii=False)


HR_BENCH_REQUIRED = ["question", "A", "B", "C", "D", "answer", "category", "image"]


def _read_tsv(path: Path) -> tuple[list[str], list[dict]]:
    csv.field_size_limit(sys.maxsize)
    with open(path, encoding="utf-8", newline="") as fh:
        reader = csv.DictReader(fh, delimiter="\t")
        records = list(reader)
        return list(reader.fieldnames or []), records


def _load_hr_bench(spec: dict, col: _Collector) -> tuple[list[dict], list[Any], int]:
    path = _require_file(spec.get("path"))
    if path.suffix.lower() == ".tsv":
        columns, records = _read_tsv(path)
    else:
        table = _read_parquet(path)
        columns, records = table.column_names, table.to_pylist()
    _require_columns(path, columns, HR_BENCH_REQUIRED,
                     f"HR-Bench needs columns {HR_BENCH_REQUIRED} (+ optional index)")
    name = spec.get("name") or "hr_bench"
    rows = []
    for i, r in enumerate(records):
        rid = _id_of(r.get("index")) if "index" in columns else str(i)
        rec = _Record(col, path, i, rid, name)
        if rid is None or rid == "":
            rec.bad("index", "index is empty", "give every row a unique index")
            continue
        options: dict[str, str] = {}
        for letter in LETTERS:
            v = r.get(letter)
            if v is None or not str(v).strip():
                rec.bad(letter, f"option {letter} is empty", "fill in all four options A-D")
            else:
                options[letter] = str(v).strip()
        q = r.get("question")
        if q is None or not str(q).strip():
            rec.bad("question", "question text is empty", "fill in the question")
        ans = r.get("answer")
        letter = str(ans).strip().upper() if ans is not None else ""
        if letter not in LETTERS or len(letter) != 1:
            rec.bad("answer", f"answer must be one letter A-D, got {_short(ans)}", "set the correct option's letter")
        img_val = r.get("image")
        img = rec.image_any("image", img_val, None, "base64")
        if img is None or len(options) != 4 or q is None or not str(q).strip() or letter not in LETTERS \
                or len(letter) != 1:
            continue
        text = "\n".join([str(q).strip()] + [f"{k}. {v}" for k, v in options.items()] + [MCQ_SUFFIX])
        rows.append(_row(rid, name, text, [img], [letter, options[letter]],
                         choices=json.dumps(options, ensure_ascii=False), category=r.get("category"),
                         _file=str(path), _index=i))
    return rows, [path], len(records)


def _load_table(spec: dict, col: _Collector) -> tuple[list[dict], list[Any], int]:
    path = _require_file(spec.get("path"))
    mapping = spec.get("columns")
    if not isinstance(mapping, dict):
        raise _fail(path, "columns", "spec key 'columns' (the column mapping) is missing",
                    "give columns: {question: ..., image|images: ..., answer|answers: ...}")
    allowed = {"id", "question", "image", "images", "answer", "answers", "choices", "category", "difficulty", "type"}
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise _fail(path, "columns", f"unknown mapping key(s) {unknown}; allowed: {sorted(allowed)}", "fix the spec")
    img_key = "images" if "images" in mapping else "image"
    ans_key = "answers" if "answers" in mapping else "answer"
    for need in ("question", img_key, ans_key):
        if need not in mapping:
            raise _fail(path, f"columns.{need}", f"the column mapping has no '{need}'",
                        "map question, image (or images) and answer (or answers) to column names")
    encoding = spec.get("image_encoding", "auto")
    if encoding not in ("auto", "base64", "path"):
        raise _fail(path, "image_encoding", f"unknown image_encoding {encoding!r}", "use auto, base64 or path")
    root = Path(spec["image_root"]) if spec.get("image_root") is not None else None
    if root is None and encoding == "path":
        root = path.parent
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        table = _read_parquet(path)
        columns, raw = table.column_names, [(i, r) for i, r in enumerate(table.to_pylist())]
    elif suffix in (".jsonl", ".json"):
        raw = _read_jsonl(path, col)
        columns = sorted({k for _, r in raw if r for k in r})
    else:
        raise _fail(path, "path", f"unsupported extension {suffix!r}", "use .parquet or .jsonl")
    need_cols = [mapping[k] for k in mapping]
    if suffix in (".parquet", ".pq"):
        _require_columns(path, columns, need_cols, f"the spec's column mapping is {mapping}")
    name = spec.get("name") or path.stem
    rows = []
    for i, r in raw:
        if r is None:
            continue
        rid = _id_of(r.get(mapping["id"])) if "id" in mapping else str(i)
        rec = _Record(col, path, i, rid, name)
        missing = [mapping[k] for k in ("question", img_key, ans_key) if mapping[k] not in r]
        if missing:
            rec.bad(",".join(missing), f"required column(s) {missing} missing from the record; present: {sorted(r)}",
                    f"the spec's column mapping is {mapping}")
            continue
        if rid is None:
            rec.bad(mapping["id"], "id is null", "give every record a unique id")
        q = r.get(mapping["question"])
        if not isinstance(q, str) or not q.strip():
            rec.bad(mapping["question"], "question text is empty or null", "fill in the question")
        val = r.get(mapping[img_key])
        images: list[bytes] = []
        if img_key == "images":
            if not isinstance(val, list) or not val:
                rec.bad(mapping[img_key], f"image list is missing or empty ({type(val).__name__})",
                        "give at least one image")
                vals = []
            else:
                vals = val
        else:
            vals = [val]
        for k, v in enumerate(vals):
            b = rec.image_any(mapping[img_key] + (f"[{k}]" if img_key == "images" else ""), v, root, encoding)
            if b is not None:
                images.append(b)
        answers = rec.answers(mapping[ans_key], r.get(mapping[ans_key]))
        choices = rec.choices(mapping["choices"], r.get(mapping["choices"])) if "choices" in mapping else None
        if rid is None or not isinstance(q, str) or not q.strip() or not vals or len(images) != len(vals) \
                or answers is None or choices is False:
            continue
        get = lambda k: r.get(mapping[k]) if k in mapping else None  # noqa: E731
        rows.append(_row(rid, name, q.strip(), images, answers, choices=choices, category=get("category"),
                         difficulty=get("difficulty"), type=get("type"), _file=str(path), _index=i))
    return rows, [path], len(raw)


FORMATS: dict[str, Callable[[dict, _Collector], tuple[list[dict], list[Any], int]]] = {
    "synth": _load_synth,
    "hr_mmsearch": _load_hr_mmsearch,
    "manifest": _load_manifest,
    "hr_bench": _load_hr_bench,
    "table": _load_table,
}


def load_benchmark(spec: dict) -> pa.Table:
    """Load and validate the benchmark described by ``spec`` into a BENCH_QUESTIONS table.

    Raises :class:`BenchmarkError` listing every problem found (file, record index/id, field, reason, fix).
    """
    if not isinstance(spec, dict):
        raise _fail("<spec>", "<spec>", f"spec must be a dict, got {type(spec).__name__}", "pass a dict")
    fmt = spec.get("format")
    if fmt not in FORMATS:
        raise _fail(spec.get("path", "<spec>"), "format", f"unknown benchmark format {fmt!r}",
                    f"use one of {sorted(FORMATS)}")
    on_error = spec.get("on_error", "raise")
    if on_error not in ("raise", "skip"):
        raise _fail(spec.get("path", "<spec>"), "on_error", f"unknown on_error {on_error!r}", "use raise or skip")
    col = _Collector()
    rows, files, n = FORMATS[fmt](spec, col)
    return _finish(rows, col, on_error, files, n)
