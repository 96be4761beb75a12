"""The ``mars_pipeline`` Prefect flow: runs the DVC stages in DAG order, one task per stage.

DVC owns the DAG, caching and lineage; this flow owns scheduling, observability and
parameterised runs (docs/design.md, Stages and their contracts). For each stage (the
requested subset plus every stage it needs, in topological order) one Prefect task named
after the stage:

- without overrides: asks ``dvc status <stage>``; a stage DVC finds up to date finishes as a
  Completed state named ``Skipped``; otherwise ``dvc repro --single-item <stage>`` runs it
  (its upstream tasks ran before it);
- with overrides (``{"rl.steps": 2}``): the whole run is one DVC experiment, ``dvc exp run --temp
  -S key=value ... <stages>`` over the requested stages and every stage downstream of them (their
  results change with the params); the workspace and its params.yaml are left as they are, and DVC
  restores every stage whose deps and params are unchanged (world..sft for an rl change) from its
  run-cache instead of running it. Each stage's task follows the experiment's output for that stage and
  finishes ``Completed`` (ran) or ``Cached`` (restored or unchanged); then the experiment's metrics are
  read from its commit (``dvc exp show`` lists it), its report is copied out of the DVC cache, and the
  log says how to bring it into the workspace (``dvc exp apply NAME``).

Stage output is streamed into the Prefect logs line by line, and each stage's metrics
files (``metrics:`` in dvc.yaml) are published as a Prefect table artifact. Prefect result
caching is off (DVC caches). Retries apply only to stages listed as network-bound in
``params.yaml`` (``pipeline.network_stages``).

Run it with ``mars pipeline [--stages a b] [--set key=value ...]`` or ``python -m pipelines.flow``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, temporary_settings
from prefect.states import Completed

from mars.params import build_dataclass, read_params_file
from pipelines.dvc import (DvcError, DvcLocked, ExperimentRun, lock_message, ordered, read_dag, run_dvc,
                           stage_is_current, with_downstream)


@dataclass(frozen=True)
class PipelineParams:
    """The ``pipeline`` section of params.yaml (orchestration only; not a DVC stage)."""

    network_stages: tuple[str, ...] = ()  # stages that talk to the network: these get retries
    retries: int = 2
    retry_delay_s: float = 30.0
    schedule_cron: str = "0 3 * * *"
    schedule_active: bool = False  # the deployment's cron schedule is off by default
    deployment_name: str = "mars-pipeline"


def load_pipeline_params(repo: str | Path = ".") -> PipelineParams:
    path = Path(repo) / "params.yaml"
    doc = read_params_file(path)
    return build_dataclass(PipelineParams, doc.get("pipeline") or {}, f"{path} [pipeline]")


def _format_value(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _read_metrics(repo: Path, paths: tuple[str, ...]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for rel in paths:
        path = repo / rel
        if path.is_file():
            metrics[rel] = yaml.safe_load(path.read_text())  # JSON is YAML
    return metrics


def _exp_metrics(repo: Path, exp_name: str, paths: tuple[str, ...]) -> dict[str, Any]:
    import dvc.api

    if not paths:
        return {}
    try:
        return {rel: dict(dvc.api.metrics_show(rel, repo=str(repo), rev=exp_name)) for rel in paths}
    except Exception as exc:  # a metrics read must not fail a stage that ran
        get_run_logger().warning("could not read metrics of experiment %s: %s", exp_name, exc)
        return {}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _publish(stage: str, metrics: dict[str, Any]) -> None:
    rows = [{"metric": k, "value": v} for k, v in _flatten(metrics).items()]
    if rows:
        key = re.sub(r"[^a-z0-9-]", "-", f"{stage}-metrics".lower())
        create_table_artifact(rows, key=key, description=f"Metrics of the '{stage}' stage")


def _link_report(stage: str, report: Path, label: str) -> None:
    key = re.sub(r"[^a-z0-9-]", "-", f"{stage}-report".lower())
    create_link_artifact(report.resolve().as_uri(), link_text=f"{stage} report ({label})", key=key,
                         description=f"The self-contained HTML report of the '{stage}' stage")


def _publish_exp_reports(stage: str, root: Path, exp: str, outs: tuple[str, ...]) -> list[str]:
    """Copy every ``report.html`` among the stage's outputs in experiment ``exp`` out of the DVC cache (to
    ``.scratch/experiments/<exp>/<out>/report.html``) and link it."""
    import dvc.api

    links = []
    for out in outs:
        try:
            data = dvc.api.read(f"{out}/report.html", repo=str(root), rev=exp, mode="rb")
        except Exception:  # noqa: BLE001 - no report among this output
            continue
        dest = root / ".scratch/experiments" / exp / out / "report.html"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        _link_report(stage, dest, f"experiment {exp}: {out}/report.html")
        links.append(str(dest))
    return links


def _publish_reports(stage: str, root: Path, outs: tuple[str, ...]) -> list[str]:
    """A link artifact for every ``report.html`` in the stage's output directories (the evaluation report)."""
    links = []
    for out in outs:
        report = root / out / "report.html"
        if report.is_file():
            _link_report(stage, report, f"{out}/report.html")
            links.append(str(report))
    return links


_RAN = re.compile(r"Running stage '([^']+)'")


