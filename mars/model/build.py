"""Build, save and load Qwen2.5-VL models: the tiny random-init one of the embedded default, or a real checkpoint.

What it does
    :func:`tiny_config` returns a ``Qwen2_5_VLConfig`` of about 1M parameters (DESIGN.md section 3: text hidden 128,
    3 layers, 4 heads / 2 KV heads; vision hidden 96, 2 layers; the merger projects to the text hidden size; mrope
    sections ``[t, h, w]`` summing to ``head_dim / 2``). :func:`build_model` initialises it deterministically from a
    seed (float32, CPU). :func:`save_checkpoint` writes model + tokenizer + processor atomically (staging directory +
    rename via :func:`mars.data.io.atomic_dir`); :func:`load_checkpoint` reads them back from a local directory only.
    The same ``load_checkpoint`` loads a real local Qwen2.5-VL checkpoint directory (``config.json``, safetensors,
    ``tokenizer.json``, ``preprocessor_config.json``): pass ``dtype=torch.bfloat16`` for a large one (not tested here).

Deviations
    Tiny random-init model on the embedded default; ``rope_theta`` defaults to 10,000 (Qwen2.5-VL uses 1e6, which
    barely separates positions in so short contexts); torchvision-free processor (see :mod:`mars.model.processor`).
    Never loads from the hub: paths only.

Run the tests: ``.venv/bin/python -m pytest tests/model -q``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from mars.data.io import atomic_dir
from mars.model.processor import MarsQwen2_5_VLProcessor, load_processor

__all__ = ["build_model", "count_params", "load_checkpoint", "save_checkpoint", "tiny_config"]


def _mrope_section(head_dim: int) -> list[int]:
    """Split ``head_dim/2`` rotary frequencies into (temporal, height, width) like Qwen's [16, 24, 24] for 128."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def tiny_config(
    vocab_size: int,
    *,
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
) -> Qwen2_5_VLConfig:
    """A small Qwen2.5-VL config; default token ids are those of :func:`mars.model.tokenizer.train_tokenizer`.

    Pass ``tokenizer.convert_tokens_to_ids(...)`` for another vocabulary. ``head_dim = text_hidden // heads`` must be
    divisible by 4 (mrope needs three sections) and ``vision_hidden // vision_heads`` by 4 (2-D rotary).
    """
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
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta), "mrope_section": _mrope_section(head_dim)},
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
        window_size=window_size,
        fullatt_block_indexes=[vision_layers - 1],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    cfg = Qwen2_5_VLConfig(
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


def build_model(config: Qwen2_5_VLConfig, seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    """A randomly initialised model, float32 on CPU, identical for the same ``config`` and ``seed``."""
    devices = [torch.device("cpu")]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    del devices
    model = model.to(torch.float32)
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
    """``(model, tokenizer, processor)`` from local directory ``path`` (never the hub)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: checkpoint directory does not exist")
    missing = [n for n in ("config.json", "tokenizer.json") if not (path / n).is_file()]
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        missing.append("*.safetensors")
    if missing:
        raise FileNotFoundError(f"{path}: not a complete checkpoint, missing {', '.join(missing)}")
    processor = load_processor(path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(path), local_files_only=True, dtype=dtype)
    model.to(device)
    model.eval()
    return model, processor.tokenizer, processor
