"""Rotary position embeddings written out (rotate-half, full or partial) -> RotaryEmbedding
(opset 23) or ONNX Runtime's com.microsoft RotaryEmbedding.

Algebra (Hugging Face's ``apply_rotary_pos_emb``, Llama, Qwen2, Mistral, Phi, Phi3; x is
the queries or keys as [B, H, S, D], the tables cos and sin [B, S, D] broadcast over heads):

    rotate_half(x) = Concat(-x[..., h:], x[..., :h])             h = D / 2
    y = x * Unsqueeze(cos, 1) + rotate_half(x) * Unsqueeze(sin, 1)

Write c1, c2 for cos's two halves and s1, s2 for sin's. Then

    y[..., :h] = x1 * c1 - x2 * s1        y[..., h:] = x2 * c2 + x1 * s2

and RotaryEmbedding(x, cos_cache=c, sin_cache=s) computes ``x1 c - x2 s`` and ``x2 c + x1 s``.
The two agree for every x exactly when c1 = c2 and s1 = s2: each table is one tensor of
angles repeated in both halves, ``Cos(Concat(freqs, freqs))`` and element-wise ops after it
(the exporters' Cast, ``* attention_scaling``). That, not "cos and sin of the same angles",
is what exactness needs: the fused op takes any two tables. Its caches are the graph's own
tables' first halves: the element-wise ops that make a table from ``Concat(freqs, freqs)`` run on
``freqs`` (``Cos(freqs)``: the same numbers as the table's first half, without the Concat), else
``Slice(cos, 0, h)`` (a copy), so no maximum position is assumed:

- standard (opset 23): RotaryEmbedding takes the caches as [B, S, h] without position ids;
- ONNX Runtime (contrib op, every opset): it takes [max_positions, h] tables and
  position ids [B, S]; the [B, S, h] caches are reshaped to [B * S, h] and the position ids
  are ``0 .. B*S - 1`` in [B, S] (built from the caches' shape), so position (b, s) reads
  row b * S + s: the graph's own value. Constant caches computed from inv_freq would need
  the largest position the model will see, which an export does not hold
  (max_position_embeddings is not in the graph, and a decode step past it still runs).
  Where the model's opset is 23 or more the standard op is written at ONNX Runtime too (its
  CPU provider runs it, without the reshapes).

Partial rotary (Phi's partial_rotary_factor, GPT-NeoX's rotary_pct; Phi3 writes it always,
with an empty pass-through): ``Concat(rotary(x[..., :R]), x[..., R:])`` is a second stage,
RotaryEmbedding(x[..., :R]) with its pass-through joined back -> RotaryEmbedding(x,
rotary_embedding_dim=R) (the op rotates the first R channels and copies the rest).

Legality (the first that fails is the refusal's reason):

1. Both slices cut x's last axis with step 1: the first is [0, h), the second [h, end >= D);
   the negated one is the second (the sign on the first half is another rotation), and it
   comes first in the Concat, along the last axis.
2. x is rank 4 with D = 2h known; the tables are ``Unsqueeze(table, 1)`` of rank-3 tables
   [B, S, 2h] whose batch and sequence dims are x's axes 0 and 2 (provably equal: a table of
   batch 1 broadcast over x's batch is not the op's cache), i.e. x is [B, H, S, D].
3. Each table's two halves are equal by construction (above), or, for a constant table, by
   value.
4. Partial: the kept slice is x[..., R:] of the same x, R = the rotated slice's end, the
   join is along the last axis; ONNX Runtime's op needs the head count (x's axis 1) static.
5. The standard form needs opset 23.

Interleaved rotation (GPT-J's rotate_every_two): :mod:`opfuse.passes.patterns.rotary_interleaved`, whose rules
run in these stages. Its partial form on [B, H, S, D] is the second stage above (the op with
interleaved=1 and rotary_embedding_dim=R rotates pairs within the first R channels and copies the rest,
as the op's definition says); on [B, S, H, D] (GPT-J's) its own second stage joins the 3-D view.
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from opfuse.core.ops import ELEMENTWISE_KINDS, MS_DOMAIN, ONNX_DOMAINS, is_onnx, is_op, op_kind
from opfuse.passes.patterns import constant_array, model_opset, opset_problem, rotary_interleaved
from opfuse.passes.patterns import constant_int as _int
from opfuse.core.dims import same_dim

TITLE = "rotary->RotaryEmbedding"
_TABLE_HOPS = 8  # element-wise ops looked through between a table and its Concat(freqs, freqs)


def _last_axis_problem(node: ir.Node, rank: int | None, what: str) -> str | None:
    """Why Slice ``node`` does not cut the last axis with step 1."""
    axes = _int(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    if len(node.inputs) <= 3 or node.inputs[3] is None:
        return f"the {what} slice has no axes input (it slices axis 0 on)"
    if axes is None:
        return f"the {what} slice's axes are not one constant"
    if not (axes == -1 or (rank is not None and axes == rank - 1)):
        return f"the {what} slice cuts axis {axes}, not the last"
    if len(node.inputs) > 4 and node.inputs[4] is not None and _int(node.inputs[4]) != 1:
        return f"the {what} slice's step is not 1"
    return None


def _table_problem(table4: ir.Value, what: str) -> tuple[ir.Value | None, str | None]:
    """The rank-3 table under ``Unsqueeze(table, 1)``, or why there is none."""
    node = table4.producer()
    if node is None or node.op_type != "Unsqueeze" or node.domain not in ONNX_DOMAINS:
        return None, f"its {what} table is not Unsqueeze(table, 1) of a [batch, seq, dim] table"
    axes = node.attributes.get("axes")
    axes = [int(a) for a in axes.value] if axes is not None else (
        None if len(node.inputs) < 2 else (lambda a: None if a is None else a.reshape(-1).tolist())(
            constant_array(node.inputs[1])))
    table = node.inputs[0]
    if axes != [1]:
        return None, f"its {what} table is unsqueezed at axes {axes}, not [1] (the heads axis of [B, H, S, D])"
    if table.shape is None or len(table.shape) != 3:
        return None, f"its {what} table is not known to be rank 3 [batch, seq, dim]"
    return table, None


def _halves_problem(table: ir.Value, what: str) -> str | None:
    """Why ``table``'s two halves along the last axis are not provably equal (None when they are)."""
    value = table
    for _ in range(_TABLE_HOPS):
        node = value.producer()
        if node is None:
            break
        if is_op(node, "Concat"):
            axis = node.attributes.get_int("axis", 0)
            if len(node.inputs) == 2 and node.inputs[0] is node.inputs[1] and axis in (-1, 2):
                return None
            return (f"its {what} table is not one tensor of angles repeated in both halves "
                    "(Concat(freqs, freqs) on the last axis), so the fused op's half-width cache would differ")
        # an element-wise op whose other operands are one-element constants keeps equal halves equal
        others = [v for v in node.inputs if (lambda c: c is None or c.size != 1)(constant_array(v))]
        if is_onnx(node) and op_kind(node) in ELEMENTWISE_KINDS and len(others) == 1 and others[0] is not None:
            value = others[0]
            continue
        break
    array = constant_array(value)
    if array is not None and array.shape and array.shape[-1] % 2 == 0:
        h = array.shape[-1] // 2
        if np.array_equal(array[..., :h], array[..., h:]):
            return None
    return (f"its {what} table does not come from one tensor of angles repeated in both halves "
            "(Concat(freqs, freqs) and element-wise ops after it), so its halves cannot be shown equal")


