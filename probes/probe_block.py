"""Held-out localisation of a trained checkpoint: does its first zoom land in the framed cell of new scenes?

What it measures
    The localisation block of the sft stage (``sft.locate_steps``) has to teach the tiny model to zoom on the red
    frame's cell; whether it did varies between runs (docs/findings.md: 30-79 of 80 test scenes framed with the
    same block). This probe scores any checkpoint directory, and optionally the training states the sft stage leaves
    (``.scratch/sft/checkpoints/locate/step-*/state.pt`` after the block,
    ``.scratch/sft/checkpoints/step-*/state.pt`` in phase 2),
    on ``--n`` held-out localisation drills (:func:`mars.train.locate.locate_dialogues` with another seed than
    training: new scenes with the world's grid, frame and clutter, the episodes' system prompt): greedy first turn,
    the zoom's cell (:func:`mars.train.locate.zoom_cell`) against the teacher's. Baselines in the same table:
    chance (one cell of the grid) and the teacher (every drill's reply, 100% by construction).

With ``--read`` it also scores reading apart from finding: ``--n`` answered perception drills
(:func:`mars.train.locate.held_out_reads`: the teacher's right zoom and the crop of the framed emblem in the prompt)
whose greedy answer is the teacher's; ``--attributes`` picks what they ask (the synthesize stage's
``perception_attributes``; all by default).

Finding (docs/findings.md): the checkpoint of a block that missed the phase change framed 37 of 80 and the SFT
checkpoint after it 39, so phase 2 did not erase localisation; after a block that crossed it the agentic first zoom
was 75 of 80.

Run (in a pipeline's working directory, after ``dvc repro`` reached sft)::

    python probes/probe_block.py --model data/sft/model \\
        --state .scratch/sft/checkpoints/locate/step-000600/state.pt \\
        --state .scratch/sft/checkpoints/step-000350/state.pt
    python probes/probe_block.py --model data/sft/model --read --attributes colour
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mars.agent.protocol import compact_system_prompt  # noqa: E402
from mars.model.build import load_checkpoint  # noqa: E402
from mars.train.locate import framed_count, held_out_drills, held_out_reads, read_count  # noqa: E402
from mars.world.questions import ATTRIBUTES  # noqa: E402
from mars.tools.base import TOOL_SCHEMAS  # noqa: E402
from mars.train.checkpoint import load_model_weights  # noqa: E402
from mars.world.scenes import read_scene  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory (data/sft/model)")
    ap.add_argument("--state", action="append", default=[],
                    help="a training state.pt whose weights replace the model's (repeatable, scored in order)")
    ap.add_argument("--world-dir", type=Path, default=Path("data/world"),
                    help="the world stage's output, whose scene.json sets the scenes' grid, frame and clutter")
    ap.add_argument("--n", type=int, default=80, help="held-out drills")
    ap.add_argument("--seed", type=int, default=99, help="drill seed (training uses sft.seed)")
    ap.add_argument("--read", action="store_true", help="also score the answer after the teacher's right zoom")
    ap.add_argument("--attributes", nargs="+", choices=sorted(ATTRIBUTES), default=None,
                    help="what the drills' perception questions ask (default: every attribute)")
    ns = ap.parse_args(argv)
    for path in [ns.model, *ns.state]:
        if not Path(path).exists():
            ap.error(f"{path}: not found (run `dvc repro` up to the sft stage, or pass an existing path)")
    scene = read_scene(ns.world_dir)
    system = compact_system_prompt(TOOL_SCHEMAS)
    drills, truth = held_out_drills(scene, ns.n, ns.seed, system, ns.attributes)
    reads, answers = held_out_reads(scene, ns.n, ns.seed, system, ns.attributes) if ns.read else ([], [])
    model, _, proc = load_checkpoint(ns.model)
    rows = [("chance (one cell)", ns.n / (scene.grid_rows * scene.grid_cols), None, 0.0),
            ("teacher", float(sum(t is not None for t in truth)), float(ns.n) if ns.read else None, 0.0)]
    for label, state in [(ns.model, None), *[(s, s) for s in ns.state]]:
        if state is not None:
            load_model_weights(model, state)
        t0 = time.perf_counter()
        framed = float(framed_count(model, proc, scene, drills, truth))
        read = float(read_count(model, proc, reads, answers)) if ns.read else None
        rows.append((label, framed, read, time.perf_counter() - t0))
    print(f"held-out localisation drills: {ns.n} new scenes (seed {ns.seed}), grid {scene.grid_rows}x{scene.grid_cols}"
          + (f"; {ns.n} answered perception drills (read)" if ns.read else ""))
    print(f"{'checkpoint':60s} {'framed':>7s} {'share':>6s} {'x chance':>8s} {'read':>6s} {'s':>5s}")
    for label, hits, read, secs in rows:
        shown = "-" if read is None else f"{read / ns.n:.1%}"
        print(f"{label[-60:]:60s} {hits:7.1f} {hits / ns.n:6.1%} {hits / rows[0][1]:8.2f} {shown:>6s} {secs:5.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
