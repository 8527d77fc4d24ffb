"""Reshape targets computed from shapes -> constant targets, where the dims are provably the input's.

Exporters with symbolic batch and sequence (torch's TorchScript exporter, tf2onnx) write a
Reshape's target as shape arithmetic::

    Reshape(x, Concat(Unsqueeze(Gather(Shape(t), 0)), Unsqueeze(Gather(Shape(t), 1)), [4], [16]))

Reshape's rule for a 0 in its target (``allowzero`` 0, the default) is "copy this axis of
the input". So an element that is provably equal to the input's own dim at that position
can be written 0, and a static one as its value; when every element of the target is then a
constant, the target is one constant and the Shape / Gather / Unsqueeze / Concat chain dies:
it is removed at once (a pattern rule after this pass must see the reshaped tensor used by
its Reshape alone, not by a dead Shape). The result is the same Reshape, and the attention and shape rules
that need a constant target can match.

Legality, each failure leaves the Reshape as it is:

1. The target is a Concat (axis 0) of pieces that are int64 constants or dims read off a
   tensor's shape: ``Gather(Shape(t), i)`` (possibly ``Unsqueeze``d, ``Shape`` with
   start / end honoured).
2. A dim read at position k becomes 0 only when the symbolic shape inference
   (:mod:`opfuse.core.symbolic_shapes`, ONNX Runtime's) names it as the same dim as the input's
   axis k (the same symbol, or the same integer); a static dim becomes its integer.
   Anything else (an unnamed dim, a dim at another position) leaves the node.
3. ``allowzero`` is 0, and the new target has at most one -1 (Reshape's own rules).

Each rewrite is a record whose tensor (the Reshape's output) verification compares.
"""

from __future__ import annotations

__all__ = ["ReshapeDimsPass"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import Constant, NameTable, find_constant, infer_shapes, node_label
from opfuse.core.dims import same_dim
from opfuse.core.edit import drop_unread_nodes
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord
from opfuse.core.symbolic_shapes import infer_symbolic_shapes
from opfuse.core.ops import int_attr, is_op


class ReshapeDimsPass(OpfusePass):
    """Computed Reshape targets -> constants where the dims are the input's (module docstring)."""

    name = "reshape-dims"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        reshapes = [n for n in model.graph if is_op(n, "Reshape") and len(n.inputs) > 1
                    and n.inputs[1] is not None and is_op(n.inputs[1].producer(), "Concat")]
        if not reshapes:
            return ir.passes.PassResult(model, modified=False)
        infer_shapes(model)
        infer_symbolic_shapes(model)
        names = NameTable(model)
        modified = False
        for node in reshapes:
            target = _constant_target(node)
            if target is None:
                continue
            value = ir.Value(name=names.fresh(f"{node.name or 'reshape'}.shape"), shape=ir.Shape([len(target)]),
                             type=ir.TensorType(ir.DataType.INT64), const_value=ir.tensor(np.array(target, np.int64)))
            model.graph.register_initializer(value)
            removed = node.inputs[1].producer()
            node.replace_input_with(1, value)
            drop_unread_nodes([removed], _SHAPE_ARITHMETIC)
            self.report.records.append(FusionRecord(
                pattern="computed Reshape target->constant", node=node_label(node),
                removed=(node_label(removed),), produced=f"Reshape target {target}", graph="main",
                detail="0 copies the input's own dim (the same symbol by shape inference)",
                output=node.outputs[0].name or ""))
            modified = True
        return ir.passes.PassResult(model, modified=modified)


_SHAPE_ARITHMETIC = frozenset({"Concat", "Unsqueeze", "Gather", "Shape", "Constant", "Cast", "Squeeze", "Slice"})


def _constant_target(node: ir.Node) -> list[int] | None:
    if int_attr(node, "allowzero", 0) != 0:
        return None
    x = node.inputs[0]
    concat = node.inputs[1].producer()
    if int_attr(concat, "axis", 0) != 0 or x is None or x.shape is None:
        return None
    elements: list = []
    for piece in concat.inputs:
        found = _piece(piece)
        if found is None:
            return None
        elements += found
    out: list[int] = []
    for k, element in enumerate(elements):
        if isinstance(element, int):
            out.append(element)
            continue
        dim = element  # a dim of some tensor: an int or a symbolic dim
        mine = x.shape[k] if k < len(x.shape) else None
        if isinstance(dim, int):
            out.append(dim)
        elif same_dim(dim, mine):
            out.append(0)
        else:
            return None
    if out.count(-1) > 1:
        return None
    return out


def _piece(value: ir.Value | None) -> list | None:
    """The elements of a 1-D int64 piece of the target: ints, or tensor dims (an int or a
    SymbolicDim read off a shape); None when it is neither."""
    if value is None:
        return None
    found = find_constant(value)
    if isinstance(found, Constant):
        array = found.array
        return [int(v) for v in array.reshape(-1)] if array.dtype == np.int64 and array.ndim <= 1 else None
    producer = value.producer()
    if is_op(producer, "Unsqueeze"):
        inner = _piece(producer.inputs[0])
        return inner if inner is not None and len(inner) == 1 else None
    if is_op(producer, "Gather") and int_attr(producer, "axis", 0) == 0:
        source = producer.inputs[0].producer() if producer.inputs[0] is not None else None
        indices = find_constant(producer.inputs[1]) if len(producer.inputs) > 1 else None
        if is_op(source, "Shape") and isinstance(indices, Constant):
            dims = _shape_dims(source)
            if dims is None:
                return None
            try:
                return [dims[int(i)] for i in indices.array.reshape(-1)]
            except IndexError:
                return None
    if is_op(producer, "Shape"):
        return _shape_dims(producer)
    return None


def _shape_dims(shape_node: ir.Node) -> list | None:
    t = shape_node.inputs[0]
    if t is None or t.shape is None:
        return None
    dims = list(t.shape)
    start = int_attr(shape_node, "start", 0)
    end = shape_node.attributes.get("end")
    return dims[start:int(end.value)] if end is not None else dims[start:]
