"""High-resolution scenes: clutter, several small emblems, and one target singled out by a cue.

Geometry (all pure functions, so tests and other stages can recompute it):

- the scene is divided into ``grid_rows`` x ``grid_cols`` equal cells (:func:`cell_box`); width and
  height are multiples of :func:`size_multiple`, so every cell boundary is an exact pixel and an
  exact fraction of the image. Resizing the whole scene to a square of ``k * 28`` px (224 for a
  2x2 grid = 8x8 merged Qwen vision tokens, 252 for 3x3 = 9x9) puts every cell boundary on a token
  boundary;
- the target's cell gets a thick pure-red (255, 0, 0) frame (:func:`frame_box`, thickness
  ``frame_thickness_frac`` of the short side, drawn inside the cell with a small inset so it never
  bleeds into the neighbouring tokens); ``decoys`` other cells get frames in other colours;
- every emblem lies wholly inside the free interior of one cell (:func:`inner_box`), never under
  a frame; the target is alone in its cell, the other emblems share the other cells. Emblems are
  ``emblem_frac`` of the short side (5% by default), so they are about a dozen pixels in the 224-px
  view of the whole scene and clear in a crop of their cell;
- the target lies wholly inside the central ``target_zone`` share (per axis) of its cell
  (:func:`zone_box`; 1.0 = anywhere in the cell). With the default 0.4, "zoom on the middle of the
  framed cell" is a choice among ``grid_rows * grid_cols`` fixed boxes, which a tiny model learns
  (docs/design.md, The embedded default world), and the crop shows the emblem large enough for
  image search to identify it; regressing an emblem's exact box from pixels is not learnable in the
  default budget.

:func:`render_scene` draws one scene and returns the image with a :class:`SceneInfo` (boxes are
tight around the emblem's visible pixels, ``x1``/``y1`` exclusive).

Try it: ``python -m mars.world.scenes OUT.jpg`` renders one scene with random emblems.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
from PIL import Image, ImageChops, ImageDraw

from mars.errors import InputError, MissingInputError
from mars.world.emblems import SHAPES, EmblemSpec, muted_colour, random_emblem, render_emblem, shape_polygon

CUE_COLOUR = (255, 0, 0)
DECOY_COLOURS: tuple[tuple[int, int, int], ...] = (
    (0, 0, 255), (0, 200, 0), (255, 255, 0), (0, 255, 255), (255, 255, 255),
)
ASPECTS: tuple[float, ...] = (4 / 3, 3 / 2, 16 / 9, 1.0, 5 / 4)
ALPHA_BOX_THRESHOLD = 16  # alpha above this counts as a visible emblem pixel for the box


@dataclass(frozen=True)
class SceneConfig:
    """The knobs of one scene (a subset of :class:`mars.world.generate.WorldSpec`)."""

    long_side_min: int = 2048
    long_side_max: int = 3840
    grid_rows: int = 2
    grid_cols: int = 2
    frame_thickness_frac: float = 0.02
    decoys: int = 0
    emblem_frac: float = 0.05
    target_zone: float = 0.4
    emblems_min: int = 3
    emblems_max: int = 6
    # the colour schemes (fill, border, accent) of emblems drawn anew for these scenes (the SFT drills' and captions'
    # emblems, of no entity): () = any palette colours; a world's own (mars.world.emblems.schemes_of) with
    # sft.emblem_colours = world
    schemes: tuple[tuple[str, str, str | None], ...] = ()


SCENE_FILE = "scene.json"  # the world stage writes its SceneConfig here; the stages that draw scenes anew read it


def write_scene(cfg: SceneConfig, world_dir: str | Path) -> None:
    """Save ``cfg`` as ``world_dir/scene.json`` (written atomically), for the stages that draw scenes like the world's."""
    import json

    from mars.data.io import atomic_write_text

    atomic_write_text(Path(world_dir) / SCENE_FILE, json.dumps(asdict(cfg), indent=1, sort_keys=True) + "\n")


