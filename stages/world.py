"""The ``world`` stage: the offline stand-in for the web, Wikipedia and 4K news photos.

Generates, from ``base.seed``, the embedded default world (docs/design.md, The embedded default
world; :mod:`mars.world`): entities with emblems and facts, the text corpus, the image-search
gallery, and a raw image pool of high-resolution scenes (plus planted curation traps) with
their world truth. ``source`` picks where the raw pool comes from:

- ``generated`` (default): the scenes and traps above;
- ``folder``: a user's folder of images (``folder``): every entry is handed to curation as it is,
  whatever its name, size or kind, and curation rejects what is not a good image with a reason
  (:mod:`mars.world.folder`); only a missing or empty folder fails the stage;
- ``urls``: a text file of image URLs (``urls_file``, one per line, ``#`` comments),
  downloaded with bounded concurrency, retries and checks (:mod:`mars.curate.download`); the
  URLs that fail are listed in ``download_failures.parquet``, which the curate stage adds to its
  rejects.

Entities, corpus and gallery are generated for every source. Outputs go to one directory
(``raw/``, ``gallery/`` and the parquet tables, each checked by its quality suite) that
replaces the previous one atomically only when everything passed.

Deviation from the paper: the paper's images are real 4K news photos and its knowledge the
live web; ours are generated so every step's ground truth is known (docs/design.md, The
embedded default world). ``folder`` / ``urls`` paths are params (user-provided data), not
dvc.yaml deps: rerun with ``dvc repro -f world`` after changing the folder's contents.

Run: ``python -m stages.world --out data/world --metrics metrics/world.json``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mars.data.io import atomic_dir
from mars.data.quality import write_artifacts
from mars.data.schemas import DOWNLOAD_FAILURES
from mars.data.suites import rows
from mars.stage import expected_errors, stage_args, write_metrics
from mars.world.generate import WorldSpec, generate_world
from mars.world.scenes import write_scene

SECTION = "world"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params(WorldSpec):
    """The ``world`` section: every :class:`~mars.world.generate.WorldSpec` knob plus the source."""

    emblem_frac: float = 0.12  # the generator's default is the tests' small-emblem world; the pipeline's are larger
    source: Literal["generated", "folder", "urls"] = "generated"
    folder: str = ""  # source=folder: directory of images
    urls_file: str = ""  # source=urls: text file with one URL per line
    workers: int = 0  # 0: one per CPU core
    download_concurrency: int = 8
    download_timeout_s: float = 10.0
    download_retries: int = 3
    download_max_bytes: int = 50_000_000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.source == "folder" and not self.folder:
            raise ValueError("source is 'folder' but 'folder' is empty: set world.folder to a directory of images")
        if self.source == "urls" and not self.urls_file:
            raise ValueError("source is 'urls' but 'urls_file' is empty: set world.urls_file to a list of URLs")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0 = one per core), got {self.workers}")


def world_spec(params: Params) -> WorldSpec:
    """The generator's spec for these params (no scenes or traps for a user-provided pool)."""
    values = {f.name: getattr(params, f.name) for f in dataclasses.fields(WorldSpec)}
    if params.source != "generated":
        values.update(n_scenes=0, planted=False)
    return WorldSpec(**values)


def read_url_list(path: str | Path) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"world.urls_file {path}: not found; give a text file with one image URL per line")
    urls = [ln.strip() for ln in path.read_text().splitlines()]
    urls = [u for u in urls if u and not u.startswith("#")]
    if not urls:
        raise ValueError(f"world.urls_file {path}: holds no URLs (one per line, '#' starts a comment)")
    return urls


def run(params: Params, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    workers = params.workers or os.cpu_count() or 1
    t0 = time.perf_counter()
    metrics: dict = {"source": params.source}
    if params.source == "folder":  # a missing or empty folder fails before any work, in one line
        from mars.world.folder import check_folder

        check_folder(params.folder)
    with atomic_dir(outputs["out"]) as out:
        spec = world_spec(params)
        tables = generate_world(spec, out / "raw", out / "gallery", progress=True, workers=workers)
        write_scene(spec.scene_config(), out)  # the scene knobs, for the stages that draw scenes like these
        raw_images = tables.raw_images
        if params.source == "folder":
            from mars.world.folder import ingest_folder

            raw_images = ingest_folder(params.folder, out / "raw")
        elif params.source == "urls":
            from mars.curate.download import download_urls

            raw_images, failures = download_urls(
                read_url_list(params.urls_file),
                out / "raw",
                concurrency=params.download_concurrency,
                timeout_s=params.download_timeout_s,
                retries=params.download_retries,
                max_bytes=params.download_max_bytes,
            )
            metrics["download_failures"] = failures.num_rows
            for row in failures.to_pylist():
                log.warning("download failed: %s: %s (%s)", row["url"], row["reason"], row["detail"])
        artifacts = dict(tables.as_dict(), raw_images=raw_images)
        # always written (empty but for source=urls), so the curate stage's dvc.yaml deps can name it
        artifacts["download_failures"] = failures if params.source == "urls" else DOWNLOAD_FAILURES.empty_table()
        write_artifacts(
            {out / f"{name}.parquet": (table, name) for name, table in artifacts.items()},
            extra={"world_truth": [rows(1)]} if params.source == "generated" else None,
        )
    truth = tables.world_truth.to_pylist()
    metrics.update(
        entities=tables.entities.num_rows,
        documents=tables.corpus.num_rows,
        gallery_images=tables.gallery.num_rows,
        raw_images=raw_images.num_rows,
        planted=sum(1 for c in raw_images.column("planted_case").to_pylist() if c),
        scenes=len({r["scene_id"] for r in truth}),
        max_target_area_frac=max(
            ((r["x1"] - r["x0"]) * (r["y1"] - r["y0"]) / (r["scene_width"] * r["scene_height"]) for r in truth if r["is_target"]),
            default=0.0,
        ),
        seconds=round(time.perf_counter() - t0, 1),
    )
    write_metrics(outputs["metrics"], metrics)
    log.info("world: %s", metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    with expected_errors():
        params, inputs, outputs = stage_args(SECTION, Params, argv, outputs=("out", "metrics"))
        if params.source == "folder" and not Path(params.folder).is_dir():  # before any work: fail fast
            from mars.errors import InputError

            why = "is not a directory" if Path(params.folder).exists() else "does not exist"
            raise InputError(f"world.folder {params.folder!r} {why}; set world.folder to a directory of images")
        if params.source == "urls" and not Path(params.urls_file).is_file():
            from mars.errors import MissingInputError

            raise MissingInputError(f"world.urls_file {params.urls_file!r}: not found; set it to a text file with "
                                    "one image URL per line")
        run(params, inputs, outputs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
