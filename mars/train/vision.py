"""Vision pre-training (phase 0 of the sft stage): teach a random-init vision tower to read emblems and to find the
framed cell (both on by default).

What it does
    :func:`pretrain_vision` trains a model's vision tower and projector (``model.model.visual``) on labelled emblem
    images before any language-model step: a :class:`ReadHeads` read-out (one learned attention query over the
    merged image tokens, the stand-in for the language model's attention to the image, then one linear head per
    attribute: fill colour, shape, letter or none, pattern or none) is trained jointly with the tower by AdamW on the
    sum of the heads' cross-entropies, then thrown away; only the tower and projector keep what they learned. The
    images are zoom crops (:func:`mars.train.captions.zoom_crop`: a new random emblem, of no entity, on a
    target-zone crop at the world's scale), so the tower learns to read an emblem at the size a zoom shows it.
    Batches are a seeded function of the step; checkpoints every ``checkpoint_every`` steps (tower, heads,
    optimizer, step, history) with the run's fingerprint, so a killed run resumes to the same weights as an
    uninterrupted one.
    Localisation uses the same loop with one head, the framed cell (:func:`cell_heads`), on the localisation drills'
    scenes in the policy's view (:func:`cell_data`: the label is the cell the teacher's zoom chose).

Why (and the deviation from the paper)
    The paper's policy starts from Qwen2.5-VL, whose vision encoder was pre-trained on billions of images and reads
    shapes and letters. The embedded default's tower is random-init, and learning to read through the language model's
    next-token loss did not happen in the SFT budget (2,000 zoom captions in the localisation block: perception at the
    multiple-choice guess; docs/findings.md). Measured with ``probes/probe_read.py``: even this direct classification
    loss leaves shape, letter and pattern at chance at ``sft.vision_lr`` (2e-3, 800 steps, at 96x2 and at 192x4); at
    5e-4 it learns shape and pattern after a phase change of hundreds of steps, letters not at all; the fill colour is
    read at 2e-3 within 200 steps (with emblems 0.05 of the scene: 23% of held-out crops at the default zone, 51% at
    ``world.target_zone`` 0.18; chance 6%) (docs/findings.md). This phase is therefore a stand-in for the base model's
    vision pre-training (supervised, as ViTs were pre-trained on labelled images), like phase 1 for its language
    pre-training. Measured in the pipeline (docs/findings.md): 3,000 steps with ``world.target_zone`` 0.18 reach shape
    29%, pattern 32%, letter 1% on held-out crops, and a 4-head SFT model's perception stayed at 20%; with colour
    questions, 400 steps at 2e-3 read the fill of half the held-out crops and that model answered 2 of 16 colour
    questions. The default asks the colour of emblems 0.12 of the scene drawn in the world's colour schemes: phase 0
    at 5e-4 reads the fill of 96-98% of held-out crops, and its 8-head SFT model answers 17-21 of 21 open colour
    questions. So reading is on by default (``sft.vision_pretrain_steps``), and it is refused with ``sft.freeze_vision``
    (a pretrained checkpoint's tower).
    Localisation: the sft stage's localisation block teaches the first zoom through the language model's loss, and
    whether the tower found the frame that way varied between runs (30-79 of 80 held-out scenes framed with the same
    block; docs/findings.md). Taught directly (``probes/probe_locate.py``: 100% of held-out scenes in 100-150 steps at
    2e-3), the tower sees the frame before the block starts (``sft.vision_locate_steps``, on by default;
    docs/findings.md). A pretrained tower (the paper's) needs neither.

Run the tests: ``.venv/bin/python -m pytest tests/train/test_vision.py -q``.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from mars.train.data import PackedPixels, pack_pixels, unpack_pixels
from mars.train.checkpoint import Checkpointer
from mars.world.emblems import GLYPHS, PALETTE, PATTERNS, SHAPES

__all__ = ["HEADS", "ReadHeads", "VisionPretrainConfig", "cell_data", "cell_heads", "emblem_labels", "pixel_batch",
           "read_accuracy", "pretrain_vision", "zoom_read_data"]
log = logging.getLogger(__name__)

# classes per attribute; the last class of glyph and pattern is "none drawn"
HEADS: dict[str, int] = {"colour": len(PALETTE), "shape": len(SHAPES), "glyph": len(GLYPHS) + 1,
                         "pattern": len(PATTERNS) + 1}
NONE_LAST = frozenset({"glyph", "pattern"})  # heads whose last class means "none drawn" (not scored)
# (pixel values, image_grid_thw [1, 3], a label per head)
Labelled = tuple[PackedPixels | torch.Tensor, torch.Tensor, tuple[int, ...]]


def cell_heads(grid_rows: int, grid_cols: int) -> dict[str, int]:
    """The localisation read-out: one head, the framed cell (``row * grid_cols + col``)."""
    return {"cell": grid_rows * grid_cols}


def emblem_labels(spec: dict) -> tuple[int, int, int, int]:
    """(fill colour, shape, glyph, pattern) class indices of an emblem spec (the order of :data:`HEADS`); a missing
    glyph or pattern is the last class."""
    g, p = spec.get("glyph"), spec.get("pattern")
    return (PALETTE.index(spec["fill"]), SHAPES.index(spec["shape"]), GLYPHS.index(g) if g else len(GLYPHS),
            PATTERNS.index(p) if p else len(PATTERNS))


class ReadHeads(torch.nn.Module):
    """One attention read-out over an image's merged tokens and a linear head per attribute (``heads``: name ->
    classes; :data:`HEADS`, reading, by default, or :func:`cell_heads`, localisation)."""

    def __init__(self, dim: int, seed: int = 0, heads: dict[str, int] | None = None):
        super().__init__()
        self.names = dict(heads or HEADS)
        with torch.random.fork_rng(devices=[]):  # the same heads for the same seed, whatever ran before
            torch.manual_seed(seed)
            self.query = torch.nn.Parameter(torch.randn(dim) * 0.02)
            self.keys = torch.nn.Linear(dim, dim)
            self.heads = torch.nn.ModuleList(torch.nn.Linear(dim, k) for k in self.names.values())

    def forward(self, tokens: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """``tokens`` [sum of merged tokens, D] of ``grid_thw`` [B, 3] images -> one [B, classes] per attribute."""
        pooled = []
        for f in torch.split(tokens, (grid_thw.prod(-1) // 4).tolist()):  # per image: [n_i, D]
            a = torch.softmax(self.keys(f) @ self.query, 0)  # [n_i]
            pooled.append(a @ f)  # [D]
        z = torch.stack(pooled)  # [B, D]
        return [h(z) for h in self.heads]


def zoom_read_data(scene, proc, n: int, seed: int, max_side: int | None = None) -> list[Labelled]:
    """``n`` labelled zoom crops (:func:`mars.train.captions.zoom_crop` on ``scene``, a
    :class:`~mars.world.scenes.SceneConfig`) in ``proc``'s view; pixel values are kept packed
    (:func:`mars.train.data.pack_pixels`: 4,000 crops in the 224-px view hold about 0.6 GB, 4.8 GB in float32)."""
    from mars.train.captions import ZOOM_LONG_SIDE, zoom_crop

    if n < 0:
        raise ValueError(f"the number of vision pre-training images must be >= 0, got {n}")
    rng = np.random.default_rng([seed, 71])
    out: list[Labelled] = []
    for _ in tqdm(range(n), desc="drawing zoom crops", unit="img", leave=False):
        img, spec = zoom_crop(scene, rng, max_side or ZOOM_LONG_SIDE)
        ip = proc.image_processor(images=[img], return_tensors="pt")
        out.append((_packed(ip["pixel_values"], proc), ip["image_grid_thw"], emblem_labels(spec)))
    return out


def cell_data(dialogues: list[list[dict]], proc, grid_rows: int, grid_cols: int) -> list[Labelled]:
    """The localisation drills among ``dialogues`` (:func:`mars.train.locate.locate_dialogues`: a scene, then a zoom
    call) as labelled images in ``proc``'s view: the label is the cell the teacher's zoom chose (:func:`cell_heads`);
    dialogues whose reply is not a zoom on image 0 (zoom captions) are skipped. Pixels packed, as
    :func:`zoom_read_data`."""
    from mars.agent.protocol import parse_turn
    from mars.train.locate import zoom_cell

    out: list[Labelled] = []
    for d in tqdm(dialogues, desc="labelling localisation drills", unit="img", leave=False):
        user = next((m for m in d if m["role"] == "user"), None)
        content = user["content"] if user is not None and isinstance(user["content"], list) else []
        images = [c["image"] for c in content if isinstance(c, dict) and c.get("type") == "image"]
        reply = next((m for m in d if m["role"] == "assistant"), None)  # a drill may go on after its zoom
        if not images or reply is None:
            continue  # a text-only drill
        cell = zoom_cell(parse_turn(reply["content"]), grid_rows, grid_cols)
        if cell is None:
            continue  # not a zoom on image 0 (a zoom caption)
        ip = proc.image_processor(images=images[:1], return_tensors="pt")
        out.append((_packed(ip["pixel_values"], proc), ip["image_grid_thw"], (cell[0] * grid_cols + cell[1],)))
    return out


def _packed(pixel_values: torch.Tensor, proc):
    return pack_pixels(pixel_values, 3, proc.image_processor.temporal_patch_size)


def pixel_batch(items: list[Labelled]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pixel_values [sum of patches, C] in float32, image_grid_thw [B, 3], labels [B, heads]) of labelled
    images."""
    return (torch.cat([unpack_pixels(b[0]) for b in items]).float(), torch.cat([b[1] for b in items]),
            torch.tensor([b[2] for b in items], dtype=torch.long))


