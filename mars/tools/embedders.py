"""Image embedders for the agent's ``image_search`` tool.

What it does
    :class:`ImageEmbedder` is the protocol every embedder follows: a ``name`` (stored in the image index
    manifest, so an index is never queried with a different embedder), a ``dim`` and
    ``embed(images) -> float32 [n, dim]`` with L2-normalised rows (inner product = cosine similarity).

    :class:`EmblemDescriptor` (spec ``"color_layout"``) is a deterministic, training-free descriptor for
    the world's procedural emblems (a shape in 2-3 colours with a letter glyph), built to be invariant to
    what the gallery renderings vary -- scale, rotation, translation, noise, +-10% colour jitter, plain or
    noisy backgrounds -- and discriminative for what tells emblems apart: shape, colours, their radial
    arrangement, and the glyph. Per image:

    1. resize (long side :data:`WORK` px, aspect kept), light Gaussian blur;
    2. object mask: the image is cut into smooth colour regions (colour gradient below a threshold that
       rises with the border's noise level; edge pixels join the nearest region); regions touching the
       image border are background -- so clutter that reaches the border of a crop is removed whatever its
       colour. Candidates are the remaining connected components and single regions, holes filled (a
       glyph may share the background colour), ranked by area x centre prior x solidity^2 (clutter glued
       to the emblem makes a candidate less convex);
    3. polar coordinates around the mask's centroid, the radius normalised by the mask's RMS radius
       (scale invariance);
    4. each pixel's colour is soft-assigned to 27 perceptual colour bins (12 hues x dark/light for chromatic
       pixels, black/grey/white for achromatic ones; linear interpolation between bins absorbs jitter) and
       accumulated, soft in radius and angle, into a (colour x radius x angle) histogram;
    5. the magnitude of the FFT along the angle axis makes it rotation invariant: frequency 0 is a
       colour-by-ring histogram (which colour sits where), frequencies 1..NF-1 describe angular structure
       per colour and ring (the shape's corners, the glyph's strokes);
    6. a contour signature: the mask's boundary radius as a function of angle, FFT magnitudes normalised by
       the mean radius (circle vs triangle vs hexagon vs star...), plus log Hu moments of the mask;
    7. an edge block: per ring, a histogram of luminance-gradient orientation relative to the radial
       direction, weighted by gradient magnitude (rotation invariant; colour-free, so it separates glyphs
       and patterns of emblems that share a colour scheme);
    8. blocks are power-normalised (square root), L2-normalised, weighted and concatenated; the result is
       L2-normalised (736 dims).

    ``embed`` uses the best mask of the "isolated" setting (gallery-style images). ``embed_views`` (used by
    the image index for queries) adds the best masks of the "crop" setting, and views of crops around
    emblem-like blobs (dense colour edges) found inside larger images such as a whole grid cell; the
    index scores a gallery image by its best match over a query's views. This rescues crops where clutter
    touching the emblem misleads one mask, and loose crops where the emblem is small.

    Measured (bench/SEARCH_CHOICE.md). Synthetic emblems drawn in bench/ and tests/ (6 shapes, 14 colours,
    20 letters, rotation 0-360): held-out renderings recall@1 / @5 = 0.94-0.98 / 0.99 with 40-200
    emblems, 0.82 / 0.96 with 1000; crops 1.4x the emblem box cut from cluttered 2048x1536 scenes
    0.93 / 1.00 (1.6x: 0.78 / 0.88, 2x: 0.65 / 0.80); the whole scene at 448 px 0.03 / 0.03-0.17.
    On mars.world's renderings (200 entities sharing 6 colour schemes, measured offline): gallery
    held-out 0.63 / 0.87, tight crops from its scenes 0.80 / 0.97, a whole grid cell 0.50 / 0.65, the
    whole scene at 448 px 0.03 / 0.10. About 7-8 ms per image on one core (15-25 ms for a query's views).

    A whole high-resolution scene shrunk to a few hundred pixels is dominated by clutter, so its descriptor
    is far from any emblem's: image search is meant to be called on a crop around the emblem (the agent
    zooms in first), which is the skill the world is built to reward.

    Limits: rotation invariance makes glyphs that are rotations of each other (M/W, N/Z, 6/9) identical;
    two emblems that differ only in such a glyph cannot be told apart by design.

    :func:`load_embedder` builds an embedder from a spec string: ``"color_layout"`` (the default above) or
    ``"hf:/local/path"``, a hook for a CLIP / SigLIP checkpoint in a local directory (transformers'
    AutoModel / AutoProcessor, imported lazily; ImportError with a clear message when transformers is not
    installed). Nothing is ever downloaded.

Deviation from the paper
    MARS's image search is a web reverse-image search (e.g. Google Lens through an API). We search an
    offline gallery of generated emblem renderings with a hand-built descriptor; a learned CLIP/SigLIP
    embedder is the scale-up path through ``hf:``.

How to run
    >>> emb = load_embedder("color_layout")
    >>> vecs = emb.embed([Image.open("a.png"), Image.open("b.png")])   # float32 [2, emb.dim]
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
from PIL import Image
from scipy import ndimage
from scipy.spatial import ConvexHull, QhullError

__all__ = ["EmblemDescriptor", "ColorLayoutEmbedder", "HFImageEmbedder", "ImageEmbedder", "load_embedder"]


@runtime_checkable
class ImageEmbedder(Protocol):
    """Maps images to L2-normalised float32 vectors; ``name`` identifies the model and its version.

    An embedder may also offer ``embed_views(image, max_views) -> float32 [m, dim]`` (several candidate
    views of one query image, row 0 = ``embed([image])[0]``); :class:`mars.tools.image_index.ImageIndex`
    uses it for queries when present.
    """

    name: str
    dim: int

    def embed(self, images: list[Image.Image]) -> np.ndarray:
        """Return float32 ``[len(images), dim]``, each row with unit L2 norm."""
        ...


# --- the offline descriptor -------------------------------------------------------------------------

WORK = 80  # working resolution (long side), pixels
N_HUE = 12
N_COLOR = N_HUE * 2 + 3  # chromatic hue x (dark, light) + achromatic (black, grey, white)
N_RAD = 4  # radial bins over normalised radius [0, RAD_MAX]
RAD_MAX = 1.3
N_ANG = 32  # angular bins before the FFT
N_FREQ = 6  # angular frequencies kept (0..N_FREQ-1)
N_CONTOUR_ANG = 64
N_CONTOUR_FREQ = 12
N_EDGE_RAD = 6  # radial bins of the edge-orientation block
N_EDGE_ORI = 12  # gradient orientation bins, measured relative to the radial direction
# Two segmentation settings (see _object_masks): "isolated" for gallery-style images (an emblem on a
# simple background, anywhere in the frame, possibly with busy patterns) and "crop" for a crop around an
# emblem in a cluttered scene. Each: (min gradient threshold, factor, border-gradient percentile, edge reach).
SEGMENTATION: dict[str, tuple[float, float, float, float]] = {
    "isolated": (0.08, 2.5, 50.0, 2.0),
    "crop": (0.05, 3.0, 25.0, np.inf),
}
CENTER_SIGMA = 0.2  # centre prior (fraction of the image side) when choosing the object
SOLIDITY_POW = 2.0  # candidates are scored by area x centre prior x solidity**SOLIDITY_POW
MIN_REGION = 0.003  # smallest region (fraction of the image) considered as an object part
MIN_OBJECT = 0.01  # smallest object mask (fraction of the image); below it the whole image is used
# Emblem proposals inside larger query images (e.g. a whole grid cell): blobs of dense colour edges.
PROPOSAL_WORK = 512  # long side of the image the proposals are searched in
PROPOSAL_MIN_PX = 24  # smallest emblem side considered, in original pixels (smaller is not recognisable)
PROPOSAL_DENSITY = 0.35  # edge density (fraction of edge pixels in a window) of an emblem blob
PROPOSAL_MARGIN = 1.5  # each proposal is cropped at this multiple of its box side


def _rgb_to_hsv(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    v = rgb.max(axis=-1)
    mn = rgb.min(axis=-1)
    d = v - mn
    s = np.where(v > 1e-6, d / np.maximum(v, 1e-6), 0.0)
    dd = np.maximum(d, 1e-6)
    h = np.where(v == r, (g - b) / dd, np.where(v == g, 2.0 + (b - r) / dd, 4.0 + (r - g) / dd))
    h = (h / 6.0) % 1.0
    return h, s, v


def _soft_colors(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Soft colour bins of ``rgb`` [n, 3] in [0, 1]: (bin indices [n, 6], weights [n, 6]); weights sum to 1."""
    h, s, v = _rgb_to_hsv(rgb)
    chroma = np.clip((s * np.sqrt(v) - 0.12) / 0.25, 0.0, 1.0)  # dark or washed-out pixels are achromatic
    # hue: circular linear interpolation between N_HUE centres
    hp = h * N_HUE
    h0 = np.floor(hp).astype(np.int64) % N_HUE
    h1 = (h0 + 1) % N_HUE
    wh1 = hp - np.floor(hp)
    # chromatic value: dark (v=0.35) / light (v=0.85)
    wl = np.clip((v - 0.35) / 0.5, 0.0, 1.0)
    # achromatic value: black 0.1 / grey 0.5 / white 0.9
    va = np.clip((v - 0.1) / 0.4, 0.0, 2.0)
    a0 = np.minimum(np.floor(va).astype(np.int64), 1)
    wa1 = va - a0
    base_a = 2 * N_HUE
    idx = np.stack([h0 * 2, h0 * 2 + 1, h1 * 2, h1 * 2 + 1, base_a + a0, base_a + a0 + 1], axis=1)
    w = np.stack(
        [
            chroma * (1 - wh1) * (1 - wl),
            chroma * (1 - wh1) * wl,
            chroma * wh1 * (1 - wl),
            chroma * wh1 * wl,
            (1 - chroma) * (1 - wa1),
            (1 - chroma) * wa1,
        ],
        axis=1,
    )
    return idx, w


