"""Hostile input to both servers, each in its own process on 127.0.0.1: `mars serve` and `mars serve-tools`.

Several hundred malformed requests, generated deterministically (a seeded RNG combining hand-written bad values):
bad JSON, wrong types for every field, missing fields, huge strings, decompression bombs (a PNG declaring
50000x50000 pixels in about a kilobyte, a complete 8000x8000 PNG in 8 KB, a JPEG declaring 60000x60000), data URLs
of 24 MB and 50 MB, non-data URLs (``http://``, ``file:///etc/passwd``), negative or enormous sizes, max_tokens,
boxes, wrong tool names and arguments. Asserted: every malformed request gets a 4xx with the JSON error body
(the tool service answers a bad TOOL CALL, what a policy writes, with HTTP 200 and an error observation, as the
in-process ToolBox does); no 5xx; the server process is alive and answers a valid request afterwards; its RSS grew
by less than 300 MB.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import io
import itertools
import json
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from urllib.parse import quote

import httpx
import psutil
import pyarrow as pa
import pytest
from PIL import Image

from mars.model.build import save_checkpoint
from tests.conftest import sub_env
from tests.model.test_hf_backend import tiny_stack
from tests.serve.test_openai_server import start_mars_serve, wait_serving
from tests.tools.test_service import free_port

SEED = 20240611
N_CHAT, N_TOOLS = 200, 150  # seeded random combinations, on top of every listed bad value once
MAX_RSS_GROWTH = 300 * 2**20


# --------------------------------------------------------------------------- payloads


def png(size=(64, 48), color=(200, 30, 30), fmt="PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int, height: int, rows: int) -> bytes:
    """A 1-bit grayscale PNG declaring ``width`` x ``height`` with ``rows`` rows of zeros (all: a complete image)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    idat = zlib.compress(b"\x00" * ((1 + (width + 7) // 8) * rows), 9)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def jpeg_declaring(width: int, height: int) -> bytes:
    """An 8x8 JPEG whose frame header is patched to declare ``width`` x ``height``."""
    data = bytearray(png((8, 8), fmt="JPEG"))
    i = data.index(b"\xff\xc0")
    data[i + 5 : i + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def url_of(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


GOOD_PNG = png()
BAD_IMAGES = {  # base64 payloads a server must refuse (name -> payload)
    "bomb_50000x50000": b64(png_bomb(50_000, 50_000, rows=200)),
    "bomb_8000x8000_complete": b64(png_bomb(8000, 8000, rows=8000)),
    "bomb_4100x4100_complete": b64(png_bomb(4100, 4100, rows=4100)),
    "jpeg_declaring_60000x60000": b64(jpeg_declaring(60_000, 60_000)),
    "jpeg_declaring_5000x5000": b64(jpeg_declaring(5000, 5000)),
    "truncated_png": b64(png((300, 300), (1, 2, 3))[:60]),
    "tiff_not_allowed": b64(png(fmt="TIFF")),
    "eps_not_allowed": b64(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"),
    "svg": b64(b"<svg xmlns='http://www.w3.org/2000/svg' width='10' height='10'/>"),
    "random_bytes": b64(random.Random(SEED).randbytes(2000)),
    "empty": "",
    "not_base64": "@@@not base64@@@",
    "non_ascii": "\u00ff\u00fe" * 10,
    "whitespace": b64(GOOD_PNG)[:40] + "\n" + b64(GOOD_PNG)[40:],
}
for name, payload in BAD_IMAGES.items():
    assert len(payload) < 20_000, (name, len(payload))  # every bomb is small on the wire

BAD_JSON_BODIES = [
    b"", b" ", b"{", b"}", b"[", b'{"messages": [', b"null", b"true", b"1", b"-1e999", b'"messages"', b"[]", b"[{}]",
    b"NaN", b"{'messages': []}", b'{"messages": [],}', b'{"messages": []} trailing', b"\xff\xfe\x00\x01garbage",
    b"\x00" * 64, b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"messages": "' + b"\\ud800" * 10 + b'"}', b"{" + b'"k": 1, ' * 20_000 + b'"messages": 5}',
]

# --------------------------------------------------------------------------- `mars serve` requests

CHAT_BAD_FIELDS = {  # top-level field -> values each of which makes a request malformed
    "model": [1, 1.5, True, [], {}, ["tiny"]],
    "messages": [None, "hi", 1, {}, [], [1], ["hi"], [None], [[]], True],
    "max_tokens": [0, -1, -(10**9), 10**9, 10**30, 1.5, "2", True, [], {}],
    "max_completion_tokens": [0, -7, 10**6, 2.0, "3", False, [1]],
    "temperature": [-0.1, -1e308, 2.5, 1e308, float("nan"), float("inf"), -float("inf"), "0", True, [], {}],
    "top_p": [0, -0.5, 1.5, float("nan"), "1", True, [0.5]],
    "seed": [-(2**63) - 1, 2**64, 10**40, 1.5, "3", True, [1]],
    "stop": ["", [""], ["x"] * 17, "x" * 257, [1], [None], 1, {}, [["a"]], True],
    "logprobs": ["yes", 1, 0, [], {}, "true"],
    "top_logprobs": [5, -1, 21, "1", 1.5],
    "n": [2, 0, -1, 10**6, "1", 1.5],
    "stream": ["yes", 1, [], {}],
    "stream_options": ["x", 1, [], {"include_usage": "yes"}],
    "return_tokens_as_token_ids": ["x", 2, []],
}

MESSAGE_BAD = [  # replacements for messages[0]
    {"content": "hi"}, {"role": None, "content": "hi"}, {"role": "wizard", "content": "hi"},
    {"role": 1, "content": "x"},
    {"role": [], "content": "x"}, {"role": "", "content": "x"}, {"role": "USER", "content": "x"},
    {"role": "u" * 10_000, "content": "x"}, {"role": "user", "content": 1}, {"role": "user", "content": 1.5},
    {"role": "user", "content": True}, {"role": "user", "content": {"type": "text", "text": "x"}},
    {"role": "user", "content": [1]}, {"role": "user", "content": ["hi"]}, {"role": "user", "content": [None]},
    {"role": "user", "content": [{"type": "audio"}]}, {"role": "user", "content": [{"type": None}]},
    {"role": "user", "content": [{}]}, {"role": "user", "content": [{"type": "text"}]},
    {"role": "user", "content": [{"type": "text", "text": 1}]},
    {"role": "user", "content": [{"type": "text", "text": None}]},
    {"role": "user", "content": [{"type": "text", "text": ["a"]}]},
    {"role": "user", "content": [{"type": "image_url"}]},
    {"role": "user", "content": [{"type": "image_url", "image_url": 1}]},
    {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": 1}}]},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": None}}]},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": [url_of(GOOD_PNG)]}}]},
    {"role": "user", "content": "x" * (16 * 8192 + 1)},  # more text than the context can take: refused untokenised
    {"role": "user", "content": "hello " * 20_000},  # tokenised: far more tokens than the context
    "not an object", 7, None, [],
]

BAD_URLS = [
    "http://127.0.0.1:1/x.png", "https://example.com/a.png", "file:///etc/passwd", "ftp://x/y", "/etc/passwd",
    "", "data:", "data:,", "data:image/png;base64,", "data:image/png,rawdata", "data:text/plain;base64,aGVsbG8=",
    "data:application/octet-stream;base64," + b64(GOOD_PNG), "data:image/png;base64",
    *(f"data:image/png;base64,{payload}" for payload in BAD_IMAGES.values()),
]


def valid_chat() -> dict:
    return {"model": "tiny", "max_tokens": 2, "temperature": 0.0, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url_of(GOOD_PNG)}},
                                     {"type": "text", "text": "what year?"}]}]}


