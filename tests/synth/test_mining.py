"""Difficulty mining: bounded streaming, pass counts saved as they come and resumed, the band's metrics, clear
errors, and mining through ``mars serve`` equal to local mining."""

from __future__ import annotations

import pytest

from mars.agent.backends import ScriptedBackend
from mars.agent.engine import EngineConfig
from mars.agent.protocol import format_answer
from mars.data.io import ChunkStore
from mars.data.schemas import PASS_COUNTS
from mars.errors import MissingInputError
from mars.synth.mining import band_metrics, histogram, keep_band, mining_backend, mining_key, pass_rates
from tests.agent.test_engine import _qrows, smoke  # noqa: F401  (the smoke world fixture)


def _rows(smoke, n):  # noqa: F811
    rows = _qrows(smoke, n=n)
    return [dict(r, split="rl") for r in rows]


class Alternating(ScriptedBackend):
    """Answers right on every other episode of question i when i is odd, always when i % 3 == 0, else never;
    fails (like a killed process) once ``fail_after`` dialogues have been answered."""

    def __init__(self, rows, fail_after: int | None = None):
        self.turn: dict[str, int] = {}
        self.fail_after, self.answered, self.seen = fail_after, 0, []
        gold = {r["question"]: (i, r["answer"]) for i, r in enumerate(rows)}

        def policy(d):
            text = next(p["text"] for p in d[1]["content"] if p["type"] == "text")
            i, answer = gold[text]
            self.seen.append(i)
            n = self.turn[text] = self.turn.get(text, 0) + 1
            right = i % 3 == 0 or (i % 2 == 1 and n % 2 == 0)
            return format_answer(answer if right else "no idea", "done")

        super().__init__(policy)

    def generate(self, dialogues, **kw):
        if self.fail_after is not None and self.answered + len(dialogues) > self.fail_after:
            raise KeyboardInterrupt("killed")
        self.answered += len(dialogues)
        return super().generate(dialogues, **kw)


def test_pass_counts_are_bounded_saved_as_they_come_and_resumed(smoke, tmp_path):  # noqa: F811
    rows = _rows(smoke, 6)
    cfg = EngineConfig(max_live_episodes=4)
    k = 4
    # question i: i % 3 == 0 -> 4/4; odd -> every other episode right -> 2/4; else 0/4
    want = {r["question_id"]: (4 if i % 3 == 0 else 2 if i % 2 else 0) for i, r in enumerate(rows)}
    whole = Alternating(rows)
    assert pass_rates(rows, whole, smoke["toolbox"], cfg, k=k, image_root=smoke["world"], progress=False) == want
    assert max(whole.batch_sizes) == 4 and sum(whole.batch_sizes) == 6 * k  # one turn each, 4 in play

    store = ChunkStore(tmp_path / "mining", "run", PASS_COUNTS)
    killed = Alternating(rows, fail_after=13)  # 3 steps of 4 answer 12 episodes = questions 0..2; the 4th step dies
    with pytest.raises(KeyboardInterrupt):
        pass_rates(rows, killed, smoke["toolbox"], cfg, k=k, image_root=smoke["world"], store=store, flush_every=1,
                   progress=False)
    saved = store.table().to_pylist()
    assert [(r["question_id"], r["passes"], r["k"], r["split"]) for r in saved] == [
        (rows[i]["question_id"], want[rows[i]["question_id"]], k, "rl") for i in range(3)]
    resumed = Alternating(rows)
    got = pass_rates(rows, resumed, smoke["toolbox"], cfg, k=k, image_root=smoke["world"], store=store,
                     progress=False)
    assert got == want
    assert sorted(set(resumed.seen)) == [3, 4, 5]  # only the questions the killed run had not finished
    assert len(store.table()) == 6
    # nothing left to play: a rerun reads every count back
    again = Alternating(rows)
    assert pass_rates(rows, again, smoke["toolbox"], cfg, k=k, image_root=smoke["world"], store=store,
                      progress=False) == want and again.calls == 0


