"""Tests of the self-contained HTML report (mars.eval.report and its jinja2 templates in mars/eval/templates/).

Structure tests parse the file with the stdlib html.parser; the browser tests open it in headless Chromium
(``--dump-dom``) and read what the page's self-check wrote into the DOM. They skip when Chromium is absent.

Run: .venv/bin/python -m pytest tests/eval/test_report.py -q
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pyarrow as pa
import pytest
from PIL import Image, ImageDraw

from mars.data.schemas import RESULTS
from mars.eval.report import render_report, write_report

SCRIPT = "<script>alert(1)</script>"
# would flag the page if the prediction's markup were ever parsed as HTML
PAYLOAD = SCRIPT + '<img src=x onerror="document.body.dataset.pwned=1">'
BENCHES = ("vstar", "mars-synth")
MODELS = ("sft", "base")
WORKFLOWS = ("direct", "agentic")
QIDS = ("q1", "q2")
MULTI = "vstar/q1/sft/agentic/0"  # the multi-turn trajectory with a zoom and its crop


def _png(w: int, h: int, colour: tuple[int, int, int]) -> bytes:
    im = Image.new("RGB", (w, h), colour)
    d = ImageDraw.Draw(im)
    for i in range(0, w, 40):
        d.line([(i, 0), (w - i, h)], fill=(255 - colour[0], 80, i % 256), width=3)
    d.rectangle([w // 3, h // 3, w // 2, h // 2], outline=(255, 0, 0), width=5)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _row(bench: str, qid: str, model: str, workflow: str, correct: bool) -> dict:
    question = f"What is written on the emblem in the red frame? ({bench}/{qid})"
    image = _png(800, 600, (30, 120, 200) if qid == "q1" else (200, 160, 40))
    system = {"role": "system", "content": "You are a visual agent. Tools: zoom_in, text_search, image_search."}
    user = {"role": "user", "content": [{"type": "image", "ref": 0}, {"type": "text", "text": question}]}
    sample_id = f"{bench}/{qid}/{model}/{workflow}/0"
    prediction = "Aster Guild" if correct else "Borealis"
    if sample_id == "mars-synth/q2/base/direct/0":
        prediction = PAYLOAD
    images = [image]
    n_zoom = 0
    if workflow == "agentic":
        call = {"name": "zoom_in", "arguments": {"bbox_2d": [300, 300, 600, 600], "label": "emblem"}}
        messages = [
            system,
            user,
            {"role": "assistant", "content": f"<think>The emblem is small; zoom in.</think>\n<tool_call>\n"
                                             f"{json.dumps(call)}\n</tool_call>"},
            {"role": "user", "content": [{"type": "text", "text": "<tool_response>\nZoomed crop of the region.\n"
                                                                  "</tool_response>"}, {"type": "image", "ref": 1}]},
            {"role": "assistant", "content": f"<think>I can read it now.</think>\n<answer>{prediction}</answer>"},
        ]
        images.append(_png(200, 150, (10, 200, 90)))
        n_zoom, turns = 1, 2
    else:
        messages = [system, user, {"role": "assistant", "content": f"<think>Looks like it.</think>\n<answer>{prediction}</answer>"}]
        turns = 1
    return dict(
        sample_id=sample_id, benchmark=bench, question_id=qid, model=model, workflow=workflow, sample_idx=0,
        seed=0, temperature=0.0, question=question, gold=["Aster Guild", "aster"], prediction=prediction,
        correct=correct, score=1.0 if correct else 0.0, judge="rule:exact", category="emblem" if qid == "q1" else "text",
        difficulty=None, type="perception" if qid == "q1" else "search", finish_reason="answer", turns=turns,
        n_zoom=n_zoom, n_text_search=0, n_image_search=0, tool_errors=0, format_errors=0, tokens=42 * turns,
        latency_s=0.5 * turns, messages_json=json.dumps(messages), images=images,
    )


def _correct(bench: str, qid: str, model: str, workflow: str) -> bool:
    return (model == "sft" and (workflow == "agentic" or qid == "q1")) or (bench == "vstar" and qid == "q1")


@pytest.fixture(scope="module")
def results() -> pa.Table:
    rows = [
        _row(b, q, m, w, _correct(b, q, m, w))
        for b in BENCHES for q in QIDS for m in MODELS for w in WORKFLOWS
    ]
    return pa.Table.from_pylist(rows, schema=RESULTS)


METRICS = {
    "vstar": {"sft/agentic": {"accuracy": 1.0, "by_type": {"perception": 1.0}}, "base/direct": {"accuracy": 0.5}},
    "mars-synth": {"sft/agentic": {"accuracy": 1.0, "n": 2}},
    "n_samples": 16,
}


@pytest.fixture(scope="module")
def report(results, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report") / "sub" / "report.html"
    path = write_report(results, METRICS, out, title="MARS test report")
    assert path == out
    return out


class _Parser(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.cards: list[dict] = []
        self._card_stack: list[dict] = []  # the open <details class=card>, to attribute images to cards
        self._depth = 0
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "script":
            self._in_script = True
            self.scripts.append("")
        if tag == "details":
            self._depth += 1
            if "card" in (a.get("class") or "").split():
                card = dict(a, _imgs=[], _depth=self._depth)
                self.cards.append(card)
                self._card_stack.append(card)
        if tag == "img" and self._card_stack:
            self._card_stack[-1]["_imgs"].append(a)

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False
        if tag == "details":
            if self._card_stack and self._card_stack[-1]["_depth"] == self._depth:
                self._card_stack.pop()
            self._depth -= 1

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data
        else:
            self.text.append(data)


def _parse(text: str) -> _Parser:
    p = _Parser()
    p.feed(text)
    p.close()
    return p


# --- structure ------------------------------------------------------------------------------------------------


def test_self_contained_and_images_inline(report, results):
    text = report.read_text(encoding="utf-8")
    p = _parse(text)
    for tag, attrs in p.tags:
        for key in ("src", "href", "action", "poster", "srcset"):
            v = (attrs.get(key) or "").strip().lower()
            assert not v.startswith(("http://", "https://", "//")), f"external {key} on <{tag}>: {v[:80]}"
        if tag in ("link", "iframe", "object", "embed"):
            raise AssertionError(f"unexpected <{tag}> in a self-contained report")
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", text), "external url() in CSS"
    assert "@import" not in text
    imgs = [a for t, a in p.tags if t == "img"]
    expected = sum(len(x) for x in results.column("images").to_pylist())
    assert len(imgs) == expected
    for a in imgs:
        assert a["src"].startswith(("data:image/png;base64,", "data:image/jpeg;base64,")), a["src"][:40]
        im = Image.open(io.BytesIO(base64.b64decode(a["src"].split(",", 1)[1])))
        im.load()
        assert max(im.size) <= 512
    assert len({a["src"] for a in imgs}) == 3  # two question images and one crop, each encoded once


def test_one_card_per_row_with_header(report, results):
    p = _parse(report.read_text(encoding="utf-8"))
    assert len(p.cards) == results.num_rows
    ids = {c["data-sample-id"] for c in p.cards}
    assert ids == set(results.column("sample_id").to_pylist())
    multi = next(c for c in p.cards if c["data-sample-id"] == MULTI)
    assert (multi["data-benchmark"], multi["data-model"], multi["data-workflow"], multi["data-correct"]) == (
        "vstar", "sft", "agentic", "correct")
    assert len(multi["_imgs"]) == 2  # question image and the zoom crop
    text = report.read_text(encoding="utf-8")
    for needle in ('class="tag tag-tool_call"', 'class="tag tag-think"', 'class="tag tag-answer"',
                   'class="msg msg-tool"', 'class="msg msg-system"', "1 tool call<", "2 turns", "0 tool calls", "1 turn<"):
        assert needle in text, needle
    # the tool call JSON is pretty-printed (and escaped: jinja2 writes a double quote as &#34;)
    assert re.search(r"\{&(quot|#34);name&(quot|#34);: &(quot|#34);zoom_in&(quot|#34);, &(quot|#34);arguments", text)
    assert '{"name": "zoom_in", "arguments": {"bbox_2d": [300, 300, 600, 600], "label": "emblem"}}' in "".join(_parse(text).text)


def test_script_in_model_output_is_escaped(report):
    text = report.read_text(encoding="utf-8")
    p = _parse(text)
    assert len(p.scripts) == 2  # only the report's own two scripts
    assert all("alert(1)" not in s and "pwned" not in s for s in p.scripts)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert SCRIPT not in text
    assert not any(t == "img" and a.get("src") == "x" for t, a in p.tags)
    assert any(SCRIPT in chunk for chunk in p.text)  # what a reader sees is the literal text


def test_results_tables_and_metrics(report, results):
    text = report.read_text(encoding="utf-8")
    p = _parse(text)
    visible = " ".join(p.text)
    for heading in ("Accuracy by benchmark", "Accuracy by type", "Accuracy by category", "Tool use and cost"):
        assert heading in visible
    assert "Accuracy by difficulty" not in visible  # all null
    for s in ("sft/agentic", "sft/direct", "base/agentic", "base/direct"):
        assert s in visible
    # vstar x base/agentic: q1 correct, q2 wrong -> 50%; sft/agentic is always correct
    rows = [r for r in results.to_pylist() if r["benchmark"] == "vstar" and r["model"] == "base"
            and r["workflow"] == "agentic"]
    assert sum(r["correct"] for r in rows) / len(rows) == 0.5
    assert "50.0%" in visible and "100.0%" in visible
    # the nested metrics dict is rendered with flattened columns
    assert "by_type.perception" in visible and "n_samples" in visible


def test_max_trajectories_round_robin(results, tmp_path):
    out = write_report(results, {}, tmp_path / "r.html", max_trajectories=4)
    p = _parse(out.read_text(encoding="utf-8"))
    assert len(p.cards) == 4
    groups = {(c["data-benchmark"], c["data-model"], c["data-workflow"]) for c in p.cards}
    assert len(groups) == 4
    assert "Showing 4 of 16 trajectories" in out.read_text(encoding="utf-8")


def test_atomic_overwrite_and_no_temp_left(results, tmp_path):
    out = tmp_path / "report.html"
    out.write_text("old")
    write_report(results.slice(0, 2), None, out)
    assert out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert [f.name for f in tmp_path.iterdir()] == ["report.html"]


def test_failure_leaves_previous_file(results, tmp_path):
    out = tmp_path / "report.html"
    out.write_text("old")
    with pytest.raises(ValueError, match="lacks columns"):
        write_report(results.drop_columns(["messages_json"]), {}, out)
    assert out.read_text() == "old"


def test_bad_messages_and_images_do_not_break(results):
    row = results.slice(0, 1).to_pylist()[0]
    bad = [
        dict(row, sample_id="a", messages_json="{not json"),
        dict(row, sample_id="b", images=[b"not an image"]),
        dict(row, sample_id="c", messages_json=json.dumps([{"role": "user", "content": [{"type": "image", "ref": 7}]}])),
    ]
    page = render_report(pa.Table.from_pylist(bad, schema=RESULTS), {})
    assert "messages_json is not a JSON list" in page
    assert "undecodable image" in page
    assert "image ref 7 missing" in page
    assert len(_parse(page).cards) == 3


# --- templates, escaping and numbers on small hand-built inputs -------------------------------------------------


def _small_row(bench: str, qid: str, model: str, workflow: str, correct: bool, **kw) -> dict:
    """A RESULTS row without images; ``kw`` overrides any field."""
    row = dict(
        sample_id=f"{bench}/{qid}/{model}/{workflow}/0", benchmark=bench, question_id=qid, model=model,
        workflow=workflow, sample_idx=0, seed=0, temperature=0.0, question=f"question {qid}", gold=["yes"],
        prediction="yes" if correct else "no", correct=correct, score=1.0 if correct else 0.0, judge="rule:exact",
        category=None, difficulty=None, type=None, finish_reason="answer", turns=1, n_zoom=0, n_text_search=0,
        n_image_search=0, tool_errors=0, format_errors=0, tokens=10, latency_s=0.5,
        messages_json=json.dumps([{"role": "assistant", "content": "<answer>yes</answer>"}]), images=[],
    )
    row.update(kw)
    return row


class _Tables(HTMLParser):
    """Every <table> of a page as ``(heading, rows of cell texts)``, the heading being the last <h2>/<h3> before it."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables: list[tuple[str, list[list[str]]]] = []
        self._heading: str | None = None
        self._last_heading = ""
        self._cell: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag in ("h2", "h3"):
            self._heading = ""
        elif tag == "table":
            self.tables.append((self._last_heading, []))
        elif tag == "tr":
            self.tables[-1][1].append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("h2", "h3") and self._heading is not None:
            self._last_heading, self._heading = self._heading.strip(), None
        elif tag in ("td", "th") and self._cell is not None:
            self.tables[-1][1][-1].append(" ".join(self._cell.split()))
            self._cell = None

    def handle_data(self, data):
        if self._heading is not None:
            self._heading += data
        if self._cell is not None:
            self._cell += data


