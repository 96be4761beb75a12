"""Tests of the embedded world generator (mars.world): determinism, schemas, scene geometry and
cue, planted curation traps, corpus and distractors, and folder ingestion. Smoke-sized; every
world is built under tmp_path."""

from __future__ import annotations

import hashlib
import io
import json
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image, ImageOps

from mars.data.schemas import CORPUS, ENTITIES, GALLERY, RAW_IMAGES, WORLD_TRUTH
from mars.world import ingest_folder
from mars.world.emblems import COLOUR_NAMES, PALETTE, emblem_json, random_emblem, render_emblem, schemes_of
from mars.world.folder import image_id_for
from mars.world.generate import WorldSpec, WorldTables, generate_world, make_entities
from mars.world.planted import PLANTED_CASES, read_png_size
from mars.world.scenes import (
    CUE_COLOUR,
    DECOY_COLOURS,
    SceneConfig,
    cell_box,
    frame_box,
    frame_thickness,
    inner_box,
    render_scene,
    zone_box,
)

SMOKE = WorldSpec.smoke(seed=0)


def _build(root: Path, spec: WorldSpec, workers: int = 1) -> tuple[WorldTables, Path, Path]:
    raw, gal = root / "raw", root / "gallery"
    return generate_world(spec, raw, gal, progress=False, workers=workers), raw, gal


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[WorldTables, Path, Path]:
    return _build(tmp_path_factory.mktemp("world_a"), SMOKE, workers=1)


@pytest.fixture(scope="module")
def world_again(tmp_path_factory: pytest.TempPathFactory) -> tuple[WorldTables, Path, Path]:
    return _build(tmp_path_factory.mktemp("world_b"), SMOKE, workers=2)


def _file_hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _rows(table: pa.Table) -> list[dict]:
    return table.to_pylist()


def _by_case(world: tuple[WorldTables, Path, Path]) -> dict[str, dict]:
    return {r["planted_case"]: r for r in _rows(world[0].raw_images) if r["planted_case"]}


# --- determinism -------------------------------------------------------------------------------


def test_same_seed_gives_identical_files_and_tables_whatever_the_workers(world, world_again) -> None:
    a, raw_a, gal_a = world
    b, raw_b, gal_b = world_again
    ha, hb = _file_hashes(raw_a), _file_hashes(raw_b)
    assert len(ha) == a.raw_images.num_rows and ha == hb
    assert _file_hashes(gal_a) == _file_hashes(gal_b)
    for name, table in a.as_dict().items():
        assert table.equals(b.as_dict()[name]), name


def test_different_seed_differs(world, tmp_path: Path) -> None:
    other, raw, gal = _build(tmp_path, WorldSpec.smoke(seed=1, n_scenes=1, planted=False))
    a = world[0]
    assert a.entities.column("name").to_pylist() != other.entities.column("name").to_pylist()
    assert not set(_file_hashes(world[2]).values()) & set(_file_hashes(gal).values())
    assert not set(a.raw_images.column("sha256").to_pylist()) & set(other.raw_images.column("sha256").to_pylist())


# --- tables ------------------------------------------------------------------------------------


def test_tables_match_schemas_ids_unique_files_as_declared(world) -> None:
    tables, raw, gal = world
    expected = {"entities": ENTITIES, "corpus": CORPUS, "gallery": GALLERY, "raw_images": RAW_IMAGES,
                "world_truth": WORLD_TRUTH}
    for name, table in tables.as_dict().items():
        assert table.schema.equals(expected[name]), name
        assert table.num_rows > 0, name
    for name, key in [("entities", "entity_id"), ("corpus", "doc_id"), ("gallery", "gallery_id"),
                      ("raw_images", "image_id")]:
        ids = tables.as_dict()[name].column(key).to_pylist()
        assert len(ids) == len(set(ids)), name
    for r in _rows(tables.raw_images):
        p = raw / r["path"]
        assert not Path(r["path"]).is_absolute() and p.is_file()
        data = p.read_bytes()
        assert len(data) == r["bytes"] and hashlib.sha256(data).hexdigest() == r["sha256"]
        assert r["source"] == "generated"
    spec = SMOKE
    n_real = spec.n_entities
    assert tables.entities.num_rows == n_real + spec.n_distractors
    assert tables.gallery.num_rows == n_real * spec.gallery_per_entity
    for r in _rows(tables.gallery):
        with Image.open(gal / r["path"]) as im:
            assert im.size == (r["width"], r["height"]) == (spec.gallery_size, spec.gallery_size)
    splits = {}
    for r in _rows(tables.gallery):
        splits.setdefault(r["entity_id"], []).append(r["split"])
        assert r["title"].startswith(tables.entities.column("name").to_pylist()[int(r["entity_id"][1:])])
    for s in splits.values():
        assert s.count("heldout") == spec.heldout_per_entity and s.count("index") == len(s) - spec.heldout_per_entity
    for e in _rows(tables.entities):
        spec_dict = json.loads(e["emblem"])
        colours = {spec_dict["fill"], spec_dict["border"], spec_dict["accent"]} - {None}
        assert spec_dict["shape"] and 2 <= len(colours) <= 3
        assert spec_dict["glyph"] or spec_dict["pattern"]
    real = [e["emblem"] for e in _rows(tables.entities) if not e["is_distractor"]]
    assert len(real) == len(set(real))


