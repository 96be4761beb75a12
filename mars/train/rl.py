"""BN-GSPO reinforcement learning with multi-turn tool rollouts (and its GRPO / GSPO ablation partners).

What it does
    :func:`train_rl` runs, for ``steps`` steps:

    1. sample ``prompts_per_step`` (B) questions from the rl split (a seeded, resumable sampler) and play each
       ``group_size`` (G) times through the shared rollout engine (:func:`mars.agent.engine.run_episodes`) with the
       current policy (``temperature``, ``top_p``), scored by the shared judge and rewards;
    2. optional dynamic sampling (DAPO style): groups whose rewards are all equal are dropped and new prompts are
       drawn, up to ``max_refills`` rounds;
    3. advantages (:func:`mars.rl.advantages.compute_advantages`: ``bn`` = group z-score then batch z-score,
       ``grpo``, ``none``);
    4. the trained batch is each episode rendered from the token ids its policy sampled (a turn is never
       re-tokenised from its text, and the ``<|im_end|>`` closing a turn cut by a stop string or the budget is
       context, not trained; tool outputs are masked out and do not count in GSPO's |y|); old log-probs are the
       rollout's own (the backend reports them at the sampling temperature), else recomputed before the step's
       first update; then ``ppo_epochs`` x ``mini_batches`` updates of :func:`mars.rl.losses.policy_loss`
       (``level`` ``sequence`` = GSPO, ``token`` = GRPO) on log-probs of ``logits / temperature``, micro-batched
       with exact gradient accumulation; an optional k3 KL penalty to the frozen initial policy (``kl_beta``).
       With one epoch and one mini-batch the ratio is exactly 1 and clipping is inert: a notice is logged. The
       learning-rate schedule spans all ``steps x ppo_epochs x mini_batches`` optimizer updates.
    5. monitors every step (dvclive): reward and its components, accuracy, degenerate-group fraction, batch scale
       1/std, entropy, response length, turns, tool-call rate per tool, tool error rate, format-error rate,
       learning rate, gradient norm (mean and max over the step's updates), and from the off-policy
       mini-batches (all but the step's first) the approximate KL per update (mean and max), clip fractions and
       ratios; ``logp_gap`` is the
       mean |trainer - rollout| log-prob on the first, on-policy mini-batch (about 1e-6 in process; larger means
       the rollout server scores other tokens or another temperature). A NaN or a collapse (tool calls per
       episode below ``collapse_min_tool_rate`` for ``collapse_window`` consecutive steps) stops the run with a
       clear message.
    6. checkpoints every ``checkpoint_every`` steps (model, optimizer, scheduler, RNG states, step, sampler
       position, monitor history, rollout samples); a rerun with the same fingerprint resumes from the newest one
       and reaches the same final weights as an uninterrupted run (CPU, same seed).

Recipes (``algorithm``): ``bn_gspo`` (default; bn + sequence), ``gspo`` (grpo + sequence), ``grpo`` (grpo +
token).

Deviations
    - The released MARS script runs plain GRPO; the paper's BN-GSPO is the default here (docs/design.md, BN-GSPO).
    - The policy is rolled out in process (HF backend); on GPUs rollouts go to a vLLM server through the ``openai``
      backend, with the weights pushed to the server after each update (:func:`mars.serve.openai_server` exposes
      the reload call the stage uses; docs/design.md, The scale path).
    - A fresh HF backend is made every step, so no KV cache computed with old weights is ever reused.
    - The monitor "tool calls on questions that need none" is not logged: every question of the generated world
      needs a tool (perception a zoom, search and multi-hop searches); ``tool_calls`` per episode and the
      per-tool rates are logged instead.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm import tqdm

from mars.agent.engine import EngineConfig, Trajectory, run_episodes
from mars.errors import StageError
from mars.model.chat import Rendered, render, vision_token_ids
from mars.rl.advantages import batch_scale, compute_advantages, group_advantages
from mars.rl.losses import entropy_from_logits, kl_penalty, loss_normalizer, masked_mean, policy_loss
from mars.rl.rewards import RewardWeights
from mars.train.checkpoint import Checkpointer, open_live
from mars.train.data import EpochSampler, collate, label_logits
from mars.train.optim import OptimConfig, make_stepper
from mars.train.sft import peak_rss_mb

__all__ = ["RLConfig", "RECIPES", "train_rl", "sequence_logps", "sampled_example", "rollout_logps", "RLCollapse"]
log = logging.getLogger(__name__)

RECIPES: dict[str, tuple[str, str]] = {"bn_gspo": ("bn", "sequence"), "gspo": ("grpo", "sequence"),
                                       "grpo": ("grpo", "token")}
TOOLS = ("image_zoom_in", "image_search", "text_search")


class RLCollapse(StageError, RuntimeError):
    """The run stopped on NaN or a collapse monitor."""


@dataclass(frozen=True)
class RLConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-4, vision_lr=2e-4, warmup_steps=0,
                                                                  schedule="constant"))  # max_steps: from ``updates``
    steps: int = 40  # RL steps (rollouts + updates); the schedule spans ``updates`` optimizer steps
    algorithm: str = "bn_gspo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_beta: float = 0.0
    prompts_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    ppo_epochs: int = 1
    mini_batches: int = 2
    micro_batch_size: int = 16
    dynamic_sampling: bool = False
    max_refills: int = 2
    collapse_window: int = 10
    collapse_min_tool_rate: float = 0.05
    checkpoint_every: int = 10
    samples_per_step: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.algorithm not in RECIPES:
            raise ValueError(f"rl.algorithm must be one of {sorted(RECIPES)}, got {self.algorithm!r}")
        if self.group_size < 2:
            raise ValueError(f"rl.group_size must be >= 2 (a group z-score needs two rollouts), got {self.group_size}")
        if not self.temperature > 0:
            raise ValueError(f"rl.temperature must be > 0 (RL samples its rollouts), got {self.temperature}")
        for name in ("steps", "prompts_per_step", "ppo_epochs", "mini_batches", "micro_batch_size",
                     "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"rl.{name} must be >= 1, got {getattr(self, name)}")
        if self.kl_beta < 0:
            raise ValueError(f"rl.kl_beta must be >= 0, got {self.kl_beta}")

    @property
    def updates(self) -> int:
        """Optimizer steps of the whole run (what the learning-rate schedule spans)."""
        return self.steps * self.ppo_epochs * self.mini_batches

    @property
    def recipe(self) -> tuple[str, str]:
        return RECIPES[self.algorithm]


def sequence_logps(model, batch, *, temperature: float = 1.0, suppress: Sequence[int] = (),
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token log-probs of each sequence's own next tokens at the sampling ``temperature`` (``logits / T``, the
    ``suppress`` ids excluded, as the rollout backend samples and reports them): ``logp`` [B, T-1], ``mask``
    [B, T-1] (model tokens), and optionally the entropy of that distribution [B, T-1]."""
    logits, labels, index = label_logits(model, batch)  # [M, V], [M], [M, 2]: only model-token positions
    logits = logits.float() / temperature  # [M, V]
    if suppress:
        logits = logits.index_fill(-1, torch.as_tensor(list(suppress), device=logits.device), float("-inf"))
    lp_sel = torch.log_softmax(logits, dim=-1).gather(-1, labels[:, None]).squeeze(-1)  # [M]
    B, T = batch.labels.shape
    mask = batch.labels[:, :-1] != -100  # [B, T-1]: labels[t] is the token at t+1 when it is a model token
    logp = torch.zeros(B, T, dtype=lp_sel.dtype).index_put((index[:, 0], index[:, 1]), lp_sel)[:, :-1]  # [B, T-1]
    ent = None
    if with_entropy:
        ent_sel = entropy_from_logits(logits.detach()[None])[0]  # [M]
        ent = torch.zeros(B, T).index_put((index[:, 0], index[:, 1]), ent_sel)[:, :-1]
    return logp, mask, ent


