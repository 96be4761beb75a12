"""Render dialogues into model inputs with an assistant-only loss mask (SFT, RL and evaluation share this).

What it does
    A message is ``{"role": "system"|"user"|"assistant"|"tool", "content": str | list[item]}`` with items
    ``{"type": "text", "text": str}`` or ``{"type": "image", "image": PIL.Image}``. :func:`render` produces ChatML as
    Qwen2.5-VL does (``<|im_start|>role\\n ... <|im_end|>\\n``; each image as
    ``<|vision_start|><|image_pad|>*n<|vision_end|>``, ``n = t*h*w/merge**2`` after the processor smart-resizes the
    image into its ``[min_pixels, max_pixels]``) and returns :class:`Rendered`. ``loss_mask`` is 1 exactly on what the
    assistant generated: its content tokens and the closing ``<|im_end|>``; 0 on the ``<|im_start|>assistant\\n``
    header, the newline after ``<|im_end|>``, and all system, user, tool and image tokens.
    A ``tool`` message (a tool's result) is rendered as a *user* turn whose text is
    ``<tool_response>\\n...\\n</tool_response>`` (left as is when the text already starts with ``<tool_response>``,
    as :func:`mars.agent.protocol.format_tool_response` writes it) followed by the message's images, as the reference
    release does. An assistant message with ``"token_ids"`` (a rollout's turn, :mod:`mars.agent.engine`) is rendered
    from those ids, not from its text: the loss mask is 1 on exactly the sampled ids, and a turn that did not end
    with ``<|im_end|>`` (cut by a stop string or the token budget) gets one as context with mask 0, so the policy
    conditions on, and RL trains, exactly what it sampled. Otherwise the text is identical to
    ``tokenizer.apply_chat_template(messages)`` of :mod:`mars.model.tokenizer`'s template, and the ids to
    ``processor(text=..., images=...)`` on it (tested).
    :func:`render_batch` left-pads (for generation) or right-pads several dialogues into one batch.

Deviations
    Segments are tokenised separately (every boundary is next to a special token, so the ids equal whole-text
    tokenisation). No default system prompt is inserted. Vision placeholder tokens inside TEXT (a model that
    generated ``<|image_pad|>``, a user pasting one) are removed: only image items produce them.

Run the tests: ``.venv/bin/python -m pytest tests/model -q``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = ["Rendered", "RenderedBatch", "render", "render_batch", "to_text", "vision_token_ids"]

_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Rendered:
    """One rendered dialogue (1-D tensors of length T; vision tensors None when it has no image)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for the model's forward with a batch of one."""
        d = {
            "input_ids": self.input_ids[None],
            "attention_mask": self.attention_mask[None],
            "mm_token_type_ids": self.mm_token_type_ids[None],
        }
        if self.pixel_values is not None:
            d["pixel_values"] = self.pixel_values
            d["image_grid_thw"] = self.image_grid_thw
        return d


