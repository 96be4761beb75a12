"""pipelines.rl_study.aggregate: per-algorithm statistics over seeds, against the SFT checkpoint."""

from __future__ import annotations

import pytest

from pipelines.rl_study import aggregate


def test_aggregate_over_seeds_by_hand():
    def run(alg, acc, perc, rf, rl):
        return {"algorithm": alg, "accuracy": acc, "by_type": {"perception": perc}, "reward_first": rf,
                "reward_last": rl}

    runs = {"bn_gspo-s0": run("bn_gspo", 0.20, 0.1, 0.5, 0.6), "bn_gspo-s1": run("bn_gspo", 0.30, 0.2, 0.4, None),
            "bn_gspo-s2": run("bn_gspo", 0.25, 0.3, 0.6, 0.9), "grpo-s0": run("grpo", 0.10, 0.0, None, 0.3)}
    got = aggregate(runs, sft_accuracy=0.22)
    assert list(got) == ["bn_gspo", "grpo"]
    b = got["bn_gspo"]
    # mean (0.20 + 0.30 + 0.25) / 3 = 0.25; population std sqrt((0.0025 + 0.0025 + 0) / 3) = 0.0408;
    # two of three seeds above 0.22; perception (0.1 + 0.2 + 0.3) / 3 = 0.2; rewards: a missing one counts 0:
    # first (0.5 + 0.4 + 0.6) / 3 = 0.5, last (0.6 + 0 + 0.9) / 3 = 0.5
    assert (b["seeds"], b["mean"], b["min"], b["max"], b["std"]) == (3, 0.25, 0.20, 0.30, 0.0408)
    assert b["delta_vs_sft"] == pytest.approx(0.03) and b["better_than_sft"] == 2
    assert b["by_type"] == {"perception": 0.2} and (b["reward_first"], b["reward_last"]) == (0.5, 0.5)
    g = got["grpo"]
    assert (g["seeds"], g["mean"], g["std"], g["better_than_sft"], g["delta_vs_sft"]) == (1, 0.1, 0.0, 0, -0.12)
    assert (g["reward_first"], g["reward_last"]) == (0.0, 0.3)
