"""The data of the cold start's phases: teacher trajectories and the drills drawn anew.

What it does
    :func:`teacher_trajectories` plays the sft split with the scripted teacher (:mod:`mars.agent.teacher`) or an
    OpenAI-compatible endpoint through the shared rollout engine and the real tools, keeping correct, well-formed
    episodes. :func:`pretrain_dialogues` and :func:`check_drills` draw phase 1's reading drills over real tool
    outputs (:mod:`mars.train.drills`) and its held-out check; :func:`locate_block_dialogues` the localisation
    block's vision drills (:mod:`mars.train.locate`, :func:`mars.train.captions.zoom_captions`), and
    :func:`frame_stage_dialogues` the block's first stage's share of them. :func:`play_and_draw` runs the teacher here
    while a worker process draws the rest. :func:`world_colours` colours the drawn emblems as the world's are.
    No drill or caption is about an entity of a test question.

Run the tests: ``.venv/bin/python -m pytest tests/train tests/stages -q``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from mars.agent.config import AgentParams
from mars.agent.protocol import content_text
from mars.data.io import read_table
from mars.data.schemas import ENTITIES
from mars.train.cold_start import SFTParams
from mars.world.questions import asked_attributes
from mars.world.scenes import SceneConfig

__all__ = ["teacher_trajectories", "tokenizer_texts", "pretrain_dialogues", "reading_dialogues", "play_and_draw",
           "check_drills", "locate_block_dialogues", "PolicyView", "agent_view", "vision_drills",
           "frame_stage_dialogues", "world_colours", "check_scene"]
TEACHER_CHUNK = 64  # teacher episodes played at once (bounds the memory of full-resolution scenes)
log = logging.getLogger(__name__)


def teacher_trajectories(params: SFTParams, agent: AgentParams, questions: list[dict], image_root: Path,
                         world_dir: Path, index_dir: Path) -> tuple[list, dict]:
    """Run the teacher on the sft questions; keep correct, well-formed episodes (at most n_trajectories)."""
    from mars.agent.engine import run_episodes
    from mars.agent.oracle import World, scripted_backend
    from mars.agent.teacher import teacher_policy

    toolbox = agent.toolbox(index_dir, world_dir / "gallery")
    if params.teacher == "scripted":
        world = World.from_dir(world_dir)
        backend = scripted_backend(
            questions, lambda q: teacher_policy(q, world, skill=params.teacher_skill, seed=params.seed), image_root)
    else:
        from mars.agent.backends import OpenAIBackend

        backend = OpenAIBackend(params.teacher_base_url, params.teacher_model)
    t0 = time.perf_counter()
    trajs = []
    # in chunks: every active episode holds its full-resolution scene (25 MB at 4K) for the tools
    for s in tqdm(range(0, len(questions), TEACHER_CHUNK), desc="teacher", unit="chunk", leave=False):
        trajs += run_episodes(questions[s : s + TEACHER_CHUNK], backend, toolbox, agent.engine(), seed=params.seed,
                              image_root=image_root, weights=agent.weights())
    good = [t for t in trajs if t.correct and t.reward_format > 0]
    kept = good[: params.n_trajectories]
    stats = {
        "teacher_episodes": len(trajs),
        "teacher_accuracy": round(sum(t.correct for t in trajs) / max(len(trajs), 1), 4),
        "trajectories": len(kept),
        "teacher_s": round(time.perf_counter() - t0, 1),
    }
    if not kept:
        raise RuntimeError(f"the teacher solved none of {len(trajs)} sft questions; nothing to train on")
    return kept, stats


def tokenizer_texts(world_dir: Path, questions: list[dict], trajs: list, system: str) -> list[str]:
    """What the local tokenizer is fitted to: corpus, names, questions, teacher dialogues, protocol (fitted without
    the teacher's turns, the model copied names less: docs/findings.md)."""
    from mars.data.schemas import CORPUS

    texts = [r["title"] + " " + r["text"] for r in read_table(world_dir / "corpus.parquet", CORPUS).to_pylist()]
    texts += [r["name"] for r in read_table(world_dir / "entities.parquet", ENTITIES).to_pylist()]
    texts += [q["question"] for q in questions]
    for t in trajs:
        texts += [content_text(m["content"], " ") for m in t.messages]
    texts += [system] * 20
    return texts


def pretrain_dialogues(params: SFTParams, agent: AgentParams, world_dir: Path, index_dir: Path,
                       all_questions: list[dict], scene: SceneConfig | None = None, system: str | None = None
                       ) -> list[list[dict]]:
    """Phase 1's data: ``pretrain_drills`` reading drills (:mod:`mars.train.drills`), never about an entity of a
    test question, and, without a localisation block (``locate_steps`` 0), the vision drills
    (:func:`vision_drills`)."""
    if params.pretrain_steps == 0:
        return []
    check_scene(params, scene)
    from mars.data.schemas import GALLERY

    held_out = _test_entities(all_questions)
    gallery = read_table(world_dir / "gallery.parquet", GALLERY).to_pylist()
    entities = read_table(world_dir / "entities.parquet", ENTITIES).to_pylist()
    drills = _reading_drills(agent, world_dir, index_dir, entities, gallery, held_out, n=params.pretrain_drills,
                             seed=params.seed)
    if params.locate_steps or scene is None:
        return drills
    return drills + vision_drills(params, scene, system, asked_attributes(all_questions), agent_view(agent))


def reading_dialogues(params: SFTParams, agent: AgentParams, world_dir: Path, index_dir: Path,
                      all_questions: list[dict], scene: SceneConfig | None, system: str
                      ) -> tuple[list[list[dict]], list[list[dict]]]:
    """(phase 1's dialogues, phase 1's held-out check drills): :func:`pretrain_dialogues` and :func:`check_drills`;
    module-level, so the stage draws them in a worker process beside :func:`locate_block_dialogues`."""
    return (pretrain_dialogues(params, agent, world_dir, index_dir, all_questions, scene, system),
            check_drills(params, agent, world_dir, index_dir, all_questions))


def play_and_draw(params: SFTParams, agent: AgentParams, inputs: dict[str, Path], all_questions: list[dict],
                  scene: SceneConfig | None, system: str, attributes: Sequence[str] | None, workers: int = 1,
                  meanwhile: Callable[[list], None] | None = None
                  ) -> tuple[list, dict, list[list[dict]], list[list[dict]], list[list[dict]]]:
    """The teacher plays the sft split here while ``workers`` processes draw phase 1's dialogues with its check
    drills (:func:`reading_dialogues`) and the block's (:func:`locate_block_dialogues`): all three mostly
    single-threaded Python (the drills' image searches, the block's scenes and crops), the same draws as in this
    process. Then ``meanwhile(trajectories)``, if given, runs here while the drawing goes on (the stage builds the
    model and trains phase 0's reading: what needs the trajectories and not the drills), with ``workers`` fewer
    torch threads, as the drawing holds that many cores. Returns (trajectories, teacher stats with
    ``beside_drawing_s``: the seconds of ``meanwhile``, and ``drills_wait_s``: how long the drawing outlasted the
    teacher and ``meanwhile``, phase 1's dialogues, the block's, the check drills). One worker (the stage's) draws
    the two in turn; two draw them at once, which on two cores did not shorten the step (5.8 minutes against 5.6:
    the teacher and one worker already hold both cores; ``probes/probe_drawing.py`` times both)."""
    from mars.workers import Background

    if workers not in (1, 2):
        raise ValueError(f"play_and_draw draws two parts: workers must be 1 or 2, got {workers}")
    # leaving the block kills the drawing: a teacher error shows at once, with no drawing process left behind
    with Background([(reading_dialogues, (params, agent, inputs["world_dir"], inputs["index_dir"], all_questions,
                                          scene, system)),
                     (locate_block_dialogues, (params, scene, system, attributes, agent_view(agent)))],
                    workers) as drawing:
        questions = [q for q in all_questions if q["split"] == "sft"]
        trajs, stats = teacher_trajectories(params, agent, questions, inputs["image_root"], inputs["world_dir"],
                                            inputs["index_dir"])
        if meanwhile is not None:
            t0, threads = time.perf_counter(), torch.get_num_threads()
            torch.set_num_threads(max(1, threads - workers))  # a thread on a drawing core stalls every parallel op
            try:
                meanwhile(trajs)
            finally:
                torch.set_num_threads(threads)
            stats["beside_drawing_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        (pretrain, held_out), locate = drawing.results()
        stats["drills_wait_s"] = round(time.perf_counter() - t0, 1)
    return trajs, stats, pretrain, locate, held_out


def check_drills(params: SFTParams, agent: AgentParams, world_dir: Path, index_dir: Path,
                 all_questions: list[dict]) -> list[list[dict]]:
    """Phase 1's held-out check drills (none without phase 1's reading drills): ``pretrain_check_drills`` reading
    drills drawn as phase 1's (:func:`mars.train.drills.reading_drills`, the same knobs and excluded entities) with
    another seed, so their stand-in names are new to the model."""
    if not (params.pretrain_steps and params.pretrain_drills and params.pretrain_check_drills):
        return []
    from mars.data.schemas import GALLERY

    entities = read_table(world_dir / "entities.parquet", ENTITIES).to_pylist()
    gallery = read_table(world_dir / "gallery.parquet", GALLERY).to_pylist()
    return _reading_drills(agent, world_dir, index_dir, entities, gallery, _test_entities(all_questions),
                           n=params.pretrain_check_drills, seed=params.seed + 99)


def _test_entities(questions: list[dict]) -> set[str]:
    """The entities of the test split's questions (no drill or caption is about one)."""
    return {q["entity_id"] for q in questions if q["split"] == "test" and q.get("entity_id")}


def _reading_drills(agent: AgentParams, world_dir: Path, index_dir: Path, entities: list[dict],
                    gallery: list[dict], held_out: set[str], *, n: int, seed: int) -> list[list[dict]]:
    """``n`` reading drills (:func:`mars.train.drills.reading_drills`) through the agent's tools."""
    from mars.train.drills import reading_drills

    return reading_drills(agent.toolbox(index_dir, world_dir / "gallery"), entities, gallery, world_dir / "gallery",
                          n=n, seed=seed, exclude_entities=held_out)


def locate_block_dialogues(params: SFTParams, scene: SceneConfig | None = None, system: str | None = None,
                           attributes: Sequence[str] | None = None, view: Callable | None = None
                           ) -> list[list[dict]]:
    """The localisation block's data (``locate_steps`` > 0, else none): the vision drills
    (:func:`vision_drills`, images kept in ``view``), the same draw phase 1 would get."""
    if params.locate_steps == 0:
        return []
    check_scene(params, scene)
    return vision_drills(params, scene, system, attributes, view)


class PolicyView:
    """An image as the policy sees it: resized (bicubic) to :func:`mars.tools.imaging.smart_resize` of its size at
    the processor's pixel bounds, when that size is a fixed point of the rule (the processor then resizes it to
    itself, so it renders to the same pixel values); else the image as it is (a rounding below ``min_pixels`` would
    be resized again). The drills keep their images so (:func:`mars.train.data.in_view`): a quarter of the memory."""

    def __init__(self, min_pixels: int, max_pixels: int, factor: int):
        self.min_pixels, self.max_pixels, self.factor = min_pixels, max_pixels, factor

    def __call__(self, image):
        from PIL import Image

        from mars.tools.imaging import smart_resize

        h, w = smart_resize(image.height, image.width, self.factor, self.min_pixels, self.max_pixels)
        if (h, w) == (image.height, image.width) or smart_resize(h, w, self.factor, self.min_pixels,
                                                                 self.max_pixels) != (h, w):
            return image
        return image.convert("RGB").resize((w, h), Image.Resampling.BICUBIC)


def agent_view(agent: AgentParams) -> PolicyView:
    """The policy's view at the agent's pixel bounds (those of the processor: :class:`PolicyView`)."""
    return PolicyView(agent.min_pixels, agent.max_pixels, agent.factor)


def vision_drills(params: SFTParams, scene: SceneConfig, system: str | None = None,
                  attributes: Sequence[str] | None = None, view: Callable | None = None) -> list[list[dict]]:
    """``pretrain_locate`` localisation drills on new scenes drawn with the world's ``scene`` knobs
    (:mod:`mars.train.locate`, with the episodes' ``system`` prompt) and ``pretrain_zoom_captions`` new emblems at a
    zoom's scale (:func:`mars.train.captions.zoom_captions`), both asking about ``attributes``
    (:func:`mars.world.questions.asked_attributes` of the questions file; all when None): phase 1's when
    ``locate_steps`` is 0, else the block's. ``view``: each image as kept (:func:`agent_view`; as drawn when None)."""
    from mars.train.captions import zoom_captions
    from mars.train.locate import locate_dialogues

    return (locate_dialogues(scene, n=params.pretrain_locate, seed=params.seed, system=system, attributes=attributes,
                             answer_share=params.locate_answers, view=view)
            + zoom_captions(scene, n=params.pretrain_zoom_captions, seed=params.seed, attributes=attributes,
                            view=view))


def world_colours(params: SFTParams, scene: SceneConfig | None, world_dir: Path) -> SceneConfig | None:
    """``scene`` with the colour schemes of the world's entity emblems (:func:`mars.world.emblems.schemes_of`) when
    ``emblem_colours`` is world, so the emblems drawn anew for phase 0, the localisation drills, the zoom captions
    and the block's checks are coloured as the world's are (the default world's six schemes: six fills for the
    colour questions to name, not the palette's 16); else ``scene`` as it is."""
    if scene is None or params.emblem_colours == "palette":
        return scene
    from mars.world.emblems import schemes_of

    path = world_dir / "entities.parquet"
    emblems = [r["emblem"] for r in read_table(path, ENTITIES).to_pylist() if r["emblem"]]
    if not emblems:
        raise ValueError(f"sft.emblem_colours = world colours the drawn emblems as the world's entities are, but "
                         f"{path} has no emblems (a world of your own images?); set sft.emblem_colours: palette")
    return replace(scene, schemes=schemes_of(emblems))


def check_scene(params: SFTParams, scene: SceneConfig | None) -> None:
    drawn = params.locate_steps or (params.pretrain_steps and (params.pretrain_locate or params.pretrain_zoom_captions))
    if (drawn or params.vision_pretrain_steps) and scene is None:
        raise ValueError("sft.pretrain_locate, pretrain_zoom_captions or vision_pretrain_steps > 0 needs the world's "
                         "scene knobs (scene.json, written by the world stage); run the stage through "
                         "`python -m stages.sft` or pass scene=mars.world.scenes.read_scene(world_dir)")


def frame_stage_dialogues(params: SFTParams, block: list[list[dict]]) -> list[list[dict]]:
    """The block's frame stage's data (``locate_frame_steps`` > 0, else none): the block's dialogues
    (:func:`locate_block_dialogues`: the localisation drills, then ``pretrain_zoom_captions`` zoom captions) up to
    its first ``locate_frame_captions`` captions: on one seed the first zoom formed in 500 steps with 1,000
    captions and not in 1,600 with 4,000, which the read needs (docs/findings.md)."""
    if not (params.locate_frame_steps and block):
        return []
    return block[:len(block) - params.pretrain_zoom_captions + params.locate_frame_captions]

