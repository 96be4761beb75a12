"""Copy probe: does a checkpoint read the answer from a text-search result in an episode as it does in a drill?

What it measures
    The SFT model's search chain breaks at its last link: with the answer in the text-search result, it writes
    the value right in a fifth of the episodes or fewer (docs/findings.md), while phase 1's fact drills (the same
    kind of observation, the question right after it, no image, no earlier turn) teach that read. This probe
    separates the causes on one checkpoint. The scripted teacher (skill 1) plays the split's search and multi-hop
    questions through the real tools; for every episode it answered right, the checkpoint writes the answer turn
    (greedy) in three contexts:

    - ``episode``: the teacher's whole dialogue up to its answer (system prompt, question image, zoom crop,
      thumbnails, earlier turns), as in phase 2 and at evaluation;
    - ``no images``: the same dialogue with every image left out (the text of every turn kept);
    - ``drill``: the last text-search observation and the question as one user turn, the shape of phase 1's
      fact drills.

    Reported per context: judged correct, the gold value written in the answer turn (in the think or the
    answer), and the answer's form right (a letter for a multiple-choice question, no letter for an open one).
    The teacher's own answer turns score 100% on all three by construction.

    With ``--types perception`` the same three contexts score the read of the zoom given a right first zoom: the
    teacher's episode is the question image, its zoom on the framed zone and the crop, so ``episode`` against ``no
    images`` separates reading the crop from guessing a likely value (docs/findings.md: an SFT model taught the
    colour with 4,000 zoom captions wrote the asked colour in 24 of 40 such episodes, 8 of 40 without the images,
    while its own first zoom framed the target in 25% of the test scenes).

Not a speed benchmark: the numbers are shares of episodes (deterministic for a checkpoint and split).

Run (in a pipeline's working directory, after ``dvc repro`` reached sft)::

    python probes/probe_copy.py --model data/sft/model
    # the same for phase 1's last checkpoint (weights from a training state.pt, the model's tokenizer):
    python probes/probe_copy.py --model data/sft/model --state .scratch/sft/checkpoints/pretrain/step-002000/state.pt
    # perception: the answer turn after the teacher's (right) zoom
    python probes/probe_copy.py --model data/sft/model --types perception
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mars.agent.config import AgentParams  # noqa: E402
from mars.agent.hf_backend import HFBackend  # noqa: E402
from mars.agent.protocol import content_text, parse_turn  # noqa: E402
from mars.data.io import read_table  # noqa: E402
from mars.data.schemas import QUESTIONS  # noqa: E402
from mars.model.build import load_checkpoint  # noqa: E402
from mars.rl.judge import rule_judge  # noqa: E402
from mars.params import load_params  # noqa: E402
from mars.train.checkpoint import load_model_weights  # noqa: E402
from mars.train.cold_start import SFTParams  # noqa: E402
from mars.train.drawing import teacher_trajectories  # noqa: E402

CONTEXTS = ("episode", "no images", "drill")


def contexts(dialogue: list[dict], question: str) -> dict[str, list[dict]]:
    """The three prompts for the answer turn of one teacher episode (``dialogue`` ends with that turn)."""
    prompt = dialogue[:-1]
    no_images = []
    for m in prompt:
        if isinstance(m["content"], list):
            m = {**m, "content": [c for c in m["content"] if c.get("type") != "image"]}
        no_images.append(m)
    observation = content_text(prompt[-1]["content"])
    drill = [{"role": "user", "content": [{"type": "text", "text": f"{observation}\n{question}"}]}]
    return {"episode": prompt, "no images": no_images, "drill": drill}


def score(text: str, q: dict) -> tuple[bool, bool, bool]:
    """(judged correct, gold value written in the turn, form right) of one generated answer turn."""
    turn = parse_turn(text)
    answer = (turn.answer or "") if turn.action == "answer" else ""
    choices = json.loads(q["choices"]) if isinstance(q.get("choices"), str) else (q.get("choices") or None)
    aliases = [str(q["answer"]), *(q.get("aliases") or [])]
    correct = bool(answer) and rule_judge(answer, aliases, choices=choices).correct
    said = str(q["answer"]).lower() in text.lower()
    letter = bool(re.fullmatch(r"\(?[A-D]\)?\.?", answer.strip()))
    return correct, said, bool(answer) and letter == bool(choices)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("data/sft/model"))
    ap.add_argument("--state", type=Path, action="append", default=[],
                    help="a training state.pt whose weights replace the model's (repeatable, probed in order)")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--questions", type=Path, default=Path("data/synthesize/questions.parquet"))
    ap.add_argument("--image-root", type=Path, default=Path("data/synthesize"))
    ap.add_argument("--world-dir", type=Path, default=Path("data/world"))
    ap.add_argument("--index-dir", type=Path, default=Path("data/index"))
    ap.add_argument("--split", default="test")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--types", nargs="+", choices=("perception", "search", "multi-hop"),
                    default=["search", "multi-hop"],
                    help="question types probed (perception: the answer turn after the teacher's zoom on the frame, "
                         "so the read is scored given a right first zoom)")
    args = ap.parse_args(argv)

    params = load_params("sft", SFTParams, args.params)
    agent = load_params("agent", AgentParams, args.params)
    qs = [q for q in read_table(args.questions, QUESTIONS).to_pylist()
          if q["split"] == args.split and q["type"] in args.types]
    kinds = " and ".join(args.types)
    if not qs:
        raise SystemExit(f"{args.questions}: no {kinds} questions in split {args.split!r}")
    t0 = time.perf_counter()
    teacher = dataclasses.replace(params, teacher_skill=1.0, n_trajectories=len(qs))
    trajs, _ = teacher_trajectories(teacher, agent, qs, args.image_root, args.world_dir, args.index_dir)
    by_id = {q["question_id"]: q for q in qs}
    print(f"teacher: {len(trajs)} of {len(qs)} {args.split} {kinds} questions answered right "
          f"({time.perf_counter() - t0:.0f} s)")
    model, _, proc = load_checkpoint(args.model)
    n = len(trajs)
    for weights in [None, *args.state]:
        if weights is not None:
            load_model_weights(model, weights)
        backend = HFBackend(model, proc)
        rows = {c: [] for c in CONTEXTS}
        for c in CONTEXTS:
            prompts = [contexts(t.messages, by_id[t.question_id]["question"])[c] for t in trajs]
            for s in range(0, len(prompts), args.batch):
                outs = backend.generate(prompts[s : s + args.batch], max_new_tokens=agent.max_new_tokens_per_turn)
                rows[c] += [score(o.text, by_id[t.question_id]) for o, t in zip(outs, trajs[s : s + args.batch])]
        print(f"\n{weights or args.model}: the answer turn of {n} teacher episodes ({args.split} split), greedy")
        print("| context | judged correct | value written | form right |\n|---|---|---|---|")
        for c in CONTEXTS:
            cols = [sum(r[k] for r in rows[c]) for k in range(3)]
            print(f"| {c} | " + " | ".join(f"{v}/{n} ({v / n:.0%})" for v in cols) + " |")
        print(f"| teacher (by construction) | {n}/{n} | {n}/{n} | {n}/{n} |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