def image_request(url: str, rng: random.Random) -> dict:
    body = valid_chat()
    part = {"type": "image_url", "image_url": {"url": url}} if rng.random() < 0.8 else {"type": "image_url",
                                                                                         "image_url": url}
    body["messages"][0]["content"].insert(rng.randrange(2), part)
    if rng.random() < 0.3:
        body["messages"].insert(0, {"role": "system", "content": "be brief"})
    return body


def chat_cases(n_random: int) -> list[tuple[str, bytes, set[int]]]:
    """(label, raw body, accepted statuses) for POST /v1/chat/completions: every listed bad value once, then
    ``n_random`` seeded combinations of 1-3 of them."""
    rng = random.Random(SEED)
    cases = [(f"json {raw[:20]!r}", raw, {400}) for raw in BAD_JSON_BODIES]
    cases += [(f"{f}={v!r:.40}", json.dumps({**valid_chat(), f: v}).encode(), {400})
              for f, vs in CHAT_BAD_FIELDS.items() for v in vs]
    cases += [(f"message {m!r:.40}", json.dumps({**valid_chat(), "messages": [m]}).encode(), {400})
              for m in MESSAGE_BAD]
    cases += [(f"url {u:.50}", json.dumps(image_request(u, rng)).encode(), {400}) for u in BAD_URLS]
    for field in ("messages",):
        body = valid_chat()
        del body[field]
        cases.append((f"missing {field}", json.dumps(body).encode(), {400}))
    cases.append(("3000 messages", json.dumps({**valid_chat(), "messages": [{"role": "user", "content": "hi"}] * 3000}
                                              ).encode(), {400}))
    five = [{"type": "image_url", "image_url": url_of(png_bomb(4096, 4096, rows=1))}] * 5
    cases.append(("5 images declaring 4096x4096 each",
                  json.dumps({**valid_chat(), "messages": [{"role": "user", "content": five}]}).encode(), {400}))
    for i in range(n_random):
        body = valid_chat()
        for _ in range(rng.randint(1, 3)):
            kind = rng.random()
            if kind < 0.5:
                field = rng.choice(sorted(CHAT_BAD_FIELDS))
                body[field] = rng.choice(CHAT_BAD_FIELDS[field])
            elif kind < 0.75:
                body["messages"] = [copy.deepcopy(rng.choice(MESSAGE_BAD[:-6] + MESSAGE_BAD[-4:]))] + (
                    body["messages"] if isinstance(body.get("messages"), list) else [])
            else:
                body = {**image_request(rng.choice(BAD_URLS), rng),
                        **{k: v for k, v in body.items() if k != "messages"}}
        cases.append((f"random {i}", json.dumps(body).encode(), {400}))
    return cases


