"""The ``sft`` stage: teacher trajectories through the real tools, then the cold-start SFT of a Qwen-VL model.

What it does (the phases, their knobs and checks: docs/training.md, SFT)
    1. Teacher trajectories: the scripted teacher (:mod:`mars.agent.teacher`, ``teacher_skill``) or an
       OpenAI-compatible endpoint (``teacher: openai``) plays the sft split through the shared rollout engine and
       the real tools (the ``agent`` params section); only episodes judged correct and well formed are kept, at most
       ``n_trajectories`` (the paper's cold start is small, so RL has headroom): ``trajectories.parquet``.
    2. The model: ``init_checkpoint`` (a local Qwen2.5-VL or Qwen3-VL directory) or a tiny random-init Qwen2.5-VL
       (``arch: qwen3_vl``: Qwen3-VL, with ``agent.factor: 32``) with a tokenizer fitted to the world's text, the
       teacher's dialogues and the protocol (:func:`tokenizer_texts`; ``tokenizer: qwen``: the real vocabulary).
       The untrained model is saved as ``base/`` (the evaluate stage's untrained row).
    3. The stand-in for a base model's pre-training (steps 0 for a pretrained ``init_checkpoint``): phase 0, the
       vision tower alone (:mod:`mars.train.vision`: reading zoom crops, ``vision_pretrain_steps``; the framed grid
       cell, ``vision_locate_steps``); phase 1, text-only reading drills over real tool outputs with fresh
       stand-in names (:mod:`mars.synth.drills`, ``pretrain_steps``; its held-out copy share is scored after it);
       the localisation block (:mod:`mars.synth.locate`, :func:`mars.synth.captions.zoom_captions`: the first zoom
       on freshly drawn scenes and the read after it, in two stages that stop on a held-out check,
       ``locate_frame_steps`` then ``locate_steps``). Phase 1's and the block's data are drawn in a worker process
       while the teacher plays (:func:`play_and_draw`).
    4. Phase 2: the teacher trajectories with a ``mix_pretrain`` share of phase 1's and the block's examples
       (:func:`mars.train.sft.train_sft`): assistant-token loss, per-module learning rates, warm-up and schedule,
       clipping, accumulation, optional DeepSpeed ZeRO-2/3. The final model is saved as ``model/``, a
       self-contained HF checkpoint directory (weights, config, tokenizer, processor, chat template).

Every phase checkpoints into ``--checkpoints`` under a key chained from the phases before it (:func:`phase_keys`:
params, inputs, code, tokenizer and data), so a killed ``dvc repro`` resumes each phase where it stopped, and a
change of a later phase's knobs (:data:`PHASE_KNOBS`) reruns only that phase and the ones after it.

Deviations: the paper's teacher is a strong VLM with about 3k cold-start trajectories; the default's teacher is
scripted over the generated world (imperfect on purpose) and SFT sees a few hundred trajectories. The paper starts
from a pretrained Qwen2.5-VL; the default's random-init model gets the short pre-training phases (step 3) first.

Run: ``python -m stages.sft --questions data/synthesize/questions.parquet --image-root data/synthesize
--world-dir data/world --index-dir data/index --out data/sft --checkpoints data/sft_ckpt --live data/sft_live
--metrics data/metrics/sft.json``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from mars.agent.config import AgentParams
from mars.agent.protocol import content_text
from mars.data.io import atomic_dir, read_table
from mars.data.quality import write_artifacts
from mars.data.schemas import ENTITIES, QUESTIONS
from mars.model.tokenizer import PRETOKENIZERS
from mars.stage import load_section, stage_args, write_metrics
from mars.world.questions import asked_attributes
from mars.world.scenes import SceneConfig

SECTION = "sft"
EMBLEM_COLOURS = ("palette", "world")  # sft.emblem_colours: any palette colours | the world's schemes (world_colours)
TEACHER_CHUNK = 64  # teacher episodes played at once (bounds the memory of full-resolution scenes)
# The training phases in order, and the params only each of the later ones reads (every other param is in every
# phase's key, :func:`phase_keys`): a change of these keeps the phases before their owner.
PHASES = ("vision", "vision_locate", "pretrain", "locate_frame", "locate", "train")
PHASE_KNOBS = {
    "pretrain": ("pretrain_steps", "pretrain_check_drills"),
    # the block's shared knobs are its frame stage's (they enter the block's key after it, also with no frame stage)
    "locate_frame": ("locate_frame_steps", "locate_frame_captions", "locate_target", "locate_check_scenes",
                     "locate_mix", "locate_check_from"),
    "locate": ("locate_steps", "locate_read_target"),
    "train": ("max_steps", "group_batches", "mix_pretrain"),
}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    """The ``sft`` section of params.yaml (its one-line comments say what each knob does; docs/training.md, SFT)."""

    teacher: str = "scripted"  # scripted | openai
    teacher_skill: float = 0.8
    teacher_base_url: str = ""
    teacher_model: str = ""
    n_trajectories: int = 600
    vision_pretrain_steps: int = 400  # phase 0: the vision tower learns to read zoomed emblems (mars.train.vision)
    vision_pretrain_images: int = 2000
    vision_pretrain_lr: float = 5e-4
    vision_locate_steps: int = 150  # phase 0: the vision tower learns the framed cell of the localisation drills
    vision_test_images: int = 300
    pretrain_steps: int = 2000  # phase 1: steps on the reading drills (0 = no phase 1)
    pretrain_drills: int = 4000  # text-only reading drills over real tool outputs (mars.synth.drills)
    pretrain_check_drills: int = 60  # held-out drills scored after phase 1 (pretrain_check_copied)
    pretrain_locate: int = 2000  # localisation drills (mars.synth.locate)
    locate_answers: float = 1.0  # share of the perception localisation drills that go on to the crop and answer
    pretrain_zoom_captions: int = 4000  # read a new emblem at a zoom's scale (mars.synth.captions.zoom_captions)
    emblem_colours: str = "world"  # the emblems drawn anew: world (its colour schemes) | palette (any)
    locate_mix: float = 0.25  # share of the block's examples drawn from phase 1's
    locate_frame_steps: int = 500  # > 0: the block's first stage (the drills with locate_frame_captions captions)
    locate_frame_captions: int = 1000
    locate_steps: int = 500  # > 0: the localisation block after phase 1 (its second stage with a frame stage)
    locate_target: float = 0.9  # > 0: a block stage stops once its first zoom frames this share of held-out scenes
    locate_read_target: float = 0.8  # > 0: the second stage's check also needs the read after the right zoom
    locate_check_scenes: int = 40
    locate_check_from: int = 200
    max_steps: int = 250  # phase 2
    mix_pretrain: float = 0.25  # share of phase 2's examples drawn from phase 1's and the block's
    group_batches: int = 8  # phase 2's length-grouped batches: runs of this many batches sorted by length (1 = off)
    tokenizer: str = "local"  # local | qwen
    pretokenizer: str = "trailing"  # local tokenizer: trailing | bytelevel (mars.model.tokenizer)
    vocab_size: int = 1024
    init_checkpoint: str = ""  # a local HF checkpoint directory instead of the tiny random-init model
    arch: str = "qwen2_5_vl"  # the tiny model's architecture: qwen2_5_vl | qwen3_vl (mars.model.build)
    text_hidden: int = 128
    text_layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    vision_hidden: int = 96
    vision_layers: int = 2
    vision_window: int = 224  # window attention span in pixels (>= the policy's view: one window per image)
    rope_theta: float = 10000.0
    batch_size: int = 16
    grad_accum: int = 1
    length_split: int = 2  # every phase's batches run as this many sub-batches of similar length (the same gradient)
    compile: bool = True  # every phase's text decoder layers through torch.compile (the same maths to rounding)
    lr: float = 2e-3
    vision_lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0
    freeze_vision: bool = False
    deepspeed_stage: int = 0
    precision: str = "fp32"
    checkpoint_every: int = 50
    max_len: int = 1536
    seed: int = 0

    def __post_init__(self) -> None:
        if self.teacher not in ("scripted", "openai"):
            raise ValueError(f"sft.teacher must be 'scripted' or 'openai', got {self.teacher!r}")
        if self.teacher == "openai" and not (self.teacher_base_url and self.teacher_model):
            raise ValueError("sft.teacher=openai needs teacher_base_url and teacher_model")
        if self.pretokenizer not in PRETOKENIZERS:
            raise ValueError(f"sft.pretokenizer must be one of {PRETOKENIZERS}, got {self.pretokenizer!r}")
        if self.tokenizer not in ("local", "qwen"):
            raise ValueError(f"sft.tokenizer must be 'local' or 'qwen', got {self.tokenizer!r}")
        if self.arch not in ("qwen2_5_vl", "qwen3_vl"):
            raise ValueError(f"sft.arch must be 'qwen2_5_vl' or 'qwen3_vl', got {self.arch!r}")
        if self.n_trajectories < 1:
            raise ValueError(f"sft.n_trajectories must be >= 1, got {self.n_trajectories}")
        counts = {k: getattr(self, k) for k in ("pretrain_drills", "pretrain_locate", "pretrain_zoom_captions")}
        for k, v in {"pretrain_steps": self.pretrain_steps, "locate_steps": self.locate_steps,
                     "vision_pretrain_steps": self.vision_pretrain_steps,
                     "vision_locate_steps": self.vision_locate_steps, **counts}.items():
            if v < 0:
                raise ValueError(f"sft.{k} must be >= 0, got {v}")
        if self.vision_test_images < 1:
            raise ValueError(f"sft.vision_test_images must be >= 1, got {self.vision_test_images}")
        for k in ("vision_pretrain_steps", "vision_locate_steps"):
            if getattr(self, k) and self.freeze_vision:
                raise ValueError(f"sft.{k} > 0 trains the vision tower, which sft.freeze_vision keeps frozen; set "
                                 f"{k}: 0 for a pretrained init_checkpoint")
        if self.vision_locate_steps and not (self.locate_steps or self.pretrain_steps):
            raise ValueError("sft.vision_locate_steps > 0 trains on the localisation drills, which only the block "
                             "(sft.locate_steps > 0) or phase 1 (sft.pretrain_steps > 0) draws: set one of them, or "
                             "sft.vision_locate_steps: 0 (a pretrained init_checkpoint needs no phase 0)")
        if self.vision_locate_steps and self.pretrain_locate < self.batch_size:
            raise ValueError(f"sft.vision_locate_steps > 0 trains on the localisation drills' images: set "
                             f"sft.pretrain_locate >= sft.batch_size ({self.batch_size}), got {self.pretrain_locate}")
        if self.vision_locate_steps:
            self.vision_locate_config()  # validates the knobs
        if self.vision_pretrain_steps:
            self.vision_config()  # validates the phase-0 knobs
            if self.vision_pretrain_images < self.batch_size:
                raise ValueError(f"sft.vision_pretrain_images must be >= sft.batch_size ({self.batch_size}), got "
                                 f"{self.vision_pretrain_images}")
        if self.emblem_colours not in EMBLEM_COLOURS:
            raise ValueError(f"sft.emblem_colours must be one of {EMBLEM_COLOURS}, got {self.emblem_colours!r}")
        if not 0.0 <= self.locate_answers <= 1.0:
            raise ValueError(f"sft.locate_answers must be in [0, 1], got {self.locate_answers}")
        for k in ("mix_pretrain", "locate_mix"):
            if not 0.0 <= getattr(self, k) < 1.0:
                raise ValueError(f"sft.{k} must be in [0, 1), got {getattr(self, k)}")
        if not 0.0 <= self.locate_target <= 1.0:
            raise ValueError(f"sft.locate_target must be in [0, 1] (0 = run all sft.locate_steps), got "
                             f"{self.locate_target}")
        if self.locate_check_scenes < 1:
            raise ValueError(f"sft.locate_check_scenes must be >= 1, got {self.locate_check_scenes}")
        if not 0.0 <= self.locate_read_target <= 1.0:
            raise ValueError(f"sft.locate_read_target must be in [0, 1] (0 = the frame alone), got "
                             f"{self.locate_read_target}")
        if self.locate_read_target and not (self.locate_target and self.locate_answers):
            raise ValueError("sft.locate_read_target > 0 adds the read to the block's check, which needs the check "
                             "(sft.locate_target > 0) and answered drills to learn it from (sft.locate_answers > 0)")
        if self.locate_check_from < 0:
            raise ValueError(f"sft.locate_check_from must be >= 0, got {self.locate_check_from}")
        if self.locate_frame_steps < 0:
            raise ValueError(f"sft.locate_frame_steps must be >= 0 (0 = the block in one stage), got "
                             f"{self.locate_frame_steps}")
        if self.locate_frame_steps and not self.locate_steps:
            raise ValueError("sft.locate_frame_steps > 0 is the localisation block's first stage: set "
                             "sft.locate_steps > 0 (its second), or sft.locate_frame_steps: 0")
        if not 0 <= self.locate_frame_captions <= self.pretrain_zoom_captions:
            raise ValueError(f"sft.locate_frame_captions must be in [0, sft.pretrain_zoom_captions = "
                             f"{self.pretrain_zoom_captions}] (the frame stage's share of the zoom captions), got "
                             f"{self.locate_frame_captions}")
        if self.locate_frame_captions and not self.locate_frame_steps:
            raise ValueError("sft.locate_frame_captions is the frame stage's: set sft.locate_frame_steps > 0, or "
                             "sft.locate_frame_captions: 0")
        if self.pretrain_check_drills < 0:
            raise ValueError(f"sft.pretrain_check_drills must be >= 0, got {self.pretrain_check_drills}")
        if self.locate_steps and not self.pretrain_locate:
            raise ValueError("sft.locate_steps > 0 trains on the localisation drills: set sft.pretrain_locate > 0")
        if self.locate_steps:  # the vision drills are then the block's, not phase 1's
            counts.pop("pretrain_locate")
            counts.pop("pretrain_zoom_captions")
        if self.pretrain_steps and not any(counts.values()):
            raise ValueError(f"sft.pretrain_steps > 0 needs one of {', '.join(counts)} > 0")
        self.train_config()  # validates the training knobs

    def vision_config(self):
        """Phase 0's config (:class:`mars.train.vision.VisionPretrainConfig`)."""
        from mars.train.vision import VisionPretrainConfig

        return VisionPretrainConfig(steps=self.vision_pretrain_steps, batch_size=self.batch_size,
                                    lr=self.vision_pretrain_lr, checkpoint_every=self.checkpoint_every * 4,
                                    seed=self.seed)

    def vision_locate_config(self):
        """Phase 0's localisation config: ``vision_locate_steps`` steps at ``vision_lr`` (the rate at which the
        tower found the frame in ``bench/probe_locate.py``)."""
        from mars.train.vision import VisionPretrainConfig

        return VisionPretrainConfig(steps=self.vision_locate_steps, batch_size=self.batch_size, lr=self.vision_lr,
                                    checkpoint_every=self.checkpoint_every, seed=self.seed)

    def pretrain_config(self):
        """Phase 1's training config: ``pretrain_steps`` steps in plain shuffled batches (length-grouped ones pad
        less but come in runs of one drill kind, and the model copied worse: docs/findings.md)."""
        return self.train_config(self.pretrain_steps, group_batches=1)

    def locate_config(self):
        """The localisation block's training config: ``locate_steps`` steps; plain shuffled batches."""
        return self.train_config(self.locate_steps, group_batches=1)

    def locate_frame_config(self):
        """The block's frame stage's config: :meth:`locate_config` with ``locate_frame_steps`` steps."""
        return self.train_config(self.locate_frame_steps, group_batches=1)

    def train_config(self, max_steps: int | None = None, group_batches: int | None = None):
        """Phase 2's training config, or a phase's with its ``max_steps`` and ``group_batches``."""
        from mars.train.optim import OptimConfig
        from mars.train.sft import SFTConfig

        optim = OptimConfig(
            lr=self.lr, vision_lr=self.vision_lr, weight_decay=self.weight_decay,
            warmup_steps=self.warmup_steps, schedule=self.schedule, min_lr_ratio=self.min_lr_ratio,
            max_steps=self.max_steps if max_steps is None else max_steps,
            clip_norm=self.clip_norm, freeze_vision=self.freeze_vision, deepspeed_stage=self.deepspeed_stage,
        )
        return SFTConfig(optim=optim, batch_size=self.batch_size, grad_accum=self.grad_accum,
                         checkpoint_every=self.checkpoint_every, precision=self.precision, seed=self.seed,
                         group_batches=self.group_batches if group_batches is None else group_batches,
                         length_split=self.length_split, compile=self.compile)


