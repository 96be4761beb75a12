"""The ``index`` stage: the text index over the corpus and the image index over the gallery.

Text: BM25 (bm25s, chosen over tantivy by measurement: bench/SEARCH_CHOICE.md) through
:class:`mars.tools.text_index.TextIndex`. Images: exact inner-product faiss search over
embeddings from a pluggable embedder (:func:`mars.tools.embedders.load_embedder`; the
default is an offline, deterministic emblem descriptor; ``hf:/local/dir`` loads a
CLIP/SigLIP checkpoint from a local path).

A probe at the end checks retrieval before the new indexes replace the old ones:
``text_recall_at_k``: for every real entity, the query "When was <name> founded?" finds one
of the entity's own documents in the top k; ``image_recall_at_k``: every held-out rendering
(never indexed) finds its entity in the top k. Both are metrics, and the stage fails when
either falls below its ``min_*`` param, leaving the previous indexes in place.

Deviation from the paper: MARS searches the live web and Wikipedia; we search the offline
world (docs/design.md, The embedded default world), with tantivy or a web API as the scale-up path
(docs/design.md, The scale path).

Run: ``python -m stages.index --entities data/world/entities.parquet --corpus data/world/corpus.parquet --gallery
data/world/gallery.parquet --gallery-dir data/world/gallery --out data/index
--metrics metrics/index.json``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from mars.data.io import atomic_dir, atomic_write_text, read_table
from mars.data.schemas import CORPUS, ENTITIES, GALLERY
from mars.stage import expected_errors, stage_args, write_metrics

SECTION = "index"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    k: int = 5  # recall@k of the probe
    embedder: str = "color_layout"  # or "hf:/path/to/local/clip-or-siglip"
    batch_size: int = 64
    min_text_recall: float = 0.9
    min_image_recall: float = 0.8

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        for name in ("min_text_recall", "min_image_recall"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")


def text_probe(index, entity_rows: list[dict], k: int) -> float:
    """Share of real entities whose own document is in the top k for a fact question."""
    real = [r for r in entity_rows if not r["is_distractor"]]
    if not real:
        return 0.0
    hits = 0
    for row in real:
        found = index.search(f"When was {row['name']} founded?", k=k)
        hits += any(h.entity_id == row["entity_id"] for h in found)
    return hits / len(real)


def image_probe(index, gallery_rows: list[dict], gallery_dir: Path, k: int, batch: int) -> float:
    """Share of held-out renderings whose entity is in the top k."""
    heldout = [r for r in gallery_rows if r["split"] == "heldout"]
    if not heldout:
        return 0.0
    hits = 0
    for s in range(0, len(heldout), batch):
        rows = heldout[s : s + batch]
        images = []
        for r in rows:
            with Image.open(gallery_dir / r["path"]) as im:
                images.append(im.convert("RGB"))
        for r, found in zip(rows, index.search_batch(images, k=k)):
            hits += any(h.entity_id == r["entity_id"] for h in found)
    return hits / len(heldout)


def run(params: Params, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    from mars.tools.embedders import load_embedder
    from mars.tools.image_index import ImageIndex
    from mars.tools.text_index import TextIndex

    entities = read_table(inputs["entities"], ENTITIES)
    corpus = read_table(inputs["corpus"], CORPUS)
    gallery = read_table(inputs["gallery"], GALLERY)
    t0 = time.perf_counter()
    text = TextIndex.build(corpus, show_progress=True)
    t_text = time.perf_counter() - t0
    embedder = load_embedder(params.embedder)
    image = ImageIndex.build(gallery, inputs["gallery_dir"], embedder, batch_size=params.batch_size)
    t_image = time.perf_counter() - t0 - t_text
    text_recall = text_probe(text, entities.to_pylist(), params.k)
    image_recall = image_probe(image, gallery.to_pylist(), inputs["gallery_dir"], params.k, params.batch_size)
    metrics = {
        "documents": len(text),
        "gallery_indexed": len(image),
        f"text_recall_at_{params.k}": round(text_recall, 4),
        f"image_recall_at_{params.k}": round(image_recall, 4),
        "text_build_s": round(t_text, 2),
        "image_build_s": round(t_image, 2),
    }
    log.info("index: %s", metrics)
    problems = []
    if len(text) != corpus.num_rows:
        problems.append(f"text index holds {len(text)} documents, corpus has {corpus.num_rows}")
    if text_recall < params.min_text_recall:
        problems.append(f"text recall@{params.k} {text_recall:.3f} < index.min_text_recall {params.min_text_recall}")
    if image_recall < params.min_image_recall:
        problems.append(f"image recall@{params.k} {image_recall:.3f} < index.min_image_recall "
                        f"{params.min_image_recall}")
    if problems:
        raise RuntimeError("index probe failed (previous indexes kept): " + "; ".join(problems))
    with atomic_dir(outputs["out"]) as out:
        text.save(out / "text")
        image.save(out / "image")
        manifest = {"documents": len(text), "images": len(image), "embedder": params.embedder}
        atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    write_metrics(outputs["metrics"], metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    with expected_errors():
        params, inputs, outputs = stage_args(
            SECTION, Params, argv, inputs=("entities", "corpus", "gallery", "gallery_dir"), outputs=("out", "metrics")
        )
        run(params, inputs, outputs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
