"""Learnability probe: can the tiny vision tower read a zoomed emblem, and which tower or view size does it need?

What it measures
    A perception question is answered after a zoom on the framed cell's target zone: the crop shows the emblem at
    the scene's scale (``world.emblem_frac``), smart-resized into the policy's view (``agent.zoom_max_pixels``, a
    224-px side by default), where it covers a few merged vision tokens. This probe isolates that reading skill from
    the language model: a vision tower and projector built by ``tiny_config`` (random init, ``sft.arch``) feed one
    learned attention read-out over the merged image tokens (standing in for the language model's attention to the
    image) and four linear heads, one per attribute (fill colour; shape; letter or none; pattern or none), trained
    jointly by :func:`mars.train.vision.pretrain_vision` (the sft stage's phase 0, AdamW, summed cross-entropy) on
    zoom crops (:func:`mars.train.captions.zoom_crop`: a new random emblem on a zone crop of the default world's
    scenes, the images ``sft.pretrain_zoom_captions`` and phase 0 train on). Reported: held-out accuracy per
    attribute on crops drawn with another seed (the letter over crops with a letter, the pattern over crops with a
    pattern; chance 1/16, 1/8, 1/24, 1/7) for each tower (``HIDDENxLAYERS``), view side and learning rate, against the
    first configuration measured in the same run.

Finding (docs/findings.md; emblems 0.05 of the scene's short side)
    At ``sft.vision_lr`` (2e-3) neither the default tower (96x2) nor a 5x larger one (192x4) leaves chance in 800 steps,
    nor does the default tower in 500 steps with the emblem filling the zoom (``--target-zone 0.12``). At 5e-4 the tower
    learns shape and pattern after a phase change of hundreds of steps (2,000 steps, ``--target-zone 0.15``, which
    ``WorldSpec`` now rejects as too small for the world's targets: shape 38%, pattern 35%); the 24 letters stay at
    chance. Hence phase 0's rate. The fill colour is the one attribute read at 2e-3: 22.5% of held-out crops after 300
    steps at the default zone (12% at 5e-4), 51% at ``--target-zone 0.18`` with a colour head alone.

Not a speed benchmark: the numbers are accuracies after a fixed number of steps (deterministic for a seed); the
seconds column says what each tower costs.

With the emblem 2.4x larger in the world (``--emblem-frac 0.12``, now the world's default; about 100 px in the zoom's
view), 1,200 steps at 5e-4 on 2,000 crops read the colour of 75% of held-out crops, the pattern 29%, the shape 16%, the
letter 1% (at 0.05: 58%, 13%, 0%, 11%; docs/findings.md); a data-dependent patch embedding (``--patch-init pca``: the
tower's first layer set to the whitened principal components of the training crops' patches) reads no better held out
(colour 42%, shape 16%, letter 2%, pattern 6% at 0.05).

Run: ``python probes/probe_read.py [--towers 96x2 192x4] [--views 224 448] [--lrs 0.002 0.0005] [--steps 2000]
[--train 4000] [--test 400] [--target-zone 0.4] [--emblem-frac 0.05] [--patch-init random] [--arch qwen2_5_vl]``
(a 448-px view holds 4x the pixels: keep ``--train`` near 1,000 there, or the crops fill the memory)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mars.model.build import ARCHES, build_model, tiny_config  # noqa: E402
from mars.model.processor import build_processor  # noqa: E402
from mars.model.tokenizer import train_tokenizer  # noqa: E402
from mars.train.vision import VisionPretrainConfig, pretrain_vision, zoom_read_data  # noqa: E402
from mars.world.generate import WorldSpec  # noqa: E402

BATCH = 16


def pca_patch_init(visual: torch.nn.Module, data, max_patches: int = 20000, seed: int = 0) -> None:
    """Set the tower's patch embedding (``visual.patch_embed.proj``, a Conv3d whose weight [H, C, T, P, P] acts on
    each flattened patch) to the top-H principal components of ``data``'s patches, each scaled to unit output
    variance (whitened): a data-dependent first layer, the kind of init a tower without pre-training can get locally.
    """
    weight = visual.patch_embed.proj.weight  # [H, C*T*P*P] once flattened, the processor's patch layout
    x = torch.cat([b[0] for b in data])  # [patches, C*T*P*P], float16 as stored (4,000 crops: about 2 GB in float32)
    g = torch.Generator().manual_seed(seed)
    x = x[torch.randperm(len(x), generator=g)[:max_patches]].float()
    x = x - x.mean(0, keepdim=True)
    _, s, vt = torch.linalg.svd(x, full_matrices=False)  # s: [min(N, C*T*P*P)], vt: [.., C*T*P*P]
    h = weight.shape[0]
    if vt.shape[0] < h:
        raise ValueError(f"PCA init needs at least {h} patches, got {vt.shape[0]}: raise --train")
    std = s[:h] / max(1, len(x) - 1) ** 0.5  # [H] the components' standard deviations
    with torch.no_grad():
        weight.copy_((vt[:h] / std[:, None].clamp_min(1e-6)).view_as(weight))


def probe(arch: str, hidden: int, layers: int, view: int, lr: float, train, test, steps: int, seed: int = 0,
          patch_init: str = "random") -> tuple[dict[str, float], float, int]:
    """(held-out accuracy per attribute after ``steps`` steps of :func:`mars.train.vision.pretrain_vision`, seconds,
    tower parameters); ``patch_init`` "pca" sets the patch embedding by :func:`pca_patch_init` first."""
    tok = train_tokenizer(["the emblem"] * 4, vocab_size=300)
    ids = tok.convert_tokens_to_ids
    cfg = tiny_config(len(tok), arch=arch, window_size=view, vision_hidden=hidden, vision_layers=layers,
                      image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                      vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
                      eos_token_id=ids("<|im_end|>"), pad_token_id=tok.pad_token_id)
    visual = build_model(cfg, seed=seed).model.visual
    if patch_init == "pca":
        pca_patch_init(visual, train, seed=seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as ckpt:
        res = pretrain_vision(visual, train, VisionPretrainConfig(steps=steps, batch_size=BATCH, lr=lr, seed=seed,
                                                                  checkpoint_every=steps),
                              dim=cfg.vision_config.out_hidden_size, ckpt_dir=ckpt, fp="probe", test=test)
    return res["test_accuracy"], time.perf_counter() - t0, sum(p.numel() for p in visual.parameters())


def tower(spec: str) -> tuple[int, int]:
    """"96x2" -> (96, 2)."""
    try:
        hidden, layers = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a tower is HIDDENxLAYERS, e.g. 96x2; got {spec!r}") from None
    if hidden % 16 or layers < 1:
        raise argparse.ArgumentTypeError(f"HIDDEN must be a multiple of 16 (4 heads, 2-D rotary) and LAYERS >= 1; "
                                         f"got {spec!r}")
    return hidden, layers


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--towers", type=tower, nargs="+", default=[(96, 2)], help="vision towers as HIDDENxLAYERS")
    ap.add_argument("--views", type=int, nargs="+", default=[224],
                    help="view sides in px (max pixels = side^2; the default view is agent.zoom_max_pixels)")
    ap.add_argument("--lrs", type=float, nargs="+", default=[2e-3, 5e-4],
                    help="AdamW rates (sft.vision_lr's and sft.vision_pretrain_lr's defaults)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--train", type=int, default=4000, help="training crops (a new emblem each)")
    ap.add_argument("--test", type=int, default=400, help="held-out crops (another seed)")
    ap.add_argument("--target-zone", type=float, default=None, help="world.target_zone (default: the world's)")
    ap.add_argument("--emblem-frac", type=float, default=None, help="world.emblem_frac (default: the world's)")
    ap.add_argument("--patch-init", choices=("random", "pca"), default="random",
                    help="the tower's patch embedding: random (build_model's) or the crops' whitened principal "
                         "components")
    ap.add_argument("--arch", choices=ARCHES, default="qwen2_5_vl")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    if ns.steps < 1 or ns.train < BATCH or ns.test < 1:
        ap.error(f"need --steps >= 1, --train >= {BATCH} (the batch) and --test >= 1")
    if any(v < 56 or v % 28 for v in ns.views):
        ap.error(f"view sides must be multiples of 28 and >= 56, got {ns.views}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    overrides = {k: v for k, v in (("target_zone", ns.target_zone), ("emblem_frac", ns.emblem_frac)) if v is not None}
    try:
        spec = WorldSpec(**overrides)
    except ValueError as e:
        ap.error(str(e))
    scene = spec.scene_config()
    max_side = 2 * max(ns.views)  # as the zoom captions: about twice the view, so the processor does the last resize
    print(f"{ns.train} training and {ns.test} held-out zoom crops (another seed) per view; arch {ns.arch}, target "
          f"zone {scene.target_zone}, emblem_frac {scene.emblem_frac}, patch init {ns.patch_init}, {ns.steps} steps "
          f"at batch {BATCH}; chance: colour 6.2%, shape 12.5%, letter 4.2%, pattern 14.3%")
    tok = train_tokenizer(["the emblem"] * 4, vocab_size=300)
    rows = []
    for view in ns.views:
        proc = build_processor(tok, 56 * 56, view * view, arch=ns.arch)
        t0 = time.perf_counter()
        train = zoom_read_data(scene, proc, ns.train, ns.seed, max_side)
        test = zoom_read_data(scene, proc, ns.test, ns.seed + 99, max_side)
        print(f"  {view} px: crops drawn in {time.perf_counter() - t0:.0f} s", flush=True)
        tokens = float(np.mean([int(b[1].prod()) // 4 for b in test]))
        for hidden, layers in ns.towers:
            for lr in ns.lrs:
                acc, secs, n_params = probe(ns.arch, hidden, layers, view, lr, train, test, ns.steps, ns.seed,
                                            ns.patch_init)
                rows.append((f"{hidden}x{layers}", view, lr, tokens, n_params, acc, secs))
                print(f"  {hidden}x{layers} at {view} px, lr {lr:g}: "
                      + ", ".join(f"{k} {v:.1%}" for k, v in acc.items()) + f" ({secs:.0f} s)", flush=True)
    base = rows[0][5]
    print("\n| tower | view px | lr | image tokens | tower params | colour | shape | letter | pattern | mean vs first "
          "| train s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for name, view, lr, tokens, n_params, acc, secs in rows:
        mean, mean0 = sum(acc.values()) / len(acc), sum(base.values()) / len(base)
        ratio = f"{mean / mean0:.2f}x" if mean0 else "-"
        print(f"| {name} | {view} | {lr:g} | {tokens:.0f} | {n_params / 1e6:.2f}M | {acc['colour']:.1%} "
              f"| {acc['shape']:.1%} | {acc['glyph']:.1%} | {acc['pattern']:.1%} | {ratio} | {secs:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
