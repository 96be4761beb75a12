"""mars.workers.Background: results in the jobs' order, a job's error raised here, and no worker left behind when the
caller leaves on an error (the jobs are stdlib functions: a spawned worker imports them by name)."""

from __future__ import annotations

import math
import multiprocessing as mp
import operator
import os
import time

import pytest

from mars.workers import Background, WorkerError


@pytest.mark.parametrize("workers", [1, 2])
def test_results_come_back_in_the_jobs_order(workers):
    """One worker runs both jobs in turn; two run one each."""
    with Background([(operator.add, (2, 3)), (operator.mul, ("ab", 2))], workers) as bg:
        assert bg.results() == [5, "abab"]
    assert mp.active_children() == []


def test_a_jobs_error_raises_with_the_workers_traceback():
    with Background([(operator.add, (1, 1)), (math.sqrt, (-1.0,))]) as bg, pytest.raises(WorkerError) as err:
        bg.results()
    assert "ValueError: math domain error" in str(err.value)
    assert mp.active_children() == []


def test_a_worker_that_dies_is_an_error_naming_its_exit_code():
    with Background([(os._exit, (3,))]) as bg, pytest.raises(WorkerError, match=r"died \(exit code 3\)"):
        bg.results()


def test_an_error_here_kills_busy_and_finished_workers_at_once():
    """One worker sleeps a minute; the other has a 64 MB result it cannot hand over (nobody reads the pipe). Leaving
    the block on an error kills both, in well under the minute (``multiprocessing.Pool``'s terminate can hang on
    the second)."""
    t0 = time.perf_counter()
    with pytest.raises(KeyError), Background([(time.sleep, (60,)), (bytes, (64 << 20,))], workers=2):
        time.sleep(3)  # both workers are running by now
        raise KeyError("the caller failed")
    assert time.perf_counter() - t0 < 30
    assert mp.active_children() == []


def test_workers_must_fit_the_jobs():
    with pytest.raises(ValueError, match="workers must be between 1 and the 2 jobs, got 3"):
        Background([(abs, (1,)), (abs, (2,))], workers=3)
