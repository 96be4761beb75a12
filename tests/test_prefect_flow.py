"""The mars_pipeline flow against a real Prefect server on 127.0.0.1 in a temporary PREFECT_HOME."""

from __future__ import annotations

import json
import sys

import httpx

from tests.conftest import dvc, sh


def run_flow(repo, home, api, *args):
    return sh(
        [sys.executable, "-m", "mars.cli", "pipeline", "--repo", str(repo), *args],
        repo,
        PREFECT_HOME=str(home),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
    )


def last_flow_run(api: str) -> dict:
    runs = httpx.post(f"{api}/flow_runs/filter", json={"sort": "EXPECTED_START_TIME_DESC", "limit": 1}).json()
    return runs[0]


def task_runs(api: str, flow_run_id: str) -> dict[str, dict]:
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 50}
    runs = httpx.post(f"{api}/task_runs/filter", json=body).json()
    return {r["name"]: r for r in runs}


def artifacts(api: str, flow_run_id: str) -> dict[str, list]:
    body = {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 50}
    rows = httpx.post(f"{api}/artifacts/filter", json=body).json()
    out = {}
    for a in rows:
        data = a["data"]
        if a["type"] == "table" and isinstance(data, str):
            data = json.loads(data)
        out[a["key"]] = data
    return out


def test_flow_runs_stages_reports_skips_and_overrides(toy_repo, prefect_api):
    home, api = prefect_api
    out = run_flow(toy_repo, home, api).stdout
    assert "a            ran" in out and "c            ran" in out
    run = last_flow_run(api)
    assert run["flow_id"] and run["state"]["type"] == "COMPLETED"
    tasks = task_runs(api, run["id"])
    assert set(tasks) == {"a", "b", "c"}
    assert all(t["state"]["type"] == "COMPLETED" for t in tasks.values())
    assert tasks["a"]["expected_start_time"] <= tasks["b"]["expected_start_time"]
    metrics = artifacts(api, run["id"])
    assert {"metric": "out/b.json.n", "value": 3} in metrics["b-metrics"]
    assert "out/c_report/report.html)" in metrics["c-report"]  # the report is published as a link (markdown)

    # second run: DVC finds everything up to date; the tasks complete as Skipped
    run_flow(toy_repo, home, api, "--stages", "b")
    run = last_flow_run(api)
    tasks = task_runs(api, run["id"])
    assert set(tasks) == {"a", "b"}
    assert {t["state"]["name"] for t in tasks.values()} == {"Skipped"}
    assert {t["state"]["type"] for t in tasks.values()} == {"COMPLETED"}

    # a run with overrides is one DVC experiment over b, what it needs (a: restored from the run-cache) and what
    # depends on it (none), in a temporary copy: the workspace's params.yaml and outputs stay byte-identical
    params_before = (toy_repo / "params.yaml").read_bytes()
    b_before = (toy_repo / "out/b.txt").read_bytes()
    out = run_flow(toy_repo, home, api, "--stages", "b", "--set", "b.n=5", "--name", "b-five").stdout
    assert "a            restored" in out and "b            ran" in out and "experiment   b-five" in out
    assert (toy_repo / "params.yaml").read_bytes() == params_before
    assert (toy_repo / "out/b.txt").read_bytes() == b_before
    run = last_flow_run(api)
    assert run["state"]["type"] == "COMPLETED"
    assert run["parameters"]["overrides"] == {"b.n": 5}
    tasks = task_runs(api, run["id"])
    assert {n: t["state"]["name"] for n, t in tasks.items() if n in "ab"} == {"a": "Cached", "b": "Completed"}
    metrics = artifacts(api, run["id"])
    assert {"metric": "out/b.json.n", "value": 5} in metrics["b-metrics"]
    assert {"metric": "out/a.json.n", "value": 2} in metrics["a-metrics"]
    status = sh(["git", "status", "--porcelain"], toy_repo).stdout
    assert "params.yaml" not in status
    # `dvc exp show` lists the experiment with its metrics (the toy keeps them in git, as dvc.yaml does)
    shown = json.loads(dvc(["exp", "show", "--json"], toy_repo).stdout)
    exps = {e["name"]: e["revs"][0]["data"] for row in shown for e in row.get("experiments") or ()}
    assert exps["b-five"]["metrics"]["out/b.json"]["data"]["n"] == 5
