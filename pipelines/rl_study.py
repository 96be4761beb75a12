"""The RL study: several seeds and algorithms from the same SFT checkpoint, each evaluated on the test split.

What it does
    For every (algorithm, seed) it runs the ``rl`` stage's ``run()`` with the params of params.yaml except
    ``rl.algorithm`` and ``rl.seed``, on the prompts the ``rl`` stage reads (``data/mine/questions.parquet``: the
    ``mine`` stage's pass-count band when it is on; ``--rl-questions`` names another file), into
    ``<out>/<algorithm>-s<seed>/``, then evaluates that checkpoint with the ``evaluate`` stage's ``run()``
    (``runs: [rl/agentic]``, plus ``sft/agentic`` once as the reference; evaluation results are reused when a
    checkpoint was already scored). It prints and writes (``--summary``) the
    test accuracy per algorithm and seed, the mean and spread (min..max, std) over seeds, the change against the
    SFT checkpoint and how many seeds beat it (:func:`aggregate`), localisation (``first_zoom_framed``), and each
    run's reward curve (first / last 5 steps) and wall-clock time, so SFT-only and SFT+RL can be compared at equal
    steps and at equal time. ``dvc.yaml`` lists the summary as a top-level metric: ``dvc metrics show`` shows it.
    A killed study resumes: each RL run from its own checkpoints, each evaluation from its progress.

    ``dvc exp run -S rl.algorithm=grpo`` runs one ablation inside DVC; this command runs the grid outside it (the
    pipeline's own outputs are not touched).

Run (after ``dvc repro mine``): ``python -m pipelines.rl_study --seeds 0 1 2 --algorithms bn_gspo gspo grpo``.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from mars.agent.config import AgentParams
from mars.params import load_params
from mars.stage import write_metrics

log = logging.getLogger("rl_study")


def _acc(metrics: dict, key: str) -> tuple[float, dict]:
    e = metrics["test"][key]
    return e["accuracy"], e.get("by_type", {})


def aggregate(runs: dict[str, dict], sft_accuracy: float) -> dict[str, dict]:
    """Per algorithm over its seeds: ``seeds``, ``mean``/``min``/``max``/``std`` (population) test accuracy,
    ``delta_vs_sft`` (mean minus the SFT checkpoint's), ``by_type`` means, ``reward_first``/``reward_last``
    means (a run without rewards counts 0) and ``better_than_sft`` (seeds above the SFT checkpoint)."""
    out: dict[str, dict] = {}
    for alg in dict.fromkeys(r["algorithm"] for r in runs.values()):
        rs = [r for r in runs.values() if r["algorithm"] == alg]
        accs = np.array([r["accuracy"] for r in rs], dtype=np.float64)  # [seeds]
        types = sorted({t for r in rs for t in r["by_type"]})
        out[alg] = {"seeds": len(rs), "mean": round(float(accs.mean()), 4), "min": float(accs.min()),
                    "max": float(accs.max()), "std": round(float(accs.std()), 4),
                    "delta_vs_sft": round(float(accs.mean()) - sft_accuracy, 4),
                    "better_than_sft": int((accs > sft_accuracy).sum()),
                    "by_type": {t: round(float(np.mean([r["by_type"].get(t, 0.0) for r in rs])), 4) for t in types},
                    "reward_first": round(float(np.mean([r["reward_first"] or 0.0 for r in rs])), 4),
                    "reward_last": round(float(np.mean([r["reward_last"] or 0.0 for r in rs])), 4)}
    return out


def main(argv: list[str] | None = None) -> int:
    from stages import evaluate, rl

    ap = argparse.ArgumentParser(prog="python -m pipelines.rl_study", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--algorithms", nargs="+", default=["bn_gspo", "gspo", "grpo"])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--data", type=Path, default=Path("data"), help="the pipeline's data directory")
    ap.add_argument("--rl-questions", type=Path, default=None,
                    help="the rl prompts (default <data>/mine/questions.parquet, what the rl stage reads: the mine "
                         "stage's band when it is on)")
    ap.add_argument("--out", type=Path, default=Path("data/experiments"), help="the runs' checkpoints and outputs")
    ap.add_argument("--summary", type=Path, default=Path("metrics/rl_study.json"),
                    help="the summary (git-tracked: dvc.yaml lists it as a top-level metric)")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rl_study] %(message)s", datefmt="%H:%M:%S")
    agent = load_params("agent", AgentParams, ns.params)
    base_rl = load_params("rl", rl.Params, ns.params)
    base_ev = load_params("evaluate", evaluate.Params, ns.params)
    d = ns.data
    inputs = {"questions": d / "synthesize/questions.parquet", "image_root": d / "synthesize",
              "world_dir": d / "world", "index_dir": d / "index", "sft": d / "sft"}
    rl_inputs = {**inputs, "questions": ns.rl_questions or d / "mine/questions.parquet"}
    summary: dict = {"runs": {}}
    sft_acc, sft_zoom = None, None
    for alg in ns.algorithms:
        for seed in ns.seeds:
            name = f"{alg}-s{seed}"
            run_dir = ns.out / name
            t0 = time.perf_counter()
            m = rl.run(replace(base_rl, algorithm=alg, seed=seed), agent, rl_inputs,
                       {"out": run_dir / "rl", "checkpoints": run_dir / "ckpt", "live": run_dir / "live",
                        "plots": run_dir / "plots/rl", "metrics": run_dir / "rl.json"})
            rl_s = time.perf_counter() - t0
            runs = ("rl/agentic", "sft/agentic") if sft_acc is None else ("rl/agentic",)
            ev = evaluate.run(replace(base_ev, runs=runs, seed=base_ev.seed), agent, {**inputs, "rl": run_dir / "rl"},
                              {"out": run_dir / "evaluate", "progress": ns.out / "evaluate_progress",
                               "plots": run_dir / "plots/evaluate", "metrics": run_dir / "evaluate.json"})
            if sft_acc is None:
                sft_acc, sft_zoom = _acc(ev, "sft/agentic"), ev["test"]["sft/agentic"].get("first_zoom_framed")
            acc, by_type = _acc(ev, "rl/agentic")
            summary["runs"][name] = {"algorithm": alg, "seed": seed, "accuracy": acc, "by_type": by_type,
                                     "reward_first": m["reward_first"], "reward_last": m["reward_last"],
                                     "degenerate_first": m["degenerate_groups_first"],
                                     "degenerate_last": m["degenerate_groups_last"],
                                     "first_zoom_framed": ev["test"]["rl/agentic"].get("first_zoom_framed"),
                                     "rl_seconds": round(rl_s, 1)}
            log.info("%s: test accuracy %.3f (sft %.3f), reward %.3f -> %.3f, %.0f s", name, acc, sft_acc[0],
                     m["reward_first"] or 0, m["reward_last"] or 0, rl_s)
    summary["sft"] = {"accuracy": sft_acc[0], "by_type": sft_acc[1], "first_zoom_framed": sft_zoom}
    summary |= aggregate(summary["runs"], sft_acc[0])
    print(f"\n{'algorithm':<10}{'seeds':>6}{'mean acc':>10}{'min..max':>14}{'vs sft':>9}{'reward first->last':>22}")
    for alg in ns.algorithms:
        a = summary[alg]
        spread, reward = f"{a['min']:.3f}..{a['max']:.3f}", f"{a['reward_first']:.3f} -> {a['reward_last']:.3f}"
        print(f"{alg:<10}{a['seeds']:>6}{a['mean']:>10.3f}{spread:>14}{a['delta_vs_sft']:>+9.3f}{reward:>22}")
    print(f"{'sft':<10}{'':>6}{sft_acc[0]:>10.3f}")
    write_metrics(ns.summary, summary)  # atomically; dvc.yaml lists it for `dvc metrics show`
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