def sampled_example(traj: Trajectory, processor) -> Rendered:
    """The trainer's example of one episode: its dialogue rendered from the ids the policy sampled (assistant
    messages carry them, :mod:`mars.agent.engine`), so the loss is on exactly those ids and nothing else. What
    follows the last assistant turn (the observation of an episode that ended there) carries no loss and conditions
    nothing: it is left out."""
    last = max((i for i, m in enumerate(traj.messages) if m["role"] == "assistant"), default=len(traj.messages) - 1)
    r = render(traj.messages[: last + 1], processor)
    if traj.token_ids is not None:
        trained = r.input_ids[r.loss_mask.bool()].tolist()
        if trained != list(traj.token_ids):
            raise RuntimeError(f"episode {traj.episode_id}: the trained ids are not the {len(traj.token_ids)} "
                               f"sampled ones ({len(trained)} trained); an assistant turn lost its token_ids")
    return r


def rollout_logps(trajs: Sequence[Trajectory], rendered: Sequence[Rendered]) -> dict[int, torch.Tensor] | None:
    """The rollout's own log-probs laid out like :func:`sequence_logps` (``[T-1]`` per episode, at the model-token
    positions), or None unless every episode has one per sampled token."""
    out = {}
    for i, (t, r) in enumerate(zip(trajs, rendered)):
        if t.logprobs is None or t.token_ids is None or len(t.logprobs) != len(t.token_ids):
            return None
        pos = r.loss_mask[1:].bool()  # [T-1]: position t predicts token t+1
        lp = torch.zeros(len(r.input_ids) - 1)
        lp[pos] = torch.tensor(t.logprobs, dtype=torch.float32)
        out[i] = lp
    return out


