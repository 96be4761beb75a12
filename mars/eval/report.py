"""The evaluation stage's report: ONE self-contained HTML file with the scores and every trajectory.

What it does
    :func:`write_report` turns a RESULTS table (:data:`mars.data.schemas.RESULTS`: one row per sample, model and
    workflow) and the stage's metrics dict into a single HTML page:

    1. **Results**: accuracy by benchmark x ``model/workflow`` (mean of ``correct`` over every sample, i.e. Avg@k,
       with the sample count), the same split by ``type`` / ``category`` / ``difficulty`` where those are set,
       tool use and cost per ``model/workflow`` (turns, tool calls, errors, tokens, latency), then the metrics dict
       as given (any nested dict of numbers: one table per top-level key, inner dicts flattened to
       ``a.b`` columns).
    2. **Trajectories**: every sample (or ``max_trajectories`` of them, round-robin over the
       benchmark/model/workflow groups) as a collapsible ``<details>`` card: header (benchmark, question id, model,
       workflow, correct/wrong badge, score, turns, tool calls), question, gold, prediction, and the dialogue of
       ``messages_json``: the system prompt collapsed, the user question with its image, every assistant turn with
       ``<think>``, ``<tool_call>`` (JSON pretty-printed) and ``<answer>`` highlighted, tool responses with their
       crops / thumbnails inline. Click an image to see it at full (downscaled) size.
    3. **Filters** (vanilla JS, no libraries): benchmark, model, workflow and correct/wrong select boxes plus a text
       search over question ids; the "N of M shown" count updates. Filters are mirrored in the URL hash
       (``report.html#model=sft&workflow=agentic&correct=wrong&q=vstar``), so a filtered view can be shared and a
       hash given when opening the file is applied on load.

    The file is self-contained: no external URL anywhere, inline CSS and JS, images as base64 ``data:`` URLs
    downscaled to ``max_image_side`` (PIL) and re-encoded as PNG or JPEG q85, whichever is smaller (an image
    repeated across rows is encoded once).

    The page is rendered by jinja2 from ``mars/eval/templates/``: ``report.html.j2`` (the page and its macros)
    inlines ``report.css``, ``selfcheck.js`` and ``report.js`` with ``{% include %}``, so the output stays one
    file. This module only prepares the data: pure functions that turn the rows into plain dicts, lists and
    strings (numbers already formatted), which the template lays out. The templates are loaded with
    ``jinja2.PackageLoader("mars.eval", "templates")``, so they are found wherever the package is installed (a
    wheel must ship them as package data). Autoescaping is on: every dataset and model string is escaped by the
    template, never by hand; model output is untrusted, so a prediction holding ``<script>`` shows as text and
    never runs. The scripts take no data from Python: they read the cards' ``data-*`` attributes and the
    filter options, which are escaped like any other text.

    A tiny self-check runs in the page: errors (``window.onerror``, failed resource loads, unhandled rejections,
    ``console.error``) are recorded in ``<body data-errors=N data-error-messages=...>``, and on ``load`` every image
    gets ``data-natural-width`` when it decoded, the body ``data-images-loaded`` / ``data-images-total``;
    the filters keep ``<body data-visible=N>``. The tests read these from Chromium's ``--dump-dom``.

    The file is written atomically (:func:`mars.data.io.atomic_path`). Its size grows with the number of
    trajectories times their images; use ``max_trajectories`` / ``max_image_side`` for very large runs.

How to open it
    Any browser, offline: ``xdg-open report.html`` / ``open report.html``, or double-click it. Nothing is fetched.

How to run (Python)::

    from mars.eval.report import write_report
    write_report(results_table, metrics, "eval/report.html", max_trajectories=500)

or from the shell: ``python -m mars.eval.report results.parquet metrics.json report.html``.

Tests::

    .venv/bin/python -m pytest tests/eval/test_report.py -q

(the Chromium tests need ``/usr/bin/chromium``: ``apt-get install chromium``; they skip with that reason
otherwise, and ``.ci/run`` installs it.)
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
import pyarrow as pa

from mars.data.io import atomic_path

__all__ = ["write_report", "render_report"]

_NEEDED = (
    "benchmark", "question_id", "model", "workflow", "question", "gold", "prediction", "correct", "score",
    "judge", "turns", "n_zoom", "n_text_search", "n_image_search", "messages_json", "images",
)
_OPTIONAL = (
    "sample_id", "sample_idx", "category", "difficulty", "type", "finish_reason", "tool_errors", "format_errors",
    "tokens", "latency_s", "seed", "temperature",
)
_TAG_RE = re.compile(r"<(think|tool_call|answer|tool_response)>(.*?)</\1>", re.S)
TEMPLATE = "report.html.j2"
_DASH = {"kind": "muted", "text": "\u2013"}  # an empty table cell


@functools.cache
def _environment() -> jinja2.Environment:
    """The jinja2 environment of the report: templates from the package, autoescaping on, undefined names fail."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("mars.eval", "templates"),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html", "html.j2"), default_for_string=True),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def _text(x: Any) -> str:
    """Any value as text for the page (None as empty); the template escapes it."""
    return "" if x is None else str(x)


