"""Naming probe: can a checkpoint's language model learn to name what its vision tower sees in a zoom?

What it measures
    A 4-head SFT model asked colour questions (docs/findings.md) answered them with one word whatever the crop ("blue"
    for open questions, "C" for multiple choice), although its vision tower, after phase 0, read the fill colour of half
    the held-out crops. This probe asks whether the language model can learn the mapping from the zoom's image tokens to
    the attribute's word with dedicated practice, and how many steps it takes: starting from a checkpoint directory, it
    trains the whole model (rates ``sft.lr`` and ``sft.vision_lr``, batch ``sft.batch_size``, constant rate) on
    ``--train`` open zoom captions (:func:`mars.train.captions.zoom_captions`: a new random emblem at the zoom's scale
    of the world in ``--world-dir``, asking only ``--attributes``) and, at each of ``--eval-at`` steps, answers
    ``--test`` held-out captions of another seed greedily. Reported per attribute: the share answered right, the share
    of the most frequent answer (1.0 = one word for every crop) and chance.

Finding (docs/findings.md): from an SFT checkpoint whose tower was pre-trained to read colour (phase 0), 1,000 colour
captions at the sft rates: colour named right in 5.3% of held-out crops (one word for 75% of them), 30.0% after 200
steps, 30.7% after 400, 62.7% after 800 (chance 6.2%). The language model can learn the mapping; the cold start's few
perception trajectories do not teach it.

Not a speed benchmark: the numbers are accuracies after a number of steps (deterministic for a seed).

Run (in a pipeline's working directory, after ``dvc repro`` reached sft)::

    python probes/probe_name.py --model data/sft/model --attributes colour --eval-at 0 200 400 800
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mars.agent.hf_backend import HFBackend  # noqa: E402
from mars.agent.protocol import parse_turn  # noqa: E402
from mars.model.build import load_checkpoint  # noqa: E402
from mars.stage import load_section  # noqa: E402
from mars.train.captions import zoom_captions  # noqa: E402
from mars.train.cold_start import SFTParams  # noqa: E402
from mars.train.data import render_examples  # noqa: E402
from mars.train.sft import train_sft  # noqa: E402
from mars.world.questions import ATTRIBUTES, asked_attribute  # noqa: E402
from mars.world.scenes import read_scene  # noqa: E402


def score(model, proc, dialogues: list[list[dict]]) -> dict[str, tuple[float, float]]:
    """Per asked attribute: (share answered right, share of the most frequent answer) of greedy replies."""
    outs = HFBackend(model, proc).generate([d[:-1] for d in dialogues], max_new_tokens=64)
    by: dict[str, list[tuple[str, str]]] = {}
    for d, o in zip(dialogues, outs):
        gold = parse_turn(d[-1]["content"]).answer
        got = parse_turn(o.text).answer if parse_turn(o.text).action == "answer" else ""
        by.setdefault(asked_attribute(d[0]["content"][1]["text"]), []).append((gold, (got or "").strip().lower()))
    return {a: (sum(g.lower() == p for g, p in pairs) / len(pairs),
                Counter(p for _, p in pairs).most_common(1)[0][1] / len(pairs)) for a, pairs in sorted(by.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a checkpoint directory (data/sft/model)")
    ap.add_argument("--params", default="params.yaml", help="its sft section: rates, batch")
    ap.add_argument("--world-dir", type=Path, default=Path("data/world"),
                    help="the world stage's output, whose scene.json sets the zoom's scale")
    ap.add_argument("--attributes", nargs="+", default=["colour"], choices=list(ATTRIBUTES))
    ap.add_argument("--train", type=int, default=2000, help="training captions")
    ap.add_argument("--test", type=int, default=200, help="held-out captions (another seed)")
    ap.add_argument("--eval-at", type=int, nargs="+", default=[0, 200, 400, 800], help="steps to score at")
    ns = ap.parse_args(argv)
    if not Path(ns.model).is_dir():
        ap.error(f"{ns.model}: not a checkpoint directory (run `dvc repro` up to the sft stage, or pass one)")
    if min(ns.eval_at) < 0:
        ap.error("--eval-at steps must be >= 0")
    scene = read_scene(ns.world_dir)
    p = load_section("sft", SFTParams, ["--params", ns.params])
    model, tok, proc = load_checkpoint(ns.model)
    train = zoom_captions(scene, n=ns.train, seed=0, mcq_share=0.0, attributes=ns.attributes)
    test = zoom_captions(scene, n=ns.test, seed=1, mcq_share=0.0, attributes=ns.attributes)
    examples = render_examples(train, proc, p.max_len, desc="rendering captions")
    steps = max(ns.eval_at)
    rows: list[tuple[int, dict, float]] = []
    t0 = time.perf_counter()

    def at(step: int) -> None:
        if step in ns.eval_at:
            model.eval()
            rows.append((step, score(model, proc, test), time.perf_counter() - t0))
            print(f"step {step}: " + ", ".join(f"{a} {r:.1%} (mode {m:.0%})" for a, (r, m) in rows[-1][1].items()),
                  flush=True)
            model.train()

    at(0)
    if steps:
        cfg = p.train_config(steps, group_batches=1)
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule="constant", warmup_steps=0),
                                  checkpoint_every=steps)
        with tempfile.TemporaryDirectory() as tmp:
            train_sft(model, examples, cfg, pad_id=tok.pad_token_id, ckpt_dir=tmp, live_dir=None, fp="probe",
                      on_step=lambda step, row: at(step + 1))
    chance = {a: 1 / len(ATTRIBUTES[a]) for a in ns.attributes}
    print(f"\n{ns.train} open zoom captions ({', '.join(ns.attributes)}), {ns.test} held out; from {ns.model}; "
          f"lr {p.lr:g}, vision lr {p.vision_lr:g}, batch {p.batch_size}, target zone {scene.target_zone}")
    print("| steps | " + " | ".join(f"{a} right | {a} mode share" for a in ns.attributes) + " | s |")
    print("|---|" + "---|---|" * len(ns.attributes) + "---|")
    print("| chance | " + " | ".join(f"{chance[a]:.1%} | -" for a in ns.attributes) + " | |")
    for step, res, secs in rows:
        cells = " | ".join(f"{res.get(a, (0.0, 0.0))[0]:.1%} | {res.get(a, (0.0, 0.0))[1]:.0%}" for a in ns.attributes)
        print(f"| {step} | {cells} | {secs:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
