"""Data-quality checks at stage boundaries, run with Great Expectations 1.x.

Suites are declared as plain data in :mod:`mars.data.suites` (one per artifact, keyed by
the artifact names of :mod:`mars.data.schemas`) and turned into GX expectations only here,
in an ephemeral GX context (no GX project on disk). GX is imported lazily inside
:func:`validate`: importing it costs seconds, so modules that never validate stay fast.

The one helper a stage calls is :func:`write_artifacts`: it checks every table against its
schema and suite *before* writing any of them, writes a JSON report next to the outputs
(``<output>.quality.json``), and on failure raises :class:`QualityError` with a summary
while the previous outputs stay byte-identical. Passing tables are then written atomically.
The summary is one line per failing expectation: the file, the column, the expectation, how
many rows fail and the ids of the first few (the artifact's key column, :data:`ROW_KEYS`),
with the stage that wrote the file and what to rerun. E.g. (each line here wrapped)::

    quality check failed for data/curate/curated.parquet (artifact 'curated', 22 rows,
      1 failing expectation); the curate stage wrote it: fix its input or params, then rerun: dvc repro curate
      - data/curate/curated.parquet: column 'width': ExpectColumnValuesToBeBetween(min_value=1,
        max_value=None): 1 of 22 rows fail: image_id ['f-2c8e1b7d9a10'] (values [0])
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from mars.data.io import atomic_write_text, conform, producer_of, write_table
from mars.data.schemas import schema_for
from mars.data.suites import SUITES, Expect
from mars.errors import StageError

log = logging.getLogger(__name__)

ROW_KEYS: dict[str, tuple[str, ...]] = {  # the columns that name a row of each artifact, in failure messages
    "entities": ("entity_id",),
    "corpus": ("doc_id",),
    "gallery": ("gallery_id",),
    "raw_images": ("image_id",),
    "world_truth": ("scene_id", "entity_id"),
    "download_failures": ("url",),
    "curated": ("image_id",),
    "rejects": ("image_id",),
    "questions": ("question_id",),
    "trajectories": ("episode_id",),
    "bench_questions": ("id",),
    "results": ("sample_id",),
}
SHOWN_IDS = 5  # ids of failing rows named in a summary line (the report keeps up to 10)
_STAGING = re.compile(r"^\.(?P<name>.+)\.tmp-\d+-[0-9a-f]+$")  # mars.data.io.atomic_dir's staging directories


class QualityError(StageError, RuntimeError):
    """A table failed its expectation suite; ``report`` holds the details (an expected error: it ends a stage
    with its message alone)."""

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
    id_columns: list[str] = field(default_factory=list)  # the key columns ``sample_ids`` holds
    sample_ids: list[Any] = field(default_factory=list)  # the keys of the first failing rows (joined by "/")


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
        """A head line (file, artifact, rows, the stage to rerun), then one line per failing expectation: the
        file, the column, the expectation, how many rows fail and the ids of the first few."""
        shown = shown_path(self.path)
        failures = self.failures()
        stage = producer_of(shown, self.artifact)
        fix = (f"the {stage} stage wrote it: fix its input or params, then rerun: dvc repro {stage}" if stage
               else "fix the code or input that wrote it")
        lines = [f"quality check failed for {shown} (artifact '{self.artifact}', {self.rows} rows, "
                 f"{len(failures)} failing expectation{'s' if len(failures) != 1 else ''}); {fix}"]
        lines += [f"  - {shown}: {_describe(o)}" for o in failures]
        return "\n".join(lines)


def shown_path(path: str | Path) -> str:
    """``path`` as the user knows it: a file in an :func:`mars.data.io.atomic_dir` staging directory
    (``data/.world.tmp-<pid>-<hex>/x.parquet``) is shown at its destination (``data/world/x.parquet``)."""
    p = Path(path)
    m = _STAGING.match(p.parent.name)
    return str(p.parent.parent / m.group("name") / p.name) if m else str(p)


def _describe(o: ExpectationOutcome) -> str:
    """``column 'x': Expectation(kwargs): N of M rows fail: <key> [ids] (values [...])`` for one outcome."""
    kwargs = dict(o.kwargs)
    if "column" in kwargs:
        where = f"column {kwargs.pop('column')!r}: "
    elif "column_A" in kwargs and "column_B" in kwargs:
        where = f"columns {kwargs.pop('column_A')!r}, {kwargs.pop('column_B')!r}: "
    elif "column_list" in kwargs:
        where = f"columns {kwargs.pop('column_list')!r}: "
    else:
        where = ""
    head = f"{where}{o.expectation}({_fmt_kwargs(kwargs)})"
    if o.error:
        return f"{head}: could not be checked: {o.error}"
    if o.unexpected_count is None:
        return f"{head}: observed {o.observed_value!r}"
    what = f"{head}: {o.unexpected_count} of {o.element_count} rows fail"
    values = o.sample_unexpected[:SHOWN_IDS]
    if not o.sample_ids:
        return f"{what}, e.g. values {values}"
    what += f": {'/'.join(o.id_columns)} {o.sample_ids[:SHOWN_IDS]}"
    if o.unexpected_count > SHOWN_IDS:
        what += f" and {o.unexpected_count - SHOWN_IDS} more"
    if [o.kwargs.get("column")] != o.id_columns and values:  # the values add nothing when they are the ids
        what += f" (values {values})"
    return what


def _fmt_kwargs(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def _row_ids(index_list: list[dict], keys: list[str]) -> list[Any]:
    """The key of each failing row GX listed (``unexpected_index_column_names``), "/"-joined for compound keys."""
    ids = []
    for row in index_list or ():
        if not isinstance(row, dict) or not all(k in row for k in keys):
            continue
        key = [row[k] for k in keys]
        ids.append(key[0] if len(key) == 1 else "/".join(str(v) for v in key))
    return _jsonable(ids)


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
    keys = [k for k in ROW_KEYS.get(artifact, table.column_names[:1]) if k in table.column_names]
    gx, ctx = _gx_context()
    df = table.to_pandas()
    ds = ctx.data_sources.add_pandas(f"mars-{artifact}")
    batch_def = ds.add_dataframe_asset(artifact).add_batch_definition_whole_dataframe("all")
    batch = batch_def.get_batch(batch_parameters={"dataframe": df})
    suite = gx.ExpectationSuite(
        name=f"{artifact}-suite",
        expectations=[getattr(gx.expectations, e.kind)(**e.kwargs) for e in expectations],
    )
    result_format: dict[str, Any] = {"result_format": "SUMMARY", "partial_unexpected_count": 10}
    if keys:  # GX lists these columns of each failing row (partial_unexpected_index_list)
        result_format["unexpected_index_column_names"] = keys
    result = batch.validate(suite, result_format=result_format)
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
                id_columns=list(keys),
                sample_ids=_row_ids(info.get("partial_unexpected_index_list") or [], keys),
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
