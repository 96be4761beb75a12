"""DeepSpeed ZeRO stepper vs the plain torch stepper: one optimizer step on the tiny Qwen-VL, CPU, one process.

Needs ``deepspeed`` (installed by ``make setup``); skipped with a reason only where it cannot be imported.
Start-up is a few seconds: the stepper keeps DeepSpeed from JIT-compiling its shm all-reduce op on one CPU rank.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from mars.model.chat import render
from mars.train.optim import OptimConfig, TorchStepper
from tests.model.test_model import image, tiny_stack

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (make setup installs it)")

# Constant lr, no warm-up, weight decay on, clipping low enough to be active on a random-init model.
CFG = dict(lr=2e-3, vision_lr=1e-2, weight_decay=0.1, warmup_steps=0, schedule="constant", clip_norm=0.5)


def dialogues() -> list[list[dict]]:
    return [
        [{"role": "user", "content": [{"type": "image", "image": image(3)}, {"type": "text", "text": "what year?"}]},
         {"role": "assistant", "content": "<think>zoom on the red frame</think>the guild founded 1987."}],
        [{"role": "user", "content": "find the city"},
         {"role": "assistant", "content": "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>"},
         {"role": "tool", "content": "the cat city 1955"},
         {"role": "assistant", "content": "the city is red 1955."}],
    ]


def masked_ce(model: torch.nn.Module, r) -> torch.Tensor:
    """Next-token cross-entropy on the assistant (loss_mask) positions."""
    logits = model(**r.model_inputs()).logits[0, :-1].float()
    target, mask = r.input_ids[1:], r.loss_mask[1:].bool()
    return F.cross_entropy(logits[mask], target[mask])


def one_step(stepper, rendered) -> tuple[float, list[float]]:
    """One optimizer update over two accumulated backwards (the trainers' pattern); losses averaged by hand."""
    stepper.zero_grad()
    losses = []
    for r in rendered:
        loss = masked_ce(stepper.module, r)
        stepper.backward(loss / len(rendered))
        losses.append(float(loss.detach()))
    return stepper.step(), losses


def test_zero2_step_matches_torch_stepper():
    _, proc, base = tiny_stack()
    rendered = [render(d, proc) for d in dialogues()]
    assert all(int(r.loss_mask.sum()) > 0 for r in rendered)
    before = {k: v.detach().clone() for k, v in base.named_parameters()}

    ref_model = copy.deepcopy(base).train()
    ref = TorchStepper(ref_model, OptimConfig(**CFG))
    ref_norm, ref_losses = one_step(ref, rendered)

    from mars.train.ds import DeepSpeedStepper

    ds_model = copy.deepcopy(base).train()
    ds = DeepSpeedStepper(ds_model, OptimConfig(**CFG, deepspeed_stage=2))
    assert os.environ.get("DS_ACCELERATOR") == "cpu" or torch.cuda.is_available()
    assert ds.lrs() == ref.lrs() == {"language": 2e-3, "language_no_decay": 2e-3, "vision": 1e-2,
                                     "vision_no_decay": 1e-2}
    ds_norm, ds_losses = one_step(ds, rendered)

    assert all(torch.isfinite(torch.tensor(ds_losses))) and ds_losses == pytest.approx(ref_losses, rel=1e-6)
    assert ds_norm > CFG["clip_norm"], "clipping should be active in this test"
    assert ds_norm == pytest.approx(ref_norm, rel=1e-5)
    ref_p, ds_p = dict(ref_model.named_parameters()), dict(ds.module.named_parameters())
    moved = max((ds_p[k].detach() - before[k]).abs().max().item() for k in before)
    assert moved > 1e-4, "parameters did not change"
    # The first AdamW step moves each weight by about lr * m/sqrt(v) (|.| <= ~1 lr). Both steppers run the same fp32
    # math; only summation order differs (ZeRO's flat buffers, its norm reduction), so the updates may differ by
    # float32 rounding, amplified where |grad| is near AdamW's eps. Tolerance: 1e-3 of the lr, relative 1e-3.
    for k, b in before.items():
        d_ds, d_ref = ds_p[k].detach() - b, ref_p[k].detach() - b
        lr = CFG["vision_lr"] if ".visual." in f".{k}" else CFG["lr"]
        torch.testing.assert_close(d_ds, d_ref, rtol=1e-3, atol=1e-3 * lr, msg=lambda m, k=k: f"{k}: {m}")

    # Resume round trip of the optimizer state (same stage and world size).
    state = ds.state_dict()
    ds.load_state_dict(state)
    assert ds.lrs() == ref.lrs()
