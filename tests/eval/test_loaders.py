"""Benchmark loaders: each format on a small file of its exact schema, and malformed records rejected with reasons."""

from __future__ import annotations

import base64
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mars.data.io import write_table
from mars.data.schemas import BENCH_QUESTIONS, QUESTIONS
from mars.eval.loaders import BenchmarkError, load_benchmark


def img_bytes(color=(200, 30, 30), fmt="PNG", size=(24, 16)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


PNG = img_bytes()
JPEG = img_bytes((10, 120, 240), "JPEG", (40, 30))
BROKEN = PNG[: len(PNG) // 2]  # a truncated PNG: opens, does not decode
NOT_AN_IMAGE = b"this is not an image at all"


def raises(spec, *fragments) -> str:
    with pytest.raises(BenchmarkError) as info:
        load_benchmark(spec)
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, f"{frag!r} not in:\n{msg}"
    return msg


# --- synth ------------------------------------------------------------------------------------


def write_synth(tmp_path, rows_extra=None, image_paths=("raw/a.png", "questions/q2.jpg")):
    root = tmp_path / "world"
    (root / "raw").mkdir(parents=True)
    (root / "questions").mkdir()
    (root / "raw" / "a.png").write_bytes(PNG)
    (root / "questions" / "q2.jpg").write_bytes(JPEG)
    rows = [
        dict(question_id="perc-0-0000", type="perception", scene_id="s1", image_path=image_paths[0],
             question="What shape?\nA. circle\nB. star\nAnswer with the option's letter.", answer="circle",
             aliases=["A"], choices=json.dumps({"A": "circle", "B": "star"}), entity_id="e1", difficulty=2,
             split="test"),
        dict(question_id="srch-0-0000", type="search", scene_id=None, image_path=image_paths[1],
             question="In which city? Answer with the city's name.", answer="Varo", aliases=[], choices=None,
             entity_id="e2", difficulty=1, split="test"),
        dict(question_id="mhop-0-0000", type="multi-hop", scene_id="s1", image_path="raw/a.png",
             question="Who founded it?", answer="Ada", aliases=[], choices=None, entity_id="e1", difficulty=3,
             split="sft"),
    ]
    rows += rows_extra or []
    path = tmp_path / "questions.parquet"
    write_table(pa.Table.from_pylist(rows, schema=QUESTIONS), path, QUESTIONS)
    return path, root


def test_synth_loads_test_split(tmp_path):
    path, root = write_synth(tmp_path)
    t = load_benchmark({"format": "synth", "path": str(path), "image_root": str(root)})
    assert t.schema.equals(BENCH_QUESTIONS)
    rows = t.to_pylist()
    assert [r["id"] for r in rows] == ["perc-0-0000", "srch-0-0000"]
    a, b = rows
    assert a["benchmark"] == "synth" and a["answers"] == ["circle", "A"] and a["images"] == [PNG]
    assert json.loads(a["choices"]) == {"A": "circle", "B": "star"}
    assert (a["type"], a["category"], a["difficulty"]) == ("perception", "perception", "2")
    assert b["answers"] == ["Varo"] and b["images"] == [JPEG] and b["choices"] is None and b["search_results"] is None
    all_rows = load_benchmark({"format": "synth", "path": str(path), "image_root": str(root), "split": "all",
                               "name": "mine"})
    assert all_rows.num_rows == 3 and set(all_rows.column("benchmark").to_pylist()) == {"mine"}


def test_synth_rejects_escape_and_missing_image(tmp_path):
    (tmp_path / "outside.png").write_bytes(PNG)
    path, root = write_synth(tmp_path, image_paths=("../outside.png", "questions/nope.png"))
    raises({"format": "synth", "path": str(path), "image_root": str(root)},
           "questions.parquet", "record 0 (id 'perc-0-0000')", "field 'image_path'", "outside the root",
           "record 1 (id 'srch-0-0000')", "nope.png not found")


def test_synth_rejects_empty_answer_and_missing_split(tmp_path):
    extra = [dict(question_id="bad-1", type="search", scene_id=None, image_path="raw/a.png", question="Q?",
                  answer="  ", aliases=[], choices=None, entity_id="e", difficulty=0, split="test")]
    path, root = write_synth(tmp_path, extra)
    raises({"format": "synth", "path": str(path), "image_root": str(root)},
           "record 3 (id 'bad-1')", "field 'answer'", "empty")
    raises({"format": "synth", "path": str(path), "image_root": str(root), "split": "rl"},
           "field 'split'", "'sft'", "'test'")


# --- hr_mmsearch ---------------------------------------------------------------------------------


def write_hr_mmsearch(path, rows, struct=False):
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())]) if struct else pa.binary()
    cols = {
        "sample_id": pa.array([r[0] for r in rows], pa.int64()),
        "query": pa.array([r[1] for r in rows], pa.string()),
        "query_image": pa.array([({"bytes": r[2], "path": f"{r[0]}.png"} if struct else r[2]) for r in rows],
                                image_type),
        "ground_truth": pa.array([r[3] for r in rows], pa.list_(pa.string())),
        "difficulty": pa.array(["easy"] * len(rows), pa.string()),
        "category": pa.array(["sports"] * len(rows), pa.string()),
    }
    pq.write_table(pa.table(cols), path)


