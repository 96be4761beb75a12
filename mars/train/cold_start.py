"""The sft stage's cold start as a sequence of training phases: their params, keys, data checks and runs.

What it does
    :class:`SFTParams` is the ``sft`` section of params.yaml (validated as a whole: a knob that needs another says
    which) with the training config of each phase. :func:`prepare` builds what every phase trains
    (:class:`Stack`): the model and tokenizer (:func:`build_stack`), the untrained ``base/`` checkpoint, the teacher
    trajectories' rendered examples, and runs phase 0's reading. :func:`run_phases` then runs the rest, in order:

    ==================  ======================================  ==========================  =========================
    phase               its data                                its steps                   its check
    ==================  ======================================  ==========================  =========================
    ``vision``          zoom crops drawn anew                   ``vision_pretrain_steps``   read-out accuracy
    ``vision_locate``   the localisation drills' scenes         ``vision_locate_steps``     framed-cell accuracy
    ``pretrain``        reading drills (+ vision drills)        ``pretrain_steps``          held-out copy share
    ``locate_frame``    drills + ``locate_frame_captions``      ``locate_frame_steps``      first zoom frames (stops)
    ``locate``          drills + all zoom captions              ``locate_steps``            frame and read (stops)
    ``train``           teacher trajectories + a mixed share    ``max_steps``               loss is finite
    ==================  ======================================  ==========================  =========================

    Each phase checkpoints under its own key (:func:`phase_keys`), chained from the phases before it, so a killed
    run resumes each phase where it stopped and a change of a later phase's knobs (:data:`PHASE_KNOBS`) reruns only
    that phase and the ones after it. The data are drawn by :mod:`mars.train.drawing`; docs/training.md (SFT) says
    what each phase is for and what it achieved.

Run the tests: ``.venv/bin/python -m pytest tests/train tests/stages -q``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from mars.agent.config import AgentParams
from mars.model.tokenizer import PRETOKENIZERS
from mars.world.scenes import SceneConfig

__all__ = ["SFTParams", "PHASES", "PHASE_KNOBS", "Stack", "build_stack", "check_arch", "phase_keys", "prepare",
           "run_phases", "locate_check", "copy_check", "vision_pretrain", "vision_locate", "mix_in", "check_masks"]
EMBLEM_COLOURS = ("palette", "world")  # sft.emblem_colours: any palette colours | the world's schemes (world_colours)
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
class SFTParams:
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
    pretrain_drills: int = 4000  # text-only reading drills over real tool outputs (mars.train.drills)
    pretrain_check_drills: int = 60  # held-out drills scored after phase 1 (pretrain_check_copied)
    pretrain_locate: int = 2000  # localisation drills (mars.train.locate)
    locate_answers: float = 1.0  # share of the perception localisation drills that go on to the crop and answer
    pretrain_zoom_captions: int = 4000  # read a new emblem at a zoom's scale (mars.train.captions.zoom_captions)
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
        tower found the frame in ``probes/probe_locate.py``)."""
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


def check_arch(params: SFTParams, agent: AgentParams) -> None:
    """The tiny model's image tokens cover ``agent.factor`` pixels (patch x merge of ``sft.arch``)."""
    from mars.model.processor import PATCH_SIZE

    side = PATCH_SIZE[params.arch] * 2  # patch x merge
    if not params.init_checkpoint and side != agent.factor:
        raise ValueError(f"sft.arch={params.arch} makes {side}-px image tokens but agent.factor is {agent.factor}; "
                         f"set agent.factor: {side} in params.yaml")


def build_stack(params: SFTParams, agent: AgentParams, texts: list[str]):
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


def phase_keys(params: SFTParams, common: Sequence, data: dict[str, Sequence[str]]) -> dict[str, str]:
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


def locate_check(params: SFTParams, proc, scene: SceneConfig, system: str, attributes: Sequence[str] | None,
                 read: bool = True):
    """The localisation block's stopping check (:class:`mars.train.locate.LocateCheck`; None when
    ``locate_target`` is 0): ``locate_check_scenes`` held-out scenes, drawn with another seed than the drills, and
    as many answered drills when ``locate_read_target`` > 0 and ``read`` (the frame stage's check has no read);
    asked from step ``locate_check_from`` on."""
    from mars.train.locate import LocateCheck

    if not params.locate_target:
        return None
    return LocateCheck(proc, scene, n=params.locate_check_scenes, target=params.locate_target,
                       seed=params.seed + 99, system=system, attributes=attributes,
                       read_target=params.locate_read_target if read else 0.0, min_step=params.locate_check_from)


