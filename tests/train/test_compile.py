"""``sft.compile``: the text decoder layers run through torch.compile during the training steps
(mars.model.build.CompiledTextLayers), the same run as eager to float rounding, the model untouched outside."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch._dynamo.utils import counters

from mars.model.build import CompiledTextLayers, cpp_compiler
from mars.train.optim import OptimConfig
from mars.train.sft import SFTConfig, train_sft
from tests.model.test_model import tiny_stack
from tests.train.test_length_split import mixed_length_examples

pytestmark = pytest.mark.skipif(cpp_compiler() is None, reason="torch.compile's CPU backend needs a C++ compiler")


def _cfg(compile: bool) -> SFTConfig:
    return SFTConfig(optim=OptimConfig(lr=2e-3, warmup_steps=0, schedule="constant", max_steps=4), batch_size=6,
                     checkpoint_every=2, seed=1, length_split=2, compile=compile)


def test_compiled_layers_train_the_same_run_as_eager(tmp_path):
    _, proc, base = tiny_stack()
    examples = mixed_length_examples(proc)
    layer_types = [type(layer) for layer in base.model.language_model.layers]
    keys = list(base.state_dict())
    runs = {}
    for c in (False, True):
        model = copy.deepcopy(base)
        graphs = counters["stats"]["unique_graphs"]
        res = train_sft(model, examples, _cfg(c), pad_id=proc.tokenizer.pad_token_id, ckpt_dir=tmp_path / str(c),
                        live_dir=None, fp="f")
        assert res["compiled"] is c
        # dynamo built graphs only for the compiled run (one per distinct layer call at least)
        assert (counters["stats"]["unique_graphs"] > graphs) is c
        # outside the steps the layers are the model's own again: the same keys in checkpoints, eager generation
        assert [type(layer) for layer in model.model.language_model.layers] == layer_types
        assert list(model.state_dict()) == keys
        last = sorted((tmp_path / str(c)).glob("step-*/state.pt"))[-1]
        assert list(torch.load(last, weights_only=False)["model"]) == keys
        runs[c] = ([l for _, l in res["history"]], model.state_dict())
        ids = torch.tensor([proc.tokenizer("find the city")["input_ids"]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3)
        assert ids.shape[1] < out.shape[1] <= ids.shape[1] + 3
    (eager, w_eager), (comp, w_comp) = runs[False], runs[True]
    assert eager[-1] < eager[0]  # it trains
    assert comp == pytest.approx(eager, rel=1e-4)
    for name, w in w_eager.items():
        assert torch.allclose(w_comp[name], w, atol=1e-4), name


def test_without_a_cpp_compiler_training_runs_eager_and_says_so(tmp_path, monkeypatch, caplog):
    _, proc, base = tiny_stack()
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler on it
    monkeypatch.delenv("CXX", raising=False)
    assert cpp_compiler() is None
    with caplog.at_level(logging.WARNING, logger="mars.model.build"):
        layers = CompiledTextLayers(base)
    assert not layers.enabled
    assert "no C++ compiler" in caplog.text and "sft.compile false" in caplog.text
    before = list(base.model.language_model.layers)
    with layers:
        assert list(base.model.language_model.layers) == before
    model = copy.deepcopy(base)
    res = train_sft(model, mixed_length_examples(proc), _cfg(True), pad_id=proc.tokenizer.pad_token_id,
                    ckpt_dir=tmp_path / "c", live_dir=None, fp="f")
    assert res["compiled"] is False and res["steps"] == 4