# --- scenes ------------------------------------------------------------------------------------


def test_targets_lie_in_their_red_framed_cell_and_are_small(world) -> None:
    tables, raw, _ = world
    paths = {r["image_id"]: r["path"] for r in _rows(tables.raw_images)}
    truth = _rows(tables.world_truth)
    scenes = sorted({t["scene_id"] for t in truth})
    assert len(scenes) >= SMOKE.n_scenes
    for sid in scenes:
        rows = [t for t in truth if t["scene_id"] == sid]
        targets = [t for t in rows if t["is_target"]]
        assert len(targets) == 1, sid
        t = targets[0]
        w, h, gr, gc = t["scene_width"], t["scene_height"], t["grid_rows"], t["grid_cols"]
        assert (gr, gc) == (SMOKE.grid_rows, SMOKE.grid_cols) and t["cue"] == "red_frame" and t["difficulty"] == 0
        assert len({r["entity_id"] for r in rows}) == len(rows)
        assert abs(t["target_zone"] - SMOKE.target_zone) < 1e-6
        zx0, zy0, zx1, zy1 = zone_box(w, h, gr, gc, t["cell_row"], t["cell_col"], t["target_zone"])
        assert zx0 <= t["x0"] and t["x1"] <= zx1 and zy0 <= t["y0"] and t["y1"] <= zy1  # in its cell's centre
        for r in rows:
            cx0, cy0, cx1, cy1 = cell_box(w, h, gr, gc, r["cell_row"], r["cell_col"])
            assert cx0 <= r["x0"] < r["x1"] <= cx1 and cy0 <= r["y0"] < r["y1"] <= cy1
            ix0, iy0, ix1, iy1 = inner_box(w, h, gr, gc, r["cell_row"], r["cell_col"], frame_thickness(w, h, 0.02))
            assert ix0 <= r["x0"] and r["x1"] <= ix1 and iy0 <= r["y0"] and r["y1"] <= iy1  # not under a frame
            area = (r["x1"] - r["x0"]) * (r["y1"] - r["y0"])
            assert area < 0.05 * w * h
            # at the whole-scene resolution the policy sees (agent.max_pixels = 224 x 224, so at most 224 px on
            # the long side) the emblem is a few pixels
            assert max(r["x1"] - r["x0"], r["y1"] - r["y0"]) * 224 / max(w, h) < 16
            if not r["is_target"]:
                assert (r["cell_row"], r["cell_col"]) != (t["cell_row"], t["cell_col"])
        with Image.open(raw / paths[t["image_id"]]) as im:
            img = np.asarray(ImageOps.exif_transpose(im).convert("RGB")).astype(int)
        assert img.shape[:2] == (h, w)
        th = frame_thickness(w, h, SMOKE.frame_thickness_frac)
        assert th >= 0.015 * min(w, h)
        fx0, fy0, fx1, fy1 = frame_box(w, h, gr, gc, t["cell_row"], t["cell_col"], th)
        band = img[fy0 + 2: fy0 + th - 2, fx0 + th: fx1 - th].reshape(-1, 3)  # top bar of the frame
        assert np.abs(band.mean(0) - np.array(CUE_COLOUR)).max() < 8, sid
        for (r2, c2) in {(r, c) for r in range(gr) for c in range(gc)} - {(t["cell_row"], t["cell_col"])}:
            gx0, gy0, gx1, gy1 = frame_box(w, h, gr, gc, r2, c2, th)
            other = img[gy0 + 2: gy0 + th - 2, gx0 + th: gx1 - th].reshape(-1, 3).mean(0)
            assert np.abs(other - np.array(CUE_COLOUR)).max() > 60  # no red frame elsewhere
        # the emblem is really there: its box is not flat background
        x0, y0, x1, y1 = t["x0"], t["y0"], t["x1"], t["y1"]
        assert img[y0:y1, x0:x1].std() > 20


