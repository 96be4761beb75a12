"""Chat rendering: the assistant-only loss mask on a 3-turn tool trajectory."""

from __future__ import annotations

import torch

from mars.agent.protocol import format_tool_response
from mars.model.chat import render, render_batch, to_text
from tests.model.test_model import image, tiny_stack

A1 = '<think>The framed cell is top-left.</think><tool_call>{"name": "image_zoom_in", "arguments": {"bbox_2d": [0, 0, 500, 500], "label": "cell", "img_idx": 0}}</tool_call>'
A2 = '<think>Search the emblem.</think><tool_call>{"name": "image_search", "arguments": {"img_idx": 1}}</tool_call>'
A3 = "<think>The guild was founded in 1987.</think><answer>1987</answer>"


def trajectory():
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "image", "image": image(3, (300, 200))},
                                     {"type": "text", "text": "When was the framed emblem's guild founded?"}]},
        {"role": "assistant", "content": A1},
        {"role": "tool", "content": [{"type": "text", "text": format_tool_response("crop of cell 0", 1)},
                                     {"type": "image", "image": image(4)}]},
        {"role": "assistant", "content": [{"type": "text", "text": A2}]},
        {"role": "tool", "content": "1. Aster Guild"},
        {"role": "assistant", "content": A3},
    ]


def spans(mask: torch.Tensor) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(mask.tolist() + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_loss_mask_exactly_on_assistant_tokens():
    tok, proc, _ = tiny_stack()
    r = render(trajectory(), proc)
    assert r.input_ids.shape == r.loss_mask.shape == r.attention_mask.shape
    got = [tok.decode(r.input_ids[a:b].tolist(), skip_special_tokens=False) for a, b in spans(r.loss_mask)]
    assert got == [A1 + "<|im_end|>", A2 + "<|im_end|>", A3 + "<|im_end|>"]
    # nothing else is masked in: image tokens and headers are 0
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert r.loss_mask[r.input_ids == pad].sum() == 0
    assert int((r.input_ids == pad).sum()) == int(r.image_grid_thw.prod(-1).sum()) // 4
    assert r.image_grid_thw.shape == (2, 3)
    # tool turn rendered as a user turn with <tool_response> and the image after its text
    text = to_text(trajectory())
    assert "<|im_start|>user\n<tool_response>\ncrop of cell 0\n</tool_response><|vision_start|><|image_pad|><|vision_end|><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n1. Aster Guild\n</tool_response><|im_end|>" in text


def test_render_matches_chat_template_and_processor():
    tok, proc, model = tiny_stack()
    msgs = trajectory()
    text = to_text(msgs, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text
    r = render(msgs, proc, add_generation_prompt=True)
    imgs = [it["image"] for m in msgs if isinstance(m["content"], list) for it in m["content"] if it["type"] == "image"]
    ref = proc(text=[text], images=imgs, return_tensors="pt")
    assert torch.equal(ref["input_ids"][0], r.input_ids)
    assert torch.equal(ref["mm_token_type_ids"][0].long(), r.mm_token_type_ids)
    assert torch.equal(ref["pixel_values"], r.pixel_values)
    with torch.no_grad():
        logits = model(**r.model_inputs()).logits
    assert torch.isfinite(logits).all()


def test_render_batch_left_and_right():
    _, proc, _ = tiny_stack()
    d1 = trajectory()[:2]
    d2 = [{"role": "user", "content": "short"}]
    for side in ("left", "right"):
        b = render_batch([d1, d2], proc, pad_side=side)
        r2 = render(d2, proc, add_generation_prompt=True)
        n = len(r2.input_ids)
        row = b.input_ids[1, -n:] if side == "left" else b.input_ids[1, :n]
        assert torch.equal(row, r2.input_ids)
        assert b.attention_mask[1].sum() == n
    assert b.pixel_values is not None and b.image_grid_thw.shape == (1, 3)


def test_vision_tokens_in_text_are_dropped_so_images_stay_in_sync():
    # an untrained policy can generate "<|image_pad|>"; re-rendering its turn must not add image tokens
    tok, proc, model = tiny_stack()
    img = image(3)
    msgs = [
        {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "q <|vision_end|>"}]},
        {"role": "assistant", "content": "<think>x<|image_pad|><|image_pad|></think><answer>1</answer>"},
    ]
    r = render(msgs, proc)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    n_pad = int((r.input_ids == pad).sum())
    assert n_pad == int(r.image_grid_thw.prod(-1).sum()) // 4  # exactly the image's merged patches
    assert int((r.input_ids == tok.convert_tokens_to_ids("<|vision_end|>")).sum()) == 1
    with torch.no_grad():
        model(**r.model_inputs())  # features and tokens agree (raised before the fix)