@dataclass
class RenderedBatch:
    """A padded batch ``[B, T]``; ``pixel_values`` concatenates the images of all dialogues in order."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    mm_token_type_ids: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "loss_mask"}
        return {k: v for k, v in d.items() if v is not None}


_VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def vision_token_ids(tokenizer) -> list[int]:
    """Ids of the vision placeholder tokens: only image items may put them in a dialogue, so a policy never
    samples them (the rollout backends suppress them and the RL trainer scores the same distribution)."""
    ids = tokenizer.convert_tokens_to_ids(list(_VISION_TOKENS))
    return sorted({int(i) for i in ids if i is not None and i != tokenizer.unk_token_id})


def _no_vision_tokens(text: str) -> str:
    """Text without vision placeholder tokens: only real images may put them in a dialogue (a model that
    generates ``<|image_pad|>`` would otherwise desynchronise image tokens and image features)."""
    for t in _VISION_TOKENS:
        if t in text:
            text = text.replace(t, "")
    return text


def _items(message: dict) -> list[dict]:
    role = message.get("role")
    if role not in _ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {_ROLES}")
    content = message.get("content")
    if isinstance(content, str):
        items = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        items = content
    else:
        raise TypeError(f"message content must be a str or a list of items, got {type(content).__name__}")
    for it in items:
        if it.get("type") not in ("text", "image"):
            raise ValueError(f"unknown content item type {it.get('type')!r}")
    items = [{"type": "text", "text": _no_vision_tokens(it["text"])} if it["type"] == "text" else it for it in items]
    if role == "tool":
        text = "".join(it["text"] for it in items if it["type"] == "text")
        if not text.startswith("<tool_response>"):
            text = f"<tool_response>\n{text}\n</tool_response>"
        items = [{"type": "text", "text": text}] + [it for it in items if it["type"] == "image"]
    return items


def to_text(messages: list[dict], *, add_generation_prompt: bool = False) -> str:
    """The ChatML text of ``messages`` with one ``<|image_pad|>`` per image (what the chat template renders)."""
    parts = []
    for m in messages:
        role = "user" if m["role"] == "tool" else m["role"]
        parts.append(f"<|im_start|>{role}\n")
        for it in _items(m):
            parts.append(it["text"] if it["type"] == "text" else "<|vision_start|><|image_pad|><|vision_end|>")
        parts.append("<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render(messages: list[dict], processor, *, add_generation_prompt: bool = False) -> Rendered:
    """Token ids, assistant-only loss mask and vision inputs of one dialogue (see the module docstring)."""
    tok = processor.tokenizer
    ids_of = tok.convert_tokens_to_ids
    im_start, im_end = ids_of("<|im_start|>"), ids_of("<|im_end|>")
    v_start, v_end, pad = ids_of("<|vision_start|>"), ids_of("<|vision_end|>"), ids_of("<|image_pad|>")
    nl = tok.encode("\n", add_special_tokens=False)

    def enc(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False) if s else []

    images = [it["image"] for m in messages for it in _items(m) if it["type"] == "image"]
    pixel_values = grid = None
    n_tokens: list[int] = []
    if images:
        vis = processor.image_processor(images=[im.convert("RGB") for im in images], return_tensors="pt")
        pixel_values, grid = vis["pixel_values"], vis["image_grid_thw"]
        merge = processor.image_processor.merge_size
        n_tokens = [int(g.prod()) // (merge * merge) for g in grid]

    ids: list[int] = []
    mask: list[int] = []
    mm: list[int] = []

    def add(tokens: list[int], m: int, kind: int = 0) -> None:
        ids.extend(tokens)
        mask.extend([m] * len(tokens))
        mm.extend([kind] * len(tokens))

    k = 0
    for msg in messages:
        role = "user" if msg["role"] == "tool" else msg["role"]
        gen = 1 if msg["role"] == "assistant" else 0
        add([im_start] + enc(f"{role}\n"), 0)
        sampled = msg.get("token_ids") if gen else None
        if sampled is not None:  # a rollout's turn: exactly the ids the policy sampled, and only those trained
            add([int(t) for t in sampled], 1)
            if not sampled or int(sampled[-1]) != im_end:
                add([im_end], 0)  # closes a turn cut by a stop string or the budget: context, never trained
            add(nl, 0)
            continue
        for it in _items(msg):
            if it["type"] == "text":
                add(enc(it["text"]), gen)
            else:
                add([v_start], 0)
                add([pad] * n_tokens[k], 0, 1)
                add([v_end], 0)
                k += 1
        add([im_end], gen)
        add(nl, 0)
    if add_generation_prompt:
        add([im_start] + enc("assistant\n"), 0)
    t = torch.tensor(ids, dtype=torch.long)
    return Rendered(
        input_ids=t,
        loss_mask=torch.tensor(mask, dtype=torch.long),
        attention_mask=torch.ones_like(t),
        mm_token_type_ids=torch.tensor(mm, dtype=torch.long),
        pixel_values=pixel_values,
        image_grid_thw=grid,
    )


def render_batch(
    dialogues: list[list[dict]], processor, *, pad_side: str = "left", add_generation_prompt: bool = True
) -> RenderedBatch:
    """Render and pad several dialogues (``pad_side="left"`` for generation, ``"right"`` for training)."""
    if pad_side not in ("left", "right"):
        raise ValueError(f"pad_side must be 'left' or 'right', got {pad_side!r}")
    rs = [render(d, processor, add_generation_prompt=add_generation_prompt) for d in dialogues]
    pad_id = processor.tokenizer.pad_token_id
    T = max(len(r.input_ids) for r in rs)

    def pad(x: torch.Tensor, value: int) -> torch.Tensor:
        fill = torch.full((T - len(x),), value, dtype=x.dtype)
        return torch.cat([fill, x]) if pad_side == "left" else torch.cat([x, fill])

    pv = [r.pixel_values for r in rs if r.pixel_values is not None]
    gr = [r.image_grid_thw for r in rs if r.image_grid_thw is not None]
    return RenderedBatch(
        input_ids=torch.stack([pad(r.input_ids, pad_id) for r in rs]),
        loss_mask=torch.stack([pad(r.loss_mask, 0) for r in rs]),
        attention_mask=torch.stack([pad(r.attention_mask, 0) for r in rs]),
        mm_token_type_ids=torch.stack([pad(r.mm_token_type_ids, 0) for r in rs]),
        pixel_values=torch.cat(pv) if pv else None,
        image_grid_thw=torch.cat(gr) if gr else None,
    )


