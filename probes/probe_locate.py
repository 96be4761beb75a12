"""Learnability probe: can the tiny vision tower find the framed cell, and at which vision learning rate?

What it measures
    The default world's perception cue is a red frame around one cell of a 2 x 2 grid (docs/design.md, The embedded
    default world). This probe isolates the vision side of that skill: the tiny model's vision tower and projector
    (``tiny_config``, random init, ``sft.arch``'s architecture) feed one learned attention read-out (a query over the
    merged image tokens, standing in for the language model's attention to the image) and a 4-way linear head; AdamW
    trains them on localisation drill images (:func:`mars.train.locate.locate_dialogues`, a new scene per drill, the
    world's grid, frame, clutter and target zone, the policy's 224-px view) with cross-entropy on the framed cell.
    Reported: held-out accuracy on scenes drawn with another seed, for each vision learning rate, against the baseline
    of the previous default (0.01) measured in the same run.

Finding (docs/findings.md)
    At 0.01 the tower never leaves chance (25%); at 1e-3 .. 3e-3 it reaches 100% of held-out scenes in about 100-150
    steps at batch 16. That is why ``sft.vision_lr`` is no longer 5x the language model's rate.

Not a speed benchmark: the numbers are accuracies after a fixed number of steps (deterministic for a seed).

Run: ``python probes/probe_locate.py [--lrs 0.01 0.003 0.002 0.001] [--steps 150] [--train 1000] [--test 200]
[--arch qwen2_5_vl]``
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mars.agent.protocol import parse_turn  # noqa: E402
from mars.model.build import ARCHES, build_model, tiny_config  # noqa: E402
from mars.model.processor import build_processor  # noqa: E402
from mars.model.tokenizer import train_tokenizer  # noqa: E402
from mars.train.locate import locate_dialogues, located_cell  # noqa: E402
from mars.world.generate import WorldSpec  # noqa: E402

BATCH = 16


def drills(scene, proc, n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """``(pixel_values, image_grid_thw, cell index)`` of ``n`` localisation drills (cell index = row * 2 + col)."""
    out = []
    for d in locate_dialogues(scene, n=n, seed=seed, system=None):
        img = next(c["image"] for c in d[0]["content"] if isinstance(c, dict) and c.get("type") == "image")
        r, c = located_cell(parse_turn(d[1]["content"]).arguments["bbox_2d"], 2, 2)
        ip = proc.image_processor(images=[img], return_tensors="pt")
        out.append((ip["pixel_values"], ip["image_grid_thw"], r * 2 + c))
    return out


class Readout(torch.nn.Module):
    """The vision tower, then one attention read-out over its merged tokens and a 4-way linear head."""

    def __init__(self, visual: torch.nn.Module, dim: int):
        super().__init__()
        self.visual = visual
        self.query = torch.nn.Parameter(torch.randn(dim) * 0.02)
        self.keys = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, 4)

    def forward(self, batch) -> torch.Tensor:  # -> [B, 4] logits
        pv = torch.cat([b[0] for b in batch])
        grid = torch.cat([b[1] for b in batch])
        tokens = self.visual(pv, grid_thw=grid, return_dict=True).pooler_output  # [sum of merged tokens, D]
        pooled = []
        for f in torch.split(tokens, (grid.prod(-1) // 4).tolist()):  # per image: [n_i, D]
            a = torch.softmax(self.keys(f) @ self.query, 0)  # [n_i]
            pooled.append(a @ f)  # [D]
        return self.head(torch.stack(pooled))


def accuracy(model: Readout, data) -> float:
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(data[i:i + 50]).argmax(1) == torch.tensor([b[2] for b in data[i:i + 50]])).sum())
                   for i in range(0, len(data), 50))
    model.train()
    return hits / len(data)


def probe(arch: str, vision_lr: float, train, test, steps: int, seed: int = 0) -> tuple[float, float]:
    """(held-out accuracy after ``steps`` steps, seconds)."""
    tok = train_tokenizer(["the red frame"] * 4, vocab_size=300)
    ids = tok.convert_tokens_to_ids
    cfg = tiny_config(len(tok), arch=arch, window_size=224, image_token_id=ids("<|image_pad|>"),
                      video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                      vision_end_token_id=ids("<|vision_end|>"), eos_token_id=ids("<|im_end|>"),
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Readout(build_model(cfg, seed=seed).model.visual, cfg.text_config.hidden_size)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=vision_lr, weight_decay=0.0)
    t0 = time.perf_counter()
    for s in range(steps):
        batch = random.Random(seed * 100_003 + s).sample(train, BATCH)
        loss = torch.nn.functional.cross_entropy(model(batch), torch.tensor([b[2] for b in batch]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return accuracy(model, test), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.003, 0.002, 0.001],
                    help="vision learning rates; the first is the baseline")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--train", type=int, default=1000, help="training drills (a new scene each)")
    ap.add_argument("--test", type=int, default=200, help="held-out drills (another seed)")
    ap.add_argument("--arch", choices=ARCHES, default="qwen2_5_vl")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    if ns.steps < 1 or ns.train < BATCH or ns.test < 1:
        ap.error(f"need --steps >= 1, --train >= {BATCH} (the batch) and --test >= 1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = train_tokenizer(["the red frame"] * 4, vocab_size=300)
    proc = build_processor(tok, 56 * 56, 224 * 224, arch=ns.arch)
    scene = WorldSpec().scene_config()
    t0 = time.perf_counter()
    train, test = drills(scene, proc, ns.train, ns.seed), drills(scene, proc, ns.test, ns.seed + 99)
    print(f"{ns.train} training and {ns.test} held-out drills drawn in {time.perf_counter() - t0:.0f} s; "
          f"arch {ns.arch}, {ns.steps} steps at batch {BATCH}; chance 25%")
    rows = [(lr, *probe(ns.arch, lr, train, test, ns.steps, ns.seed)) for lr in ns.lrs]
    base = rows[0][1]
    print(f"\n| vision lr | held-out accuracy | vs lr {rows[0][0]:g} | train s |\n|---|---|---|---|")
    for lr, acc, secs in rows:
        ratio = f"{acc / base:.2f}x" if base else "-"
        print(f"| {lr:g} | {acc:.1%} | {ratio} | {secs:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
