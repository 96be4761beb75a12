"""Typed parquet I/O: schema checks with file/column/expected/found, atomic writes."""

from __future__ import annotations

import os
import subprocess
import sys

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mars.data.io import (SchemaError, atomic_dir, atomic_path, read_frame, read_table, sweep_stale_dirs, write_frame,
                          write_table)

SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("w", pa.int32(), nullable=False),
                    pa.field("note", pa.string(), nullable=True)])


def table(**cols):
    data = {"id": ["a", "b"], "w": [1, 2], "note": [None, "x"]}
    data.update(cols)
    return pa.table(data).cast(SCHEMA) if not cols else pa.table(data)


def test_roundtrip_and_polars(tmp_path):
    path = write_table(table(), tmp_path / "t.parquet", SCHEMA)
    back = read_table(path, SCHEMA)
    assert back.schema.equals(SCHEMA) and back.to_pylist() == table().to_pylist()
    frame = read_frame(path, SCHEMA).with_columns(pl.col("w") * 10)
    write_frame(frame, tmp_path / "f.parquet", SCHEMA)
    assert read_table(tmp_path / "f.parquet", SCHEMA).column("w").to_pylist() == [10, 20]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files left


def test_read_reports_file_column_expected_and_found(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"id": ["a"], "w": ["12"], "note": [None]}), path)
    with pytest.raises(SchemaError) as exc:
        read_table(path, SCHEMA)
    msg = str(exc.value)
    assert str(path) in msg and "column 'w' has type string, expected int32" in msg


def test_missing_extra_and_null_columns(tmp_path):
    path = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a"], "note": ["x"]}), path)
    with pytest.raises(SchemaError, match="column 'w' is missing"):
        read_table(path, SCHEMA)
    with pytest.raises(SchemaError, match="unexpected column 'zz'"):
        write_table(pa.table({"id": ["a"], "w": pa.array([1], pa.int32()), "note": ["x"], "zz": [1]}), path, SCHEMA)
    nulls = pa.table({"id": ["a", None], "w": pa.array([1, 2], pa.int32()), "note": [None, None]})
    with pytest.raises(SchemaError, match="column 'id' must not be null, found 1"):
        write_table(nulls, path, SCHEMA)
    with pytest.raises(SchemaError, match="file not found"):
        read_table(tmp_path / "nope.parquet", SCHEMA)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(SchemaError, match="not a readable parquet file"):
        read_table(tmp_path / "junk.parquet", SCHEMA)


def test_failed_write_leaves_previous_file_intact(tmp_path):
    path = write_table(table(), tmp_path / "t.parquet", SCHEMA)
    before = path.read_bytes()
    with pytest.raises(SchemaError):
        write_table(pa.table({"id": ["z"], "w": ["oops"], "note": [None]}), path, SCHEMA)
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash mid-write")
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["t.parquet"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_atomic_dir_tidies_what_killed_runs_left(tmp_path):
    target = tmp_path / "out"
    dead, live = _dead_pid(), os.getpid()
    stale_tmp = tmp_path / f".out.tmp-{dead}-0000aaaa"  # killed inside its block
    backup = tmp_path / f".out.old-{dead}-0000bbbb"  # killed between its two renames: the only copy of the old out
    concurrent = tmp_path / f".out.tmp-{live}-0000cccc"  # a run still going
    for d in (stale_tmp, backup, concurrent):
        d.mkdir()
        (d / "f.txt").write_text(d.name)
    assert sweep_stale_dirs(target) == [(backup, "restored"), (stale_tmp, "removed")]
    assert (target / "f.txt").read_text() == backup.name  # the previous output is back, not lost
    assert not stale_tmp.exists() and concurrent.exists()

    backup.mkdir()  # with a target in place, a dead run's backup is garbage
    with atomic_dir(target) as tmp:
        assert not backup.exists()
        (tmp / "g.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["g.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [concurrent.name, "out"]