@pytest.mark.parametrize("struct", [False, True])
def test_hr_mmsearch(tmp_path, struct):
    path = tmp_path / "hr_mmsearch.parquet"
    write_hr_mmsearch(path, [(1, "Who won?", JPEG, ["Team A", "A"]), (2, "When?", PNG, ["1999"])], struct)
    rows = load_benchmark({"format": "hr_mmsearch", "path": str(path)}).to_pylist()
    assert [r["id"] for r in rows] == ["1", "2"]
    assert rows[0]["question"] == "Who won?" and rows[0]["answers"] == ["Team A", "A"] and rows[0]["images"] == [JPEG]
    assert rows[1]["answers"] == ["1999"] and rows[1]["difficulty"] == "easy" and rows[1]["category"] == "sports"
    assert rows[0]["benchmark"] == "hr_mmsearch"


def test_hr_mmsearch_string_ground_truth(tmp_path):
    path = tmp_path / "gt.parquet"
    pq.write_table(pa.table({"sample_id": ["x"], "query": ["Q"], "query_image": pa.array([PNG], pa.binary()),
                             "ground_truth": ["Paris"], "difficulty": ["hard"], "category": ["geo"]}), path)
    assert load_benchmark({"format": "hr_mmsearch", "path": str(path)}).column("answers").to_pylist() == [["Paris"]]


def test_hr_mmsearch_rejects_bad_records(tmp_path):
    path = tmp_path / "bad.parquet"
    write_hr_mmsearch(path, [(1, "ok", PNG, ["a"]), (2, "no image", None, ["a"]), (3, "empty", PNG, []),
                             (4, "broken", BROKEN, ["a"]), (5, "junk", NOT_AN_IMAGE, ["a"]), (5, "dup", PNG, ["b"])])
    msg = raises({"format": "hr_mmsearch", "path": str(path)},
                 "bad.parquet", "record 1 (id '2'): field 'query_image': image is missing",
                 "record 2 (id '3'): field 'ground_truth': answer list is empty",
                 "record 3 (id '4'): field 'query_image': image does not decode",
                 "record 4 (id '5'): field 'query_image'", "record 5 (id '5'): field 'id': duplicate id")
    assert "record 0 " not in msg


def test_hr_mmsearch_missing_column_lists_present(tmp_path):
    path = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"sample_id": [1], "query": ["q"], "query_image": pa.array([PNG], pa.binary())}), path)
    raises({"format": "hr_mmsearch", "path": str(path)}, "nocol.parquet", "field 'ground_truth'",
           "required column 'ground_truth' is missing", "'sample_id', 'query', 'query_image'")


# --- manifest --------------------------------------------------------------------------------------


