"""fold-batchnorm, every case, run on ONNX Runtime against the unrewritten model: Conv,
ConvTranspose, Gemm and MatMul producers; the BatchNormalization modes and inputs it
refuses; float16, bfloat16 and mixed dtypes.

Applied folds: the node is gone, the report records it, the outputs match.
Refusals: the report carries the reason, the node is still there, the outputs match.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from graphs import assert_same, bn_node, bn_params, conv_bn_model, model, ops, rng, tensor, vinfo
from opfuse import optimize

F16 = TensorProto.FLOAT16


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
    if case == "training_mode=1":  # with the running statistics the spec requires in training mode
        m.graph.node[1].output.extend(["running_mean", "running_var"])  # (one output: bad input, test_cli)
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
