"""The ``sft`` stage: teacher trajectories through the real tools, then the cold-start SFT of a Qwen-VL model.

What it does
    1. Teacher trajectories: the scripted teacher (:mod:`mars.agent.teacher`, skill knob ``teacher_skill``) plays
       the sft split's questions through the shared rollout engine and the real tools (config: the ``agent``
       params section), or ``teacher: openai`` uses any OpenAI-compatible endpoint. Only episodes the judge marks
       correct and well formed are kept (rejection sampling), at most ``n_trajectories`` of them (the paper's cold
       start is small: few trajectories, so RL has headroom). Written to ``trajectories.parquet``.
    2. The model: ``init_checkpoint`` (a local Qwen2.5-VL or Qwen3-VL directory, e.g. Qwen2.5-VL-7B) or, by
       default, a tiny random-init Qwen2.5-VL (``arch: qwen3_vl``: Qwen3-VL, which needs ``agent.factor: 32``)
       built from the ``text_*`` / ``vision_*`` params, with a tokenizer trained on the
       world's text, the teacher's dialogues and the protocol (``tokenizer: local``, :func:`tokenizer_texts`;
       ``split_digits``: one token per digit) or the real Qwen2/2.5 vocabulary (``qwen``). The
       untrained model is saved as ``base/`` (the evaluate stage's "untrained" row).
    3. Vision pre-training, phase 0 (``vision_pretrain_steps`` > 0; :mod:`mars.train.vision`): the vision tower
       and projector alone learn to read the emblem in ``vision_pretrain_images`` zoom crops (fill colour, shape,
       letter, pattern; a throw-away attention read-out and linear heads, rate ``vision_pretrain_lr``), the stand-in
       for a base model's vision pre-training; checkpoints in ``--checkpoints``/vision; its held-out read-out
       accuracy goes to the metrics. It needs the trajectories (the tokenizer is fitted to them) and no drills, so it
       trains while the drills are drawn (:func:`play_and_draw`'s ``meanwhile``; ``beside_drawing_s`` in the
       metrics), on the cores the drawing leaves. Its localisation half (``vision_locate_steps`` > 0, the default;
       :func:`vision_locate`): the tower and projector alone learn which grid cell of the localisation drills'
       scenes is framed (a cell read-out, rate ``vision_lr``; checkpoints in ``--checkpoints``/vision_locate;
       held-out cell accuracy in the metrics), so the block below only has to route what the tower already sees into
       the zoom call (the block alone missed that phase change in some runs; README). Then the pre-training phase
       (``pretrain_steps`` > 0; the embedded default):
       ``pretrain_steps`` steps (language-model rate ``pretrain_lr``, or ``lr`` when 0) on gallery captions
       (:mod:`mars.synth.captions`: an emblem's fill colour, shape, letter or pattern) and text-only reading drills
       over real tool outputs (:mod:`mars.synth.drills`: copy a fact from a snippet, copy the top image-search title
       into a query), about entities of no test question, optional pure copy drills (``pretrain_copy``),
       localisation drills (:mod:`mars.synth.locate`: the first zoom on freshly drawn scenes with the world's grid
       and frame; ``pretrain_locate``; with ``locate_answers`` > 0 that share of the perception ones go on to the
       crop and the answer) and zoom captions (:func:`mars.synth.captions.zoom_captions`: read a new
       emblem at a zoom's scale); the emblems these and phase 0 draw anew take any palette colours, or with
       ``emblem_colours: world`` the world's own colour schemes (:func:`world_colours`). These stand in for the base
       model's pre-training (a random-init tiny model cannot read emblems or copy names from its context, and the
       multimodal trajectories are too costly per step to teach it); checkpoints in ``--checkpoints``/pretrain.
       With ``locate_steps`` > 0 the vision drills (localisation drills and zoom captions, :func:`vision_drills`)
       are not mixed into phase 1 but get a block of their own
       after it: ``locate_steps`` steps on them and a seeded ``locate_mix`` share of phase 1's examples (rates
       ``lr`` and ``vision_lr``; checkpoints in ``--checkpoints``/locate), dedicated practice a random-init vision
       tower needs (README: localisation); without phase 1's examples the block erased the copying phase 1 taught
       (README). With ``locate_target`` > 0 the block stops early once the model's greedy first zoom frames that
       share of ``locate_check_scenes`` held-out scenes (asked at every checkpoint from step ``locate_check_from``
       on: :func:`locate_check`; the metrics' ``locate_check_framed`` is the share of the block's last weights), so
       ``locate_steps`` is a ceiling: a fixed 200-step block framed 80 of 80 test scenes in one run and 19 in
       another (README, session 17). With ``locate_read_target`` > 0 the check also needs the read: the greedy
       answer after the teacher's right zoom is the teacher's on that share of as many held-out answered drills
       (``locate_check_read``): the colour profile's second link (README, session 29). With
       ``locate_frame_steps`` > 0 the block runs in two stages (:func:`frame_stage_dialogues`; checkpoints in
       ``--checkpoints``/locate_frame, then /locate): first the localisation drills with only the first
       ``locate_frame_captions`` zoom captions, at most ``locate_frame_steps`` steps or until the frame check holds
       (no read), then all of them for ``locate_steps`` with the read (README, session 30: a large caption dose kept
       the frame from forming on seed 1, a small one did not teach the read). Phase 1 likewise, with
       ``pretrain_target`` > 0: it stops once its greedy replies copy that share of ``pretrain_check_drills``
       held-out reading drills right (another seed, so new stand-in names; asked at the checkpoints from step
       ``pretrain_check_from`` on: :func:`copy_check`; the metrics' ``pretrain_check_copied`` is the share of phase
       1's last weights, scored with or without a target), so ``pretrain_steps`` is a ceiling.
       Measured (README, session 21): the held-out share plateaus near 70% on seeds 0 and 2 once the loss is low,
       and neither the check (seed 0 stopped at step 1,950) nor a longer phase 1 (seed 2, 3,000 steps) raised the
       SFT score, so the default has no target. Phase 1's and the block's dialogues (and the check's drills) are
       drawn in a worker process while the teacher of step 1 plays (:func:`play_and_draw`; ``drills_wait_s`` in
       the metrics: how long the drawing outlasted it).
    4. Training on the teacher trajectories (with ``trajectory_names: new`` or ``world`` their organisation and
       founder names replaced by stand-ins, a fresh set per trajectory, as in the drills:
       :func:`trajectory_dialogues`; measured in the README, off by default), with a seeded ``mix_pretrain`` share
       of phase 1's (and the block's) examples mixed in
       (without them the agentic phase overwrote the copy skill phase 1 taught; README)
       (:func:`mars.train.sft.train_sft`): assistant-token loss, per-module learning rates, warm-up and
       schedule, clipping, accumulation, optional DeepSpeed ZeRO-2/3, checkpoints every ``checkpoint_every``
       steps into ``--checkpoints`` (kept by DVC across runs: a killed ``dvc repro`` resumes each phase from its
       newest checkpoint when its key holds, :func:`phase_keys`: the params, input files, code, tokenizer and the
       data (:func:`mars.train.data.dialogues_digest`) of that phase and every one before it; a complete phase is
       restored from its last checkpoint, so a change of a later phase's knobs (:data:`PHASE_KNOBS`, e.g.
       ``locate_steps`` or ``max_steps``) reruns only that phase and the ones after it), curves with dvclive in
       ``--live``. The final model is saved as ``model/``, a self-contained HF checkpoint directory
       (weights, config, tokenizer, processor, chat template).

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
from mars.synth.drills import RENAME_SOURCES
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
    "pretrain": ("pretrain_steps", "pretrain_batch_size", "pretrain_lr", "pretrain_group_batches", "pretrain_target",
                 "pretrain_check_drills", "pretrain_check_from"),
    # the block's shared knobs are its frame stage's (they enter the block's key after it, also with no frame stage)
    "locate_frame": ("locate_frame_steps", "locate_frame_captions", "locate_batch_size", "locate_target",
                     "locate_check_scenes", "locate_mix", "locate_check_from"),
    "locate": ("locate_steps", "locate_read_target"),
    "train": ("max_steps", "group_batches", "mix_pretrain"),
}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    teacher: str = "scripted"  # scripted | openai
    teacher_skill: float = 0.8
    teacher_base_url: str = ""
    teacher_model: str = ""
    n_trajectories: int = 450
    pretrain_steps: int = 0  # phase 1: steps on gallery captions + reading drills (0 = no pre-training phase)
    pretrain_captions: int = 0  # gallery-caption dialogues (mars.synth.captions)
    pretrain_drills: int = 0  # text-only reading drills over real tool outputs (mars.synth.drills)
    pretrain_copy: int = 0  # pure copy drills: repeat a list of fresh names (mars.synth.drills.copy_drills)
    drill_names: str = "new"  # the drills' stand-in names: new (generated words) | world (the world's own words)
    drill_chains: float = 0.0  # share of the title drills that go on to the text search and the answer
    trajectory_names: str = "real"  # phase 2's names: real | new | world (mars.synth.drills.rename_dialogues)
    pretrain_locate: int = 0  # localisation drills: zoom on the red frame of a freshly drawn scene (mars.synth.locate)
    pretrain_zoom_captions: int = 0  # read a new emblem at a zoom's scale (mars.synth.captions.zoom_captions)
    locate_answers: float = 0.0  # share of the perception localisation drills that go on to the crop and answer
    emblem_colours: str = "palette"  # the colours of the emblems drawn anew (phase 0's crops, the localisation
    #                                  drills, zoom captions, the block's checks): palette (any) | world (its schemes)
    locate_steps: int = 0  # > 0: the pretrain_locate drills get a block of their own, these steps after phase 1
    locate_target: float = 0.0  # > 0: the block stops once its first zoom frames this share of held-out scenes
    locate_check_scenes: int = 40  # the held-out scenes of that check (asked at every checkpoint)
    locate_read_target: float = 0.0  # > 0: the check also needs the answer after the teacher's right zoom on this
    #                                  share of as many held-out answered drills (the read, once the frame holds)
    locate_check_from: int = 0  # the block's check is asked at the checkpoints from this step on (in each stage)
    locate_frame_steps: int = 0  # > 0: the block in two stages: first the drills with locate_frame_captions of the
    #                              zoom captions, at most these steps or until the frame check holds (locate_target),
    #                              then the drills with all of them and the read check (README, session 30)
    locate_frame_captions: int = 0  # the frame stage's zoom captions (the first of the pretrain_zoom_captions)
    pretrain_target: float = 0.0  # > 0: phase 1 stops once its greedy replies copy this share of held-out drills
    #                               (0: they are only scored after phase 1: pretrain_check_copied in the metrics)
    pretrain_check_drills: int = 60  # the held-out reading drills of that check (another seed: fresh names)
    pretrain_check_from: int = 0  # the check is asked at the checkpoints from this phase-1 step on
    mix_pretrain: float = 0.0  # share of phase 2's examples drawn from phase 1's data (so its skills are kept)
    locate_mix: float = 0.0  # share of the localisation block's examples drawn from phase 1's data (likewise)
    vision_pretrain_steps: int = 0  # phase 0: the vision tower learns to read zoomed emblems (mars.train.vision)
    vision_pretrain_images: int = 4000  # its labelled zoom crops (a new emblem each)
    vision_pretrain_lr: float = 5e-4
    vision_locate_steps: int = 0  # phase 0: the vision tower learns the framed cell of the localisation drills
    vision_test_images: int = 300  # held-out crops / scenes phase 0's read-outs are scored on (dvc metrics)
    tokenizer: str = "local"  # local | qwen
    pretokenizer: str = "trailing"  # local tokenizer: trailing (a word keeps the space after it) | words (spaces
    #                                 are tokens of their own) | bytelevel (GPT-2 style); mars.model.tokenizer
    split_digits: bool = False  # local tokenizer: one token per digit (as Qwen's); measured worse for years (README)
    vocab_size: int = 1024
    init_checkpoint: str = ""  # a local HF checkpoint directory instead of the tiny random-init model
    arch: str = "qwen2_5_vl"  # the tiny model's architecture: qwen2_5_vl | qwen3_vl (mars.model.build)
    text_hidden: int = 128
    text_layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    vision_hidden: int = 96
    vision_layers: int = 2
    vision_window: int = 224  # window attention span in pixels (>= the policy's view: one window per image)
    rope_theta: float = 10000.0
    batch_size: int = 16
    pretrain_batch_size: int = 0  # phase 1's batch (0 = batch_size)
    locate_batch_size: int = 0  # the localisation block's (0 = batch_size)
    grad_accum: int = 1
    group_batches: int = 1  # phase 2's length-grouped batches: runs of this many batches sorted by length (1 = off)
    pretrain_group_batches: int = 1  # phase 1's (1 = plain shuffled batches)
    length_split: int = 1  # every phase's batches run as this many sub-batches of similar length (the same gradient)
    compile: bool = False  # every phase's text decoder layers through torch.compile (the same maths to rounding)
    max_steps: int = 350
    lr: float = 2e-3
    pretrain_lr: float = 0.0  # phase 1's language-model rate (0 = lr; the vision rate stays vision_lr)
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
        if self.drill_names not in RENAME_SOURCES:
            raise ValueError(f"sft.drill_names must be one of {RENAME_SOURCES}, got {self.drill_names!r}")
        if self.trajectory_names not in ("real", *RENAME_SOURCES):
            raise ValueError(f"sft.trajectory_names must be one of {('real', *RENAME_SOURCES)}, got "
                             f"{self.trajectory_names!r}")
        if self.arch not in ("qwen2_5_vl", "qwen3_vl"):
            raise ValueError(f"sft.arch must be 'qwen2_5_vl' or 'qwen3_vl', got {self.arch!r}")
        if self.n_trajectories < 1:
            raise ValueError(f"sft.n_trajectories must be >= 1, got {self.n_trajectories}")
        counts = {k: getattr(self, k) for k in ("pretrain_captions", "pretrain_drills", "pretrain_copy",
                                                 "pretrain_locate", "pretrain_zoom_captions")}
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
        if not 0.0 <= self.drill_chains <= 1.0:
            raise ValueError(f"sft.drill_chains must be in [0, 1], got {self.drill_chains}")
        if self.emblem_colours not in EMBLEM_COLOURS:
            raise ValueError(f"sft.emblem_colours must be one of {EMBLEM_COLOURS}, got {self.emblem_colours!r}")
        if not 0.0 <= self.locate_answers <= 1.0:
            raise ValueError(f"sft.locate_answers must be in [0, 1], got {self.locate_answers}")
        for k in ("mix_pretrain", "locate_mix"):
            if not 0.0 <= getattr(self, k) < 1.0:
                raise ValueError(f"sft.{k} must be in [0, 1), got {getattr(self, k)}")
        if self.pretrain_lr < 0:
            raise ValueError(f"sft.pretrain_lr must be >= 0 (0 = sft.lr), got {self.pretrain_lr}")
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
        if not 0.0 <= self.pretrain_target <= 1.0:
            raise ValueError(f"sft.pretrain_target must be in [0, 1] (0 = run all sft.pretrain_steps), got "
                             f"{self.pretrain_target}")
        if self.pretrain_target and not (self.pretrain_steps and self.pretrain_drills and self.pretrain_check_drills):
            raise ValueError("sft.pretrain_target > 0 checks phase 1's copying on held-out reading drills: set "
                             "sft.pretrain_steps and sft.pretrain_drills > 0, or sft.pretrain_target: 0")
        if self.pretrain_check_drills < 0 or self.pretrain_check_from < 0:
            raise ValueError(f"sft.pretrain_check_drills and sft.pretrain_check_from must be >= 0, got "
                             f"{self.pretrain_check_drills}, {self.pretrain_check_from}")
        if self.locate_steps and not self.pretrain_locate:
            raise ValueError("sft.locate_steps > 0 trains on the localisation drills: set sft.pretrain_locate > 0")
        if self.locate_steps:  # the vision drills are then the block's, not phase 1's
            counts.pop("pretrain_locate")
            counts.pop("pretrain_zoom_captions")
        if self.pretrain_steps and not any(counts.values()):
            raise ValueError(f"sft.pretrain_steps > 0 needs one of {', '.join(counts)} > 0")
        for k in ("pretrain_batch_size", "locate_batch_size"):
            if getattr(self, k) < 0:
                raise ValueError(f"sft.{k} must be >= 0 (0 = sft.batch_size), got {getattr(self, k)}")
        if self.pretrain_group_batches < 1:
            raise ValueError(f"sft.pretrain_group_batches must be >= 1, got {self.pretrain_group_batches}")
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
        """Phase 1's training config: ``pretrain_steps`` steps of ``pretrain_batch_size`` (``batch_size`` when 0)
        at ``pretrain_lr`` (``lr`` when 0), in ``pretrain_group_batches`` length-grouped batches (1 = shuffled:
        grouped, the drills' batches pad less but come in runs of one drill kind, and the SFT model copied the top
        title less: README, run Q)."""
        return self.train_config(self.pretrain_steps, lr=self.pretrain_lr or self.lr,
                                 group_batches=self.pretrain_group_batches, batch_size=self.pretrain_batch_size)

    def locate_config(self):
        """The localisation block's training config: ``locate_steps`` steps of ``locate_batch_size``
        (``batch_size`` when 0) at ``lr`` and ``vision_lr``; plain shuffled batches."""
        return self.train_config(self.locate_steps, group_batches=1, batch_size=self.locate_batch_size)

    def locate_frame_config(self):
        """The block's frame stage's config: :meth:`locate_config` with ``locate_frame_steps`` steps."""
        return self.train_config(self.locate_frame_steps, group_batches=1, batch_size=self.locate_batch_size)

    def train_config(self, max_steps: int | None = None, lr: float | None = None, group_batches: int | None = None,
                     batch_size: int = 0):
        """Phase 2's training config, or a phase's with its ``max_steps``, ``lr``, ``group_batches`` and
        ``batch_size`` (0 = ``batch_size``)."""
        from mars.train.optim import OptimConfig
        from mars.train.sft import SFTConfig

        optim = OptimConfig(
            lr=self.lr if lr is None else lr, vision_lr=self.vision_lr, weight_decay=self.weight_decay,
            warmup_steps=self.warmup_steps, schedule=self.schedule, min_lr_ratio=self.min_lr_ratio,
            max_steps=self.max_steps if max_steps is None else max_steps,
            clip_norm=self.clip_norm, freeze_vision=self.freeze_vision, deepspeed_stage=self.deepspeed_stage,
        )
        return SFTConfig(optim=optim, batch_size=batch_size or self.batch_size, grad_accum=self.grad_accum,
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
    """What the local tokenizer is fitted to: corpus, names, questions, teacher dialogues, protocol.

    The teacher's dialogues stay in (measured, README session 19): fitted to the teacher's fixed wording and its
    tool observations instead of its turns (runs Z3, Z5), the SFT model's query copied the top image-search title
    in 24-28% of the test chains (36-70% in runs W and Y, two seeds of this fit) and it scored 10.8-12.5%
    (15.0-15.8%)."""
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
    """The pre-training phase's data: ``pretrain_captions`` gallery captions (:mod:`mars.synth.captions`),
    ``pretrain_drills`` reading drills (:mod:`mars.synth.drills`), never about an entity of a test question,
    ``pretrain_copy`` pure copy drills of fresh names (:func:`mars.synth.drills.copy_drills`)
    and the vision drills (:func:`vision_drills`: localisation drills and zoom captions). With ``locate_steps`` > 0
    the vision drills are not phase 1's but the block's (:func:`locate_block_dialogues`)."""
    if params.pretrain_steps == 0:
        return []
    _check_scene(params, scene)
    from mars.data.schemas import GALLERY
    from mars.synth.captions import caption_dialogues
    from mars.synth.drills import copy_drills

    held_out = _test_entities(all_questions)
    gallery = read_table(world_dir / "gallery.parquet", GALLERY).to_pylist()
    entities = read_table(world_dir / "entities.parquet", ENTITIES).to_pylist()
    captions = caption_dialogues(gallery, entities, world_dir / "gallery", n=params.pretrain_captions,
                                 seed=params.seed, exclude_entities=held_out)
    drills = _reading_drills(params, agent, world_dir, index_dir, entities, gallery, held_out,
                             n=params.pretrain_drills, seed=params.seed)
    drills += copy_drills(entities, n=params.pretrain_copy, seed=params.seed, rename_from=params.drill_names)
    if params.locate_steps or scene is None:
        return captions + drills
    return captions + drills + vision_drills(params, scene, system, asked_attributes(all_questions))


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
    the two in turn; two draw them at once, which on two cores did not shorten the step (the colour profile's data:
    teacher and drawing 5.8 minutes with one worker, run P3, 5.6 with two, run P5; README, session 25), as the
    teacher and one worker already hold both cores; ``bench/probe_drawing.py`` times both."""
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
    return _reading_drills(params, agent, world_dir, index_dir, entities, gallery, _test_entities(all_questions),
                           n=params.pretrain_check_drills, seed=params.seed + 99)


