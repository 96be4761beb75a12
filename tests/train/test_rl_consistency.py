"""RL trains exactly what the policy sampled: real rollouts of a tiny checkpoint, then the trainer's batch.

The trained ids are the sampled ids (no re-tokenisation of the text, no ``<|im_end|>`` the policy did not sample),
and the trainer's log-probs at the sampling temperature equal the rollout's to 1e-4 in fp32: in process (engine +
``HFBackend``) and over HTTP (the ``openai`` rollout backend against the real ``mars serve`` app, which is what a
vLLM rollout server has to match too).
"""

from __future__ import annotations

import pytest
import torch

from mars.agent.backends import OpenAIBackend
from mars.agent.engine import EngineConfig, run_episodes
from mars.agent.hf_backend import HFBackend
from mars.model.build import build_model, tiny_config
from mars.model.chat import render, vision_token_ids
from mars.serve.openai_server import create_app
from mars.train.data import collate
from mars.train.rl import rollout_logps, sampled_example, sequence_logps
from tests.conftest import serve_app
from tests.model.test_model import image, tiny_stack

T = 0.7
QUESTIONS = [{"question_id": f"q{i}", "question": f"What colour is thing {i}?", "answer": "red",
              "image": image(60 + i, (56, 56))} for i in range(4)]


def policy():
    tok, proc, _ = tiny_stack()
    return build_model(tiny_config(len(tok)), seed=21).eval(), proc


def rollouts(backend, max_turns: int):
    cfg = EngineConfig(max_turns=max_turns, max_new_tokens_per_turn=10, temperature=T, prompt="compact")
    return run_episodes(QUESTIONS * 2, backend, None, cfg, seed=3)


def trainer_logps(model, proc, trajs, temperature: float) -> list[torch.Tensor]:
    examples = [sampled_example(t, proc) for t in trajs]
    with torch.no_grad():
        lp, mask, _ = sequence_logps(model, collate(examples, proc.tokenizer.pad_token_id), temperature=temperature,
                                      suppress=vision_token_ids(proc.tokenizer))
    return [lp[i][mask[i]] for i in range(len(trajs))]


def check(model, proc, trajs) -> None:
    for t in trajs:
        ex = sampled_example(t, proc)
        assert ex.input_ids[ex.loss_mask.bool()].tolist() == t.token_ids  # trained ids == sampled ids
        assert len(t.logprobs) == len(t.token_ids)
    for t, lp in zip(trajs, trainer_logps(model, proc, trajs, T)):
        torch.testing.assert_close(lp, torch.tensor(t.logprobs), atol=1e-4, rtol=0)
    # the layout rollout_logps gives the trainer as old log-probs is the same
    old = rollout_logps(trajs, [sampled_example(t, proc) for t in trajs])
    assert old is not None and all(torch.equal(old[i][old[i] != 0], torch.tensor(t.logprobs)[torch.tensor(
        t.logprobs) != 0]) for i, t in enumerate(trajs))


def test_in_process_rollouts_train_the_sampled_ids_at_the_sampling_temperature():
    model, proc = policy()
    trajs = rollouts(HFBackend(model, proc), max_turns=3)
    assert max(t.n_turns for t in trajs) >= 2  # malformed turns get an error observation and another turn
    check(model, proc, trajs)
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    cut = [t for t in trajs if any(m["role"] == "assistant" and m["token_ids"][-1] != im_end for m in t.messages)]
    assert cut, "no turn was cut by the budget"
    for t in cut:  # the <|im_end|> closing a cut turn is context (mask 0), never trained
        ex = sampled_example(t, proc)
        assert any(int(i) == im_end and not int(m) for i, m in zip(ex.input_ids, ex.loss_mask))
    # what the fix changed: a re-rendering of the text trains other tokens than the sampled ones
    retok = [render([{k: v for k, v in m.items() if k != "token_ids"} for m in t.messages], proc) for t in trajs]
    assert any(r.input_ids[r.loss_mask.bool()].tolist() != t.token_ids for r, t in zip(retok, trajs))
    # and log-probs at temperature 1 are not the rollout's
    gaps = [float((lp - torch.tensor(t.logprobs)).abs().max()) for t, lp in
            zip(trajs, trainer_logps(model, proc, trajs, 1.0))]
    assert max(gaps) > 1e-2


def test_openai_backend_on_mars_serve_returns_the_sampled_ids_and_logprobs():
    model, proc = policy()
    with serve_app(create_app(HFBackend(model, proc), "tiny")) as url:
        backend = OpenAIBackend(url, "tiny", token_ids=True)
        trajs = rollouts(backend, max_turns=1)
        assert not backend.errors
    assert all(t.token_ids is not None for t in trajs)
    check(model, proc, trajs)


def test_the_observation_after_the_last_turn_is_not_in_the_example():
    model, proc = policy()
    trajs = rollouts(HFBackend(model, proc), max_turns=1)  # malformed turns: an error observation follows
    t = next(t for t in trajs if t.messages[-1]["role"] == "user")
    ex = sampled_example(t, proc)
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    nl = proc.tokenizer.encode("\n", add_special_tokens=False)
    # the example ends with the assistant turn (its closing <|im_end|> and newline), not with the observation
    assert ex.input_ids[-1 - len(nl)].item() == im_end and ex.input_ids[-len(nl):].tolist() == nl
    assert len(ex.input_ids) < len(render(t.messages, proc).input_ids)


def test_sampled_example_refuses_a_turn_without_its_ids():
    model, proc = policy()
    trajs = rollouts(HFBackend(model, proc), max_turns=1)
    t = trajs[0]
    t.messages = [{k: v for k, v in m.items() if k != "token_ids"} for m in t.messages]
    t.token_ids = [*t.token_ids, 7]
    with pytest.raises(RuntimeError, match="trained ids are not the"):
        sampled_example(t, proc)
