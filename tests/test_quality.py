"""Great Expectations suites at the stage boundary: pass, fail with a report, no clobbering."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from mars.data.io import read_table
from mars.data.quality import QualityError, report_path, write_artifacts
from mars.data.schemas import RAW_IMAGES


def raw(rows: int = 3, **over) -> pa.Table:
    data = {
        "image_id": [f"img-{i}" for i in range(rows)],
        "path": [f"scenes/{i}.jpg" for i in range(rows)],
        "source": ["generated"] * rows,
        "scene_id": [f"s{i}" for i in range(rows)],
        "planted_case": [None] * rows,
        "expected_reason": [None] * rows,
        "bytes": [1000 + i for i in range(rows)],
        "sha256": ["ab" * 32] * rows,
    }
    data.update(over)
    return pa.Table.from_pydict(data, schema=RAW_IMAGES)


def test_passing_table_is_written_with_a_report(tmp_path):
    out = tmp_path / "raw_images.parquet"
    write_artifacts({out: (raw(), "raw_images")})
    assert read_table(out, RAW_IMAGES).num_rows == 3
    report = json.loads(report_path(out).read_text())
    assert report["success"] is True and report["rows"] == 3
    assert {o["expectation"] for o in report["outcomes"]} >= {"ExpectColumnValuesToBeUnique", "ExpectColumnValuesToBeInSet"}


def test_failing_table_stops_with_report_and_keeps_previous_outputs(tmp_path):
    out = tmp_path / "raw_images.parquet"
    other = tmp_path / "second.parquet"
    write_artifacts({out: (raw(), "raw_images"), other: (raw(2), "raw_images")})
    before, before_other = out.read_bytes(), other.read_bytes()
    bad = raw(4, image_id=["a", "b", "b", "c"], source=["generated", "scraped", "folder", "urls"])
    with pytest.raises(QualityError) as exc:
        # the good table comes first: it must not be written either, since a sibling failed
        write_artifacts({other: (raw(5), "raw_images"), out: (bad, "raw_images")})
    msg = str(exc.value)
    assert f"{out}: column 'image_id': ExpectColumnValuesToBeUnique(): 2 of 4 rows fail: image_id ['b', 'b']" in msg
    assert "ExpectColumnValuesToBeInSet" in msg and "'scraped'" in msg
    assert out.read_bytes() == before and other.read_bytes() == before_other
    report = json.loads(report_path(out).read_text())
    assert report["success"] is False
    failed = {o["expectation"]: o for o in report["outcomes"] if not o["success"]}
    assert failed["ExpectColumnValuesToBeUnique"]["unexpected_count"] == 2
    assert failed["ExpectColumnValuesToBeInSet"]["sample_unexpected"] == ["scraped"]
