"""The RL trainer: resume after a kill reaches the same weights, monitors, collapse stop, dynamic sampling, recipes,
and the policy refresh on a real `mars serve` server.

Rollouts here come from a seeded scripted policy (answers right with probability 1/2, drawn from the engine's
per-step seed), so the tests are fast and rewards vary inside groups; the tiny model still computes every
log-prob, ratio, loss and update for real.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

from mars.agent.engine import Generation
from mars.agent.protocol import format_answer
from mars.model.build import build_model, save_checkpoint, tiny_config
from mars.train.optim import OptimConfig
from mars.train.rl import RLCollapse, RLConfig, train_rl
from tests.conftest import sub_env
from tests.model.test_model import image, tiny_stack

QUESTIONS = [
    {"question_id": f"q{i}", "question": f"What colour is thing {i}?", "answer": ["red", "blue"][i % 2],
     "aliases": [], "image": image(40 + i, (64, 64))}
    for i in range(6)
]


class CoinBackend:
    """Answers each question right with probability ``p`` (or always wrong for ids in ``hopeless``), from ``seed``."""

    def __init__(self, p: float = 0.5, hopeless: tuple[str, ...] = ()):
        self.p, self.hopeless = p, hopeless

    def generate(self, dialogues, *, max_new_tokens, temperature, top_p, seed):
        rng = np.random.default_rng(seed)
        out = []
        for d in dialogues:
            text = next(p["text"] for p in d[1]["content"] if p["type"] == "text")
            q = next(q for q in QUESTIONS if q["question"] == text)
            right = q["question_id"] not in self.hopeless and rng.random() < self.p
            ans = q["answer"] if right else {"red": "blue", "blue": "red"}[q["answer"]]
            out.append(Generation(text=format_answer(ans, "I look at it."), finish_reason="stop"))
        return out


def model_and_proc():
    tok, proc, _ = tiny_stack()
    return build_model(tiny_config(len(tok)), seed=3), proc


def cfg(**kw) -> RLConfig:
    base = dict(optim=OptimConfig(lr=1e-3, vision_lr=1e-3, warmup_steps=0, schedule="constant"), steps=4,
                prompts_per_step=2, group_size=4, mini_batches=2, micro_batch_size=3, checkpoint_every=2,
                collapse_window=1000, seed=5)
    base.update(kw)
    return RLConfig(**base)


def run(tmp, c, backend=None, **kw):
    from mars.agent.engine import EngineConfig

    model, proc = model_and_proc()
    summary = train_rl(model, proc, QUESTIONS, toolbox=None, engine=EngineConfig(max_turns=2, prompt="compact"),
                       cfg=c, ckpt_dir=tmp / "ckpt", live_dir=tmp / "live", fp="test", image_root=None,
                       backend_factory=lambda m: backend or CoinBackend(), **kw)
    return model, summary


def test_kill_and_resume_reaches_the_same_weights(tmp_path):
    full, s_full = run(tmp_path / "a", cfg())

    class Killed(Exception):
        pass

    def die(step):
        if step == 2:  # after the update of the 3rd step, before its checkpoint (saved every 2 steps)
            raise Killed

    with pytest.raises(Killed):
        run(tmp_path / "b", cfg(), on_update=die)
    resumed, s_res = run(tmp_path / "b", cfg())
    assert s_res["resumed_from"] == 2
    for (n, p), (_, q) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(p, q), n
    assert [h["reward"] for h in s_full["history"]] == [h["reward"] for h in s_res["history"]]
    # the dvclive curve has one row per step, none repeated by the resume
    head, *rows = (tmp_path / "b/live/plots/metrics/rl/reward.tsv").read_text().splitlines()
    k = head.split("\t").index("step")
    assert [int(r.split("\t")[k]) for r in rows] == [0, 1, 2, 3]


def test_updates_are_live_and_monitored(tmp_path):
    before, _ = model_and_proc()
    model, s = run(tmp_path, cfg(steps=2))
    h = s["history"]
    assert len(h) == 2
    for key in ("reward", "reward_answer", "reward_format", "accuracy", "degenerate_groups", "batch_scale",
                "clip_frac", "approx_kl", "entropy", "response_tokens", "turns", "tool_calls", "tool_error_rate",
                "calls_image_zoom_in", "calls_text_search", "calls_image_search", "ratio_mean"):
        assert key in h[0] and np.isfinite(h[0][key]), key
    assert all(0 <= x["reward"] <= 1.5 for x in h)
    # two mini-batches: the second one sees a policy moved by the first, so the ratio is not exactly 1
    assert h[-1]["approx_kl"] > 0
    assert any(not torch.equal(p, q) for p, q in zip(before.parameters(), model.parameters()))


def test_the_schedule_spans_every_update(tmp_path):
    # linear from 1e-3 to 1e-4 over steps x mini_batches = 3 x 2 = 6 updates; step k starts at update 2k:
    # multiplier 1 - 0.9 * 2k / 6 = 1.0, 0.7, 0.4 (a schedule over 3 updates would give 1.0, 0.4, 0.1)
    c = cfg(steps=3, optim=OptimConfig(lr=1e-3, vision_lr=1e-3, warmup_steps=0, schedule="linear", min_lr_ratio=0.1))
    _, s = run(tmp_path, c)
    np.testing.assert_allclose([h["lr"] for h in s["history"]], [1e-3, 7e-4, 4e-4], rtol=1e-6)


def test_kept_rollouts_have_unique_episode_ids_when_questions_come_back(tmp_path):
    from mars.agent.engine import EngineConfig

    model, proc = model_and_proc()
    s = train_rl(model, proc, QUESTIONS[:2], toolbox=None, engine=EngineConfig(max_turns=2, prompt="compact"),
                 cfg=cfg(steps=2), ckpt_dir=tmp_path / "ckpt", live_dir=None, fp="test", image_root=None,
                 backend_factory=lambda m: CoinBackend())
    ids = [r["episode_id"] for r in s["samples"]]
    assert len(ids) == 4 and len(set(ids)) == 4  # both steps play the same two questions


def test_monitors_measure_the_off_policy_updates(tmp_path):
    _, s = run(tmp_path, cfg(steps=2))
    for h in s["history"]:
        # the KL per update is measured on the second mini-batch only (the first is on-policy: exactly 0)
        assert h["approx_kl"] > 1e-7 and h["approx_kl_max"] >= h["approx_kl"]
        assert h["grad_norm"] > 0 and h["grad_norm_max"] >= h["grad_norm"]
    # full precision: nothing is rounded to 4 decimals
    assert any(round(h["approx_kl"], 4) != h["approx_kl"] for h in s["history"])


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "bn_gspo"])
def test_each_recipe_steps_with_a_finite_loss(tmp_path, algorithm):
    _, s = run(tmp_path, cfg(algorithm=algorithm, steps=1))
    assert s["estimator"] == {"grpo": "grpo", "gspo": "grpo", "bn_gspo": "bn"}[algorithm]
    assert s["level"] == {"grpo": "token", "gspo": "sequence", "bn_gspo": "sequence"}[algorithm]
    assert np.isfinite(s["history"][0]["entropy"])


def test_inert_ratio_is_announced(tmp_path, caplog):
    before, _ = model_and_proc()
    with caplog.at_level(logging.WARNING, logger="mars.train.rl"):
        model, s = run(tmp_path, cfg(mini_batches=1, steps=1))
    assert "clipping is inert" in caplog.text
    # no separate old-log-prob pass: the old log-probs are the update's own, detached, so the ratio is exactly 1
    # (a second forward pass would differ by float noise) and the policy still moves
    h = s["history"][0]
    assert "ratio_mean" not in h and h["approx_kl"] == 0.0 and h["clip_frac"] == 0.0
    assert any(not torch.equal(p, q) for p, q in zip(before.parameters(), model.parameters()))


def test_collapse_stops_with_a_clear_message(tmp_path):
    # the scripted policy never calls a tool: with a 0.5 floor over 2 steps the run must stop
    with pytest.raises(RLCollapse, match=r"tool calls per episode below 0.5 for 2 steps"):
        run(tmp_path, cfg(collapse_window=2, collapse_min_tool_rate=0.5))


def test_dynamic_sampling_refills_degenerate_groups(tmp_path):
    # q0/q1 are hopeless (every rollout wrong: a degenerate group); dynamic sampling replaces their groups
    back = CoinBackend(hopeless=("q0", "q1"))
    _, plain = run(tmp_path / "p", cfg(steps=3), backend=back)
    _, dyn = run(tmp_path / "d", cfg(dynamic_sampling=True, max_refills=3,
                                     steps=3), backend=back)
    assert sum(h["degenerate_groups"] for h in dyn["history"]) < sum(h["degenerate_groups"] for h in plain["history"])
    assert any(h["refill_rounds"] > 0 for h in dyn["history"])


def test_policy_refresh_on_mars_serve(tmp_path):
    """The RL stage's weight refresh: save, POST /v1/reload, and the server now answers with the new weights."""
    from stages.rl import Params, remote_backend_factory

    tok, proc, _ = tiny_stack()
    model = build_model(tiny_config(len(tok)), seed=11)
    first = tmp_path / "first"
    save_checkpoint(model, tok, proc, first)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "mars.cli", "serve", "--checkpoint", str(first), "--port",
                               str(port)], env=sub_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "mars serve did not start"
            time.sleep(0.3)
        body = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 4, "temperature": 0,
                "logprobs": True}

        def logprobs():
            r = httpx.post(f"{base}/chat/completions", json=body, timeout=60).json()
            return [c["logprob"] for c in r["choices"][0]["logprobs"]["content"]]

        old = logprobs()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        factory = remote_backend_factory(Params(rollout_base_url=base), proc, tmp_path / "served")
        backend = factory(model)  # saves the updated weights and reloads them on the server
        assert (tmp_path / "served" / "config.json").is_file()
        new = logprobs()
        assert new != old
        bad = httpx.post(f"{base}/reload", json={"path": str(tmp_path / "missing")}, timeout=60)
        assert bad.status_code == 400 and "cannot load" in bad.json()["error"]["message"]
        assert backend.url.startswith(base)
    finally:
        server.terminate()
        server.wait(timeout=30)
