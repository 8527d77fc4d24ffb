"""Epilogue fusion into com.microsoft.FusedConv / FusedGemm, fused vs unfused on ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import opfuse
from graphs import assert_same, model, ops, rng, tensor, vinfo
from opfuse.targets.onnxruntime import has_layout_pass, runtime_graph

MS = [helper.make_opsetid("com.microsoft", 1)]


def fuse(m, **kw):
    kw.setdefault("target", "onnxruntime")
    kw.setdefault("runtime_level", "disabled")
    return opfuse.optimize(m, **kw)


def conv_then(act_nodes, *, bias=True, opset=17, extra_inits=(), c=8, inputs=None, outputs=None, name="conv"):
    """x -> Conv -> act_nodes...; act_nodes read 'y' and the last writes 'out'."""
    r = rng(0)
    inits = [tensor("W", r.normal(0, 0.3, (c, 4, 3, 3)).astype(np.float32))]
    conv_in = ["x", "W"]
    if bias:
        inits.append(tensor("B", r.normal(0, 0.3, c).astype(np.float32)))
        conv_in.append("B")
    nodes = [helper.make_node("Conv", conv_in, ["y"], name=name, pads=[1, 1, 1, 1]), *act_nodes]
    return model(nodes, inputs or [vinfo("x", ["N", 4, 6, 6])], outputs or [vinfo("out", ["N", c, 6, 6])],
                 inits + list(extra_inits), opset=opset)


def fused_node(m) -> ir.Node:
    found = [n for n in m.graph if n.domain == "com.microsoft"]
    assert len(found) == 1, [n.op_type for n in m.graph]
    return found[0]


ACTIVATIONS = {
    "Relu": ([helper.make_node("Relu", ["y"], ["out"], name="act")], (), "Relu", []),
    "LeakyRelu": ([helper.make_node("LeakyRelu", ["y"], ["out"], name="act", alpha=0.2)], (), "LeakyRelu", [0.2]),
    "LeakyRelu-default": ([helper.make_node("LeakyRelu", ["y"], ["out"], name="act")], (), "LeakyRelu", [0.01]),
    "Sigmoid": ([helper.make_node("Sigmoid", ["y"], ["out"], name="act")], (), "Sigmoid", []),
    "Tanh": ([helper.make_node("Tanh", ["y"], ["out"], name="act")], (), "Tanh", []),
    "HardSigmoid": ([helper.make_node("HardSigmoid", ["y"], ["out"], name="act", alpha=0.3, beta=0.4)], (),
                    "HardSigmoid", [0.3, 0.4]),
    "Clip-inputs": ([helper.make_node("Clip", ["y", "lo", "hi"], ["out"], name="act")],
                    (tensor("lo", np.float32(0)), tensor("hi", np.float32(6))), "Clip", [0, 6]),
    "Clip-min-only": ([helper.make_node("Clip", ["y", "lo"], ["out"], name="act")],
                      (tensor("lo", np.float32(-0.5)),), "Clip", [-0.5, float(np.finfo(np.float32).max)]),
    "Clip-max-only": ([helper.make_node("Clip", ["y", "", "hi"], ["out"], name="act")],
                      (tensor("hi", np.float32(0.7)),), "Clip", [float(np.finfo(np.float32).min), 0.7]),
    "Clip-no-bounds": ([helper.make_node("Clip", ["y"], ["out"], name="act")], (), "Clip",
                       [float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)]),
    "Relu-then-Clip": ([helper.make_node("Relu", ["y"], ["r"], name="act0"),
                        helper.make_node("Clip", ["r", "lo", "hi"], ["out"], name="act")],
                       (tensor("lo", np.float32(-1)), tensor("hi", np.float32(6))), "Clip", [0, 6]),
    "Clip-then-Relu": ([helper.make_node("Clip", ["y", "lo", "hi"], ["r"], name="act0"),
                        helper.make_node("Relu", ["r"], ["out"], name="act")],
                       (tensor("lo", np.float32(-1)), tensor("hi", np.float32(6))), "Clip", [0, 6]),
}


@pytest.mark.parametrize("case", sorted(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
def test_conv_activation_fuses(case, bias):
    nodes, inits, kind, params = ACTIVATIONS[case]
    m = conv_then(nodes, bias=bias, extra_inits=inits)
    out, report = fuse(m, dims={"N": 2})
    node = fused_node(out)
    assert node.op_type == "FusedConv" and ops(out) == ["FusedConv"]
    assert node.attributes["activation"].value == kind
    got = list(node.attributes["activation_params"].value) if params else []
    np.testing.assert_allclose(got, params, rtol=1e-6)
    assert report.verification.ok
    assert_same(m, out, dims={"N": 3})


@pytest.mark.parametrize("opset", [6, 10])
def test_clip_with_attribute_bounds(opset):
    m = conv_then([helper.make_node("Clip", ["y"], ["out"], name="act", min=0.0, max=6.0)], opset=opset)
    out, _ = fuse(m, verify=opset >= 7)
    assert list(fused_node(out).attributes["activation_params"].value) == [0.0, 6.0]


def test_clip_bound_from_a_graph_input_is_refused():
    m = conv_then([helper.make_node("Clip", ["y", "lo"], ["out"], name="act")],
                  inputs=[vinfo("x", ["N", 4, 6, 6]), vinfo("lo", [])])
    out, report = fuse(m)
    assert ops(out) == ["Conv", "Clip"]
    assert "lower bound is not a constant" in report.reason_for("act")


def test_output_with_two_consumers_or_graph_output_is_refused():
    m = conv_then([helper.make_node("Relu", ["y"], ["out"], name="act"),
                   helper.make_node("Sigmoid", ["y"], ["s"], name="sig")],
                  outputs=[vinfo("out", ["N", 8, 6, 6]), vinfo("s", ["N", 8, 6, 6])])
    out, report = fuse(m)
    assert ops(out) == ["Conv", "Relu", "Sigmoid"]
    assert "feeds 2 consumers" in report.reason_for("act")
    assert "feeds 2 consumers" in report.reason_for("sig")
    assert_same(m, out)
    m = conv_then([helper.make_node("Relu", ["y"], ["out"], name="act")],
                  outputs=[vinfo("out", ["N", 8, 6, 6]), vinfo("y", ["N", 8, 6, 6])])
    out, report = fuse(m)
    assert "graph output" in report.reason_for("act")
    assert [v.name for v in out.graph.outputs] == ["out", "y"]


def test_float64_conv_is_refused_by_dtype():
    r = rng(1)
    inits = [tensor("W", r.normal(size=(8, 4, 3, 3)))]
    nodes = [helper.make_node("Conv", ["x", "W"], ["y"], name="conv"), helper.make_node("Relu", ["y"], ["out"], name="act")]
    m = model(nodes, [vinfo("x", [1, 4, 5, 5], TensorProto.DOUBLE)], [vinfo("out", [1, 8, 3, 3], TensorProto.DOUBLE)], inits)
    out, report = fuse(m, verify=False)  # no float64 Conv kernel in onnxruntime's CPU provider
    assert "not float64" in report.reason_for("act")
    assert ops(out) == ["Conv", "Relu"]


def test_float16_conv_relu_fuses():
    r = rng(2)
    inits = [tensor("W", r.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float16))]
    nodes = [helper.make_node("Conv", ["x", "W"], ["y"], name="conv"), helper.make_node("Relu", ["y"], ["out"], name="act")]
    m = model(nodes, [vinfo("x", [1, 4, 5, 5], TensorProto.FLOAT16)], [vinfo("out", [1, 8, 3, 3], TensorProto.FLOAT16)], inits)
    out, report = fuse(m)
    assert ops(out) == ["FusedConv"]
    assert_same(m, out, rtol=1e-2, atol=2e-3)


# --- residual Add -----------------------------------------------------------------------------

def residual_model(*, act=True, bias=True, other_shape=None, negative=False, other_from="input"):
    """x -> Conv -> Add(other) -> [Relu]; other from a graph input, a Relu or another conv."""
    r = rng(3)
    inits = [tensor("W", r.normal(0, 0.3, (8, 8, 3, 3)).astype(np.float32))]
    conv_in = ["x", "W"] + (["B"] if bias else [])
    if bias:
        inits.append(tensor("B", r.normal(size=8).astype(np.float32)))
    nodes = [helper.make_node("Conv", conv_in, ["y"], name="conv", pads=[1, 1, 1, 1])]
    inputs = [vinfo("x", ["N", 8, 6, 6])]
    if other_from == "input":
        inputs.append(vinfo("z", other_shape or ["N", 8, 6, 6]))
        other = "z"
    elif other_from == "relu":
        nodes.insert(0, helper.make_node("Relu", ["x"], ["z"], name="zrelu"))
        other = "z"
    if negative:
        inits.append(tensor("k", np.float32(-100)))
        nodes.append(helper.make_node("Mul", [other, "k"], ["zneg"], name="neg"))
        other = "zneg"
    nodes.append(helper.make_node("Add", ["y", other], ["a"], name="add"))
    if act:
        nodes.append(helper.make_node("Relu", ["a"], ["out"], name="relu"))
    final = "out" if act else "a"
    return model(nodes, inputs, [vinfo(final, ["N", 8, 6, 6])], inits)


@pytest.mark.parametrize("act", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("other_from", ["input", "relu"])
def test_residual_add_becomes_z(act, bias, other_from):
    m = residual_model(act=act, bias=bias, other_from=other_from)
    out, report = fuse(m, dims={"N": 2})
    node = fused_node(out)
    assert len(node.inputs) == 4 and node.inputs[3] is not None and node.inputs[3].name == "z"
    if not bias:  # an explicit zero bias: the runtime's NCHWc pass skips Z without B
        assert not node.inputs[2].const_value.numpy().any()
    assert report.applied("Conv+Add+Relu" if act else "Conv+Add")
    assert_same(m, out, dims={"N": 2})


def test_strongly_negative_residual_is_added_before_the_activation():
    m = residual_model(negative=True)
    out, report = fuse(m)
    assert "FusedConv" in ops(out)
    expected, _ = __import__("graphs").run(m)
    assert (expected["out"] == 0).mean() > 0.3  # the residual really drives outputs negative
    assert_same(m, out)


def test_broadcasting_residual_is_refused():
    m = residual_model(other_shape=[1, 8, 1, 1])
    out, report = fuse(m)
    assert "does not broadcast" in report.reason_for("add")
    assert "Add" in ops(out)
    assert_same(m, out)


def test_add_after_the_activation_is_not_fused_into_z():
    m = conv_then([helper.make_node("Relu", ["y"], ["r"], name="act"),
                   helper.make_node("Add", ["r", "z"], ["out"], name="add")],
                  inputs=[vinfo("x", ["N", 4, 6, 6]), vinfo("z", ["N", 8, 6, 6])])
    out, report = fuse(m)
    assert ops(out) == ["FusedConv", "Add"]
    assert "act(conv + Z)" in report.reason_for("add")
    assert_same(m, out)


def two_conv_add(c_in=16, c=16):
    r = rng(5)
    inits = [tensor("W1", r.normal(0, 0.3, (c, c_in, 3, 3)).astype(np.float32)),
             tensor("W2", r.normal(0, 0.3, (c, c_in, 1, 1)).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "W1"], ["y1"], name="main", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["x", "W2"], ["y2"], name="shortcut"),
             helper.make_node("Add", ["y1", "y2"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["out"], name="relu")]
    return model(nodes, [vinfo("x", ["N", c_in, 6, 6])], [vinfo("out", ["N", c, 6, 6])], inits)


def test_two_convs_into_one_add_fuse_into_the_later_one_and_say_so():
    m = two_conv_add()
    out, report = fuse(m)
    assert ops(out) == ["Conv", "FusedConv"]
    record = report.applied("Conv+Add+Relu")[0]
    assert record.node == "shortcut"
    assert "fused into the later one" in record.detail and "Conv 'main' feeds Z" in record.detail
    assert_same(m, out)


def test_conv_act_configuration_leaves_adds_with_a_reason():
    m = residual_model()
    out, report = fuse(m, passes=["fuse-activation"])
    assert "Add" in ops(out) and "FusedConv" not in ops(out)
    assert "fuse-activation only" in report.reason_for("add")
    assert report.reason_for("relu")


# --- Gemm ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("act,attrs,kind", [
    ("Relu", {}, "Relu"), ("LeakyRelu", {"alpha": 0.3}, "LeakyRelu"), ("Sigmoid", {}, "Sigmoid"),
    ("Tanh", {}, "Tanh"), ("HardSigmoid", {"alpha": 0.25, "beta": 0.4}, "HardSigmoid"),
])
def test_gemm_activation_becomes_fused_gemm(act, attrs, kind):
    r = rng(6)
    inits = [tensor("B", r.normal(size=(5, 7)).astype(np.float32)), tensor("C", r.normal(size=5).astype(np.float32))]
    nodes = [helper.make_node("Gemm", ["a", "B", "C"], ["y"], name="fc", transB=1, alpha=0.5),
             helper.make_node(act, ["y"], ["out"], name="act", **attrs)]
    m = model(nodes, [vinfo("a", ["N", 7])], [vinfo("out", ["N", 5])], inits)
    out, report = fuse(m, dims={"N": 3})
    node = fused_node(out)
    assert node.op_type == "FusedGemm" and node.attributes["activation"].value == kind
    assert_same(m, out, dims={"N": 3})


def test_gemm_clip_is_refused_with_the_kernel_reason():
    r = rng(7)
    inits = [tensor("B", r.normal(size=(7, 5)).astype(np.float32)), tensor("lo", np.float32(0)),
             tensor("hi", np.float32(6))]
    nodes = [helper.make_node("Gemm", ["a", "B"], ["y"], name="fc"),
             helper.make_node("Clip", ["y", "lo", "hi"], ["out"], name="act")]
    m = model(nodes, [vinfo("a", [2, 7])], [vinfo("out", [2, 5])], inits)
    out, report = fuse(m)
    assert "FusedGemm runs no Clip epilogue" in report.reason_for("act")


# --- targets, levels, layout ----------------------------------------------------------------------

def test_fusion_passes_need_the_onnxruntime_target():
    m = conv_then([helper.make_node("Relu", ["y"], ["out"], name="act")])
    with pytest.raises(opfuse.BadInputError, match="--target onnxruntime"):
        opfuse.optimize(m, passes=["fuse-epilogue"])
    out, _ = opfuse.optimize(m)  # the portable default never emits contrib ops
    assert ops(out) == ["Conv", "Relu"]


def test_output_runs_and_declares_the_contrib_domain():
    m = conv_then([helper.make_node("Relu", ["y"], ["out"], name="act")])
    out, _ = fuse(m)
    assert out.opset_imports.get("com.microsoft") == 1
    import onnx
    onnx.checker.check_model(ir.serde.serialize_model(out))


def test_layout_check_leaves_a_fusion_that_would_lose_nchwc_to_the_runtime():
    # Z from a graph input keeps a FusedConv outside ONNX Runtime's NCHWc layout.
    m = residual_model(other_from="input")
    _, low = fuse(m, runtime_level="extended")
    assert low.applied("Conv+Add+Relu")
    out, report = fuse(m, runtime_level="all")
    if has_layout_pass(runtime_graph(ir.serde.deserialize_model(m))):
        assert not report.applied("Conv+Add+Relu")
        assert "NCHWc" in report.reason_for("add")
        assert "left to the runtime" in report.notes[-1]
    else:  # no layout pass on this machine: nothing to lose
        assert report.applied("Conv+Add+Relu")
        assert "none of this model's convolutions in its NCHWc layout" in report.notes[-1]
    assert_same(m, out)


def test_layout_check_excludes_an_unnamed_conv_by_the_name_it_is_given():
    """Exporters leave nodes unnamed; the check excludes fusions by the conv's name."""
    m = residual_model(other_from="input")
    for node in m.graph.node:
        node.name = ""
    out, report = fuse(m, runtime_level="all")
    if has_layout_pass(runtime_graph(ir.serde.deserialize_model(m))):
        assert not report.applied("Conv+Add+Relu")
        assert "NCHWc" in " ".join(r.reason for r in report.refusals)
        assert "FusedConv" not in ops(out)
    assert_same(m, out)


