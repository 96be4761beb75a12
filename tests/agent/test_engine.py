"""The rollout engine (mars.agent.engine) with ScriptedBackend over a real smoke world, real indexes and real tools.

Also covers the question builder (mars.world.questions). Run: ``.venv/bin/python -m pytest tests/agent -q``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from mars.agent.backends import ScriptedBackend
from mars.agent.engine import EngineConfig, Generation, run_episodes, stream_episodes, trajectories_table
from mars.agent.protocol import format_answer, format_tool_call
from mars.data.io import write_table
from mars.data.schemas import QUESTIONS, TRAJECTORIES
from mars.tools.toolbox import ToolBox, ToolConfig
from mars.world.generate import WorldSpec, generate_world
from mars.world.questions import load_question_image, make_questions


def build_smoke_world(root: Path) -> dict:
    """Generate the smoke world (no curation traps) with the real generator, write its tables like the world stage
    and build the real text and image indexes like the index stage. Returns paths and tables."""
    from mars.tools.embedders import load_embedder
    from mars.tools.image_index import ImageIndex
    from mars.tools.text_index import TextIndex
    from mars.data.schemas import ENTITIES, CORPUS, GALLERY, RAW_IMAGES, WORLD_TRUTH

    world = root / "world"
    tables = generate_world(WorldSpec.smoke(planted=False), world / "raw", world / "gallery", progress=False)
    for name, schema in (("entities", ENTITIES), ("corpus", CORPUS), ("gallery", GALLERY),
                         ("raw_images", RAW_IMAGES), ("world_truth", WORLD_TRUTH)):
        write_table(getattr(tables, name), world / f"{name}.parquet", schema)
    index = root / "index"
    TextIndex.build(tables.corpus).save(index / "text")
    ImageIndex.build(tables.gallery, world / "gallery", load_embedder("color_layout"), show_progress=False).save(
        index / "image")
    (index / "manifest.json").write_text(json.dumps({"embedder": "color_layout"}))
    return {"world": world, "index": index, "tables": tables}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent-world")
    built = build_smoke_world(root)
    q = make_questions(built["tables"], built["world"] / "raw", built["world"] / "questions", seed=0, n_per_type=12)
    built["questions"] = q
    built["toolbox"] = ToolBox.from_dirs(built["index"], built["world"] / "gallery", ToolConfig())
    return built


# ------------------------------------------------------------------------------------------------ questions


def test_questions_deterministic_typed_and_valid(smoke, tmp_path):
    q = smoke["questions"]
    assert q.schema.equals(QUESTIONS)
    rows = q.to_pylist()
    assert {r["type"] for r in rows} == {"perception", "search", "multi-hop"}
    assert len({r["question_id"] for r in rows}) == len(rows)
    n_mcq = 0
    for r in rows:
        assert r["answer"].strip() and r["split"] == "test"
        assert (r["scene_id"] is None) == (r["type"] == "search")
        img = load_question_image(smoke["world"], r["image_path"])
        assert min(img.size) >= 256
        if r["choices"] is not None:
            n_mcq += 1
            choices = json.loads(r["choices"])
            assert sorted(choices) == ["A", "B", "C", "D"] and len(set(choices.values())) == 4
            assert r["answer"] in choices.values() and choices[r["aliases"][0]] == r["answer"]
            for k, v in choices.items():
                assert f"{k}. {v}" in r["question"]
    assert 0 < n_mcq < len(rows)
    # same inputs and seed: equal table and identical search images; another seed differs
    again = make_questions(smoke["tables"], smoke["world"] / "raw", tmp_path / "q", seed=0, n_per_type=12,
                           root=smoke["world"])
    a = [{k: v for k, v in r.items() if k != "image_path"} for r in again.to_pylist()]
    b = [{k: v for k, v in r.items() if k != "image_path"} for r in rows]
    assert a == b
    for r in again.to_pylist():
        if r["type"] == "search":
            name = Path(r["image_path"]).name
            assert (tmp_path / "q" / name).read_bytes() == (smoke["world"] / "questions" / name).read_bytes()
    other = make_questions(smoke["tables"], smoke["world"] / "raw", tmp_path / "q2", seed=1, n_per_type=12)
    assert other.column("question").to_pylist() != q.column("question").to_pylist()


# ------------------------------------------------------------------------------------------------ engine


def _qrows(smoke, qtype: str | None = None, n: int | None = None) -> list[dict]:
    """Questions with distinct texts (so a scripted policy can tell them apart by text)."""
    rows, seen = [], set()
    for r in smoke["questions"].to_pylist():
        if (qtype is None or r["type"] == qtype) and r["question"] not in seen:
            seen.add(r["question"])
            rows.append(r)
    assert n is None or len(rows) >= n
    return rows[:n] if n else rows


def _n_assistant(d):
    return sum(m["role"] == "assistant" for m in d)


def test_batching_and_finished_episodes_leave_the_batch(smoke):
    qs = _qrows(smoke, n=6)
    # episode i answers after i % 3 text searches
    want = {q["question"]: i % 3 for i, q in enumerate(qs)}

    def policy(d):
        text = next(p["text"] for p in d[1]["content"] if p["type"] == "text")
        if _n_assistant(d) < want[text]:
            return format_tool_call("text_search", {"query": "founded"}, "search")
        return format_answer("x", "done")

    backend = ScriptedBackend(policy)
    trajs = run_episodes(qs, backend, smoke["toolbox"], EngineConfig(), seed=0, image_root=smoke["world"])
    # one generate call per step, containing every unfinished episode: 6, then 4, then 2
    assert backend.batch_sizes == [6, 4, 2]
    assert [t.n_tool_calls for t in trajs] == [i % 3 for i in range(6)]
    assert all(t.finish_reason == "answer" and t.n_format_errors == 0 for t in trajs)
    assert [t.question_id for t in trajs] == [q["question_id"] for q in qs]


def test_live_episodes_are_bounded_and_questions_read_lazily(smoke):
    qs = _qrows(smoke, n=6)
    want = {q["question"]: i % 3 for i, q in enumerate(qs)}  # episode i answers after i % 3 text searches

    def policy(d):
        text = next(p["text"] for p in d[1]["content"] if p["type"] == "text")
        if _n_assistant(d) < want[text]:
            return format_tool_call("text_search", {"query": "founded"}, "search")
        return format_answer(text[:12], "done")

    read: list[int] = []

    def lazily():
        for i, q in enumerate(qs):
            read.append(i)
            yield q

    backend = ScriptedBackend(policy)
    cfg = EngineConfig(max_live_episodes=2)
    stream = stream_episodes(lazily(), backend, smoke["toolbox"], cfg, seed=0, image_root=smoke["world"])
    first = next(stream)
    # episodes 0 (answers at once) and 1 (one search) start; 0 finishes in step 1 before question 2 is read
    assert first[0] == 0 and read == [0, 1]
    rest = list(stream)
    # episode i plays i % 3 searches, then answers. Slots: step 1 [0,1] -> 0 done; step 2 [1,2] -> 1 done;
    # step 3 [2,3] -> 3 done; step 4 [2,4] -> 2 done; step 5 [4,5] -> 4 done; steps 6, 7 [5] -> 5 done
    assert backend.batch_sizes == [2, 2, 2, 2, 2, 1, 1]
    assert [i for i, _ in [first, *rest]] == [0, 1, 3, 2, 4, 5]
    # the same episodes as one unbounded batch (a deterministic policy): bounding changes nothing else
    bounded = {i: t for i, t in [first, *rest]}
    whole = run_episodes(qs, ScriptedBackend(policy), smoke["toolbox"], EngineConfig(), seed=0,
                         image_root=smoke["world"])
    assert [bounded[i].row()["messages_json"] for i in range(6)] == [t.row()["messages_json"] for t in whole]
    assert [bounded[i].n_tool_calls for i in range(6)] == [i % 3 for i in range(6)]


def test_the_episodes_of_a_question_share_its_image(smoke):
    qs = _qrows(smoke, n=2)
    trajs = run_episodes([qs[0], qs[0], qs[1], qs[0]], ScriptedBackend(lambda d: format_answer("x", "done")),
                         smoke["toolbox"], EngineConfig(max_live_episodes=2), image_root=smoke["world"])
    first = [t.images[0] for t in trajs]
    # episodes 0 and 1 are in play together: one image opened; episode 3 starts after both left: opened again
    assert first[0] is first[1] and first[2] is not first[0] and first[3] is not first[0]
    assert first[3].tobytes() == first[0].tobytes()


class Releasing(ScriptedBackend):
    """A scripted backend that records the dialogues the engine releases."""

    def __init__(self, policy):
        super().__init__(policy)
        self.released: list[int] = []

    def release(self, dialogues):
        self.released += [len(d) for d in dialogues]


def test_finished_episodes_are_released_to_the_backend(smoke):
    qs = _qrows(smoke, n=3)
    backend = Releasing(lambda d: format_answer("x", "done") if _n_assistant(d) else "not a turn")
    trajs = run_episodes(qs, backend, smoke["toolbox"], EngineConfig(max_live_episodes=2, max_turns=3), seed=0,
                         image_root=smoke["world"])
    # every episode: a malformed turn, its error observation, then the answer: system + user + 3 = 5 messages
    assert backend.released == [5, 5, 5] and all(t.finish_reason == "answer" for t in trajs)


class GatedToolBox:
    """The real ToolBox behind a gate that opens only once ``n`` calls are inside it at the same time, recording the
    most calls inside at once. Calls run one after another never open it: each then fails (after ``timeout_s``,
    then at once) and the engine records an internal tool error."""

    def __init__(self, inner, n: int, timeout_s: float = 60.0) -> None:
        self.inner, self.cfg = inner, inner.cfg
        self.gate = threading.Barrier(n, timeout=timeout_s)
        self.active = self.peak = 0
        self.lock = threading.Lock()

    def call(self, name, arguments, images):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            self.gate.wait()
            return self.inner.call(name, arguments, images)
        finally:
            with self.lock:
                self.active -= 1


def test_tool_calls_of_a_step_run_concurrently(smoke):
    qs = _qrows(smoke, n=8)

    def policy(d):
        if _n_assistant(d) == 0:
            return format_tool_call("image_zoom_in", {"bbox_2d": [0, 0, 500, 500], "label": "tl", "img_idx": 0}, "z")
        return format_answer("x", "done")

    box = GatedToolBox(smoke["toolbox"], 8)
    trajs = run_episodes(qs, ScriptedBackend(policy), box, EngineConfig(tool_workers=8), image_root=smoke["world"])
    assert box.peak == 8 and box.active == 0  # the step's eight calls were all inside at once (the speed-up they
    # give is bench/bench_bounds.py's)
    for t in trajs:
        assert t.n_tool_calls == 1 and t.n_tool_errors == 0 and len(t.images) == 2
        # the crop of the original is sent back at policy resolution
        assert t.images[1].width * t.images[1].height <= 224 * 224
        user = t.messages[3]
        assert user["role"] == "user" and user["content"][0]["text"].startswith("<tool_response>")
        assert user["content"][1]["image"] is t.images[1]


def test_malformed_turns_become_error_observations_never_raise(smoke):
    qs = _qrows(smoke, n=5)
    bad = [
        "",
        "just some text",
        '<think>x</think><tool_call>{"name": "text_search", "arguments": {"query": </tool_call>',
        '<think>x</think><tool_call>{"name": "fly", "arguments": {}}</tool_call>',
        "<answer>1900</answer>",  # no <think>: malformed in strict mode
    ]

    def policy(d):
        n = _n_assistant(d)
        text = next(p["text"] for p in d[1]["content"] if p["type"] == "text")
        i = [q["question"] for q in qs].index(text)
        if n == 0:
            return bad[i]
        if n == 1:  # a well-formed call with a bad argument: a tool error, not a format error
            return format_tool_call("image_zoom_in", {"bbox_2d": [10, 10, 5, 5], "label": "x", "img_idx": 7}, "z")
        return format_answer("x", "done")

    trajs = run_episodes(qs, ScriptedBackend(policy), smoke["toolbox"], EngineConfig(), image_root=smoke["world"])
    for t in trajs:
        assert t.n_format_errors == 1 and t.n_tool_errors == 1 and t.n_turns == 3
        assert t.finish_reason == "answer" and t.reward_format == 0.0
        err = t.messages[3]["content"][0]["text"]
        assert err.startswith("<tool_response>\nError: your last turn was malformed.")
        assert t.tool_calls[0]["error"] and t.tool_calls[0]["turn"] == 1
    # lenient mode executes the usable answer of the last bad turn (still a format error)
    lenient = run_episodes(qs[4:], ScriptedBackend(lambda d: bad[4]), smoke["toolbox"], EngineConfig(lenient=True),
                           image_root=smoke["world"])
    assert lenient[0].finish_reason == "answer" and lenient[0].answer == "1900" and lenient[0].n_format_errors == 1


def test_limits_end_episodes(smoke):
    qs = _qrows(smoke, n=3)
    loop = lambda d: format_tool_call("text_search", {"query": "founded"}, "again")  # noqa: E731
    backend = ScriptedBackend(loop)
    trajs = run_episodes(qs, backend, smoke["toolbox"], EngineConfig(max_turns=4), image_root=smoke["world"])
    assert backend.batch_sizes == [3, 3, 3, 3]
    assert all(t.finish_reason == "max_turns" and t.n_turns == 4 and not t.correct for t in trajs)
    assert all(t.answer is None and t.reward == 0.0 and t.judge == "rule:no_answer" for t in trajs)

    class TokenBackend(ScriptedBackend):  # reports 100 token ids per turn
        def generate(self, dialogues, **kw):
            return [Generation(g.text, list(range(100)), [-0.5] * 100, "stop") for g in super().generate(dialogues, **kw)]

    trajs = run_episodes(qs, TokenBackend(loop), smoke["toolbox"], EngineConfig(max_total_tokens=250),
                         image_root=smoke["world"])
    assert all(t.finish_reason == "token_budget" and t.n_turns == 3 for t in trajs)
    assert all(len(t.token_ids) == 300 and len(t.logprobs) == 300 for t in trajs)
    assert all(t.turn_tokens == [100, 100, 100] and t.row()["turn_tokens"] == [100, 100, 100] for t in trajs)

    class FailingBackend(ScriptedBackend):
        def generate(self, dialogues, **kw):
            return [Generation("", None, None, "error") for _ in dialogues]

    trajs = run_episodes(qs, FailingBackend(loop), smoke["toolbox"], EngineConfig(), image_root=smoke["world"])
    assert all(t.finish_reason == "backend_error" and t.n_turns == 0 and t.n_format_errors == 0 for t in trajs)


def test_scoring_and_trajectories_table(smoke, tmp_path):
    qs = _qrows(smoke, n=4)

    def policy(d):
        text = next(p["text"] for p in d[1]["content"] if p["type"] == "text")
        q = next(q for q in qs if q["question"] == text)
        if _n_assistant(d) == 0:
            return format_tool_call("image_search", {"img_idx": 0}, "who is it")
        return format_answer(q["aliases"][0] if q["choices"] else q["answer"], "known")

    trajs = run_episodes(qs, ScriptedBackend(policy), smoke["toolbox"], EngineConfig(), image_root=smoke["world"])
    assert all(t.correct and t.reward == 1.5 and t.reward_answer == 1.0 and t.reward_format == 0.5 for t in trajs)
    table = trajectories_table(trajs)
    assert table.schema.equals(TRAJECTORIES) and table.num_rows == 4
    write_table(table, tmp_path / "trajectories.parquet", TRAJECTORIES)
    row = table.to_pylist()[0]
    msgs = json.loads(row["messages_json"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[1]["content"][0] == {"type": "image", "ref": 0}
    refs = [p["ref"] for m in msgs if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
    assert refs == list(range(len(row["images"]))) and len(refs) >= 2
    for b in row["images"]:
        assert b[:8] == b"\x89PNG\r\n\x1a\n"
    calls = json.loads(row["tool_calls_json"])
    assert calls[0]["name"] == "image_search" and calls[0]["turn"] == 0 and calls[0]["error"] is None
    assert row["token_ids"] is None and row["logprobs"] is None
