"""The ``synthesize`` stage: questions with sft / rl / test splits, from the world or from an LLM.

What it does
    ``source: world`` (the default): from the curated scenes (only scenes curation accepted), the world truth and
    the entities, builds perception, search and multi-hop questions (:mod:`mars.world.questions`; open and
    multiple-choice variants, answer aliases, difficulty tags) and assigns splits that are disjoint by scene, with
    a share of test entities never seen in sft or rl (:mod:`mars.synth.splits`). ``<split>_per_type`` caps the
    questions of each type in each split (the type mix); ``types`` selects the types and ``perception_attributes``
    what perception questions ask about the framed emblem (fill colour, shape, letter, pattern).

    ``source: llm``: for real images, an OpenAI-compatible endpoint (``llm_base_url``, ``llm_model``; key from
    ``llm_api_key_env``) is asked for a search question about each curated image and its caption (a JSONL file
    ``llm_captions`` of ``{"id", "image_path", "caption"}``, image paths relative to the raw pool directory);
    unusable replies are written to ``rejects.jsonl`` with their reasons (:mod:`mars.synth.llm`). Splits are
    assigned by image with the same fractions.

    Difficulty mining (optional, ``mine_checkpoint`` or ``mine_base_url`` set): the policy in that checkpoint (or
    served at that endpoint as ``mine_model``) plays each question of the ``mine_splits`` ``mine_k`` times
    (:mod:`mars.synth.mining`: bounded memory, a progress bar, counts saved under ``--scratch`` as they come, so a
    killed run resumes); only questions solved between ``mine_min_pass`` and ``mine_max_pass`` times are kept (the
    paper keeps those solved at most once in 8 for SFT). The counts go to ``pass_counts.parquet``, their
    histogram per split and type and the kept and dropped counts to the metrics (``mining``).

Outputs (``--out``): ``questions.parquet`` (QUESTIONS schema, quality-checked), ``images/`` (scene files linked
from the raw pool, search images rendered), image paths relative to ``--out``; metrics: counts per split and
type, scene overlap (must be 0) and the unseen test-entity share.

Deviation: the paper's questions come from a model plus human checks over real photos; the default's are
templated over the generated world, whose ground truth the teacher and the judge use.

Run: ``python -m stages.synthesize --world-dir data/world --curated data/curate/curated.parquet
--index-dir data/index --out data/synthesize --scratch .scratch/synthesize --metrics metrics/synthesize.json``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from mars.data.io import atomic_dir, read_table
from mars.data.quality import write_artifacts
from mars.data.schemas import CURATED, PASS_COUNTS, QUESTIONS
from mars.agent.config import AgentParams
from mars.stage import expected_errors, load_section, stage_args, write_metrics
from mars.synth.splits import SPLITS, plan_splits, split_report
from mars.world.questions import ATTRIBUTES

SECTION = "synthesize"
log = logging.getLogger(__name__)
TYPES = ("perception", "search", "multi-hop")


@dataclass(frozen=True)
class Params:
    source: str = "world"  # world | llm
    types: tuple[str, ...] = TYPES
    perception_attributes: tuple[str, ...] = ("colour",)  # any of mars.world.questions.ATTRIBUTES
    frac_sft: float = 0.4
    frac_rl: float = 0.3
    frac_test: float = 0.3
    unseen_entity_share: float = 0.1
    sft_per_type: int = 300
    rl_per_type: int = 100
    test_per_type: int = 80
    llm_base_url: str = ""
    llm_model: str = ""
    llm_api_key_env: str = "OPENAI_API_KEY"
    llm_captions: str = ""
    llm_concurrency: int = 4
    mine_checkpoint: str = ""  # a policy checkpoint directory; "" and no mine_base_url = no difficulty mining
    mine_base_url: str = ""  # or an OpenAI-compatible endpoint serving the policy (vLLM, mars serve)
    mine_model: str = ""
    mine_k: int = 8
    mine_min_pass: int = 0
    mine_max_pass: int = 1
    mine_splits: tuple[str, ...] = ("sft",)
    mine_temperature: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source not in ("world", "llm"):
            raise ValueError(f"synthesize.source must be 'world' or 'llm', got {self.source!r}")
        bad = [t for t in self.types if t not in TYPES]
        if bad or not self.types:
            raise ValueError(f"synthesize.types must be a non-empty subset of {list(TYPES)}, got {list(self.types)}")
        bad = [a for a in self.perception_attributes if a not in ATTRIBUTES]
        if bad or not self.perception_attributes:
            raise ValueError(f"synthesize.perception_attributes must be a non-empty subset of {list(ATTRIBUTES)}, "
                             f"got {list(self.perception_attributes)}")
        bad = [s for s in self.mine_splits if s not in SPLITS]
        if bad:
            raise ValueError(f"synthesize.mine_splits must be a subset of {list(SPLITS)}, got {list(self.mine_splits)}")
        for name in ("sft_per_type", "rl_per_type", "test_per_type", "mine_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"synthesize.{name} must be >= 0, got {getattr(self, name)}")
        if any(f < 0 for f in self.fractions) or abs(sum(self.fractions) - 1.0) > 1e-6:
            raise ValueError(f"synthesize split fractions (frac_sft, frac_rl, frac_test) must be >= 0 and sum to 1, "
                             f"got {self.fractions}")
        if not 0.0 <= self.unseen_entity_share < 1.0:
            raise ValueError(f"synthesize.unseen_entity_share must be in [0, 1), got {self.unseen_entity_share}")
        if self.source == "llm" and not (self.llm_base_url and self.llm_model and self.llm_captions):
            raise ValueError("synthesize.source=llm needs llm_base_url, llm_model and llm_captions")
        if self.mine_base_url and not self.mine_model:
            raise ValueError("synthesize.mine_base_url is set but synthesize.mine_model is empty: name the served "
                             "model")

    @property
    def mining(self) -> bool:
        return bool(self.mine_checkpoint or self.mine_base_url)

    @property
    def fractions(self) -> tuple[float, float, float]:
        return (self.frac_sft, self.frac_rl, self.frac_test)

    @property
    def per_split(self) -> dict[str, int]:
        return {"sft": self.sft_per_type, "rl": self.rl_per_type, "test": self.test_per_type}


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem: copy
        shutil.copy2(src, dst)


def world_questions(params: Params, world_dir: Path, curated: pa.Table, out: Path) -> list[dict]:
    """Questions over the generated world's curated scenes, split (see the module docstring)."""
    from mars.agent.oracle import load_world_tables
    from mars.world.questions import question_rows

    tables = load_world_tables(world_dir)
    ok_paths = set(curated.column("path").to_pylist())
    raw = [r for r in tables.raw_images.to_pylist() if r["path"] in ok_paths and r["scene_id"]]
    if not raw:
        raise RuntimeError(f"{world_dir}: no curated scene images; run the world and curate stages first")
    scenes_dir = out / "images" / "scenes"
    for r in raw:
        _link(world_dir / "raw" / r["path"], scenes_dir / r["path"])
    tables.raw_images = pa.Table.from_pylist(raw, schema=tables.raw_images.schema)
    real = [e["entity_id"] for e in tables.entities.to_pylist() if not e["is_distractor"]]
    usable = [r["scene_id"] for r in raw if not r["planted_case"]]  # planted traps never carry questions
    targets = {t["scene_id"]: t["entity_id"] for t in tables.world_truth.to_pylist() if t["is_target"]}
    plan = plan_splits(usable, real, fractions=params.fractions,
                       unseen_entity_share=params.unseen_entity_share, seed=params.seed, scene_targets=targets)
    rows = question_rows(tables, scenes_dir, out / "images" / "search", seed=params.seed, root=out,
                         assign=plan.assign, per_split=params.per_split, attributes=params.perception_attributes)
    return [r for r in rows if r["type"] in params.types]


