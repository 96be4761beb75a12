"""What every DVC stage module shares: argument parsing, params loading, logging, metrics.

A stage module ``stages/<name>.py`` defines ``SECTION = "<name>"``, a frozen ``Params``
dataclass, ``run(params, inputs, outputs)`` and ``main(argv)``. ``main`` calls
:func:`stage_args`, which parses ``--params`` plus the stage's input and output paths (paths
come only from dvc.yaml), loads and validates the params (failing before any work on a typo),
and sets up logging. The stage name is the
dvc.yaml key, the params.yaml section, the module name and the Prefect task name.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any, TypeVar

from mars.data.io import atomic_write_text
from mars.params import ParamsError, load_params

T = TypeVar("T")

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