def _tables(page: str) -> dict[str, list[list[str]]]:
    p = _Tables()
    p.feed(page)
    p.close()
    return dict(p.tables)


def test_untrusted_text_is_escaped_everywhere():
    evil = "<script>alert(1)</script> & <b>bold</b> \"dq\" 'sq'"
    rows = [
        _small_row("bench<i>", 'q"><script>alert(2)</script>', "m&m", "agentic", False, prediction=evil,
                   question=evil, gold=[evil], judge=evil,
                   messages_json=json.dumps([{"role": "user", "content": evil},
                                             {"role": "assistant", "content": f"<think>{evil}</think><answer>{evil}</answer>"}])),
    ]
    page = render_report(pa.Table.from_pylist(rows, schema=RESULTS), {evil: {evil: 1.0}}, title=evil)
    p = _parse(page)
    assert len(p.scripts) == 2 and all("alert(" not in s for s in p.scripts)  # only the report's own scripts
    tags = [t for t, _ in p.tags]
    assert tags.count("b") == 1 and "i" not in tags  # only the report's own <b>Question</b>: no markup from the data
    assert "<script>alert" not in page and "<b>bold" not in page
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;"
    # title, h1, question, gold, prediction, judge, user message, think, answer, metrics heading and table cell
    assert page.count(escaped) == 11
    visible = "".join(p.text)
    assert visible.count(evil) == 11  # what a reader sees is the literal text, quotes included
    card = p.cards[0]
    assert (card["data-benchmark"], card["data-model"], card["data-qid"]) == (
        "bench<i>", "m&m", 'q"><script>alert(2)</script>')
    options = {a.get("value") for t, a in p.tags if t == "option"}
    assert {"bench<i>", "m&m"} <= options


