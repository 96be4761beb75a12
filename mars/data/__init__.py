"""Artifact schemas, atomic typed parquet I/O and data-quality suites (see the submodules)."""
