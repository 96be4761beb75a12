"""The Qwen2.5-VL / Qwen3-VL processor without torchvision: THE one place for that shim.

What it does
    :func:`build_processor` returns a :class:`MarsQwen2_5_VLProcessor`, a subclass of transformers'
    ``Qwen2_5_VLProcessor`` with the same ``__call__(text=..., images=...)`` contract (``input_ids``,
    ``attention_mask``, ``mm_token_type_ids``, ``pixel_values``, ``image_grid_thw``; each
    ``<|image_pad|>`` expanded to ``t*h*w/merge**2`` copies). Its image processor is transformers' PIL/numpy Qwen2-VL
    image processor (``Qwen2VLImageProcessorPil``), which resizes with Qwen's smart_resize inside
    ``[min_pixels, max_pixels]`` (factor 28), so nothing needs torchvision. :func:`load_processor` reads it back from a
    local directory written by ``save_pretrained`` (or from a real Qwen2.5-VL checkpoint directory).
    ``build_processor(..., arch="qwen3_vl")`` is the same class with Qwen3-VL's 16-px patches (factor 32): for images
    both stock processors expand ``<|image_pad|>`` identically (they differ only in video timestamps), so one class
    serves both; ``save_pretrained`` names the stock class of the architecture.

Deviations
    transformers 5 builds ``Qwen2_5_VLProcessor`` with a video processor and checks its class, which fails without
    torchvision. The subclass drops the video processor (videos are not used by this project); everything else is
    inherited. ``save_pretrained`` writes ``processor_config.json`` with ``processor_class = "Qwen2_5_VLProcessor"``
    and the image processor's settings, plus the tokenizer files and the chat template, so a checkpoint directory is
    self-contained: where torchvision *is* installed, ``AutoProcessor.from_pretrained(dir)`` loads it as the stock
    processor (with the fast image processor, which computes the same patches); without torchvision
    ``AutoProcessor`` cannot build the stock class, so use :func:`load_processor` (``mars.model.build.load_checkpoint``
    does). Passing ``use_fast=False`` does not help there: the failure is the video processor, not the images.

Run the tests: ``.venv/bin/python -m pytest tests/model -q``.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

__all__ = ["PATCH_SIZE", "MarsQwen2_5_VLProcessor", "build_processor", "load_processor"]

PATCH_SIZE = {"qwen2_5_vl": 14, "qwen3_vl": 16}  # the vision patch per architecture; merged tokens cover 2x2 patches
# the stock transformers class a torchvision-equipped install should build for each architecture
_STOCK_CLASS = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}


class MarsQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` with a PIL image processor and no video processor (no torchvision needed)."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        if chat_template is None:
            chat_template = getattr(tokenizer, "chat_template", None)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.stock_class = "Qwen2_5_VLProcessor"  # set by build_processor / load_processor; not an init kwarg

    @property
    def min_pixels(self) -> int:
        return int(self.image_processor.size["shortest_edge"])

    @property
    def max_pixels(self) -> int:
        return int(self.image_processor.size["longest_edge"])

    def to_dict(self):
        d = super().to_dict()
        d.pop("stock_class", None)
        d["processor_class"] = self.stock_class  # what a torchvision-equipped transformers should build
        return d

    def save_pretrained(self, save_directory, **kwargs):
        out = super().save_pretrained(save_directory, **kwargs)
        cfg = Path(save_directory) / "processor_config.json"
        if cfg.is_file():
            d = json.loads(cfg.read_text())
            d["processor_class"] = self.stock_class
            cfg.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
        return out


def build_processor(tokenizer, min_pixels: int, max_pixels: int, arch: str = "qwen2_5_vl") -> MarsQwen2_5_VLProcessor:
    """A Qwen2.5-VL (or Qwen3-VL) processor over ``tokenizer`` whose images are smart-resized into
    ``[min_pixels, max_pixels]``."""
    if not 0 < min_pixels <= max_pixels:
        raise ValueError(f"need 0 < min_pixels <= max_pixels, got {min_pixels}, {max_pixels}")
    if arch not in PATCH_SIZE:
        raise ValueError(f"arch must be one of {', '.join(PATCH_SIZE)}, got {arch!r}")
    ip = Qwen2VLImageProcessorPil(min_pixels=int(min_pixels), max_pixels=int(max_pixels), patch_size=PATCH_SIZE[arch])
    proc = MarsQwen2_5_VLProcessor(image_processor=ip, tokenizer=tokenizer)
    proc.stock_class = _STOCK_CLASS[arch]
    return proc


def load_processor(path: str | Path) -> MarsQwen2_5_VLProcessor:
    """The processor saved in local directory ``path`` (ours, or a real Qwen2.5-VL checkpoint's)."""
    path = Path(path)
    cfg_file = path / "processor_config.json"
    pre_file = path / "preprocessor_config.json"  # layout of released Qwen checkpoints
    stock = None  # the stock class named in the saved processor config, if any
    if cfg_file.is_file() and "image_processor" in (d := json.loads(cfg_file.read_text())):
        ip_cfg = d["image_processor"]
        stock = d.get("processor_class")
    elif pre_file.is_file():
        ip_cfg = json.loads(pre_file.read_text())
    else:
        raise FileNotFoundError(f"{path}: no processor_config.json or preprocessor_config.json (not a checkpoint dir)")
    size = ip_cfg.get("size") or {}
    min_pixels = ip_cfg.get("min_pixels") or size.get("shortest_edge") or 56 * 56
    max_pixels = ip_cfg.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
    kwargs = {k: ip_cfg[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
              if k in ip_cfg}
    ip = Qwen2VLImageProcessorPil(min_pixels=int(min_pixels), max_pixels=int(max_pixels), **kwargs)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    chat_template = None
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        chat_template = jinja.read_text()
    elif (path / "chat_template.json").is_file():
        chat_template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
    proc = MarsQwen2_5_VLProcessor(image_processor=ip, tokenizer=tok, chat_template=chat_template)
    if stock in _STOCK_CLASS.values():
        proc.stock_class = stock
    elif (path / "config.json").is_file():  # a released checkpoint: the model type names the architecture
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
        proc.stock_class = _STOCK_CLASS.get(model_type, proc.stock_class)
    return proc
