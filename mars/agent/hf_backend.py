"""Batched local generation with a transformers Qwen2.5-VL model (the rollout/eval backend on CPU or one GPU).

What it does
    :class:`HFBackend` renders the dialogues with :func:`mars.model.chat.render_batch` (left padding, generation
    prompt ``<|im_start|>assistant\\n``), runs one batched ``model.generate`` with the KV cache, and cuts each row at
    the first of: ``<|im_end|>`` / ``<|endoftext|>`` (finish_reason ``"stop"``; the eos id is kept in ``token_ids``
    and its log-prob in ``logprobs``, since the trained turn ends with it, but not in ``text``), the end of a stop
    string (``"stop"``; text ends with the stop string, tokens up to the one completing it), or the budget
    (``"length"``). Greedy when ``temperature == 0``; otherwise sampling with ``temperature``/``top_p`` from a
    ``torch.Generator`` state seeded by ``seed``.
    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the model's raw distribution
    (``log_softmax`` of the logits, before temperature/top-p): what a trainer recomputes for the policy ratio.

    Shared prefix: when every row starts with the same tokens (the system prompt with the tool schemas, at least
    ``min_prefix`` of them, before any image), their keys and values are computed once and kept across calls, and
    rows are padded after that prefix instead of before it. Output equals the plain left-padded path (tested).

Deviations
    A sequence that hit a stop string keeps generating inside the batch until all rows stop (transformers' batch
    semantics); those extra tokens are discarded. Sampling results depend on the batch composition (one RNG stream).

Run the tests: ``.venv/bin/python -m pytest tests/model -q``.
"""

from __future__ import annotations

import copy

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from mars.agent.engine import Generation  # the one result type every backend returns
from mars.model.chat import render, render_batch

__all__ = ["Generation", "HFBackend"]


