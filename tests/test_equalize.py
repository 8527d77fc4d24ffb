"""equalize (cross-layer equalisation), run on ONNX Runtime against the unrewritten model.

Applied: the outputs match, each pair's per-channel ranges are equal afterwards
(max |W1'[i]| == max |W2'[:, i]|, computed here from the weights, not by opfuse), and a
second run changes nothing. Refused: the report carries the reason and nothing changes.
The property test builds random chains of 2-4 convolutions and decides from the rules
alone which pairs must be equalised.
"""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from onnx import helper

from graphs import (  # tests/ is on sys.path under pytest's default import mode
    FP16,
    assert_outputs_close,
    assert_same,
    bn_node,
    bn_params,
    model,
    ops,
    ort_run,
    rng,
    tensor,
    to_proto,
    vinfo,
)
from opfuse.cli import main
from opfuse.passes.equalize import EqualizePass, chain_scales
from opfuse.pipeline import run_passes
from opfuse.report import FusionReport

# activation between two convs -> (expected op types in its place afterwards, legal)
ACTIVATIONS = {
    "none": ([], True),
    "relu": (["Relu"], True),
    "leaky": (["LeakyRelu"], True),
    "prelu": (["PRelu"], True),
    "prelu-channel": (["PRelu"], True),
    "clip-0-6": (["Relu", "Min"], True),
    "clip-0-6-attr": (["Relu", "Min"], True),  # opset 10: bounds are attributes
    "clip--1-6": (["Min", "Max"], True),
    "clip--1-inf": (["Max"], True),
    "relu-min-6": (["Relu", "Min"], True),  # the pass's own form, written by hand
    "sigmoid": (["Sigmoid"], False),
}