def teacher_trajectories(params: Params, agent: AgentParams, questions: list[dict], image_root: Path,
                         world_dir: Path, index_dir: Path) -> tuple[list, dict]:
    """Run the teacher on the sft questions; keep correct, well-formed episodes (at most n_trajectories)."""
    from mars.agent.engine import run_episodes
    from mars.agent.oracle import World, scripted_backend
    from mars.agent.teacher import teacher_policy

    toolbox = agent.toolbox(index_dir, world_dir / "gallery")
    if params.teacher == "scripted":
        world = World.from_dir(world_dir)
        backend = scripted_backend(
            questions, lambda q: teacher_policy(q, world, skill=params.teacher_skill, seed=params.seed), image_root)
    else:
        from mars.agent.backends import OpenAIBackend

        backend = OpenAIBackend(params.teacher_base_url, params.teacher_model)
    t0 = time.perf_counter()
    trajs = []
    # in chunks: every active episode holds its full-resolution scene (25 MB at 4K) for the tools
    for s in tqdm(range(0, len(questions), TEACHER_CHUNK), desc="teacher", unit="chunk", leave=False):
        trajs += run_episodes(questions[s : s + TEACHER_CHUNK], backend, toolbox, agent.engine(), seed=params.seed,
                              image_root=image_root, weights=agent.weights())
    good = [t for t in trajs if t.correct and t.reward_format > 0]
    kept = good[: params.n_trajectories]
    stats = {
        "teacher_episodes": len(trajs),
        "teacher_accuracy": round(sum(t.correct for t in trajs) / max(len(trajs), 1), 4),
        "trajectories": len(kept),
        "teacher_s": round(time.perf_counter() - t0, 1),
    }
    if not kept:
        raise RuntimeError(f"the teacher solved none of {len(trajs)} sft questions; nothing to train on")
    return kept, stats


