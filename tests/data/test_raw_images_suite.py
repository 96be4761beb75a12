"""The raw-images suite accepts an empty file (curation rejects it as empty_file) and still refuses a negative size;
the rejects suite knows every reason curation and the sources give."""

from __future__ import annotations

import hashlib

import pyarrow as pa

from mars.curate.download import FAILURE_REASONS_AS_REJECTS
from mars.curate.probe import REASONS
from mars.data.quality import validate
from mars.data.schemas import RAW_IMAGES, REJECTS
from mars.data.suites import REJECT_REASONS


def raw_table(sizes: list[int]) -> pa.Table:
    return pa.Table.from_pylist([
        dict(image_id=f"f-{i}", path=f"{i}.jpg", source="folder", scene_id=None, planted_case=None,
             expected_reason=None, bytes=n, sha256=hashlib.sha256(b"").hexdigest())
        for i, n in enumerate(sizes)
    ], schema=RAW_IMAGES)


def test_a_zero_byte_file_passes_the_raw_images_suite_a_negative_size_does_not():
    assert validate(raw_table([0, 5]), "raw_images").success
    report = validate(raw_table([0, -1]), "raw_images")
    assert not report.success and "bytes" in report.summary()


def test_the_rejects_suite_takes_every_reason_given():
    given = set(REASONS) | {"exact_duplicate", "near_duplicate", "download_failed"}
    given |= set(FAILURE_REASONS_AS_REJECTS.values())
    assert given == set(REJECT_REASONS) and len(REJECT_REASONS) == len(set(REJECT_REASONS))
    rows = [dict(image_id=f"x-{i}", path=f"{i}", reason=r, detail="why") for i, r in enumerate(REJECT_REASONS)]
    assert validate(pa.Table.from_pylist(rows, schema=REJECTS), "rejects").success
    rows.append(dict(image_id="x-new", path="n", reason="not_a_reason", detail="why"))
    assert not validate(pa.Table.from_pylist(rows, schema=REJECTS), "rejects").success