def _logits(visual: torch.nn.Module, heads: ReadHeads, items: list[Labelled]
            ) -> tuple[list[torch.Tensor], torch.Tensor]:
    pv, grid, y = pixel_batch(items)
    tokens = visual(pv, grid_thw=grid, return_dict=True).pooler_output  # [sum of merged tokens, D]
    return heads(tokens, grid), y


def read_accuracy(visual: torch.nn.Module, heads: ReadHeads, data: list[Labelled], chunk: int = 50
                  ) -> dict[str, float]:
    """Accuracy per head on ``data`` (the letter over images with a letter, the pattern over those with a
    pattern; chance 1/8, 1/24, 1/7; the cell: one over the grid's cells)."""
    was = visual.training, heads.training
    visual.eval()
    heads.eval()
    hits, seen = [0] * len(heads.names), [0] * len(heads.names)
    with torch.no_grad():
        for i in range(0, len(data), chunk):
            logits, y = _logits(visual, heads, data[i:i + chunk])
            for k, (name, n) in enumerate(heads.names.items()):
                keep = y[:, k] < n - 1 if name in NONE_LAST else torch.ones(len(y), dtype=torch.bool)
                hits[k] += int(((logits[k].argmax(1) == y[:, k]) & keep).sum())
                seen[k] += int(keep.sum())
    visual.train(was[0])
    heads.train(was[1])
    return {name: hits[k] / max(1, seen[k]) for k, name in enumerate(heads.names)}


