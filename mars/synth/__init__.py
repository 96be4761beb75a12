"""The synthesize stage: question-answer synthesis (LLM-backed mode for real images in :mod:`mars.synth.llm`)."""
