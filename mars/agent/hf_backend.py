"""Batched local generation with a transformers Qwen2.5-VL model (the rollout/eval backend on CPU or one GPU).

What it does
    :class:`HFBackend` renders the dialogues with :func:`mars.model.chat.render` (generation prompt
    ``<|im_start|>assistant\\n``), prefills them as one batch and decodes with the KV cache, and cuts each row at
    the first of: ``<|im_end|>`` / ``<|endoftext|>`` (finish_reason ``"stop"``; the eos id is kept in ``token_ids``
    and its log-prob in ``logprobs``, since the trained turn ends with it, but not in ``text``), the end of a stop
    string (``"stop"``; text ends with the stop string, tokens up to the one completing it), or the budget
    (``"length"``). Greedy when ``temperature == 0``; otherwise sampling with ``temperature``/``top_p`` from a
    ``torch.Generator`` state seeded by ``seed``.
    A row stops generating at the token that completes a stop string: transformers' ``StopStringCriteria``
    applied to the generated tokens only (a stop string never starts in the prompt), built once per stop tuple (it
    reads the whole vocabulary: 1-2 s for Qwen's). The cut itself is made on the decoded text (the shortest prefix
    of the ids whose decoding contains a stop string); for the byte-level tokenizers of :mod:`mars.model.tokenizer`
    the criterion fires at that same token (``tests/model/test_stop_strings.py``).
    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` at the sampling temperature (``log_softmax`` of
    ``logits / temperature``; of the raw logits when greedy), before top-p: what the RL trainer computes for the
    policy ratio (as TRL and verl do). A vLLM server returns the same with ``--logprobs-mode processed_logprobs``
    (its default, ``raw_logprobs``, ignores the temperature). Vision placeholder tokens are never sampled (their
    logits are -inf: only image items make them; :func:`mars.model.chat.vision_token_ids`), and the log-probs
    are of that distribution, as the RL trainer computes them.

    Episode cache (``episode_cache=True``, the default): the engine calls :meth:`HFBackend.generate` once per step
    with every unfinished dialogue, each grown by an assistant turn and a tool turn since the last call. After a
    call the backend keeps, per row, the keys/values of every token it processed (prompt + the generated tokens it
    kept and fed back), unpadded, with the row's mrope positions, in an LRU bounded by ``max_cache_tokens``. The
    key is the token-id sequence with each image's tokens replaced by a fingerprint of that image's pixels (two
    same-size images never share keys/values). On the next call each row reuses the entry sharing its longest
    prefix (the dialogue's previous prompt plus the reply as re-rendered; when re-tokenising the reply gives other
    ids, the common prefix; never cutting through an image), so only the new suffix is prefilled and only the new
    images go through the vision encoder. Rows are laid out ``[zeros][cached_i][new_i][pad][generated...]`` with
    attention mask 0 on zeros and pads; positions of the suffix come from ``get_rope_index`` on the suffix alone
    (with its own images' grids) shifted by ``1 + max`` of the cached positions, which is exactly what
    ``get_rope_index`` gives on the whole sequence. Decoding is a plain loop over ``model.model`` + ``lm_head`` with
    a preallocated cache buffer (same token choice, eos/stop-string/budget rules and raw-logit log-probs as the
    ``model.generate`` path; tested equal within 1e-4). Images are preprocessed once per distinct image (memo).
    Rows without a cached entry still share the system prompt below.

    Shared prefix: when every row starts with the same tokens (the system prompt with the tool schemas, at least
    ``min_prefix`` of them, before any image), their keys and values are computed once and kept across calls, and
    rows are padded after that prefix instead of before it. Output equals the plain left-padded path (tested).

    ``episode_cache=False`` is the previous path: ``render_batch`` + one ``model.generate`` per call with only the
    shared-prefix cache. It is also used when the model has non-full-attention layers or a ``repetition_penalty`` /
    ``no_repeat_ngram_size`` in its generation config (logits processors the own decode loop does not apply).

Deviations
    A sequence that hit a stop string keeps generating inside the batch until all rows stop (transformers' batch
    semantics); those extra tokens are discarded. Sampling results depend on the batch composition (one RNG stream),
    and with the episode cache on they can differ from the ``model.generate`` path (same distribution; greedy
    output is the same). Reused keys/values were computed in another batch layout, so logits differ from a fresh
    prefill by float rounding (~1e-6). ``clear_cache()`` forgets all cached dialogues; ``release(dialogues)`` the
    entries of finished ones (the engine calls it as episodes end, so a long stream of episodes keeps only the
    entries of those in play; the image memo stays LRU-bounded at 512 MiB, shared by the episodes of a group).

Run the tests: ``.venv/bin/python -m pytest tests/model -q``; throughput: ``python bench/bench_rollout.py``.
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from mars.agent.engine import Generation  # the one result type every backend returns
from mars.model.chat import render, render_batch, vision_token_ids

__all__ = ["Generation", "HFBackend"]


def _logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, suppress: list[int]) -> torch.Tensor:
    """Log-probs [B, S] of ``ids`` [B, S] under ``logits`` [B, S, V] at the sampling temperature (raw when greedy),
    the ``suppress`` ids excluded as when sampling."""
    scaled = logits.float() / temperature if temperature > 0 else logits.float().clone()
    scaled[..., suppress] = float("-inf")
    return torch.log_softmax(scaled, dim=-1).gather(-1, ids[..., None]).squeeze(-1)


class _Generated(StoppingCriteria):
    """``inner`` applied to the generated tokens only: ``input_ids`` from ``prompt_len`` on.

    transformers' ``StopStringCriteria`` looks at the end of the whole sequence, so a stop string could start in the
    prompt (``"\\n\\n"`` after the generation prompt's ``"assistant\\n"``); here it must lie in the generated text.
    """

    def __init__(self, inner: StoppingCriteria, prompt_len: int):
        self.inner, self.n = inner, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return self.inner(input_ids[:, self.n :], scores, **kwargs)


class _BufferLayer(DynamicLayer):
    """A full-attention cache layer writing into one preallocated buffer (no concatenation per decoded token)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.n, self.kbuf, self.vbuf = capacity, 0, None, None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self.kbuf is None or self.n + t > self.kbuf.shape[-2]:
            cap = max(self.capacity, 2 * (self.n + t))
            kb = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
            vb = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
            if self.n:
                kb[..., : self.n, :] = self.keys
                vb[..., : self.n, :] = self.values
            self.kbuf, self.vbuf = kb, vb
        self.kbuf[..., self.n : self.n + t, :] = key_states
        self.vbuf[..., self.n : self.n + t, :] = value_states
        self.n += t
        self.keys, self.values = self.kbuf[..., : self.n, :], self.vbuf[..., : self.n, :]
        return self.keys, self.values


class _MemoImageProcessor:
    """Wraps the image processor: each distinct image (by its pixels) is preprocessed once and fingerprinted."""

    def __init__(self, inner, max_bytes: int = 512 * 2**20):
        self.inner, self.max_bytes, self.bytes = inner, max_bytes, 0
        self.memo: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.last_digests: list[bytes] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, images, return_tensors="pt", **kwargs):
        pvs, grids, digests = [], [], []
        for im in images:
            h = hashlib.blake2b(im.tobytes(), digest_size=16)
            h.update(repr((im.mode, im.size)).encode())
            d = h.digest()
            if d not in self.memo:
                out = self.inner(images=[im], return_tensors=return_tensors, **kwargs)
                self.memo[d] = (out["pixel_values"], out["image_grid_thw"])
                self.bytes += out["pixel_values"].nbytes
                while self.bytes > self.max_bytes and len(self.memo) > 1:
                    self.bytes -= self.memo.popitem(last=False)[1][0].nbytes
            else:
                self.memo.move_to_end(d)
            pv, g = self.memo[d]
            pvs.append(pv)
            grids.append(g)
            digests.append(d)
        self.last_digests = digests
        return {"pixel_values": torch.cat(pvs), "image_grid_thw": torch.cat(grids)}


