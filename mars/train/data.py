"""Trajectories as training examples: dialogue reconstruction, rendering, a resumable sampler and batching.

What it does
    :func:`dialogue_from_row` turns a TRAJECTORIES row (``messages_json`` with ``{"type": "image", "ref": i}``
    items, ``images`` as PNG bytes) back into the engine's dialogue (PIL images inline).
    :func:`render_examples` renders dialogues once, up front, with :func:`mars.model.chat.render` (token ids,
    assistant-only loss mask, pixel values), dropping those longer than ``max_len`` and saying how many. Their pixel
    values are kept packed (:func:`pack_pixels`: one byte per value, a quarter of float16, restored exactly by
    :func:`unpack_pixels` when a batch is collated), so a phase's thousands of images fit a laptop's memory.
    :class:`EpochSampler` yields example indices in a seeded permutation per epoch, optionally length-grouped
    (batches of similar length pad less); its position (``epoch``, ``offset``) is part of a training checkpoint,
    so a resumed run sees the same batches.
    :func:`collate` right-pads a list of rendered examples into one batch with ``labels`` = the next token where
    the loss mask is 1 and -100 elsewhere. :func:`length_chunks` cuts a batch into runs of similar length, each
    collated (padded) on its own: the trainer sums their losses into the same gradient with less padding.
    :func:`dialogues_digest` hashes what a phase trains on (roles, texts, image pixels), so a checkpoint is only
    resumed by a run that trains on the same data, whatever code or input produced it.

Run the tests: ``.venv/bin/python -m pytest tests/train -q``.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from mars.model.chat import Rendered, render

__all__ = ["dialogue_from_row", "dialogues_digest", "in_view", "render_examples", "PackedPixels", "pack_pixels",
           "unpack_pixels", "EpochSampler", "collate", "Batch", "label_logits", "length_chunks"]
log = logging.getLogger(__name__)


def dialogue_from_row(messages_json: str, images: list[bytes]) -> list[dict]:
    """The dialogue of a trajectory row with its images decoded (inverse of ``messages_to_json``)."""
    pics = []
    for b in images or []:
        with Image.open(io.BytesIO(b)) as im:
            pics.append(im.convert("RGB"))
    out = []
    for m in json.loads(messages_json):
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for p in content:
                if p.get("type") == "image":
                    ref = int(p.get("ref", -1))
                    if not 0 <= ref < len(pics):
                        raise ValueError(f"image ref {ref} out of range (the row has {len(pics)} images)")
                    parts.append({"type": "image", "image": pics[ref]})
                else:
                    parts.append({"type": "text", "text": p.get("text", "")})
            content = parts
        out.append({"role": m["role"], "content": content})
    return out


def in_view(dialogue: list[dict], view) -> list[dict]:
    """``dialogue`` with every image replaced by ``view(image)`` (``dialogue`` itself when ``view`` is None).

    The drills draw their images larger than the policy sees them; with ``view`` the policy's view
    (:func:`mars.tools.imaging.policy_view` at the processor's pixel bounds) they keep a quarter of the memory and
    render to exactly the same pixel values: the processor resizes an image already at its size to itself."""
    if view is None:
        return dialogue
    out = []
    for m in dialogue:
        content = m["content"]
        if isinstance(content, list):
            content = [{**p, "image": view(p["image"])} if p.get("type") == "image" else p for p in content]
        out.append({**m, "content": content})
    return out


def dialogues_digest(dialogues: list[list[dict]]) -> str:
    """A 16-hex-digit hash of ``dialogues``: every message's role, text and image (mode, size and pixels), in order.

    Training checkpoints carry it in their fingerprint: a change of the data (new drill wording, a teacher fix, other
    renders), not only of params or input files, then starts a phase afresh instead of resuming the old run's
    weights. Hashing the default's 329 teacher trajectories (their images' pixels) took 0.16 s."""
    h = hashlib.blake2b(digest_size=8)
    for dialogue in dialogues:
        for m in dialogue:
            h.update(b"\x02" + str(m["role"]).encode())
            content = m["content"]
            for part in ([{"type": "text", "text": content}] if isinstance(content, str) else content):
                if part.get("type") == "image":
                    im = part["image"]
                    h.update(f"\x03{im.mode}{im.size}".encode())
                    h.update(im.tobytes())
                else:
                    h.update(b"\x04" + str(part.get("text", "")).encode())
        h.update(b"\x01")
    return h.hexdigest()


@dataclass
class PackedPixels:
    """One image's pixel values ``[N, C*T*P*P]`` (N patches; per patch C channels, T temporal copies, P x P pixels)
    at one byte per value. The processor maps each channel's 0-255 levels to one normalised value each, so a channel
    holds at most 256 distinct values: ``table[c]`` lists them (float16) and ``codes`` indexes them. A still image's T
    copies are equal and kept once. A 224-px view (256 patches of 14 px) takes 150 KB instead of 602 KB in float16."""

    codes: torch.Tensor  # [N, C, P*P] uint8: each value's index in its channel's table
    table: torch.Tensor  # [C, 256] float16: each channel's distinct values
    temporal: int  # T


def pack_pixels(pixel_values: torch.Tensor, channels: int, temporal: int) -> PackedPixels | torch.Tensor:
    """``pixel_values`` ``[N, C*T*P*P]`` as :class:`PackedPixels` (their float16 values, exactly); float16 as they
    are when they cannot be packed (a channel with more than 256 distinct values, or unequal temporal copies)."""
    half = pixel_values.to(torch.float16)
    n = half.shape[0]
    x = half.reshape(n, channels, temporal, -1)  # [N, C, T, P*P]
    if not bool((x == x[:, :, :1]).all()):
        return half
    x = x[:, :, 0]  # [N, C, P*P]
    codes = torch.empty(x.shape, dtype=torch.uint8)
    table = torch.zeros(channels, 256, dtype=torch.float16)
    for c in range(channels):
        values, index = torch.unique(x[:, c], return_inverse=True)
        if len(values) > 256:
            return half
        table[c, : len(values)] = values
        codes[:, c] = index.to(torch.uint8)
    return PackedPixels(codes, table, temporal)


def unpack_pixels(pixels: PackedPixels | torch.Tensor) -> torch.Tensor:
    """The float16 pixel values ``[N, C*T*P*P]`` of :func:`pack_pixels`' result."""
    if isinstance(pixels, torch.Tensor):
        return pixels
    n, c, pp = pixels.codes.shape
    values = torch.stack([pixels.table[k][pixels.codes[:, k].long()] for k in range(c)], 1)  # [N, C, P*P]
    return values[:, :, None, :].expand(n, c, pixels.temporal, pp).reshape(n, c * pixels.temporal * pp)


