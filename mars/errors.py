"""The base class of expected errors, which end a stage with their message alone.

An expected error is one whose message already says what is wrong and what to do: bad input (a folder that does
not exist, a malformed benchmark file), an upstream artifact written by another version of the code (a missing or
retyped column), a table that fails its quality suite, an endpoint or service that stays down after its retries or
spends its failure budget. Such classes subclass :class:`StageError` *and* keep their usual base (``ValueError``,
``RuntimeError``, ``FileNotFoundError``), so existing ``except`` clauses still catch them::

    class QualityError(StageError, RuntimeError): ...

:func:`mars.stage.expected_errors`, used by every stage's ``main``, ends the stage on a :class:`StageError` with one
last line ``error: <message>`` on stderr and exit status 1; any other exception is a bug and keeps its traceback.

This module imports nothing, so every package can import it without cycles.
"""

from __future__ import annotations

__all__ = ["StageError", "InputError", "MissingInputError", "EndpointDown"]


class StageError(Exception):
    """An expected failure whose message says what is wrong and how to fix it (no traceback needed)."""


class InputError(StageError, ValueError):
    """User input named in params (a folder, a list file) is unusable."""


class MissingInputError(StageError, FileNotFoundError):
    """A file or directory the stage needs is not there; the message says which stage or param provides it."""


class EndpointDown(StageError, RuntimeError):
    """An endpoint or service failed more often than its failure budget allows, after its retries."""
