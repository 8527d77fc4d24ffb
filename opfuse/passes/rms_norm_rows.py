"""``rms-norm-rows``: an RMSNormalization over the last axis of a tensor with several leading axes, on rows (``--target qnn``).

Qwen3 and Gemma3 normalise each attention head's queries and keys (``q_norm``, ``k_norm``): an
``RMSNormalization`` (opset 23) over the head dim of a [B, S, H, D] or [B, H, S, D] tensor. ONNX Runtime's
QNN provider writes it as QNN's ``RmsNorm`` with the same rank-4 shape (``QNN_op_type: RmsNorm`` on
``rank=4 dimensions=(1 64 8 32)`` in its log), and the HTP computes wrong values for many such shapes
(zeros among them) with nothing in the log; a prefill's per-head norms are among them, a decode step's
(one position: [1, 1, H, D]) are not. The same norm on the same rows as a [1, N, D] tensor, the shape of
every hidden-state norm of a decoder, it computes right. So this pass writes::

    RMSNormalization(x, scale, axis=-1)  ->  Reshape(RMSNormalization(Reshape(x, [1, N, D]), scale, axis=-1), shape(x))

with ``N`` the product of ``x``'s dims but the last. Why exact: RMSNormalization over the last axis maps each
row ``x[i, ..., :]`` of D elements to ``x / sqrt(mean(x^2) + epsilon) * scale`` on its own, and the
``scale`` (of rank at most 1: it broadcasts to the normalised shape [D]) is the same for every row; a
Reshape keeps the elements in order, so the [1, N, D] tensor holds the same rows, and the second Reshape
puts each result back where it was.

Legality: an ``RMSNormalization`` of the main graph whose ``axis`` names the last axis of an input with a
static shape of rank 3 or more whose dims before the last two are not all 1 (the forms of a per-head norm:
a hidden-state norm, [1, S, D], is left as it is), and whose ``scale`` has rank at most 1. Its output keeps
its name (now the second Reshape's), which verification compares.
"""

from __future__ import annotations

__all__ = ["RmsNormRowsPass"]

import math

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import NameTable, Scope, infer_shapes, node_label
from opfuse.core.edit import add_constant
from opfuse.core.ops import int_attr, is_op
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord

PATTERN = "RMSNormalization->rows"


class RmsNormRowsPass(OpfusePass):
    """RMSNormalization on [.., S, H, D] -> on [1, N, D] between two Reshapes (module docstring)."""

    name = "rms-norm-rows"
    requires_ops = frozenset({"RMSNormalization"})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        candidates = [n for n in model.graph if is_op(n, "RMSNormalization") and n.inputs and n.inputs[0] is not None]
        if not candidates:
            return ir.passes.PassResult(model, modified=False)
        self._names = NameTable(model)
        if any(n.inputs[0].shape is None for n in candidates):
            infer_shapes(model)  # (the input's static shape decides; only when a norm is there)
        modified = False
        for node in candidates:
            modified |= self._rewrite(node)
        return ir.passes.PassResult(model, modified=modified)

    def _rewrite(self, node: ir.Node) -> bool:
        x = node.inputs[0]
        scale = node.inputs[1] if len(node.inputs) > 1 else None
        shape = list(x.shape) if x.shape is not None else None
        if shape is None or len(shape) < 3 or not all(isinstance(d, int) for d in shape):
            return False  # (rank 2 or less is rows already; a symbolic dim is the static-shape step's to report)
        if math.prod(shape[:-2]) == 1:
            return False  # (a hidden-state norm's [1, S, D], or one position's [1, 1, H, D]: the HTP's right form)
        axis = int_attr(node, "axis", -1)
        if axis not in (-1, len(shape) - 1):
            self.refuse(PATTERN, node, f"it normalises from axis {axis} of a rank-{len(shape)} input, not the last "
                        "axis alone")
            return False
        if scale is None or scale.shape is None or len(scale.shape) > 1:
            self.refuse(PATTERN, node, "its scale's rank is unknown or above 1")
            return False
        graph, out = node.graph, node.outputs[0]
        rows = [1, math.prod(shape[:-1]), shape[-1]]
        base = node.name or "RMSNormalization"
        flat = self._reshape(graph, x, rows, f"{base}_rows", x.type)
        norm = ir.Node("", "RMSNormalization", [flat.outputs[0], scale],
                       attributes=[ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
                       name=self._names.fresh(f"{base}_on_rows"),
                       outputs=[ir.Value(name=self._names.fresh(f"{out.name or 'normed'}_rows"), type=out.type,
                                         shape=ir.Shape(rows))])
        back = self._reshape(graph, norm.outputs[0], shape, f"{base}_back", out.type)
        graph.insert_before(node, [flat, norm, back])
        name = out.name
        out.replace_all_uses_with(back.outputs[0], replace_graph_outputs=True)
        graph.remove(node, safe=True)
        back.outputs[0].name = name
        self.report.records.append(FusionRecord(
            pattern=PATTERN, node=node_label(node), removed=(node_label(node),), produced=node_label(norm),
            graph="main", output=name,
            detail=(f"{shape} normalised as {rows} rows between two Reshapes: the same rows; QNN's HTP computes its "
                    "RmsNorm of a per-head shape wrongly (opfuse.passes.rms_norm_rows)")))
        return True

    def _reshape(self, graph: ir.Graph, x: ir.Value, shape: list[int], base: str, type_) -> ir.Node:
        name = self._names.fresh(base)
        target = add_constant(Scope(graph, "main"), self._names, None, np.array(shape, np.int64), f"{name}.shape")
        return ir.Node("", "Reshape", [x, target], name=name,
                       outputs=[ir.Value(name=self._names.fresh(f"{x.name or 'x'}_{'x'.join(map(str, shape))}"),
                                         type=type_, shape=ir.Shape(shape))])
