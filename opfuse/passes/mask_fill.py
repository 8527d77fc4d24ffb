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

**Attention-23's mask.** Once ``fuse-patterns`` has written the attention as one ``Attention`` (opset 23),
the mask is its ``attn_mask`` input, added to the scores inside the op: ``Attention(Q, K, V,
Expand(Where(allowed, 0, F), shape))``. There is no Add left to rewrite, so the fill itself changes:
the Where's ``F`` becomes :data:`ATTENTION_FILL` (-32768) in place, read through value-preserving ops
(Expand, Reshape, Unsqueeze, Squeeze, Identity). Not -65504: the mask is added, and on the HTP's
float16 ``s - 65504`` is ``-inf`` for any score below -16 (65520 rounds to infinity), so a fully
masked row would be ``-inf`` throughout and its Softmax NaN, which the next layer's real queries read
through the padded keys; ``s - 32768`` stays finite for every score above -32736. Quantised, the mask's
range [-32768, 0] puts 0 and -32768 on the 16-bit grid exactly (step 0.5, zero point 65535).

- a row with an allowed position: as above, a masked score ``s - 32768`` has ``exp(s - 32768 - max)``
  = 0 in float32 (and float16), as ``s + F`` had: the same Softmax, the same output;
- a fully masked row (a left-padded query): the original's row is ``F`` throughout (uniform), the new
  one ``s - 32768`` (the Softmax of the scores themselves): it differs, at padded queries only, whose
  values are undefined (:mod:`opfuse.verify`, "Padded batches"; Attention-23 itself gives its own
  there) and reach no real token (every real query masks the padded keys).

Legality: every reader of the Where, through those ops, is the ``attn_mask`` of an ``Attention`` with
no ``softcap`` (a softcap's tanh would saturate both fills to the same value, but the op then computes
another function of the mask than an Add) whose ``qk_matmul_output`` nobody reads (it would expose the
mask's values); none of them is a graph output; the fill is a one-element constant, replaced by one of
the same shape.
"""

from __future__ import annotations

__all__ = ["MaskFillPass", "FILL", "ATTENTION_FILL"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import Constant, NameTable, find_constant, node_label
from opfuse.core.edit import drop_unread_nodes
from opfuse.core.ops import is_op
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord

FILL = float(np.finfo(np.float16).min)  # -65504: the most negative float16, finite on the HTP
ATTENTION_FILL = -32768.0  # Attention-23's additive mask: s + fill stays finite in float16 (module docstring)
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
        done = set()
        for node in list(graph):
            if node.graph is not None and is_op(node, "Attention"):
                modified |= self._rewrite_attention(node, done)
        return ir.passes.PassResult(model, modified=modified)

    def _rewrite_attention(self, attention: ir.Node, done: set) -> bool:
        """Attention-23's ``attn_mask`` from ``Where(allowed, 0, F)`` through value-preserving ops: the
        Where's F becomes :data:`ATTENTION_FILL` (module docstring, "Attention-23's mask")."""
        if len(attention.inputs) < 4 or attention.inputs[3] is None:
            return False
        mask = attention.inputs[3]
        while is_op(mask.producer(), *_PASS_THROUGH) and mask.producer().inputs:
            mask = mask.producer().inputs[0]
        found = _fill_where(mask, mask) if mask is not None else None
        if found is None or found[0] in done:
            return False
        where, condition, masked_when_true, fill = found
        readers = _attention_readers(where.outputs[0])
        if readers is None:
            return False
        done.add(where)
        index = 1 if masked_when_true else 2
        old = where.inputs[index]
        shape = find_constant(old).array.shape
        dtype = old.type.dtype if old.type is not None else ir.DataType.FLOAT
        value = ir.Value(name=self._names.fresh(f"{where.name or 'mask'}_fill"), shape=ir.Shape(list(shape)),
                         type=ir.TensorType(dtype),
                         const_value=ir.tensor(np.full(shape, ATTENTION_FILL, dtype=dtype.numpy())))
        where.graph.register_initializer(value)
        where.replace_input_with(index, value)
        names = sorted({node_label(a) for a in readers})
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        self.report.records.append(FusionRecord(
            pattern=f"attention mask fill->{ATTENTION_FILL:g}", node=node_label(where), removed=(),
            produced=node_label(where), graph="main",
            detail=(f"the attention mask '{where.outputs[0].name}' filled masked positions with {fill:g}, outside "
                    f"float16 and a 16-bit range; filled with {ATTENTION_FILL:g}, the attn_mask of {shown} gives "
                    "the same Softmax on every row with an allowed position (exp underflows to 0 either way), and "
                    "the added scores stay finite in float16; a fully masked row (a padded query, undefined) "
                    "differs")))
        return True

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


_PASS_THROUGH = ("Expand", "Reshape", "Unsqueeze", "Squeeze", "Identity")  # what reaches the attn_mask unchanged


def _attention_readers(value: ir.Value) -> list[ir.Node] | None:
    """The Attention nodes reading ``value`` as ``attn_mask``, through :data:`_PASS_THROUGH` ops; None when
    anything else reads it (or a graph output is on the way, or an Attention has a softcap or a read
    ``qk_matmul_output``): module docstring, Legality."""
    found, pending = [], [value]
    while pending:
        v = pending.pop()
        if v.is_graph_output():
            return None
        for use in v.uses():
            node, index = use.node, use.idx
            if is_op(node, *_PASS_THROUGH) and index == 0:
                pending.extend(node.outputs)
            elif is_op(node, "Attention") and index == 3:
                softcap = node.attributes.get("softcap")
                qk = node.outputs[3] if len(node.outputs) > 3 else None
                if (softcap is not None and softcap.as_float() != 0.0) or (qk is not None and (qk.uses() or qk.is_graph_output())):
                    return None
                found.append(node)
            else:
                return None
    return found or None


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
