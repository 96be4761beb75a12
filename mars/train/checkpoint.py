"""Training checkpoints (model, optimizer, scheduler, RNG states, step, sampler position) and curve resumption.

What it does
    :func:`save_state` writes ``<dir>/step-<NNNNNN>/state.pt`` (and its fingerprint in ``fingerprint.txt``)
    atomically (staging directory + rename), removes the checkpoints of other fingerprints and keeps the newest
    ``keep`` of its own; :func:`latest_state` loads the newest one whose ``fingerprint`` (a hash of the
    run's params and inputs) matches, so a changed run starts fresh instead of resuming someone else's state;
    :func:`load_model_weights` puts a state's model weights into a loaded checkpoint (the bench probes).
    :func:`source_digest` hashes code under given roots (the stages pass ``mars`` and ``stages``): they put it in
    their fingerprints, so a code change (a reward, a loss, a judge) never resumes state made by the old code.
    :func:`rng_state` / :func:`set_rng_state` capture Python's, NumPy's and torch's generators.
    :func:`truncate_live` drops dvclive rows logged after the resumed step, so a curve from a killed and resumed
    run is identical to an uninterrupted one. The stages keep checkpoints and the live curve in scratch space that
    DVC does not track (so its run-cache can restore them) and, at the end, :func:`publish_curves` copies the
    finished curve to the git-tracked path that ``dvc plots`` reads.
    :class:`Checkpointer` is the one resume loop every trainer uses (sft, vision, rl): it restores the named parts
    of a run (modules and optimisers through ``load_state_dict``, samplers through ``load``) and the RNG states
    from the newest matching checkpoint, and saves them every ``every`` steps and at the last.

Run the tests: ``.venv/bin/python -m pytest tests/train -q``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import random
import re
import shutil
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from mars.data.io import atomic_dir

__all__ = ["fingerprint", "source_digest", "save_state", "latest_state", "rng_state", "set_rng_state",
           "truncate_live", "open_live", "publish_curves", "Checkpointer"]
log = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d{6,})$")
_FP_FILE = "fingerprint.txt"


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-able parts (params, input hashes)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def source_digest(roots: Sequence[str | Path]) -> str:
    """A short hash of every ``*.py`` file under ``roots`` (the stages pass the ``mars`` and ``stages`` packages:
    :func:`stages.code_digest`), by path relative to its root and content. About 150 files, a few milliseconds."""
    h = hashlib.sha256()
    for k, root in enumerate(Path(r) for r in roots):
        for f in sorted(root.rglob("*.py")):
            h.update(f"{k}:{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _stored_fingerprint(step_dir: Path) -> str | None:
    f = step_dir / _FP_FILE
    return f.read_text().strip() if f.is_file() else None


def save_state(ckpt_dir: str | Path, step: int, state: dict, keep: int = 2) -> Path:
    """Write ``state`` (anything ``torch.save`` takes) as step ``step``, its ``fingerprint`` beside it in a small
    text file; prune every checkpoint of another fingerprint (an earlier run with other params, inputs or code,
    whose higher step numbers would otherwise outlive this run's checkpoints) and all but the newest ``keep``."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step-{step:06d}"
    fp = state.get("fingerprint")
    with atomic_dir(path) as tmp:
        torch.save(state, tmp / "state.pt")
        if fp is not None:
            (tmp / _FP_FILE).write_text(str(fp))
    steps = sorted((p for p in ckpt_dir.iterdir() if _STEP.match(p.name)), key=lambda p: int(_STEP.match(p.name)[1]))
    if fp is not None:
        stale = [p for p in steps if _stored_fingerprint(p) != str(fp)]
        for old in stale:
            log.info("removing checkpoint %s of another run (params, inputs or code changed)", old)
            shutil.rmtree(old, ignore_errors=True)
        steps = [p for p in steps if p not in stale]
    for old in steps[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_model_weights(model: torch.nn.Module, state_path: str | Path) -> None:
    """Replace ``model``'s weights by the ``model`` entry of a training ``state.pt`` (:func:`save_state`), e.g. to
    probe phase 1's last checkpoint with the final model's tokenizer and config."""
    state = torch.load(state_path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or "model" not in state:
        raise ValueError(f"{state_path}: not a training state (no 'model' entry); pass a <ckpt>/step-*/state.pt "
                         "written by the sft, vision or rl stage")
    model.load_state_dict(state["model"])


def latest_state(ckpt_dir: str | Path, fp: str) -> dict | None:
    """The newest checkpoint state with fingerprint ``fp``, or None."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    steps = sorted((p for p in ckpt_dir.iterdir() if _STEP.match(p.name)), key=lambda p: -int(_STEP.match(p.name)[1]))
    for p in steps:
        f = p / "state.pt"
        if not f.is_file():
            continue
        stored = _stored_fingerprint(p)
        if stored is not None and stored != fp:
            log.info("checkpoint %s belongs to another run (params, inputs or code changed); starting fresh", p)
            return None
        try:
            state = torch.load(f, map_location="cpu", weights_only=False)
        except Exception as exc:  # a torn file from a kill: try the previous one
            log.warning("checkpoint %s unreadable (%s); trying an older one", f, exc)
            continue
        if state.get("fingerprint") != fp:
            log.info("checkpoint %s belongs to another run (params or inputs changed); starting fresh", p)
            return None
        return state
    return None


def truncate_live(live_dir: str | Path, step: int) -> None:
    """Drop dvclive metric rows with ``step`` > ``step`` (all ``plots/metrics/**/*.tsv``)."""
    root = Path(live_dir) / "plots" / "metrics"
    if not root.is_dir():
        return
    for tsv in root.rglob("*.tsv"):
        with tsv.open(newline="") as f:
            rows = list(csv.reader(f, delimiter="\t"))
        if not rows:
            continue
        head, body = rows[0], rows[1:]
        k = head.index("step") if "step" in head else None
        if k is None:
            continue
        keep = [r for r in body if r and int(float(r[k])) <= step]
        tmp = tsv.with_suffix(".tsv.tmp")
        with tmp.open("w", newline="") as f:
            w = csv.writer(f, delimiter="\t", lineterminator="\n")
            w.writerow(head)
            w.writerows(keep)
        tmp.replace(tsv)


def open_live(live_dir: str | Path | None, start: int):
    """A dvclive logger for a run starting at step ``start`` (None without ``live_dir``).

    A resumed run (``start > 0``) keeps the curve up to ``start - 1`` and continues it at ``start``."""
    if live_dir is None:
        return None
    from dvclive import Live

    if start:
        truncate_live(live_dir, start - 1)
    live = Live(dir=str(live_dir), resume=bool(start), report=None, save_dvc_exp=False, dvcyaml=False)
    live.step = start
    return live


def publish_curves(live_dir: str | Path, dest: str | Path) -> None:
    """Replace ``dest`` (atomically) by the curves of the dvclive run in ``live_dir``: its ``plots/metrics`` tree
    (``<dest>/<group>/<metric>.tsv``, the step in the first column); an empty ``dest`` when it logged none."""
    src = Path(live_dir) / "plots" / "metrics"
    with atomic_dir(dest) as tmp:
        if src.is_dir():
            shutil.copytree(src, tmp, dirs_exist_ok=True)


class Checkpointer:
    """Resume and checkpoint one training run: ``parts`` name what it saves (objects with ``state_dict`` /
    ``load_state_dict``, or a sampler's ``state`` / ``load``), under fingerprint ``fp`` in ``ckpt_dir``, every
    ``every`` steps and at step ``last``, keeping the newest ``keep``; with ``rng`` the Python, NumPy and torch
    generators too (a run that draws its batches as a function of the step needs none). ``label`` names the run
    in the log."""

    def __init__(self, ckpt_dir: str | Path, fp: str, parts: dict[str, Any], *, every: int, last: int,
                 keep: int = 2, rng: bool = True, label: str = "training"):
        if every < 1:
            raise ValueError(f"{label}: checkpoint_every must be >= 1, got {every}")
        self.dir, self.fp, self.parts = Path(ckpt_dir), fp, parts
        self.every, self.last, self.keep, self.rng, self.label = every, last, keep, rng, label

    def resume(self) -> tuple[int, dict]:
        """(the step to start at, the newest matching state): its parts are loaded into ``parts``; (0, {}) when
        there is none. The state's other entries (a history, samples) are the caller's to take."""
        state = latest_state(self.dir, self.fp)
        if state is None:
            return 0, {}
        for name, part in self.parts.items():
            (part.load_state_dict if hasattr(part, "load_state_dict") else part.load)(state[name])
        if self.rng:
            set_rng_state(state["rng"])
        step = int(state["step"])
        log.info("resuming %s from step %d (%s)", self.label, step, self.dir)
        return step, state

    def step_done(self, done: int, **extra: Any) -> bool:
        """Save the run after ``done`` steps when a checkpoint is due (every ``every`` and the last), with ``extra``
        entries beside the parts; True when it saved."""
        if done % self.every and done != self.last:
            return False
        state = {"fingerprint": self.fp, "step": done,
                 **{n: (p.state_dict() if hasattr(p, "state_dict") else p.state()) for n, p in self.parts.items()}}
        if self.rng:
            state["rng"] = rng_state()
        save_state(self.dir, done, {**state, **extra}, keep=self.keep)
        return True