def _test_entities(questions: list[dict]) -> set[str]:
    """The entities of the test split's questions (no drill or caption is about one)."""
    return {q["entity_id"] for q in questions if q["split"] == "test" and q.get("entity_id")}


def _reading_drills(params: Params, agent: AgentParams, world_dir: Path, index_dir: Path, entities: list[dict],
                    gallery: list[dict], held_out: set[str], *, n: int, seed: int) -> list[list[dict]]:
    """``n`` reading drills (:func:`mars.synth.drills.reading_drills`) with the params' chain share and names."""
    from mars.synth.drills import reading_drills

    return reading_drills(agent.toolbox(index_dir, world_dir / "gallery"), entities, gallery, world_dir / "gallery",
                          n=n, seed=seed, exclude_entities=held_out, chain_share=params.drill_chains,
                          rename_from=params.drill_names)


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
                         "scene knobs (the world params section); run the stage through `python -m stages.sft` or pass "
                         "scene=WorldSpec(...).scene_config()")


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
    tok = (train_tokenizer(texts, vocab_size=params.vocab_size, pretokenizer=params.pretokenizer,
                           split_digits=params.split_digits)
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
    before it would train the same, and a change of a later phase's knobs keeps it: with the colour profile a new
    ``locate_steps`` reruns the block and phase 2 and restores phases 0 and 1 (about 19 minutes) in seconds."""
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
            examples and phase 0's reading (its own crops; the colour profile's ~2.5 minutes)."""
            model, tok, proc = build_stack(params, agent, tokenizer_texts(inputs["world_dir"], questions, trajs,
                                                                          system))
            save_checkpoint(model, tok, proc, out / "base")
            dialogues = trajectory_dialogues(params, trajs, inputs["world_dir"])
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
            # the block keeps seeing phase 1's data: alone, its 600 steps erased the copying (README, Results)
            kept = _mix(pool, len(block), params.locate_mix, params.seed) if name != "pretrain" else []
            check = (copy_check(params, proc, held_out) if name == "pretrain"
                     else locate_check(params, proc, scene, system, attributes, read=name == "locate"))
            res = train_sft(model, block + kept, config(), pad_id=tok.pad_token_id,
                            ckpt_dir=outputs["checkpoints"] / name, live_dir=None,
                            fp=keys[name], until=check)
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
    its first ``locate_frame_captions`` captions. Measured (README, session 29): on seed 1 the first zoom formed in
    500 steps with 1,000 captions and not in 1,600 with 4,000, which the read needs."""
    if not (params.locate_frame_steps and block):
        return []
    return block[:len(block) - params.pretrain_zoom_captions + params.locate_frame_captions]


def copy_check(params: Params, proc, drills: list[list[dict]]):
    """Phase 1's check (:class:`mars.synth.drills.CopyCheck`; None without held-out ``drills``,
    :func:`check_drills`): the share of them the greedy reply copies right, asked at the checkpoints from step
    ``pretrain_check_from`` on when ``pretrain_target`` > 0 (a stopping check), else only scored after phase 1."""
    from mars.synth.drills import CopyCheck

    if not drills:
        return None
    return CopyCheck(proc, drills, target=params.pretrain_target, min_step=params.pretrain_check_from)


def trajectory_dialogues(params: Params, trajs: list, world_dir: Path) -> list[list[dict]]:
    """Phase 2's dialogues: the teacher trajectories, with stand-in names when ``trajectory_names`` asks for them
    (:func:`mars.synth.drills.rename_dialogues`; ``trajectories.parquet`` keeps the real ones)."""
    dialogues = [t.messages for t in trajs]
    if params.trajectory_names == "real":
        return dialogues
    from mars.synth.drills import rename_dialogues

    entities = read_table(world_dir / "entities.parquet", ENTITIES).to_pylist()
    return rename_dialogues(dialogues, entities, seed=params.seed, rename_from=params.trajectory_names)


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
    from stages.world import Params as WorldParams, world_spec

    run(params, agent, inputs, outputs, scene=world_spec(load_section("world", WorldParams, argv)).scene_config())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
