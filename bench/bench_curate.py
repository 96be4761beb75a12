"""Benchmark image curation against a naive baseline, in the same run.

Usage::

    python bench/bench_curate.py [--n 500] [--workers N] [--pool-dir DIR] [--skip-baseline]

1. Builds (once, cached in ``--pool-dir``; default ``$TMPDIR/mars_bench_curate_pool``)
   a pool of ``--n`` synthetic high-resolution images, 2048-4096 px on the long side:
   a smooth random field with shapes and noise drawn at quarter resolution, upscaled,
   plus full-resolution noise for JPEGs. 93% are plain RGB JPEG (quality 90), 4% RGB
   PNG, 2% EXIF-rotated JPEG (curation writes an upright derivative for those) and 1%
   exact copies. Images are
   deterministic per index, so a pool built with a smaller ``--n`` is extended, not redone.
2. Reads every file once so both contestants start from a warm page cache.
3. Times (a) the naive baseline, one process: ``Image.open`` + full ``load()`` +
   ``convert("RGB")`` + sha256 + phash of the full image, and (b)
   :func:`mars.curate.pool.curate_pool` with ``--workers`` (default ``os.cpu_count()``).
4. Prints name, images, wall seconds, images/s, ratio versus the baseline, CPU seconds
   (user + system of the process and its children: a load-independent view when other
   work shares the cores), images per CPU second and its ratio, and peak memory: the
   largest sum of RSS over the main process and its children, sampled every 20 ms with
   psutil (shared copy-on-write pages count once per process, so it overestimates).

``--only jpeg`` (or png, rotated, copy) times one kind of file from the same pool;
``--repeat R`` runs each contestant R times and reports the fastest run (the cores are
shared, so a single run can be slowed down by other work).

Target (brief): curate >= 5x the baseline on 2 cores with peak memory < 2 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mars.curate.hashing import phash, sha256_file  # noqa: E402
from mars.curate.pool import CurateConfig, curate_pool, summarize  # noqa: E402
from mars.data.schemas import RAW_IMAGES  # noqa: E402

MANIFEST = "manifest.json"
POOL_VERSION = 2


def _kind(i: int) -> str:
    """Pool composition: 1% exact copies, 2% EXIF-rotated JPEG, 4% PNG, the rest JPEG."""
    if i % 100 == 99:
        return "copy"
    if i % 50 == 5:
        return "rotated"
    if i % 25 == 3:
        return "png"
    return "jpeg"


_NOISE_TILE: np.ndarray | None = None


def _noise_like(h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """Full-resolution +-5 noise, tiled from one random 521x523 tile (cheap to make)."""
    global _NOISE_TILE
    if _NOISE_TILE is None:
        _NOISE_TILE = np.random.default_rng(1).integers(-5, 6, (521, 523, 3), dtype=np.int16)
    th, tw = _NOISE_TILE.shape[:2]
    reps = (h // th + 2, w // tw + 2, 1)
    oy, ox = int(rng.integers(0, th)), int(rng.integers(0, tw))
    return np.tile(_NOISE_TILE, reps)[oy : oy + h, ox : ox + w]


def _make_image(i: int) -> Image.Image:
    rng = np.random.default_rng(10_000 + i)
    long = int(rng.integers(2048, 4097))
    aspect = float(rng.choice([4 / 3, 3 / 2, 16 / 9, 1.0]))
    w, h = long, max(1024, int(round(long / aspect)))
    if rng.random() < 0.25:
        w, h = h, w
    qw, qh = w // 4, h // 4
    base = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((qw, qh), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(base)
    for _ in range(40):
        x0, y0 = int(rng.integers(0, qw)), int(rng.integers(0, qh))
        x1, y1 = x0 + int(rng.integers(4, qw // 4)), y0 + int(rng.integers(4, qh // 4))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)([x0, y0, x1, y1], fill=colour)
    noise = rng.integers(-12, 13, (qh, qw, 3), dtype=np.int16)
    base = Image.fromarray(np.clip(np.asarray(base, dtype=np.int16) + noise, 0, 255).astype(np.uint8))
    return base.resize((w, h), Image.Resampling.BICUBIC)


def _generate(args: tuple[int, str]) -> tuple[int, str]:
    i, pool_dir = args
    root = Path(pool_dir)
    kind = _kind(i)
    if kind == "copy":  # generated after every non-copy (see build_pool)
        src_i = i - 7
        while _kind(src_i) == "copy":
            src_i -= 1
        src = next(root.glob(f"img{src_i:05d}.*"))
        name = f"img{i:05d}{src.suffix}"
        shutil.copyfile(src, root / (name + ".tmp"))
        os.replace(root / (name + ".tmp"), root / name)
        return i, name
    im = _make_image(i)
    if kind == "png":
        name = f"img{i:05d}.png"
        im.save(root / (name + ".tmp"), "PNG", compress_level=1)
    else:
        arr = np.asarray(im, dtype=np.int16)
        arr = arr + _noise_like(arr.shape[0], arr.shape[1], np.random.default_rng(i))
        im = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
        name = f"img{i:05d}.jpg"
        if kind == "rotated":
            exif = Image.Exif()
            exif[0x0112] = 6
            im.save(root / (name + ".tmp"), "JPEG", quality=90, exif=exif.tobytes())
        else:
            im.save(root / (name + ".tmp"), "JPEG", quality=90)
    os.replace(root / (name + ".tmp"), root / name)
    return i, name


def build_pool(pool_dir: Path, n: int, jobs: int) -> pa.Table:
    """Create (or extend) the cached pool and return its RAW_IMAGES table."""
    pool_dir.mkdir(parents=True, exist_ok=True)
    man_path = pool_dir / MANIFEST
    manifest: dict[str, object] = {"version": POOL_VERSION, "items": {}}
    if man_path.exists():
        loaded = json.loads(man_path.read_text())
        if loaded.get("version") == POOL_VERSION:
            manifest = loaded
    items: dict[str, dict[str, object]] = manifest["items"]  # type: ignore[assignment]
    todo = [i for i in range(n) if str(i) not in items or not (pool_dir / str(items[str(i)]["name"])).exists()]
    if todo:
        print(f"generating {len(todo)} images into {pool_dir} ({jobs} jobs) ...", flush=True)
        t0 = time.perf_counter()
        originals = [(i, str(pool_dir)) for i in todo if _kind(i) != "copy"]
        copies = [(i, str(pool_dir)) for i in todo if _kind(i) == "copy"]
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            done = list(ex.map(_generate, originals, chunksize=4))
        done += [_generate(c) for c in copies]  # after their sources exist
        for i, name in done:
            p = pool_dir / name
            items[str(i)] = {"name": name, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
        man_path.write_text(json.dumps(manifest))
        print(f"generated in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for i in range(n):
        it = items[str(i)]
        rows.append(
            {
                "image_id": f"b{i:05d}",
                "path": it["name"],
                "source": "generated",
                "scene_id": None,
                "planted_case": _kind(i),
                "expected_reason": "exact_duplicate" if _kind(i) == "copy" else None,
                "bytes": it["bytes"],
                "sha256": it["sha256"],
            }
        )
    return pa.Table.from_pylist(rows, schema=RAW_IMAGES)


class PeakRSS:
    """Sample the RSS of this process plus all its children in a background thread."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._me = psutil.Process()

    def _sample(self) -> int:
        total = 0
        procs = [self._me]
        try:
            procs += self._me.children(recursive=True)
        except psutil.Error:
            pass
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakRSS:
        self.peak = self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._sample())


