"""Localisation drills: "zoom on the red frame" first turns over freshly drawn scenes (SFT pre-training).

What it does
    :func:`locate_dialogues` draws ``n`` new scenes with the world's scene generator
    (:func:`mars.world.scenes.render_scene`, the world's grid, frame, clutter and target zone, random emblems that
    belong to no entity, coloured with the scene knobs' ``schemes`` when it has them) at about twice the policy's
    view, and writes one-turn dialogues: the user turn holds the scene and a perception or multi-hop question (the
    synthesize stage's templates; the perception questions ask about one of ``attributes``, those the synthesized
    questions ask), the assistant turn is the teacher's first move, ``image_zoom_in`` on the framed cell's target zone
    (:func:`mars.agent.oracle.zone_zoom_box`) with one of the teacher's ``<think>`` wordings for the question's
    type and its zoom label (:data:`mars.agent.teacher.ZOOM_LABEL`: the plan, answer or search, is stated before
    the zoom, as the teacher does). By default nothing after the zoom is written: the drill teaches where to look,
    and the agentic trajectories teach the rest. With ``answer_share`` > 0 (``sft.locate_answers``) that share of
    the perception drills are whole perception episodes: the zoom's observation as the zoom tool words it
    (:func:`mars.tools.toolbox.zoom_text`) with a crop of the framed emblem drawn at a zoom's scale
    (:func:`mars.train.captions.zoom_crop`; the drawn scene is too small to crop it from) and the teacher's answer,
    the target's own value, so localisation and reading are practised in the episode's own context.

Deviation from the paper (and why)
    The paper's Qwen2.5-VL already localises a described region. The embedded default's vision tower is random-init and
    finding the framed cell was measured to take 500-1,000 steps at batch 16, each with a framed scene. The sft split
    has a few dozen scenes and a few hundred trajectories, and with the previous defaults the SFT checkpoint's first
    zoom hit the framed cell at chance (24 of 80 test episodes against 20 by chance; docs/findings.md). These drills are
    cheap (one 224-px view, a ~100-token dialogue; 7 ms to draw) and every one draws a new scene, so the cue, not a
    scene, is what can be learned. They stand in for the base model's grounding pre-training (``sft.pretrain_locate``; 0
    for a pretrained ``init_checkpoint``).

    Measured (docs/findings.md): with the old ``sft.vision_lr`` of 0.01 they did not teach the framed cell (the tower
    stayed at chance: ``probes/probe_locate.py`` shows a random-init tower never leaves 25% at 0.01 and reaches 100% of
    held-out scenes in about 150 steps at 1e-3 .. 3e-3). At 0.002, 400 steps of these drills alone put 43-46 of 80 first
    zooms on new scenes in the framed cell (chance 20). Mixed into phase 1 they did not carry over (25 of 80 test scenes
    after the pipeline); in a block of their own after phase 1 (``sft.locate_steps``: 600 steps on 2,000 drills) the SFT
    model's first zoom hit the framed cell in 74 of 80, but in other runs the block missed it (30-35 of 80). Now the
    tower first learns the framed cell of these drills' scenes directly (sft phase 0, ``sft.vision_locate_steps``:
    :func:`mars.train.vision.cell_data`), and a 300-step block framed 80 of 80.

How to run (Python)::

    dialogues = locate_dialogues(WorldSpec().scene_config(), n=1000, seed=0, system=compact_system_prompt(schemas))
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from PIL import Image

from mars.agent.oracle import zone_zoom_box
from mars.agent.protocol import format_tool_call
from mars.agent.teacher import THINK, ZOOM_LABEL, asked_word
from mars.train.data import in_view
from mars.train.drills import scored_once
from mars.world.emblems import random_emblem
from mars.world.questions import (ATTRIBUTES, FACT_QUESTIONS, FACTS, FRAMED_SUBJECT, MULTIHOP_SUBJECT,
                                  PERCEPTION_QUESTIONS, attribute_value, check_attributes, question_text)
from mars.world.scenes import SceneConfig, render_scene, scene_size

__all__ = ["LOCATE_LONG_SIDE", "LocateCheck", "framed_count", "held_out_drills", "held_out_reads", "locate_dialogues",
           "located_cell", "read_count", "zoom_cell", "zooms_on_scene"]

LOCATE_LONG_SIDE = (448, 672)  # scenes are drawn at about twice the policy's 224-px view (a 4K scene costs 50x)
_EMBLEM_POOL = 64  # random emblems the drawn scenes pick from (clutter for the cue; their identity is never asked)


def locate_dialogues(
    scene: SceneConfig,
    *,
    n: int,
    seed: int = 0,
    system: str | None = None,
    mcq_share: float = 0.5,
    perception_share: float = 0.5,
    long_side: tuple[int, int] = LOCATE_LONG_SIDE,
    attributes: Sequence[str] | None = None,
    answer_share: float = 0.0,
    view: Callable[[Image.Image], Image.Image] | None = None,
) -> list[list[dict]]:
    """``n`` dialogues ``[system?, user: scene + question, assistant: the zoom call]``; see the module docstring.
    With ``answer_share`` > 0 that share of the perception drills (asking an attribute the target emblem has) go on
    to the zoom's observation (the toolbox's text and a crop of the target emblem at a zoom's scale,
    :func:`mars.train.captions.zoom_crop`) and the teacher's answer turn: whole perception episodes on new scenes
    (the question then asks about the target's real value). The scenes drawn do not depend on it.

    ``scene``: the world's scene knobs (:meth:`mars.world.generate.WorldSpec.scene_config`); its long-side bounds
    are replaced by ``long_side``. ``system``: the episodes' system prompt, so the drill's context matches theirs.
    ``attributes``: what the perception questions may ask (keys of :data:`mars.world.questions.ATTRIBUTES`, all by
    default), so the drills ask what the synthesized questions ask.
    """
    if n < 0:
        raise ValueError(f"the number of localisation drills must be >= 0, got {n}")
    attributes = check_attributes(attributes)
    if not (0.0 <= mcq_share <= 1.0 and 0.0 <= perception_share <= 1.0 and 0.0 <= answer_share <= 1.0):
        raise ValueError(f"mcq_share, perception_share and answer_share must be in [0, 1], got {mcq_share}, "
                         f"{perception_share}, {answer_share}")
    if n == 0:
        return []
    rng = np.random.default_rng([seed, 41])
    answer_rng = np.random.default_rng([seed, 47])  # its own stream: the drawn scenes do not depend on answer_share
    pool = [random_emblem(rng, scene.schemes) for _ in range(max(_EMBLEM_POOL, scene.emblems_max))]
    years = [str(y) for y in range(1700, 2021)]
    out: list[list[dict]] = []
    for _ in range(n):
        size = scene_size(rng, long_side[0], long_side[1], scene.grid_rows, scene.grid_cols)
        image, info = render_scene(rng, scene, pool, size=size)
        mcq = bool(rng.random() < mcq_share)
        qtype = "perception" if rng.random() < perception_share else "multi-hop"
        answered = None  # (attribute, its value on the target emblem, choices) of a drill that goes on to answer
        if qtype == "perception":
            attr = attributes[int(rng.integers(len(attributes)))]
            values = list(ATTRIBUTES[attr])
            base = PERCEPTION_QUESTIONS[attr].format(subject=FRAMED_SUBJECT)
            value = values[int(rng.integers(len(values)))]
            target = pool[next(p.entity_index for p in info.placements if p.is_target)]
            has = [a for a in attributes if attribute_value(target, a) is not None]
            answer = bool(answer_share and has and answer_rng.random() < answer_share)
            if answer:
                if attr not in has:  # the target has no glyph or no pattern: ask what it has
                    attr = has[int(answer_rng.integers(len(has)))]
                    values = list(ATTRIBUTES[attr])
                    base = PERCEPTION_QUESTIONS[attr].format(subject=FRAMED_SUBJECT)
                value = attribute_value(target, attr)
            text, choices, _ = question_text(base, attr, value, values, rng if mcq else None)
            if answer:
                answered = (attr, value, choices)
        else:  # the options of a multi-hop question are never read before the zoom: years stand in for them
            fact = FACTS[int(rng.integers(len(FACTS)))]
            values = years
            base = FACT_QUESTIONS[fact].format(subject=MULTIHOP_SUBJECT)
            text, _, _ = question_text(base, fact, values[int(rng.integers(len(values)))], values,
                                       rng if mcq and fact == "founded_year" else None)
        truth = {"scene_width": info.width, "scene_height": info.height, "grid_rows": info.grid_rows,
                 "grid_cols": info.grid_cols, "cell_row": info.target_cell[0], "cell_col": info.target_cell[1],
                 "target_zone": info.target_zone}
        wordings = THINK["zoom" if qtype == "perception" else "zoom_search"]
        asked = asked_word(attr if qtype == "perception" else fact)
        think = wordings[int(rng.integers(len(wordings)))].format(kind=asked)
        reply = format_tool_call("image_zoom_in", {"bbox_2d": zone_zoom_box(truth), "label": ZOOM_LABEL[qtype],
                                                   "img_idx": 0}, think)
        dialogue = [{"role": "system", "content": system}] if system else []
        dialogue += [
            {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]},
            {"role": "assistant", "content": reply},
        ]
        if answered is not None:
            dialogue += _answer_turns(scene, answered, target, zone_zoom_box(truth), answer_rng)
        out.append(in_view(dialogue, view))  # each drill's images in the policy's view as it is drawn
    return out


def _answer_turns(scene: SceneConfig, answered: tuple, target: dict, box: list[int],
                  rng: np.random.Generator) -> list[dict]:
    """The zoom's observation (the toolbox's text, a crop of the ``target`` emblem at a zoom on ``scene``'s
    target zone) and the teacher's answer turn for a perception drill asking ``answered`` (attribute, value,
    choices)."""
    from mars.agent.oracle import final_turn
    from mars.agent.protocol import format_tool_response
    from mars.train.captions import zoom_crop
    from mars.tools.toolbox import zoom_text

    attr, value, choices = answered
    crop, _ = zoom_crop(scene, rng, spec=target)
    wordings = THINK["answer_attr"]
    think = wordings[int(rng.integers(len(wordings)))].format(kind=asked_word(attr), value=value)
    return [
        {"role": "user", "content": [{"type": "text", "text": format_tool_response(zoom_text(ZOOM_LABEL["perception"],
                                                                                                0, box, 1), 1)},
                                     {"type": "image", "image": crop}]},
        {"role": "assistant", "content": final_turn({"choices": choices}, value, think)},
    ]


def located_cell(box: list[float], grid_rows: int, grid_cols: int) -> tuple[int, int]:
    """The grid cell (row, col) holding the centre of a relative (0..1000) ``bbox_2d``: which cell a zoom chose."""
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return (min(grid_rows - 1, max(0, int(cy * grid_rows // 1000))),
            min(grid_cols - 1, max(0, int(cx * grid_cols // 1000))))


def zooms_on_scene(turn) -> bool:
    """Whether a parsed turn (:func:`mars.agent.protocol.parse_turn`) is an ``image_zoom_in`` call on image 0 (the
    question's scene), well formed or not."""
    return turn.action == "tool_call" and turn.tool_name == "image_zoom_in" and turn.arguments.get("img_idx", 0) == 0


def zoom_cell(turn, grid_rows: int, grid_cols: int) -> tuple[int, int] | None:
    """The cell (:func:`located_cell`) an ``image_zoom_in`` call on image 0 chose, for a parsed turn
    (:func:`mars.agent.protocol.parse_turn`); None when the turn is no such call (:func:`zooms_on_scene`) or its
    ``bbox_2d`` is malformed (a model's malformed call is a miss, not a crash)."""
    if not zooms_on_scene(turn):
        return None
    try:
        return located_cell([float(v) for v in turn.arguments.get("bbox_2d")], grid_rows, grid_cols)
    except (TypeError, ValueError, IndexError):
        return None


def held_out_drills(scene: SceneConfig, n: int, seed: int, system: str | None = None,
                    attributes: Sequence[str] | None = None
                    ) -> tuple[list[list[dict]], list[tuple[int, int] | None]]:
    """``n`` localisation drills on new scenes (draw them with another ``seed`` than training's) without their
    answer turn, and the teacher's cell of each: the prompts a localisation check asks a model."""
    from mars.agent.protocol import parse_turn

    drills = locate_dialogues(scene, n=n, seed=seed, system=system, attributes=attributes)
    return ([d[:-1] for d in drills],
            [zoom_cell(parse_turn(d[-1]["content"]), scene.grid_rows, scene.grid_cols) for d in drills])


def framed_count(model, processor, scene: SceneConfig, prompts: list[list[dict]],
                 truth: list[tuple[int, int] | None], max_new_tokens: int = 96) -> int:
    """How many of ``prompts`` (:func:`held_out_drills`) a Qwen-VL ``model``'s greedy first turn zooms into the
    teacher's cell of (a malformed or other turn is a miss)."""
    from mars.agent.hf_backend import HFBackend
    from mars.agent.protocol import parse_turn

    outs = HFBackend(model, processor).generate(prompts, max_new_tokens=max_new_tokens)
    return sum(t is not None and zoom_cell(parse_turn(o.text), scene.grid_rows, scene.grid_cols) == t
               for o, t in zip(outs, truth))


def held_out_reads(scene: SceneConfig, n: int, seed: int, system: str | None = None,
                   attributes: Sequence[str] | None = None, mcq_share: float = 0.5
                   ) -> tuple[list[list[dict]], list[str]]:
    """``n`` answered perception drills (``answer_share`` 1) on new scenes without their answer turn, and the
    teacher's answer of each (a value, or an option's letter; ``mcq_share`` of the questions are multiple-choice):
    the prompts that score reading a right zoom's crop apart from finding it (the teacher's zoom and its crop are in
    the prompt)."""
    from mars.agent.protocol import parse_turn

    prompts: list[list[dict]] = []
    answers: list[str] = []
    for k in range(100):  # a target without any asked attribute (no glyph for a letter-only draw) is not answered
        for d in locate_dialogues(scene, n=n, seed=seed + 1000 * k, system=system, attributes=attributes,
                                  perception_share=1.0, answer_share=1.0, mcq_share=mcq_share):
            if len(prompts) < n and sum(m["role"] == "assistant" for m in d) == 2:
                prompts.append(d[:-1])
                answers.append(str(parse_turn(d[-1]["content"]).answer))
        if len(prompts) == n:
            return prompts, answers
    raise ValueError(f"only {len(prompts)} of {n} drawn scenes have a target with one of the attributes "
                     f"{attributes}; ask about more attributes")


def read_count(model, processor, prompts: list[list[dict]], answers: list[str], max_new_tokens: int = 64) -> int:
    """How many of ``prompts`` (:func:`held_out_reads`) a Qwen-VL ``model``'s greedy answer turn answers as the
    teacher did (case and surrounding space ignored; a malformed turn is a miss)."""
    from mars.agent.hf_backend import HFBackend
    from mars.agent.protocol import parse_turn

    outs = HFBackend(model, processor).generate(prompts, max_new_tokens=max_new_tokens)
    got = [parse_turn(o.text).answer for o in outs]
    return sum(g is not None and g.strip().lower() == a.strip().lower() for g, a in zip(got, answers))


class LocateCheck:
    """A stopping check for training on localisation drills (:func:`mars.train.sft.train_sft`'s ``until``): True
    once the model's greedy first zoom frames at least ``target`` (a share) of ``n`` held-out scenes
    (:func:`held_out_drills`) and, with ``read_target`` > 0, its greedy answer after the teacher's right zoom is the
    teacher's on at least that share of ``n`` held-out answered drills (:func:`held_out_reads`, open questions: the
    value read from the crop, not an option's letter, which the tiny models answer at chance; asked only once the
    frame holds: the read is the slower link, and a check that fails on the frame costs one generation). Not asked
    before ``min_step``. ``history`` keeps (step, framed share) of every check, ``reads`` (step, read share); a reply
    is cut at ``max_new_tokens`` (a zoom call longer than that is a miss)."""

    def __init__(self, processor, scene: SceneConfig, *, n: int, target: float, seed: int,
                 system: str | None = None, attributes: Sequence[str] | None = None, read_target: float = 0.0,
                 min_step: int = 0, max_new_tokens: int = 96) -> None:
        if n < 1 or not 0.0 < target <= 1.0 or not 0.0 <= read_target <= 1.0:
            raise ValueError(f"a localisation check needs n >= 1, 0 < target <= 1 and 0 <= read_target <= 1, got "
                             f"{n}, {target}, {read_target}")
        self.processor, self.scene, self.target = processor, scene, target
        self.read_target, self.min_step, self.max_new_tokens = read_target, min_step, max_new_tokens
        self.prompts, self.truth = held_out_drills(scene, n, seed, system, attributes)
        self.reading, self.answers = (held_out_reads(scene, n, seed, system, attributes, mcq_share=0.0)
                                      if read_target else ([], []))
        self.history: list[tuple[int, float]] = []
        self.reads: list[tuple[int, float]] = []

    def framed(self, model, step: int) -> float:
        """The share of the held-out scenes ``model`` frames, recorded in ``history`` for ``step`` (once a step)."""
        return scored_once(self.history, step, lambda: framed_count(
            model, self.processor, self.scene, self.prompts, self.truth, self.max_new_tokens) / len(self.prompts))

    def read(self, model, step: int) -> float:
        """The share of the held-out answered drills ``model`` answers as the teacher, recorded in ``reads`` for
        ``step`` (once a step)."""
        if not self.reading:
            raise ValueError("this localisation check has no read drills: give it read_target > 0")
        return scored_once(self.reads, step, lambda: read_count(
            model, self.processor, self.reading, self.answers, self.max_new_tokens) / len(self.reading))

    def scores(self, model, step: int) -> dict[str, float]:
        """Each link's share for ``model`` at ``step`` (each scored once a step): ``framed``, and ``read`` with
        ``read_target`` > 0 (the stage's metrics after the block)."""
        return {"framed": self.framed(model, step), **({"read": self.read(model, step)} if self.read_target else {})}

    def histories(self) -> dict[str, list[tuple[int, float]]]:
        """Every check's (step, share) per link: ``framed`` and ``read``."""
        return {"framed": self.history, "read": self.reads}

    def __call__(self, model, step: int) -> bool:
        if step < self.min_step or self.framed(model, step) < self.target:
            return False
        return not self.read_target or self.read(model, step) >= self.read_target