def write_manifest(tmp_path, records, as_list=False, length=-1):
    data = tmp_path / "data" / "hr"
    (data / "images").mkdir(parents=True)
    (data / "thumbs").mkdir()
    (data / "images" / "1.jpg").write_bytes(JPEG)
    (data / "images" / "2.png").write_bytes(PNG)
    (data / "thumbs" / "t1.jpg").write_bytes(JPEG)
    ann = data / "test.jsonl"
    ann.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    entry = {"root": "data/hr", "annotation": "data/hr/test.jsonl", "length": length}
    manifest = tmp_path / "eval.json"
    manifest.write_text(json.dumps([{"name": "hr_mmsearch", **entry}] if as_list else {"hr_mmsearch": entry}))
    return manifest


def mrec(image, gt, question="Who built this?", **extra):
    return {"prompt": [{"role": "system", "content": "You are an agent."},
                       {"role": "user", "content": f"<image>\n{question}"}],
            "image": image, "reward_model": {"ground_truth": gt, "style": "rule"}, **extra}


@pytest.mark.parametrize("as_list", [False, True])
def test_manifest(tmp_path, as_list):
    recs = [mrec("images/1.jpg", ["Gaudi", "Antoni Gaudi"], image_search_title_list=["Sagrada", "Casa"],
                 image_search_thumbnail_list=["thumbs/t1.jpg", None]),
            mrec(["images/2.png", "images/1.jpg"], "1882", question="When?", id="custom")]
    manifest = write_manifest(tmp_path, recs, as_list)
    rows = load_benchmark({"format": "manifest", "path": str(manifest)}).to_pylist()
    a, b = rows
    assert (a["id"], a["benchmark"], a["question"]) == ("hr_mmsearch-0", "hr_mmsearch", "Who built this?")
    assert a["answers"] == ["Gaudi", "Antoni Gaudi"] and a["images"] == [JPEG]
    sr = json.loads(a["search_results"])
    assert sr["titles"] == ["Sagrada", "Casa"] and base64.b64decode(sr["thumbnails"][0]) == JPEG
    assert sr["thumbnails"][1] is None
    assert (b["id"], b["question"], b["answers"], b["images"]) == ("custom", "When?", ["1882"], [PNG, JPEG])
    assert b["search_results"] is None


def test_manifest_length_and_list_content(tmp_path):
    rec = mrec("images/1.jpg", "x")
    rec["prompt"] = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "<image> What?"}]}]
    manifest = write_manifest(tmp_path, [rec, mrec("images/2.png", "y")], length=1)
    rows = load_benchmark({"format": "manifest", "path": str(manifest), "name": "hrm"}).to_pylist()
    assert len(rows) == 1 and rows[0]["question"] == "What?" and rows[0]["benchmark"] == "hrm"
    manifest = write_manifest(tmp_path / "b", [rec], length=5)
    raises({"format": "manifest", "path": str(manifest)}, "eval.json", "hr_mmsearch.length", "says 5 records")


def test_manifest_rejects_bad_records(tmp_path):
    outside = tmp_path / "secret.png"
    outside.write_bytes(PNG)
    recs = [mrec("images/1.jpg", "ok"), mrec("../../secret.png", "x"), mrec(str(outside), "x"),
            mrec("images/missing.png", "x"), mrec("images/1.jpg", []), mrec("images/1.jpg", ""),
            mrec("images/1.jpg", "x", image_search_thumbnail_list=["../../secret.png"])]
    del recs[0]["reward_model"]
    manifest = write_manifest(tmp_path, recs)
    raises({"format": "manifest", "path": str(manifest)},
           "test.jsonl", "record 0 (id 'hr_mmsearch-0'): field 'reward_model.ground_truth'",
           "record 1 (id 'hr_mmsearch-1'): field 'image': path '../../secret.png'", "outside the root",
           "record 2 (id 'hr_mmsearch-2'): field 'image': absolute path",
           "record 3 (id 'hr_mmsearch-3'): field 'image'", "missing.png not found",
           "record 4 (id 'hr_mmsearch-4'): field 'reward_model.ground_truth': answer list is empty",
           "record 5 (id 'hr_mmsearch-5'): field 'reward_model.ground_truth': answer [0] is empty",
           "record 6 (id 'hr_mmsearch-6'): field 'image_search_thumbnail_list[0]'")


