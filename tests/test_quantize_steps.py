"""The quantisation steps (opfuse.quantization.steps), each applied alone to a state.

A Ranges step makes the first candidate (ONNX Runtime's QDQ model, all of it int8); AdaRound and
bias correction each refine that candidate where they raise its tuning output SQNR, decide there
whether they stay, and join the candidate maker that the mixed-precision search draws from. The
oracles: the weights and biases in the candidate against the Ranges step's, the scorer's SQNR of
the candidate recomputed here with ONNX Runtime.
"""

from __future__ import annotations

import tempfile

import numpy as np
import onnx
from onnx import numpy_helper

from opfuse.quantization.options import QuantizeOptions
from opfuse.quantization.presets import AdaRound, BiasCorrection, Ranges
from opfuse.quantization.qdq.quantizer import prepare
from opfuse.quantization.qdq.sqnr import OutputReference
from opfuse.quantization.report import QuantReport
from opfuse.quantization.steps import AdaRoundStep, BiasCorrectionStep, QuantState, RangesStep
from test_quantize_accuracy import smooth
from test_reconstruction import residual_net


def state_after_ranges(tmp: str, preset: str = "per-tensor") -> QuantState:
    options = QuantizeOptions(preset=preset, reconstruct=False)
    float_model, _ = prepare(residual_net(seed=2), options.chosen)
    tune = [{"x": x} for x in smooth(12, (1, 3, 16, 16), 1)]
    state = QuantState(options, QuantReport(), float_model, tune, tune, tmp, reconstruct=False)
    assert RangesStep(Ranges(), None).apply(state).ran
    return state


def ints(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if i.data_type in (3, 6)}  # int8, int32


def test_ranges_alone_makes_the_first_candidate_all_of_it_int8():
    with tempfile.TemporaryDirectory() as tmp:
        state = state_after_ranges(tmp)
        assert state.quantised and state.qdq is state.trial.qdq and state.maker.steps == []
        assert {n.op_type for n in state.qdq.graph.node} >= {"QuantizeLinear", "DequantizeLinear", "Conv"}


def test_adaround_alone_rounds_the_candidate_and_is_kept_only_where_it_helps():
    with tempfile.TemporaryDirectory() as tmp:
        state = state_after_ranges(tmp)
        before = ints(state.qdq)
        reference = OutputReference(state.float_model, state.tune)
        start_db = reference.sqnr(state.qdq)
        assert AdaRoundStep(AdaRound()).apply(state).ran
        facts = state.trial.facts
        without_db, with_db = facts.adaround_sqnr_db
        assert abs(without_db - start_db) < 1e-9  # the guard's figure is the scorer's
        changed = [k for k, v in ints(state.qdq).items() if not np.array_equal(v, before[k])]
        assert facts.adaround == (with_db > without_db) == bool(changed)
        assert abs(reference.sqnr(state.qdq) - max(without_db, with_db)) < 1e-9
        assert [type(s).__name__ for s in state.maker.steps] == ["AdaRoundTrial"]


def test_bias_correction_alone_corrects_int32_biases_only_where_it_helps():
    with tempfile.TemporaryDirectory() as tmp:
        state = state_after_ranges(tmp, "cpu")
        before = ints(state.qdq)
        assert BiasCorrectionStep(BiasCorrection()).apply(state).ran
        facts = state.trial.facts
        without_db, with_db = facts.bias_sqnr_db
        changed = {k for k, v in ints(state.qdq).items() if not np.array_equal(v, before[k])}
        assert all(before[k].dtype == np.int32 for k in changed)  # biases only, no weight
        assert (facts.correction is not None) == (with_db > without_db) == bool(changed)
        # a later candidate (one layer kept in float) is corrected as the first decided, not re-decided
        decided = facts.bias_sqnr_db
        later = state.maker.make(["pw"], keep_as="float")
        assert next(n for n in later.graph.node if n.name == "pw").input[1] == "wp"  # its float weight
        assert facts.bias_sqnr_db == decided


def test_a_step_on_a_model_with_nothing_quantised_says_so():
    with tempfile.TemporaryDirectory() as tmp:
        state = state_after_ranges(tmp)
        for node in [n for n in state.qdq.graph.node if n.op_type == "QuantizeLinear"]:
            node.op_type = "Identity"  # (no QuantizeLinear left)
        outcome = AdaRoundStep(AdaRound()).apply(state)
        assert not outcome.ran and outcome.reason == "nothing was quantised" and state.maker.steps == []
