"""Expected errors end a stage with one line ``error: <message>`` (exit status 1, no traceback); bugs keep theirs.

The stages run as subprocesses on inputs built in tmp_path that are wrong in the ways a user's are: a params folder
that does not exist, an upstream parquet written by another version of the code, a malformed benchmark file.
"""

from __future__ import annotations

import base64
import csv
import io
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from mars.data.io import ArtifactReadError, SchemaError, read_table
from mars.data.schemas import CURATED, QUESTIONS, RAW_IMAGES, TRAJECTORIES
from tests.conftest import REPO, sh


def params_file(tmp_path, **sections) -> str:
    """params.yaml with the smoke profile, ``sections`` updating the stage sections."""
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    doc["base"]["profile"] = "smoke"
    for name, values in sections.items():
        doc[name].update(values)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def stage(tmp_path, name: str, *args: str):
    proc = sh([sys.executable, "-m", f"stages.{name}", *args], tmp_path, check=False, OMP_NUM_THREADS="1")
    return proc, proc.stderr.rstrip().splitlines()


def assert_one_line_error(proc, lines, *needles: str) -> str:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = lines[-1]
    assert last.startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in last, (needle, last)
    return last


def png_bytes(size=(32, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 40, 40)).save(buf, format="PNG")
    return buf.getvalue()


def curated_rows(n: int = 2) -> dict:
    return {"image_id": [f"img-{i}" for i in range(n)], "path": [f"p/{i}.png" for i in range(n)],
            "derivative": [None] * n, "sha256": ["ab" * 32] * n, "width": [640] * n, "height": [480] * n,
            "mode": ["RGB"] * n, "phash": ["0123456789abcdef"] * n, "quality": [0.5] * n}


# --- the stages, as a user runs them ---------------------------------------------------------------------------


def test_world_with_a_missing_folder_ends_with_one_line_before_any_work(tmp_path):
    missing = tmp_path / "my-photos"
    params = params_file(tmp_path, world={"source": "folder", "folder": str(missing)})
    proc, lines = stage(tmp_path, "world", "--params", params, "--out", str(tmp_path / "world"),
                        "--metrics", str(tmp_path / "world.json"))
    assert_one_line_error(proc, lines, "error: world.folder", str(missing), "does not exist")
    assert not (tmp_path / "world").exists()  # failed before generating anything


def test_curate_on_raw_images_of_an_older_schema_names_file_column_and_stage_to_rerun(tmp_path):
    world = tmp_path / "data" / "world"
    (world / "raw").mkdir(parents=True)
    data = {"image_id": ["a"], "path": ["a.png"], "source": ["folder"], "scene_id": [None], "planted_case": [None],
            "expected_reason": [None], "bytes": [10]}  # no sha256: written before the column existed
    pq.write_table(pa.table(data, schema=pa.schema([RAW_IMAGES.field(n) for n in data])), world / "raw_images.parquet")
    params = params_file(tmp_path)
    proc, lines = stage(tmp_path, "curate", "--params", params, "--raw-images", str(world / "raw_images.parquet"),
                        "--raw-dir", str(world / "raw"), "--out", str(tmp_path / "curate"),
                        "--metrics", str(tmp_path / "curate.json"))
    last = assert_one_line_error(proc, lines, str(world / "raw_images.parquet"), "column 'sha256' is missing",
                                 "schema RAW_IMAGES")
    assert last.endswith("rerun the world stage: dvc repro world")


def test_evaluate_with_a_malformed_benchmark_lists_its_problems_then_one_error_line(tmp_path):
    synth = tmp_path / "synthesize"
    synth.mkdir()
    (synth / "q.png").write_bytes(png_bytes())
    question = {"question_id": "q-0", "type": "perception", "scene_id": None, "image_path": "q.png",
                "question": "What colour is the emblem?", "answer": "red", "aliases": [], "choices": None,
                "entity_id": "e-0", "difficulty": 1, "split": "test"}
    pq.write_table(pa.Table.from_pylist([question], schema=QUESTIONS), synth / "questions.parquet")
    bench = tmp_path / "hr_bench.tsv"
    good = base64.b64encode(png_bytes()).decode()
    with bench.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["index", "question", "A", "B", "C", "D", "answer", "category", "image"],
                           delimiter="\t")
        w.writeheader()
        w.writerow(dict(index=1, question="Q", A="a", B="b", C="c", D="d", answer="E", category="x", image=good))
        w.writerow(dict(index=2, question="Q", A="a", B="b", C="c", D="d", answer="A", category="x", image="%%"))
    params = params_file(tmp_path, evaluate={"runs": ["no-tool/direct"],
                                             "benchmarks": [{"format": "hr_bench", "path": str(bench)}]})
    proc, lines = stage(tmp_path, "evaluate", "--params", params, "--questions", str(synth / "questions.parquet"),
                        "--image-root", str(synth), "--world-dir", str(tmp_path / "world"),
                        "--index-dir", str(tmp_path / "index"), "--out", str(tmp_path / "evaluate"),
                        "--progress", str(tmp_path / "progress"), "--plots", str(tmp_path / "plots"),
                        "--metrics", str(tmp_path / "evaluate.json"))
    last = assert_one_line_error(proc, lines, str(bench), "2 problem(s)", "the 2 lines above")
    assert "record 0 (id '1'): field 'answer'" in lines[-3] and "record 1 (id '2'): field 'image'" in lines[-2], last
    assert not (tmp_path / "evaluate").exists()


