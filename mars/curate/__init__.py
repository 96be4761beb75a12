"""Image curation for high-resolution raw pools (the library behind the ``curate`` stage).

- :mod:`mars.curate.probe`: per-file header checks, safe reduced-size decode, reject reasons.
- :mod:`mars.curate.hashing`: streamed sha256, DCT perceptual hash, Hamming distances.
- :mod:`mars.curate.pool`: :class:`CurateConfig` and :func:`curate_pool` (parallel probe,
  exact and near duplicate removal) returning the ``curated`` and ``rejects`` tables.
- :mod:`mars.curate.download`: the "urls" source, a safe bounded-concurrency downloader.

Tests: ``python -m pytest tests/curate``; benchmark: ``python bench/bench_curate.py``.
"""

from mars.curate.pool import CurateConfig, curate_pool

__all__ = ["CurateConfig", "curate_pool"]