def _solidity(mask: np.ndarray) -> float:
    """Mask area over the area of the convex hull of its pixel squares."""
    ys, xs = np.nonzero(mask)
    if len(ys) < 3:
        return 0.0
    pts = np.concatenate(
        [np.stack([ys + dy, xs + dx], axis=1) for dy in (-0.5, 0.5) for dx in (-0.5, 0.5)]
    ).astype(np.float64)
    try:
        hull = ConvexHull(pts).volume
    except QhullError:  # degenerate (collinear) masks
        return 0.0
    return float(len(ys) / hull)


def _object_masks(img: np.ndarray, max_masks: int = 1, mode: str = "isolated") -> list[np.ndarray]:
    """Candidate emblem masks of ``img`` [h, w, 3] (blurred, [0, 1]), best first; see the module docstring.

    The image is cut into smooth colour regions: pixels whose colour gradient is below a threshold (at
    least ``t_min``, raised to ``k`` x a percentile of the border's gradient on noisy or graded
    backgrounds). Edge pixels within ``reach`` px of a region join the nearest one, so thin bands between
    two background regions disappear; farther edge pixels (busy patterns, glyph strokes) stay foreground.
    Regions touching the image border are background. Candidates are each connected component of the
    foreground and each single foreground region, holes filled (a glyph may share the background colour),
    ranked by area x a centre prior x solidity**2 (clutter glued to the emblem makes a union less solid).
    ``mode`` picks the setting in :data:`SEGMENTATION`.
    """
    t_min, k, pct, reach = SEGMENTATION[mode]
    h, w, _ = img.shape
    gy = ndimage.sobel(img, axis=0)
    gx = ndimage.sobel(img, axis=1)
    grad = np.sqrt((gx**2 + gy**2).sum(axis=2)) / 8.0
    border_grad = np.concatenate([grad[0], grad[-1], grad[:, 0], grad[:, -1]])
    smooth = grad < max(t_min, k * float(np.percentile(border_grad, pct)))
    labels, n = ndimage.label(smooth)
    whole = [np.ones((h, w), bool)]
    if n == 0:
        return whole
    dist, (iy, ix) = ndimage.distance_transform_edt(labels == 0, return_indices=True)
    labels = np.where(dist <= reach, labels[iy, ix], 0)
    bg_labels = np.unique(np.concatenate([labels[0], labels[-1], labels[:, 0], labels[:, -1]]))
    bg_labels = bg_labels[bg_labels > 0]
    fg = ~np.isin(labels, bg_labels)
    fg = ndimage.binary_opening(fg, structure=np.ones((3, 3), bool))
    comp, n_comp = ndimage.label(fg, structure=np.ones((3, 3), bool))
    ids = np.arange(1, n + 1)
    area = ndimage.sum_labels(np.ones_like(labels), labels, ids)
    parts = ids[(area >= MIN_REGION * h * w) & ~np.isin(ids, bg_labels)]
    candidates = [comp == c for c in range(1, n_comp + 1)] + [labels == int(r) for r in parts]
    scored: list[tuple[float, int, np.ndarray]] = []
    for i, m in enumerate(candidates):
        m = ndimage.binary_fill_holes(m)
        a = int(m.sum())
        if a < MIN_OBJECT * h * w:
            continue
        ys, xs = np.nonzero(m)
        dn = ((ys.mean() - (h - 1) / 2) / h) ** 2 + ((xs.mean() - (w - 1) / 2) / w) ** 2
        score = a * np.exp(-dn / (2 * CENTER_SIGMA**2)) * _solidity(m) ** SOLIDITY_POW
        scored.append((float(score), i, m))
    scored.sort(key=lambda t: (-t[0], t[1]))
    out: list[np.ndarray] = []
    for _, _, m in scored:
        if all(int((m ^ o).sum()) > 0.1 * int(m.sum()) for o in out):  # skip near-duplicates
            out.append(m)
            if len(out) >= max_masks:
                break
    return out or whole


