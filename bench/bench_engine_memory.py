"""Engine peak memory against the number of episodes: bounded live episodes against one unbounded batch.

Each run is a fresh process (so its peak resident set is its own) that builds the smoke world, its tool indexes and
a tiny random-init Qwen2.5-VL policy (:func:`bench.bench_rollout.tiny_policy`), then streams N episodes through
:func:`mars.agent.engine.stream_episodes` with :class:`~mars.agent.hf_backend.HFBackend` and keeps only a pass
count per episode, as difficulty mining does. ``bounded`` runs with ``max_live_episodes = --live`` (the engine
takes a question when a slot frees and releases a finished episode's images and cache); the baseline ``unbounded``
puts all N in play at once (``max_live_episodes = N``: the engine before the bound). Prints each run's peak RSS
(``ru_maxrss``), its seconds and episodes/s, and ratios: peak RSS against the same mode at the smallest N, and
bounded against unbounded at the same N (target: bounded peak at N = 512 within 1.5x of N = 32).

Run: ``python bench/bench_engine_memory.py [--episodes 32 512] [--live 32] [--turns 2] [--tokens 16]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def child(n: int, live: int, turns: int, tokens: int) -> dict:
    """One run in this process: ``{"seconds", "peak_rss_mb", "episodes"}``."""
    import torch

    from bench.bench_rollout import smoke_toolbox, tiny_policy
    from mars.agent.engine import EngineConfig, stream_episodes
    from mars.agent.hf_backend import HFBackend
    from mars.world.questions import make_questions

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tables, toolbox = smoke_toolbox(root)
        base = make_questions(tables, root / "raw", seed=0, n_per_type=64).to_pylist()
        model, proc = tiny_policy(tables.corpus.column("text").to_pylist(), 224 * 224)
        cfg = EngineConfig(max_turns=turns, max_new_tokens_per_turn=tokens, max_live_episodes=live,
                           min_pixels=56 * 56, max_pixels=224 * 224)
        questions = ({**base[i % len(base)], "question_id": f"q{i}"} for i in range(n))  # read lazily
        t0 = time.perf_counter()
        done = sum(1 for _ in stream_episodes(questions, HFBackend(model, proc), toolbox, cfg, image_root=root))
        sec = time.perf_counter() - t0
    return {"seconds": sec, "episodes": done,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, nargs="+", default=[32, 512])
    ap.add_argument("--live", type=int, default=32, help="max_live_episodes of the bounded runs")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="max new tokens per turn")
    ap.add_argument("--child", type=int, nargs=2, metavar=("N", "LIVE"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        print(json.dumps(child(ns.child[0], ns.child[1], ns.turns, ns.tokens)))
        return 0
    runs: dict[tuple[str, int], dict] = {}
    for n in sorted(ns.episodes):
        for mode, live in (("bounded", min(ns.live, n)), ("unbounded", n)):
            out = subprocess.run([sys.executable, __file__, "--child", str(n), str(live), "--turns", str(ns.turns),
                                  "--tokens", str(ns.tokens)], capture_output=True, text=True, check=True)
            runs[(mode, n)] = json.loads(out.stdout.strip().splitlines()[-1])
            r = runs[(mode, n)]
            print(f"  {mode:9s} N={n:5d}: {r['peak_rss_mb']:8.0f} MB, {r['seconds']:7.1f} s", file=sys.stderr)
    small = min(ns.episodes)
    print(f"live bound {ns.live}; {ns.turns} turns x {ns.tokens} tokens; one fresh process per run")
    print(f"{'mode':10s} {'episodes':>8s} {'peak RSS MB':>11s} {'seconds':>8s} {'episodes/s':>10s} "
          f"{'RSS / N=' + str(small):>11s} {'bounded/unbounded':>17s}")
    for (mode, n), r in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        vs = runs[("bounded", n)]["peak_rss_mb"] / runs[("unbounded", n)]["peak_rss_mb"]
        print(f"{mode:10s} {n:8d} {r['peak_rss_mb']:11.0f} {r['seconds']:8.1f} {n / r['seconds']:10.2f} "
              f"{r['peak_rss_mb'] / runs[(mode, small)]['peak_rss_mb']:11.2f} "
              f"{vs if mode == 'bounded' else 1.0:17.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
