"""Quality-suite failures name their rows by id: one line per failing expectation, with the file as the user knows
it, the column, the expectation, the ids of the first failing rows, and the stage to rerun."""

from __future__ import annotations

import pyarrow as pa
import pytest

from mars.data.io import atomic_dir
from mars.data.quality import QualityError, validate, write_artifacts
from mars.data.schemas import RAW_IMAGES, WORLD_TRUTH


def raw(rows: int, source: list[str]) -> pa.Table:
    return pa.Table.from_pydict({
        "image_id": [f"img-{i}" for i in range(rows)], "path": [f"scenes/{i}.jpg" for i in range(rows)],
        "source": source, "scene_id": [f"s{i}" for i in range(rows)], "planted_case": [None] * rows,
        "expected_reason": [None] * rows, "bytes": [1000 + i for i in range(rows)], "sha256": ["ab" * 32] * rows,
    }, schema=RAW_IMAGES)


def test_a_failure_names_the_failing_rows_by_id_one_line_per_expectation(tmp_path):
    """Each failing expectation is one line: the file as the user knows it (not the stage's staging directory),
    the column, the expectation, the count, the ids of the first failing rows (the artifact's key) and their
    values; the head names the stage that wrote the file and what to rerun."""
    sources = ["generated"] * 8
    sources[2] = sources[6] = "scraped"
    with pytest.raises(QualityError) as exc, atomic_dir(tmp_path / "world") as out:
        write_artifacts({out / "raw_images.parquet": (raw(8, source=sources), "raw_images")})
    lines = str(exc.value).splitlines()
    shown = tmp_path / "world" / "raw_images.parquet"
    assert lines[0] == (f"quality check failed for {shown} (artifact 'raw_images', 8 rows, 1 failing expectation); "
                        "the world stage wrote it: fix its input or params, then rerun: dvc repro world")
    assert lines[1:] == [f"  - {shown}: column 'source': ExpectColumnValuesToBeInSet(value_set=['generated', "
                         "'folder', 'urls']): 2 of 8 rows fail: image_id ['img-2', 'img-6'] "
                         "(values ['scraped', 'scraped'])"]
    assert exc.value.report.failures()[0].sample_ids == ["img-2", "img-6"]


def test_a_compound_key_names_rows_by_all_its_columns():
    rows = [dict(scene_id="s1", image_id="i1", entity_id=e, x0=x0, y0=0, x1=10, y1=10, is_target=False,
                 scene_width=100, scene_height=100, grid_rows=2, grid_cols=2, cell_row=0, cell_col=0, cue="red_frame",
                 difficulty=1, target_zone=0.5) for e, x0 in (("e1", 0), ("e2", 20), ("e3", 30))]
    report = validate(pa.Table.from_pylist(rows, schema=WORLD_TRUTH), "world_truth", "world_truth.parquet")
    assert "columns 'x1', 'x0': ExpectColumnPairValuesAToBeGreaterThanB(or_equal=False): 2 of 3 rows fail: " \
           "scene_id/entity_id ['s1/e2', 's1/e3']" in report.summary()
    assert report.summary().splitlines()[0].endswith("rerun: dvc repro world")
