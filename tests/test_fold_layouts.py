"""Folds through layout ops: graphs with the traits of TF/Keras and Caffe-origin exports.

Each graph is built here with the shapes real exporters write (a Caffe ResNet block re-exported
NHWC, tf2onnx's Conv1D and 1x1 heads, TensorFlow's Dense on 3-D input), optimised by opfuse
(which verifies), and compared on ONNX Runtime against the unrewritten model independently
(:func:`graphs.assert_same`) at two batch sizes. What must fold and what must be refused is
written down per case from the layout's algebra, never read from opfuse.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import opfuse

from graphs import FP16, assert_outputs_close, assert_same, model, ops, ort_run, rng, run, tensor, vinfo

n = helper.make_node
NHWC, NCHW = [0, 2, 3, 1], [0, 3, 1, 2]


def _check(m, batches=(1, 3), tol=None, **options):
    """opfuse's result (verified), and the same numbers as the original at each batch size."""
    out, report = opfuse.optimize(m, dims={"N": batches[0]}, **options)
    assert report.verification.ok
    for b in batches:
        assert_same(m, out, dims={"N": b}, **({} if tol is None else dict(rtol=tol[0], atol=tol[1])))
    return out, report


def _patterns(report):
    """The folds applied (cancel-transposes' moves are tested in test_cancel_transposes.py)."""
    return sorted(r.pattern for r in report.records if not r.pattern.startswith("Transpose"))


def _refusal(report, node):
    found = [r.reason for r in report.refusals if r.node == node]
    assert found, (node, report.refusals)
    return found[0]


# -- Caffe-origin ResNet re-exported NHWC: Conv -> Transpose -> Sub/Mul/Add ---------------------

def _affine_nhwc(prefix, x, c, r, dtype, nodes, inits):
    """Caffe's BatchNorm + Scale as a TensorFlow port writes it, on an NHWC tensor."""
    inits += [tensor(f"{prefix}.mean", r.normal(0, 0.5, c).astype(dtype)),
              tensor(f"{prefix}.scale", r.uniform(0.5, 1.5, c).astype(dtype)),
              tensor(f"{prefix}.beta", r.normal(0, 0.5, c).astype(dtype))]
    nodes += [n("Sub", [x, f"{prefix}.mean"], [f"{prefix}.s"], name=f"{prefix}_sub"),
              n("Mul", [f"{prefix}.s", f"{prefix}.scale"], [f"{prefix}.m"], name=f"{prefix}_mul"),
              n("Add", [f"{prefix}.m", f"{prefix}.beta"], [f"{prefix}.a"], name=f"{prefix}_add")]
    return f"{prefix}.a"


