"""Small helpers shared by the fold tests: build ONNX graphs with onnx.helper, run them on
ONNX Runtime (CPU, graph optimisations off, one thread), and compare outputs.

Nothing here imports opfuse: the tests decide what the right answer is on their own.
"""

from __future__ import annotations

__all__ = [
    "np_to_onnx_dtype",
    "value_info",
    "initializer",
    "constant_node",
    "make_model",
    "to_proto",
    "ort_run",
    "assert_outputs_close",
    "node_names",
    "nodes_by_name",
    "dead_nodes",
    "unused_initializers",
]

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import helper, numpy_helper


def np_to_onnx_dtype(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def value_info(name: str, dtype, shape: Sequence[int | str] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, np_to_onnx_dtype(dtype), shape)


def initializer(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def constant_node(name: str, output: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [output], name=name, value=numpy_helper.from_array(np.asarray(array))
    )


def make_model(
    nodes: Iterable[onnx.NodeProto],
    inputs: Iterable[onnx.ValueInfoProto],
    outputs: Iterable[onnx.ValueInfoProto],
    initializers: Iterable[onnx.TensorProto] = (),
    opset: int = 17,
    name: str = "g",
) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs), list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = min(model.ir_version, 10)  # onnxruntime reads IR 10 everywhere
    onnx.checker.check_model(model)
    return model


def to_proto(model: onnx.ModelProto | ir.Model) -> onnx.ModelProto:
    if isinstance(model, ir.Model):
        return ir.serde.serialize_model(model)
    return model


def ort_run(
    model: onnx.ModelProto | ir.Model, feeds: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """All graph outputs, by name, on the CPU provider with graph optimisations disabled."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(
        to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds))))


def assert_outputs_close(
    expected: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    rtol: float,
    atol: float,
    exact: Iterable[str] = (),
) -> None:
    """Every expected output is in ``actual`` with the same shape and dtype and
    ``|a - b| <= atol * scale + rtol * |a|`` (scale = max |a|); non-finite values must
    sit in the same places with the same values. Names in ``exact`` must match bitwise."""
    exact = set(exact)
    assert list(actual) == list(expected), f"outputs changed: {list(expected)} -> {list(actual)}"
    for name, ref in expected.items():
        got = actual[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype, (
            f"output {name!r}: {ref.shape} {ref.dtype} became {got.shape} {got.dtype}"
        )
        if name in exact:
            assert np.array_equal(ref, got, equal_nan=True), f"output {name!r} changed"
            continue
        a, b = ref.astype(np.float64), got.astype(np.float64)
        finite = np.isfinite(a)
        assert np.array_equal(finite, np.isfinite(b)), f"output {name!r}: inf/NaN moved"
        assert np.array_equal(a[~finite], b[~finite], equal_nan=True), (
            f"output {name!r}: non-finite values changed"
        )
        a, b = a[finite], b[finite]
        if a.size == 0:
            continue
        scale = float(np.max(np.abs(a))) or 1.0
        err = np.abs(a - b)
        limit = atol * scale + rtol * np.abs(a)
        worst = int(np.argmax(err / limit))
        assert np.all(err <= limit), (
            f"output {name!r}: max |diff| {err.max():.3g} (worst {err[worst]:.3g} at "
            f"reference {a[worst]:.4g}, limit {limit[worst]:.3g}); scale {scale:.3g}"
        )


def node_names(model: ir.Model | onnx.ModelProto) -> list[str]:
    if isinstance(model, ir.Model):
        return [n.name for n in model.graph]
    return [n.name for n in model.graph.node]


def nodes_by_name(model: ir.Model) -> dict[str, ir.Node]:
    return {n.name: n for n in model.graph}


def dead_nodes(model: ir.Model) -> list[str]:
    """Nodes of the main graph none of whose outputs is used or a graph output."""
    return [
        n.name or n.op_type
        for n in model.graph
        if not any(v.uses() or v.is_graph_output() for v in n.outputs)
    ]


def unused_initializers(model: ir.Model) -> list[str]:
    return [
        name
        for name, v in model.graph.initializers.items()
        if not v.uses() and not v.is_graph_output() and not v.is_graph_input()
    ]