def big_chat_cases():
    """The two huge requests (built when sent): a data URL over the image limit, a body over the body limit."""
    yield "data URL of 24 MB", json.dumps(image_request("data:image/png;base64," + "A" * 24_000_000,
                                                        random.Random(SEED))).encode(), {400}
    yield "data URL of 50 MB", json.dumps(image_request("data:image/png;base64," + "A" * 50_000_000,
                                                        random.Random(SEED))).encode(), {413}


# --------------------------------------------------------------------------- `mars serve-tools` requests

TOOL_ARG_BAD = {  # tool -> arguments the ToolBox answers with an error observation
    "text_search": [None, 1, "x", "[]", "{bad json", [], {}, {"query": 1}, {"query": None}, {"query": []},
                    {"query": ""}, {"query": "   "}, {"query": "x" * 100_000}, {"query": True},
                    {"query": "ok", "extra": 1}, {"q": "observatory"}, '{"query": 5}', "[" * 50_000 + "]" * 50_000],
    "image_zoom_in": [
        {"bbox_2d": [0, 0, 0, 0], "label": "a", "img_idx": 0},
        {"bbox_2d": [-5, -5, 10, 10], "label": "a", "img_idx": 0},
        {"bbox_2d": [0, 0, 1e308, 1e308], "label": "a", "img_idx": 0},
        {"bbox_2d": [0, 0, 10**30, 10**30], "label": "a", "img_idx": 0},
        {"bbox_2d": [0, 0, float("nan"), 5], "label": "a", "img_idx": 0},
        {"bbox_2d": [1, 2, 3], "label": "a", "img_idx": 0}, {"bbox_2d": [1, 2, 3, 4, 5], "label": "a", "img_idx": 0},
        {"bbox_2d": ["a", 0, 1, 1], "label": "a", "img_idx": 0}, {"bbox_2d": None, "label": "a", "img_idx": 0},
        {"bbox_2d": "0,0,1,1", "label": "a", "img_idx": 0},
        {"bbox_2d": [600, 100, 100, 700], "label": "a", "img_idx": 0},
        {"bbox_2d": [0, 0, 1001, 500], "label": "a", "img_idx": 0},
        {"bbox_2d": [0, 0, 500, 500], "label": 1, "img_idx": 0},
        {"bbox_2d": [0, 0, 500, 500], "label": "x" * 100_000, "img_idx": 0},
        {"bbox_2d": [0, 0, 500, 500], "label": "a", "img_idx": -1},
        {"bbox_2d": [0, 0, 500, 500], "label": "a", "img_idx": 5},
        {"bbox_2d": [0, 0, 500, 500], "label": "a", "img_idx": "0"},
        {"bbox_2d": [0, 0, 500, 500], "label": "a", "img_idx": 1.5},
        {"bbox_2d": [0, 0, 500, 500], "label": "a", "img_idx": True},
        {"bbox_2d": [0, 0, 500, 500], "label": "a"}, {}, [], "zoom",
    ],
    "image_search": [{"img_idx": -1}, {"img_idx": 9}, {"img_idx": "0"}, {"img_idx": None}, {"img_idx": 2**70},
                     {}, {"img_idx": 0, "extra": 1}, 0, "x"],
}

