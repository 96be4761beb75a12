"""Timing probe of the sft stage's first step: the teacher plays while the drills are drawn, one worker against two.

What it measures
    Before phase 0 the sft stage plays the teacher over the sft split and draws phase 1's reading drills (with the
    check drills) and the localisation block's drills and zoom captions (:func:`mars.train.drawing.play_and_draw`); all
    three are mostly single-threaded Python. The stage has one worker draw both parts in turn beside the teacher
    (two at once were no shorter on two cores in a pipeline run: docs/findings.md). This benchmark
    runs both on the same data, in the same run:
    ``1 worker`` (the baseline) and ``2 workers``, each timed from the start to the last part drawn, with the
    teacher's own seconds and the wait after it (``drills_wait_s``), and checks that both drew the same dialogues
    (:func:`mars.train.data.dialogues_digest`). Wall time on a shared machine: run it when nothing else runs. Not in
    ``make bench``: it needs a pipeline's data.

Run (in a pipeline's working directory, after ``dvc repro`` reached synthesize; the sft params of ``--params``)::

    python probes/probe_drawing.py
    python probes/probe_drawing.py --captions 1000   # sft.pretrain_zoom_captions for this run (a quicker probe)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mars.agent.config import AgentParams  # noqa: E402
from mars.agent.protocol import compact_system_prompt, system_prompt  # noqa: E402
from mars.data.io import read_table  # noqa: E402
from mars.data.schemas import QUESTIONS  # noqa: E402
from mars.stage import load_section  # noqa: E402
from mars.tools.base import TOOL_SCHEMAS  # noqa: E402
from mars.train.cold_start import SFTParams  # noqa: E402
from mars.train.data import dialogues_digest  # noqa: E402
from mars.train.drawing import play_and_draw  # noqa: E402
from mars.world.questions import asked_attributes  # noqa: E402
from mars.world.scenes import read_scene  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params.yaml", help="the params file (its profile's sft, agent)")
    ap.add_argument("--data", default="data", help="the pipeline's data directory")
    ap.add_argument("--captions", type=int, default=None, help="sft.pretrain_zoom_captions for this run")
    ns = ap.parse_args(argv)
    args = ["--params", ns.params]
    params = load_section("sft", SFTParams, args)
    if ns.captions is not None:
        params = dataclasses.replace(params, pretrain_zoom_captions=ns.captions)
    if not (params.pretrain_steps or params.locate_steps):
        sys.exit(f"{ns.params}: sft.pretrain_steps and sft.locate_steps are both 0: nothing is drawn beside the "
                 "teacher; use a profile with phase 1 or the localisation block")
    agent = load_section("agent", AgentParams, args)
    data = Path(ns.data)
    inputs = {"questions": data / "synthesize" / "questions.parquet", "image_root": data / "synthesize",
              "world_dir": data / "world", "index_dir": data / "index"}
    for name, path in inputs.items():
        if not path.exists():
            sys.exit(f"{path} ({name}) is missing: run `dvc repro synthesize` in this directory first")
    scene = read_scene(inputs["world_dir"])  # the world stage's scene knobs (its scene.json)
    all_questions = read_table(inputs["questions"], QUESTIONS).to_pylist()
    system = (system_prompt if agent.prompt == "full" else compact_system_prompt)(TOOL_SCHEMAS)
    attributes = asked_attributes(all_questions)

    rows, digests = [], []
    for workers in (1, 2):
        t0 = time.perf_counter()
        trajs, stats, pretrain, locate, held_out = play_and_draw(params, agent, inputs, all_questions, scene, system,
                                                                 attributes, workers=workers)
        wall = time.perf_counter() - t0
        digests.append([dialogues_digest(d) for d in (pretrain, locate, held_out)])
        rows.append((f"{workers} worker{'s' if workers > 1 else ''}", len(trajs), len(pretrain), len(locate), wall,
                     stats["teacher_s"], stats["drills_wait_s"]))
        # the images of one run's dialogues (4,000 zoom captions: several GB) must go before the next is drawn:
        # held across both runs they took 18 GB and the kernel's OOM killer ended the probe
        del trajs, pretrain, locate, held_out
        gc.collect()
        print(f"{rows[-1][0]}: {wall:.1f} s", flush=True)
    if digests[0] != digests[1]:
        sys.exit(f"the two runs drew different dialogues: {digests}")
    base = rows[0][4]
    print("\n| drawing | trajectories | phase-1 dialogues | block dialogues | wall s | teacher s | wait s | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n_traj, n_pre, n_loc, wall, teacher, wait in rows:
        print(f"| {name} | {n_traj} | {n_pre} | {n_loc} | {wall:.1f} | {teacher:.1f} | {wait:.1f} | "
              f"{base / wall:.2f}x |")
    print("\nthe same dialogues drawn by both (digests equal)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
