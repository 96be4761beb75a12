"""Bad input never refuses the pool: the world stage hands every entry of a folder (and every URL) to curation, and
the curate stage puts each in exactly one of curated.parquet / rejects.parquet, a reject with its reason.

Both tests run the real stages (``run()``) on the smoke profile, with their params in a params.yaml in tmp_path."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import stat
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from mars.curate.download import failure_id
from mars.params import load_params
from stages import curate, world
from tests.conftest import REPO, umask


def write_params(tmp: Path, **world_overrides) -> tuple[world.Params, curate.Params]:
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    doc["base"]["profile"] = "smoke"
    doc["world"].update(world_overrides, workers=1)
    doc["curate"].update(workers=1)
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_params("world", world.Params, path), load_params("curate", curate.Params, path)


def run_world_and_curate(tmp: Path, **world_overrides) -> tuple[dict, dict]:
    wp, cp = write_params(tmp, **world_overrides)
    wm = world.run(wp, {}, {"out": tmp / "world", "metrics": tmp / "metrics/world.json"})
    cm = curate.run(
        cp,
        {"raw_images": tmp / "world/raw_images.parquet", "raw_dir": tmp / "world/raw"},
        {"out": tmp / "curate", "metrics": tmp / "metrics/curate.json"},
    )
    return wm, cm


def photo(seed: int, size: tuple[int, int] = (1600, 1280)) -> Image.Image:
    """A sharp, distinct image above curation's bounds (short side >= 1024, >= 2 Mpx): random blocks."""
    blocks = np.random.default_rng(seed).integers(0, 256, size=(size[1] // 32, size[0] // 32, 3), dtype=np.uint8)
    return Image.fromarray(blocks).resize(size, Image.Resampling.NEAREST)


def encode(img: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kwargs)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height (1-bit gray) and holds one tiny IDAT: a decompression bomb."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def outcome_by_path(tmp: Path) -> tuple[dict[str, str], dict[str, dict]]:
    """path -> "curated" or the reject reason (each path must appear once), and the curated rows by path."""
    curated = pq.read_table(tmp / "curate/curated.parquet").to_pylist()
    rejects = pq.read_table(tmp / "curate/rejects.parquet").to_pylist()
    paths = [r["path"] for r in curated] + [r["path"] for r in rejects]
    assert len(paths) == len(set(paths)), "a file is in curated and rejects, or twice"
    out = {r["path"]: "curated" for r in curated} | {r["path"]: r["reason"] for r in rejects}
    assert all(r["detail"] for r in rejects)
    return out, {r["path"]: r for r in curated}


def test_a_folder_of_bad_files_ends_each_in_curated_or_rejects_with_its_reason(tmp_path: Path):
    src, outside = tmp_path / "photos", tmp_path / "outside"
    (src / "sub").mkdir(parents=True)
    outside.mkdir()
    photo(1).save(src / "good_a.jpg", "JPEG", quality=90)
    photo(2).quantize(64).save(src / "sub" / "good_b.png")  # palette: curated through an RGB derivative
    (src / "scan.dat").write_bytes(encode(photo(3), "PNG"))  # a real image under a non-image name: kept
    secret = encode(photo(4), "JPEG", quality=90)
    (outside / "secret.jpg").write_bytes(secret)
    (src / "outside_link.jpg").symlink_to(outside / "secret.jpg")
    (src / "inside_link.jpg").symlink_to("good_a.jpg")  # inside the folder: copied, then a duplicate
    (src / "broken.jpg").symlink_to("nowhere.jpg")
    (src / "empty.jpg").write_bytes(b"")
    (src / "notes.jpg").write_text("a text file named .jpg\n")
    (src / "readme.txt").write_text("captions are in captions.csv\n")
    whole = encode(photo(5), "JPEG", quality=90)
    (src / "truncated.jpg").write_bytes(whole[: len(whole) // 2])
    (src / "bomb.png").write_bytes(png_header_only(100_000, 100_000))
    (src / "d.jpg").mkdir()
    (src / "album.png").mkdir()
    Image.new("RGB", (64, 48), (200, 10, 10)).save(src / "album.png" / "tiny.png")
    os.mkfifo(src / "pipe.jpg")  # never opened: reading it would block

    with umask(0o027):
        wm, cm = run_world_and_curate(tmp_path, source="folder", folder=str(src))

    expected = {
        "good_a.jpg": "curated",
        "sub/good_b.png": "curated",
        "scan.dat": "curated",
        "outside_link.jpg": "symlink_outside_folder",
        "broken.jpg": "missing",
        "empty.jpg": "empty_file",
        "notes.jpg": "not_an_image",
        "readme.txt": "unsupported_extension",
        "truncated.jpg": "truncated",
        "bomb.png": "decompression_bomb",
        "d.jpg": "not_a_file",
        "album.png": "not_a_file",
        "album.png/tiny.png": "low_resolution",
        "pipe.jpg": "not_a_file",
    }
    raw = pq.read_table(tmp_path / "world/raw_images.parquet").to_pylist()
    assert sorted(r["path"] for r in raw) == sorted([*expected, "inside_link.jpg"])
    got, curated = outcome_by_path(tmp_path)
    # a link to a file inside the folder is that file again: one of the two is kept, the other an exact duplicate
    ids = {r["path"]: r["image_id"] for r in raw}
    kept, dup = sorted(["good_a.jpg", "inside_link.jpg"], key=ids.get)  # equal files: the smaller image_id is kept
    assert (got.pop(kept), got.pop(dup)) == ("curated", "exact_duplicate")
    assert got == {k: v for k, v in expected.items() if k != "good_a.jpg"}
    assert wm["raw_images"] == 15 and (cm["raw"], cm["curated"], cm["rejected"]) == (15, 3, 12)
    assert cm["reasons"] == {"decompression_bomb": 1, "empty_file": 1, "exact_duplicate": 1, "low_resolution": 1,
                             "missing": 1, "not_a_file": 3, "not_an_image": 1, "symlink_outside_folder": 1,
                             "truncated": 1, "unsupported_extension": 1}
    rejects = {r["path"]: r["detail"] for r in pq.read_table(tmp_path / "curate/rejects.parquet").to_pylist()}
    assert "100000x100000" in rejects["bomb.png"] and str(outside / "secret.jpg") in rejects["outside_link.jpg"]
    assert curated["sub/good_b.png"]["derivative"] and curated["sub/good_b.png"]["mode"] == "P"
    assert (curated["scan.dat"]["width"], curated["scan.dat"]["height"]) == (1600, 1280)

    # nothing outside the folder was read into the pool, and the pool holds no link or FIFO
    pool = tmp_path / "world/raw"
    entries = list(pool.rglob("*"))
    assert all(stat.S_ISREG(p.lstat().st_mode) or stat.S_ISDIR(p.lstat().st_mode) for p in entries)
    assert all(secret not in p.read_bytes() for p in entries if p.is_file())
    # and everything both stages wrote has the mode a plain write gives under umask 027
    written = [p for d in ("world", "curate", "metrics") for p in [tmp_path / d, *(tmp_path / d).rglob("*")]]
    modes = {p.relative_to(tmp_path).as_posix(): (p.is_dir(), stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert {rel: oct(m) for rel, (is_dir, m) in modes.items() if m != (0o750 if is_dir else 0o640)} == {}
    assert any(rel.startswith("curate/derivatives/") for rel in modes)  # probe's own atomic write is covered


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_a_missing_or_empty_folder_fails_the_world_stage_in_one_line(tmp_path: Path, case: str):
    folder = tmp_path / "photos"
    if case == "empty":
        (folder / "sub").mkdir(parents=True)  # sub-folders, but no file
    wp, _ = write_params(tmp_path, source="folder", folder=str(folder))
    with pytest.raises(ValueError) as exc:
        world.run(wp, {}, {"out": tmp_path / "world", "metrics": tmp_path / "w.json"})
    message = str(exc.value)
    assert "\n" not in message and str(folder) in message and "set world.folder" in message
    assert ("does not exist" if case == "missing" else "is empty: no files") in message
    assert not (tmp_path / "world").exists()


def test_every_url_ends_in_curated_or_rejects_with_its_reason(tmp_path: Path):
    site = tmp_path / "site"
    site.mkdir()
    good = encode(photo(11), "JPEG", quality=90)
    files = {
        "photo.jpg": good,
        "copy.jpg": good,  # same bytes at another URL
        "other.jpg": encode(photo(12), "JPEG", quality=90),
        "small.png": encode(Image.new("RGB", (64, 48), (10, 200, 10)), "PNG"),
        "cut.jpg": encode(photo(13), "JPEG", quality=90)[:20_000],
        "text.jpg": b"served as image/jpeg, but text\n",
        "empty.jpg": b"",
        "page.html": b"<html>not an image</html>",
    }
    for name, data in files.items():
        (site / name).write_bytes(data)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    urls = [f"{base}/{name}" for name in files] + [f"{base}/missing.jpg", "ftp://example.invalid/x.jpg",
                                                   f"{base}/photo.jpg"]  # listed twice
    (tmp_path / "urls.txt").write_text("\n".join(["# fault inputs", *urls]) + "\n")
    try:
        wm, cm = run_world_and_curate(tmp_path, source="urls", urls_file=str(tmp_path / "urls.txt"),
                                      download_timeout_s=5.0, download_retries=0)
    finally:
        server.shutdown()
        server.server_close()

    got, _ = outcome_by_path(tmp_path)
    kept = [("photo.jpg", ".jpg"), ("other.jpg", ".jpg"), ("small.png", ".png"), ("cut.jpg", ".jpg")]
    stored = {name: hashlib.sha256(files[name]).hexdigest() + ext for name, ext in kept}  # content-addressed
    raw_paths = pq.read_table(tmp_path / "world/raw_images.parquet").column("path").to_pylist()
    assert sorted(raw_paths) == sorted(stored.values())
    assert {name: got.pop(path) for name, path in stored.items()} == {
        "photo.jpg": "curated", "other.jpg": "curated", "small.png": "low_resolution", "cut.jpg": "truncated"}
    # the URLs that never became a raw image are rejects under their URL (the twice-listed photo once)
    assert got == {
        f"{base}/copy.jpg": "exact_duplicate",
        f"{base}/photo.jpg": "exact_duplicate",
        f"{base}/text.jpg": "not_an_image",
        f"{base}/empty.jpg": "empty_file",
        f"{base}/page.html": "not_an_image",
        f"{base}/missing.jpg": "download_failed",
        "ftp://example.invalid/x.jpg": "download_failed",
    }
    rejects = {r["path"]: r for r in pq.read_table(tmp_path / "curate/rejects.parquet").to_pylist()}
    assert rejects[f"{base}/missing.jpg"]["detail"].startswith("http_status: 404")
    assert rejects[f"{base}/missing.jpg"]["image_id"] == failure_id(f"{base}/missing.jpg")
    assert wm["raw_images"] == 4 and wm["download_failures"] == 7
    assert (cm["raw"], cm["curated"], cm["rejected"], cm["download_failures"]) == (4, 2, 9, 7)
