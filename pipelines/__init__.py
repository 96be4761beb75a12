"""Prefect flows and deployments that run the DVC stages (thin: they never re-implement a stage)."""
