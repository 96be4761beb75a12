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
    repeated across rows is encoded once). All dataset and model text is escaped with :func:`html.escape`:
    model output is untrusted, so a prediction holding ``<script>`` shows as text and never runs.

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
import hashlib
import html
import io
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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


def esc(x: Any) -> str:
    """Escape any value for HTML text or a quoted attribute."""
    return html.escape("" if x is None else str(x), quote=True)


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


def _img_html(cache: _ImageCache, images: list, ref: Any) -> str:
    try:
        i = int(ref)
    except (TypeError, ValueError):
        return f'<div class="missing">image without a valid ref: {esc(ref)}</div>'
    if not 0 <= i < len(images):
        return f'<div class="missing">image ref {i} missing ({len(images)} images in this row)</div>'
    url, caption = cache.encode(images[i])
    if url is None:
        return f'<div class="missing">image {i}: {esc(caption)}</div>'
    return (
        f'<figure><img src="{url}" alt="image {i}" data-ref="{i}">'
        f"<figcaption>image {i} \u00b7 {esc(caption)}</figcaption></figure>"
    )


# --- text -------------------------------------------------------------------------------------------------------


def _pretty_json(s: str) -> str:
    try:
        obj = json.loads(s)
        one_line = json.dumps(obj, ensure_ascii=False)
        return one_line if len(one_line) <= 120 else json.dumps(obj, indent=2, ensure_ascii=False)
    except (ValueError, TypeError):
        return s.strip()


def _highlight(text: str) -> str:
    """Escape ``text`` and wrap its protocol tags in highlighted blocks (the text is split first, then escaped)."""
    out: list[str] = []
    pos = 0
    for m in _TAG_RE.finditer(text):
        gap = text[pos : m.start()]
        if gap.strip():  # whitespace between two highlighted blocks would only add blank lines
            out.append(esc(gap))
        tag, inner = m.group(1), m.group(2)
        inner = _pretty_json(inner) if tag == "tool_call" else inner.strip("\n")
        out.append(
            f'<span class="tag tag-{tag}"><span class="tagname">&lt;{tag}&gt;</span>'
            f'{esc(inner)}<span class="tagname">&lt;/{tag}&gt;</span></span>'
        )
        pos = m.end()
    tail = text[pos:]
    if tail.strip() or pos == 0:
        out.append(esc(tail))
    return "".join(out)


def _content_html(content: Any, cache: _ImageCache, images: list) -> str:
    if isinstance(content, str):
        return f'<div class="text">{_highlight(content)}</div>'
    if not isinstance(content, list):
        return f'<div class="text">{esc(json.dumps(content, ensure_ascii=False))}</div>'
    parts: list[str] = []
    figs: list[str] = []

    def flush() -> None:
        if figs:
            parts.append('<div class="figs">' + "".join(figs) + "</div>")
            figs.clear()

    for item in content:
        kind = item.get("type") if isinstance(item, Mapping) else None
        if kind == "text":
            flush()
            parts.append(f'<div class="text">{_highlight(str(item.get("text", "")))}</div>')
        elif kind == "image":
            figs.append(_img_html(cache, images, item.get("ref")))
        else:
            flush()
            parts.append(f'<div class="text">{esc(json.dumps(item, ensure_ascii=False, default=str))}</div>')
    flush()
    return "".join(parts)


def _is_tool_response(content: Any) -> bool:
    if isinstance(content, str):
        return content.lstrip().startswith("<tool_response>")
    if isinstance(content, list):
        for item in content:
            if isinstance(item, Mapping) and item.get("type") == "text":
                return str(item.get("text", "")).lstrip().startswith("<tool_response>")
    return False


def _dialogue_html(messages_json: str | None, cache: _ImageCache, images: list) -> str:
    try:
        messages = json.loads(messages_json or "[]")
        if not isinstance(messages, list):
            raise ValueError("not a list")
    except ValueError as exc:
        return (
            f'<div class="missing">messages_json is not a JSON list ({esc(exc)}); raw:</div>'
            f'<div class="text">{esc(messages_json)}</div>'
        )
    out: list[str] = []
    n_assistant = 0
    for m in messages:
        if not isinstance(m, Mapping):
            out.append(f'<div class="msg"><div class="text">{esc(m)}</div></div>')
            continue
        role = str(m.get("role", "?"))
        content = m.get("content", "")
        body = _content_html(content, cache, images)
        if role == "system":
            out.append(f'<details class="msg msg-system"><summary>system prompt</summary>{body}</details>')
            continue
        if role == "assistant":
            n_assistant += 1
            label, cls = f"assistant \u00b7 turn {n_assistant}", "msg-assistant"
        elif role in ("user", "tool") and _is_tool_response(content):
            label, cls = "tool response", "msg-tool"
        else:
            label, cls = role, f"msg-{re.sub(r'[^a-z]', '', role.lower()) or 'other'}"
        out.append(f'<div class="msg {cls}"><div class="role">{esc(label)}</div>{body}</div>')
    return "".join(out)


