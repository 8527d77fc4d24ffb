"""The quantisation algorithms as steps with one interface, run in a preset's order.

A step is built from its setting in the preset (:mod:`.presets`) and has one method,
``apply(state) -> StepOutcome``, in the way NNCF composes ``Algorithm.apply`` in a pipeline:
it reads and changes the :class:`QuantState` (the float model, the samples, the candidate
QDQ model, the report) and says whether it ran, and if not, why. A reason a user should read
is also a note of the report, where it was before; every outcome is in ``report.steps``.
A step catches only the exceptions it expects (the interpreter's
:class:`~.torch_ops_common.Unsupported`); any other error is a bug and is raised.

    Equalize        cross-layer equalisation, run by the fold (it is one of its passes)
    Ranges          the calibration method, then ONNX Runtime's quantiser (:class:`.qdq.Quantizer`):
                    the first candidate, all of it int8
    AdaRound        the rounding of each int8 weight of the candidate, kept where it helps (:mod:`.adaround`)
    BiasCorrection  empirical bias correction of the candidate, kept where it helps (:mod:`.bias_correction`)
    MixedPrecision  with a target, the monotone search (:mod:`.search`) from the candidate
    Reconstruction  block reconstruction of the model chosen (:mod:`.reconstruction`)

AdaRound and bias correction each refine the candidate the steps before them made, deciding
there whether they stay (:class:`.trials.CandidateStep`), then join the candidate maker
(:class:`.trials.TrialMaker`), which refines every later candidate the search makes as they
decided. Each can be applied alone to a state whose candidate a Ranges step made.
"""

from __future__ import annotations

__all__ = ["Step", "StepOutcome", "QuantState", "build_steps"]

import dataclasses
import importlib.util
from typing import Any, Protocol

import onnx

from opfuse.quantization.presets import (
    AdaRound,
    BiasCorrection,
    Equalize,
    MixedPrecision,
    Preset,
    Ranges,
    Reconstruction,
)
from opfuse.quantization.algorithms.bias_correction import compute_corrections, select_corrections
from opfuse.quantization.algorithms.rounding import torch_missing
from opfuse.quantization.qdq.quantizer import Quantizer
from opfuse.quantization.qdq.sqnr import OutputReference
from opfuse.quantization.report import QuantReport, ReconstructionFacts
from opfuse.quantization.algorithms.search import KEEP_ACTIONS, monotone_search
from opfuse.quantization.algorithms.trials import (
    CHOICE_SAMPLES,
    AdaRoundTrial,
    BiasCorrectionTrial,
    CandidateStep,
    Trial,
    TrialMaker,
)
from opfuse.runtime import create_session


@dataclasses.dataclass
class StepOutcome:
    """What one step did: ``ran``, and when it did not, ``reason`` in words."""

    step: str
    ran: bool
    reason: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class QuantState:
    """What the steps share: the inputs, the decisions so far and the candidate model."""

    options: Any  # .options.QuantizeOptions
    report: QuantReport
    float_model: onnx.ModelProto
    tune: list  # the tuning samples
    check: list  # the search's stopping samples (the tuning ones without a target)
    workdir: str
    device: Any = None  # the target's device module (None: ONNX Runtime's CPU)
    device_options: Any = None  # its parsed options
    reconstruct: bool | str = False  # decided: True or False, or "auto" until decided
    reconstruct_reason: str = ""  # decided False: why
    quantizer: Quantizer | None = None
    maker: TrialMaker | None = None
    trial: Trial | None = None  # the first candidate, refined by the steps in turn
    qdq: onnx.ModelProto | None = None
    keep: list = dataclasses.field(default_factory=list)
    why: dict = dataclasses.field(default_factory=dict)
    gain_of: dict = dataclasses.field(default_factory=dict)

    @property
    def preset(self) -> Preset:
        return self.options.chosen

    @property
    def keep_action(self):
        """How the search keeps a layer out of int8 (:data:`.search.KEEP_ACTIONS`)."""
        return KEEP_ACTIONS[self.options.keep_as or self.preset.keep_as]

    @property
    def quantised(self) -> bool:
        return self.qdq is not None and any(n.op_type == "QuantizeLinear" for n in self.qdq.graph.node)


class Step(Protocol):
    name: str

    def apply(self, state: QuantState) -> StepOutcome: ...


@dataclasses.dataclass
class EqualizeStep:
    setting: Equalize
    name = "equalize"

    def apply(self, state: QuantState) -> StepOutcome:
        """The pass ran with the folds (:func:`opfuse.optimize`, verified with them): its
        records are in the fusion log."""
        return StepOutcome(self.name, True)