def read_scene(world_dir: str | Path) -> SceneConfig:
    """The world's :class:`SceneConfig` from ``world_dir/scene.json`` (:func:`write_scene`), with a clear error when it
    is missing or does not match this code's scene knobs."""
    import json

    path = Path(world_dir) / SCENE_FILE
    if not path.is_file():
        raise MissingInputError(f"{path}: not found; the world stage writes it: rerun it (dvc repro world)")
    values = json.loads(path.read_text())
    known = {f.name for f in fields(SceneConfig)}
    if set(values) != known:
        raise InputError(f"{path}: its keys {sorted(set(values) ^ known)} do not match this code's scene knobs; "
                         "rerun the world stage (dvc repro -f world)")
    values["schemes"] = tuple(tuple(s) for s in values["schemes"])
    return SceneConfig(**values)


@dataclass(frozen=True)
class Placement:
    """One emblem in a scene: which entity (index into the emblem list), where, and its cell."""

    entity_index: int
    box: tuple[int, int, int, int]  # tight box of visible pixels, x1/y1 exclusive
    cell: tuple[int, int]  # (row, col)
    is_target: bool


@dataclass(frozen=True)
class SceneInfo:
    """What was drawn: size, grid, framed cells and every emblem."""

    width: int
    height: int
    grid_rows: int
    grid_cols: int
    target_cell: tuple[int, int]
    decoy_cells: tuple[tuple[int, int], ...]
    frame_thickness: int
    placements: tuple[Placement, ...] = field(default_factory=tuple)
    target_zone: float = 1.0


def size_multiple(grid_rows: int, grid_cols: int) -> int:
    """Scene width and height are multiples of this, so cell boundaries are exact pixels."""
    return math.lcm(grid_rows, grid_cols) * 8


