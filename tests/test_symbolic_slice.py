"""ONNX Runtime's symbolic shape inference, as opfuse runs it (opfuse.core.symbolic_shapes):
a Slice with a negative constant start on a symbolic dim is not assumed to be that long
(a sliding-window cache, x[:, :, -4095:], is min(n, 4095) long, not 4095), and the model
optimised with it runs at a shorter n, equal to the input."""

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper

from graphs import model, ort_run, tensor, vinfo
from opfuse.core.symbolic_shapes import infer_symbolic_shapes
from opfuse.pipeline import optimize

INT_MAX = np.iinfo(np.int64).max


def _sliced(start: int):
    nodes = [helper.make_node("Slice", ["x", "start", "end", "axis"], ["window"], name="window"),
             helper.make_node("Shape", ["window"], ["shape"], name="shape"),
             helper.make_node("Reshape", ["y", "shape"], ["y_as_window"], name="as_window"),
             helper.make_node("Add", ["window", "y_as_window"], ["out"], name="add")]
    inits = [tensor("start", np.array([start], np.int64)), tensor("end", np.array([INT_MAX], np.int64)),
             tensor("axis", np.array([1], np.int64))]
    return model(nodes, [vinfo("x", [1, "n"]), vinfo("y", [1, "m"])], [vinfo("out", None)], inits)


@pytest.mark.parametrize("start", [-4095, -3])
def test_a_negative_start_on_a_symbolic_dim_is_not_assumed_to_fit(start):
    m = ir.from_proto(_sliced(start))
    assert infer_symbolic_shapes(m)
    (window,) = [n.outputs[0] for n in m.graph if n.name == "window"]
    assert window.shape is not None and window.shape[1] != -start
    out, report = optimize(_sliced(start), target="onnx")
    assert report.verification.ok
    feeds = {"x": np.arange(5, dtype=np.float32)[None], "y": np.ones((1, 3 if start == -3 else 5), np.float32)}
    np.testing.assert_array_equal(ort_run(out, feeds)["out"], ort_run(_sliced(start), feeds)["out"])


def test_the_last_position_keeps_its_length_of_one():
    m = ir.from_proto(_sliced(-1))
    assert infer_symbolic_shapes(m)
    (window,) = [n.outputs[0] for n in m.graph if n.name == "window"]
    assert window.shape[1] == 1
