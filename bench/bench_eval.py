"""Evaluation throughput: ``evaluate_model`` in chunks of 32 episodes against one sample at a time.

What it measures
    Samples/s and generated tokens/s of :func:`mars.eval.run.evaluate_model` (agentic workflow, greedy, k=1) with
    :class:`~mars.agent.hf_backend.HFBackend` on a smoke world with its indexes: the whole evaluation path (question
    image decoding, batched multi-turn rollout with tools, rule judging, result rows with PNG-encoded images,
    one parquet chunk per ``chunk_size`` in a :class:`~mars.eval.run.ResultStore`).

Baseline
    The same call with ``chunk_size=1``: every sample is played alone (one ``backend.generate`` per sample and turn).
    Same tiny random-init Qwen2.5-VL (weights perturbed as in ``bench_rollout.py`` so greedy output is varied text,
    as an untrained policy's would be), same questions, same engine settings; a fresh backend and an empty result
    store per run. Variants run in ``--repeat`` interleaved rounds (rotated order); the fastest round of each is
    kept, and the machine's load average is printed (other jobs slow every variant alike: read the ratios).
    ``same preds`` says whether a variant's predictions and token counts equal the first variant's.

Target: chunk_size 32 >= 4x the samples/s of chunk_size 1 (as the batched engine's rollout target).

Run: ``python bench/bench_eval.py [--samples 32] [--turns 2] [--tokens 16] [--chunks 32 1] [--repeat 2]``
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import smoke_toolbox, tiny_policy  # noqa: E402
from mars.agent.engine import EngineConfig  # noqa: E402
from mars.agent.hf_backend import HFBackend  # noqa: E402
from mars.eval.run import ResultStore, evaluate_model  # noqa: E402
from mars.world.questions import make_questions  # noqa: E402


def bench_rows(questions: list[dict], root: Path, n: int) -> list[dict]:
    """BENCH_QUESTIONS rows from QUESTIONS rows (image files re-encoded as PNG bytes), repeated up to ``n``."""
    out = []
    for i in range(n):
        q = questions[i % len(questions)]
        with Image.open(root / q["image_path"]) as im:
            buf = io.BytesIO()
            im.convert("RGB").save(buf, format="PNG")
        out.append({"id": f"{q['question_id']}-{i}", "benchmark": "synth", "question": q["question"],
                    "images": [buf.getvalue()], "answers": [q["answer"], *q["aliases"]], "choices": q["choices"],
                    "category": q["type"], "difficulty": str(q["difficulty"]), "type": q["type"],
                    "search_results": None})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="max new tokens per turn")
    ap.add_argument("--pixels", type=int, default=224 * 224)
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 1], help="chunk sizes; the last is the baseline")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the fastest round of each is kept")
    ns = ap.parse_args(argv)
    load0 = os.getloadavg()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tables, toolbox = smoke_toolbox(root)
        qs = make_questions(tables, root / "raw", seed=0, n_per_type=ns.samples).to_pylist()
        rows = bench_rows(qs, root, ns.samples)
        model, proc = tiny_policy(tables.corpus.column("text").to_pylist(), ns.pixels)
        cfg = EngineConfig(max_turns=ns.turns, max_new_tokens_per_turn=ns.tokens, min_pixels=ns.pixels,
                           max_pixels=ns.pixels, temperature=0.0)
        evaluate_model(rows[:2], lambda: HFBackend(model, proc), toolbox, cfg, ResultStore(root / "warm", "w"),
                       model="tiny", workflow="agentic", chunk_size=2)  # warm-up, not timed
        results: dict[int, tuple[list[dict], list[float]]] = {}
        variants = list(ns.chunks)
        for r in range(ns.repeat):
            for c in variants[r % len(variants):] + variants[: r % len(variants)]:
                store = ResultStore(root / f"store-{r}-{c}", "run")
                t0 = time.perf_counter()
                n = evaluate_model(rows, lambda: HFBackend(model, proc), toolbox, cfg, store, model="tiny",
                                   workflow="agentic", chunk_size=c)
                sec = time.perf_counter() - t0
                assert n == len(rows), (n, len(rows))
                out = sorted(store.table().select(["sample_id", "prediction", "tokens", "turns", "correct"])
                             .to_pylist(), key=lambda x: x["sample_id"])
                results.setdefault(c, (out, []))[1].append(sec)
    load1 = os.getloadavg()
    print(f"eval bench: {ns.samples} samples (smoke world, agentic, greedy, k=1), <= {ns.turns} turns x {ns.tokens} "
          f"tokens; best of {ns.repeat} interleaved rounds; torch threads {torch.get_num_threads()}; "
          f"os.cpu_count {os.cpu_count()}")
    print(f"load average (1/5/15 min): before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
          f"after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}")
    ref = results[variants[0]][0]
    base = variants[-1]
    stats = {}
    for c in variants:
        out, secs = results[c]
        sec = min(secs)
        tok = sum(x["tokens"] for x in out)
        stats[c] = (len(out) / sec, tok / sec)
    print(f"\n{'variant':22s} {'samples':>7s} {'tokens':>7s} {'turns/s':>7s} {'seconds':>8s} {'samples/s':>9s} "
          f"{'tokens/s':>9s} {'ratio':>7s} {'same preds':>10s}")
    for c in variants:
        out, secs = results[c]
        sec = min(secs)
        tok = sum(x["tokens"] for x in out)
        turns = sum(x["turns"] for x in out)
        same = [(x["prediction"], x["tokens"]) for x in out] == [(x["prediction"], x["tokens"]) for x in ref]
        print(f"{'chunk_size ' + str(c):22s} {len(out):7d} {tok:7d} {turns / sec:7.2f} {sec:8.2f} {stats[c][0]:9.3f} "
              f"{stats[c][1]:9.1f} {stats[c][0] / stats[base][0]:6.2f}x {str(same):>10s}")
    print(f"\n(ratio: samples/s over chunk_size {base}; all runs per round: "
          + ", ".join(f"chunk {c}: " + "/".join(f"{s:.1f}" for s in results[c][1]) + " s" for c in variants) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