def long_side_range(lo: int, hi: int, grid_rows: int, grid_cols: int) -> tuple[int, int]:
    """Smallest and largest allowed long side: the multiples of :func:`size_multiple` in [lo, hi]."""
    m = size_multiple(grid_rows, grid_cols)
    first, last = -(-lo // m) * m, hi // m * m
    if first > last:
        raise ValueError(f"no scene long side in [{lo}, {hi}] is a multiple of {m} (needed by a "
                         f"{grid_rows}x{grid_cols} grid); widen scene_long_side_min..scene_long_side_max")
    return first, last


def scene_size(rng: np.random.Generator, lo: int, hi: int, grid_rows: int, grid_cols: int) -> tuple[int, int]:
    """Random (width, height): long side in [lo, hi], a common aspect, landscape 3 times in 4.
    Both sides are multiples of :func:`size_multiple`."""
    m = size_multiple(grid_rows, grid_cols)
    first, last = long_side_range(lo, hi, grid_rows, grid_cols)
    long_side = first + m * int(rng.integers(0, (last - first) // m + 1))
    aspect = ASPECTS[int(rng.integers(len(ASPECTS)))]
    short = max(m, int(round(long_side / aspect / m)) * m)
    return (long_side, short) if rng.random() < 0.75 else (short, long_side)


def cell_box(width: int, height: int, grid_rows: int, grid_cols: int, row: int, col: int) -> tuple[int, int, int, int]:
    """Pixel box (x0, y0, x1, y1), x1/y1 exclusive, of cell (row, col): equal fractions of the image."""
    return (col * width // grid_cols, row * height // grid_rows,
            (col + 1) * width // grid_cols, (row + 1) * height // grid_rows)


def frame_thickness(width: int, height: int, frac: float) -> int:
    """Frame thickness in pixels: ``frac`` of the short side, at least 2."""
    return max(2, int(round(frac * min(width, height))))


def frame_inset(thickness: int) -> int:
    """Gap between a cell's edge and its frame, so resampling never bleeds the frame into a
    neighbouring cell."""
    return max(1, thickness // 2)


def frame_box(width: int, height: int, grid_rows: int, grid_cols: int, row: int, col: int,
              thickness: int) -> tuple[int, int, int, int]:
    """Outer box (x1/y1 exclusive) of the frame drawn in cell (row, col); the frame's pixels are the
    band of ``thickness`` pixels just inside this box."""
    x0, y0, x1, y1 = cell_box(width, height, grid_rows, grid_cols, row, col)
    i = frame_inset(thickness)
    return x0 + i, y0 + i, x1 - i, y1 - i


def inner_box(width: int, height: int, grid_rows: int, grid_cols: int, row: int, col: int,
              thickness: int) -> tuple[int, int, int, int]:
    """The free interior of a cell where emblems may lie (inside any frame, with a margin)."""
    x0, y0, x1, y1 = frame_box(width, height, grid_rows, grid_cols, row, col, thickness)
    m = thickness + max(4, thickness // 2)
    return x0 + m, y0 + m, x1 - m, y1 - m


def zone_box(width: int, height: int, grid_rows: int, grid_cols: int, row: int, col: int,
             zone: float) -> tuple[int, int, int, int]:
    """The central ``zone`` share (per axis) of cell (row, col), x1/y1 exclusive: where the target lies."""
    x0, y0, x1, y1 = cell_box(width, height, grid_rows, grid_cols, row, col)
    mx, my = round((x1 - x0) * (1 - zone) / 2), round((y1 - y0) * (1 - zone) / 2)
    return x0 + mx, y0 + my, x1 - mx, y1 - my


def draw_frame(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], thickness: int,
               colour: tuple[int, int, int]) -> None:
    """A rectangular frame of ``thickness`` px just inside ``box`` (x1/y1 exclusive)."""
    x0, y0, x1, y1 = box
    draw.rectangle([x0, y0, x1 - 1, y1 - 1], outline=colour, width=thickness)


def background(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A smooth low-frequency background: random muted blotches upsampled bilinearly."""
    gw, gh = int(rng.integers(3, 9)), int(rng.integers(3, 9))
    base = np.array([muted_colour(rng, 0.35) for _ in range(gw * gh)], dtype=np.uint8).reshape(gh, gw, 3)
    return Image.fromarray(base).resize((width, height), Image.Resampling.BILINEAR)


def draw_clutter(img: Image.Image, rng: np.random.Generator, density: float = 1.0,
                 keep_clear: tuple[int, int, int, int] | None = None) -> None:
    """Random muted shapes, lines, hatching and emblem-sized badges drawn over ``img`` in place.

    ``keep_clear`` (x0, y0, x1, y1): no shape is drawn that could reach into this box (the target's zone, so
    a crop of it shows the emblem on a calm background).
    """
    w, h = img.size
    short = min(w, h)
    d = ImageDraw.Draw(img)
    n = int(density * max(40, w * h / 45000))
    for _ in range(n):
        kind = int(rng.integers(7))
        x, y = int(rng.integers(-short // 10, w)), int(rng.integers(-short // 10, h))
        e = int(short * math.exp(rng.uniform(math.log(0.006), math.log(0.22))))
        colour = muted_colour(rng)
        if keep_clear is not None and (x - 2 * e < keep_clear[2] and x + 2 * e > keep_clear[0]
                                       and y - 2 * e < keep_clear[3] and y + 2 * e > keep_clear[1]):
            continue
        if kind == 0:
            d.rectangle([x, y, x + e, y + int(e * rng.uniform(0.2, 1.2))], fill=colour)
        elif kind == 1:
            d.ellipse([x, y, x + e, y + int(e * rng.uniform(0.4, 1.2))], fill=colour)
        elif kind == 2:
            n_pts = int(rng.integers(3, 6))
            d.polygon([(x + int(rng.integers(0, e + 1)), y + int(rng.integers(0, e + 1))) for _ in range(n_pts)],
                      fill=colour)
        elif kind == 3:
            end = (x + int(rng.integers(-2 * e, 2 * e + 1)), y + int(rng.integers(-2 * e, 2 * e + 1)))
            d.line([(x, y), end], fill=colour, width=int(rng.integers(1, max(2, short // 250))))
        elif kind == 4:  # hatching texture patch
            step = max(3, e // 8)
            for k in range(0, e, step):
                d.line([(x + k, y), (x + k + e // 3, y + e)], fill=colour, width=1)
        elif kind == 5:  # arcs
            d.arc([x, y, x + e, y + e], float(rng.uniform(0, 360)), float(rng.uniform(0, 360)), fill=colour,
                  width=int(rng.integers(1, 4)))
        else:  # emblem-sized plain badge (no glyph): a near miss for the eye
            shape = SHAPES[int(rng.integers(len(SHAPES)))]
            r = short * rng.uniform(0.01, 0.025)
            d.polygon(shape_polygon(shape, x, y, r), fill=colour, outline=muted_colour(rng), width=2)


def _noise_tile(rng: np.random.Generator, amplitude: int, block: int) -> np.ndarray:
    """A 256 x 256 x 3 uint8 tile of uniform noise in [0, 2 * amplitude] (``block`` x ``block`` blocks)."""
    cells = 256 // block
    tile = rng.integers(0, 2 * amplitude + 1, (cells, cells, 3), dtype=np.uint8)
    return tile.repeat(block, 0).repeat(block, 1)


def add_tiled_noise(img: Image.Image, rng: np.random.Generator, amplitude: int, block: int = 1) -> Image.Image:
    """Add uniform noise in [-amplitude, amplitude] (a random 256 px tile, repeated) to an RGB image.

    ``block`` > 1 makes blocky noise, which PNG compresses far better than per-pixel noise."""
    if amplitude <= 0:
        return img
    tile = _noise_tile(rng, amplitude, block)
    w, h = img.size
    reps = (-(-h // 256), -(-w // 256), 1)
    noise = Image.fromarray(np.ascontiguousarray(np.tile(tile, reps)[:h, :w]))
    return ImageChops.add(img, noise, scale=1.0, offset=-amplitude)


def render_clutter(rng: np.random.Generator, width: int, height: int, noise: int = 4) -> Image.Image:
    """A scene-like image with no emblems and no cue (used for planted traps)."""
    img = background(rng, width, height)
    draw_clutter(img, rng)
    return add_tiled_noise(img, rng, noise)


def alpha_box(emblem: Image.Image) -> tuple[int, int, int, int]:
    """Tight box of an RGBA emblem's visible pixels (alpha > threshold), x1/y1 exclusive."""
    mask = emblem.getchannel("A").point(lambda v: 255 if v > ALPHA_BOX_THRESHOLD else 0)
    box = mask.getbbox()
    if box is None:
        raise ValueError("emblem rendering has no visible pixels")
    return box


def _overlaps(a: tuple[int, int, int, int], b: tuple[int, int, int, int], pad: int) -> bool:
    return not (a[2] + pad <= b[0] or b[2] + pad <= a[0] or a[3] + pad <= b[1] or b[3] + pad <= a[1])


def plan_cells(rng: np.random.Generator, grid_rows: int, grid_cols: int, decoys: int
               ) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
    """Draw the target cell and ``decoys`` distinct other cells."""
    cells = [(r, c) for r in range(grid_rows) for c in range(grid_cols)]
    target = cells[int(rng.integers(len(cells)))]
    others = [c for c in cells if c != target]
    if decoys > len(others):
        raise ValueError(f"decoys={decoys} but a {grid_rows}x{grid_cols} grid has only {len(others)} other cells")
    picks = rng.choice(len(others), decoys, replace=False) if decoys else []
    return target, tuple(others[int(i)] for i in sorted(picks))


def render_scene(rng: np.random.Generator, cfg: SceneConfig, emblems: Sequence[EmblemSpec],
                 size: tuple[int, int] | None = None, noise_block: int = 1) -> tuple[Image.Image, SceneInfo]:
    """Render one scene using emblems drawn from ``emblems`` (distinct entities; the first drawn is
    the target). Returns the RGB image and what was placed where."""
    w, h = size or scene_size(rng, cfg.long_side_min, cfg.long_side_max, cfg.grid_rows, cfg.grid_cols)
    rows, cols = cfg.grid_rows, cfg.grid_cols
    t = frame_thickness(w, h, cfg.frame_thickness_frac)
    target_cell, decoy_cells = plan_cells(rng, rows, cols, cfg.decoys)
    k = int(rng.integers(cfg.emblems_min, cfg.emblems_max + 1))
    if k > len(emblems):
        raise ValueError(f"a scene needs up to {k} distinct entities but only {len(emblems)} exist")
    chosen = [int(i) for i in rng.choice(len(emblems), k, replace=False)]

    img = background(rng, w, h)
    zone = zone_box(w, h, rows, cols, *target_cell, cfg.target_zone) if cfg.target_zone < 1.0 else None
    draw_clutter(img, rng, keep_clear=zone)
    img = add_tiled_noise(img, rng, int(rng.integers(2, 7)), noise_block)  # before the cue: it stays pure red
    d = ImageDraw.Draw(img)
    draw_frame(d, frame_box(w, h, rows, cols, *target_cell, t), t, CUE_COLOUR)
    colours = [DECOY_COLOURS[int(i)] for i in rng.permutation(len(DECOY_COLOURS))]
    for j, cell in enumerate(decoy_cells):
        draw_frame(d, frame_box(w, h, rows, cols, *cell, t), t, colours[j % len(colours)])

    short = min(w, h)
    other_cells = [(r, c) for r in range(rows) for c in range(cols) if (r, c) != target_cell]
    placements: list[Placement] = []
    for j, ent in enumerate(chosen):
        is_target = j == 0
        size_px = max(12, int(round(cfg.emblem_frac * short * rng.uniform(0.85, 1.15))))
        emblem = render_emblem(emblems[ent], size_px, float(rng.uniform(-20, 20)))
        bx0, by0, bx1, by1 = alpha_box(emblem)
        cells = [target_cell] if is_target else [other_cells[int(i)] for i in rng.permutation(len(other_cells))]
        placed = None
        for cell in cells:
            ix0, iy0, ix1, iy1 = inner_box(w, h, rows, cols, *cell, t)
            if is_target:
                zx0, zy0, zx1, zy1 = zone_box(w, h, rows, cols, *cell, cfg.target_zone)
                ix0, iy0, ix1, iy1 = max(ix0, zx0), max(iy0, zy0), min(ix1, zx1), min(iy1, zy1)
            if ix1 - ix0 < emblem.width or iy1 - iy0 < emblem.height:
                raise ValueError(
                    f"emblem of {emblem.width}x{emblem.height} px does not fit in "
                    f"{'the central target_zone of ' if is_target else ''}a cell of a {w}x{h} scene; "
                    "lower emblem_frac or frame_thickness_frac, raise target_zone, or use fewer grid cells")
            for _ in range(40):
                px = int(rng.integers(ix0, ix1 - emblem.width + 1))
                py = int(rng.integers(iy0, iy1 - emblem.height + 1))
                box = (px + bx0, py + by0, px + bx1, py + by1)
                if not any(_overlaps(box, p.box, size_px // 3) for p in placements):
                    placed = (px, py, box, cell)
                    break
            if placed:
                break
        if placed is None:
            if is_target:
                raise RuntimeError("could not place the target emblem")  # its cell is empty: unreachable
            continue
        px, py, box, cell = placed
        img.paste(emblem, (px, py), emblem)
        placements.append(Placement(entity_index=ent, box=box, cell=cell, is_target=is_target))

    info = SceneInfo(width=w, height=h, grid_rows=rows, grid_cols=cols, target_cell=target_cell,
                     decoy_cells=decoy_cells, frame_thickness=t, placements=tuple(placements),
                     target_zone=cfg.target_zone)
    return img, info


if __name__ == "__main__":
    g = np.random.default_rng(0)
    specs = [random_emblem(g) for _ in range(10)]
    image, scene = render_scene(g, SceneConfig(), specs)
    image.save(sys.argv[1] if len(sys.argv) > 1 else "scene.jpg", quality=90)
    print(scene)
