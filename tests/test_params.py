"""params.yaml loading: strict keys and types, profiles, clear errors before any work."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mars.params import ParamsError, build_dataclass, load_params
from tests.conftest import REPO, sh


@dataclass(frozen=True)
class P:
    n_items: int = 4
    rate: float = 0.5
    name: str = "x"
    flag: bool = False
    sizes: tuple[int, ...] = (1, 2)
    mode: str | None = None
    seed: int = 0


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "params.yaml"
    path.write_text(text)
    return path


BASE = "base: {seed: 7, profile: default}\nprofiles:\n  default: {s: {}}\n  smoke: {s: {n_items: 1}}\n"


def test_loads_section_with_defaults_and_base_seed(tmp_path):
    p = load_params("s", P, write(tmp_path, BASE + "s: {rate: 2, sizes: [3, 4, 5]}\n"))
    assert p == P(n_items=4, rate=2.0, sizes=(3, 4, 5), seed=7)
    assert isinstance(p.rate, float)


def test_profile_overrides_apply(tmp_path):
    text = BASE.replace("profile: default", "profile: smoke") + "s: {n_items: 9}\n"
    assert load_params("s", P, write(tmp_path, text)).n_items == 1


def test_unknown_key_names_key_section_type_and_nearest(tmp_path):
    with pytest.raises(ParamsError) as exc:
        load_params("s", P, write(tmp_path, BASE + "s: {n_itemz: 3}\n"))
    msg = str(exc.value)
    assert "unknown key 'n_itemz'" in msg and "[s," in msg
    assert "Nearest valid key: 'n_items' (expects int)" in msg


def test_base_typo_is_reported_with_nearest_key(tmp_path):
    text = BASE.replace("seed: 7", "seeed: 1") + "s: {}\n"
    with pytest.raises(ParamsError, match=r"\[base\]: unknown key 'seeed'\. Nearest valid key: 'seed' \(expects int\)"):
        load_params("s", P, write(tmp_path, text))


@pytest.mark.parametrize(
    "line, expected",
    [
        ("n_items: ten", "key 'n_items': expected int, found str ('ten')"),
        ("n_items: true", "key 'n_items': expected int, found bool"),
        ("flag: 1", "key 'flag': expected bool, found int"),
        ("rate: fast", "key 'rate': expected float, found str"),
        ("sizes: [1, two]", "key 'sizes'[1]: expected int, found str"),
        ("mode: 3", "key 'mode': expected str | null, found int"),
    ],
)
def test_mistyped_values(tmp_path, line, expected):
    with pytest.raises(ParamsError) as exc:
        load_params("s", P, write(tmp_path, BASE + "s:\n  " + line + "\n"))
    assert expected in str(exc.value)


def test_missing_profile_and_section_errors(tmp_path):
    with pytest.raises(ParamsError, match="profile' names 'smok'.*Nearest: 'smoke'"):
        load_params("s", P, write(tmp_path, BASE.replace("profile: default", "profile: smok") + "s: {}\n"))
    with pytest.raises(ParamsError, match="section 's' is missing"):
        load_params("s", P, write(tmp_path, BASE))
    text = "base: {seed: 1, profile: default}\nprofiles: {default: {}}\ns: {}\n"
    with pytest.raises(ParamsError, match=r"profiles.default\]: has no entry for section 's'"):
        load_params("s", P, write(tmp_path, text))


def test_post_init_validation_is_reported(tmp_path):
    @dataclass(frozen=True)
    class G:
        group: int = 2

        def __post_init__(self):
            if self.group < 2:
                raise ValueError(f"group must be >= 2, got {self.group}")

    with pytest.raises(ParamsError, match="where: group must be >= 2, got 1"):
        build_dataclass(G, {"group": 1}, "where")


def test_repository_params_are_valid():
    proc = sh([sys.executable, "-m", "mars.cli", "params", "check"], REPO)
    assert "ok (profile default" in proc.stdout


def _section_classes() -> dict:
    """Each params.yaml section and the dataclass that reads it."""
    import importlib

    from mars.agent.config import AgentParams
    from pipelines.dvc import read_dag
    from pipelines.flow import PipelineParams

    classes = {name: importlib.import_module(f"stages.{name}").Params for name in read_dag(REPO)}
    return {**classes, "agent": AgentParams, "pipeline": PipelineParams}


def test_params_yaml_is_the_one_place_a_default_lives():
    """Every dataclass field that reads params.yaml has the section's value as its default, and every key of a
    section is a field (the default profile selects no overrides: the stage sections are what make repro runs)."""
    import dataclasses

    import yaml

    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    assert doc["base"]["profile"] == "default"
    assert all(v in ({}, None) for v in doc["profiles"]["default"].values())
    differ = []
    for section, cls in _section_classes().items():
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert set(doc[section]) <= set(fields), (section, set(doc[section]) - set(fields))
        for name, f in fields.items():
            if name == "seed":  # base.seed, shared
                continue
            assert name in doc[section], f"{section}.{name} has no value in params.yaml"
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            value = doc[section][name]
            if (list(default) if isinstance(default, tuple) else default) != value:
                differ.append(f"{section}.{name}: {default!r} in {cls.__module__}, {value!r} in params.yaml")
    assert not differ, differ


def _named_keys(text: str, sections: list[str]):
    """(section, key) of every ``section.key`` named in ``text``, not part of a path or a dotted module name."""
    import re

    pattern = re.compile(r"(?<![\w./-])(" + "|".join(sections) + r")\.([a-z_][a-z0-9_]*)\b(?![(\w])")
    for m in pattern.finditer(text):
        if m.group(2) not in ("py", "json", "parquet", "html", "yaml", "md", "jsonl", "tsv", "txt", "faiss"):
            yield m.groups()


def test_every_param_named_in_docs_and_docstrings_exists():
    """A param named in the README, docs/ (but the experiment record, which names removed knobs with the commit that
    had them), params.yaml's comments, or a docstring or comment of the code is a key of params.yaml."""
    import importlib
    import io
    import re
    import tokenize

    import yaml

    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    sections = [s for s in doc if s != "profiles"]
    texts = [(p, p.read_text()) for p in [REPO / "README.md", REPO / "params.yaml", *(REPO / "docs").glob("*.md")]
             if p.name != "findings.md"]
    for folder in ("mars", "stages", "pipelines", "bench", "probes", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            toks = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            strings = (t.string for t in toks if t.type in (tokenize.COMMENT, tokenize.STRING))
            texts.append((path, re.sub(r"\{[^{}]*\}", "", "\n".join(strings))))  # not an f-string's code
    stale = []
    for path, text in texts:
        for section, key in _named_keys(text, sections):
            if key in doc[section] or key == "seed":
                continue
            module = f"stages.{section}"
            if section in doc and importlib.util.find_spec(module) and hasattr(importlib.import_module(module), key):
                continue  # a function of the stage module (sft.run)
            stale.append(f"{path.relative_to(REPO)}: {section}.{key}")
    assert not stale, stale


def test_typo_fails_before_any_work(toy_repo):
    text = (toy_repo / "params.yaml").read_text().replace("seed: 3", "seeed: 1")
    (toy_repo / "params.yaml").write_text(text)
    proc = sh([sys.executable, "-m", "dvc", "repro"], toy_repo, check=False)
    assert proc.returncode != 0
    assert "unknown key 'seeed'. Nearest valid key: 'seed' (expects int)" in proc.stdout + proc.stderr
    assert not (toy_repo / "out").exists()  # no stage wrote anything


REMOVED = [("sft", "pretrain_copy", 4000), ("sft", "drill_chains", 0.5), ("sft", "trajectory_names", "new"),
           ("sft", "drill_names", "world"), ("sft", "pretrain_captions", 1500), ("sft", "pretrain_target", 0.75),
           ("sft", "pretrain_check_from", 1000), ("sft", "split_digits", True), ("sft", "pretrain_lr", 0.005),
           ("sft", "pretrain_batch_size", 8), ("sft", "locate_batch_size", 8), ("sft", "pretrain_group_batches", 8),
           ("world", "corpus_style", "plain"), ("rl", "estimator", "grpo"), ("rl", "level", "token")]


@pytest.mark.parametrize("section,key,value", REMOVED, ids=[f"{s}.{k}" for s, k, _ in REMOVED])
def test_a_knob_measured_not_to_help_is_an_unknown_key(tmp_path, section, key, value):
    """The knobs removed with their code (docs/findings.md) fail like any typo, with the nearest valid key."""
    import yaml

    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    doc[section][key] = value
    path = write(tmp_path, yaml.safe_dump(doc))
    unknown = rf"\[{section}, profile default\]: unknown key '{key}'. Nearest valid key: '\w+'"
    with pytest.raises(ParamsError, match=unknown):
        load_params(section, _section_classes()[section], path)


@pytest.mark.parametrize("key,value,expected", [
    ("rl.steps", "30", 30),
    ("sft.lr", "0.001", 0.001),
    ("profiles.smoke.rl.steps", "2", 2),
    ("synthesize.llm_model", "qwen", "qwen"),
    ("evaluate.runs", "[sft/agentic,rl/agentic]", ["sft/agentic", "rl/agentic"]),
])
def test_dvc_exp_set_changes_only_the_lines_of_the_key_it_sets(tmp_path, key, value, expected):
    """params.yaml is written the way DVC writes it back (block style, its quoting), so the file `dvc exp run -S
    key=value` leaves differs from the repository's only on that key's lines (its list items for a list)."""
    import difflib
    import shutil

    import yaml
    from dvc.utils.hydra import apply_overrides  # what `dvc exp run -S` calls on params.yaml

    path = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", path)
    apply_overrides(str(path), [f"{key}={value}"])
    before, after = (REPO / "params.yaml").read_text().splitlines(), path.read_text().splitlines()
    changed = [ln[1:] for ln in difflib.unified_diff(before, after, lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    leaf = key.rsplit(".", 1)[-1]
    assert changed and all(ln.lstrip().startswith((f"{leaf}:", "- ")) for ln in changed), changed
    doc = yaml.safe_load(path.read_text())
    for part in key.split("."):
        doc = doc[part]
    assert doc == expected
