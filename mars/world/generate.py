"""Generate the embedded default world: entities, corpus, gallery, raw image pool, world truth.

The world is an offline stand-in for the web, Wikipedia and 4K news photos (docs/design.md, The
embedded default world):

- entities with a procedural emblem and facts (kind, founding year, city, founder), plus
  distractor entities with similar names that exist only in the corpus;
- a text corpus: several short documents per entity stating its facts in varied wording
  (:mod:`mars.world.text`);
- a gallery: several renderings of each real entity's emblem, split "index" / "heldout";
- a raw image pool: high-resolution scenes (see :mod:`mars.world.scenes`) and, when
  ``planted``, the curation traps of :mod:`mars.world.planted`;
- the world truth: every emblem of every scene with its pixel box and whether it is the target.

Everything is seeded per item (``np.random.default_rng([seed, stream, index])``), so the same
:class:`WorldSpec` always gives byte-identical files and equal tables, whatever ``workers`` is.

Python::

    from mars.world.generate import WorldSpec, generate_world
    tables = generate_world(WorldSpec.smoke(), raw_dir, gallery_dir)

From the command line, run the ``world`` stage: ``python -m stages.world --out DIR --metrics FILE``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
from PIL import Image
from tqdm import tqdm

from mars.data.schemas import CORPUS, ENTITIES, GALLERY, RAW_IMAGES, WORLD_TRUTH
from mars.world import planted as pl
from mars.world.emblems import colour_schemes, emblem_json, random_emblem, render_gallery_image
from mars.world.scenes import SceneConfig, SceneInfo, long_side_range, render_clutter, render_scene, size_multiple
from mars.world.text import (
    Facts,
    KINDS,
    different_facts,
    distractor_name,
    entity_documents,
    entity_name,
    make_cities,
    make_facts,
    make_word,
)

# Independent random streams: rng = default_rng([seed, STREAM, index...]).
STREAM_CITIES, STREAM_ENTITY, STREAM_DISTRACTOR, STREAM_DOCS = 1, 2, 3, 4
STREAM_GALLERY, STREAM_SCENE, STREAM_PLANTED, STREAM_IDS, STREAM_SCHEMES = 5, 6, 7, 8, 9

GALLERY_SUFFIXES: tuple[str, ...] = ("", "", " logo", " emblem", " crest", " insignia", " badge")
CUE = "red_frame"
SOURCE = "generated"
REPAIRABLE_MIN_LONG_SIDE = 2048

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class WorldSpec:
    """Every size knob of the generated world, with the default profile's values.

    ``difficulty`` (recorded in world_truth) is derived: ``max(grid_rows, grid_cols) - 2 + decoys``
    (0 = 2x2 grid without decoys, the learnable default; 1 = 3x3 or one decoy; ...)."""

    seed: int = 0
    n_entities: int = 400
    n_distractors: int = 60
    docs_per_entity: int = 3
    gallery_per_entity: int = 5
    heldout_per_entity: int = 1
    gallery_size: int = 256
    n_scenes: int = 100
    scene_long_side_min: int = 2048
    scene_long_side_max: int = 3840
    emblems_per_scene_min: int = 3
    emblems_per_scene_max: int = 6
    emblem_frac: float = 0.05
    target_zone: float = 0.4  # the target lies in this central share (per axis) of its cell
    grid_rows: int = 2
    grid_cols: int = 2
    frame_thickness_frac: float = 0.02
    decoys: int = 0
    planted: bool = True
    jpeg_quality: int = 90
    colour_schemes: int = 6  # shared colour schemes (0 = every emblem draws its own colours)

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ValueError(f"WorldSpec: {what}")

        need(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        need(self.n_entities >= 1, f"n_entities must be >= 1, got {self.n_entities}")
        need(self.n_distractors >= 0, f"n_distractors must be >= 0, got {self.n_distractors}")
        need(self.docs_per_entity >= 1, f"docs_per_entity must be >= 1, got {self.docs_per_entity}")
        need(0 <= self.heldout_per_entity < self.gallery_per_entity,
             f"need 0 <= heldout_per_entity < gallery_per_entity, got {self.heldout_per_entity} and "
             f"{self.gallery_per_entity}")
        need(32 <= self.gallery_size <= 4096, f"gallery_size must be in 32..4096, got {self.gallery_size}")
        need(self.n_scenes >= (1 if self.planted else 0),
             f"n_scenes must be >= 1 when planted (near duplicates copy scenes), got {self.n_scenes}")
        need(256 <= self.scene_long_side_min <= self.scene_long_side_max,
             f"need 256 <= scene_long_side_min <= scene_long_side_max, got {self.scene_long_side_min}, "
             f"{self.scene_long_side_max}")
        need(1 <= self.emblems_per_scene_min <= self.emblems_per_scene_max <= self.n_entities,
             f"need 1 <= emblems_per_scene_min <= emblems_per_scene_max <= n_entities, got "
             f"{self.emblems_per_scene_min}, {self.emblems_per_scene_max}, {self.n_entities}")
        need(0.005 <= self.emblem_frac <= 0.2, f"emblem_frac must be in 0.005..0.2, got {self.emblem_frac}")
        need(0.1 <= self.target_zone <= 1.0, f"target_zone must be in 0.1..1.0, got {self.target_zone}")
        need(self.grid_rows >= 1 and self.grid_cols >= 1 and self.grid_rows * self.grid_cols >= 2,
             f"the grid needs at least 2 cells, got {self.grid_rows}x{self.grid_cols}")
        need(0 < self.frame_thickness_frac <= 0.1,
             f"frame_thickness_frac must be in (0, 0.1], got {self.frame_thickness_frac}")
        # the largest target (size jitter x1.15, rotated up to 20 degrees: x(cos 20 + sin 20) = x1.28) must fit the
        # central zone of its cell, with 10% to spare for pixel rounding in small scenes (the localisation drills
        # render scenes of ~500 px; target_zone 0.15 passed the 4K world and failed there)
        zone_min = 1.1 * 1.15 * 1.2817 * self.emblem_frac * max(self.grid_rows, self.grid_cols)
        need(self.target_zone >= zone_min,
             f"target_zone {self.target_zone} is too small for emblem_frac {self.emblem_frac} on a "
             f"{self.grid_rows}x{self.grid_cols} grid: the largest target emblem would not fit the central zone of "
             f"its cell; raise target_zone to >= {zone_min:.3f} or lower emblem_frac")
        need(0 <= self.decoys < self.grid_rows * self.grid_cols,
             f"decoys must be in 0..{self.grid_rows * self.grid_cols - 1}, got {self.decoys}")
        try:
            long_side_range(self.scene_long_side_min, self.scene_long_side_max, self.grid_rows, self.grid_cols)
        except ValueError as exc:
            raise ValueError(f"WorldSpec: {exc}") from None
        need(30 <= self.jpeg_quality <= 100, f"jpeg_quality must be in 30..100, got {self.jpeg_quality}")

    @property
    def difficulty(self) -> int:
        """Curriculum level of the cue: 0 for a 2x2 grid without decoys."""
        return max(0, max(self.grid_rows, self.grid_cols) - 2) + self.decoys

    def scene_config(self, long_side_min: int | None = None, long_side_max: int | None = None) -> SceneConfig:
        """The scene knobs (optionally with other long-side bounds)."""
        return SceneConfig(
            long_side_min=long_side_min or self.scene_long_side_min,
            long_side_max=long_side_max or self.scene_long_side_max,
            grid_rows=self.grid_rows, grid_cols=self.grid_cols,
            frame_thickness_frac=self.frame_thickness_frac, decoys=self.decoys,
            emblem_frac=self.emblem_frac, target_zone=self.target_zone, emblems_min=self.emblems_per_scene_min,
            emblems_max=self.emblems_per_scene_max,
        )

    @classmethod
    def smoke(cls, seed: int = 0, **overrides: Any) -> "WorldSpec":
        """A tiny world for tests and smoke runs (a few seconds)."""
        base = dict(seed=seed, n_entities=12, n_distractors=4, docs_per_entity=2, gallery_per_entity=4,
                    heldout_per_entity=1, gallery_size=128, n_scenes=4, scene_long_side_min=2048,
                    scene_long_side_max=2048, emblems_per_scene_min=2, emblems_per_scene_max=4)
        base.update(overrides)
        return cls(**base)


@dataclass(frozen=True)
class WorldTables:
    """The five tables of a generated world (schemas in :mod:`mars.data.schemas`)."""

    entities: pa.Table
    corpus: pa.Table
    gallery: pa.Table
    raw_images: pa.Table
    world_truth: pa.Table

    def as_dict(self) -> dict[str, pa.Table]:
        """Artifact name -> table."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class Entity:
    """One entity (real or distractor) before it becomes a table row."""

    entity_id: str
    word: str
    name: str
    facts: Facts
    emblem: str  # canonical JSON
    is_distractor: bool


