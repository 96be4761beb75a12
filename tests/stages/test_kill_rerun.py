"""kill -9 during the curate and index stages, then the stage again: it finishes, its outputs equal an uninterrupted
run's (CPU, same seed), and no half-written output is ever visible.

Each stage runs as DVC runs it (its ``cmd`` from dvc.yaml, in a project folder holding a smoke-profile params.yaml
and ``data/world``). A watcher polls every millisecond for the stage's staging directory (``atomic_dir``:
``data/.<out>.tmp-<pid>-<hex>``) and sends SIGKILL once the run has reached a chosen point inside it. The killed
run must leave no ``data/<out>`` and no metrics file; its staging directory stays behind, hidden. The same command
again sweeps it away, and its outputs equal those of an uninterrupted run of the same command in another folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import REPO, sub_env

POLL_S = 0.001
RUN_TIMEOUT_S = 600
ATTEMPTS = 6  # a kill point the stage can pass before the watcher acts is tried again in a fresh folder
BM25_DIR = "text/bm25"  # index: the bm25s files of the text index
TIMING_KEYS = {"curate": {"images_per_s"}, "index": {"text_build_s", "image_build_s"}}  # metrics that are wall time


def stage_cmd(stage: str) -> list[str]:
    """The stage's command from dvc.yaml, run with this interpreter."""
    cmd = shlex.split(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage]["cmd"])
    assert cmd[:3] == ["python", "-m", f"stages.{stage}"], cmd
    return [sys.executable, *cmd[1:]]


def stage_path(stage: str, flag: str) -> Path:
    """A path argument of the stage's command (relative to the project folder), e.g. ``--out``."""
    cmd = stage_cmd(stage)
    return Path(cmd[cmd.index(flag) + 1])


def listing(root: Path) -> list[str]:
    """Every file and directory under ``root`` (directories end with /), hidden ones included."""
    return sorted(p.relative_to(root).as_posix() + ("/" if p.is_dir() else "") for p in root.rglob("*"))


@dataclass
class Run:
    returncode: int
    stderr: str
    first_seen: list[str] | None = None  # what data/<out> held the first time the watcher saw it
    staging: Path | None = None  # the staging directory the run was writing when it was killed
    landed: bool = False  # the kill landed inside the atomic_dir block: staging left behind, no data/<out>
    killed_after_s: float = 0.0
    workers: list[psutil.Process] = field(default_factory=list)  # the stage's child processes at the kill


def run_stage(stage: str, root: Path, kill_when: Callable[[Path], bool] | None = None,
              kill_workers: bool = True) -> Run:
    """Run the stage's dvc.yaml command in ``root``; with ``kill_when``, SIGKILL it once its staging directory
    exists and ``kill_when(staging)`` holds (then its pool workers too, unless ``kill_workers`` is false).

    The stage is frozen (SIGSTOP) the moment the point is seen, so that its child processes can be listed, then
    killed; whether the kill landed inside the atomic_dir block is read off the disk once it is dead (the
    stage may have got past its rename between the watcher's look and the signal: then ``landed`` is false)."""
    out = root / stage_path(stage, "--out")
    err_path = root / f"{stage}-{time.monotonic_ns()}.stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(stage_cmd(stage), cwd=root, env=sub_env(OMP_NUM_THREADS="1"),
                                stdout=subprocess.DEVNULL, stderr=err)
    pattern = f".{out.name}.tmp-{proc.pid}-*"  # atomic_dir's staging directory of this process
    t0 = time.monotonic()
    run = Run(returncode=0, stderr="")
    try:
        while proc.poll() is None:
            if run.first_seen is None and out.exists():
                run.first_seen = listing(out)
            staging = next(out.parent.glob(pattern), None) if kill_when is not None else None
            if staging is not None and kill_when(staging):
                proc.send_signal(signal.SIGSTOP)
                try:
                    workers = psutil.Process(proc.pid).children(recursive=True)
                except psutil.NoSuchProcess:
                    workers = []
                proc.send_signal(signal.SIGKILL)
                run.killed_after_s = time.monotonic() - t0
                proc.wait()
                run.staging, run.workers = staging, workers
                run.landed = staging.is_dir() and not out.exists()
                if kill_workers:
                    for w in workers:
                        try:
                            w.kill()  # psutil checks the pid still names that process
                        except psutil.NoSuchProcess:
                            pass
                    _, alive = psutil.wait_procs(workers, timeout=30)
                    assert not alive, alive
                break
            assert time.monotonic() - t0 < RUN_TIMEOUT_S, f"{stage} still running after {RUN_TIMEOUT_S} s"
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if run.first_seen is None and out.exists():
        run.first_seen = listing(out)
    run.returncode, run.stderr = proc.returncode, err_path.read_text()
    return run


