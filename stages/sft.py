"""The ``sft`` stage: teacher trajectories through the real tools, then the cold-start SFT of a Qwen-VL model.

What it does (the phases, their knobs and checks: docs/training.md, SFT)
    1. Teacher trajectories: the scripted teacher (:mod:`mars.agent.teacher`, ``teacher_skill``) or an
       OpenAI-compatible endpoint (``teacher: openai``) plays the sft split through the shared rollout engine and
       the real tools (the ``agent`` params section); only episodes judged correct and well formed are kept, at most
       ``n_trajectories`` (the paper's cold start is small, so RL has headroom): ``trajectories.parquet``.
    2. The model: ``init_checkpoint`` (a local Qwen2.5-VL or Qwen3-VL directory) or a tiny random-init Qwen2.5-VL
       (``arch: qwen3_vl``: Qwen3-VL, with ``agent.factor: 32``) with a tokenizer fitted to the world's text, the
       teacher's dialogues and the protocol (:func:`mars.train.drawing.tokenizer_texts`; ``tokenizer: qwen``: the
       real vocabulary). The untrained model is saved as ``base/`` (the evaluate stage's untrained row).
    3. The stand-in for a base model's pre-training (steps 0 for a pretrained ``init_checkpoint``): phase 0, the
       vision tower alone (:mod:`mars.train.vision`: reading zoom crops, ``vision_pretrain_steps``; the framed grid
       cell, ``vision_locate_steps``); phase 1, text-only reading drills over real tool outputs with fresh
       stand-in names (:mod:`mars.train.drills`, ``pretrain_steps``; its held-out copy share is scored after it);
       the localisation block (:mod:`mars.train.locate`, :func:`mars.train.captions.zoom_captions`: the first zoom
       on freshly drawn scenes and the read after it, in two stages that stop on a held-out check,
       ``locate_frame_steps`` then ``locate_steps``). Phase 1's and the block's data are drawn in a worker process
       while the teacher plays (:func:`mars.train.drawing.play_and_draw`).
    4. Phase 2: the teacher trajectories with a ``mix_pretrain`` share of phase 1's and the block's examples
       (:func:`mars.train.sft.train_sft`): assistant-token loss, per-module learning rates, warm-up and schedule,
       clipping, accumulation, optional DeepSpeed ZeRO-2/3. The final model is saved as ``model/``, a
       self-contained HF checkpoint directory (weights, config, tokenizer, processor, chat template).

The phases run in order from :mod:`mars.train.cold_start` (each: its data, its steps, its check, its checkpoint key).
Every phase checkpoints into ``--checkpoints`` (scratch space that DVC does not track, so that its run-cache can restore
the stage) under a key chained from the phases before it
(:func:`mars.train.cold_start.phase_keys`: params, inputs, code, tokenizer and data), so a killed ``dvc repro``
resumes each phase where it stopped, and a change of a later phase's knobs (:data:`mars.train.cold_start.PHASE_KNOBS`)
reruns only that phase and the ones after it. The drawn drills keep their images in the policy's view and the
rendered examples their pixels at a byte per value, so the stage stays within a laptop's memory. Phase 2's curve is
logged to ``--live`` (scratch, resumed with the checkpoints) and copied at the end to ``--plots`` (``dvc plots``).

Deviations: the paper's teacher is a strong VLM with about 3k cold-start trajectories; the default's teacher is
scripted over the generated world (imperfect on purpose) and SFT sees a few hundred trajectories. The paper starts
from a pretrained Qwen2.5-VL; the default's random-init model gets the short pre-training phases (step 3) first.

Run: ``python -m stages.sft --questions data/synthesize/questions.parquet --image-root data/synthesize
--world-dir data/world --index-dir data/index --out data/sft --checkpoints .scratch/sft/checkpoints
--live .scratch/sft/live --plots plots/sft --metrics metrics/sft.json``.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from mars.agent.config import AgentParams
from mars.data.io import atomic_dir, read_table
from mars.data.quality import write_artifacts
from mars.data.schemas import QUESTIONS
from mars.stage import expected_errors, load_section, stage_args, write_metrics
from mars.train.checkpoint import publish_curves
from mars.train.cold_start import SFTParams, check_arch, prepare, run_phases
from mars.world.questions import asked_attributes
from mars.world.scenes import SceneConfig

__all__ = ["SECTION", "Params", "run", "main"]
SECTION = "sft"
Params = SFTParams  # the ``sft`` section of params.yaml (mars.train.cold_start: its knobs, checks and phase configs)
log = logging.getLogger(__name__)


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def run(params: Params, agent: AgentParams, inputs: dict[str, Path], outputs: dict[str, Path],
        scene: SceneConfig | None = None) -> dict:
    """The stage (module docstring); ``scene``: the world's scene knobs (:func:`mars.world.scenes.read_scene`)."""
    from mars.agent.engine import trajectories_table
    from mars.agent.protocol import compact_system_prompt, system_prompt
    from mars.model.build import count_params, save_checkpoint
    from mars.tools.base import TOOL_SCHEMAS
    from mars.train.drawing import check_scene, play_and_draw, teacher_trajectories, tokenizer_texts, world_colours
    from stages import code_digest

    check_scene(params, scene)  # before the teacher's minutes
    check_arch(params, agent)
    scene = world_colours(params, scene, inputs["world_dir"])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    all_questions = read_table(inputs["questions"], QUESTIONS).to_pylist()
    questions = [q for q in all_questions if q["split"] == "sft"]
    if not questions:
        raise RuntimeError(f"{inputs['questions']}: no questions in the sft split; check the synthesize params")
    system = (system_prompt if agent.prompt == "full" else compact_system_prompt)(TOOL_SCHEMAS)
    attributes = asked_attributes(all_questions)  # the localisation drills ask what the questions ask
    drawn: dict[str, list] = {"pretrain": [], "locate": [], "held_out": []}
    prepared: dict = {}
    with atomic_dir(outputs["out"]) as out:
        def meanwhile(trajs: list) -> None:  # what needs the trajectories and not the drills, beside the drawing
            texts = tokenizer_texts(inputs["world_dir"], questions, trajs, system)
            prepared["stack"], prepared["stats"] = prepare(
                params, agent, trajs, texts, scene, out / "base", outputs["checkpoints"],
                (_file_hash(inputs["questions"]), code_digest()))

        if not (params.pretrain_steps or params.locate_steps):
            trajs, stats = teacher_trajectories(params, agent, questions, inputs["image_root"], inputs["world_dir"],
                                                inputs["index_dir"])
            meanwhile(trajs)
        else:
            trajs, stats, drawn["pretrain"], drawn["locate"], drawn["held_out"] = play_and_draw(
                params, agent, inputs, all_questions, scene, system, attributes, meanwhile=meanwhile)
        write_artifacts({out / "trajectories.parquet": (trajectories_table(trajs), "trajectories")})
        stack = prepared["stack"]
        summary, phase_stats = run_phases(params, stack, drawn, scene, system, attributes, outputs["checkpoints"],
                                          outputs["live"])
        save_checkpoint(stack.model, stack.tok, stack.proc, out / "model")
    publish_curves(outputs["live"], outputs["plots"])
    metrics = {**stats, **{k: v for k, v in summary.items() if k != "history"}, "params": count_params(stack.model),
               "examples": len(stack.examples), **prepared["stats"], **phase_stats}
    log.info("sft: %s", metrics)
    write_metrics(outputs["metrics"], metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    with expected_errors():
        params, inputs, outputs = stage_args(
            SECTION, Params, argv, inputs=("questions", "image_root", "world_dir", "index_dir"),
            outputs=("out", "checkpoints", "live", "plots", "metrics"),
        )
        agent = load_section("agent", AgentParams, argv)
        from mars.world.scenes import read_scene

        run(params, agent, inputs, outputs, scene=read_scene(inputs["world_dir"]))  # the world's own scene knobs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
