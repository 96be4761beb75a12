"""The world, curate and index stages on the smoke profile: determinism, traps, probes, DVC."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image, ImageOps

from mars.params import load_params
from mars.world.planted import PLANTED_CASES
from stages import curate, index, world
from tests.conftest import REPO


def smoke_params(tmp: Path, section: str, cls, **override):
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    doc["base"]["profile"] = "smoke"
    doc[section].update(override)
    path = tmp / f"params-{section}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_params(section, cls, path)


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.endswith(".quality.json")
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stages")
    wp = smoke_params(tmp, "world", world.Params, workers=2)
    world.run(wp, {}, {"out": tmp / "world", "metrics": tmp / "world.json"})
    cp = smoke_params(tmp, "curate", curate.Params, workers=2)
    curate.run(
        cp,
        {"raw_images": tmp / "world/raw_images.parquet", "raw_dir": tmp / "world/raw"},
        {"out": tmp / "curate", "metrics": tmp / "curate.json"},
    )
    ip = smoke_params(tmp, "index", index.Params)
    index.run(
        ip,
        {
            "entities": tmp / "world/entities.parquet",
            "corpus": tmp / "world/corpus.parquet",
            "gallery": tmp / "world/gallery.parquet",
            "gallery_dir": tmp / "world/gallery",
        },
        {"out": tmp / "index", "metrics": tmp / "index.json"},
    )
    return tmp, wp


def test_same_seed_same_hashes_other_seed_differs(built, tmp_path):
    tmp, wp = built
    world.run(wp, {}, {"out": tmp_path / "again", "metrics": tmp_path / "m.json"})
    first, again = tree_hashes(tmp / "world"), tree_hashes(tmp_path / "again")
    assert len(first) > 40 and first == again
    other = smoke_params(tmp_path, "world", world.Params, seed=1, workers=1)
    world.run(other, {}, {"out": tmp_path / "other", "metrics": tmp_path / "o.json"})
    assert tree_hashes(tmp_path / "other")["corpus.parquet"] != first["corpus.parquet"]


def test_the_world_writes_its_scene_knobs_for_the_stages_that_draw_scenes(built, tmp_path):
    """scene.json holds the world's SceneConfig (what the sft stage draws its drills with, instead of reading the
    world's params); a missing or foreign file is a one-line error that says to rerun the world stage."""
    import json

    from mars.world.scenes import SCENE_FILE, read_scene

    tmp, wp = built
    assert read_scene(tmp / "world") == world.world_spec(wp).scene_config()
    with pytest.raises(FileNotFoundError, match=r"scene.json: not found; the world stage writes it"):
        read_scene(tmp_path)
    values = json.loads((tmp / "world" / SCENE_FILE).read_text())
    (tmp_path / SCENE_FILE).write_text(json.dumps({**values, "grid": 3}))
    with pytest.raises(ValueError, match=r"keys \['grid'\] do not match this code's scene knobs; rerun the world"):
        read_scene(tmp_path)


def outcomes(tmp: Path) -> tuple[dict, dict, set]:
    raw = pq.read_table(tmp / "world/raw_images.parquet").to_pylist()
    rejects = {r["image_id"]: r for r in pq.read_table(tmp / "curate/rejects.parquet").to_pylist()}
    kept = set(pq.read_table(tmp / "curate/curated.parquet").column("image_id").to_pylist())
    return {r["planted_case"]: r for r in raw if r["planted_case"]}, rejects, kept


@pytest.mark.parametrize("case", sorted(PLANTED_CASES))
def test_each_planted_case_gets_its_outcome(built, case):
    tmp, _ = built
    planted, rejects, kept = outcomes(tmp)
    row = planted[case]
    expected = PLANTED_CASES[case]
    if expected is None:
        assert row["image_id"] in kept, rejects.get(row["image_id"])
    elif case == "exact_dup":  # either twin may be kept; the other is the duplicate
        twins = [r for r in pq.read_table(tmp / "world/raw_images.parquet").to_pylist() if r["sha256"] == row["sha256"]]
        assert len(twins) == 2 and sorted(rejects.get(t["image_id"], {}).get("reason", "kept") for t in twins) == [
            "exact_duplicate",
            "kept",
        ]
    else:
        assert rejects[row["image_id"]]["reason"] == expected, rejects[row["image_id"]]