# --- images -----------------------------------------------------------------------------------------------------


class _ImageCache:
    """Decode, downscale and re-encode images once per distinct input bytes."""

    def __init__(self, max_side: int):
        self.max_side = int(max_side)
        self._cache: dict[str, tuple[str, str]] = {}

    def encode(self, data: bytes | None) -> tuple[str | None, str]:
        """Return ``(data URL or None, caption)``."""
        if not data:
            return None, "empty image"
        key = hashlib.sha1(data).hexdigest()
        if key not in self._cache:
            self._cache[key] = self._encode(data)
        url, caption = self._cache[key]
        return (url or None), caption

    def _encode(self, data: bytes) -> tuple[str, str]:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                w0, h0 = im.size
                has_alpha = im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info)
                im = im.convert("RGBA" if has_alpha else "RGB")
                if max(im.size) > self.max_side:
                    im.thumbnail((self.max_side, self.max_side), Image.LANCZOS)
        except Exception as exc:  # an undecodable image must not break the report
            return "", f"undecodable image ({type(exc).__name__})"
        png = io.BytesIO()
        im.save(png, format="PNG", optimize=True)
        best, mime = png.getvalue(), "image/png"
        if not has_alpha:
            jpg = io.BytesIO()
            im.save(jpg, format="JPEG", quality=85, optimize=True)
            if len(jpg.getvalue()) < len(best):
                best, mime = jpg.getvalue(), "image/jpeg"
        caption = f"{w0}\u00d7{h0}" + (f" \u2192 {im.size[0]}\u00d7{im.size[1]}" if im.size != (w0, h0) else "")
        return f"data:{mime};base64,{base64.b64encode(best).decode('ascii')}", caption


def _figure(cache: _ImageCache, images: list, ref: Any) -> dict:
    """One image of a message: ``{"src", "ref", "caption"}``, or ``{"missing": why}`` when it cannot be shown."""
    try:
        i = int(ref)
    except (TypeError, ValueError):
        return {"missing": f"image without a valid ref: {_text(ref)}"}
    if not 0 <= i < len(images):
        return {"missing": f"image ref {i} missing ({len(images)} images in this row)"}
    url, caption = cache.encode(images[i])
    if url is None:
        return {"missing": f"image {i}: {caption}"}
    return {"src": url, "ref": i, "caption": caption}


# --- text -------------------------------------------------------------------------------------------------------


def _pretty_json(s: str) -> str:
    try:
        obj = json.loads(s)
        one_line = json.dumps(obj, ensure_ascii=False)
        return one_line if len(one_line) <= 120 else json.dumps(obj, indent=2, ensure_ascii=False)
    except (ValueError, TypeError):
        return s.strip()