def _proposal_boxes(img: Image.Image, max_boxes: int) -> list[tuple[int, int, int, int]]:
    """Up to ``max_boxes`` square crop boxes around emblem-like blobs of ``img`` (RGB), best first.

    An emblem (ring, glyph, pattern) is a compact blob of dense colour edges, unlike flat clutter, thin
    lines or the background. Edges are found at :data:`PROPOSAL_WORK` px; their density in a window of
    half the smallest emblem side is thresholded; compact blobs between :data:`PROPOSAL_MIN_PX` (in
    original pixels) and half the image are kept, ranked by density x fill.
    """
    w0, h0 = img.size
    if max_boxes < 1 or max(w0, h0) < 6 * PROPOSAL_MIN_PX:  # small images: the whole-image views suffice
        return []
    sc = min(1.0, PROPOSAL_WORK / max(w0, h0))
    small = img.resize((max(8, round(w0 * sc)), max(8, round(h0 * sc))), Image.BILINEAR)
    arr = ndimage.gaussian_filter(np.asarray(small, dtype=np.float32) / 255.0, sigma=(0.7, 0.7, 0))
    h, w, _ = arr.shape
    gy = ndimage.sobel(arr, axis=0)
    gx = ndimage.sobel(arr, axis=1)
    edges = (np.sqrt((gx**2 + gy**2).sum(axis=2)) / 8.0 >= 0.06).astype(np.float32)
    min_side = max(4.0, PROPOSAL_MIN_PX * sc)
    dens = ndimage.uniform_filter(edges, size=max(3, int(round(min_side / 2))))
    blobs, _ = ndimage.label(dens > PROPOSAL_DENSITY)
    scored: list[tuple[float, int, tuple[float, float, float, float]]] = []
    for label, sl in enumerate(ndimage.find_objects(blobs), start=1):
        if sl is None:
            continue
        hh, ww = sl[0].stop - sl[0].start, sl[1].stop - sl[1].start
        if max(hh, ww) < min_side or max(hh, ww) > 0.5 * min(h, w) or max(hh, ww) > 2.5 * min(hh, ww):
            continue
        m = blobs[sl] == label
        fill = float(m.mean())
        if fill < 0.45:
            continue
        box = (sl[1].start / sc, sl[0].start / sc, sl[1].stop / sc, sl[0].stop / sc)
        scored.append((float(dens[sl][m].mean()) * fill, label, box))
    scored.sort(key=lambda t: (-t[0], t[1]))
    out = []
    for _, _, (x0, y0, x1, y1) in scored[:max_boxes]:
        cx, cy, half = (x0 + x1) / 2, (y0 + y1) / 2, max(x1 - x0, y1 - y0) * PROPOSAL_MARGIN / 2
        out.append((int(cx - half), int(cy - half), int(np.ceil(cx + half)), int(np.ceil(cy + half))))
    return out


