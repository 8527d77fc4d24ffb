"""The original's own float32 variation: how far its outputs are from the same model in float64.

A rewrite of a deep float32 model moves its outputs by reordering sums, and so does the model's
own float32 arithmetic: verification (:mod:`opfuse.verify`) lets a check differ from the original
by :data:`opfuse.verify.VARIATION_FACTOR` times ``d0``, the distance from the original's float32
run to the same model run in float64 (:func:`_in_float64`; a model kept with external data:
:func:`_float64_session`, its weights cast as the run reads them), or, where ONNX Runtime cannot build or
run that, to the original at ONNX Runtime's :data:`VARIATION_LEVEL` (its own fusions and
reorderings). A wrong rewrite moves them by far more.
"""

from __future__ import annotations

__all__ = ["VARIATION_LEVEL", "runtime_variation", "runtime_rounding"]

import os
import tempfile
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from opfuse.core.ops import ONNX_DOMAINS
from opfuse.runtime import create_session, serialized, session_with_weights, shared_weights
from opfuse.verify.inputs import defined_positions

VARIATION_LEVEL = "all"  # the original runs at this ONNX Runtime level for d0 where float64 cannot run


def runtime_variation(original, feeds: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                      tensors: Iterable[str], mask: np.ndarray | None = None) -> dict[str, float]:
    """tensor -> d0, the original's own float32 variation on ``feeds``: max |``expected`` -
    the original in float64| (else the original at ONNX Runtime :data:`VARIATION_LEVEL`; where
    defined, for a padded batch's ``mask``); a check of a rewrite may differ from ``expected`` by :data:`VARIATION_FACTOR`
    times it (``compare_tensor(..., floor=VARIATION_FACTOR * d0)``). Empty when the original
    does not run at that level. ``original``: an ir.Model or what runtime.serialized made."""
    source = serialized(original) if isinstance(original, ir.Model) else original
    _, found = runtime_rounding(source, [("", feeds, expected)], list(tensors), {"": mask} if mask is not None else {})
    return {name: value for (_, name), value in found.items()}


def runtime_rounding(original_x, sets, tensors: list[str], masks=None) -> tuple[str, dict[tuple[str, str], float]]:
    """(the reference used, {(input set, tensor): d0}) for each tensor (where defined, on a padded
    batch): the distance from the original's float32 run to the same model in float64
    (:func:`_in_float64`: its own float32 error), or, where ONNX Runtime cannot build or run that,
    to the original at :data:`VARIATION_LEVEL` (how far the runtime's own fusions and
    reorderings move it)."""
    masks = masks or {}
    if not tensors:
        return VARIATION_LEVEL, {}
    for level in ("float64", VARIATION_LEVEL):
        found = _distances(original_x, sets, tensors, masks, level)
        if found is not None:
            return level, found
    return VARIATION_LEVEL, {}


def _distances(original_x, sets, tensors, masks, level: str) -> dict[tuple[str, str], float] | None:
    """The distances of :func:`runtime_rounding` at one ``level`` (None when the original does
    not build or run there)."""
    try:
        if level != "float64":
            session = create_session(original_x, level, prepack=False, share_weights=True)
        elif isinstance(original_x, ir.Model):  # its weights where they are, widened as the run reads them
            session = _float64_session(original_x, set(tensors))
        else:
            session = _float64_from_bytes(original_x)
    except Exception:  # noqa: BLE001 - onnxruntime raises its own exception types
        return None
    if session is None:
        return None
    return _measured(session, sets, tensors, masks, level)


def _float64_from_bytes(original_x: bytes):
    """The float64 session of a model given as bytes (:func:`_in_float64`), through a file with
    its weights as external data (the session maps them, not copies)."""
    proto = _in_float64(original_x)
    if proto is None:
        return None
    with tempfile.TemporaryDirectory(prefix="opfuse-float64-") as tmp:
        source = os.path.join(tmp, "float64.onnx")
        try:
            onnx.save_model(proto, source, save_as_external_data=True, location="float64.onnx.data")
        except (OSError, ValueError):
            return None
        del proto
        return create_session(source, "disabled", prepack=False)


