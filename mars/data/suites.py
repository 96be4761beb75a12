"""Expectation suites, one per artifact, declared as plain data.

Each entry names a Great Expectations 1.x expectation class (``gx.expectations.<kind>``)
and its keyword arguments; :mod:`mars.data.quality` builds and runs them. Keeping them as
data means this module imports nothing heavy. Checks that span several tables (every raw
image in exactly one of curated/rejects, for instance) live in the stage that owns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Expect:
    kind: str  # a class name under gx.expectations, e.g. "ExpectColumnValuesToBeUnique"
    kwargs: dict[str, Any] = field(default_factory=dict)


def unique(column: str) -> Expect:
    return Expect("ExpectColumnValuesToBeUnique", {"column": column})


def between(column: str, lo: float | None = None, hi: float | None = None) -> Expect:
    return Expect("ExpectColumnValuesToBeBetween", {"column": column, "min_value": lo, "max_value": hi})


def in_set(column: str, values: list[Any]) -> Expect:
    return Expect("ExpectColumnValuesToBeInSet", {"column": column, "value_set": values})


def rows(lo: int = 1, hi: int | None = None) -> Expect:
    return Expect("ExpectTableRowCountToBeBetween", {"min_value": lo, "max_value": hi})


def non_empty(column: str) -> Expect:
    return Expect("ExpectColumnValueLengthsToBeBetween", {"column": column, "min_value": 1})


def greater(a: str, b: str, or_equal: bool = False) -> Expect:
    return Expect("ExpectColumnPairValuesAToBeGreaterThanB", {"column_A": a, "column_B": b, "or_equal": or_equal})


REJECT_REASONS = [
    "not_an_image",
    "decompression_bomb",
    "low_resolution",
    "bad_aspect",
    "corrupt",
    "truncated",
    "low_quality",
    "exact_duplicate",
    "near_duplicate",
    "missing",
    "empty_file",
    "not_a_file",
    "symlink_outside_folder",
    "unsupported_extension",
    "unreadable",
    "download_failed",
]

SUITES: dict[str, list[Expect]] = {
    "entities": [rows(), unique("entity_id"), unique("name"), non_empty("name"), between("founded_year", 1000, 2100)],
    "corpus": [rows(), unique("doc_id"), non_empty("title"), non_empty("text")],
    "gallery": [
        rows(),
        unique("gallery_id"),
        unique("path"),
        in_set("split", ["index", "heldout"]),
        between("width", 16, 4096),
        between("height", 16, 4096),
    ],
    "raw_images": [
        rows(),
        unique("image_id"),
        unique("path"),
        in_set("source", ["generated", "folder", "urls"]),
        between("bytes", 0, None),  # an empty file is curation's to reject (empty_file), not the pool's
        Expect("ExpectColumnValueLengthsToEqual", {"column": "sha256", "value": 64}),
    ],
    "world_truth": [  # empty for user-provided pools; the world stage requires rows for generated ones
        Expect("ExpectCompoundColumnsToBeUnique", {"column_list": ["scene_id", "entity_id"]}),
        greater("x1", "x0"),
        greater("y1", "y0"),
        between("x0", 0, None),
        between("y0", 0, None),
        greater("scene_width", "x1", or_equal=True),
        greater("scene_height", "y1", or_equal=True),
        between("grid_rows", 1, 8),
        between("grid_cols", 1, 8),
    ],
    "curated": [
        unique("image_id"),
        unique("sha256"),
        between("width", 1, None),
        between("height", 1, None),
        Expect("ExpectColumnValueLengthsToEqual", {"column": "phash", "value": 16}),
    ],
    "rejects": [unique("image_id"), in_set("reason", REJECT_REASONS), non_empty("detail")],
    "questions": [
        rows(),
        unique("question_id"),
        non_empty("question"),
        non_empty("answer"),
        non_empty("image_path"),
        in_set("type", ["perception", "search", "multi-hop"]),
        in_set("split", ["sft", "rl", "test"]),
        between("difficulty", 0, None),
    ],
    "trajectories": [
        rows(),
        unique("episode_id"),
        in_set("finish_reason", ["answer", "max_turns", "token_budget", "backend_error"]),
        between("n_turns", 1, None),
        between("reward", 0.0, None),
    ],
    "pass_counts": [
        rows(),
        unique("question_id"),
        in_set("split", ["sft", "rl", "test"]),
        between("passes", 0, None),
        greater("k", "passes", or_equal=True),
    ],
    "results": [
        rows(),
        unique("sample_id"),
        in_set("workflow", ["direct", "agentic"]),
        between("score", 0.0, 1.0),
        between("turns", 0, None),
    ],
}