def test_numbers_of_a_small_report():
    rows = [
        _small_row("A", "q1", "m", "agentic", True, turns=1, n_zoom=1, tokens=100, latency_s=0.5,
                   type="perception", score=1.0),
        _small_row("A", "q2", "m", "agentic", False, turns=2, n_text_search=2, tokens=200, latency_s=1.25,
                   type="search", score=1 / 3),
        _small_row("A", "q3", "m", "agentic", True, turns=3, n_zoom=1, n_image_search=1, tokens=300, latency_s=2.0,
                   type="perception", tool_errors=1),
        _small_row("B", "q1", "m", "agentic", True, turns=4, tokens=None, latency_s=None),
        _small_row("A", "q1", "m", "direct", False, tokens=50, latency_s=0.1, type="perception"),
    ]
    metrics = {"n_samples": 5, "tiny": 1.5e-5, "big": 123456.0,
               "A": {"m/agentic": {"accuracy": 2 / 3, "by_type": {"perception": 1.0}}, "m/direct": {"accuracy": 0.0}}}
    page = render_report(pa.Table.from_pylist(rows, schema=RESULTS), metrics, title="small")
    visible = " ".join(" ".join(_parse(page).text).split())
    assert "5 samples \u00b7 4 questions \u00b7 2 benchmarks \u00b7 2 model/workflow pairs" in visible
    t = _tables(page)
    assert t["Accuracy by benchmark"] == [
        ["benchmark", "m/agentic", "m/direct"],
        ["A", "66.7% n=3", "0.0% n=1"],
        ["B", "100.0% n=1", "\u2013"],
        ["all", "75.0% n=4", "0.0% n=1"],
    ]
    assert 'style="--a:0.667"' in page and 'style="--a:0.750"' in page
    assert t["Accuracy by type"] == [
        ["benchmark", "type", "m/agentic", "m/direct"],
        ["A", "perception", "100.0% n=2", "0.0% n=1"],
        ["A", "search", "0.0% n=1", "\u2013"],
        ["B", "(none)", "100.0% n=1", "\u2013"],
    ]
    assert "Accuracy by category" not in t and "Accuracy by difficulty" not in t
    # means per sample; tokens and latency over the rows that have them
    assert t["Tool use and cost (mean per sample)"] == [
        ["model/workflow", "samples", "turns", "tool calls", "zoom", "text search", "image search", "tool errors",
         "format errors", "tokens", "latency s"],
        ["m/agentic", "4", "2.5", "1.25", "0.5", "0.5", "0.25", "0.25", "0", "200", "1.25"],
        ["m/direct", "1", "1", "0", "0", "0", "0", "0", "0", "50", "0.1"],
    ]
    assert t["Metrics"] == [["metric", "value"], ["n_samples", "5"], ["tiny", "1.5e-05"], ["big", "1.235e+05"]]
    assert t["A"] == [["", "accuracy", "by_type.perception"], ["m/agentic", "0.6667", "1"], ["m/direct", "0", ""]]
    p = _parse(page)
    assert len(p.cards) == 5 and p.tags[[t for t, _ in p.tags].index("body")][1]["data-visible"] == "5"
    assert "5 of 5 trajectories shown" in visible
    q2 = next(c for c in p.cards if c["data-sample-id"] == "A/q2/m/agentic/0")
    assert q2["data-correct"] == "wrong"
    assert "score 0.3333" in visible and "2 turns" in visible and "2 tool calls" in visible
    assert "zoom 0, text search 2, image search 0; tool errors 0, format errors 0" in visible
    assert "200 tokens, 1.25 s" in visible and "None tokens, s" in visible


