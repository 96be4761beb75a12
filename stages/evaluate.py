"""The ``evaluate`` stage: every model and workflow on every benchmark, under the same tools and judge.

What it does
    Benchmarks: the synthesized test split (``--questions``, always) plus any ``benchmarks`` specs in params (real
    benchmark files from local paths: HR-MMSearch parquet, the reference release's manifest, HR-Bench style MCQ,
    mapped tables; see :mod:`mars.eval.loaders`). Every file is validated whole before anything is scored.
    Runs: ``runs`` lists ``"<model>/<workflow>"`` with workflow ``agentic`` (the three tools) or ``direct`` (no
    tools). Models: ``base`` (the untrained model the sft stage saved), ``sft`` and ``rl`` (the pipeline's
    checkpoints), ``oracle`` (the world's ground truth driving the tools; synthesized benchmarks only),
    ``no-tool`` (a fixed guess, near chance), any name in ``checkpoints`` (a local checkpoint directory) or in
    ``endpoints`` (an OpenAI-compatible server: vLLM, or an API model as an agentic baseline).
    Each question is played ``k`` times (Avg@k; sample 0 is Pass@1) with ``temperature`` and ``seed`` recorded.
    Scoring: the shared rule judge, or ``judge: llm`` on an endpoint; the judge's identity is in every row.
    Resumable: finished chunks of samples are appended to ``--progress`` (scratch space DVC does not track), keyed by a
    fingerprint of the model weights, the benchmark, the params and the code (``mars`` and ``stages``); an
    interrupted run continues, a rerun with the same inputs and code scores nothing again, and every sample is
    scored exactly once (checked).

Outputs (``--out``): ``results.parquet`` (RESULTS schema), ``report.html`` (self-contained, every trajectory);
``--plots``: ``accuracy.csv`` and ``tool_calls.csv`` (``dvc plots show``); ``--metrics``: accuracy per
benchmark, model/workflow, question type, category and difficulty, and on the test split (with
``agent.coords: relative``) ``first_zoom_framed``: the share of scene episodes whose first zoom lands in the framed
cell (:func:`mars.eval.run.first_zoom_framed`; localisation, chance one cell of the grid), and the search
chain of the search and multi-hop episodes (``chain_*``, :func:`mars.eval.run.search_chain`: top-1 image-search
title right, query copies it, the text-search result holds the answer, right given that) and perception accuracy
per asked attribute (``perception_by_attribute``: colour, shape, letter, pattern;
:func:`mars.eval.run.perception_by_attribute`) and by answer form (``by_form``: open, choice; ``letter_on_open``,
``letter_on_choice``: the shares answered with a bare option letter; :func:`mars.eval.run.answer_form`).

Run: ``python -m stages.evaluate --questions data/synthesize/questions.parquet --image-root data/synthesize
--world-dir data/world --index-dir data/index --sft data/sft --out data/evaluate --progress .scratch/evaluate/progress
--plots plots/evaluate --metrics metrics/evaluate.json`` (add ``--rl data/rl`` for the RL checkpoint).
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from mars.agent.config import AgentParams
from mars.data.io import atomic_dir
from mars.data.quality import write_artifacts
from mars.stage import expected_errors, load_section, stage_args, write_metrics

SECTION = "evaluate"
log = logging.getLogger(__name__)
SCRIPTED = ("oracle", "no-tool")
PIPELINE = {"base": ("sft", "base"), "sft": ("sft", "model"), "rl": ("rl", "model")}


@dataclass(frozen=True)
class Params:
    runs: tuple[str, ...] = ("no-tool/direct", "base/agentic", "sft/agentic", "rl/agentic", "oracle/agentic")
    benchmarks: tuple[dict[str, Any], ...] = ()
    checkpoints: dict[str, str] = field(default_factory=dict)  # name -> local checkpoint directory
    endpoints: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {base_url, model, api_key_env}
    k: int = 1
    temperature: float = 0.0
    chunk_size: int = 32
    judge: str = "rule"  # rule | llm
    judge_base_url: str = ""
    judge_model: str = ""
    report_max_trajectories: int = 300
    seed: int = 0

    def __post_init__(self) -> None:
        for r in self.runs:
            model, _, wf = r.partition("/")
            if wf not in ("agentic", "direct") or not model:
                raise ValueError(f"evaluate.runs entry {r!r} must be '<model>/agentic' or '<model>/direct'")
            known = set(SCRIPTED) | set(PIPELINE) | set(self.checkpoints) | set(self.endpoints)
            if model not in known:
                raise ValueError(f"evaluate.runs entry {r!r}: unknown model {model!r}; known: {sorted(known)}")
        if self.k < 1 or self.chunk_size < 1:
            raise ValueError("evaluate.k and evaluate.chunk_size must be >= 1")
        if self.judge not in ("rule", "llm"):
            raise ValueError(f"evaluate.judge must be 'rule' or 'llm', got {self.judge!r}")
        if self.judge == "llm" and not (self.judge_base_url and self.judge_model):
            raise ValueError("evaluate.judge=llm needs judge_base_url and judge_model")


def _weights_hash(path: Path) -> str:
    """A cheap identity of a checkpoint: names, sizes and the first MiB of each weight file."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")) + [path / "config.json"]:
        if f.is_file():
            h.update(f.name.encode() + str(f.stat().st_size).encode())
            with f.open("rb") as fh:
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def _bench_hash(rows: list[dict]) -> str:
    h = hashlib.sha256()
    for r in rows:
        h.update(f"{r['benchmark']}|{r['id']}|{r['question']}|{r['answers']}".encode())
        h.update(hashlib.sha256(r["images"][0]).digest())
    return h.hexdigest()[:16]


