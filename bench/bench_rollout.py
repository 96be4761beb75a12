"""Rollout throughput: the batched engine against the same episodes one at a time.

Builds a smoke world with its indexes, a tiny random-init Qwen2.5-VL (weights perturbed so
greedy output is varied text, as an untrained policy's would be) and ``--episodes``
questions, then runs the same episodes through :func:`mars.agent.engine.run_episodes`
(a) all at once (batched generation with the KV cache, concurrent tool calls) and (b) one
episode at a time, with the same model and greedy decoding. Prints generated tokens/s for
both and the ratio (target: >= 4x at 32 concurrent episodes on 2 cores).

Run: ``python bench/bench_rollout.py [--episodes 32] [--turns 3] [--tokens 32]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from mars.agent.engine import EngineConfig, run_episodes
from mars.agent.hf_backend import HFBackend
from mars.agent.protocol import system_prompt
from mars.model.build import build_model, tiny_config
from mars.model.processor import build_processor
from mars.model.tokenizer import train_tokenizer
from mars.tools.base import TOOL_SCHEMAS
from mars.tools.embedders import load_embedder
from mars.tools.image_index import ImageIndex
from mars.tools.text_index import TextIndex
from mars.tools.toolbox import ToolBox, ToolConfig
from mars.world.generate import WorldSpec, generate_world
from mars.world.questions import make_questions


def tiny_policy(texts: list[str], pixels: int):
    # the tokenizer sees the world's text and the protocol's own text (system prompt, tags), as
    # the pipeline's tokenizer does, so the system prompt does not explode into byte-level tokens
    protocol = [system_prompt(TOOL_SCHEMAS)] * 50
    tok = train_tokenizer(texts + protocol, vocab_size=2048)
    proc = build_processor(tok, pixels, pixels)
    model = build_model(tiny_config(len(tok)), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # an untouched random model repeats one token; perturb it into varied text
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.08)
    model.eval()
    return model, proc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="max new tokens per turn")
    ap.add_argument("--pixels", type=int, default=224 * 224)
    ns = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tables = generate_world(WorldSpec.smoke(), root / "raw", root / "gallery", progress=False)
        toolbox = ToolBox(
            TextIndex.build(tables.corpus),
            ImageIndex.build(tables.gallery, root / "gallery", load_embedder("color_layout"), show_progress=False),
            root / "gallery",
            ToolConfig(),
        )
        questions = make_questions(tables, root / "raw", seed=0, n_per_type=ns.episodes).to_pylist()
        questions = (questions * ns.episodes)[: ns.episodes]
        for i, q in enumerate(questions):
            q["question_id"] = f"{q['question_id']}-{i}"
        model, proc = tiny_policy(tables.corpus.column("text").to_pylist(), ns.pixels)
        backend = HFBackend(model, proc)
        cfg = EngineConfig(max_turns=ns.turns, max_new_tokens_per_turn=ns.tokens, min_pixels=ns.pixels,
                           max_pixels=ns.pixels)
        run_episodes(questions[:2], backend, toolbox, cfg, image_root=root)  # warm-up

        t0 = time.perf_counter()
        batched = run_episodes(questions, backend, toolbox, cfg, image_root=root)
        t_batched = time.perf_counter() - t0
        t0 = time.perf_counter()
        single = [run_episodes([q], backend, toolbox, cfg, image_root=root)[0] for q in questions]
        t_single = time.perf_counter() - t0

    tok_b = sum(t.n_generated_tokens for t in batched)
    tok_s = sum(t.n_generated_tokens for t in single)
    rows = [
        ("one episode at a time [baseline]", len(single), tok_s, t_single, tok_s / t_single, 1.0),
        (f"batched engine ({ns.episodes} at once)", len(batched), tok_b, t_batched, tok_b / t_batched,
         (tok_b / t_batched) / (tok_s / t_single)),
    ]
    print(f"{'name':40s} {'episodes':>8s} {'tokens':>7s} {'seconds':>8s} {'tokens/s':>9s} {'ratio':>6s}")
    for name, n, tok, sec, tps, ratio in rows:
        print(f"{name:40s} {n:8d} {tok:7d} {sec:8.2f} {tps:9.1f} {ratio:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