class RotateHalf(pattern.RewriteRuleClassBase):
    """x * cos + rotate_half(x) * sin -> RotaryEmbedding over the whole head."""

    def __init__(self, name: str, form: str):
        super().__init__(name)
        self._form = form
        self._contrib = form != "standard"

    def pattern(self, op, x, cos, sin, start1, end1, start2, end2):
        first = op.Slice(x, start1, end1, _allow_other_inputs=True, _outputs=["first"])
        second = op.Slice(x, start2, end2, _allow_other_inputs=True, _outputs=["second"])
        rotated = op.Concat(op.Neg(second), first, _allow_other_attributes=True, _outputs=["rotated"])
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))

    def check(self, context, x, cos, sin, start1, end1, start2, end2, first, second, rotated, **_):
        result = pattern.MatchResult()
        problem = self._problem(context, x, cos, sin, start1, end1, start2, end2, first, second, rotated)
        return result.fail(problem) if problem else result

    def _problem(self, context, x, cos, sin, start1, end1, start2, end2, first, second, rotated) -> str | None:
        rank = len(x.shape) if x.shape is not None else None
        for node, what in ((first.producer(), "kept"), (second.producer(), "negated")):
            problem = _last_axis_problem(node, rank, what)
            if problem:
                return problem
        s1, e1, s2, e2 = (_int(v) for v in (start1, end1, start2, end2))
        if None in (s1, e1, s2, e2):
            return "its slices' bounds are not constants"
        if s2 == 0 and s1 == e2:
            return ("the negated slice is the first half: rotate_half negates the second half and puts it "
                    "first (-x2, x1), this is another rotation")
        if not (s1 == 0 and e1 == s2 and s2 > 0):
            return f"its slices [{s1}, {e1}) and [{s2}, {e2}) are not the two halves [0, h) and [h, D)"
        h = s2
        if rotated.producer().attributes.get_int("axis", 0) not in (-1, 3):
            return "its halves are joined along another axis than the last"
        if rank != 4:
            return f"x has rank {rank}, not 4 ([batch, heads, seq, head_dim])"
        if e2 < 2 * h:
            return f"the second slice ends at {e2}, before 2h = {2 * h}"
        if x.shape[3] != 2 * h:
            return f"x's last axis is {x.shape[3]}, not known to be 2h = {2 * h}"
        for value, what in ((cos, "cos"), (sin, "sin")):
            table, problem = _table_problem(value, what)
            if problem:
                return problem
            if not (same_dim(table.shape[0], x.shape[0]) and same_dim(table.shape[1], x.shape[2])
                    and same_dim(table.shape[2], x.shape[3])):
                return (f"its {what} table is {list(table.shape)} and x is {list(x.shape)}: the table's batch and "
                        "sequence are not provably x's axes 0 and 2, as the fused op's cache must be")
            problem = _halves_problem(table, what)
            if problem:
                return problem
        if self._form == "standard":
            return opset_problem(context, "RotaryEmbedding", 23)
        self._contrib = model_opset(context) < 23  # (read by the rewrite that follows this check)
        return None

    def rewrite(self, op, x, cos, sin, start2, **_):
        h = _int(start2)
        cos_half, sin_half = (_first_half(op, v.producer().inputs[0], h) for v in (cos, sin))
        if self._form == "standard" or not self._contrib:
            return op.RotaryEmbedding(x, cos_half, sin_half)
        cos_2d, sin_2d = (op.Reshape(t, _ints(op, [-1, h])) for t in (cos_half, sin_half))
        rows = op.Gather(op.Shape(cos_2d), op.Constant(value=ir.tensor(np.int64(0))), axis=0)
        positions = op.Range(op.Constant(value=ir.tensor(np.int64(0))), rows, op.Constant(value=ir.tensor(np.int64(1))))
        batch_seq = op.Slice(op.Shape(cos_half), _ints(op, [0]), _ints(op, [2]), _ints(op, [0]))
        positions = op.Reshape(positions, batch_seq)
        heads = x.shape[1] if isinstance(x.shape[1], int) else 0
        return op.RotaryEmbedding(x, positions, cos_2d, sin_2d, num_heads=heads, _domain=MS_DOMAIN)