# --- the mechanism -----------------------------------------------------------------------------------------------

RUN = textwrap.dedent(
    """
    import sys
    from mars.errors import InputError
    from mars.stage import expected_errors

    with expected_errors():
        if sys.argv[1] == "bug":
            raise RuntimeError("a plain bug")
        raise InputError(sys.argv[2])
    """
)


def run_block(tmp_path, *args: str):
    proc = sh([sys.executable, "-c", RUN, *args], tmp_path, check=False)
    return proc, proc.stderr.rstrip().splitlines()


def test_an_unexpected_error_keeps_its_traceback(tmp_path):
    proc, lines = run_block(tmp_path, "bug")
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and lines[-1] == "RuntimeError: a plain bug"
    assert not any(line.startswith("error:") for line in lines)


@pytest.mark.parametrize("message, details, last", [
    ("in.txt: bad", [], "error: in.txt: bad"),
    ("in.txt: 1 problem:\n  - row 3: empty", [], "error: in.txt: 1 problem: row 3: empty"),
    ("in.txt: 2 problems:\n  - row 3: empty\n  - row 4: empty", ["  - row 3: empty", "  - row 4: empty"],
     "error: in.txt: 2 problems (the 2 lines above)"),
])
def test_an_expected_error_is_its_message_alone_ending_in_one_error_line(tmp_path, message, details, last):
    proc, lines = run_block(tmp_path, "expected", message)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines == details + [last]


def test_the_expected_errors_keep_their_usual_bases():
    """Existing ``except ValueError`` / ``except RuntimeError`` clauses still catch them."""
    from mars.data.quality import QualityError
    from mars.errors import EndpointDown, InputError, MissingInputError, StageError
    from mars.eval.loaders import BenchmarkError
    from mars.llm_client import LLMError
    from mars.rl.judge import JudgeUnavailable
    from mars.tools.cache import CacheLoadError
    from mars.tools.service import ToolServiceDown
    from mars.tools.text_index import IndexLoadError
    from mars.tools.web import MissingAPIKeyError, WebSearchError
    from mars.train.rl import RLCollapse

    bases = {QualityError: RuntimeError, BenchmarkError: ValueError, ArtifactReadError: SchemaError,
             LLMError: RuntimeError, JudgeUnavailable: RuntimeError, ToolServiceDown: RuntimeError,
             WebSearchError: RuntimeError,
             MissingAPIKeyError: RuntimeError, IndexLoadError: ValueError, CacheLoadError: ValueError,
             RLCollapse: RuntimeError, EndpointDown: RuntimeError, InputError: ValueError,
             MissingInputError: FileNotFoundError}
    for cls, base in bases.items():
        assert issubclass(cls, StageError) and issubclass(cls, base), cls
    assert not issubclass(SchemaError, StageError)  # a table our code builds wrong, on write, is a bug: traceback


# --- an upstream artifact of an older schema ---------------------------------------------------------------------


def test_a_missing_or_retyped_column_names_file_column_schema_and_stage(tmp_path):
    curate = tmp_path / "data" / "curate"
    curate.mkdir(parents=True)
    path = curate / "curated.parquet"
    rows = curated_rows()
    pq.write_table(pa.table({k: v for k, v in rows.items() if k != "width"}), path)
    with pytest.raises(ArtifactReadError) as exc:
        read_table(path, CURATED)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: column 'width' is missing (schema CURATED has it, type int32;")
    assert msg.endswith("written by another version of the code; rerun the curate stage: dvc repro curate")

    pq.write_table(pa.table({**rows, "width": ["640", "480"]}), path)
    with pytest.raises(ArtifactReadError, match=r"column 'width' has type string, expected int32 \(schema CURATED\).*"
                                          r"dvc repro curate"):
        read_table(path, CURATED)
    with pytest.raises(ArtifactReadError, match=r"file not found; fix the path, or rerun the curate stage"):
        read_table(curate / "gone.parquet", CURATED)


def test_the_stage_to_rerun_comes_from_the_folder_else_the_artifact(tmp_path):
    rollouts = tmp_path / "rl" / "rollouts.parquet"  # trajectories: the sft stage's, unless they sit in rl/
    rollouts.parent.mkdir()
    pq.write_table(pa.table({"question_id": ["q"]}), rollouts)
    with pytest.raises(ArtifactReadError, match=r"schema TRAJECTORIES.*rerun the rl stage: dvc repro rl"):
        read_table(rollouts, TRAJECTORIES)
    elsewhere = tmp_path / "copies" / "questions.parquet"
    elsewhere.parent.mkdir()
    pq.write_table(pa.table({"question_id": ["q"]}), elsewhere)
    with pytest.raises(ArtifactReadError, match=r"schema QUESTIONS.*rerun the synthesize stage: dvc repro synthesize"):
        read_table(elsewhere, QUESTIONS)