def test_manifest_bad_json_line_and_skip(tmp_path):
    manifest = write_manifest(tmp_path, [mrec("images/1.jpg", "a"), mrec("images/nope.png", "b")])
    ann = tmp_path / "data" / "hr" / "test.jsonl"
    ann.write_text(ann.read_text() + "{not json\n")
    raises({"format": "manifest", "path": str(manifest)}, "record 2: field '<line>'", "line 3 is not a JSON object")
    t = load_benchmark({"format": "manifest", "path": str(manifest), "on_error": "skip"})
    assert t.column("id").to_pylist() == ["hr_mmsearch-0"]


# --- hr_bench ----------------------------------------------------------------------------------------


def hb_rows():
    b64 = base64.b64encode(PNG).decode()
    return [
        dict(index=10, question="What color is the car?", A="red", B="blue", C="green", D="white", answer="A",
             category="single", image=b64),
        dict(index=11, question="What is written?", A="stop", B="go", C="exit", D="open", answer="d",
             category="cross", image=base64.b64encode(JPEG).decode()),
    ]


def write_tsv(path, rows):
    cols = list(rows[0])
    path.write_text("\n".join(["\t".join(cols)] + ["\t".join(str(r[c]) for c in cols) for r in rows]) + "\n")


@pytest.mark.parametrize("ext", ["tsv", "parquet"])
def test_hr_bench(tmp_path, ext):
    path = tmp_path / f"hr_bench_4k.{ext}"
    if ext == "tsv":
        write_tsv(path, hb_rows())
    else:
        pq.write_table(pa.Table.from_pylist(hb_rows()), path)
    rows = load_benchmark({"format": "hr_bench", "path": str(path)}).to_pylist()
    a, b = rows
    assert a["id"] == "10" and a["benchmark"] == "hr_bench" and a["images"] == [PNG]
    assert a["question"] == ("What color is the car?\nA. red\nB. blue\nC. green\nD. white\n"
                             "Answer with the option's letter.")
    assert a["answers"] == ["A", "red"] and json.loads(a["choices"]) == {"A": "red", "B": "blue", "C": "green",
                                                                       "D": "white"}
    assert b["answers"] == ["D", "open"] and b["category"] == "cross" and b["images"] == [JPEG]


def test_hr_bench_rejects_bad_records(tmp_path):
    rows = hb_rows() + [
        dict(index=12, question="Q", A="a", B="b", C="c", D="d", answer="E", category="x",
             image=base64.b64encode(PNG).decode()),
        dict(index=13, question="Q", A="a", B="b", C="c", D="d", answer="A", category="x", image="%%%not-base64%%%"),
        dict(index=14, question="Q", A="a", B="b", C="c", D="d", answer="A", category="x",
             image=base64.b64encode(NOT_AN_IMAGE).decode()),
        dict(index=15, question="Q", A="a", B="b", C="c", D="d", answer="A", category="x", image=""),
    ]
    path = tmp_path / "hrb.tsv"
    write_tsv(path, rows)
    raises({"format": "hr_bench", "path": str(path)},
           "hrb.tsv", "record 2 (id '12'): field 'answer': answer must be one letter A-D, got 'E'",
           "record 3 (id '13'): field 'image': bad base64",
           "record 4 (id '14'): field 'image': image does not decode",
           "record 5 (id '15'): field 'image': image is missing")


def test_hr_bench_missing_column(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "D"} for r in hb_rows()]
    path = tmp_path / "nod.tsv"
    write_tsv(path, rows)
    raises({"format": "hr_bench", "path": str(path)}, "nod.tsv", "field 'D'", "required column 'D' is missing",
           "'question', 'A', 'B', 'C'")