def test_partition_and_bomb_rejected_from_header(built):
    tmp, _ = built
    raw = pq.read_table(tmp / "world/raw_images.parquet").column("image_id").to_pylist()
    planted, rejects, kept = outcomes(tmp)
    assert not kept & set(rejects) and kept | set(rejects) == set(raw)
    bomb = rejects[planted["bomb"]["image_id"]]
    assert "40000x40000" in bomb["detail"] or "1,600,000,000" in bomb["detail"] or "1.6" in bomb["detail"]
    metrics = json.loads((tmp / "curate.json").read_text())
    assert metrics["planted_recall"] == 1.0
    # repaired files carry an upright RGB derivative
    curated = {r["image_id"]: r for r in pq.read_table(tmp / "curate/curated.parquet").to_pylist()}
    rot = curated[planted["exif_rotated"]["image_id"]]
    with Image.open(tmp / "curate" / rot["derivative"]) as im:
        assert im.mode == "RGB" and (im.width, im.height) == (rot["width"], rot["height"]) and im.width > im.height


def test_index_probe_metrics(built):
    tmp, _ = built
    m = json.loads((tmp / "index.json").read_text())
    # measured on the smoke world: 1.0 and 1.0; on the default world see docs/findings.md
    assert m["text_recall_at_5"] >= 0.95 and m["image_recall_at_5"] >= 0.9
    assert json.loads((tmp / "index/manifest.json").read_text())["documents"] == m["documents"]


def test_index_probe_failure_keeps_previous_indexes(built, tmp_path):
    tmp, _ = built
    strict = smoke_params(tmp_path, "index", index.Params, min_image_recall=1.0, k=1, embedder="color_layout")
    out = tmp_path / "index"
    out.mkdir()
    (out / "keep.txt").write_text("previous")
    ins = {
        "entities": tmp / "world/entities.parquet",
        "corpus": tmp / "world/corpus.parquet",
        "gallery": tmp / "world/gallery.parquet",
        "gallery_dir": tmp / "world/gallery",
    }
    try:
        index.run(strict, ins, {"out": out, "metrics": tmp_path / "m.json"})
    except RuntimeError as exc:
        assert "previous indexes kept" in str(exc)
        assert (out / "keep.txt").read_text() == "previous"
    else:  # recall@1 was perfect: then the new index replaced the old directory
        assert not (out / "keep.txt").exists() and (out / "text").is_dir()


