"""HFBackend: batched greedy generation equals one-at-a-time; logprobs, stop strings and budgets."""

from __future__ import annotations

import math

import pytest
import torch

from mars.agent.hf_backend import Generation, HFBackend
from mars.model.build import build_model, tiny_config
from tests.model.test_model import image
from tests.model.test_model import tiny_stack as _tiny_stack

_M: dict = {}


def tiny_stack(arch: str = "qwen2_5_vl"):
    """Like the shared stack, but with weights scaled up so a random model's greedy output is not one repeated token."""
    if arch not in _M:
        from mars.model.processor import build_processor

        tok, proc, _ = _tiny_stack()
        if arch != "qwen2_5_vl":
            proc = build_processor(tok, proc.min_pixels, proc.max_pixels, arch=arch)
        model = build_model(tiny_config(len(tok), arch=arch), seed=1)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.add_(torch.randn(p.shape, generator=g) * 0.08)
        _M[arch] = (tok, proc, model)
    return _M[arch]


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


def _grow(dl: list[list[dict]], gens: list[Generation], turn: int) -> None:
    """Append each reply and a tool turn; every other dialogue gets a tool image (a crop) of its own size."""
    for i, (d, g) in enumerate(zip(dl, gens)):
        d.append({"role": "assistant", "content": g.text})
        content = [{"type": "text", "text": f"<tool_response>\nresult {turn}\n</tool_response>"}]
        if (i + turn) % 2:
            content.append({"type": "image", "image": image(30 + 7 * i + turn, (56 + 14 * (i % 3), 84))})
        d.append({"role": "tool", "content": content})


def _same(a: list[Generation], b: list[Generation], tol: float = 1e-4) -> None:
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.text for g in a] == [g.text for g in b]
    assert [g.finish_reason for g in a] == [g.finish_reason for g in b]
    for x, y in zip(a, b):
        assert len(x.logprobs) == len(y.logprobs)
        assert all(abs(p - q) < tol for p, q in zip(x.logprobs, y.logprobs))


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_episode_cache_over_turns_equals_uncached_generation(arch):
    """Three turns on growing dialogues (tool images in later turns, a repeated dialogue, two dialogues that differ
    only in the pixels of a same-size image): reusing each dialogue's keys/values gives the same tokens and
    log-probs as a fresh backend without the episode cache (plain ``model.generate``). Qwen3-VL too: its DeepStack
    features enter the first LM layer at the image positions of the uncached suffix only."""
    from mars.agent.protocol import system_prompt
    from mars.tools.base import TOOL_SCHEMAS

    _, proc, model = tiny_stack(arch)
    sp = system_prompt(TOOL_SCHEMAS)
    q = "what year was it founded?"
    base = [
        [{"role": "system", "content": sp},
         {"role": "user", "content": [{"type": "image", "image": image(1)}, {"type": "text", "text": q}]}],
        [{"role": "system", "content": sp},
         {"role": "user", "content": [{"type": "image", "image": image(2)}, {"type": "text", "text": q}]}],
        [{"role": "system", "content": sp},
         {"role": "user", "content": [{"type": "image", "image": image(1)}, {"type": "text", "text": q}]}],
        [{"role": "system", "content": sp}, {"role": "user", "content": "the cat sat on the mat"}],
        [{"role": "user", "content": "no system prompt here"}],
    ]
    on, off = HFBackend(model, proc), HFBackend(model, proc, episode_cache=False)
    dl_on = [list(d) for d in base]
    dl_off = [list(d) for d in base]
    for turn in range(3):
        a = on.generate(dl_on, max_new_tokens=9, stop=())
        if turn:
            assert on.last_stats["cached_tokens"] > on.last_stats["prefilled_tokens"]  # the cache was used
        b = HFBackend(model, proc, episode_cache=False).generate(dl_off, max_new_tokens=9, stop=())
        _same(a, b)
        _grow(dl_on, a, turn)
        _grow(dl_off, b, turn)
    # a sub-batch in another order, one dialogue one turn further: still the same as without the cache
    sub = [dl_on[3], dl_on[0]]
    _same(on.generate(sub, max_new_tokens=9, stop=()), off.generate(sub, max_new_tokens=9, stop=()))