def llm_questions(params: Params, world_dir: Path, curated: pa.Table, out: Path) -> tuple[list[dict], list[dict]]:
    """Questions written by an LLM endpoint about curated images and their captions."""
    from mars.synth.llm import LLMSynthesizer

    captions = [json.loads(line) for line in Path(params.llm_captions).read_text().splitlines() if line.strip()]
    ok = set(curated.column("path").to_pylist())
    items = [c for c in captions if c.get("image_path") in ok]
    if not items:
        raise RuntimeError(f"{params.llm_captions}: none of its images is among the curated images")
    for c in items:
        _link(world_dir / "raw" / c["image_path"], out / "images" / "llm" / c["image_path"])
    with LLMSynthesizer(params.llm_base_url, params.llm_model, api_key_env=params.llm_api_key_env,
                        concurrency=params.llm_concurrency) as synth:
        rows, rejects = synth.synthesize(items, image_root=world_dir / "raw")
    ids = sorted({r["question_id"] for r in rows})
    order = np.random.default_rng([params.seed, 33]).permutation(len(ids))
    n = len(ids)
    cut = {ids[int(i)]: ("sft" if k < params.frac_sft * n else "rl" if k < (params.frac_sft + params.frac_rl) * n
                         else "test") for k, i in enumerate(order)}
    for r in rows:
        r["split"] = cut[r["question_id"]]
        r["image_path"] = f"images/llm/{r['image_path']}"
    return rows, rejects


