"""The scripted SFT teacher: reads names and facts from real observations; the skill knob adds mistakes + recovery."""

from __future__ import annotations

from mars.agent.engine import EngineConfig, run_episodes
from mars.agent.oracle import accuracy_by_type, scripted_backend, zone_zoom_box
from mars.agent.teacher import ZOOM_LABEL, fact_from_observation, teacher_policy, titles_from_observation
from tests.agent.test_oracle import smoke  # noqa: F401  (module fixture: smoke world, questions, tools)

CFG = EngineConfig(max_turns=8)


def play(smoke, skill):  # noqa: F811
    qs, world = smoke["questions"], smoke["world_truth"]
    backend = scripted_backend(qs, lambda q: teacher_policy(q, world, skill=skill, seed=0), smoke["world"])
    return qs, run_episodes(qs, backend, smoke["toolbox"], CFG, seed=0, image_root=smoke["world"])


def test_skill_one_follows_the_shortest_plan_and_reads_observations(smoke):  # noqa: F811
    qs, trajs = play(smoke, 1.0)
    want = {"perception": 2, "search": 3, "multi-hop": 4}
    assert all(t.n_turns == want[q["type"]] for t, q in zip(trajs, qs))
    acc = accuracy_by_type(trajs, qs)
    assert acc["perception"] == 1.0  # the teacher's eyes are the world truth
    # it zooms on the centre zone of the framed cell (one of 4 fixed boxes), which holds the whole target
    for t, q in zip(trajs, qs):
        if q["type"] == "search":
            continue
        truth = smoke["world_truth"].targets[q["scene_id"]]
        box = t.tool_calls[0]["arguments"]["bbox_2d"]
        assert box == zone_zoom_box(truth)
        W, H = truth["scene_width"], truth["scene_height"]
        assert box[0] * W / 1000 <= truth["x0"] and truth["x1"] <= box[2] * W / 1000
        assert box[1] * H / 1000 <= truth["y0"] and truth["y1"] <= box[3] * H / 1000
        # the zoom's think and label say what comes after it: answer (perception) or search (multi-hop)
        think = t.messages[2]["content"].split("</think>")[0]
        assert t.tool_calls[0]["arguments"]["label"] == ZOOM_LABEL[q["type"]]
        assert ("search" in think) == (q["type"] == "multi-hop"), think
    # search answers are read from observations: wrong exactly when image search's top-1 title was wrong
    for t, q in zip(trajs, qs):
        if q["type"] == "search" and t.correct:
            name = smoke["world_truth"].entities[q["entity_id"]]["name"]
            search_obs = t.messages[3]["content"][0]["text"]
            assert titles_from_observation(search_obs)[0] == name
    assert 0.3 <= acc["search"] <= 1.0 and all(t.n_format_errors == 0 for t in trajs)


def test_skill_zero_makes_a_mistake_then_recovers(smoke):  # noqa: F811
    qs, trajs = play(smoke, 0.0)
    want = {"perception": 3, "search": 4, "multi-hop": 6}
    assert all(t.n_turns == want[q["type"]] for t, q in zip(trajs, qs))
    for t, q in zip(trajs, qs):
        names = [c["name"] for c in t.tool_calls]
        if q["type"] != "search":
            assert names[:2] == ["image_zoom_in", "image_zoom_in"]  # a wrong cell first, then the framed one
            truth = smoke["world_truth"].targets[q["scene_id"]]
            others = [zone_zoom_box(truth, (r, c)) for r in range(2) for c in range(2)
                      if (r, c) != (truth["cell_row"], truth["cell_col"])]
            assert t.tool_calls[0]["arguments"]["bbox_2d"] in others
            assert t.tool_calls[1]["arguments"]["bbox_2d"] == zone_zoom_box(truth)
        if q["type"] != "perception":
            assert names.count("text_search") == 2  # near-miss query, then the right one
    assert accuracy_by_type(trajs, qs)["perception"] == 1.0  # it recovers
    thinks = {t.messages[2]["content"].split("</think>")[0] for t in trajs}
    assert len(thinks) >= 2  # varied <think> text


def test_fact_reading():
    obs = "[1] Acme Guild: Acme Guild was founded in 1901 in Paris by Ann Wu.\n[2] Acme Guilds: founded 1950 in Lyon."
    assert fact_from_observation(obs, "Acme Guild", "founded_year", {}) == "1901"
    assert fact_from_observation(obs, "Acme Guild", "city", {"city": ["Lyon", "Paris"]}) == "Paris"
    assert fact_from_observation(obs, "Other", "city", {"city": ["Lyon"]}) is None
    assert titles_from_observation("Image search results for image 0:\n[1] Acme Guild logo\n[2] Bo crest\nThumbs") == [
        "Acme Guild", "Bo"]
