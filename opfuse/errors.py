"""Errors opfuse raises on purpose, each mapped to a CLI exit code.

- :class:`BadInputError` (exit 2): the input cannot be read as a model opfuse can handle,
  or the command line is wrong. Its message is one line a user can act on.
- :class:`VerificationError` (exit 1): the optimised model does not compute the same
  numbers as the original; nothing was written. Carries the report.
"""

from __future__ import annotations

__all__ = ["OpfuseError", "BadInputError", "VerificationError"]


class OpfuseError(Exception):
    """Base class of the errors opfuse raises on purpose."""

    exit_code = 2


class BadInputError(OpfuseError):
    """The input is missing, unreadable, not ONNX, invalid, or unsupported."""

    exit_code = 2


class VerificationError(OpfuseError):
    """The optimised model's outputs differ from the original's beyond tolerance."""

    exit_code = 1

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report
