"""Rollout throughput: the batched engine against the same episodes one at a time.

Builds a smoke world with its indexes, a tiny random-init Qwen2.5-VL (weights perturbed so
greedy output is varied text, as an untrained policy's would be) and ``--episodes``
questions, then runs the same episodes through :func:`mars.agent.engine.run_episodes`
(a) all at once (batched generation, concurrent tool calls) and (b) one episode at a time,
with the same model and greedy decoding, each with :class:`~mars.agent.hf_backend.HFBackend`'s
per-dialogue KV cache off (``episode_cache=False``: ``model.generate`` with only the shared
system-prompt cache, the previous backend) and on (keys/values of each dialogue reused across
turns). The variants run in ``--repeat`` interleaved rounds (rotated order, cache cleared before
each run) and the fastest round of each is reported, since other load on a shared machine
otherwise dominates. Prints generated tokens/s, whether every variant produced the same token
ids as the first, and a table of tokens/s ratios against both one-at-a-time baselines
(target: batched >= 4x the one-at-a-time baseline at 32 concurrent episodes on 2 cores;
the baseline of the original bench is "one at a time, episode_cache=off").

Run: ``python bench/bench_rollout.py [--episodes 32] [--turns 3] [--tokens 32] [--repeat 3]
[--cache off on] [--single off on] [--profile]`` (``--profile``: cProfile of the first batched
``episode_cache=on`` run, by own time).
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


def smoke_toolbox(root: Path):
    """A smoke world generated under ``root`` and a ToolBox over its in-memory indexes: ``(tables, toolbox)``."""
    tables = generate_world(WorldSpec.smoke(), root / "raw", root / "gallery", progress=False)
    toolbox = ToolBox(
        TextIndex.build(tables.corpus),
        ImageIndex.build(tables.gallery, root / "gallery", load_embedder("color_layout"), show_progress=False),
        root / "gallery",
        ToolConfig(),
    )
    return tables, toolbox


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
    ap.add_argument("--cache", nargs="*", default=["off", "on"], choices=["off", "on"],
                    help="episode_cache settings of the batched runs")
    ap.add_argument("--single", nargs="*", default=["off", "on"], choices=["off", "on"],
                    help="episode_cache settings of the one-at-a-time baselines")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the fastest round of each is kept")
    ap.add_argument("--profile", action="store_true", help="cProfile the first batched episode_cache=on run")
    ns = ap.parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tables, toolbox = smoke_toolbox(root)
        questions = make_questions(tables, root / "raw", seed=0, n_per_type=ns.episodes).to_pylist()
        questions = (questions * ns.episodes)[: ns.episodes]
        for i, q in enumerate(questions):
            q["question_id"] = f"{q['question_id']}-{i}"
        model, proc = tiny_policy(tables.corpus.column("text").to_pylist(), ns.pixels)
        cfg = EngineConfig(max_turns=ns.turns, max_new_tokens_per_turn=ns.tokens, min_pixels=ns.pixels,
                           max_pixels=ns.pixels)
        backends = {"off": HFBackend(model, proc, episode_cache=False), "on": HFBackend(model, proc)}
        for be in backends.values():
            run_episodes(questions[:2], be, toolbox, cfg, image_root=root)  # warm-up

        def timed(fn):
            t0 = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - t0

        variants = [(f"batched, episode_cache={c}", c, True) for c in ns.cache]
        variants += [(f"one at a time, episode_cache={c}", c, False) for c in ns.single]
        results: dict[str, tuple[list, list[float]]] = {}
        for r in range(ns.repeat):  # interleaved rounds, rotated order: other load on the machine hits all alike
            for name, cache, batched in variants[r % len(variants) :] + variants[: r % len(variants)]:
                be = backends[cache]
                be.clear_cache()
                prof = None
                if ns.profile and batched and cache == "on" and r == 0:
                    import cProfile

                    prof = cProfile.Profile()
                    prof.enable()
                if batched:
                    trajs, sec = timed(lambda: run_episodes(questions, be, toolbox, cfg, image_root=root))
                else:
                    trajs, sec = timed(lambda: [run_episodes([q], be, toolbox, cfg, image_root=root)[0]
                                                for q in questions])
                if prof is not None:
                    import pstats

                    prof.disable()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
                results.setdefault(name, (trajs, []))[1].append(sec)
        runs = [(name, results[name][0], min(results[name][1])) for name, _, _ in variants]

    ref = [t.token_ids for t in runs[0][1]]
    print(f"best of {ns.repeat} interleaved rounds; torch threads: {torch.get_num_threads()}")
    print(f"{'name':40s} {'episodes':>8s} {'tokens':>7s} {'seconds':>8s} {'tokens/s':>9s} {'same ids':>8s}")
    for name, trajs, sec in runs:
        tok = sum(t.n_generated_tokens for t in trajs)
        same = [t.token_ids for t in trajs] == ref
        print(f"{name:40s} {len(trajs):8d} {tok:7d} {sec:8.2f} {tok / sec:9.1f} {str(same):>8s}")
    tps = {name: sum(t.n_generated_tokens for t in trajs) / sec for name, trajs, sec in runs}
    singles = [n for n in tps if n.startswith("one")]
    if singles:
        print("\nratio of tokens/s (row / column)")
        print(f"{'':40s}" + "".join(f" {'single ' + n.split('=')[1]:>18s}" for n in singles))
        for n in tps:
            print(f"{n:40s}" + "".join(f" {tps[n] / tps[s]:17.2f}x" for s in singles))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
