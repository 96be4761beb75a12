"""The ground-truth oracle and the no-tool baseline (mars.agent.oracle) through the real engine, tools and indexes.

Run: ``.venv/bin/python -m pytest tests/agent -q``.
"""

from __future__ import annotations

import pytest

from mars.agent.backends import ScriptedBackend
from mars.agent.engine import EngineConfig, run_episodes
from mars.agent.oracle import (
    World,
    accuracy_by_type,
    image_search_hits,
    main,
    no_tool_policy,
    oracle_policy,
    read_fact,
    scripted_backend,
)
from mars.tools.toolbox import ToolBox, ToolConfig
from mars.world.questions import make_questions
from tests.agent.test_engine import build_smoke_world


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle-world")
    built = build_smoke_world(root)
    built["questions"] = make_questions(built["tables"], built["world"] / "raw", built["world"] / "questions",
                                        seed=0, n_per_type=20).to_pylist()
    built["toolbox"] = ToolBox.from_dirs(built["index"], built["world"] / "gallery", ToolConfig())
    built["world_truth"] = World.from_tables(built["tables"])
    return built


def test_oracle_solves_every_type_and_no_tool_is_near_chance(smoke):
    qs, world = smoke["questions"], smoke["world_truth"]
    assert {q["type"] for q in qs} == {"perception", "search", "multi-hop"}
    backend = scripted_backend(qs, lambda q: oracle_policy(q, world), smoke["world"])
    trajs = run_episodes(qs, backend, smoke["toolbox"], EngineConfig(), seed=0, image_root=smoke["world"])
    acc = accuracy_by_type(trajs, qs)
    assert all(acc[t] >= 0.95 for t in ("perception", "search", "multi-hop")), acc
    assert all(t.n_format_errors == 0 and t.n_tool_errors == 0 and t.reward_format == 0.5 for t in trajs)
    want_turns = {"perception": 2, "search": 3, "multi-hop": 4}
    assert all(t.n_turns == want_turns[q["type"]] for t, q in zip(trajs, qs))
    # every step is one batched call: at most 4 steps (multi-hop), shrinking as perception/search finish
    assert len(backend.batch_sizes) == 4 and backend.batch_sizes[0] == len(qs)
    hits = image_search_hits(trajs, qs, world)
    assert hits["calls"] > 0 and hits["topk"] >= 0.5, hits  # image search is genuinely informative

    base = run_episodes(qs, ScriptedBackend(no_tool_policy), smoke["toolbox"], EngineConfig(), image_root=smoke["world"])
    nacc = accuracy_by_type(base, qs)
    assert all(nacc[t] <= 0.35 for t in nacc), nacc
    assert all(t.n_turns == 1 and t.n_tool_calls == 0 for t in base)


def test_read_fact_prefers_the_observation():
    obs = ("[1] Varn Guild - history: Founded by Ada Lee in 1871, Varn Guild is a guild based in Tolm.\n"
           "[2] Varne Guild: Varne Guild was founded in 1902 in Kesh by Bo Ray.")
    assert read_fact(obs, "Varn Guild", "founded_year", "1999") == ("1871", True)
    assert read_fact(obs, "Varne Guild", "city", "Kesh") == ("Kesh", True)
    assert read_fact(obs, "Other Guild", "founder", "Al Bo") == ("Al Bo", False)


def test_cli_prints_accuracy_table(smoke, tmp_path, capsys):
    assert main(["--world-dir", str(smoke["world"]), "--index-dir", str(smoke["index"]), "--n-per-type", "4",
                 "--questions-dir", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    for word in ("perception", "search", "multi-hop", "oracle", "no-tool"):
        assert word in out


def test_perception_questions_ask_the_chosen_attributes(smoke, tmp_path):
    import json

    from mars.world.emblems import COLOUR_NAMES
    from mars.world.questions import attribute_value, question_rows

    emblems = {e["entity_id"]: json.loads(e["emblem"]) for e in smoke["tables"].entities.to_pylist() if e["emblem"]}
    perc = [q for q in smoke["questions"] if q["type"] == "perception"]
    colour = [q for q in perc if q["question"].startswith("What colour is the emblem inside the red frame filled")]
    assert colour and len(colour) < len(perc)  # the default asks all four attributes
    for q in colour:  # the answer is the name of the framed emblem's fill
        assert q["answer"] == COLOUR_NAMES[emblems[q["entity_id"]]["fill"]]
    assert attribute_value({"fill": "#f28c28", "shape": "star", "glyph": None}, "colour") == "orange"
    assert attribute_value({"fill": "#f28c28", "shape": "star", "glyph": None}, "glyph") is None
    with pytest.raises(ValueError, match="unknown perception attribute 'size'"):
        attribute_value({}, "size")

    only = question_rows(smoke["tables"], smoke["world"] / "raw", tmp_path, seed=0, n_per_type=20,
                         attributes=["colour"])
    asked = [q for q in only if q["type"] == "perception"]
    assert asked and all(q["question"].startswith("What colour") for q in asked)
    assert all(q["answer"] in COLOUR_NAMES.values() for q in asked)
    with pytest.raises(ValueError,
                       match=r"non-empty subset of \['colour', 'shape', 'glyph', 'pattern'\].*unknown: \['hue'\]"):
        question_rows(smoke["tables"], smoke["world"] / "raw", tmp_path, attributes=["colour", "hue"])
    with pytest.raises(ValueError, match="non-empty subset"):
        question_rows(smoke["tables"], smoke["world"] / "raw", tmp_path, attributes=[])