def _segments(text: str) -> list[dict]:
    """Split ``text`` at its protocol tags: ``[{"tag": None | "think" | ..., "text": ...}]``.

    Tagged segments are highlighted by the template; a ``tool_call``'s JSON is pretty-printed. Whitespace between
    two tagged blocks is dropped (it would only add blank lines).
    """
    out: list[dict] = []
    pos = 0
    for m in _TAG_RE.finditer(text):
        gap = text[pos : m.start()]
        if gap.strip():
            out.append({"tag": None, "text": gap})
        tag, inner = m.group(1), m.group(2)
        out.append({"tag": tag, "text": _pretty_json(inner) if tag == "tool_call" else inner.strip("\n")})
        pos = m.end()
    tail = text[pos:]
    if tail.strip() or pos == 0:
        out.append({"tag": None, "text": tail})
    return out


def _plain(text: str) -> dict:
    """A text block shown as is."""
    return {"kind": "text", "segments": [{"tag": None, "text": text}]}


def _blocks(content: Any, cache: _ImageCache, images: list) -> list[dict]:
    """A message's content as blocks: ``{"kind": "text", "segments"}`` and ``{"kind": "figs", "figures"}``
    (consecutive images share one row)."""
    if isinstance(content, str):
        return [{"kind": "text", "segments": _segments(content)}]
    if not isinstance(content, list):
        return [_plain(json.dumps(content, ensure_ascii=False))]
    blocks: list[dict] = []
    figures: list[dict] = []

    def flush() -> None:
        if figures:
            blocks.append({"kind": "figs", "figures": list(figures)})
            figures.clear()

    for item in content:
        kind = item.get("type") if isinstance(item, Mapping) else None
        if kind == "text":
            flush()
            blocks.append({"kind": "text", "segments": _segments(str(item.get("text", "")))})
        elif kind == "image":
            figures.append(_figure(cache, images, item.get("ref")))
        else:
            flush()
            blocks.append(_plain(json.dumps(item, ensure_ascii=False, default=str)))
    flush()
    return blocks


def _is_tool_response(content: Any) -> bool:
    if isinstance(content, str):
        return content.lstrip().startswith("<tool_response>")
    if isinstance(content, list):
        for item in content:
            if isinstance(item, Mapping) and item.get("type") == "text":
                return str(item.get("text", "")).lstrip().startswith("<tool_response>")
    return False


def _dialogue(messages_json: str | None, cache: _ImageCache, images: list) -> dict:
    """The trajectory's messages: ``{"messages": [...]}``, or ``{"error", "raw"}`` when ``messages_json`` is not
    a JSON list. A message is ``{"kind": "system" | "message" | "raw", ...}`` with its label, CSS class and
    content blocks."""
    try:
        messages = json.loads(messages_json or "[]")
        if not isinstance(messages, list):
            raise ValueError("not a list")
    except ValueError as exc:
        return {"error": str(exc), "raw": _text(messages_json), "messages": []}
    out: list[dict] = []
    n_assistant = 0
    for m in messages:
        if not isinstance(m, Mapping):
            out.append({"kind": "raw", "text": str(m)})
            continue
        role = str(m.get("role", "?"))
        content = m.get("content", "")
        blocks = _blocks(content, cache, images)
        if role == "system":
            out.append({"kind": "system", "blocks": blocks})
            continue
        if role == "assistant":
            n_assistant += 1
            label, cls = f"assistant \u00b7 turn {n_assistant}", "msg-assistant"
        elif role in ("user", "tool") and _is_tool_response(content):
            label, cls = "tool response", "msg-tool"
        else:
            label, cls = role, f"msg-{re.sub(r'[^a-z]', '', role.lower()) or 'other'}"
        out.append({"kind": "message", "label": label, "cls": cls, "blocks": blocks})
    return {"error": None, "raw": "", "messages": out}


