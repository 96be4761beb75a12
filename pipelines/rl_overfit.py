"""The RL overfit check: the real ``rl`` stage on a few fixed rl questions, all of them seen every step.

What it does
    Takes ``--questions`` (4) questions of the rl split in file order (after ``--skip`` of them), writes them as
    the only rl questions of a copy of ``questions.parquet``, and runs the ``rl`` stage's ``run()`` with the
    params of params.yaml (``--set rl.KEY=VALUE`` overrides any of them) and ``prompts_per_step`` = the number of
    questions, for ``--steps`` (16) steps, into ``--out``. On prompts it sees
    every step a working RL update overfits: the check passes when the mean reward of the last 4 steps is at least
    ``--margin`` (0.2) above the first 4. It prints the reward curve with the per-update KL, clip fraction and
    gradient norm, and exits 1 when the check fails.

Run (after ``dvc repro sft``): ``python -m pipelines.rl_overfit [--questions 4] [--steps 16] [--set rl.lr=0.001]``;
about 3 minutes on 2 cores with the default group size.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import yaml

from mars.agent.config import AgentParams
from mars.data.io import read_table, write_table
from mars.data.schemas import QUESTIONS
from mars.params import ParamsError, build_dataclass, load_params

log = logging.getLogger("rl_overfit")


def verdict(rewards: list[float], margin: float, window: int = 4) -> tuple[float, float, bool]:
    """(mean of the first ``window`` rewards, mean of the last ``window``, whether the last beat the first by
    ``margin``).

    >>> verdict([0.5, 0.5, 0.7, 0.5, 0.9, 1.0, 1.1, 1.0], 0.2)
    (0.55, 1.0, True)
    """
    first, last = float(np.mean(rewards[:window])), float(np.mean(rewards[-window:]))
    return round(first, 4), round(last, 4), last >= first + margin


def main(argv: list[str] | None = None) -> int:
    from stages import rl

    ap = argparse.ArgumentParser(prog="python -m pipelines.rl_overfit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=4, help="how many fixed rl questions")
    ap.add_argument("--skip", type=int, default=0, help="rl questions to skip before taking them (file order)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--margin", type=float, default=0.2, help="the rise in mean reward the check asks for")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="rl.KEY=VALUE",
                    help="override an rl param (repeatable)")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--data", type=Path, default=Path("data"), help="the pipeline's data directory")
    ap.add_argument("--out", type=Path, default=Path("data/experiments/rl_overfit"))
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [rl_overfit] %(message)s", datefmt="%H:%M:%S")
    changes = {}
    for item in ns.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("rl."):
            raise SystemExit(f"error: --set expects rl.KEY=VALUE (e.g. rl.lr=0.001), got {item!r}")
        changes[key[3:].strip()] = yaml.safe_load(value)
    try:
        params = build_dataclass(rl.Params, {**asdict(load_params("rl", rl.Params, ns.params)), **changes}, "--set rl")
    except ParamsError as exc:
        raise SystemExit(f"error: {exc}") from None
    params = replace(params, steps=ns.steps, prompts_per_step=ns.questions, checkpoint_every=ns.steps)
    d = ns.data
    table = read_table(d / "synthesize/questions.parquet", QUESTIONS)
    rows = table.to_pylist()
    rl_rows = [r for r in rows if r["split"] == "rl"][ns.skip : ns.skip + ns.questions]
    if len(rl_rows) < ns.questions:
        raise SystemExit(f"error: {d / 'synthesize/questions.parquet'} has fewer than {ns.skip + ns.questions} rl "
                         "questions; lower --questions or --skip")
    keep = {r["question_id"] for r in rl_rows}
    ns.out.mkdir(parents=True, exist_ok=True)
    questions = ns.out / "questions.parquet"
    write_table(table.from_pylist([r for r in rows if r["split"] != "rl" or r["question_id"] in keep],
                                  schema=table.schema), questions, QUESTIONS)
    log.info("rl overfit check: %s, %d steps, %s", sorted(keep), ns.steps, changes or "params.yaml's rl section")
    inputs = {"questions": questions, "image_root": d / "synthesize", "world_dir": d / "world",
              "index_dir": d / "index", "sft": d / "sft"}
    rl.run(params, load_params("agent", AgentParams, ns.params), inputs,
           {"out": ns.out / "rl", "checkpoints": ns.out / "ckpt", "live": ns.out / "live",
            "plots": ns.out / "plots", "metrics": ns.out / "rl.json"})
    history = json.loads((ns.out / "rl" / "monitors.json").read_text())
    print(f"\n{'step':>4}{'reward':>8}{'answer':>8}{'format':>8}{'kl/update':>11}{'clip':>7}{'grad':>7}")
    for h in history:
        print(f"{h['step']:>4}{h['reward']:>8.3f}{h['reward_answer']:>8.3f}{h['reward_format']:>8.3f}"
              f"{h['approx_kl']:>11.4f}{h['clip_frac']:>7.3f}{h['grad_norm']:>7.2f}")
    first, last, ok = verdict([h["reward"] for h in history], ns.margin)
    print(f"\nmean reward, first 4 steps {first:.3f}, last 4 {last:.3f}: "
          f"{'PASS' if ok else 'FAIL'} (needs +{ns.margin})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