@dataclasses.dataclass
class RangesStep:
    setting: Ranges
    reconstruction: Reconstruction | None  # the preset's, when it runs: it may pick the ranges
    name = "ranges"

    def apply(self, state: QuantState) -> StepOutcome:
        report, preset, calibrate = state.report, state.preset, state.options.calibrate
        # auto judges ranges by their 8-bit round trip (int8 asymmetric: the same 255 steps, the zero point moved)
        if calibrate == "auto" and preset.activation not in ("uint8", "int8"):
            calibrate = "minmax"
            report.notes.append(f"--calibrate auto reads MinMax ranges for {preset.activation} activations: its "
                                "per-tensor search judges a range by the 8-bit round trip")
        searched = self.reconstruction is not None and self.reconstruction.scale_fit == "search"
        if state.reconstruct == "auto" and searched:  # decided before calibrating: it picks the ranges
            ReconstructionStep(self.reconstruction).decide(state)
        if calibrate == "auto" and searched and state.reconstruct is True:
            calibrate = "minmax"  # the scale search (x0.7..x1.5) then clips where the block's output says so
            report.notes.append("--calibrate auto starts from MinMax ranges where block reconstruction searches "
                                "the activation scales (the qnn presets): each scale is then judged by its block's "
                                "output, not by its own round trip")
        state.quantizer = Quantizer(state.float_model, preset, state.tune, state.workdir, method=calibrate)
        report.calibration = calibrate
        guards = None
        if state.device is not None and any(isinstance(s, (AdaRound, BiasCorrection)) for s in state.options.steps()):
            guards = _device_runner(state.device.Runner(state.device_options),  # the device judges their fit
                                    [o.name for o in state.float_model.graph.output])
        state.maker = TrialMaker(state.quantizer, state.float_model, state.tune, adaround=False,
                                 bias_correction=False, runner=guards,
                                 runner_name=state.device.NAME if guards is not None else "")
        state.trial = state.maker.start(keep_as=state.keep_action.name)
        state.qdq = state.trial.qdq
        return StepOutcome(self.name, True)


@dataclasses.dataclass
class AdaRoundStep:
    setting: AdaRound
    name = "adaround"

    def apply(self, state: QuantState) -> StepOutcome:
        why = torch_missing("AdaRound")  # (its optimiser is torch's, :mod:`.algorithms.rounding`)
        if why and state.quantised:  # the command goes on: its output says why, as a note
            state.report.notes.append(why)
            return StepOutcome(self.name, False, why)
        return _refine(self.name, AdaRoundTrial(), state)


@dataclasses.dataclass
class BiasCorrectionStep:
    setting: BiasCorrection
    name = "bias-correction"

    def apply(self, state: QuantState) -> StepOutcome:
        return _refine(self.name, BiasCorrectionTrial(), state)


@dataclasses.dataclass
class MixedPrecisionStep:
    setting: MixedPrecision
    name = "mixed-precision"

    def apply(self, state: QuantState) -> StepOutcome:
        options, report, maker = state.options, state.report, state.maker
        action = state.keep_action
        if not options.searching:  # no target (--min-sqnr or a metric): the one candidate, all of it int8
            maker.record_facts(report)
            return StepOutcome(self.name, True)
        metric = options.metric

        def measured(model):
            return metric(create_session(model, "all"))

        outcome = monotone_search(
            lambda keep: maker.make(keep, keep_as=action.name), state.float_model,
            OutputReference(state.float_model, state.tune, runner=options.runner),
            OutputReference(state.float_model, state.check, runner=options.runner),
            report, keep_as=action, min_sqnr=options.min_sqnr, metric=measured if metric else None,
            min_metric=options.min_metric, max_steps=options.max_steps, ranked=options.search_candidates)
        state.qdq, state.keep, state.why, state.gain_of = outcome.model, outcome.kept, outcome.why, outcome.gain_of
        report.search_stopped = outcome.stopped
        report.tuning_samples, report.check_samples = len(state.tune), len(state.check)
        maker.record_facts(report)
        return StepOutcome(self.name, True)


