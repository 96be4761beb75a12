"""Tests of the advantage estimators; golden values derived by hand in the comments."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import mars.rl.advantages as adv_mod
from mars.rl.advantages import ESTIMATORS, batch_normalize, batch_scale, compute_advantages, group_advantages

# Two groups of G=4: [1,0,0,1 | 1,1,1,0]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
IDS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
R3 = math.sqrt(3.0)
# group 0: mean 0.5, deviations +-0.5, sum of squares 4 * 0.25 = 1, unbiased var 1/3, std sqrt(1/3) = 0.57735
#          -> A = +-0.5 / sqrt(1/3) = +-sqrt(3)/2 = +-0.866025
# group 1: mean 0.75, deviations 0.25, 0.25, 0.25, -0.75, sum of squares 3 * 0.0625 + 0.5625 = 0.75,
#          unbiased var 0.75 / 3 = 0.25, std 0.5 -> A = 0.5, 0.5, 0.5, -1.5
GRPO_GOLDEN = [R3 / 2, -R3 / 2, -R3 / 2, R3 / 2, 0.5, 0.5, 0.5, -1.5]
# batch step on GRPO_GOLDEN: mean (0 + 0) / 8 = 0; population var (4 * 0.75 + 3 * 0.25 + 2.25) / 8 = 6 / 8 = 0.75,
# std sqrt(0.75) = sqrt(3)/2 -> divide by sqrt(3)/2: group 0 -> +-1, group 1 -> 1/sqrt(3) = 0.57735 (x3), -sqrt(3)
BN_GOLDEN = [1.0, -1.0, -1.0, 1.0, 1 / R3, 1 / R3, 1 / R3, -R3]
# "none": r - group mean -> 0.5, -0.5, -0.5, 0.5 | 0.25, 0.25, 0.25, -0.75
NONE_GOLDEN = [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]


def close(t: torch.Tensor, expected: list[float], tol: float = 1e-5) -> None:
    assert t.dtype == torch.float32
    assert t.shape == (len(expected),)
    assert torch.allclose(t, torch.tensor(expected, dtype=torch.float32), atol=tol, rtol=0), (t.tolist(), expected)


def pop_std(t: torch.Tensor) -> float:
    return float(torch.sqrt(((t - t.mean()) ** 2).mean()))


def test_doctests():
    res = doctest.testmod(adv_mod)
    assert res.attempted > 0 and res.failed == 0


def test_group_advantages_golden():
    close(group_advantages(REWARDS, IDS), GRPO_GOLDEN)


def test_group_advantages_accepts_lists_and_int_rewards():
    close(group_advantages([1, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1, 1]), GRPO_GOLDEN)


def test_group_advantages_eps_enters_denominator():
    # group [0, 2]: mean 1, deviations -+1, unbiased var (1 + 1) / 1 = 2, std sqrt(2); eps=1 -> 1 / (sqrt(2) + 1)
    a = group_advantages(torch.tensor([0.0, 2.0]), torch.tensor([0, 0]), eps=1.0)
    close(a, [-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1)])


def test_degenerate_group_gives_zeros():
    # group 1 all 1.0 -> deviations 0, std 0 -> 0 / (0 + eps) = 0 exactly; group 0 as in GRPO_GOLDEN
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]), IDS)
    close(a, [R3 / 2, -R3 / 2, -R3 / 2, R3 / 2, 0.0, 0.0, 0.0, 0.0])
    assert (a[4:] == 0).all()
    assert (group_advantages(torch.zeros(6), torch.tensor([0, 0, 1, 1, 2, 2])) == 0).all()


def test_non_contiguous_unequal_groups():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 9.0, 0.0, 2.0])
    ids = torch.tensor([7, 3, 7, 3, 7, 3, -1, -1])
    # group 7: [1, 3, 5], mean 3, deviations -2, 0, 2, sum sq 8, var 8 / 2 = 4, std 2 -> -1, 0, 1
    # group 3: [2, 4, 9], mean 5, deviations -3, -1, 4, sum sq 9 + 1 + 16 = 26, var 13, std sqrt(13) = 3.605551
    #          -> -3/sqrt13 = -0.832050, -1/sqrt13 = -0.277350, 4/sqrt13 = 1.109400
    # group -1: [0, 2], mean 1, deviations -1, 1, var 2, std sqrt(2) -> -0.707107, 0.707107
    s13, s2 = math.sqrt(13), math.sqrt(2)
    expected = [-1.0, -3 / s13, 0.0, -1 / s13, 1.0, 4 / s13, -1 / s2, 1 / s2]
    close(group_advantages(rewards, ids), expected)
    # same result as the contiguous layout, permuted back
    perm = torch.tensor([0, 2, 4, 1, 3, 5, 6, 7])
    contiguous = group_advantages(rewards[perm], torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]))
    out = torch.empty(8)
    out[perm] = contiguous
    assert torch.allclose(out, group_advantages(rewards, ids), atol=1e-6)


def test_group_of_one_rejected():
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]))
    for est in ESTIMATORS:
        with pytest.raises(ValueError, match="G >= 2"):
            compute_advantages(torch.tensor([1.0]), torch.tensor([4]), est)


def test_bad_inputs_rejected():
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0, 0]))  # length mismatch
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))  # float labels
    with pytest.raises(ValueError):
        group_advantages(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long))  # not 1-D
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))  # non-finite reward
    with pytest.raises(ValueError):
        batch_normalize(torch.tensor([]))


def test_batch_normalize_golden_population_std():
    # [1, 2, 3, 4]: mean 2.5, population var (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25, std sqrt(1.25) = 1.118034
    # -> -1.5/1.118034 = -1.341641, -0.447214, 0.447214, 1.341641 (unbiased std 1.290994 would give -1.161895 ...)
    s = math.sqrt(1.25)
    a = batch_normalize(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    close(a, [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s])
    assert batch_scale(torch.tensor([1.0, 2.0, 3.0, 4.0])) == pytest.approx(1 / s, rel=1e-6)


def test_batch_normalize_of_group_advantages_golden():
    a = batch_normalize(torch.tensor(GRPO_GOLDEN))
    close(a, BN_GOLDEN)
    assert float(a.mean()) == pytest.approx(0.0, abs=1e-6)
    assert pop_std(a) == pytest.approx(1.0, abs=1e-5)


def test_batch_normalize_includes_degenerate_groups():
    rewards = torch.cat([REWARDS, torch.tensor([1.0, 1.0])])
    ids = torch.cat([IDS, torch.tensor([2, 2])])
    # group advantages GRPO_GOLDEN + [0, 0]; N = 10, mean 0, population var 6 / 10 = 0.6, std sqrt(0.6) = 0.774597
    # -> group 0: (sqrt(3)/2) / sqrt(0.6) = sqrt(1.25) = 1.118034; group 1: 0.5 / 0.774597 = 0.645497,
    #    -1.5 / 0.774597 = -1.936492; the degenerate group stays 0 (but counted in N)
    s = math.sqrt(0.6)
    h = math.sqrt(1.25)
    a = compute_advantages(rewards, ids, "bn")
    close(a, [h, -h, -h, h, 0.5 / s, 0.5 / s, 0.5 / s, -1.5 / s, 0.0, 0.0])
    assert float(a.mean()) == pytest.approx(0.0, abs=1e-6)
    assert pop_std(a) == pytest.approx(1.0, abs=1e-5)


def test_batch_normalize_all_equal_gives_zeros():
    assert (batch_normalize(torch.zeros(5)) == 0).all()
    assert (batch_normalize(torch.full((3,), 2.5)) == 0).all()


def test_bn_equals_grpo_times_one_constant_with_equal_group_sizes():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 4, (6 * 5,), generator=g).float() * 0.5  # 0, 0.5, 1, 1.5 like the paper's reward
    ids = torch.arange(6).repeat_interleave(5)[torch.randperm(30, generator=g)]  # 6 groups of 5, shuffled
    grpo = compute_advantages(rewards, ids, "grpo")
    bn = compute_advantages(rewards, ids, "bn")
    # each group z-score sums to 0, so the batch mean is 0 and BN is a pure rescale by c = 1 / std_pop(grpo)
    assert float(grpo.mean()) == pytest.approx(0.0, abs=1e-6)
    c = batch_scale(grpo)
    assert torch.allclose(bn, grpo * c, atol=1e-5)
    nz = grpo.abs() > 1e-3
    ratios = bn[nz] / grpo[nz]
    assert torch.allclose(ratios, torch.full_like(ratios, c), rtol=1e-5)


def test_compute_advantages_estimators():
    close(compute_advantages(REWARDS, IDS, "grpo"), GRPO_GOLDEN)
    close(compute_advantages(REWARDS, IDS, "bn"), BN_GOLDEN)
    close(compute_advantages(REWARDS, IDS, "none"), NONE_GOLDEN)
    # "none" with rewards 0 / 0.5 / 1.5: group [1.5, 0, 0.5] mean 2/3 -> 0.833333, -0.666667, -0.166667
    close(compute_advantages([1.5, 0.0, 0.5], [3, 3, 3], "none"), [1.5 - 2 / 3, -2 / 3, 0.5 - 2 / 3])


def test_compute_advantages_eps_kwargs():
    # group [0, 2]: std sqrt(2); group_eps=1 -> +-1 / (sqrt(2) + 1) = +-0.414214
    a = compute_advantages([0.0, 2.0], [0, 0], "grpo", group_eps=1.0)
    close(a, [-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1)])
    # batch step on [-0.414214, 0.414214]: pop std 0.414214, batch_eps = 0.414214 -> +-0.5
    b = compute_advantages([0.0, 2.0], [0, 0], "bn", group_eps=1.0, batch_eps=math.sqrt(2) - 1)
    close(b, [-0.5, 0.5])


def test_unknown_estimator_names_valid_ones():
    with pytest.raises(ValueError, match="grpo.*bn.*none"):
        compute_advantages(REWARDS, IDS, "gae")
