"""Arrow schemas of every artifact the pipeline writes, declared once.

Each artifact named in docs/design.md, Stages and their contracts, has exactly one schema
here; stages pass these objects to :func:`mars.data.io.write_table` /
:func:`mars.data.io.read_table` and the quality suites in :mod:`mars.data.suites` are
keyed by the same names. Columns marked ``nullable=False`` must never hold nulls.

Run ``python -m mars.data.schemas`` to print every schema.
"""

from __future__ import annotations

import pyarrow as pa


def _f(name: str, typ: pa.DataType, nullable: bool = False) -> pa.Field:
    return pa.field(name, typ, nullable=nullable)


# --- world stage -----------------------------------------------------------------

ENTITIES = pa.schema(
    [
        _f("entity_id", pa.string()),
        _f("name", pa.string()),
        _f("kind", pa.string()),  # e.g. "observatory", "guild", ... (what the entity is)
        _f("founded_year", pa.int32()),
        _f("city", pa.string()),
        _f("founder", pa.string()),
        _f("emblem", pa.string()),  # JSON: the procedural emblem spec (shape, colours, glyph)
        _f("is_distractor", pa.bool_()),  # similar-name entity that exists only in the corpus
    ]
)

CORPUS = pa.schema(
    [
        _f("doc_id", pa.string()),
        _f("entity_id", pa.string()),
        _f("title", pa.string()),
        _f("text", pa.string()),
        _f("is_distractor", pa.bool_()),
    ]
)

GALLERY = pa.schema(
    [
        _f("gallery_id", pa.string()),
        _f("entity_id", pa.string()),
        _f("title", pa.string()),
        _f("path", pa.string()),  # relative to the gallery directory
        _f("split", pa.string()),  # "index" (searchable) or "heldout" (recall probes)
        _f("width", pa.int32()),
        _f("height", pa.int32()),
    ]
)

RAW_IMAGES = pa.schema(
    [
        _f("image_id", pa.string()),
        _f("path", pa.string()),  # relative to the raw pool directory
        _f("source", pa.string()),  # "generated", "folder" or "urls"
        _f("scene_id", pa.string(), nullable=True),  # set for generated scenes
        _f("planted_case", pa.string(), nullable=True),  # which curation trap this file is
        _f("expected_reason", pa.string(), nullable=True),  # reject reason curation should give
        _f("bytes", pa.int64()),
        _f("sha256", pa.string()),
    ]
)

WORLD_TRUTH = pa.schema(
    [
        _f("scene_id", pa.string()),
        _f("image_id", pa.string()),
        _f("entity_id", pa.string()),
        _f("x0", pa.int32()),
        _f("y0", pa.int32()),
        _f("x1", pa.int32()),
        _f("y1", pa.int32()),
        _f("is_target", pa.bool_()),
        _f("scene_width", pa.int32()),
        _f("scene_height", pa.int32()),
        _f("grid_rows", pa.int32()),
        _f("grid_cols", pa.int32()),
        _f("cell_row", pa.int32()),
        _f("cell_col", pa.int32()),
        _f("cue", pa.string()),  # how the target is singled out, e.g. "red_frame"
        _f("difficulty", pa.int32()),
        _f("target_zone", pa.float32()),  # the target lies in this central share (per axis) of its cell
    ]
)

DOWNLOAD_FAILURES = pa.schema(  # source=urls: every URL that did not become a raw image, and why
    [
        _f("url", pa.string()),
        _f("reason", pa.string()),
        _f("detail", pa.string()),
    ]
)

# --- curate stage -------------------------------------------------------------------

CURATED = pa.schema(
    [
        _f("image_id", pa.string()),
        _f("path", pa.string()),  # source file, relative to the raw pool directory
        _f("derivative", pa.string(), nullable=True),  # RGB re-encode, relative to the curated dir
        _f("sha256", pa.string()),
        _f("width", pa.int32()),  # after EXIF orientation
        _f("height", pa.int32()),
        _f("mode", pa.string()),  # PIL mode of the source file
        _f("phash", pa.string()),  # 64-bit perceptual hash, 16 hex digits
        _f("quality", pa.float64()),
    ]
)

REJECTS = pa.schema(
    [
        _f("image_id", pa.string()),
        _f("path", pa.string()),
        _f("reason", pa.string()),
        _f("detail", pa.string()),
    ]
)

# --- synthesize / agent rollouts ------------------------------------------------------

QUESTIONS = pa.schema(
    [
        _f("question_id", pa.string()),
        _f("type", pa.string()),  # "perception", "search" or "multi-hop"
        _f("scene_id", pa.string(), nullable=True),  # set for questions about a scene
        _f("image_path", pa.string()),  # relative to the question image root (mars.world.questions)
        _f("question", pa.string()),  # the full prompt text (options included for multiple choice)
        _f("answer", pa.string()),
        _f("aliases", pa.list_(pa.string())),
        _f("choices", pa.string(), nullable=True),  # JSON {"A": ..., "B": ...} for multiple choice
        _f("entity_id", pa.string()),
        _f("difficulty", pa.int32()),
        _f("split", pa.string()),  # "sft", "rl" or "test"
    ]
)