def copy_check(proc, drills: list[list[dict]]):
    """Phase 1's held-out copy score (:class:`mars.train.drills.CopyCheck`; None without held-out ``drills``,
    :func:`check_drills`): the share of them the greedy reply copies right, scored after phase 1."""
    from mars.train.drills import CopyCheck

    return CopyCheck(proc, drills) if drills else None


def vision_pretrain(params: SFTParams, model, proc, scene: SceneConfig, ckpt_dir: Path, fp: str) -> dict:
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


def vision_locate(params: SFTParams, model, proc, scene: SceneConfig, drills: list[list[dict]], ckpt_dir: Path,
                  fp: str, attributes: Sequence[str] | None = None) -> dict:
    """Phase 0, localisation (:func:`mars.train.vision.pretrain_vision` with :func:`mars.train.vision.cell_heads`):
    ``vision_locate_steps`` steps teaching the vision tower and projector the framed cell of the localisation
    drills' scenes among ``drills`` (the block's, or phase 1's when there is no block), rate ``vision_lr``; returns
    its metrics, with the read-out's accuracy on ``vision_test_images`` scenes of another seed (chance: one cell
    of the grid; its questions ask about ``attributes``, as in :func:`vision_drills`)."""
    from mars.train.locate import locate_dialogues
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


def mix_in(pre_examples: list, n_trajectories: int, share: float, seed: int) -> list:
    """A seeded draw of phase-1 examples making up ``share`` of phase 2's examples (with ``n_trajectories``)."""
    k = min(len(pre_examples), round(share / (1.0 - share) * n_trajectories)) if share > 0 else 0
    pick = np.random.default_rng([seed, 53]).permutation(len(pre_examples))[:k]
    return [pre_examples[int(i)] for i in sorted(pick)]


def check_masks(examples, tok) -> None:
    """The loss mask never covers image, role-header or padding tokens (the stage contract)."""
    banned = {tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
                                                     "<|im_start|>")}
    for i, r in enumerate(examples):
        hit = set(r.input_ids[r.loss_mask.bool()].tolist()) & banned
        if hit:
            raise RuntimeError(f"trajectory {i}: the loss mask covers non-generated tokens {sorted(hit)}")



@dataclass
class Stack:
    """What :func:`prepare` builds for the phases: the model, tokenizer and processor, the teacher trajectories'
    rendered ``examples``, and the parts of every phase's key that are not knobs (``common``: agent params, scene
    knobs, the questions file's and the code's digests, the tokenizer's; ``train_digest``: the trajectories')."""

    model: torch.nn.Module
    tok: object
    proc: object
    examples: list
    common: tuple
    train_digest: str


def prepare(params: SFTParams, agent: AgentParams, trajs: list, texts: list[str], scene: SceneConfig | None,
            base_dir: Path, ckpt_dir: Path, digests: Sequence[str]) -> tuple[Stack, dict]:
    """Everything that needs the teacher's trajectories and not the drills (the stage runs it beside the drawing,
    :func:`mars.train.drawing.play_and_draw`): the model and tokenizer fitted to ``texts``, the untrained checkpoint
    at ``base_dir``, the trajectories' rendered examples and phase 0's reading (its own crops; checkpoints under
    ``ckpt_dir``/vision). ``digests``: the questions file's and the code's, for the keys. Returns the stack and phase
    0's metrics."""
    from mars.model.build import save_checkpoint
    from mars.model.tokenizer import tokenizer_digest
    from mars.train.data import dialogues_digest, render_examples

    model, tok, proc = build_stack(params, agent, texts)
    save_checkpoint(model, tok, proc, base_dir)
    dialogues = [t.messages for t in trajs]
    examples = render_examples(dialogues, proc, params.max_len, desc="rendering trajectories")
    check_masks(examples, tok)
    # the code, the world's scene knobs, the tokenizer and each phase's data are in its key: a code change never
    # resumes old weights, nor does a change of the world or index inputs, which the questions file's hash does not
    # cover; a change of a later phase's knobs keeps the phases before it
    questions_digest, code = digests
    common = (asdict(agent), asdict(scene) if scene is not None else None, questions_digest, tokenizer_digest(tok),
              code)
    stack = Stack(model, tok, proc, examples, common, dialogues_digest(dialogues))
    stats = {}
    if params.vision_pretrain_steps:  # phase 0's reading trains on no drawn data: its key is the first
        key = phase_keys(params, common, {})["vision"]
        stats = vision_pretrain(params, model, proc, scene, ckpt_dir / "vision", key)
    return stack, stats