def test_episode_cache_stop_strings_sampling_and_eviction():
    tok, proc, model = tiny_stack()
    dl = dialogues()
    ref = HFBackend(model, proc, episode_cache=False).generate(dl, max_new_tokens=10, stop=())
    stops = tuple({tok.decode(g.token_ids[2:3]) for g in ref if len(g.token_ids) > 3} - {""})
    small = HFBackend(model, proc, max_cache_tokens=150)  # evicts: at most 150 cached tokens
    for _ in range(2):
        a = small.generate(dl, max_new_tokens=10, stop=stops)
        b = HFBackend(model, proc, episode_cache=False).generate(dl, max_new_tokens=10, stop=stops)
        _same(a, b)
        assert small._cached_tokens <= 150
        _grow(dl, a, 1)
    s1 = HFBackend(model, proc).generate(dl, max_new_tokens=5, temperature=1.0, top_p=0.9, seed=3, stop=())
    s2 = HFBackend(model, proc).generate(dl, max_new_tokens=5, temperature=1.0, top_p=0.9, seed=3, stop=())
    assert [g.token_ids for g in s1] == [g.token_ids for g in s2]
    assert all(len(g.logprobs) == len(g.token_ids) <= 5 for g in s1)


def test_run_episodes_with_episode_cache_equals_uncached():
    """The engine's multi-turn loop (one ``generate`` per step over all unfinished episodes) gives the same
    trajectories with and without the episode cache, and with one episode in play at a time; finished episodes'
    cache entries are released."""
    from dataclasses import replace

    from mars.agent.engine import EngineConfig, run_episodes
    from mars.tools.base import Observation

    class Tools:
        def call(self, name, arguments, images):
            return Observation(text="nothing found", images=[image(5, (70, 70))])

    _, proc, model = tiny_stack()
    qs = [{"question": f"which guild {i}?", "answer": "x", "image": image(40 + i % 2)} for i in range(3)]
    cfg = EngineConfig(max_turns=3, max_new_tokens_per_turn=8, min_pixels=28 * 28, max_pixels=56 * 56)
    on = run_episodes(qs, HFBackend(model, proc), Tools(), cfg)
    off = run_episodes(qs, HFBackend(model, proc, episode_cache=False), Tools(), cfg)
    assert [t.token_ids for t in on] == [t.token_ids for t in off]
    assert [t.n_turns for t in on] == [t.n_turns for t in off] and all(t.n_turns == 3 for t in on)
    for a, b in zip(on, off):
        assert all(abs(x - y) < 1e-4 for x, y in zip(a.logprobs, b.logprobs))
    be = HFBackend(model, proc)
    one = run_episodes(qs, be, Tools(), replace(cfg, max_live_episodes=1))
    assert [t.token_ids for t in one] == [t.token_ids for t in on]
    assert not be._entries and be._cached_tokens == 0 and not be._owner  # every finished episode released


def test_release_keeps_an_entry_another_live_dialogue_shares():
    """Two live dialogues with the same tokens (greedy samples of one question) share one cache entry: releasing one
    keeps it for the other; releasing both drops it."""
    _, proc, model = tiny_stack()
    be = HFBackend(model, proc)
    a, b = dialogues()[3], dialogues()[3]
    ga, gb = be.generate([a, b], max_new_tokens=6, stop=())
    assert ga.token_ids == gb.token_ids and len(be._entries) == 1 and len(be._owner) == 2
    be.release([a])
    assert len(be._entries) == 1 and be._cached_tokens > 0 and list(be._owner) == [id(b)]
    be.release([b])
    assert not be._entries and be._cached_tokens == 0 and not be._owner
