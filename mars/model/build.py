"""Build, save and load Qwen2.5-VL and Qwen3-VL models: the tiny random-init one of the embedded default, or a real
checkpoint.

What it does
    :func:`tiny_config` returns a ``Qwen2_5_VLConfig`` (``arch="qwen2_5_vl"``) or a ``Qwen3VLConfig``
    (``arch="qwen3_vl"``) of about 1M parameters (docs/design.md, The embedded default world: text hidden 128, 3 layers
    and 4 heads / 2 KV heads here and in the smoke profile, 4 layers and 8 / 4 in the default's ``sft.text_layers``,
    ``sft.heads``, ``sft.kv_heads``; vision hidden 96, 2 layers; the merger projects to the text hidden size; mrope
    sections ``[t, h, w]`` summing to ``head_dim / 2``). The two architectures differ where it matters for the tiny
    model: Qwen3-VL's vision tower adds a learned absolute position embedding to its patches (Qwen2.5-VL's knows
    positions only through 2-D rotary attention, so no token's value says where it is), uses 16-px patches (32-px merged
    tokens, against 28), feeds early vision layers into the first LM layers (DeepStack) and interleaves the mrope
    frequencies. Measured on the localisation drills (docs/findings.md): both learn the framed cell alike (43-46 of 80
    new scenes after 400 steps). :func:`build_model` initialises it deterministically from a seed (float32, CPU).
    :func:`save_checkpoint` writes model + tokenizer + processor atomically (staging directory + rename via
    :func:`mars.data.io.atomic_dir`); :func:`load_checkpoint` reads them back from a local directory only. Both give the
    vision tower's patch embedding :class:`PatchLinear` (:func:`fast_patch_embed`): its Conv3d has kernel = stride = the
    whole patch, so it is one matrix product over flattened patches, with the same values and the same weights
    (state-dict keys unchanged), and its backward costs a quarter of the CPU Conv3d's (bench/bench_sft.py;
    docs/benchmarks.md). The same ``load_checkpoint`` loads a real local Qwen2.5-VL or Qwen3-VL checkpoint directory
    (``config.json``, safetensors, ``tokenizer.json``, ``preprocessor_config.json``): pass ``dtype=torch.bfloat16`` for
    a large one (not tested here). :class:`CompiledTextLayers` runs the text decoder layers through ``torch.compile``
    inside a ``with`` block (the trainers' steps: ``sft.compile``), leaving the model untouched outside it.

Deviations
    Tiny random-init model on the embedded default; ``rope_theta`` defaults to 10,000 (Qwen2.5-VL uses 1e6, which
    barely separates positions in so short contexts); torchvision-free processor (see :mod:`mars.model.processor`).
    The tiny Qwen3-VL taps its first vision layer for DeepStack (the release taps layers 8, 16, 24 of 27) and keeps a
    16 x 16 absolute position table (the release: 48 x 48).
    Never loads from the hub: paths only.

Run the tests: ``.venv/bin/python -m pytest tests/model -q``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import (
    PretrainedConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from mars.data.io import atomic_dir
from mars.errors import MissingInputError
from mars.model.processor import PATCH_SIZE, MarsQwen2_5_VLProcessor, load_processor

__all__ = ["ARCHES", "PATCH_SIZE", "CompiledTextLayers", "PatchLinear", "build_model", "count_params", "cpp_compiler",
           "fast_patch_embed", "load_checkpoint", "save_checkpoint", "tiny_config"]
log = logging.getLogger(__name__)

# model_type -> the transformers class that builds and loads it
_MODEL_CLASS = {"qwen2_5_vl": Qwen2_5_VLForConditionalGeneration, "qwen3_vl": Qwen3VLForConditionalGeneration}
ARCHES = tuple(_MODEL_CLASS)


def _mrope_section(head_dim: int, arch: str = "qwen2_5_vl") -> list[int]:
    """Split ``head_dim/2`` rotary frequencies into (temporal, height, width) like Qwen2.5-VL's [16, 24, 24] for 128
    (Qwen3-VL: [24, 20, 20])."""
    half = head_dim // 2
    t = half * 3 // 8 if arch == "qwen3_vl" else half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def tiny_config(
    vocab_size: int,
    *,
    arch: str = "qwen2_5_vl",
    text_hidden: int = 128,
    text_layers: int = 3,
    heads: int = 4,
    kv_heads: int = 2,
    text_intermediate: int | None = None,
    vision_hidden: int = 96,
    vision_layers: int = 2,
    vision_heads: int = 4,
    vision_intermediate: int | None = None,
    rope_theta: float = 10000.0,
    image_token_id: int = 12,
    video_token_id: int = 13,
    vision_start_token_id: int = 9,
    vision_end_token_id: int = 10,
    eos_token_id: int | list[int] = 2,
    pad_token_id: int = 0,
    bos_token_id: int | None = None,
    max_position_embeddings: int = 8192,
    tie_word_embeddings: bool = True,
    window_size: int = 112,
    num_position_embeddings: int = 256,
) -> PretrainedConfig:
    """A small Qwen2.5-VL (or Qwen3-VL) config; default token ids are those of
    :func:`mars.model.tokenizer.train_tokenizer`.

    Pass ``tokenizer.convert_tokens_to_ids(...)`` for another vocabulary. ``head_dim = text_hidden // heads`` must be
    divisible by 4 (mrope needs three sections) and ``vision_hidden // vision_heads`` by 4 (2-D rotary).
    ``window_size`` is Qwen2.5-VL's window attention span (px); ``num_position_embeddings`` is Qwen3-VL's absolute
    position table (a square number: 256 is a 16x16 patch grid, bilinearly interpolated to each image's grid).
    """
    if arch not in _MODEL_CLASS:
        raise ValueError(f"arch must be one of {', '.join(ARCHES)}, got {arch!r}")
    if arch == "qwen3_vl" and int(num_position_embeddings ** 0.5) ** 2 != num_position_embeddings:
        raise ValueError(f"num_position_embeddings must be a square number (a side x side grid), got "
                         f"{num_position_embeddings}")
    if text_hidden % heads or (text_hidden // heads) % 4:
        raise ValueError(f"text_hidden/heads must be an integer divisible by 4, got {text_hidden}/{heads}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if vision_hidden % vision_heads or (vision_hidden // vision_heads) % 4:
        raise ValueError(f"vision_hidden/vision_heads must be divisible by 4, got {vision_hidden}/{vision_heads}")
    head_dim = text_hidden // heads
    text = dict(
        vocab_size=vocab_size,
        hidden_size=text_hidden,
        intermediate_size=text_intermediate or 2 * text_hidden,
        num_hidden_layers=text_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta),
                         "mrope_section": _mrope_section(head_dim, arch)},
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    vision = dict(
        depth=vision_layers,
        hidden_size=vision_hidden,
        intermediate_size=vision_intermediate or 2 * vision_hidden,
        num_heads=vision_heads,
        out_hidden_size=text_hidden,
        patch_size=PATCH_SIZE[arch],
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if arch == "qwen3_vl":
        text.update(head_dim=head_dim)
        text["rope_parameters"]["mrope_interleaved"] = True
        # DeepStack: the first vision layer's features join the first LM layer (the release taps 3 of 27 layers)
        vision.update(num_position_embeddings=int(num_position_embeddings),
                      deepstack_visual_indexes=[0] if vision_layers > 1 else [])
    else:
        vision.update(window_size=window_size, fullatt_block_indexes=[vision_layers - 1])
    cfg = (Qwen3VLConfig if arch == "qwen3_vl" else Qwen2_5_VLConfig)(
        text_config=text,
        vision_config=vision,
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        vision_start_token_id=vision_start_token_id,
        vision_end_token_id=vision_end_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    cfg.eos_token_id = eos_token_id
    cfg.pad_token_id = pad_token_id
    return cfg


def _model_class(model_type: str, where: str):
    if model_type not in _MODEL_CLASS:
        raise ValueError(f"{where}: model_type {model_type!r} is not supported; this project builds and loads "
                         f"{', '.join(ARCHES)} (Qwen2.5-VL, Qwen3-VL)")
    return _MODEL_CLASS[model_type]


class PatchLinear(torch.nn.Conv3d):
    """The vision patch embedding's Conv3d computed as a matrix product: every input row is one whole patch
    (kernel = stride = the input's last three dims), so ``conv(x)`` equals ``x.flatten(1) @ W.flatten(1).T + b``.
    Same parameters and state-dict keys as the Conv3d; other input shapes fall back to the convolution. A module of
    its own (not a patched forward), so DeepSpeed ZeRO-3's per-module parameter gathering still sees its weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, C, T, P, P]
        if tuple(x.shape[2:]) != tuple(self.kernel_size) or self.stride != self.kernel_size:
            return super().forward(x)
        w = self.weight  # [E, C, T, P, P]
        y = torch.nn.functional.linear(x.reshape(x.shape[0], -1), w.reshape(w.shape[0], -1), self.bias)  # [N, E]
        return y.view(x.shape[0], w.shape[0], 1, 1, 1)


def fast_patch_embed(model: torch.nn.Module) -> torch.nn.Module:
    """Turn every Conv3d patch embedding of ``model`` whose kernel equals its stride into :class:`PatchLinear`
    (in place, parameters kept); returns ``model``."""
    for mod in model.modules():
        if type(mod) is torch.nn.Conv3d and mod.kernel_size == mod.stride and mod.padding == (0, 0, 0) \
                and mod.dilation == (1, 1, 1) and mod.groups == 1:
            mod.__class__ = PatchLinear
    return model


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend (inductor) would call (``$CXX``, else ``g++``, ``c++`` or
    ``clang++`` on the PATH), or None when there is none."""
    for name in filter(None, (os.environ.get("CXX"), "g++", "c++", "clang++")):
        found = shutil.which(name)
        if found:
            return found
    return None


class CompiledTextLayers:
    """Inside ``with`` the text decoder layers of ``model`` run through ``torch.compile`` (inductor, dynamic
    shapes); outside, the model is exactly as it was (the layer objects themselves, so ``state_dict`` keys,
    checkpoints and generation see no wrapper).

    Why only the text layers: they are most of a training step's time, and the compiled layer fuses the small
    elementwise work around the attention and MLP matrix products (norms, rotary, SiLU gate, residual adds): the
    8-head default trained its phases 1.3-1.4x faster (sft 27.6 minutes instead of 35.8), a 4-head model no
    faster (docs/findings.md); bench/bench_sft.py 1.16x a step at 8 heads (docs/benchmarks.md). The vision
    tower loops over images in Python (one attention call per image) and recompiles for every image count, and
    generation passes a growing KV cache: both stay eager. The first step compiles (14-28 s on 2 cores); values
    equal the eager layers' to float rounding, so a compiled run is reproducible but not equal to an eager one bit
    for bit. ``enabled`` False, or no C++ compiler on the machine (:func:`cpp_compiler`; a warning says so), makes
    it a no-op (:func:`mars.train.sft.train_sft` passes False under DeepSpeed, whose engine is left alone)."""

    def __init__(self, model: torch.nn.Module, enabled: bool = True):
        layers = model.model.language_model.layers if enabled else None
        if enabled and cpp_compiler() is None:
            log.warning("no C++ compiler (g++, c++, clang++ or $CXX) on the PATH: torch.compile cannot build CPU "
                        "kernels, so training runs eager (slower, same maths); install g++ or set sft.compile false")
            layers = None
        self.enabled = layers is not None
        self._layers = layers
        self._eager = list(layers) if layers is not None else []
        self._compiled = [torch.compile(layer, dynamic=True) for layer in self._eager]

    def __enter__(self) -> "CompiledTextLayers":
        for i, layer in enumerate(self._compiled):
            self._layers[i] = layer
        return self

    def __exit__(self, *exc) -> None:
        for i, layer in enumerate(self._eager):
            self._layers[i] = layer


def build_model(config: PretrainedConfig, seed: int = 0):
    """A randomly initialised model, float32 on CPU, identical for the same ``config`` and ``seed``."""
    cls = _model_class(config.model_type, "build_model")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model = fast_patch_embed(model.to(torch.float32))
    gc = model.generation_config
    gc.eos_token_id = config.eos_token_id if config.eos_token_id is not None else config.text_config.eos_token_id
    gc.pad_token_id = config.pad_token_id if config.pad_token_id is not None else config.text_config.pad_token_id
    gc.bos_token_id = None
    gc.do_sample = False
    gc.temperature = None
    gc.top_p = None
    gc.top_k = None
    model.eval()
    return model


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def save_checkpoint(model, tokenizer, processor: MarsQwen2_5_VLProcessor, path: str | Path) -> Path:
    """Write model (safetensors + config), tokenizer and processor to ``path`` atomically; returns ``path``."""
    path = Path(path)
    if processor.tokenizer is not tokenizer:
        processor.tokenizer = tokenizer
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        processor.save_pretrained(tmp)  # writes the tokenizer files and the chat template too
    return path


def load_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """``(model, tokenizer, processor)`` from local directory ``path`` (never the hub); the class follows
    ``config.json``'s ``model_type`` (``qwen2_5_vl`` or ``qwen3_vl``)."""
    path = Path(path)
    if not path.is_dir():
        raise MissingInputError(f"{path}: checkpoint directory does not exist")
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("*.safetensors")
    if missing:
        raise MissingInputError(f"{path}: not a complete checkpoint, missing {', '.join(missing)}")
    model_type = json.loads((path / "config.json").read_text()).get("model_type", "")
    cls = _model_class(model_type, str(path / "config.json"))
    processor = load_processor(path)
    model = fast_patch_embed(cls.from_pretrained(str(path), local_files_only=True, dtype=dtype))
    model.to(device)
    model.eval()
    return model, processor.tokenizer, processor
