"""The clean-up stage and graph hygiene, each on a graph built in code like the wheel model
that showed the problem (benchmarks/wild.py): constant subexpressions folded, no Identity,
Constant or dead node left, true refusal reasons, the input's shape information kept."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import opfuse
from graphs import assert_same, constant_node, dead_nodes, model, ops, rng, tensor, unused_initializers, vinfo
from opfuse.core.analysis import NameTable


def convs_with_reshaped_bias(blocks: int = 3, c: int = 8):
    """PP-OCR cls: bias-free convs, each followed by Add(conv, Reshape(Constant[C], Constant
    shape)), on an input of shape [-1, 3, '?', '?']."""
    r = rng(1)
    nodes, inits, x, cin = [], [], "x", 3
    for i in range(blocks):
        inits.append(tensor(f"w{i}", r.normal(0, 0.3, (c, cin, 3, 3)).astype(np.float32)))
        nodes += [
            helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
            constant_node("", f"k{i}", r.normal(0, 1, c).astype(np.float32)),
            constant_node("", f"s{i}", np.array([1, c, 1, 1], np.int64)),
            helper.make_node("Reshape", [f"k{i}", f"s{i}"], [f"kr{i}"]),
            helper.make_node("Add", [f"c{i}", f"kr{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
        ]
        x, cin = f"r{i}", c
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, None, None])
    x_info.type.tensor_type.shape.dim[0].dim_value = -1  # as Paddle2ONNX writes it
    return model(nodes, [x_info], [vinfo(x, None)], inits, opset=11, fill_output_shapes=False)


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_add_of_a_reshaped_constant_folds_into_the_conv(target):
    m = convs_with_reshaped_bias()
    out, report = opfuse.optimize(m, target=target, runtime_level="extended",
                                  dims={"x:0": 2, "x:2": 8, "x:3": 8})
    assert len(report.applied("Conv+Add")) == 3
    left = set(ops(out))
    assert not left & {"Add", "Reshape", "Constant", "Identity"}, ops(out)
    assert not dead_nodes(out) and not unused_initializers(out)
    assert report.verification.ok


def test_symbolic_shapes_give_cannot_prove_not_a_mismatch():
    """ddddocr: [1, 24, 32, unk__0] against [1, 24, 32, unk__2] are equal at run time; the
    true reason is that opfuse cannot prove it, not that they differ."""
    r = rng(2)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Add", ["y", "z"], ["out"], name="add")]
    m = model(nodes, [vinfo("x", [1, 4, 32, "W1"]), vinfo("z", [1, 8, 32, "W2"])],
              [vinfo("out", [1, 8, 32, "W1"])], [tensor("w", r.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float32))])
    _, report = opfuse.optimize(m, target="onnxruntime", runtime_level="extended", dims={"W1": 8, "W2": 8})
    reason = report.reason_for("add")
    assert "cannot prove" in reason and "axis 3" in reason and "not the conv output" not in reason
    # a proven mismatch keeps its own reason
    m2 = model(nodes, [vinfo("x", [1, 4, 32, 8]), vinfo("z", [1, 8, 32, 1])], [vinfo("out", [1, 8, 32, 8])],
               [tensor("w", r.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float32))])
    _, report2 = opfuse.optimize(m2, target="onnxruntime", runtime_level="extended")
    assert "does not broadcast" in report2.reason_for("add") and "cannot prove" not in report2.reason_for("add")


def test_identity_nodes_go_and_graph_names_stay():
    """PP-OCR det keeps 145 Identity nodes; none is needed. An Identity that is the only
    link between a graph input and a graph output stays (both names are the contract)."""
    r = rng(3)
    nodes = [helper.make_node("Identity", ["x"], ["x1"]),
             helper.make_node("Conv", ["x1", "w"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("Identity", ["y"], ["y1"]),
             helper.make_node("Relu", ["y1"], ["r"]),
             helper.make_node("Identity", ["r"], ["out"]),
             helper.make_node("Identity", ["x"], ["x_copy"])]
    m = model(nodes, [vinfo("x", [1, 4, 8, 8])], [vinfo("out", [1, 8, 8, 8]), vinfo("x_copy", [1, 4, 8, 8])],
              [tensor("w", r.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float32))])
    out, _ = opfuse.optimize(m)
    assert ops(out) == ["Conv", "Relu", "Identity"]
    assert [v.name for v in out.graph.outputs] == ["out", "x_copy"]
    assert [v.name for v in out.graph.inputs] == ["x"]
    assert_same(m, out)


def test_clip_bounds_from_constant_nodes_leave_nothing_dead_after_fusion():
    """torch's MobileNetV2 export: ReLU6 is Clip(y, Constant, Constant); once the Clip is
    fused into FusedConv its bound nodes must go too."""
    r = rng(4)
    nodes, x = [], "x"
    for i in range(3):
        nodes += [helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  constant_node("", f"lo{i}", np.float32(0)), constant_node("", f"hi{i}", np.float32(6)),
                  helper.make_node("Clip", [f"c{i}", f"lo{i}", f"hi{i}"], [f"r{i}"])]
        x = f"r{i}"
    inits = [t for i in range(3) for t in (tensor(f"w{i}", r.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32)),
                                           tensor(f"b{i}", r.normal(0, 0.3, 4).astype(np.float32)))]
    m = model(nodes, [vinfo("x", [1, 4, 8, 8])], [vinfo(x, [1, 4, 8, 8])], inits)
    out, report = opfuse.optimize(m, target="onnxruntime", runtime_level="extended")
    assert ops(out) == ["FusedConv"] * 3
    assert not dead_nodes(out) and not unused_initializers(out)
    assert len(report.applied("Conv+Clip")) == 3
    assert_same(m, out)


def test_constant_subexpressions_become_initializers():
    """Shape arithmetic, Cast and Unsqueeze on constants: folded before the folds look."""
    r = rng(5)
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
             constant_node("", "k", r.uniform(0.5, 2, 8).astype(np.float64)),
             helper.make_node("Cast", ["k"], ["k32"], to=TensorProto.FLOAT),
             helper.make_node("Shape", ["w"], ["wshape"]),
             helper.make_node("Slice", ["wshape", "zero", "one"], ["cout"]),
             helper.make_node("Concat", ["one", "cout", "one", "one"], ["kshape"], axis=0),
             helper.make_node("Reshape", ["k32", "kshape"], ["k4"]),
             helper.make_node("Mul", ["y", "k4"], ["out"])]
    m = model(nodes, [vinfo("x", [1, 4, 8, 8])], [vinfo("out", [1, 8, 8, 8])],
              [tensor("w", r.normal(0, 0.3, (8, 4, 3, 3)).astype(np.float32)),
               tensor("zero", np.array([0], np.int64)), tensor("one", np.array([1], np.int64))])
    out, report = opfuse.optimize(m)
    assert ops(out) == ["Conv"]
    assert report.applied("Conv+Mul")
    assert "clean-up" in " ".join(report.notes)
    assert_same(m, out)


def test_no_cleanup_keeps_the_graph_as_the_folds_left_it():
    m = convs_with_reshaped_bias(blocks=1)
    out, report = opfuse.optimize(m, cleanup=False, dims={"x:0": 1, "x:2": 8, "x:3": 8})
    assert "Reshape" in ops(out) and not report.applied("Conv+Add")


def test_written_model_keeps_the_inputs_shape_information(tmp_path):
    """Outputs do not grow by a value_info per tensor, and an unnamed dimension is not
    given a name like unk__54; --keep-shapes keeps what was inferred."""
    m = convs_with_reshaped_bias(blocks=2)
    src = tmp_path / "in.onnx"
    onnx.save(m, src)
    dims = {"x:0": 1, "x:2": 8, "x:3": 8}
    opfuse.optimize(src, output=tmp_path / "out.onnx", dims=dims)
    written = onnx.load(tmp_path / "out.onnx")
    assert not written.graph.value_info
    for value in [*written.graph.input, *written.graph.output]:
        for d in value.type.tensor_type.shape.dim:
            assert not d.dim_param.startswith("unk__"), value
    assert written.graph.input[0] == m.graph.input[0]
    # the output was declared without a shape: completed for the checker (a load note
    # says so), with onnx's invented dimension names left out
    completed = written.graph.output[0].type.tensor_type
    assert completed.elem_type == TensorProto.FLOAT
    assert [d.dim_value for d in completed.shape.dim] == [-1, 8, 0, 0]
    assert not any(d.dim_param for d in completed.shape.dim)
    opfuse.optimize(src, output=tmp_path / "kept.onnx", dims=dims, keep_shapes=True)
    assert onnx.load(tmp_path / "kept.onnx").graph.value_info


def test_fresh_names_are_unique_without_scanning_every_suffix():
    """Unnamed exporters: thousands of fresh names from one base, around names the model
    already has (base_1, base_3), are unique and skip the taken ones."""
    m = model([helper.make_node("Relu", ["x"], ["base_1"], name="base_3"),
               helper.make_node("Relu", ["base_1"], ["y"], name="base")],
              [vinfo("x", [1])], [vinfo("y", [1])])
    from onnx_ir import serde

    table = NameTable(serde.deserialize_model(m))
    names = [table.fresh("base") for _ in range(5000)]
    assert len(set(names)) == len(names)
    assert not {"base", "base_1", "base_3", "x", "y"} & set(names)
    assert names[:3] == ["base_2", "base_4", "base_5"]


def sliced_weight(shared: bool) -> onnx.ModelProto:
    """A conv weight sliced out of a larger constant (36864 elements, over onnxscript's
    folding limit), as exporters write it; ``shared``: another conv reads the whole one."""
    r = rng(4)
    full = r.normal(0, 0.1, (64, 64, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Slice", ["W", "starts", "ends", "axes"], ["Wpart"], name="slice"),
             helper.make_node("Conv", ["x", "Wpart"], ["y"], pads=[1, 1, 1, 1], name="conv")]
    outputs = [vinfo("y", [1, 8, 8, 8])]
    if shared:
        nodes.append(helper.make_node("Conv", ["x", "W"], ["z"], pads=[1, 1, 1, 1], name="conv_full"))
        outputs.append(vinfo("z", [1, 64, 8, 8]))
    inits = [tensor("W", full), tensor("starts", np.array([0], np.int64)), tensor("ends", np.array([8], np.int64)),
             tensor("axes", np.array([0], np.int64))]
    return model(nodes, [vinfo("x", [1, 64, 8, 8])], outputs, inits)


@pytest.mark.parametrize("shared", [False, True])
def test_a_weight_sliced_from_a_large_constant_folds_unless_that_stores_it_twice(shared):
    m = sliced_weight(shared)
    out, report = opfuse.optimize(m)
    assert report.verification.ok
    sizes = sorted(int(np.prod(v.const_value.shape)) for v in out.graph.initializers.values()
                   if v.const_value is not None and v.const_value.size > 100)
    if shared:  # folding would keep the whole weight and its slice: the Slice stays
        assert "Slice" in ops(out) and sizes == [64 * 64 * 9]
    else:  # the slice becomes the weight, the whole one goes
        assert "Slice" not in ops(out) and sizes == [8 * 64 * 9]
    assert_same(m, out)


def test_folder_is_skipped_only_where_nothing_can_fold(monkeypatch):
    """onnxscript's folder runs when some node has only constant inputs (an initializer or a
    Constant's output) or an op it evaluates partially; on a Conv -> Relu chain it is
    skipped, and the clean-up's result is the same as with it."""
    import onnx_ir as ir

    from opfuse.passes import cleanup

    w = rng(1).normal(size=(2, 2, 1, 1)).astype(np.float32)
    chain = model([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
                  [vinfo("x", [1, 2, 4, 4])], [vinfo("y", [1, 2, 4, 4])], [tensor("w", w)])
    assert not cleanup._could_fold(ir.serde.deserialize_model(chain))
    constant_add = model([constant_node("k", "k", np.ones(2, np.float32)),
                          helper.make_node("Add", ["k", "b"], ["kb"]), helper.make_node("Mul", ["x", "kb"], ["y"])],
                         [vinfo("x", [2])], [vinfo("y", [2])], [tensor("b", np.ones(2, np.float32))])
    assert cleanup._could_fold(ir.serde.deserialize_model(constant_add))
    shape = model([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Cast", ["s"], ["y"], to=1)],
                  [vinfo("x", [2, "n"])], [vinfo("y", [2])])
    assert cleanup._could_fold(ir.serde.deserialize_model(shape))
    then, other = (helper.make_graph([helper.make_node(op, ["x"], [op])], op, [], [vinfo(op, [2])])
                   for op in ("Relu", "Neg"))
    branch = model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                   [vinfo("x", [2])], [vinfo("y", [2])], [tensor("c", np.array(True))])
    assert cleanup._could_fold(ir.serde.deserialize_model(branch))  # an If on a constant: inlined

    calls = []
    original = cleanup._fold_constants
    monkeypatch.setattr(cleanup, "_fold_constants", lambda *a: calls.append(1) or original(*a))
    skipped, report = opfuse.optimize(chain)
    assert not calls and report.verification.ok
    monkeypatch.setattr(cleanup, "_could_fold", lambda m: True)
    folded, _ = opfuse.optimize(chain)
    assert calls and ops(skipped) == ops(folded)


def test_a_graph_output_folded_into_a_constant_keeps_its_type():
    """onnxscript's new initializer has no type; ONNX requires one on a graph output."""
    import onnx_ir as ir

    m = model([helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Neg", ["c"], ["y"])],
              [vinfo("x", [2])], [vinfo("a", [2]), vinfo("y", [2])], [tensor("c", np.array([1.0, 2.0], np.float32))])
    result, report = opfuse.optimize(m)
    written = ir.serde.serialize_model(result)
    onnx.checker.check_model(written, full_check=True)
    assert [o.name for o in written.graph.output] == ["a", "y"] and report.verification.ok


def test_equal_integer_constants_become_one_and_so_do_the_nodes_reading_them():
    """Two integer initializers of equal type, shape and bytes are one value after the rewrites (a
    rewrite writes its own shape constants per site); the two Reshapes of x by them are then one
    node (common subexpressions). Two equal float initializers stay two: a weight or a scale a
    later step may change for one layer alone."""
    shape, scale = np.array([4, 2], np.int64), np.array([0.5, -2.0], np.float32)
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"]), helper.make_node("Reshape", ["x", "s2"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["ab"]), helper.make_node("Mul", ["ab", "w1"], ["m1"]),
             helper.make_node("Mul", ["ab", "w2"], ["m2"]), helper.make_node("Add", ["m1", "m2"], ["out"])]
    m = model(nodes, [vinfo("x", [2, 4])], [vinfo("out", [4, 2])],
              [tensor("s1", shape), tensor("s2", shape.copy()), tensor("w1", scale), tensor("w2", scale.copy())])
    out, _ = opfuse.optimize(m)
    assert sorted(ops(out)) == ["Add", "Add", "Mul", "Mul", "Reshape"]
    assert sorted(v.name for v in out.graph.initializers.values()) == ["s1", "w1", "w2"]
    assert not unused_initializers(out)
    assert_same(m, out)


def _layer_norms(mean_is_output: bool):
    """Two LayerNormalizations (opset 17) with all three outputs named; the second's Mean a graph output
    when asked; an op of an unknown domain with an unread second output between them."""
    r = rng(7)
    d = 16
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["y0", "m0", "v0"], axis=-1, epsilon=1e-5),
        helper.make_node("Custom", ["y0"], ["c0", "c1"], domain="example.custom"),
        helper.make_node("LayerNormalization", ["y0", "g", "b"], ["y1", "m1", "v1"], axis=-1, epsilon=1e-5),
    ]
    outputs = [vinfo("y1", [2, 3, d]), vinfo("c0", [2, 3, d])] + ([vinfo("m1", [2, 3, 1])] if mean_is_output else [])
    m = model(nodes, [vinfo("x", [2, 3, d])], outputs,
              [tensor("g", r.normal(1, 0.1, d).astype(np.float32)), tensor("b", r.normal(0, 0.1, d).astype(np.float32))],
              opset=17, extra_opsets=[helper.make_opsetid("example.custom", 1)], fill_output_shapes=False)
    return m


@pytest.mark.parametrize("mean_is_output", [False, True])
def test_unread_optional_outputs_are_written_unnamed(mean_is_output):
    """Step 6: LayerNormalization's Mean and InvStdDev, optional in its schema, read by nothing, are
    written unnamed; a graph output keeps its name; an op of an unknown domain keeps every output."""
    m = _layer_norms(mean_is_output)
    out, _ = opfuse.optimize(m, verify=False)
    out = ir.to_proto(out)  # (as written)
    norms = [n for n in out.graph.node if n.op_type == "LayerNormalization"]
    assert [list(n.output) for n in norms] == [["y0"], ["y1", "m1"] if mean_is_output else ["y1"]]  # (trailing unnamed outputs are left out)
    custom = [n for n in out.graph.node if n.op_type == "Custom"]
    assert [list(n.output) for n in custom] == [["c0", "c1"]]
    onnx.checker.check_model(out)