def test_templates_come_from_the_package(tmp_path):
    import jinja2

    import mars.eval
    from mars.eval import report

    env = report._environment()
    assert isinstance(env.loader, jinja2.PackageLoader)
    templates = Path(mars.eval.__file__).parent / "templates"
    names = {"report.html.j2", "report.css", "report.js", "selfcheck.js"}
    assert names <= set(env.loader.list_templates())
    for name in names:
        _, filename, _ = env.loader.get_source(env, name)
        assert Path(filename) == templates / name
    assert env.autoescape(report.TEMPLATE) and env.from_string("{{ x }}").render(x="<&>") == "&lt;&amp;&gt;"
    # the CSS and both scripts are inlined verbatim (no jinja2 syntax in them is interpreted)
    page = render_report(pa.Table.from_pylist([_small_row("A", "q1", "m", "w", True)], schema=RESULTS), None)
    p = _parse(page)
    style = page.split("<style>", 1)[1].split("</style>", 1)[0]
    assert style.strip() == (templates / "report.css").read_text(encoding="utf-8").strip()
    assert [s.strip() for s in p.scripts] == [
        (templates / f).read_text(encoding="utf-8").strip() for f in ("selfcheck.js", "report.js")]
    # a copy of the package elsewhere on the path (as a wheel installs it) renders from its own templates
    site = tmp_path / "site"
    shutil.copytree(Path(mars.__file__).parent, site / "mars", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import pyarrow as pa, mars.eval.report as r\n"
        "from mars.data.schemas import RESULTS\n"
        "env = r._environment()\n"
        "print(env.loader.get_source(env, r.TEMPLATE)[1])\n"
        "print(r.render_report(pa.Table.from_pylist([], schema=RESULTS), None)[:15])\n"
    )
    env_vars = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env_vars, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [str(site / "mars" / "eval" / "templates" / report.TEMPLATE), "<!DOCTYPE html>"]


