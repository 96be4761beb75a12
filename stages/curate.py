"""The ``curate`` stage: keep high-resolution, unique, decodable images; say why others went.

Wraps :func:`mars.curate.pool.curate_pool` (header-first probing, bomb refusal without
decoding, EXIF orientation, mode conversion to RGB derivatives, sha256 and perceptual-hash
de-duplication, a sharpness score; parallel over a process pool with a progress bar).
Writes ``curated.parquet``, ``rejects.parquet`` and ``derivatives/`` into one output
directory that replaces the previous one only when every check passed: every raw image
lands in exactly one of the two tables, and both pass their quality suites.

Every raw file counts, whatever it is: a source hands over everything it found (a folder's
empty files, text files, directories named like images, links out of it: :mod:`mars.world.folder`)
and curation rejects each with a reason. For the URL source, the URLs that never became a raw
image (the world stage's ``download_failures.parquet``, read from beside ``raw_images``) are added
to ``rejects`` too (:func:`mars.curate.download.failures_as_rejects`), so every URL ends in one
of the two tables.

For the generated world, each planted trap's ``expected_reason`` is compared with the
reason curation gave; ``planted_recall`` (share of traps handled as expected) is a metric.

Deviation from the paper: the paper curates real 4K photos by hand-tuned filters we do not
know; ours are documented in :mod:`mars.curate.probe` and tuned on the generated traps.

Run: ``python -m stages.curate --raw-images data/world/raw_images.parquet --raw-dir
data/world/raw --out data/curate --metrics metrics/curate.json``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from mars.data.io import atomic_dir, read_table
from mars.data.quality import write_artifacts
from mars.data.schemas import DOWNLOAD_FAILURES, RAW_IMAGES
from mars.stage import expected_errors, stage_args, write_metrics

SECTION = "curate"
FAILURES_FILE = "download_failures.parquet"  # the world stage's, for source=urls; beside raw_images
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    min_short_side: int = 1024
    min_pixels: int = 2_000_000
    max_aspect: float = 3.0
    max_pixels: int = 100_000_000  # declared canvas above this is a decompression bomb
    phash_hamming: int = 10
    quality_threshold: float = 5.0
    workers: int = 0  # 0 = one process per core


def check_partition(raw_ids: list[str], curated_ids: list[str], reject_ids: list[str]) -> None:
    """Every raw image in exactly one of curated / rejects, or a clear error."""
    both = set(curated_ids) & set(reject_ids)
    lost = set(raw_ids) - set(curated_ids) - set(reject_ids)
    extra = (set(curated_ids) | set(reject_ids)) - set(raw_ids)
    if both or lost or extra:
        raise RuntimeError(
            f"curate: partition broken: in both tables {sorted(both)[:5]}, in neither {sorted(lost)[:5]}, "
            f"unknown {sorted(extra)[:5]}"
        )


def _add_url_rejects(rejects: pa.Table, url_rejects: pa.Table, curated_ids: list[str]) -> pa.Table:
    """``rejects`` plus the URL source's failures, sorted by image_id; their ids must be new."""
    taken = set(rejects.column("image_id").to_pylist()) | set(curated_ids)
    clash = set(url_rejects.column("image_id").to_pylist()) & taken
    if clash:
        raise RuntimeError(f"curate: download failure ids {sorted(clash)[:5]} clash with raw image ids; "
                           "rerun the world stage")
    merged = pa.concat_tables([rejects, url_rejects])
    return merged.take(pc.sort_indices(merged, sort_keys=[("image_id", "ascending")]))


def planted_outcomes(raw: list[dict], reasons: dict[str, str]) -> dict[str, dict]:
    """For each planted trap: its expected reason and what curation gave (None = kept).

    Of two identical files either may be the one kept, so an exact duplicate counts as
    handled when any file with its bytes was rejected as ``exact_duplicate``.
    """
    by_sha: dict[str, set] = {}
    for r in raw:
        by_sha.setdefault(r["sha256"], set()).add(reasons.get(r["image_id"]))
    out = {}
    for r in raw:
        if r["planted_case"]:
            got = reasons.get(r["image_id"])
            if r["expected_reason"] == "exact_duplicate" and "exact_duplicate" in by_sha[r["sha256"]]:
                got = "exact_duplicate"
            out[r["planted_case"]] = {"expected": r["expected_reason"], "got": got}
    return out


def run(params: Params, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    from mars.curate.pool import CurateConfig, curate_pool

    raw = read_table(inputs["raw_images"], RAW_IMAGES)
    beside = Path(inputs["raw_images"]).with_name(FAILURES_FILE)
    failures = (read_table(inputs["download_failures"], DOWNLOAD_FAILURES) if inputs.get("download_failures")
                else read_table(beside, DOWNLOAD_FAILURES) if beside.is_file() else None)
    shared = {f.name: getattr(params, f.name) for f in dataclasses.fields(CurateConfig) if f.name != "workers"}
    cfg = CurateConfig(**shared, workers=params.workers or os.cpu_count() or 1)
    t0 = time.perf_counter()
    with atomic_dir(outputs["out"]) as out:
        curated, rejects = curate_pool(raw, inputs["raw_dir"], out / "derivatives", cfg, relative_to=out)
        check_partition(
            raw.column("image_id").to_pylist(),
            curated.column("image_id").to_pylist(),
            rejects.column("image_id").to_pylist(),
        )
        if failures is not None and failures.num_rows:
            from mars.curate.download import failures_as_rejects

            rejects = _add_url_rejects(rejects, failures_as_rejects(failures), curated.column("image_id").to_pylist())
        write_artifacts({out / "curated.parquet": (curated, "curated"), out / "rejects.parquet": (rejects, "rejects")})
    seconds = time.perf_counter() - t0
    reasons = dict(zip(rejects.column("image_id").to_pylist(), rejects.column("reason").to_pylist()))
    planted = planted_outcomes(raw.to_pylist(), reasons)
    for case, o in sorted(planted.items()):
        if o["expected"] != o["got"]:
            log.warning("planted %s: expected %s, curation gave %s", case, o["expected"] or "kept", o["got"] or "kept")
    metrics = {
        "raw": raw.num_rows,
        "curated": curated.num_rows,
        "rejected": rejects.num_rows,
        **({"download_failures": failures.num_rows} if failures is not None else {}),
        "reasons": dict(sorted(Counter(reasons.values()).items())),
        "images_per_s": round(raw.num_rows / max(seconds, 1e-9), 2),
    }
    if planted:
        metrics["planted_recall"] = round(sum(o["expected"] == o["got"] for o in planted.values()) / len(planted), 4)
    write_metrics(outputs["metrics"], metrics)
    log.info("curate: %s", metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    with expected_errors():
        params, inputs, outputs = stage_args(
            SECTION, Params, argv, inputs=("raw_images", "raw_dir"), outputs=("out", "metrics"),
            optional_inputs=("download_failures",),
        )
        run(params, inputs, outputs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
