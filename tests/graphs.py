"""The test suite's one helper module: build small ONNX graphs, run them, compare outputs.

Graphs are built with onnx.helper; they run on ONNX Runtime's CPU provider with graph
optimisations disabled and one thread (:func:`ort_run`, which does not go through opfuse:
the tests decide what the right answer is on their own). Random inputs come from
:func:`opfuse.verify.make_inputs`, so a test exercises the same inputs a user's
verification would. Fixtures live in ``conftest.py``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from opfuse.verify import make_inputs

RTOL, ATOL = 1e-4, 1e-5  # float32, atol relative to the output's scale
FP16 = (1e-2, 2e-3)


# -- building ----------------------------------------------------------------------------------

def tensor(name: str, array) -> onnx.TensorProto:
    """An initializer from anything numpy can read."""
    return numpy_helper.from_array(np.asarray(array), name)


def vinfo(name: str, shape, dtype=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    """A typed value; ``dtype`` an ONNX element type or anything numpy reads as a dtype."""
    if not isinstance(dtype, int):
        dtype = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return helper.make_tensor_value_info(name, dtype, shape)


def constant_node(name: str, output: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [output], name=name, value=numpy_helper.from_array(np.asarray(array))
    )


def model(
    nodes,
    inputs,
    outputs,
    initializers=(),
    opset: int = 17,
    functions=(),
    extra_opsets=(),
    ir_version: int | None = None,
    *,
    name: str = "test",
    fill_output_shapes: bool = True,
    check: bool = False,
) -> onnx.ModelProto:
    """A model at IR version 10 at most (what onnxruntime reads everywhere).

    ``fill_output_shapes`` gives outputs declared without a shape the inferred one (the
    checker wants one); ``check`` runs onnx.checker on the result.
    """
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs), list(initializers))
    opsets = [helper.make_opsetid("", opset), *extra_opsets]
    m = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    m.ir_version = ir_version or min(m.ir_version, 10)
    if fill_output_shapes:
        _fill_output_shapes(m)
    if check:
        onnx.checker.check_model(m)
    return m


def _fill_output_shapes(m: onnx.ModelProto) -> None:
    missing = [o for o in m.graph.output if not o.type.tensor_type.HasField("shape")]
    if not missing:
        return
    inferred = onnx.shape_inference.infer_shapes(m)
    known = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for out in missing:
        if out.name in known and known[out.name].type.tensor_type.HasField("shape"):
            out.type.CopyFrom(known[out.name].type)


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


# -- the fold tests' standard case ----------------------------------------------------------

def conv_bn_model(
    spatial=2, c_in=4, c_out=6, k=3, group=1, bias=True, eps=None, conv_attrs=None, size=7,
    opset=17, bn_attrs=None, dtype=np.float32, seed=0,
):
    r = rng(seed)
    w = r.normal(0, 0.5, (c_out, c_in // group) + (k,) * spatial).astype(dtype)
    inits = [tensor("W", w)] + bn_params("bn", c_out, seed, dtype)
    conv_inputs = ["x", "W"]
    if bias:
        inits.append(tensor("Bc", r.normal(0, 0.5, c_out).astype(dtype)))
        conv_inputs.append("Bc")
    attrs = dict(conv_attrs or {})
    attrs.setdefault("group", group)
    if "auto_pad" not in attrs:
        attrs.setdefault("pads", [k // 2] * (2 * spatial))
    bn_kw = dict(bn_attrs or {})
    if eps is not None:
        bn_kw["epsilon"] = eps
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("Conv", conv_inputs, ["y"], name="conv", **attrs),
        bn_node("bn", "y", "z", **bn_kw),
    ]
    return model(
        nodes,
        [vinfo("x", ["N", c_in] + [size] * spatial, elem)],
        [vinfo("z", ["N", c_out] + [f"s{i}" for i in range(spatial)], elem)],
        inits,
        opset=opset,
    )


# -- running -------------------------------------------------------------------------------------

def to_proto(m: onnx.ModelProto | ir.Model) -> onnx.ModelProto:
    return ir.serde.serialize_model(m) if isinstance(m, ir.Model) else m


def ort_run(m: onnx.ModelProto | ir.Model, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All graph outputs, by name, on the CPU provider with graph optimisations disabled."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    external = isinstance(m, ir.Model) and any(
        isinstance(v.const_value, ir.ExternalTensor) for v in m.graph.initializers.values())
    if external:  # the runtime reads external data from files next to a model file only
        with tempfile.TemporaryDirectory(prefix="opfuse-test-") as tmp:
            source = os.path.join(tmp, "m.onnx")
            ir.save(m, source, external_data="m.onnx.data")
            session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    else:  # (bytes: no folder made and removed for each of the property tests' thousands of runs)
        session = ort.InferenceSession(to_proto(m).SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds))))


def run(m, feeds=None, dims=None, seed=0):
    """Run a model on seeded random inputs (or ``feeds``); returns (outputs, feeds)."""
    irm = m if isinstance(m, ir.Model) else ir.serde.deserialize_model(m)
    feeds = feeds if feeds is not None else make_inputs(irm, dims=dims, seed=seed)
    return ort_run(m, feeds), feeds


# -- comparing -----------------------------------------------------------------------------------

def assert_outputs_close(
    expected: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    rtol: float = RTOL,
    atol: float = ATOL,
    exact: Iterable[str] = (),
    floor: float = 0.0,
) -> None:
    """Every expected output is in ``actual`` with the same shape and dtype and
    ``|a - b| <= max(atol * scale + rtol * |a|, floor)`` (scale = max |a|); non-finite
    values must sit in the same places with the same values. Names in ``exact`` must
    match bitwise."""
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
        limit = np.maximum(atol * scale + rtol * np.abs(a), floor)
        worst = int(np.argmax(err / limit))
        assert np.all(err <= limit), (
            f"output {name!r}: max |diff| {err.max():.3g} (worst {err[worst]:.3g} at "
            f"reference {a[worst]:.4g}, limit {limit[worst]:.3g}); scale {scale:.3g}"
        )


def assert_same(original, optimised, dims=None, rtol=RTOL, atol=ATOL, seed=0):
    """Both models give the same outputs on the same random inputs."""
    expected, feeds = run(original, dims=dims, seed=seed)
    actual, _ = run(optimised, feeds=feeds)
    assert_outputs_close(expected, actual, rtol, atol)


# -- looking at graphs ------------------------------------------------------------------------

def ops(m) -> list[str]:
    """Op types of the main graph, in order."""
    if isinstance(m, ir.Model):
        return [n.op_type for n in m.graph]
    return [n.op_type for n in m.graph.node]


def node_names(m: ir.Model | onnx.ModelProto) -> list[str]:
    if isinstance(m, ir.Model):
        return [n.name for n in m.graph]
    return [n.name for n in m.graph.node]


def nodes_by_name(m: ir.Model) -> dict[str, ir.Node]:
    return {n.name: n for n in m.graph}


def dead_nodes(m: ir.Model) -> list[str]:
    """Nodes of the main graph none of whose outputs is used or a graph output."""
    return [
        n.name or n.op_type
        for n in m.graph
        if not any(v.uses() or v.is_graph_output() for v in n.outputs)
    ]


def unused_initializers(m: ir.Model) -> list[str]:
    return [
        name
        for name, v in m.graph.initializers.items()
        if not v.uses() and not v.is_graph_output() and not v.is_graph_input()
    ]