def write_params(root: Path) -> None:
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    doc["base"]["profile"] = "smoke"
    doc["world"]["workers"] = 2
    doc["curate"]["workers"] = 2  # a process pool, so the kill also meets live pool workers
    (root / "params.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def project(root: Path, world_root: Path) -> Path:
    """A project folder: the same params.yaml, and data/world linked to the module's world."""
    (root / "data").mkdir(parents=True)
    (root / "params.yaml").write_bytes((world_root / "params.yaml").read_bytes())
    (root / "data" / "world").symlink_to(world_root / "data" / "world", target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The smoke world, then curate and index run uninterrupted, in one project folder."""
    root = tmp_path_factory.mktemp("uninterrupted")
    write_params(root)
    for stage in ("world", "curate", "index"):
        run = run_stage(stage, root)
        assert run.returncode == 0, run.stderr
        if stage != "world":
            assert run.first_seen in (None, listing(root / stage_path(stage, "--out")))
    return root


def quality_report(path: Path, out_rel: Path) -> dict:
    """A ``<table>.quality.json`` without its ``path``: write_artifacts records the path it wrote the table to,
    which is inside the run's staging directory (``data/.curate.tmp-<pid>-<hex>/curated.parquet``), so it differs
    from run to run by the pid and the random hex; everything else must be equal."""
    doc = json.loads(path.read_text())
    written = Path(doc.pop("path"))
    assert written.name == path.name.removesuffix(".quality.json")
    assert written.parent.parent == out_rel.parent
    assert re.fullmatch(rf"\.{re.escape(out_rel.name)}\.tmp-\d+-[0-9a-f]{{8}}", written.parent.name), written
    return doc


def bm25_content(directory: Path) -> tuple[dict, dict]:
    """A saved bm25s index by what it scores: its params, and for each vocabulary token the (doc, score) pairs
    of its column of the score matrix (CSC: indptr over token ids, indices = doc rows, data = scores).

    The files themselves differ from process to process: bm25s numbers the vocabulary in the iteration order of
    a Python set of strings, which follows the process's string-hash seed (PYTHONHASHSEED, random per process).
    The token ids, so vocab.index.json and the order of the CSC arrays, change; the scores do not."""
    params = json.loads((directory / "params.index.json").read_text())
    vocab = json.loads((directory / "vocab.index.json").read_text())
    data, rows, indptr = (np.load(directory / f"{name}.csc.index.npy") for name in ("data", "indices", "indptr"))
    assert len(indptr) == len(vocab)  # the empty token "" has an id and no column
    columns = {}
    for token, col in vocab.items():
        if col + 1 < len(indptr):
            lo, hi = indptr[col], indptr[col + 1]
            columns[token] = sorted(zip(rows[lo:hi].tolist(), data[lo:hi].tolist()))
        else:
            columns[token] = None
    return params, columns


def assert_same_outputs(stage: str, expected_root: Path, root: Path, metrics_required: bool = True) -> None:
    """Every output file equal to the uninterrupted run's: tables by content, quality reports up to the staging
    path they name, the BM25 text index by its scores (:func:`bm25_content`), every other file byte for byte
    (index: the manifests hold counts, versions and id digests, no timestamps or temp names, so they too are
    byte-equal); the metrics (written after the output: a run killed in between has none) equal up to their
    wall-time keys."""
    out_rel, metrics_rel = stage_path(stage, "--out"), stage_path(stage, "--metrics")
    want, got = expected_root / out_rel, root / out_rel
    files = listing(want)
    assert listing(got) == files
    assert not [f for f in files if any(part.startswith(".") for part in f.split("/"))], files  # no temp leftovers
    for rel in (f for f in files if not f.endswith("/")):
        if rel.endswith(".parquet"):
            assert pq.read_table(got / rel).equals(pq.read_table(want / rel), check_metadata=True), rel
        elif rel.endswith(".quality.json"):
            assert quality_report(got / rel, out_rel) == quality_report(want / rel, out_rel), rel
        elif stage == "index" and rel.startswith(f"{BM25_DIR}/"):
            continue  # compared as a whole below
        else:
            assert (got / rel).read_bytes() == (want / rel).read_bytes(), rel
    if stage == "index":
        assert bm25_content(got / BM25_DIR) == bm25_content(want / BM25_DIR)
    if not (metrics_required or (root / metrics_rel).exists()):
        return
    m_want, m_got = json.loads((expected_root / metrics_rel).read_text()), json.loads((root / metrics_rel).read_text())
    assert TIMING_KEYS[stage] <= set(m_want) and TIMING_KEYS[stage] <= set(m_got)
    for key in TIMING_KEYS[stage]:
        del m_want[key], m_got[key]
    assert m_got == m_want


def n_files(directory: Path) -> int:
    return sum(1 for _ in directory.iterdir()) if directory.is_dir() else 0


# Where the kill lands, inside the stage's atomic_dir block (the staging directory exists, data/<out> does not).
KILL_POINTS: dict[str, dict[str, Callable[[Path], bool]]] = {
    "curate": {
        # the pool workers are writing derivatives; no table yet (they come seconds later, after the quality suites)
        "probing": lambda staging: n_files(staging / "derivatives") >= 2,
        # the quality reports are written and the two tables are being written (fsync'd one after the other)
        "writing-tables": lambda staging: any(staging.glob("*.quality.json")),
    },
    "index": {
        # the indexes are built and probed; the staging directory has just been made and the saves begin
        "staging-made": lambda staging: True,
        # both sub-indexes saved into the staging directory (complete-looking), the top manifest not yet in place
        "sub-indexes-saved": lambda staging: (staging / "image").is_dir(),
    },
}


@pytest.mark.parametrize(("stage", "point"), [(s, p) for s, points in KILL_POINTS.items() for p in points])
def test_kill_9_mid_stage_then_rerun_equals_uninterrupted(stage, point, reference, tmp_path):
    out_rel, metrics_rel = stage_path(stage, "--out"), stage_path(stage, "--metrics")
    for attempt in range(1, ATTEMPTS + 1):
        root = project(tmp_path / f"try{attempt}", reference)
        killed = run_stage(stage, root, KILL_POINTS[stage][point])
        if killed.landed:
            break
        # the run got past its rename before the kill reached it: its output is whole and equals the reference
        if killed.staging is None:
            assert killed.returncode == 0, killed.stderr
        assert killed.first_seen == listing(root / out_rel)
        assert_same_outputs(stage, reference, root, metrics_required=killed.returncode == 0)
    else:
        pytest.fail(f"{stage}: no kill landed at {point} in {ATTEMPTS} runs")
    out, metrics = root / out_rel, root / metrics_rel

    # the kill landed mid-run, inside the atomic_dir block: the output never existed
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.first_seen is None
    # no half-written output is visible: no data/<out>, no metrics; the pieces stay in the hidden staging directory
    assert not out.exists() and not metrics.exists()
    assert killed.staging.is_dir()
    left = listing(killed.staging)
    full = set(listing(reference / out_rel))
    assert not [f for f in left if f not in full and not any(part.startswith(".") for part in f.split("/"))], left
    if point == "probing":
        assert "derivatives/" in left and "curated.parquet" not in left and "rejects.parquet" not in left, left
    if point == "writing-tables":
        assert len([f for f in left if f.endswith(".quality.json")]) >= 1, left
    if point == "sub-indexes-saved":
        assert {"text/manifest.json", "image/manifest.json"} <= set(left), left
    print(f"{stage} {point}: killed {killed.killed_after_s:.3f} s after start, try {attempt}; staging held {left}")

    # the same command again: it sweeps the killed run's staging directory, finishes, and equals the reference
    again = run_stage(stage, root)
    assert again.returncode == 0, again.stderr
    assert f"removed {killed.staging.relative_to(root)}, left by a killed run" in again.stderr
    assert again.first_seen == listing(out)  # the first time data/<out> was visible, it was already whole
    assert_same_outputs(stage, reference, root)
    assert not killed.staging.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(".")]  # no staging dir, no temp file


def test_curate_pool_workers_exit_when_the_stage_is_killed(reference, tmp_path):
    root = project(tmp_path / "proj", reference)
    killed = run_stage("curate", root, KILL_POINTS["curate"]["probing"], kill_workers=False)
    assert killed.staging is not None and killed.returncode == -signal.SIGKILL
    assert len(killed.workers) == 2  # curate.workers
    _, alive = psutil.wait_procs(killed.workers, timeout=5)
    for w in alive:  # end the orphans this test made, by pid (psutil checks the pid still names that process)
        try:
            w.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=30)
    assert not alive, f"{len(alive)} pool worker(s) still running 5 s after the stage was killed"


def test_stage_commands_are_dvc_yamls(reference):
    """The commands above are dvc.yaml's, writing under data/ of the project folder (what the sweep relies on)."""
    for stage in KILL_POINTS:
        assert stage_path(stage, "--out") == Path("data") / stage
        assert stage_path(stage, "--metrics") == Path("metrics") / f"{stage}.json"
        assert (reference / "data" / stage).is_dir() and os.path.isfile(reference / "metrics" / f"{stage}.json")
