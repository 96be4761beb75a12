"""Benchmark of the search backends behind ``text_search`` and ``image_search``.

What it does
    Text: generates a synthetic corpus (entities with pseudo-word names and facts written as 40-120-word
    documents, plus distractor entities whose name differs by one letter), builds a
    :class:`mars.tools.text_index.TextIndex` (bm25s), and measures build time, saved size, p50/p99 query
    latency and recall (the fact document of the entity named in the query in the top 1 / 5; the top hit
    from the named entity, not its one-letter distractor). Baseline, measured in the same run: a naive
    linear scan scoring every document by query-token overlap.

    Image: draws procedural emblems (a shape in 2-3 colours with a letter glyph), renders ``--images``
    gallery renderings (random scale 0.6-1.0, rotation 0-360, colour jitter +-10%, noise, plain/noisy
    backgrounds) plus held-out renderings as queries, embeds them in batches with the default embedder,
    builds a :class:`mars.tools.image_index.ImageIndex` (faiss IndexFlatIP) and measures embedding and build
    time, p50/p99 single-query latency (search only, and end-to-end with embedding) and recall@1/@5.
    Baseline, same run: numpy brute-force matmul over the same embeddings.

    ``--compare-text-backends`` additionally builds tantivy over the same pre-tokenised corpus (same
    tokeniser, title repeated as in bm25s) and prints build time, index size, p50/p99 latency and recall
    for both engines: the measurement behind bench/SEARCH_CHOICE.md. Tantivy is imported only here.

Deviation from the paper
    The paper's tools search the live web and Wikipedia; this measures the offline world's backends.

How to run
    python bench/bench_search.py                      # 100k docs, 10k images
    python bench/bench_search.py --docs 20000 --images 2000 --queries 200
    python bench/bench_search.py --compare-text-backends --skip-images
    Rendered emblems are cached under --cache-dir (default: $TMPDIR/mars_bench_cache).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image, ImageDraw, ImageFont

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mars.tools.embedders import load_embedder  # noqa: E402
from mars.tools.image_index import ImageIndex  # noqa: E402
from mars.tools.text_index import TITLE_REPEAT, TextIndex, tokenize  # noqa: E402

# =====================================================================================================
# synthetic corpus
# =====================================================================================================

_CONS = list("bcdfghjklmnprstvz") + ["th", "sh", "ch", "br", "tr", "kr", "st"]
_VOWS = list("aeiou") + ["ae", "io", "ou"]
_KINDS = (
    "Observatory Guild Foundry Society Institute Library Academy Brewery Company Museum Orchestra Press "
    "Collective Mill Trust Workshop Archive Gallery Conservatory Hospital"
).split()
_FILLER = (
    "the a of and in to its was is for with on by as from at which this that over more many new old local "
    "early later known work works members visitors annual report building hall collection river north south "
    "east west century period during after before under several number large small famous public private "
    "program season record records history histories community region regional national council market "
    "trade craft crafts tradition festival exhibition journal letters notes survey study studies map maps "
    "bridge tower garden harbour station square street road quarter district valley hill coast island"
).split()


def _word(rng: np.random.Generator, syll: int) -> str:
    return "".join(str(rng.choice(_CONS)) + str(rng.choice(_VOWS)) for _ in range(syll)) + str(
        rng.choice(["", "n", "r", "s", "l", "x"])
    )


def _one_letter_variant(rng: np.random.Generator, word: str) -> str:
    while True:
        i = int(rng.integers(1, len(word)))
        c = word[i]
        pool = "aeiou" if c in "aeiou" else "bcdfghklmnprstvz"
        new = word[:i] + str(rng.choice([x for x in pool if x != c])) + word[i + 1 :]
        if new != word:
            return new


def make_corpus(n_docs: int, seed: int = 0, n_queries: int = 1000) -> tuple[pa.Table, list[tuple[str, str, str]]]:
    """A CORPUS table of about ``n_docs`` docs and queries ``(query, entity_id, fact doc_id)``."""
    rng = np.random.default_rng(seed)
    filler_p = 1.0 / np.arange(1, len(_FILLER) + 1)
    filler_p /= filler_p.sum()
    extra_vocab = [_word(rng, 2) for _ in range(3000)]
    cities = sorted({_word(rng, 2).capitalize() for _ in range(400)})
    n_ent = max(4, int(n_docs / (4 + 2 / 3)))
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < n_ent:
        w = _word(rng, int(rng.integers(2, 4))).capitalize()
        if w not in seen:
            seen.add(w)
            names.append(w)
    rows: dict[str, list] = {k: [] for k in ("doc_id", "entity_id", "title", "text", "is_distractor")}

    def filler(n: int) -> str:
        words = []
        for _ in range(n):
            if rng.random() < 0.35:
                words.append(str(extra_vocab[int(rng.integers(len(extra_vocab)))]))
            else:
                words.append(str(_FILLER[int(rng.choice(len(_FILLER), p=filler_p))]))
        if rng.random() < 0.3:  # cross-reference to another entity
            words.insert(int(rng.integers(len(words) + 1)), names[int(rng.integers(len(names)))])
        return " ".join(words) + "."

    def add(eid: str, title: str, text: str, distractor: bool) -> str:
        did = f"doc{len(rows['doc_id']):07d}"
        rows["doc_id"].append(did)
        rows["entity_id"].append(eid)
        rows["title"].append(title)
        rows["text"].append(text)
        rows["is_distractor"].append(distractor)
        return did

    facts: list[tuple[str, str, dict[str, str]]] = []
    for e, base in enumerate(names):
        if len(rows["doc_id"]) >= n_docs:
            break
        kind = str(rng.choice(_KINDS))
        name = f"{base} {kind}"
        eid = f"ent{e:06d}"
        year = int(rng.integers(1700, 2021))
        city = str(rng.choice(cities))
        founder = f"{_word(rng, 2).capitalize()} {_word(rng, 2).capitalize()}"

        def body(first: str) -> str:
            n = int(rng.integers(40, 121))
            return first + " " + filler(max(5, n - len(first.split())))

        docs = {
            "year": add(eid, f"{name}", body(f"The {name} was founded in {year} in {city}."), False),
            "founder": add(eid, f"{name}: people", body(f"{founder} established the {name} and led it."), False),
            "city": add(eid, f"{name}: location", body(f"The {name} is based in {city} near the {kind.lower()} quarter."), False),
            "misc": add(eid, f"{name}: notes", body(f"Notes about the {name}."), False),
        }
        facts.append((name, eid, docs))
        if rng.random() < 2 / 3:  # a distractor entity with a one-letter-different name
            dname = f"{_one_letter_variant(rng, base)} {kind}"
            if dname.split()[0] not in seen:
                seen.add(dname.split()[0])
                did_e = f"dis{e:06d}"
                dyear = int(rng.integers(1700, 2021))
                add(did_e, dname, body(f"The {dname} was founded in {dyear} in {rng.choice(cities)}."), True)
                add(did_e, f"{dname}: people", body(f"{_word(rng, 2).capitalize()} established the {dname}."), True)
    table = pa.table(rows)
    templates = {
        "year": "When was the {} founded?",
        "founder": "Who established the {}?",
        "city": "Where is the {} based?",
    }
    queries = []
    for j in rng.choice(len(facts), size=min(n_queries, len(facts)), replace=False):
        name, eid, docs = facts[int(j)]
        fact = str(rng.choice(list(templates)))
        queries.append((templates[fact].format(name), eid, docs[fact]))
    return table, queries


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _pct(lat: list[float]) -> tuple[float, float]:
    a = np.asarray(lat) * 1000.0
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


class NaiveTextScan:
    """Baseline: score = number of distinct query tokens in the document, linear scan, ties by doc id."""

    def __init__(self, table: pa.Table) -> None:
        self.ids = table.column("doc_id").to_pylist()
        titles = table.column("title").to_pylist()
        texts = table.column("text").to_pylist()
        self.sets = [frozenset(tokenize(t + " " + x)) for t, x in zip(titles, texts)]

    def search(self, query: str, k: int) -> list[str]:
        q = set(tokenize(query))
        scored = [(len(q & s), i) for i, s in enumerate(self.sets)]
        scored = [x for x in scored if x[0] > 0]
        scored.sort(key=lambda x: (-x[0], self.ids[x[1]]))
        return [self.ids[i] for _, i in scored[:k]]


def _recall(results: list[list[str]], queries: list[tuple[str, str, str]], doc_entity: dict[str, str]) -> dict[str, float]:
    n = len(queries)
    r1 = sum(q[2] in res[:1] for res, q in zip(results, queries)) / n
    r5 = sum(q[2] in res[:5] for res, q in zip(results, queries)) / n
    ent1 = sum(bool(res) and doc_entity[res[0]] == q[1] for res, q in zip(results, queries)) / n
    return {"fact_r@1": r1, "fact_r@5": r5, "entity_top1": ent1}


def bench_text(n_docs: int, n_queries: int, seed: int, compare: bool, rows: list, notes: list[str]) -> None:
    t0 = time.perf_counter()
    table, queries = make_corpus(n_docs, seed=seed, n_queries=n_queries)
    notes.append(f"corpus: {table.num_rows} docs generated in {time.perf_counter() - t0:.1f}s, {len(queries)} queries")
    doc_entity = dict(zip(table.column("doc_id").to_pylist(), table.column("entity_id").to_pylist()))

    t0 = time.perf_counter()
    idx = TextIndex.build(table)
    t_build = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as td:
        t0 = time.perf_counter()
        idx.save(Path(td) / "text")
        t_save = time.perf_counter() - t0
        size = _dir_size(Path(td) / "text")
        t0 = time.perf_counter()
        TextIndex.load(Path(td) / "text")
        t_load = time.perf_counter() - t0
    for q, _, _ in queries[:20]:  # warm-up
        idx.search(q, 5)
    gc.collect()
    lat, res = [], []
    for q, _, _ in queries:
        t0 = time.perf_counter()
        hits = idx.search(q, 5)
        lat.append(time.perf_counter() - t0)
        res.append([h.doc_id for h in hits])
    rec = _recall(res, queries, doc_entity)

    t0 = time.perf_counter()
    naive = NaiveTextScan(table)
    t_naive_build = time.perf_counter() - t0
    nq_naive = min(len(queries), 100)
    lat_n, res_n = [], []
    for q, _, _ in queries[:nq_naive]:
        t0 = time.perf_counter()
        res_n.append(naive.search(q, 5))
        lat_n.append(time.perf_counter() - t0)
    rec_n = _recall(res_n, queries[:nq_naive], doc_entity)
    p50n, p99n = _pct(lat_n)
    p50, p99 = _pct(lat)
    rows.append((f"text naive scan ({table.num_rows} docs, {nq_naive} q) [baseline]", p50n, p99n, 1.0, 1.0))
    rows.append((f"text TextIndex.search bm25s ({table.num_rows} docs)", p50, p99, p50n / p50, p99n / p99))
    notes.append(
        f"text bm25s: build {t_build:.1f}s, save {t_save:.1f}s, load {t_load:.2f}s, size {size / 1e6:.1f} MB; "
        f"recall {_fmt(rec)}"
    )
    notes.append(f"text naive scan: prepare {t_naive_build:.1f}s; recall {_fmt(rec_n)}")
    if compare:
        _bench_tantivy(table, queries, doc_entity, rows, notes, p50n, p99n)


def _fmt(d: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in d.items())


def _bench_tantivy(table: pa.Table, queries: list, doc_entity: dict, rows: list, notes: list, p50n: float, p99n: float) -> None:
    import tantivy

    ids = table.column("doc_id").to_pylist()
    titles = table.column("title").to_pylist()
    texts = table.column("text").to_pylist()
    with tempfile.TemporaryDirectory() as td:
        t0 = time.perf_counter()
        sb = tantivy.SchemaBuilder()
        sb.add_text_field("doc_id", stored=True, tokenizer_name="raw")
        sb.add_text_field("body", stored=False, tokenizer_name="whitespace", index_option="freq")
        schema = sb.build()
        index = tantivy.Index(schema, path=td)
        writer = index.writer(heap_size=200_000_000, num_threads=1)
        for i, t, x in zip(ids, titles, texts):
            writer.add_document(tantivy.Document(doc_id=i, body=" ".join(tokenize(" ".join([t] * TITLE_REPEAT + [x])))))
        writer.commit()
        writer.wait_merging_threads()
        index.reload()
        t_build = time.perf_counter() - t0
        size = _dir_size(Path(td))
        searcher = index.searcher()

        def run(q: str) -> list[str]:
            toks = sorted(set(tokenize(q)))
            query = tantivy.Query.boolean_query(
                [(tantivy.Occur.Should, tantivy.Query.term_query(schema, "body", tok)) for tok in toks]
            )
            return [searcher.doc(addr)["doc_id"][0] for _, addr in searcher.search(query, 5, count=False).hits]

        for q, _, _ in queries[:20]:  # warm-up
            run(q)
        gc.collect()
        lat, res = [], []
        for q, _, _ in queries:
            t0 = time.perf_counter()
            res.append(run(q))
            lat.append(time.perf_counter() - t0)
    p50, p99 = _pct(lat)
    rows.append((f"text tantivy, same tokens ({table.num_rows} docs)", p50, p99, p50n / p50, p99n / p99))
    notes.append(
        f"text tantivy (k1=1.2, b=0.75 fixed): build {t_build:.1f}s (1 writer thread), size {size / 1e6:.1f} MB; "
        f"recall {_fmt(_recall(res, queries, doc_entity))}"
    )
    # bm25s with tantivy's fixed BM25 parameters: separates the engine from the parameter choice
    import bm25s

    ref = bm25s.BM25(k1=1.2, b=0.75)
    ref.index([tokenize(" ".join([t] * TITLE_REPEAT + [x])) for t, x in zip(titles, texts)], show_progress=False)
    res_ref = []
    for q, _, _ in queries:
        sc = ref.get_scores([tok for tok in tokenize(q) if tok in ref.vocab_dict])
        res_ref.append([ids[i] for i in np.lexsort((np.arange(len(sc)), -sc))[:5]])
    notes.append(f"text bm25s with k1=1.2, b=0.75 (tantivy's): recall {_fmt(_recall(res_ref, queries, doc_entity))}")


# =====================================================================================================
# procedural emblems (a stand-in for mars/world's generator, which this file must not depend on)
# =====================================================================================================

SHAPES = ("circle", "square", "triangle", "hexagon", "star", "diamond")
PALETTE = (
    (215, 40, 40), (240, 140, 30), (240, 205, 40), (60, 165, 60), (30, 140, 140), (40, 90, 200),
    (120, 60, 180), (230, 110, 170), (120, 75, 35), (245, 245, 245), (25, 25, 25), (140, 140, 140),
    (120, 195, 240), (160, 210, 80),
)  # fmt: skip
LETTERS = "ABCDEFGHJKLPRSTUVXYZ"  # no rotation-ambiguous pairs (M/W, N/Z) or near-symmetric ones (O/Q, I)


def emblem_specs(n: int, seed: int = 0) -> list[dict]:
    """``n`` distinct emblem specs: shape, 2-3 palette colours (fill, optional ring, glyph), letter."""
    rng = np.random.default_rng(seed)
    specs, seen = [], set()
    while len(specs) < n:
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        k = int(rng.integers(2, 4))
        cols = tuple(int(c) for c in rng.choice(len(PALETTE), size=k, replace=False))
        letter = LETTERS[int(rng.integers(len(LETTERS)))]
        key = (shape, cols, letter)
        if key not in seen:
            seen.add(key)
            specs.append({"shape": shape, "colors": cols, "letter": letter})
    return specs


def _shape_points(shape: str, c: float, r: float) -> list[tuple[float, float]]:
    def poly(n: int, rot: float, rr: float) -> list[tuple[float, float]]:
        return [(c + rr * math.cos(rot + 2 * math.pi * i / n), c + rr * math.sin(rot + 2 * math.pi * i / n)) for i in range(n)]

    if shape == "square":
        return poly(4, math.pi / 4, r * 1.0)
    if shape == "triangle":
        return poly(3, -math.pi / 2, r * 1.05)
    if shape == "hexagon":
        return poly(6, 0.0, r)
    if shape == "diamond":
        return [(c, c - r), (c + 0.58 * r, c), (c, c + r), (c - 0.58 * r, c)]
    if shape == "star":
        pts = []
        for i in range(10):
            rr = r if i % 2 == 0 else r * 0.45
            a = -math.pi / 2 + math.pi * i / 5
            pts.append((c + rr * math.cos(a), c + rr * math.sin(a)))
        return pts
    raise ValueError(shape)


def draw_emblem(spec: dict, size: int = 128) -> Image.Image:
    """The canonical emblem as RGBA with a transparent background."""
    ss = size * 2  # draw at 2x and downsample: antialiased edges
    im = Image.new("RGBA", (ss, ss), (0, 0, 0, 0))
    d = ImageDraw.Draw(im)
    c, r = ss / 2, ss * 0.47
    cols = [PALETTE[i] for i in spec["colors"]]
    fill, glyph = cols[0], cols[-1]
    ring = cols[1] if len(cols) == 3 else None

    def shape_at(rr: float, col: tuple[int, int, int]) -> None:
        if spec["shape"] == "circle":
            d.ellipse([c - rr, c - rr, c + rr, c + rr], fill=col)
        else:
            d.polygon(_shape_points(spec["shape"], c, rr), fill=col)

    if ring is not None:
        shape_at(r, ring)
        shape_at(r * 0.78, fill)
    else:
        shape_at(r, fill)
    fsize = {"triangle": 0.30, "star": 0.26, "diamond": 0.34}.get(spec["shape"], 0.46) * ss
    cy = c + (0.12 * r if spec["shape"] == "triangle" else 0.0)
    font = ImageFont.load_default(size=int(fsize))
    d.text((c, cy), spec["letter"], fill=glyph, font=font, anchor="mm")
    return im.resize((size, size), Image.LANCZOS)


def render_variant(
    canon: Image.Image, rng: np.random.Generator, out: int = 96, background: Image.Image | None = None
) -> Image.Image:
    """One gallery-style rendering of an RGBA emblem: scale, rotation, jitter, background, noise."""
    scale = float(rng.uniform(0.6, 1.0))
    em_size = max(8, int(out * scale))
    em = canon.resize((em_size, em_size), Image.BILINEAR)
    em = em.rotate(float(rng.uniform(0, 360)), resample=Image.BICUBIC, expand=True)
    arr = np.asarray(em, dtype=np.float32)
    arr[..., :3] *= rng.uniform(0.9, 1.1, size=3)  # colour jitter +-10% per channel
    em = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGBA")
    if background is None:
        base = rng.integers(0, 256, size=3).astype(np.float32)
        bg = np.broadcast_to(base, (out, out, 3)).copy()
        kind = rng.integers(3)
        if kind == 1:  # per-pixel noise
            bg += rng.normal(0, rng.uniform(10, 35), size=bg.shape)
        elif kind == 2:  # gradient to a second colour
            other = rng.integers(0, 256, size=3).astype(np.float32)
            t = np.linspace(0, 1, out, dtype=np.float32)[None, :, None]
            bg = bg * (1 - t) + other * t
        background = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8), "RGB")
    img = background.copy()
    slack_x, slack_y = img.width - em.width, img.height - em.height
    ox = slack_x // 2 + int(rng.integers(-abs(slack_x) // 4 - 1, abs(slack_x) // 4 + 1))
    oy = slack_y // 2 + int(rng.integers(-abs(slack_y) // 4 - 1, abs(slack_y) // 4 + 1))
    img.paste(em, (ox, oy), em)
    a = np.asarray(img, dtype=np.float32)
    a += rng.normal(0, rng.uniform(0, 8), size=a.shape)
    return Image.fromarray(np.clip(a, 0, 255).astype(np.uint8), "RGB")


def make_gallery(
    n_ids: int, per_id: int, heldout_per_id: int, directory: Path, seed: int = 0, out: int = 96
) -> pa.Table:
    """Render a GALLERY table (and PNG files under ``directory``); cached by file name."""
    directory.mkdir(parents=True, exist_ok=True)
    specs = emblem_specs(n_ids, seed)
    rows: dict[str, list] = {k: [] for k in ("gallery_id", "entity_id", "title", "path", "split", "width", "height")}
    for e, spec in enumerate(specs):
        canon = draw_emblem(spec)
        rng = np.random.default_rng([seed, e])
        for j in range(per_id + heldout_per_id):
            split = "index" if j < per_id else "heldout"
            rel = f"e{e:05d}_{j:03d}_{out}_{seed}.png"
            img = render_variant(canon, rng, out)  # always drawn, so the rng stream does not depend on the cache
            if not (directory / rel).exists():
                img.save(directory / rel)
            rows["gallery_id"].append(f"g{e:05d}_{j:03d}")
            rows["entity_id"].append(f"ent{e:05d}")
            rows["title"].append(f"{spec['shape']} emblem {spec['letter']} of entity {e}")
            rows["path"].append(rel)
            rows["split"].append(split)
            rows["width"].append(out)
            rows["height"].append(out)
    return pa.table(rows)


def bench_image(n_images: int, seed: int, cache_dir: Path, rows: list, notes: list[str], batch: int = 256) -> None:
    per_id, held = 10, 2
    n_ids = max(2, n_images // per_id)
    gdir = cache_dir / "gallery"
    t0 = time.perf_counter()
    table = make_gallery(n_ids, per_id, held, gdir, seed=seed)
    notes.append(f"gallery: {n_ids} emblems x {per_id} index + {held} held-out renderings, 96 px, "
                 f"generated/cached in {time.perf_counter() - t0:.1f}s")
    emb = load_embedder("color_layout")
    t0 = time.perf_counter()
    index = ImageIndex.build(table, gdir, emb, batch_size=batch, show_progress=True)
    t_build = time.perf_counter() - t0
    n = len(index)
    with tempfile.TemporaryDirectory() as td:
        index.save(Path(td) / "img")
        size = _dir_size(Path(td) / "img")
    held_rows = table.filter(pa.compute.equal(table.column("split"), "heldout"))
    q_imgs = [Image.open(gdir / p).convert("RGB") for p in held_rows.column("path").to_pylist()]
    q_ent = held_rows.column("entity_id").to_pylist()
    t0 = time.perf_counter()
    q_emb = emb.embed(q_imgs)
    t_q_embed = (time.perf_counter() - t0) / len(q_imgs)
    gal = index.embeddings()
    faiss_index = index._index  # the raw faiss IndexFlatIP, for the engine-only row
    # numpy brute force baseline: matmul + top-5
    gc.collect()
    lat_n = []
    for v in q_emb:
        t0 = time.perf_counter()
        s = gal @ v
        cand = np.argpartition(-s, 5)[:5]
        cand[np.argsort(-s[cand], kind="stable")]
        lat_n.append(time.perf_counter() - t0)
    # faiss engine only, one query at a time
    lat_r = []
    for v in q_emb:
        t0 = time.perf_counter()
        faiss_index.search(v[None, :], 5)
        lat_r.append(time.perf_counter() - t0)
    # ImageIndex.search_vectors: faiss + deterministic tie order + ImageHit records
    lat_f, top = [], []
    for v in q_emb:
        t0 = time.perf_counter()
        hits = index.search_vectors(v[None, :], 5)[0]
        lat_f.append(time.perf_counter() - t0)
        top.append([h.entity_id for h in hits])
    # batches of 100 queries: per-query time of one call
    lat_nb, lat_fb = [], []
    for b0 in range(0, len(q_emb) - 99, 100):
        qb = q_emb[b0 : b0 + 100]
        t0 = time.perf_counter()
        np.argpartition(-(qb @ gal.T), 5, axis=1)[:, :5]
        lat_nb.append((time.perf_counter() - t0) / len(qb))
        t0 = time.perf_counter()
        faiss_index.search(qb, 5)
        lat_fb.append((time.perf_counter() - t0) / len(qb))
    # end-to-end (multi-view query embedding + search), on a subset
    lat_e, top_mv = [], []
    n_mv = min(len(q_imgs), 500)
    for im in q_imgs[:n_mv]:
        t0 = time.perf_counter()
        hits = index.search(im, 5)
        lat_e.append(time.perf_counter() - t0)
        top_mv.append([h.entity_id for h in hits])
    r1_mv = float(np.mean([t[0] == e for t, e in zip(top_mv, q_ent)]))
    r5_mv = float(np.mean([e in t for t, e in zip(top_mv, q_ent)]))
    r1 = float(np.mean([t[0] == e for t, e in zip(top, q_ent)]))
    r5 = float(np.mean([e in t for t, e in zip(top, q_ent)]))
    p50n, p99n = _pct(lat_n)
    p50r, p99r = _pct(lat_r)
    p50, p99 = _pct(lat_f)
    p50e, p99e = _pct(lat_e)
    rows.append((f"image numpy matmul+top5 ({n} imgs) [baseline]", p50n, p99n, 1.0, 1.0))
    rows.append((f"image faiss IndexFlatIP.search ({n} imgs)", p50r, p99r, p50n / p50r, p99n / p99r))
    rows.append((f"image ImageIndex.search_vectors ({n} imgs)", p50, p99, p50n / p50, p99n / p99))
    rows.append((f"image ImageIndex.search, embeds ({n} imgs)", p50e, p99e, p50n / p50e, p99n / p99e))
    if lat_nb:
        p50nb, p99nb = _pct(lat_nb)
        p50fb, p99fb = _pct(lat_fb)
        rows.append(("image numpy batch of 100, per query [baseline]", p50nb, p99nb, 1.0, 1.0))
        rows.append(("image faiss batch of 100, per query", p50fb, p99fb, p50nb / p50fb, p99nb / p99fb))
    notes.append(
        f"image: embed+build {t_build:.1f}s ({t_build / n * 1000:.1f} ms/img, dim {emb.dim}), query embed "
        f"{t_q_embed * 1000:.1f} ms, index size {size / 1e6:.1f} MB; held-out recall@1={r1:.3f} "
        f"recall@5={r5:.3f} over {len(q_ent)} queries ({n_ids} emblems); with multi-view queries "
        f"(ImageIndex.search) recall@1={r1_mv:.3f} recall@5={r5_mv:.3f} over {n_mv}; faiss top-5 == numpy "
        f"top-5 for {_agree(gal, q_emb[:50], index):.0%} of 50 queries"
    )


def _agree(gal: np.ndarray, q: np.ndarray, index: ImageIndex) -> float:
    ok = 0
    for v in q:
        s = gal @ v
        ref = list(np.argsort(-s, kind="stable")[:5])
        got = [index.gallery_ids.index(h.gallery_id) for h in index.search_vectors(v[None, :], 5)[0]]
        ok += ref == got
    return ok / len(q)


# =====================================================================================================


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=100_000)
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "mars_bench_cache")
    ap.add_argument("--compare-text-backends", action="store_true", help="also measure tantivy")
    ap.add_argument("--skip-text", action="store_true")
    ap.add_argument("--skip-images", action="store_true")
    ap.add_argument("--clear-cache", action="store_true")
    ap.add_argument("--faiss-threads", type=int, default=1,
                    help="OpenMP threads for faiss (0 = faiss default); 1 avoids thread overhead on single queries")
    args = ap.parse_args(argv)
    if args.faiss_threads > 0:
        import faiss

        faiss.omp_set_num_threads(args.faiss_threads)
    if args.clear_cache and args.cache_dir.exists():
        shutil.rmtree(args.cache_dir)
    rows: list[tuple[str, float, float, float, float]] = []
    notes: list[str] = []
    if not args.skip_text:
        bench_text(args.docs, args.queries, args.seed, args.compare_text_backends, rows, notes)
    if not args.skip_images:
        bench_image(args.images, args.seed, args.cache_dir, rows, notes)
    print(f"\nload average: {os.getloadavg()[0]:.2f}; cpus: {os.cpu_count()}; faiss threads: {args.faiss_threads or 'default'}")
    print("speedup = baseline latency / this latency (baseline rows: 1x), same run, same queries")
    print(f"{'name':56s} {'p50 ms':>9s} {'p99 ms':>9s} {'speedup p50':>12s} {'speedup p99':>12s}")
    for name, p50, p99, r50, r99 in rows:
        print(f"{name:56s} {p50:9.3f} {p99:9.3f} {r50:11.3g}x {r99:11.3g}x")
    print()
    for n in notes:
        print("-", n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