# --- headless Chromium ------------------------------------------------------------------------------------------


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        pytest.skip("no Chromium installed: apt-get install chromium (CI installs it in .ci/run)")
    return exe


def _dump_dom(exe: str, url: str) -> tuple[str, str]:
    """Load ``url`` in headless Chromium; return (serialized DOM after load, Chromium's stderr)."""
    with tempfile.TemporaryDirectory(prefix="mars-chromium-") as profile:
        args = [
            exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
            "--no-first-run", "--no-default-browser-check", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--disable-extensions", "--mute-audio",
            f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000",
            "--dump-dom", url,
        ]
        env = dict(os.environ, HOME=profile)  # keep Chromium's crash/config files out of the real home
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env)
        except subprocess.TimeoutExpired as exc:
            tail = (exc.stderr or b"")[-2000:]
            tail = tail.decode("utf-8", "replace") if isinstance(tail, bytes) else tail
            raise AssertionError(
                "Chromium did not finish within 60 s (an alert() dialog, e.g. from unescaped model output, blocks "
                f"headless Chromium):\n{tail}"
            ) from None
    assert proc.returncode == 0, f"Chromium failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    assert "<body" in proc.stdout, f"no DOM dumped:\n{proc.stderr[-3000:]}"
    return proc.stdout, proc.stderr