# --- tables -----------------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return esc(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}" if abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3) else f"{v:.4f}".rstrip("0").rstrip(".")
    if isinstance(v, (list, tuple)):
        return esc(", ".join(_fmt(x) for x in v)) if len(v) <= 8 else esc(f"[{len(v)} values]")
    return esc(v)


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    """Rows are already-escaped HTML cells."""
    h = "".join(f"<th>{c}</th>" for c in header)
    b = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>'


def _acc_cell(vals: list[bool]) -> str:
    if not vals:
        return '<span class="muted">\u2013</span>'
    acc = sum(vals) / len(vals)
    return f'<span class="acc" style="--a:{acc:.3f}">{100 * acc:.1f}%</span> <span class="n">n={len(vals)}</span>'


def _accuracy_tables(rows: list[dict]) -> str:
    systems = list(dict.fromkeys(f"{r['model']}/{r['workflow']}" for r in rows))
    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    out = ["<h3>Accuracy by benchmark</h3>"]
    cells: dict[tuple, list[bool]] = {}
    for r in rows:
        sysk = f"{r['model']}/{r['workflow']}"
        cells.setdefault((r["benchmark"], sysk), []).append(bool(r["correct"]))
        cells.setdefault(("all", sysk), []).append(bool(r["correct"]))
    body = [[esc(b)] + [_acc_cell(cells.get((b, s), [])) for s in systems] for b in benches]
    if len(benches) > 1:
        body.append(["<b>all</b>"] + [_acc_cell(cells.get(("all", s), [])) for s in systems])
    out.append(_table(["benchmark"] + [esc(s) for s in systems], body, "acc-table"))
    for dim in ("type", "category", "difficulty"):
        if not any(r.get(dim) not in (None, "") for r in rows):
            continue
        split: dict[tuple, list[bool]] = {}
        for r in rows:
            key = (r["benchmark"], r.get(dim) if r.get(dim) not in (None, "") else "(none)")
            split.setdefault(key + (f"{r['model']}/{r['workflow']}",), []).append(bool(r["correct"]))
        keys = list(dict.fromkeys(k[:2] for k in split))
        body = [[esc(b), esc(v)] + [_acc_cell(split.get((b, v, s), [])) for s in systems] for b, v in keys]
        out.append(f"<h3>Accuracy by {esc(dim)}</h3>")
        out.append(_table(["benchmark", esc(dim)] + [esc(s) for s in systems], body, "acc-table"))
    # tool use and cost per system
    cols = [("turns", "turns"), ("tool calls", None), ("zoom", "n_zoom"), ("text search", "n_text_search"),
            ("image search", "n_image_search"), ("tool errors", "tool_errors"), ("format errors", "format_errors"),
            ("tokens", "tokens"), ("latency s", "latency_s")]
    body = []
    for s in systems:
        rs = [r for r in rows if f"{r['model']}/{r['workflow']}" == s]
        line = [esc(s), str(len(rs))]
        for _, col in cols:
            if col is None:
                vals = [_n_tools(r) for r in rs]
            else:
                vals = [r.get(col) for r in rs if r.get(col) is not None]
            line.append(_fmt(sum(vals) / len(vals)) if vals else '<span class="muted">\u2013</span>')
        body.append(line)
    out.append("<h3>Tool use and cost (mean per sample)</h3>")
    out.append(_table(["model/workflow", "samples"] + [c for c, _ in cols], body))
    return "".join(out)