def tokenizer_texts(world_dir: Path, questions: list[dict], trajs: list, system: str) -> list[str]:
    """What the local tokenizer is fitted to: corpus, names, questions, teacher dialogues, protocol (fitted without
    the teacher's turns, the model copied names less: docs/findings.md)."""
    from mars.data.schemas import CORPUS

    texts = [r["title"] + " " + r["text"] for r in read_table(world_dir / "corpus.parquet", CORPUS).to_pylist()]
    texts += [r["name"] for r in read_table(world_dir / "entities.parquet", ENTITIES).to_pylist()]
    texts += [q["question"] for q in questions]
    for t in trajs:
        texts += [content_text(m["content"], " ") for m in t.messages]
    texts += [system] * 20
    return texts


def pretrain_dialogues(params: Params, agent: AgentParams, world_dir: Path, index_dir: Path,
                       all_questions: list[dict], scene: SceneConfig | None = None, system: str | None = None
                       ) -> list[list[dict]]:
    """Phase 1's data: ``pretrain_drills`` reading drills (:mod:`mars.synth.drills`), never about an entity of a
    test question, and, without a localisation block (``locate_steps`` 0), the vision drills
    (:func:`vision_drills`)."""
    if params.pretrain_steps == 0:
        return []
    _check_scene(params, scene)
    from mars.data.schemas import GALLERY

    held_out = _test_entities(all_questions)
    gallery = read_table(world_dir / "gallery.parquet", GALLERY).to_pylist()
    entities = read_table(world_dir / "entities.parquet", ENTITIES).to_pylist()
    drills = _reading_drills(agent, world_dir, index_dir, entities, gallery, held_out, n=params.pretrain_drills,
                             seed=params.seed)
    if params.locate_steps or scene is None:
        return drills
    return drills + vision_drills(params, scene, system, asked_attributes(all_questions))


