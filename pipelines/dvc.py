"""Thin helpers over the DVC command line: the stage DAG, status, repro and experiments.

The Prefect flow never re-implements a stage: it asks DVC. :func:`read_dag` reads
dvc.yaml (stage names, deps, outs, metrics; the DAG follows from outs feeding deps) and
:func:`ordered` gives a topological order of a subset plus everything it needs.
:func:`run_dvc` runs one DVC command and streams its output line by line to a callback.
A command refused because another DVC process holds the repository (its lock, or the read/write
lock of a running stage's files) is reported as :class:`DvcLocked`, whose message says so and
names the process (:func:`lock_message`). :class:`ExperimentRun` runs one ``dvc exp run --temp`` (a run with param
overrides: one DVC experiment, whose unchanged stages DVC restores) in the background and hands each stage's part
of its output to whoever follows that stage (the flow's task for it), as DVC reaches it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import yaml


class DvcError(RuntimeError):
    """A DVC command failed or dvc.yaml is not what the pipeline expects."""


class DvcLocked(DvcError):
    """A DVC command was refused because another DVC process (a ``dvc repro``, ``dvc exp run`` or another flow run)
    holds the repository."""


_BUSY = re.compile(r"'([^']+)' is busy, it is being blocked by:\s*\(PID (\d+)\): ([^\n]*)")


def lock_message(output: str, repo: str | Path, command: str) -> str | None:
    """The one-line error for a DVC ``command`` whose ``output`` is DVC's refusal to run beside another DVC process,
    else None. DVC refuses in two ways: the repository lock (``.dvc/tmp/lock``, held while a command reads or writes
    dvc.yaml / dvc.lock; waited for 3 s) and the read/write lock of a running stage's files (``.dvc/tmp/rwlock``)."""
    repo = Path(repo)
    if "Unable to acquire lock" in output:
        return (f"{command}: the DVC repository {repo} is locked by another run (DVC could not take "
                f"{repo / '.dvc/tmp/lock'}); wait for the other dvc repro, dvc exp run or mars pipeline to finish and "
                f"run again; if none is running, a killed run left the lock behind: delete that file")
    found = _BUSY.search(output)
    if found:
        path, pid, cmd = found.groups()
        cmd = re.sub(r"\S*dvc/__main__\.py", "dvc", cmd.strip())
        return (f"{command}: the DVC repository {repo} is locked by another run: PID {pid} ({cmd}) is running a "
                f"stage that uses {path}; wait for it to finish and run again; if no process {pid} exists, a killed "
                f"run left the lock behind: delete {repo / '.dvc/tmp/rwlock'}")
    return None


@dataclass(frozen=True)
class StageSpec:
    name: str
    deps: tuple[str, ...]
    outs: tuple[str, ...]
    metrics: tuple[str, ...] = ()
    upstream: frozenset[str] = field(default_factory=frozenset)


def _paths(entries: Iterable) -> tuple[str, ...]:
    out = []
    for e in entries or ():
        out.append(next(iter(e)) if isinstance(e, dict) else str(e))
    return tuple(out)


def _under(path: str, root: str) -> bool:
    p, r = PurePosixPath(path), PurePosixPath(root)
    return p == r or r in p.parents or p in r.parents


def read_dag(repo: str | Path = ".") -> dict[str, StageSpec]:
    """Parse ``dvc.yaml`` into stage specs with their upstream stages resolved."""
    path = Path(repo) / "dvc.yaml"
    if not path.is_file():
        raise DvcError(f"{path}: not found; run from the repository root (or pass repo=...)")
    doc = yaml.safe_load(path.read_text()) or {}
    raw = doc.get("stages") or {}
    specs = {}
    for name, st in raw.items():
        if "foreach" in st or "matrix" in st:
            raise DvcError(f"{path}: stage '{name}' uses foreach/matrix, which the pipeline flow does not expand")
        metrics = _paths(st.get("metrics"))
        outs = _paths(st.get("outs")) + metrics + _paths(st.get("plots"))
        specs[name] = StageSpec(name, _paths(st.get("deps")), outs, metrics)
    resolved = {}
    for name, spec in specs.items():
        ups = {
            other.name
            for other in specs.values()
            if other.name != name and any(_under(d, o) for d in spec.deps for o in other.outs)
        }
        resolved[name] = StageSpec(spec.name, spec.deps, spec.outs, spec.metrics, frozenset(ups))
    return resolved


def ordered(dag: dict[str, StageSpec], wanted: Iterable[str] | None = None) -> list[str]:
    """Topological order (dvc.yaml order among equals) of ``wanted`` plus their ancestors."""
    wanted = list(dag) if wanted is None else list(wanted)
    for name in wanted:
        if name not in dag:
            raise DvcError(f"unknown stage '{name}'; stages in dvc.yaml: {', '.join(dag) or '(none)'}")
    needed: set[str] = set()
    stack = list(wanted)
    while stack:
        name = stack.pop()
        if name not in needed:
            needed.add(name)
            stack.extend(dag[name].upstream)
    order: list[str] = []
    remaining = [n for n in dag if n in needed]
    while remaining:
        ready = [n for n in remaining if dag[n].upstream <= set(order)]
        if not ready:
            raise DvcError(f"dvc.yaml has a cycle among {remaining}")
        order.append(ready[0])
        remaining.remove(ready[0])
    return order


