"""Model layer: tokenizer, torchvision-free Qwen2.5-VL processor, tiny/real model build + checkpoints, chat rendering.

See the module docstrings; run the tests with ``.venv/bin/python -m pytest tests/model -q``.
"""

from mars.model.build import build_model, count_params, load_checkpoint, save_checkpoint, tiny_config
from mars.model.chat import Rendered, RenderedBatch, render, render_batch, to_text
from mars.model.processor import MarsQwen2_5_VLProcessor, build_processor, load_processor
from mars.model.tokenizer import PROTOCOL_TOKENS, SPECIAL_TOKENS, load_qwen_vocab, train_tokenizer

__all__ = [
    "MarsQwen2_5_VLProcessor", "PROTOCOL_TOKENS", "Rendered", "RenderedBatch", "SPECIAL_TOKENS", "build_model",
    "build_processor", "count_params", "load_checkpoint", "load_processor", "load_qwen_vocab", "render",
    "render_batch", "save_checkpoint", "tiny_config", "to_text", "train_tokenizer",
]
