"""Procedural emblems: the visual identity of each entity, and its renderings.

An emblem spec is a small JSON-serialisable dict::

    {"shape": "hexagon", "fill": "#1f3a93", "border": "#f4d35e", "accent": "#2e9e44" or None,
     "glyph": "K" or None, "pattern": "stripes" or None}

with two or three distinct colours (each from ``PALETTE``, named by ``COLOUR_NAMES``) and at least one of
glyph / pattern. :func:`random_emblem` draws one (from shared colour schemes when given:
:func:`schemes_of` reads a world's), :func:`emblem_json` serialises it canonically (sorted keys, stored in
``entities.emblem``), :func:`render_emblem` draws it as an RGBA image of a given size and rotation
(supersampled, so small renderings stay clean), and :func:`render_gallery_image` makes one noisy, jittered gallery
rendering on a random background.

Try it: ``python -m mars.world.emblems OUT.png`` writes a sheet of 24 random emblems.
"""

from __future__ import annotations

import colorsys
import functools
import json
import math
import sys
from typing import Any, Iterable, Sequence

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "hexagon", "star", "diamond", "pentagon", "octagon")
PATTERNS: tuple[str, ...] = ("stripes", "dots", "cross", "chevron", "ring", "half", "checker")
GLYPHS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
# Well separated colours; no pure red (pure red is reserved for the scene cue).
PALETTE: tuple[str, ...] = (
    "#1f3a93", "#2e6fdb", "#5bc0eb", "#0f8b8d", "#2e9e44", "#9bc53d", "#f4d35e", "#d4a017",
    "#f28c28", "#7b1e3a", "#6a4c93", "#e07a9f", "#8b5a2b", "#1b1b1b", "#f5f5f5", "#8d99ae",
)
# one plain word per palette colour: what a perception question about an emblem's fill answers
COLOUR_NAMES: dict[str, str] = dict(zip(PALETTE, (
    "navy", "blue", "sky", "teal", "green", "lime", "yellow", "gold",
    "orange", "maroon", "purple", "pink", "brown", "black", "white", "grey",
)))
MIN_CONTRAST = 0.3  # luminance difference between fill and border (the glyph is drawn in border)
SUPERSAMPLE = 4  # for small emblems; large ones use less (see supersample_for)
SUPERSAMPLED_MAX = 768  # largest supersampled canvas side

EmblemSpec = dict[str, Any]


def hex_to_rgb(colour: str) -> tuple[int, int, int]:
    """"#rrggbb" -> (r, g, b)."""
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def luminance(colour: str) -> float:
    """Relative luminance in 0..1 (Rec. 601 weights, no gamma)."""
    r, g, b = hex_to_rgb(colour)
    return (0.299 * r + 0.587 * g + 0.114 * b) / 255.0


ColourScheme = tuple[str, str, "str | None"]  # fill, border, accent


def random_scheme(rng: np.random.Generator) -> ColourScheme:
    """Draw fill and border (luminance contrast ensured) and, half the time, an accent colour."""
    while True:
        fill, border = (PALETTE[int(i)] for i in rng.choice(len(PALETTE), 2, replace=False))
        if abs(luminance(fill) - luminance(border)) >= MIN_CONTRAST:
            break
    accent = None
    if rng.random() < 0.5:
        rest = [c for c in PALETTE if c not in (fill, border)]
        accent = rest[int(rng.integers(len(rest)))]
    return fill, border, accent


def colour_schemes(rng: np.random.Generator, n: int) -> list[ColourScheme]:
    """``n`` distinct colour schemes that entities share (so colour alone cannot identify one)."""
    out: list[ColourScheme] = []
    while len(out) < n:
        scheme = random_scheme(rng)
        if scheme not in out:
            out.append(scheme)
    return out


def schemes_of(emblems: Iterable[str | EmblemSpec]) -> tuple[ColourScheme, ...]:
    """The distinct colour schemes (fill, border, accent) of ``emblems`` (specs or their JSON, as stored in
    ``entities.emblem``), sorted: what :func:`random_emblem` draws from to colour new emblems as a world's are."""
    specs = [json.loads(e) if isinstance(e, str) else e for e in emblems]
    schemes = {(s["fill"], s["border"], s["accent"]) for s in specs}
    return tuple(sorted(schemes, key=lambda c: (c[0], c[1], c[2] or "")))


def random_emblem(rng: np.random.Generator, schemes: Sequence[ColourScheme] | None = None) -> EmblemSpec:
    """Draw one emblem spec: shape, 2-3 colours (fill/border contrast ensured), glyph and/or pattern.

    With ``schemes``, the colours are one of those shared schemes: entities then differ by
    shape, glyph and pattern, which only a close look (a crop) resolves.
    """
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    if schemes:
        fill, border, accent = schemes[int(rng.integers(len(schemes)))]
    else:
        fill, border, accent = random_scheme(rng)
    glyph = GLYPHS[int(rng.integers(len(GLYPHS)))]
    pattern = PATTERNS[int(rng.integers(len(PATTERNS)))]
    if accent is None:  # two colours: a glyph or a pattern
        if rng.random() < 0.6:
            pattern = None
        else:
            glyph = None
    return {"shape": shape, "fill": fill, "border": border, "accent": accent, "glyph": glyph, "pattern": pattern}


