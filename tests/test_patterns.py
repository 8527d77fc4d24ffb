"""Multi-op patterns (fuse-patterns): each spelling exporters write becomes the fused op the
target runs, the result computes the same numbers on ONNX Runtime, and every illegal
variant stays with a reason. The graphs are built here by the formulas, not from opfuse."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

import opfuse
from graphs import assert_same, model, ops, rng, tensor, vinfo

D = 8


def optimize(m, target="onnx", **kw):
    kw.setdefault("runtime_level", "disabled")
    return opfuse.optimize(m, target=target, **kw)


# -- LayerNorm ----------------------------------------------------------------------------------

def layer_norm_model(opset=17, axes_as="attribute", square="pow", normalise="div", scale=True, bias=True,
                     scale_shape=(D,), axes=(-1,), keepdims=1, shape=("N", 5, D), extra_output=None):
    """x -> mean/var over ``axes`` -> (x - mean) / sqrt(var + eps) [* g] [+ b]."""
    r = rng(3)
    inits = [tensor("eps", np.float32(1e-5))]
    nodes = []

    def mean(src, out):
        if axes_as == "attribute":
            nodes.append(helper.make_node("ReduceMean", [src], [out], axes=list(axes), keepdims=keepdims))
        else:
            nodes.append(helper.make_node("ReduceMean", [src, "axes"], [out], keepdims=keepdims))

    if axes_as == "input":
        inits.append(tensor("axes", np.array(axes, np.int64)))
    mean("x", "mean")
    nodes.append(helper.make_node("Sub", ["x", "mean"], ["d"]))
    if square == "pow":
        inits.append(tensor("two", np.float32(2)))
        nodes.append(helper.make_node("Pow", ["d", "two"], ["dd"]))
    else:
        nodes.append(helper.make_node("Mul", ["d", "d"], ["dd"]))
    mean("dd", "var")
    nodes += [helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["std"])]
    if normalise == "div":
        nodes.append(helper.make_node("Div", ["d", "std"], ["n"]))
    else:
        nodes += [helper.make_node("Reciprocal", ["std"], ["inv"]), helper.make_node("Mul", ["d", "inv"], ["n"])]
    last = "n"
    if scale:
        inits.append(tensor("g", r.uniform(0.5, 1.5, scale_shape).astype(np.float32)))
        nodes.append(helper.make_node("Mul", [last, "g"], ["scaled"]))
        last = "scaled"
    if bias:
        inits.append(tensor("b", r.normal(0, 0.5, D).astype(np.float32)))
        nodes.append(helper.make_node("Add", [last, "b"], ["biased"]))
        last = "biased"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    outputs = [vinfo("y", None)] + ([vinfo(extra_output, None)] if extra_output else [])
    return model(nodes, [vinfo("x", list(shape))], outputs, inits, opset=opset)


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
@pytest.mark.parametrize("case", [
    dict(), dict(axes_as="input", opset=18), dict(square="mul"), dict(normalise="reciprocal"),
    dict(scale=False, bias=False), dict(bias=False), dict(axes=(2,)), dict(scale_shape=(1, 1, D)),
    dict(axes=(-2, -1), scale_shape=(5, D)),
])
def test_layer_norm_spellings_become_layer_normalization(target, case):
    m = layer_norm_model(**case)
    out, report = optimize(m, target)
    assert ops(out).count("LayerNormalization") == 1 and "ReduceMean" not in ops(out), (ops(out), report.refusals)
    assert report.applied("LayerNorm->LayerNormalization")
    assert report.verification.ok
    assert_same(m, out, dims={"N": 3})


@pytest.mark.parametrize("case, reason", [
    (dict(axes=(1,)), "not the same trailing axes"),
    (dict(keepdims=0, shape=(D, D, D), scale=False, bias=False), "keepdims=0"),
    (dict(extra_output="d"), "used outside"),
])
def test_illegal_layer_norms_stay_with_a_reason(case, reason):
    m = layer_norm_model(**case)
    out, report = optimize(m, "onnxruntime")
    assert "LayerNormalization" not in ops(out)
    reasons = " ".join(r.reason for r in report.refusals if "LayerNorm" in r.pattern)
    assert reason in reasons, report.refusals
    assert_same(m, out, dims={"N": 2})


def test_a_scale_that_varies_along_other_axes_stays_after_the_fused_core():
    """LayerNorm(x) * g with g per position ([S, D]) is not LayerNormalization's scale: the
    core fuses (with scale 1), the Mul and Add stay, and the refusal says why."""
    m = layer_norm_model(scale_shape=(5, D))
    out, report = optimize(m, "onnxruntime")
    assert ops(out) == ["LayerNormalization", "Mul", "Add"]
    assert "not the normalised shape" in " ".join(r.reason for r in report.refusals)
    assert_same(m, out, dims={"N": 2})


def test_layer_norm_below_opset_17_needs_the_opset_upgrade_on_the_onnx_target():
    m = layer_norm_model(opset=13)
    out, report = optimize(m, "onnx")
    assert "LayerNormalization" not in ops(out)
    assert "--opset 17" in " ".join(r.reason for r in report.refusals)
    up, report = optimize(m, "onnx", opset=17)
    assert "LayerNormalization" in ops(up) and any("opset raised 13 -> 17" in n for n in report.notes)
    assert_same(m, up, dims={"N": 2})
    ort_out, _ = optimize(m, "onnxruntime")  # ONNX Runtime runs LayerNormalization at any opset
    assert "LayerNormalization" in ops(ort_out)


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(axes_as=st.sampled_from(["attribute", "input"]), square=st.sampled_from(["pow", "mul"]),
       normalise=st.sampled_from(["div", "reciprocal"]), scale=st.booleans(), bias=st.booleans(),
       axes=st.sampled_from([(-1,), (2,), (1,), (-2, -1), (1, 2)]),
       scale_shape=st.sampled_from([(D,), (1, D), (5, D), (1,)]))
def test_random_layer_norm_variants_fuse_exactly_when_the_rules_allow(axes_as, square, normalise, scale, bias,
                                                                      axes, scale_shape):
    """The oracle: LayerNormalization normalises trailing axes, with a scale and bias over
    those axes only (the rank is 3 and static here; keepdims=0 has its own test)."""
    keepdims = 1
    if bias and not scale:
        scale = True  # (the builder adds the bias after the scale)
    m = layer_norm_model(opset=18 if axes_as == "input" else 17, axes_as=axes_as, square=square,
                         normalise=normalise, scale=scale, bias=bias, axes=axes, keepdims=keepdims,
                         scale_shape=scale_shape, shape=(2, 5, D))
    trailing = sorted(a % 3 for a in axes) in ([2], [1, 2])
    normalised = [5, D][-len(axes):] if trailing else None
    size_ok = not scale or scale_shape == (1,) or (normalised is not None
                                                    and list(scale_shape[-len(normalised):]) == normalised
                                                    and all(s == 1 for s in scale_shape[:-len(normalised)]))
    if scale and normalised is not None and len(scale_shape) < len(normalised):
        size_ok = size_ok and scale_shape == (1,)
    out, report = optimize(m, "onnxruntime", verify=False)
    # the core fuses whenever it normalises trailing axes; the scale (and the bias after it)
    # join only when they vary along the normalised axes alone
    assert ("LayerNormalization" in ops(out)) == trailing, (axes, scale_shape, ops(out), report.refusals)
    if trailing:
        assert ("Mul" in ops(out)) == (scale and not size_ok), (axes, scale_shape, ops(out))
    assert_same(m, out)


# -- GELU -----------------------------------------------------------------------------------------

def gelu_model(spelling: str, opset=20):
    """x -> GELU(x) in one exporter's spelling."""
    inits = [tensor("half", np.float32(0.5)), tensor("one", np.float32(1.0)),
             tensor("sqrt2", np.float32(math.sqrt(2))), tensor("inv_sqrt2", np.float32(1 / math.sqrt(2))),
             tensor("c", np.float32(0.044715)), tensor("k", np.float32(math.sqrt(2 / math.pi))),
             tensor("three", np.float32(3))]
    n = helper.make_node
    if spelling == "torch":  # 0.5 * (x * (1 + erf(x / sqrt2)))
        nodes = [n("Div", ["x", "sqrt2"], ["a"]), n("Erf", ["a"], ["e"]), n("Add", ["e", "one"], ["p"]),
                 n("Mul", ["x", "p"], ["xp"]), n("Mul", ["xp", "half"], ["y"])]
    elif spelling == "keras":  # (x * 0.5) * (1 + erf(x * 1/sqrt2))
        nodes = [n("Mul", ["x", "inv_sqrt2"], ["a"]), n("Erf", ["a"], ["e"]), n("Add", ["one", "e"], ["p"]),
                 n("Mul", ["x", "half"], ["xh"]), n("Mul", ["xh", "p"], ["y"])]
    elif spelling == "half-on-term":  # x * (0.5 * (1 + erf(x / sqrt2)))
        nodes = [n("Div", ["x", "sqrt2"], ["a"]), n("Erf", ["a"], ["e"]), n("Add", ["e", "one"], ["p"]),
                 n("Mul", ["half", "p"], ["ph"]), n("Mul", ["x", "ph"], ["y"])]
    else:  # tanh: 0.5 * x * (1 + tanh(k * (x + 0.044715 x^3)))
        nodes = [n("Pow", ["x", "three"], ["x3"]), n("Mul", ["c", "x3"], ["cx3"]), n("Add", ["x", "cx3"], ["in"]),
                 n("Mul", ["k", "in"], ["kin"]), n("Tanh", ["kin"], ["t"]), n("Add", ["t", "one"], ["p"]),
                 n("Mul", ["half", "p"], ["ph"]), n("Mul", ["x", "ph"], ["y"])]
    return model(nodes, [vinfo("x", ["N", 16])], [vinfo("y", None)], inits, opset=opset)


