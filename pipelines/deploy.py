"""Serve the ``mars_pipeline`` deployment so the Prefect UI can run and schedule it.

The deployment (name from ``pipeline.deployment_name``) carries a cron schedule from
``pipeline.schedule_cron``, inactive unless ``pipeline.schedule_active`` is true. Runs
started from the UI take ``stages``, ``overrides`` and ``experiment`` as parameters: a run with
overrides is one DVC experiment (``dvc exp show`` lists it), so a user can rerun one stage with new
params without editing params.yaml.

Run with ``mars ui`` (starts a local server too) or, against a running server,
``PREFECT_API_URL=http://127.0.0.1:4200/api python -m pipelines.deploy``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect.schedules import Cron

from pipelines.flow import load_pipeline_params, mars_pipeline


def serve(repo: str = ".") -> None:
    root = str(Path(repo).resolve())
    cfg = load_pipeline_params(root)
    schedule = Cron(cfg.schedule_cron, active=cfg.schedule_active) if cfg.schedule_cron else None
    mars_pipeline.serve(
        name=cfg.deployment_name,
        schedules=[schedule] if schedule else None,
        parameters={"repo": root},
        description="Run the MARS DVC stages (all, or a subset with what they need); with param overrides, as one "
                    "DVC experiment over the stages and what depends on them.",
        tags=["mars"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.deploy")
    parser.add_argument("--repo", default=".")
    serve(parser.parse_args(argv).repo)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
