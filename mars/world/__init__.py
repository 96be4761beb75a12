"""The embedded default world: a seeded, offline stand-in for the web, Wikipedia and 4K photos.

Modules: :mod:`~mars.world.text` (names, facts, documents), :mod:`~mars.world.emblems`
(procedural emblems and gallery renderings), :mod:`~mars.world.scenes` (high-resolution scenes
with a grid-aligned red-frame cue), :mod:`~mars.world.planted` (curation traps),
:mod:`~mars.world.generate` (:class:`WorldSpec`, :func:`generate_world`) and
:mod:`~mars.world.folder` (:func:`ingest_folder`, a user's own image folder as the raw pool).

Run the ``world`` stage (``python -m stages.world --out DIR --metrics FILE``) to generate one.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["WorldSpec", "WorldTables", "generate_world", "ingest_folder"]
_HOME = {"WorldSpec": "generate", "WorldTables": "generate", "generate_world": "generate", "ingest_folder": "folder"}


def __getattr__(name: str) -> Any:
    # lazy, so ``python -m mars.world.generate`` does not import the module twice
    if name in _HOME:
        return getattr(importlib.import_module(f"mars.world.{_HOME[name]}"), name)
    raise AttributeError(f"module 'mars.world' has no attribute {name!r}")