# --- tables -----------------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    """A value as table text: floats to 4 decimals (or 4 significant digits when very large or small), None empty."""
    if isinstance(v, bool) or v is None:
        return _text(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}" if abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3) else f"{v:.4f}".rstrip("0").rstrip(".")
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v) if len(v) <= 8 else f"[{len(v)} values]"
    return str(v)


def _table(header: list[str], rows: list[list[Any]], cls: str = "") -> dict:
    """A table for the template: a cell is text, or a dict with a ``kind`` (``acc``, ``muted``, ``bold``)."""
    return {"cls": cls, "header": header, "rows": rows}


def _acc_cell(vals: list[bool]) -> dict:
    """Accuracy of ``vals`` as a cell: the percentage, the sample count and the bar shade ``--a``."""
    if not vals:
        return _DASH
    acc = sum(vals) / len(vals)
    return {"kind": "acc", "shade": f"{acc:.3f}", "pct": f"{100 * acc:.1f}%", "n": len(vals)}


def _system(r: dict) -> str:
    return f"{r['model']}/{r['workflow']}"


def _accuracy_sections(rows: list[dict]) -> list[dict]:
    """The Results tables as ``[{"heading", "table"}]``: accuracy by benchmark, by type / category / difficulty
    where those are set, then tool use and cost per model/workflow."""
    systems = list(dict.fromkeys(_system(r) for r in rows))
    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    cells: dict[tuple, list[bool]] = {}
    for r in rows:
        cells.setdefault((r["benchmark"], _system(r)), []).append(bool(r["correct"]))
        cells.setdefault(("all", _system(r)), []).append(bool(r["correct"]))
    body: list[list[Any]] = [[_text(b)] + [_acc_cell(cells.get((b, s), [])) for s in systems] for b in benches]
    if len(benches) > 1:
        body.append([{"kind": "bold", "text": "all"}] + [_acc_cell(cells.get(("all", s), [])) for s in systems])
    out = [{"heading": "Accuracy by benchmark", "table": _table(["benchmark"] + systems, body, "acc-table")}]
    for dim in ("type", "category", "difficulty"):
        if not any(r.get(dim) not in (None, "") for r in rows):
            continue
        split: dict[tuple, list[bool]] = {}
        for r in rows:
            key = (r["benchmark"], r.get(dim) if r.get(dim) not in (None, "") else "(none)")
            split.setdefault(key + (_system(r),), []).append(bool(r["correct"]))
        keys = list(dict.fromkeys(k[:2] for k in split))
        body = [[_text(b), _text(v)] + [_acc_cell(split.get((b, v, s), [])) for s in systems] for b, v in keys]
        out.append({"heading": f"Accuracy by {dim}",
                    "table": _table(["benchmark", dim] + systems, body, "acc-table")})
    cols = [("turns", "turns"), ("tool calls", None), ("zoom", "n_zoom"), ("text search", "n_text_search"),
            ("image search", "n_image_search"), ("tool errors", "tool_errors"), ("format errors", "format_errors"),
            ("tokens", "tokens"), ("latency s", "latency_s")]
    body = []
    for s in systems:
        rs = [r for r in rows if _system(r) == s]
        line: list[Any] = [s, str(len(rs))]
        for _, col in cols:
            if col is None:
                vals = [_n_tools(r) for r in rs]
            else:
                vals = [r.get(col) for r in rs if r.get(col) is not None]
            line.append(_fmt(sum(vals) / len(vals)) if vals else _DASH)
        body.append(line)
    out.append({"heading": "Tool use and cost (mean per sample)",
                "table": _table(["model/workflow", "samples"] + [c for c, _ in cols], body)})
    return out


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def _metrics_table(d: Mapping) -> dict | None:
    """One top-level metrics entry as a table (inner dicts flattened to ``a.b`` columns); None when empty."""
    rows: list[tuple[str, dict[str, Any]]] = []
    cols: dict[str, None] = {}
    for k, v in d.items():
        flat = _flatten(v) if isinstance(v, Mapping) else {"value": v}
        rows.append((str(k), flat))
        cols.update(dict.fromkeys(flat))
    if not cols:
        return None
    if len(cols) > 30 and len(rows) < len(cols):  # wide and short: transpose
        body = [[c] + [_fmt(f.get(c)) if c in f else "" for _, f in rows] for c in cols]
        return _table(["metric"] + [k for k, _ in rows], body)
    body = [[k] + [_fmt(f[c]) if c in f else "" for c in cols] for k, f in rows]
    return _table([""] + list(cols), body)