class _MemoProcessor:
    """What :func:`render` needs of a processor: the tokenizer, and the memoising image processor."""

    def __init__(self, processor):
        self.tokenizer = processor.tokenizer
        self.image_processor = _MemoImageProcessor(processor.image_processor)


@dataclass
class _Entry:
    """Keys/values of one processed token sequence (no padding), kept across calls."""

    key: torch.Tensor  # [L] int64: token ids, image tokens replaced by a negative code of the image's pixels
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [heads, L, head_dim]
    pos: torch.Tensor  # [3, L] mrope positions
    hash: bytes = b""


@dataclass
class _Row:
    """One dialogue of a call: its render, matching key and where its image spans start."""

    r: object  # chat.Rendered
    key: torch.Tensor
    starts: list[int]  # start index of each image span
    lengths: list[int]  # patches of each image in pixel_values


class HFBackend:
    def __init__(self, model, processor, *, device: str = "cpu", min_prefix: int = 32, episode_cache: bool = True,
                 max_cache_tokens: int = 262144):
        self.model = model.to(device)
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.device = device
        ids = self.tokenizer.convert_tokens_to_ids
        self.eos_ids = [i for i in (ids("<|im_end|>"), ids("<|endoftext|>")) if i is not None]
        self.suppress = vision_token_ids(self.tokenizer)  # never sampled: only image items make vision tokens
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[-1]
        self.min_prefix = min_prefix
        self._prefix: tuple[tuple[int, ...], object] | None = None  # (shared prompt prefix ids, its KV cache)
        self.episode_cache = episode_cache
        self.max_cache_tokens = max_cache_tokens
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # LRU of processed sequences
        self._owner: dict[int, bytes] = {}  # id(dialogue) -> its latest entry (for release)
        self._cached_tokens = 0
        self._memo = _MemoProcessor(processor)  # image preprocessing memo + image fingerprints for the cache keys
        self.last_stats: dict = {}  # rows, cached_tokens, prefilled_tokens of the last cached-path call
        self._stop_criteria: OrderedDict[tuple[str, ...], StopStringCriteria] = OrderedDict()  # by stop tuple

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
        if self.episode_cache and self._own_loop_ok():
            return self._generate_cached(dialogues, max_new_tokens, temperature, top_p, seed, tuple(stop))
        inputs, prefix_cache = self._inputs(dialogues)
        prompt_len = inputs["input_ids"].shape[1]
        sample = temperature > 0
        kw = dict(do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0) if sample else dict(
            do_sample=False, temperature=None, top_p=None, top_k=None
        )
        if prefix_cache is not None:
            kw["cache"] = prefix_cache
        criteria = StoppingCriteriaList([_Generated(self._stop_criterion(tuple(stop)), prompt_len)]) if stop else None
        self.model.eval()
        if hasattr(self.model, "model") and hasattr(self.model.model, "rope_deltas"):
            self.model.model.rope_deltas = None  # never reuse mrope deltas of a previous batch
        with torch.random.fork_rng(devices=[] if self.device == "cpu" else [torch.device(self.device)]):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                suppress_tokens=self.suppress or None,
                eos_token_id=self.eos_ids,
                pad_token_id=self.pad_id,
                stopping_criteria=criteria,
                output_logits=True,
                return_dict_in_generate=True,
                **kw,
            )
        seqs = out.sequences[:, prompt_len:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B, steps, V]
        lp_all = _logprobs(logits, seqs[:, : logits.shape[1]], temperature, self.suppress)
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
        if self._prefix is None or self._prefix[0] != prefix or isinstance(self._prefix[1], _Entry):
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

    def _stop_criterion(self, stop: tuple[str, ...]) -> StopStringCriteria:
        """transformers' stop-string criterion for ``stop`` (the last 8 stop tuples are kept: building one reads the
        whole vocabulary)."""
        crit = self._stop_criteria.get(stop)
        if crit is None:
            crit = self._stop_criteria[stop] = StopStringCriteria(self.tokenizer, list(stop))
            while len(self._stop_criteria) > 8:
                self._stop_criteria.popitem(last=False)
        else:
            self._stop_criteria.move_to_end(stop)
        return crit

    # ------------------------------------------------------------------ per-dialogue KV cache (episode_cache=True)

    def _own_loop_ok(self) -> bool:
        """The cached path runs its own decode loop; it covers full attention and the default logits processing."""
        text_cfg = self.model.config.get_text_config(decoder=True)
        if any(t != "full_attention" for t in (getattr(text_cfg, "layer_types", None) or ["full_attention"])):
            return False
        gc = getattr(self.model, "generation_config", None)
        rp = getattr(gc, "repetition_penalty", None)
        return (rp is None or rp == 1.0) and not getattr(gc, "no_repeat_ngram_size", 0)

    def clear_cache(self) -> None:
        """Forget every cached dialogue and the shared prefix."""
        self._entries.clear()
        self._owner.clear()
        self._cached_tokens = 0
        self._prefix = None
        self.last_stats = {}
        self._memo = _MemoProcessor(self.processor)

    def _row(self, dialogue: list[dict]) -> _Row:
        self._memo.image_processor.last_digests = []
        r = render(dialogue, self._memo, add_generation_prompt=True)
        digests = self._memo.image_processor.last_digests
        key = r.input_ids.clone()
        mm = r.mm_token_type_ids
        starts: list[int] = []
        lengths: list[int] = []
        if r.image_grid_thw is not None:
            flags = mm.tolist()
            starts = [i for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1])]
            merge = self.processor.image_processor.merge_size
            lengths = [int(g.prod()) for g in r.image_grid_thw]
            for s, n, d in zip(starts, lengths, digests):
                key[s : s + n // (merge * merge)] = -1 - int.from_bytes(d[:7], "little")
        return _Row(r, key, starts, lengths)

    def _lookup(self, row: _Row) -> tuple[_Entry | None, int]:
        """The cached entry sharing the longest prefix with the row (at least one row token left uncached)."""
        x = row.key
        best, best_n = None, 0
        for e in self._entries.values():
            n = min(len(e.key), len(x) - 1)
            if n <= best_n:
                continue
            ne = (e.key[:n] != x[:n]).nonzero()
            lcp = int(ne[0]) if len(ne) else n
            if lcp > best_n:
                best, best_n = e, lcp
        return best, best_n

    @staticmethod
    def _clamp(row: _Row, n: int) -> int:
        """Never split an image: a cut inside an image span moves to the span's start."""
        mm = row.r.mm_token_type_ids
        if 0 < n < len(mm) and bool(mm[n]) and bool(mm[n - 1]):
            n = max(s for s in row.starts if s < n)
        return n

    def _shared_prefix_entry(self, rows: list[_Row]) -> _Entry | None:
        """The shared-prefix entry (system prompt) for this batch, as in :meth:`_inputs` (None if too short)."""
        ids = [row.r.input_ids for row in rows]
        shortest = min(len(x) for x in ids)
        limit = min([shortest - 1, *[s for row in rows for s in row.starts[:1]]])
        same = torch.stack([x[:limit] for x in ids]).eq(ids[0][:limit]).all(0)
        P = int(same.logical_not().nonzero()[0]) if not bool(same.all()) else limit
        if P < self.min_prefix:
            return None
        prefix = tuple(ids[0][:P].tolist())
        if self._prefix is None or self._prefix[0] != prefix or not isinstance(self._prefix[1], _Entry):
            t = torch.tensor([prefix], device=self.device)
            out = self.model(input_ids=t, attention_mask=torch.ones_like(t), mm_token_type_ids=torch.zeros_like(t),
                             use_cache=True, logits_to_keep=1)
            cache = getattr(out, "cache", None) or out.past_key_values
            kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
            self._prefix = (prefix, _Entry(ids[0][:P].clone(), kv, torch.arange(P).expand(3, P)))
        return self._prefix[1]

    def release(self, dialogues: list[list[dict]]) -> None:
        """Drop the cached keys/values of finished dialogues (the engine calls this as episodes end); an entry that
        another live dialogue shares (the same tokens, e.g. greedy samples of one question) stays for it."""
        for d in dialogues:
            h = self._owner.pop(id(d), None)
            if h is not None and h in self._entries and h not in self._owner.values():
                self._cached_tokens -= len(self._entries.pop(h).key)

    def _store(self, key: torch.Tensor, kv: list, pos: torch.Tensor) -> bytes:
        h = hashlib.blake2b(key.numpy().tobytes(), digest_size=16).digest()
        if h in self._entries:
            self._entries.move_to_end(h)
            return h
        self._entries[h] = _Entry(key, kv, pos, h)
        self._cached_tokens += len(key)
        while self._cached_tokens > self.max_cache_tokens and self._entries:
            _, old = self._entries.popitem(last=False)
            self._cached_tokens -= len(old.key)
        return h

    def _generate_cached(self, dialogues, max_new_tokens, temperature, top_p, seed, stop) -> list[Generation]:
        dev = self.device
        rows = [self._row(d) for d in dialogues]
        B = len(rows)
        # 1. the longest cached prefix of every row (its own earlier turns, or the shared system prompt)
        matches = [self._lookup(row) for row in rows]
        if any(n < self.min_prefix for _, n in matches):
            shared = self._shared_prefix_entry(rows)
            if shared is not None:
                P = len(shared.key)
                matches = [(e, n) if n >= P else (shared, P) for e, n in matches]
        matches = [(e, self._clamp(row, n)) for row, (e, n) in zip(rows, matches)]
        cl = [n for _, n in matches]
        total = sum(len(row.key) for row in rows)
        self.last_stats = {"rows": B, "cached_tokens": sum(cl), "prefilled_tokens": total - sum(cl)}
        # 2. the uncached suffix of every row: ids, vision inputs of its new images, mrope positions
        rope = self.model.model.get_rope_index
        new_ids, new_mm, new_pos, pv, grids = [], [], [], [], []
        for row, (e, c) in zip(rows, matches):
            r = row.r
            k = sum(1 for s in row.starts if s < c)  # images already inside the cached keys/values
            g = r.image_grid_thw[k:] if r.image_grid_thw is not None and k < len(row.starts) else None
            if g is not None:
                pv.append(r.pixel_values[sum(row.lengths[:k]) :])
                grids.append(g)
            ids, mm = r.input_ids[c:], r.mm_token_type_ids[c:]
            pos = rope(ids[None], mm[None], image_grid_thw=g)[0][:, 0]
            if c:
                pos = pos + (e.pos[:, :c].max() + 1)
            new_ids.append(ids)
            new_mm.append(mm)
            new_pos.append(pos)
        C, N = max(cl), max(len(x) for x in new_ids)
        nl = [len(x) for x in new_ids]
        # layout per row: [zero keys/values (C - c_i)][cached c_i] [new n_i][pad (N - n_i)] [generated ...]
        mask = torch.zeros(B, C + N, dtype=torch.long)
        input_ids = torch.full((B, N), self.pad_id, dtype=torch.long)
        mm_ids = torch.zeros(B, N, dtype=torch.long)
        position_ids = torch.zeros(3, B, N, dtype=torch.long)
        for b in range(B):
            mask[b, C - cl[b] : C + nl[b]] = 1
            input_ids[b, : nl[b]] = new_ids[b]
            mm_ids[b, : nl[b]] = new_mm[b]
            position_ids[:, b, : nl[b]] = new_pos[b]
        cache = DynamicCache(config=self.model.config)
        cache.layers = [_BufferLayer(C + N + max_new_tokens) for _ in cache.layers]
        if C:
            ref = next(e for e, c in matches if c).kv
            for li, (k0, _) in enumerate(ref):
                H, D = k0.shape[0], k0.shape[-1]
                ks = k0.new_zeros(B, H, C, D)
                vs = k0.new_zeros(B, H, C, D)
                for b, (e, c) in enumerate(matches):
                    if c:
                        ks[b, :, C - c :] = e.kv[li][0][:, :c]
                        vs[b, :, C - c :] = e.kv[li][1][:, :c]
                cache.update(ks.to(dev), vs.to(dev), li)
        inputs = dict(input_ids=input_ids.to(dev), mm_token_type_ids=mm_ids.to(dev), position_ids=position_ids.to(dev))
        if pv:
            inputs["pixel_values"] = torch.cat(pv).to(dev)
            inputs["image_grid_thw"] = torch.cat(grids).to(dev)
        # 3. prefill the suffixes, then decode token by token (same semantics as model.generate in the plain path)
        self.model.eval()
        base = self.model.model
        head = self.model.get_output_embeddings()
        last = torch.tensor([n - 1 for n in nl], device=dev)
        rows_ix = torch.arange(B, device=dev)
        mask = mask.to(dev)
        next_pos = (position_ids.to(dev).gather(2, last.view(1, B, 1).expand(3, B, 1)).amax(0).view(B) + 1)
        warpers = []
        if temperature > 0:  # what model.generate applies for do_sample with top_k=0
            warpers = [TemperatureLogitsWarper(float(temperature))]
            warpers += [TopPLogitsWarper(float(top_p))] if top_p < 1.0 else []
        criteria = self._stop_criterion(stop) if stop else None  # fed the generated tokens only
        eos = torch.tensor(self.eos_ids, device=dev)
        gen_tokens, gen_logits = [], []
        unfinished = torch.ones(B, dtype=torch.bool, device=dev)
        with torch.random.fork_rng(devices=[] if dev == "cpu" else [torch.device(dev)]):
            if seed is not None:
                torch.manual_seed(seed)
            out = base(attention_mask=mask, cache=cache, use_cache=True, **inputs)
            cache = getattr(out, "cache", None) or out.past_key_values
            logits = head(out.last_hidden_state[rows_ix, last]).float()
            for step in range(max_new_tokens):
                logits[:, self.suppress] = float("-inf")
                gen_logits.append(logits)
                if warpers:
                    scores = logits
                    for w in warpers:
                        scores = w(None, scores)
                    tok = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
                else:
                    tok = logits.argmax(-1)
                tok = torch.where(unfinished, tok, torch.full_like(tok, self.pad_id))
                gen_tokens.append(tok)
                unfinished &= ~torch.isin(tok, eos)
                if criteria is not None:
                    unfinished &= ~criteria(torch.stack(gen_tokens, 1), None)
                if step == max_new_tokens - 1 or not bool(unfinished.any()):
                    break
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
                out = base(input_ids=tok[:, None], attention_mask=mask, cache=cache, use_cache=True,
                           position_ids=(next_pos + step).view(1, B, 1).expand(3, B, 1))
                logits = head(out.last_hidden_state[:, -1]).float()
        seqs = torch.stack(gen_tokens, 1).cpu()
        lp_all = _logprobs(torch.stack(gen_logits, 1).cpu(), seqs, temperature, self.suppress)
        gens = [self._finish(seqs[b].tolist(), lp_all[b].tolist(), stop, max_new_tokens) for b in range(B)]
        # 4. keep every row's keys/values: prompt + the generated tokens it kept that were fed back
        if len(self._owner) > 4 * len(self._entries) + 256:  # callers that never release: forget evicted owners
            self._owner = {k: h for k, h in self._owner.items() if h in self._entries}
        fed = len(gen_tokens) - 1
        layers = cache.layers
        for b, (row, g) in enumerate(zip(rows, gens)):
            keep = min(len(g.token_ids), fed)
            L = cl[b] + nl[b] + keep
            cols = mask[b].nonzero().view(-1)[:L]
            kv = [(layer.keys[b][:, cols], layer.values[b][:, cols]) for layer in layers]  # copies, on the device
            prompt_pos = torch.cat([matches[b][0].pos[:, : cl[b]] if cl[b] else torch.zeros(3, 0, dtype=torch.long),
                                    new_pos[b]], dim=1)
            gpos = (next_pos[b].cpu() + torch.arange(keep)).expand(3, keep)
            key = torch.cat([row.key, torch.tensor(g.token_ids[:keep], dtype=torch.long)])
            self._owner[id(dialogues[b])] = self._store(key, kv, torch.cat([prompt_pos, gpos], dim=1))
            e = matches[b][0]
            if e is not None and e.hash and cl[b] == len(e.key) and e.hash in self._entries:
                self._cached_tokens -= len(self._entries.pop(e.hash).key)  # superseded by the longer entry
        if hasattr(base, "rope_deltas"):
            base.rope_deltas = None
        return gens

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
