"""Evaluate stage: benchmark loading and scoring."""
