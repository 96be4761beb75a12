"""DVC wiring: repro, no-op second repro, and a param change reruns only what it touches."""

from __future__ import annotations

import re

import yaml

from pipelines.dvc import ordered, read_dag
from tests.conftest import REPO, dvc, sh


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


def _module_file(module: str):
    """The repository file that defines ``module`` (a package's ``__init__.py``), or None (third party)."""
    path = REPO / module.replace(".", "/")
    for f in (path / "__init__.py", path.with_suffix(".py")):
        if f.is_file():
            return f
    return None


def _imported_files(start):
    """Every repository module ``start`` imports, directly or not (ast: imports inside functions included, and the
    packages above each module, whose ``__init__`` runs first)."""
    import ast

    seen, todo = set(), [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        package = path.relative_to(REPO).with_suffix("").parts
        if path.name == "__init__.py":
            package = package[:-1] + ("__init__",)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(list(package[:-node.level]) + [node.module or ""]).strip(".") if node.level else node.module
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] not in ("mars", "stages", "pipelines"):
                    continue
                for i in range(1, len(parts) + 1):
                    found = _module_file(".".join(parts[:i]))
                    if found is not None and found not in seen:
                        todo.append(found)
    return seen


def test_every_module_a_stage_imports_is_one_of_its_deps():
    """DVC reruns a stage when a dep changes: every repository module its ``stages/<name>.py`` imports, however
    deeply, is listed in dvc.yaml's deps (the file or a folder above it)."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    missing = []
    for name, stage in stages.items():
        deps = [d.rstrip("/") for d in stage["deps"] if not d.startswith("data/")]
        for f in sorted(_imported_files(REPO / "stages" / f"{name}.py")):
            rel = str(f.relative_to(REPO))
            if not any(rel == d or rel.startswith(d + "/") for d in deps):
                missing.append(f"stage {name}: {rel}")
    assert not missing, "dvc.yaml deps miss imported modules (add them to the stage's deps):\n" + "\n".join(missing)


def test_metrics_and_plots_live_where_git_tracks_them():
    """Every metrics and plots path of dvc.yaml is a git-tracked path (not ignored, cache: false), so each
    experiment's commit carries it and `dvc exp show` / `dvc plots diff` read it; checkpoints, curves in progress and
    evaluation progress are scratch space, no stage's declared output (no persist: DVC's run-cache restores stages)."""
    doc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    paths = [next(iter(m)) if isinstance(m, dict) else m for m in doc.get("metrics") or ()]
    paths += [next(iter(p)) if isinstance(p, dict) else p for p in doc.get("plots") or ()]
    for name, stage in doc["stages"].items():
        for kind in ("metrics", "plots"):
            paths += [next(iter(m)) if isinstance(m, dict) else m for m in stage.get(kind) or ()]
        for out in stage.get("outs") or ():
            path, spec = (next(iter(out.items())) if isinstance(out, dict) else (out, {}))
            assert not spec.get("persist"), f"stage {name}: {path} is persist: DVC's run-cache would skip the stage"
            if spec.get("cache") is False:
                paths.append(path)
        for m in stage.get("metrics") or ():
            assert isinstance(m, dict) and next(iter(m.values())).get("cache") is False, (name, m)
    assert len(paths) >= 12
    ignored = sh(["git", "check-ignore", "--no-index", *paths], REPO, check=False).stdout.split()
    assert ignored == [], f"dvc.yaml declares git-ignored metrics or plots: {ignored}"
    scratch = [a for c in (s["cmd"] for s in doc["stages"].values()) for a in c.split() if a.startswith(".scratch/")]
    assert len(scratch) == 7  # synthesize and mine (mining counts), sft and rl (checkpoints, live), evaluate
    assert sh(["git", "check-ignore", "--no-index", *scratch], REPO).stdout.split() == scratch