def _model_source(name: str, params: Params, inputs: dict[str, Path]) -> tuple[str, Any]:
    """("scripted" | "checkpoint" | "endpoint", detail) for a model name."""
    if name in SCRIPTED:
        return "scripted", name
    if name in params.checkpoints:
        return "checkpoint", Path(params.checkpoints[name])
    if name in params.endpoints:
        return "endpoint", dict(params.endpoints[name])
    stage, sub = PIPELINE[name]
    if stage not in inputs:
        raise SystemExit(f"error: evaluate.runs uses {name!r}, which needs --{stage} (the {stage} stage's output)")
    return "checkpoint", inputs[stage] / sub


def run(params: Params, agent: AgentParams, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    from mars.agent.backends import OpenAIBackend, ScriptedBackend
    from mars.agent.oracle import World, no_tool_policy, oracle_policy, scripted_backend
    from mars.data.io import read_table
    from mars.data.schemas import ENTITIES, QUESTIONS, WORLD_TRUTH
    from mars.eval.loaders import load_benchmark
    from mars.eval.report import write_report
    from mars.eval.run import (ResultStore, answer_form, evaluate_model, first_zoom_framed, perception_by_attribute,
                               plot_rows, search_chain, summarize)
    from mars.train.checkpoint import fingerprint
    from stages import code_digest

    code = code_digest()  # a code change (judge, engine, tools) re-scores instead of reusing the stored episodes
    specs = [{"format": "synth", "name": "test", "path": str(inputs["questions"]),
              "image_root": str(inputs["image_root"]), "split": "test"}] + [dict(b) for b in params.benchmarks]
    benches = [(s, load_benchmark(s).to_pylist()) for s in specs]
    synth = {q["question_id"]: q for q in read_table(inputs["questions"], QUESTIONS).to_pylist()}
    world = World.from_dir(inputs["world_dir"]) if any(r.startswith("oracle/") for r in params.runs) else None
    toolbox = agent.toolbox(inputs["index_dir"], inputs["world_dir"] / "gallery")
    judge = None
    if params.judge == "llm":
        from mars.rl.judge import LLMJudge

        judge = LLMJudge(params.judge_base_url, params.judge_model).judge
    cfg = agent.engine(temperature=params.temperature)
    tables = []
    for run_name in params.runs:
        model, _, workflow = run_name.partition("/")
        kind, detail = _model_source(model, params, inputs)
        for spec, rows in benches:
            if model == "oracle" and spec["format"] != "synth":
                log.info("skipping oracle on %s: the oracle needs the generated world's truth", spec.get("name"))
                continue
            ident = _weights_hash(detail) if kind == "checkpoint" else str(detail)
            fp = fingerprint(ident, _bench_hash(rows), agent, params.k, params.temperature, params.seed, params.judge,
                             params.judge_model, code)
            key = f"{model}__{workflow}__{fp}"
            store = ResultStore(outputs["progress"], key)
            if kind == "scripted" and model == "oracle":
                ids = [r["id"] for r in rows]
                factory = lambda ids=ids: scripted_backend(  # noqa: E731
                    [synth[i] for i in ids], lambda q: oracle_policy(q, world), inputs["image_root"])
                hook = lambda r, q: {**q, **{k: synth[r["id"]][k] for k in ("type", "entity_id", "scene_id")}}  # noqa: E731
            elif kind == "scripted":
                factory, hook = (lambda: ScriptedBackend(no_tool_policy)), None
            elif kind == "checkpoint":
                def factory(path=detail):
                    from mars.agent.hf_backend import HFBackend
                    from mars.model.build import load_checkpoint

                    m, _, proc = load_checkpoint(path)
                    agent.check_processor(proc, str(path))
                    return HFBackend(m, proc)
                hook = None
            else:
                factory = lambda d=detail: OpenAIBackend(  # noqa: E731
                    d["base_url"], d["model"], api_key=os.environ.get(d.get("api_key_env", "OPENAI_API_KEY")))
                hook = None
            n = evaluate_model(rows, factory, toolbox, cfg, store, model=model, workflow=workflow, k=params.k,
                               seed=params.seed, chunk_size=params.chunk_size, question_hook=hook, judge=judge)
            t = store.table()
            ids = t.column("sample_id").to_pylist()
            if len(ids) != len(set(ids)) or len(ids) != len(rows) * params.k:
                raise RuntimeError(f"{run_name} on {spec.get('name')}: {len(ids)} results for {len(rows) * params.k} "
                                   f"samples ({len(ids) - len(set(ids))} duplicated); delete {store.dir} and rerun")
            log.info("%s on %s: %d samples scored now, %d reused", run_name, spec.get("name"), n, len(ids) - n)
            tables.append(t)
    results = pa.concat_tables(tables)
    metrics = summarize(results)
    test = results.filter(pc.equal(results.column("benchmark"), "test"))
    if agent.coords == "relative":  # localisation on the generated scenes (boxes on the 0..1000 grid)
        truth = {r["scene_id"]: r for r in read_table(inputs["world_dir"] / "world_truth.parquet",
                                                      WORLD_TRUTH).to_pylist() if r["is_target"]}
        scene_of = {i: q["scene_id"] for i, q in synth.items()}
        for mw, loc in first_zoom_framed(test, scene_of, truth).items():
            metrics["test"][mw] |= loc
    names = {r["entity_id"]: r["name"] for r in read_table(inputs["world_dir"] / "entities.parquet",
                                                           ENTITIES).to_pylist()}
    for mw, chain in search_chain(test, synth, names).items():  # which link of the search chain fails
        metrics["test"][mw] |= chain
    for mw, by_attr in perception_by_attribute(test, synth).items():  # which emblem attribute is read
        metrics["test"][mw] |= by_attr
    for mw, form in answer_form(test, synth).items():  # open questions against option letters
        metrics["test"][mw] |= form
    acc, tools = plot_rows(results)
    with atomic_dir(outputs["out"]) as out:
        write_artifacts({out / "results.parquet": (results, "results")})
        write_report(results, metrics, out / "report.html", max_trajectories=params.report_max_trajectories)
    with atomic_dir(outputs["plots"]) as plots:
        for name, rows_ in (("accuracy", acc), ("tool_calls", tools)):
            with (plots / f"{name}.csv").open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows_[0]))
                w.writeheader()
                w.writerows(rows_)
    write_metrics(outputs["metrics"], metrics)
    for bench, by in metrics.items():
        for mw, e in by.items():
            log.info("%s %-22s accuracy %.3f %s", bench, mw, e["accuracy"], e.get("by_type", ""))
    return metrics


def main(argv: list[str] | None = None) -> int:
    with expected_errors():
        params, inputs, outputs = stage_args(
            SECTION, Params, argv, inputs=("questions", "image_root", "world_dir", "index_dir"),
            outputs=("out", "progress", "plots", "metrics"), optional_inputs=("sft", "rl"),
        )
        run(params, load_section("agent", AgentParams, argv), inputs, outputs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
