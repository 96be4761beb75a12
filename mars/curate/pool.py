"""Curate a raw image pool: probe every file in parallel, then drop duplicates.

:func:`curate_pool` takes the ``raw_images`` table (schema ``RAW_IMAGES``) and returns
``(curated, rejects)`` tables (schemas ``CURATED`` and ``REJECTS``), both sorted by
``image_id``; every input row lands in exactly one of them (asserted).

1. Probe (:func:`mars.curate.probe.probe_file`) each file: header bounds, safe decode at
   reduced size, sha256, phash, quality, RGB derivative when a conversion was needed.
   With ``cfg.workers > 1`` this runs in a ``ProcessPoolExecutor`` ("fork" start method on
   Linux, "spawn" elsewhere) through ``map`` with chunks, so results come back in input
   order; workers return small records only and hold one decoded image at a time.
   ``workers=1`` runs in-process. Results are identical either way.
2. Exact duplicates: accepted files with the same sha256; the one with most pixels is kept
   (ties: smallest image_id), the others are rejected as ``exact_duplicate``.
3. Near duplicates: among the survivors, sorted by (pixels descending, file size
   descending, image_id), a file whose phash is within ``cfg.phash_hamming`` bits of an
   already kept file is rejected as ``near_duplicate`` (the detail names the closest kept
   file and the distance). This greedy pass guarantees that no two curated images are
   within the threshold of each other. Derivatives written for files rejected here are
   deleted again.

``phash_hamming`` defaults to 10, not 6. Measured on generated scenes (tests/curate and
worlds of :mod:`mars.world`): JPEG re-encodes and 90% resizes land at 0-2 bits, 2% crops
(per side or one-sided) at 0-8 bits (the world's crop at 4-8), while distinct scenes were
at least 16 bits apart (1770 pairs of test scenes) and 20 in a 30-scene world. pHash
distances are always even (the median splits the 64 coefficients 32/32), so 6 would miss
some crops; 10 sits between the two populations, nearer the duplicates, because merging
distinct scenes loses data silently while a missed duplicate only costs a little.

Deviations from the brief:

- ties in pixel count are broken by file size (larger kept) before image_id, so a
  quality-60 re-encode loses to its quality-90 original whatever their ids (for exact
  duplicates sizes are equal and image_id decides);
- ``curate_pool`` takes an extra keyword ``relative_to`` (default: the derivative
  directory) that the ``derivative`` column is relative to, so the stage can keep the
  derivatives in a sub-folder of its output directory;
- more reject reasons: ``missing`` (file listed but absent), and for what a source hands over
  unfiltered (every entry of a folder, every URL): ``empty_file``, ``not_a_file``,
  ``symlink_outside_folder`` (a link out of the source's folder), ``unsupported_extension``,
  ``unreadable`` (:mod:`mars.curate.probe`) and ``download_failed``
  (:func:`mars.curate.download.failures_as_rejects`);
- the sha256 stored is the one computed here; a disagreement with the raw table's
  ``sha256`` column is logged as a warning.

Library only; the ``curate`` stage wraps it. Tests: ``python -m pytest tests/curate``;
speed: ``python bench/bench_curate.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import os
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from mars.curate.hashing import hamming_to_many, hashes_to_array
from mars.curate.probe import ProbeLimits, ProbeResult, probe_file
from mars.data.schemas import CURATED, RAW_IMAGES, REJECTS
from mars.workers import die_with_parent

log = logging.getLogger(__name__)


def _default_workers() -> int:
    return os.cpu_count() or 1


@dataclass(frozen=True)
class CurateConfig:
    """Every tunable of the curate stage (mirrors the ``curate`` section of params.yaml)."""

    min_short_side: int = 1024
    min_pixels: int = 2_000_000
    max_aspect: float = 3.0
    max_pixels: int = 100_000_000
    phash_hamming: int = 10
    quality_threshold: float = 5.0
    workers: int = field(default_factory=_default_workers)

    def __post_init__(self) -> None:
        if self.min_short_side < 1:
            raise ValueError(f"min_short_side must be >= 1, got {self.min_short_side}")
        if self.min_pixels < 0 or self.max_pixels < 1:
            raise ValueError(f"pixel bounds must be positive, got {self.min_pixels}, {self.max_pixels}")
        if self.max_aspect < 1.0:
            raise ValueError(f"max_aspect must be >= 1.0, got {self.max_aspect}")
        if not 0 <= self.phash_hamming <= 64:
            raise ValueError(f"phash_hamming must be in 0..64, got {self.phash_hamming}")
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")

    @property
    def limits(self) -> ProbeLimits:
        return ProbeLimits(
            min_short_side=self.min_short_side,
            min_pixels=self.min_pixels,
            max_aspect=self.max_aspect,
            max_pixels=self.max_pixels,
            quality_threshold=self.quality_threshold,
        )


_Task = tuple[str, str, str, str, ProbeLimits]


def _mp_context() -> multiprocessing.context.BaseContext:
    """"fork" on Linux (cheap, no re-import of ``__main__``), "spawn" elsewhere.

    Workers only run PIL/numpy code and never touch the caller's locks or threads, which
    is what makes forking a multi-threaded caller safe here.
    """
    if sys.platform.startswith("linux"):
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def _probe_task(task: _Task) -> ProbeResult:
    image_id, rel, raw_dir, derivative_dir, limits = task
    return probe_file(Path(raw_dir) / rel, image_id, Path(derivative_dir), limits, rel_path=rel)


def _probe_all(
    tasks: Sequence[_Task], workers: int, progress: bool
) -> list[ProbeResult]:
    results: list[ProbeResult] = []
    bar = tqdm(total=len(tasks), desc="curate", unit="img", disable=not progress)
    try:
        it: Iterator[ProbeResult]
        if workers <= 1 or len(tasks) <= 1:
            for task in tasks:
                results.append(_probe_task(task))
                bar.update(1)
        else:
            n = min(workers, len(tasks))
            chunksize = max(1, min(8, len(tasks) // (n * 8)))
            with ProcessPoolExecutor(max_workers=n, mp_context=_mp_context(), initializer=die_with_parent) as ex:
                it = ex.map(_probe_task, tasks, chunksize=chunksize)
                for r in it:
                    results.append(r)
                    bar.update(1)
    finally:
        bar.close()
    return results


def _keep_order(r: ProbeResult) -> tuple[int, int, str]:
    """Which copy of a duplicate group to keep: most pixels, then largest file, then image_id."""
    return (-r.pixels, -(r.nbytes or 0), r.image_id)


def _reject_row(r: ProbeResult, reason: str, detail: str) -> dict[str, object]:
    return {"image_id": r.image_id, "path": r.path, "reason": reason, "detail": detail}


def _check_input(raw_images: pa.Table) -> None:
    missing = [c for c in ("image_id", "path") if c not in raw_images.column_names]
    if missing:
        raise ValueError(
            f"raw_images lacks column(s) {missing}; expected the RAW_IMAGES schema "
            f"({RAW_IMAGES.names}) from mars.data.schemas"
        )
    for col in ("image_id", "path"):
        if raw_images.column(col).null_count:
            raise ValueError(f"raw_images column {col!r} holds nulls; every row needs one")
    counts = Counter(raw_images.column("image_id").to_pylist())
    if len(counts) != raw_images.num_rows:
        dup = sorted(i for i, c in counts.items() if c > 1)[:5]
        raise ValueError(f"raw_images column 'image_id' is not unique (e.g. {dup}); fix the world/source stage")


def curate_pool(
    raw_images: pa.Table,
    raw_dir: Path,
    derivative_dir: Path,
    cfg: CurateConfig,
    progress: bool = True,
    *,
    relative_to: Path | None = None,
) -> tuple[pa.Table, pa.Table]:
    """Probe, filter and deduplicate ``raw_images``; return ``(curated, rejects)``.

    ``raw_dir``: directory the ``path`` column is relative to. ``derivative_dir``: where RGB
    derivatives go (created if needed). ``relative_to``: directory the ``derivative``
    column is relative to (default ``derivative_dir``).
    """
    _check_input(raw_images)
    raw_dir = Path(raw_dir)
    derivative_dir = Path(derivative_dir)
    derivative_dir.mkdir(parents=True, exist_ok=True)
    rel_root = Path(relative_to) if relative_to is not None else derivative_dir

    rows = sorted(raw_images.select(["image_id", "path"]).to_pylist(), key=lambda r: r["image_id"])
    declared_sha: dict[str, str | None] = {}
    if "sha256" in raw_images.column_names:
        declared_sha = dict(
            zip(raw_images.column("image_id").to_pylist(), raw_images.column("sha256").to_pylist(), strict=True)
        )
    limits = cfg.limits
    tasks: list[_Task] = [
        (r["image_id"], r["path"], str(raw_dir), str(derivative_dir), limits) for r in rows
    ]
    results = _probe_all(tasks, cfg.workers, progress)

    rejects: list[dict[str, object]] = []
    accepted: list[ProbeResult] = []
    for r in results:
        if r.ok:
            accepted.append(r)
            want = declared_sha.get(r.image_id)
            if want and want != r.sha256:
                log.warning("%s: sha256 in raw_images (%s) differs from the file's (%s)", r.image_id, want, r.sha256)
        else:
            rejects.append(_reject_row(r, r.reason or "", r.detail))

    # Exact duplicates: keep most pixels, ties by image_id.
    by_sha: dict[str, list[ProbeResult]] = {}
    for r in accepted:
        by_sha.setdefault(r.sha256 or "", []).append(r)
    survivors: list[ProbeResult] = []
    dropped: list[ProbeResult] = []
    for group in by_sha.values():
        group.sort(key=_keep_order)
        keep = group[0]
        survivors.append(keep)
        for r in group[1:]:
            dropped.append(r)
            rejects.append(
                _reject_row(r, "exact_duplicate", f"identical bytes to {keep.image_id} (sha256 {keep.sha256})")
            )

    # Near duplicates: greedy over (pixels desc, image_id).
    survivors.sort(key=_keep_order)
    kept: list[ProbeResult] = []
    kept_hashes = np.zeros(len(survivors), dtype=np.uint64)
    all_hashes = hashes_to_array([r.phash or "0" * 16 for r in survivors])
    min_kept_gap = 65
    for i, r in enumerate(survivors):
        if kept:
            dist = hamming_to_many(int(all_hashes[i]), kept_hashes[: len(kept)])
            j = int(np.argmin(dist))  # first minimum = the earliest (largest) kept file
            d = int(dist[j])
            if d <= cfg.phash_hamming:
                dropped.append(r)
                rejects.append(
                    _reject_row(
                        r,
                        "near_duplicate",
                        f"phash distance {d} <= {cfg.phash_hamming} to {kept[j].image_id} "
                        f"({kept[j].width}x{kept[j].height} kept over {r.width}x{r.height})",
                    )
                )
                continue
            min_kept_gap = min(min_kept_gap, d)
        kept_hashes[len(kept)] = all_hashes[i]
        kept.append(r)
    if len(kept) > 1:
        log.info("curate: smallest phash distance between two kept images: %d (threshold %d)", min_kept_gap, cfg.phash_hamming)

    for r in dropped:
        if r.derivative:
            try:
                (derivative_dir / r.derivative).unlink()
            except FileNotFoundError:
                pass

    curated_rows = [
        {
            "image_id": r.image_id,
            "path": r.path,
            "derivative": (
                os.path.relpath(derivative_dir / r.derivative, rel_root) if r.derivative else None
            ),
            "sha256": r.sha256,
            "width": r.width,
            "height": r.height,
            "mode": r.mode,
            "phash": r.phash,
            "quality": r.quality,
        }
        for r in sorted(kept, key=lambda r: r.image_id)
    ]
    rejects.sort(key=lambda x: str(x["image_id"]))

    ids_in = {r["image_id"] for r in rows}
    ids_cur = [r["image_id"] for r in curated_rows]
    ids_rej = [r["image_id"] for r in rejects]
    assert len(ids_cur) + len(ids_rej) == len(rows), "curate lost or duplicated rows"
    assert set(ids_cur) | set(ids_rej) == ids_in and not set(ids_cur) & set(ids_rej), (
        "every raw image must be in exactly one of curated / rejects"
    )
    curated = pa.Table.from_pylist(curated_rows, schema=CURATED)
    rejected = pa.Table.from_pylist(rejects, schema=REJECTS)
    return curated, rejected


def summarize(curated: pa.Table, rejects: pa.Table) -> dict[str, int]:
    """Counts per outcome: ``{"curated": n, "<reason>": n, ...}`` (for logs and metrics)."""
    out: dict[str, int] = {"curated": curated.num_rows}
    for reason in rejects.column("reason").to_pylist():
        out[reason] = out.get(reason, 0) + 1
    return out


__all__ = ["CurateConfig", "curate_pool", "summarize"]