@pytest.mark.parametrize("spelling", ["torch", "keras", "half-on-term", "tanh"])
@pytest.mark.parametrize("target, op", [("onnx", "Gelu"), ("onnxruntime", None)])
def test_gelu_spellings_become_one_op(spelling, target, op):
    m = gelu_model(spelling)
    out, report = optimize(m, target, dims={"N": 4})
    expected = op or ("FastGelu" if spelling == "tanh" else "Gelu")
    assert ops(out) == [expected], (ops(out), report.refusals)
    if target == "onnx":
        assert out.graph.node(0).attributes["approximate"].value == ("tanh" if spelling == "tanh" else "none")
    else:
        assert out.graph.node(0).domain == "com.microsoft"
    assert report.verification.ok and report.applied(f"GELU->{expected}")
    assert_same(m, out, dims={"N": 5})


def test_erf_gelu_becomes_a_tanh_op_only_when_asked_and_is_logged_as_an_approximation():
    m = gelu_model("torch")
    exact, report = optimize(m, "onnxruntime")
    assert ops(exact) == ["Gelu"] and "approximation" not in report.applied("GELU->Gelu")[0].detail
    approx, report = optimize(m, "onnxruntime", approximate=True, verify=False)
    assert ops(approx) == ["FastGelu"]
    assert "approximation" in report.applied("GELU->FastGelu")[0].detail