TOOL_NAMES_BAD = ["no_such_tool", "TEXT_SEARCH", " text_search", "text_search ", "..", "%00", "\u00e9\u00e8",
                  "x" * 2000, "image_zoom_in;rm -rf /", "../../etc/passwd", "<script>", "null", "0"]


def valid_tool_body(tool: str) -> dict:
    if tool == "text_search":
        return {"arguments": {"query": "observatory"}, "images": {}, "n_images": 0}
    args = {"img_idx": 0} if tool == "image_search" else {"bbox_2d": [0, 0, 500, 500], "label": "a", "img_idx": 0}
    return {"arguments": args, "images": {"0": b64(GOOD_PNG)}, "n_images": 1}


ENVELOPE_BAD = {  # field -> values that make the request itself malformed (HTTP 4xx)
    "images": [1, "x", True, [1], [None], [[]], {"a": "x"}, {"0": 1}, {"0": None}, {"-1": b64(GOOD_PNG)},
               {"5": b64(GOOD_PNG)}, [b64(GOOD_PNG)] * 3, *({"0": p} for p in BAD_IMAGES.values())],
    "n_images": [-1, "1", 1.5, True, [], {}, 10**12, 65, 10**30],
}


def tool_cases(n_random: int) -> list[tuple[str, str, bytes, set[int]]]:
    """(label, tool name, raw body, accepted statuses) for POST /v1/tools/{name}; 200 means an error observation."""
    rng = random.Random(SEED + 1)
    tools = sorted(TOOL_ARG_BAD)
    cases = [(f"json {raw[:20]!r}", rng.choice(tools), raw, {400}) for raw in BAD_JSON_BODIES]
    for field, values in ENVELOPE_BAD.items():
        cases += [(f"{field}={v!r:.40}", t, json.dumps({**valid_tool_body(t), field: v}).encode(), {400})
                  for v in values for t in ("image_zoom_in",)]
    cases.append(("img_idx names an image not sent", "image_search",
                  json.dumps({"arguments": {"img_idx": 1}, "images": {"0": b64(GOOD_PNG)}, "n_images": 2}).encode(),
                  {400}))
    cases.append(("images declare 5 x 4096x4096", "image_search", json.dumps({
        "arguments": {"img_idx": 0}, "images": [b64(png_bomb(4096, 4096, rows=1))] * 5}).encode(), {400}))
    cases += [(f"args {a!r:.40}", t, json.dumps({**valid_tool_body(t), "arguments": a}).encode(), {200})
              for t in tools for a in TOOL_ARG_BAD[t]]
    cases += [(f"tool {name!r:.40}", name, json.dumps(valid_tool_body(rng.choice(tools))).encode(), {200, 404})
              for name in TOOL_NAMES_BAD]  # 404: a name with "/" or ".." is no route
    for i in range(n_random):
        tool = rng.choice(tools)
        body = valid_tool_body(tool)
        if rng.random() < 0.5:  # the request is malformed
            field = rng.choice(sorted(ENVELOPE_BAD))
            body[field] = rng.choice(ENVELOPE_BAD[field])
            expect = {400}
        else:  # the request is fine, the tool call is not
            body["arguments"] = rng.choice(TOOL_ARG_BAD[tool])
            expect = {200}
            if rng.random() < 0.3:
                tool = rng.choice(TOOL_NAMES_BAD)
                expect = {200, 404}
        cases.append((f"random {i}", tool, json.dumps(body).encode(), expect))
    return cases