def _first_half(op, table: ir.Value, h: int):
    """``table[..., :h]``: where the table is ``Concat(freqs, freqs)`` and element-wise ops after it
    (:func:`_halves_problem`), those ops on ``freqs`` (the same numbers, element by element, without
    the Concat and the Slice: ``Cos(freqs)`` for ``Slice(Cos(Concat(freqs, freqs)), 0, h)``); else a
    Slice of the table (a copy)."""
    chain, value = [], table
    for _ in range(_TABLE_HOPS):
        node = value.producer()
        if node is None:
            break
        if is_op(node, "Concat"):
            freqs = node.inputs[0]
            if (len(node.inputs) != 2 or node.inputs[1] is not freqs or node.attributes.get_int("axis", 0) not in (-1, 2)
                    or freqs.shape is None or len(freqs.shape) != 3 or freqs.shape[-1] != h):
                break
            half = freqs
            for link, index in reversed(chain):
                inputs = [half if i == index else v for i, v in enumerate(link.inputs)]
                half = getattr(op, link.op_type)(*inputs, **{k: a.value for k, a in link.attributes.items()})
            return half
        operands = [i for i, v in enumerate(node.inputs) if (lambda c: c is None or c.size != 1)(constant_array(v))]
        if not (is_onnx(node) and op_kind(node) in ELEMENTWISE_KINDS and len(operands) == 1
                and node.inputs[operands[0]] is not None and len(node.outputs) == 1):
            break
        chain.append((node, operands[0]))
        value = node.inputs[operands[0]]
    return op.Slice(table, _ints(op, [0]), _ints(op, [h]), _ints(op, [-1]))


