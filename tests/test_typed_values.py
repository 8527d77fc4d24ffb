"""A value opfuse gives a shape also has a type: onnx-ir writes a value_info only for a typed
value and logs "The value type for shape [...] is not known ... Skipping serialization" once per
value otherwise (dozens of lines on an exported decoder). Symbolic shape inference
(:mod:`opfuse.core.symbolic_shapes`) gives a value without a type the tool's element type along
with its shape."""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper

from graphs import model, rng, tensor, vinfo
from opfuse.core.symbolic_shapes import infer_symbolic_shapes


def untyped_chain() -> ir.Model:
    """x[batch, seq, 8] -> MatMul -> Relu -> Add -> y, with no value_info: the intermediates
    load with neither type nor shape, as from a graph onnx's inference could not type."""
    m = model([helper.make_node("MatMul", ["x", "W"], ["h"], name="proj"),
               helper.make_node("Relu", ["h"], ["r"], name="relu"),
               helper.make_node("Add", ["r", "x"], ["y"], name="add")],
              [vinfo("x", ["batch", "seq", 8])], [vinfo("y", ["batch", "seq", 8])],
              [tensor("W", rng(0).normal(size=(8, 8)).astype(np.float32))])
    del m.graph.value_info[:]
    return ir.serde.deserialize_model(m)


def test_symbolic_shapes_give_an_untyped_value_its_type_too(caplog):
    m = untyped_chain()
    values = ir.convenience.create_value_mapping(m.graph)
    assert values["h"].type is None and values["h"].shape is None
    assert infer_symbolic_shapes(m)
    for name in ("h", "r"):
        assert values[name].dtype == ir.DataType.FLOAT, name
        assert [d if isinstance(d, int) else d.value for d in values[name].shape] == ["batch", "seq", 8]
    with caplog.at_level(logging.WARNING):
        proto = ir.serde.serialize_model(m)
    assert not [r for r in caplog.records if "is not known" in r.getMessage()]
    infos = {v.name: v.type.tensor_type.elem_type for v in proto.graph.value_info}
    assert infos["h"] == infos["r"] == TensorProto.FLOAT


def test_an_exported_decoder_is_saved_without_an_untyped_value(tmp_path, caplog):
    """A dynamo export (a tiny Llama with a ``position_ids`` input) through ``--target
    onnxruntime``: before the fix, 16 of its values came out of symbolic shape inference shaped
    but untyped, and onnx-ir logged each on saving."""
    from decoder_nets import export_tiny_llama
    from opfuse.cli import main

    source = export_tiny_llama(tmp_path / "llama.onnx", positions=True)
    with caplog.at_level(logging.WARNING):
        assert main(["optimize", str(source), "-o", str(tmp_path / "o.onnx"), "--target", "onnxruntime",
                     "--no-verify", "-q"]) == 0
    assert not [r.getMessage() for r in caplog.records if "is not known" in r.getMessage()]
