"""RL step time, split into rollout / scoring / old log-probs / update: our ``train_rl`` against TRL's GRPOTrainer.

What it measures
    1. The same single-turn, text-only GRPO step for both trainers: the same tiny model (the default profile's
       Qwen2.5-VL from ``tiny_config``: 128 hidden, 3 layers; random init, weights perturbed as in
       ``bench_rollout.py`` so sampled text varies; the same initial weights for every run), the same prompts
       (short arithmetic questions, "What is 3 + 4?", gold = the number), ``--prompts`` (B) prompts x
       ``--group`` (G) samples per step, at most ``--tokens`` generated tokens, temperature 1, one optimizer update
       per step on the whole batch (ours: ``mini_batches=1, ppo_epochs=1, micro_batch_size=B*G``; TRL:
       ``per_device_train_batch_size=B*G, num_generations=G, steps_per_generation=1, num_iterations=1``),
       AdamW at a constant learning rate, no KL term, reward = exact match of the ``<answer>`` (rule judge).
       Both use the direct-answer system prompt in ChatML. Ours always shows the question image: here a 28x28
       blank image (1 vision token; ``min_pixels = max_pixels = 784``); TRL gets the same text without it.

       Phases. Ours: ``t_rollout`` / ``t_old_logp`` / ``t_update`` from ``train_rl``'s history; scoring (rule judge
       and reward of every episode, inside ``run_episodes``) is timed by wrapping ``mars.agent.engine._score`` and
       taken out of the rollout column. TRL: ``_generate`` (rollout), ``_calculate_rewards`` (scoring),
       ``_get_per_token_logps_and_entropies`` under ``no_grad`` (old log-probs; TRL skips them when generation and
       update are aligned, as here, and uses the detached current log-probs instead; ours takes the rollout's own
       log-probs, reported at the sampling temperature, and recomputes nothing),
       and update = the rest of the optimizer step (the training forward/backward, optimizer, logging).
       Step = ours: the sum of its three phases; TRL: wall time from ``on_step_begin`` to ``on_step_end``.
       Ours runs with ``HFBackend``'s per-dialogue KV cache on (its own decode loop, the default) and off
       (``model.generate``, the path TRL also uses), to tell the decode loop apart from the rest of the rollout.
       Each run does ``--steps`` steps; the fastest step (by total) of each run is kept, runs are interleaved over
       ``--repeat`` rounds (rotated order) and the best round of each trainer is printed, with the load average.

    2. Peak memory of one default-profile-sized RL step (``--mem-prompts`` 8 x ``--mem-group`` 8 rollouts, the
       agent section's defaults: 6 turns, 96 tokens per turn, 256 tokens per episode, 56*56..224*224 pixels,
       compact prompt, the three tools on a smoke world; ``RLConfig`` defaults: 2 mini-batches, micro-batch 16)
       with our tiny model and ``HFBackend``, in a child process (``ru_maxrss`` of that process alone).
       Target < 8 GiB. Only with ``--memory``: it takes about 6 minutes on 2 loaded cores (measured 2026-11-30:
       peak RSS 3006 MiB = 2.94 GiB, 897 MiB before the step; rollout 266 s, old log-probs 22 s, update 62 s).
       Caveat: the random-init policy never calls a tool, so its dialogues hold no tool images; a trained
       policy's longer dialogues (crops and thumbnails as image tokens) would need more memory in the update.

TRL is the ``bench`` extra (``pip install -c requirements.lock -e '.[bench]'``); without it the bench says
"TRL not installable/importable: <reason>" and measures ours only.

Run: ``python bench/bench_rl.py [--prompts 4] [--group 4] [--tokens 32] [--steps 2] [--repeat 2] [--ours on off]
[--memory [--mem-prompts 8] [--mem-group 8]]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mars.agent.engine as engine_mod  # noqa: E402
from mars.agent.engine import EngineConfig  # noqa: E402
from mars.agent.hf_backend import HFBackend  # noqa: E402
from mars.agent.protocol import DIRECT_SYSTEM_PROMPT, parse_turn  # noqa: E402
from mars.model.build import build_model, tiny_config  # noqa: E402
from mars.model.chat import to_text  # noqa: E402
from mars.model.processor import build_processor  # noqa: E402
from mars.model.tokenizer import train_tokenizer  # noqa: E402
from mars.rl.judge import rule_judge  # noqa: E402
from mars.rl.rewards import RewardWeights  # noqa: E402
from mars.train.optim import OptimConfig  # noqa: E402
from mars.train.rl import RLConfig, train_rl  # noqa: E402

PIX = 28 * 28
LR = 1e-4


def arithmetic(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        out.append({"question_id": f"q{i}", "question": f"What is {a} + {b}? Answer with the number.",
                    "answer": str(a + b), "aliases": []})
    return out


def perturbed(vocab: int, seed: int = 0, scale: float = 0.08):
    model = build_model(tiny_config(vocab), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # an untouched random model repeats one token; perturb it into varied text
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def exact_reward(text: str, gold: str) -> float:
    t = parse_turn(text)
    return float(t.action == "answer" and t.well_formed and rule_judge(t.answer, [gold]).correct)


# ----------------------------------------------------------------------------------------------------------- ours

def run_ours(init: dict, vocab: int, proc, questions: list[dict], ns, tmp: Path, cache: bool = True) -> list[dict]:
    model = build_model(tiny_config(vocab), seed=0)
    model.load_state_dict(init)
    blank = Image.new("RGB", (28, 28), (128, 128, 128))
    qs = [{**q, "image": blank} for q in questions]
    score_t = [0.0]
    orig = engine_mod._score

    def timed_score(ep, weights):
        t0 = time.perf_counter()
        out = orig(ep, weights)
        score_t[0] += time.perf_counter() - t0
        return out

    per_step: list[float] = []

    def on_update(step: int) -> None:
        per_step.append(score_t[0])
        score_t[0] = 0.0

    cfg = RLConfig(optim=OptimConfig(lr=LR, vision_lr=LR, warmup_steps=0, schedule="constant"), steps=ns.steps,
                   algorithm="grpo", prompts_per_step=ns.prompts, group_size=ns.group, temperature=1.0,
                   mini_batches=1, ppo_epochs=1, micro_batch_size=ns.prompts * ns.group, checkpoint_every=10**6,
                   collapse_window=10**6, seed=0)
    eng = EngineConfig(max_turns=1, max_new_tokens_per_turn=ns.tokens, max_total_tokens=ns.tokens,
                       min_pixels=PIX, max_pixels=PIX, prompt="direct")
    engine_mod._score = timed_score
    logging.getLogger("mars.train.rl").setLevel(logging.ERROR)  # the "ratio is exactly 1" notice: intended here
    try:
        s = train_rl(model, proc, qs, None, eng, cfg, ckpt_dir=tmp / "ckpt", live_dir=None, fp="bench",
                     image_root=None, weights=RewardWeights(answer=1.0, format=0.0),
                     backend_factory=lambda m: HFBackend(m, proc, episode_cache=cache), on_update=on_update)
    finally:
        engine_mod._score = orig
    rows = []
    for h, sc in zip(s["history"], per_step):
        rows.append({"rollout": h["t_rollout"] - sc, "scoring": sc, "old_logp": h["t_old_logp"],
                     "update": h["t_update"], "total": h["t_rollout"] + h["t_old_logp"] + h["t_update"],
                     "tokens": h["response_tokens"] * ns.prompts * ns.group, "reward": h["reward"]})
    return rows


# ------------------------------------------------------------------------------------------------------------ TRL

def run_trl(init: dict, vocab: int, tok, questions: list[dict], ns, tmp: Path) -> list[dict]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model = build_model(tiny_config(vocab), seed=0)
    model.load_state_dict(init)
    prompts = [to_text([{"role": "system", "content": DIRECT_SYSTEM_PROMPT},
                        {"role": "user", "content": q["question"]}], add_generation_prompt=True) for q in questions]
    ds = Dataset.from_list([{"prompt": p, "gold": q["answer"]} for p, q in zip(prompts, questions)])

    def reward_exact(completions, gold, **kw):
        return [exact_reward(c, g) for c, g in zip(completions, gold)]

    args = GRPOConfig(
        output_dir=str(tmp / "trl"), per_device_train_batch_size=ns.prompts * ns.group, gradient_accumulation_steps=1,
        num_generations=ns.group, steps_per_generation=1, num_iterations=1, max_completion_length=ns.tokens,
        max_steps=ns.steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, temperature=1.0, top_p=1.0, loss_type="grpo", scale_rewards="group",
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_exact], args=args, train_dataset=ds,
                          processing_class=tok)
    acc = {"rollout": 0.0, "scoring": 0.0, "old_logp": 0.0, "gen_and_score": 0.0, "tokens": 0}

    def wrap(name: str, key):
        f = getattr(trainer, name)

        def w(*a, **k):
            t0 = time.perf_counter()
            out = f(*a, **k)
            dt = time.perf_counter() - t0
            kk = key() if callable(key) else key
            if kk:
                acc[kk] += dt
            return out

        setattr(trainer, name, w)

    wrap("_generate", "rollout")
    wrap("_calculate_rewards", "scoring")
    wrap("_generate_and_score_completions", "gen_and_score")
    wrap("_get_per_token_logps_and_entropies", lambda: None if torch.is_grad_enabled() else "old_logp")
    rows: list[dict] = []
    rewards: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            for k in acc:
                acc[k] = 0.0
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            total = time.perf_counter() - self.t0
            rows.append({"rollout": acc["rollout"], "scoring": acc["scoring"], "old_logp": acc["old_logp"],
                         "update": total - acc["gen_and_score"], "total": total,
                         "other": acc["gen_and_score"] - acc["rollout"] - acc["scoring"] - acc["old_logp"]})

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
            if logs and "completions/mean_length" in logs and rows:
                rows[-1]["tokens"] = float(logs["completions/mean_length"]) * ns.prompts * ns.group

    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # its per-step log dicts would bury the table
    trainer.add_callback(Timer())
    trainer.train()
    for r, rw in zip(rows, rewards):
        r["reward"] = rw
    return rows


# --------------------------------------------------------------------------------------------- memory (child)

def memory_child(ns) -> int:
    """One default-profile RL step in this process; prints a JSON line with its peak RSS and phase times."""
    import resource

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_rollout import smoke_toolbox, tiny_policy
    from mars.world.questions import make_questions

    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tables, toolbox = smoke_toolbox(root)
        qs = make_questions(tables, root / "raw", seed=0, n_per_type=ns.mem_prompts).to_pylist()
        model, proc = tiny_policy(tables.corpus.column("text").to_pylist(), 224 * 224)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        eng = EngineConfig(max_turns=6, max_new_tokens_per_turn=96, max_total_tokens=256, min_pixels=3136,
                           max_pixels=50176, prompt="compact", tool_workers=4)
        cfg = RLConfig(optim=OptimConfig(lr=2e-4, vision_lr=2e-4, warmup_steps=0, schedule="constant"), steps=1,
                       prompts_per_step=ns.mem_prompts, group_size=ns.mem_group, checkpoint_every=10**6, seed=0)
        t0 = time.perf_counter()
        s = train_rl(model, proc, qs, toolbox, eng, cfg, ckpt_dir=root / "ckpt", live_dir=None, fp="mem",
                     image_root=root)
        wall = time.perf_counter() - t0
    h = s["history"][0]
    print("MEMJSON " + json.dumps({
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_before_step_mib": rss0,
        "wall_s": wall, "t_rollout": h["t_rollout"], "t_old_logp": h["t_old_logp"], "t_update": h["t_update"],
        "response_tokens": h["response_tokens"], "turns": h["turns"], "tool_calls": h["tool_calls"],
        "episodes": ns.mem_prompts * ns.mem_group}))
    return 0


# ------------------------------------------------------------------------------------------------------------ main

def best_step(rows: list[dict]) -> dict:
    return min(rows, key=lambda r: r["total"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="B: prompts per step")
    ap.add_argument("--group", type=int, default=4, help="G: samples per prompt")
    ap.add_argument("--tokens", type=int, default=32, help="max generated tokens")
    ap.add_argument("--steps", type=int, default=2, help="steps per run (the fastest step is kept)")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the best round of each is kept")
    ap.add_argument("--ours", nargs="+", default=["on", "off"], choices=["on", "off"],
                    help="HFBackend episode_cache of our runs (off = model.generate, as TRL)")
    ap.add_argument("--memory", action="store_true",
                    help="also run the default-profile-sized memory step (about 6 minutes on 2 loaded cores)")
    ap.add_argument("--mem-prompts", type=int, default=8, help="B of the memory step")
    ap.add_argument("--mem-group", type=int, default=8, help="G of the memory step")
    ap.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.memory_child:
        return memory_child(ns)
    load0 = os.getloadavg()
    torch.manual_seed(0)
    questions = arithmetic(64)
    texts = [q["question"] for q in questions] * 20 + [DIRECT_SYSTEM_PROMPT] * 50 + [
        f"<think>{a} plus {b}</think>\n<answer>{a + b}</answer>" for a in range(1, 21) for b in range(1, 21)]
    tok = train_tokenizer(texts, vocab_size=1024)
    proc = build_processor(tok, PIX, PIX)
    init = perturbed(len(tok)).state_dict()
    trl_reason = None
    try:
        import trl  # noqa: F401

        trl_version = trl.__version__
    except Exception as exc:  # noqa: BLE001
        trl_reason = f"TRL not installable/importable: {type(exc).__name__}: {exc}"
    trainers = [f"ours, episode_cache={c}" for c in ns.ours]
    trainers += [] if trl_reason else [f"TRL {trl_version} GRPOTrainer"]
    runs: dict[str, list[list[dict]]] = {t: [] for t in trainers}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(ns.repeat):
            for name in trainers[r % len(trainers):] + trainers[: r % len(trainers)]:
                d = Path(tmp) / f"{r}-{trainers.index(name)}"
                if name.startswith("ours"):
                    rows = run_ours(init, len(tok), proc, questions, ns, d, cache=name.endswith("=on"))
                else:
                    try:
                        rows = run_trl(init, len(tok), tok, questions, ns, d)
                    except Exception as exc:  # noqa: BLE001
                        trl_reason = f"TRL run failed: {type(exc).__name__}: {exc}"
                        trainers.remove(name)
                        runs.pop(name, None)
                        continue
                runs[name].append(rows)
    mem = None
    if ns.memory:
        cmd = [sys.executable, __file__, "--memory-child", "--mem-prompts", str(ns.mem_prompts), "--mem-group",
               str(ns.mem_group)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = next((x for x in p.stdout.splitlines() if x.startswith("MEMJSON ")), None)
        mem = json.loads(line[8:]) if line else {"error": (p.stderr or p.stdout)[-2000:]}
    load1 = os.getloadavg()

    print(f"RL bench: single-turn text-only GRPO step, B={ns.prompts} prompts x G={ns.group} samples, <= {ns.tokens} "
          f"generated tokens, 1 update/step, tiny Qwen2.5-VL ({len(tok)} vocab); {ns.steps} steps per run, fastest "
          f"step per run, best of {ns.repeat} interleaved rounds; torch threads {torch.get_num_threads()}; "
          f"os.cpu_count {os.cpu_count()}")
    print(f"load average (1/5/15 min): before {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
          f"after {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}")
    if trl_reason:
        print(trl_reason)
    best = {name: min((best_step(rows) for rows in runs[name]), key=lambda x: x["total"]) for name in trainers}
    cols = ("rollout", "scoring", "old_logp", "update", "total")
    print(f"\n{'trainer':28s} " + " ".join(f"{c + ' s':>10s}" for c in cols) + f" {'gen tok':>8s} {'tok/s':>7s} "
          f"{'reward':>6s}")
    for name in trainers:
        b = best[name]
        tokens = b.get("tokens", float("nan"))
        print(f"{name:28s} " + " ".join(f"{b[c]:10.3f}" for c in cols)
              + f" {tokens:8.0f} {tokens / b['total']:7.1f} {b.get('reward', float('nan')):6.2f}")
    tname = next((n for n in trainers if n.startswith("TRL")), None)
    if tname is not None:
        t = best[tname]
        print("\nratio ours / TRL (time; < 1 = ours faster)")
        for name in trainers:
            if name != tname:
                o = best[name]
                print(f"  {name:26s} " + ", ".join(
                    f"{c} {o[c] / t[c]:.2f}x" if t[c] > 0 else f"{c} {o[c]:.3f}s vs 0" for c in cols))
        print(f"TRL 'update' = step wall time minus generate+score (training forward/backward, optimizer, logging); "
              f"TRL other work inside generate+score (tokenising, advantages, metrics): {t.get('other', 0):.3f} s")
    print("\nall steps (total s): " + "; ".join(
        f"{name}: " + " | ".join("/".join(f"{x['total']:.2f}" for x in rows) for rows in runs[name])
        for name in trainers))
    if mem is not None:
        if "error" in mem:
            print(f"\nmemory step failed:\n{mem['error']}")
        else:
            gib = mem["peak_rss_mib"] / 1024
            print(f"\ndefault-profile RL step ({mem['episodes']} episodes = {ns.mem_prompts} x {ns.mem_group}, "
                  "6 turns x 96 tokens, 256/episode, tools on a smoke world, mini_batches 2, micro-batch 16), "
                  "child process:")
            print(f"  peak RSS {mem['peak_rss_mib']:.0f} MiB ({gib:.2f} GiB; {mem['rss_before_step_mib']:.0f} MiB "
                  f"before the step) -> target < 8 GiB {'met' if gib < 8 else 'NOT met'}")
            print(f"  step {mem['wall_s']:.1f} s: rollout {mem['t_rollout']:.1f} s, old log-probs "
                  f"{mem['t_old_logp']:.1f} s, update {mem['t_update']:.1f} s; mean {mem['response_tokens']:.0f} "
                  f"generated tokens, {mem['turns']:.1f} turns, {mem['tool_calls']:.2f} tool calls per episode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
