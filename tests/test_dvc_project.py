"""The project's own dvc.yaml on the smoke profile: `dvc repro` runs every stage, a second is a no-op, and
experiments with changed rl params (`dvc exp run` with the mine stage on, and the Prefect flow's override run)
restore world..sft from DVC's run-cache, run only what the change touched, and keep their metrics (the mine stage's
pass-count histogram beside the RL result) where `dvc exp show` reads them."""

from __future__ import annotations

import json
import re
import sys

import pyarrow.parquet as pq
import yaml

from mars.stage import write_metrics
from pipelines.rl_study import aggregate
from tests.conftest import dvc, sh
from tests.test_prefect_flow import artifacts, last_flow_run, run_flow, task_runs

STAGES = {"world", "curate", "index", "synthesize", "sft", "mine", "rl", "evaluate"}


def ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def restored(output: str) -> set[str]:
    """Stages DVC did not run: restored from its run-cache, or unchanged with their outputs checked out."""
    return set(re.findall(r"Stage '([^']+)' (?:is cached|didn't change)", output))


def experiments(repo) -> dict[str, dict]:
    """`dvc exp show --json`: experiment name -> its metrics, by file (a metrics file the experiment lacks, such as
    the RL study's summary, shows as an error entry without data and is passed over)."""
    shown = json.loads(dvc(["exp", "show", "--json"], repo).stdout)
    return {e["name"]: {f: m["data"] for f, m in e["revs"][0]["data"]["metrics"].items() if "data" in m}
            for row in shown for e in row.get("experiments") or ()}