def test_band_histogram_and_metrics():
    rows = [dict(question_id=f"q{i}", split=s, type=t, k=4, passes=p) for i, (s, t, p) in enumerate(
        [("rl", "search", 0), ("rl", "search", 2), ("rl", "search", 4), ("rl", "perception", 1),
         ("rl", "perception", 1), ("sft", "search", 3)])]
    hist = histogram(rows, 4)
    # every (split, type) lists counts 0..4: rl/perception [0,2,0,0,0], rl/search [1,0,1,0,1], sft/search [0,0,0,1,0]
    assert [(h["split"], h["type"], h["questions"]) for h in hist if h["passes"] == 1] == [
        ("rl", "perception", 2), ("rl", "search", 0), ("sft", "search", 0)]
    assert sum(h["questions"] for h in hist) == 6 and len(hist) == 3 * 5
    m = band_metrics(rows, 4, 1, 3)
    # rl: passes 0,2,4,1,1 -> kept 2,1,1 (3), dropped 0 and 4 (2); degenerate (0 or 4 of 4): 2/5 = 0.4, kept 0;
    # mean pass rate (0+2+4+1+1) / (4*5) = 0.4; histogram of 0..4 passes: one 0, two 1s, one 2, one 4
    assert m["rl"] == {"questions": 5, "kept": 3, "dropped": 2, "degenerate_share": 0.4,
                       "degenerate_share_kept": 0.0, "mean_pass_rate": 0.4,
                       "histogram": {"0": 1, "1": 2, "2": 1, "3": 0, "4": 1},
                       "perception": {"kept": 2, "questions": 2, "histogram": {"0": 0, "1": 2, "2": 0, "3": 0, "4": 0}},
                       "search": {"kept": 1, "questions": 3, "histogram": {"0": 1, "1": 0, "2": 1, "3": 0, "4": 1}}}
    assert m["sft"]["kept"] == 1 and m["sft"]["mean_pass_rate"] == 0.75
    passes = {r["question_id"]: r["passes"] for r in rows}
    assert [r["question_id"] for r in keep_band(rows, passes, 1, 3)] == ["q1", "q3", "q4", "q5"]
    with pytest.raises(ValueError, match="min_pass"):
        keep_band(rows, passes, 3, 1)


def test_a_checkpoint_path_that_is_not_a_model_is_one_clear_line(tmp_path):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.json").write_text("{}")
    with pytest.raises(MissingInputError) as e:
        mining_backend(str(tmp_path / "sft"), "", "", None, "synthesize.mine_checkpoint")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("synthesize.mine_checkpoint: ")
    assert str(tmp_path / "sft") in msg and "config.json" in msg and "data/sft/model" in msg
    with pytest.raises(ValueError, match="no model name given"):
        mining_backend("", "http://127.0.0.1:9/v1", "", None, "mine: the sft checkpoint")


def test_mining_key_follows_the_policy_and_params(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model.safetensors").write_bytes(b"1234")
    a = mining_key(str(ck), "", "", {"k": 8}, ["q1", "q2"])
    assert a == mining_key(str(ck), "", "", {"k": 8}, ["q1", "q2"])
    assert a != mining_key(str(ck), "", "", {"k": 4}, ["q1", "q2"])
    assert a != mining_key(str(ck), "", "", {"k": 8}, ["q1"])
    (ck / "model.safetensors").write_bytes(b"12345")  # retrained: another size
    assert a != mining_key(str(ck), "", "", {"k": 8}, ["q1", "q2"])
    assert mining_key("", "http://h/v1", "m", {"k": 8}) != mining_key("", "http://h/v1", "n", {"k": 8})


def test_mining_through_mars_serve_equals_local_mining(smoke, tmp_path):  # noqa: F811
    """The same filter over an endpoint: greedy pass counts and episodes through `mars serve` equal the local
    checkpoint's (the tiny random model answers nothing right, so the texts are compared too). One turn: the
    random model's bytes do not survive the server's re-rendering of earlier turns from text (mars.agent.engine,
    Sampled tokens); tests/stages/test_synthesize_sft_evaluate.py compares a trained policy's multi-turn episodes."""
    from mars.agent.engine import run_episodes
    from mars.model.build import save_checkpoint
    from tests.model.test_hf_backend import tiny_stack
    from tests.serve.test_openai_server import start_mars_serve, wait_serving

    class Agent:  # the processor check of AgentParams for the tiny model's 28-px merged patches
        @staticmethod
        def check_processor(processor, where):
            assert processor.image_processor.patch_size * processor.image_processor.merge_size == 28, where

    tok, proc, model = tiny_stack()
    save_checkpoint(model, tok, proc, tmp_path / "ckpt")
    rows = _rows(smoke, 3)
    cfg = EngineConfig(max_turns=1, max_new_tokens_per_turn=12, min_pixels=28 * 28, max_pixels=56 * 56,
                       prompt="compact", max_live_episodes=4)
    local = mining_backend(str(tmp_path / "ckpt"), "", "", Agent(), "ckpt")
    p, url = start_mars_serve(tmp_path / "ckpt", tmp_path / "serve.log")
    try:
        wait_serving(p, url, tmp_path / "serve.log")
        remote = mining_backend("", f"{url}/v1", "tiny", Agent(), "ckpt")
        kw = dict(k=2, image_root=smoke["world"], progress=False)
        assert pass_rates(rows, remote, smoke["toolbox"], cfg, **kw) == pass_rates(rows, local, smoke["toolbox"], cfg,
                                                                                  **kw)
        a = run_episodes(rows, remote, smoke["toolbox"], cfg, image_root=smoke["world"])
        b = run_episodes(rows, local, smoke["toolbox"], cfg, image_root=smoke["world"])
        assert [t.row()["messages_json"] for t in a] == [t.row()["messages_json"] for t in b]
        assert all(t.finish_reason != "backend_error" for t in a)
    finally:
        p.terminate()
        p.wait(timeout=20)