def test_the_target_zone_is_calm_apart_from_the_target(world) -> None:
    """No clutter reaches the target's zone: outside the emblem (with a margin), neighbouring pixels differ only by
    the background's smooth gradient and the noise (amplitude <= 7), so a crop of the zone shows one object."""
    tables, raw, _ = world
    paths = {r["image_id"]: r["path"] for r in _rows(tables.raw_images)}
    for t in (r for r in _rows(tables.world_truth) if r["is_target"]):
        with Image.open(raw / paths[t["image_id"]]) as im:
            img = np.asarray(ImageOps.exif_transpose(im).convert("RGB")).astype(int)
        zx0, zy0, zx1, zy1 = zone_box(t["scene_width"], t["scene_height"], t["grid_rows"], t["grid_cols"],
                                      t["cell_row"], t["cell_col"], t["target_zone"])
        zone = img[zy0:zy1, zx0:zx1]
        edges = np.abs(np.diff(zone, axis=1)).max(axis=2)  # [h, w-1] strongest channel step to the right
        keep = np.ones_like(edges, dtype=bool)
        pad = (t["x1"] - t["x0"]) // 4
        keep[max(0, t["y0"] - zy0 - pad): t["y1"] - zy0 + pad, max(0, t["x0"] - zx0 - pad): t["x1"] - zx0 + pad] = False
        assert (edges[keep] > 30).mean() < 0.001, t["scene_id"]


def test_scene_sizes_formats_and_png_frame_is_pure_red(world) -> None:
    tables, raw, _ = world
    truth = {t["image_id"]: t for t in _rows(tables.world_truth) if t["is_target"]}
    ordinary = [r for r in _rows(tables.raw_images) if r["planted_case"] is None]
    assert len(ordinary) == SMOKE.n_scenes
    assert all(r["scene_id"] and r["expected_reason"] is None for r in ordinary)
    assert {Path(r["path"]).suffix for r in ordinary} == {".jpg", ".png"}
    for r in ordinary:
        t = truth[r["image_id"]]
        with Image.open(raw / r["path"]) as im:
            assert im.size == (t["scene_width"], t["scene_height"])
            w, h = im.size
            assert SMOKE.scene_long_side_min <= max(w, h) <= SMOKE.scene_long_side_max
            assert w % t["grid_cols"] == 0 and h % t["grid_rows"] == 0
            if r["path"].endswith(".png"):
                th = frame_thickness(w, h, SMOKE.frame_thickness_frac)
                fx0, fy0, fx1, _ = frame_box(w, h, 2, 2, t["cell_row"], t["cell_col"], th)
                band = np.asarray(im.convert("RGB"))[fy0: fy0 + th, fx0: fx1].reshape(-1, 3)
                assert (band == np.array(CUE_COLOUR)).all()


