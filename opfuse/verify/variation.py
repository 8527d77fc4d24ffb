"""The original's own float32 variation: how far its outputs are from the same model in float64.

A rewrite of a deep float32 model moves its outputs by reordering sums, and so does the model's
own float32 arithmetic: verification (:mod:`opfuse.verify`) lets a check differ from the original
by :data:`opfuse.verify.VARIATION_FACTOR` times ``d0``, the distance from the original's float32
run to the same model run in float64 (:func:`_in_float64`), or, where ONNX Runtime cannot build or
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
from onnx import numpy_helper

from opfuse.runtime import create_session, serialized
from opfuse.save import PROTOBUF_LIMIT
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
    with tempfile.TemporaryDirectory(prefix="opfuse-float64-") as tmp:
        if level == "float64":  # on disk with its weights as external data: the session maps them, not copies
            proto = _in_float64(original_x)
            if proto is None:
                return None
            source = os.path.join(tmp, "float64.onnx")
            try:
                onnx.save_model(proto, source, save_as_external_data=True, location="float64.onnx.data")
            except (OSError, ValueError):
                return None
            del proto
        else:
            source = original_x
        try:
            session = create_session(source, "disabled" if level == "float64" else level, prepack=False)
        except Exception:  # noqa: BLE001 - onnxruntime raises its own exception types
            return None
        return _measured(session, sets, tensors, masks, level)


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
    """The original with every float32 tensor in float64 (initializers, constants, Casts, declared
    types, subgraphs): a reference without float32's rounding. ``original_x`` is bytes,
    or an ir.Model kept with external data (its weights are read in). None when the float64
    model would exceed protobuf's 2 GB, or cannot be converted."""
    if isinstance(original_x, ir.Model):
        weights = {name: v.const_value for name, v in original_x.graph.initializers.items() if v.const_value is not None}
        if 2 * sum(t.nbytes for t in weights.values()) >= PROTOBUF_LIMIT:
            return None
        try:
            proto = ir.serde.serialize_model(original_x)
            for t in proto.graph.initializer:
                if t.data_location == onnx.TensorProto.EXTERNAL and t.name in weights:
                    t.CopyFrom(numpy_helper.from_array(weights[t.name].numpy(), t.name))
        except Exception:  # noqa: BLE001 - a tensor numpy cannot read: no float64 reference
            return None
    elif isinstance(original_x, (bytes, bytearray)):
        proto = onnx.ModelProto()
        proto.ParseFromString(bytes(original_x))
    else:
        return None
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

    def graph(g):
        for t in g.initializer:
            tensor(t)
        for v in [*g.input, *g.output, *g.value_info]:
            if v.type.tensor_type.elem_type == float32:
                v.type.tensor_type.elem_type = float64
        nodes(g.node)

    try:
        graph(proto.graph)
        for function in proto.functions:
            nodes(function.node)
        return proto
    except Exception:  # noqa: BLE001 - external data, a tensor numpy cannot read: no float64 reference
        return None
