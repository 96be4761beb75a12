"""Split assignment for synthesized questions: sft / rl / test, disjoint by scene, with unseen test entities.

What it does
    :func:`plan_splits` decides, from the scene ids and the real entity ids of a world, a
    :class:`SplitPlan` whose :meth:`SplitPlan.assign` gives each candidate question its split:

    - questions about a scene (perception, multi-hop) take their SCENE's split: scenes are shuffled with
      ``numpy.random.default_rng([seed, 31])`` and cut by the fractions, so no scene is in two splits;
    - a share ``unseen_entity_share`` of the real entities is held out: their search questions go to test only,
      and a sft/rl scene question whose target is one of them is dropped, so those entities are never seen in
      sft or rl; the other entities' search questions are split by entity with the same fractions.

    :func:`split_report` measures what the stage checks: scene overlap between splits (must be empty), the share
    of test entities unseen in sft/rl, and the type mix per split.

Deviation
    The paper does not describe its splits; held-out scenes and entities are what make a generated world's test
    split honest.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

__all__ = ["SPLITS", "SplitPlan", "plan_splits", "split_report"]

SPLITS: tuple[str, ...] = ("sft", "rl", "test")
STREAM_SCENES, STREAM_ENTITIES = 31, 32


def _cut(ids: list[str], fractions: tuple[float, float, float], rng: np.random.Generator) -> dict[str, str]:
    order = [ids[int(i)] for i in rng.permutation(len(ids))]
    n = len(order)
    n_sft = int(round(fractions[0] * n))
    n_rl = int(round((fractions[0] + fractions[1]) * n)) - n_sft
    out = {}
    for k, x in enumerate(order):
        out[x] = "sft" if k < n_sft else ("rl" if k < n_sft + n_rl else "test")
    return out


@dataclass
class SplitPlan:
    scene_split: dict[str, str]
    entity_split: dict[str, str]  # split of each entity's search questions
    unseen: set[str] = field(default_factory=set)  # entities held out of sft and rl

    def assign(self, qtype: str, scene_id: str | None, entity_id: str) -> str | None:
        """The split of one candidate question, or None to drop it."""
        if scene_id is not None:
            split = self.scene_split.get(scene_id)
            if split is None or (split != "test" and entity_id in self.unseen):
                return None
            return split
        return self.entity_split.get(entity_id)


def plan_splits(
    scene_ids: list[str],
    entity_ids: list[str],
    *,
    fractions: tuple[float, float, float],
    unseen_entity_share: float,
    seed: int,
    scene_targets: dict[str, str] | None = None,
) -> SplitPlan:
    """A :class:`SplitPlan` (see the module docstring). ``fractions`` = (sft, rl, test), summing to 1.

    ``scene_targets`` (scene id -> its target entity): held-out entities are then drawn from entities that are not
    the target of an sft or rl scene, so holding them out never empties a training scene."""
    if any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"split fractions (sft, rl, test) must be >= 0 and sum to 1, got {fractions}")
    if not 0.0 <= unseen_entity_share < 1.0:
        raise ValueError(f"unseen_entity_share must be in [0, 1), got {unseen_entity_share}")
    scenes = _cut(sorted(set(scene_ids)), fractions, np.random.default_rng([seed, STREAM_SCENES]))
    ents = sorted(set(entity_ids))
    rng = np.random.default_rng([seed, STREAM_ENTITIES])
    order = [ents[int(i)] for i in rng.permutation(len(ents))]
    n_unseen = int(round(unseen_entity_share * len(order)))
    training = {e for sc, e in (scene_targets or {}).items() if scenes.get(sc) in ("sft", "rl")}
    unseen = set([e for e in order if e not in training][:n_unseen])
    entity_split = {e: "test" for e in unseen}
    entity_split.update(_cut([e for e in order if e not in unseen], fractions, rng))
    return SplitPlan(scenes, entity_split, unseen)


def split_report(rows: list[dict]) -> dict:
    """Checks and counts over question rows: scene overlap, unseen test entities, types per split."""
    scenes = {s: {r["scene_id"] for r in rows if r["split"] == s and r["scene_id"]} for s in SPLITS}
    overlap = sorted((scenes["sft"] & scenes["rl"]) | (scenes["sft"] & scenes["test"]) | (scenes["rl"] & scenes["test"]))
    seen = {r["entity_id"] for r in rows if r["split"] in ("sft", "rl")}
    test_ents = {r["entity_id"] for r in rows if r["split"] == "test"}
    mix = Counter((r["split"], r["type"]) for r in rows)
    return {
        "scene_overlap": overlap,
        "test_entities": len(test_ents),
        "test_entities_unseen_share": (len(test_ents - seen) / len(test_ents)) if test_ents else 0.0,
        "counts": {s: {t: mix[(s, t)] for t in ("perception", "search", "multi-hop")} for s in SPLITS},
    }