def caffe_nhwc_block(c=8, size=6, dtype=np.float32, opset=17, seed=0):
    """x (NHWC, from the block before) -> [T -> Conv -> T -> Sub/Mul/Add -> Relu] x 2 -> + x -> Relu."""
    r = rng(seed)
    nodes, inits, h = [n("Relu", ["inp"], ["x"], name="previous")], [], "x"
    for i in range(2):
        inits.append(tensor(f"w{i}", r.normal(0, 0.3, (c, c, 3, 3)).astype(dtype)))
        nodes += [n("Transpose", [h], [f"in{i}"], name=f"to_nchw{i}", perm=NCHW),
                  n("Conv", [f"in{i}", f"w{i}"], [f"conv{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
                  n("Transpose", [f"conv{i}"], [f"nhwc{i}"], name=f"to_nhwc{i}", perm=NHWC)]
        h = _affine_nhwc(f"bn{i}", f"nhwc{i}", c, r, dtype, nodes, inits)
        if i == 0:
            nodes.append(n("Relu", [h], ["relu0"], name="relu0"))
            h = "relu0"
    nodes += [n("Add", [h, "x"], ["res"], name="residual"), n("Relu", ["res"], ["y"], name="relu1")]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return model(nodes, [vinfo("inp", ["N", size, size, c], elem)], [vinfo("y", None, elem)], inits, opset=opset)


@pytest.mark.parametrize("opset", [11, 13, 17])
def test_a_caffe_nhwc_block_folds_every_affine_op_into_its_conv(opset):
    m = caffe_nhwc_block(opset=opset)
    out, report = _check(m)
    assert _patterns(report) == ["Conv+Add"] * 2 + ["Conv+Mul"] * 2 + ["Conv+Sub"] * 2, report.records
    assert ops(out).count("Sub") == ops(out).count("Mul") == 0 and ops(out).count("Add") == 1  # the residual
    assert ops(out).count("Transpose") == 2  # conv0's two cancel once its map is folded; the others stay
    assert not report.refusals, report.refusals
    assert all("through Transpose" in r.detail for r in report.records if r.pattern.startswith("Conv"))


def test_a_float16_nhwc_block_folds_and_keeps_its_numbers():
    m = caffe_nhwc_block(dtype=np.float16)
    out, report = _check(m, tol=FP16)
    assert len(_patterns(report)) == 6 and "Sub" not in ops(out)


def test_the_folded_tensor_keeps_the_consumer_name_and_the_rewired_values_get_fresh_ones():
    m = caffe_nhwc_block()
    out, report = _check(m)
    names = {v.name for node in out.graph for v in node.outputs}
    assert "bn1.a" in names  # the last fold of conv1's chain, checked by verification
    assert "conv0" not in names and "nhwc0" not in names  # they hold folded values now: new names
    checked = {c.name for c in report.verification.rewrites}
    assert "bn1.a" in checked


def _conv_transpose_affine(op="Mul", const_shape=(8,), perm=NHWC, c=8, size=(8, 5), extra_output=None, seed=1):
    r = rng(seed)
    inits = [tensor("w", r.normal(0, 0.3, (c, 3, 3, 3)).astype(np.float32)),
             tensor("k", r.uniform(0.5, 1.5, const_shape).astype(np.float32))]
    nodes = [n("Conv", ["x", "w"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
             n("Transpose", ["conv"], ["t"], name="t", perm=perm),
             n(op, ["t", "k"], ["y"], name="consumer")]
    outputs = [vinfo("y", None)] + ([vinfo(extra_output, None)] if extra_output else [])
    return model(nodes, [vinfo("x", ["N", 3, *size])], outputs, inits)


@pytest.mark.parametrize("shape, legal", [
    ((8,), True), ((1, 1, 1, 8), True), ((1, 8), True),  # along the last axis, where NHWC puts C
    ((8, 1, 1), False), ((1, 8, 1, 1), False),  # where C was before the Transpose (now H, also 8)
    ((5, 8), False), ((1, 1, 5, 1), False),  # along W
])
def test_after_an_nhwc_transpose_the_constant_must_vary_along_the_last_axis(shape, legal):
    m = _conv_transpose_affine("Mul", shape)
    out, report = _check(m)
    assert (_patterns(report) == ["Conv+Mul"]) is legal, (report.records, report.refusals)
    if not legal:
        reason = _refusal(report, "consumer")
        assert "axis" in reason and "Transpose 't'" in reason, reason
        assert "Mul" in ops(out)


def test_a_transposed_output_used_elsewhere_or_as_a_graph_output_stays():
    m = _conv_transpose_affine("Add", (8,), extra_output="t")
    out, report = _check(m)
    assert not report.records and "graph output" in _refusal(report, "consumer")
    m = _conv_transpose_affine("Add", (8,), extra_output="conv")
    out, report = _check(m)
    assert not report.records and "graph output" in _refusal(report, "consumer")


def test_a_shared_weight_gets_a_private_folded_copy_and_the_other_conv_is_untouched():
    r = rng(2)
    inits = [tensor("w", r.normal(0, 0.3, (4, 3, 1, 1)).astype(np.float32)),
             tensor("k", r.uniform(0.5, 1.5, 4).astype(np.float32))]
    nodes = [n("Conv", ["x", "w"], ["c1"], name="conv1"), n("Transpose", ["c1"], ["t"], name="t", perm=NHWC),
             n("Mul", ["t", "k"], ["y1"], name="mul"), n("Conv", ["x", "w"], ["y2"], name="conv2")]
    m = model(nodes, [vinfo("x", ["N", 3, 4, 4])], [vinfo("y1", None), vinfo("y2", None)], inits)
    out, report = _check(m)
    assert _patterns(report) == ["Conv+Mul"] and report.records[0].extra_bytes == 4 * 3 * 4
    expected, feeds = run(m, dims={"N": 2})
    assert np.array_equal(ort_run(out, feeds)["y2"], expected["y2"])  # bit for bit


@pytest.mark.parametrize("perm, folds", [([0, 1, 3, 2], True), (NHWC, False)])
def test_batchnorm_after_a_transpose_folds_only_where_its_axis_1_is_the_channel_axis(perm, folds):
    r = rng(3)
    c = 6
    inits = [tensor("w", r.normal(0, 0.3, (c, 3, 3, 3)).astype(np.float32)),
             tensor("g", r.uniform(0.5, 1.5, c).astype(np.float32)), tensor("b", r.normal(0, 1, c).astype(np.float32)),
             tensor("mu", r.normal(0, 1, c).astype(np.float32)), tensor("var", r.uniform(0.5, 2, c).astype(np.float32))]
    nodes = [n("Conv", ["x", "w"], ["conv"], name="conv"), n("Transpose", ["conv"], ["t"], name="t", perm=perm)]
    if not folds:  # NHWC's axis 1 is H: give it c rows so the statistics' shapes fit
        nodes[0] = n("Conv", ["x", "w"], ["conv"], name="conv", pads=[1, 1, 1, 1])
    nodes.append(n("BatchNormalization", ["t", "g", "b", "mu", "var"], ["y"], name="bn"))
    m = model(nodes, [vinfo("x", ["N", 3, c, c + 2] if not folds else ["N", 3, 7, 9])], [vinfo("y", None)], inits)
    out, report = _check(m)
    assert (_patterns(report) == ["Conv+BatchNormalization"]) is folds, (report.records, report.refusals)
    if not folds:
        assert "axis 1" in _refusal(report, "bn")


# -- tf2onnx's Keras Conv1D, magika's Slice, 1x1 heads --------------------------------------------

@pytest.mark.parametrize("opset", [11, 13])
def test_a_tf2onnx_conv1d_then_squeeze_then_bias_add_folds(opset):
    """[N, W, Cin] -> Unsqueeze(1) -> T(0,3,1,2) -> Conv(1 x 3) -> T(0,2,3,1) -> Squeeze(1) -> + b[Cout]."""
    r = rng(4)
    axes_in = opset >= 13
    inits = [tensor("w", r.normal(0, 0.3, (8, 5, 1, 3)).astype(np.float32)),
             tensor("b", r.normal(0, 1, 8).astype(np.float32))]
    if axes_in:
        inits.append(tensor("axis1", np.array([1], np.int64)))
    axes = dict(inputs=["axis1"]) if axes_in else dict(attrs={"axes": [1]})
    nodes = [n("Unsqueeze", ["x"] + axes.get("inputs", []), ["x4"], name="expand", **axes.get("attrs", {})),
             n("Transpose", ["x4"], ["xc"], name="to_nchw", perm=NCHW),
             n("Conv", ["xc", "w"], ["conv"], name="conv1d"),
             n("Transpose", ["conv"], ["t"], name="to_nhwc", perm=NHWC),
             n("Squeeze", ["t"] + axes.get("inputs", []), ["sq"], name="squeeze", **axes.get("attrs", {})),
             n("Add", ["sq", "b"], ["y"], name="bias")]
    m = model(nodes, [vinfo("x", ["N", 12, 5])], [vinfo("y", None)], inits, opset=opset)
    out, report = _check(m)
    assert _patterns(report) == ["Conv+Add"] and "Add" not in ops(out)


@pytest.mark.parametrize("channel_slice, folds", [((0, 2**62), True), ((0, 4), False)])
def test_magika_conv_slice_squeeze_add_folds_when_the_slice_keeps_every_channel(channel_slice, folds):
    """magika's Conv1D: Conv -> Slice (all axes; a full one on C) -> Squeeze(3) -> + b[1, C, 1]."""
    r = rng(5)
    c = 8
    inits = [tensor("w", r.normal(0, 0.3, (c, 4, 5, 1)).astype(np.float32)),
             tensor("b", r.normal(0, 1, (1, channel_slice[1] if not folds else c, 1)).astype(np.float32)),
             tensor("starts", np.array([0, channel_slice[0], 0, 0], np.int64)),
             tensor("ends", np.array([2**62, channel_slice[1], 6, 2**62], np.int64)),
             tensor("axes", np.array([0, 1, 2, 3], np.int64)), tensor("sq", np.array([3], np.int64))]
    nodes = [n("Conv", ["x", "w"], ["conv"], name="conv"), n("Slice", ["conv", "starts", "ends", "axes"], ["s"], name="slice"),
             n("Squeeze", ["s", "sq"], ["q"], name="squeeze"), n("Add", ["q", "b"], ["y"], name="bias")]
    m = model(nodes, [vinfo("x", ["N", 4, 12, 1])], [vinfo("y", None)], inits, opset=15)
    out, report = _check(m)
    assert (_patterns(report) == ["Conv+Add"]) is folds
    if not folds:
        assert "slices the channel axis" in _refusal(report, "bias")


@pytest.mark.parametrize("head", ["reshape0", "reshape_c", "flatten", "squeeze"])
def test_a_1x1_head_reshaped_to_n_c_then_bias_add_folds_with_a_dynamic_batch(head):
    r = rng(6)
    c = 10
    inits = [tensor("w", r.normal(0, 0.3, (c, 16, 1, 1)).astype(np.float32)),
             tensor("b", r.normal(0, 1, c).astype(np.float32))]
    layout = {"reshape0": ("Reshape", [0, -1]), "reshape_c": ("Reshape", [-1, c]),
              "flatten": ("Flatten", None), "squeeze": ("Squeeze", [2, 3])}[head]
    op, target = layout
    extra = []
    if target is not None:
        inits.append(tensor("target", np.array(target, np.int64)))
        extra = ["target"]
    nodes = [n("Conv", ["x", "w"], ["conv"], name="head"), n(op, ["conv"] + extra, ["flat"], name="layout"),
             n("Add", ["flat", "b"], ["y"], name="bias")]
    m = model(nodes, [vinfo("x", ["N", 16, 1, 1])], [vinfo("y", None)], inits, opset=17)
    out, report = _check(m)
    assert _patterns(report) == ["Conv+Add"], report.refusals
    assert ops(out) == ["Conv", op]


def test_a_reshape_that_merges_channels_with_space_is_refused_with_what_it_cannot_prove():
    r = rng(7)
    inits = [tensor("w", r.normal(0, 0.3, (4, 3, 1, 1)).astype(np.float32)),
             tensor("b", r.normal(0, 1, 4).astype(np.float32)), tensor("target", np.array([-1, 4], np.int64))]
    nodes = [n("Conv", ["x", "w"], ["conv"], name="conv"), n("Reshape", ["conv", "target"], ["flat"], name="reshape"),
             n("Add", ["flat", "b"], ["y"], name="bias")]
    m = model(nodes, [vinfo("x", ["N", 3, "H", 1])], [vinfo("y", None)], inits)
    out, report = opfuse.optimize(m, dims={"N": 2, "H": 3})
    reason = _refusal(report, "bias")
    assert "cannot prove" in reason and "Reshape 'reshape'" in reason, reason
    assert_same(m, out, dims={"N": 2, "H": 3})


# -- TensorFlow's Dense on 3-D input: Reshape -> MatMul -> Reshape -> Add ---------------------------

@pytest.mark.parametrize("op", ["Add", "Mul"])
def test_tensorflow_dense_on_3d_input_folds_its_bias_through_the_reshape(op):
    r = rng(8)
    inits = [tensor("w", r.normal(0, 0.3, (6, 5)).astype(np.float32)), tensor("b", r.normal(0, 1, 5).astype(np.float32)),
             tensor("to2d", np.array([-1, 6], np.int64)), tensor("to3d", np.array([-1, 7, 5], np.int64))]
    nodes = [n("Reshape", ["x", "to2d"], ["x2"], name="flatten"), n("MatMul", ["x2", "w"], ["p"], name="dense"),
             n("Reshape", ["p", "to3d"], ["p3"], name="unflatten"), n(op, ["p3", "b"], ["y"], name="bias")]
    m = model(nodes, [vinfo("x", ["N", 7, 6])], [vinfo("y", None)], inits)
    out, report = _check(m)
    assert _patterns(report) == [f"MatMul+{op}"], report.refusals
    assert ops(out) == ["Reshape", "Gemm" if op == "Add" else "MatMul", "Reshape"]


def test_a_bias_after_a_3d_matmul_and_a_reshape_is_refused_it_would_need_a_gemm():
    r = rng(9)
    inits = [tensor("w", r.normal(0, 0.3, (6, 5)).astype(np.float32)), tensor("b", r.normal(0, 1, 5).astype(np.float32)),
             tensor("to2d", np.array([-1, 5], np.int64))]
    nodes = [n("MatMul", ["x", "w"], ["p"], name="dense"), n("Reshape", ["p", "to2d"], ["p2"], name="flatten"),
             n("Add", ["p2", "b"], ["y"], name="bias")]
    m = model(nodes, [vinfo("x", ["N", 7, 6])], [vinfo("y", None)], inits)
    out, report = _check(m)
    assert not report.records and "2-D" in _refusal(report, "bias")


def test_a_plain_2d_matmul_and_bias_add_becomes_a_gemm():
    r = rng(10)
    inits = [tensor("w", r.normal(0, 0.3, (6, 5)).astype(np.float32)), tensor("b", r.normal(0, 1, 5).astype(np.float32))]
    nodes = [n("MatMul", ["x", "w"], ["p"], name="dense"), n("Add", ["p", "b"], ["y"], name="bias")]
    m = model(nodes, [vinfo("x", ["N", 6])], [vinfo("y", None)], inits)
    out, report = _check(m)
    assert ops(out) == ["Gemm"]


def test_the_float16_1x1_head_folds_too():
    r = rng(11)
    inits = [tensor("w", r.normal(0, 0.3, (10, 16, 1, 1)).astype(np.float16)),
             tensor("b", r.normal(0, 1, 10).astype(np.float16))]
    nodes = [n("Conv", ["x", "w"], ["conv"], name="head"), n("Flatten", ["conv"], ["flat"], name="flatten"),
             n("Add", ["flat", "b"], ["y"], name="bias")]
    m = model(nodes, [vinfo("x", ["N", 16, 1, 1], np.float16)], [vinfo("y", None, np.float16)], inits)
    out, report = _check(m, tol=FP16)
    assert _patterns(report) == ["Conv+Add"]
    expected, feeds = run(m, dims={"N": 2})
    assert_outputs_close(expected, ort_run(out, feeds), *FP16)


@pytest.mark.parametrize("where", ["after the conv", "after the transpose"])
def test_basic_pitch_conv_neg_folds_into_the_weights(where):
    """basic-pitch (tf2onnx): Conv -> Neg -> Transpose -> Reshape; -y is y scaled by -1."""
    r = rng(12)
    inits = [tensor("w", r.normal(0, 0.3, (6, 1, 1, 4)).astype(np.float32)),
             tensor("b", r.normal(0, 1, 6).astype(np.float32)), tensor("target", np.array([-1, 9, 6], np.int64))]
    conv = n("Conv", ["x", "w", "b"], ["conv"], name="conv")
    if where == "after the conv":
        nodes = [conv, n("Neg", ["conv"], ["neg"], name="neg"), n("Transpose", ["neg"], ["t"], name="t", perm=NHWC),
                 n("Reshape", ["t", "target"], ["y"], name="reshape")]
    else:
        nodes = [conv, n("Transpose", ["conv"], ["t"], name="t", perm=NHWC), n("Neg", ["t"], ["neg"], name="neg"),
                 n("Reshape", ["neg", "target"], ["y"], name="reshape")]
    m = model(nodes, [vinfo("x", ["N", 1, 1, 12])], [vinfo("y", None)], inits)
    out, report = _check(m)
    assert _patterns(report) == ["Conv+Neg"] and "Neg" not in ops(out)
