"""Reading drills: real tool observations in the prompt, the teacher's copy in the reply, held-out entities unused."""

from __future__ import annotations

import json

import pytest

from mars.agent.engine import EngineConfig, run_episodes
from mars.agent.oracle import oracle_policy, scripted_backend
from mars.agent.protocol import format_answer, format_tool_call, parse_turn
from mars.agent.teacher import titles_from_observation
from mars.synth.drills import (COPY_PROMPT, CopyCheck, copied, copy_drills, drill_kind, reading_drills,
                               rename_dialogues)
from mars.world.text import KINDS
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


def test_chain_drills_answer_the_first_turns_question_from_the_second_observation(smoke):  # noqa: F811
    entities = smoke["tables"].entities.to_pylist()
    words = {w for e in entities for w in (e["name"].split()[:-1] + e["founder"].split())}
    plain = reading_drills(**_args(smoke, n=40, seed=4))
    drills = reading_drills(**_args(smoke, n=40, seed=4, chain_share=1.0))
    assert not any(drill_kind(d) == "chain" for d in plain)  # off by default: the old drills, unchanged
    kinds = [drill_kind(d) for d in drills]
    assert kinds.count("title") == 0 and kinds.count("chain") >= 5 and kinds.count("fact") >= 5
    for d in drills:
        if drill_kind(d) != "chain":
            continue
        assert [m["role"] for m in d] == ["user", "assistant", "user", "assistant"]
        observation, question = d[0]["content"][0]["text"].split("\n</tool_response>\n")
        call, answer = parse_turn(d[1]["content"]), parse_turn(d[3]["content"])
        top = titles_from_observation(observation)[0]
        assert call.tool_name == "text_search" and call.arguments["query"].startswith(top + " ")
        assert "this emblem" in question and answer.action == "answer" and answer.well_formed
        second = d[2]["content"][0]["text"]
        assert second.startswith("<tool_response>\n") and second.endswith("\n</tool_response>")
        value = answer.answer
        if "\nA. " in question:  # the options are the first turn's; the answer the letter of the value read
            value = dict(line.split(". ", 1) for line in question.splitlines()[1:5])[answer.answer]
        assert f"The snippet about {top} gives {value}." in d[3]["content"] and value in second
        texts = " ".join([d[0]["content"][0]["text"], d[1]["content"], second, d[3]["content"]])
        assert not set(texts.replace("\n", " ").split()) & words  # renamed alike in all four turns
    with pytest.raises(ValueError, match="chain_share must be in"):
        reading_drills(**_args(smoke, n=3, chain_share=1.5))


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


def test_copy_drills_repeat_fresh_names_exactly(smoke):  # noqa: F811
    entities = smoke["tables"].entities.to_pylist()
    world_words = {w for e in entities for w in (e["name"].split()[:-1] + e["founder"].split())}
    drills = copy_drills(entities, n=50, seed=3)
    assert len(drills) == 50 and {drill_kind(d) for d in drills} == {"copy"}
    counts = []
    for user, assistant in drills:
        text = user["content"][0]["text"]
        assert text.startswith(COPY_PROMPT + " ") and text.endswith(".")
        listed = text[len(COPY_PROMPT) + 1:-1]
        names = listed.split(", ")
        counts.append(len(names))
        turn = parse_turn(assistant["content"])
        assert turn.well_formed and turn.action == "answer" and turn.answer == listed
        assert turn.think == f"In order: {listed}."
        words = {w for name in names for w in name.split()}
        assert not words & world_words  # fresh: nothing of the world to memorise
    assert min(counts) == 2 and max(counts) == 5  # names=(2, 5)
    dump = lambda ds: json.dumps(ds, sort_keys=True)  # noqa: E731
    assert dump(copy_drills(entities, n=5, seed=3)) == dump(drills[:5])
    assert dump(copy_drills(entities, n=5, seed=4)) != dump(drills[:5])
    assert copy_drills(entities, n=0) == []
    with pytest.raises(ValueError, match="copy drills must be >= 0"):
        copy_drills(entities, n=-1)
    with pytest.raises(ValueError, match="names must be a range"):
        copy_drills(entities, n=1, names=(3, 2))