TRAJECTORIES = pa.schema(
    [
        _f("question_id", pa.string()),
        _f("episode_id", pa.string()),
        _f("messages_json", pa.string()),  # the dialogue; images as {"type": "image", "ref": i}
        _f("images", pa.list_(pa.binary())),  # PNG bytes of every image as shown, in dialogue order
        _f("tool_calls_json", pa.string()),  # [{turn, name, arguments, error, latency_s}]
        _f("n_turns", pa.int32()),
        _f("n_tool_calls", pa.int32()),
        _f("n_tool_errors", pa.int32()),
        _f("n_format_errors", pa.int32()),
        _f("answer", pa.string(), nullable=True),
        _f("finish_reason", pa.string()),  # answer / max_turns / token_budget / backend_error
        _f("correct", pa.bool_()),
        _f("reward", pa.float64()),
        _f("reward_answer", pa.float64()),
        _f("reward_format", pa.float64()),
        _f("judge", pa.string()),  # e.g. "rule:exact", "rule:none"
        _f("token_ids", pa.list_(pa.int64()), nullable=True),  # generated tokens, all turns, when known
        _f("logprobs", pa.list_(pa.float32()), nullable=True),
        _f("turn_tokens", pa.list_(pa.int32()), nullable=True),  # generated tokens of each assistant turn
    ]
)

PASS_COUNTS = pa.schema(  # difficulty mining: how often a policy solved each question (mars.synth.mining)
    [
        _f("question_id", pa.string()),
        _f("split", pa.string()),
        _f("type", pa.string()),
        _f("k", pa.int32()),  # episodes played
        _f("passes", pa.int32()),  # correct episodes, 0..k
    ]
)

# --- evaluate ------------------------------------------------------------------------------

BENCH_QUESTIONS = pa.schema(
    [
        _f("id", pa.string()),  # unique within a benchmark
        _f("benchmark", pa.string()),
        _f("question", pa.string()),  # the prompt text (options listed for multiple choice)
        _f("images", pa.list_(pa.binary())),  # encoded image files (PNG/JPEG bytes), at least one
        _f("answers", pa.list_(pa.string())),  # gold answer and aliases, non-empty
        _f("choices", pa.string(), nullable=True),  # JSON {"A": ..., "B": ...} for multiple choice
        _f("category", pa.string(), nullable=True),
        _f("difficulty", pa.string(), nullable=True),
        _f("type", pa.string(), nullable=True),  # perception / search / multi-hop for the synthesized split
        _f("search_results", pa.string(), nullable=True),  # JSON pre-computed image search: {"titles", "thumbnails"}
    ]
)

RESULTS = pa.schema(
    [
        _f("sample_id", pa.string()),  # "<benchmark>/<id>/<model>/<workflow>/<k>", unique
        _f("benchmark", pa.string()),
        _f("question_id", pa.string()),
        _f("model", pa.string()),  # e.g. "sft", "base", "oracle", "no-tool", or an endpoint's model name
        _f("workflow", pa.string()),  # "direct" (no tools) or "agentic"
        _f("sample_idx", pa.int32()),  # k of Avg@k
        _f("seed", pa.int64()),
        _f("temperature", pa.float64()),
        _f("question", pa.string()),
        _f("gold", pa.list_(pa.string())),
        _f("prediction", pa.string(), nullable=True),
        _f("correct", pa.bool_()),
        _f("score", pa.float64()),
        _f("judge", pa.string()),  # the judge's identity and method, e.g. "rule:exact", "llm:<model>:yes"
        _f("category", pa.string(), nullable=True),
        _f("difficulty", pa.string(), nullable=True),
        _f("type", pa.string(), nullable=True),
        _f("finish_reason", pa.string()),
        _f("turns", pa.int32()),
        _f("n_zoom", pa.int32()),
        _f("n_text_search", pa.int32()),
        _f("n_image_search", pa.int32()),
        _f("tool_errors", pa.int32()),
        _f("format_errors", pa.int32()),
        _f("tokens", pa.int32()),  # generated tokens
        _f("latency_s", pa.float64()),
        _f("messages_json", pa.string()),  # the dialogue, images as {"type": "image", "ref": i}
        _f("images", pa.list_(pa.binary())),  # PNG bytes of every image in the dialogue, in order
    ]
)

ARTIFACTS: dict[str, pa.Schema] = {
    "entities": ENTITIES,
    "corpus": CORPUS,
    "gallery": GALLERY,
    "raw_images": RAW_IMAGES,
    "world_truth": WORLD_TRUTH,
    "download_failures": DOWNLOAD_FAILURES,
    "curated": CURATED,
    "rejects": REJECTS,
    "questions": QUESTIONS,
    "trajectories": TRAJECTORIES,
    "pass_counts": PASS_COUNTS,
    "bench_questions": BENCH_QUESTIONS,
    "results": RESULTS,
}


def schema_for(artifact: str) -> pa.Schema:
    """Return the schema of ``artifact`` or fail naming the known artifacts."""
    try:
        return ARTIFACTS[artifact]
    except KeyError:
        raise KeyError(f"unknown artifact {artifact!r}; known: {sorted(ARTIFACTS)}") from None


if __name__ == "__main__":
    for name, schema in ARTIFACTS.items():
        print(f"# {name}\n{schema}\n")
