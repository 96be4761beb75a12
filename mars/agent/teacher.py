"""The scripted SFT teacher: an imperfect policy that reads its tools' real observations, with a skill knob.

What it does
    :func:`teacher_policy` returns a ``policy(dialogue) -> str`` for one question, played through the same engine,
    protocol and tools as a model (via :func:`mars.agent.oracle.scripted_backend`). Unlike the oracle
    (:mod:`mars.agent.oracle`), the teacher uses the world's ground truth only where a model has to use its eyes
    (where the red-framed emblem is, what the emblem in a crop shows); every name and fact it states is READ from
    the tool observations in the dialogue:

    - perception: ``image_zoom_in`` on the centre of the red-framed cell (:func:`~mars.agent.oracle.zone_zoom_box`:
      the central ``target_zone`` share of the cell, where the world puts the target), then ``<answer>`` the
      emblem's fill colour / shape / letter / pattern;
    - the zoom's ``<think>`` names what the question asks and the plan, and its ``label`` (:data:`ZOOM_LABEL`,
      echoed by the tool's observation right before the crop) differs by type: "framed region" before a
      perception answer, "emblem to search" before a multi-hop image search. Without that, an SFT model on
      length-grouped batches answered every multi-hop question after its zoom as if it were a perception question
      (no image search in 240 multi-hop episodes of its own training split; docs/findings.md);
    - search: ``image_search(img_idx=0)``, then ``text_search("<top-1 title's name> <fact keyword>")``, then the fact
      read from the snippet titled with that name (no snippet with it: an unsupported guess, which the judge then
      rejects);
    - multi-hop: zoom, ``image_search`` on the crop, ``text_search``, answer, as above.

    The skill knob (``sft.teacher_skill``; docs/training.md, SFT): with probability ``1 - skill``
    per decision the teacher makes a plausible mistake, then recovers: it zooms on the centre of ANOTHER cell
    first, looks at the crop, says the frame is not there and zooms again; or it sends a
    near-miss query (the name without the fact keyword, or the second image-search title) and searches again.
    The ``<think>`` text is drawn from several templates per step. Recovery turns make trajectories longer; a
    teacher that read a wrong name (image search's top-1 is wrong) answers wrongly, and the SFT stage keeps only
    trajectories the judge marks correct (rejection sampling, as the paper does with its teacher model).

Deviation
    The paper's teacher is a strong VLM; ours is scripted over a generated world. Its "eyes" (which cell is
    framed, the emblem's attributes) come from world truth; everything else comes from observations. It zooms
    on the framed cell's centre rather than the emblem's exact box (as a VLM teacher would): a 4-way choice the
    tiny student can learn, where regressing exact boxes from pixels was not (docs/design.md, The embedded default
    world; docs/findings.md).

How to run (Python)::
        backend = scripted_backend(questions, lambda q: teacher_policy(q, world, skill=0.8, seed=0), world_dir)
        trajs = run_episodes(questions, backend, toolbox, cfg, image_root=world_dir)
"""

from __future__ import annotations

import json
import re
from typing import Callable

import numpy as np

from mars.agent.oracle import (
    FACT_KEYWORD,
    World,
    _last_user_text,
    _n_assistant,
    _question_kind,
    final_turn,
    snippets_about,
    zone_zoom_box,
)
from mars.agent.protocol import format_tool_call
from mars.world.questions import attribute_value

__all__ = ["FACT_WORDS", "THINK", "ZOOM_LABEL", "asked_word", "teacher_policy", "titles_from_observation",
           "fact_from_observation"]

_TITLE_SUFFIX = re.compile(r"\s+(logo|emblem|crest|insignia|badge)$")
_YEAR = re.compile(r"\b(\d{4})\b")

ATTRIBUTE_WORDS = {"colour": "fill colour", "glyph": "letter"}  # how a think names a perception attribute
FACT_WORDS = {"founded_year": "founding year", "city": "city", "founder": "founder"}  # ... and a fact
# the zoom's label by question type: the tool's observation echoes it right before the crop, where the policy
# chooses between answering (perception) and searching (multi-hop)
ZOOM_LABEL = {"perception": "framed region", "multi-hop": "emblem to search"}


