"""RMSNorm in every exporter's spelling (rms-norm) and the residual Add before it (skip-rms-norm):
each becomes SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization on ONNX Runtime and
RMSNormalization at opset 23, computes the same numbers on ONNX Runtime, and the illegal variants
stay with a reason. The graphs are built here from the formula y = x / sqrt(mean(x^2) + eps) * g."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from onnx import TensorProto, helper

import opfuse
from decoder_nets import export_tiny_llama
from graphs import assert_same, model, ops, rng, tensor, vinfo

D = 8
SHAPE = ("N", 5, D)


def rms_model(opset=17, rsqrt="div-one", x_first=True, casts=False, scale_first=True, axes=(-1,), keepdims=1,
              eps="scalar", residual=False, sum_used=False, shape=SHAPE, exponent=2.0):
    """[a + b ->] x [-> Cast] -> x * rsqrt(mean(x^2) + eps) [-> Cast] -> g * . (or . * g)."""
    r = rng(5)
    inits = [tensor("two", np.float32(exponent)), tensor("g", r.uniform(0.5, 1.5, (D,)).astype(np.float32))]
    inputs = [vinfo("x", shape)]
    nodes = []
    if eps == "scalar":
        inits.append(tensor("eps", np.float32(1e-5)))
    elif eps == "vector":
        inits.append(tensor("eps", np.full((D,), 1e-5, np.float32)))
    else:  # computed at run time
        inputs.append(vinfo("eps", []))
    if residual:
        inputs.append(vinfo("skip", shape if residual is True else residual))
        nodes.append(helper.make_node("Add", ["x", "skip"], ["s"]))
    x = "s" if residual else "x"
    if casts:
        nodes.append(helper.make_node("Cast", [x], ["xc"], to=TensorProto.FLOAT))
        x = "xc"
    nodes.append(helper.make_node("Pow", [x, "two"], ["sq"]))
    if opset >= 18:
        inits.append(tensor("axes", np.array(axes, np.int64)))
        nodes.append(helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=keepdims))
    else:
        nodes.append(helper.make_node("ReduceMean", ["sq"], ["ms"], axes=list(axes), keepdims=keepdims))
    nodes += [helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rms"])]
    if rsqrt == "reciprocal":
        nodes.append(helper.make_node("Reciprocal", ["rms"], ["inv"]))
    else:
        inits.append(tensor("one", np.float32(1)))
        nodes.append(helper.make_node("Div", ["one", "rms"], ["inv"]))
    nodes.append(helper.make_node("Mul", [x, "inv"] if x_first else ["inv", x], ["n"]))
    n = "n"
    if casts:
        nodes.append(helper.make_node("Cast", ["n"], ["nc"], to=TensorProto.FLOAT))
        n = "nc"
    nodes.append(helper.make_node("Mul", ["g", n] if scale_first else [n, "g"], ["y"]))
    outputs = [vinfo("y", None)]
    if sum_used:  # the sum is the next block's residual
        nodes.append(helper.make_node("Add", ["s", "y"], ["next"]))
        outputs = [vinfo("next", None)]
    return model(nodes, inputs, outputs, inits, opset=opset)


def optimize(m, target, **kw):
    kw.setdefault("runtime_level", "disabled")
    return opfuse.optimize(m, target=target, **kw)


SPELLINGS = [
    dict(),  # TorchScript: x * Div(1, Sqrt(...)), attribute axes, Mul(g, .)
    dict(opset=18),  # TorchScript at 18: axes as an input
    dict(casts=True),  # HF LlamaRMSNorm: to(float32) and back
    dict(opset=18, casts=True, scale_first=False),
    dict(rsqrt="reciprocal", opset=18),  # dynamo's
    dict(rsqrt="reciprocal", opset=17, casts=True),
    dict(x_first=False),
    dict(rsqrt="reciprocal", x_first=False, scale_first=False),
    dict(axes=(2,)),  # the last axis, counted from the front
]


@pytest.mark.parametrize("case", SPELLINGS)
@pytest.mark.parametrize("target, opset, fused", [
    ("onnxruntime", None, "SimplifiedLayerNormalization"), ("onnx", 23, "RMSNormalization"),
])
def test_each_spelling_becomes_the_fused_op(case, target, opset, fused):
    m = rms_model(**case)
    out, report = optimize(m, target, opset=opset)
    assert ops(out).count(fused) == 1, (ops(out), report.refusals)
    assert not {"ReduceMean", "Pow", "Sqrt", "Div", "Reciprocal"} & set(ops(out)), ops(out)
    assert len(report.applied(f"RMSNorm->{fused}")) == 1
    assert report.verification.ok
    assert_same(m, out, dims={"N": 3})


def test_below_opset_23_the_onnx_target_keeps_it_with_the_opset_named():
    m = rms_model(opset=18)
    out, report = optimize(m, "onnx")
    assert "RMSNormalization" not in ops(out)
    assert any("opset 23" in r.reason for r in report.refusals if "RMSNorm" in r.pattern), report.refusals
    assert_same(m, out, dims={"N": 2})


@pytest.mark.parametrize("case, reason", [
    (dict(axes=(1,)), "reduces axes [1]"),
    (dict(opset=18, axes=(1,)), "reduces axes [1]"),
    (dict(axes=(-2, -1)), "reduces axes [-2, -1]"),
    (dict(keepdims=0, shape=(D, D, D)), "keepdims=0"),
    (dict(eps="vector"), "epsilon has shape [8]"),
    (dict(eps="computed"), "epsilon is computed at run time"),
    (dict(exponent=4.0), "exponent is [4.0], not the constant 2"),
])
@pytest.mark.parametrize("target, opset", [("onnxruntime", None), ("onnx", 23)])
def test_illegal_rms_norms_stay_with_a_reason(case, reason, target, opset):
    m = rms_model(**case)
    out, report = optimize(m, target, opset=opset)
    assert not {"SimplifiedLayerNormalization", "RMSNormalization"} & set(ops(out)), ops(out)
    reasons = " ".join(r.reason for r in report.refusals if "RMSNorm" in r.pattern)
    assert reason in reasons, report.refusals
    assert_same(m, out, dims={"N": 2})


# -- residual Add + RMSNorm -> SkipSimplifiedLayerNormalization ---------------------------------

@pytest.mark.parametrize("case", [dict(), dict(opset=18, casts=True), dict(rsqrt="reciprocal", scale_first=False)])
@pytest.mark.parametrize("sum_used", [False, True])
def test_a_residual_add_joins_the_rms_norm_on_onnxruntime(case, sum_used):
    m = rms_model(residual=True, sum_used=sum_used, **case)
    out, report = optimize(m, "onnxruntime")
    written = ops(out)
    assert written.count("SkipSimplifiedLayerNormalization") == 1, (written, report.refusals)
    assert "SimplifiedLayerNormalization" not in written
    assert written.count("Add") == int(sum_used)  # the next residual reads the fused op's sum
    (record,) = report.applied("Add+RMSNorm->SkipSimplifiedLayerNormalization")
    assert "took in RMSNorm->SimplifiedLayerNormalization" in record.detail
    (skip,) = [n for n in out.graph if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert [v.name for v in skip.outputs[1:3]] == ["", ""]  # mean, inv_std_var: read by nothing, not computed
    if sum_used:
        assert skip.domain == "com.microsoft" and skip.outputs[3].uses()  # input_skip_bias_sum
    assert report.verification.ok
    assert_same(m, out, dims={"N": 3})


def test_the_onnx_target_writes_no_skip_op():
    m = rms_model(residual=True, sum_used=True)
    out, report = optimize(m, "onnx", opset=23)
    assert ops(out).count("RMSNormalization") == 1 and "SkipSimplifiedLayerNormalization" not in ops(out)
    assert_same(m, out, dims={"N": 2})


def test_a_broadcast_skip_is_refused_with_a_reason():
    """input + skip where skip is [D] (a bias, not a residual of the same shape): not the kernel's skip."""
    m = rms_model(residual=[D], sum_used=True)
    out, report = optimize(m, "onnxruntime")
    assert ops(out).count("SimplifiedLayerNormalization") == 1 and "SkipSimplifiedLayerNormalization" not in ops(out)
    reasons = " ".join(r.reason for r in report.refusals if "Skip" in r.pattern)
    assert "Shape mismatch" in reasons, report.refusals
    assert_same(m, out, dims={"N": 2})