def run_phases(params: SFTParams, stack: Stack, drawn: dict[str, list], scene: SceneConfig | None, system: str,
               attributes: Sequence[str] | None, ckpt_dir: Path, live_dir: Path) -> tuple[dict, dict]:
    """Phase 0's localisation, phase 1, the localisation block (in two stages with ``locate_frame_steps``) and phase
    2 on ``stack`` (after :func:`prepare`), each with its own checkpoints under ``ckpt_dir`` (phase 2's at its root,
    its curves in ``live_dir``), so a kill in any phase resumes there. ``drawn``: the drawn data
    (:func:`mars.train.drawing.play_and_draw`): ``pretrain``, ``locate`` and ``held_out`` dialogues; their lists are
    emptied as the phases render them (the dialogues' images are not needed once rendered). Returns (phase 2's
    summary, the metrics of the phases before it)."""
    from mars.train.data import dialogues_digest, render_examples
    from mars.train.drawing import frame_stage_dialogues
    from mars.train.sft import train_sft

    model, tok, proc = stack.model, stack.tok, stack.proc
    pretrain, locate, held_out = drawn["pretrain"], drawn["locate"], drawn["held_out"]
    frame = frame_stage_dialogues(params, locate)
    d_pre, d_loc, d_held, d_frame = (dialogues_digest(d) for d in (pretrain, locate, held_out, frame))
    keys = phase_keys(params, stack.common, {"vision_locate": [d_loc if locate else d_pre], "pretrain": [d_pre, d_held],
                                             "locate_frame": [d_frame], "locate": [d_loc],
                                             "train": [stack.train_digest]})
    stats: dict = {}
    if params.vision_locate_steps:
        stats |= vision_locate(params, model, proc, scene, locate or pretrain, ckpt_dir / "vision_locate",
                               keys["vision_locate"], attributes)
    pool: list = []  # phase 1's and the block's examples, which phase 2 mixes in
    frame_examples: list = []  # the frame stage's rendered examples: the block's first ones
    n_frame = len(frame)
    # each phase: its name, its data, its steps (config) and its check (built when the phase runs)
    phases = (("pretrain", pretrain, params.pretrain_config, lambda: copy_check(proc, held_out)),
              ("locate_frame", frame, params.locate_frame_config,
               lambda: locate_check(params, proc, scene, system, attributes, read=False)),
              ("locate", locate, params.locate_config,
               lambda: locate_check(params, proc, scene, system, attributes, read=True)))
    for name, dialogues, config, make_check in phases:
        if not dialogues:
            continue
        rest = dialogues[n_frame:] if name == "locate" else dialogues  # the frame stage's are rendered
        block = frame_examples + render_examples(rest, proc, params.max_len, desc=f"rendering {name} data")
        del rest
        dialogues.clear()  # the dialogues' images now live in the rendered examples
        check_masks(block, tok)
        check = make_check()
        # the block keeps seeing phase 1's data: alone, it erased the copying (docs/findings.md)
        kept = mix_in(pool, len(block), params.locate_mix, params.seed) if name != "pretrain" else []
        res = train_sft(model, block + kept, config(), pad_id=tok.pad_token_id, ckpt_dir=ckpt_dir / name,
                        live_dir=None, fp=keys[name], until=None if name == "pretrain" else check)
        stats |= {f"{name}_examples": len(block), f"{name}_loss_first": res["loss_first"],
                  f"{name}_loss_final": res["loss_final"], f"{name}_tokens_per_s": res["tokens_per_s"],
                  f"{name}_steps_run": res["steps"]}
        if check is not None:  # the held-out shares of the phase's last weights (not rescored if just asked)
            scores = check.scores(model, res["steps"])
            stats |= {f"{name}_check_{k}": v for k, v in scores.items()}
            log.info("%s check (step, share): %s", name, {k: check.histories()[k] for k in scores})
            if name == "locate_frame" and scores["framed"] < params.locate_target:
                log.warning("the block's frame stage ran to its ceiling (sft.locate_frame_steps = %d) with the first "
                            "zoom framing %.0f%% of the held-out scenes, short of sft.locate_target; the block goes "
                            "on with all the zoom captions", params.locate_frame_steps, 100 * scores["framed"])
        if kept:
            stats[f"{name}_mixed_examples"] = len(kept)
        if name == "locate_frame":
            frame_examples = block
        else:
            pool += block
    mixed = mix_in(pool, len(stack.examples), params.mix_pretrain, params.seed)
    del pool, frame_examples  # the examples not mixed in are not needed in phase 2
    summary = train_sft(model, stack.examples + mixed, params.train_config(), pad_id=tok.pad_token_id,
                        ckpt_dir=ckpt_dir, live_dir=live_dir, fp=keys["train"])
    if not all(torch.isfinite(torch.tensor([l for _, l in summary["history"]]))):
        raise RuntimeError("SFT loss became NaN/inf; lower sft.lr or sft.vision_lr")
    stats["mixed_pretrain_examples"] = len(mixed)
    return summary, stats