def asked_word(kind: str) -> str:
    """How a think names what a question asks: an attribute (:data:`ATTRIBUTE_WORDS`) or a fact
    (:data:`FACT_WORDS`); the two key sets are disjoint, anything else is named as it is."""
    return ATTRIBUTE_WORDS.get(kind) or FACT_WORDS.get(kind, kind)


THINK = {  # the teacher's <think> wordings per step (also used by the drills of mars.synth)
    "zoom": (  # perception; {kind}: ATTRIBUTE_WORDS
        "The emblem's {kind} is too small to see; zoom in on the red frame.",
        "To tell the {kind}, I need a closer look at the red frame.",
        "The red frame marks the emblem whose {kind} is asked; crop its centre.",
    ),
    "zoom_search": (  # multi-hop: the plan (zoom, then search) is stated before the zoom; {kind}: FACT_WORDS
        "The {kind} is not in the picture: zoom in on the framed emblem, then search for it.",
        "To find the {kind}, crop the framed emblem, then search for it.",
        "First zoom in on the framed emblem, then search for it to learn its {kind}.",
    ),
    "zoom_wrong": (
        "Zoom in on this region to see its emblem better.",
        "Let me look closer at one of the regions.",
    ),
    "rezoom": (
        "This crop is not inside the red frame; that was the wrong region. Zoom on the framed one.",
        "Wrong region: the red frame is elsewhere. Crop the middle of the framed region instead.",
    ),
    "rezoom_search": (
        "This crop is not inside the red frame; zoom on the framed emblem, then search for it.",
        "Wrong region: the red frame is elsewhere. Crop the framed emblem to search for it.",
    ),
    "image_search": (
        "Find out whose emblem this is.",
        "Search for similar images to identify the emblem.",
        "An image search should tell me which organisation this is.",
    ),
    "text_search": (
        "The image search says this is {name}; look up the fact.",
        "Top match: {name}. Search the text for it.",
        "It is {name}. Now find the {keyword} in the documents.",
    ),
    "requery": (
        "These snippets do not give the {keyword} of {name}; search again with a better query.",
        "Not the right documents. Search for {name} and its {keyword}.",
    ),
    "answer_fact": (
        "The snippet about {name} gives {value}.",
        "According to the document on {name}, the answer is {value}.",
    ),
    "answer_attr": (  # {kind}: ATTRIBUTE_WORDS
        "In the crop the emblem's {kind} is {value}.",
        "The zoomed emblem clearly shows the {kind}: {value}.",
    ),
}