def test_world_names_stand_in_from_the_worlds_own_words(smoke):  # noqa: F811
    """rename_from="world": every stand-in is a word of the world (a trained token at a vocabulary that holds
    every world word), drawn afresh per drill, so a name never keeps its facts and the copy stays exact."""
    entities = smoke["tables"].entities.to_pylist()
    words = {w for e in entities for w in (e["name"].split()[:-1] + e["founder"].split())}
    plain = reading_drills(**_args(smoke, n=40, seed=5, fresh_names=False))
    world = reading_drills(**_args(smoke, n=40, seed=5, rename_from="world"))
    assert [drill_kind(d) for d in plain] == [drill_kind(d) for d in world]  # the same drills, renamed
    stand_ins: dict[str, set[str]] = {}
    changed = 0
    for (p_user, p_reply), (user, assistant) in zip(plain, world):
        text, p_text = user["content"][0]["text"], p_user["content"][0]["text"]
        assert len(text.split()) == len(p_text.split())  # a word-for-word substitution
        pairs = [(a, b) for a, b in zip(p_text.split(), text.split()) if a != b]
        changed += bool(pairs)
        for _, b in pairs:
            assert b.strip(".,():") in words, b  # only world words stand in
        turn = parse_turn(assistant["content"])
        assert turn.well_formed, assistant["content"]
        observation, question = text.split("\n</tool_response>\n")
        if turn.action == "tool_call":
            top = titles_from_observation(observation)[0]
            assert turn.arguments["query"].startswith(top + " ")
            original = titles_from_observation(p_text.split("\n</tool_response>\n")[0])[0]
            stand_ins.setdefault(original, set()).add(top)
        else:
            value = turn.answer
            if "\nA. " in question:
                value = dict(line.split(". ", 1) for line in question.splitlines()[1:5])[turn.answer]
            assert value in observation
    assert changed == len(plain)
    # the stand-ins are drawn per drill: an entity seen in two title drills is (almost surely) renamed twice apart
    assert any(len(s) > 1 for s in stand_ins.values())
    for user, assistant in copy_drills(entities, n=20, seed=3, rename_from="world"):
        listed = user["content"][0]["text"][len(COPY_PROMPT) + 1:-1]
        assert {w for name in listed.split(", ") for w in name.split()} <= words | {k.title() for k in KINDS}
    with pytest.raises(ValueError, match="rename_from must be one of"):
        reading_drills(**_args(smoke, n=3, rename_from="pool"))


def _texts(dialogue: list[dict]) -> list[str]:
    out = []
    for m in dialogue:
        c = m["content"]
        out += [c] if isinstance(c, str) else [p["text"] for p in c if p.get("type") == "text"]
    return out