class Chain:
    """x -> Conv -> act -> Conv -> act -> ... -> out, with deliberately unbalanced channels."""

    def __init__(self, dtype=np.float32, spatial=2, size=6, seed=0, spread=2.0):
        self.dtype, self.spatial, self.size, self.spread = np.dtype(dtype), spatial, size, spread
        self.r = rng(seed)
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.feeds: dict[str, np.ndarray] = {}
        self.opset = 17

    def conv(self, x, c_in, c_out, name, group=1, k=3, bias=True, weight=None):
        shape = (c_out, c_in // group) + (k,) * self.spatial
        half = self.spread / 2  # channel ranges spread over 10 ** spread
        w = self.r.normal(0, 1, shape) * 10 ** self.r.uniform(-half, half, (c_out,) + (1,) * (len(shape) - 1))
        inputs = [x, weight or f"{name}.W"]
        if weight is None:
            self.inits.append(tensor(f"{name}.W", w.astype(self.dtype)))
        if bias:
            self.inits.append(tensor(f"{name}.B", self.r.normal(0, 1, c_out).astype(self.dtype)))
            inputs.append(f"{name}.B")
        self.nodes.append(helper.make_node("Conv", inputs, [f"{name}.y"], name=name, group=group,
                                           pads=[k // 2] * (2 * self.spatial)))
        return f"{name}.y"

    def act(self, kind, x, name, channels):
        cast = self.dtype.type
        if kind == "none":
            return x
        y = f"{name}.y"
        per_channel = (channels,) + (1,) * self.spatial
        if kind == "relu":
            self.nodes.append(helper.make_node("Relu", [x], [y], name=name))
        elif kind == "sigmoid":
            self.nodes.append(helper.make_node("Sigmoid", [x], [y], name=name))
        elif kind == "leaky":
            self.nodes.append(helper.make_node("LeakyRelu", [x], [y], name=name, alpha=0.1))
        elif kind.startswith("prelu"):
            slope = np.full((1,), 0.25) if kind == "prelu" else self.r.uniform(0.05, 0.5, per_channel)
            self.inits.append(tensor(f"{name}.slope", slope.astype(self.dtype)))
            self.nodes.append(helper.make_node("PRelu", [x, f"{name}.slope"], [y], name=name))
        elif kind == "clip-0-6-attr":
            self.opset = 10
            self.nodes.append(helper.make_node("Clip", [x], [y], name=name, min=0.0, max=6.0))
        elif kind.startswith("clip"):
            lo, hi = {"clip-0-6": (0, 6), "clip--1-6": (-1, 6), "clip--1-inf": (-1, None)}[kind]
            self.inits.append(tensor(f"{name}.lo", np.array(lo, self.dtype)))
            bounds = [f"{name}.lo"]
            if hi is not None:
                self.inits.append(tensor(f"{name}.hi", np.array(hi, self.dtype)))
                bounds.append(f"{name}.hi")
            self.nodes.append(helper.make_node("Clip", [x, *bounds], [y], name=name))
        elif kind == "relu-min-6":
            self.inits.append(tensor(f"{name}.six", np.array(cast(6))))
            self.nodes.append(helper.make_node("Relu", [x], [f"{name}.r"], name=f"{name}.relu"))
            self.nodes.append(helper.make_node("Min", [f"{name}.r", f"{name}.six"], [y], name=name))
        else:
            raise AssertionError(kind)
        return y

    def model(self, c_in, out, c_out):
        elem = helper.np_dtype_to_tensor_dtype(self.dtype)
        spatial = [self.size] * self.spatial
        inputs = [vinfo("x", ["N", c_in, *spatial], elem), *self.inputs]
        outputs = [vinfo(out, ["N", c_out, *spatial], elem), *self.outputs]
        return model(self.nodes, inputs, outputs, self.inits, opset=self.opset, fill_output_shapes=False)


def pair_model(act="relu", *, c1=(3, 6), c2_out=5, group2=1, spatial=2, dtype=np.float32, seed=0):
    c = Chain(dtype=dtype, spatial=spatial, seed=seed)
    y = c.conv("x", c1[0], c1[1], "conv1")
    y = c.act(act, y, "act", c1[1])
    y = c.conv(y, c1[1], c2_out, "conv2", group=group2)
    return c.model(c1[0], y, c2_out)


def equalize(m):
    """One run of the pass on a copy: (model, report, pass, modified)."""
    work = ir.serde.deserialize_model(m)
    report = FusionReport()
    p = EqualizePass(report)
    result = p(work)
    return work, report, p, result.modified


def weight(m: ir.Model, conv: str) -> np.ndarray:
    node = next(n for n in m.graph if n.name == conv)
    return node.inputs[1].const_value.numpy().astype(np.float64)


def output_ranges(w):
    return np.abs(w).reshape(w.shape[0], -1).max(axis=1)


def input_ranges(w, group):
    """max |W[o, j, ...]| per input channel i = g * (Cin/g) + j, over group g's outputs."""
    cout, cin_g = w.shape[:2]
    return np.abs(w).reshape(group, cout // group, cin_g, -1).max(axis=(1, 3)).reshape(-1)


def spread(r):
    return float(r.max() / r.min())


def assert_balanced(m, first, second, group=1, rtol=1e-5):
    r1, r2 = output_ranges(weight(m, first)), input_ranges(weight(m, second), group)
    np.testing.assert_allclose(r1, r2, rtol=rtol, err_msg=f"{first} -> {second} not balanced")


# -- applied: exact, balanced ------------------------------------------------------------------

@pytest.mark.parametrize("act", [a for a, (_, legal) in ACTIVATIONS.items() if legal])
def test_a_pair_is_equalised_exactly(act):
    m = pair_model(act)
    out, report, p, modified = equalize(m)
    assert modified and not p.refusals
    (record,) = report.records
    assert record.pattern.startswith("Conv+") and record.pattern.endswith("Conv equalisation")
    assert record.node == "conv1" and record.output == "conv2.y"
    assert "spread" in record.detail
    assert ops(out) == ["Conv", *ACTIVATIONS[act][0], "Conv"]
    assert_balanced(out, "conv1", "conv2")
    assert_same(m, out, dims={"N": 2})


def test_the_ranges_become_the_geometric_mean():
    m = pair_model("relu")
    before = ir.serde.deserialize_model(m)
    out, *_ = equalize(m)
    r1, r2 = output_ranges(weight(before, "conv1")), input_ranges(weight(before, "conv2"), 1)
    np.testing.assert_allclose(output_ranges(weight(out, "conv1")), np.sqrt(r1 * r2), rtol=1e-6)


def test_relu6_keeps_a_relu_and_gets_per_channel_bounds():
    out, *_ = equalize(pair_model("clip-0-6"))
    relu, minimum = [n for n in out.graph if n.op_type in ("Relu", "Min")]
    bound = minimum.inputs[1].const_value.numpy()
    assert bound.shape == (6, 1, 1) and len(set(bound.reshape(-1).tolist())) > 1
    assert not any(n.op_type == "Clip" for n in out.graph)


def test_grouped_and_depthwise_second_conv():
    m = pair_model("relu", c1=(3, 6), c2_out=4, group2=2)
    out, report, _, _ = equalize(m)
    assert len(report.records) == 1
    assert_balanced(out, "conv1", "conv2", group=2)
    assert_same(m, out, dims={"N": 2})
    m = pair_model("clip-0-6", c1=(3, 6), c2_out=6, group2=6)
    out, report, _, _ = equalize(m)
    assert_balanced(out, "conv1", "conv2", group=6)
    assert_same(m, out, dims={"N": 2})


@pytest.mark.parametrize("act", ["relu", "clip-0-6", "clip--1-6"])
def test_1d_convs(act):
    m = pair_model(act, spatial=1)
    out, report, _, _ = equalize(m)
    assert len(report.records) == 1
    assert_balanced(out, "conv1", "conv2")
    assert_same(m, out, dims={"N": 2})


@pytest.mark.parametrize("act", ["relu", "clip-0-6"])
def test_float16(act):
    m = pair_model(act, dtype=np.float16)
    out, report, _, _ = equalize(m)
    assert len(report.records) == 1
    assert next(n for n in out.graph if n.name == "conv1").inputs[1].const_value.dtype == ir.DataType.FLOAT16
    assert_balanced(out, "conv1", "conv2", rtol=2e-3)
    assert_same(m, out, dims={"N": 2}, rtol=FP16[0], atol=FP16[1])
    again, report2, p2, modified = equalize(to_proto(out))
    assert not modified and not report2.records and not p2.refusals


def mobilenet_block(dtype=np.float32):
    c = Chain(dtype=dtype)
    y = c.conv("x", 4, 12, "expand", k=1)
    y = c.act("clip-0-6", y, "relu6a", 12)
    y = c.conv(y, 12, 12, "depthwise", group=12)
    y = c.act("clip-0-6", y, "relu6b", 12)
    y = c.conv(y, 12, 5, "project", k=1)
    return c.model(4, y, 5)


def test_mobilenetv2_block_pointwise_depthwise_pointwise():
    m = mobilenet_block()
    out, report, p, _ = equalize(m)
    assert [r.node for r in report.records] == ["expand", "depthwise"] and not p.refusals
    assert ops(out) == ["Conv", "Relu", "Min", "Conv", "Relu", "Min", "Conv"]
    assert_balanced(out, "expand", "depthwise", group=12)
    assert_balanced(out, "depthwise", "project")
    assert_same(m, out, dims={"N": 2})


def test_a_chain_shrinks_the_spread_of_ranges():
    c = Chain(spread=3.0, seed=3)
    y = c.conv("x", 3, 8, "a")
    y = c.act("relu", y, "r1", 8)
    y = c.conv(y, 8, 8, "b")
    y = c.act("relu", y, "r2", 8)
    y = c.conv(y, 8, 8, "c")
    y = c.act("relu", y, "r3", 8)
    y = c.conv(y, 8, 4, "d")
    m = c.model(3, y, 4)
    before = ir.serde.deserialize_model(m)
    out, report, _, _ = equalize(m)
    assert len(report.records) == 3
    for first, second in (("a", "b"), ("b", "c"), ("c", "d")):
        assert_balanced(out, first, second)
        worst = max(spread(output_ranges(weight(before, first))), spread(input_ranges(weight(before, second), 1)))
        assert spread(output_ranges(weight(out, first))) < worst
    assert_same(m, out, dims={"N": 2})


def test_chain_scales_of_one_pair_is_the_square_root_of_the_range_ratio():
    w1 = np.array([[[1.0]], [[4.0]], [[0.0]]])  # [3, 1, 1]
    w2 = np.array([[[1.0], [1.0], [2.0]]])  # [1, 3, 1]
    balance = chain_scales([w1, w2], [1, 1])
    np.testing.assert_allclose(balance.scales[0], [1.0, 2.0, 1.0])  # a zero range keeps s = 1
    assert balance.converged and balance.sweeps <= 2


# -- a second run, the pipeline ----------------------------------------------------------------

@pytest.mark.parametrize("build", [lambda: pair_model("clip--1-6"), mobilenet_block,
                                   lambda: pair_model("prelu-channel", spatial=1)])
def test_a_second_run_is_a_no_op(build):
    out, report, _, _ = equalize(build())
    first = to_proto(out).SerializeToString()
    again, report2, p2, modified = equalize(onnx.load_from_string(first))
    assert not modified and not report2.records and not p2.refusals
    assert to_proto(again).SerializeToString() == first


def test_the_pipeline_runs_it_to_a_fixpoint_once():
    work = ir.serde.deserialize_model(mobilenet_block())
    report = FusionReport()
    run_passes(work, ["equalize"], report)
    assert len(report.records) == 2 and not report.refusals


def test_rescaled_tensors_get_new_names_and_the_last_output_keeps_its_own():
    out, *_ = equalize(mobilenet_block())
    names = {v.name for n in out.graph for v in n.outputs}
    assert "expand.y" not in names and "depthwise.y" not in names and "project.y" in names
    assert any(name.startswith("expand.y_equalized") for name in names)


def test_a_shared_weight_is_copied_privately():
    c = Chain()
    y = c.conv("x", 3, 3, "conv1")
    y = c.act("relu", y, "act", 3)
    y = c.conv(y, 3, 3, "conv2")
    side = c.conv("x", 3, 3, "other", weight="conv1.W")  # the same weight, elsewhere
    c.outputs.append(vinfo(side, ["N", 3, 6, 6]))
    m = c.model(3, y, 3)
    out, report, _, _ = equalize(m)
    (record,) = report.records
    assert record.extra_bytes == 3 * 3 * 9 * 4
    other = next(n for n in out.graph if n.name == "other")
    assert other.inputs[1].name == "conv1.W"
    assert_same(m, out, dims={"N": 2})


def test_a_pair_inside_an_if_branch_is_equalised_there():
    r = rng(0)
    inits = [tensor("W1", (r.normal(size=(4, 3, 3, 3)) * 10 ** r.uniform(-1, 1, (4, 1, 1, 1))).astype(np.float32)),
             tensor("W2", r.normal(size=(2, 4, 3, 3)).astype(np.float32)),
             tensor("W3", r.normal(size=(2, 3, 3, 3)).astype(np.float32)),
             tensor("lo", np.float32(0)), tensor("hi", np.float32(6))]
    then = helper.make_graph([
        helper.make_node("Conv", ["x", "W1"], ["a"], name="c1", pads=[1] * 4),
        helper.make_node("Clip", ["a", "lo", "hi"], ["b"], name="clip"),
        helper.make_node("Conv", ["b", "W2"], ["t"], name="c2", pads=[1] * 4)], "then", [], [vinfo("t", None)])
    other = helper.make_graph([helper.make_node("Conv", ["x", "W3"], ["e"], name="c3", pads=[1] * 4)],
                              "else", [], [vinfo("e", None)])
    m = model([helper.make_node("If", ["cond"], ["out"], name="if", then_branch=then, else_branch=other)],
              [vinfo("x", ["N", 3, 5, 5]), vinfo("cond", [], onnx.TensorProto.BOOL)], [vinfo("out", None)],
              inits, fill_output_shapes=False)
    out, report, p, _ = equalize(m)
    (record,) = report.records
    assert record.graph == "main/if/then_branch" and not p.refusals
    feeds = {"x": r.normal(size=(2, 3, 5, 5)).astype(np.float32), "cond": np.array(True)}
    assert_outputs_close(ort_run(m, feeds), ort_run(out, feeds))


# -- refused --------------------------------------------------------------------------------------

def refused(m, *words):
    out, report, p, modified = equalize(m)
    assert not modified and not report.records
    (refusal,) = p.refusals
    for word in words:
        assert word in refusal.reason, refusal.reason
    assert to_proto(out).SerializeToString() == to_proto(ir.serde.deserialize_model(m)).SerializeToString()
    return refusal


def test_the_homogeneous_variant_refuses_a_relu6_and_equalises_the_rest():
    """``equalize-homogeneous`` (the per-tensor quantisation preset's): a ReLU6 between would
    become a Relu and a per-channel Min, which ONNX Runtime's int8 conv does not absorb as it
    absorbs the Clip, so the pair is refused with that reason and the model left as it was;
    a Relu or nothing between is equalised as by ``equalize``."""
    from opfuse.passes.equalize import HomogeneousEqualizePass

    def run(m):
        work, report = ir.serde.deserialize_model(m), FusionReport()
        p = HomogeneousEqualizePass(report)
        return work, report, p, p(work).modified

    m = pair_model("clip-0-6")
    out, report, p, modified = run(m)
    assert not modified and not report.records
    (refusal,) = p.refusals
    assert "would become per-channel Min/Max bounds" in refusal.reason and refusal.node == "conv1"
    assert to_proto(out).SerializeToString() == to_proto(ir.serde.deserialize_model(m)).SerializeToString()
    m = pair_model("relu")
    out, report, p, modified = run(m)
    assert modified and not p.refusals and ops(out) == ["Conv", "Relu", "Conv"]
    assert_balanced(out, "conv1", "conv2")
    assert_same(m, out, dims={"N": 2})


def test_sigmoid_between_is_refused():
    refusal = refused(pair_model("sigmoid"), "Sigmoid(x/s) != Sigmoid(x)/s")
    assert refusal.node == "conv1" and refusal.anchor == "conv2"
    assert refusal.pattern == "Conv+Sigmoid+Conv equalisation"


def test_a_second_consumer_is_refused():
    m = pair_model("relu")
    m.graph.node.append(helper.make_node("Neg", ["conv1.y"], ["side"], name="side"))
    m.graph.output.append(vinfo("side", ["N", 6, 6, 6]))
    refused(m, "feeds 2 consumers", "Neg 'side'")


def test_a_graph_output_between_is_refused():
    m = pair_model("relu")
    m.graph.output.append(vinfo("act.y", ["N", 6, 6, 6]))
    refused(m, "graph output", "Relu 'act'")


def test_a_weight_from_a_graph_input_is_refused():
    m = pair_model("relu")
    m.graph.input.append(vinfo("conv2.W", [5, 6, 3, 3]))  # an initializer that is also an input
    refused(m, "conv2.W", "graph input")


def test_a_clip_bound_computed_at_run_time_is_refused():
    m = pair_model("clip-0-6")
    m.graph.initializer.remove(next(t for t in m.graph.initializer if t.name == "act.hi"))
    m.graph.input.append(vinfo("act.hi", []))
    refusal = refused(m, "upper bound", "graph input", "Clip bound")
    assert refusal.node == "conv1" and refusal.anchor == "conv2"
    feeds = {"x": rng(1).normal(size=(2, 3, 6, 6)).astype(np.float32), "act.hi": np.array(6, np.float32)}
    assert ort_run(m, feeds)  # the model still runs as it was


def test_a_bound_per_position_not_per_channel_is_refused():
    m = pair_model("relu-min-6")
    six = next(t for t in m.graph.initializer if t.name == "act.six")
    width = m.graph.input[0].type.tensor_type.shape.dim[-1].dim_value
    six.CopyFrom(tensor("act.six", np.linspace(5, 7, width).astype(np.float32)))  # shape [W]: one per column
    refused(m, "does not broadcast", "channels")


def test_a_batchnorm_between_asks_for_folding_first():
    m = pair_model("none")
    for node in m.graph.node:
        if node.name == "conv2":
            node.input[0] = "bn.y"
    m.graph.node.insert(1, bn_node("bn", "conv1.y", "bn.y"))
    m.graph.initializer.extend(bn_params("bn", 6))
    refused(m, "fold-batchnorm")


# -- the command line ------------------------------------------------------------------------------

def test_optimize_with_fold_batchnorm_and_equalize(tmp_model, tmp_path):
    c = Chain()
    y = c.conv("x", 3, 6, "conv1")
    c.inits += bn_params("bn", 6)
    c.nodes.append(bn_node("bn", y, "bn.y"))
    y = c.act("clip-0-6", "bn.y", "relu6", 6)
    y = c.conv(y, 6, 4, "conv2")
    path = tmp_model(c.model(3, y, 4))
    out, rep = tmp_path / "out.onnx", tmp_path / "r.json"
    assert main(["optimize", str(path), "-o", str(out), "--report", str(rep), "--passes",
                 "fold-batchnorm,equalize", "-q"]) == 0
    data = json.loads(rep.read_text())
    assert data["summary"]["applied"] == {"Conv+BatchNormalization": 1, "Conv+Clip+Conv equalisation": 1}
    assert data["summary"]["verified"] is True and data["refused"] == []
    assert [n.op_type for n in onnx.load(out).graph.node] == ["Conv", "Relu", "Min", "Conv"]


# -- property: random chains ---------------------------------------------------------------------

CHOICES = ["none", "relu", "leaky", "prelu", "prelu-channel", "clip-0-6", "clip--1-6", "clip--1-inf",
           "relu-min-6", "sigmoid"]


@st.composite
def chains(draw):
    n = draw(st.integers(2, 4))
    spatial = draw(st.sampled_from([1, 2]))
    channels = [draw(st.sampled_from([2, 3, 4, 6]))]
    layers = []
    for _ in range(n):
        c_in = channels[-1]
        c_out = draw(st.sampled_from([2, 3, 4, 6, c_in]))
        divisors = [g for g in range(1, math.gcd(c_in, c_out) + 1) if c_in % g == 0 and c_out % g == 0]
        layers.append((c_out, draw(st.sampled_from(divisors)), draw(st.sampled_from([1, 3])), draw(st.booleans())))
        channels.append(c_out)
    acts = [draw(st.sampled_from(CHOICES)) for _ in range(n - 1)]
    return spatial, channels, layers, acts, draw(st.integers(0, 2**16))


@settings(deadline=None, derandomize=True, max_examples=100, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_random_chains_are_equalised_exactly_and_balanced(case):
    spatial, channels, layers, acts, seed = case
    note(f"channels {channels}, layers (c_out, group, k, bias) {layers}, acts {acts}")
    c = Chain(spatial=spatial, size=5, seed=seed)
    y, names = "x", []
    for i, (c_out, group, k, bias) in enumerate(layers):
        if i:
            y = c.act(acts[i - 1], y, f"act{i}", channels[i])
        y = c.conv(y, channels[i], c_out, f"conv{i}", group=group, k=k, bias=bias)
        names.append(f"conv{i}")
    m = c.model(channels[0], y, channels[-1])

    out, report, p, _ = equalize(m)
    legal = [(names[i], names[i + 1], layers[i + 1][1]) for i, a in enumerate(acts) if ACTIVATIONS[a][1]]
    assert sorted(r.node for r in report.records) == sorted(first for first, _, _ in legal)
    assert sorted(r.node for r in p.refusals) == sorted(names[i] for i, a in enumerate(acts) if a == "sigmoid")
    assert all("Sigmoid(x/s) != Sigmoid(x)/s" in r.reason for r in p.refusals)
    for first, second, group in legal:
        assert_balanced(out, first, second, group)
    feeds = {"x": rng(seed).normal(size=(2, channels[0]) + (5,) * spatial).astype(np.float32)}
    assert_outputs_close(ort_run(m, feeds), ort_run(out, feeds))
    again, report2, p2, modified = equalize(to_proto(out))
    assert not modified and not report2.records and len(p2.refusals) == len(p.refusals)