def titles_from_observation(text: str) -> list[str]:
    """Entity names in an image_search observation (``[i] <name> logo`` lines), in rank order."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\[\d+\]\s*(.+)$", line.strip())
        if m and ":" not in m.group(1):
            out.append(_TITLE_SUFFIX.sub("", m.group(1).strip()))
    return out


def fact_from_observation(text: str, name: str, fact: str, pools: dict[str, list[str]]) -> str | None:
    """The fact about ``name`` read from a text_search observation, or None when no snippet titled ``name`` has it.

    Years are the first 4-digit number of the snippet; cities and founders the first known value (``pools``)
    the snippet mentions.
    """
    for snippet in snippets_about(text, name):
        if fact == "founded_year":
            y = _YEAR.search(snippet)
            if y:
                return y.group(1)
            continue
        hits = [(snippet.find(v), v) for v in pools.get(fact, ()) if re.search(r"\b" + re.escape(v) + r"\b", snippet)]
        if hits:
            return min(hits)[1]
    return None


def _obs_after(dialogue: list[dict], k: int) -> str:
    """Text of the user message that followed the k-th assistant turn (0-based)."""
    seen = -1
    for i, m in enumerate(dialogue):
        if m["role"] == "assistant":
            seen += 1
            if seen == k:
                return _last_user_text(dialogue[: i + 2]) if i + 1 < len(dialogue) else ""
    return ""


def _wrong_box(world: World, q: dict, rng: np.random.Generator) -> list[int]:
    """A plausible wrong zoom: the centre of another cell of the grid."""
    t = world.targets[q["scene_id"]]
    cells = [(r, c) for r in range(t["grid_rows"]) for c in range(t["grid_cols"])
             if (r, c) != (t["cell_row"], t["cell_col"])]
    return zone_zoom_box(t, cells[int(rng.integers(len(cells)))])


def teacher_policy(
    question_row: dict,
    world: World,
    *,
    skill: float = 1.0,
    seed: int | list[int] = 0,
    pools: dict[str, list[str]] | None = None,
) -> Callable[[list[dict]], str]:
    """An imperfect, observation-reading teacher for one question (see the module docstring).

    ``skill`` in [0, 1]: the chance of each decision being made right the first time. ``pools``: the known
    values of each fact (cities, founders) used to read them from snippets; built from ``world`` when omitted.
    """
    if not 0.0 <= skill <= 1.0:
        raise ValueError(f"skill must be in [0, 1], got {skill}")
    q = dict(question_row)
    qtype, kind = q["type"], _question_kind(q)
    truth = world.entities[q["entity_id"]]
    if pools is None:
        pools = {k: sorted({str(e[k]) for e in world.entities.values() if e.get(k) is not None})
                 for k in ("city", "founder")}
    seed_list = list(seed) if isinstance(seed, (list, tuple)) else [int(seed)]
    rng = np.random.default_rng(seed_list + [sum(map(ord, str(q["question_id"])))])
    # The plan is fixed up front (so the policy is a pure function of the turn number and the observations).
    wrong_zoom = qtype != "search" and rng.random() > skill
    wrong_query = qtype != "perception" and rng.random() > skill
    picks = {k: int(rng.integers(len(v))) for k, v in THINK.items()}
    wrong_box = _wrong_box(world, q, rng) if wrong_zoom else None
    keyword = FACT_KEYWORD.get(kind, kind)

    def think(key: str, **kw) -> str:
        return THINK[key][picks[key]].format(**kw)

    plan: list[str] = []
    if qtype in ("perception", "multi-hop"):
        zoom, rezoom = ("zoom", "rezoom") if qtype == "perception" else ("zoom_search", "rezoom_search")
        plan += (["zoom_wrong", rezoom] if wrong_zoom else [zoom])
    if qtype in ("search", "multi-hop"):
        plan += ["image_search"] + (["query_wrong", "requery"] if wrong_query else ["text_search"])
    plan.append("answer")
    crop_idx = 2 if wrong_zoom else 1  # image index of the right crop (image 0 is the question image)

    def name_seen(dialogue: list[dict]) -> str | None:
        k = plan.index("image_search")
        titles = titles_from_observation(_obs_after(dialogue, k))
        return titles[0] if titles else None

    def policy(dialogue: list[dict]) -> str:
        n = _n_assistant(dialogue)
        step = plan[min(n, len(plan) - 1)]
        if step in ("zoom", "zoom_search", "rezoom", "rezoom_search"):
            return format_tool_call("image_zoom_in", {"bbox_2d": zone_zoom_box(world.targets[q["scene_id"]]),
                                                      "label": ZOOM_LABEL[qtype], "img_idx": 0},
                                    think(step, kind=asked_word(kind)))
        if step == "zoom_wrong":
            return format_tool_call("image_zoom_in", {"bbox_2d": wrong_box, "label": "region", "img_idx": 0},
                                    think("zoom_wrong"))
        if step == "image_search":
            idx = 0 if qtype == "search" else crop_idx
            return format_tool_call("image_search", {"img_idx": idx}, think("image_search"))
        name = name_seen(dialogue) if "image_search" in plan else None
        if step in ("text_search", "query_wrong", "requery"):
            if name is None:
                return final_turn(q, "unknown", "The image search found nothing I can use.")
            if step == "query_wrong":
                k = plan.index("image_search")
                titles = titles_from_observation(_obs_after(dialogue, k))
                query = titles[1] if len(titles) > 1 and rng.random() < 0.5 else name
                return format_tool_call("text_search", {"query": query}, think("text_search", name=query, keyword=keyword))
            label = "requery" if step == "requery" else "text_search"
            return format_tool_call("text_search", {"query": f"{name} {keyword}"},
                                    think(label, name=name, keyword=keyword))
        # answer
        if qtype == "perception":
            value = str(attribute_value(json.loads(truth["emblem"]), kind))
            return final_turn(q, value, think("answer_attr", kind=ATTRIBUTE_WORDS.get(kind, kind), value=value))
        value = fact_from_observation(_obs_after(dialogue, n - 1), name or "", kind, pools) if name else None
        if value is None:
            return final_turn(q, "unknown", "The documents do not say; I cannot tell.")
        return final_turn(q, value, think("answer_fact", name=name, value=value))

    return policy