def render_examples(dialogues: list[list[dict]], processor, max_len: int, desc: str = "rendering") -> list[Rendered]:
    """Rendered dialogues no longer than ``max_len`` tokens (in order); logs how many were dropped. Pixel values are
    kept packed (:func:`pack_pixels`: their float16 values at one byte each; :func:`collate` hands the model
    float32): an eighth of the memory of float32 (1.2 MB an image in the 224-px view; the default's localisation
    block holds about 7,000)."""
    ip = processor.image_processor
    out, dropped = [], 0
    for d in tqdm(dialogues, desc=desc, unit="traj", leave=False):
        r = render(d, processor)
        if len(r.input_ids) > max_len:
            dropped += 1
            continue
        if int(r.loss_mask.sum()) == 0:
            dropped += 1
            continue
        if r.pixel_values is not None:
            r.pixel_values = pack_pixels(r.pixel_values, 3, ip.temporal_patch_size)
        out.append(r)
    if dropped:
        log.warning("%d of %d dialogues dropped (longer than %d tokens or no generated tokens)", dropped,
                    len(dialogues), max_len)
    return out


class EpochSampler:
    """Batches of indices from a seeded permutation per epoch; ``state()`` / ``load()`` for resume.

    With ``lengths`` and ``group_batches`` > 1 the permutation is length-grouped (as transformers' ``group_by_length``):
    each run of ``group_batches * batch_size`` shuffled indices is sorted by length, cut into batches, and the epoch's
    batches are shuffled, so a batch holds examples of similar length and pads less (phase 2 of the default sft: 93% of
    the padded tokens are real with 8, 63% without; docs/findings.md). Every batch is then whole: a run's last batch
    overlaps the one before it (a few examples seen twice that epoch).
    """

    def __init__(self, n: int, batch_size: int, seed: int, lengths=None, group_batches: int = 1):
        if n < 1:
            raise ValueError("no training examples")
        if group_batches < 1:
            raise ValueError(f"group_batches must be >= 1, got {group_batches}")
        if lengths is not None and len(lengths) != n:
            raise ValueError(f"lengths has {len(lengths)} entries for {n} examples")
        self.n, self.bs, self.seed = n, batch_size, seed
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.group = group_batches
        self.epoch, self.offset = 0, 0
        self._cache: tuple[int, np.ndarray] | None = None

    def _perm(self, epoch: int) -> np.ndarray:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        perm = rng.permutation(self.n)
        if self.lengths is not None and self.group > 1:
            span = self.group * self.bs
            batches = []
            for s in range(0, self.n, span):
                run = perm[s : s + span]
                if len(run) < self.bs:  # a short tail run: filled up with the epoch's first examples
                    run = np.concatenate([run, np.resize(perm, self.bs - len(run))])
                run = run[np.argsort(-self.lengths[run], kind="stable")]
                # whole batches only (an epoch stays aligned to batch_size): the last one overlaps its neighbour
                batches += [run[min(k, len(run) - self.bs) : min(k, len(run) - self.bs) + self.bs]
                            for k in range(0, len(run), self.bs)]
            perm = np.concatenate([batches[i] for i in rng.permutation(len(batches))])
        self._cache = (epoch, perm)
        return perm

    def next(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.bs:
            perm = self._perm(self.epoch)
            take = perm[self.offset : self.offset + self.bs - len(out)]
            out.extend(int(i) for i in take)
            self.offset += len(take)
            if self.offset >= len(perm):
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load(self, state: dict) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


def length_chunks(idx: list[int], lengths, k: int) -> list[list[int]]:
    """``idx`` (one batch's example indices) ordered longest first (stable) and cut into ``min(k, len(idx))`` runs of
    near-equal count (the first runs one longer when it does not divide), so each run pads only to its own longest.

    >>> length_chunks([0, 1, 2, 3, 4], [5, 300, 40, 310, 50], 2)
    [[3, 1, 4], [2, 0]]
    """
    if k < 1:
        raise ValueError(f"length_chunks: k must be >= 1, got {k}")
    order = sorted(idx, key=lambda i: -int(lengths[i]))  # sorted() is stable
    if not order:
        return []
    k = min(k, len(order))
    q, r = divmod(len(order), k)
    out, s = [], 0
    for j in range(k):
        out.append(order[s : s + q + (j < r)])
        s += q + (j < r)
    return out


@dataclass
class Batch:
    inputs: dict[str, torch.Tensor]  # model kwargs
    labels: torch.Tensor  # [B, T], -100 where no loss
    n_tokens: int  # tokens with a loss


def collate(examples: list[Rendered], pad_id: int) -> Batch:
    """Right-padded batch; labels[t] = input_ids[t+1] where loss_mask[t+1] == 1, else -100."""
    T = max(len(r.input_ids) for r in examples)

    def pad(x: torch.Tensor, v: int) -> torch.Tensor:
        return torch.cat([x, torch.full((T - len(x),), v, dtype=x.dtype)])

    ids = torch.stack([pad(r.input_ids, pad_id) for r in examples])  # [B, T]
    mask = torch.stack([pad(r.loss_mask, 0) for r in examples])  # [B, T]
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = torch.where(mask[:, 1:].bool(), ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.stack([pad(r.attention_mask, 0) for r in examples]),
        "mm_token_type_ids": torch.stack([pad(r.mm_token_type_ids, 0) for r in examples]),
    }
    pv = [r.pixel_values for r in examples if r.pixel_values is not None]
    if pv:
        inputs["pixel_values"] = torch.cat([unpack_pixels(p) for p in pv]).float()  # packed by render_examples
        inputs["image_grid_thw"] = torch.cat([r.image_grid_thw for r in examples if r.image_grid_thw is not None])
    return Batch(inputs, labels, int((labels != -100).sum()))


def label_logits(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits only where a label exists: ``(logits [M, V], labels [M], index [M, 2])`` with M labelled positions.

    The language-model head and the loss over a 2k vocabulary cost more than the whole tiny transformer when run on
    every position; generated tokens are a quarter of a trajectory, so projecting only their hidden states saves
    most of that (the values are identical to slicing full logits)."""
    inner = model.model if hasattr(model, "model") and hasattr(model, "lm_head") else model.module.model
    head = model.lm_head if hasattr(model, "lm_head") else model.module.lm_head
    hidden = inner(**batch.inputs).last_hidden_state  # [B, T, H]
    sel = batch.labels != -100  # [B, T]
    index = sel.nonzero()  # [M, 2]
    return head(hidden[sel]), batch.labels[sel], index
