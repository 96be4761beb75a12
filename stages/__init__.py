"""DVC stages: one module per stage (``python -m stages.<name>``), each a thin run()/main()."""

from pathlib import Path


def code_digest() -> str:
    """A hash of the library's and the stages' code: the stages put it in their checkpoint fingerprints, so a code
    change (a reward, a loss, a judge) never resumes state made by the old code."""
    import mars
    from mars.train.checkpoint import source_digest

    return source_digest([Path(mars.__file__).parent, Path(__file__).parent])