def test_layout_check_keeps_fusions_that_keep_nchwc():
    m = two_conv_add()
    out, report = fuse(m, runtime_level="all")
    assert report.applied("Conv+Add+Relu")


def test_builtin_resnet50_everything_fused():
    from opfuse.models import build

    out, report = fuse(build("resnet50", batch=1, image_size=64), runtime_level="disabled")
    counts = report.pattern_counts()
    assert counts == {"Conv+BatchNormalization": 53, "Conv+Relu": 33, "Conv+Add+Relu": 16}
    assert sum(report.ops_after.values()) == 57
    assert not any(op in report.ops_after for op in ("Relu", "Add", "BatchNormalization"))
    assert report.verification.ok


def test_layout_check_that_runs_out_of_attempts_says_which_fusions_still_lose_the_layout(monkeypatch):
    """Each exclusion can move the loss to the next block; after LAYOUT_ATTEMPTS + 1 runs the
    fusions reported as left to the runtime are really absent, and those still losing the
    layout are emitted and named as such (the runtime is stubbed: a loss per attempt)."""
    from opfuse.targets import onnxruntime as ort_target

    r = rng(4)
    nodes, inits = [], []
    x = "x"
    for i in range(6):  # six Conv -> Add(residual) -> Relu blocks
        inits.append(tensor(f"W{i}", r.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32)))
        nodes += [helper.make_node("Conv", [x, f"W{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
                  helper.make_node("Add", [f"c{i}", x], [f"a{i}"], name=f"add{i}"),
                  helper.make_node("Relu", [f"a{i}"], [f"y{i}"], name=f"relu{i}")]
        x = f"y{i}"
    m = model(nodes, [vinfo("x", [1, 8, 6, 6])], [vinfo(x, [1, 8, 6, 6])], inits)
    monkeypatch.setattr(ort_target, "runtime_graph", lambda model: [("com.microsoft.nchwc", "Conv", "")])
    monkeypatch.setattr(ort_target, "layout_losses",  # the first fusion still emitted loses the layout
                        lambda baseline, fused, emitted: {min(emitted): "loses NCHWc (stub)"} if emitted else {})
    out, report = opfuse.optimize(m, target="onnxruntime", runtime_level="all")
    note = next(n for n in report.notes if n.startswith("runtime level all"))
    attempts = ort_target.LAYOUT_ATTEMPTS
    assert f"{attempts} fusion(s) left to the runtime" in note
    assert f"after {attempts + 1} attempts 1 emitted fusion(s) still lose it (conv{attempts})" in note
    fused = {n.name for n in out.graph if n.op_type == "FusedConv"}
    left = {f"conv{i}" for i in range(attempts)}
    assert not fused & left and f"conv{attempts}" in fused
    assert all("stub" in report.reason_for(f"add{i}") for i in range(attempts))
    assert report.verification.ok
