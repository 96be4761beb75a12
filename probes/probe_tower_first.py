"""Learnability probe: does teaching the vision tower the framed cell first make the localisation block reliable?

What it measures
    The sft stage's localisation block (``sft.locate_steps``) teaches the tiny model's first zoom through the language
    model's loss, and whether its random-init tower found the red frame that way varied between runs (docs/findings.md).
    Phase 0's localisation half (``sft.vision_locate_steps``; :func:`mars.train.cold_start.vision_locate`) teaches the
    tower the framed cell directly before the block. This probe replays the block from a pipeline's phase-1 state
    (``.scratch/sft/checkpoints/pretrain/step-*/state.pt``: the language model after the text-only pre-training
    phase, which never touches the vision tower) with the untrained tower of ``data/sft/base``, twice per block seed:
    as it is (the baseline) and after ``--tower-steps`` steps of phase-0 localisation. The block is the stage's: its
    drills, its ``locate_mix`` share of phase 1's examples, its rates and schedule (``--block-steps``, default
    ``sft.locate_steps``). Every ``--every`` block steps the model is scored on held-out localisation drills
    (:func:`mars.train.locate.framed_count`: new scenes, greedy first turn, the zoom's cell against the teacher's).

Finding (docs/findings.md): from one pipeline's phase-1 state, 300 block steps alone framed 24 and 23 of 80
held-out scenes (chance 20) with block seeds 0 and 1; after 150 tower steps (held-out cell 99%) the block framed 80
of 80 by step 200 with both.

Not a speed benchmark: the numbers are held-out counts after fixed steps (deterministic for a seed).

Run (in a pipeline's working directory, after ``dvc repro`` reached sft; 2 minutes to prepare, then 3-4 minutes a
variant)::

    python probes/probe_tower_first.py [--tower-steps 150] [--block-steps 300] [--seeds 0 1] [--every 100]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mars.agent.config import AgentParams  # noqa: E402
from mars.agent.protocol import compact_system_prompt, system_prompt  # noqa: E402
from mars.data.io import read_table  # noqa: E402
from mars.data.schemas import QUESTIONS  # noqa: E402
from mars.model.build import load_checkpoint  # noqa: E402
from mars.stage import load_section  # noqa: E402
from mars.train.locate import framed_count, held_out_drills  # noqa: E402
from mars.tools.base import TOOL_SCHEMAS  # noqa: E402
from mars.train.checkpoint import load_model_weights  # noqa: E402
from mars.train.cold_start import SFTParams, mix_in, vision_locate  # noqa: E402
from mars.train.data import render_examples  # noqa: E402
from mars.train.drawing import locate_block_dialogues, pretrain_dialogues  # noqa: E402
from mars.train.sft import train_sft  # noqa: E402
from mars.world.scenes import read_scene  # noqa: E402


def newest_state(folder: Path) -> Path | None:
    steps = sorted((p for p in folder.glob("step-*") if re.fullmatch(r"step-\d{6}", p.name)), key=lambda p: p.name)
    return steps[-1] / "state.pt" if steps else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params.yaml", help="its sft and agent sections")
    ap.add_argument("--base", default="data/sft/base", help="the untrained checkpoint the sft stage saved")
    ap.add_argument("--state", default="", help="the phase-1 state.pt (default: the newest under "
                    ".scratch/sft/checkpoints/pretrain)")
    ap.add_argument("--questions", default="data/synthesize/questions.parquet")
    ap.add_argument("--world-dir", default="data/world")
    ap.add_argument("--index-dir", default="data/index")
    ap.add_argument("--tower-steps", type=int, default=150)
    ap.add_argument("--block-steps", type=int, default=0, help="0 = sft.locate_steps")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="block seeds (batch order)")
    ap.add_argument("--every", type=int, default=100, help="probe every this many block steps")
    ap.add_argument("--n", type=int, default=80, help="held-out drills")
    ns = ap.parse_args(argv)
    state = Path(ns.state) if ns.state else newest_state(Path(".scratch/sft/checkpoints/pretrain"))
    for path in (ns.base, state, ns.questions, ns.world_dir, ns.index_dir):
        if path is None or not Path(path).exists():
            ap.error(f"{path or '.scratch/sft/checkpoints/pretrain/step-*'}: not found (run `dvc repro` up to the "
                     "sft stage with sft.pretrain_steps > 0, or pass existing paths)")
    if ns.tower_steps < 1 or ns.every < 1 or ns.n < 1 or ns.block_steps < 0:
        ap.error("need --tower-steps, --every and --n >= 1 and --block-steps >= 0")
    argv_p = ["--params", ns.params]
    p = load_section("sft", SFTParams, argv_p)
    p = dataclasses.replace(p, vision_locate_steps=ns.tower_steps, locate_steps=ns.block_steps or p.locate_steps)
    agent = load_section("agent", AgentParams, argv_p)
    scene = read_scene(ns.world_dir)  # the world stage's scene knobs (its scene.json)
    system = (system_prompt if agent.prompt == "full" else compact_system_prompt)(TOOL_SCHEMAS)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    model, tok, proc = load_checkpoint(ns.base)
    base_tower = copy.deepcopy(model.model.visual.state_dict())
    load_model_weights(model, state)
    model.model.visual.load_state_dict(base_tower)  # phase 1 is text only: its tower is the untrained one
    start = copy.deepcopy(model.state_dict())
    t0 = time.perf_counter()
    questions = read_table(Path(ns.questions), QUESTIONS).to_pylist()
    pool = render_examples(pretrain_dialogues(p, agent, Path(ns.world_dir), Path(ns.index_dir), questions, scene,
                                              system), proc, p.max_len, desc="rendering phase-1 data")
    locate = locate_block_dialogues(p, scene, system)
    block = render_examples(locate, proc, p.max_len, desc="rendering block data")
    kept = mix_in(pool, len(block), p.locate_mix, p.seed)
    del pool
    drills, truth = held_out_drills(scene, ns.n, 99, compact_system_prompt(TOOL_SCHEMAS))
    print(f"block: {len(block)} drills + {len(kept)} phase-1 examples, {p.locate_steps} steps; {ns.n} held-out "
          f"scenes; prepared in {time.perf_counter() - t0:.0f} s", flush=True)

    rows = []
    for seed in ns.seeds:
        for variant in ("block only", f"tower {ns.tower_steps} + block"):
            model.load_state_dict(start)
            cell = float("nan")
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                if variant != "block only":
                    cell = vision_locate(p, model, proc, scene, locate, Path(tmp) / "tower", "probe")[
                        "vision_locate_test_cell"]
                counts: list[int] = []

                def probe(step: int, _row: dict) -> None:
                    if (step + 1) % ns.every == 0 or step + 1 == p.locate_steps:
                        counts.append(framed_count(model, proc, scene, drills, truth))
                        model.train()
                        print(f"  {variant}, seed {seed}, block step {step + 1}: framed {counts[-1]} of {ns.n}",
                              flush=True)

                train_sft(model, block + kept, dataclasses.replace(p, seed=seed).locate_config(),
                          pad_id=tok.pad_token_id, ckpt_dir=Path(tmp) / "block", live_dir=None, fp="probe",
                          on_step=probe)
            rows.append((variant, seed, cell, counts, time.perf_counter() - t0))

    steps = [s for s in range(ns.every, p.locate_steps + 1, ns.every)]
    steps += [p.locate_steps] if p.locate_steps % ns.every else []
    print("\n| variant | block seed | tower held-out cell | " + " | ".join(f"framed @{s}" for s in steps)
          + " | final vs block only | s |")
    print("|---|---|---|" + "---|" * len(steps) + "---|---|")
    for i, (variant, seed, cell, counts, secs) in enumerate(rows):
        base = rows[i - i % 2][3][-1]
        ratio = f"{counts[-1] / base:.2f}x" if base else "n/a (baseline 0)"
        print(f"| {variant} | {seed} | {'-' if cell != cell else f'{cell:.0%}'} | "
              + " | ".join(f"{c}/{ns.n}" for c in counts) + f" | {ratio} | {secs:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