# --- table ----------------------------------------------------------------------------------------------


def test_table_parquet_bytes_and_jsonl_paths(tmp_path):
    path = tmp_path / "custom.parquet"
    pq.write_table(pa.table({"qid": ["a", "b"], "q": ["Q1", "Q2"], "pic": pa.array([PNG, JPEG], pa.binary()),
                             "gold": [["x", "ex"], ["y"]], "opts": [None, '{"A": "y", "B": "z"}'],
                             "cat": ["c1", "c2"], "level": [1, 2]}), path)
    spec = {"format": "table", "path": str(path),
            "columns": {"id": "qid", "question": "q", "image": "pic", "answers": "gold", "choices": "opts",
                        "category": "cat", "difficulty": "level"}}
    rows = load_benchmark(spec).to_pylist()
    assert rows[0]["benchmark"] == "custom" and rows[0]["answers"] == ["x", "ex"] and rows[0]["images"] == [PNG]
    assert json.loads(rows[1]["choices"]) == {"A": "y", "B": "z"} and rows[1]["difficulty"] == "2"

    root = tmp_path / "imgs"
    root.mkdir()
    (root / "p.png").write_bytes(PNG)
    jl = tmp_path / "set.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in [
        {"question": "Q", "images": ["p.png", base64.b64encode(JPEG).decode()], "answer": "z"},
    ]))
    spec = {"format": "table", "path": str(jl), "name": "t",
            "columns": {"question": "question", "images": "images", "answer": "answer"}}
    # auto encoding: strings are base64 without image_root, so the path "p.png" is rejected ...
    raises(spec, "set.jsonl", "record 0 (id '0'): field 'images[0]': bad base64")
    # ... and paths with it (then the base64 string, starting with "/", is an absolute path outside the root)
    msg = raises({**spec, "image_root": str(root)}, "record 0 (id '0'): field 'images[1]'", "outside the root")
    assert len(msg) < 1000  # long values are shortened in messages
    jl.write_text(json.dumps({"question": "Q", "images": ["p.png"], "answer": "z"}) + "\n")
    rows = load_benchmark({**spec, "image_root": str(root)}).to_pylist()
    assert rows[0]["images"] == [PNG] and rows[0]["answers"] == ["z"] and rows[0]["id"] == "0"


def test_table_rejects_bad_records(tmp_path):
    root = tmp_path / "imgs"
    root.mkdir()
    (root / "ok.png").write_bytes(PNG)
    (tmp_path / "escape.png").write_bytes(PNG)
    jl = tmp_path / "bad.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in [
        {"id": "r0", "q": "Q", "img": "ok.png", "a": "x"},
        {"id": "r1", "q": "Q", "img": "../escape.png", "a": "x"},
        {"id": "r2", "q": "Q", "img": "ok.png", "a": []},
        {"id": "r3", "q": "Q", "a": "x"},
        {"id": "r0", "q": "Q", "img": "ok.png", "a": "x"},
    ]))
    spec = {"format": "table", "path": str(jl), "image_root": str(root),
            "columns": {"id": "id", "question": "q", "image": "img", "answer": "a"}}
    raises(spec, "bad.jsonl", "record 1 (id 'r1'): field 'img'", "outside the root",
           "record 2 (id 'r2'): field 'a': answer list is empty", "record 3 (id 'r3'): field 'img'",
           "required column(s) ['img'] missing", "record 4 (id 'r0'): field 'id': duplicate id")
    pq.write_table(pa.table({"q": ["Q"], "a": ["x"]}), tmp_path / "nocol.parquet")
    raises({**spec, "path": str(tmp_path / "nocol.parquet")}, "nocol.parquet", "field 'img'",
           "required column 'img' is missing", "present columns: ['q', 'a']")


def test_spec_errors(tmp_path):
    raises({"format": "nope", "path": "x"}, "unknown benchmark format 'nope'", "'hr_bench'")
    raises({"format": "hr_bench", "path": str(tmp_path / "absent.tsv")}, "absent.tsv", "not found")
