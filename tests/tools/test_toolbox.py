"""Tests of mars.tools.toolbox (the agent's tools) and mars.tools.base, on a tiny generated world."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mars.tools.base import TOOL_NAMES, TOOL_SCHEMAS, Observation
from mars.tools.embedders import load_embedder
from mars.tools.image_index import ImageIndex
from mars.tools.text_index import TextIndex
from mars.tools.toolbox import ToolBox, ToolConfig
from mars.world.generate import WorldSpec, generate_world

RED = (230, 20, 20)


class World:
    def __init__(self, root: Path) -> None:
        self.gallery_dir = root / "gallery"
        self.tables = generate_world(WorldSpec.smoke(), root / "raw", self.gallery_dir, progress=False)
        self.text_index = TextIndex.build(self.tables.corpus)
        self.image_index = ImageIndex.build(self.tables.gallery, self.gallery_dir, load_embedder("color_layout"),
                                            show_progress=False)
        self.entities = self.tables.entities.to_pylist()
        self.gallery = self.tables.gallery.to_pylist()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("world"))


@pytest.fixture(scope="module")
def box(world: World) -> ToolBox:
    return ToolBox(world.text_index, world.image_index, world.gallery_dir, ToolConfig())


def square_image(w: int = 560, h: int = 420, sq: tuple[int, int, int, int] = (280, 210, 336, 252)) -> Image.Image:
    """Grey image with a red square at pixel box ``sq`` (l, t, r, b)."""
    arr = np.full((h, w, 3), 128, dtype=np.uint8)
    l, t, r, b = sq
    arr[t:b, l:r] = RED
    return Image.fromarray(arr)


def red_fraction(im: Image.Image) -> float:
    a = np.asarray(im.convert("RGB")).astype(int)
    return float(((a[..., 0] > 180) & (a[..., 1] < 80) & (a[..., 2] < 80)).mean())


def zoom(box: ToolBox, bbox, images, idx: int = 0, label: str = "square") -> Observation:
    return box.call("image_zoom_in", {"bbox_2d": bbox, "label": label, "img_idx": idx}, images)


# --- schemas --------------------------------------------------------------------------------------


def test_schemas_are_openai_function_format() -> None:
    assert TOOL_NAMES == ("image_zoom_in", "image_search", "text_search")
    for s in TOOL_SCHEMAS:
        assert s["type"] == "function"
        f = s["function"]
        assert set(f) == {"name", "description", "parameters"}
        assert f["parameters"]["type"] == "object"
        assert set(f["parameters"]["required"]) == set(f["parameters"]["properties"])
    json.dumps(TOOL_SCHEMAS)  # serialisable
    zoom_schema = TOOL_SCHEMAS[0]["function"]["parameters"]["properties"]
    assert zoom_schema["bbox_2d"]["minItems"] == zoom_schema["bbox_2d"]["maxItems"] == 4
    assert Observation("x").ok and not Observation("x", error="x").ok


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="coords"):
        ToolConfig(coords="pixels")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_pixels"):
        ToolConfig(min_pixels=10_000, max_pixels=100)
    with pytest.raises(ValueError, match="text_k"):
        ToolConfig(text_k=0)


# --- image_zoom_in --------------------------------------------------------------------------------


def test_zoom_exact_box_contains_the_square(box: ToolBox) -> None:
    im = square_image()
    # relative: the square spans x 280..336 of 560 (500..600) and y 210..252 of 420 (500..600)
    obs = zoom(box, [500, 500, 600, 600], [im, im.copy()])
    assert obs.ok, obs.error
    assert obs.text == "Zoomed in on square (image 0, box [500, 500, 600, 600]); the crop is image 2."
    (crop,) = obs.images
    assert red_fraction(crop) > 0.9
    w, h = crop.size
    assert w % 28 == 0 and h % 28 == 0
    assert 56 * 56 <= w * h <= 224 * 224
    assert abs(w / h - 56 / 42) < 0.35  # aspect kept as well as rounding allows


def test_zoom_loose_box_and_pixel_bounds(box: ToolBox) -> None:
    im = square_image()
    obs = zoom(box, [400, 400, 700, 700], [im])  # pixels 224..392 x 168..294: square in the middle
    assert obs.ok
    crop = obs.images[0]
    frac = red_fraction(crop)
    assert 0.05 < frac < 0.2  # (56*42)/(168*126) = 0.11
    a = np.asarray(crop)
    cy, cx = a.shape[0] // 2, a.shape[1] // 2
    assert tuple(a[cy, cx]) == RED  # centred
    big = zoom(box, [0, 0, 1000, 1000], [Image.new("RGB", (2000, 1500))]).images[0]
    assert big.width * big.height <= 224 * 224 and big.width % 28 == 0 and big.height % 28 == 0
    tiny = zoom(box, [500, 500, 501, 501], [im]).images[0]  # 1 px -> upscaled to at least min_pixels
    assert tiny.width * tiny.height >= 56 * 56 and tiny.width % 28 == 0


def test_zoom_relative_and_absolute_agree(box: ToolBox) -> None:
    im = square_image()
    rel = zoom(box, [500, 500, 600, 600], [im])
    absolute = ToolBox(None, None, None, ToolConfig(coords="absolute"))
    ab = zoom(absolute, [280, 210, 336, 252], [im])
    assert ab.ok, ab.error
    assert rel.images[0].size == ab.images[0].size
    assert rel.images[0].tobytes() == ab.images[0].tobytes()
    # absolute boxes are in pixels of the image shown: 600 is outside a 560 px wide image
    bad = zoom(absolute, [500, 300, 600, 400], [im])
    assert bad.error and "x2 (600) is outside image 0, which is 560x420 pixels" in bad.error
    # relative 0..1000 fractional values are fine, and crop a chained image (index 1)
    chained = zoom(box, [250.5, 0, 750.25, 1000], [im, rel.images[0]], idx=1)
    assert chained.ok and "image 1, box [250.5, 0, 750.25, 1000]" in chained.text
    assert "the crop is image 2" in chained.text


def test_zoom_config_limits(box: ToolBox) -> None:
    small = ToolBox(None, None, None, ToolConfig(max_pixels=112 * 112, min_pixels=28 * 28, factor=14))
    crop = zoom(small, [0, 0, 1000, 1000], [Image.new("RGB", (800, 800))]).images[0]
    assert crop.size == (112, 112)


# --- text_search ----------------------------------------------------------------------------------


def test_text_search_finds_entity_doc(box: ToolBox, world: World) -> None:
    ent = next(e for e in world.entities if not e["is_distractor"])
    obs = box.call("text_search", {"query": f"{ent['name']} founded"}, [])
    assert obs.ok, obs.error
    lines = obs.text.split("\n")
    assert 1 <= len(lines) <= 3
    assert lines[0].startswith("[1] ") and ent["name"] in lines[0]
    assert str(ent["founded_year"]) in obs.text
    assert obs.images == []
    for i, line in enumerate(lines, 1):
        assert line.startswith(f"[{i}] ")


def test_text_search_caps(world: World) -> None:
    ent = world.entities[0]
    tight = ToolBox(world.text_index, None, None, ToolConfig(text_k=5, max_snippet_chars=40, max_output_chars=150))
    obs = tight.call("text_search", {"query": ent["name"]}, [])
    assert obs.ok and len(obs.text) <= 150
    for line in obs.text.split("\n"):
        snippet = line.split(": ", 1)[1]
        assert len(snippet) <= 40
    tiny = ToolBox(world.text_index, None, None, ToolConfig(max_output_chars=30))
    assert len(tiny.call("text_search", {"query": ent["name"]}, []).text) <= 30


def test_text_search_no_results_is_not_an_error(box: ToolBox) -> None:
    obs = box.call("text_search", {"query": "zzqxv unknownword"}, [])
    assert obs.ok and obs.text == 'No results for "zzqxv unknownword".'
    obs = box.call("text_search", {"query": "the of and"}, [])  # stopwords only
    assert obs.ok and obs.text.startswith("No results")


def test_arguments_as_json_string(box: ToolBox, world: World) -> None:
    obs = box.call("text_search", json.dumps({"query": world.entities[0]["name"]}), [])
    assert obs.ok and obs.text.startswith("[1] ")


# --- image_search ---------------------------------------------------------------------------------


def test_image_search_heldout_rendering(box: ToolBox, world: World) -> None:
    names = {e["entity_id"]: e["name"] for e in world.entities}
    held = [g for g in world.gallery if g["split"] == "heldout"]
    assert held
    top1 = top5 = 0
    for g in held:
        with Image.open(world.gallery_dir / g["path"]) as im:
            query = im.convert("RGB")
        shown = [square_image(), query]
        obs = box.call("image_search", {"img_idx": 1}, shown)
        assert obs.ok, obs.error
        lines = obs.text.split("\n")
        assert lines[0] == "Image search results for image 1:"
        assert lines[-1] == "Thumbnails [1]-[5] are images 2-6, in this order."
        titles = lines[1:-1]
        assert len(titles) == 5 and titles[0].startswith("[1] ")
        assert len(obs.images) == 5 and all(t.size == (64, 64) for t in obs.images)
        name = names[g["entity_id"]]
        top1 += name in titles[0]
        top5 += any(name in t for t in titles)
    print("image top1/top5", top1, top5, len(held))
    assert top5 / len(held) >= 0.75, (top1, top5, len(held))
    assert top1 / len(held) >= 0.5, (top1, top5, len(held))


def test_image_search_thumbnail_matches_gallery_file(box: ToolBox, world: World) -> None:
    g = next(g for g in world.gallery if g["split"] == "index")
    with Image.open(world.gallery_dir / g["path"]) as im:
        query = im.convert("RGB")
    obs = box.call("image_search", {"img_idx": 0}, [query])
    assert obs.ok and g["title"] in obs.text.split("\n")[1]
    expect = query.resize((64, 64), Image.Resampling.BICUBIC)
    assert obs.images[0].tobytes() == expect.tobytes()  # the best hit is the image itself


def test_from_dirs(world: World, tmp_path: Path) -> None:
    world.text_index.save(tmp_path / "index" / "text")
    world.image_index.save(tmp_path / "index" / "image")
    (tmp_path / "index" / "manifest.json").write_text(json.dumps({"embedder": "color_layout"}))
    loaded = ToolBox.from_dirs(tmp_path / "index", world.gallery_dir, ToolConfig(text_k=2))
    obs = loaded.call("text_search", {"query": world.entities[0]["name"]}, [])
    assert obs.ok and len(obs.text.split("\n")) <= 2


# --- bad calls ------------------------------------------------------------------------------------

Z = "image_zoom_in"
OK_BOX = [100, 100, 400, 400]

# fmt: off
BAD_CALLS = [  # (id, tool, arguments, expected start of the error message)
    ("unknown_tool", "web_search", {"query": "x"}, "unknown tool \"web_search\": use one of image_zoom_in, image_search, text_search"),
    ("name_not_str", 42, {}, "unknown tool 42"),
    ("args_list", Z, [1, 2], "image_zoom_in: arguments must be a JSON object with keys image_zoom_in(bbox_2d, label, img_idx), got a list"),
    ("args_none", "text_search", None, "text_search: arguments must be a JSON object with keys text_search(query), got null"),
    ("args_bad_json", "text_search", "{query: x", "text_search: arguments must be a JSON object like text_search(query), got a string that is not JSON"),
    ("missing", Z, {"bbox_2d": OK_BOX, "img_idx": 0}, "image_zoom_in: missing argument(s) label; call it as image_zoom_in(bbox_2d, label, img_idx)"),
    ("extra", "image_search", {"img_idx": 0, "k": 3}, "image_search: unexpected argument(s) \"k\"; image_search accepts only img_idx"),
    ("bbox_str", Z, {"bbox_2d": "100,100,400,400", "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d must be a list of 4 numbers [x1, y1, x2, y2], got a string"),
    ("bbox_len3", Z, {"bbox_2d": [1, 2, 3], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d must have exactly 4 numbers [x1, y1, x2, y2], got 3"),
    ("bbox_elem_str", Z, {"bbox_2d": [1, "2", 3, 4], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d y1 must be a number, got a string \"2\""),
    ("bbox_elem_bool", Z, {"bbox_2d": [True, 2, 3, 4], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d x1 must be a number, got a boolean True"),
    ("bbox_nan", Z, {"bbox_2d": [1, 2, float("nan"), 4], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d x2 must be a finite number, got nan"),
    ("bbox_inf", Z, {"bbox_2d": [1, 2, 3, float("inf")], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d y2 must be a finite number, got inf"),
    ("bbox_huge", Z, {"bbox_2d": [0, 0, 10**400, 10], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d x2 (a huge number) is outside the relative grid 0..1000"),
    ("bbox_negative", Z, {"bbox_2d": [-5, 0, 10, 10], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d x1 (-5) is outside the relative grid 0..1000"),
    ("bbox_over_1000", Z, {"bbox_2d": [0, 0, 10, 1001], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d y2 (1001) is outside the relative grid 0..1000"),
    ("bbox_inverted_x", Z, {"bbox_2d": [300, 0, 120, 10], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d x2 (120) must be > x1 (300)"),
    ("bbox_inverted_y", Z, {"bbox_2d": [0, 50, 10, 20.5], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d y2 (20.5) must be > y1 (50)"),
    ("bbox_zero_area", Z, {"bbox_2d": [10, 10, 10, 20], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d x2 (10) must be > x1 (10)"),
    ("bbox_too_thin", Z, {"bbox_2d": [0, 0, 1000, 1], "label": "a", "img_idx": 0}, "image_zoom_in: the box is 560x1 pixels on image 0, too thin to zoom in on (aspect ratio must be below 200)"),
    ("bbox_nested", Z, {"bbox_2d": [[1, 2], [3, 4]], "label": "a", "img_idx": 0}, "image_zoom_in: bbox_2d must have exactly 4 numbers [x1, y1, x2, y2], got 2"),
    ("label_not_str", Z, {"bbox_2d": OK_BOX, "label": 7, "img_idx": 0}, "image_zoom_in: label must be a string naming what is in the box, got an integer"),
    ("label_huge", Z, {"bbox_2d": OK_BOX, "label": "x" * 5000, "img_idx": 0}, "image_zoom_in: label is too long (5000 chars); use a short name (at most 512 chars)"),
    ("idx_str", Z, {"bbox_2d": OK_BOX, "label": "a", "img_idx": "0"}, "image_zoom_in: img_idx must be an integer image index (0 to 1), got a string \"0\""),
    ("idx_float", "image_search", {"img_idx": 1.0}, "image_search: img_idx must be an integer image index (0 to 1), got a number 1.0"),
    ("idx_bool", "image_search", {"img_idx": False}, "image_search: img_idx must be an integer image index (0 to 1), got a boolean False"),
    ("idx_negative", Z, {"bbox_2d": OK_BOX, "label": "a", "img_idx": -1}, "image_zoom_in: img_idx -1 is out of range: the dialogue has 2 image(s), use 0 to 1"),
    ("idx_too_big", "image_search", {"img_idx": 2}, "image_search: img_idx 2 is out of range: the dialogue has 2 image(s), use 0 to 1"),
    ("idx_huge", "image_search", {"img_idx": 10**400}, "image_search: img_idx a huge number is out of range"),
    ("query_empty", "text_search", {"query": ""}, "text_search: query is empty; pass a few keywords, e.g. an entity name"),
    ("query_whitespace", "text_search", {"query": " \n\t "}, "text_search: query is empty"),
    ("query_not_str", "text_search", {"query": ["a", "b"]}, "text_search: query must be a string of keywords, got a list"),
    ("query_oversized", "text_search", {"query": "word " * 200}, "text_search: query is too long (1000 chars, at most 512); use a few keywords"),
]
# fmt: on


@pytest.mark.parametrize("case", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_are_error_observations(box: ToolBox, case) -> None:
    _, name, args, message = case
    images = [square_image(), square_image(224, 168, (10, 10, 20, 20))]
    obs = box.call(name, args, images)
    assert isinstance(obs, Observation)
    assert obs.error is not None and not obs.ok
    assert obs.text == obs.error
    assert obs.images == []
    assert obs.error.startswith(message), obs.error


def test_absolute_bbox_out_of_image() -> None:
    ab = ToolBox(None, None, None, ToolConfig(coords="absolute"))
    obs = zoom(ab, [0, 0, 100, 500], [square_image()])
    assert obs.error == "image_zoom_in: bbox_2d y2 (500) is outside image 0, which is 560x420 pixels (x in 0..560, y in 0..420)"


def test_index_not_configured() -> None:
    bare = ToolBox(None, None, None)
    assert bare.call("text_search", {"query": "x"}, []).error == "text_search: no text index is configured for this tool box"
    obs = bare.call("image_search", {"img_idx": 0}, [square_image()])
    assert obs.error == "image_search: no image index is configured for this tool box"
    assert bare.call("image_search", {"img_idx": 0}, []).error == "image_search: there is no image in the dialogue to use"


def test_internal_errors_are_caught(world: World, tmp_path: Path) -> None:
    # a gallery directory without the files: loading a thumbnail fails inside the tool
    broken = ToolBox(world.text_index, world.image_index, tmp_path / "nowhere")
    obs = broken.call("image_search", {"img_idx": 0}, [square_image()])
    assert obs.error is not None and obs.error.startswith("internal tool error: FileNotFoundError")
    # images that are not images
    obs = broken.call("image_zoom_in", {"bbox_2d": OK_BOX, "label": "a", "img_idx": 0}, ["not an image"])
    assert obs.error is not None and obs.error.startswith("internal tool error: ")


# --- fuzz -----------------------------------------------------------------------------------------


def _random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(16 if depth < 3 else 11)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 999, 1000, 1001, 10**18, -(10**18), 10**400, -(10**400), 2**63])
    if kind == 3:
        return rng.choice([float("nan"), float("inf"), float("-inf"), -0.0, 1e-320, 1e308, 0.5, 999.999])
    if kind == 4:
        return rng.uniform(-2000, 2000)
    if kind == 5:
        return rng.randint(-5, 1200)
    if kind == 6:
        return rng.choice(["", " ", "\n\t", "é中文🙂", "\x00\x01", "0", "[1,2,3,4]", '{"query": "x"}', "NaN"])
    if kind == 7:
        return "x" * rng.choice([513, 10_000, 1_000_000])
    if kind == 8:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(1, 40)))
    if kind == 9:  # a plausible box, maybe reversed or degenerate
        b = [rng.randint(-50, 1100) for _ in range(4)]
        return b if rng.random() < 0.5 else sorted(b)
    if kind == 10:
        return [rng.uniform(0, 1000) for _ in range(rng.choice([0, 1, 3, 4, 4, 4, 5]))]
    if kind == 11:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    if kind == 12:
        return [[_random_value(rng, depth + 1) for _ in range(2)] for _ in range(rng.randrange(1, 5))]
    if kind == 13:
        return {str(_random_value(rng, 3))[:20]: _random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}
    if kind == 14:
        return tuple(_random_value(rng, depth + 1) for _ in range(4))
    return {"nested": {"bbox_2d": [1, 2, 3, 4]}}


def _random_payload(rng: random.Random, name: str):
    r = rng.random()
    if r < 0.1:
        return _random_value(rng)  # not a dict at all (or a random one)
    if r < 0.15:
        return json.dumps({"query": "Ornil"}) if rng.random() < 0.5 else "{" * rng.randrange(1, 5000)
    keys = {"image_zoom_in": ["bbox_2d", "label", "img_idx"], "image_search": ["img_idx"], "text_search": ["query"]}
    args = {}
    for k in keys[name]:
        if rng.random() < 0.9:
            args[k] = _random_value(rng) if rng.random() < 0.6 else _plausible(rng, k)
    if rng.random() < 0.1:
        args[rng.choice(["k", "bbox", "img", 3, None, ""])] = _random_value(rng)
    return args


def _plausible(rng: random.Random, key: str):
    if key == "bbox_2d":
        x1, y1 = rng.uniform(0, 900), rng.uniform(0, 900)
        return [x1, y1, rng.uniform(x1, 1000), rng.uniform(y1, 1000)]
    if key == "img_idx":
        return rng.randint(-1, 3)
    if key == "label":
        return rng.choice(["emblem", "", "top-left cell"])
    return rng.choice(["Ornil Press", "founded 1779", "  ", "Velmora"])


def test_fuzz_never_raises(world: World) -> None:
    rng = random.Random(1234)
    box = ToolBox(world.text_index, world.image_index, world.gallery_dir, ToolConfig(image_k=2))
    images = [square_image(), square_image(112, 84, (0, 0, 40, 40)), Image.new("L", (30, 300))]
    n_ok = n_err = 0
    names = list(TOOL_NAMES) + ["bogus", None]
    for i in range(1200):
        name = names[i % len(names)] if i % 50 else rng.choice([None, 3, "", "IMAGE_ZOOM_IN"])
        args = _random_payload(rng, name if name in TOOL_NAMES else rng.choice(TOOL_NAMES))
        t0 = time.perf_counter()
        obs = box.call(name, args, images)
        wall = time.perf_counter() - t0
        assert isinstance(obs, Observation)
        assert isinstance(obs.text, str) and obs.text
        assert len(obs.text) <= 2000
        assert 0 < obs.latency_s <= wall  # the call's own time, measured, error or not
        if obs.error is None:
            n_ok += 1
            assert name in TOOL_NAMES
            assert not obs.text.startswith("internal tool error")
        else:
            n_err += 1
            assert obs.text == obs.error and obs.images == []
            assert not obs.error.startswith("internal tool error"), (name, obs.error)
        if name not in TOOL_NAMES:
            assert obs.error is not None
    print("fuzz ok/err", n_ok, n_err)
    assert n_ok > 30 and n_err > 500, (n_ok, n_err)
    assert all(math.isfinite(x) for x in (n_ok, n_err))