def emblem_json(spec: EmblemSpec) -> str:
    """Canonical JSON of a spec (sorted keys, no spaces): equal specs give equal strings."""
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def emblem_colours(spec: EmblemSpec) -> list[str]:
    """The distinct colours of a spec, fill first."""
    return [c for c in (spec["fill"], spec["border"], spec["accent"]) if c is not None]


def shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Vertices of ``shape`` centred at (cx, cy) with circumradius ``r`` (circle: 64-gon)."""
    def ring(n: int, start_deg: float, radii: tuple[float, ...] = (1.0,)) -> list[tuple[float, float]]:
        pts = []
        for k in range(n * len(radii)):
            a = math.radians(start_deg + 360.0 * k / (n * len(radii)))
            rr = r * radii[k % len(radii)]
            pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
        return pts

    if shape == "circle":
        return ring(64, 0)
    if shape == "square":
        return ring(4, 45, (1.0,))
    if shape == "diamond":
        return ring(4, -90)
    if shape == "triangle":
        return [(x, y + 0.18 * r) for x, y in ring(3, -90)]
    if shape == "pentagon":
        return ring(5, -90)
    if shape == "hexagon":
        return ring(6, 0)
    if shape == "octagon":
        return ring(8, 22.5)
    if shape == "star":
        return ring(5, -90, (1.0, 0.48))
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def _glyph_box(shape: str) -> tuple[float, float]:
    """(font size, vertical offset) of the glyph as fractions of the canvas, per shape."""
    return {"triangle": (0.30, 0.10), "star": (0.26, 0.03), "diamond": (0.34, 0.0)}.get(shape, (0.42, 0.0))


@functools.lru_cache(maxsize=64)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def draw_pattern(draw: ImageDraw.ImageDraw, pattern: str, s: int, colour: tuple[int, int, int]) -> None:
    """Draw ``pattern`` over a whole ``s`` x ``s`` layer (it is masked to the shape afterwards)."""
    w = max(2, s // 14)
    if pattern == "stripes":
        for k in range(-s, 2 * s, 3 * w):
            draw.line([(k, 0), (k + s, s)], fill=colour, width=w)
    elif pattern == "dots":
        step = s // 6
        for y in range(step // 2, s, step):
            for x in range(step // 2, s, step):
                draw.ellipse([x - w // 2 - 1, y - w // 2 - 1, x + w // 2 + 1, y + w // 2 + 1], fill=colour)
    elif pattern == "cross":
        draw.rectangle([s // 2 - w, 0, s // 2 + w, s], fill=colour)
        draw.rectangle([0, s // 2 - w, s, s // 2 + w], fill=colour)
    elif pattern == "chevron":
        for off in (-2 * w, 2 * w):
            y = s // 2 + off
            draw.line([(0, y - s // 3), (s // 2, y), (s, y - s // 3)], fill=colour, width=w)
    elif pattern == "ring":
        m = s // 4
        draw.ellipse([m, m, s - m, s - m], outline=colour, width=w)
    elif pattern == "half":
        draw.rectangle([0, 0, s // 2, s], fill=colour)
    elif pattern == "checker":
        step = s // 5
        for y in range(0, s, step):
            for x in range(0, s, step):
                if (x // step + y // step) % 2 == 0:
                    draw.rectangle([x, y, x + step - 1, y + step - 1], fill=colour)
    else:
        raise ValueError(f"unknown pattern {pattern!r}; expected one of {PATTERNS}")


def supersample_for(size: int) -> int:
    """Supersampling factor for an emblem of ``size`` px: 4 for small ones, down to 1, keeping the
    drawing canvas under ``SUPERSAMPLED_MAX`` px."""
    return max(1, min(SUPERSAMPLE, SUPERSAMPLED_MAX // max(1, int(size))))


def render_emblem(spec: EmblemSpec, size: int, angle: float = 0.0) -> Image.Image:
    """Draw ``spec`` as an RGBA image: a ``size`` x ``size`` canvas (larger when rotated, since the
    rotation expands the canvas), transparent outside the emblem. ``angle`` in degrees, counter-
    clockwise. Drawn supersampled (:func:`supersample_for`), box-reduced, then rotated at the final
    size, so even 30 px emblems keep clean edges. Transparent pixels carry the border colour, so
    resampling never darkens the rim."""
    ss = supersample_for(size)
    s = max(8, int(size)) * ss
    c = s / 2.0
    r = 0.48 * s
    fill, border = hex_to_rgb(spec["fill"]), hex_to_rgb(spec["border"])
    outer = shape_polygon(spec["shape"], c, c, r)
    inner = shape_polygon(spec["shape"], c, c, r * (0.80 if spec["shape"] in ("triangle", "star") else 0.86))

    img = Image.new("RGBA", (s, s), border + (0,))
    d = ImageDraw.Draw(img)
    d.polygon(outer, fill=border + (255,))
    d.polygon(inner, fill=fill + (255,))
    if spec.get("pattern"):
        pat_colour = hex_to_rgb(spec["accent"] or spec["border"])
        layer = Image.new("RGBA", (s, s), (0, 0, 0, 0))
        draw_pattern(ImageDraw.Draw(layer), spec["pattern"], s, pat_colour)
        mask = Image.new("L", (s, s), 0)
        ImageDraw.Draw(mask).polygon(inner, fill=255)
        alpha = Image.fromarray(np.minimum(np.asarray(layer.getchannel("A")), np.asarray(mask)))
        layer.putalpha(alpha)
        img.alpha_composite(layer)
    if spec.get("glyph"):
        frac, dy = _glyph_box(spec["shape"])
        font = _font(max(6, int(frac * s * 1.25)))
        colour = border
        d = ImageDraw.Draw(img)
        sw = max(1, s // 60)
        d.text((c, c + dy * s), spec["glyph"], font=font, fill=colour + (255,), anchor="mm",
               stroke_width=sw, stroke_fill=fill + (255,))
    if ss > 1:
        img = img.reduce(ss)
    if angle:
        img = img.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=border + (0,))
    return img


def muted_colour(rng: np.random.Generator, sat_max: float = 0.45) -> tuple[int, int, int]:
    """A random colour of low saturation (never close to the pure-red cue)."""
    h, s, v = rng.random(), rng.uniform(0.05, sat_max), rng.uniform(0.3, 0.92)
    r, g, b = colorsys.hsv_to_rgb(h, s, v)
    return int(r * 255), int(g * 255), int(b * 255)


def gallery_background(rng: np.random.Generator, size: int) -> Image.Image:
    """A random background: solid, gradient, or soft blotches with a few shapes."""
    kind = int(rng.integers(3))
    if kind == 0:
        return Image.new("RGB", (size, size), muted_colour(rng, 0.3))
    if kind == 1:
        a, b = np.array(muted_colour(rng)), np.array(muted_colour(rng))
        t = np.linspace(0.0, 1.0, size)[:, None, None]
        grad = (a * (1 - t) + b * t).astype(np.uint8)
        arr = np.broadcast_to(grad, (size, size, 3))
        if rng.random() < 0.5:
            arr = arr.transpose(1, 0, 2)
        return Image.fromarray(np.ascontiguousarray(arr))
    small = rng.integers(60, 220, (4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((size, size), Image.Resampling.BILINEAR)
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 7))):
        x, y = (int(v) for v in rng.integers(0, size, 2))
        e = int(rng.integers(size // 10, size // 3))
        d.rectangle([x, y, x + e, y + e // 2], fill=muted_colour(rng)) if rng.random() < 0.5 else d.ellipse(
            [x, y, x + e, y + e], fill=muted_colour(rng)
        )
    return img


def jitter_colours(img: Image.Image, gains: np.ndarray) -> Image.Image:
    """Multiply the RGB channels of an RGBA image by ``gains`` (3 floats), alpha untouched."""
    arr = np.asarray(img).astype(np.float32)
    arr[..., :3] = np.clip(arr[..., :3] * gains[None, None, :], 0, 255)
    return Image.fromarray(arr.astype(np.uint8), "RGBA")


def add_noise(img: Image.Image, rng: np.random.Generator, sigma: float) -> Image.Image:
    """Gaussian pixel noise of standard deviation ``sigma`` (RGB image)."""
    if sigma <= 0:
        return img
    noise = rng.standard_normal((img.height, img.width, 3), dtype=np.float32) * np.float32(sigma)
    arr = np.asarray(img).astype(np.float32) + noise
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def render_gallery_image(spec: EmblemSpec, rng: np.random.Generator, size: int) -> Image.Image:
    """One gallery rendering of ``spec``: random scale, rotation, colour jitter, background, blur
    and noise, on a ``size`` x ``size`` RGB canvas."""
    scale = rng.uniform(0.45, 0.85)
    angle = float(rng.uniform(-30, 30))
    emblem = render_emblem(spec, int(size * scale), angle)
    emblem = jitter_colours(emblem, rng.uniform(0.85, 1.15, 3).astype(np.float32))
    canvas = gallery_background(rng, size)
    if emblem.width > size or emblem.height > size:
        emblem.thumbnail((size, size), Image.Resampling.LANCZOS)
    x = int(rng.integers(0, size - emblem.width + 1))
    y = int(rng.integers(0, size - emblem.height + 1))
    canvas.paste(emblem, (x, y), emblem)
    if rng.random() < 0.3:
        canvas = canvas.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.4, 1.2))))
    return add_noise(canvas, rng, float(rng.uniform(0.0, 8.0)))


if __name__ == "__main__":
    g = np.random.default_rng(0)
    sheet = Image.new("RGB", (6 * 140, 4 * 140), (230, 230, 230))
    for k in range(24):
        e = render_emblem(random_emblem(g), 128)
        sheet.paste(e, ((k % 6) * 140 + 6, (k // 6) * 140 + 6), e)
    sheet.save(sys.argv[1] if len(sys.argv) > 1 else "emblems.png")
