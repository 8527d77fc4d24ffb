"""The folds in real graph structure: Constant nodes and Identity, shared weights and
statistics, chains, If/Loop subgraphs, model-local functions, unknown domains, dynamic
batch, the caller's model left untouched; run on ONNX Runtime against the unrewritten model.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import opfuse
from graphs import assert_same, bn_node, bn_params, conv_bn_model, model, ops, rng, tensor, vinfo
from opfuse import optimize

F16 = TensorProto.FLOAT16


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
    out, report = optimize(m, cleanup=False)  # the fold itself looks through Identity
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
    from graphs import run
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
