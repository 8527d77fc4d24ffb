"""``attention-presents``: an Attention's KV cache outputs read by the graph's outputs themselves (``--target qnn``).

ONNX Runtime's QNN provider writes ``Attention`` (opset 23) as QNN ops and declares its ``present_key`` and
``present_value`` outputs as QNN graph outputs (``QNN_TENSOR_TYPE_APP_READ``) whatever reads them. ONNX
Runtime binds a buffer only to the ONNX graph's own outputs, so a present that reaches the graph's outputs
through another node is a QNN graph output with no buffer: the model compiles, and every run fails with
``QNN_GRAPH_ERROR_INVALID_TENSOR`` ("Invalid or NULL QNN tensor"). Transformers' sliding-window cache
(Mistral, Gemma3) writes exactly that: ``present = Slice(Concat(past, new), -window + 1, end, axis=2)``,
the Concat now the Attention's present output; with the window longer than the bound context the Slice
keeps the whole axis. (The same binding, for a QDQ model's Q/DQ pair after a present, is what
:func:`opfuse.targets.qnn.conventions.float_attention_presents` removes.)

The rewrite: a ``Slice`` that returns its input whole, between a present and a graph output, goes, and the
present takes the graph output's name. Why exact: on an axis of static size ``d`` with step 1, ``Slice``
reads ``[s', e')`` with ``s' = clamp(s + d if s < 0 else s, 0, d)`` and ``e' = clamp(e + d if e < 0 else e,
0, d)`` (ONNX's Slice); when ``s' = 0`` and ``e' = d`` on every axis it names, the output is the input,
element for element.

Legality: an ``Attention`` of the main graph whose present output (1 or 2) is read only by one ``Slice``, and
is itself no graph output; the Slice's output is a graph output; its starts, ends, axes and steps are
constants (steps absent or all 1) and the present's dims on those axes are known (onnx's shape inference),
each clamped range the whole axis. Otherwise the node is left and the refusal says why: a Slice that cuts
the cache (a window shorter than the context) would still leave the present unbound on the HTP.
"""

from __future__ import annotations

__all__ = ["AttentionPresentsPass"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import Constant, find_constant, infer_shapes, node_label
from opfuse.core.ops import is_op
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord, Reason

PATTERN = "Attention present->graph output"
_PRESENTS = (1, 2)  # Attention-23's present_key and present_value outputs


class AttentionPresentsPass(OpfusePass):
    """Attention present -> whole Slice -> graph output: the Slice goes (module docstring)."""

    name = "attention-presents"
    requires_ops = frozenset({"Attention"})

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        found = [(node, i) for node in model.graph if is_op(node, "Attention") for i in _PRESENTS
                 if i < len(node.outputs) and node.outputs[i].consumers() and not node.outputs[i].is_graph_output()]
        if not found:
            return ir.passes.PassResult(model, modified=False)
        infer_shapes(model)  # (the present's dims decide; only when such a present is there)
        modified = False
        for node, index in found:
            modified |= self._rewrite(node, node.outputs[index])
        return ir.passes.PassResult(model, modified=modified)

    def _rewrite(self, node: ir.Node, present: ir.Value) -> bool:
        readers = present.consumers()
        slice_ = readers[0] if len(readers) == 1 and len(present.uses()) == 1 else None
        if not is_op(slice_, "Slice") or slice_.graph is not node.graph:
            self.refuse(PATTERN, node, f"its present '{present.name}' is read by "
                        f"{', '.join(r.op_type for r in readers)}, not by one Slice to a graph output: QNN's HTP "
                        "would leave it an unbound graph output (QNN_GRAPH_ERROR_INVALID_TENSOR at run)")
            return False
        out = slice_.outputs[0]
        whole = _whole(slice_, present) if out.is_graph_output() else Reason(
            f"the Slice's output '{out.name}' is not a graph output")
        if isinstance(whole, Reason):
            self.refuse(PATTERN, node, f"its present '{present.name}' goes through {node_label(slice_)}: "
                        f"{whole.sentence}; QNN's HTP would leave the present an unbound graph output "
                        "(QNN_GRAPH_ERROR_INVALID_TENSOR at run)", anchor=slice_)
            return False
        name = out.name
        out.replace_all_uses_with(present, replace_graph_outputs=True)
        slice_.graph.remove(slice_, safe=True)
        old, present.name = present.name, name
        self.report.records.append(FusionRecord(
            pattern=PATTERN, node=node_label(node), removed=(node_label(slice_),), produced=node_label(node),
            graph="main", output=name,
            detail=(f"'{old}' through a Slice of the whole axis {whole} is the graph output '{name}' itself: "
                    "QNN's HTP binds an Attention's present only as a graph output (opfuse.passes.attention_presents)")))
        return True


def _whole(node: ir.Node, x: ir.Value) -> list[int] | Reason:
    """The axes a Slice of ``x`` names when it returns ``x`` whole, or why it does not (or may not)."""
    if x.shape is None:
        return Reason(f"the shape of '{x.name}' is unknown")
    rank = len(x.shape)
    parts = []
    for i, role in enumerate(("starts", "ends", "axes", "steps")):
        value = node.inputs[i + 1] if i + 1 < len(node.inputs) else None
        if value is None:
            parts.append(None)
            continue
        found = find_constant(value, role)
        if not isinstance(found, Constant):
            return found
        parts.append(found.array.astype(np.int64).reshape(-1))
    starts, ends, axes, steps = parts
    if starts is None or ends is None:
        return Reason("the Slice has no starts or ends input (an opset below 10)")
    axes = np.arange(len(starts)) if axes is None else axes
    if steps is not None and not np.all(steps == 1):
        return Reason(f"its steps are {steps.tolist()}, not 1")
    named = []
    for start, end, axis in zip(starts.tolist(), ends.tolist(), axes.tolist()):
        axis = axis + rank if axis < 0 else axis
        dim = x.shape[axis] if 0 <= axis < rank else None
        if not isinstance(dim, int):
            return Reason(f"the dim {axis} of '{x.name}' is not a number")
        first = min(max(start + dim if start < 0 else start, 0), dim)
        last = min(max(end + dim if end < 0 else end, 0), dim)
        if (first, last) != (0, dim):
            return Reason(f"it keeps [{first}, {last}) of the {dim} positions of axis {axis}")
        named.append(axis)
    return named