def _flatten(d: Mapping, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def _metrics_table(d: Mapping) -> str:
    rows: list[tuple[str, dict[str, Any]]] = []
    cols: dict[str, None] = {}
    for k, v in d.items():
        flat = _flatten(v) if isinstance(v, Mapping) else {"value": v}
        rows.append((str(k), flat))
        cols.update(dict.fromkeys(flat))
    if not cols:
        return '<p class="muted">(empty)</p>'
    if len(cols) > 30 and len(rows) < len(cols):  # wide and short: transpose
        body = [[esc(c)] + [_fmt(f.get(c)) if c in f else "" for _, f in rows] for c in cols]
        return _table(["metric"] + [esc(k) for k, _ in rows], body)
    body = [[esc(k)] + [_fmt(f[c]) if c in f else "" for c in cols] for k, f in rows]
    return _table([""] + [esc(c) for c in cols], body)


def _metrics_html(metrics: Mapping | None) -> str:
    if not metrics:
        return '<p class="muted">no metrics given</p>'
    out: list[str] = []
    scalars = {k: v for k, v in metrics.items() if not isinstance(v, Mapping)}
    if scalars:
        out.append(_table(["metric", "value"], [[esc(k), _fmt(v)] for k, v in scalars.items()]))
    for k, v in metrics.items():
        if isinstance(v, Mapping):
            out.append(f"<h3>{esc(k)}</h3>{_metrics_table(v)}")
    return "".join(out)


# --- trajectories -----------------------------------------------------------------------------------------------


def _n_tools(r: dict) -> int:
    return int(r.get("n_zoom") or 0) + int(r.get("n_text_search") or 0) + int(r.get("n_image_search") or 0)


def _plural(n: Any, word: str) -> str:
    return f"{esc(n)} {word}" + ("" if n == 1 else "s")


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


def _card_html(r: dict, images: list, cache: _ImageCache, card_id: str) -> str:
    ok = bool(r["correct"])
    verdict = "correct" if ok else "wrong"
    attrs = " ".join(
        f'data-{k}="{esc(v)}"'
        for k, v in (("benchmark", r["benchmark"]), ("model", r["model"]), ("workflow", r["workflow"]),
                     ("correct", verdict), ("qid", r["question_id"]), ("sample-id", r.get("sample_id") or ""))
    )
    k = r.get("sample_idx")
    head = (
        f'<span class="badge {verdict}">{verdict}</span>'
        f'<span class="bench">{esc(r["benchmark"])}</span>'
        f'<span class="qid">{esc(r["question_id"])}</span>'
        f'<span class="sys">{esc(r["model"])}/{esc(r["workflow"])}</span>'
        + (f'<span class="kv">k={esc(k)}</span>' if k is not None else "")
        + f'<span class="kv">score {_fmt(float(r["score"]))}</span>'
        f'<span class="kv">{_plural(r["turns"], "turn")}</span>'
        f'<span class="kv">{_plural(_n_tools(r), "tool call")}</span>'
    )
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
    meta = "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>" for k, v in meta_items if v not in (None, ""))
    return (
        f'<details class="card" id="{esc(card_id)}" {attrs}><summary>{head}</summary>'
        f'<div class="body"><div class="question"><b>Question</b><div class="text">{esc(r.get("question"))}</div></div>'
        f'<dl class="meta">{meta}</dl>'
        f'<div class="dialogue">{_dialogue_html(r.get("messages_json"), cache, images)}</div></div></details>'
    )


def _options(values: list[str]) -> str:
    return "".join(f'<option value="{esc(v)}">{esc(v)}</option>' for v in values)


# --- page -------------------------------------------------------------------------------------------------------