# --- entities and corpus ---------------------------------------------------------------------


def make_entities(spec: WorldSpec) -> list[Entity]:
    """Real entities (unique word, name and emblem) followed by distractors (similar names,
    different facts). Deterministic in ``spec.seed``."""
    cities = make_cities(np.random.default_rng([spec.seed, STREAM_CITIES]), max(12, spec.n_entities // 4))
    words: set[str] = set()
    names: set[str] = set()
    emblems: set[str] = set()
    schemes = colour_schemes(np.random.default_rng([spec.seed, STREAM_SCHEMES]), spec.colour_schemes)
    out: list[Entity] = []
    for i in range(spec.n_entities):
        rng = np.random.default_rng([spec.seed, STREAM_ENTITY, i])
        while True:
            word, kind = make_word(rng), KINDS[int(rng.integers(len(KINDS)))]
            if word not in words:
                break
        facts = make_facts(rng, cities, kind)
        while True:
            emblem = emblem_json(random_emblem(rng, schemes))
            if emblem not in emblems:
                break
        name = entity_name(word, kind)
        words.add(word)
        names.add(name)
        emblems.add(emblem)
        out.append(Entity(f"e{i:04d}", word, name, facts, emblem, False))

    bases = np.random.default_rng([spec.seed, STREAM_DISTRACTOR]).permutation(spec.n_entities)
    for k in range(spec.n_distractors):
        rng = np.random.default_rng([spec.seed, STREAM_DISTRACTOR, k])
        base = out[int(bases[k % spec.n_entities])]
        style = "letter" if k % 2 == 0 else "shared_word"
        for attempt in range(1000):
            word, kind, name = distractor_name(rng, base.word, base.facts.kind, style)
            real_word_clash = style == "letter" and word in words
            if name not in names and not real_word_clash:
                break
            if attempt > 20:
                style = "letter" if style == "shared_word" else "shared_word"
        else:  # pragma: no cover - needs a pathological seed
            raise RuntimeError(f"could not find a distractor name for {base.name!r}")
        names.add(name)
        facts = different_facts(rng, base.facts, cities, kind)
        out.append(Entity(f"x{k:04d}", word, name, facts, emblem_json(random_emblem(rng, schemes)), True))
    return out


def entity_rows(entities: Sequence[Entity]) -> list[dict[str, Any]]:
    """Rows of the ENTITIES table."""
    return [dict(entity_id=e.entity_id, name=e.name, kind=e.facts.kind, founded_year=e.facts.founded_year,
                 city=e.facts.city, founder=e.facts.founder, emblem=e.emblem, is_distractor=e.is_distractor)
            for e in entities]


def corpus_rows(spec: WorldSpec, entities: Sequence[Entity]) -> list[dict[str, Any]]:
    """Rows of the CORPUS table: ``docs_per_entity`` documents per entity, ids ``<entity_id>-<j>``."""
    rows = []
    for k, e in enumerate(entities):
        rng = np.random.default_rng([spec.seed, STREAM_DOCS, k])
        docs = entity_documents(rng, e.name, e.facts, spec.docs_per_entity)
        for j, (title, text) in enumerate(docs):
            rows.append(dict(doc_id=f"{e.entity_id}-{j}", entity_id=e.entity_id, title=title, text=text,
                             is_distractor=e.is_distractor))
    return rows


# --- parallel map ---------------------------------------------------------------------------


def parallel_map(fn: Callable[[T], R], items: Sequence[T], workers: int, desc: str, progress: bool) -> list[R]:
    """``[fn(x) for x in items]`` in order, in a process pool when ``workers`` > 1."""
    bar = dict(total=len(items), desc=desc, disable=not progress, unit="img", leave=False)
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in tqdm(items, **bar)]
    chunk = max(1, len(items) // (workers * 8))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(tqdm(pool.map(fn, items, chunksize=chunk), **bar))


def _write(path: Path, data: bytes) -> tuple[int, str]:
    path.write_bytes(data)
    return len(data), hashlib.sha256(data).hexdigest()


# --- gallery --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GalleryTask:
    """One gallery rendering: entity, rendering index ``j``, split and where to write it."""

    seed: int
    entity_index: int
    j: int
    entity_id: str
    name: str
    emblem: str
    size: int
    heldout: bool
    jpeg_quality: int
    gallery_dir: str


def render_gallery_task(task: GalleryTask) -> dict[str, Any]:
    """Render and write one gallery image; returns its GALLERY row."""
    rng = np.random.default_rng([task.seed, STREAM_GALLERY, task.entity_index, task.j])
    img = render_gallery_image(json.loads(task.emblem), rng, task.size)
    title = task.name + GALLERY_SUFFIXES[int(rng.integers(len(GALLERY_SUFFIXES)))]
    fmt = "PNG" if rng.random() < 0.5 else "JPEG"
    rel = f"{task.entity_id}-{task.j}.{'png' if fmt == 'PNG' else 'jpg'}"
    _write(Path(task.gallery_dir) / rel, pl.encode(img, fmt, task.jpeg_quality))
    return dict(gallery_id=f"g-{task.entity_id}-{task.j}", entity_id=task.entity_id, title=title, path=rel,
                split="heldout" if task.heldout else "index", width=img.width, height=img.height)


def gallery_tasks(spec: WorldSpec, entities: Sequence[Entity], gallery_dir: Path) -> list[GalleryTask]:
    """One task per gallery rendering of each real entity (heldout ones picked per entity)."""
    tasks = []
    for i, e in enumerate(x for x in entities if not x.is_distractor):
        rng = np.random.default_rng([spec.seed, STREAM_GALLERY, i])
        held = set(int(h) for h in rng.choice(spec.gallery_per_entity, spec.heldout_per_entity, replace=False))
        for j in range(spec.gallery_per_entity):
            tasks.append(GalleryTask(spec.seed, i, j, e.entity_id, e.name, e.emblem, spec.gallery_size,
                                     j in held, spec.jpeg_quality, str(gallery_dir)))
    return tasks


# --- raw pool: scenes and planted traps ------------------------------------------------------


@dataclass(frozen=True)
class RawTask:
    """One file of the raw pool rendered from scratch: an ordinary scene, a repairable scene, or
    an independent trap image (``case``)."""

    seed: int
    stream: int
    index: int
    image_id: str
    scene_id: str | None
    case: str | None  # None: ordinary scene
    fmt: str
    cfg: SceneConfig
    emblems: tuple[str, ...]
    entity_ids: tuple[str, ...]
    difficulty: int
    jpeg_quality: int
    raw_dir: str


def _truth_rows(task: RawTask, info: SceneInfo) -> list[dict[str, Any]]:
    return [dict(scene_id=task.scene_id, image_id=task.image_id, entity_id=task.entity_ids[p.entity_index],
                 x0=p.box[0], y0=p.box[1], x1=p.box[2], y1=p.box[3], is_target=p.is_target,
                 scene_width=info.width, scene_height=info.height, grid_rows=info.grid_rows,
                 grid_cols=info.grid_cols, cell_row=p.cell[0], cell_col=p.cell[1], cue=CUE,
                 difficulty=task.difficulty, target_zone=info.target_zone)
            for p in info.placements]


def _encode_case(task: RawTask, rng: np.random.Generator) -> tuple[bytes, str, SceneInfo | None]:
    """(file bytes, extension, scene info or None) for one raw task."""
    q = task.jpeg_quality
    case = task.case
    if case is None:
        img, info = render_scene(rng, task.cfg, [json.loads(e) for e in task.emblems],
                                 noise_block=4 if task.fmt == "PNG" else 1)
        return pl.encode(img, task.fmt, q), "png" if task.fmt == "PNG" else "jpg", info
    if case in pl.REPAIRABLE:
        img, info = render_scene(rng, task.cfg, [json.loads(e) for e in task.emblems], noise_block=4)
        if case == "exif_rotated":
            stored, exif = pl.exif_rotated(img, 6)
            return pl.encode(stored, "JPEG", q, exif=exif), "jpg", info
        if case == "cmyk":
            return pl.encode(img.convert("CMYK"), "JPEG", q), "jpg", info
        if case == "16bit":
            return pl.encode(pl.to_16bit(img), "PNG"), "png", None  # grayscale: the red cue is gone
        if case == "palette":
            return pl.encode(pl.to_palette(img), "PNG"), "png", info
        return pl.encode(pl.to_alpha(img), "PNG"), "png", info
    if case == "low_res":
        return pl.encode(render_clutter(rng, *pl.LOW_RES_SIZE), "JPEG", q), "jpg", None
    if case == "bad_aspect":
        return pl.encode(render_clutter(rng, *pl.BAD_ASPECT_SIZE), "JPEG", q), "jpg", None
    if case == "low_quality":
        return pl.encode(pl.low_quality_image(rng), "JPEG", q), "jpg", None
    if case == "truncated":
        return pl.truncate(pl.encode(render_clutter(rng, *pl.TRUNCATED_SIZE), "JPEG", q)), "jpg", None
    raise ValueError(f"no renderer for planted case {case!r}")


def render_raw_task(task: RawTask) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Render and write one raw-pool file; returns its RAW_IMAGES row and its WORLD_TRUTH rows."""
    rng = np.random.default_rng([task.seed, task.stream, task.index])
    data, ext, info = _encode_case(task, rng)
    rel = f"{task.image_id}.{ext}"
    n, sha = _write(Path(task.raw_dir) / rel, data)
    scene_id = task.scene_id if info is not None else None
    row = dict(image_id=task.image_id, path=rel, source=SOURCE, scene_id=scene_id, planted_case=task.case,
               expected_reason=pl.PLANTED_CASES.get(task.case) if task.case else None, bytes=n, sha256=sha)
    return row, (_truth_rows(task, info) if info is not None and scene_id is not None else [])


def _derived_bytes(case: str, src: Path, jpeg_quality: int) -> tuple[bytes, str]:
    """Bytes and extension of a duplicate / near duplicate of the scene file ``src``."""
    ext = src.suffix.lstrip(".")
    fmt = "PNG" if ext == "png" else "JPEG"
    if case == "exact_dup":
        return src.read_bytes(), ext
    with Image.open(src) as im:
        img = im.convert("RGB")
    if case == "near_dup_reencode":  # same pixels, lower JPEG quality: fewer bytes than the original
        return pl.encode(img, "JPEG", max(30, jpeg_quality - 20)), "jpg"
    if case == "near_dup_resize":
        return pl.encode(pl.near_dup_resize(img), fmt, jpeg_quality), ext
    if case == "near_dup_crop":
        return pl.encode(pl.near_dup_crop(img), fmt, jpeg_quality), ext
    raise ValueError(f"unknown derived case {case!r}")


def _planted_bytes(case: str, rng: np.random.Generator, name: str) -> tuple[bytes, str]:
    if case == "corrupt":
        return pl.corrupt_png_bytes(rng), "png"
    if case == "not_an_image":
        return pl.not_an_image_bytes(name), "jpg"
    if case == "bomb":
        return pl.bomb_png_bytes(), "png"
    raise ValueError(f"unknown planted case {case!r}")


def image_ids(seed: int, n: int) -> list[str]:
    """Neutral, shuffled image ids ``img-00000`` .. for the ``n`` raw-pool files, so traps are not
    told apart by their name or position."""
    perm = np.random.default_rng([seed, STREAM_IDS]).permutation(n)
    return [f"img-{int(p):05d}" for p in perm]


# --- the world ------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=schema)


def generate_world(spec: WorldSpec, raw_dir: str | Path, gallery_dir: str | Path, progress: bool = True,
                   workers: int = 1) -> WorldTables:
    """Generate the world described by ``spec``: write the raw pool into ``raw_dir`` and the gallery
    into ``gallery_dir`` (created if missing; files of the same names are overwritten, others left
    alone) and return the tables. Paths in the tables are relative to those directories.

    ``workers`` > 1 renders images in a process pool; the output is identical for any value."""
    raw_dir, gallery_dir = Path(raw_dir), Path(gallery_dir)
    raw_dir.mkdir(parents=True, exist_ok=True)
    gallery_dir.mkdir(parents=True, exist_ok=True)

    entities = make_entities(spec)
    real = [e for e in entities if not e.is_distractor]
    gallery = parallel_map(render_gallery_task, gallery_tasks(spec, entities, gallery_dir), workers,
                           "gallery", progress)

    emblems = tuple(e.emblem for e in real)
    ent_ids = tuple(e.entity_id for e in real)
    cases = list(pl.PLANTED_CASES) if spec.planted else []
    ids = image_ids(spec.seed, spec.n_scenes + len(cases))
    cfg = spec.scene_config()
    tasks = [RawTask(spec.seed, STREAM_SCENE, i, ids[i], f"scene-{i:04d}", None, "JPEG" if i % 2 == 0 else "PNG",
                     cfg, emblems, ent_ids, spec.difficulty, spec.jpeg_quality, str(raw_dir))
             for i in range(spec.n_scenes)]
    lo = max(REPAIRABLE_MIN_LONG_SIDE, spec.scene_long_side_min)
    rep_cfg = spec.scene_config(lo, max(lo + size_multiple(spec.grid_rows, spec.grid_cols), spec.scene_long_side_max))
    n_scene_ids = spec.n_scenes
    for k, case in enumerate(cases):
        if case in pl.DERIVED or case in ("corrupt", "not_an_image", "bomb"):
            continue
        scene_id = None
        if case in pl.SCENE_REPAIRABLE:
            scene_id, n_scene_ids = f"scene-{n_scene_ids:04d}", n_scene_ids + 1
        tasks.append(RawTask(spec.seed, STREAM_PLANTED, k, ids[spec.n_scenes + k], scene_id, case, "", rep_cfg,
                             emblems, ent_ids, spec.difficulty, spec.jpeg_quality, str(raw_dir)))
    results = parallel_map(render_raw_task, tasks, workers, "scenes", progress)
    raw_rows = [r for r, _ in results]
    truth_rows = [t for _, ts in results for t in ts]

    scene_paths = [raw_dir / results[i][0]["path"] for i in range(spec.n_scenes)]
    sources = {"exact_dup": 0, "near_dup_reencode": 1, "near_dup_resize": 2, "near_dup_crop": 3}
    # the resized copy must stay above curation's pixel floor: shrink the largest scene
    areas = [ts[0]["scene_width"] * ts[0]["scene_height"] if ts else 0 for _, ts in results[: spec.n_scenes]]
    if areas:
        sources["near_dup_resize"] = int(np.argmax(areas))
    for k, case in enumerate(cases):
        image_id = ids[spec.n_scenes + k]
        if case in pl.DERIVED:
            data, ext = _derived_bytes(case, scene_paths[sources[case] % spec.n_scenes], spec.jpeg_quality)
        elif case in ("corrupt", "not_an_image", "bomb"):
            data, ext = _planted_bytes(case, np.random.default_rng([spec.seed, STREAM_PLANTED, k]), image_id)
        else:
            continue
        rel = f"{image_id}.{ext}"
        n, sha = _write(raw_dir / rel, data)
        raw_rows.append(dict(image_id=image_id, path=rel, source=SOURCE, scene_id=None, planted_case=case,
                             expected_reason=pl.PLANTED_CASES[case], bytes=n, sha256=sha))

    raw_rows.sort(key=lambda r: r["image_id"])
    truth_rows.sort(key=lambda r: (r["scene_id"], not r["is_target"], r["entity_id"]))
    return WorldTables(
        entities=_table(entity_rows(entities), ENTITIES),
        corpus=_table(corpus_rows(spec, entities), CORPUS),
        gallery=_table(gallery, GALLERY),
        raw_images=_table(raw_rows, RAW_IMAGES),
        world_truth=_table(truth_rows, WORLD_TRUTH),
    )
