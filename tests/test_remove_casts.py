"""remove-casts: a Cast to a value's own dtype and an exact round trip go; a narrowing stays.

Which round trips are exact is decided here by converting every value of the narrow dtype
(all of them for 8- and 16-bit types, edge values and a sample for wider ones) with numpy
and ml_dtypes, never from opfuse's table; the graphs run on ONNX Runtime against the
unrewritten model.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import opfuse
from opfuse.passes.remove_casts import holds_exactly

from graphs import assert_same, model, ops, run, ort_run, vinfo

n = helper.make_node
TYPES = {
    "bool": (TensorProto.BOOL, np.bool_), "int8": (TensorProto.INT8, np.int8), "uint8": (TensorProto.UINT8, np.uint8),
    "int16": (TensorProto.INT16, np.int16), "uint16": (TensorProto.UINT16, np.uint16),
    "int32": (TensorProto.INT32, np.int32), "int64": (TensorProto.INT64, np.int64),
    "float16": (TensorProto.FLOAT16, np.float16), "bfloat16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16),
    "float32": (TensorProto.FLOAT, np.float32), "float64": (TensorProto.DOUBLE, np.float64),
}


def _every_value(dtype) -> np.ndarray:
    """All values of an 8/16-bit dtype; the edges and a spread of the others for wider ones."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.array([False, True])
    if dtype.itemsize <= 2:
        raw = np.arange(2 ** (8 * dtype.itemsize), dtype=np.uint64).astype(f"u{dtype.itemsize}")
        values = raw.view(dtype)
        if dtype.kind in "fV":  # floats (bfloat16's kind is V): the finite ones, and inf and NaN apart
            with np.errstate(all="ignore"):
                values = values[np.isfinite(values.astype(np.float64))]
        return values
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        edges = [info.min, info.max, info.max - 1, 2**24 + 1, 2**53 + 1, 0, 1]
        return np.array([e for e in edges if info.min <= e <= info.max], dtype)
    info = np.finfo(dtype)
    return np.array([info.max, -info.max, info.tiny, info.smallest_subnormal, 1 + info.eps, np.pi, 1e-30], dtype)


@pytest.mark.parametrize("narrow", list(TYPES))
@pytest.mark.parametrize("wide", list(TYPES))
def test_which_round_trips_are_exact_matches_converting_every_value(narrow, wide):
    """Claimed exact: every value comes back. Refused: some value is not a value of the wide
    dtype (an integer wrapping around into another signedness is not: runtimes differ)."""
    values = _every_value(TYPES[narrow][1])
    with np.errstate(all="ignore"):
        widened = values.astype(TYPES[wide][1])
        back = widened.astype(TYPES[narrow][1])
    # Python compares ints and floats by their exact values
    same_numbers = all(a == b for a, b in zip(_numbers(values), _numbers(widened)))
    claim = holds_exactly(ir.DataType(TYPES[narrow][0]), ir.DataType(TYPES[wide][0]))
    if claim:
        assert np.array_equal(back, values) and same_numbers, f"{narrow} -> {wide} -> {narrow} changes a value"
    else:
        assert not same_numbers, f"{narrow} -> {wide} keeps every value, but the round trip is refused"


def _numbers(array: np.ndarray) -> list:
    if array.dtype == ml_dtypes.bfloat16:
        array = array.astype(np.float32)  # exact
    return array.tolist()


def _chain(x_type, casts, opset=17, output=None):
    nodes, h = [n("Relu" if x_type in ("float16", "float32", "float64") else "Identity", ["x"], ["h0"], name="source")], "h0"
    for i, to in enumerate(casts):
        nodes.append(n("Cast", [h], [f"c{i}"], name=f"cast{i}", to=TYPES[to][0]))
        h = f"c{i}"
    nodes.append(n("Identity" if output else "Abs", [h], ["y"], name="reader"))
    return model(nodes, [vinfo("x", ["N", 5], TYPES[x_type][0])], [vinfo("y", None, TYPES[casts[-1]][0])], opset=opset)


