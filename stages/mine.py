"""The ``mine`` stage: the rl prompts whose SFT pass rate lies in a band (between ``sft`` and ``rl``).

What it does
    With ``mine.enabled``: the SFT policy (``--sft``/model, or an endpoint serving it: ``base_url`` and ``model``)
    plays every rl question ``k`` times at ``temperature`` under the shared ``agent`` configuration
    (:mod:`mars.synth.mining`: at most ``agent.max_live_episodes`` episodes in play, a progress bar, counts saved
    under ``--scratch`` as they come, so a killed ``dvc repro`` resumes), and keeps the questions solved between
    ``min_pass`` and ``max_pass`` times: a group whose episodes all succeed or all fail gives GRPO / GSPO no
    signal (its advantages are all zero), so the band spends RL's rollouts on prompts that can teach.
    Disabled (the default), every rl question passes through unchanged.

Outputs (``--out``): ``questions.parquet`` (QUESTIONS, the rl questions that ``rl`` trains on, quality-checked)
and, when enabled, ``pass_counts.parquet`` (PASS_COUNTS); ``--plots``: ``pass_counts.csv`` (questions per pass
count, for ``dvc plots``); metrics: kept and dropped counts, the degenerate share before and after the band and
the pass-count histogram of the split and per type (``dvc exp show`` shows them beside the RL result).

Deviation: the MARS paper gives no RL filter; its 8B release's RL sets are 28-51% of the 7B counts, which suggests
one. The band is off by default: on the default pipeline it cut the degenerate groups of an RL step from 31-41% to
6-9% but left held-out accuracy where it was (three RL seeds, docs/findings.md).

Run: ``python -m stages.mine --questions data/synthesize/questions.parquet --image-root data/synthesize
--world-dir data/world --index-dir data/index --sft data/sft --out data/mine --scratch .scratch/mine
--plots plots/mine --metrics metrics/mine.json``.
"""

from __future__ import annotations

import csv
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from mars.agent.config import AgentParams
from mars.data.io import atomic_dir, atomic_write_text, read_table
from mars.data.quality import write_artifacts
from mars.data.schemas import PASS_COUNTS, QUESTIONS
from mars.stage import expected_errors, load_section, stage_args, write_metrics

SECTION = "mine"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    enabled: bool = False
    k: int = 8
    min_pass: int = 1
    max_pass: int = 6
    temperature: float = 0.7
    base_url: str = ""  # "" = the SFT checkpoint in process; else an OpenAI-compatible endpoint serving it
    model: str = ""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"mine.k must be >= 1, got {self.k}")
        if not 0 <= self.min_pass <= self.max_pass <= self.k:
            raise ValueError(f"mine needs 0 <= min_pass <= max_pass <= k, got {self.min_pass}, {self.max_pass}, "
                             f"{self.k}")
        if self.base_url and not self.model:
            raise ValueError("mine.base_url is set but mine.model is empty: name the served model")


def histogram_csv(counts: list[dict], k: int) -> str:
    """``passes,questions`` for pass counts 0..k (header only when nothing was mined)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["passes", "questions"])
    if counts:
        for p in range(k + 1):
            w.writerow([p, sum(c["passes"] == p for c in counts)])
    return buf.getvalue()


def run(params: Params, agent: AgentParams, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    from mars.synth.mining import band_metrics, keep_band, mine
    from stages import code_digest

    rl = [q for q in read_table(inputs["questions"], QUESTIONS).to_pylist() if q["split"] == "rl"]
    counts: list[dict] = []
    kept = rl
    metrics: dict = {"enabled": params.enabled, "questions": len(rl)}
    if params.enabled:
        counts = mine(rl, agent, checkpoint=str(inputs["sft"] / "model"), base_url=params.base_url,
                      model=params.model, k=params.k, temperature=params.temperature, seed=params.seed,
                      image_root=inputs["image_root"], index_dir=inputs["index_dir"],
                      gallery_dir=inputs["world_dir"] / "gallery", scratch=outputs["scratch"],
                      label="mine: the sft checkpoint", key_parts=[code_digest()])
        kept = keep_band(rl, {c["question_id"]: c["passes"] for c in counts}, params.min_pass, params.max_pass)
        metrics.update(band_metrics(counts, params.k, params.min_pass, params.max_pass).get("rl", {}))
    metrics["kept"] = len(kept)
    with atomic_dir(outputs["out"]) as out:
        tables = {out / "questions.parquet": (pa.Table.from_pylist(kept, schema=QUESTIONS), "questions")}
        if counts:
            tables[out / "pass_counts.parquet"] = (pa.Table.from_pylist(counts, schema=PASS_COUNTS), "pass_counts")
        write_artifacts(tables)
    Path(outputs["plots"]).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(outputs["plots"]) / "pass_counts.csv", histogram_csv(counts, params.k))
    log.info("mine: %s", metrics)
    write_metrics(outputs["metrics"], metrics)
    return metrics


def main(argv: list[str] | None = None) -> int:
    with expected_errors():
        params, inputs, outputs = stage_args(
            SECTION, Params, argv, inputs=("questions", "image_root", "world_dir", "index_dir", "sft"),
            outputs=("out", "scratch", "plots", "metrics"),
        )
        run(params, load_section("agent", AgentParams, argv), inputs, outputs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