def naive_baseline(raw: pa.Table, raw_dir: Path) -> int:
    """One process: full decode, RGB convert, sha256, phash on the full-size image."""
    done = 0
    for rel in raw.column("path").to_pylist():
        p = raw_dir / rel
        with Image.open(p) as im:
            im.load()
            rgb = im.convert("RGB")
            sha256_file(p)
            phash(rgb)
        done += 1
    return done


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its reaped children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(fn: Callable[[], object]) -> tuple[float, float, int, object]:
    """Wall seconds, CPU seconds, peak RSS bytes and the result of ``fn()``."""
    with PeakRSS() as mem:
        c0 = _cpu_s()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        cpu = _cpu_s() - c0
    return dt, cpu, mem.peak, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500, help="number of images in the pool (default 500)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="curate_pool workers (default: cpu count)")
    ap.add_argument("--pool-dir", type=Path, default=Path(tempfile.gettempdir()) / "mars_bench_curate_pool")
    ap.add_argument("--gen-jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes for pool generation")
    ap.add_argument("--skip-baseline", action="store_true", help="time curate_pool only")
    ap.add_argument("--repeat", type=int, default=1, help="runs per contestant; the fastest is reported")
    ap.add_argument("--only", choices=["jpeg", "png", "rotated", "copy"], help="time one kind of file only")
    args = ap.parse_args(argv)

    raw = build_pool(args.pool_dir, args.n, args.gen_jobs)
    if args.only:
        raw = raw.filter(pc.equal(raw.column("planted_case"), args.only))
    total_bytes = sum(raw.column("bytes").to_pylist())
    for rel in raw.column("path").to_pylist():  # warm the page cache for both contestants
        with open(args.pool_dir / rel, "rb") as f:
            while f.read(1 << 22):
                pass
    kinds = Counter(raw.column("planted_case").to_pylist())
    print(
        f"pool: {raw.num_rows} images ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}), "
        f"{total_bytes / 2**20:.0f} MiB, {args.pool_dir}; cpus={os.cpu_count()} load={os.getloadavg()[0]:.2f}",
        flush=True,
    )

    results: list[tuple[str, int, float, float, int]] = []

    def best_of(name: str, fn: Callable[[], object]) -> object:
        runs = [_timed(fn) for _ in range(args.repeat)]
        dt, cpu, _, out = min(runs, key=lambda r: r[0])
        peak = max(r[2] for r in runs)
        results.append((name, raw.num_rows, dt, cpu, peak))
        print(f"{name}: " + ", ".join(f"{r[0]:.1f} s" for r in runs), flush=True)
        return out

    if not args.skip_baseline:
        best_of("naive baseline (1 proc)", lambda: naive_baseline(raw, args.pool_dir))

    der = Path(tempfile.mkdtemp(prefix="mars_bench_der_"))
    try:
        cfg = CurateConfig(workers=args.workers)
        out = best_of(
            f"curate_pool (workers={args.workers})",
            lambda: curate_pool(raw, args.pool_dir, der, cfg, progress=False),
        )
        curated, rejects = out  # type: ignore[misc]
        print(f"curate_pool outcome: {summarize(curated, rejects)}", flush=True)
    finally:
        shutil.rmtree(der, ignore_errors=True)

    base = results[0] if not args.skip_baseline else None
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print()
    print(
        f"{'name':<28} {'images':>7} {'seconds':>8} {'images/s':>9} {'ratio':>7} "
        f"{'cpu s':>7} {'img/cpu-s':>9} {'cpu ratio':>9} {'peak MiB':>9}"
    )
    for name, n, dt, cpu, peak in results:
        ratio = f"{(n / dt) / (base[1] / base[2]):.2f}x" if base else "-"
        cpu_ratio = f"{(n / cpu) / (base[1] / base[3]):.2f}x" if base else "-"
        print(
            f"{name:<28} {n:>7} {dt:>8.2f} {n / dt:>9.2f} {ratio:>7} "
            f"{cpu:>7.2f} {n / cpu:>9.2f} {cpu_ratio:>9} {peak / 2**20:>9.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
