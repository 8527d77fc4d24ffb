"""opfuse.llm's attention step reads the optimised graph without its large weights and writes its result
with their bytes copied from file to file (``_without_large_weights``, ``_save_streamed``): on a graph
built here (weights in external data, small ones too, a node's tensor, a tensor added after loading), the
same two files as ``onnx.load`` of the whole model followed by ``onnx.save`` with external data.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import opfuse.llm as llm


def _graph() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in (("big", (64, 48)), ("mid", (16, 20)), ("tiny", (4,)), ("big2", (48, 40)))]
    nodes = [helper.make_node("MatMul", ["x", "big"], ["a"]),
             helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(
                 rng.standard_normal((20, 30)).astype(np.float32), "c_value")),
             helper.make_node("MatMul", ["a", "big2"], ["b"]),
             helper.make_node("Add", ["b", "tiny_b"], ["y"])]
    inits.append(numpy_helper.from_array(rng.standard_normal((40,)).astype(np.float32), "tiny_b"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 40])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_streamed_save_writes_what_onnx_save_writes(tmp_path, monkeypatch):
    source = tmp_path / "src" / "model.onnx"
    source.parent.mkdir()
    onnx.save(_graph(), str(source), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx.data", size_threshold=0, convert_attribute=True)  # (small ones too)
    monkeypatch.setattr(llm, "LOADED_BYTES", 2000)  # ("big" and "big2" stay in their file)
    extra = numpy_helper.from_array(np.arange(600, dtype=np.float32), "added")  # (a rewrite's new tensor)

    whole = onnx.load(str(source))
    whole.graph.initializer.append(extra)
    (tmp_path / "whole").mkdir()
    onnx.save(whole, str(tmp_path / "whole" / "model.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)

    partial = llm._without_large_weights(source)
    big = [t.name for t in partial.graph.initializer if onnx.external_data_helper.uses_external_data(t)]
    assert sorted(big) == ["big", "big2"]
    partial.graph.initializer.append(extra)
    (tmp_path / "streamed").mkdir()
    llm._save_streamed(partial, tmp_path / "streamed" / "model.onnx", source.parent)

    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "streamed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