def test_cropping_is_necessary(built):
    """Image search cannot identify the target from the policy's view of the whole scene; it can from a crop of the
    framed cell's zone (the teacher's zoom) and from a tight crop of the emblem.

    The region of the 224-px view around the target, cut out and upsampled, is no longer a negative: on the calm
    zone the hand-built descriptor identifies most targets from it (measured 7/8 on this world; it was <= 4/8
    with clutter around the target). A policy cannot make that call: image search takes a whole image, so it
    has to zoom first (docs/design.md, The embedded default world)."""
    from mars.agent.oracle import zone_zoom_box
    from mars.tools.embedders import load_embedder
    from mars.tools.image_index import ImageIndex
    from mars.tools.imaging import policy_view

    tmp, _ = built
    idx = ImageIndex.load(tmp / "index/image", load_embedder("color_layout"))
    raw = {r["image_id"]: r for r in pq.read_table(tmp / "world/raw_images.parquet").to_pylist()}
    targets = [r for r in pq.read_table(tmp / "world/world_truth.parquet").to_pylist() if r["is_target"]]
    crop_top1 = zone_top1 = view_top1 = 0
    for t in targets:
        with Image.open(tmp / "world/raw" / raw[t["image_id"]]["path"]) as im:
            scene = ImageOps.exif_transpose(im).convert("RGB")
        pad = (t["x1"] - t["x0"]) // 2
        box = (max(0, t["x0"] - pad), max(0, t["y0"] - pad), min(scene.width, t["x1"] + pad), min(scene.height, t["y1"] + pad))
        z = zone_zoom_box(t)  # relative 0..1000, as the teacher sends it
        zone = scene.crop((z[0] * scene.width // 1000, z[1] * scene.height // 1000,
                           z[2] * scene.width // 1000, z[3] * scene.height // 1000))
        view = policy_view(scene, 56 * 56, 224 * 224)  # the default policy's view of the whole scene
        crop_top1 += idx.search(scene.crop(box), 1)[0].entity_id == t["entity_id"]
        zone_top1 += idx.search(policy_view(zone, 56 * 56, 224 * 224), 1)[0].entity_id == t["entity_id"]
        view_top1 += idx.search(view, 1)[0].entity_id == t["entity_id"]
    n = len(targets)
    assert crop_top1 / n >= 0.85, (crop_top1, n)
    assert zone_top1 / n >= 0.6, (zone_top1, n)
    assert view_top1 / n <= 0.25, (view_top1, n)


def test_folder_source_runs_curation_on_real_photos(tmp_path):
    from skimage import data as skdata

    src = tmp_path / "photos"
    src.mkdir()
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        img = Image.fromarray(getattr(skdata, name)()).convert("RGB")
        img.resize((img.width * 4, img.height * 4), Image.Resampling.BICUBIC).save(src / f"{name}.jpg", quality=90)
    Image.fromarray(skdata.camera()).save(src / "small_camera.png")  # 512x512: too small
    (src / "notes.jpg").write_text("not an image")
    wp = smoke_params(tmp_path, "world", world.Params, source="folder", folder=str(src), workers=1)
    world.run(wp, {}, {"out": tmp_path / "world", "metrics": tmp_path / "w.json"})
    cp = smoke_params(tmp_path, "curate", curate.Params, workers=1)
    m = curate.run(
        cp,
        {"raw_images": tmp_path / "world/raw_images.parquet", "raw_dir": tmp_path / "world/raw"},
        {"out": tmp_path / "curate", "metrics": tmp_path / "c.json"},
    )
    assert m["raw"] == 6 and m["curated"] == 4
    assert m["reasons"] == {"low_resolution": 1, "not_an_image": 1}
    assert "planted_recall" not in m


def test_urls_source_downloads_into_the_raw_pool(tmp_path):
    import functools
    import http.server
    import threading

    site = tmp_path / "site"
    site.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        arr = rng.integers(0, 255, size=(1100, 1500, 3), dtype=np.uint8)
        Image.fromarray(arr).save(site / f"photo{i}.jpg", quality=85)
    (site / "page.html").write_text("<html>not an image</html>")
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        urls = tmp_path / "urls.txt"
        urls.write_text(f"# two photos, a page and a missing file\n{base}/photo0.jpg\n{base}/photo1.jpg\n"
                        f"{base}/page.html\n{base}/missing.jpg\nftp://example.invalid/x.jpg\n")
        wp = smoke_params(tmp_path, "world", world.Params, source="urls", urls_file=str(urls), workers=1,
                          download_timeout_s=5.0, download_retries=0)
        m = world.run(wp, {}, {"out": tmp_path / "world", "metrics": tmp_path / "w.json"})
    finally:
        server.shutdown()
    raw = pq.read_table(tmp_path / "world/raw_images.parquet").to_pylist()
    assert m["raw_images"] == 2 and m["download_failures"] == 3
    failures = pq.read_table(tmp_path / "world/download_failures.parquet").to_pylist()
    assert sorted(f["url"].rsplit("/", 1)[-1] for f in failures) == ["missing.jpg", "page.html", "x.jpg"]
    assert {r["source"] for r in raw} == {"urls"}
    for r in raw:
        assert hashlib.sha256((tmp_path / "world/raw" / r["path"]).read_bytes()).hexdigest() == r["sha256"]
