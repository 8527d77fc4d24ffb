"""fold-arithmetic: constant Add, Sub, Mul and Div along the channel axis of a producer,
and the operands it refuses (not per channel, divided by the conv, zero divisors, computed
at run time), run on ONNX Runtime against the unrewritten model.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from graphs import assert_same, model, ops, rng, tensor, vinfo
from opfuse import optimize



# --- constant Add / Sub / Mul / Div -----------------------------------------------------------

def arith_model(op, const_shape, conv_first=True, producer="Conv", seed=5, values=None):
    r = rng(seed)
    c = 6
    if producer == "Conv":
        w = r.normal(0, 0.5, (c, 4, 3, 3)).astype(np.float32)
        prod = helper.make_node("Conv", ["x", "W", "Bc"], ["y"], name="conv", pads=[1, 1, 1, 1])
        x = vinfo("x", [2, 4, 6, 6])  # width 6 == C: a rank-1 [C] constant broadcasts
    elif producer == "ConvTranspose":
        w = r.normal(0, 0.5, (4, c, 3, 3)).astype(np.float32)
        prod = helper.make_node("ConvTranspose", ["x", "W", "Bc"], ["y"], name="conv")
        x = vinfo("x", [2, 4, 5, 5])
    else:
        w = r.normal(0, 0.5, (7, c)).astype(np.float32)
        prod = helper.make_node("Gemm", ["x", "W", "Bc"], ["y"], name="conv")
        x = vinfo("x", [3, 7])
    const = values if values is not None else r.uniform(0.5, 2.0, const_shape).astype(np.float32)
    inits = [tensor("W", w), tensor("Bc", r.normal(size=c).astype(np.float32)), tensor("k", const)]
    operands = ["y", "k"] if conv_first else ["k", "y"]
    nodes = [prod, helper.make_node(op, operands, ["z"], name="arith")]
    return model(nodes, [x], [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], inits)


LEGAL_SHAPES = [(), (1,), (6, 1, 1), (1, 6, 1, 1), (1, 1, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("shape", LEGAL_SHAPES, ids=str)
@pytest.mark.parametrize("op,conv_first", [
    ("Add", True), ("Add", False), ("Mul", True), ("Mul", False), ("Sub", True), ("Sub", False), ("Div", True),
])
def test_constant_arithmetic_folds(op, conv_first, shape):
    m = arith_model(op, shape, conv_first)
    out, report = optimize(m)
    assert ops(out) == ["Conv"], report.refusals
    assert report.applied(f"Conv+{op}")
    assert_same(m, out)


@pytest.mark.parametrize("producer,shape", [
    ("ConvTranspose", (6, 1, 1)), ("ConvTranspose", ()), ("Gemm", (6,)), ("Gemm", (1, 6)), ("Gemm", ()),
])
@pytest.mark.parametrize("op", ["Add", "Mul", "Sub", "Div"])
def test_constant_arithmetic_folds_into_other_producers(producer, shape, op):
    m = arith_model(op, shape, producer=producer)
    out, report = optimize(m)
    assert ops(out) == [producer]
    assert_same(m, out)


ILLEGAL_SHAPES = {
    "rank-1 [C] aligns with width": ((6,), "aligns with the last axis"),
    "[1,1,1,C]": ((1, 1, 1, 6), "varies along the spatial axis 3"),
    "[1,1,H,1]": ((1, 1, 6, 1), "varies along the spatial axis 2"),
    "spatially varying [C,H,W]": ((6, 6, 6), "spatial axis"),
    "batch [2,1,1,1]": ((2, 1, 1, 1), "batch axis 0"),
    "rank 5": ((1, 1, 6, 1, 1), "higher rank"),
}


@pytest.mark.parametrize("case", sorted(ILLEGAL_SHAPES))
@pytest.mark.parametrize("op", ["Add", "Mul"])
def test_constant_not_along_channels_is_refused(case, op):
    shape, words = ILLEGAL_SHAPES[case]
    m = arith_model(op, shape)
    out, report = optimize(m)
    assert ops(out) == ["Conv", op]
    assert words in report.reason_for("arith"), report.reason_for("arith")
    assert_same(m, out)


def test_gemm_constant_per_row_is_refused():
    # A constant Add of shape [M, 1] varies per row: not a per-channel map, even though
    # Gemm's own C may have that shape (and folds, see test_gemm_bn_folds).
    m = arith_model("Add", (3, 1), producer="Gemm")
    out, report = optimize(m)
    assert "batch axis 0" in report.reason_for("arith")
    assert_same(m, out)


def test_constant_divided_by_conv_is_refused():
    m = arith_model("Div", (6, 1, 1), conv_first=False)
    out, report = optimize(m)
    assert "not affine" in report.reason_for("arith")
    assert_same(m, out)


def test_division_by_zero_entry_is_refused():
    values = np.ones((6, 1, 1), np.float32)
    values[2] = 0
    m = arith_model("Div", None, values=values)
    out, report = optimize(m, verify=False)
    assert "zero" in report.reason_for("arith")
    assert ops(out) == ["Conv", "Div"]


def test_operand_computed_at_run_time_is_refused():
    m = arith_model("Add", (6, 1, 1))
    m.graph.initializer.pop()  # k
    m.graph.node.insert(0, helper.make_node("Shape", ["x"], ["s"], name="shape"))
    m.graph.input.append(vinfo("k", [6, 1, 1]))
    out, report = optimize(m)
    assert "graph input, set at run time" in report.reason_for("arith")