@dataclass
class VisionPretrainConfig:
    steps: int = 2000
    batch_size: int = 16
    lr: float = 5e-4  # measured: 2e-3 (sft.vision_lr) stays at chance (probes/probe_read.py, docs/findings.md)
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"vision pre-training needs steps >= 1, batch_size >= 1 and lr > 0; "
                             f"got {self.steps}, {self.batch_size}, {self.lr}")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {self.checkpoint_every}")


def pretrain_vision(visual: torch.nn.Module, data: list[Labelled], cfg: VisionPretrainConfig, *, dim: int,
                    ckpt_dir: str | Path, fp: str, test: list[Labelled] | None = None,
                    heads: dict[str, int] | None = None) -> dict:
    """Train ``visual`` (a Qwen-VL vision tower + projector whose output width is ``dim``) in place on labelled
    images ``data`` (module docstring) with read-out ``heads`` (:data:`HEADS` by default; :func:`cell_heads` for
    localisation); resumes from the newest checkpoint in ``ckpt_dir`` with fingerprint ``fp``.
    Returns the summary: steps, resumed_from, loss_first, loss_final (mean of the first / last 50 steps' summed
    cross-entropy), accuracy per head on up to 500 training images and on ``test`` when given, seconds."""
    if len(data) < cfg.batch_size:
        raise ValueError(f"vision pre-training needs at least batch_size ({cfg.batch_size}) images, got {len(data)}; "
                         "raise sft.vision_pretrain_images (reading) or sft.pretrain_locate (localisation)")
    heads = ReadHeads(dim, seed=cfg.seed, heads=heads)
    params = list(visual.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)  # constant rate, no clipping: as measured
    history: list[float] = []
    # no RNG state: a step's batch is a function of the step
    ckpt = Checkpointer(ckpt_dir, fp, {"visual": visual, "heads": heads, "opt": opt}, every=cfg.checkpoint_every,
                        last=cfg.steps, keep=cfg.keep_checkpoints, rng=False, label="vision pre-training")
    start, state = ckpt.resume()
    history = list(state.get("history", history))
    visual.train()
    heads.train()
    t0 = time.perf_counter()
    bar = tqdm(range(start, cfg.steps), desc=f"vision pre-training ({', '.join(heads.names)})", unit="step",
               initial=start, total=cfg.steps, leave=False)
    for step in bar:
        batch = random.Random(cfg.seed * 1_000_003 + step).sample(data, cfg.batch_size)  # a function of the step
        logits, y = _logits(visual, heads, batch)
        loss = sum(torch.nn.functional.cross_entropy(lg, y[:, k]) for k, lg in enumerate(logits))
        if not torch.isfinite(loss):
            raise RuntimeError(f"vision pre-training loss became {float(loss)} at step {step}; lower "
                               "sft.vision_pretrain_lr")
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(float(loss.detach()))
        bar.set_postfix(loss=f"{history[-1]:.3f}")
        done = step + 1
        ckpt.step_done(done, history=history, config=asdict(cfg))
    bar.close()
    k = max(1, min(50, len(history) // 5))
    acc = read_accuracy(visual, heads, data[:500])
    held = {"test_accuracy": {a: round(v, 4) for a, v in read_accuracy(visual, heads, test).items()}} if test else {}
    return {"steps": cfg.steps, "resumed_from": start, "loss_first": round(sum(history[:k]) / k, 5),
            "loss_final": round(sum(history[-k:]) / k, 5), "train_accuracy": {a: round(v, 4) for a, v in acc.items()},
            **held, "seconds": round(time.perf_counter() - t0, 1)}
