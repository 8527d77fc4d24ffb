"""One candidate int8 model: ONNX Runtime's QDQ, then AdaRound, then bias correction.

A :class:`TrialMaker` turns "these layers stay out of int8" into a QDQ model, the same way
every time, so that the mixed-precision search (:mod:`.search`) compares candidates that
differ only in what they keep:

1. :meth:`Quantizer.quantize <opfuse.quantization.qdq.quantizer.Quantizer.quantize>` with the kept
   layers excluded (the keep action: in float, or with 16-bit activations);
2. AdaRound (:mod:`.adaround`): the rounding of every int8 weight chosen on the tuning
   samples, each layer kept only where its exact reconstruction error drops; results are
   cached by the layer's quantisation parameters, so a layer quantised alike in a later
   trial is not optimised again. The first trial of each calibration method decides
   whether AdaRound stays at all: only if it raises that trial's output SQNR on the tuning
   samples;
3. empirical bias correction (:mod:`.bias_correction`): decided layer by layer on the
   first trial of each calibration method (kept where it raises the output SQNR), the
   same corrections applied to every later trial (a layer kept out of int8 is skipped).

The samples are the tuning samples only: whatever judges a trial from outside (the
search's stopping test, the held-out verification) runs on others. The two whole-model
guards (AdaRound's and bias correction's "did the output SQNR rise") run the candidate on
``runner`` when one is given: the ``qnn`` preset passes the HTP's, since a rounding fitted
to ONNX Runtime's CPU QDQ can raise the CPU's SQNR and lower the NPU's (silero_vad:
docs/results/measurements.md).
"""

from __future__ import annotations

__all__ = ["TrialMaker", "MethodFacts", "Trial", "CandidateStep", "AdaRoundTrial", "BiasCorrectionTrial"]

import dataclasses
from typing import Protocol

import onnx

from opfuse.quantization.algorithms.adaround import Rounding, adaround_layers, apply_rounding
from opfuse.quantization.algorithms.bias_correction import (
    BiasCorrection,
    apply_corrections,
    compute_corrections,
    select_corrections,
)
from opfuse.quantization.qdq.quantizer import Quantizer
from opfuse.quantization.qdq.sqnr import OutputReference

CHOICE_SAMPLES = 16  # tuning samples on which each bias correction is kept or not


@dataclasses.dataclass
class MethodFacts:
    """What the first trial of one calibration method decided."""

    adaround: bool = False
    adaround_sqnr_db: tuple[float, float] | None = None  # tuning output SQNR without -> with
    rounding: Rounding | None = None  # the first trial's per-layer results
    correction: BiasCorrection | None = None
    bias_sqnr_db: tuple[float, float] | None = None
    bias_skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    bias_layers: int = 0