def test_renamed_trajectories_keep_every_copy_and_show_no_real_name(smoke):  # noqa: F811
    """sft.trajectory_names: the oracle's real episodes, renamed: no organisation word or founder name of the world
    is left outside the system prompt, the copies the episode makes (top title -> query, snippet -> answer) still
    hold, images and the system prompt are the same objects, and the input dialogues are untouched."""
    qs, entities = smoke["questions"], smoke["tables"].entities.to_pylist()
    words = {w for e in entities for w in (e["name"].split()[:-1] + e["founder"].split())}
    backend = scripted_backend(qs, lambda q: oracle_policy(q, smoke["world_truth"]), smoke["world"])
    trajs = run_episodes(qs, backend, smoke["toolbox"], EngineConfig(), seed=0, image_root=smoke["world"])
    dialogues = [t.messages for t in trajs]
    before = [_texts(d) for d in dialogues]
    renamed = rename_dialogues(dialogues, entities, seed=0)
    assert [_texts(d) for d in dialogues] == before  # the input is not modified
    assert len(renamed) == len(dialogues)
    first_names, copies = [], 0
    for q, old, new in zip(qs, dialogues, renamed):
        assert [m["role"] for m in new] == [m["role"] for m in old]
        for m_old, m_new in zip(old, new):
            if m_old["role"] == "system":
                assert m_new["content"] == m_old["content"]
            if isinstance(m_old["content"], list):  # images are shared, in the same places
                assert [p.get("image") for p in m_new["content"]] == [p.get("image") for p in m_old["content"]]
        texts = _texts([m for m in new if m["role"] != "system"])
        tokens = {w.strip(".,:;!?'\"()[]{}") for t in texts for w in t.split()}
        assert not tokens & words, (q["question_id"], tokens & words)
        # a word-for-word substitution: the same layout, years and cities kept
        assert [len(t.split()) for t in _texts(new)] == [len(t.split()) for t in _texts(old)]
        turns = [parse_turn(m["content"]) for m in new if m["role"] == "assistant"]
        assert all(t.well_formed for t in turns)
        tops: tuple[str, str] | None = None  # (old, new) top-1 title of the last image search
        for m_old, m in zip(old, new):
            if m["role"] == "system":
                continue
            text_old, text = _texts([m_old])[0], _texts([m])[0]
            if m["role"] == "user" and "Image search results" in text:
                tops = tuple(titles_from_observation(t.split("<tool_response>\n", 1)[1])[0] for t in (text_old, text))
            turn, turn_old = (parse_turn(t) if m["role"] == "assistant" else None for t in (text, text_old))
            if turn is not None and turn.action == "tool_call" and turn.tool_name == "text_search" and tops:
                copied = turn_old.arguments["query"].startswith(tops[0] + " ")  # the oracle may query another name
                assert turn.arguments["query"].startswith(tops[1] + " ") == copied  # the copy holds after renaming
                copies += copied
                first_names.append(tops[1])
                tops = None
        if q["type"] != "perception" and q["choices"] is None:  # an open fact: the answer is in a snippet
            snippets = [t for t in texts if t.startswith("<tool_response>") and "Image search" not in t]
            assert any(turns[-1].answer in s for s in snippets), (q["question_id"], turns[-1].answer)
    assert copies >= 5
    assert len(set(first_names)) == len(first_names)  # fresh names in every dialogue
    dump = lambda ds: json.dumps([_texts(d) for d in ds])  # noqa: E731
    assert dump(rename_dialogues(dialogues, entities, seed=0)) == dump(renamed)
    assert dump(rename_dialogues(dialogues, entities, seed=1)) != dump(renamed)
    with pytest.raises(ValueError, match="rename_from must be one of"):
        rename_dialogues(dialogues, entities, rename_from="pool")


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


def test_copy_check_asks_from_its_first_step_and_keeps_every_share(smoke):  # noqa: F811
    from tests.model.test_model import tiny_stack

    _, proc, model = tiny_stack()
    drills = reading_drills(**_args(smoke, n=5, seed=9))
    check = CopyCheck(proc, drills, target=0.5, min_step=4, max_new_tokens=24)
    assert check.prompts == [d[:1] for d in drills]  # the user turn, without the reply
    assert check(model, 2) is False and check.history == []  # before min_step: not asked, nothing generated
    # a random-init model writes no well-formed copy of any of the 5 replies: share 0, below the target
    assert check(model, 4) is False and check.history == [(4, 0.0)]
    assert check.measure(model, 3) == 0.0 and check.history[-1] == (3, 0.0)  # measure: asked at any step
    assert check.scores(model, 3) == {"copied": 0.0} and len(check.history) == 2  # once a step: not asked again
    assert check.histories() == {"copied": [(4, 0.0), (3, 0.0)]}
    never = CopyCheck(proc, drills, target=0.0)  # target 0: never asked during training, measure() still scores
    assert never(model, 10) is False and never.history == []
    with pytest.raises(ValueError, match="a copy check needs held-out drills and 0 <= target <= 1"):
        CopyCheck(proc, [], target=0.5)
    with pytest.raises(ValueError, match="a copy check needs"):
        CopyCheck(proc, drills, target=1.5)