def _metrics_sections(metrics: Mapping | None) -> dict | None:
    """The metrics dict as ``{"scalars": table | None, "groups": [{"name", "table"}]}``; None when empty."""
    if not metrics:
        return None
    scalars = [[str(k), _fmt(v)] for k, v in metrics.items() if not isinstance(v, Mapping)]
    return {
        "scalars": _table(["metric", "value"], scalars) if scalars else None,
        "groups": [{"name": str(k), "table": _metrics_table(v)} for k, v in metrics.items() if isinstance(v, Mapping)],
    }


# --- trajectories -----------------------------------------------------------------------------------------------


def _n_tools(r: dict) -> int:
    return int(r.get("n_zoom") or 0) + int(r.get("n_text_search") or 0) + int(r.get("n_image_search") or 0)


def _plural(n: Any, word: str) -> str:
    return f"{_text(n)} {word}" + ("" if n == 1 else "s")


def _pick(rows: list[dict], limit: int | None) -> list[int]:
    """Indices of the rows to show: all, or ``limit`` taken round-robin over (benchmark, model, workflow)."""
    if limit is None or limit >= len(rows):
        return list(range(len(rows)))
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r["benchmark"], r["model"], r["workflow"]), []).append(i)
    picked: list[int] = []
    depth = 0
    while len(picked) < limit:
        for idx in groups.values():
            if depth < len(idx) and len(picked) < limit:
                picked.append(idx[depth])
        depth += 1
    return sorted(picked)


def _card(r: dict, images: list, cache: _ImageCache, card_id: str) -> dict:
    """One trajectory card: the filter attributes, the header, the question, the details and the dialogue."""
    k = r.get("sample_idx")
    meta_items = [
        ("gold", " | ".join(str(g) for g in (r.get("gold") or []))),
        ("prediction", r.get("prediction")),
        ("judge", r.get("judge")),
        ("finish", r.get("finish_reason")),
        ("type / category / difficulty", " / ".join(str(r.get(x) or "\u2013") for x in ("type", "category", "difficulty"))),
        ("tools", f"zoom {r.get('n_zoom')}, text search {r.get('n_text_search')}, image search "
                  f"{r.get('n_image_search')}; tool errors {r.get('tool_errors', '?')}, format errors "
                  f"{r.get('format_errors', '?')}"),
        ("tokens / latency", f"{r.get('tokens', '?')} tokens, {_fmt(r.get('latency_s'))} s"),
        ("sample", r.get("sample_id")),
    ]
    return {
        "id": card_id,
        "verdict": "correct" if bool(r["correct"]) else "wrong",
        "benchmark": _text(r["benchmark"]),
        "model": _text(r["model"]),
        "workflow": _text(r["workflow"]),
        "qid": _text(r["question_id"]),
        "sample_id": _text(r.get("sample_id") or ""),
        "k": None if k is None else _text(k),
        "score": _fmt(float(r["score"])),
        "turns": _plural(r["turns"], "turn"),
        "tool_calls": _plural(_n_tools(r), "tool call"),
        "question": _text(r.get("question")),
        "meta": [(name, str(v)) for name, v in meta_items if v not in (None, "")],
        "dialogue": _dialogue(r.get("messages_json"), cache, images),
    }


# --- page -------------------------------------------------------------------------------------------------------