class TrialMaker:
    """QDQ models of one float model on the tuning samples, as the module docstring says."""

    def __init__(self, quantizer: Quantizer, float_model: onnx.ModelProto, samples, *, adaround: bool = True,
                 bias_correction: bool = True, runner=None, runner_name: str = ""):
        self.quantizer = quantizer
        self.float_model = float_model
        self.samples = list(samples)
        self.reference = OutputReference(float_model, self.samples)  # on the CPU
        self.guard = self.reference.on(runner)  # the whole-model guards' scorer (module docstring)
        self.facts: dict[str, MethodFacts] = {}
        self._rounding_cache: dict = {}
        self.runner = runner  # (model, samples) -> outputs per sample, for the guards; None: the CPU
        self.runner_name = runner_name  # where the runner runs, as the notes say it ("HTP")
        self.steps: list[CandidateStep] = [*[AdaRoundTrial()] * adaround, *[BiasCorrectionTrial()] * bias_correction]
        self.first: Trial | None = None  # the first candidate, as :meth:`start` made it and the steps refined it

    @property
    def use_adaround(self) -> bool:
        return any(isinstance(s, AdaRoundTrial) for s in self.steps)

    @property
    def use_bias_correction(self) -> bool:
        return any(isinstance(s, BiasCorrectionTrial) for s in self.steps)

    def start(self, keep_as: str | None = None) -> Trial:
        """The first candidate (nothing kept out of int8), not refined yet: each quantisation step
        refines it in turn, deciding whether it stays (:class:`CandidateStep`), and then joins
        :attr:`steps`, which refine every later candidate as it decided; :meth:`make` with
        nothing kept gives (a copy of) this one."""
        qdq = self.quantizer.quantize([], keep_as=keep_as)
        self.first = Trial(qdq, True, self.facts.setdefault(self.quantizer.method, MethodFacts()))
        return self.first

    def make(self, keep=(), keep_as: str | None = None) -> onnx.ModelProto:
        """The QDQ model with ``keep`` out of int8 (``keep_as``: "float" or "int16"), refined by
        each candidate step in order (AdaRound, then bias correction)."""
        method = self.quantizer.method
        if not keep and self.first is not None:
            return _copy(self.first.qdq)
        qdq = self.quantizer.quantize(list(keep), keep_as=keep_as)
        if not any(n.op_type == "QuantizeLinear" for n in qdq.graph.node):
            return qdq  # nothing was quantised: no rounding to choose, no bias to correct, nothing to judge
        first = method not in self.facts
        trial = Trial(qdq, first, self.facts.setdefault(method, MethodFacts()))
        for step in self.steps:
            step.refine(self, trial)
        return trial.qdq

    def record_facts(self, report) -> None:
        """The calibration method's first-trial decisions (AdaRound, bias correction, ranges) in
        ``report`` (a :class:`~.report.QuantReport`), with a note where a step was not kept."""
        facts = self.facts.get(self.quantizer.method)
        for record in [*getattr(self.quantizer, "lstm_records", ()),  # LSTMs on an integer LSTM's grid, or why not
                       *getattr(self.quantizer, "device_notes", ())]:  # the device's own QDQ form
            if record not in report.notes:
                report.notes.append(record)
        if self.quantizer.range_choices:
            kinds: dict[str, int] = {}
            for choice in self.quantizer.range_choices:
                kinds[choice.kind] = kinds.get(choice.kind, 0) + 1
            report.range_kinds = kinds
        if facts is None:
            return
        where = f" on the {self.runner_name}" if self.runner is not None and self.runner_name else ""
        if facts.adaround_sqnr_db is not None:
            report.adaround_sqnr_db = facts.adaround_sqnr_db
            results = facts.rounding.results if facts.rounding else []
            report.adaround_layers = sum(r.kept for r in results) if facts.adaround else 0
            report.adaround_errors = [{"layer": r.layer, "nearest": r.nearest_error, "adaround": r.adaround_error,
                                       "kept": r.kept and facts.adaround} for r in results]
            if not facts.adaround:
                before, after = facts.adaround_sqnr_db
                report.notes.append(f"AdaRound did not raise the tuning output SQNR{where} ({before:.1f} -> "
                                    f"{after:.1f} dB), so the weights stay rounded to nearest")
        if facts.bias_sqnr_db is not None:
            report.bias_sqnr_db, report.bias_skipped = facts.bias_sqnr_db, facts.bias_skipped
            report.bias_corrected = facts.bias_layers
            if facts.correction is None:
                without_db, with_db = facts.bias_sqnr_db
                report.notes.append(f"bias correction did not raise the tuning output SQNR{where} "
                                    f"({without_db:.1f} -> {with_db:.1f} dB), so it was not applied")


@dataclasses.dataclass
class Trial:
    """One candidate as the candidate steps refine it."""

    qdq: onnx.ModelProto
    first: bool  # the first trial of its calibration method: the steps decide whether they stay
    facts: MethodFacts  # what that first trial decided
    judged: float | None = None  # the guard's figure for qdq as it now stands (each judge may compile on the HTP)


class CandidateStep(Protocol):
    """A step applied to every candidate the search makes (the module docstring's 2 and 3)."""

    def refine(self, maker: TrialMaker, trial: Trial) -> None: ...


class AdaRoundTrial:
    """AdaRound in a candidate: decided on the first trial, cached by layer afterwards."""

    def refine(self, maker: TrialMaker, trial: Trial) -> None:
        facts = trial.facts
        if not (trial.first or facts.adaround):
            return
        rounding = adaround_layers(maker.float_model, trial.qdq, maker.samples, maker._rounding_cache)
        if trial.first:
            without_db = maker.guard.sqnr(trial.qdq)
            rounded = _copy(trial.qdq)
            apply_rounding(rounded, rounding)
            with_db = maker.guard.sqnr(rounded)
            facts.adaround, facts.adaround_sqnr_db = with_db > without_db, (without_db, with_db)
            facts.rounding = rounding
            trial.judged = with_db if facts.adaround else without_db
        if facts.adaround:
            apply_rounding(trial.qdq, rounding)


class BiasCorrectionTrial:
    """Bias correction in a candidate: chosen layer by layer on the first trial, then reapplied."""

    def refine(self, maker: TrialMaker, trial: Trial) -> None:
        facts = trial.facts
        if trial.first:
            without_db = trial.judged if trial.judged is not None else maker.guard.sqnr(trial.qdq)
            subset = maker.reference.head(CHOICE_SAMPLES)
            corrected, correction = select_corrections(
                trial.qdq, compute_corrections(maker.float_model, trial.qdq, maker.samples), subset.sqnr)
            with_db = maker.guard.sqnr(corrected)
            facts.bias_sqnr_db = (without_db, with_db)
            facts.bias_skipped = dict(correction.skipped)
            if with_db > without_db:
                facts.correction, facts.bias_layers = correction, len(correction.layers)
                trial.qdq = corrected
        elif facts.correction is not None:
            apply_corrections(trial.qdq, facts.correction)


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out