WIDENED = "__opfuse_float32"  # suffix of a float32 weight's own name in the float64 model; a Cast gives the old name
# ops that only move or select a weight's elements (input 0): run on the float32 weight, with the Cast after them
MOVES = frozenset({"Gather", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Slice", "Identity"})


def _float64_session(original: ir.Model, measured: set[str] | None = None):
    """The session of the original in float64 without a float64 copy of its weights: the large float32
    initializers stay float32 and are given to the runtime where they are
    (:func:`opfuse.runtime.shared_weights`), each followed by a Cast to float64 under its own name,
    which the run computes when it reads it (exact: every float32 is a float64); the rest is widened
    as :func:`_in_float64` does. A weight read by an op that only moves or selects its elements
    (:data:`MOVES`: an embedding's Gather, a tied head's Transpose) is read by it in float32 and the
    Cast follows that op instead (the same numbers: such an op and the Cast commute), so a lookup
    widens the rows it takes, not the table. The same numbers as the model :func:`_in_float64`
    writes, with one weight in float64 at a time instead of all. ``measured``: the outputs the run is
    asked for; the others (the original's extra outputs: probes, a floor's sources) leave the graph's
    outputs, so none is kept whole for its own sake (a tied head's transposed table among them would
    be widened whole, its product not split). None when the original cannot be so converted."""
    shared = shared_weights(original)
    if shared is None:
        return None
    proto, weights = shared
    kept = [o for o in proto.graph.output if measured is None or o.name in measured]
    if kept:
        del proto.graph.output[:]
        proto.graph.output.extend(kept)
    taken = {t.name for t in proto.graph.initializer} | {o for n in proto.graph.node for o in n.output}
    taken |= {v.name for v in [*proto.graph.input, *proto.graph.output]}

    def fresh(name: str) -> str:
        name += WIDENED
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    float32 = {}  # a weight's name -> its float32 tensor's new name
    for t in proto.graph.initializer:
        if t.name in weights and t.data_type == onnx.TensorProto.FLOAT:
            float32[t.name] = fresh(t.name)
            weights[float32[t.name]] = weights.pop(t.name)
            t.name = float32[t.name]
    if not _widen(proto, keep=set(float32.values())):
        return None
    outputs = {v.name for v in proto.graph.output}
    nodes, widened_whole = [], set(float32) & outputs
    heads, through = _split_products(proto, weights, float32, outputs)
    for index, node in enumerate(proto.graph.node):
        if index in heads:
            nodes += _in_column_blocks(proto, node, *heads[index], fresh)
            continue
        if node.output and node.output[0] in through:
            continue  # (a Transpose the split product reads through, block by block)
        moved = (node.domain in ONNX_DOMAINS and node.op_type in MOVES and len(node.output) == 1
                 and node.input and node.input[0] in float32 and node.output[0] not in float32)
        if moved:
            node.input[0] = float32[node.input[0]]
            out = node.output[0]
            node.output[0] = fresh(out)
            nodes += [node, helper.make_node("Cast", [node.output[0]], [out], to=onnx.TensorProto.DOUBLE,
                                             name=node.output[0] + "_cast")]
            widened_whole.update(n for n in node.input[1:] if n in float32)
            continue
        widened_whole.update(n for n in node.input if n in float32)
        nodes.append(node)
    casts = [helper.make_node("Cast", [float32[n]], [n], to=onnx.TensorProto.DOUBLE, name=float32[n] + "_cast")
             for n in float32 if n in widened_whole or _read_in_subgraph(proto.graph.node, n)]
    del proto.graph.node[:]
    proto.graph.node.extend([*casts, *nodes])
    return session_with_weights(proto, weights, "disabled", prepack=False, cpu_arena=False)


SPLIT_BYTES = 1 << 26  # a product's weight larger than this in float64 is widened a block of columns at a time


def _split_products(proto, weights, float32, outputs):
    """({the MatMul's index: (its weight's name, its float32 tensor's, whether it reads the weight transposed,
    the shape of its right operand [K, N])}, the Transposes' outputs those read through) for each
    main-graph MatMul whose right operand is a 2-D weight (or its Transpose, read by nothing else) above
    :data:`SPLIT_BYTES` in float64: widened whole, that operand would be a float64 copy of a tied
    head's table. None in a model below opset 13."""
    found, through = {}, set()
    if next((o.version for o in proto.opset_import if o.domain in ONNX_DOMAINS), 0) < 13:
        return found, through
    readers: dict[str, int] = {}
    for node in proto.graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    producers = {o: node for node in proto.graph.node for o in node.output}
    for index, node in enumerate(proto.graph.node):
        if node.domain not in ONNX_DOMAINS or node.op_type != "MatMul" or len(node.input) != 2:
            continue
        right, transposed = node.input[1], False
        source = producers.get(right)
        if (source is not None and source.domain in ONNX_DOMAINS and source.op_type == "Transpose"
                and source.input and source.input[0] in float32 and readers.get(right) == 1 and right not in outputs
                and all(list(a.ints) == [1, 0] for a in source.attribute if a.name == "perm")
                and not _read_in_subgraph(proto.graph.node, right)):
            right, transposed = source.input[0], True
        elif right not in float32:
            continue
        array = weights.get(float32[right])
        if array is None or array.ndim != 2 or array.size * 8 <= SPLIT_BYTES:
            continue
        shape = array.shape[::-1] if transposed else array.shape
        found[index] = (right, float32[right], transposed, shape)
        if transposed:
            through.add(node.input[1])
    return found, through


def _in_column_blocks(proto, node, weight: str, source: str, transposed: bool, shape, fresh) -> list:
    """``node`` (MatMul of x and a large float32 weight, or its Transpose, widened) as MatMuls of x
    and blocks of the weight's columns, each sliced in float32 (rows of the weight when transposed,
    then transposed) and widened, their results concatenated on the last axis: the same products (each
    output is one column's), with one block of the weight in float64 at a time."""
    k, n = shape
    blocks = -(-n * k * 8 // SPLIT_BYTES)
    step = -(-n // blocks)
    axis = 0 if transposed else 1
    out, parts = [], []
    for start in range(0, n, step):
        stop = min(n, start + step)
        bounds = fresh(f"{weight}_block{start}")
        proto.graph.initializer.extend([
            onnx.numpy_helper.from_array(np.array([start], np.int64), bounds + "_starts"),
            onnx.numpy_helper.from_array(np.array([stop], np.int64), bounds + "_ends"),
            onnx.numpy_helper.from_array(np.array([axis], np.int64), bounds + "_axes")])
        block = bounds + "_f32"
        out.append(helper.make_node("Slice", [source, bounds + "_starts", bounds + "_ends", bounds + "_axes"], [block],
                                    name=block))
        if transposed:
            out.append(helper.make_node("Transpose", [block], [block + "_t"], perm=[1, 0], name=block + "_t"))
            block += "_t"
        out.append(helper.make_node("Cast", [block], [bounds + "_f64"], to=onnx.TensorProto.DOUBLE, name=bounds + "_f64"))
        out.append(helper.make_node("MatMul", [node.input[0], bounds + "_f64"], [bounds + "_y"], name=bounds + "_y"))
        parts.append(bounds + "_y")
    out.append(helper.make_node("Concat", parts, [node.output[0]], axis=-1, name=node.output[0] + "_blocks"))
    return out


def _read_in_subgraph(nodes, name: str) -> bool:
    """Whether a subgraph of ``nodes`` reads ``name`` (an outer-scope value)."""
    for node in nodes:
        for a in node.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                if any(name in n.input for n in g.node) or any(name == o.name for o in g.output) \
                        or _read_in_subgraph(g.node, name):
                    return True
    return False


def _measured(session, sets, tensors, masks, level: str) -> dict[tuple[str, str], float] | None:
    """Each tensor's distance from ``session``'s run to the float32 original's (``sets``' expected)."""
    names = [o.name for o in session.get_outputs()]
    wanted = [t for t in tensors if t in names]
    out = {}
    for label, feeds, expected in sets:
        if level == "float64":
            feeds = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
        try:
            got = dict(zip(wanted, session.run(wanted, dict(feeds))))
        except Exception:  # noqa: BLE001
            return None if level == "float64" else out
        for tensor in wanted:
            ref = np.asarray(expected.get(tensor))
            value = np.asarray(got[tensor])
            if ref.shape == value.shape and ref.dtype.kind == "f" and ref.size:
                where = defined_positions(ref.shape, masks[label]) if label in masks else None
                if where is not None:
                    ref, value = ref[where], value[where]
                    if not ref.size:
                        continue
                diff = np.abs(ref.astype(np.float64) - value.astype(np.float64))
                out[(label, tensor)] = float(np.nanmax(np.where(np.isfinite(diff), diff, 0.0)))
    return out


def _in_float64(original_x) -> onnx.ModelProto | None:
    """The original, given as bytes, with every float32 tensor in float64 (initializers, constants,
    Casts, declared types, subgraphs): a reference without float32's rounding. None when it cannot
    be converted."""
    if not isinstance(original_x, (bytes, bytearray)):
        return None
    proto = onnx.ModelProto()
    proto.ParseFromString(bytes(original_x))
    return proto if _widen(proto) else None


def _widen(proto: onnx.ModelProto, keep: frozenset[str] | set[str] = frozenset()) -> bool:
    """Every float32 tensor of ``proto`` in float64, in place (the main graph's initializers named
    in ``keep`` excepted); whether that could be done."""
    float32, float64 = onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE

    def tensor(t):
        if t.data_type == float32:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))

    def nodes(ns):
        for node in ns:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.INT and a.name in ("to", "dtype") and a.i == float32:
                    a.i = float64
                elif a.type == onnx.AttributeProto.TENSOR:
                    tensor(a.t)
                elif a.type == onnx.AttributeProto.GRAPH:
                    graph(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sub in a.graphs:
                        graph(sub)

    def graph(g, keep=frozenset()):
        for t in g.initializer:
            if t.name not in keep:
                tensor(t)
        for v in [*g.input, *g.output, *g.value_info]:
            if v.type.tensor_type.elem_type == float32:
                v.type.tensor_type.elem_type = float64
        nodes(g.node)

    try:
        graph(proto.graph, keep)
        for function in proto.functions:
            nodes(function.node)
        return True
    except Exception:  # noqa: BLE001 - external data, a tensor numpy cannot read: no float64 reference
        return False