def _monitors(trajs: Sequence[Trajectory], adv_group: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    n = len(trajs)
    rewards = torch.tensor([t.reward for t in trajs])
    degenerate = 0
    ids = groups.unique()
    for g in ids:
        r = rewards[groups == g]
        degenerate += int(bool((r == r[0]).all()))
    m = {
        "reward": float(rewards.mean()),
        "reward_answer": float(np.mean([t.reward_answer for t in trajs])),
        "reward_format": float(np.mean([t.reward_format for t in trajs])),
        "accuracy": float(np.mean([t.correct for t in trajs])),
        "degenerate_groups": degenerate / max(len(ids), 1),
        "batch_scale": batch_scale(adv_group),
        "response_tokens": float(np.mean([t.n_generated_tokens for t in trajs])),
        "turns": float(np.mean([t.n_turns for t in trajs])),
        "tool_calls": float(np.mean([t.n_tool_calls for t in trajs])),
        "tool_error_rate": sum(t.n_tool_errors for t in trajs) / max(1, sum(t.n_tool_calls for t in trajs)),
        "format_error_rate": float(np.mean([t.n_format_errors > 0 for t in trajs])),
    }
    for tool in TOOLS:
        m[f"calls_{tool}"] = sum(1 for t in trajs for c in t.tool_calls if c["name"] == tool) / max(n, 1)
    return m


def train_rl(
    model: torch.nn.Module,
    processor,
    questions: Sequence[dict],
    toolbox: Any,
    engine: EngineConfig,
    cfg: RLConfig,
    *,
    ckpt_dir: str | Path,
    live_dir: str | Path | None,
    fp: str,
    image_root: str | Path | None,
    weights: RewardWeights = RewardWeights(),
    backend_factory: Callable[[torch.nn.Module], Any] | None = None,
    on_update: Callable[[int], None] | None = None,
) -> dict:
    """Train ``model`` in place (see the module docstring); returns the run summary with the monitor history."""
    from mars.agent.hf_backend import HFBackend

    estimator, level = cfg.recipe
    make_backend = backend_factory or (lambda m: HFBackend(m, processor))
    engine = EngineConfig(**{**asdict(engine), "temperature": cfg.temperature, "top_p": cfg.top_p})
    stepper = make_stepper(model, replace(cfg.optim, max_steps=cfg.updates))  # the schedule spans every update
    ref = None
    if cfg.kl_beta > 0:
        import copy

        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
    sampler = EpochSampler(len(questions), cfg.prompts_per_step, cfg.seed)
    refill_sampler = EpochSampler(len(questions), cfg.prompts_per_step, cfg.seed + 7919)
    history: list[dict] = []
    samples: list[dict] = []
    ckpt = Checkpointer(ckpt_dir, fp, {"model": model, "stepper": stepper, "sampler": sampler,
                                       "refill_sampler": refill_sampler},
                        every=cfg.checkpoint_every, last=cfg.steps, label="RL")
    start, state = ckpt.resume()
    history, samples = list(state.get("history", history)), list(state.get("samples", samples))
    inert = cfg.ppo_epochs == 1 and cfg.mini_batches == 1
    if inert:
        log.warning("rl: one epoch and one mini-batch: the importance ratio is exactly 1 and clipping is inert "
                    "(the update is plain policy gradient); raise rl.mini_batches or rl.ppo_epochs to make it live")
    live = open_live(live_dir, start)
    pad_id = processor.tokenizer.pad_token_id
    suppress = vision_token_ids(processor.tokenizer)  # the backends never sample them
    low_tool_steps = 0
    bar = tqdm(range(start, cfg.steps), desc=f"rl {cfg.algorithm}", unit="step", initial=start,
               total=cfg.steps, leave=False)
    for step in bar:
        t0 = time.perf_counter()
        model.eval()
        backend = make_backend(model)
        picked = [questions[i] for i in sampler.next()]
        trajs: list[Trajectory] = []
        groups: list[int] = []
        rounds = 0
        pending = picked
        while pending:
            batch_q = [q for q in pending for _ in range(cfg.group_size)]
            got = run_episodes(batch_q, backend, toolbox, engine, seed=cfg.seed * 100003 + step * 101 + rounds,
                               image_root=image_root, weights=weights)
            for gi in range(len(pending)):
                g = got[gi * cfg.group_size : (gi + 1) * cfg.group_size]
                if cfg.dynamic_sampling and len({t.reward for t in g}) == 1 and rounds < cfg.max_refills:
                    continue
                gid = len(trajs) // cfg.group_size
                trajs.extend(g)
                groups.extend([gid] * len(g))
            if not cfg.dynamic_sampling or rounds >= cfg.max_refills:
                break
            missing = cfg.prompts_per_step - len(trajs) // cfg.group_size
            if missing <= 0:
                break
            rounds += 1
            pending = [questions[i] for i in refill_sampler.next()[:missing]]
        t_roll = time.perf_counter() - t0
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32)  # [N]
        gids = torch.tensor(groups)  # [N]
        adv = compute_advantages(rewards, gids, estimator)  # [N]
        adv_group = group_advantages(rewards, gids)
        mon = _monitors(trajs, adv_group, gids)
        mon["refill_rounds"] = rounds
        # the trained batch: each episode rendered from the ids its policy sampled (only those carry a loss)
        t1 = time.perf_counter()
        rendered = [sampled_example(t, processor) for t in trajs]
        old = rollout_logps(trajs, rendered)  # the behaviour policy's own log-probs, when the backend gave them
        if old is None and not inert:  # recomputed by the model as it was before this step's updates
            old = {}
            with torch.no_grad():
                for s in range(0, len(trajs), cfg.micro_batch_size):
                    idx = list(range(s, min(s + cfg.micro_batch_size, len(trajs))))
                    lp, _, _ = sequence_logps(model, collate([rendered[i] for i in idx], pad_id),
                                              temperature=cfg.temperature, suppress=suppress)
                    old.update({i: lp[j] for j, i in enumerate(idx)})
        t_old = time.perf_counter() - t1
        t2 = time.perf_counter()
        lr_now = max(stepper.lrs().values())  # the step's first update's learning rate (the schedule's position)
        model.train()
        stats_acc: dict[str, list[float]] = {}  # policy stats of the off-policy mini-batches (after the first)
        ent_vals: list[float] = []
        gaps: list[float] = []  # |trainer - rollout| log-prob on the first, on-policy mini-batch
        norms: list[float] = []
        rng = np.random.default_rng([cfg.seed, step, 17])
        for epoch in range(cfg.ppo_epochs):
            perm = [int(i) for i in rng.permutation(len(trajs))]
            mbs = [perm[k :: cfg.mini_batches] for k in range(cfg.mini_batches)]
            for k, mb in enumerate(mbs):
                if not mb:
                    continue
                on_policy = epoch == 0 and k == 0
                micro = [mb[s : s + cfg.micro_batch_size] for s in range(0, len(mb), cfg.micro_batch_size)]
                batches = [collate([rendered[i] for i in m_idx], pad_id) for m_idx in micro]
                masks = [b.labels[:, :-1] != -100 for b in batches]
                T = max(x.shape[1] for x in masks)
                full = torch.zeros(len(mb), T, dtype=torch.bool)
                r0 = 0
                for x in masks:
                    full[r0 : r0 + len(x), : x.shape[1]] = x
                    r0 += len(x)
                total = loss_normalizer(full, level)
                for m_idx, b in zip(micro, batches):
                    lp, mask, ent = sequence_logps(stepper.module, b, temperature=cfg.temperature, suppress=suppress,
                                                   with_entropy=True)
                    T_ = lp.shape[1]
                    olp = lp.detach() if old is None else torch.stack(
                        [torch.nn.functional.pad(old[i], (0, max(0, T_ - len(old[i]))))[:T_] for i in m_idx])
                    loss, st = policy_loss(lp, olp, adv[m_idx], mask, level=level, clip_low=cfg.clip_low,
                                           clip_high=cfg.clip_high, normalizer=total)
                    if ref is not None:
                        with torch.no_grad():
                            rlp, _, _ = sequence_logps(ref, b, temperature=cfg.temperature, suppress=suppress)
                        kl = kl_penalty(lp, rlp, mask)
                        loss = loss + cfg.kl_beta * kl * (float(mask.sum()) / max(float(full.sum()), 1.0))
                        st["kl_ref"] = float(kl)
                    if not torch.isfinite(loss):
                        raise RLCollapse(f"rl step {step}: the loss is {float(loss)}; lower rl.lr or check the "
                                         f"rollouts (ratio_max {st.get('ratio_max')})")
                    stepper.backward(loss)
                    ent_vals.append(float(masked_mean(ent, mask)))
                    if on_policy:
                        gaps.append(float(masked_mean((lp.detach() - olp).abs(), mask)))
                    else:
                        for key, v in st.items():
                            stats_acc.setdefault(key, []).append(v)
                norms.append(stepper.step())
        if on_update is not None:
            on_update(step)
        t_upd = time.perf_counter() - t2
        mon.update({k: float(np.mean(v)) for k, v in stats_acc.items() if k not in ("n_tokens", "n_seqs", "loss")})
        for key in ("approx_kl", "clip_frac", "clip_frac_high", "clip_frac_low"):
            mon.setdefault(key, 0.0)  # one epoch and one mini-batch: no off-policy update to measure
        mon["approx_kl_max"] = float(max(stats_acc.get("approx_kl", [0.0])))
        mon["logp_gap"] = float(np.mean(gaps)) if gaps else 0.0
        mon["lr"] = lr_now
        mon["grad_norm"] = float(np.mean(norms))
        mon["grad_norm_max"] = float(max(norms))
        mon["entropy"] = float(np.mean(ent_vals)) if ent_vals else 0.0
        mon.update({"t_rollout": t_roll, "t_old_logp": t_old, "t_update": t_upd, "step": step})
        history.append(mon)
        for t in trajs[: cfg.samples_per_step]:  # a question comes back in later steps: the step names the episode
            samples.append({**t.row(), "episode_id": f"{t.episode_id}@{step}", "step": step})
        bar.set_postfix(reward=f"{mon['reward']:.2f}", acc=f"{mon['accuracy']:.2f}")
        if live is not None:
            for k, v in mon.items():
                if k != "step":
                    live.log_metric(f"rl/{k}", v)
            live.next_step()
        if not all(math.isfinite(v) for v in mon.values() if isinstance(v, float)):
            raise RLCollapse(f"rl step {step}: a monitor is not finite: {mon}")
        low_tool_steps = low_tool_steps + 1 if mon["tool_calls"] < cfg.collapse_min_tool_rate else 0
        if low_tool_steps >= cfg.collapse_window:
            raise RLCollapse(f"rl collapsed at step {step}: tool calls per episode below "
                             f"{cfg.collapse_min_tool_rate} for {cfg.collapse_window} steps "
                             "(rl.collapse_min_tool_rate / rl.collapse_window); lower rl.lr")
        done = step + 1
        ckpt.step_done(done, history=history, samples=samples)
    bar.close()
    if live is not None:
        live.end()
    model.eval()
    return {"history": history, "samples": samples, "resumed_from": start, "peak_rss_mb": round(peak_rss_mb(), 1),
            "estimator": estimator, "level": level}