def test_harder_grid_with_decoys_keeps_cells_token_aligned() -> None:
    cfg = SceneConfig(long_side_min=2048, long_side_max=2400, grid_rows=3, grid_cols=3, decoys=2)
    specs = [random_emblem(np.random.default_rng([5, i])) for i in range(8)]
    img, info = render_scene(np.random.default_rng(3), cfg, specs)
    w, h = img.size
    assert (info.grid_rows, info.grid_cols) == (3, 3) and len(info.decoy_cells) == 2
    assert info.target_cell not in info.decoy_cells
    # cells are equal fractions: resized to 252 px (9x9 merged 28 px tokens) boundaries hit tokens
    assert {cell_box(w, h, 3, 3, r, c)[0] * 252 / w for r in range(3) for c in range(3)} == {0, 84, 168}
    a = np.asarray(img).astype(int)
    th = info.frame_thickness
    seen = []
    for cell in info.decoy_cells:
        fx0, fy0, fx1, _ = frame_box(w, h, 3, 3, *cell, th)
        seen.append(tuple(int(v) for v in a[fy0 + th // 2, (fx0 + fx1) // 2]))
    assert all(c in DECOY_COLOURS and c != CUE_COLOUR for c in seen)
    target = [p for p in info.placements if p.is_target]
    assert len(target) == 1 and target[0].cell == info.target_cell


def test_emblem_rendering_is_deterministic_and_drawn() -> None:
    spec = random_emblem(np.random.default_rng(11))
    a, b = render_emblem(spec, 64, 10.0), render_emblem(spec, 64, 10.0)
    assert a.tobytes() == b.tobytes() and a.mode == "RGBA"
    alpha = np.asarray(a.getchannel("A"))
    assert alpha.max() == 255 and alpha[0, 0] == 0
    assert emblem_json(spec) == emblem_json(json.loads(emblem_json(spec)))


def test_schemes_of_reads_a_worlds_shared_colour_schemes_and_new_emblems_keep_to_them() -> None:
    spec = WorldSpec.smoke(n_entities=60, colour_schemes=3)
    entities = make_entities(spec)
    schemes = schemes_of(e.emblem for e in entities)
    # 60 entities (and their distractors) share the world's 3 schemes and use all of them; sorted, so the draws
    # below do not depend on the entities' order
    assert len(schemes) == 3 and list(schemes) == sorted(schemes, key=lambda c: (c[0], c[1], c[2] or ""))
    assert schemes_of(json.loads(e.emblem) for e in reversed(entities)) == schemes
    assert all(f in PALETTE and b in PALETTE and a in (None, *PALETTE) for f, b, a in schemes)
    drawn = [random_emblem(np.random.default_rng([5, i]), schemes) for i in range(60)]
    assert {(d["fill"], d["border"], d["accent"]) for d in drawn} == set(schemes)
    free = [random_emblem(np.random.default_rng([5, i])) for i in range(60)]
    assert len({COLOUR_NAMES[d["fill"]] for d in free}) > 3  # without schemes any palette colour
    assert schemes_of([]) == ()


# --- planted traps -----------------------------------------------------------------------------


def test_every_planted_case_present_with_its_expected_reason(world) -> None:
    cases = _by_case(world)
    assert set(cases) == set(PLANTED_CASES)
    for case, row in cases.items():
        assert row["expected_reason"] == PLANTED_CASES[case], case
    assert PLANTED_CASES["bomb"] == "decompression_bomb" and PLANTED_CASES["cmyk"] is None
    # traps are not given away by their file names
    assert all(Path(r["path"]).stem == r["image_id"] for r in cases.values())


def test_bomb_is_small_on_disk_but_declares_a_huge_canvas(world) -> None:
    path = world[1] / _by_case(world)["bomb"]["path"]
    data = path.read_bytes()
    assert len(data) < 1_000_000
    w, h = read_png_size(data)
    assert w * h > 100_000_000
    assert struct.unpack(">II", data[16:24]) == (w, h)
    with pytest.raises(Image.DecompressionBombError):
        Image.open(path)  # PIL refuses at open, before decoding anything


def test_repairable_cases_have_declared_modes_and_high_resolution(world) -> None:
    cases, raw = _by_case(world), world[1]
    truth = {t["image_id"]: t for t in _rows(world[0].world_truth) if t["is_target"]}
    expected_mode = {"cmyk": "CMYK", "16bit": "I;16", "palette": "P", "alpha": "RGBA", "exif_rotated": "RGB"}
    for case, mode in expected_mode.items():
        with Image.open(raw / cases[case]["path"]) as im:
            assert im.mode == mode, case
            assert max(im.size) >= 2048, case
    rot = cases["exif_rotated"]
    with Image.open(raw / rot["path"]) as im:
        assert im.format == "JPEG" and im.getexif().get(0x0112) in (6, 8)
        t = truth[rot["image_id"]]
        assert im.size == (t["scene_height"], t["scene_width"])  # stored sideways
        assert ImageOps.exif_transpose(im).size == (t["scene_width"], t["scene_height"])
    # repairable images are distinct content, not copies of any other file
    shas = [r["sha256"] for r in _rows(world[0].raw_images)]
    for case in expected_mode:
        assert shas.count(cases[case]["sha256"]) == 1


def test_rejectable_cases_really_are_broken(world) -> None:
    tables, raw, _ = world
    cases = _by_case(world)
    by_id = {r["image_id"]: r for r in _rows(tables.raw_images)}
    scenes = [r for r in by_id.values() if r["planted_case"] is None]
    assert cases["exact_dup"]["sha256"] in {r["sha256"] for r in scenes}
    sizes = {}
    for r in scenes:
        with Image.open(raw / r["path"]) as im:
            sizes[r["image_id"]] = im.size
    for case in ("near_dup_reencode", "near_dup_resize", "near_dup_crop"):
        with Image.open(raw / cases[case]["path"]) as im:
            w, h = im.size
            im.load()
        assert cases[case]["sha256"] not in {r["sha256"] for r in scenes}
        # never larger than the largest scene it could duplicate; same aspect as some scene
        assert any(w * h <= sw * sh and abs(w / h - sw / sh) < 0.02 for sw, sh in sizes.values()), case
    with Image.open(raw / cases["near_dup_resize"]["path"]) as im:
        assert any(abs(im.width - 0.9 * sw) <= 1 for sw, _ in sizes.values())
    with Image.open(raw / cases["low_res"]["path"]) as im:
        assert max(im.size) < 512
    with Image.open(raw / cases["bad_aspect"]["path"]) as im:
        assert max(im.size) / min(im.size) >= 4 and min(im.size) >= 1024
    with Image.open(raw / cases["low_quality"]["path"]) as im:
        a = np.asarray(im.convert("L"), dtype=float)
        assert max(im.size) >= 2048
    lap = a[1:-1, 1:-1] * 4 - a[:-2, 1:-1] - a[2:, 1:-1] - a[1:-1, :-2] - a[1:-1, 2:]
    assert lap.var() < 5.0
    with pytest.raises(OSError):  # truncated: the header parses, the pixels do not
        with Image.open(raw / cases["truncated"]["path"]) as im:
            assert max(im.size) >= 2048
            im.load()
    with pytest.raises(Exception):
        with Image.open(raw / cases["corrupt"]["path"]) as im:
            im.load()
    corrupt = (raw / cases["corrupt"]["path"]).read_bytes()
    assert corrupt[:8] == b"\x89PNG\r\n\x1a\n" and corrupt[12:16] == b"IHDR"
    not_image = raw / cases["not_an_image"]["path"]
    assert not_image.suffix == ".jpg"
    not_image.read_bytes().decode("utf-8")
    with pytest.raises(Image.UnidentifiedImageError):
        Image.open(not_image)


# --- corpus and distractors --------------------------------------------------------------------


def test_corpus_states_the_facts_of_every_entity(world) -> None:
    tables = world[0]
    docs = _rows(tables.corpus)
    assert len(docs) == tables.entities.num_rows * SMOKE.docs_per_entity
    for e in _rows(tables.entities):
        mine = [d for d in docs if d["entity_id"] == e["entity_id"]]
        assert [d["doc_id"] for d in mine] == [f"{e['entity_id']}-{j}" for j in range(SMOKE.docs_per_entity)]
        assert len({d["text"] for d in mine}) == len(mine)  # varied wording
        for d in mine:
            assert d["is_distractor"] == e["is_distractor"] and e["name"] in d["title"]
            for fact in (e["name"], str(e["founded_year"]), e["city"], e["founder"], e["kind"]):
                assert fact in d["text"], (fact, d["text"])


def test_documents_are_the_seeded_varied_wording() -> None:
    from mars.world.text import Facts, entity_documents

    facts = Facts(kind="institute", founded_year=1846, city="Thimhaven", founder="Arir Ionubruth")
    # the documents the generator has always given (printed by mars/world/text.py of commit 6f348da, same seed)
    a = entity_documents(np.random.default_rng(3), "Olath Institute", facts, 3)
    b = entity_documents(np.random.default_rng(3), "Olath Institute", facts, 3)
    assert a == b == [
        ("Olath Institute", "Olath Institute (institute, Thimhaven) was founded in 1846; the founder was Arir "
                            "Ionubruth."),
        ("Olath Institute - overview", "Located in Thimhaven, Olath Institute dates back to 1846, when Arir Ionubruth "
                                       "founded the institute. The institute published its first report a few years "
                                       "later."),
        ("Olath Institute - history", "In 1846, Arir Ionubruth founded Olath Institute, an institute in the city of "
                                      "Thimhaven. A small exhibition tells its story to visitors. The institute "
                                      "published its first report a few years later."),
    ]


def _one_letter_apart(a: str, b: str) -> bool:
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1


def test_distractors_have_similar_names_and_other_facts(world) -> None:
    tables = world[0]
    ents = _rows(tables.entities)
    real = [e for e in ents if not e["is_distractor"]]
    fake = [e for e in ents if e["is_distractor"]]
    assert len(fake) == SMOKE.n_distractors
    real_names = {e["name"] for e in real}
    assert len({e["name"] for e in ents}) == len(ents)
    for d in fake:
        assert d["name"] not in real_names
        similar = [r for r in real if _one_letter_apart(r["name"], d["name"])
                   or r["name"].split()[0] == d["name"].split()[0]]
        assert similar, d["name"]
        for r in similar:
            assert (r["founded_year"], r["city"], r["founder"]) != (d["founded_year"], d["city"], d["founder"])
    styles = {"letter" if any(_one_letter_apart(r["name"], d["name"]) for r in real) else "word" for d in fake}
    assert styles == {"letter", "word"}
    fake_ids = {d["entity_id"] for d in fake}
    assert not fake_ids & set(tables.gallery.column("entity_id").to_pylist())
    assert not fake_ids & set(tables.world_truth.column("entity_id").to_pylist())


def test_spec_rejects_bad_knobs() -> None:
    for bad in (dict(heldout_per_entity=4), dict(decoys=4), dict(grid_rows=1, grid_cols=1),
                dict(scene_long_side_min=4000, scene_long_side_max=3000), dict(emblems_per_scene_max=99),
                dict(grid_rows=3, grid_cols=3)):  # no multiple of 24 in 2048..2048
        with pytest.raises(ValueError, match="WorldSpec"):
            WorldSpec.smoke(**bad)
    # the largest target, 0.05 x 1.15 x 1.28 of the short side, needs a zone of 1.1 x that per cell (a 2x2 grid:
    # 0.162 of a cell, 0.243 of a 3x3 grid's); 0.15 failed in the localisation drills' ~500-px scenes
    with pytest.raises(ValueError, match=r"target_zone 0.15 is too small .* raise target_zone to >= 0.162"):
        WorldSpec(target_zone=0.15)
    assert WorldSpec(target_zone=0.18).target_zone == 0.18
    with pytest.raises(ValueError, match=r"raise target_zone to >= 0.243"):
        WorldSpec(grid_rows=3, grid_cols=3, target_zone=0.2)
    assert WorldSpec(grid_rows=3, grid_cols=3, decoys=1).difficulty == 2 and WorldSpec().difficulty == 0


# --- folder ingestion --------------------------------------------------------------------------


def _png_bytes(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 12), colour).save(buf, "PNG")
    return buf.getvalue()


def test_ingest_folder_copies_every_file_with_stable_ids(tmp_path: Path) -> None:
    """Every file is copied, whatever its name or content: judging it is curation's job."""
    src = tmp_path / "photos"
    (src / "sub" / "deeper").mkdir(parents=True)
    files = {"b.PNG": (255, 0, 0), "a.jpg": (0, 255, 0), "sub/c.TIFF": (0, 0, 255), "sub/deeper/d.webp": (9, 9, 9)}
    for rel, colour in files.items():
        (src / rel).write_bytes(_png_bytes(colour))  # contents need not match the extension
    (src / "notes.txt").write_text("not an image")
    (src / "sub" / "e.gif").write_bytes(b"GIF89a")
    (src / "empty.jpg").write_bytes(b"")
    (src / ".hidden").write_bytes(b"x")
    table = ingest_folder(src, tmp_path / "raw")
    assert table.schema.equals(RAW_IMAGES)
    rows = _rows(table)
    assert [r["path"] for r in rows] == sorted([*files, "notes.txt", "sub/e.gif", "empty.jpg", ".hidden"])
    for r in rows:
        data = (tmp_path / "raw" / r["path"]).read_bytes()
        assert data == (src / r["path"]).read_bytes()
        assert r["bytes"] == len(data) and r["sha256"] == hashlib.sha256(data).hexdigest()
        assert r["image_id"] == image_id_for(r["path"]) and r["image_id"].startswith("f-") and len(r["image_id"]) == 14
        assert r["source"] == "folder" and r["scene_id"] is None and r["planted_case"] is None
    assert {r["path"]: r["bytes"] for r in rows}["empty.jpg"] == 0
    again = ingest_folder(src, tmp_path / "raw2")
    assert again.equals(table)


def test_ingest_folder_leaves_notes_for_what_it_does_not_copy(tmp_path: Path) -> None:
    """Links out of the folder, broken links, links to directories, FIFOs and empty directories named like images
    are rows too: the pool gets a reject note in their place (nothing outside the folder is read); a directory
    named like an image that holds files stays a directory; a link to a file inside the folder is copied."""
    import os

    from mars.curate.probe import read_reject_note

    src, outside = tmp_path / "photos", tmp_path / "outside"
    (src / "album.jpg").mkdir(parents=True)
    (src / "plain_dir").mkdir()
    outside.mkdir()
    (outside / "secret.png").write_bytes(_png_bytes((1, 2, 3)))
    (src / "a.png").write_bytes(_png_bytes((4, 5, 6)))
    (src / "album.jpg" / "in.png").write_bytes(_png_bytes((7, 8, 9)))
    (src / "out.png").symlink_to(outside / "secret.png")
    (src / "up.png").symlink_to("../outside/secret.png")
    (src / "in.png").symlink_to("a.png")
    (src / "broken.png").symlink_to("gone.png")
    (src / "dirlink.jpg").symlink_to("plain_dir")
    (src / "empty.jpg").mkdir()
    os.mkfifo(src / "pipe.png")
    raw = tmp_path / "raw"
    rows = {r["path"]: r for r in _rows(ingest_folder(src, raw))}
    assert sorted(rows) == ["a.png", "album.jpg", "album.jpg/in.png", "broken.png", "dirlink.jpg", "empty.jpg",
                            "in.png", "out.png", "pipe.png", "up.png"]
    notes = {rel: read_reject_note(raw / rel) for rel in rows if (raw / rel).is_file()}
    assert {rel: n[0] for rel, n in notes.items() if n} == {
        "out.png": "symlink_outside_folder", "up.png": "symlink_outside_folder", "broken.png": "missing",
        "dirlink.jpg": "not_a_file", "empty.jpg": "not_a_file", "pipe.png": "not_a_file"}
    assert str(outside / "secret.png") in notes["out.png"][1] and "../outside/secret.png" in notes["up.png"][1]
    assert (raw / "in.png").read_bytes() == (src / "a.png").read_bytes()
    assert (raw / "album.jpg").is_dir() and rows["album.jpg"]["bytes"] == 0
    assert all(not p.is_symlink() for p in raw.rglob("*"))
    for rel, r in rows.items():
        if (raw / rel).is_file():
            assert r["sha256"] == hashlib.sha256((raw / rel).read_bytes()).hexdigest()


def test_ingest_folder_errors_name_the_folder(tmp_path: Path) -> None:
    from mars.errors import InputError

    missing = tmp_path / "nowhere"
    with pytest.raises(InputError, match="nowhere.*does not exist"):
        ingest_folder(missing, tmp_path / "raw")
    (tmp_path / "file.jpg").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"file.jpg' is not a directory"):
        ingest_folder(tmp_path / "file.jpg", tmp_path / "raw")
    empty = tmp_path / "empty"
    (empty / "sub" / "deeper").mkdir(parents=True)  # folders, no file
    with pytest.raises(ValueError, match=r"empty' is empty: no files in it or its sub-folders"):
        ingest_folder(empty, tmp_path / "raw")
    (empty / "sub" / "readme.txt").write_text("no images here")  # one file: a pool of one (curation rejects it)
    assert [r["path"] for r in _rows(ingest_folder(empty, tmp_path / "raw"))] == ["sub/readme.txt"]


def test_world_without_scenes_still_has_entities_corpus_and_gallery(tmp_path: Path) -> None:
    # what the world stage asks for when the raw pool comes from a folder or URLs
    spec = WorldSpec.smoke(n_entities=3, n_distractors=1, emblems_per_scene_max=3, n_scenes=0, planted=False)
    tables, raw, gal = _build(tmp_path, spec)
    assert tables.raw_images.num_rows == 0 and tables.world_truth.num_rows == 0
    assert tables.world_truth.schema.equals(WORLD_TRUTH) and tables.raw_images.schema.equals(RAW_IMAGES)
    assert tables.gallery.num_rows == 3 * spec.gallery_per_entity == len(list(gal.iterdir()))
    assert tables.corpus.num_rows == 4 * spec.docs_per_entity