def test_dvc_repro_smoke_then_noop_then_rl_experiments(clean_copy, prefect_api):
    repo = clean_copy
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["base"]["profile"] = "smoke"
    # this test is about the DVC wiring, not what SFT learns (the smoke sft fixture of
    # tests/stages/test_synthesize_sft_evaluate.py checks that): shorter sft and rl runs than the smoke profile's
    params["profiles"]["smoke"]["sft"] |= {"pretrain_steps": 10, "pretrain_drills": 40, "max_steps": 20,
                                           "checkpoint_every": 10}
    params["profiles"]["smoke"]["rl"] |= {"steps": 2, "checkpoint_every": 1}
    # the untrained model's row (it talks until its token budget) is left out: every run below evaluates
    params["profiles"]["smoke"]["evaluate"] |= {"runs": ["no-tool/direct", "sft/agentic", "rl/agentic",
                                                         "oracle/agentic"]}
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = dvc(["repro"], repo).stdout  # the whole pipeline, world to evaluate, on the smoke profile
    assert set(yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]) == STAGES
    assert ran(out) == STAGES
    assert ran(dvc(["repro"], repo).stdout) == set()
    shown = json.loads(dvc(["metrics", "show", "--json"], repo).stdout)
    metrics = next(iter(shown.values()))["data"]  # the workspace entry
    assert metrics["metrics/index.json"]["data"]["text_recall_at_5"] >= 0.95
    assert metrics["metrics/curate.json"]["data"]["planted_recall"] == 1.0
    evaluated = metrics["metrics/evaluate.json"]["data"]["test"]
    assert evaluated["oracle/agentic"]["accuracy"] >= 0.95
    assert evaluated["oracle/agentic"]["first_zoom_framed"] == 1.0  # localisation: the oracle's zoom is the frame
    # the rl stage ran its two steps from scratch, kept rl.samples_per_step rollouts a step, and its model was
    # evaluated on every test question, as the sft model was
    rl_m = metrics["metrics/rl.json"]["data"]
    assert (rl_m["steps"], rl_m["resumed_from"], rl_m["algorithm"]) == (2, 0, params["rl"]["algorithm"])
    assert [h["step"] for h in json.loads((repo / "data/rl/monitors.json").read_text())] == [0, 1]
    kept = pq.read_table(repo / "data/rl/rollouts.parquet").column("episode_id").to_pylist()
    assert sorted(e.rsplit("@", 1)[1] for e in kept) == sorted(["0", "1"] * params["rl"]["samples_per_step"])
    assert evaluated["rl/agentic"]["n"] == evaluated["sft/agentic"]["n"] == evaluated["oracle/agentic"]["n"] > 0
    assert 'data-model="rl"' in (repo / "data/evaluate/report.html").read_text(encoding="utf-8")
    # the curves `dvc plots` reads, published from the stages' scratch space: one row per step
    reward = (repo / "plots/rl/rl/reward.tsv").read_text().splitlines()
    assert reward[0].split("\t")[0] == "step" and [r.split("\t")[0] for r in reward[1:]] == ["0", "1"]
    assert (repo / "plots/sft/train/loss.tsv").is_file() and (repo / "plots/evaluate/accuracy.csv").is_file()
    # metrics, plots and dvc.lock are what Git tracks: the results are a commit
    sh(["git", "add", "-A"], repo)
    committed = set(sh(["git", "diff", "--cached", "--name-only"], repo).stdout.split())
    assert {"dvc.lock", "metrics/rl.json", "metrics/evaluate.json", "plots/rl/rl/reward.tsv"} <= committed
    assert not any(p.startswith(("data/", ".scratch/")) for p in committed)
    sh(["git", "commit", "-q", "-m", "smoke results"], repo)

    # dvc.yaml's top-level metrics: the RL study's summary (written outside dvc repro) is listed once it exists
    runs = {"bn_gspo-s0": {"algorithm": "bn_gspo", "accuracy": 0.3, "by_type": {}, "reward_first": 0.1,
                           "reward_last": 0.2}}
    write_metrics(repo / "metrics/rl_study.json", {"runs": runs} | aggregate(runs, 0.25))
    shown = json.loads(dvc(["metrics", "show", "--json"], repo).stdout)
    study = next(iter(shown.values()))["data"]["metrics/rl_study.json"]["data"]
    assert study["bn_gspo"]["mean"] == 0.3 and study["bn_gspo"]["delta_vs_sft"] == 0.05
    (repo / "metrics/rl_study.json").unlink()
    check = sh([sys.executable, "-m", "mars.cli", "params", "check"], repo)
    assert "profile smoke" in check.stdout

    # an rl experiment with the mine stage on, in a temporary copy: world..sft are not run (DVC checks out their
    # outputs); mine plays the rl questions k = 2 times with the sft model and keeps those solved at most once, then
    # rl trains on them and evaluate runs
    band = ["-S", "mine.enabled=true", "-S", "mine.k=2", "-S", "mine.min_pass=0", "-S", "mine.max_pass=1"]
    out = dvc(["exp", "run", "--temp", "-n", "rl-steps-1", "-S", "profiles.smoke.rl.steps=1", *band], repo).stdout
    assert ran(out) == {"mine", "rl", "evaluate"} and restored(out) == STAGES - {"mine", "rl", "evaluate"}, out
    # the Prefect flow's override run of rl: the second experiment, rl and what depends on it
    home, api = prefect_api
    out = run_flow(repo, home, api, "--stages", "rl", "--set", "profiles.smoke.rl.steps=3", "--name", "rl-flow")
    assert re.search(r"^sft +(restored|unchanged)$", out.stdout, re.M) and "rl           ran" in out.stdout
    assert "evaluate     ran" in out.stdout and "experiment   rl-flow" in out.stdout
    run = last_flow_run(api)
    assert {n: t["state"]["name"] for n, t in task_runs(api, run["id"]).items() if n in STAGES} == {
        **{s: "Cached" for s in STAGES - {"rl", "evaluate"}}, "rl": "Completed", "evaluate": "Completed"}
    published = artifacts(api, run["id"])
    assert {"metric": "metrics/rl.json.steps", "value": 3} in published["rl-metrics"]
    assert any(r["metric"] == "metrics/evaluate.json.test.rl/agentic.accuracy" for r in published["evaluate-metrics"])
    assert (repo / ".scratch/experiments/rl-flow/data/evaluate/report.html").is_file()
    # `dvc exp show` holds both experiments' rl and evaluate metrics side by side
    exps = experiments(repo)
    assert {n: e["metrics/rl.json"]["steps"] for n, e in exps.items()} == {"rl-steps-1": 1, "rl-flow": 3}
    # the mine stage's pass-count histogram beside the RL result: on in the first, off (every question kept) in the
    # second
    mined, passed = exps["rl-steps-1"]["metrics/mine.json"], exps["rl-flow"]["metrics/mine.json"]
    rl_questions = mined["questions"]
    hist = mined["histogram"]
    assert mined["enabled"] and list(hist) == ["0", "1", "2"] and sum(hist.values()) == rl_questions
    assert mined["kept"] == hist["0"] + hist["1"] == rl_questions - mined["dropped"]
    assert passed == {"enabled": False, "questions": rl_questions, "kept": rl_questions}
    header = dvc(["exp", "show", "--csv"], repo).stdout.splitlines()[0].split(",")
    assert {"histogram.0", "histogram.1", "histogram.2", "reward_last"} <= set(header), header
    for e in exps.values():
        assert {"sft/agentic", "rl/agentic"} <= set(e["metrics/evaluate.json"]["test"])
        assert e["metrics/evaluate.json"]["test"]["sft/agentic"] == evaluated["sft/agentic"]  # sft restored, not rerun
    # `dvc plots diff` draws both experiments' reward curves: one step, then three
    plotted = json.loads(dvc(["plots", "diff", "rl-steps-1", "rl-flow", "--json"], repo).stdout)["data"]
    reward = plotted["plots/rl/rl/reward.tsv"][0]["content"]["data"]["values"]
    assert sorted({(v["rev"], int(v["step"])) for v in reward}) == [("rl-flow", 0), ("rl-flow", 1), ("rl-flow", 2),
                                                                   ("rl-steps-1", 0)]
    # the workspace is where it was: params.yaml and the results unchanged, nothing to commit
    assert sh(["git", "status", "--porcelain"], repo).stdout.strip() == ""