def _body_attrs(dom: str) -> dict:
    return next(a for t, a in _parse(dom).tags if t == "body")


def _page_errors(stderr: str) -> list[str]:
    """Console messages / uncaught exceptions Chromium logged for the page.

    Chromium logs every console call of a page as ``...:INFO:CONSOLE:<line>] "<message>", source: file://...``
    whatever its level, so any CONSOLE line from the report counts: the report never writes to the console.
    """
    return [
        line for line in stderr.splitlines()
        if "Uncaught" in line or (":CONSOLE" in line and "file://" in line)
    ]


@pytest.fixture(scope="module")
def chromium() -> str:
    return _chromium()


def test_chromium_loads_without_errors_and_renders_images(chromium, report, results):
    dom, stderr = _dump_dom(chromium, report.as_uri())
    body = _body_attrs(dom)
    assert body.get("data-selfcheck") == "done", f"the page's load handler did not run: {body}"
    assert body.get("data-errors") == "0", body.get("data-error-messages")
    assert not _page_errors(stderr), _page_errors(stderr)
    n_imgs = sum(len(x) for x in results.column("images").to_pylist())
    assert body.get("data-images-total") == str(n_imgs)
    assert body.get("data-images-loaded") == str(n_imgs)
    p = _parse(dom)
    multi = next(c for c in p.cards if c["data-sample-id"] == MULTI)
    widths = [int(a.get("data-natural-width", "0")) for a in multi["_imgs"]]
    assert len(widths) == 2 and all(w > 0 for w in widths), widths
    assert sorted(widths) == [200, 512]  # the crop as is, the 800x600 question image downscaled
    # the untrusted prediction was shown as text, never executed
    assert "data-pwned" not in dom
    assert body.get("data-visible") == str(results.num_rows)


def test_chromium_filters_from_url_hash(chromium, report, results):
    rows = results.select(["model", "correct", "question_id"]).to_pylist()
    for frag, expect in (
        ("model=sft&correct=wrong", sum(r["model"] == "sft" and not r["correct"] for r in rows)),
        ("model=base&correct=correct", sum(r["model"] == "base" and r["correct"] for r in rows)),
        ("q=Q2", sum(r["question_id"] == "q2" for r in rows)),
        ("benchmark=vstar&workflow=agentic&model=nonexistent", 4),  # unknown values are ignored
    ):
        dom, stderr = _dump_dom(chromium, report.as_uri() + "#" + frag)
        body = _body_attrs(dom)
        assert body.get("data-errors") == "0", body.get("data-error-messages")
        assert not _page_errors(stderr)
        assert body.get("data-visible") == str(expect), frag
        shown = [c for c in _parse(dom).cards if "hidden" not in c]
        assert len(shown) == expect, frag
        assert f"{expect} of {results.num_rows} trajectories shown" in dom
