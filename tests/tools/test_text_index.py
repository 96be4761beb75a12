"""Tests of mars.tools.text_index (bm25s text search over a CORPUS table)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from mars.tools import text_index as ti
from mars.tools.text_index import IndexLoadError, TextHit, TextIndex, tokenize

_CONS = "bcdfghklmnprstvz"
_VOWS = "aeiou"
_FILLER = (
    "the a of and in its was for with by from at old new local early later known members visitors annual "
    "report building hall collection river north south century period during several public program season "
    "record history community region market trade craft festival journal survey map bridge tower garden"
).split()


def _word(rng: np.random.Generator, syll: int) -> str:
    return "".join(rng.choice(list(_CONS)) + rng.choice(list(_VOWS)) for _ in range(syll)) + rng.choice(["", "n", "r"])


def _variant(rng: np.random.Generator, word: str) -> str:
    i = int(rng.integers(1, len(word)))
    pool = _VOWS if word[i] in _VOWS else _CONS
    return word[:i] + str(rng.choice([c for c in pool if c != word[i]])) + word[i + 1 :]


def make_corpus(n_entities: int = 60, seed: int = 0) -> tuple[pa.Table, list[tuple[str, str, str]]]:
    """Entities with 3 fact documents each, a one-letter distractor for half of them; (query, entity, doc)."""
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {k: [] for k in ("doc_id", "entity_id", "title", "text", "is_distractor")}
    names: list[str] = []
    while len(names) < n_entities:
        w = _word(rng, 3).capitalize()
        if w not in names:
            names.append(w)

    def filler(n: int) -> str:
        words = [str(rng.choice(_FILLER)) for _ in range(n)]
        if rng.random() < 0.4:  # a cross-reference to another entity
            words.insert(int(rng.integers(n)), f"the {names[int(rng.integers(len(names)))]} Guild")
        return " ".join(words)

    def add(eid: str, title: str, text: str, distractor: bool) -> str:
        did = f"d{len(rows['doc_id']):05d}"
        for k, v in zip(rows, (did, eid, title, text, distractor)):
            rows[k].append(v)
        return did

    queries = []
    for e, base in enumerate(names):
        name, eid = f"{base} Guild", f"e{e:03d}"
        year, city = int(rng.integers(1700, 2020)), _word(rng, 2).capitalize()
        founder = f"{_word(rng, 2).capitalize()} {_word(rng, 2).capitalize()}"
        d_year = add(eid, name, f"The {name} was founded in {year}. {filler(int(rng.integers(30, 90)))}", False)
        d_founder = add(eid, f"{name}: people", f"{founder} established the {name}. {filler(int(rng.integers(30, 90)))}", False)
        d_city = add(eid, f"{name}: place", f"The {name} is based in {city}. {filler(int(rng.integers(30, 90)))}", False)
        queries += [
            (f"When was the {name} founded?", eid, d_year),
            (f"Who established the {name}?", eid, d_founder),
            (f"Where is the {name} based?", eid, d_city),
        ]
        if e % 2 == 0:
            dname = f"{_variant(rng, base)} Guild"
            if dname.split()[0] not in names:
                add(f"x{e:03d}", dname, f"The {dname} was founded in {int(rng.integers(1700, 2020))}. {filler(40)}", True)
                add(f"x{e:03d}", f"{dname}: people", f"{_word(rng, 2)} established the {dname}. {filler(40)}", True)
    return pa.table(rows), queries


@pytest.fixture(scope="module")
def corpus() -> tuple[pa.Table, list[tuple[str, str, str]]]:
    return make_corpus()


@pytest.fixture(scope="module")
def index(corpus: tuple[pa.Table, list]) -> TextIndex:
    return TextIndex.build(corpus[0])


def _ids(hits: list[TextHit]) -> list[str]:
    return [h.doc_id for h in hits]


def test_tokenize_lowercases_strips_accents_and_stopwords() -> None:
    assert tokenize("The Velmöra  Observatory's 1820 founding, in Ostrava!") == [
        "velmora",
        "observatory",
        "1820",
        "founding",
        "ostrava",
    ]
    assert tokenize("   ") == []


def test_build_save_load_roundtrip(tmp_path: Path, corpus: tuple[pa.Table, list], index: TextIndex) -> None:
    table, queries = corpus
    assert len(index) == table.num_rows
    index.save(tmp_path / "text")
    manifest = json.loads((tmp_path / "text" / "manifest.json").read_text())
    assert manifest["backend"] == "bm25s" and manifest["doc_count"] == table.num_rows
    assert manifest["doc_ids_sha256"] == ti.ids_digest(sorted(table.column("doc_id").to_pylist()))
    loaded = TextIndex.load(tmp_path / "text")
    assert len(loaded) == len(index)
    for q, _, _ in queries[:30]:
        assert loaded.search(q, 5) == index.search(q, 5)
    assert [p.name for p in tmp_path.iterdir()] == ["text"]  # no temporary or backup dirs left


def test_hit_fields(index: TextIndex, corpus: tuple[pa.Table, list]) -> None:
    q, eid, did = corpus[1][0]
    hit = index.search(q, 1)[0]
    assert (hit.doc_id, hit.entity_id) == (did, eid)
    assert "founded" in hit.text and hit.title.endswith("Guild") and hit.score > 0
    with pytest.raises(AttributeError):
        hit.score = 0.0  # type: ignore[misc]  # frozen


def test_true_entity_beats_one_letter_distractor() -> None:
    table = pa.table(
        {
            "doc_id": ["a1", "a2", "b1", "b2", "c1"],
            "entity_id": ["vel", "vel", "var", "var", "oth"],
            "title": ["Velmora Observatory", "Velmora Observatory: people", "Velmara Observatory",
                      "Velmara Observatory: people", "Korvani Guild"],  # fmt: skip
            "text": [
                "The Velmora Observatory was founded in 1820 in Ostrava.",
                "Ana Brel established the Velmora Observatory.",
                "The Velmara Observatory was founded in 1901 in Pelt. It is an observatory observatory.",
                "Tom Vask established the Velmara Observatory, the oldest observatory.",
                "The Korvani Guild was founded in 1750.",
            ],
            "is_distractor": [False, False, True, True, False],
        }
    )
    idx = TextIndex.build(table)
    hits = idx.search("When was the Velmora Observatory founded?", 5)
    assert hits[0].doc_id == "a1"
    ents = [h.entity_id for h in hits]
    assert ents.index("vel") < ents.index("var")
    assert max(h.score for h in hits if h.entity_id == "var") < min(h.score for h in hits if h.entity_id == "vel")
    assert idx.search("Velmara Observatory founded", 1)[0].doc_id == "b1"  # and the other way round


def test_recall_on_synthetic_corpus(index: TextIndex, corpus: tuple[pa.Table, list]) -> None:
    # measured on this corpus (240 docs, 180 queries): fact-doc recall@1 = recall@5 = entity@1 = 1.00;
    # the 100k-doc bench corpus gives recall@1 0.90, recall@5 1.00 (bench/SEARCH_CHOICE.md)
    queries = corpus[1]
    top = [index.search(q, 5) for q, _, _ in queries]
    r1 = np.mean([h[0].doc_id == d for h, (_, _, d) in zip(top, queries)])
    r5 = np.mean([d in _ids(h) for h, (_, _, d) in zip(top, queries)])
    e1 = np.mean([h[0].entity_id == e for h, (_, e, _) in zip(top, queries)])
    assert r5 >= 0.98, r5
    assert r1 >= 0.95, r1
    assert e1 >= 0.98, e1


def test_k_bounds(index: TextIndex) -> None:
    assert len(index.search("Guild", 1)) == 1
    assert len(index.search("Guild", 7)) == 7
    everything = index.search("Guild", 10_000)
    assert 0 < len(everything) <= len(index)
    assert all(h.score > 0 for h in everything)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="k must be a positive integer"):
            index.search("Guild", bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("query", ["", "   ", "\n\t "])
def test_empty_query_raises(index: TextIndex, query: str) -> None:
    with pytest.raises(ValueError, match="query is empty"):
        index.search(query, 5)


def test_stopword_or_unknown_query_returns_nothing(index: TextIndex) -> None:
    assert index.search("the of and", 5) == []
    assert index.search("zzqxv", 5) == []


def test_deterministic_order_and_ties(corpus: tuple[pa.Table, list]) -> None:
    table = corpus[0]
    shuffled = table.take(np.random.default_rng(1).permutation(table.num_rows))
    a, b = TextIndex.build(table), TextIndex.build(shuffled)
    for q, _, _ in corpus[1][:40]:
        assert a.search(q, 10) == b.search(q, 10)
    twins = pa.table(
        {
            "doc_id": ["z9", "a1", "m5", "b2"],
            "entity_id": ["e", "e", "e", "f"],
            "title": ["Same", "Same", "Same", "Other"],
            "text": ["identical words here"] * 3 + ["unrelated"],
            "is_distractor": [False] * 4,
        }
    )
    hits = TextIndex.build(twins).search("identical words", 2)
    assert _ids(hits) == ["a1", "m5"] and hits[0].score == hits[1].score


def test_build_rejects_bad_tables() -> None:
    with pytest.raises(ValueError, match="duplicate doc_id"):
        TextIndex.build(pa.table({"doc_id": ["a", "a"], "entity_id": ["e", "e"], "title": ["t", "t"], "text": ["x", "y"]}))
    with pytest.raises(ValueError, match="lacks column"):
        TextIndex.build(pa.table({"doc_id": ["a"], "text": ["x"]}))
    with pytest.raises(ValueError, match="empty"):
        TextIndex.build(pa.table({c: pa.array([], pa.string()) for c in ("doc_id", "entity_id", "title", "text")}))


def test_load_errors_name_the_directory_and_the_problem(tmp_path: Path, index: TextIndex) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(IndexLoadError, match=r"nope.*does not exist"):
        TextIndex.load(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(IndexLoadError, match=r"empty.*manifest\.json"):
        TextIndex.load(empty)

    good = tmp_path / "good"
    index.save(good)

    def damaged(name: str) -> Path:
        d = tmp_path / name
        index.save(d)
        return d

    d = damaged("badjson")
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(IndexLoadError, match=r"badjson.*not valid JSON"):
        TextIndex.load(d)

    d = damaged("nobm25")
    (d / "bm25" / "vocab.index.json").unlink()
    with pytest.raises(IndexLoadError, match=r"nobm25.*missing.*vocab\.index\.json"):
        TextIndex.load(d)

    d = damaged("baddocs")
    (d / "docs.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(IndexLoadError, match=r"docs\.parquet is corrupt"):
        TextIndex.load(d)

    d = damaged("badhash")
    m = json.loads((d / "manifest.json").read_text())
    m["doc_ids_sha256"] = "0" * 64
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IndexLoadError, match=r"badhash.*doc ids do not match"):
        TextIndex.load(d)

    d = damaged("badcount")
    m = json.loads((d / "manifest.json").read_text())
    m["doc_count"] += 1
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IndexLoadError, match=r"badcount.*manifest says"):
        TextIndex.load(d)

    d = damaged("otherbackend")
    m = json.loads((d / "manifest.json").read_text())
    m["backend"] = "tantivy"
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IndexLoadError, match=r"backend 'tantivy'"):
        TextIndex.load(d)

    assert len(TextIndex.load(good)) == len(index)


def test_failed_save_leaves_existing_index_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small, _ = make_corpus(n_entities=5, seed=3)
    big, _ = make_corpus(n_entities=20, seed=4)
    target = tmp_path / "idx"
    TextIndex.build(small).save(target)
    before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}

    new = TextIndex.build(big)

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(new._bm25, "save", boom)  # fails after docs.parquet was written
    with pytest.raises(OSError, match="disk full"):
        new.save(target)
    after = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]  # temporary dir cleaned up
    assert len(TextIndex.load(target)) == small.num_rows

    monkeypatch.undo()
    new.save(target)  # a successful save replaces it
    assert len(TextIndex.load(target)) == big.num_rows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idx"]


def test_save_to_a_file_path_fails_without_touching_it(tmp_path: Path, index: TextIndex) -> None:
    f = tmp_path / "file"
    f.write_text("keep me")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        index.save(f)
    assert f.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
