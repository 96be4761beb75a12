"""``length_split``: a batch run as sub-batches of similar length (mars.train.data.length_chunks) gives the same
training run as whole batches, with less padding."""

from __future__ import annotations

import copy

import pytest
import torch

from mars.model.chat import render
from mars.train.data import length_chunks
from mars.train.optim import OptimConfig
from mars.train.sft import SFTConfig, train_sft
from tests.model.test_model import tiny_stack
from tests.train.test_deepspeed import dialogues


def test_length_chunks_orders_longest_first_and_cuts_near_equal_runs():
    lengths = [5, 300, 40, 310, 50, 40, 7]
    assert length_chunks([0, 1, 2, 3, 4], lengths, 2) == [[3, 1, 4], [2, 0]]
    # ties keep the batch's order (stable); 7 into 3 runs: 3, 2, 2
    assert length_chunks(list(range(7)), lengths, 3) == [[3, 1, 4], [2, 5], [6, 0]]
    assert length_chunks([6, 2], lengths, 5) == [[2], [6]]  # never more runs than examples
    assert length_chunks([4, 1], lengths, 1) == [[1, 4]]
    assert length_chunks([], lengths, 2) == []
    with pytest.raises(ValueError, match="k must be >= 1, got 0"):
        length_chunks([0], lengths, 0)
    # padding: one batch of 7 pads every example to 310 (2170 tokens); three runs pad to 310, 40 and 7 (1024)
    runs = length_chunks(list(range(7)), lengths, 3)
    assert sum(len(r) * max(lengths[i] for i in r) for r in runs) == 3 * 310 + 2 * 40 + 2 * 7 == 1024


def mixed_length_examples(proc) -> list:
    """Six dialogues of 4 lengths (two with an image), so a batch of six pads a lot when whole."""
    base = dialogues()
    texts = [[{"role": "user", "content": "find the city " + "north " * n},
              {"role": "assistant", "content": "the city is red " + "1955 " * (n // 2)}] for n in (1, 9, 30, 60)]
    return [render(d, proc) for d in base + texts]


def test_split_batches_train_the_same_run_as_whole_ones(tmp_path):
    """The loss of every sub-batch is divided by the label tokens of the whole batch, so the summed gradient is the
    whole batch's: 4 steps at length_split 1, 2 and 4 give the same losses and weights to float rounding."""
    _, proc, base = tiny_stack()
    examples = mixed_length_examples(proc)
    assert len({len(e.input_ids) for e in examples}) >= 5
    runs = {}
    for k in (1, 2, 4):
        model = copy.deepcopy(base)
        cfg = SFTConfig(optim=OptimConfig(lr=2e-3, warmup_steps=0, schedule="constant", max_steps=4),
                        batch_size=6, checkpoint_every=100, seed=1, length_split=k)
        res = train_sft(model, examples, cfg, pad_id=proc.tokenizer.pad_token_id, ckpt_dir=tmp_path / str(k),
                        live_dir=None, fp="f")
        runs[k] = ([l for _, l in res["history"]], model.state_dict())
    whole_losses, whole_state = runs[1]
    assert whole_losses[-1] < whole_losses[0]  # it trains
    # weights to 5e-5: Adam divides by the root of the squared-gradient average, so a parameter whose gradient is
    # near zero turns the split's rounding into a visible step (measured on an AMD EPYC: one of 61,056 embedding
    # weights 1.07e-5 apart at k=4, every other one under 1e-5); a wrong split moves weights by ~lr (2e-3) a step
    for k in (2, 4):
        losses, state = runs[k]
        assert losses == pytest.approx(whole_losses, rel=1e-5)
        for name, w in whole_state.items():
            assert torch.allclose(state[name], w, atol=5e-5), (k, name)
    with pytest.raises(ValueError, match="length_split must be >= 1"):
        SFTConfig(length_split=0)