def _context(results: pa.Table, metrics: Mapping | None, title: str, max_image_side: int,
             max_trajectories: int | None) -> dict:
    """Everything the template shows, as plain dicts, lists and strings."""
    light = [c for c in (*_NEEDED, *_OPTIONAL) if c in results.column_names and c not in ("messages_json", "images")]
    rows = results.select(light).to_pylist()
    messages_col = results.column("messages_json")
    images_col = results.column("images")
    cache = _ImageCache(max_image_side)

    picked = _pick(rows, max_trajectories)
    cards = []
    for n, i in enumerate(picked):
        r = dict(rows[i])
        r["messages_json"] = messages_col[i].as_py()
        cards.append(_card(r, images_col[i].as_py() or [], cache, f"t{n}"))

    def uniq(col: str) -> list[str]:
        return sorted({str(r[col]) for r in rows})

    return {
        "title": _text(title),
        "n_samples": len(rows),
        "n_questions": len({(r["benchmark"], r["question_id"]) for r in rows}),
        "n_benchmarks": len(uniq("benchmark")),
        "n_systems": len({(r["model"], r["workflow"]) for r in rows}),
        "results": _accuracy_sections(rows) if rows else None,
        "metrics": _metrics_sections(metrics),
        "truncated": len(picked) < len(rows),
        "max_trajectories": max_trajectories,
        "filters": [(col, uniq(col)) for col in ("benchmark", "model", "workflow")],
        "cards": cards,
    }


def render_report(
    results: pa.Table,
    metrics: Mapping | None,
    *,
    title: str = "MARS evaluation",
    max_image_side: int = 512,
    max_trajectories: int | None = None,
) -> str:
    """Return the report's HTML (see the module docstring); :func:`write_report` writes it to a file."""
    missing = [c for c in _NEEDED if c not in results.column_names]
    if missing:
        raise ValueError(
            f"results table lacks columns {missing}; expected the RESULTS schema (mars.data.schemas.RESULTS)"
        )
    if max_image_side < 16:
        raise ValueError(f"max_image_side must be >= 16, got {max_image_side}")
    if max_trajectories is not None and max_trajectories < 0:
        raise ValueError(f"max_trajectories must be >= 0 or None, got {max_trajectories}")
    context = _context(results, metrics, title, max_image_side, max_trajectories)
    return _environment().get_template(TEMPLATE).render(context)


def write_report(
    results: pa.Table,
    metrics: Mapping | None,
    out_path: str | Path,
    *,
    title: str = "MARS evaluation",
    max_image_side: int = 512,
    max_trajectories: int | None = None,
) -> Path:
    """Write the self-contained HTML report of ``results`` and ``metrics`` to ``out_path`` atomically.

    ``results`` follows :data:`mars.data.schemas.RESULTS`; ``metrics`` is any nested dict of numbers (e.g.
    ``{"<benchmark>": {"<model>/<workflow>": {"accuracy": 0.5, "by_type": {...}}}}``). Images are downscaled so
    their longer side is at most ``max_image_side``; ``max_trajectories`` caps the trajectory cards (None: all).
    Returns the path written.
    """
    page = render_report(
        results, metrics, title=title, max_image_side=max_image_side, max_trajectories=max_trajectories
    )
    out = Path(out_path)
    with atomic_path(out, suffix=".html") as tmp:
        tmp.write_text(page, encoding="utf-8")
    return out


def _main(argv: list[str] | None = None) -> int:
    import argparse

    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(prog="python -m mars.eval.report", description=__doc__.splitlines()[0])
    ap.add_argument("results", help="RESULTS parquet file")
    ap.add_argument("metrics", nargs="?", help="metrics JSON file (optional)")
    ap.add_argument("out", help="HTML file to write")
    ap.add_argument("--title", default="MARS evaluation")
    ap.add_argument("--max-image-side", type=int, default=512)
    ap.add_argument("--max-trajectories", type=int, default=None)
    a = ap.parse_args(argv)
    metrics = json.loads(Path(a.metrics).read_text()) if a.metrics else {}
    out = write_report(pq.read_table(a.results), metrics, a.out, title=a.title,
                       max_image_side=a.max_image_side, max_trajectories=a.max_trajectories)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
