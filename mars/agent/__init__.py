"""The agent: prompt and tool-call protocol (:mod:`mars.agent.protocol`); the rollout loop and trajectory records
build on it."""

from mars.agent.protocol import (
    ERROR_CODES,
    TOOL_NAMES,
    FormatError,
    ParsedTurn,
    format_answer,
    format_error_observation,
    format_tool_call,
    format_tool_response,
    parse_turn,
    system_prompt,
)

__all__ = [
    "ERROR_CODES",
    "TOOL_NAMES",
    "FormatError",
    "ParsedTurn",
    "format_answer",
    "format_error_observation",
    "format_tool_call",
    "format_tool_response",
    "parse_turn",
    "system_prompt",
]