@pytest.mark.parametrize("x_type, casts, removed", [
    ("float32", ["float64", "float32"], 2),  # widening round trip
    ("float16", ["float32", "float16"], 2),
    ("float32", ["float32"], 1),  # to its own dtype
    ("int32", ["float64", "int32"], 2),
    ("float32", ["float16", "float32"], 0),  # narrowing first: values change
    ("int32", ["float32", "int32"], 0),  # 2**24 + 1 does not survive float32
    ("float64", ["float32", "float64"], 0),
])
def test_no_op_casts_go_and_value_changing_ones_stay(x_type, casts, removed):
    m = _chain(x_type, casts)
    out, report = opfuse.optimize(m, passes=["remove-casts"], cleanup=False, dims={"N": 2})
    assert ops(out).count("Cast") == len(casts) - removed, report.records
    if removed == 0:
        reason = report.refusals[0].reason
        assert "changes values" in reason and report.refusals[0].node == f"cast{len(casts) - 1}"
    assert_same(m, out, dims={"N": 3})


def test_a_cast_chain_whose_inner_cast_is_read_elsewhere_keeps_that_cast():
    m = _chain("float32", ["float64", "float32"])
    m.graph.output.append(vinfo("c0", None, TensorProto.DOUBLE))
    out, report = opfuse.optimize(m, passes=["remove-casts"], cleanup=False, dims={"N": 2})
    assert ops(out).count("Cast") == 1 and report.records[0].removed == ("cast1",)
    assert_same(m, out, dims={"N": 2})


def test_a_no_op_cast_onto_a_graph_output_hands_it_its_name_or_stays_with_a_reason():
    m = _chain("float32", ["float32"], output=True)  # Relu -> Cast -> Identity -> y
    m.graph.node[-1].op_type = "Cast"
    m.graph.node[-1].attribute.append(helper.make_attribute("to", TensorProto.FLOAT))
    out, report = opfuse.optimize(m, passes=["remove-casts"], cleanup=False, dims={"N": 2})
    assert ops(out) == ["Relu"] and [v.name for v in out.graph.outputs] == ["y"]
    assert_same(m, out, dims={"N": 2})
    copy = model([n("Cast", ["x"], ["y"], name="copy", to=TensorProto.FLOAT)], [vinfo("x", [2])], [vinfo("y", [2])])
    out, report = opfuse.optimize(copy, passes=["remove-casts"], cleanup=False)
    assert ops(out) == ["Cast"] and "graph output" in report.refusals[0].reason


def test_by_default_the_casts_of_a_tf_export_go_and_the_folds_then_reach_the_conv():
    """tf2onnx writes Cast(x, to=FLOAT) on float tensors; between a conv and its bias it hides the bias."""
    from graphs import rng, tensor

    r = rng(0)
    inits = [tensor("w", r.normal(0, 0.3, (4, 3, 1, 1)).astype(np.float32)),
             tensor("b", r.normal(0, 1, (4, 1, 1)).astype(np.float32))]
    nodes = [n("Conv", ["x", "w"], ["conv"], name="conv"),
             n("Cast", ["conv"], ["wide"], name="to_double", to=TensorProto.DOUBLE),
             n("Cast", ["wide"], ["back"], name="to_float", to=TensorProto.FLOAT),
             n("Add", ["back", "b"], ["y"], name="bias")]
    m = model(nodes, [vinfo("x", ["N", 3, 4, 4])], [vinfo("y", None)], inits)
    out, report = opfuse.optimize(m, dims={"N": 2})
    assert ops(out) == ["Conv"], report.refusals
    assert sorted(r.pattern for r in report.records) == ["Cast+Cast", "Conv+Add"]
    expected, feeds = run(m, dims={"N": 2})
    assert np.allclose(ort_run(out, feeds)["y"], expected["y"], rtol=1e-5, atol=1e-5)