_CSS = """
:root{--fg:#1d232b;--muted:#6b7480;--bg:#fff;--line:#d9dee5;--ok:#1a7f37;--bad:#c62828;--soft:#f5f7fa}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg);margin:0 auto;max-width:1200px;padding:16px 24px}
h1{font-size:22px;margin:4px 0 12px}h2{font-size:18px;border-bottom:1px solid var(--line);padding-bottom:4px;margin-top:28px}h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;margin:4px 0 12px;font-size:13px}th,td{border:1px solid var(--line);padding:3px 8px;text-align:left;vertical-align:top}
th{background:var(--soft)}.muted,.n{color:var(--muted)}.n{font-size:11px}
.acc{display:inline-block;min-width:52px;padding:0 4px;border-radius:3px;background:rgba(26,127,55,calc(var(--a)*.35))}
#filters{position:sticky;top:0;background:var(--bg);padding:8px 0;border-bottom:1px solid var(--line);z-index:2;display:flex;flex-wrap:wrap;gap:8px;align-items:center}
#filters label{font-size:12px;color:var(--muted)}#filters select,#filters input{font:inherit;padding:2px 4px}
#count{font-weight:600;margin-left:auto}
details.card{border:1px solid var(--line);border-radius:6px;margin:6px 0;background:var(--bg)}
details.card>summary{cursor:pointer;padding:6px 10px;display:flex;flex-wrap:wrap;gap:10px;align-items:center;list-style:none}
details.card>summary::before{content:"\\25B8";color:var(--muted)}details.card[open]>summary::before{content:"\\25BE"}
details.card[open]>summary{border-bottom:1px solid var(--line);background:var(--soft)}
.badge{color:#fff;border-radius:10px;padding:0 8px;font-size:12px;font-weight:600}.badge.correct{background:var(--ok)}.badge.wrong{background:var(--bad)}
.bench{font-weight:600}.qid{font-family:ui-monospace,Menlo,Consolas,monospace}.sys{color:#0b4f8a}.kv{color:var(--muted);font-size:12px}
.body{padding:8px 12px}.meta{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;margin:8px 0}.meta dt{color:var(--muted)}.meta dd{margin:0;white-space:pre-wrap;word-break:break-word}
.text{white-space:pre-wrap;word-break:break-word;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px}
.msg{border-left:4px solid var(--line);margin:8px 0;padding:4px 10px;background:var(--soft);border-radius:0 4px 4px 0}
.msg .role{font-size:11px;text-transform:uppercase;letter-spacing:.04em;color:var(--muted);margin-bottom:2px}
.msg-system{border-left-color:#9aa4b1}.msg-system>summary{cursor:pointer;color:var(--muted);font-size:12px}
.msg-user{border-left-color:#0b63c5}.msg-assistant{border-left-color:#8250df;background:#faf7ff}.msg-tool{border-left-color:#d97706;background:#fffaf0}
.tag{display:block;margin:3px 0;padding:3px 6px;border-radius:3px}.tagname{color:var(--muted);font-size:11px}
.tag-think{background:#f0f0f0;color:#444;font-style:italic}.tag-tool_call{background:#e7f0ff;color:#0b3d91}
.tag-answer{background:#e3f6e8;color:#0f5b27;font-weight:600}.tag-tool_response{background:#fff1dc}
.figs{display:flex;flex-wrap:wrap;gap:8px;margin:4px 0}figure{margin:0}figcaption{font-size:11px;color:var(--muted)}
figure img{max-width:240px;max-height:240px;border:1px solid var(--line);cursor:zoom-in;display:block}
figure img.zoomed{max-width:100%;max-height:none;cursor:zoom-out}
.missing{color:var(--bad);font-size:12px}
"""

# Runs first: record every error of the page where the tests (and a curious reader) can see it.
_JS_HEAD = """
(function(){
  var errs = window.__marsErrors = [];
  function rec(m){ errs.push(String(m)); if (document.body) { document.body.dataset.errors = String(errs.length); } }
  window.addEventListener('error', function(e){
    var t = e.target;
    if (t && t !== window && (t.src || t.href)) { rec('resource failed: ' + String(t.src || t.href).slice(0, 80)); }
    else { rec((e.message || 'error') + ' @' + (e.lineno || '?')); }
  }, true);
  window.addEventListener('unhandledrejection', function(e){ rec('unhandled rejection: ' + e.reason); });
  var ce = console.error;
  console.error = function(){ rec(Array.prototype.join.call(arguments, ' ')); return ce.apply(console, arguments); };
})();
"""

