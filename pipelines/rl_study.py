"""The RL study: several seeds and algorithms from the same SFT checkpoint, each evaluated on the test split.

What it does
    For every (algorithm, seed) it runs the ``rl`` stage's ``run()`` with the params of params.yaml except
    ``rl.algorithm`` and ``rl.seed``, into ``<out>/<algorithm>-s<seed>/``, then evaluates that checkpoint with the
    ``evaluate`` stage's ``run()`` (``runs: [rl/agentic]``, plus ``sft/agentic`` once as the reference; evaluation
    results are reused when a checkpoint was already scored). It prints and writes (``<out>/summary.json``) the
    test accuracy per algorithm and seed, the mean and spread (min..max) over seeds, the change against the SFT
    checkpoint, and each run's reward curve (first / last 5 steps) and wall-clock time, so SFT-only and SFT+RL can
    be compared at equal steps and at equal time.

    ``dvc exp run -S rl.algorithm=grpo`` runs one ablation inside DVC; this command runs the grid outside it (the
    pipeline's own outputs are not touched).

Run (after ``dvc repro sft``): ``python -m pipelines.rl_study --seeds 0 1 2 --algorithms bn_gspo gspo grpo``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from mars.agent.config import AgentParams
from mars.params import load_params

log = logging.getLogger("rl_study")


def _acc(metrics: dict, key: str) -> tuple[float, dict]:
    e = metrics["test"][key]
    return e["accuracy"], e.get("by_type", {})


def main(argv: list[str] | None = None) -> int:
    from stages import evaluate, rl

    ap = argparse.ArgumentParser(prog="python -m pipelines.rl_study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algorithms", nargs="+", default=["bn_gspo", "gspo", "grpo"])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--data", type=Path, default=Path("data"), help="the pipeline's data directory")
    ap.add_argument("--out", type=Path, default=Path("data/experiments"))
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rl_study] %(message)s", datefmt="%H:%M:%S")
    agent = load_params("agent", AgentParams, ns.params)
    base_rl = load_params("rl", rl.Params, ns.params)
    base_ev = load_params("evaluate", evaluate.Params, ns.params)
    d = ns.data
    inputs = {"questions": d / "synthesize/questions.parquet", "image_root": d / "synthesize",
              "world_dir": d / "world", "index_dir": d / "index", "sft": d / "sft"}
    summary: dict = {"runs": {}}
    sft_acc = None
    for alg in ns.algorithms:
        for seed in ns.seeds:
            name = f"{alg}-s{seed}"
            run_dir = ns.out / name
            t0 = time.perf_counter()
            m = rl.run(replace(base_rl, algorithm=alg, seed=seed), agent, inputs,
                       {"out": run_dir / "rl", "checkpoints": run_dir / "ckpt", "live": run_dir / "live",
                        "metrics": run_dir / "rl.json"})
            rl_s = time.perf_counter() - t0
            runs = ("rl/agentic", "sft/agentic") if sft_acc is None else ("rl/agentic",)
            ev = evaluate.run(replace(base_ev, runs=runs, seed=base_ev.seed), agent, {**inputs, "rl": run_dir / "rl"},
                              {"out": run_dir / "evaluate", "progress": ns.out / "evaluate_progress",
                               "metrics": run_dir / "evaluate.json"})
            if sft_acc is None:
                sft_acc = _acc(ev, "sft/agentic")
            acc, by_type = _acc(ev, "rl/agentic")
            summary["runs"][name] = {"algorithm": alg, "seed": seed, "accuracy": acc, "by_type": by_type,
                                     "reward_first": m["reward_first"], "reward_last": m["reward_last"],
                                     "rl_seconds": round(rl_s, 1)}
            log.info("%s: test accuracy %.3f (sft %.3f), reward %.3f -> %.3f, %.0f s", name, acc, sft_acc[0],
                     m["reward_first"] or 0, m["reward_last"] or 0, rl_s)
    summary["sft"] = {"accuracy": sft_acc[0], "by_type": sft_acc[1]}
    print(f"\n{'algorithm':<10}{'seeds':>6}{'mean acc':>10}{'min..max':>14}{'vs sft':>9}{'reward first->last':>22}")
    for alg in ns.algorithms:
        rs = [r for r in summary["runs"].values() if r["algorithm"] == alg]
        accs = np.array([r["accuracy"] for r in rs])
        summary[alg] = {"mean": float(accs.mean()), "min": float(accs.min()), "max": float(accs.max()),
                        "delta_vs_sft": float(accs.mean() - sft_acc[0])}
        rf = np.mean([r["reward_first"] or 0 for r in rs])
        rlast = np.mean([r["reward_last"] or 0 for r in rs])
        print(f"{alg:<10}{len(rs):>6}{accs.mean():>10.3f}{f'{accs.min():.3f}..{accs.max():.3f}':>14}"
              f"{accs.mean() - sft_acc[0]:>+9.3f}{f'{rf:.3f} -> {rlast:.3f}':>22}")
    print(f"{'sft':<10}{'':>6}{sft_acc[0]:>10.3f}")
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