def _ints(op, values: list[int]):
    return op.Constant(value=ir.tensor(np.array(values, np.int64)))


class PartialRotary(pattern.RewriteRuleClassBase):
    """Concat(RotaryEmbedding(x[..., :R]), x[..., R:]) -> RotaryEmbedding(x, rotary_embedding_dim=R)."""

    def __init__(self, name: str, domain: str):
        super().__init__(name)
        self._domain = domain

    def pattern(self, op, x, start_rot, end_rot, start_pass, end_pass):
        rotated_part = op.Slice(x, start_rot, end_rot, _allow_other_inputs=True, _outputs=["rotated_slice"])
        rope = op.RotaryEmbedding(rotated_part, _allow_other_inputs=True, _allow_other_attributes=True,
                                  _domain=self._domain, _outputs=["rope"])
        kept = op.Slice(x, start_pass, end_pass, _allow_other_inputs=True, _outputs=["kept_slice"])
        return op.Concat(rope, kept, _allow_other_attributes=True, _outputs=["joined"])

    def check(self, context, x, start_rot, end_rot, start_pass, end_pass, rotated_slice, rope, kept_slice, joined,
              **_):
        result = pattern.MatchResult()
        rank = len(x.shape) if x.shape is not None else None
        problem = (_last_axis_problem(rotated_slice.producer(), rank, "rotated")
                   or _last_axis_problem(kept_slice.producer(), rank, "passed-through"))
        s0, r1, r2, end = (_int(v) for v in (start_rot, end_rot, start_pass, end_pass))
        node = rope.producer()
        if problem:
            pass
        elif None in (s0, r1, r2, end):
            problem = "its slices' bounds are not constants"
        elif rank != 4 or not isinstance(x.shape[3], int):
            problem = "x is not known to be rank 4 with a static head size"
        elif not (s0 == 0 and r1 == r2 and 0 < r1 <= x.shape[3] and end >= x.shape[3]):
            problem = (f"its slices [{s0}, {r1}) and [{r2}, {end}) are not the rotated [0, R) and "
                       f"passed-through [R, {x.shape[3]}) parts of one head")
        elif joined.producer().attributes.get_int("axis", 0) not in (-1, 3):
            problem = "its parts are joined along another axis than the last"
        elif node.attributes.get_int("rotary_embedding_dim", 0):
            problem = "the rotary op already rotates part of its input"
        elif self._domain == MS_DOMAIN and not isinstance(x.shape[1], int):
            problem = "ONNX Runtime's RotaryEmbedding needs the head count (x's axis 1) static for a partial rotation"
        return result.fail(problem) if problem else result

    def rewrite(self, op, x, end_rot, rope, **_):
        node = rope.producer()
        attributes = {k: v for k, v in node.attributes.items() if k != "rotary_embedding_dim"}
        rotary_dim = _int(end_rot)
        if rotary_dim < x.shape[3]:
            attributes["rotary_embedding_dim"] = rotary_dim
        return op.RotaryEmbedding(x, *node.inputs[1:], _domain=self._domain, **attributes)


def stages(form: str, approximate: bool = False):
    if form not in ("standard", "onnxruntime"):
        form = "standard"
    written = "RotaryEmbedding" if form == "standard" else "RotaryEmbedding (com.microsoft below opset 23)"
    interleaved, interleaved_partial = rotary_interleaved.stages(form)
    return [[RotateHalf.rule(f"rotate-half->{written}", form), *interleaved],
            [PartialRotary.rule("partial rotary->RotaryEmbedding", ""),
             PartialRotary.rule("partial rotary->com.microsoft RotaryEmbedding", MS_DOMAIN), *interleaved_partial]]