@dataclasses.dataclass
class ReconstructionStep:
    setting: Reconstruction
    name = "reconstruction"

    def apply(self, state: QuantState) -> StepOutcome:
        if not state.quantised:
            return StepOutcome(self.name, False, "nothing was quantised")
        if state.reconstruct == "auto":
            self.decide(state)
        if state.reconstruct is not True:
            return StepOutcome(self.name, False, state.reconstruct_reason)
        return self._run(state)

    def decide(self, state: QuantState) -> None:
        """``reconstruct="auto"``: it runs when torch is installed, AdaRound does not round the
        weights already, and it is estimated to take at most the options' budget (times the
        setting's ``budget_factor``); otherwise the reason is a note of the report."""
        why = self._why_not(state)
        state.reconstruct, state.reconstruct_reason = not why, why
        if why:
            state.report.notes.append(why)

    def _why_not(self, state: QuantState) -> str:
        budget = state.options.reconstruction_budget_s
        if importlib.util.find_spec("torch") is None:
            return "block reconstruction did not run: torch is not installed (pip install 'opfuse[torch]')"
        if any(isinstance(s, AdaRound) for s in state.options.steps()):
            return ("block reconstruction did not run: AdaRound rounds the weights layer by layer "
                    "(--reconstruct on runs it too, from ONNX Runtime's rounding, kept only where it "
                    "raises the tuning output SQNR further)")
        from opfuse.quantization.algorithms.reconstruction import estimated_seconds  # (torch: only this step needs it)

        seconds, why = estimated_seconds(state.float_model, state.tune[0],
                                         iterations=state.options.reconstruction_iterations)
        factor = self.setting.budget_factor
        if seconds is None or seconds * factor > budget:
            how = ""  # for qnn, the estimate times the factor
            if seconds is not None and factor > 1:
                how = f"estimated {seconds / 60:.0f} min, times {factor:g} for the qnn presets' scale search; "
            return ("block reconstruction did not run: " + (why if seconds is None else
                    f"it would take about {seconds * factor / 60:.0f} min here ({how}more than "
                    f"{budget / 60:.0f})") + "; --reconstruct on runs it")
        return ""

    def _run(self, state: QuantState) -> StepOutcome:
        """The model the search chose, its rounding and activation scales learned block by block
        from ONNX Runtime's quantisation (AdaRound and bias correction are fitted to the
        rounding it replaces), then bias correction again where it helps; kept only if that
        raises the output SQNR on the tuning samples (on the device, with one)."""
        from opfuse.quantization.algorithms.reconstruction import SAMPLES, apply_reconstruction, reconstruct  # (torch)

        maker, report = state.maker, state.report
        start = maker.quantizer.quantize(list(state.keep), keep_as=state.keep_action.name)
        kept_scales = getattr(state.device, "kept_scales", None)  # a device whose kernels fix or share some
        result = reconstruct(maker.float_model, start, maker.samples, seed=state.options.seed,
                             iterations=state.options.reconstruction_iterations, scale_fit=self.setting.scale_fit,
                             kept_scales=kept_scales(maker.float_model) if kept_scales else ())
        candidate = onnx.ModelProto()
        candidate.CopyFrom(start)
        apply_reconstruction(candidate, result)
        if maker.use_bias_correction and result.values:
            candidate, _ = select_corrections(candidate, compute_corrections(maker.float_model, candidate,
                                                                             maker.samples),
                                              maker.reference.head(CHOICE_SAMPLES).sqnr)
        before = maker.guard.sqnr(state.qdq)
        after = maker.guard.sqnr(candidate) if result.values else before
        report.reconstruction = ReconstructionFacts(
            blocks=[dataclasses.asdict(b) for b in result.blocks], layers=result.layers, sqnr_db=(before, after),
            kept=after > before, stopped=result.stopped, weighted=result.weighted,
            unweighted_reason=result.unweighted_reason, seconds=result.seconds,
            samples=min(len(maker.samples), SAMPLES))
        if after > before:
            state.qdq = candidate
        return StepOutcome(self.name, True)


def _refine(name: str, step: CandidateStep, state: QuantState) -> StepOutcome:
    """``step`` refines the first candidate (and decides there whether it stays), then refines
    every later one the candidate maker makes."""
    if not state.quantised:
        return StepOutcome(name, False, "nothing was quantised")
    step.refine(state.maker, state.trial)
    state.maker.steps.append(step)
    state.qdq = state.trial.qdq
    return StepOutcome(name, True)


_STEPS = {Equalize: EqualizeStep, AdaRound: AdaRoundStep,
          BiasCorrection: BiasCorrectionStep, MixedPrecision: MixedPrecisionStep,
          Reconstruction: ReconstructionStep}


def build_steps(settings) -> list[Step]:
    """The steps of a list of settings (:meth:`.options.QuantizeOptions.steps`), in its order."""
    reconstruction = next((s for s in settings if isinstance(s, Reconstruction)), None)
    return [RangesStep(s, reconstruction) if isinstance(s, Ranges) else _STEPS[type(s)](s)
            for s in settings]


def _device_runner(runner, names):
    """A search :data:`~.search.Runner` on the device (every graph output, in the float model's order)."""

    def run(model, samples):
        return runner.outputs(model, [dict(s) for s in samples], names)

    return run
