"""Atomic writes give files and directories the mode a plain write gives them under the process's umask (not the
0600 of a temp file), for every helper of mars.data.io and for a real stage's outputs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pyarrow as pa
import pytest

from mars.data.io import (atomic_dir, atomic_open, atomic_path, atomic_write_bytes, atomic_write_text, current_umask,
                          plain_dir_mode, plain_file_mode, write_table)
from tests.conftest import umask


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def plain_modes(where: Path) -> tuple[int, int]:
    """What a plain open() and a plain mkdir give under the current umask."""
    where.mkdir()
    with open(where / "plain.txt", "w") as fh:
        fh.write("x")
    (where / "plain_dir").mkdir()
    return mode(where / "plain.txt"), mode(where / "plain_dir")


@pytest.mark.parametrize("mask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_every_atomic_helper_writes_with_the_plain_mode(tmp_path: Path, mask: int, file_mode: int, dir_mode: int):
    schema = pa.schema([pa.field("a", pa.int64(), nullable=False)])
    with umask(mask):
        assert current_umask() == mask and (plain_file_mode(), plain_dir_mode()) == (file_mode, dir_mode)
        assert plain_modes(tmp_path / "plain") == (file_mode, dir_mode)
        out = tmp_path / "out"
        with atomic_path(out / "nested" / "p.bin") as tmp:
            tmp.write_bytes(b"p")
        with atomic_open(out / "o.txt") as fh:
            fh.write("o")
        atomic_write_bytes(out / "b.bin", b"b")
        atomic_write_text(out / "t.txt", "t")
        write_table(pa.table({"a": [1]}, schema=schema), out / "t.parquet", schema)
        (out / "old.txt").write_text("old")
        os.chmod(out / "old.txt", 0o600)  # replacing a 0600 file (as written before this fix) gives the plain mode
        atomic_write_text(out / "old.txt", "new")
        with atomic_dir(out / "d") as d:
            atomic_write_text(d / "first.txt", "f")
        assert mode(out / "d") == dir_mode and mode(out / "d" / "first.txt") == file_mode
        with atomic_dir(out / "d") as d:  # replacing a directory
            atomic_write_text(d / "again.txt", "a")
    files = sorted(p for p in out.rglob("*") if p.is_file())
    dirs = sorted([out, *(p for p in out.rglob("*") if p.is_dir())])
    assert [p.relative_to(out).as_posix() for p in files] == [
        "b.bin", "d/again.txt", "nested/p.bin", "o.txt", "old.txt", "t.parquet", "t.txt"
    ]
    assert {p.relative_to(out).as_posix(): oct(mode(p)) for p in files} == {
        p.relative_to(out).as_posix(): oct(file_mode) for p in files
    }
    assert {p.name: oct(mode(p)) for p in dirs} == {p.name: oct(dir_mode) for p in dirs}
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []  # no temp files or staging dirs left


def test_a_stage_writes_every_output_with_the_plain_mode(tmp_path: Path):
    """The world stage on the smoke profile, under umask 027: every file 0640, every directory 0750."""
    from stages import world
    from tests.stages.test_world_curate_index import smoke_params

    params = smoke_params(tmp_path, "world", world.Params, workers=1)
    with umask(0o027):
        world.run(params, {}, {"out": tmp_path / "world", "metrics": tmp_path / "metrics" / "world.json"})
    written = [tmp_path / "world", tmp_path / "metrics", *(tmp_path / "world").rglob("*"),
               *(tmp_path / "metrics").rglob("*")]
    files = [p for p in written if p.is_file()]
    dirs = [p for p in written if p.is_dir()]
    assert len(files) > 40 and {"raw_images.parquet", "scene.json", "world.json"} <= {p.name for p in files}
    assert {p.relative_to(tmp_path).as_posix() for p in files if mode(p) != 0o640} == set()
    assert {p.relative_to(tmp_path).as_posix() for p in dirs if mode(p) != 0o750} == set()