# -- a real export: TorchScript's tiny Llama ----------------------------------------------------

@pytest.fixture(scope="module")
def torchscript_llama(tmp_path_factory):
    """A tiny random Llama exported by TorchScript (dynamo=False) at opset 17, prefill; attention_mask and
    position_ids inputs, as test_rotary's TorchScript case and test_attention_torchscript have it (one export
    a session for all three: the norms read neither)."""
    return export_tiny_llama(tmp_path_factory.mktemp("llama") / "llama.onnx", exporter="torchscript", opset=17,
                             mask="input", positions=True)


def test_torchscript_llama_norms_become_skip_simplified_layer_normalization(torchscript_llama):
    """Five RMSNorms (two per layer, the final one): the first reads the embedding, the other four
    a residual sum, so one SimplifiedLayerNormalization and four SkipSimplifiedLayerNormalization."""
    out, report = opfuse.optimize(str(torchscript_llama), target="onnxruntime")
    assert report.verification.ok
    written = Counter(node.op_type for node in out.graph)
    assert written["SimplifiedLayerNormalization"] == 1 and written["SkipSimplifiedLayerNormalization"] == 4, written
    assert written["ReduceMean"] == 0
    counts = report.pattern_counts()
    assert counts["RMSNorm->SimplifiedLayerNormalization"] == 1
    assert counts["Add+RMSNorm->SkipSimplifiedLayerNormalization"] == 4