def reading_dialogues(params: Params, agent: AgentParams, world_dir: Path, index_dir: Path,
                      all_questions: list[dict], scene: SceneConfig | None, system: str
                      ) -> tuple[list[list[dict]], list[list[dict]]]:
    """(phase 1's dialogues, phase 1's held-out check drills): :func:`pretrain_dialogues` and :func:`check_drills`;
    module-level, so the stage draws them in a worker process beside :func:`locate_block_dialogues`."""
    return (pretrain_dialogues(params, agent, world_dir, index_dir, all_questions, scene, system),
            check_drills(params, agent, world_dir, index_dir, all_questions))


def play_and_draw(params: Params, agent: AgentParams, inputs: dict[str, Path], all_questions: list[dict],
                  scene: SceneConfig | None, system: str, attributes: Sequence[str] | None, workers: int = 1,
                  meanwhile: Callable[[list], None] | None = None
                  ) -> tuple[list, dict, list[list[dict]], list[list[dict]], list[list[dict]]]:
    """The teacher plays the sft split here while ``workers`` processes draw phase 1's dialogues with its check
    drills (:func:`reading_dialogues`) and the block's (:func:`locate_block_dialogues`): all three mostly
    single-threaded Python (the drills' image searches, the block's scenes and crops), the same draws as in this
    process. Then ``meanwhile(trajectories)``, if given, runs here while the drawing goes on (the stage builds the
    model and trains phase 0's reading: what needs the trajectories and not the drills), with ``workers`` fewer
    torch threads, as the drawing holds that many cores. Returns (trajectories, teacher stats with
    ``beside_drawing_s``: the seconds of ``meanwhile``, and ``drills_wait_s``: how long the drawing outlasted the
    teacher and ``meanwhile``, phase 1's dialogues, the block's, the check drills). One worker (the stage's) draws
    the two in turn; two draw them at once, which on two cores did not shorten the step (5.8 minutes against 5.6:
    the teacher and one worker already hold both cores; ``bench/probe_drawing.py`` times both)."""
    import multiprocessing as mp

    if workers not in (1, 2):
        raise ValueError(f"play_and_draw draws two parts: workers must be 1 or 2, got {workers}")
    # a Pool, not a ProcessPoolExecutor: leaving it terminates the drawing, so a teacher error shows at once
    with mp.get_context("spawn").Pool(workers) as drawer:
        reading = drawer.apply_async(reading_dialogues, (params, agent, inputs["world_dir"], inputs["index_dir"],
                                                         all_questions, scene, system))
        block = drawer.apply_async(locate_block_dialogues, (params, scene, system, attributes))
        questions = [q for q in all_questions if q["split"] == "sft"]
        trajs, stats = teacher_trajectories(params, agent, questions, inputs["image_root"], inputs["world_dir"],
                                            inputs["index_dir"])
        if meanwhile is not None:
            t0, threads = time.perf_counter(), torch.get_num_threads()
            torch.set_num_threads(max(1, threads - workers))  # a thread on a drawing core stalls every parallel op
            try:
                meanwhile(trajs)
            finally:
                torch.set_num_threads(threads)
            stats["beside_drawing_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        (pretrain, held_out), locate = reading.get(), block.get()
        stats["drills_wait_s"] = round(time.perf_counter() - t0, 1)
    return trajs, stats, pretrain, locate, held_out


def check_drills(params: Params, agent: AgentParams, world_dir: Path, index_dir: Path,
                 all_questions: list[dict]) -> list[list[dict]]:
    """Phase 1's held-out check drills (none without phase 1's reading drills): ``pretrain_check_drills`` reading
    drills drawn as phase 1's (:func:`mars.synth.drills.reading_drills`, the same knobs and excluded entities) with
    another seed, so their stand-in names are new to the model."""
    if not (params.pretrain_steps and params.pretrain_drills and params.pretrain_check_drills):
        return []
    from mars.data.schemas import GALLERY

    entities = read_table(world_dir / "entities.parquet", ENTITIES).to_pylist()
    gallery = read_table(world_dir / "gallery.parquet", GALLERY).to_pylist()
    return _reading_drills(agent, world_dir, index_dir, entities, gallery, _test_entities(all_questions),
                           n=params.pretrain_check_drills, seed=params.seed + 99)


def _test_entities(questions: list[dict]) -> set[str]:
    """The entities of the test split's questions (no drill or caption is about one)."""
    return {q["entity_id"] for q in questions if q["split"] == "test" and q.get("entity_id")}


def _reading_drills(agent: AgentParams, world_dir: Path, index_dir: Path, entities: list[dict],
                    gallery: list[dict], held_out: set[str], *, n: int, seed: int) -> list[list[dict]]:
    """``n`` reading drills (:func:`mars.synth.drills.reading_drills`) through the agent's tools."""
    from mars.synth.drills import reading_drills

    return reading_drills(agent.toolbox(index_dir, world_dir / "gallery"), entities, gallery, world_dir / "gallery",
                          n=n, seed=seed, exclude_entities=held_out)


def locate_block_dialogues(params: Params, scene: SceneConfig | None = None, system: str | None = None,
                           attributes: Sequence[str] | None = None) -> list[list[dict]]:
    """The localisation block's data (``locate_steps`` > 0, else none): the vision drills
    (:func:`vision_drills`), the same draw phase 1 would get."""
    if params.locate_steps == 0:
        return []
    _check_scene(params, scene)
    return vision_drills(params, scene, system, attributes)


def vision_drills(params: Params, scene: SceneConfig, system: str | None = None,
                  attributes: Sequence[str] | None = None) -> list[list[dict]]:
    """``pretrain_locate`` localisation drills on new scenes drawn with the world's ``scene`` knobs
    (:mod:`mars.synth.locate`, with the episodes' ``system`` prompt) and ``pretrain_zoom_captions`` new emblems at a
    zoom's scale (:func:`mars.synth.captions.zoom_captions`), both asking about ``attributes``
    (:func:`mars.world.questions.asked_attributes` of the questions file; all when None): phase 1's when
    ``locate_steps`` is 0, else the block's."""
    from mars.synth.captions import zoom_captions
    from mars.synth.locate import locate_dialogues

    return (locate_dialogues(scene, n=params.pretrain_locate, seed=params.seed, system=system, attributes=attributes,
                             answer_share=params.locate_answers)
            + zoom_captions(scene, n=params.pretrain_zoom_captions, seed=params.seed, attributes=attributes))


def world_colours(params: Params, scene: SceneConfig | None, world_dir: Path) -> SceneConfig | None:
    """``scene`` with the colour schemes of the world's entity emblems (:func:`mars.world.emblems.schemes_of`) when
    ``emblem_colours`` is world, so the emblems drawn anew for phase 0, the localisation drills, the zoom captions
    and the block's checks are coloured as the world's are (the default world's six schemes: six fills for the
    colour questions to name, not the palette's 16); else ``scene`` as it is."""
    if scene is None or params.emblem_colours == "palette":
        return scene
    from mars.world.emblems import schemes_of

    path = world_dir / "entities.parquet"
    emblems = [r["emblem"] for r in read_table(path, ENTITIES).to_pylist() if r["emblem"]]
    if not emblems:
        raise ValueError(f"sft.emblem_colours = world colours the drawn emblems as the world's entities are, but "
                         f"{path} has no emblems (a world of your own images?); set sft.emblem_colours: palette")
    return replace(scene, schemes=schemes_of(emblems))


def _check_scene(params: Params, scene: SceneConfig | None) -> None:
    drawn = params.locate_steps or (params.pretrain_steps and (params.pretrain_locate or params.pretrain_zoom_captions))
    if (drawn or params.vision_pretrain_steps) and scene is None:
        raise ValueError("sft.pretrain_locate, pretrain_zoom_captions or vision_pretrain_steps > 0 needs the world's "
                         "scene knobs (scene.json, written by the world stage); run the stage through "
                         "`python -m stages.sft` or pass scene=mars.world.scenes.read_scene(world_dir)")


def _check_arch(params: Params, agent: AgentParams) -> None:
    from mars.model.processor import PATCH_SIZE

    side = PATCH_SIZE[params.arch] * 2  # patch x merge
    if not params.init_checkpoint and side != agent.factor:
        raise ValueError(f"sft.arch={params.arch} makes {side}-px image tokens but agent.factor is {agent.factor}; "
                         f"set agent.factor: {side} in params.yaml")


def build_stack(params: Params, agent: AgentParams, texts: list[str]):
    """(model, tokenizer, processor): the init checkpoint, or the tiny model with its tokenizer."""
    from mars.model.build import build_model, load_checkpoint, tiny_config
    from mars.model.processor import build_processor
    from mars.model.tokenizer import load_qwen_vocab, train_tokenizer

    if params.init_checkpoint:
        model, tok, proc = load_checkpoint(params.init_checkpoint)
        agent.check_processor(proc, params.init_checkpoint)
        return model, tok, proc
    tok = (train_tokenizer(texts, vocab_size=params.vocab_size, pretokenizer=params.pretokenizer)
           if params.tokenizer == "local" else load_qwen_vocab())
    proc = build_processor(tok, agent.min_pixels, agent.max_pixels, arch=params.arch)
    ids = tok.convert_tokens_to_ids
    cfg = tiny_config(
        len(tok), arch=params.arch, text_hidden=params.text_hidden, text_layers=params.text_layers, heads=params.heads,
        kv_heads=params.kv_heads, vision_hidden=params.vision_hidden, vision_layers=params.vision_layers,
        rope_theta=params.rope_theta, window_size=params.vision_window, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        eos_token_id=ids("<|im_end|>"), pad_token_id=tok.pad_token_id,
    )
    return build_model(cfg, seed=params.seed), tok, proc


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def phase_keys(params: Params, common: Sequence, data: dict[str, Sequence[str]]) -> dict[str, str]:
    """Each training phase's checkpoint key (:data:`PHASES`), chained: a phase's key is the one before it plus its
    own knobs (:data:`PHASE_KNOBS`) and the digests of the data it trains on (``data[phase]``); the first key holds
    ``common`` (the agent params, input and code hashes, the tokenizer's digest) and every param no later phase
    owns. So a phase resumes (or, complete, is restored from its last checkpoint) only when it and everything
    before it would train the same, and a change of a later phase's knobs keeps it: a new ``locate_steps`` reruns
    the block and phase 2 and restores phases 0 and 1 (about 19 minutes) in seconds."""
    from mars.train.checkpoint import fingerprint

    values = asdict(params)
    owned = {k for knobs in PHASE_KNOBS.values() for k in knobs}
    unknown = owned - set(values)
    if unknown:  # a renamed param would silently leave every key
        raise KeyError(f"PHASE_KNOBS names params sft.Params lacks: {sorted(unknown)}")
    key = fingerprint({k: v for k, v in values.items() if k not in owned}, list(common))
    keys = {}
    for phase in PHASES:
        key = fingerprint(key, phase, {k: values[k] for k in PHASE_KNOBS.get(phase, ())}, list(data.get(phase, ())))
        keys[phase] = key
    return keys


def run(params: Params, agent: AgentParams, inputs: dict[str, Path], outputs: dict[str, Path],
        scene: SceneConfig | None = None) -> dict:
    """The stage (module docstring); ``scene``: the world's scene knobs (``pretrain_locate``,
    ``pretrain_zoom_captions``)."""
    from mars.agent.engine import trajectories_table
    from mars.agent.protocol import compact_system_prompt, system_prompt
    from mars.model.build import count_params, save_checkpoint
    from mars.tools.base import TOOL_SCHEMAS
    from mars.model.tokenizer import tokenizer_digest
    from stages import code_digest
    from mars.train.data import dialogues_digest, render_examples
    from mars.train.sft import train_sft

    _check_scene(params, scene)  # before the teacher's minutes
    _check_arch(params, agent)
    scene = world_colours(params, scene, inputs["world_dir"])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    all_questions = read_table(inputs["questions"], QUESTIONS).to_pylist()
    questions = [q for q in all_questions if q["split"] == "sft"]
    if not questions:
        raise RuntimeError(f"{inputs['questions']}: no questions in the sft split; check the synthesize params")
    system = (system_prompt if agent.prompt == "full" else compact_system_prompt)(TOOL_SCHEMAS)
    attributes = asked_attributes(all_questions)  # the localisation drills ask what the questions ask
    pretrain, locate, held_out = [], [], []
    pre_stats: dict = {}
    stack: dict = {}  # what prepare() builds
    with atomic_dir(outputs["out"]) as out:
        def prepare(trajs: list) -> None:
            """Everything that needs the teacher's trajectories and not the drills, beside the drawing when there is
            one (:func:`play_and_draw`): the model and tokenizer, the untrained base checkpoint, the trajectories'
            examples and phase 0's reading (its own crops; about 2.5 minutes)."""
            model, tok, proc = build_stack(params, agent, tokenizer_texts(inputs["world_dir"], questions, trajs,
                                                                          system))
            save_checkpoint(model, tok, proc, out / "base")
            dialogues = [t.messages for t in trajs]
            examples = render_examples(dialogues, proc, params.max_len, desc="rendering trajectories")
            _check_masks(examples, tok)
            # the code, the world's scene knobs, the tokenizer and each phase's data are in its key: a code change
            # never resumes old weights, nor does a change of the world or index inputs, which the questions file's
            # hash does not cover; a change of a later phase's knobs keeps the phases before it
            common = (asdict(agent), asdict(scene) if scene is not None else None, _file_hash(inputs["questions"]),
                      tokenizer_digest(tok), code_digest())
            stack.update(model=model, tok=tok, proc=proc, examples=examples, common=common,
                         d_train=dialogues_digest(dialogues))
            if params.vision_pretrain_steps:  # phase 0's reading trains on no drawn data: its key is the first
                pre_stats.update(vision_pretrain(params, model, proc, scene, outputs["checkpoints"] / "vision",
                                                 phase_keys(params, common, {})["vision"]))

        if not (params.pretrain_steps or params.locate_steps):
            trajs, stats = teacher_trajectories(params, agent, questions, inputs["image_root"], inputs["world_dir"],
                                                inputs["index_dir"])
            prepare(trajs)
        else:
            trajs, stats, pretrain, locate, held_out = play_and_draw(params, agent, inputs, all_questions, scene,
                                                                     system, attributes, meanwhile=prepare)
        model, tok, proc, examples = stack["model"], stack["tok"], stack["proc"], stack["examples"]
        frame = frame_stage_dialogues(params, locate)
        d_pre, d_loc, d_held, d_frame = (dialogues_digest(d) for d in (pretrain, locate, held_out, frame))
        keys = phase_keys(params, stack["common"], {"vision_locate": [d_loc if locate else d_pre],
                                                    "pretrain": [d_pre, d_held], "locate_frame": [d_frame],
                                                    "locate": [d_loc], "train": [stack["d_train"]]})
        pool: list = []  # phase 1's and the block's examples, which phase 2 mixes in
        write_artifacts({out / "trajectories.parquet": (trajectories_table(trajs), "trajectories")})
        if params.vision_locate_steps:
            pre_stats |= vision_locate(params, model, proc, scene, locate or pretrain,
                                       outputs["checkpoints"] / "vision_locate", keys["vision_locate"],
                                       attributes)
        # phase 1, then the localisation block (in two stages with locate_frame_steps), each with its own
        # checkpoints, so a kill in any phase resumes there
        frame_examples: list = []  # the frame stage's rendered examples: the block's first ones
        for name, dialogues, config in (("pretrain", pretrain, params.pretrain_config),
                                        ("locate_frame", frame, params.locate_frame_config),
                                        ("locate", locate, params.locate_config)):
            if not dialogues:
                continue
            rest = dialogues[len(frame):] if name == "locate" else dialogues  # the frame stage's are rendered
            block = frame_examples + render_examples(rest, proc, params.max_len, desc=f"rendering {name} data")
            _check_masks(block, tok)
            # the block keeps seeing phase 1's data: alone, it erased the copying (docs/findings.md)
            kept = _mix(pool, len(block), params.locate_mix, params.seed) if name != "pretrain" else []
            check = (copy_check(proc, held_out) if name == "pretrain"
                     else locate_check(params, proc, scene, system, attributes, read=name == "locate"))
            res = train_sft(model, block + kept, config(), pad_id=tok.pad_token_id,
                            ckpt_dir=outputs["checkpoints"] / name, live_dir=None,
                            fp=keys[name], until=None if name == "pretrain" else check)
            pre_stats |= {f"{name}_examples": len(block), f"{name}_loss_first": res["loss_first"],
                          f"{name}_loss_final": res["loss_final"], f"{name}_tokens_per_s": res["tokens_per_s"],
                          f"{name}_steps_run": res["steps"]}
            if check is not None:  # the held-out shares of the phase's last weights (not rescored if just asked)
                scores = check.scores(model, res["steps"])
                pre_stats |= {f"{name}_check_{k}": v for k, v in scores.items()}
                log.info("%s check (step, share): %s", name, {k: check.histories()[k] for k in scores})
                if name == "locate_frame" and scores["framed"] < params.locate_target:
                    log.warning("the block's frame stage ran to its ceiling (sft.locate_frame_steps = %d) with the "
                                "first zoom framing %.0f%% of the held-out scenes, short of sft.locate_target; the "
                                "block goes on with all the zoom captions", params.locate_frame_steps,
                                100 * scores["framed"])
            if kept:
                pre_stats[f"{name}_mixed_examples"] = len(kept)
            if name == "locate_frame":
                frame_examples = block
            else:
                pool += block
        mixed = _mix(pool, len(examples), params.mix_pretrain, params.seed)
        del pool, pretrain, locate, frame, frame_examples  # the pixels not mixed in are not needed in phase 2
        summary = train_sft(model, examples + mixed, params.train_config(), pad_id=tok.pad_token_id,
                            ckpt_dir=outputs["checkpoints"], live_dir=outputs["live"], fp=keys["train"])
        if not all(torch.isfinite(torch.tensor([l for _, l in summary["history"]]))):
            raise RuntimeError("SFT loss became NaN/inf; lower sft.lr or sft.vision_lr")
        save_checkpoint(model, tok, proc, out / "model")
    metrics = {**stats, **{k: v for k, v in summary.items() if k != "history"}, "params": count_params(model),
               "examples": len(examples), "mixed_pretrain_examples": len(mixed), **pre_stats}
    log.info("sft: %s", metrics)
    write_metrics(outputs["metrics"], metrics)
    return metrics


def locate_check(params: Params, proc, scene: SceneConfig, system: str, attributes: Sequence[str] | None,
                 read: bool = True):
    """The localisation block's stopping check (:class:`mars.synth.locate.LocateCheck`; None when
    ``locate_target`` is 0): ``locate_check_scenes`` held-out scenes, drawn with another seed than the drills, and
    as many answered drills when ``locate_read_target`` > 0 and ``read`` (the frame stage's check has no read);
    asked from step ``locate_check_from`` on."""
    from mars.synth.locate import LocateCheck

    if not params.locate_target:
        return None
    return LocateCheck(proc, scene, n=params.locate_check_scenes, target=params.locate_target,
                       seed=params.seed + 99, system=system, attributes=attributes,
                       read_target=params.locate_read_target if read else 0.0, min_step=params.locate_check_from)


def frame_stage_dialogues(params: Params, block: list[list[dict]]) -> list[list[dict]]:
    """The block's frame stage's data (``locate_frame_steps`` > 0, else none): the block's dialogues
    (:func:`locate_block_dialogues`: the localisation drills, then ``pretrain_zoom_captions`` zoom captions) up to
    its first ``locate_frame_captions`` captions: on one seed the first zoom formed in 500 steps with 1,000
    captions and not in 1,600 with 4,000, which the read needs (docs/findings.md)."""
    if not (params.locate_frame_steps and block):
        return []
    return block[:len(block) - params.pretrain_zoom_captions + params.locate_frame_captions]


def copy_check(proc, drills: list[list[dict]]):
    """Phase 1's held-out copy score (:class:`mars.synth.drills.CopyCheck`; None without held-out ``drills``,
    :func:`check_drills`): the share of them the greedy reply copies right, scored after phase 1."""
    from mars.synth.drills import CopyCheck

    return CopyCheck(proc, drills) if drills else None


def vision_pretrain(params: Params, model, proc, scene: SceneConfig, ckpt_dir: Path, fp: str) -> dict:
    """Phase 0 (:mod:`mars.train.vision`): ``vision_pretrain_steps`` steps teaching the vision tower and projector
    to read ``vision_pretrain_images`` zoom crops drawn with the world's ``scene`` knobs; returns its metrics,
    with the read-out's accuracy on ``vision_test_images`` crops of another seed (chance: shape 12.5%, letter 4.2%,
    pattern 14.3%)."""
    from mars.train.vision import pretrain_vision, zoom_read_data

    data = zoom_read_data(scene, proc, params.vision_pretrain_images, params.seed)
    test = zoom_read_data(scene, proc, params.vision_test_images, params.seed + 99)
    visual = model.model.visual
    res = pretrain_vision(visual, data, params.vision_config(), dim=model.config.vision_config.out_hidden_size,
                          ckpt_dir=ckpt_dir, fp=fp, test=test)
    log.info("vision pre-training: %s", res)
    return {"vision_pretrain_loss_first": res["loss_first"], "vision_pretrain_loss_final": res["loss_final"],
            **{f"vision_pretrain_test_{k}": v for k, v in res["test_accuracy"].items()},
            "vision_pretrain_s": res["seconds"]}


def vision_locate(params: Params, model, proc, scene: SceneConfig, drills: list[list[dict]], ckpt_dir: Path,
                  fp: str, attributes: Sequence[str] | None = None) -> dict:
    """Phase 0, localisation (:func:`mars.train.vision.pretrain_vision` with :func:`mars.train.vision.cell_heads`):
    ``vision_locate_steps`` steps teaching the vision tower and projector the framed cell of the localisation
    drills' scenes among ``drills`` (the block's, or phase 1's when there is no block), rate ``vision_lr``; returns
    its metrics, with the read-out's accuracy on ``vision_test_images`` scenes of another seed (chance: one cell
    of the grid; its questions ask about ``attributes``, as in :func:`vision_drills`)."""
    from mars.synth.locate import locate_dialogues
    from mars.train.vision import cell_data, cell_heads, pretrain_vision

    rows, cols = scene.grid_rows, scene.grid_cols
    data = cell_data(drills, proc, rows, cols)
    held_out = locate_dialogues(scene, n=params.vision_test_images, seed=params.seed + 99, attributes=attributes)
    test = cell_data(held_out, proc, rows, cols)
    res = pretrain_vision(model.model.visual, data, params.vision_locate_config(),
                          dim=model.config.vision_config.out_hidden_size, ckpt_dir=ckpt_dir, fp=fp, test=test,
                          heads=cell_heads(rows, cols))
    log.info("vision localisation pre-training: %s", res)
    return {"vision_locate_loss_first": res["loss_first"], "vision_locate_loss_final": res["loss_final"],
            "vision_locate_test_cell": res["test_accuracy"]["cell"], "vision_locate_s": res["seconds"]}


def _mix(pre_examples: list, n_trajectories: int, share: float, seed: int) -> list:
    """A seeded draw of phase-1 examples making up ``share`` of phase 2's examples (with ``n_trajectories``)."""
    k = min(len(pre_examples), round(share / (1.0 - share) * n_trajectories)) if share > 0 else 0
    pick = np.random.default_rng([seed, 53]).permutation(len(pre_examples))[:k]
    return [pre_examples[int(i)] for i in sorted(pick)]


def _check_masks(examples, tok) -> None:
    """The loss mask never covers image, role-header or padding tokens (the stage contract)."""
    banned = {tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
                                                     "<|im_start|>")}
    for i, r in enumerate(examples):
        hit = set(r.input_ids[r.loss_mask.bool()].tolist()) & banned
        if hit:
            raise RuntimeError(f"trajectory {i}: the loss mask covers non-generated tokens {sorted(hit)}")


def main(argv: list[str] | None = None) -> int:
    params, inputs, outputs = stage_args(
        SECTION, Params, argv, inputs=("questions", "image_root", "world_dir", "index_dir"),
        outputs=("out", "checkpoints", "live", "metrics"),
    )
    agent = load_section("agent", AgentParams, argv)
    from mars.world.scenes import read_scene

    run(params, agent, inputs, outputs, scene=read_scene(inputs["world_dir"]))  # the world's own scene knobs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
