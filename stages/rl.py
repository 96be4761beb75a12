"""The ``rl`` stage: BN-GSPO (or GRPO / GSPO) from the SFT checkpoint on the rl split's questions.

What it does
    Loads the SFT checkpoint (``--sft``/model), the rl split of ``--questions`` (answers only: no trajectories) and
    the tools (the ``agent`` params section), and runs :func:`mars.train.rl.train_rl`: B prompts x G rollouts per
    step through the shared engine, the shared judge and rewards, advantages by ``rl.algorithm``'s recipe
    (``bn_gspo`` default, ``gspo``, ``grpo``), ``ppo_epochs`` x ``mini_batches`` clipped updates, monitors in
    dvclive (``--live``, copied to ``--plots`` at the end for ``dvc plots``), checkpoints in ``--checkpoints``
    (``--live`` and ``--checkpoints`` are scratch space that DVC does not track: a killed ``dvc repro`` resumes,
    and DVC's run-cache can restore the stage). Writes the final self-contained HF checkpoint (``model/``),
    ``rollouts.parquet`` (a few rollouts per step, for the report) and ``monitors.json``; metrics: the first and
    last windows of the monitors and the step time split (rollout / old log-probs / update).

The trainer trains exactly the token ids the policy sampled, with log-probs at the sampling temperature
(docs/training.md).

Deviation: the embedded default trains the vision tower too (``freeze_vision: false``), as in SFT; pretrained
checkpoints freeze it (the release does). Rollouts run in process; for GPU runs point ``rollout_base_url`` at a
vLLM (or ``mars serve``) server: after every update the stage saves the weights and calls the server's
``/v1/reload`` (``mars serve`` implements it; for vLLM's weight-update endpoints see docs/design.md, The scale
path). The server is asked for each sampled token's id and log-prob (``logprobs``, ``return_tokens_as_token_ids``);
run vLLM with ``--logprobs-mode processed_logprobs`` so they are at the sampling temperature.

Run: ``python -m stages.rl --questions data/synthesize/questions.parquet --image-root data/synthesize
--world-dir data/world --index-dir data/index --sft data/sft --out data/rl --checkpoints .scratch/rl/checkpoints
--live .scratch/rl/live --plots plots/rl --metrics metrics/rl.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import pyarrow as pa

from mars.agent.config import AgentParams
from mars.data.io import atomic_dir, atomic_write_text, read_table
from mars.data.quality import write_artifacts
from mars.data.schemas import QUESTIONS, TRAJECTORIES
from mars.stage import expected_errors, load_section, stage_args, write_metrics

SECTION = "rl"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    algorithm: str = "bn_gspo"  # bn_gspo | gspo | grpo
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_beta: float = 0.0
    steps: int = 8
    prompts_per_step: int = 4
    group_size: int = 8
    temperature: float = 0.7
    top_p: float = 1.0
    ppo_epochs: int = 1
    mini_batches: int = 2
    micro_batch_size: int = 16
    lr: float = 5e-5
    vision_lr: float = 5e-5
    warmup_steps: int = 0
    schedule: str = "constant"
    clip_norm: float = 1.0
    freeze_vision: bool = False
    deepspeed_stage: int = 0
    dynamic_sampling: bool = False
    max_refills: int = 2
    collapse_window: int = 10
    collapse_min_tool_rate: float = 0.05
    checkpoint_every: int = 10
    samples_per_step: int = 2
    rollout_base_url: str = ""  # "" = in-process rollouts; else an OpenAI-compatible server to refresh and use
    seed: int = 0

    def config(self):
        from mars.train.optim import OptimConfig
        from mars.train.rl import RLConfig

        optim = OptimConfig(lr=self.lr, vision_lr=self.vision_lr, warmup_steps=self.warmup_steps,
                            schedule=self.schedule, max_steps=self.steps * self.ppo_epochs * self.mini_batches,
                            clip_norm=self.clip_norm,
                            freeze_vision=self.freeze_vision, deepspeed_stage=self.deepspeed_stage, weight_decay=0.0)
        shared = {f.name: getattr(self, f.name) for f in fields(RLConfig) if f.name != "optim"}
        return RLConfig(optim=optim, **shared)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"rl.steps must be >= 1, got {self.steps}")
        self.config()


def _window(history: list[dict], key: str, first: bool, n: int = 5) -> float | None:
    vals = [h[key] for h in history if key in h]
    if not vals:
        return None
    part = vals[:n] if first else vals[-n:]
    return float(np.mean(part))


def remote_backend_factory(params: Params, processor, save_dir: Path):
    """Rollouts on an OpenAI-compatible server whose weights are refreshed from ``save_dir`` after every update."""
    import httpx

    from mars.agent.backends import OpenAIBackend
    from mars.model.build import save_checkpoint

    base = params.rollout_base_url.rstrip("/")

    def refresh(model) -> None:
        save_checkpoint(model, processor.tokenizer, processor, save_dir)
        r = httpx.post(f"{base}/reload", json={"path": str(save_dir)}, timeout=600)
        r.raise_for_status()

    def factory(model):
        refresh(model)
        return OpenAIBackend(base, "policy", token_ids=True)

    return factory


def run(params: Params, agent: AgentParams, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    from mars.model.build import load_checkpoint, save_checkpoint
    from mars.train.checkpoint import fingerprint, publish_curves
    from mars.train.rl import train_rl
    from stages import code_digest

    questions = [q for q in read_table(inputs["questions"], QUESTIONS).to_pylist() if q["split"] == "rl"]
    if len(questions) < params.prompts_per_step:
        raise RuntimeError(f"{inputs['questions']}: {len(questions)} rl questions, fewer than rl.prompts_per_step "
                           f"({params.prompts_per_step}); raise synthesize.rl_per_type")
    sft_dir = inputs["sft"] / "model"
    model, tok, proc = load_checkpoint(sft_dir)
    agent.check_processor(proc, str(sft_dir))
    toolbox = agent.toolbox(inputs["index_dir"], inputs["world_dir"] / "gallery")
    weights_hash = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(sft_dir.glob("*.safetensors")))).hexdigest()
    # the code is in the fingerprint too: a change of reward, loss or rollout code never resumes the old run
    fp = fingerprint(params, agent, weights_hash[:16], [q["question_id"] for q in questions], code_digest())
    factory = None
    if params.rollout_base_url:
        factory = remote_backend_factory(params, proc, Path(outputs["checkpoints"]) / "served")
    summary = train_rl(model, proc, questions, toolbox, agent.engine(), params.config(),
                       ckpt_dir=outputs["checkpoints"], live_dir=outputs["live"], fp=fp,
                       image_root=inputs["image_root"], weights=agent.weights(), backend_factory=factory)
    history = summary["history"]
    with atomic_dir(outputs["out"]) as out:
        save_checkpoint(model, tok, proc, out / "model")
        rows = [{k: v for k, v in s.items() if k != "step"} for s in summary["samples"]]
        write_artifacts({out / "rollouts.parquet": (pa.Table.from_pylist(rows, schema=TRAJECTORIES), "trajectories")})
        atomic_write_text(out / "monitors.json", json.dumps(history, indent=1) + "\n")
    publish_curves(outputs["live"], outputs["plots"])
    metrics = {"algorithm": params.algorithm, "estimator": summary["estimator"], "level": summary["level"],
               "steps": params.steps, "resumed_from": summary["resumed_from"], "peak_rss_mb": summary["peak_rss_mb"]}
    for key in ("reward", "reward_answer", "reward_format", "accuracy", "tool_calls", "degenerate_groups",
                "clip_frac", "approx_kl", "approx_kl_max", "grad_norm", "logp_gap", "entropy", "response_tokens"):
        metrics[f"{key}_first"] = _window(history, key, True)
        metrics[f"{key}_last"] = _window(history, key, False)
    for key in ("t_rollout", "t_old_logp", "t_update"):
        metrics[f"{key}_mean_s"] = _window(history, key, False, n=len(history))
    log.info("rl: %s", metrics)
    write_metrics(outputs["metrics"], metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    with expected_errors():
        params, inputs, outputs = stage_args(
            SECTION, Params, argv, inputs=("questions", "image_root", "world_dir", "index_dir", "sft"),
            outputs=("out", "checkpoints", "live", "plots", "metrics"),
        )
        run(params, load_section("agent", AgentParams, argv), inputs, outputs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
