"""One candidate int8 model: ONNX Runtime's QDQ, then AdaRound, then bias correction.

A :class:`TrialMaker` turns "these layers stay out of int8" into a QDQ model, the same way
every time, so that the mixed-precision search (:mod:`.search`) compares candidates that
differ only in what they keep:

1. :meth:`Quantizer.quantize <opfuse.quantization.qdq.Quantizer.quantize>` with the kept
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
to ONNX Runtime's CPU QDQ can raise the CPU's SQNR and lower the NPU's (silero_vad
16k_op15: CPU 19.1 -> 22.0 dB, HTP 17.5 -> 8.4 dB).
"""

from __future__ import annotations

__all__ = ["TrialMaker", "MethodFacts"]

import dataclasses

import onnx

from opfuse.quantization.adaround import Rounding, adaround_layers, apply_rounding
from opfuse.quantization.bias_correction import (
    BiasCorrection,
    apply_corrections,
    compute_corrections,
    select_corrections,
)
from opfuse.quantization.qdq import Quantizer
from opfuse.quantization.sqnr import OutputReference, outputs_db

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
                 bias_correction: bool = True, runner=None):
        self.quantizer = quantizer
        self.float_model = float_model
        self.samples = list(samples)
        self.reference = OutputReference(float_model, self.samples)
        self.use_adaround = adaround
        self.use_bias_correction = bias_correction
        self.facts: dict[str, MethodFacts] = {}
        self._rounding_cache: dict = {}
        self.runner = runner  # (model, samples) -> outputs per sample, for the guards; None: the CPU

    def judge(self, model: onnx.ModelProto) -> float:
        """The tuning output SQNR of ``model`` as the guards measure it (module docstring)."""
        if self.runner is None:
            return self.reference.sqnr(model)
        return outputs_db(self.reference.names, self.reference.values, self.runner(model, self.samples))

    def make(self, keep=(), keep_as: str | None = None) -> onnx.ModelProto:
        """The QDQ model with ``keep`` out of int8 (``keep_as``: "float" or "int16")."""
        method = self.quantizer.method
        qdq = self.quantizer.quantize(list(keep), keep_as=keep_as)
        if not any(n.op_type == "QuantizeLinear" for n in qdq.graph.node):
            return qdq  # nothing was quantised: no rounding to choose, no bias to correct, nothing to judge
        first = method not in self.facts
        facts = self.facts.setdefault(method, MethodFacts())
        judged = None  # the guard's figure for qdq as it now stands (each judge may compile on the HTP)
        if self.use_adaround and (first or facts.adaround):
            rounding = adaround_layers(self.float_model, qdq, self.samples, self._rounding_cache)
            if first:
                without_db = self.judge(qdq)
                rounded = _copy(qdq)
                apply_rounding(rounded, rounding)
                with_db = self.judge(rounded)
                facts.adaround, facts.adaround_sqnr_db, facts.rounding = with_db > without_db, (without_db, with_db), rounding
                judged = with_db if facts.adaround else without_db
            if facts.adaround:
                apply_rounding(qdq, rounding)
        if self.use_bias_correction:
            if first:
                without_db = judged if judged is not None else self.judge(qdq)
                subset = self.reference.head(CHOICE_SAMPLES)
                corrected, correction = select_corrections(
                    qdq, compute_corrections(self.float_model, qdq, self.samples), subset.sqnr)
                with_db = self.judge(corrected)
                facts.bias_sqnr_db = (without_db, with_db)
                facts.bias_skipped = dict(correction.skipped)
                if with_db > without_db:
                    facts.correction, facts.bias_layers = correction, len(correction.layers)
                    qdq = corrected
            elif facts.correction is not None:
                apply_corrections(qdq, facts.correction)
        return qdq


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out
