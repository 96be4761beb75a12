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
    - ``chain`` (a ``chain_share`` of the title drills, ``sft.drill_chains``): the title drill goes on, as an
      episode does: the real ``text_search`` observation for that query comes back as a tool turn and the reply
      answers the question of the first turn (the fact about the top-1 title, read as in a fact drill). In an
      episode the question sits turns before the answer; in a fact drill it sits right before it, and the SFT
      model's answers in episodes named the wrong fact or the wrong format (a letter for an open question) even
      when the snippet held the answer (README, search chain). Measured with half the title drills as chains
      (README, run I): the episodes' answers kept the asked fact and format more often, but phase 1 took 50% more
      time and read fewer held-out facts, and accuracy did not rise: off by default.

    :func:`copy_drills` (optional, ``sft.pretrain_copy``): the user lists 2-5 fresh names and the reply repeats
    them, a pure copy task. Measured (README): 4,000 of them beside the 4,000 reading drills did not raise the
    held-out copy rate in 2,000 steps, and their own loss stayed high: the tiny model learns to copy a name of
    several tokens slowly, whatever the drill.

    :class:`CopyCheck` (``sft.pretrain_target``): phase 1's stopping check, the share of held-out drills (drawn
    with another seed) whose greedy reply does what the teacher's does (:func:`copied`: the same query, or the same
    answer).

    The tools are called once per gallery rendering and per query (they are deterministic; the renaming makes
    every drill new), so thousands of drills cost little more than the distinct observations.

    Observations are wrapped exactly as in an episode (:func:`mars.agent.protocol.format_tool_response`), and the
    replies use the teacher's wording, so the circuits learned here are the ones the agentic trajectories use.

    ``fresh_names`` (the default): every organisation word and founder name in a drill (observation, question,
    options and reply alike) is replaced, consistently within the drill, by a freshly generated word
    (:func:`mars.world.text.make_word`, the world's own syllables). Years, cities and kinds are kept. The copy
    relations stay exact (the query still starts with the top title; the answer is still in the snippet), but no
    name is ever seen twice, so the model cannot memorise name -> fact or name -> name and has to copy. Measured on
    the default world (README): without it the SFT model wrote a plausible training name ("Eros Observatory" for
    "Ecamtes Observatory") and copied 12 of 51 held-out titles despite a drill loss of 0.03.

    ``rename_from="world"`` (``sft.drill_names: world``) draws the stand-ins from the world's own organisation
    and founder words instead, so that at a vocabulary holding every world word as one token (6,144) each
    stand-in is a trained single token. Measured (README): it copies worse (0 of 51 held-out titles after 2,000
    steps, from the world's 1,346 words or from 300 of them): the model copies the first title's kind but not its
    word, so the default stays ``"new"``.

    :func:`rename_dialogues` (``sft.trajectory_names``) applies the same renaming to whole dialogues, the teacher
    trajectories of phase 2: no real name is trained on, so none can be recalled instead of copied. Measured
    (README, "search chain"): the SFT model's queries copied the top-1 title in 41% of search and multi-hop episodes
    (11-16% in three runs with real names) and the answer was in the text-search result in 38% (10-18%), but it
    answered only a fifth of those right, and its accuracy did not rise (10.8% against 15.8%): off by default.

Deviation from the paper (and why)
    The paper's policy starts from an LLM that can already copy a name from its context. The embedded default's
    language model is random-init, and measured on the default world it did not learn to copy from ~700 teacher
    trajectories in 600 steps: it answered with names memorised from training. In a text-only probe the same
    model learned copying (98% on unseen names) after about 1,500 steps on thousands of varied examples, which
    the multimodal trajectories (about 10x the cost per step) cannot afford. These drills, with the gallery
    captions (:mod:`mars.synth.captions`), are the default's stand-in for base-model pre-training; they run as a
    cheap first phase of the ``sft`` stage (``sft.pretrain_steps``) and are off for a pretrained checkpoint.

How to run (Python)::

    drills = reading_drills(toolbox, entities, gallery, gallery_dir, n=3000, seed=0, exclude_entities=test_ids)
    copies = copy_drills(entities, n=1000, seed=0)
    renamed = rename_dialogues([t.messages for t in trajectories], entities, seed=0)
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
from mars.world.text import KINDS, entity_name, make_word

__all__ = ["COPY_PROMPT", "RENAME_SOURCES", "CopyCheck", "copied", "copy_drills", "drill_kind", "reading_drills",
           "rename_dialogues", "scored_once"]

COPY_PROMPT = "Repeat these names in order:"
RENAME_SOURCES = ("new", "world")


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
    chain_share: float = 0.0,
    fresh_names: bool = True,
    rename_from: str = "new",
) -> list[list[dict]]:
    """``n`` drill dialogues (text only; ``[user, assistant]``, four messages for a chain); see the module
    docstring. A ``chain_share`` of the title drills go on to the text search and the answer.

    ``toolbox``: a :class:`mars.tools.toolbox.ToolBox` (its ``text_search`` and ``image_search`` are called);
    ``entities``: ENTITIES rows (real ones are used: ``is_distractor`` false); ``gallery``: GALLERY rows;
    ``rename_from`` (with ``fresh_names``): ``"new"`` (generated words) or ``"world"`` (the world's own words).
    """
    if n < 0:
        raise ValueError(f"the number of reading drills must be >= 0, got {n}")
    for k, v in {"mcq_share": mcq_share, "title_share": title_share, "chain_share": chain_share}.items():
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
    rename = _Renamer(entities, np.random.default_rng([seed, 38]), rename_from) if fresh_names else None
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
            if chain_share and rng.random() < chain_share:  # a chain: the question's answer comes two turns later
                found = _read(toolbox, text_obs, query, titles[0], fact, pools)
                if found is None:
                    continue
                text, answer = _fact_qa(base, fact, titles[0], found[1], pools, rng if mcq else None)
                out.append(_dialogue(obs.text, text, reply, rename, more=(found[0], answer)))
                continue
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

    def __init__(self, entities: list[dict], rng: np.random.Generator, source: str = "new"):
        if source not in RENAME_SOURCES:
            raise ValueError(f"rename_from must be one of {RENAME_SOURCES}, got {source!r}")
        words = set()
        for e in entities:
            kind = str(e.get("kind", ""))
            name = str(e["name"])
            words.add(name[: -len(kind) - 1] if kind and name.lower().endswith(" " + kind.lower()) else name)
            words.update(str(e.get("founder", "")).split())
        words.discard("")
        self.known = words
        self.rng = rng
        self.pool = sorted(words) if source == "world" else None
        alternation = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        self.pattern = re.compile(rf"\b(?:{alternation})\b")

    def fresh(self, used: set[str]) -> str:
        if self.pool is not None:  # a world word not yet used in this drill
            if len(used) >= len(self.pool):
                raise ValueError(f"a drill names more than the world's {len(self.pool)} words; generate a larger world")
            while True:
                w = self.pool[int(self.rng.integers(len(self.pool)))]
                if w not in used:
                    used.add(w)
                    return w
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


def _dialogue(observation: str, question: str, reply: str, rename: _Renamer | None,
              more: tuple[str, ...] = ()) -> list[dict]:
    """``[user (observation + question), assistant (reply)]``, then for a chain ``more`` = [the next observation,
    the next reply] as a tool turn and an assistant turn; renamed consistently across all of them."""
    texts = [observation, question, reply, *more]
    if rename is not None:
        texts = rename(texts)
    out = [_user(texts[0], texts[1]), {"role": "assistant", "content": texts[2]}]
    for obs, turn in zip(texts[3::2], texts[4::2]):
        out += [{"role": "user", "content": [{"type": "text", "text": format_tool_response(obs)}]},
                {"role": "assistant", "content": turn}]
    return out


def rename_dialogues(dialogues: list[list[dict]], entities: list[dict], *, seed: int = 0,
                     rename_from: str = "new") -> list[list[dict]]:
    """The same dialogues with every organisation word and founder name in their user and assistant text replaced
    by a stand-in (as in the drills: consistently within a dialogue, a fresh set for each); system messages and
    images are kept as they are (images are shared, not copied). ``sft.trajectory_names: new`` applies this to the
    teacher trajectories, so that phase 2 never shows a real name and the only way to its names is copying.

    Deviation: the trajectories stay real tool observations up to a consistent renaming of their text (the stored
    ``trajectories.parquet`` keeps the real names); the paper's pretrained model needs no such help.
    """
    rename = _Renamer(entities, np.random.default_rng([seed, 41]), rename_from)
    out: list[list[dict]] = []
    for dialogue in dialogues:
        slots: list[tuple[int, int | None]] = []  # (message, part or None for a string content)
        texts: list[str] = []
        for i, m in enumerate(dialogue):
            if m["role"] == "system":
                continue
            if isinstance(m["content"], str):
                slots.append((i, None))
                texts.append(m["content"])
            else:
                for j, part in enumerate(m["content"]):
                    if part.get("type") == "text":
                        slots.append((i, j))
                        texts.append(part["text"])
        new = [dict(m, content=list(m["content"]) if isinstance(m["content"], list) else m["content"])
               for m in dialogue]
        for (i, j), text in zip(slots, rename(texts)):
            if j is None:
                new[i]["content"] = text
            else:
                new[i]["content"][j] = dict(new[i]["content"][j], text=text)
        out.append(new)
    return out


def copy_drills(entities: list[dict], *, n: int, seed: int = 0, names: tuple[int, int] = (2, 5),
                rename_from: str = "new") -> list[list[dict]]:
    """``n`` pure copy dialogues: the user lists ``names[0]..names[1]`` fresh organisation and founder names, the
    reply repeats them in order, in its thinking and in the answer (every reply token after the first is a copy).

    The names are new words in the world's syllables (never an entity's or founder's word), organisations with
    the world's kinds. Deviation: a curriculum step of the default's stand-in pre-training (module docstring),
    measured in the README; the paper's pretrained model needs none.
    """
    if n < 0:
        raise ValueError(f"the number of copy drills must be >= 0, got {n}")
    if not 1 <= names[0] <= names[1]:
        raise ValueError(f"names must be a range 1 <= low <= high, got {names}")
    words = _Renamer(entities, np.random.default_rng([seed, 39]), rename_from)
    rng = np.random.default_rng([seed, 40])
    out: list[list[dict]] = []
    for _ in range(n):
        listed: list[str] = []
        used: set[str] = set()
        for _ in range(int(rng.integers(names[0], names[1] + 1))):
            if rng.random() < 0.7:  # an organisation, as a title is copied into a query
                listed.append(entity_name(words.fresh(used), KINDS[int(rng.integers(len(KINDS)))]))
            else:  # a founder, as a fact is copied into an answer
                listed.append(f"{words.fresh(used)} {words.fresh(used)}")
        names_text = ", ".join(listed)
        user = {"role": "user", "content": [{"type": "text", "text": f"{COPY_PROMPT} {names_text}."}]}
        out.append([user, {"role": "assistant", "content": format_answer(names_text, f"In order: {names_text}.")}])
    return out


def drill_kind(dialogue: list[dict]) -> str:
    """``"title"``, ``"fact"``, ``"chain"`` (:func:`reading_drills`) or ``"copy"`` (:func:`copy_drills`): which
    drill a dialogue is (for reports and tests)."""
    if dialogue[0]["content"][0]["text"].startswith(COPY_PROMPT):
        return "copy"
    if len(dialogue) > 2:
        return "chain"
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
    entry is already that step's (:class:`CopyCheck`, :class:`mars.synth.locate.LocateCheck`: the stage's metric
    after a phase reuses the check its last step just ran)."""
    if not history or history[-1][0] != step:
        history.append((step, round(score(), 4)))
    return history[-1][1]


class CopyCheck:
    """Phase 1's stopping check (:func:`mars.train.sft.train_sft`'s ``until``): True once the model's greedy reply
    to at least ``target`` (a share) of held-out ``drills`` (:func:`reading_drills` drawn with another seed: fresh
    names, so nothing can be recalled) is :func:`copied` right. Not asked before ``min_step``, nor ever with
    ``target`` 0 (it returns False there without generating; :meth:`measure` still scores the model). ``history``
    keeps (step, copied share) of every check it ran."""

    def __init__(self, processor, drills: list[list[dict]], *, target: float, min_step: int = 0,
                 max_new_tokens: int = 96) -> None:
        if not drills or not 0.0 <= target <= 1.0:
            raise ValueError(f"a copy check needs held-out drills and 0 <= target <= 1, got {len(drills)} drills, "
                             f"target {target}")
        self.processor, self.target, self.min_step, self.max_new_tokens = processor, target, min_step, max_new_tokens
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
        """Every check's (step, share): ``copied``."""
        return {"copied": self.history}

    def __call__(self, model, step: int) -> bool:
        return bool(self.target) and step >= self.min_step and self.measure(model, step) >= self.target
