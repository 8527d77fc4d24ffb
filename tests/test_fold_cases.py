"""Every case of the folding passes, run on ONNX Runtime against the unrewritten model.

Applied folds: the node is gone, the report records it, the outputs match.
Refusals: the report carries the reason, the node is still there, the outputs match.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import opfuse
from conftest import assert_same, bn_node, bn_params, model, ops, rng, tensor, vinfo

F16 = TensorProto.FLOAT16


def optimize(m, **kw):
    kw.setdefault("verify", True)
    return opfuse.optimize(m, **kw)


def conv_bn_model(
    spatial=2, c_in=4, c_out=6, k=3, group=1, bias=True, eps=None, conv_attrs=None, size=7,
    opset=17, bn_attrs=None, dtype=np.float32, seed=0,
):
    r = rng(seed)
    w = r.normal(0, 0.5, (c_out, c_in // group) + (k,) * spatial).astype(dtype)
    inits = [tensor("W", w)] + bn_params("bn", c_out, seed, dtype)
    conv_inputs = ["x", "W"]
    if bias:
        inits.append(tensor("Bc", r.normal(0, 0.5, c_out).astype(dtype)))
        conv_inputs.append("Bc")
    attrs = dict(conv_attrs or {})
    attrs.setdefault("group", group)
    if "auto_pad" not in attrs:
        attrs.setdefault("pads", [k // 2] * (2 * spatial))
    bn_kw = dict(bn_attrs or {})
    if eps is not None:
        bn_kw["epsilon"] = eps
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("Conv", conv_inputs, ["y"], name="conv", **attrs),
        bn_node("bn", "y", "z", **bn_kw),
    ]
    return model(
        nodes,
        [vinfo("x", ["N", c_in] + [size] * spatial, elem)],
        [vinfo("z", ["N", c_out] + [f"s{i}" for i in range(spatial)], elem)],
        inits,
        opset=opset,
    )


def folded(report, node_name: str) -> bool:
    return any(node_name in r.removed for r in report.records)


# --- Conv + BatchNormalization -----------------------------------------------------------

CONV_CASES = {
    "1d": dict(spatial=1),
    "2d": dict(spatial=2),
    "3d": dict(spatial=3, size=5),
    "no-bias": dict(bias=False),
    "grouped": dict(group=2),
    "depthwise": dict(c_in=6, c_out=6, group=6),
    "depthwise-multiplier": dict(c_in=3, c_out=6, group=3),
    "strided": dict(conv_attrs={"strides": [2, 2]}),
    "dilated": dict(conv_attrs={"dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    "asym-pads": dict(conv_attrs={"pads": [0, 1, 2, 0]}),
    "auto-pad-same-upper": dict(conv_attrs={"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    "auto-pad-same-lower": dict(conv_attrs={"auto_pad": "SAME_LOWER"}),
    "auto-pad-valid": dict(conv_attrs={"auto_pad": "VALID"}),
    "1x1": dict(k=1),
    "eps-1e-3": dict(eps=1e-3),
    "opset-9": dict(opset=9),
    "opset-13": dict(opset=13),
    "opset-14-training-mode-0": dict(opset=14, bn_attrs={"training_mode": 0}),
    "opset-15": dict(opset=15),
    "opset-7-spatial-1": dict(opset=7, bn_attrs={"spatial": 1}),
}


@pytest.mark.parametrize("case", sorted(CONV_CASES))
def test_conv_bn_folds(case):
    m = conv_bn_model(**CONV_CASES[case])
    out, report = optimize(m, dims={"N": 2})
    assert ops(out) == ["Conv"]
    assert report.applied("Conv+BatchNormalization")
    assert report.verification.ok
    assert_same(m, out, dims={"N": 2})


def test_opset_6_with_is_test_folds_algebraically():
    # onnxruntime has no BatchNormalization-6 kernel, so the check is algebraic.
    m = conv_bn_model(opset=6, bn_attrs={"is_test": 1}, bias=False)
    out, report = optimize(m, verify=False)
    assert ops(out) == ["Conv"] and report.applied("Conv+BatchNormalization")
    w = onnx.numpy_helper.to_array(m.graph.initializer[0]).astype(np.float64)
    g, b, mu, var = (onnx.numpy_helper.to_array(t).astype(np.float64) for t in m.graph.initializer[1:5])
    s = g / np.sqrt(var + 1e-5)
    conv = next(iter(out.graph))
    np.testing.assert_allclose(conv.inputs[1].const_value.numpy(), w * s[:, None, None, None], rtol=1e-6)
    np.testing.assert_allclose(conv.inputs[2].const_value.numpy(), b - mu * s, rtol=1e-5, atol=1e-6)


def test_epsilon_is_read_from_the_node_and_defaulted_only_when_absent():
    for eps, expected in ((1e-3, 1e-3), (None, 1e-5), (0.1, 0.1)):
        m = conv_bn_model(eps=eps, bias=False)
        out, report = optimize(m)
        g, _, _, var = (onnx.numpy_helper.to_array(t).astype(np.float64) for t in m.graph.initializer[1:5])
        w = onnx.numpy_helper.to_array(m.graph.initializer[0]).astype(np.float64)
        conv = next(iter(out.graph))
        want = w * (g / np.sqrt(var + np.float32(expected)))[:, None, None, None]
        np.testing.assert_allclose(conv.inputs[1].const_value.numpy(), want, rtol=1e-6)
        assert report.records[0].detail == f"epsilon={float(np.float32(expected)):g}"


def test_conv_without_bias_gets_the_bn_bias():
    m = conv_bn_model(bias=False)
    out, _ = optimize(m)
    conv = next(iter(out.graph))
    assert len(conv.inputs) == 3 and conv.inputs[2] is not None
    assert conv.inputs[2].const_value.shape == (6,)


# --- BatchNormalization refusals -------------------------------------------------------------

BN_REFUSALS = {
    "training_mode=1": (dict(opset=14, bn_attrs={"training_mode": 1}), "training mode"),
    "opset-6-is_test-default": (dict(opset=6), "is_test=0"),
    "spatial=0": (dict(opset=7, bn_attrs={"spatial": 0}), "spatial=0"),
}


@pytest.mark.parametrize("case", sorted(BN_REFUSALS))
def test_bn_mode_refusals(case):
    kw, words = BN_REFUSALS[case]
    m = conv_bn_model(**kw)
    out, report = optimize(m, verify=False)
    assert ops(out) == ["Conv", "BatchNormalization"]
    assert words in report.reason_for("bn")


def test_bn_with_optional_outputs_is_refused():
    r = rng(1)
    inits = [tensor("W", r.normal(size=(4, 3, 3, 3)).astype(np.float32))] + bn_params("bn", 4)
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["y"], name="conv"),
        helper.make_node(
            "BatchNormalization", ["y", "bn.scale", "bn.B", "bn.mean", "bn.var"],
            ["z", "rm", "rv"], name="bn", training_mode=1,
        ),
    ]
    m = model(nodes, [vinfo("x", [2, 3, 5, 5])], [vinfo("z", [2, 4, 3, 3]), vinfo("rm", [4]), vinfo("rv", [4])],
              inits, opset=15)
    out, report = optimize(m, verify=False)
    assert "BatchNormalization" in ops(out)
    assert "training mode" in report.reason_for("bn") or "optional outputs" in report.reason_for("bn")


def test_bn_after_a_layer_without_weights_is_reported():
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), bn_node("bn", "r", "z")]
    m = model(nodes, [vinfo("x", [1, 4, 5, 5])], [vinfo("z", [1, 4, 5, 5])], bn_params("bn", 4))
    out, report = optimize(m)
    assert ops(out) == ["Relu", "BatchNormalization"]
    assert "Relu 'relu'" in report.reason_for("bn")


def test_bn_on_graph_input_is_reported():
    m = model([bn_node("bn", "x", "z")], [vinfo("x", [1, 4, 5, 5])], [vinfo("z", [1, 4, 5, 5])],
              bn_params("bn", 4))
    _, report = optimize(m)
    assert "graph input" in report.reason_for("bn")


def test_bn_stats_as_graph_input_are_refused_and_inputs_unchanged():
    m = conv_bn_model()
    m.graph.input.append(vinfo("bn.mean", [6]))  # initializer also listed as an input
    out, report = optimize(m)
    assert "can be overridden at run time" in report.reason_for("bn")
    assert [v.name for v in out.graph.inputs] == ["x", "bn.mean"]
    assert "bn.mean" in out.graph.initializers
    assert_same(m, out)


def test_weight_as_pure_graph_input_is_refused():
    m = conv_bn_model()
    w = m.graph.initializer[0]
    m.graph.initializer.remove(w)
    m.graph.input.append(vinfo("W", list(w.dims)))
    out, report = optimize(m, verify=False)
    assert "graph input, set at run time" in report.reason_for("bn")
    assert ops(out) == ["Conv", "BatchNormalization"]


def test_weight_as_initializer_listed_as_input_is_refused():
    m = conv_bn_model()
    m.graph.input.append(vinfo("W", [6, 4, 3, 3]))
    out, report = optimize(m)
    assert "overridden at run time" in report.reason_for("bn")
    assert [v.name for v in out.graph.inputs] == ["x", "W"]


def test_conv_output_that_is_a_graph_output_is_refused():
    m = conv_bn_model()
    m.graph.output.append(vinfo("y", ["N", 6, 7, 7]))
    out, report = optimize(m)
    assert "graph output" in report.reason_for("bn")
    assert ops(out) == ["Conv", "BatchNormalization"]
    assert_same(m, out)


def test_conv_output_with_two_consumers_is_refused():
    m = conv_bn_model()
    m.graph.node.append(helper.make_node("Relu", ["y"], ["r"], name="relu"))
    m.graph.output.append(vinfo("r", ["N", 6, 7, 7]))
    out, report = optimize(m)
    reason = report.reason_for("bn")
    assert "feeds 2 consumers" in reason and "Relu 'relu'" in reason
    assert_same(m, out)


def test_bn_output_name_is_kept_when_it_is_a_graph_output():
    m = conv_bn_model()
    out, _ = optimize(m)
    assert [v.name for v in out.graph.outputs] == ["z"]
    assert [v.name for v in out.graph.inputs] == ["x"]


# --- float16, bfloat16 and mixed dtypes ------------------------------------------------------

def test_float16_conv_bn_folds():
    m = conv_bn_model(dtype=np.float16)
    out, report = optimize(m)
    assert ops(out) == ["Conv"]
    assert next(iter(out.graph)).inputs[1].const_value.dtype == ir.DataType.FLOAT16
    assert_same(m, out, rtol=1e-2, atol=2e-3)


def test_bn15_float16_data_float32_statistics():
    r = rng(2)
    inits = [tensor("W", r.normal(0, 0.5, (6, 4, 3, 3)).astype(np.float16))] + bn_params("bn", 6, 3, np.float32)
    nodes = [helper.make_node("Conv", ["x", "W"], ["y"], name="conv", pads=[1, 1, 1, 1]),
             bn_node("bn", "y", "z", epsilon=1e-3)]
    m = model(nodes, [vinfo("x", [1, 4, 6, 6], F16)], [vinfo("z", [1, 4 + 2, 6, 6], F16)], inits, opset=15)
    out, report = optimize(m)
    assert ops(out) == ["Conv"]
    conv = next(iter(out.graph))
    assert conv.inputs[1].const_value.dtype == ir.DataType.FLOAT16
    assert conv.inputs[2].const_value.dtype == ir.DataType.FLOAT16
    onnx.checker.check_model(ir.serde.serialize_model(out), full_check=True)
    assert_same(m, out, rtol=1e-2, atol=2e-3)


def test_float16_overflow_is_refused_even_though_the_runtime_would_hide_it():
    m = conv_bn_model(dtype=np.float16, bias=False)
    for t in m.graph.initializer:
        if t.name == "bn.scale":
            t.CopyFrom(tensor("bn.scale", np.full(6, 3e4, np.float16)))
        if t.name == "bn.var":
            t.CopyFrom(tensor("bn.var", np.full(6, 1e-3, np.float16)))
    out, report = optimize(m, verify=False)
    reason = report.reason_for("bn")
    assert "overflow" in reason and "float16" in reason
    assert ops(out) == ["Conv", "BatchNormalization"]


def test_float16_underflow_is_refused():
    m = conv_bn_model(dtype=np.float16, bias=False)
    for t in m.graph.initializer:
        if t.name == "bn.scale":
            t.CopyFrom(tensor("bn.scale", np.full(6, 1e-4, np.float16)))
        if t.name == "bn.var":
            t.CopyFrom(tensor("bn.var", np.full(6, 1e3, np.float16)))
    out, report = optimize(m, verify=False)
    assert "underflow" in report.reason_for("bn")


def test_bfloat16_weights_stay_bfloat16():
    import ml_dtypes

    m = conv_bn_model(bias=False)
    w = onnx.numpy_helper.to_array(m.graph.initializer[0])
    m.graph.initializer[0].CopyFrom(tensor("W", w.astype(ml_dtypes.bfloat16)))
    m.graph.input[0].type.tensor_type.elem_type = TensorProto.BFLOAT16
    m.graph.output[0].type.tensor_type.elem_type = TensorProto.BFLOAT16
    out, report = optimize(m, verify=False)
    conv = next(iter(out.graph))
    assert conv.inputs[1].const_value.dtype == ir.DataType.BFLOAT16
    g, _, _, var = (onnx.numpy_helper.to_array(t).astype(np.float64) for t in m.graph.initializer[1:5])
    want = w.astype(ml_dtypes.bfloat16).astype(np.float64) * (g / np.sqrt(var + 1e-5))[:, None, None, None]
    got = conv.inputs[1].const_value.numpy().astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-2)


# --- ConvTranspose, Gemm, MatMul -------------------------------------------------------------

@pytest.mark.parametrize("group,bias,spatial,strides,out_pad", [
    (1, True, 2, 1, 0), (2, False, 2, 2, 1), (3, True, 1, 2, 0), (2, True, 3, 1, 0), (4, False, 2, 2, 0),
])
def test_conv_transpose_bn_folds(group, bias, spatial, strides, out_pad):
    r = rng(group)
    c_in, c_out = 4 * group // (2 if group == 4 else 1), 2 * group
    c_in = max(c_in, group)
    w = r.normal(0, 0.5, (c_in, c_out // group) + (3,) * spatial).astype(np.float32)
    inits = [tensor("W", w)] + bn_params("bn", c_out, group)
    inputs = ["x", "W"]
    if bias:
        inits.append(tensor("Bc", r.normal(size=c_out).astype(np.float32)))
        inputs.append("Bc")
    attrs = dict(group=group, strides=[strides] * spatial)
    if out_pad:
        attrs["output_padding"] = [out_pad] * spatial
    nodes = [helper.make_node("ConvTranspose", inputs, ["y"], name="deconv", **attrs),
             bn_node("bn", "y", "z", epsilon=1e-3)]
    m = model(nodes, [vinfo("x", [2, c_in] + [4] * spatial)], [helper.make_tensor_value_info("z", 1, None)], inits)
    out, report = optimize(m)
    assert ops(out) == ["ConvTranspose"]
    assert report.applied("ConvTranspose+BatchNormalization")
    assert_same(m, out)


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("c_shape", [None, (5,), (1, 5), (), (3, 1), (3, 5)])
def test_gemm_bn_folds(trans_b, c_shape):
    r = rng(3)
    b = r.normal(size=(5, 7) if trans_b else (7, 5)).astype(np.float32)
    inits = [tensor("B", b)] + bn_params("bn", 5, 4)
    inputs = ["a", "B"]
    if c_shape is not None:
        inits.append(tensor("C", r.normal(size=c_shape).astype(np.float32)))
        inputs.append("C")
    nodes = [helper.make_node("Gemm", inputs, ["y"], name="fc", transB=trans_b, alpha=0.7, beta=1.3),
             bn_node("bn", "y", "z")]
    m = model(nodes, [vinfo("a", [3, 7])], [vinfo("z", [3, 5])], inits)
    out, report = optimize(m)
    assert ops(out) == ["Gemm"]
    assert_same(m, out)


def test_matmul_bn_becomes_gemm():
    r = rng(4)
    inits = [tensor("W", r.normal(size=(7, 5)).astype(np.float32))] + bn_params("bn", 5)
    nodes = [helper.make_node("MatMul", ["a", "W"], ["y"], name="mm"), bn_node("bn", "y", "z")]
    m = model(nodes, [vinfo("a", ["N", 7])], [vinfo("z", ["N", 5])], inits)
    out, report = optimize(m, dims={"N": 4})
    assert ops(out) == ["Gemm"]
    assert report.applied("MatMul+BatchNormalization")[0].produced
    assert_same(m, out, dims={"N": 4})


def test_matmul_with_3d_input_is_refused():
    r = rng(4)
    inits = [tensor("W", r.normal(size=(7, 5)).astype(np.float32))] + bn_params("bn", 4)
    nodes = [helper.make_node("MatMul", ["a", "W"], ["y"], name="mm"), bn_node("bn", "y", "z")]
    m = model(nodes, [vinfo("a", [2, 4, 7])], [vinfo("z", [2, 4, 5])], inits)
    out, report = optimize(m)
    assert "not known to be 2-D" in report.reason_for("bn")
    assert_same(m, out)


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


# --- constants as Constant nodes, Identity, shared weights ------------------------------------

def test_constant_nodes_count_as_constants():
    m = conv_bn_model(bias=True)
    for init in list(m.graph.initializer):
        m.graph.node.insert(0, helper.make_node("Constant", [], [init.name], name=f"const_{init.name}", value=init))
    del m.graph.initializer[:]
    out, report = optimize(m)
    assert ops(out) == ["Conv"], report.refusals
    assert_same(m, out)


def test_identity_between_conv_and_bn_and_on_weights():
    m = conv_bn_model()
    m.graph.node[1].input[0] = "y_id2"
    m.graph.node.insert(1, helper.make_node("Identity", ["y"], ["y_id"], name="id1"))
    m.graph.node.insert(2, helper.make_node("Identity", ["y_id"], ["y_id2"], name="id2"))
    m.graph.node[0].input[1] = "W_id"  # torch's exporter puts Identity on weights
    m.graph.node.insert(0, helper.make_node("Identity", ["W"], ["W_id"], name="wid"))
    out, report = optimize(m)
    assert ops(out) == ["Conv"]
    assert set(report.records[0].removed) >= {"bn", "id1", "id2"}
    assert_same(m, out)


def test_identity_with_a_second_consumer_blocks():
    m = conv_bn_model()
    m.graph.node[1].input[0] = "y_id"
    m.graph.node.insert(1, helper.make_node("Identity", ["y"], ["y_id"], name="id1"))
    m.graph.output.append(vinfo("y_id", ["N", 6, 7, 7]))
    out, report = optimize(m)
    assert "graph output" in report.reason_for("bn")
    assert_same(m, out)


def two_convs_sharing_w(bn_on_both: bool):
    r = rng(6)
    inits = [tensor("W", r.normal(size=(6, 4, 3, 3)).astype(np.float32))] + bn_params("bn1", 6, 1)
    nodes = [helper.make_node("Conv", ["x", "W"], ["y1"], name="conv1"), bn_node("bn1", "y1", "z1"),
             helper.make_node("Conv", ["x", "W"], ["y2"], name="conv2")]
    if bn_on_both:
        inits += bn_params("bn2", 6, 2)
        nodes.append(bn_node("bn2", "y2", "z2", epsilon=1e-3))
    else:
        nodes.append(helper.make_node("Relu", ["y2"], ["z2"], name="relu"))
    return model(nodes, [vinfo("x", [1, 4, 6, 6])], [vinfo("z1", [1, 6, 4, 4]), vinfo("z2", [1, 6, 4, 4])], inits)


def test_shared_weight_gets_a_private_copy():
    m = two_convs_sharing_w(bn_on_both=False)
    out, report = optimize(m)
    assert ops(out) == ["Conv", "Conv", "Relu"]
    conv1, conv2 = list(out.graph)[:2]
    assert conv2.inputs[1].name == "W"  # untouched
    assert conv1.inputs[1] is not conv2.inputs[1]
    np.testing.assert_array_equal(conv2.inputs[1].const_value.numpy(),
                                  onnx.numpy_helper.to_array(m.graph.initializer[0]))
    assert report.records[0].extra_bytes == 6 * 4 * 3 * 3 * 4
    assert report.extra_bytes == 864
    assert_same(m, out)


def test_shared_weight_folded_at_both_sites_costs_nothing_extra():
    m = two_convs_sharing_w(bn_on_both=True)
    out, report = optimize(m)
    assert ops(out) == ["Conv", "Conv"]
    assert "W" not in out.graph.initializers
    assert report.extra_bytes == 0
    assert_same(m, out)


def test_shared_bn_statistics_between_two_bns():
    m = two_convs_sharing_w(bn_on_both=False)
    m.graph.node[3].CopyFrom(bn_node("bn1", "y2", "z2"))
    m.graph.node[3].name = "bn1b"
    out, report = optimize(m)
    assert ops(out) == ["Conv", "Conv"]
    assert_same(m, out)


# --- chains, subgraphs, functions --------------------------------------------------------------

def test_paddle_style_conv_transpose_add_bn_chain_becomes_one_node():
    r = rng(7)
    inits = [tensor("W", r.normal(size=(4, 6, 2, 2)).astype(np.float32)),
             tensor("bias", r.normal(size=(1, 6, 1, 1)).astype(np.float32))] + bn_params("bn", 6)
    nodes = [
        helper.make_node("ConvTranspose", ["x", "W"], ["y"], name="deconv", strides=[2, 2]),
        helper.make_node("Add", ["y", "bias"], ["a"], name="add"),
        bn_node("bn", "a", "z", epsilon=1e-3),
    ]
    m = model(nodes, [vinfo("x", [1, 4, 5, 5])], [vinfo("z", [1, 6, 10, 10])], inits)
    out, report = optimize(m)
    assert ops(out) == ["ConvTranspose"]
    assert report.pattern_counts() == {"ConvTranspose+Add": 1, "ConvTranspose+BatchNormalization": 1}
    assert not report.refusals
    assert_same(m, out)


def test_long_chain_folds_completely():
    m = conv_bn_model()
    extra = [tensor("k1", np.full((6, 1, 1), 2.0, np.float32)), tensor("k2", np.float32(0.5)),
             tensor("k3", np.arange(6, dtype=np.float32).reshape(1, 6, 1, 1))]
    m.graph.initializer.extend(extra)
    m.graph.node[1].output[0] = "z0"
    m.graph.node.extend([
        helper.make_node("Mul", ["k1", "z0"], ["z1"], name="mul"),
        helper.make_node("Sub", ["z1", "k2"], ["z2"], name="sub"),
        helper.make_node("Div", ["z2", "k3"], ["z3"], name="div_refused_zero"),
        helper.make_node("Add", ["z2", "k3"], ["z"], name="add"),
    ])
    m.graph.node.pop(-2)  # no Div by the zero entry
    out, report = optimize(m)
    assert ops(out) == ["Conv"]
    assert_same(m, out)


def if_model():
    r = rng(8)
    then_nodes = [helper.make_node("Conv", ["x", "W"], ["ty"], name="then_conv"), bn_node("bn", "ty", "tz")]
    else_nodes = [helper.make_node("Conv", ["x", "W"], ["ey"], name="else_conv"),
                  helper.make_node("Mul", ["ey", "k"], ["ez"], name="else_mul")]
    then_g = helper.make_graph(then_nodes, "then", [], [vinfo("tz", [1, 6, 3, 3])])
    else_g = helper.make_graph(else_nodes, "else", [], [vinfo("ez", [1, 6, 3, 3])])
    inits = [tensor("W", r.normal(size=(6, 4, 3, 3)).astype(np.float32)),
             tensor("k", np.full((6, 1, 1), 3.0, np.float32))] + bn_params("bn", 6)
    nodes = [helper.make_node("If", ["cond"], ["z"], name="if", then_branch=then_g, else_branch=else_g)]
    return model(nodes, [vinfo("cond", [], TensorProto.BOOL), vinfo("x", [1, 4, 5, 5])],
                 [vinfo("z", [1, 6, 3, 3])], inits)


def test_subgraphs_are_folded():
    m = if_model()
    out, report = optimize(m, verify=False)
    assert report.pattern_counts() == {"Conv+BatchNormalization": 1, "Conv+Mul": 1}
    assert all(r.graph.startswith("main/if/") for r in report.records)
    x = rng(9).normal(size=(1, 4, 5, 5)).astype(np.float32)
    from conftest import run
    for cond in (True, False):
        feeds = {"cond": np.array(cond), "x": x}
        expected, _ = run(m, feeds=feeds)
        actual, _ = run(out, feeds=feeds)
        np.testing.assert_allclose(actual["z"], expected["z"], rtol=1e-4, atol=1e-5 * np.abs(expected["z"]).max())
    # and the pipeline's own verification agrees
    optimize(m)


def test_model_local_functions_are_folded():
    r = rng(10)
    w = tensor("fw", r.normal(size=(6, 4, 3, 3)).astype(np.float32))
    params = bn_params("fbn", 6)
    body = [helper.make_node("Constant", [], [t.name], value=t) for t in [w, *params]]
    body += [helper.make_node("Conv", ["X", "fw"], ["y"], name="fconv"), bn_node("fbn", "y", "Y", epsilon=1e-3)]
    fn = helper.make_function("custom", "ConvBN", ["X"], ["Y"], body, [helper.make_opsetid("", 17)])
    nodes = [helper.make_node("ConvBN", ["x"], ["z"], domain="custom", name="call")]
    m = model(nodes, [vinfo("x", [1, 4, 5, 5])], [vinfo("z", [1, 6, 3, 3])], functions=[fn],
              extra_opsets=[helper.make_opsetid("custom", 1)])
    out, report = optimize(m)
    assert report.pattern_counts() == {"Conv+BatchNormalization": 1}
    assert report.records[0].graph == "function:custom.ConvBN"
    body_ops = [n.op_type for n in out.functions[("custom", "ConvBN", "")]]
    assert "BatchNormalization" not in body_ops
    assert_same(m, out)


def test_unknown_domain_nodes_pass_through_untouched():
    m = conv_bn_model()
    m.graph.node.append(helper.make_node("Mystery", ["z"], ["q"], domain="vendor.ops", name="mystery", alpha=3))
    m.graph.output[0].CopyFrom(vinfo("q", ["N", 6, 7, 7]))
    m.opset_import.append(helper.make_opsetid("vendor.ops", 1))
    out, report = optimize(m, verify=False)
    assert ops(out) == ["Conv", "Mystery"]
    node = list(out.graph)[1]
    assert node.domain == "vendor.ops" and node.attributes["alpha"].value == 3
    with pytest.raises(opfuse.BadInputError, match="cannot verify"):
        optimize(m)


def test_caller_model_is_not_mutated():
    m = conv_bn_model()
    before = m.SerializeToString()
    optimize(m)
    assert m.SerializeToString() == before
    irm = ir.serde.deserialize_model(m)
    optimize(irm)
    assert [n.op_type for n in irm.graph] == ["Conv", "BatchNormalization"]


def test_dynamic_batch_verifies_at_several_sizes():
    m = conv_bn_model()
    out, _ = optimize(m)
    for n in (1, 3, 8):
        assert_same(m, out, dims={"N": n})


def test_refusals_describe_the_final_graph():
    # Conv -> Add(const) -> BN: round one sees BN after Add; the final log must not.
    r = rng(11)
    inits = [tensor("W", r.normal(size=(6, 4, 3, 3)).astype(np.float32)),
             tensor("k", np.ones((6, 1, 1), np.float32))] + bn_params("bn", 6)
    nodes = [helper.make_node("Conv", ["x", "W"], ["y"], name="conv"),
             helper.make_node("Add", ["y", "k"], ["a"], name="add"), bn_node("bn", "a", "z")]
    m = model(nodes, [vinfo("x", [1, 4, 5, 5])], [vinfo("z", [1, 6, 3, 3])], inits)
    _, report = optimize(m, passes=["fold-batchnorm", "fold-arithmetic"])
    assert report.refusals == []


def test_loop_body_is_folded_with_outer_scope_weights():
    # Loop(trip_count, cond, x): body = Conv(x, W) -> BN -> carried x (W, BN params outer scope)
    r = rng(12)
    body_nodes = [helper.make_node("Conv", ["x_in", "W"], ["y"], name="body_conv", pads=[1, 1, 1, 1]),
                  bn_node("bn", "y", "x_out", epsilon=1e-3),
                  helper.make_node("Identity", ["cond_in"], ["cond_out"], name="cond_pass")]
    body = helper.make_graph(
        body_nodes, "body",
        [vinfo("i", [], TensorProto.INT64), vinfo("cond_in", [], TensorProto.BOOL), vinfo("x_in", [1, 4, 5, 5])],
        [vinfo("cond_out", [], TensorProto.BOOL), vinfo("x_out", [1, 4, 5, 5])],
    )
    inits = [tensor("W", r.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32)), tensor("n", np.int64(3)),
             tensor("c", np.array(True))] + bn_params("bn", 4)
    nodes = [helper.make_node("Loop", ["n", "c", "x"], ["z"], name="loop", body=body)]
    m = model(nodes, [vinfo("x", [1, 4, 5, 5])], [vinfo("z", [1, 4, 5, 5])], inits)
    out, report = optimize(m)
    assert report.pattern_counts() == {"Conv+BatchNormalization": 1}
    assert report.records[0].graph == "main/loop/body"
    body_ops = [n.op_type for n in out.graph.node("loop").attributes["body"].value]
    assert "BatchNormalization" not in body_ops
    assert_same(m, out)


def test_a_chain_of_folds_rounds_the_weight_once():
    # Conv -> BN -> Mul -> Add -> Mul in float16: the folded weight equals the float64
    # composition rounded once, not a float16 rounding after every fold.
    r = rng(13)
    w = r.normal(0, 0.5, (6, 4, 3, 3)).astype(np.float16)
    params = bn_params("bn", 6, 4, np.float16)
    k1 = r.uniform(0.3, 3, (6, 1, 1)).astype(np.float16)
    k2 = r.normal(size=(6, 1, 1)).astype(np.float16)
    k3 = r.uniform(0.3, 3, (1, 6, 1, 1)).astype(np.float16)
    inits = [tensor("W", w), tensor("k1", k1), tensor("k2", k2), tensor("k3", k3)] + params
    nodes = [helper.make_node("Conv", ["x", "W"], ["y"], name="conv", pads=[1, 1, 1, 1]),
             bn_node("bn", "y", "z0", epsilon=1e-3), helper.make_node("Mul", ["z0", "k1"], ["z1"], name="mul1"),
             helper.make_node("Add", ["z1", "k2"], ["z2"], name="add"),
             helper.make_node("Mul", ["k3", "z2"], ["z"], name="mul2")]
    m = model(nodes, [vinfo("x", [1, 4, 5, 5], F16)], [vinfo("z", [1, 6, 5, 5], F16)], inits)
    out, report = optimize(m)
    assert ops(out) == ["Conv"] and len(report.records) == 4
    g, b, mu, var = (onnx.numpy_helper.to_array(t).astype(np.float64) for t in params)
    s = g / np.sqrt(var + np.float32(1e-3)) * k1.astype(np.float64).reshape(-1) * k3.astype(np.float64).reshape(-1)
    want_w = (w.astype(np.float64) * s[:, None, None, None]).astype(np.float16)
    conv = next(iter(out.graph))
    np.testing.assert_array_equal(conv.inputs[1].const_value.numpy(), want_w)
    t = ((b - mu * g / np.sqrt(var + np.float32(1e-3))) * k1.reshape(-1) + k2.reshape(-1)) * k3.reshape(-1)
    np.testing.assert_array_equal(conv.inputs[2].const_value.numpy(), t.astype(np.float16))
    assert_same(m, out, rtol=1e-2, atol=2e-3)
