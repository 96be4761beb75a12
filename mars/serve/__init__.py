"""Servers for local checkpoints (``mars serve``: OpenAI-compatible chat completions)."""
