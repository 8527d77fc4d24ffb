"""Shared test helpers: tiny ONNX graphs built with onnx.helper, run on ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from opfuse.verify import make_inputs, run_model

RTOL, ATOL = 1e-4, 1e-5  # float32, atol relative to the output's scale
FP16 = (1e-2, 2e-3)


def tensor(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def model(
    nodes,
    inputs,
    outputs,
    initializers=(),
    opset: int = 17,
    functions=(),
    extra_opsets=(),
    ir_version: int | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, list(initializers))
    opsets = [helper.make_opsetid("", opset), *extra_opsets]
    m = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    m.ir_version = ir_version or min(m.ir_version, 10)
    _fill_output_shapes(m)
    return m


def _fill_output_shapes(m: onnx.ModelProto) -> None:
    """Give outputs declared without a shape the shape ONNX infers (the checker wants one)."""
    missing = [o for o in m.graph.output if not o.type.tensor_type.HasField("shape")]
    if not missing:
        return
    inferred = onnx.shape_inference.infer_shapes(m)
    known = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for out in missing:
        if out.name in known and known[out.name].type.tensor_type.HasField("shape"):
            out.type.CopyFrom(known[out.name].type)


def vinfo(name: str, shape, dtype=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def run(m, feeds=None, dims=None, seed=0):
    """Run a ModelProto or onnx_ir.Model on ORT (optimisations off); returns (outputs, feeds)."""
    irm = m if isinstance(m, ir.Model) else ir.serde.deserialize_model(m)
    feeds = feeds if feeds is not None else make_inputs(irm, dims=dims, seed=seed)
    return run_model(irm, feeds), feeds


def assert_same(original, optimised, dims=None, rtol=RTOL, atol=ATOL, seed=0):
    """Both models give the same outputs on the same random inputs."""
    expected, feeds = run(original, dims=dims, seed=seed)
    actual, _ = run(optimised, feeds=feeds)
    assert set(expected) == set(actual), (sorted(expected), sorted(actual))
    for name, ref in expected.items():
        got = actual[name]
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        a, b = ref.astype(np.float64), got.astype(np.float64)
        scale = float(np.max(np.abs(a))) or 1.0
        err = np.abs(a - b)
        assert np.all(err <= atol * scale + rtol * np.abs(a)), (
            f"{name}: max err {err.max():.3g} at scale {scale:.3g}"
        )


def ops(m) -> list[str]:
    """Op types of the main graph, in order."""
    if isinstance(m, ir.Model):
        return [n.op_type for n in m.graph]
    return [n.op_type for n in m.graph.node]


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def bn_params(prefix: str, c: int, seed: int = 0, dtype=np.float32):
    """Initializers scale/B/mean/var for a BatchNormalization with c channels."""
    r = rng(seed)
    return [
        tensor(f"{prefix}.scale", r.uniform(0.5, 1.5, c).astype(dtype)),
        tensor(f"{prefix}.B", r.normal(0, 0.5, c).astype(dtype)),
        tensor(f"{prefix}.mean", r.normal(0, 0.5, c).astype(dtype)),
        tensor(f"{prefix}.var", r.uniform(0.3, 2.0, c).astype(dtype)),
    ]


def bn_node(prefix: str, x: str, y: str, **attrs):
    return helper.make_node(
        "BatchNormalization",
        [x, f"{prefix}.scale", f"{prefix}.B", f"{prefix}.mean", f"{prefix}.var"],
        [y],
        name=prefix,
        **attrs,
    )


@pytest.fixture
def tmp_model(tmp_path):
    """Save a ModelProto under tmp_path and return its path."""

    def save(m: onnx.ModelProto, name: str = "model.onnx"):
        path = tmp_path / name
        onnx.save(m, path)
        return path

    return save