def with_downstream(dag: dict[str, StageSpec], wanted: Iterable[str] | None = None) -> list[str]:
    """``wanted`` (default: every stage) plus every stage downstream of them, in dvc.yaml order."""
    names = set(dag) if wanted is None else set(wanted)
    unknown = sorted(names - set(dag))
    if unknown:
        raise DvcError(f"unknown stage '{unknown[0]}'; stages in dvc.yaml: {', '.join(dag) or '(none)'}")
    grew = True
    while grew:
        more = {n for n, spec in dag.items() if spec.upstream & names} - names
        names |= more
        grew = bool(more)
    return [n for n in dag if n in names]


def dvc_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DVC_NO_ANALYTICS", "1")
    # Stages run `python -m stages.<name>`: use the interpreter that runs us.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def dvc_bin() -> list[str]:
    return [sys.executable, "-m", "dvc"]


def run_dvc(args: list[str], repo: str | Path, on_line: Callable[[str], None] | None = None) -> tuple[int, str]:
    """Run ``dvc <args>`` in ``repo``, streaming merged stdout/stderr lines to ``on_line``."""
    proc = subprocess.Popen(
        dvc_bin() + args,
        cwd=repo,
        env=dvc_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        if on_line:
            on_line(line)
    return proc.wait(), "\n".join(lines)


def stage_is_current(stage: str, repo: str | Path) -> bool:
    """True when ``dvc status <stage>`` reports nothing changed for the stage itself."""
    proc = subprocess.run(
        dvc_bin() + ["status", "--json", stage], cwd=repo, env=dvc_env(), capture_output=True, text=True
    )
    if proc.returncode != 0:
        locked = lock_message(proc.stdout + proc.stderr, repo, f"dvc status {stage}")
        if locked:
            raise DvcLocked(locked)
        raise DvcError(f"dvc status {stage} failed:\n{proc.stdout}\n{proc.stderr}")
    import json

    status = json.loads(proc.stdout.strip().splitlines()[-1] or "{}")
    return stage not in status and not any(k.endswith(f":{stage}") for k in status)


# How DVC announces each stage it reaches: run, restored from the run-cache, or unchanged (its outputs checked out).
_STAGE_LINE = re.compile(r"^(?:Running stage '([^']+)'|Stage '([^']+)' (is cached|didn't change))")
_RAN_EXP = re.compile(r"Ran experiment\(s\):\s*(\S+)")


class ExperimentRun:
    """``dvc exp run --temp [-n name] -S key=value ... <targets>`` in a background thread: one DVC experiment in a
    temporary copy of the repository (the workspace is untouched). :meth:`follow` streams one stage's lines as DVC
    reaches the stage and returns how DVC handled it (``ran``, ``restored`` from the run-cache, ``unchanged``);
    :meth:`finish` waits for the end and returns the experiment's name."""

    def __init__(self, repo: str | Path, overrides: dict[str, str], targets: Iterable[str] = (),
                 name: str | None = None):
        self.repo = Path(repo)
        sets = [a for k, v in overrides.items() for a in ("-S", f"{k}={v}")]
        self.args = ["exp", "run", "--temp", *(["-n", name] if name else []), *sets, *targets]
        self.command = f"dvc {' '.join(self.args)}"
        self._cond = threading.Condition()
        self._order: list[str] = []  # stages in the order DVC reached them
        self._status: dict[str, str] = {}
        self._lines: dict[str, list[str]] = {}
        self.code: int | None = None
        self.output = ""
        self._thread = threading.Thread(target=self._run, name="dvc-exp-run", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            code, output = run_dvc(self.args, self.repo, on_line=self._line)
        except BaseException as exc:  # noqa: BLE001 - reported to the followers as a failed command
            code, output = -1, f"{self.command} could not run: {exc}"
        with self._cond:
            self.code, self.output = code, output
            self._cond.notify_all()

    def _line(self, line: str) -> None:
        with self._cond:
            m = _STAGE_LINE.match(line)
            if m:
                stage = m[1] or m[2]
                self._order.append(stage)
                self._status[stage] = "ran" if m[1] else "restored" if m[3] == "is cached" else "unchanged"
                self._lines[stage] = [line]
            elif self._order:
                self._lines[self._order[-1]].append(line)
            self._cond.notify_all()

    def _failure(self) -> DvcError:
        locked = lock_message(self.output, self.repo, self.command)
        if locked:
            return DvcLocked(locked)
        return DvcError(f"{self.command} failed with exit code {self.code} (see the log above)")

    def follow(self, stage: str, on_line: Callable[[str], None]) -> str:
        """Send ``stage``'s output lines to ``on_line`` as they come; once DVC has moved past the stage, return its
        status. Raises :class:`DvcError` when the command fails in the stage or ends before reaching it."""
        sent = 0
        with self._cond:
            while True:
                lines = self._lines.get(stage, [])
                for line in lines[sent:]:
                    on_line(line)
                sent = len(lines)
                ended = self.code is not None
                if stage in self._status and (self._order[-1] != stage or ended):
                    if ended and self.code != 0 and self._order[-1] == stage:
                        raise self._failure()
                    return self._status[stage]
                if ended:
                    if self.code != 0:
                        raise self._failure()
                    raise DvcError(f"{self.command} ended without reaching stage '{stage}'")
                self._cond.wait()

    def finish(self) -> str:
        """Wait for the command; the experiment's name (DVC's ``Ran experiment(s): NAME``)."""
        self._thread.join()
        if self.code != 0:
            raise self._failure()
        found = _RAN_EXP.findall(self.output)
        if not found:
            raise DvcError(f"{self.command}: DVC did not name the experiment it ran; its output:\n{self.output}")
        return found[-1]
