"""Tests of the PPO/GRPO token-level and GSPO sequence-level losses; golden values derived by hand in comments."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import mars.rl.losses as losses_mod
from mars.rl.losses import (
    entropy_from_logits,
    kl_penalty,
    loss_normalizer,
    masked_mean,
    microbatch_weight,
    policy_loss,
)

CLIP = {"clip_low": 0.2, "clip_high": 0.28}  # ratio kept in [0.8, 1.28]
LN = math.log
NAN, INF = float("nan"), float("inf")


def run(logp, old, adv, mask, **kw):
    """policy_loss on a fresh leaf copy of logp; returns (loss, stats, grad of logp)."""
    lp = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(lp, old, adv, mask, **kw)
    loss.backward()
    return loss.detach(), stats, lp.grad


def test_doctests():
    res = doctest.testmod(losses_mod)
    assert res.attempted > 0 and res.failed == 0


# ---------------------------------------------------------------- token level, N=2, T=3
# row 0: A = +1, log ratios [ln 1.5, ln 0.5, 0], mask [1, 1, 1] -> ratios 1.5, 0.5, 1.0
#   t0: max(-1.5, -clip(1.5)=-1.28) = -1.28   (clipped high: A > 0 and 1.5 > 1.28 -> zero gradient)
#   t1: max(-0.5, -clip(0.5)=-0.8)  = -0.5    (unclipped: pessimistic min picks the raw ratio)
#   t2: max(-1, -1) = -1
# row 1: A = -1, log ratios [ln 0.5, ln 1.2, garbage], mask [1, 1, 0]
#   t0: max(0.5, clip(0.5)=0.8) = 0.8         (clipped low: A < 0 and 0.5 < 0.8 -> zero gradient)
#   t1: max(1.2, 1.2) = 1.2                    (1.2 inside [0.8, 1.28])
# sum = -1.28 - 0.5 - 1 + 0.8 + 1.2 = -0.78 over 5 tokens -> loss = -0.156
# clip_frac 2/5 = 0.4 (high 0.2, low 0.2); ratio_mean (1.5 + 0.5 + 1 + 0.5 + 1.2) / 5 = 0.94
# approx_kl k3 = r - 1 - ln r: 1.5 -> 0.5 - 0.405465 = 0.094535; 0.5 -> -0.5 + 0.693147 = 0.193147 (twice);
#   1 -> 0; 1.2 -> 0.2 - 0.182322 = 0.017678; sum 0.498507 / 5 = 0.099701
# gradient d loss / d logp_t = -A * ratio_t / 5 where unclipped, else 0:
#   row 0: [0, -0.5/5 = -0.1, -1/5 = -0.2]; row 1: [0, +1.2/5 = 0.24, 0 (masked)]
TOK_OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, NAN]])
TOK_LR = torch.tensor([[LN(1.5), LN(0.5), 0.0], [LN(0.5), LN(1.2), 0.0]])
TOK_LOGP = TOK_OLD + TOK_LR
TOK_LOGP[1, 2] = -INF
TOK_ADV = torch.tensor([1.0, -1.0])
TOK_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_token_level_golden():
    loss, st, grad = run(TOK_LOGP, TOK_OLD, TOK_ADV, TOK_MASK, level="token", **CLIP)
    assert loss.item() == pytest.approx(-0.156, abs=1e-6)
    assert st["loss"] == pytest.approx(-0.156, abs=1e-6)
    assert st["clip_frac"] == pytest.approx(0.4)
    assert st["clip_frac_high"] == pytest.approx(0.2)
    assert st["clip_frac_low"] == pytest.approx(0.2)
    assert st["ratio_mean"] == pytest.approx(0.94, abs=1e-6)
    assert st["ratio_min"] == pytest.approx(0.5, abs=1e-6)
    assert st["ratio_max"] == pytest.approx(1.5, abs=1e-6)
    assert st["approx_kl"] == pytest.approx(0.498507 / 5, abs=1e-6)
    assert st["n_tokens"] == 5.0 and st["n_seqs"] == 2.0
    assert all(isinstance(v, float) for v in st.values())
    assert torch.allclose(grad, torch.tensor([[0.0, -0.1, -0.2], [0.0, 0.24, 0.0]]), atol=1e-6)


# ---------------------------------------------------------------- sequence level (GSPO), N=2, T=3
# row 0: A = +1, mask [1, 1, 0], log ratios [0.3, -0.1, garbage] -> mean (0.3 - 0.1) / 2 = 0.1,
#   s_0 = e^0.1 = 1.105171 inside [0.8, 1.28] -> unclipped; every token loss -1.105171, sequence mean -1.105171
#   (token level would have clipped t0: e^0.3 = 1.3499 > 1.28 -- GSPO looks at the sequence ratio only)
# row 1: A = -1, mask [1, 1, 1], log ratios [-0.6, -0.3, -0.3] -> mean -0.4, s_1 = e^-0.4 = 0.670320 < 0.8
#   -> max(0.670320, 0.8) = 0.8, clipped low (A < 0), sequence mean 0.8
# loss = (-1.105171 + 0.8) / 2 = -0.152585; clip_frac 1/2 (low 1/2, high 0); ratio_mean (1.105171 + 0.670320) / 2
# gradient: row 0 unclipped, d/dlogp_t = -A * s_0 / |y_0| / n_seq = -1.105171 / 2 / 2 = -0.276293 on t0, t1;
#   row 1 clipped -> 0; masked positions 0
SEQ_OLD = torch.tensor([[-0.9, -1.3, INF], [-2.0, -0.4, -1.1]])
SEQ_LR = torch.tensor([[0.3, -0.1, 0.0], [-0.6, -0.3, -0.3]])
SEQ_LOGP = SEQ_OLD + SEQ_LR
SEQ_LOGP[0, 2] = NAN
SEQ_ADV = torch.tensor([1.0, -1.0])
SEQ_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_sequence_level_golden():
    loss, st, grad = run(SEQ_LOGP, SEQ_OLD, SEQ_ADV, SEQ_MASK, level="sequence", **CLIP)
    e1, em4 = math.exp(0.1), math.exp(-0.4)
    assert loss.item() == pytest.approx((-e1 + 0.8) / 2, abs=1e-6)
    assert st["clip_frac"] == pytest.approx(0.5)
    assert st["clip_frac_low"] == pytest.approx(0.5)
    assert st["clip_frac_high"] == 0.0
    assert st["ratio_mean"] == pytest.approx((e1 + em4) / 2, abs=1e-6)
    assert st["n_tokens"] == 5.0 and st["n_seqs"] == 2.0
    g0 = -e1 / 2 / 2
    assert torch.allclose(grad, torch.tensor([[g0, g0, 0.0], [0.0, 0.0, 0.0]]), atol=1e-6)


def test_sequence_level_clip_high_direction():
    # A = +1 with s = e^0.5 = 1.6487 > 1.28 -> clipped high, loss -1.28, zero gradient;
    # A = -1 with the same s is NOT clipped (pessimistic max picks -A*s = 1.6487), gradient -A*s/|y|/n = 1.6487/2/2
    logp = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    old = torch.zeros(2, 2)
    loss, st, grad = run(logp, old, torch.tensor([1.0, -1.0]), torch.ones(2, 2), level="sequence", **CLIP)
    s = math.exp(0.5)
    assert loss.item() == pytest.approx((-1.28 + s) / 2, abs=1e-6)
    assert st["clip_frac"] == 0.5 and st["clip_frac_high"] == 0.5 and st["clip_frac_low"] == 0.0
    assert torch.allclose(grad, torch.tensor([[0.0, 0.0], [s / 4, s / 4]]), atol=1e-6)


def _random_batch(seed: int, n: int = 6, t: int = 7, scale: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3
    logp = old + torch.randn(n, t, generator=g) * scale
    adv = torch.randn(n, generator=g)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    return logp, old, adv, mask


def test_sequence_gradient_matches_hand_formula_when_unclipped():
    logp, old, adv, mask = _random_batch(1, scale=0.2)
    wide = {"clip_low": 0.99, "clip_high": 100.0}  # nothing gets clipped
    loss, st, grad = run(logp, old, adv, mask, level="sequence", **wide)
    assert st["clip_frac"] == 0.0
    m = mask.bool()
    length = mask.sum(1).float()  # |y_i|
    s = torch.exp(torch.where(m, logp - old, 0.0).sum(1) / length)  # s_i
    n = logp.shape[0]
    # d loss / d logp_it = -A_i * s_i / (|y_i| * n_seq) on model tokens, 0 elsewhere
    expected = torch.where(m, (-adv * s / (length * n))[:, None].expand_as(logp), 0.0)
    assert torch.allclose(grad, expected, atol=1e-6)
    # and it equals the gradient of the plain sequence objective mean_i(-A_i * s_i(theta)) (GSPO eq.)
    lp = logp.clone().requires_grad_(True)
    direct = (-adv * torch.exp(torch.where(m, lp - old, 0.0).sum(1) / length)).mean()
    direct.backward()
    assert torch.allclose(grad, lp.grad, atol=1e-6)
    assert loss.item() == pytest.approx(direct.item(), abs=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_ratio_one(level):
    logp, _, adv, mask = _random_batch(2)
    loss, st, grad = run(logp, logp.clone(), adv, mask, level=level, **CLIP)
    assert st["clip_frac"] == 0.0 and st["clip_frac_low"] == 0.0 and st["clip_frac_high"] == 0.0
    assert st["ratio_mean"] == pytest.approx(1.0) and st["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    length = mask.sum(1).float()
    if level == "sequence":
        expected = -adv.mean()  # every s_i = 1, each sequence's token mean is -A_i
    else:
        expected = (-adv * length).sum() / length.sum()  # token mean of -A
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_garbage_under_mask_does_not_leak(level):
    logp, old, adv, mask = _random_batch(3, scale=0.4)
    clean_loss, clean_st, clean_grad = run(logp, old, adv, mask, level=level, **CLIP)
    m = mask.bool()
    pattern = torch.tensor([NAN, INF, -INF, 1e30, -1e30, 7.0, NAN]).expand_as(logp)
    dirty_logp = torch.where(m, logp, pattern)
    dirty_old = torch.where(m, old, pattern.flip(1))
    loss, st, grad = run(dirty_logp, dirty_old, adv, mask, level=level, **CLIP)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert loss.item() == clean_loss.item()
    assert torch.equal(grad, clean_grad)
    assert (grad[~m] == 0).all()
    assert st == clean_st


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_right_padding_changes_nothing(level):
    logp, old, adv, mask = _random_batch(4, scale=0.4)
    loss, st, grad = run(logp, old, adv, mask, level=level, **CLIP)
    pad = torch.full((logp.shape[0], 5), NAN)
    loss_p, st_p, grad_p = run(
        torch.cat([logp, pad], 1), torch.cat([old, pad], 1), adv, torch.cat([mask, torch.zeros_like(pad).long()], 1),
        level=level, **CLIP,
    )
    assert loss_p.item() == pytest.approx(loss.item(), abs=1e-7)
    assert st_p["ratio_mean"] == pytest.approx(st["ratio_mean"], abs=1e-7)
    assert st_p["clip_frac"] == st["clip_frac"]
    assert torch.allclose(grad_p[:, : logp.shape[1]], grad, atol=1e-7)
    assert (grad_p[:, logp.shape[1]:] == 0).all()


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_microbatch_accumulation_matches_full_batch(level):
    logp, old, adv, mask = _random_batch(5, n=7, scale=0.4)
    mask[3] = 0  # one sequence without model tokens: excluded from the sequence count
    full_loss, _, full_grad = run(logp, old, adv, mask, level=level, **CLIP)
    total = loss_normalizer(mask, level)
    assert total == (6.0 if level == "sequence" else float(mask.sum()))
    splits = [(0, 2), (2, 3), (3, 4), (4, 7)]  # includes a micro-batch whose only sequence is empty

    # (a) weight default-normalised micro losses by microbatch_weight
    lp = logp.clone().requires_grad_(True)
    acc = 0.0
    for a, b in splits:
        loss, _ = policy_loss(lp[a:b], old[a:b], adv[a:b], mask[a:b], level=level, **CLIP)
        w = microbatch_weight(mask[a:b], level, total)
        (loss * w).backward()
        acc += loss.item() * w
    assert acc == pytest.approx(full_loss.item(), abs=1e-6)
    assert torch.allclose(lp.grad, full_grad, atol=1e-6)

    # (b) pass the full batch's normalizer to every micro-batch and sum
    lp = logp.clone().requires_grad_(True)
    acc = 0.0
    for a, b in splits:
        loss, _ = policy_loss(lp[a:b], old[a:b], adv[a:b], mask[a:b], level=level, normalizer=total, **CLIP)
        loss.backward()
        acc += loss.item()
    assert acc == pytest.approx(full_loss.item(), abs=1e-6)
    assert torch.allclose(lp.grad, full_grad, atol=1e-6)


def test_microbatch_weight_values():
    m = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    assert loss_normalizer(m, "token") == 5.0 and loss_normalizer(m, "sequence") == 2.0
    assert microbatch_weight(m, "token", 20) == 0.25
    assert microbatch_weight(m, "sequence", 8.0) == 0.25
    with pytest.raises(ValueError):
        microbatch_weight(m, "token", 0)
    with pytest.raises(ValueError):
        loss_normalizer(m, "word")


def test_empty_sequences_excluded_and_all_empty_is_zero_with_grad():
    logp = torch.tensor([[-0.5, -0.5], [NAN, NAN]])
    old = torch.tensor([[-0.5, -0.5], [INF, -INF]])
    mask = torch.tensor([[1, 1], [0, 0]])
    loss, st, grad = run(logp, old, torch.tensor([2.0, NAN]), mask, level="sequence", **CLIP)
    # only row 0 counts: ratio 1, loss -A_0 = -2; gradient -A * 1 / |y| / n_seq = -2 / 2 / 1 = -1
    assert loss.item() == pytest.approx(-2.0) and st["n_seqs"] == 1.0
    assert torch.allclose(grad, torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))
    for level in ("token", "sequence"):
        lp = torch.full((2, 3), NAN, requires_grad=True)
        loss, st = policy_loss(lp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3), level=level, **CLIP)
        assert loss.item() == 0.0 and loss.grad_fn is not None
        loss.backward()
        assert (lp.grad == 0).all()
        assert st["clip_frac"] == 0.0 and st["ratio_mean"] == 0.0 and st["n_seqs"] == 0.0


def test_bad_arguments_rejected():
    lp, old, adv, mask = TOK_LOGP, TOK_OLD, TOK_ADV, TOK_MASK
    with pytest.raises(ValueError, match="token.*sequence"):
        policy_loss(lp, old, adv, mask, level="seq", **CLIP)
    with pytest.raises(ValueError):
        policy_loss(lp, old, adv[:1], mask, level="token", **CLIP)
    with pytest.raises(ValueError):
        policy_loss(lp, old[:, :2], adv, mask, level="token", **CLIP)
    with pytest.raises(ValueError):
        policy_loss(lp, old, adv, mask, level="token", clip_low=1.0, clip_high=0.2)
    with pytest.raises(ValueError):
        policy_loss(lp, old, adv, mask, level="token", normalizer=0.0, **CLIP)
    with pytest.raises(TypeError):
        policy_loss(lp, old, adv, mask, "token", 0.2, 0.28)  # keyword-only


def test_bf16_inputs_compute_in_float32():
    logp = TOK_LOGP.to(torch.bfloat16)
    lp = logp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp, TOK_OLD.to(torch.bfloat16), TOK_ADV, TOK_MASK, level="token", **CLIP)
    assert loss.dtype == torch.float32
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad.float()).all()


# ---------------------------------------------------------------- kl, masked_mean, entropy


def test_kl_penalty():
    logp = torch.tensor([[-1.0, -2.0, NAN]])
    mask = torch.tensor([[1, 1, 0]])
    assert kl_penalty(logp, logp.clone(), mask).item() == 0.0
    # ref - logp = ln 2 -> 2 - 0.693147 - 1 = 0.306853; = -ln 2 -> 0.5 + 0.693147 - 1 = 0.193147; mean 0.25
    ref = logp + torch.tensor([[LN(2.0), -LN(2.0), 0.0]])
    lp = logp.clone().requires_grad_(True)
    kl = kl_penalty(lp, ref, mask)
    assert kl.item() == pytest.approx(0.25, abs=1e-6)
    kl.backward()
    # d/dlogp of exp(d) - d - 1 with d = ref - logp is -(exp(d) - 1) / n_tok: -(2 - 1)/2 = -0.5, -(0.5 - 1)/2 = 0.25
    assert torch.allclose(lp.grad, torch.tensor([[-0.5, 0.25, 0.0]]), atol=1e-6)
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    assert kl_penalty(a, b, torch.ones(4, 5)).item() > 0
    assert kl_penalty(a, b, torch.zeros(4, 5)).item() == 0.0


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, NAN], [4.0, INF, 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # (1 + 2 + 4 + 6) / 4 = 3.25; rows: (1 + 2) / 2 = 1.5, (4 + 6) / 2 = 5; columns: 2.5, 2, 6
    assert masked_mean(x, m).item() == 3.25
    assert masked_mean(x, m, dim=1).tolist() == [1.5, 5.0]
    assert masked_mean(x, m, dim=0).tolist() == [2.5, 2.0, 6.0]
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_entropy_from_logits():
    v = 7
    h = entropy_from_logits(torch.zeros(2, 3, v))
    assert h.shape == (2, 3)
    assert torch.allclose(h, torch.full((2, 3), math.log(v)), atol=1e-6)
    # probs [0.5, 0.25, 0.25, 0]: H = 0.5 ln 2 + 2 * 0.25 ln 4 = 0.346574 + 0.693147 = 1.039721
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25, 0.0]]])).requires_grad_(True)
    h = entropy_from_logits(logits)
    assert h.item() == pytest.approx(0.5 * LN(2) + 0.5 * LN(4), abs=1e-6)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