_JS_BODY = """
(function(){
  var body = document.body;
  body.dataset.errors = String(window.__marsErrors.length);
  var cards = Array.prototype.slice.call(document.querySelectorAll('details.card'));
  var keys = ['benchmark', 'model', 'workflow', 'correct'];
  var sel = {};
  keys.forEach(function(k){ sel[k] = document.getElementById('f-' + k); });
  var q = document.getElementById('f-q');
  var count = document.getElementById('count');
  function apply(writeHash){
    var shown = 0, ok = 0, needle = q.value.trim().toLowerCase();
    cards.forEach(function(c){
      var vis = keys.every(function(k){ return !sel[k].value || c.dataset[k] === sel[k].value; })
        && (!needle || c.dataset.qid.toLowerCase().indexOf(needle) >= 0);
      c.hidden = !vis;
      if (vis) { shown++; if (c.dataset.correct === 'correct') ok++; }
    });
    count.textContent = shown + ' of ' + cards.length + ' trajectories shown' +
      (shown ? ' \\u00b7 ' + ok + ' correct (' + (100 * ok / shown).toFixed(1) + '%)' : '');
    body.dataset.visible = String(shown);
    if (writeHash) {
      var p = new URLSearchParams();
      keys.forEach(function(k){ if (sel[k].value) p.set(k, sel[k].value); });
      if (q.value) p.set('q', q.value);
      try { history.replaceState(null, '', '#' + p.toString()); } catch (e) { /* file:// in some browsers */ }
    }
  }
  function fromHash(){
    var p = new URLSearchParams(location.hash.replace(/^#/, ''));
    keys.forEach(function(k){
      var v = p.get(k);
      if (v !== null && Array.prototype.some.call(sel[k].options, function(o){ return o.value === v; })) sel[k].value = v;
    });
    if (p.get('q') !== null) q.value = p.get('q');
  }
  keys.forEach(function(k){ sel[k].addEventListener('change', function(){ apply(true); }); });
  q.addEventListener('input', function(){ apply(true); });
  window.addEventListener('hashchange', function(){ fromHash(); apply(false); });
  document.getElementById('expand').addEventListener('click', function(){ cards.forEach(function(c){ if (!c.hidden) c.open = true; }); });
  document.getElementById('collapse').addEventListener('click', function(){ cards.forEach(function(c){ c.open = false; }); });
  document.addEventListener('click', function(e){
    if (e.target.tagName === 'IMG' && e.target.closest('figure')) e.target.classList.toggle('zoomed');
  });
  fromHash();
  apply(false);
  window.addEventListener('load', function(){
    var imgs = document.images, loaded = 0;
    for (var i = 0; i < imgs.length; i++) {
      if (imgs[i].complete && imgs[i].naturalWidth > 0) { loaded++; imgs[i].dataset.naturalWidth = String(imgs[i].naturalWidth); }
    }
    body.dataset.imagesTotal = String(imgs.length);
    body.dataset.imagesLoaded = String(loaded);
    body.dataset.errors = String(window.__marsErrors.length);
    body.dataset.errorMessages = window.__marsErrors.join(' | ').slice(0, 2000);
    body.dataset.selfcheck = 'done';
  });
})();
"""


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
        cards.append(_card_html(r, images_col[i].as_py() or [], cache, f"t{n}"))

    def uniq(col: str) -> list[str]:
        return sorted({str(r[col]) for r in rows})

    shown_note = (
        f'<p class="muted">Showing {len(picked)} of {len(rows)} trajectories (max_trajectories={max_trajectories},'
        " round-robin over benchmark/model/workflow); the tables above use every row.</p>"
        if len(picked) < len(rows) else ""
    )
    filters = (
        '<div id="filters">'
        f'<label>benchmark <select id="f-benchmark"><option value="">all</option>{_options(uniq("benchmark"))}</select></label>'
        f'<label>model <select id="f-model"><option value="">all</option>{_options(uniq("model"))}</select></label>'
        f'<label>workflow <select id="f-workflow"><option value="">all</option>{_options(uniq("workflow"))}</select></label>'
        '<label>result <select id="f-correct"><option value="">all</option><option value="correct">correct</option>'
        '<option value="wrong">wrong</option></select></label>'
        '<label>question id <input id="f-q" type="search" placeholder="substring" size="18"></label>'
        '<button id="expand" type="button">expand shown</button><button id="collapse" type="button">collapse all</button>'
        f'<span id="count">{len(picked)} of {len(picked)} trajectories shown</span></div>'
    )
    n_q = len({(r["benchmark"], r["question_id"]) for r in rows})
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{_CSS}</style><script>{_JS_HEAD}</script></head>"
        f'<body data-errors="0" data-visible="{len(picked)}"><h1>{esc(title)}</h1>'
        f'<p class="muted">{len(rows)} samples \u00b7 {n_q} questions \u00b7 {len(uniq("benchmark"))} benchmarks \u00b7 '
        f'{len({(r["model"], r["workflow"]) for r in rows})} model/workflow pairs</p>'
        f'<h2 id="results">Results</h2>{_accuracy_tables(rows) if rows else "<p class=muted>no results</p>"}'
        f'<h2 id="metrics">Metrics</h2>{_metrics_html(metrics)}'
        f'<h2 id="trajectories">Trajectories</h2>{shown_note}{filters}'
        f'<div id="cards">{"".join(cards)}</div>'
        f"<script>{_JS_BODY}</script></body></html>\n"
    )


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
