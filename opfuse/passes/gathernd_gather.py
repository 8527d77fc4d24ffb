"""``gathernd-gather``: a GatherND that reads whole slices along the first axis, as a Gather (``--target qnn``).

A mixture-of-experts layer exported by torch's dynamo exporter picks each token's experts' weights with
advanced indexing, ``w[idx]`` on a constant ``w`` of shape [E, ...] with the router's TopK indices, which
the export writes as ``GatherND(w, Unsqueeze(idx, -1))``. QNN's HTP compiler accepts that node (its
validation passes: it becomes QNN's ``GatherNd`` on a ``QNN_TENSOR_TYPE_STATIC`` input) and then dies of
a signal in ``FinalizeGraphs`` (SIGSEGV, or glibc's abort on a corrupted heap) once the static input is a
few hundred KiB; the same selection as ``Gather`` compiles and runs. This pass writes that Gather.

The algebra. ``GatherND`` with ``batch_dims`` 0 and ``indices`` of shape ``[i_0, ..., i_{q-2}, 1]``
reads, for every index tuple ``t`` of the leading axes, the slice ``data[indices[t, 0]]`` (the last axis
of ``indices`` names one coordinate, so each slice is a whole ``data[k, ...]``)::

    y[t, ...] = data[indices[t, 0], ...],   shape  indices.shape[:-1] + data.shape[1:]

and ``Gather(data, v, axis=0)`` with ``v = indices[..., 0]`` is by definition
``y[t, ...] = data[v[t], ...]`` with shape ``v.shape + data.shape[1:]``: the same tensor, element for
element (no arithmetic, so exact in every dtype). Both ops take an index in ``[-s, s-1]``, a negative one
counted from the end, and both reject one outside it. ``v`` is the ``Unsqueeze``'s input when ``indices``
is ``Unsqueeze(v, -1)`` (the export's form: the Unsqueeze, if nothing else reads it, goes), else
``Squeeze(indices, [-1])``.

Legality: a ``GatherND`` of the main graph with ``batch_dims`` 0 whose ``indices`` have a known rank of at
least 1 and a last dim of 1 (after onnx's shape inference). The Gather's output takes the GatherND's
name (a graph output stays one), which verification compares.
"""

from __future__ import annotations

__all__ = ["GatherNdGatherPass"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import NameTable, Scope, infer_shapes, node_label, opset_of
from opfuse.core.edit import add_constant, drop_unread_nodes
from opfuse.core.ops import int_attr, is_op
from opfuse.passes.base import OpfusePass
from opfuse.passes.patterns import reduce_axes
from opfuse.report import FusionRecord

PATTERN = "GatherND(one coordinate)->Gather"


class GatherNdGatherPass(OpfusePass):
    """GatherND(data, indices[..., 1]) -> Gather(data, indices[..., 0], axis=0) (module docstring)."""

    name = "gathernd-gather"
    requires_ops = frozenset({"GatherND"})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        candidates = [n for n in model.graph if is_op(n, "GatherND") and int_attr(n, "batch_dims", 0) == 0
                      and len(n.inputs) == 2 and None not in n.inputs]
        if not candidates:
            return ir.passes.PassResult(model, modified=False)
        infer_shapes(model)  # (the indices' last dim decides; only when a GatherND is there)
        self._names = NameTable(model)
        self._opset = opset_of(model.opset_imports)
        modified = False
        for node in candidates:
            modified |= self._rewrite(node)
        return ir.passes.PassResult(model, modified=modified)

    def _rewrite(self, node: ir.Node) -> bool:
        data, indices = node.inputs
        out = node.outputs[0]
        shape = indices.shape
        if shape is None or len(shape) < 1 or shape[-1] != 1 or not isinstance(shape[-1], int):
            self.refuse(PATTERN, node, f"the indices '{indices.name}' do not end in a dim of 1 "
                        f"(shape {shape}): each index names more than the first axis")
            return False
        graph = node.graph
        made: list[ir.Node] = []
        vector = _unsqueezed_at_end(indices, len(shape))
        if vector is None:
            squeeze = self._squeeze(graph, indices, f"{node.name or 'GatherND'}_squeeze")
            made.append(squeeze)
            vector = squeeze.outputs[0]
        gather = ir.Node("", "Gather", [data, vector], attributes=[ir.AttrInt64("axis", 0)],
                         name=self._names.fresh(f"{node.name or 'GatherND'}_gather"),
                         outputs=[ir.Value(name=self._names.fresh(f"{out.name or 'gathered'}_gather"),
                                           type=out.type, shape=out.shape)])
        made.append(gather)
        graph.insert_before(node, made)
        name = out.name
        out.replace_all_uses_with(gather.outputs[0], replace_graph_outputs=True)
        graph.remove(node, safe=True)
        gather.outputs[0].name = name
        removed = [node, *drop_unread_nodes([indices.producer()], frozenset({"Unsqueeze"}))]
        self.report.records.append(FusionRecord(
            pattern=PATTERN, node=node_label(node), removed=tuple(node_label(n) for n in removed),
            produced=node_label(gather), graph="main", output=name,
            detail=(f"indices '{indices.name}' [..., 1]: whole slices of axis 0, read by a Gather"
                    + (" of the Unsqueeze's input" if not made[:-1] else " of the indices squeezed")
                    + "; QNN's HTP compiler crashes on a GatherNd of a constant (opfuse.passes.gathernd_gather)")))
        return True

    def _squeeze(self, graph: ir.Graph, x: ir.Value, base: str) -> ir.Node:
        name = self._names.fresh(base)
        output = ir.Value(name=self._names.fresh(f"{x.name or 'indices'}_squeezed"), type=x.type,
                          shape=ir.Shape(list(x.shape)[:-1]) if x.shape is not None else None)
        if self._opset >= 13:
            axes = add_constant(Scope(graph, "main"), self._names, None, np.array([-1], np.int64), f"{name}.axes")
            return ir.Node("", "Squeeze", [x, axes], name=name, outputs=[output])
        return ir.Node("", "Squeeze", [x], attributes=[ir.AttrInt64s("axes", [-1])], name=name, outputs=[output])


def _unsqueezed_at_end(indices: ir.Value, rank: int) -> ir.Value | None:
    """``v`` when ``indices`` is ``Unsqueeze(v, [-1])`` (or the axis ``rank - 1``), else None."""
    producer = indices.producer()
    if not is_op(producer, "Unsqueeze") or not producer.inputs or producer.inputs[0] is None:
        return None
    axes = reduce_axes(producer)  # (an Unsqueeze's axes are spelled as a reduction's: attribute, then input)
    if axes is None or len(axes) != 1 or axes[0] not in (-1, rank - 1):
        return None
    return producer.inputs[0]
