"""Work in other processes that ends with the caller: worker processes the kernel kills when the stage dies, and
:class:`Background`, jobs run in spawned processes whose results come back in order and which are killed, not
waited for, when the caller leaves on an error."""

from __future__ import annotations

import multiprocessing as mp
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any


def die_with_parent() -> None:
    """In a worker (a pool's initializer, a process's first call): on Linux the kernel kills the worker when its
    parent dies (``kill -9`` included), instead of leaving it running, or blocked on a pipe, as an orphan."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


class WorkerError(RuntimeError):
    """A background job raised; the message carries the worker's traceback."""


def _run_jobs(conn, jobs: Sequence[tuple[Callable, tuple]]) -> None:
    """A worker's body: run ``jobs`` in turn, sending ("ok", result) for each, or ("error", traceback) and stop."""
    die_with_parent()
    try:
        for fn, args in jobs:
            conn.send(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller, which raises it
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class Background:
    """Run ``jobs`` (``(function, args)`` pairs, module-level functions) in ``workers`` spawned processes while the
    caller goes on; :meth:`results` waits for them, in the jobs' order. One worker runs the jobs in turn, as many
    workers as jobs run them at once. Leaving the ``with`` block kills the workers that are still running: an error
    in the caller shows at once, with no process left behind (``multiprocessing.Pool``'s ``terminate`` can hang on
    a worker that is idle or sending a large result)."""

    def __init__(self, jobs: Sequence[tuple[Callable, tuple]], workers: int = 1):
        if not 1 <= workers <= len(jobs):
            raise ValueError(f"Background: workers must be between 1 and the {len(jobs)} jobs, got {workers}")
        ctx = mp.get_context("spawn")
        per = [list(jobs[i::workers]) for i in range(workers)]  # worker i runs jobs i, i + workers, ...
        self._order = [(i % workers) for i in range(len(jobs))]
        self._conns, self._procs = [], []
        for share in per:
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_run_jobs, args=(send, share), daemon=True)
            proc.start()
            send.close()  # the worker holds the only sending end: its death shows here as EOF
            self._conns.append(recv)
            self._procs.append(proc)

    def results(self) -> list[Any]:
        """Every job's result, in the jobs' order; a job's error (or a worker's death) raises :class:`WorkerError`."""
        out = []
        for w in self._order:
            try:
                kind, value = self._conns[w].recv()
            except EOFError:
                self._procs[w].join()
                raise WorkerError(f"a background worker died (exit code {self._procs[w].exitcode}) before sending "
                                  "its result") from None
            if kind == "error":
                raise WorkerError(f"a background job failed:\n{value}")
            out.append(value)
        return out

    def close(self) -> None:
        """Kill the workers still running and reap them all."""
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
