"""MARS: a reproducible pipeline for vision-language agents that reason with tools.

Library code lives here (data I/O and quality, world generation, curation, tools, ...);
the DVC stages in ``stages/`` compose it and ``pipelines/`` orchestrates them with Prefect.
See README.md for how to run it.
"""

__version__ = "0.1.0"