class _StopStrings(StoppingCriteria):
    """Per-row stop when the decoded tail of the generated tokens contains a stop string."""

    def __init__(self, tokenizer, stop: tuple[str, ...], prompt_len: int):
        self.tok, self.stop, self.n = tokenizer, stop, prompt_len
        self.window = 8 + max((len(s) for s in stop), default=0)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        gen = input_ids[:, self.n :]
        tail = gen[:, -self.window :].tolist()
        done = [any(s in self.tok.decode(row, skip_special_tokens=False) for s in self.stop) for row in tail]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class HFBackend:
    def __init__(self, model, processor, *, device: str = "cpu", min_prefix: int = 32):
        self.model = model.to(device)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.device = device
        ids = self.tokenizer.convert_tokens_to_ids
        self.eos_ids = [i for i in (ids("<|im_end|>"), ids("<|endoftext|>")) if i is not None]
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[-1]
        self.min_prefix = min_prefix
        self._prefix: tuple[tuple[int, ...], object] | None = None  # (shared prompt prefix ids, its KV cache)

    @torch.no_grad()
    def generate(
        self,
        dialogues: list[list[dict]],
        *,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: tuple[str, ...] = ("</tool_call>", "</answer>"),
    ) -> list[Generation]:
        if not dialogues:
            return []
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        inputs, prefix_cache = self._inputs(dialogues)
        prompt_len = inputs["input_ids"].shape[1]
        sample = temperature > 0
        kw = dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0) if sample else dict(
            do_sample=False, temperature=None, top_p=None, top_k=None
        )
        if prefix_cache is not None:
            kw["cache"] = prefix_cache
        criteria = StoppingCriteriaList([_StopStrings(self.tokenizer, tuple(stop), prompt_len)]) if stop else None
        self.model.eval()
        if hasattr(self.model, "model") and hasattr(self.model.model, "rope_deltas"):
            self.model.model.rope_deltas = None  # never reuse mrope deltas of a previous batch
        with torch.random.fork_rng(devices=[] if self.device == "cpu" else [torch.device(self.device)]):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                eos_token_id=self.eos_ids,
                pad_token_id=self.pad_id,
                stopping_criteria=criteria,
                output_logits=True,
                return_dict_in_generate=True,
                **kw,
            )
        seqs = out.sequences[:, prompt_len:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, steps, V]
        lp_all = torch.log_softmax(logits, dim=-1).gather(-1, seqs[:, : logits.shape[1], None]).squeeze(-1)
        return [self._finish(seqs[b].tolist(), lp_all[b].tolist(), stop, max_new_tokens) for b in range(len(seqs))]

    def _inputs(self, dialogues: list[list[dict]]):
        """Model inputs for a batch, and a KV cache of the prompt prefix every row shares (or None).

        Rows start with the same system prompt, which is most of a short dialogue's prompt. Its
        keys and values are computed once (and kept while it stays the same across calls) and
        the rows are padded *after* it: ``[prefix][pad...][rest]``, positions following the
        attention mask, so the output is the same as with left padding (tested).
        """
        rs = [render(d, self.processor, add_generation_prompt=True) for d in dialogues]
        ids = [r.input_ids for r in rs]
        shortest = min(len(x) for x in ids)
        first_vision = [int(r.mm_token_type_ids.nonzero()[0]) for r in rs if r.mm_token_type_ids.any()]
        limit = min([shortest - 1, *first_vision])  # at least one token of each row stays uncached
        same = torch.stack([x[:limit] for x in ids]).eq(ids[0][:limit]).all(0)  # [limit]
        P = int(same.logical_not().nonzero()[0]) if not bool(same.all()) else limit
        if P < self.min_prefix:
            batch = render_batch(dialogues, self.processor, pad_side="left", add_generation_prompt=True)
            return {k: v.to(self.device) for k, v in batch.model_inputs().items()}, None
        prefix = tuple(ids[0][:P].tolist())
        if self._prefix is None or self._prefix[0] != prefix:
            t = torch.tensor([prefix], device=self.device)
            out = self.model(input_ids=t, attention_mask=torch.ones_like(t), mm_token_type_ids=torch.zeros_like(t),
                             use_cache=True)
            self._prefix = (prefix, getattr(out, "cache", None) or out.past_key_values)
        cache = copy.deepcopy(self._prefix[1])
        cache.batch_repeat_interleave(len(rs))
        T = max(len(x) for x in ids)

        def mid(x: torch.Tensor, value: int) -> torch.Tensor:
            return torch.cat([x[:P], torch.full((T - len(x),), value, dtype=x.dtype), x[P:]])

        inputs = {
            "input_ids": torch.stack([mid(r.input_ids, self.pad_id) for r in rs]),
            "attention_mask": torch.stack([mid(r.attention_mask, 0) for r in rs]),
            "mm_token_type_ids": torch.stack([mid(r.mm_token_type_ids, 0) for r in rs]),
        }
        pv = [r.pixel_values for r in rs if r.pixel_values is not None]
        if pv:
            inputs["pixel_values"] = torch.cat(pv)
            inputs["image_grid_thw"] = torch.cat([r.image_grid_thw for r in rs if r.image_grid_thw is not None])
        return {k: v.to(self.device) for k, v in inputs.items()}, cache

    def _finish(self, ids: list[int], lps: list[float], stop: tuple[str, ...], budget: int) -> Generation:
        dec = self.tokenizer.decode
        n, reason = min(len(ids), budget), "length"
        for i, t in enumerate(ids[:budget]):
            if t in self.eos_ids:
                n, reason = i + 1, "stop"
                break
        # earliest stop string: shortest prefix whose decoding contains one
        if stop:
            text_all = dec(ids[:n], skip_special_tokens=False)
            if any(s in text_all for s in stop):
                lo, hi = 1, n
                while lo < hi:
                    mid = (lo + hi) // 2
                    if any(s in dec(ids[:mid], skip_special_tokens=False) for s in stop):
                        hi = mid
                    else:
                        lo = mid + 1
                n, reason = lo, "stop"
        ids, lps = ids[:n], lps[:n]
        body = ids[:-1] if ids and ids[-1] in self.eos_ids else ids
        text = dec(body, skip_special_tokens=False)
        if stop:
            cut = min((text.find(s) + len(s) for s in stop if s in text), default=None)
            if cut is not None:
                text = text[:cut]
        return Generation(text=text, token_ids=ids, logprobs=lps, finish_reason=reason)
