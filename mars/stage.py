"""What every DVC stage module shares: argument parsing, params loading, logging, metrics.

A stage module ``stages/<name>.py`` defines ``SECTION = "<name>"``, a frozen ``Params``
dataclass, ``run(params, inputs, outputs)`` and ``main(argv)``. ``main`` calls
:func:`stage_args`, which parses ``--params`` plus the stage's input and output paths (paths
come only from dvc.yaml), loads and validates the params (failing before any work on a typo),
and sets up logging. The stage name is the
dvc.yaml key, the params.yaml section, the module name and the Prefect task name.

``main`` runs inside :func:`expected_errors`: an expected error (:class:`mars.errors.StageError`: bad input, a
stale upstream artifact, a failed quality suite, an endpoint that stays down) ends the stage with one last line
``error: <message>`` on stderr and exit status 1, as a params error does; any other exception keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from mars.data.io import atomic_write_text
from mars.errors import StageError
from mars.params import ParamsError, load_params

T = TypeVar("T")
log = logging.getLogger(__name__)
_BULLET = re.compile(r"^[-*]\s+")


def error_lines(exc: BaseException) -> tuple[list[str], str]:
    """``(details, last)``: how an expected error is shown. ``last`` is the one line ``error: <message>``.

    A one-line message is ``last`` alone; a message with one detail line under its head (``head:\n  - detail``)
    is joined into ``last``; with several, the detail lines come first and ``last`` is the head, so the
    output still ends with the one ``error:`` line."""
    lines = [ln.rstrip() for ln in str(exc).strip().splitlines() if ln.strip()] or [type(exc).__name__]
    head, details = lines[0], lines[1:]
    if not details:
        return [], f"error: {head}"
    head = head.rstrip().rstrip(":")
    if len(details) == 1:
        return [], f"error: {head}: {_BULLET.sub('', details[0].strip())}"
    return details, f"error: {head} (the {len(details)} lines above)"


@contextlib.contextmanager
def expected_errors() -> Iterator[None]:
    """End the stage on an expected error with its message alone; let every other exception keep its traceback.

    Every stage's ``main`` runs its work inside this block. On a :class:`mars.errors.StageError` (whatever else it
    subclasses) the message's detail lines, if any, go to stderr and the process ends with ``SystemExit("error:
    <message>")``: one last line on stderr, exit status 1. With ``-v`` the traceback is logged first (debug)."""
    try:
        yield
    except StageError as exc:
        log.debug("the expected error's traceback", exc_info=True)
        details, last = error_lines(exc)
        for line in details:
            print(line, file=sys.stderr)
        sys.stderr.flush()
        raise SystemExit(last) from None


def stage_args(
    section: str,
    params_cls: type[T],
    argv: list[str] | None,
    inputs: tuple[str, ...] = (),
    outputs: tuple[str, ...] = (),
    optional_inputs: tuple[str, ...] = (),
) -> tuple[T, dict[str, Path], dict[str, Path]]:
    """Parse ``--params`` and ``--<io>`` path arguments, then load the stage's params.

    ``optional_inputs`` appear in the inputs dict only when given on the command line."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{section}", description=f"Run the '{section}' stage.")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    for name in inputs + outputs:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, required=True, type=Path)
    for name in optional_inputs:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, type=Path)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if ns.verbose else logging.INFO,
        format=f"%(asctime)s [{section}] %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        params = load_params(section, params_cls, ns.params)
    except ParamsError as exc:  # fail before any work, with the message alone
        raise SystemExit(f"error: {exc}") from None
    ins = {n: getattr(ns, n) for n in inputs}
    ins.update({n: getattr(ns, n) for n in optional_inputs if getattr(ns, n) is not None})
    return params, ins, {n: getattr(ns, n) for n in outputs}


def load_section(section: str, cls: type[T], argv: list[str] | None) -> T:
    """Load another params section (e.g. the shared ``agent`` one) from the same ``--params`` file as the stage."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--params", default="params.yaml")
    ns, _ = parser.parse_known_args(argv)
    try:
        return load_params(section, cls, ns.params)
    except ParamsError as exc:
        raise SystemExit(f"error: {exc}") from None


def write_metrics(path: str | Path, metrics: dict[str, Any]) -> None:
    """Write a flat or nested metrics dict as JSON for ``dvc metrics show`` (atomically)."""

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if hasattr(v, "item"):  # numpy scalars
            return clean(v.item())
        return v

    atomic_write_text(path, json.dumps(clean(metrics), indent=2, sort_keys=True) + "\n")
