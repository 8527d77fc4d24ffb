"""``slices-to-split``: Slices that tile an axis of one tensor -> one Split.

An LSTM stack exported layer by layer reads its initial states as ``h0[l:l+1]`` and
``c0[l:l+1]``, one Slice per layer; ONNX Runtime's EXTENDED level writes one Split per tensor
(``GatherSliceToSplitFusion``). The rule:

    Slice(x, s_i, e_i, [a]) for i = 1..n (n >= 2)   ->   Split(x, [e_1 - s_1, ..., e_n - s_n], axis=a)

Algebra: with the bounds as Slice reads them (negative counted from the end, then clamped to
[0, d]), sorted by start, and tiling ``[0, d)`` exactly (each interval non-empty, each starting
where the last ended, the last ending at d), Split's output i is elements s_i .. e_i - 1 along
axis a, which is Slice i's. Exact: both copy.

Legality (otherwise the Slices stay; nothing to refuse: most Slices are no tiling):

- every Slice reading x as its data is in the group (a Split's outputs cover the axis once),
  one constant axis for all, step 1 (absent or constant 1), constant starts and ends of one
  element each (opset 10+ Slice: inputs, not attributes);
- x's dim on that axis is static (declared, or from onnx's shape inference);
- no Slice output is a graph output; the main graph only;
- Split takes its sizes as an input from opset 13, as an attribute before.

It runs with the fusion into the target's kernels, after the patterns (``after_rewrites``): a
computed tensor's Slices may be a pattern's own spelling (rotate-half's halves of q and k, a
partial rotary's rotated and passed-through parts: :mod:`opfuse.passes.patterns.rotary`), which the
patterns must still find as Slices. Each Split output keeps the name of the Slice output it
replaces, so verification checks every one at its own tensor.
"""

from __future__ import annotations

__all__ = ["SlicesToSplitPass"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import Constant, NameTable, find_constant, infer_shapes, node_label, opset_of
from opfuse.core.edit import drop_unread_nodes
from opfuse.core.ops import is_op
from opfuse.passes.base import OpfusePass
from opfuse.passes.patterns import constant_int
from opfuse.report import FusionRecord

PATTERN = "Slices->Split"


class SlicesToSplitPass(OpfusePass):
    """Slices that tile an axis -> one Split (module docstring)."""

    name = "slices-to-split"
    after_rewrites = True  # (a pattern's Slices are the pattern's: they go first)
    options = frozenset({"target", "exclude", "veto"})  # (what the fusion stage hands every pass; none used)
    requires_ops = frozenset({"Slice"})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        groups = [x for x in _sliced(graph) if _could_tile(x)]
        if not groups:
            return ir.passes.PassResult(model, modified=False)
        infer_shapes(model)  # (only where a group is there: it reads the whole model)
        names, opset, modified = NameTable(model), opset_of(model.opset_imports), False
        order = {n: i for i, n in enumerate(graph)}
        for x in groups:
            modified |= self._split(graph, x, names, opset, order)
        return ir.passes.PassResult(model, modified=modified)

    def _split(self, graph: ir.Graph, x: ir.Value, names: NameTable, opset: int, order: dict) -> bool:
        slices = _readers(x)
        if len(slices) < 2 or x.shape is None:
            return False
        rank = len(x.shape)
        parts, axis = [], None
        for s in slices:
            found = _one_axis_interval(s, rank)
            if found is None or any(v.is_graph_output() for v in s.outputs):
                return False
            a, start, end = found
            if axis is not None and a != axis:
                return False
            axis = a
            parts.append((start, end, s))
        dim = x.shape[axis]
        if not isinstance(dim, int):
            return False
        parts = sorted(((_clamp(start, dim), _clamp(end, dim), s) for start, end, s in parts), key=lambda p: p[0])
        edges = [0] + [end for _, end, _ in parts]
        if any(start != edge or end <= start for (start, end, _), edge in zip(parts, edges)) or edges[-1] != dim:
            return False
        first = min(slices, key=lambda n: order.get(n, 0))
        sizes = np.array([end - start for start, end, _ in parts], np.int64)
        base = f"{x.name}_split"
        if opset >= 13:
            name = names.fresh(f"{base}_sizes")
            const = ir.Value(name=name, shape=ir.Shape([len(parts)]), type=ir.TensorType(ir.DataType.INT64),
                             const_value=ir.tensor(sizes, name=name))
            graph.register_initializer(const)
            inputs, attributes = [x, const], [ir.AttrInt64("axis", axis)]
        else:
            inputs, attributes = [x], [ir.AttrInt64("axis", axis), ir.AttrInt64s("split", sizes.tolist())]
        split = ir.Node("", "Split", inputs, attributes=attributes, num_outputs=len(parts), name=names.fresh(base))
        graph.insert_before(first, split)
        kept = []
        for out, (_, _, s) in zip(split.outputs, parts):
            old = s.outputs[0]
            out.dtype, out.shape = old.dtype, old.shape
            kept.append(old.name)
            old.replace_all_uses_with(out)
        for _, _, s in parts:
            graph.remove(s, safe=True)
        removed = [s for _, _, s in parts]
        removed += drop_unread_nodes([v.producer() for s in removed for v in s.inputs[1:] if v is not None])
        for out, name in zip(split.outputs, kept):
            out.name = name  # each output keeps the name of the Slice output it replaces
        detail = f"{len(parts)} Slices of '{x.name}' tile its axis {axis} (size {dim}) as {sizes.tolist()}"
        for i, out in enumerate(split.outputs):
            self.report.records.append(FusionRecord(
                pattern=PATTERN, node=node_label(first), removed=tuple(node_label(n) for n in removed) if i == 0 else (),
                produced=node_label(split), graph="main", detail=detail, output=out.name))
        return True


def _readers(x: ir.Value) -> list[ir.Node]:
    return [use.node for use in x.uses() if use.idx == 0 and is_op(use.node, "Slice")]


def _sliced(graph: ir.Graph) -> list[ir.Value]:
    """The tensors at least two Slices of this graph read as their data, once each, in order."""
    found: dict[ir.Value, int] = {}
    for node in graph:
        if is_op(node, "Slice") and node.inputs and node.inputs[0] is not None:
            found[node.inputs[0]] = found.get(node.inputs[0], 0) + 1
    return [x for x, count in found.items() if count >= 2]


def _could_tile(x: ir.Value) -> bool:
    """A cheap look before shape inference: every Slice of ``x`` has constant bounds."""
    return all(len(s.inputs) >= 3 and all(isinstance(find_constant(v), Constant) for v in s.inputs[1:] if v is not None)
               for s in _readers(x))


def _one_axis_interval(node: ir.Node, rank: int) -> tuple[int, int, int] | None:
    """(axis, start, end) of a Slice of one constant axis and step 1 (opset 10+: its inputs), else None."""
    inputs = list(node.inputs) + [None] * 5
    if len(node.inputs) < 3 or node.attributes.get("starts") is not None:
        return None
    start, end = constant_int(inputs[1]), constant_int(inputs[2])
    axis = 0 if inputs[3] is None else constant_int(inputs[3])
    step = 1 if inputs[4] is None else constant_int(inputs[4])
    if None in (start, end, axis) or step != 1 or not -rank <= axis < rank:
        return None
    return axis % rank, start, end


def _clamp(index: int, dim: int) -> int:
    """A Slice bound as Slice reads it: negative counted from the end, then clamped to [0, dim]."""
    return min(max(index + dim if index < 0 else index, 0), dim)
