"""Errors opfuse raises on purpose, each mapped to a CLI exit code.

- :class:`BadInputError` (exit 2): the input cannot be read as a model opfuse can handle,
  or the command line is wrong. Its message is one line a user can act on.
- :class:`VerificationError` (exit 1): the optimised model does not compute the same
  numbers as the original; nothing was written. Carries the report.
- :class:`MissingExtraError` (exit 2): a package of an optional extra (``opfuse[ethos-u]``,
  ``[qnn]``, ``[torch]``, ``[plot]``: :data:`EXTRAS`) is not installed. A command that needs
  one asks :func:`require_extra` before any work: the message names each package missing and
  the ``pip install`` to run. An import of an extra's module deeper down that still fails (a
  module imported by another, before any check could run) is turned into the same line by the
  command line (:func:`extra_error`), so a missing extra is never an internal error.
"""

from __future__ import annotations

__all__ = ["OpfuseError", "BadInputError", "VerificationError", "MissingExtraError", "EXTRAS", "missing_extra",
           "require_extra", "extra_error"]

import dataclasses
import importlib.util


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


class MissingExtraError(BadInputError):
    """A package of an optional extra is not installed (exit 2): the message names the install command."""


@dataclasses.dataclass(frozen=True)
class Extra:
    """An extra of pyproject.toml: its packages (import name -> distribution) and where it exists."""

    name: str
    packages: tuple[tuple[str, str], ...]
    note: str = ""  # the platforms the extra's wheels exist for, when not every one

    @property
    def command(self) -> str:
        return f"pip install 'opfuse[{self.name}]'"


EXTRAS: dict[str, Extra] = {e.name: e for e in (
    Extra("ethos-u", (("ethosu", "ethos-u-vela"), ("ai_edge_litert", "ai-edge-litert"), ("flatbuffers", "flatbuffers"))),
    Extra("qnn", (("onnxruntime_qnn", "onnxruntime-qnn"),), note="Linux x86_64, Python 3.11+"),
    Extra("torch", (("torch", "torch"),)),
    Extra("plot", (("matplotlib", "matplotlib"),)),
    Extra("llm", (("transformers", "transformers"), ("gguf", "gguf"), ("accelerate", "accelerate"),
                  ("onnxruntime_genai", "onnxruntime-genai"))),
)}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


def missing_extra(extra: str) -> list[str]:
    """The distributions of ``extra`` that are not installed (nothing is imported)."""
    return [dist for module, dist in EXTRAS[extra].packages if not _installed(module)]


def _message(extra: Extra, what: str, absent: list[str]) -> str:
    where = f" ({extra.note})" if extra.note else ""
    return f"{what} needs {', '.join(absent)}{where}, which is not installed: {extra.command}"


def require_extra(extra: str, what: str) -> None:
    """Nothing, or :class:`MissingExtraError` naming ``what`` (``--target qnn``, ``--plot``...)
    needs, the packages missing and the install command."""
    absent = missing_extra(extra)
    if absent:
        raise MissingExtraError(_message(EXTRAS[extra], what, absent))


def extra_error(error: ModuleNotFoundError) -> MissingExtraError | None:
    """The error to report for an import of an extra's module that failed, or None when the
    module is no extra's (a bug, reported as such)."""
    top = (error.name or "").split(".")[0]
    for extra in EXTRAS.values():
        for module, dist in extra.packages:
            if module == top:
                return MissingExtraError(_message(extra, "this command", missing_extra(extra.name) or [dist]))
    return None