def big_tool_cases():
    yield "image of 12 MB", "image_zoom_in", json.dumps({**valid_tool_body("image_zoom_in"),
                                                         "images": {"0": "A" * 12_000_000}}).encode(), {400}
    yield "body of 50 MB", "text_search", json.dumps({**valid_tool_body("text_search"),
                                                      "arguments": {"query": "q" * 50_000_000}}).encode(), {413}


# --------------------------------------------------------------------------- servers


def tiny_tool_dirs(root: Path) -> tuple[Path, Path]:
    """A three-document corpus and a three-image gallery, indexed as the index stage saves them."""
    from mars.tools.embedders import load_embedder
    from mars.tools.image_index import ImageIndex
    from mars.tools.text_index import TextIndex

    gallery = root / "gallery"
    gallery.mkdir(parents=True)
    colors = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
    for i, c in enumerate(colors):
        Image.new("RGB", (64, 64), c).save(gallery / f"g{i}.png")
    corpus = pa.table({"doc_id": ["d0", "d1", "d2"], "entity_id": ["e0", "e1", "e2"],
                       "title": ["Observatory", "Guild", "Press"],
                       "text": ["The observatory was founded in 1901.", "The guild meets in the red hall.",
                                "The press printed maps."]})
    table = pa.table({"gallery_id": ["g0", "g1", "g2"], "entity_id": ["e0", "e1", "e2"],
                      "title": ["Observatory", "Guild", "Press"], "path": [f"g{i}.png" for i in range(3)],
                      "split": ["index"] * 3})
    TextIndex.build(corpus).save(root / "index/text")
    ImageIndex.build(table, gallery, load_embedder("color_layout"), show_progress=False).save(root / "index/image")
    (root / "index/manifest.json").write_text('{"embedder": "color_layout"}')
    return root / "index", gallery


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers in their own processes (started together); yields their (process, URL) pairs."""
    root = tmp_path_factory.mktemp("hostile")
    tok, proc, model = tiny_stack()
    save_checkpoint(model, tok, proc, root / "ckpt")
    index_dir, gallery = tiny_tool_dirs(root)
    chat_proc, chat_url = start_mars_serve(root / "ckpt", root / "serve.log")
    port = free_port()
    with open(root / "tools.log", "wb") as err:
        tool_proc = subprocess.Popen(
            [sys.executable, "-m", "mars.cli", "serve-tools", "--index-dir", str(index_dir), "--gallery-dir",
             str(gallery), "--port", str(port)], env=sub_env(), stdout=subprocess.DEVNULL, stderr=err)
    tool_url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(chat_proc, chat_url, root / "serve.log")
        wait_serving(tool_proc, tool_url, root / "tools.log")
        yield {"chat": (chat_proc, chat_url, root / "serve.log"), "tools": (tool_proc, tool_url, root / "tools.log")}
    finally:
        for p in (chat_proc, tool_proc):
            p.terminate()
            p.wait(timeout=20)


def rss(proc: subprocess.Popen) -> int:
    return psutil.Process(proc.pid).memory_info().rss


def check_refusal(label: str, r: httpx.Response, accepted: set[int]) -> None:
    assert r.status_code in accepted, f"{label}: HTTP {r.status_code} {r.text[:300]}"
    body = r.json()
    if r.status_code >= 400:
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"], (label, body)
        assert len(r.content) < 2000, (label, len(r.content))  # the input is never echoed back
    else:
        assert isinstance(body["error"], str) and body["error"] and body["text"], (label, body)


# --------------------------------------------------------------------------- tests


def digest(cases) -> tuple[int, str]:
    h = hashlib.sha256()
    for case in cases:
        h.update(repr(case[:-2]).encode() + case[-2])
    return len(cases), h.hexdigest()


def test_cases_are_deterministic_and_many():
    chat, tools = digest(chat_cases(N_CHAT)), digest(tool_cases(N_TOOLS))
    assert chat == digest(chat_cases(N_CHAT)) and tools == digest(tool_cases(N_TOOLS))
    assert chat[0] + tools[0] + len(list(big_chat_cases())) + len(list(big_tool_cases())) >= 500


def valid_chat_works(url: str, image: bytes = GOOD_PNG) -> None:
    body = valid_chat()
    body["messages"][0]["content"][0]["image_url"]["url"] = url_of(image)
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def valid_tools_work(url: str) -> None:
    for tool in ("text_search", "image_zoom_in", "image_search"):
        r = httpx.post(f"{url}/v1/tools/{tool}", json=valid_tool_body(tool), timeout=60)
        assert r.status_code == 200 and r.json()["error"] is None, (tool, r.text)


def send_all(client: httpx.Client, requests) -> tuple[dict[int, int], list[tuple[str, dict]]]:
    """Send (label, method, URL, raw body, accepted statuses) and check each answer: the count of each status, and
    the label and body of each HTTP 200."""
    statuses: dict[int, int] = {}
    answered = []
    for label, method, url, raw, accepted in requests:
        r = client.request(method, url, content=raw, headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        check_refusal(label, r, accepted)
        if r.status_code == 200:
            answered.append((label, r.json()))
    return statuses, answered


def report(name: str, statuses: dict[int, int], before: int, grown: int, extra: str = "") -> None:
    print(f"\n{name}: {sum(statuses.values())} malformed requests, statuses {dict(sorted(statuses.items()))}, "
          f"RSS {before / 2**20:.0f} MB, grown by {grown / 2**20:.1f} MB{extra}")


def test_mars_serve_refuses_hostile_requests_and_keeps_serving(servers):
    proc, url, log = servers["chat"]
    valid_chat_works(url)
    before = rss(proc)
    chat = f"{url}/v1/chat/completions"
    requests = itertools.chain(
        ((label, "POST", chat, raw, accepted) for label, raw, accepted in chat_cases(N_CHAT)),
        ((label, "POST", chat, raw, accepted) for label, raw, accepted in big_chat_cases()),
        [("GET completions", "GET", chat, b"", {405}), ("unknown route", "POST", f"{url}/v1/nope", b"{}", {404}),
         ("reload without path", "POST", f"{url}/v1/reload", b"{}", {400}),
         ("reload /etc/passwd", "POST", f"{url}/v1/reload", b'{"path": "/etc/passwd"}', {400}),
         ("reload of 1 MB", "POST", f"{url}/v1/reload", b'{"path": "' + b"p" * 2**20 + b'"}', {413})],
    )
    with httpx.Client(timeout=60) as client:
        statuses, _ = send_all(client, requests)
    valid_chat_works(url)
    grown = rss(proc) - before
    valid_chat_works(url, png((2048, 2048)))  # a large image within the limits is served
    report("mars serve", statuses, before, grown)
    assert proc.poll() is None, log.read_text()[-3000:]
    assert not any(s >= 500 for s in statuses) and grown < MAX_RSS_GROWTH
    assert "Traceback" not in log.read_text()


def test_mars_serve_tools_refuses_hostile_requests_and_keeps_serving(servers):
    proc, url, log = servers["tools"]
    valid_tools_work(url)
    before = rss(proc)
    requests = itertools.chain(
        ((f"{tool!r:.40} {label}", "POST", f"{url}/v1/tools/{quote(tool, safe='')}", raw, accepted)
         for label, tool, raw, accepted in itertools.chain(tool_cases(N_TOOLS), big_tool_cases())),
        [("GET a tool", "GET", f"{url}/v1/tools/text_search", b"", {405})],
    )
    with httpx.Client(timeout=60) as client:
        statuses, answered = send_all(client, requests)
    valid_tools_work(url)
    grown = rss(proc) - before
    internal = [(label, a["error"][:120]) for label, a in answered if a["error"].startswith("internal tool error")]
    report("mars serve-tools", statuses, before, grown, f"; {statuses.get(200, 0)} bad tool calls answered with an "
           f"error observation, {len(internal)} of them internal tool errors {internal}")
    assert proc.poll() is None, log.read_text()[-3000:]
    assert not any(s >= 500 for s in statuses) and grown < MAX_RSS_GROWTH
    assert "Traceback" not in log.read_text()
