"""Tests of mars.tools.cache (record / replay of tool results) through the real ToolBox."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from PIL import Image

from mars.tools.cache import CacheLoadError, ToolCache, image_digest
from mars.tools.toolbox import ToolBox, ToolConfig
from tests.tools.test_toolbox import World, square_image


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("cache_world"))


def calls(world: World) -> list[tuple[str, dict, list[Image.Image]]]:
    g = next(g for g in world.gallery if g["split"] == "heldout")
    with Image.open(world.gallery_dir / g["path"]) as im:
        emblem = im.convert("RGB")
    scene = square_image()
    name = world.entities[0]["name"]
    return [
        ("image_zoom_in", {"bbox_2d": [500, 500, 600, 600], "label": "square", "img_idx": 0}, [scene]),
        ("image_zoom_in", {"bbox_2d": [0, 0, 1000, 1000], "label": "all", "img_idx": 1}, [scene, emblem]),
        ("image_search", {"img_idx": 1}, [scene, emblem]),
        ("text_search", {"query": f"{name} founded"}, []),
        ("text_search", {"query": "zzqxv"}, []),  # no results: a normal observation, cached too
    ]


def same(a, b) -> None:
    assert a.text == b.text
    assert a.error == b.error
    assert [im.size for im in a.images] == [im.size for im in b.images]
    assert [im.convert("RGB").tobytes() for im in a.images] == [im.convert("RGB").tobytes() for im in b.images]


def test_record_then_replay_without_backend(world: World, tmp_path: Path) -> None:
    cfg = ToolConfig()
    rec = ToolCache(tmp_path / "cache", mode="record")
    live = ToolBox(world.text_index, world.image_index, world.gallery_dir, cfg, rec)
    recorded = [live.call(n, a, ims) for n, a, ims in calls(world)]
    assert all(o.ok for o in recorded), [o.error for o in recorded]
    assert rec.stats["writes"] == 5
    # the artifact: one JSON line per entry, PNGs named by their own sha256
    lines = (tmp_path / "cache" / "entries.jsonl").read_text().splitlines()
    assert len(lines) == 5 and all(json.loads(x)["key"] for x in lines)
    pngs = sorted((tmp_path / "cache" / "images").glob("*.png"))
    assert len(pngs) == 1 + 1 + 5
    for p in pngs:
        assert hashlib.sha256(p.read_bytes()).hexdigest() == p.stem
    # recording again does not duplicate entries
    live.call(*calls(world)[3])
    assert len((tmp_path / "cache" / "entries.jsonl").read_text().splitlines()) == 5

    replay = ToolCache(tmp_path / "cache", mode="replay")
    offline = ToolBox(None, None, None, cfg, replay)  # no index at all
    for (n, a, ims), want in zip(calls(world), recorded):
        got = offline.call(n, a, ims)
        assert got.ok, got.error
        same(got, want)
    assert replay.stats["hits"] == 5 and replay.stats["misses"] == 0


def test_replay_miss_is_an_error_and_validation_comes_first(world: World, tmp_path: Path) -> None:
    replay = ToolCache(tmp_path / "empty", mode="replay")
    box = ToolBox(world.text_index, world.image_index, world.gallery_dir, ToolConfig(), replay)
    obs = box.call("text_search", {"query": "Ornil Press"}, [])
    assert obs.error is not None and obs.error.startswith('cache miss in replay mode for text_search {"query":"Ornil Press"}')
    assert obs.text == obs.error
    bad = box.call("text_search", {"query": "  "}, [])
    assert bad.error is not None and bad.error.startswith("text_search: query is empty")
    assert not (tmp_path / "empty").exists()  # replay never writes


def test_readwrite_and_key_depends_only_on_the_read_image(world: World, tmp_path: Path) -> None:
    cache = ToolCache(tmp_path / "c", mode="readwrite")
    box = ToolBox(world.text_index, world.image_index, world.gallery_dir, ToolConfig(), cache)
    _, _, (scene, emblem) = calls(world)[2]
    first = box.call("image_search", {"img_idx": 1}, [scene, emblem])
    assert cache.stats == {"entries": 1, "hits": 0, "misses": 1, "writes": 1}
    # a different image 0 (not read by the call) still hits; served with no backend at all
    offline = ToolBox(None, None, None, ToolConfig(), cache)
    other = Image.new("RGB", (300, 200), (0, 200, 0))
    again = offline.call("image_search", {"img_idx": 1}, [other, emblem])
    same(again, first)
    assert cache.stats["hits"] == 1
    # a different read image misses; the live error (no index) is not cached
    miss = offline.call("image_search", {"img_idx": 0}, [other, emblem])
    assert miss.error == "image_search: no image index is configured for this tool box"
    assert len(cache) == 1
    # the text names the indices new images get, so the dialogue length is part of the key
    longer = box.call("image_search", {"img_idx": 1}, [scene, emblem, other])
    assert "images 3-7" in longer.text and len(cache) == 2
    # so is the config: a different k is a different result
    k2 = ToolBox(world.text_index, world.image_index, world.gallery_dir, ToolConfig(image_k=2), cache)
    assert len(k2.call("image_search", {"img_idx": 1}, [scene, emblem]).images) == 2


def test_validation_errors_are_not_recorded(world: World, tmp_path: Path) -> None:
    cache = ToolCache(tmp_path / "c", mode="record")
    box = ToolBox(world.text_index, None, None, ToolConfig(), cache)
    assert box.call("image_zoom_in", {"bbox_2d": [5, 5, 1, 1], "label": "x", "img_idx": 0}, [square_image()]).error
    assert box.call("nope", {}, []).error
    assert len(cache) == 0 and not (tmp_path / "c" / "entries.jsonl").exists()


def test_truncated_last_line_is_tolerated(world: World, tmp_path: Path) -> None:
    d = tmp_path / "c"
    cache = ToolCache(d, mode="record")
    box = ToolBox(world.text_index, world.image_index, world.gallery_dir, ToolConfig(), cache)
    a, b, c = calls(world)[0], calls(world)[3], calls(world)[2]
    obs_a, obs_b = box.call(*a), box.call(*b)
    path = d / "entries.jsonl"
    full = path.read_bytes()
    path.write_bytes(full[: len(full) - 25])  # crash in the middle of writing the second entry
    rw = ToolCache(d, mode="readwrite")
    assert len(rw) == 1
    box2 = ToolBox(world.text_index, world.image_index, world.gallery_dir, ToolConfig(), rw)
    same(box2.call(*a), obs_a)
    same(box2.call(*b), obs_b)  # recomputed and appended on a fresh line
    box2.call(*c)
    assert all(json.loads(x) for x in path.read_text().splitlines())  # the torn line was cut off
    reloaded = ToolCache(d, mode="replay")
    assert len(reloaded) == 3
    offline = ToolBox(None, None, None, ToolConfig(), reloaded)
    same(offline.call(*b), obs_b)


def test_corrupt_middle_line_and_missing_image(world: World, tmp_path: Path) -> None:
    d = tmp_path / "c"
    box = ToolBox(world.text_index, None, None, ToolConfig(), ToolCache(d, mode="record"))
    zoom_call = calls(world)[0]
    box.call(*zoom_call)
    box.call(*calls(world)[3])
    # a deleted image file makes its entry a miss
    for p in (d / "images").glob("*.png"):
        p.unlink()
    replay = ToolBox(None, None, None, ToolConfig(), ToolCache(d, mode="replay"))
    assert replay.call(*zoom_call).error.startswith("cache miss in replay mode for image_zoom_in")
    lines = (d / "entries.jsonl").read_text().splitlines()
    (d / "entries.jsonl").write_text("\n".join([lines[0][:30], lines[1]]) + "\n")
    with pytest.raises(CacheLoadError, match="line 1 is corrupt"):
        ToolCache(d, mode="replay")


def test_last_entry_without_newline_is_kept(world: World, tmp_path: Path) -> None:
    d = tmp_path / "c"
    box = ToolBox(world.text_index, None, None, ToolConfig(), ToolCache(d, mode="record"))
    box.call(*calls(world)[3])
    path = d / "entries.jsonl"
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    rw = ToolCache(d, mode="readwrite")
    assert len(rw) == 1
    ToolBox(world.text_index, None, None, ToolConfig(), rw).call(*calls(world)[4])
    assert len(ToolCache(d, mode="replay")) == 2 and len(path.read_text().splitlines()) == 2


def test_modes_and_digest(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cache mode"):
        ToolCache(tmp_path, mode="write")  # type: ignore[arg-type]
    off = ToolCache(tmp_path / "off", mode="off")
    box = ToolBox(None, None, None, ToolConfig(), off)
    assert box.call("image_zoom_in", {"bbox_2d": [0, 0, 500, 500], "label": "a", "img_idx": 0}, [square_image()]).ok
    assert not (tmp_path / "off").exists()
    im = square_image()
    assert image_digest(im) == image_digest(im.convert("RGBA").convert("RGB"))
    assert image_digest(im) != image_digest(im.resize((280, 210)))
    k = ToolCache.key("text_search", {"query": "a"}, [], {"x": 1})
    assert k == ToolCache.key("text_search", {"query": "a"}, [], {"x": 1}) and len(k) == 64
    assert k != ToolCache.key("text_search", {"query": "b"}, [], {"x": 1})
