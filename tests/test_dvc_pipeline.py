"""DVC wiring: repro, no-op second repro, and a param change reruns only what it touches."""

from __future__ import annotations

import re

import yaml

from pipelines.dvc import ordered, read_dag
from tests.conftest import REPO, dvc


def ran(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def test_repro_then_noop_then_param_change_reruns_descendants_only(toy_repo):
    first = dvc(["repro"], toy_repo).stdout
    assert ran(first) == {"a", "b", "c"}
    assert (toy_repo / "out/b.txt").read_text() == "alphaalpha|3\nbetabetabeta|3\n"
    assert ran(dvc(["repro"], toy_repo).stdout) == set()

    params = yaml.safe_load((toy_repo / "params.yaml").read_text())
    params["a"]["n"] = 1
    (toy_repo / "params.yaml").write_text(yaml.safe_dump(params))
    assert ran(dvc(["repro"], toy_repo).stdout) == {"a", "b"}  # c untouched
    assert (toy_repo / "out/b.txt").read_text() == "alpha|3\nbetabetabeta|3\n"

    params["c"]["word"] = "delta"
    (toy_repo / "params.yaml").write_text(yaml.safe_dump(params))
    assert ran(dvc(["repro"], toy_repo).stdout) == {"c"}


def test_profile_switch_is_tracked_by_dvc(toy_repo):
    dvc(["repro"], toy_repo)
    params = yaml.safe_load((toy_repo / "params.yaml").read_text())
    params["base"]["profile"] = "smoke"
    (toy_repo / "params.yaml").write_text(yaml.safe_dump(params))
    # base changed, so every stage reruns, and the smoke override of a.n applies
    assert ran(dvc(["repro"], toy_repo).stdout) == {"a", "b", "c"}
    assert (toy_repo / "out/a.txt").read_text() == "alpha|3\n"
    lock = yaml.safe_load((toy_repo / "dvc.lock").read_text())
    assert lock["stages"]["a"]["params"]["params.yaml"]["profiles.smoke.a"] == {"n": 1}


def test_dag_order_and_subsets(toy_repo):
    dag = read_dag(toy_repo)
    assert dag["b"].upstream == {"a"} and dag["a"].upstream == frozenset()
    assert ordered(dag) == ["a", "b", "c"]
    assert ordered(dag, ["b"]) == ["a", "b"]
    assert ordered(dag, ["c"]) == ["c"]


def test_repository_dvc_yaml_follows_the_conventions():
    """Every stage is python -m stages.<name>, depends on its params and the shared code."""
    doc = yaml.safe_load((REPO / "dvc.yaml").read_text()) or {}
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for name, stage in (doc.get("stages") or {}).items():
        assert stage["cmd"].startswith(f"python -m stages.{name} "), name
        assert stage["params"][:3] == ["base", name, f"profiles.${{base.profile}}.{name}"], name
        assert f"stages/{name}.py" in stage["deps"], name
        assert any(d.startswith("mars/") for d in stage["deps"]), name
        assert name in params, name
        for profile, sections in params["profiles"].items():
            assert name in sections, f"profiles.{profile} lacks {name}"
