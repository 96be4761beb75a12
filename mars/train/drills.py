"""Reading drills: text-only fragments of search episodes, built from real tool observations (SFT pre-training).

What it does
    :func:`reading_drills` writes one-turn dialogues that teach the two copying skills every search and multi-hop
    episode needs, over many entities (never one named by a held-out question):

    - ``fact``: the user turn holds a real ``text_search`` observation for ``"<name> <keyword>"`` (the tool is
      called) and a question about the named organisation, open or multiple choice; the reply reads the value
      from the snippet titled with that name (``The snippet about <name> gives <value>.``) and answers it or its
      option letter. An observation that does not state the fact is skipped, as the teacher would fail on it;
    - ``title``: the user turn holds a real ``image_search`` observation for a gallery rendering of the entity
      (titles only; the thumbnails are left out) and a search question; the reply copies the top-1 title's name
      into a ``text_search`` call (``"<name> <keyword>"``), as the teacher does;

    :class:`CopyCheck`: phase 1's held-out score, the share of held-out drills (drawn with another seed) whose
    greedy reply does what the teacher's does (:func:`copied`: the same query, or the same answer).

    The tools are called once per gallery rendering and per query (they are deterministic; the renaming makes
    every drill new), so thousands of drills cost little more than the distinct observations.

    Observations are wrapped exactly as in an episode (:func:`mars.agent.protocol.format_tool_response`), and the
    replies use the teacher's wording, so the circuits learned here are the ones the agentic trajectories use.

    ``fresh_names`` (the default): every organisation word and founder name in a drill (observation, question,
    options and reply alike) is replaced, consistently within the drill, by a freshly generated word
    (:func:`mars.world.text.make_word`, the world's own syllables). Years, cities and kinds are kept. The copy
    relations stay exact (the query still starts with the top title; the answer is still in the snippet), but no
    name is ever seen twice, so the model cannot memorise name -> fact or name -> name and has to copy. Without
    it the SFT model wrote a plausible training name ("Eros Observatory" for "Ecamtes Observatory") and copied 12
    of 51 held-out titles despite a drill loss of 0.03 (docs/findings.md).

Deviation from the paper (and why)
    The paper's policy starts from an LLM that can already copy a name from its context. The embedded default's
    language model is random-init, and measured on the default world it did not learn to copy from ~700 teacher
    trajectories in 600 steps: it answered with names memorised from training. In a text-only probe the same
    model learned copying (98% on unseen names) after about 1,500 steps on thousands of varied examples, which
    the multimodal trajectories (about 10x the cost per step) cannot afford. These drills are the default's
    stand-in for base-model pre-training; they run as a cheap first phase of the ``sft`` stage
    (``sft.pretrain_steps``) and are off for a pretrained checkpoint.

How to run (Python)::

    drills = reading_drills(toolbox, entities, gallery, gallery_dir, n=3000, seed=0, exclude_entities=test_ids)
    share = CopyCheck(processor, held_out_drills).measure(model, step=0)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from PIL import Image

from mars.agent.oracle import FACT_KEYWORD
from mars.agent.protocol import format_answer, format_tool_call, format_tool_response
from mars.agent.teacher import fact_from_observation, titles_from_observation
from mars.world.questions import FACT_QUESTIONS, FACTS, SEARCH_SUBJECT, question_text
from mars.world.text import make_word

__all__ = ["CopyCheck", "copied", "drill_kind", "reading_drills", "scored_once"]


def _user(observation: str, question: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": f"{format_tool_response(observation)}\n{question}"}]}


def reading_drills(
    toolbox,
    entities: list[dict],
    gallery: list[dict],
    gallery_dir: str | Path,
    *,
    n: int,
    seed: int = 0,
    exclude_entities: Iterable[str] = (),
    mcq_share: float = 0.5,
    title_share: float = 0.4,
    fresh_names: bool = True,
) -> list[list[dict]]:
    """``n`` drill dialogues (text only; ``[user, assistant]``); see the module docstring.

    ``toolbox``: a :class:`mars.tools.toolbox.ToolBox` (its ``text_search`` and ``image_search`` are called);
    ``entities``: ENTITIES rows (real ones are used: ``is_distractor`` false); ``gallery``: GALLERY rows.
    """
    if n < 0:
        raise ValueError(f"the number of reading drills must be >= 0, got {n}")
    for k, v in {"mcq_share": mcq_share, "title_share": title_share}.items():
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{k} must be in [0, 1], got {v}")
    if n == 0:
        return []
    excluded = set(exclude_entities)
    real = [e for e in entities if not e.get("is_distractor")]
    pool = sorted((e for e in real if e["entity_id"] not in excluded), key=lambda e: e["entity_id"])
    if not pool:
        raise ValueError(f"no entity left for reading drills ({len(real)} real, {len(excluded)} excluded); set "
                         "sft.pretrain_drills to 0 or generate a larger world")
    pools = {k: sorted({str(e[k]) for e in real}) for k in FACTS}
    renders: dict[str, list[str]] = {}
    for r in sorted(gallery, key=lambda r: r["path"]):
        renders.setdefault(r["entity_id"], []).append(r["path"])
    root = Path(gallery_dir)
    rng = np.random.default_rng([seed, 37])
    rename = _Renamer(entities, np.random.default_rng([seed, 38])) if fresh_names else None
    out: list[list[dict]] = []
    # the tools are deterministic: one call per gallery rendering and per query (renaming makes each drill new)
    image_obs: dict[str, object] = {}
    text_obs: dict[str, object] = {}
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 4 * n + 100:
            raise RuntimeError(f"only {len(out)} of {n} reading drills could be built in {attempts} attempts: the "
                               "tools rarely return the fact or a title; check the index stage")
        ent = pool[int(rng.integers(len(pool)))]
        fact = FACTS[int(rng.integers(len(FACTS)))]
        keyword = FACT_KEYWORD.get(fact, fact)
        mcq = bool(rng.random() < mcq_share)
        if rng.random() < title_share and renders.get(ent["entity_id"]):
            paths = renders[ent["entity_id"]]
            path = paths[int(rng.integers(len(paths)))]
            if path not in image_obs:
                with Image.open(root / path) as im:
                    image_obs[path] = toolbox.call("image_search", {"img_idx": 0}, [im.convert("RGB")])
            obs = image_obs[path]
            titles = titles_from_observation(obs.text) if obs.error is None else []
            if not titles:
                continue
            base = FACT_QUESTIONS[fact].format(subject=SEARCH_SUBJECT)
            query = f"{titles[0]} {keyword}"
            reply = format_tool_call("text_search", {"query": query}, f"Top match: {titles[0]}. Search the text for it.")
            text, _, _ = question_text(base, fact, str(ent[fact]), pools[fact], rng if mcq else None)
            out.append(_dialogue(obs.text, text, reply, rename))
            continue
        name = ent["name"]
        found = _read(toolbox, text_obs, f"{name} {keyword}", name, fact, pools)
        if found is None:
            continue
        text, reply = _fact_qa(FACT_QUESTIONS[fact].format(subject=name), fact, name, found[1], pools,
                               rng if mcq else None)
        out.append(_dialogue(found[0], text, reply, rename))
    return out


def _read(toolbox, cache: dict, query: str, name: str, fact: str, pools: dict) -> tuple[str, str] | None:
    """(observation text, the fact about ``name`` it states) for a ``text_search`` of ``query`` (one call per
    query), or None when it does not state it (the teacher would fail on it)."""
    if query not in cache:
        cache[query] = toolbox.call("text_search", {"query": query}, [])
    obs = cache[query]
    value = fact_from_observation(obs.text, name, fact, pools) if obs.error is None else None
    return None if value is None else (obs.text, value)


def _fact_qa(base: str, fact: str, name: str, value: str, pools: dict, rng) -> tuple[str, str]:
    """(question text, the teacher's answer turn) for a fact ``value`` read from the snippet about ``name``; a
    multiple-choice question when ``rng`` is given."""
    text, choices, aliases = question_text(base, fact, value, pools[fact], rng)
    think = f"The snippet about {name} gives {value}."
    reply = format_answer(aliases[0], f"{think} That is option {aliases[0]}.") if choices else \
        format_answer(value, think)
    return text, reply


class _Renamer:
    """Replaces the world's organisation words and founder names in a drill by fresh words (module docstring)."""

    def __init__(self, entities: list[dict], rng: np.random.Generator):
        words = set()
        for e in entities:
            kind = str(e.get("kind", ""))
            name = str(e["name"])
            words.add(name[: -len(kind) - 1] if kind and name.lower().endswith(" " + kind.lower()) else name)
            words.update(str(e.get("founder", "")).split())
        words.discard("")
        self.known = words
        self.rng = rng
        alternation = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        self.pattern = re.compile(rf"\b(?:{alternation})\b")

    def fresh(self, used: set[str]) -> str:
        while True:
            w = make_word(self.rng)
            if w not in self.known and w not in used:
                used.add(w)
                return w

    def __call__(self, texts: list[str]) -> list[str]:
        table: dict[str, str] = {}
        used: set[str] = set()

        def sub(m: re.Match) -> str:
            if m.group(0) not in table:
                table[m.group(0)] = self.fresh(used)
            return table[m.group(0)]

        return [self.pattern.sub(sub, t) for t in texts]


def _dialogue(observation: str, question: str, reply: str, rename: _Renamer | None) -> list[dict]:
    """``[user (observation + question), assistant (reply)]``, renamed consistently across all three texts."""
    texts = [observation, question, reply]
    if rename is not None:
        texts = rename(texts)
    return [_user(texts[0], texts[1]), {"role": "assistant", "content": texts[2]}]


def drill_kind(dialogue: list[dict]) -> str:
    """``"title"`` or ``"fact"`` (:func:`reading_drills`): which drill a dialogue is (for reports and tests)."""
    return "title" if "<tool_call>" in dialogue[-1]["content"] else "fact"


def copied(text: str, reference: str) -> bool:
    """Whether a generated drill reply ``text`` does what the ``reference`` reply does: the same tool with the same
    query (a title drill), or the same answer (a fact drill; case and surrounding space ignored). The thinking may
    differ; a malformed turn is a miss."""
    from mars.agent.protocol import parse_turn

    got, ref = parse_turn(text), parse_turn(reference)
    if not got.well_formed or got.action != ref.action:
        return False
    if ref.action == "tool_call":
        return got.tool_name == ref.tool_name and got.arguments == ref.arguments
    return (got.answer or "").strip().lower() == (ref.answer or "").strip().lower()


def scored_once(history: list[tuple[int, float]], step: int, score: Callable[[], float]) -> float:
    """A stopping check's share at ``step``: ``score()`` recorded in ``history`` as (step, share), unless its last
    entry is already that step's (:class:`CopyCheck`, :class:`mars.train.locate.LocateCheck`: the stage's metric
    after a phase reuses the check its last step just ran)."""
    if not history or history[-1][0] != step:
        history.append((step, round(score(), 4)))
    return history[-1][1]


class CopyCheck:
    """Phase 1's held-out score: the share of held-out ``drills`` (:func:`reading_drills` drawn with another seed:
    fresh names, so nothing can be recalled) whose greedy reply is :func:`copied` right. ``history`` keeps (step,
    copied share) of every score it ran (the metric ``pretrain_check_copied``: a diagnostic, not a stopping rule;
    a stop at a target share scored lower, docs/findings.md)."""

    def __init__(self, processor, drills: list[list[dict]], *, max_new_tokens: int = 96) -> None:
        if not drills:
            raise ValueError("a copy check needs held-out drills, got none")
        self.processor, self.max_new_tokens = processor, max_new_tokens
        self.prompts = [d[:-1] for d in drills]
        self.references = [d[-1]["content"] for d in drills]
        self.history: list[tuple[int, float]] = []

    def measure(self, model, step: int) -> float:
        """The share of the held-out drills ``model`` copies right (greedy), recorded in ``history`` for ``step``
        (scored once a step)."""
        from mars.agent.hf_backend import HFBackend

        def share() -> float:
            outs = HFBackend(model, self.processor).generate(self.prompts, max_new_tokens=self.max_new_tokens)
            return sum(copied(o.text, r) for o, r in zip(outs, self.references)) / len(self.prompts)

        return scored_once(self.history, step, share)

    def scores(self, model, step: int) -> dict[str, float]:
        """``{"copied": share}`` for ``model`` at ``step`` (scored once a step; the stage's metric after phase 1)."""
        return {"copied": self.measure(model, step)}

    def histories(self) -> dict[str, list[tuple[int, float]]]:
        """``{"copied": history}``."""
        return {"copied": self.history}
