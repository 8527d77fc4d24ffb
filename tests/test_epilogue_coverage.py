"""Property test: every element-wise op after a layer is fused or explained, on real graphs.

The alphabet is the ONNX specification's element-wise ops (an independent list, each one
checked against onnx's own schemas below), not opfuse's op table. The oracle knows, on its
own, which activations ONNX Runtime's FusedConv kernel runs (``fused_conv.cc`` parses them
through MLAS's activation kinds; HardSwish measured on onnxruntime 1.32): a chain
Conv -> op fuses exactly when the op is one of those, and otherwise the op stays with a
reason that names it and the target. Every element-wise op left whose input comes from a
layer must carry a reason, and the outputs must not change.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

import opfuse
from graphs import assert_same, model, tensor, vinfo

OPSET = 18
# ONNX's element-wise ops with one float input (attributes at their defaults or as given)
UNARY = {
    "Relu": {}, "LeakyRelu": {"alpha": 0.2}, "Sigmoid": {}, "HardSigmoid": {"alpha": 0.3, "beta": 0.4},
    "HardSwish": {}, "Tanh": {}, "Elu": {"alpha": 0.7}, "Selu": {}, "Celu": {"alpha": 1.5},
    "Softplus": {}, "Softsign": {}, "Mish": {}, "ThresholdedRelu": {"alpha": 0.3},
    "Abs": {}, "Neg": {}, "Exp": {}, "Erf": {}, "Floor": {}, "Ceil": {}, "Round": {}, "Sign": {},
    "Sin": {}, "Cos": {}, "Shrink": {"lambd": 0.5},
}
# the specification's activation functions among them (and PRelu below)
ACTIVATION_FUNCTIONS = {"Relu", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu",
                        "Celu", "Softplus", "Softsign", "Mish", "ThresholdedRelu", "PRelu"}
# element-wise ops whose second operand is a tensor the graph computes (not a constant to fold)
BINARY_WITH_INPUT = ("PRelu", "Mul", "Sub", "Div", "Max", "Min")
# FusedConv's activations, known independently of opfuse (see the module docstring)
FUSED_CONV_RUNS = {"Relu", "LeakyRelu", "Sigmoid", "HardSigmoid", "Tanh", "HardSwish"}
# ops that are a per-channel affine map of the layer's output (Neg: a scale by -1), which the
# folds absorb into its weights before any epilogue is considered
FOLDS_INTO_THE_LAYER = {"Neg"}


def test_the_alphabet_is_onnx_ops_of_one_float_input():
    for op in (*UNARY, *BINARY_WITH_INPUT):
        schema = onnx.defs.get_schema(op, OPSET)
        assert schema.since_version <= OPSET
        assert any("float" in t for c in schema.type_constraints for t in c.allowed_type_strs), op


def chain_model(ops: list[str], seed: int):
    r = np.random.default_rng(seed)
    inits = [tensor("W", r.normal(0, 0.5, (4, 4, 3, 3)).astype(np.float32)),
             tensor("B", r.normal(0, 0.3, 4).astype(np.float32))]
    inputs = [vinfo("x", [1, 4, 5, 5])]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["v0"], name="conv", pads=[1, 1, 1, 1])]
    for i, op in enumerate(ops):
        src, out, name = f"v{i}", f"v{i + 1}", f"op{i}"
        if op in UNARY:
            nodes.append(helper.make_node(op, [src], [out], name=name, **UNARY[op]))
        else:
            operand = f"t{i}"
            if op == "PRelu":
                inits.append(tensor(operand, r.uniform(0.05, 0.5, (4, 1, 1)).astype(np.float32)))
            else:
                inputs.append(vinfo(operand, [1, 4, 5, 5]))  # computed elsewhere: a graph input
            nodes.append(helper.make_node(op, [src, operand], [out], name=name))
    return model(nodes, inputs, [vinfo(f"v{len(ops)}", None)], inits, opset=OPSET)


@pytest.mark.parametrize("op", sorted(UNARY) + list(BINARY_WITH_INPUT))
def test_conv_then_one_op_fuses_exactly_when_the_kernel_runs_it(op):
    m = chain_model([op], seed=1)
    out, report = opfuse.optimize(m, target="onnxruntime", runtime_level="disabled")
    left = {n.name: n for n in out.graph}
    if op in FOLDS_INTO_THE_LAYER:  # -y is y scaled by -1: the fold absorbs it into the weights
        assert "op0" not in left and report.applied(f"Conv+{op}")
    elif op in FUSED_CONV_RUNS:
        assert "op0" not in left and [n.op_type for n in out.graph] == ["FusedConv"], report.refusals
        assert report.applied(f"Conv+{op}")
    else:
        assert "op0" in left, [n.op_type for n in out.graph]
        reason = report.reason_for("op0")
        assert op in reason and "ONNX Runtime" in reason, reason
    assert report.verification.ok


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(sorted(UNARY) + list(BINARY_WITH_INPUT)), min_size=1, max_size=3),
       st.integers(0, 2**16))
def test_no_element_wise_op_after_a_layer_is_left_without_a_record(ops, seed):
    m = chain_model(ops, seed)
    out, report = opfuse.optimize(m, target="onnxruntime", runtime_level="disabled", verify=False)
    fused = {name for r in report.records for name in r.removed}
    # the oracle: the first op fuses when the kernel runs it; after an activation no other
    # activation merges unless both are Relu (Relu/Relu is one Relu)
    folded = []  # leading ops that are a scale of the layer's output fold into its weights first
    for op in ops:
        if op not in FOLDS_INTO_THE_LAYER:
            break
        folded.append(f"op{len(folded)}")
    expected = []
    for i in range(len(folded), len(ops)):
        op = ops[i]
        if op not in FUSED_CONV_RUNS or (expected and not (op == "Relu" and ops[i - 1] == "Relu")):
            break
        expected.append(f"op{i}")
    expected = folded + expected
    assert sorted(n for n in fused if n.startswith("op")) == expected, (ops, report.records, report.refusals)
    for node in out.graph:  # every op after a layer, and every activation, says why it stayed
        producer = node.inputs[0].producer()
        after_layer = producer is not None and producer.op_type in ("Conv", "FusedConv")
        if node.name.startswith("op") and (after_layer or node.op_type in ACTIVATION_FUNCTIONS):
            assert report.reason_for(node.name), (ops, node.name, report.refusals)
    assert_same(m, out, seed=seed)
