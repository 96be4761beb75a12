"""mars.train.checkpoint: the code digest the stages put in their fingerprints, and resumption by fingerprint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mars.train.checkpoint import fingerprint, latest_state, save_state, source_digest


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_source_digest_sees_every_code_change_and_nothing_else(tmp_path: Path) -> None:
    a = _tree(tmp_path / "a", {"pkg/__init__.py": "", "pkg/loss.py": "def loss(x):\n    return x\n"})
    b = _tree(tmp_path / "b", {"stage.py": "print(1)\n"})
    d0 = source_digest([a, b])
    assert d0 == source_digest([a, b]) and len(d0) == 16
    (a / "notes.md").write_text("not code")  # a non-Python file does not count
    assert source_digest([a, b]) == d0
    (a / "pkg/loss.py").write_text("def loss(x):\n    return -x\n")  # a changed loss
    d1 = source_digest([a, b])
    assert d1 != d0
    (a / "pkg/loss.py").rename(a / "pkg/losses.py")  # same bytes, another module name
    assert source_digest([a, b]) not in (d0, d1)
    (a / "pkg/losses.py").rename(a / "pkg/loss.py")
    assert source_digest([a, b]) == d1
    # the same file under the other root is another tree
    (b / "stage.py").rename(b / "x.py")
    moved = source_digest([a, b])
    (b / "x.py").rename(a / "x.py")
    assert source_digest([a, b]) != moved
    # the stages' digest covers this project's mars and stages packages, and nothing else
    import mars
    import stages

    roots = [Path(mars.__file__).parent, Path(stages.__file__).parent]
    assert stages.code_digest() == source_digest(roots) != source_digest(roots[:1])


def _steps(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_a_changed_fingerprint_starts_afresh_and_its_checkpoints_outlive_the_old_runs(tmp_path: Path) -> None:
    fp_old, fp_new = fingerprint({"lr": 1e-3}, "code-a"), fingerprint({"lr": 1e-3}, "code-b")
    for step in (100, 200, 300):
        save_state(tmp_path, step, {"fingerprint": fp_old, "step": step, "w": torch.ones(2)})
    assert _steps(tmp_path) == ["step-000200", "step-000300"]  # keep=2
    assert latest_state(tmp_path, fp_old)["step"] == 300
    assert latest_state(tmp_path, fp_new) is None  # new code: start afresh
    # the new run's first checkpoint (a lower step) removes the old run's: before, pruning by step number kept
    # steps 200 and 300 and deleted step 50 at once, so a kill of the new run could never resume
    save_state(tmp_path, 50, {"fingerprint": fp_new, "step": 50, "w": torch.zeros(2)})
    assert _steps(tmp_path) == ["step-000050"]
    assert (tmp_path / "step-000050" / "fingerprint.txt").read_text() == fp_new
    save_state(tmp_path, 100, {"fingerprint": fp_new, "step": 100, "w": torch.zeros(2)})
    save_state(tmp_path, 150, {"fingerprint": fp_new, "step": 150, "w": torch.zeros(2)})
    assert _steps(tmp_path) == ["step-000100", "step-000150"]
    state = latest_state(tmp_path, fp_new)
    assert state["step"] == 150 and torch.equal(state["w"], torch.zeros(2))
    assert latest_state(tmp_path, fp_old) is None


def test_load_model_weights_takes_a_states_model_entry_and_rejects_other_files(tmp_path):
    from mars.train.checkpoint import load_model_weights

    trained, fresh = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    with torch.no_grad():
        trained.weight.fill_(0.5)
    path = save_state(tmp_path, 7, {"fingerprint": "fp", "step": 7, "model": trained.state_dict()}) / "state.pt"
    load_model_weights(fresh, path)
    assert torch.equal(fresh.weight, trained.weight) and torch.equal(fresh.bias, trained.bias)
    torch.save({"w": torch.ones(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="no 'model' entry"):
        load_model_weights(fresh, tmp_path / "other.pt")


def test_checkpointer_saves_when_due_and_resumes_every_part(tmp_path: Path) -> None:
    """Every 2 steps and at the last (5): steps 2, 4 and 5 save, 1 and 3 do not; with keep=2 steps 4 and 5 stay.
    A resume loads the module, the sampler and the RNG state of step 5 and hands back the extras."""
    from mars.train.checkpoint import Checkpointer
    from mars.train.data import EpochSampler

    model, sampler = torch.nn.Linear(2, 1), EpochSampler(10, 3, seed=0)
    ckpt = Checkpointer(tmp_path, "fp-a", {"model": model, "sampler": sampler}, every=2, last=5, label="test")
    assert ckpt.resume() == (0, {})
    saved = []
    for done in range(1, 6):
        sampler.next()
        saved.append(ckpt.step_done(done, history=[done]))
    assert saved == [False, True, False, True, True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000005"]
    weights, position, draw = model.weight.detach().clone(), sampler.state(), torch.rand(3)

    fresh, fresh_sampler = torch.nn.Linear(2, 1), EpochSampler(10, 3, seed=0)
    again = Checkpointer(tmp_path, "fp-a", {"model": fresh, "sampler": fresh_sampler}, every=2, last=5)
    start, state = again.resume()
    assert start == 5 and state["history"] == [5]
    assert torch.equal(fresh.weight, weights) and fresh_sampler.state() == position == {"epoch": 1, "offset": 5}
    assert torch.equal(torch.rand(3), draw)  # the generators are where they were when step 5 was saved
    assert Checkpointer(tmp_path, "fp-b", {"model": fresh}, every=2, last=5).resume() == (0, {})


def test_publish_curves_copies_a_resumed_curve_whole_and_replaces_the_last_one(tmp_path):
    """A run logs steps 0..2, is killed, resumes at step 2 (the row of step 2 is logged again) and ends at step 3:
    the published curve is dvclive's plots/metrics tree, rows 0..3 once each; publishing again replaces it."""
    from mars.train.checkpoint import open_live, publish_curves

    live = open_live(tmp_path / "live", 0)
    for step in range(3):
        live.log_metric("train/loss", 1.0 / (step + 1))
        live.next_step()
    live = open_live(tmp_path / "live", 2)  # the resume: the checkpoint held steps 0..1
    for step in (2, 3):
        live.log_metric("train/loss", 1.0 / (step + 1))
        live.next_step()
    live.end()
    dest = tmp_path / "plots/sft"
    dest.mkdir(parents=True)
    (dest / "stale.tsv").write_text("from an earlier run\n")
    publish_curves(tmp_path / "live", dest)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == ["train/loss.tsv"]
    head, *rows = [ln.split("\t") for ln in (dest / "train/loss.tsv").read_text().splitlines()]
    assert head == ["step", "loss"]
    assert [(int(s), float(x)) for s, x in rows] == [(0, 1.0), (1, 0.5), (2, 1 / 3), (3, 0.25)]
    publish_curves(tmp_path / "nothing", dest)  # a run that logged no curve publishes an empty one
    assert list(dest.iterdir()) == []