def mine(params: Params, agent: AgentParams, rows: list[dict], out: Path, index_dir: Path, world_dir: Path,
         scratch: Path) -> tuple[list[dict], list[dict], dict]:
    """Difficulty mining (see the module docstring): the kept rows, the pass counts and their metrics."""
    from mars.synth.mining import band_metrics, keep_band
    from mars.synth.mining import mine as mine_counts
    from stages import code_digest

    target = [r for r in rows if r["split"] in params.mine_splits]
    counts = mine_counts(target, agent, checkpoint=params.mine_checkpoint, base_url=params.mine_base_url,
                         model=params.mine_model, k=params.mine_k, temperature=params.mine_temperature,
                         seed=params.seed, image_root=out, index_dir=index_dir, gallery_dir=world_dir / "gallery",
                         scratch=scratch / "mining", label="synthesize.mine_checkpoint", key_parts=[code_digest()])
    passes = {c["question_id"]: c["passes"] for c in counts}
    kept = keep_band(rows, passes, params.mine_min_pass, params.mine_max_pass)
    return kept, counts, {"mined": len(target), "mined_kept": sum(r["question_id"] in passes for r in kept),
                          "mining": band_metrics(counts, params.mine_k, params.mine_min_pass, params.mine_max_pass)}


def run(params: Params, inputs: dict[str, Path], outputs: dict[str, Path], agent: AgentParams | None = None) -> dict:
    curated = read_table(inputs["curated"], CURATED)
    world_dir = inputs["world_dir"]
    extra_metrics: dict = {}
    with atomic_dir(outputs["out"]) as out:
        if params.source == "world":
            rows, rejects = world_questions(params, world_dir, curated, out), []
        else:
            rows, rejects = llm_questions(params, world_dir, curated, out)
        counts: list[dict] = []
        if params.mining:
            rows, counts, extra_metrics = mine(params, agent or AgentParams(), rows, out, inputs["index_dir"],
                                               world_dir, outputs["scratch"])
        report = split_report(rows)
        if report["scene_overlap"]:
            raise RuntimeError(f"splits share scenes {report['scene_overlap'][:5]}: a bug in the split plan")
        tables = {out / "questions.parquet": (pa.Table.from_pylist(rows, schema=QUESTIONS), "questions")}
        if counts:
            tables[out / "pass_counts.parquet"] = (pa.Table.from_pylist(counts, schema=PASS_COUNTS), "pass_counts")
        write_artifacts(tables)
        if rejects:
            (out / "rejects.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rejects))
    metrics = {
        "questions": len(rows),
        "rejected": len(rejects),
        "test_entities_unseen_share": round(report["test_entities_unseen_share"], 4),
        "scene_overlap": len(report["scene_overlap"]),
        **{f"{s}_{t}": n for s, by in report["counts"].items() for t, n in by.items()},
        **extra_metrics,
    }
    log.info("synthesize: %s", metrics)
    write_metrics(outputs["metrics"], metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    with expected_errors():
        params, inputs, outputs = stage_args(
            SECTION, Params, argv, inputs=("world_dir", "curated", "index_dir"), outputs=("out", "scratch", "metrics"),
        )
        run(params, inputs, outputs, load_section("agent", AgentParams, argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
