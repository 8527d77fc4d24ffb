"""The Vela veto (opfuse.targets.ethos_u.vela_veto) tells a candidate Vela has no figure for from
a bug: the lowering's refusal and Vela's own failure are "no objection" with the reason kept; a
bug in the lowering (a TypeError, a KeyError...) is raised, not turned into "no objection"."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper
from onnx_ir.passes.common import ShapeInferencePass

from graphs import model, rng, tensor, vinfo
from opfuse.cost.profiles import load_profile
from opfuse.targets.ethos_u import lower, vela, vela_veto
from opfuse.targets.ethos_u.tflite_graph import LoweringError


def _conv_relu() -> tuple[ir.Node, list[ir.Node]]:
    w = rng(0).normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["y"], ["out"], name="relu")]
    m = ir.from_proto(model(nodes, [vinfo("x", [1, 3, 8, 8])], [vinfo("out", [1, 4, 8, 8])], [tensor("w", w)]))
    ShapeInferencePass()(m)
    conv = next(n for n in m.graph if n.op_type == "Conv")
    relu = next(n for n in m.graph if n.op_type == "Relu")
    return conv, [relu]


@pytest.fixture
def veto(monkeypatch):
    """The veto of ethos-u55-128 with the candidate's quantisation skipped (the lowering is replaced)."""
    monkeypatch.setattr(vela_veto, "_quantize", lambda float_model: float_model)
    return vela_veto.vela_fusion_veto(load_profile("ethos-u55-128"))


@pytest.mark.parametrize("bug", [TypeError("'NoneType' object is not subscriptable"), KeyError("t3"),
                                 AttributeError("'Value' object has no attribute 'dims'")])
def test_a_bug_in_the_lowering_is_raised_not_taken_for_no_objection(veto, monkeypatch, bug):
    def broken(*args, **kwargs):
        raise bug

    monkeypatch.setattr(lower, "lower_to_tflite", broken)
    conv, absorbed = _conv_relu()
    with pytest.raises(type(bug)):
        veto(conv, absorbed)


def test_a_candidate_the_lowering_refuses_is_no_objection_with_its_reason(veto, monkeypatch):
    def refuse(qdq, fuse_activations):
        raise LoweringError(None, "a residual Add has no TFLite form inside a conv")

    monkeypatch.setattr(lower, "lower_to_tflite", refuse)
    conv, absorbed = _conv_relu()
    assert veto(conv, absorbed) is None
    (verdict,) = veto.verdicts.values()
    assert verdict.fused_cycles is None and "residual Add" in verdict.note


def test_a_candidate_vela_cannot_compile_is_no_objection_with_its_reason(veto, monkeypatch):
    def fails(tflite, **kwargs):
        raise vela.VelaError("Vela could not compile the TFLite for ethos-u55-128 (exit 1): boom")

    monkeypatch.setattr(lower, "lower_to_tflite", lambda qdq, fuse_activations: b"tflite")
    monkeypatch.setattr(vela, "compile_with_vela", fails)
    conv, absorbed = _conv_relu()
    assert veto(conv, absorbed) is None
    (verdict,) = veto.verdicts.values()
    assert verdict.unfused_cycles is None and "Vela could not compile" in verdict.note