def test_gelu_below_opset_20_stays_on_the_onnx_target_with_the_opset_in_the_reason():
    m = gelu_model("torch", opset=17)
    out, report = optimize(m, "onnx")
    assert "Erf" in ops(out) and "--opset 20" in report.refusals[0].reason


# -- SiLU, HardSwish ------------------------------------------------------------------------------

def test_silu_becomes_quickgelu_on_onnxruntime_and_swish_at_opset_24():
    n = helper.make_node
    m = model([n("Sigmoid", ["x"], ["s"]), n("Mul", ["x", "s"], ["y"])], [vinfo("x", [2, 16])], [vinfo("y", None)],
              opset=24)
    out, report = optimize(m, "onnxruntime")
    assert ops(out) == ["QuickGelu"] and out.graph.node(0).attributes["alpha"].value == 1.0
    assert_same(m, out)
    std, _ = optimize(m, "onnx")
    assert ops(std) == ["Swish"]
    assert_same(m, std)


def hardswish_model(spelling: str, opset=14):
    n = helper.make_node
    inits = [tensor("three", np.float32(3)), tensor("zero", np.float32(0)), tensor("six", np.float32(6)),
             tensor("sixth", np.float32(1 / 6))]
    if spelling == "hardsigmoid":
        nodes = [n("HardSigmoid", ["x"], ["h"], alpha=1 / 6, beta=0.5), n("Mul", ["x", "h"], ["y"])]
    else:
        nodes = [n("Add", ["x", "three"], ["a"]), n("Clip", ["a", "zero", "six"], ["c"])]
        if spelling == "tf2onnx":  # x * relu6(x + 3) * 0.16666667
            nodes += [n("Mul", ["x", "c"], ["xc"]), n("Mul", ["xc", "sixth"], ["y"])]
        else:  # x * (clip / 6)
            nodes += [n("Div", ["c", "six"], ["h"]), n("Mul", ["x", "h"], ["y"])]
    return model(nodes, [vinfo("x", [2, 4, 5, 5])], [vinfo("y", None)], inits, opset=opset)


