"""The library's layers: ``mars/`` imports no stage and no flow (the command line aside), and the reward and
advantage math in ``mars/rl/`` imports nothing of the rollout loop in ``mars/agent/``."""

from __future__ import annotations

import ast

from tests.conftest import REPO


def _imports(path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, those inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


def _offending(folder: str, prefixes: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    hits = []
    for path in sorted((REPO / folder).rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel in allowed:
            continue
        hits += [f"{rel}:{line}: {mod}" for line, mod in _imports(path)
                 if any(mod == prefix or mod.startswith(prefix + ".") for prefix in prefixes)]
    return hits


def test_the_library_imports_no_stage_and_no_flow():
    # mars/cli.py is the command line: it starts the stages and the Prefect flow
    assert _offending("mars", ("stages", "pipelines"), allowed=("mars/cli.py",)) == []


def test_the_rl_math_imports_nothing_of_the_rollout_loop():
    assert _offending("mars/rl", ("mars.agent",)) == []


def test_every_installed_third_party_import_is_declared():
    """Each package the code imports (mars, stages, pipelines, bench, tests) is declared in pyproject.toml, in the
    dependencies or an extra; the optional ones that are not installed here (guarded imports) are left out."""
    import importlib.metadata
    import re
    import sys
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    declared_names = {norm(re.match(r"[A-Za-z0-9_.\-]+", d).group(0)) for d in declared}
    owners = importlib.metadata.packages_distributions()
    ours = {"mars", "stages", "pipelines", "tests", "bench", "probes"}
    missing = set()
    for folder in sorted(ours):
        for path in (REPO / folder).rglob("*.py"):
            for _, mod in _imports(path):
                top = mod.split(".")[0]
                if top in ours or top in sys.stdlib_module_names or top not in owners:
                    continue
                if not any(norm(d) in declared_names for d in owners[top]):
                    missing.add(f"{top} ({', '.join(owners[top])}), imported in {path.relative_to(REPO)}")
    assert not missing, sorted(missing)
