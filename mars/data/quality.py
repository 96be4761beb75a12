"""Data-quality checks at stage boundaries, run with Great Expectations 1.x.

Suites are declared as plain data in :mod:`mars.data.suites` (one per artifact, keyed by
the artifact names of :mod:`mars.data.schemas`) and turned into GX expectations only here,
in an ephemeral GX context (no GX project on disk). GX is imported lazily inside
:func:`validate`: importing it costs seconds, so modules that never validate stay fast.

The one helper a stage calls is :func:`write_artifacts`: it checks every table against its
schema and suite *before* writing any of them, writes a JSON report next to the outputs
(``<output>.quality.json``), and on failure raises :class:`QualityError` with a summary
(which expectation, how many rows, sample offending values) while the previous outputs
stay byte-identical. Passing tables are then written atomically.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from mars.data.io import atomic_write_text, conform, write_table
from mars.data.schemas import schema_for
from mars.data.suites import SUITES, Expect

log = logging.getLogger(__name__)


class QualityError(RuntimeError):
    """A table failed its expectation suite; ``report`` holds the details."""

    def __init__(self, message: str, report: "SuiteReport"):
        super().__init__(message)
        self.report = report


@dataclass
class ExpectationOutcome:
    expectation: str
    kwargs: dict[str, Any]
    success: bool
    element_count: int | None = None
    unexpected_count: int | None = None
    sample_unexpected: list[Any] = field(default_factory=list)
    observed_value: Any = None
    error: str | None = None


@dataclass
class SuiteReport:
    artifact: str
    path: str
    rows: int
    success: bool
    outcomes: list[ExpectationOutcome]

    def failures(self) -> list[ExpectationOutcome]:
        return [o for o in self.outcomes if not o.success]

    def summary(self) -> str:
        lines = [f"quality check failed for artifact '{self.artifact}' ({self.path}, {self.rows} rows):"]
        for o in self.failures():
            what = o.error or (
                f"{o.unexpected_count} of {o.element_count} rows unexpected, e.g. {o.sample_unexpected[:5]}"
                if o.unexpected_count is not None
                else f"observed {o.observed_value!r}"
            )
            lines.append(f"  - {o.expectation}({_fmt_kwargs(o.kwargs)}): {what}")
        return "\n".join(lines)


def _fmt_kwargs(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _gx_context():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    logging.getLogger("great_expectations").setLevel(logging.ERROR)  # before import: it logs while loading
    import great_expectations as gx  # lazy: seconds to import
    ctx = gx.get_context(mode="ephemeral")
    try:
        ctx.variables.progress_bars = {"globally": False, "metric_calculations": False}
    except Exception:  # older/newer GX without the setting: progress bars only cost output
        pass
    return gx, ctx


def validate(table: pa.Table, artifact: str, path: str | Path = "", extra: list[Expect] | tuple = ()) -> SuiteReport:
    """Run the artifact's suite (plus ``extra`` expectations) over ``table``."""
    expectations = list(SUITES.get(artifact, ())) + list(extra)
    if not expectations:
        return SuiteReport(artifact, str(path), table.num_rows, True, [])
    gx, ctx = _gx_context()
    df = table.to_pandas()
    ds = ctx.data_sources.add_pandas(f"mars-{artifact}")
    batch_def = ds.add_dataframe_asset(artifact).add_batch_definition_whole_dataframe("all")
    batch = batch_def.get_batch(batch_parameters={"dataframe": df})
    suite = gx.ExpectationSuite(
        name=f"{artifact}-suite",
        expectations=[getattr(gx.expectations, e.kind)(**e.kwargs) for e in expectations],
    )
    result = batch.validate(suite, result_format={"result_format": "SUMMARY", "partial_unexpected_count": 10})
    outcomes = []
    for spec, res in zip(expectations, result.results):
        info = res.result or {}
        exc = res.exception_info or {}
        outcomes.append(
            ExpectationOutcome(
                expectation=spec.kind,
                kwargs=_jsonable(spec.kwargs),
                success=bool(res.success),
                element_count=info.get("element_count"),
                unexpected_count=info.get("unexpected_count"),
                sample_unexpected=_jsonable(info.get("partial_unexpected_list") or []),
                observed_value=_jsonable(info.get("observed_value")),
                error=exc.get("exception_message") if exc.get("raised_exception") else None,
            )
        )
    return SuiteReport(artifact, str(path), table.num_rows, all(o.success for o in outcomes), outcomes)


def report_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".quality.json")


def write_artifacts(outputs: dict[str | Path, tuple[pa.Table, str]], extra: dict[str, list[Expect]] | None = None) -> None:
    """Check every ``path -> (table, artifact)`` pair, then write them all atomically.

    Schema conformity and the artifact's suite are checked for all tables before the first
    write. A report is written beside each output (``<path>.quality.json``); on any failure
    a :class:`QualityError` is raised and no parquet output is touched.
    """
    checked: list[tuple[Path, pa.Table, str]] = []
    reports: list[tuple[Path, SuiteReport]] = []
    for path, (table, artifact) in outputs.items():
        path = Path(path)
        table = conform(table, schema_for(artifact), f"writing {path}")
        report = validate(table, artifact, path, (extra or {}).get(artifact, ()))
        reports.append((path, report))
        checked.append((path, table, artifact))
    for path, report in reports:
        atomic_write_text(report_path(path), json.dumps(asdict(report), indent=2, default=str))
    failed = [r for _, r in reports if not r.success]
    if failed:
        raise QualityError("\n".join(r.summary() for r in failed), failed[0])
    for path, table, artifact in checked:
        write_table(table, path, schema_for(artifact))
        log.info("wrote %s (%d rows, artifact %s)", path, table.num_rows, artifact)
