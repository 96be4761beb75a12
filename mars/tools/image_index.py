"""Exact nearest-neighbour image index over the gallery: the backend behind the agent's ``image_search``.

What it does
    :class:`ImageIndex` embeds the gallery rows with ``split == "index"`` (GALLERY schema,
    :data:`mars.data.schemas.GALLERY`; ``path`` is relative to the gallery directory) with an
    :class:`mars.tools.embedders.ImageEmbedder` and stores the L2-normalised vectors in a faiss
    ``IndexFlatIP`` (exact inner product = cosine similarity; a gallery of a few thousand to a few hundred
    thousand images needs no approximate index). ``search(image, k)`` / ``search_batch(images, k)`` return
    :class:`ImageHit` records (gallery_id, entity_id, title, path, score), best first, ties broken by
    gallery_id, so results are deterministic.

    Queries: when the embedder offers ``embed_views`` (the default
    :class:`~mars.tools.embedders.EmblemDescriptor` does), a query image is embedded as several candidate
    views (object masks, emblem-like blobs inside a loose crop) and a gallery image scores its best match
    over them; this stays exact (each view fetches its own top k from faiss). The ``query_views``
    attribute (default 4) bounds the whole-image views; 1 disables multi-view queries.

    Speed (bench/SEARCH_CHOICE.md, 10k x 736 gallery, 2 shared cores): a single faiss query takes about
    0.9 ms with one OpenMP thread, on par with a numpy matmul + top-k (0.8 ms); with faiss's default
    threads it gets slower (2.1 ms), so a server answering one query at a time may call
    ``faiss.omp_set_num_threads(1)``. At this size faiss buys no speed (numpy was faster on batches of
    100); it is kept for the index format and the scale-up path (IVF / HNSW indexes behind the same
    class). Embedding the query (about 7 ms per view, 15-20 ms in all) dominates the tool call anyway.

    ``save(dir)`` is atomic (temporary sibling directory, then rename; an existing index is kept until the
    new one is in place) and writes ``index.faiss``, ``items.parquet`` (row i = vector i, sorted by
    gallery_id) and ``manifest.json`` (embedder name, dim, count, faiss version, format version, SHA-256 of
    the gallery ids). ``load(dir, embedder)`` refuses an index built with another embedder name or
    dimension and names the directory and the problem (:class:`mars.tools.text_index.IndexLoadError`).

Deviation from the paper
    MARS calls a web reverse-image search; we search the offline world's gallery of emblem renderings.
    Held-out renderings (``split == "heldout"``) are never indexed: they are recall probes.

How to run
    >>> emb = load_embedder("color_layout")
    >>> idx = ImageIndex.build(gallery_table, Path("data/world/gallery"), emb)
    >>> idx.save(Path("data/index/image")); idx = ImageIndex.load(Path("data/index/image"), emb)
    >>> idx.search(Image.open("crop.png"), k=5)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image

from mars.tools.embedders import ImageEmbedder
from mars.data.io import atomic_dir
from mars.tools.text_index import MANIFEST, IndexLoadError, ids_digest, read_manifest

__all__ = ["ImageHit", "ImageIndex"]

FORMAT_VERSION = 1
BACKEND = "faiss.IndexFlatIP"
FAISS_FILE = "index.faiss"
ITEMS_FILE = "items.parquet"
_ITEM_COLUMNS = ("gallery_id", "entity_id", "title", "path")
_TIE_SLACK = 16  # extra neighbours fetched so that score ties at the cut-off are ordered by gallery_id


@dataclass(frozen=True, slots=True)
class ImageHit:
    """One gallery image returned by image search; ``path`` is relative to the gallery directory."""

    gallery_id: str
    entity_id: str
    title: str
    path: str
    score: float


class ImageIndex:
    """faiss IndexFlatIP over gallery embeddings; see the module docstring."""

    def __init__(self, items: pa.Table, index: faiss.Index, embedder: ImageEmbedder, query_views: int = 4) -> None:
        self._items = items
        self.query_views = query_views
        self.gallery_ids: list[str] = items.column("gallery_id").to_pylist()
        self.entity_ids: list[str] = items.column("entity_id").to_pylist()
        self._titles: list[str] = items.column("title").to_pylist()
        self._paths: list[str] = items.column("path").to_pylist()
        self._index = index
        self.embedder = embedder

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        gallery: pa.Table,
        gallery_dir: Path,
        embedder: ImageEmbedder,
        *,
        batch_size: int = 64,
        show_progress: bool = True,
    ) -> ImageIndex:
        """Embed every ``split == "index"`` row of a GALLERY table (files under ``gallery_dir``) and index them."""
        missing = [c for c in (*_ITEM_COLUMNS, "split") if c not in gallery.column_names]
        if missing:
            raise ValueError(f"gallery table lacks column(s) {missing}; expected the GALLERY schema")
        items = gallery.filter(pc.equal(gallery.column("split"), "index")).select(list(_ITEM_COLUMNS))
        if items.num_rows == 0:
            raise ValueError("gallery has no rows with split == 'index': nothing to index")
        items = items.cast(pa.schema([pa.field(c, pa.string(), nullable=False) for c in _ITEM_COLUMNS]))
        items = items.sort_by("gallery_id")
        ids = items.column("gallery_id").to_pylist()
        dupes = sorted({a for a, b in zip(ids, ids[1:]) if a == b})
        if dupes:
            raise ValueError(f"gallery has duplicate gallery_id(s), e.g. {dupes[:5]}")
        gallery_dir = Path(gallery_dir)
        paths = items.column("path").to_pylist()
        absent = [p for p in paths if not (gallery_dir / p).is_file()]
        if absent:
            raise FileNotFoundError(f"{len(absent)} gallery file(s) missing under {gallery_dir}, e.g. {absent[:3]}")
        index = faiss.IndexFlatIP(embedder.dim)
        starts = range(0, len(paths), batch_size)
        if show_progress:
            from tqdm import tqdm

            starts = tqdm(starts, desc=f"embedding gallery ({embedder.name})", unit="batch")
        for s in starts:
            images = []
            for p in paths[s : s + batch_size]:
                with Image.open(gallery_dir / p) as im:
                    images.append(im.convert("RGB"))
            index.add(_checked(embedder.embed(images), embedder, len(images)))
        return cls(items, index, embedder)

    def save(self, directory: Path) -> None:
        """Write the index to ``directory`` atomically."""
        with atomic_dir(Path(directory)) as tmp:
            faiss.write_index(self._index, str(tmp / FAISS_FILE))
            pq.write_table(self._items, tmp / ITEMS_FILE)
            manifest = {
                "kind": "image",
                "backend": BACKEND,
                "backend_version": faiss.__version__,
                "format_version": FORMAT_VERSION,
                "embedder": self.embedder.name,
                "dim": int(self.embedder.dim),
                "count": len(self),
                "gallery_ids_sha256": ids_digest(self.gallery_ids),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: Path, embedder: ImageEmbedder) -> ImageIndex:
        """Load an index saved by :meth:`save`; it must have been built with ``embedder`` (name and dim)."""
        directory = Path(directory)
        m = read_manifest(directory, "image")
        need = ("backend", "format_version", "embedder", "dim", "count", "gallery_ids_sha256")
        lacking = [k for k in need if k not in m]
        if lacking:
            raise IndexLoadError(f"image index manifest in {directory} lacks key(s) {lacking}")
        if m["backend"] != BACKEND or m["format_version"] != FORMAT_VERSION:
            raise IndexLoadError(
                f"image index in {directory} is {m['backend']!r} format {m['format_version']!r}; this code reads "
                f"{BACKEND!r} format {FORMAT_VERSION}: rebuild it"
            )
        if m["embedder"] != embedder.name or int(m["dim"]) != int(embedder.dim):
            raise IndexLoadError(
                f"image index in {directory} was built with embedder {m['embedder']!r} (dim {m['dim']}), "
                f"but {embedder.name!r} (dim {embedder.dim}) was given: rebuild the index or pass the same embedder"
            )
        absent = [f for f in (FAISS_FILE, ITEMS_FILE) if not (directory / f).is_file()]
        if absent:
            raise IndexLoadError(f"image index directory {directory} is incomplete: missing {absent}")
        try:
            index = faiss.read_index(str(directory / FAISS_FILE))
        except Exception as exc:  # faiss raises RuntimeError with a C++ message
            raise IndexLoadError(f"image index file {directory / FAISS_FILE} is corrupt: {exc}") from exc
        try:
            items = pq.read_table(directory / ITEMS_FILE)
        except Exception as exc:
            raise IndexLoadError(f"image index file {directory / ITEMS_FILE} is corrupt: {exc}") from exc
        if [c for c in _ITEM_COLUMNS if c not in items.column_names]:
            raise IndexLoadError(f"image index file {directory / ITEMS_FILE} lacks columns; expected {_ITEM_COLUMNS}")
        if index.d != int(m["dim"]) or index.ntotal != int(m["count"]) or items.num_rows != int(m["count"]):
            raise IndexLoadError(
                f"image index in {directory} is inconsistent: manifest count {m['count']} dim {m['dim']}, "
                f"{FAISS_FILE} has {index.ntotal} vectors of dim {index.d}, {ITEMS_FILE} has {items.num_rows} rows"
            )
        if ids_digest(items.column("gallery_id").to_pylist()) != m["gallery_ids_sha256"]:
            raise IndexLoadError(f"image index in {directory}: gallery ids do not match the manifest hash")
        return cls(items.select(list(_ITEM_COLUMNS)), index, embedder)

    # --- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self._index.ntotal)

    def embeddings(self) -> np.ndarray:
        """All indexed vectors, float32 ``[len(self), dim]`` in gallery_id order."""
        return self._index.reconstruct_n(0, self._index.ntotal)

    def search(self, image: Image.Image, k: int = 5) -> list[ImageHit]:
        """The ``k`` gallery images most similar to ``image`` (score desc, ties by gallery_id)."""
        return self.search_batch([image], k)[0]

    def search_batch(self, images: Sequence[Image.Image], k: int = 5) -> list[list[ImageHit]]:
        """:meth:`search` for several images (one faiss call).

        If the embedder has ``embed_views(image, max_views)`` and ``query_views > 1``, each query image is
        embedded as several candidate views and a gallery image scores its best match over them.
        """
        if not images:
            return []
        views = getattr(self.embedder, "embed_views", None)
        if views is None or self.query_views <= 1:
            vecs = _checked(self.embedder.embed(list(images)), self.embedder, len(images))
            return self.search_vectors(vecs, k)
        per_image = [np.atleast_2d(views(im, self.query_views)) for im in images]
        owner = np.repeat(np.arange(len(images)), [len(v) for v in per_image])
        vecs = np.concatenate(per_image)
        return self._search(_checked(vecs, self.embedder, len(vecs)), owner, len(images), k)

    def search_vectors(self, vectors: np.ndarray, k: int = 5) -> list[list[ImageHit]]:
        """Search with precomputed, L2-normalised query vectors ``[n, dim]`` (one result list per row)."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        return self._search(vectors, np.arange(len(vectors)), len(vectors), k)

    def _search(self, vectors: np.ndarray, owner: np.ndarray, n_queries: int, k: int) -> list[list[ImageHit]]:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        if vectors.ndim != 2 or vectors.shape[1] != self._index.d:
            raise ValueError(f"query vectors must have shape [n, {self._index.d}], got {vectors.shape}")
        fetch = min(len(self), k + _TIE_SLACK)
        scores, idx = self._index.search(vectors, fetch)
        out: list[list[ImageHit]] = []
        for q in range(n_queries):
            rows = np.flatnonzero(owner == q)
            s, i = scores[rows].ravel(), idx[rows].ravel()
            keep = i >= 0
            s, i = s[keep], i[keep]
            # best score per gallery row over this query's views (exact: each view fetched its own top k)
            first = np.lexsort((-s, i))
            i, s = i[first], s[first]
            uniq = np.r_[True, i[1:] != i[:-1]]
            i, s = i[uniq], s[uniq]
            order = np.lexsort((i, -s))[:k]  # items are sorted by gallery_id
            out.append(
                [
                    ImageHit(
                        gallery_id=self.gallery_ids[g],
                        entity_id=self.entity_ids[g],
                        title=self._titles[g],
                        path=self._paths[g],
                        score=float(v),
                    )
                    for g, v in zip(i[order].tolist(), s[order].tolist())
                ]
            )
        return out


def _checked(vecs: np.ndarray, embedder: ImageEmbedder, n: int) -> np.ndarray:
    vecs = np.ascontiguousarray(vecs, dtype=np.float32)
    if vecs.shape != (n, embedder.dim):
        raise ValueError(f"embedder {embedder.name!r} returned shape {vecs.shape}, expected {(n, embedder.dim)}")
    return vecs
