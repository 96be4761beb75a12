"""Tests of mars.curate.pool.curate_pool on a small planted pool built with PIL.

The pool holds every trap listed in docs/design.md, The embedded default world (low
resolution, exact and near duplicates, corrupt, truncated, non-image, EXIF-rotated, CMYK,
16-bit, palette, RGBA, decompression bomb) plus distinct scenes; each file's expected
outcome is known.
Run: ``python -m pytest tests/curate/test_pool.py -q``.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from PIL import Image

from mars.curate.hashing import hamming
from mars.curate.pool import CurateConfig, curate_pool, summarize
from mars.data.schemas import CURATED, RAW_IMAGES, REJECTS

from .test_probe import (
    make_scene,
    write_bomb_png,
    write_corrupt_png,
    write_exif_rotated,
    write_idat_garbage_png,
    write_truncated_jpeg,
)

# image_id -> expected reason (None: curated)
EXPECTED: dict[str, str | None] = {
    "s00": None,
    "s00-q60": "near_duplicate",
    "s00-r90": "near_duplicate",
    "s00-crop2": "near_duplicate",
    "s01": None,
    "s01-copy": "exact_duplicate",
    "s02": None,
    "s03-png": None,
    "s04": None,
    "s05-large": None,
    "s05-small": "near_duplicate",  # same scene, fewer pixels, larger image_id loses anyway
    "t-bomb": "decompression_bomb",
    "t-cmyk": None,
    "t-cmyk-copy": "exact_duplicate",
    "t-corrupt": "corrupt",
    "t-corrupt-idat": "corrupt",
    "t-flat": "low_quality",
    "t-i16": None,
    "t-lowres": "low_resolution",
    "t-palette": None,
    "t-rgba": None,
    "t-rotated": None,
    "t-text": "not_an_image",
    "t-truncated": "truncated",
    "t-wide": "bad_aspect",
    "a-missing": "missing",
    "a-s02-q60": "near_duplicate",  # same pixels as s02, sorts first, but the smaller file loses
}

DERIVATIVES = {"t-cmyk", "t-i16", "t-palette", "t-rgba", "t-rotated"}


def _build_pool(root: Path) -> pa.Table:
    root.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}

    def put(image_id: str, name: str) -> None:
        files[image_id] = name

    scenes = {i: make_scene(100 + i) for i in range(5)}
    for i in (0, 1, 2, 4):
        scenes[i].save(root / f"s{i:02d}.jpg", quality=92)
        put(f"s{i:02d}", f"s{i:02d}.jpg")
    scenes[3].save(root / "s03.png", compress_level=1)
    put("s03-png", "s03.png")
    s0 = scenes[0]
    w, h = s0.size
    s0.save(root / "s00-q60.jpg", quality=60)
    put("s00-q60", "s00-q60.jpg")
    s0.resize((int(w * 0.9), int(h * 0.9)), Image.Resampling.LANCZOS).save(root / "s00-r90.jpg", quality=90)
    put("s00-r90", "s00-r90.jpg")
    dx, dy = int(w * 0.02), int(h * 0.02)
    s0.crop((dx, dy, w, h)).save(root / "s00-crop2.jpg", quality=90)
    put("s00-crop2", "s00-crop2.jpg")
    scenes[2].save(root / "a-s02-q60.jpg", quality=60)
    put("a-s02-q60", "a-s02-q60.jpg")
    shutil.copy(root / "s01.jpg", root / "s01-copy.jpg")
    put("s01-copy", "s01-copy.jpg")
    big = make_scene(200, 2400, 1680)
    big.save(root / "s05-large.jpg", quality=90)
    put("s05-large", "s05-large.jpg")
    big.resize((2000, 1400), Image.Resampling.LANCZOS).save(root / "s05-small.jpg", quality=90)
    put("s05-small", "s05-small.jpg")

    write_bomb_png(root / "bomb.png", 20000, 20000)
    put("t-bomb", "bomb.png")
    other = make_scene(300)
    other.convert("CMYK").save(root / "cmyk.jpg", quality=95)
    put("t-cmyk", "cmyk.jpg")
    shutil.copy(root / "cmyk.jpg", root / "cmyk-copy.jpg")
    put("t-cmyk-copy", "cmyk-copy.jpg")
    write_corrupt_png(root / "corrupt.png", make_scene(301))
    put("t-corrupt", "corrupt.png")
    write_idat_garbage_png(root / "corrupt-idat.png", make_scene(302))
    put("t-corrupt-idat", "corrupt-idat.png")
    Image.new("RGB", (2000, 1400), (90, 90, 90)).save(root / "flat.jpg")
    put("t-flat", "flat.jpg")
    g16 = np.asarray(make_scene(303).convert("L"), dtype=np.uint16) * 257
    Image.fromarray(g16).save(root / "i16.png")
    put("t-i16", "i16.png")
    make_scene(304, 640, 480).save(root / "lowres.jpg")
    put("t-lowres", "lowres.jpg")
    make_scene(305).quantize(128).save(root / "palette.png")
    put("t-palette", "palette.png")
    rgba = make_scene(306).convert("RGBA")
    rgba.putalpha(200)
    rgba.save(root / "rgba.png", compress_level=1)
    put("t-rgba", "rgba.png")
    write_exif_rotated(root / "rotated.jpg", make_scene(307, 1400, 2000))
    put("t-rotated", "rotated.jpg")
    (root / "text.jpg").write_text("not an image\n")
    put("t-text", "text.jpg")
    write_truncated_jpeg(root / "truncated.jpg", make_scene(308))
    put("t-truncated", "truncated.jpg")
    Image.new("RGB", (3600, 1100), (1, 2, 3)).save(root / "wide.png")
    put("t-wide", "wide.png")
    put("a-missing", "does-not-exist.jpg")

    assert set(files) == set(EXPECTED)
    rows = []
    for image_id, name in files.items():  # deliberately not sorted
        p = root / name
        data = p.read_bytes() if p.exists() else b""
        rows.append(
            {
                "image_id": image_id,
                "path": name,
                "source": "generated",
                "scene_id": None,
                "planted_case": image_id,
                "expected_reason": EXPECTED[image_id],
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    return pa.Table.from_pylist(rows, schema=RAW_IMAGES)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pa.Table]:
    root = tmp_path_factory.mktemp("raw")
    return root, _build_pool(root)


@pytest.fixture(scope="module")
def runs(
    pool: tuple[Path, pa.Table], tmp_path_factory: pytest.TempPathFactory
) -> dict[int, tuple[pa.Table, pa.Table, Path]]:
    root, raw = pool
    out = {}
    for workers in (1, 2):
        der = tmp_path_factory.mktemp(f"der{workers}")
        curated, rejects = curate_pool(raw, root, der, CurateConfig(workers=workers), progress=False)
        out[workers] = (curated, rejects, der)
    return out


def test_every_row_lands_once_with_expected_reason(runs: dict[int, tuple[pa.Table, pa.Table, Path]]) -> None:
    curated, rejects, _ = runs[2]
    assert curated.schema.equals(CURATED) and rejects.schema.equals(REJECTS)
    got: dict[str, str | None] = {i: None for i in curated.column("image_id").to_pylist()}
    for row in rejects.to_pylist():
        assert row["image_id"] not in got
        got[row["image_id"]] = row["reason"]
    assert got == EXPECTED
    assert curated.column("image_id").to_pylist() == sorted(curated.column("image_id").to_pylist())
    assert rejects.column("image_id").to_pylist() == sorted(rejects.column("image_id").to_pylist())
    counts = summarize(curated, rejects)
    assert counts["curated"] == sum(v is None for v in EXPECTED.values())
    assert counts["near_duplicate"] == 5


def test_worker_count_does_not_change_results(runs: dict[int, tuple[pa.Table, pa.Table, Path]]) -> None:
    c1, r1, d1 = runs[1]
    c2, r2, d2 = runs[2]
    assert c1.equals(c2)
    assert r1.equals(r2)
    assert sorted(p.name for p in d1.iterdir()) == sorted(p.name for p in d2.iterdir())


def test_duplicates_point_at_the_kept_image(runs: dict[int, tuple[pa.Table, pa.Table, Path]]) -> None:
    _, rejects, _ = runs[2]
    detail = {r["image_id"]: r["detail"] for r in rejects.to_pylist()}
    assert "s01" in detail["s01-copy"].split("identical bytes to ")[1]
    assert detail["t-cmyk-copy"].startswith("identical bytes to t-cmyk ")
    for near in ("s00-q60", "s00-r90", "s00-crop2"):
        assert " to s00 " in detail[near], detail[near]
        assert detail[near].startswith("phash distance ")
    assert " to s05-large " in detail["s05-small"]
    assert " to s02 " in detail["a-s02-q60"]


def test_curated_invariants(runs: dict[int, tuple[pa.Table, pa.Table, Path]], pool: tuple[Path, pa.Table]) -> None:
    root, _ = pool
    curated, _, der = runs[2]
    cfg = CurateConfig()
    rows = curated.to_pylist()
    for r in rows:
        short, long = min(r["width"], r["height"]), max(r["width"], r["height"])
        assert short >= cfg.min_short_side and r["width"] * r["height"] >= cfg.min_pixels
        assert long / short <= cfg.max_aspect
        assert r["sha256"] == hashlib.sha256((root / r["path"]).read_bytes()).hexdigest()
        assert r["quality"] >= cfg.quality_threshold
    hashes = [r["phash"] for r in rows]
    for i in range(len(hashes)):
        for j in range(i + 1, len(hashes)):
            assert hamming(hashes[i], hashes[j]) > cfg.phash_hamming
    by_id = {r["image_id"]: r for r in rows}
    assert (by_id["t-rotated"]["width"], by_id["t-rotated"]["height"]) == (1400, 2000)
    assert by_id["t-i16"]["mode"] == "I;16" and by_id["t-cmyk"]["mode"] == "CMYK"
    # derivatives: exactly for the converted images, none left for rejected duplicates
    with_der = {r["image_id"] for r in rows if r["derivative"] is not None}
    assert with_der == DERIVATIVES
    assert sorted(p.name for p in der.iterdir()) == sorted(by_id[i]["derivative"] for i in DERIVATIVES)
    for i in DERIVATIVES:
        with Image.open(der / by_id[i]["derivative"]) as d:
            assert d.mode == "RGB" and d.size == (by_id[i]["width"], by_id[i]["height"])


def test_relative_to_and_input_checks(pool: tuple[Path, pa.Table], tmp_path: Path) -> None:
    root, raw = pool
    subset = raw.filter(pc.is_in(raw.column("image_id"), pa.array(["t-rotated", "t-text"])))
    out = tmp_path / "curated"
    curated, rejects = curate_pool(
        subset, root, out / "derivatives", CurateConfig(workers=1), progress=False, relative_to=out
    )
    assert curated.column("derivative").to_pylist() == ["derivatives/t-rotated.jpg"]
    assert rejects.column("reason").to_pylist() == ["not_an_image"]
    with pytest.raises(ValueError, match="not unique"):
        curate_pool(pa.concat_tables([subset, subset]), root, tmp_path, CurateConfig(workers=1), progress=False)
    with pytest.raises(ValueError, match="lacks column"):
        curate_pool(subset.drop_columns(["path"]), root, tmp_path, CurateConfig(workers=1), progress=False)
    empty_c, empty_r = curate_pool(subset.slice(0, 0), root, tmp_path, CurateConfig(workers=2), progress=False)
    assert empty_c.num_rows == 0 and empty_r.num_rows == 0


def test_config_validation() -> None:
    assert CurateConfig().workers >= 1
    for bad in ({"workers": 0}, {"phash_hamming": 65}, {"max_aspect": 0.5}, {"min_short_side": 0}):
        with pytest.raises(ValueError):
            CurateConfig(**bad)  # type: ignore[arg-type]