@pytest.mark.parametrize("spelling", ["hardsigmoid", "tf2onnx", "div"])
def test_hardswish_spellings_become_hardswish(spelling):
    m = hardswish_model(spelling)
    out, report = optimize(m, "onnx")
    assert ops(out) == ["HardSwish"], (ops(out), report.refusals)
    assert_same(m, out)


def test_mobilenetv3_block_conv_hardswish_becomes_one_fused_conv_on_onnxruntime():
    """Conv -> x * Clip(x + 3, 0, 6) / 6 (a MobileNetV3 block as exported): the pattern makes
    it HardSwish, and the epilogue pass takes it into FusedConv (onnxruntime 1.32 runs it)."""
    r = rng(5)
    n = helper.make_node
    inits = [tensor("W", r.normal(0, 0.4, (8, 4, 3, 3)).astype(np.float32)),
             tensor("B", r.normal(0, 0.2, 8).astype(np.float32)),
             tensor("three", np.float32(3)), tensor("zero", np.float32(0)), tensor("six", np.float32(6))]
    nodes = [n("Conv", ["x", "W", "B"], ["v"], name="conv", pads=[1, 1, 1, 1]),
             n("Add", ["v", "three"], ["a"]), n("Clip", ["a", "zero", "six"], ["c"]),
             n("Mul", ["v", "c"], ["vc"]), n("Div", ["vc", "six"], ["y"])]
    m = model(nodes, [vinfo("x", ["N", 4, 7, 7])], [vinfo("y", None)], inits, opset=14)
    out, report = optimize(m, "onnxruntime", dims={"N": 2})
    assert ops(out) == ["FusedConv"] and out.graph.node(0).attributes["activation"].value == "HardSwish"
    assert report.applied("HardSwish") and report.applied("Conv+HardSwish")
    assert_same(m, out, dims={"N": 3})


def test_matmul_add_becomes_gemm_only_when_c_broadcasts_as_gemm_s():
    r = rng(2)
    n = helper.make_node
    for c_shape, fused in (((5,), True), ((1, 5), True), ((3, 1), True), ((2, 3, 5), False)):
        inits = [tensor("W", r.normal(size=(4, 5)).astype(np.float32)),
                 tensor("C", r.normal(size=c_shape).astype(np.float32))]
        m = model([n("MatMul", ["a", "W"], ["p"]), n("Add", ["p", "C"], ["y"])], [vinfo("a", [3, 4])],
                  [vinfo("y", None)], inits)
        out, report = optimize(m, "onnx")
        assert (ops(out) == ["Gemm"]) == fused, (c_shape, ops(out), report.refusals)
        assert_same(m, out)


# -- computed Reshape targets ---------------------------------------------------------------------

def reshape_model(source: str = "x"):
    """x [batch, seq, 8] -> Reshape(x, [dim0 of source, dim1 of source, 2, 4]) -> y."""
    n = helper.make_node
    inits = [tensor("i0", np.array(0, np.int64)), tensor("i1", np.array(1, np.int64)),
             tensor("ax", np.array([0], np.int64)), tensor("tail", np.array([2, 4], np.int64))]
    nodes = [n("Shape", [source], ["s"]), n("Gather", ["s", "i0"], ["d0"]), n("Gather", ["s", "i1"], ["d1"]),
             n("Unsqueeze", ["d0", "ax"], ["u0"]), n("Unsqueeze", ["d1", "ax"], ["u1"]),
             n("Concat", ["u0", "u1", "tail"], ["target"], axis=0), n("Reshape", ["x", "target"], ["y"], name="r")]
    inputs = [vinfo("x", ["batch", "seq", 8]), vinfo("other", ["seq", "batch"])]
    return model(nodes, inputs, [vinfo("y", None)], inits, opset=17)


def test_a_reshape_target_read_off_its_own_input_becomes_a_constant():
    m = reshape_model("x")
    out, report = optimize(m, "onnx", dims={"batch": 2, "seq": 3})
    assert ops(out) == ["Reshape"], ops(out)
    target = out.graph.node(0).inputs[1].const_value.numpy().tolist()
    assert target == [0, 0, 2, 4] and report.applied("computed Reshape target->constant")
    assert_same(m, out, dims={"batch": 3, "seq": 5})


def test_a_reshape_target_read_off_another_tensor_with_other_dims_stays():
    """'other' is [seq, batch]: its dim 0 is not x's dim 0, so no 0 may stand for it."""
    m = reshape_model("other")
    out, _ = optimize(m, "onnx", dims={"batch": 2, "seq": 2})
    assert "Concat" in ops(out) and "Shape" in ops(out)
    assert_same(m, out, dims={"batch": 2, "seq": 2})
