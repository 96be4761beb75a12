"""Tests of mars.curate.probe and mars.curate.hashing on real files built with PIL.

The helpers at the top (scene, bomb PNG, EXIF-rotated JPEG, ...) are reused by
test_pool.py. Run: ``python -m pytest tests/curate/test_probe.py -q``.
"""

from __future__ import annotations

import hashlib
import io
import resource
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFile, ImageFilter

from mars.curate.hashing import (
    hamming,
    hamming_to_many,
    hashes_to_array,
    phash,
    popcount64,
    sha256_bytes,
    sha256_file,
)
from mars.curate.probe import ProbeLimits, probe_file, quality_score, sniff_format, to_rgb

# ----------------------------------------------------------------------------- helpers


def make_scene(seed: int, w: int = 2000, h: int = 1400) -> Image.Image:
    """A smooth random colour field with random rectangles/ellipses and fine noise."""
    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(
        (w, h), Image.Resampling.BICUBIC
    )
    draw = ImageDraw.Draw(base)
    for _ in range(25):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x1, y1 = x0 + int(rng.integers(20, w // 4)), y0 + int(rng.integers(20, h // 4))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)([x0, y0, x1, y1], fill=colour)
    noise = rng.integers(-8, 9, (h, w, 3), dtype=np.int16)
    return Image.fromarray(np.clip(np.asarray(base, dtype=np.int16) + noise, 0, 255).astype(np.uint8))


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_bomb_png(path: Path, width: int = 40000, height: int = 40000) -> None:
    """A valid 1-bit grayscale PNG of width x height zeros, written in ~0.5 s, ~200 KB."""
    row = b"\x00" * (1 + (width + 7) // 8)  # filter byte + packed bits
    comp = zlib.compressobj(9)
    rows_per_block = max(1, 5_000_000 // len(row))
    parts = []
    left = height
    while left > 0:
        n = min(rows_per_block, left)
        parts.append(comp.compress(row * n))
        left -= n
    parts.append(comp.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", b"".join(parts)) + _png_chunk(b"IEND", b"")
    )


def write_exif_rotated(path: Path, upright: Image.Image, orientation: int = 6) -> None:
    """Store ``upright`` so that a viewer applying EXIF ``orientation`` 6 shows it upright."""
    assert orientation == 6
    stored = upright.rotate(90, expand=True)  # counter-clockwise; orientation 6 turns it back
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored.save(path, "JPEG", quality=95, exif=exif.tobytes())


def write_truncated_jpeg(path: Path, im: Image.Image) -> None:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    path.write_bytes(data[: len(data) // 2])


def write_corrupt_png(path: Path, im: Image.Image) -> None:
    """Valid signature and IHDR, random garbage afterwards."""
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=1)
    data = buf.getvalue()
    rng = np.random.default_rng(7)
    path.write_bytes(data[:33] + rng.bytes(len(data) - 33))


def write_idat_garbage_png(path: Path, im: Image.Image) -> None:
    """Structurally valid PNG whose IDAT payload is garbage (so it opens, then fails to decode)."""
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=1)
    data = bytearray(buf.getvalue())
    i = data.find(b"IDAT")
    n = struct.unpack(">I", data[i - 4 : i])[0]
    rng = np.random.default_rng(8)
    data[i + 4 + 64 : i + 4 + n - 64] = rng.bytes(n - 128)
    path.write_bytes(bytes(data))


def mean_abs_diff(a: Image.Image, b: Image.Image) -> float:
    return float(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16)).mean())


# ------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def scene() -> Image.Image:
    return make_scene(1)


def test_plain_jpeg_is_accepted_without_derivative(tmp_path: Path, scene: Image.Image) -> None:
    p = tmp_path / "a.jpg"
    scene.save(p, "JPEG", quality=90)
    r = probe_file(p, "a", tmp_path / "der", rel_path="a.jpg")
    assert r.ok, r.detail
    assert (r.width, r.height, r.mode, r.format, r.path) == (2000, 1400, "RGB", "JPEG", "a.jpg")
    assert r.sha256 == hashlib.sha256(p.read_bytes()).hexdigest()
    # the probe's hash is the scene's (a JPEG at quality 90 moves few of its 64 bits; another scene moves ~32)
    assert r.phash is not None and len(r.phash) == 16 and hamming(r.phash, phash(scene)) <= 4
    assert r.quality is not None and r.quality > ProbeLimits().quality_threshold
    assert r.derivative is None
    assert not (tmp_path / "der").exists() or not any((tmp_path / "der").iterdir())


def test_jpeg_fast_path_and_png_full_path_agree(tmp_path: Path, scene: Image.Image) -> None:
    scene.save(tmp_path / "a.jpg", "JPEG", quality=95)
    scene.save(tmp_path / "a.png", "PNG", compress_level=1)
    rj = probe_file(tmp_path / "a.jpg", "j", None)
    rp = probe_file(tmp_path / "a.png", "p", None)
    assert rj.ok and rp.ok
    assert rp.derivative is None  # RGB PNG: nothing to convert
    assert hamming(rj.phash or "", rp.phash or "") <= 2
    assert rj.quality == pytest.approx(rp.quality, rel=0.25)


def test_not_an_image(tmp_path: Path) -> None:
    p = tmp_path / "notes.jpg"
    p.write_text("this is a text file, not a JPEG\n" * 20)
    r = probe_file(p, "t", tmp_path)
    assert r.reason == "not_an_image"


def test_missing_file(tmp_path: Path) -> None:
    assert probe_file(tmp_path / "nope.jpg", "m", tmp_path).reason == "missing"


@pytest.mark.parametrize(
    ("size", "needle"),
    [((800, 600), "short side 600 < 1024"), ((1100, 1100), "1,210,000 px < min 2,000,000 px")],
)
def test_low_resolution(tmp_path: Path, size: tuple[int, int], needle: str) -> None:
    p = tmp_path / "small.jpg"
    make_scene(3, *size).save(p, "JPEG")
    r = probe_file(p, "s", tmp_path)
    assert r.reason == "low_resolution"
    assert needle in r.detail


def test_bad_aspect(tmp_path: Path) -> None:
    p = tmp_path / "wide.png"
    Image.new("RGB", (3600, 1100), (10, 200, 30)).save(p, "PNG")
    r = probe_file(p, "w", tmp_path)
    assert r.reason == "bad_aspect"
    assert "3.27 > 3.00" in r.detail


def test_truncated_jpeg_and_png(tmp_path: Path, scene: Image.Image) -> None:
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    write_truncated_jpeg(tmp_path / "t.jpg", scene)
    buf = io.BytesIO()
    scene.save(buf, "PNG", compress_level=1)
    (tmp_path / "t.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    for name in ("t.jpg", "t.png"):
        r = probe_file(tmp_path / name, name, tmp_path / "der")
        assert r.reason == "truncated", (name, r.detail)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_corrupt_png(tmp_path: Path, scene: Image.Image) -> None:
    write_corrupt_png(tmp_path / "c.png", scene)
    write_idat_garbage_png(tmp_path / "d.png", scene)
    r1 = probe_file(tmp_path / "c.png", "c", tmp_path)
    r2 = probe_file(tmp_path / "d.png", "d", tmp_path)
    assert r1.reason == "corrupt" and "PNG" in r1.detail
    assert r2.reason == "corrupt" and "decode failed" in r2.detail


def test_load_truncated_images_must_stay_false(tmp_path: Path, scene: Image.Image) -> None:
    p = tmp_path / "a.jpg"
    scene.save(p)
    ImageFile.LOAD_TRUNCATED_IMAGES = True
    try:
        with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
            probe_file(p, "a", None)
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = False


def test_decompression_bomb_is_never_decoded(tmp_path: Path) -> None:
    p = tmp_path / "bomb.png"
    write_bomb_png(p, 40000, 40000)
    assert p.stat().st_size < 1_000_000
    before_limit = Image.MAX_IMAGE_PIXELS
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    r = probe_file(p, "bomb", tmp_path / "der")
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert r.reason == "decompression_bomb"
    assert "40000x40000" in r.detail and "1,600,000,000 px" in r.detail and "not decoded" in r.detail
    # Decoding would allocate 1.6 GB (mode "1" stores a byte per pixel) and take seconds; the probe's cost against
    # an ordinary image's is bench/bench_bounds.py's.
    assert rss_after - rss_before < 100 * 1024
    assert Image.MAX_IMAGE_PIXELS == before_limit  # PIL's global limit is restored


def test_decompression_bomb_warning_band_and_custom_limit(tmp_path: Path, scene: Image.Image) -> None:
    # 120 M px: above max_pixels (100 M) but below PIL's error level (2x): the warning path.
    p = tmp_path / "b.png"
    write_bomb_png(p, 12000, 10000)
    r = probe_file(p, "b", tmp_path)
    assert r.reason == "decompression_bomb" and "12000x10000" in r.detail
    # The limit is a parameter: an ordinary scene is a bomb under a 1 M px limit.
    q = tmp_path / "s.jpg"
    scene.save(q)
    r2 = probe_file(q, "s", tmp_path, ProbeLimits(max_pixels=1_000_000, min_pixels=0))
    assert r2.reason == "decompression_bomb" and "2000x1400" in r2.detail


def test_exif_rotated_jpeg_gets_upright_derivative(tmp_path: Path) -> None:
    upright = make_scene(5, 1400, 2000)  # portrait
    p = tmp_path / "rot.jpg"
    write_exif_rotated(p, upright)
    with Image.open(p) as raw:
        assert raw.size == (2000, 1400)
    der = tmp_path / "der"
    r = probe_file(p, "rot", der)
    assert r.ok, r.detail
    assert (r.width, r.height) == (1400, 2000)
    assert r.derivative == "rot.jpg"
    with Image.open(der / "rot.jpg") as d:
        assert d.mode == "RGB" and d.size == (1400, 2000)
        assert mean_abs_diff(d, upright) < 6.0
    # the hash is the upright image's
    plain = tmp_path / "upright.jpg"
    upright.save(plain, quality=95)
    assert hamming(r.phash or "", probe_file(plain, "u", None).phash or "") <= 2


def test_mode_conversions_write_rgb_derivatives(tmp_path: Path, scene: Image.Image) -> None:
    der = tmp_path / "der"
    gray = scene.convert("L")
    scene.convert("CMYK").save(tmp_path / "cmyk.jpg", "JPEG", quality=95)
    a16 = np.asarray(gray, dtype=np.uint16) * 257
    Image.fromarray(a16).save(tmp_path / "i16.png")
    pal = scene.quantize(64)
    pal.save(tmp_path / "pal.png")
    rgba = scene.convert("RGBA")
    alpha = Image.new("L", scene.size, 255)
    alpha.paste(0, (0, 0, 500, 1400))  # left quarter fully transparent
    rgba.putalpha(alpha)
    rgba.save(tmp_path / "rgba.png", compress_level=1)
    gray.save(tmp_path / "gray.jpg", quality=95)

    expect_mode = {"cmyk.jpg": "CMYK", "i16.png": "I;16", "pal.png": "P", "rgba.png": "RGBA", "gray.jpg": "L"}
    results = {}
    for name, mode in expect_mode.items():
        stem = name.split(".")[0]
        r = probe_file(tmp_path / name, stem, der)
        assert r.ok, (name, r.detail)
        assert r.mode == mode
        assert (r.width, r.height) == (2000, 1400)
        assert r.derivative is not None and r.derivative.startswith(stem + ".")
        with Image.open(der / r.derivative) as d:
            assert d.mode == "RGB" and d.size == (2000, 1400)
            results[stem] = d.copy()
    assert mean_abs_diff(results["cmyk"], scene) < 8.0
    assert mean_abs_diff(results["i16"].convert("L"), gray) < 1.0  # 16-bit scaled, not clipped
    assert mean_abs_diff(results["pal"], pal.convert("RGB")) == 0.0  # lossless PNG derivative
    left = np.asarray(results["rgba"])[:, :500]
    assert left.min() == 255  # composited over white
    assert mean_abs_diff(results["rgba"].crop((500, 0, 2000, 1400)), scene.crop((500, 0, 2000, 1400))) < 1.0
    assert mean_abs_diff(results["gray"].convert("L"), gray) < 3.0
    assert sorted(p.name for p in der.iterdir()) == ["cmyk.jpg", "gray.jpg", "i16.png", "pal.png", "rgba.png"]


def test_low_quality_flat_image(tmp_path: Path) -> None:
    p = tmp_path / "flat.jpg"
    Image.new("RGB", (2000, 1400), (120, 130, 140)).save(p, quality=90)
    r = probe_file(p, "flat", tmp_path)
    assert r.reason == "low_quality" and "Laplacian variance" in r.detail


def test_to_rgb_i_mode_and_la() -> None:
    arr = (np.arange(64 * 64, dtype=np.int32).reshape(64, 64) * 16) % 65536
    out = to_rgb(Image.fromarray(arr, mode="I"))
    assert out.mode == "RGB" and np.asarray(out).max() > 200
    la = Image.new("LA", (8, 8), (0, 0))
    assert np.asarray(to_rgb(la)).min() == 255


def test_hashing_helpers(tmp_path: Path, scene: Image.Image) -> None:
    p = tmp_path / "x.bin"
    data = np.random.default_rng(0).bytes(3_000_000)
    p.write_bytes(data)
    assert sha256_file(p, chunk_size=4096) == hashlib.sha256(data).hexdigest() == sha256_bytes(data)
    h1 = phash(scene)
    assert h1 == phash(np.asarray(scene))  # array and image agree
    assert hamming(h1, h1) == 0 and hamming("0" * 16, "f" * 16) == 64
    arr = hashes_to_array([h1, "0" * 16, "f" * 16])
    assert list(hamming_to_many(0, arr)) == [bin(int(h1, 16)).count("1"), 0, 64]
    assert hamming(h1, phash(make_scene(2))) > 10
    with pytest.raises(ValueError):
        hamming("abc", h1)


def test_popcount_fallback_for_numpy_1(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(3).integers(0, 2**63, 200, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    want = [bin(int(v)).count("1") for v in x]
    assert list(popcount64(x)) == want
    monkeypatch.delattr(np, "bitwise_count", raising=False)
    assert list(popcount64(x)) == want


def test_sniff_format() -> None:
    assert sniff_format(b"\xff\xd8\xff\xe0") == "JPEG"
    assert sniff_format(b"\x89PNG\r\n\x1a\n....") == "PNG"
    assert sniff_format(b"GIF89a") == "GIF"
    assert sniff_format(b"RIFF\x00\x00\x00\x00WEBPVP8 ") == "WEBP"
    assert sniff_format(b"BM" + b"\x00" * 14) == "BMP"
    assert sniff_format(b"II*\x00") == "TIFF" and sniff_format(b"MM\x00*") == "TIFF"
    assert sniff_format(b"<html>") is None


def test_quality_score_orders_sharp_over_blurred(scene: Image.Image) -> None:
    g = scene.convert("L").resize((512, 358))
    assert quality_score(g) > 4 * quality_score(g.filter(ImageFilter.GaussianBlur(4)))


# --- what a source hands over unfiltered: entries that are not image files --------------------------------------


def test_empty_files_directories_and_fifos_are_rejected_unopened(tmp_path: Path) -> None:
    import os

    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "d.jpg").mkdir()
    os.mkfifo(tmp_path / "pipe.jpg")  # opening it would block the probe
    (tmp_path / "dangling.jpg").symlink_to("nowhere.jpg")
    got = {n: probe_file(tmp_path / n, n, None) for n in ("empty.jpg", "d.jpg", "pipe.jpg", "dangling.jpg")}
    assert {n: r.reason for n, r in got.items()} == {
        "empty.jpg": "empty_file", "d.jpg": "not_a_file", "pipe.jpg": "not_a_file", "dangling.jpg": "missing"}
    assert "0 bytes" in got["empty.jpg"].detail and "directory" in got["d.jpg"].detail
    assert "prw" in got["pipe.jpg"].detail and "nowhere.jpg" in got["dangling.jpg"].detail


def test_the_name_only_words_the_reason_content_decides(tmp_path: Path, scene: Image.Image) -> None:
    """A non-image is not_an_image under an image name, unsupported_extension under another; a real image is kept
    whatever its name; a known signature keeps its own reason (truncated) whatever the name."""
    (tmp_path / "notes.jpg").write_text("text")
    (tmp_path / "notes.txt").write_text("text")
    (tmp_path / "noext").write_text("text")
    scene.save(tmp_path / "scan.dat", "PNG", compress_level=1)
    write_truncated_jpeg(tmp_path / "cut.bin", scene)
    got = {n: probe_file(tmp_path / n, n, None) for n in ("notes.jpg", "notes.txt", "noext", "scan.dat", "cut.bin")}
    assert {n: r.reason for n, r in got.items()} == {
        "notes.jpg": "not_an_image", "notes.txt": "unsupported_extension", "noext": "unsupported_extension",
        "scan.dat": None, "cut.bin": "truncated"}
    assert ".txt is not an image extension" in got["notes.txt"].detail
    assert "(no extension)" in got["noext"].detail
    assert (got["scan.dat"].width, got["scan.dat"].height) == scene.size


def test_a_symlink_in_the_pool_is_followed(tmp_path: Path, scene: Image.Image) -> None:
    """The raw pool may hold links (a DVC cache can link its files there): curation reads through them."""
    store = tmp_path / "cache"
    store.mkdir()
    scene.save(store / "blob", "JPEG", quality=90)
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "a.jpg").symlink_to(store / "blob")
    r = probe_file(tmp_path / "pool" / "a.jpg", "a", None)
    assert r.ok and r.sha256 == hashlib.sha256((store / "blob").read_bytes()).hexdigest()


def test_a_reject_note_is_rejected_with_its_reason_and_detail(tmp_path: Path) -> None:
    from mars.curate.probe import REJECT_NOTE_MAGIC, read_reject_note, write_reject_note

    write_reject_note(tmp_path / "sub" / "link.jpg", "symlink_outside_folder", "link.jpg -> /etc/passwd")
    r = probe_file(tmp_path / "sub" / "link.jpg", "n", None)
    assert (r.reason, r.detail) == ("symlink_outside_folder", "link.jpg -> /etc/passwd")
    assert read_reject_note(tmp_path / "sub" / "link.jpg") == ("symlink_outside_folder", "link.jpg -> /etc/passwd")
    with pytest.raises(ValueError, match=r"x.jpg: reason 'vanished' is not one of"):
        write_reject_note(tmp_path / "x.jpg", "vanished", "?")
    # the marker alone, or a note with an unknown reason, is just a file that is not an image
    (tmp_path / "fake.jpg").write_bytes(REJECT_NOTE_MAGIC + b'{"reason": "vanished", "detail": "x"}\n')
    assert read_reject_note(tmp_path / "fake.jpg") is None
    assert probe_file(tmp_path / "fake.jpg", "f", None).reason == "not_an_image"


def test_derivatives_get_the_mode_of_a_plain_write(tmp_path: Path, scene: Image.Image) -> None:
    import os
    import stat

    scene.convert("RGBA").save(tmp_path / "rgba.png", compress_level=1)
    old = os.umask(0o027)
    try:
        r = probe_file(tmp_path / "rgba.png", "rgba", tmp_path / "der")
    finally:
        os.umask(old)
    assert r.ok and r.derivative
    assert stat.S_IMODE((tmp_path / "der" / r.derivative).stat().st_mode) == 0o640
