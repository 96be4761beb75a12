"""HFBackend: batched greedy generation equals one-at-a-time; logprobs, stop strings and budgets."""

from __future__ import annotations

import math

import torch

from mars.agent.hf_backend import Generation, HFBackend
from mars.model.build import build_model, tiny_config
from tests.model.test_model import image
from tests.model.test_model import tiny_stack as _tiny_stack

_M: dict = {}


def tiny_stack():
    """Like the shared stack, but with weights scaled up so a random model's greedy output is not one repeated token."""
    if "m" not in _M:
        tok, proc, _ = _tiny_stack()
        model = build_model(tiny_config(len(tok)), seed=1)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.add_(torch.randn(p.shape, generator=g) * 0.08)
        _M["m"] = (tok, proc, model)
    return _M["m"]


def dialogues():
    return [
        [{"role": "user", "content": [{"type": "image", "image": image(10)}, {"type": "text", "text": "what year?"}]}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat on the mat"}],
        [{"role": "user", "content": [{"type": "text", "text": "crop"}, {"type": "image", "image": image(11, (90, 200))}]}],
        [{"role": "user", "content": "guild founded year city red frame crop search answer"}],
    ]


def test_batched_greedy_equals_single():
    _, proc, model = tiny_stack()
    be = HFBackend(model, proc)
    batch = be.generate(dialogues(), max_new_tokens=12, stop=())
    singles = [be.generate([d], max_new_tokens=12, stop=())[0] for d in dialogues()]
    assert [g.text for g in batch] == [g.text for g in singles]
    assert [g.token_ids for g in batch] == [g.token_ids for g in singles]
    for g, s in zip(batch, singles):
        assert isinstance(g, Generation)
        assert len(g.logprobs) == len(g.token_ids) and 1 <= len(g.token_ids) <= 12
        assert all(math.isfinite(x) and x <= 0 for x in g.logprobs)
        assert all(abs(a - b) < 1e-3 for a, b in zip(g.logprobs, s.logprobs))
        assert g.finish_reason in ("stop", "length")
        if g.finish_reason == "length":
            assert len(g.token_ids) == 12


def test_budget_and_sampling_seed():
    _, proc, model = tiny_stack()
    be = HFBackend(model, proc)
    gs = be.generate(dialogues(), max_new_tokens=3, temperature=1.0, top_p=0.9, seed=7, stop=())
    again = be.generate(dialogues(), max_new_tokens=3, temperature=1.0, top_p=0.9, seed=7, stop=())
    assert [g.token_ids for g in gs] == [g.token_ids for g in again]
    for g in gs:
        assert len(g.token_ids) <= 3 and len(g.logprobs) == len(g.token_ids)
        assert all(math.isfinite(x) for x in g.logprobs)


def test_stop_strings_respected():
    tok, proc, model = tiny_stack()
    be = HFBackend(model, proc)
    base = be.generate(dialogues(), max_new_tokens=10, stop=())
    # choose, per dialogue, a stop string that the greedy output is known to contain (its 3rd token's text)
    checked = 0
    for d, g in zip(dialogues(), base):
        if len(g.token_ids) < 4:
            continue
        s = tok.decode(g.token_ids[2:3])
        if not s.strip() or s not in g.text:
            continue
        out = be.generate([d], max_new_tokens=10, stop=(s,))[0]
        assert out.finish_reason == "stop"
        assert out.text.endswith(s) and out.text.count(s) == 1 and g.text.startswith(out.text)
        assert len(out.token_ids) <= 3 and len(out.logprobs) == len(out.token_ids)
        checked += 1
    assert checked >= 1


def test_shared_prefix_cache_gives_the_same_output_as_left_padding():
    """Rows sharing a long system prompt reuse its KV cache; greedy output and log-probs are unchanged."""
    from mars.agent.protocol import system_prompt
    from mars.tools.base import TOOL_SCHEMAS

    _, proc, model = tiny_stack()
    sp = system_prompt(TOOL_SCHEMAS)
    dl = [[{"role": "system", "content": sp}, *d] for d in dialogues()]
    cached = HFBackend(model, proc)  # min_prefix 32: the system prompt is cached
    plain = HFBackend(model, proc, min_prefix=10**9)  # never: plain left padding
    first = cached.generate(dl, max_new_tokens=8, stop=())
    assert cached._prefix is not None and len(cached._prefix[0]) > 100
    again = cached.generate(dl[1:], max_new_tokens=8, stop=())  # a smaller batch reuses the same cache
    ref = plain.generate(dl, max_new_tokens=8, stop=())
    assert plain._prefix is None
    assert [g.token_ids for g in first] == [g.token_ids for g in ref]
    assert [g.token_ids for g in again] == [g.token_ids for g in ref[1:]]
    for a, b in zip(first, ref):
        assert all(abs(x - y) < 1e-3 for x, y in zip(a.logprobs, b.logprobs))
