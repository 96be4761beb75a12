"""BM25 text index over the world's corpus: the backend behind the agent's ``text_search`` tool.

What it does
    :class:`TextIndex` indexes a CORPUS table (:data:`mars.data.schemas.CORPUS`: doc_id, entity_id, title,
    text, is_distractor) with `bm25s <https://github.com/xhluca/bm25s>`_ and answers ``search(query, k)``
    with :class:`TextHit` records, best first. The title is indexed twice (a cheap title boost) together
    with the text. BM25 parameters are k1=1.2, b=0.3: world documents are short and of similar length,
    and with the usual b=0.75 a short document that merely names the entity beats the one holding the
    asked fact (fact-doc recall@1 0.58 -> 0.90 on the 100k-doc bench corpus, bench/SEARCH_CHOICE.md).

    Tokenisation (:func:`tokenize`, used for documents and queries alike): Unicode NFKD with accents
    stripped, lowercase, maximal ``[a-z0-9]+`` runs, a small English stopword list removed, single letters
    dropped (digits kept). No stemming and no fuzzy matching, on purpose: entity names must match exactly,
    so a distractor whose name differs by one letter ("Velmora" vs "Velmara") does not share the name
    token and ranks below the true entity's documents for a query with the true name.

    Ordering is deterministic: score descending, ties by doc_id ascending. Only documents sharing at least
    one query token (score > 0) are returned, so fewer than ``k`` hits (or none) is a valid answer.

    ``save(dir)`` is atomic: everything is written to a temporary sibling directory, then renamed into
    place (an existing index is moved aside first and only deleted once the new one is in place; if
    anything fails, the old index is left as it was). ``dir/manifest.json`` records the backend, its
    version, the format version, the document count and a SHA-256 over the sorted doc ids; ``load``
    checks all of them and fails with :class:`IndexLoadError` naming the directory and what is wrong.

Why bm25s (not tantivy)
    Measured on a 100k-document synthetic corpus in ``bench/SEARCH_CHOICE.md`` (reproduce with
    ``python bench/bench_search.py --compare-text-backends``): p50/p99 0.42/0.66 ms (tantivy 0.30/0.51,
    naive scan 85/129 ms). Both are fast enough; bm25s lets us set k1/b (tantivy's are fixed at b=0.75:
    recall@1 0.60 vs 0.90), gives every document's score so ties are broken by doc_id exactly, and is
    plain numpy/json files on disk with no writer lock. tantivy builds faster and is 8x smaller on disk.

Deviation from the paper
    MARS searches the live web / Wikipedia through a search API. We search an offline, generated world
    corpus; tantivy over a local Wikipedia dump, or a cached web API (:mod:`mars.tools.web`), is the scale-up path
    (bench/SEARCH_CHOICE.md; docs/design.md, The scale path).

How to run
    >>> idx = TextIndex.build(corpus_table)          # pa.Table with the CORPUS columns
    >>> idx.save(Path("data/index/text"))
    >>> idx = TextIndex.load(Path("data/index/text"))
    >>> idx.search("When was the Velmora Observatory founded?", k=5)
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import bm25s
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mars.data.io import atomic_dir
from mars.errors import StageError

__all__ = [
    "STOPWORDS",
    "IndexLoadError",
    "TextHit",
    "TextIndex",
    "ids_digest",
    "read_manifest",
    "tokenize",
]

FORMAT_VERSION = 1
BACKEND = "bm25s"
TITLE_REPEAT = 2  # the title is indexed this many times (a cheap field boost)
BM25_K1 = 1.2
BM25_B = 0.3  # weak length normalisation: world docs are short and of similar length (see bench/SEARCH_CHOICE.md)
MANIFEST = "manifest.json"
DOCS_FILE = "docs.parquet"
BM25_DIR = "bm25"
_BM25_FILES = (
    "data.csc.index.npy",
    "indices.csc.index.npy",
    "indptr.csc.index.npy",
    "vocab.index.json",
    "params.index.json",
)
_DOC_COLUMNS = ("doc_id", "entity_id", "title", "text")

STOPWORDS: frozenset[str] = frozenset(
    """
    a an and are as at be been but by can could did do does for from had has have he her his how i if in
    into is it its me my no not of on or our she so than that the their them then there these they this
    those to was we were what when where which who whom whose why will with would you your about after
    also any before did each other over such up out s t
    """.split()
)

_TOKEN_RE = re.compile(r"[a-z0-9]+")


class IndexLoadError(StageError, ValueError):
    """An index directory is missing, incomplete, corrupt or built for something else."""


def tokenize(text: str) -> list[str]:
    """Lowercase alphanumeric tokens of ``text`` without stopwords and single letters (digits kept)."""
    norm = unicodedata.normalize("NFKD", text)
    norm = "".join(ch for ch in norm if not unicodedata.combining(ch)).lower()
    return [t for t in _TOKEN_RE.findall(norm) if t not in STOPWORDS and (len(t) > 1 or t.isdigit())]


def ids_digest(ids: Sequence[str]) -> str:
    """SHA-256 (hex) over ``ids`` in the given order, newline separated."""
    h = hashlib.sha256()
    for i in ids:
        h.update(i.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def read_manifest(directory: Path, kind: str) -> dict:
    """Read ``directory/manifest.json`` or raise :class:`IndexLoadError` saying what is wrong."""
    directory = Path(directory)
    if not directory.exists():
        raise IndexLoadError(f"{kind} index directory {directory} does not exist (build and save it first)")
    if not directory.is_dir():
        raise IndexLoadError(f"{kind} index path {directory} is not a directory")
    path = directory / MANIFEST
    if not path.is_file():
        raise IndexLoadError(f"{kind} index directory {directory} has no {MANIFEST} (incomplete or not an index)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexLoadError(f"{kind} index manifest {path} is unreadable or not valid JSON: {exc}") from exc
    if not isinstance(manifest, dict):
        raise IndexLoadError(f"{kind} index manifest {path} is not a JSON object")
    return manifest


def _require(manifest: dict, key: str, directory: Path, kind: str) -> object:
    if key not in manifest:
        raise IndexLoadError(f"{kind} index manifest in {directory} lacks the key {key!r}")
    return manifest[key]


@dataclass(frozen=True, slots=True)
class TextHit:
    """One search result: a corpus document and its BM25 score."""

    doc_id: str
    entity_id: str
    title: str
    text: str
    score: float


class TextIndex:
    """BM25 (bm25s) index over a CORPUS table; see the module docstring."""

    def __init__(self, docs: pa.Table, bm25: bm25s.BM25) -> None:
        # docs: the _DOC_COLUMNS, sorted by doc_id; row i is BM25 document i.
        self._doc_ids: list[str] = docs.column("doc_id").to_pylist()
        self._entity_ids: list[str] = docs.column("entity_id").to_pylist()
        self._titles: list[str] = docs.column("title").to_pylist()
        self._texts: list[str] = docs.column("text").to_pylist()
        self._docs = docs
        self._bm25 = bm25
        self._vocab: dict[str, int] = bm25.vocab_dict

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def build(cls, docs: pa.Table, *, show_progress: bool = False) -> TextIndex:
        """Index a CORPUS table (extra columns are ignored). Fails on missing columns, nulls or duplicate ids."""
        missing = [c for c in _DOC_COLUMNS if c not in docs.column_names]
        if missing:
            raise ValueError(f"corpus table lacks column(s) {missing}; expected the CORPUS schema {_DOC_COLUMNS}")
        if docs.num_rows == 0:
            raise ValueError("corpus table is empty: nothing to index")
        table = docs.select(list(_DOC_COLUMNS)).cast(
            pa.schema([pa.field(c, pa.string(), nullable=False) for c in _DOC_COLUMNS])
        )
        for c in _DOC_COLUMNS:
            if table.column(c).null_count:
                raise ValueError(f"corpus column {c!r} has {table.column(c).null_count} null(s)")
        table = table.sort_by("doc_id")
        ids = table.column("doc_id").to_pylist()
        dupes = sorted({a for a, b in zip(ids, ids[1:]) if a == b})
        if dupes:
            raise ValueError(f"corpus has duplicate doc_id(s), e.g. {dupes[:5]}")
        titles = table.column("title").to_pylist()
        texts = table.column("text").to_pylist()
        corpus_tokens = [tokenize(" ".join([t] * TITLE_REPEAT + [x])) for t, x in zip(titles, texts)]
        bm25 = bm25s.BM25(k1=BM25_K1, b=BM25_B)
        bm25.index(corpus_tokens, show_progress=show_progress)
        return cls(table, bm25)

    def save(self, directory: Path) -> None:
        """Write the index to ``directory`` atomically (see :func:`mars.data.io.atomic_dir`)."""
        directory = Path(directory)
        with atomic_dir(directory) as tmp:
            pq.write_table(self._docs, tmp / DOCS_FILE)
            self._bm25.save(str(tmp / BM25_DIR), show_progress=False)
            manifest = {
                "kind": "text",
                "backend": BACKEND,
                "backend_version": bm25s.__version__,
                "format_version": FORMAT_VERSION,
                "doc_count": len(self),
                "doc_ids_sha256": ids_digest(self._doc_ids),
                "tokenizer": {"stopwords": len(STOPWORDS), "title_repeat": TITLE_REPEAT},
                "bm25": {"k1": BM25_K1, "b": BM25_B, "method": "lucene"},
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: Path) -> TextIndex:
        """Load an index saved by :meth:`save`; :class:`IndexLoadError` names the directory and the problem."""
        directory = Path(directory)
        manifest = read_manifest(directory, "text")
        backend = _require(manifest, "backend", directory, "text")
        if backend != BACKEND:
            raise IndexLoadError(f"text index in {directory} was built with backend {backend!r}, expected {BACKEND!r}")
        version = _require(manifest, "format_version", directory, "text")
        if version != FORMAT_VERSION:
            raise IndexLoadError(
                f"text index in {directory} has format_version {version!r}, this code reads "
                f"{FORMAT_VERSION}; rebuild it"
            )
        count = _require(manifest, "doc_count", directory, "text")
        digest = _require(manifest, "doc_ids_sha256", directory, "text")
        missing = [DOCS_FILE] if not (directory / DOCS_FILE).is_file() else []
        missing += [f"{BM25_DIR}/{f}" for f in _BM25_FILES if not (directory / BM25_DIR / f).is_file()]
        if missing:
            raise IndexLoadError(f"text index directory {directory} is incomplete: missing {missing}")
        try:
            docs = pq.read_table(directory / DOCS_FILE)
        except Exception as exc:  # pyarrow raises several types for damaged files
            raise IndexLoadError(f"text index file {directory / DOCS_FILE} is corrupt: {exc}") from exc
        if [c for c in _DOC_COLUMNS if c not in docs.column_names]:
            raise IndexLoadError(f"text index file {directory / DOCS_FILE} lacks columns; expected {_DOC_COLUMNS}")
        try:
            bm25 = bm25s.BM25.load(str(directory / BM25_DIR), show_progress=False, verbosity=0)
        except Exception as exc:
            raise IndexLoadError(f"text index files under {directory / BM25_DIR} are corrupt: {exc}") from exc
        if docs.num_rows != count:
            raise IndexLoadError(
                f"text index in {directory}: manifest says {count} docs, {DOCS_FILE} holds {docs.num_rows}"
            )
        n_bm25 = int(bm25.scores["num_docs"])
        if n_bm25 != count:
            raise IndexLoadError(f"text index in {directory}: manifest says {count} docs, the BM25 matrix has {n_bm25}")
        if ids_digest(docs.column("doc_id").to_pylist()) != digest:
            raise IndexLoadError(
                f"text index in {directory}: doc ids do not match the manifest hash (corrupt or mixed files)"
            )
        return cls(docs.select(list(_DOC_COLUMNS)), bm25)

    # --- queries ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._doc_ids)

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document (float32, doc_id order) for ``query``; zeros if no token is known."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("text_search query is empty: pass a few words, e.g. an entity name")
        ids = sorted({self._vocab[t] for t in tokenize(query) if t in self._vocab})
        if not ids:
            return np.zeros(len(self), dtype=np.float32)
        return np.asarray(self._bm25.get_scores_from_ids(ids), dtype=np.float32)

    def search(self, query: str, k: int = 5) -> list[TextHit]:
        """Top ``k`` documents for ``query`` (score desc, ties by doc_id); only documents with score > 0.

        Raises ValueError for an empty/whitespace query or ``k < 1``. A query made only of stopwords or
        unknown words returns ``[]``.
        """
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        scores = self.scores(query)
        cand = np.flatnonzero(scores > 0)
        if cand.size > k:
            s = scores[cand]
            kth = np.partition(s, cand.size - k)[cand.size - k]  # k-th largest score
            cand = cand[s >= kth]  # keeps every doc tied at the cut-off
        order = cand[np.lexsort((cand, -scores[cand]))][:k]  # rows are sorted by doc_id
        return [
            TextHit(
                doc_id=self._doc_ids[i],
                entity_id=self._entity_ids[i],
                title=self._titles[i],
                text=self._texts[i],
                score=float(scores[i]),
            )
            for i in order.tolist()
        ]
