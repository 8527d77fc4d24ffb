"""``mask-fill``: an additive attention mask's fill value in a range an NPU holds (``--target qnn``).

Transformers write the padding and causal mask as ``Where(allowed, 0, finfo(float32).min)``
(or ``-inf``) and add it to the attention scores before the Softmax. QNN's HTP computes a
float graph in float16, where -3.4e38 is ``-inf``, and a 16-bit quantised tensor whose range
must hold -3.4e38 keeps nothing else: the value is outside what the NPU's number formats
carry. This pass writes -65504 instead (``finfo(float16).min``: the most negative value the
HTP's float16 keeps finite, and one a 16-bit quantiser's range holds), in a form that is exact
in effect::

    Softmax(Add(scores, Where(allowed, 0, F)))  ->  Softmax(Where(allowed, scores, -65504))

with ``F <= -1e30`` or ``-inf`` (either branch order: ``Where(masked, F, 0)`` becomes
``Where(masked, -65504, scores)``; either Add operand). Why exact:

- a **row with at least one allowed position**: both forms keep the allowed scores as they
  are; a masked entry was ``s + F`` (``exp`` of it minus the row's maximum is 0 in float32)
  and is now -65504, whose ``exp(-65504 - max)`` is 0 in float32 too as long as the allowed
  maximum exceeds -65400 (float32's ``exp`` underflows to 0 below -104); attention scores
  are nowhere near that;
- a **fully masked row** (a left-padded position's own query in a prefill): in float32
  ``s + F`` rounds to ``F`` for every ``|s| < ulp(F) / 2`` (3.8e22 for ``F = -1e30``), so
  the original's row is constant and its Softmax uniform; the new row is -65504 everywhere,
  so its Softmax is uniform too. (Writing only the constant, ``Add(scores, Where(allowed, 0,
  -65504))``, would not be: that row would become ``Softmax(scores)``.) With ``F = -inf``
  the original's fully masked row is NaN (``-inf - -inf``), which the exporters' guard
  ``Where(IsNaN(p), 0, p)`` turns into 0 and the new row into a uniform row: the one case
  that differs, and only on the rows of padding.

Legality: the Add's output is read by Softmax nodes only (so the scores plus mask are never
seen elsewhere), the Where's ``0`` and ``F`` are one-element constants of no higher rank than
the Add's output (so the new Where broadcasts to the same shape), and the Add is in the main
graph and is no graph output. The mask's Where, left unread, goes. The Add's output name is
kept; its values differ at masked positions (by design), so the record names no tensor for
verification to compare there: the Softmax after it and the graph's outputs check it.
"""

from __future__ import annotations

__all__ = ["MaskFillPass", "FILL"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import Constant, NameTable, find_constant, node_label
from opfuse.core.edit import drop_unread_nodes
from opfuse.core.ops import is_op
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord

FILL = float(np.finfo(np.float16).min)  # -65504: the most negative float16, finite on the HTP
_HUGE = -1e30  # a fill at or below this absorbs any score in float32 (s + F == F)


class MaskFillPass(OpfusePass):
    """An additive mask of float-minimum fills before a Softmax -> a Where of -65504 (module docstring)."""

    name = "mask-fill"
    after_rewrites = True  # its Where is no attention spelling: it runs once the patterns have settled
    options = frozenset({"target", "exclude", "veto"})  # (what the fusion stage hands every pass; none used)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self._names = NameTable(model)
        modified = False
        for node in list(graph):
            if node.graph is not None and is_op(node, "Add"):
                modified |= self._rewrite(node)
        return ir.passes.PassResult(model, modified=modified)

    def _rewrite(self, add: ir.Node) -> bool:
        out = add.outputs[0]
        if (len(add.inputs) != 2 or None in add.inputs or out.is_graph_output() or not out.uses()
                or not all(is_op(use.node, "Softmax") for use in out.uses())):
            return False
        for scores, mask in (add.inputs, add.inputs[::-1]):
            found = _fill_where(mask, out)
            if found is None:
                continue
            where, condition, masked_when_true, fill = found
            dtype = out.type.dtype if out.type is not None else ir.DataType.FLOAT
            value = ir.Value(name=self._names.fresh(f"{add.name or 'mask'}_fill"), shape=ir.Shape([]),
                             type=ir.TensorType(dtype),
                             const_value=ir.tensor(np.array(FILL, dtype=dtype.numpy())))
            add.graph.register_initializer(value)
            inputs = [condition, value, scores] if masked_when_true else [condition, scores, value]
            new = ir.Node("", "Where", inputs, name=self._names.fresh(f"{add.name or 'Add'}_mask"),
                          outputs=[ir.Value(name=self._names.fresh(f"{out.name}_masked"), type=out.type,
                                            shape=out.shape)])
            add.graph.insert_before(add, [new])
            name = out.name
            out.replace_all_uses_with(new.outputs[0])
            add.graph.remove(add, safe=True)
            new.outputs[0].name = name
            removed = [add, *drop_unread_nodes([where])]
            softmaxes = sorted({node_label(u.node) for u in new.outputs[0].uses()})
            self.report.records.append(FusionRecord(
                pattern="mask fill->-65504", node=node_label(add), removed=tuple(node_label(n) for n in removed),
                produced=node_label(new), graph="main",
                detail=(f"the mask '{mask.name}' filled masked positions with {fill:g}, outside float16 and a "
                        f"16-bit range; Where('{condition.name}', scores, {FILL:g}) before {', '.join(softmaxes)} "
                        "gives the same Softmax on every row with an allowed position (exp underflows to 0 "
                        "either way) and a uniform row where all are masked, as before"
                        + (" (with -inf the original's fully masked row was NaN)" if np.isinf(fill) else ""))))
            return True
        return False


def _fill_where(mask: ir.Value, like: ir.Value):
    """(the Where, its condition, whether true means masked, F) for ``mask = Where(c, 0, F)`` or
    ``Where(c, F, 0)`` with one-element constants and ``F <= -1e30``; else None."""
    where = mask.producer()
    if not is_op(where, "Where") or len(where.inputs) != 3 or None in where.inputs or where.graph is None:
        return None
    condition, a, b = where.inputs
    ranks = [len(v.shape) for v in (like, condition) if v.shape is not None]
    rank = max(ranks, default=0)  # (a scalar never broadcasts to more)
    values = []
    for v in (a, b):
        found = find_constant(v)
        if (not isinstance(found, Constant) or found.array.size != 1 or found.array.dtype.kind != "f"
                or found.array.ndim > rank):
            return None
        values.append(float(found.array.reshape(-1)[0]))
    if values[0] == 0.0 and values[1] <= _HUGE:
        return where, condition, False, values[1]
    if values[1] == 0.0 and values[0] <= _HUGE:
        return where, condition, True, values[0]
    return None
