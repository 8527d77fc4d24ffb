"""What ``opfuse quantize`` is asked to do, as one frozen value: :class:`QuantizeOptions`.

:func:`opfuse.quantize` takes the same keywords as ever and builds this value from them
(``quantize(model, calibration, options=None, **keywords)``); the pipeline reads nothing
else. :meth:`QuantizeOptions.check` refuses what cannot run, before any work, each with
one line (:class:`~opfuse.errors.BadInputError`, exit 2), and
:meth:`QuantizeOptions.steps` is the preset's list of steps with the caller's choices
applied: ``equalize``, ``adaround``, ``bias_correction`` and ``reconstruct`` add or drop a
step of it (:mod:`.presets`).

The knobs a test or a benchmark turns are fields here, not module globals:
``reconstruction_budget_s`` (``reconstruct="auto"`` runs block reconstruction when it is
estimated to take at most this) and ``reconstruction_iterations`` (its Adam steps per block).
"""

from __future__ import annotations

__all__ = ["QuantizeOptions", "Calibrate", "KeepAs", "Reconstruct", "RECONSTRUCTION_BUDGET_S",
           "RECONSTRUCTION_ITERATIONS"]

import dataclasses
import os
import pathlib
from collections.abc import Callable
from typing import Any, Literal

from opfuse.errors import BadInputError, require_extra
from opfuse.quantization.presets import (
    DEFAULT_PRESET,
    PRESETS,
    AdaRound,
    BiasCorrection,
    Equalize,
    Preset,
    Ranges,
    Reconstruction,
    StepSetting,
)

Calibrate = Literal["auto", "minmax", "percentile", "entropy"]
KeepAs = Literal["float", "int16", "int16-weights"]
Reconstruct = bool | Literal["auto"]
CALIBRATIONS = ("auto", "minmax", "percentile", "entropy")  # .qdq.CALIBRATION_METHODS's keys
KEEP_AS = ("float", "int16", "int16-weights")  # .search.KEEP_ACTIONS's keys
RECONSTRUCTION_BUDGET_S = 900.0  # reconstruct="auto" runs when estimated to take at most this
RECONSTRUCTION_ITERATIONS = 300  # Adam steps per block


@dataclasses.dataclass(frozen=True)
class QuantizeOptions:
    """The keywords of :func:`opfuse.quantize`, documented there, and the reconstruction's knobs."""

    preset: str = DEFAULT_PRESET
    equalize: bool | None = None  # None: the preset's
    min_sqnr: float | None = None
    metric: Callable[[Any], float] | None = None  # metric(InferenceSession) -> float, higher is better
    min_metric: float | None = None
    bias_correction: bool = True
    adaround: bool | None = None  # None: the preset's
    reconstruct: Reconstruct = "auto"
    calibrate: Calibrate = "auto"
    holdout: int | None = None
    max_steps: int = 64
    search_candidates: int | None = None  # the search measures at most this many candidates per ranking (None: all)
    runner: Callable | None = None  # runner(model, samples) -> outputs per sample (.qdq.sqnr.Runner)
    keep_as: KeepAs | None = None  # None: the preset's
    output: str | os.PathLike | None = None
    report_path: str | os.PathLike | None = None
    overwrite: bool = False
    seed: int = 0
    dims: dict[str, int] | None = None
    constant_inputs: dict[str, object] | None = None
    require_npu: bool = False
    htp_options: dict[str, str] | None = None  # the device's options (--htp KEY=VALUE)
    context: str | os.PathLike | None = None
    reconstruction_budget_s: float = RECONSTRUCTION_BUDGET_S
    reconstruction_iterations: int = RECONSTRUCTION_ITERATIONS

    @classmethod
    def of(cls, options: QuantizeOptions | None, keywords: dict) -> QuantizeOptions:
        """``options`` with ``keywords`` replacing its fields (an unknown keyword: TypeError)."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"quantize() takes its options as a QuantizeOptions or as keywords, not {options!r}")
        unknown = sorted(set(keywords) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"quantize() got an unexpected keyword argument {unknown[0]!r}")
        return dataclasses.replace(options or cls(), **keywords)

    @property
    def searching(self) -> bool:
        """A target is given: the mixed-precision search runs."""
        return self.min_sqnr is not None or self.metric is not None

    @property
    def chosen(self) -> Preset:
        return PRESETS[self.preset]

    def check(self, model) -> None:
        """Every refusal that needs no work, as the one line the command line prints."""
        if self.calibrate not in CALIBRATIONS:
            raise BadInputError(f"unknown calibration method {self.calibrate!r}; choose from "
                                + ", ".join(CALIBRATIONS))
        if self.preset not in PRESETS:
            raise BadInputError(f"unknown preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        if (self.min_metric is None) != (self.metric is None):
            raise BadInputError("metric and min_metric go together")
        if self.keep_as is not None and self.keep_as not in KEEP_AS:
            raise BadInputError(f"unknown keep action {self.keep_as!r}; choose from {', '.join(KEEP_AS)}")
        if self.search_candidates is not None and self.search_candidates < 1:
            raise BadInputError(f"search_candidates is at least 1, not {self.search_candidates}")
        if self.output is not None and isinstance(model, (str, os.PathLike)) and not self.overwrite:
            if pathlib.Path(self.output).resolve() == pathlib.Path(model).resolve():
                raise BadInputError(f"{self.output}: refusing to overwrite the input model; choose another output")
        if self.reconstruct not in (True, False, "auto"):
            raise BadInputError(f"reconstruct is True, False or 'auto', not {self.reconstruct!r}")
        if self.reconstruct is True:
            require_extra("torch", "--reconstruct")

    def steps(self) -> tuple[StepSetting, ...]:
        """The preset's steps, in order, with this call's choices applied (module docstring)."""
        steps = list(self.chosen.steps)
        if self.equalize is not None:  # True: every pair; False: none
            steps = [s for s in steps if not isinstance(s, Equalize)] + [Equalize("equalize")] * self.equalize
        if self.adaround is not None:
            steps = [s for s in steps if not isinstance(s, AdaRound)]
            if self.adaround:
                after = next(i for i, s in enumerate(steps) if isinstance(s, Ranges)) + 1
                steps.insert(after, AdaRound())
        if not self.bias_correction:
            steps = [s for s in steps if not isinstance(s, BiasCorrection)]
        if self.reconstruct is False:
            steps = [s for s in steps if not isinstance(s, Reconstruction)]
        return tuple(sorted(steps, key=lambda s: isinstance(s, Equalize), reverse=True))  # the folds' pass first
