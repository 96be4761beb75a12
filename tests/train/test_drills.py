"""Reading drills: real tool observations in the prompt, the teacher's copy in the reply, held-out entities unused."""

from __future__ import annotations

import json

import pytest

from mars.agent.protocol import format_answer, format_tool_call, parse_turn
from mars.agent.teacher import titles_from_observation
from mars.train.drills import CopyCheck, copied, drill_kind, reading_drills
from tests.agent.test_oracle import smoke  # noqa: F401  (module fixture: smoke world, questions, tools)


def _args(smoke, **kw):  # noqa: F811
    tables = smoke["tables"]
    return dict(toolbox=smoke["toolbox"], entities=tables.entities.to_pylist(), gallery=tables.gallery.to_pylist(),
                gallery_dir=smoke["world"] / "gallery", **kw)


def test_drills_copy_from_real_observations(smoke):  # noqa: F811
    entities = {e["entity_id"]: e for e in smoke["tables"].entities.to_pylist()}
    real = sorted(e for e, r in entities.items() if not r["is_distractor"])
    held_out = set(real[:3])
    drills = reading_drills(**_args(smoke, n=40, seed=0, exclude_entities=held_out, fresh_names=False))
    assert len(drills) == 40
    kinds = [drill_kind(d) for d in drills]
    assert 5 <= kinds.count("title") <= 30 and kinds.count("fact") >= 5
    held_names = {entities[e]["name"] for e in held_out}
    for user, assistant in drills:
        text = user["content"][0]["text"]
        assert text.startswith("<tool_response>\n") and "\n</tool_response>\n" in text
        observation, question = text.split("\n</tool_response>\n")
        turn = parse_turn(assistant["content"])
        assert turn.well_formed, assistant["content"]
        if turn.action == "tool_call":  # title drill: the query starts with the top-1 title's name
            top = titles_from_observation(observation)[0]
            assert turn.tool_name == "text_search" and turn.arguments["query"].startswith(top + " ")
            assert "this emblem" in question
        else:  # fact drill: the question names an entity that is not held out, and the answer is in the snippet
            name = max((r["name"] for r in entities.values() if r["name"] in question.splitlines()[0]), key=len)
            assert name not in held_names
            ent = next(r for r in entities.values() if r["name"] == name)
            truth = {str(ent[k]) for k in ("founded_year", "city", "founder")}
            value = turn.answer
            if "\nA. " in question:
                value = dict(line.split(". ", 1) for line in question.splitlines()[1:5])[turn.answer]
            assert value in truth and value in observation


def test_drills_are_seeded_and_fail_clearly(smoke):  # noqa: F811
    a = reading_drills(**_args(smoke, n=8, seed=1))
    b = reading_drills(**_args(smoke, n=8, seed=1))
    c = reading_drills(**_args(smoke, n=8, seed=2))
    dump = lambda ds: json.dumps(ds, sort_keys=True)  # noqa: E731
    assert dump(a) == dump(b) and dump(a) != dump(c)
    assert reading_drills(**_args(smoke, n=0)) == []
    every = {e["entity_id"] for e in smoke["tables"].entities.to_pylist()}
    with pytest.raises(ValueError, match="no entity left"):
        reading_drills(**_args(smoke, n=3, exclude_entities=every))
    with pytest.raises(ValueError, match=">= 0"):
        reading_drills(**_args(smoke, n=-1))


def test_fresh_names_keep_the_copy_exact_and_never_repeat(smoke):  # noqa: F811
    entities = smoke["tables"].entities.to_pylist()
    words = {w for e in entities for w in (e["name"].split()[:-1] + e["founder"].split())}
    plain = reading_drills(**_args(smoke, n=30, seed=5, fresh_names=False))
    fresh = reading_drills(**_args(smoke, n=30, seed=5))
    assert [drill_kind(d) for d in plain] == [drill_kind(d) for d in fresh]  # the same drills, renamed
    seen_names = []
    for (p_user, p_reply), (user, assistant) in zip(plain, fresh):
        text = user["content"][0]["text"]
        observation, question = text.split("\n</tool_response>\n")
        tokens = set(text.replace("\n", " ").split()) | set(assistant["content"].split())
        assert not tokens & words, tokens & words  # no organisation word or founder name of the world is left
        turn = parse_turn(assistant["content"])
        assert turn.well_formed, assistant["content"]
        if turn.action == "tool_call":
            top = titles_from_observation(observation)[0]
            assert turn.arguments["query"].startswith(top + " ")
            assert top not in {e["name"] for e in entities}
            seen_names.append(top)
        else:
            value = turn.answer
            if "\nA. " in question:
                value = dict(line.split(". ", 1) for line in question.splitlines()[1:5])[turn.answer]
            assert value in observation
        # the renaming is a word-for-word substitution: same layout, same years and cities
        assert len(text.split()) == len(p_user["content"][0]["text"].split())
    assert len(set(seen_names)) == len(seen_names)  # a fresh name per drill


def test_copied_compares_the_action_not_the_thinking():
    title = format_tool_call("text_search", {"query": "Zorvan Museum founder"}, "Top match: Zorvan Museum. Search.")
    assert copied(format_tool_call("text_search", {"query": "Zorvan Museum founder"}, "other words"), title)
    assert not copied(format_tool_call("text_search", {"query": "Zorvan Musem founder"}, "Top match"), title)
    assert not copied(format_tool_call("image_search", {"img_idx": 0}, "Top match"), title)
    assert not copied(format_answer("Zorvan Museum founder", "Top match"), title)
    fact = format_answer("Ilma Tarso", "The snippet about Zorvan Museum gives Ilma Tarso.")
    assert copied(format_answer(" ilma tarso", "I read it."), fact)  # case and surrounding space ignored
    assert not copied(format_answer("Ilma Tars", "I read it."), fact)
    assert not copied("<answer>Ilma Tarso</answer>", fact)  # no thinking: malformed, a miss
    assert not copied("", fact)


def test_copy_check_scores_held_out_drills_once_a_step(smoke):  # noqa: F811
    from tests.model.test_model import tiny_stack

    _, proc, model = tiny_stack()
    drills = reading_drills(**_args(smoke, n=5, seed=9))
    check = CopyCheck(proc, drills, max_new_tokens=24)
    assert check.prompts == [d[:1] for d in drills]  # the user turn, without the reply
    # a random-init model writes no well-formed copy of any of the 5 replies: share 0
    assert check.measure(model, 4) == 0.0 and check.history == [(4, 0.0)]
    assert check.scores(model, 4) == {"copied": 0.0} and len(check.history) == 1  # once a step: not asked again
    assert check.measure(model, 3) == 0.0 and check.history[-1] == (3, 0.0)
    assert check.histories() == {"copied": [(4, 0.0), (3, 0.0)]}
    # the reference replies themselves are copies: the scorer counts a right reply as copied
    assert all(copied(r, r) for r in check.references)
    with pytest.raises(ValueError, match="a copy check needs held-out drills"):
        CopyCheck(proc, [])