@task(cache_policy=NO_CACHE, persist_result=False)
def run_stage(stage: str, repo: str, metrics_paths: tuple[str, ...], outs: tuple[str, ...] = ()):
    """Run one DVC stage in the workspace; a stage that is up to date finishes as Completed named Skipped.

    Its metrics are published as a table artifact and any ``report.html`` among its outputs as a link."""
    logger = get_run_logger()
    root = Path(repo)
    if stage_is_current(stage, root):
        logger.info("stage '%s' is up to date; DVC skips it", stage)
        _publish(stage, _read_metrics(root, metrics_paths))
        _publish_reports(stage, root, outs)
        return Completed(name="Skipped", message=f"{stage}: up to date", data={"stage": stage, "status": "skipped"})
    args = ["repro", "--single-item", stage]
    logger.info("dvc %s", " ".join(args))
    code, output = run_dvc(args, root, on_line=logger.info)
    if code != 0:
        locked = lock_message(output, root, f"dvc {' '.join(args)}")
        if locked:
            raise DvcLocked(locked)
        raise DvcError(f"dvc {' '.join(args)} failed with exit code {code} (see the log above)")
    ran = stage in _RAN.findall(output)
    metrics = _read_metrics(root, metrics_paths)
    _publish_reports(stage, root, outs)
    _publish(stage, metrics)
    status = "ran" if ran else "restored"
    return Completed(
        name="Completed" if ran else "Cached",
        message=f"{stage}: {status}",
        data={"stage": stage, "status": status, "metrics": metrics},
    )


@task(cache_policy=NO_CACHE, persist_result=False)
def experiment_stage(stage: str, experiment: ExperimentRun):
    """Follow one stage of the flow's experiment: its part of DVC's output goes to this task's log; Completed when
    DVC ran it, Cached when DVC restored it from the run-cache or found it unchanged."""
    status = experiment.follow(stage, get_run_logger().info)
    return Completed(name="Completed" if status == "ran" else "Cached", message=f"{stage}: {status}",
                     data={"stage": stage, "status": status})


@task(cache_policy=NO_CACHE, persist_result=False)
def experiment_results(experiment: ExperimentRun, stages: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
                       ) -> str:
    """Wait for the experiment; publish each stage's metrics as the experiment's commit holds them, link any
    ``report.html`` among the outputs (copied from the DVC cache to ``.scratch/experiments/NAME/``) and log how
    to bring the experiment into the workspace. Returns its name."""
    logger = get_run_logger()
    name = experiment.finish()
    root = experiment.repo
    for stage, (metrics_paths, outs) in stages.items():
        _publish(stage, _exp_metrics(root, name, metrics_paths))
        _publish_exp_reports(stage, root, name, outs)
    logger.info("experiment %s: `dvc exp show` lists it; `dvc exp apply %s` brings its params, metrics and outputs "
                "into the workspace", name, name)
    return name


@flow(name="mars_pipeline", log_prints=True)
def mars_pipeline(
    stages: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    repo: str = ".",
    experiment: str | None = None,
) -> dict[str, str]:
    """Run ``stages`` (default: all) and what they need, in DAG order; return stage -> status.

    ``overrides`` maps params keys to values (``{"rl.steps": 2}``); with any set, the run is one DVC experiment
    (named ``experiment``, or by DVC) over ``stages``, what they need and what depends on them, and params.yaml
    stays unchanged; the returned dict then also holds ``"experiment": NAME``.
    """
    logger = get_run_logger()
    root = Path(repo).resolve()
    dag = read_dag(root)
    overrides = dict(overrides or {})
    if overrides:
        wanted = with_downstream(dag, stages)
        order = ordered(dag, wanted)
        logger.info("one experiment with overrides %s; stages, in order: %s", overrides, order)
        run = ExperimentRun(root, {k: _format_value(v) for k, v in overrides.items()},
                            targets=wanted if stages else (), name=experiment)
        statuses = {}
        for name in order:
            result = experiment_stage.with_options(name=name, task_run_name=name).submit(name, run).result()
            statuses[name] = result["status"]
        statuses["experiment"] = experiment_results.submit(
            run, {n: (dag[n].metrics, dag[n].outs) for n in order}).result()
        return statuses
    order = ordered(dag, stages)
    cfg = load_pipeline_params(root)
    logger.info("stages to run, in order: %s", order)
    statuses = {}
    previous = None
    for name in order:
        retries = cfg.retries if name in cfg.network_stages else 0
        stage_task = run_stage.with_options(
            name=name, task_run_name=name, retries=retries, retry_delay_seconds=cfg.retry_delay_s
        )
        future = stage_task.submit(name, str(root), dag[name].metrics, dag[name].outs,
                                   wait_for=[previous] if previous else None)
        result = future.result()
        statuses[name] = result["status"]
        previous = future
    return statuses


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--set expects key=value (e.g. world.n_entities=10), got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mars pipeline", description="Run the DVC stages as a Prefect flow.")
    parser.add_argument("--stages", nargs="*", default=None, help="stages to run (plus what they need); default all")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="param override (repeatable): the run is one `dvc exp run --temp -S` experiment over "
                             "the stages, what they need and what depends on them")
    parser.add_argument("--name", default=None, help="the experiment's name, with --set (default: DVC picks one)")
    parser.add_argument("--repo", default=".", help="repository root (default: .)")
    ns = parser.parse_args(argv)
    if ns.name and not ns.overrides:
        parser.error("--name names the experiment of a run with --set overrides; add --set KEY=VALUE")
    overrides = _parse_overrides(ns.overrides)
    # without PREFECT_API_URL the flow starts a temporary server, which first creates or migrates the database in
    # PREFECT_HOME: Prefect's 20 s wait timed out on a fresh .prefect on 2 busy cores (unless the user set one)
    wait = {} if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in os.environ else {
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS: 180}
    with temporary_settings(updates=wait):
        statuses = mars_pipeline(stages=ns.stages, overrides=overrides, repo=ns.repo, experiment=ns.name)
    for name, status in statuses.items():
        print(f"{name:12s} {status}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
