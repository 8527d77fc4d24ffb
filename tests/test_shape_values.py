"""Shape arithmetic on static dims becomes constants; symbolic dims stay symbolic.

The CRNN of the issue, built in code (opset 12): input [1, 1, 64, width], a Conv stack
(static channels and height, symbolic width), a Transpose to [W, 1, C, H], a Reshape to
[W, 1, C*H] whose target is computed (Shape -> Gather -> Mul -> Unsqueeze -> Concat),
LSTM initial states from ConstantOfShape([2, batch, hidden]) with the batch read off a
shape, then a Gemm and a computed Reshape back. opfuse must leave no more than 1.1x
onnxslim's nodes on both targets, and the written model must compute the same at other
widths than verification's (a folded dim that is really the width would break there).
Also: a computed Pad ``pads`` folds to exactly its value (onnxslim once moved
``[0,0,0,0,0,0,1,1]`` to ``[0,0,1,1,0,0,0,0]``), and a dim that may broadcast is not folded.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import extras
from graphs import constant_node, model, ort_run, rng, tensor, vinfo
from opfuse.pipeline import optimize

HIDDEN = 16


def _gather_dim(name, shape_of, index, nodes, inits):
    inits.append(tensor(f"{name}.i", np.array(index, np.int64)))  # a scalar index, as torch writes it
    nodes.append(helper.make_node("Gather", [shape_of, f"{name}.i"], [name], axis=0, name=name))
    return name


def crnn(width="width"):
    r = rng(2)
    nodes, inits = [], []
    x, cin = "image", 1
    for i, cout in enumerate((8, 16)):
        inits += [tensor(f"c{i}.w", r.normal(0, 0.3, (cout, cin, 3, 3)).astype(np.float32)),
                  tensor(f"c{i}.b", r.normal(0, 0.1, cout).astype(np.float32)),
                  tensor(f"bn{i}.s", r.uniform(0.5, 1.5, cout).astype(np.float32)),
                  tensor(f"bn{i}.o", r.normal(0, 0.1, cout).astype(np.float32)),
                  tensor(f"bn{i}.m", r.normal(0, 0.1, cout).astype(np.float32)),
                  tensor(f"bn{i}.v", r.uniform(0.5, 1.5, cout).astype(np.float32))]
        nodes += [helper.make_node("Conv", [x, f"c{i}.w", f"c{i}.b"], [f"conv{i}"], pads=[1, 1, 1, 1], name=f"Conv_{i}"),
                  helper.make_node("BatchNormalization", [f"conv{i}", f"bn{i}.s", f"bn{i}.o", f"bn{i}.m", f"bn{i}.v"],
                                   [f"bn{i}"], name=f"BN_{i}"),
                  helper.make_node("Relu", [f"bn{i}"], [f"relu{i}"], name=f"Relu_{i}"),
                  helper.make_node("MaxPool", [f"relu{i}"], [f"pool{i}"], kernel_shape=[2, 2], strides=[2, 2],
                                   name=f"Pool_{i}")]
        x, cin = f"pool{i}", cout
    # [1, 16, 16, W/4] -> [W/4, 1, 16, 16] -> Reshape [W/4, 1, 256] with a computed target
    nodes.append(helper.make_node("Transpose", [x], ["seq4"], perm=[3, 0, 1, 2], name="Transpose_seq"))
    nodes.append(helper.make_node("Shape", ["seq4"], ["s4"], name="Shape_seq"))
    w = _gather_dim("Gather_w", "s4", 0, nodes, inits)
    n = _gather_dim("Gather_n", "s4", 1, nodes, inits)
    c = _gather_dim("Gather_c", "s4", 2, nodes, inits)
    h = _gather_dim("Gather_h", "s4", 3, nodes, inits)
    nodes += [helper.make_node("Mul", [c, h], ["ch"], name="Mul_ch")]
    for v in (w, n, "ch"):
        nodes.append(helper.make_node("Unsqueeze", [v], [f"{v}.u"], axes=[0], name=f"Unsqueeze_{v}"))
    nodes += [helper.make_node("Concat", [f"{w}.u", f"{n}.u", "ch.u"], ["target"], axis=0, name="Concat_target"),
              helper.make_node("Reshape", ["seq4", "target"], ["seq"], name="Reshape_seq")]
    # LSTM initial states: ConstantOfShape([2, batch, HIDDEN]), the batch read off the sequence's shape
    nodes.append(helper.make_node("Shape", ["seq"], ["s3"], name="Shape_h0"))
    b = _gather_dim("Gather_batch", "s3", 1, nodes, inits)
    inits += [tensor("two", np.array([2], np.int64)), tensor("hid", np.array([HIDDEN], np.int64))]
    nodes += [helper.make_node("Unsqueeze", [b], ["b.u"], axes=[0], name="Unsqueeze_batch"),
              helper.make_node("Concat", ["two", "b.u", "hid"], ["h0.shape"], axis=0, name="Concat_h0"),
              helper.make_node("ConstantOfShape", ["h0.shape"], ["h0"], name="ConstantOfShape_h0"),
              helper.make_node("ConstantOfShape", ["h0.shape"], ["c0"], name="ConstantOfShape_c0")]
    inits += [tensor("lstm.w", r.normal(0, 0.1, (2, 4 * HIDDEN, 256)).astype(np.float32)),
              tensor("lstm.r", r.normal(0, 0.1, (2, 4 * HIDDEN, HIDDEN)).astype(np.float32)),
              tensor("lstm.b", r.normal(0, 0.1, (2, 8 * HIDDEN)).astype(np.float32))]
    nodes.append(helper.make_node("LSTM", ["seq", "lstm.w", "lstm.r", "lstm.b", "", "h0", "c0"], ["y"],
                                  hidden_size=HIDDEN, direction="bidirectional", name="LSTM"))
    # [W/4, 2, 1, H] -> [W/4, 1, 2, H] -> Reshape [W/4, 2H] (computed) -> Gemm -> Reshape [W/4, 1, classes]
    inits += [tensor("shape0", np.array([0, 0, -1], np.int64)),
              tensor("fc.w", r.normal(0, 0.2, (2 * HIDDEN, 10)).astype(np.float32)),
              tensor("fc.b", r.normal(0, 0.1, 10).astype(np.float32)),
              tensor("one", np.array([1], np.int64)), tensor("minus1", np.array([-1], np.int64))]
    nodes += [helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3], name="Transpose_y"),
              helper.make_node("Reshape", ["yt", "shape0"], ["y3"], name="Reshape_y3"),
              helper.make_node("Shape", ["y3"], ["sy"], name="Shape_y")]
    t = _gather_dim("Gather_t", "sy", 0, nodes, inits)
    k = _gather_dim("Gather_k", "sy", 2, nodes, inits)
    nodes += [helper.make_node("Unsqueeze", [t], ["t.u"], axes=[0], name="Unsqueeze_t"),
              helper.make_node("Unsqueeze", [k], ["k.u"], axes=[0], name="Unsqueeze_k"),
              helper.make_node("Concat", ["t.u", "k.u"], ["flat"], axis=0, name="Concat_flat"),
              helper.make_node("Reshape", ["y3", "flat"], ["y2"], name="Reshape_y2"),
              helper.make_node("Gemm", ["y2", "fc.w", "fc.b"], ["logits"], name="Gemm"),
              helper.make_node("Concat", ["t.u", "one", "minus1"], ["out.shape"], axis=0, name="Concat_out"),
              helper.make_node("Reshape", ["logits", "out.shape"], ["out"], name="Reshape_out")]
    return model(nodes, [vinfo("image", [1, 1, 64, width])], [vinfo("out", ["steps", 1, 10])], inits, opset=12)


def _count(m) -> int:
    return len(m.graph.node) if isinstance(m, onnx.ModelProto) else sum(1 for _ in m.graph)


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_a_crnn_leaves_no_more_nodes_than_onnxslim_and_keeps_its_width_symbolic(target):
    onnxslim = extras.require("onnxslim")  # the bench extra, installed by make
    slim = _count(onnxslim.slim(crnn()))
    out, report = optimize(crnn(), target=target)
    assert report.verification.ok
    mine = _count(out)
    assert mine <= 1.1 * slim, (mine, slim)
    ops = [n.op_type for n in out.graph]
    assert "Shape" not in ops and "ConstantOfShape" not in ops and "Concat" not in ops
    assert any(r.pattern == "shape arithmetic->constant" for r in report.records)
    written = onnx.load_from_string(__import__("onnx_ir").serde.serialize_model(out).SerializeToString())
    assert written.graph.input[0].type.tensor_type.shape.dim[3].dim_param == "width"
    for width in (12, 40, 100):  # not verification's sizes: a width folded as a number would break here
        feeds = {"image": rng(width).normal(0, 1, (1, 1, 64, width)).astype(np.float32)}
        want, got = ort_run(crnn(), feeds)["out"], ort_run(written, feeds)["out"]
        assert want.shape == got.shape == (width // 4, 1, 10)
        assert np.allclose(want, got, rtol=1e-4, atol=1e-5)


def test_a_computed_pad_folds_to_its_own_value():
    """pads = [0,0,0,0, 0,0, 64-63, 64-63] from the height: it must stay at the end (the
    side that pads the bottom and right), not move to the front."""
    nodes, inits = [], [tensor("zeros", np.zeros(6, np.int64)), tensor("k63", np.array(63, np.int64))]
    nodes.append(helper.make_node("Shape", ["x"], ["sx"], name="Shape"))
    hgt = _gather_dim("Gather_h", "sx", 2, nodes, inits)
    nodes += [helper.make_node("Sub", [hgt, "k63"], ["one"], name="Sub"),
              helper.make_node("Unsqueeze", ["one"], ["one.u"], axes=[0], name="Unsqueeze"),
              helper.make_node("Concat", ["zeros", "one.u", "one.u"], ["pads"], axis=0, name="Concat"),
              helper.make_node("Pad", ["x", "pads"], ["y"], mode="constant", name="Pad")]
    m = model(nodes, [vinfo("x", [1, 1, 64, "w"])], [vinfo("y", None)], inits, opset=12)
    out, report = optimize(m)
    assert report.verification.ok
    pad = next(n for n in out.graph if n.op_type == "Pad")
    assert pad.inputs[1].const_value.numpy().tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    x = rng(0).normal(0, 1, (1, 1, 64, 7)).astype(np.float32)
    got = ort_run(out, {"x": x})["y"]
    assert got.shape == (1, 1, 65, 8) and np.array_equal(got[:, :, :64, :7], x) and not got[:, :, 64:, :].any()


def test_a_dim_that_may_broadcast_is_not_folded():
    """x [1, w] + c [1, 5]: shape inference merges w with 5, yet w = 1 runs too (it
    broadcasts). The length read off x's shape must stay computed."""
    nodes, inits = [], [tensor("c", np.arange(5, dtype=np.float32).reshape(1, 5))]
    nodes += [helper.make_node("Add", ["x", "c"], ["s"], name="Add"),
              helper.make_node("Shape", ["x"], ["sx"], name="Shape")]
    w = _gather_dim("Gather_w", "sx", 1, nodes, inits)
    nodes += [helper.make_node("Unsqueeze", [w], ["w.u"], axes=[0], name="Unsqueeze"),
              helper.make_node("ConstantOfShape", ["w.u"], ["ones"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
                               name="ConstantOfShape")]
    m = model(nodes, [vinfo("x", [1, "w"])], [vinfo("s", None), vinfo("ones", None)], inits, opset=12)
    out, report = optimize(m, dims={"w": 5})
    assert report.verification.ok and not any(r.pattern == "shape arithmetic->constant" for r in report.records)
    x1 = np.ones((1, 1), np.float32)
    assert ort_run(out, {"x": x1})["ones"].shape == ort_run(m, {"x": x1})["ones"].shape == (1,)


def open_nsfw_stem_pad(hw: int = 8):
    """open_nsfw's ``/Pad_1`` (a Caffe ResNet re-exported through torch): TensorFlow's SAME
    padding of a 3x3 stride-2 max pool, computed from H and W, written as torch's
    ``F.pad(x, [w_begin, w_end, h_begin, h_end], mode="replicate")``. The op sequence is the
    model's own: Shape -> Gather -> Add/Sub/Div -> Cast -> Cast -> Sub/Mul/Add -> Sub ->
    Div -> Cast -> Cast -> Sub, four Unsqueezes (last dim first, begin then end) -> Concat
    -> Cast, zeros from ConstantOfShape(8 - len), Concat -> Reshape[-1, 2] -> Slice(step
    -1) -> Transpose -> Reshape[-1] -> Cast -> Pad(edge) -> MaxPool."""
    nodes = []

    def const(name, value):
        nodes.append(constant_node(name, name, np.asarray(value, np.int64)))
        return name

    def op(op_type, inputs, name, **attrs):
        nodes.append(helper.make_node(op_type, inputs, [name], name=name, **attrs))
        return name

    def same_padding(axis, tag):  # (begin, end) of SAME padding along ``axis``: total = (ceil(n/2)-1)*2 + 3 - n
        n = op("Gather", [op("Shape", ["x"], f"Shape_{tag}"), const(f"axis_{tag}", axis)], f"Gather_{tag}", axis=0)
        half = op("Div", [op("Sub", [op("Add", [n, const(f"c2_{tag}", 2)], f"Add_{tag}"), const(f"c1_{tag}", 1)],
                             f"Sub_{tag}"), const(f"two_{tag}", 2)], f"Div_{tag}")
        half = op("Cast", [op("Cast", [half], f"Cast_a_{tag}", to=TensorProto.INT64)], f"Cast_b_{tag}",
                  to=TensorProto.INT64)
        total = op("Sub", [op("Add", [op("Mul", [op("Sub", [half, const(f"one_{tag}", 1)], f"Sub1_{tag}"),
                                                 const(f"stride_{tag}", 2)], f"Mul_{tag}"),
                                      const(f"k_{tag}", 3)], f"Add3_{tag}"), n], f"Total_{tag}")
        begin = op("Div", [total, const(f"halve_{tag}", 2)], f"Half_{tag}")
        begin = op("Cast", [op("Cast", [begin], f"Cast_c_{tag}", to=TensorProto.INT64)], f"Begin_{tag}",
                   to=TensorProto.INT64)
        return begin, op("Sub", [total, begin], f"End_{tag}")

    w_begin, w_end = same_padding(3, "w")
    h_begin, h_end = same_padding(2, "h")
    zero = const("unsqueeze_axes", [0])
    listed = op("Concat", [op("Unsqueeze", [v, zero], f"Unsqueeze_{i}") for i, v in
                           enumerate((w_begin, w_end, h_begin, h_end))], "Concat_list", axis=0)
    count = op("Gather", [op("Shape", [listed], "Shape_list"), const("first", [0])], "Gather_len", axis=0)
    zeros = op("ConstantOfShape", [op("Sub", [const("eight", [8]), count], "Sub_len")], "ConstantOfShape_zeros",
               value=helper.make_tensor("v", TensorProto.INT64, [1], [0]))
    pairs = op("Reshape", [op("Concat", [op("Cast", [listed], "Cast_list", to=TensorProto.INT64), zeros],
                              "Concat_pads", axis=0), const("pairs_shape", [-1, 2])], "Reshape_pairs")
    flipped = op("Slice", [pairs, const("start", [-1]), const("end", [-(2 ** 63) + 1]), const("axis0", [0]),
                           const("step", [-1])], "Slice_flip")
    pads = op("Reshape", [op("Transpose", [flipped], "Transpose_pairs", perm=[1, 0]), const("flat", [-1])],
              "Reshape_flat")
    nodes += [helper.make_node("Cast", [pads], ["pads"], name="Cast_pads", to=TensorProto.INT64),
              helper.make_node("Pad", ["x", "pads"], ["padded"], name="/Pad_1", mode="edge"),
              helper.make_node("MaxPool", ["padded"], ["y"], name="MaxPool", kernel_shape=[3, 3], strides=[2, 2])]
    return model(nodes, [vinfo("x", ["batch", 4, hw, hw])], [vinfo("y", None)], opset=17)


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_open_nsfws_computed_pad_folds_to_the_end_side(target):
    """SAME padding of 8: begin 0, end 1 on H and W, so pads = [0,0,0,0, 0,0,1,1]. ONNX
    Runtime's symbolic inference slices the [4, 2] pairs as 8 flat elements and gives
    [0,0,1,1, 0,0,0,0] (padding on the top and left); the value written is the chain's own."""
    out, report = optimize(open_nsfw_stem_pad(), target=target)
    assert report.verification.ok
    assert [n.op_type for n in out.graph] == ["Pad", "MaxPool"]
    pad = next(n for n in out.graph if n.op_type == "Pad")
    assert pad.inputs[1].const_value.numpy().tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert any(r.pattern == "shape arithmetic->constant" and r.node == "/Pad_1" for r in report.records)
    for batch in (1, 3):
        x = rng(batch).normal(0, 1, (batch, 4, 8, 8)).astype(np.float32)
        want, got = ort_run(open_nsfw_stem_pad(), {"x": x})["y"], ort_run(out, {"x": x})["y"]
        assert want.shape == got.shape == (batch, 4, 4, 4) and np.array_equal(want, got)



def test_a_value_the_evaluation_does_not_reach_stays_computed_with_a_reason(monkeypatch):
    """When ONNX's reference ops evaluate none of the chain (made to fail here), the
    inference's value is not written: the Pad keeps its computed pads and the report
    says why, at the Pad."""
    from opfuse.passes import shape_values

    monkeypatch.setattr(shape_values, "_run_op", lambda node, opset, inputs: None)
    out, report = optimize(open_nsfw_stem_pad())
    assert report.verification.ok
    pad = next(n for n in out.graph if n.op_type == "Pad")
    assert pad.inputs[1].const_value is None and pad.inputs[1].producer() is not None
    reasons = [r.reason for r in report.refusals if r.pattern == "shape arithmetic->constant" and r.node == "/Pad_1"]
    assert len(reasons) == 1 and "does not confirm" in reasons[0] and "did not reach" in reasons[0], reasons
    x = rng(3).normal(0, 1, (3, 4, 8, 8)).astype(np.float32)
    assert np.array_equal(ort_run(open_nsfw_stem_pad(), {"x": x})["y"], ort_run(out, {"x": x})["y"])


def test_a_refusal_the_constant_folder_made_moot_is_not_reported(monkeypatch):
    """Only the Slice fails to evaluate: the confirmed part before it folds, constant folding
    evaluates the rest (ONNX's reference ops again, through onnxscript), and the Pad reads
    [0,0,0,0, 0,0,1,1] with no refusal left about it."""
    from opfuse.passes import shape_values

    run_op = shape_values._run_op
    monkeypatch.setattr(shape_values, "_run_op",
                        lambda node, opset, inputs: None if node.op_type == "Slice" else run_op(node, opset, inputs))
    out, report = optimize(open_nsfw_stem_pad())
    assert report.verification.ok
    pad = next(n for n in out.graph if n.op_type == "Pad")
    assert pad.inputs[1].const_value.numpy().tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert not [r for r in report.refusals if r.pattern == "shape arithmetic->constant"], report.refusals