def _prepare(image: Image.Image) -> tuple[np.ndarray, np.ndarray]:
    """RGB float array at the working size (blurred for features) and a stronger blur for segmentation."""
    img = image.convert("RGB")
    w0, h0 = img.size
    scale = WORK / max(w0, h0)
    img = img.resize((max(8, round(w0 * scale)), max(8, round(h0 * scale))), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.float32) / 255.0
    arr = ndimage.gaussian_filter(arr, sigma=(0.8, 0.8, 0))
    return arr, ndimage.gaussian_filter(arr, sigma=(1.0, 1.0, 0))


def _edge_orientation(arr: np.ndarray, ys: np.ndarray, xs: np.ndarray, rn: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """Rotation-invariant edge block: per ring, a histogram of luminance-gradient orientation measured
    relative to the radial direction, weighted by gradient magnitude (glyph strokes, patterns)."""
    lum = arr @ np.array([0.299, 0.587, 0.114], dtype=arr.dtype)
    gy = ndimage.sobel(lum, axis=0)[ys, xs]
    gx = ndimage.sobel(lum, axis=1)[ys, xs]
    mag = np.sqrt(gx**2 + gy**2)
    op = ((np.arctan2(gy, gx) - theta) % (2 * np.pi)) / (2 * np.pi) * N_EDGE_ORI
    o0 = np.floor(op).astype(np.int64) % N_EDGE_ORI
    wo = op - np.floor(op)
    rp = np.clip(rn / RAD_MAX * N_EDGE_RAD - 0.5, 0, N_EDGE_RAD - 1)
    r0 = np.minimum(np.floor(rp).astype(np.int64), N_EDGE_RAD - 2)
    wr = rp - r0
    hist = np.zeros(N_EDGE_RAD * N_EDGE_ORI)
    for rr, w1 in ((r0, 1 - wr), (r0 + 1, wr)):
        for oo, w2 in ((o0, 1 - wo), ((o0 + 1) % N_EDGE_ORI, wo)):
            hist += np.bincount(rr * N_EDGE_ORI + oo, weights=mag * w1 * w2, minlength=hist.size)
    return np.sqrt(hist / len(ys))


def _hu_moments(mask: np.ndarray) -> np.ndarray:
    ys, xs = np.nonzero(mask)
    x = xs - xs.mean()
    y = ys - ys.mean()
    m00 = float(len(xs))

    def eta(p: int, q: int) -> float:
        return float((x**p * y**q).sum()) / m00 ** (1 + (p + q) / 2)

    n20, n02, n11 = eta(2, 0), eta(0, 2), eta(1, 1)
    n30, n03, n21, n12 = eta(3, 0), eta(0, 3), eta(2, 1), eta(1, 2)
    hu = np.array(
        [
            n20 + n02,
            (n20 - n02) ** 2 + 4 * n11**2,
            (n30 - 3 * n12) ** 2 + (3 * n21 - n03) ** 2,
            (n30 + n12) ** 2 + (n21 + n03) ** 2,
        ]
    )
    return -np.sign(hu) * np.log10(np.abs(hu) + 1e-12)


class EmblemDescriptor:
    """Deterministic colour-layout + shape descriptor for emblems (spec ``"color_layout"``).

    ``weights`` scales the blocks (colour-by-ring, angular colour structure, contour, Hu moments, edge
    orientation) before the final L2 normalisation.
    """

    VERSION = 2

    def __init__(self, weights: tuple[float, float, float, float, float] = (1.0, 0.8, 0.5, 0.2, 1.2)) -> None:
        if len(weights) != 5:
            raise ValueError(f"EmblemDescriptor needs 5 block weights, got {weights!r}")
        self.weights = tuple(float(x) for x in weights)
        self._dims = (N_COLOR * N_RAD, N_COLOR * N_RAD * (N_FREQ - 1), N_CONTOUR_FREQ, 4, N_EDGE_RAD * N_EDGE_ORI)
        self.dim = int(sum(self._dims))
        wtag = "-".join(f"{x:g}" for x in self.weights)
        self.name = f"color_layout-v{self.VERSION}-w{wtag}"

    def embed(self, images: list[Image.Image]) -> np.ndarray:
        out = np.zeros((len(images), self.dim), dtype=np.float32)
        for i, im in enumerate(images):
            out[i] = self.embed_one(im)
        return out

    def embed_one(self, image: Image.Image) -> np.ndarray:
        """Descriptor of one image: its best object mask in the "isolated" setting."""
        arr, seg = _prepare(image)
        return self._describe(arr, _object_masks(seg, 1, "isolated")[0])

    def embed_views(self, image: Image.Image, max_views: int = 4, max_proposals: int = 4) -> np.ndarray:
        """Descriptors of candidate views of a query image ([m, dim]); row 0 equals ``embed_one``.

        Views of the whole image: the best "isolated" mask, then the best "crop" masks (near-duplicates
        dropped), ``max_views`` in all. Then, for up to ``max_proposals`` emblem-like blobs found inside a
        larger image (:func:`_proposal_boxes`, e.g. an emblem of 50 px in a 1000 px grid cell), the best
        "isolated" and "crop" masks of a crop around each. :class:`mars.tools.image_index.ImageIndex`
        scores a gallery image by its best match over a query's views.
        """
        img = image.convert("RGB")
        views = [self._views(img, max_views)]
        for box in _proposal_boxes(img, max_proposals):
            views.append(self._views(img.crop(box), 2))
        return np.concatenate(views)

    def _views(self, image: Image.Image, max_views: int) -> np.ndarray:
        arr, seg = _prepare(image)
        masks = _object_masks(seg, 1, "isolated")
        for m in _object_masks(seg, max_views, "crop"):
            if len(masks) >= max_views:
                break
            if all(int((m ^ o).sum()) > 0.1 * int(m.sum()) for o in masks):
                masks.append(m)
        return np.stack([self._describe(arr, m) for m in masks])

    def _describe(self, arr: np.ndarray, mask: np.ndarray) -> np.ndarray:
        ys, xs = np.nonzero(mask)
        cy, cx = ys.mean(), xs.mean()
        dy, dx = ys - cy, xs - cx
        r = np.sqrt(dy**2 + dx**2)
        r_rms = max(float(np.sqrt((r**2).mean())), 1e-6)
        rn = r / (np.sqrt(2.0) * r_rms)  # 1.0 at the edge of a disk
        theta = np.arctan2(dy, dx)

        # (colour x radius x angle) soft histogram
        cidx, cw = _soft_colors(arr[ys, xs])
        rp = np.clip(rn / RAD_MAX * N_RAD - 0.5, 0, N_RAD - 1)
        r0 = np.minimum(np.floor(rp).astype(np.int64), N_RAD - 2)
        wr1 = rp - r0
        ap = (theta / (2 * np.pi) % 1.0) * N_ANG
        a0 = np.floor(ap).astype(np.int64) % N_ANG
        wa1 = ap - np.floor(ap)
        a1 = (a0 + 1) % N_ANG
        hist = np.zeros(N_COLOR * N_RAD * N_ANG, dtype=np.float64)
        for rr, wr in ((r0, 1 - wr1), (r0 + 1, wr1)):
            for aa, wa in ((a0, 1 - wa1), (a1, wa1)):
                flat = (cidx * N_RAD + rr[:, None]) * N_ANG + aa[:, None]
                hist += np.bincount(flat.ravel(), weights=(cw * (wr * wa)[:, None]).ravel(), minlength=hist.size)
        hist = hist.reshape(N_COLOR, N_RAD, N_ANG) / len(ys)
        spec = np.abs(np.fft.rfft(hist, axis=2))[:, :, :N_FREQ]
        block0 = np.sqrt(spec[:, :, 0]).ravel()
        block1 = np.sqrt(spec[:, :, 1:]).ravel()

        # contour signature: boundary radius per angle
        cb = (theta / (2 * np.pi) % 1.0 * N_CONTOUR_ANG).astype(np.int64) % N_CONTOUR_ANG
        edge = np.zeros(N_CONTOUR_ANG)
        np.maximum.at(edge, cb, rn)
        if (edge == 0).any():  # fill empty bins from neighbours (tiny masks)
            nz = np.flatnonzero(edge)
            if nz.size:
                edge = np.interp(np.arange(N_CONTOUR_ANG), nz, edge[nz], period=N_CONTOUR_ANG)
        ef = np.abs(np.fft.rfft(edge))
        contour = ef[1 : N_CONTOUR_FREQ + 1] / max(ef[0], 1e-6)
        hu = _hu_moments(mask) / 10.0
        edges = _edge_orientation(arr, ys, xs, rn, theta)

        parts = []
        for block, wgt in zip((block0, block1, np.sqrt(contour), hu, edges), self.weights):
            nrm = np.linalg.norm(block)
            parts.append(block * (wgt / nrm) if nrm > 0 else block)
        v = np.concatenate(parts)
        v /= max(np.linalg.norm(v), 1e-12)
        return v.astype(np.float32)


ColorLayoutEmbedder = EmblemDescriptor


# --- optional learned embedder ----------------------------------------------------------------------


class HFImageEmbedder:
    """CLIP / SigLIP image tower from a local checkpoint directory (spec ``"hf:/path"``); never downloads.

    Requires ``transformers`` (and torch); raises ImportError with instructions when it is missing.
    """

    def __init__(self, path: Path, batch_size: int = 32) -> None:
        try:
            from transformers import AutoModel, AutoProcessor  # first: fails fast when absent

            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                f"image embedder 'hf:{path}' needs the 'transformers' package (and torch); install it "
                "(e.g. `pip install transformers`) or use the offline embedder 'color_layout'"
            ) from exc
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"image embedder checkpoint directory {path} does not exist")
        self._torch = torch
        self._model = AutoModel.from_pretrained(str(path), local_files_only=True).eval()
        self._processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
        self.batch_size = batch_size
        self.name = f"hf:{path.resolve()}"
        self.dim = int(self.embed([Image.new("RGB", (32, 32))]).shape[1])

    def embed(self, images: list[Image.Image]) -> np.ndarray:
        torch = self._torch
        outs = []
        with torch.no_grad():
            for i in range(0, len(images), self.batch_size):
                batch = [im.convert("RGB") for im in images[i : i + self.batch_size]]
                inputs = self._processor(images=batch, return_tensors="pt")
                feats = self._model.get_image_features(pixel_values=inputs["pixel_values"])
                outs.append(torch.nn.functional.normalize(feats.float(), dim=-1).cpu().numpy())
        return np.concatenate(outs).astype(np.float32)


def load_embedder(spec: str = "color_layout") -> ImageEmbedder:
    """Embedder for ``spec``: ``"color_layout"`` (offline descriptor) or ``"hf:/local/checkpoint/dir"``."""
    if spec in ("color_layout", "emblem", "default"):
        return EmblemDescriptor()
    if spec.startswith("hf:"):
        return HFImageEmbedder(Path(spec[3:]))
    raise ValueError(f"unknown image embedder spec {spec!r}; use 'color_layout' or 'hf:/path/to/local/checkpoint'")
