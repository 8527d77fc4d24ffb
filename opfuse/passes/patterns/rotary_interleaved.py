"""Interleaved rotary position embeddings written out (GPT-J's rotate_every_two, full or partial)
-> RotaryEmbedding(interleaved=1), opset 23 or ONNX Runtime's com.microsoft op, its cos/sin caches
the model's own constant table.

Algebra (Hugging Face's GPT-J; x is the queries or keys, [B, S, H, D] before the heads are moved,
or [B, H, S, D]; t the [P, 2h] table ``Concat(sin(angles), cos(angles))``, D = 2h):

    sin, cos = Split(Gather(t, position_ids))                          each [B, S, h]
    rep(c) = Reshape(Expand|Tile(Unsqueeze(c, [heads axis, 4]), [1, 1, 1, 1, 2]))   [B, S, 1, 2h]
    rotate_every_two(x) = Reshape(Concat(Unsqueeze(-x[..., 1::2], -1), Unsqueeze(x[..., ::2], -1)))
    y = x * rep(cos) + rotate_every_two(x) * rep(sin)

rep(c) repeats each angle in two adjacent channels (c0 c0 c1 c1 ...), and rotate_every_two puts
(-x[2i+1], x[2i]) in channels (2i, 2i+1). So

    y[2i] = x[2i] c_i - x[2i+1] s_i        y[2i+1] = x[2i+1] c_i + x[2i] s_i

which is RotaryEmbedding's interleaved rotation (x1 = x[::2], x2 = x[1::2]; ``x1 c - x2 s`` and
``x1 s + x2 c``, written back to the even and odd channels) with cos_cache = c, sin_cache = s for any
two tables c and s: exactness needs each table's pairs equal (the repeat above), not that they are
the cosine and sine of one angle. c and s are rows of the constant t picked by position_ids, so the
caches are t's own columns ``t[:, cos columns]`` and ``t[:, sin columns]`` (copies, exact; a Cast
between the Gather and the Split is applied to them) of shape [P, h], and position_ids [B, S] is
the op's position input: the op gathers the same rows the graph did.

Layout: the op rotates x as [B, H, S, D], or as [B, S, hidden] with num_heads. GPT-J rotates
[B, S, H, D] (the heads axis is where the tables are unsqueezed, axis 2): that x is reshaped to
[B, S, H*D] and back (a copy-free Reshape of a contiguous tensor), with num_heads = H.

Partial rotary (GPT-J's rotary_dim < head_dim): ``Concat(rotary(x[..., :R]), x[..., R:])`` is a
second stage, as in :mod:`opfuse.passes.patterns.rotary`: the op with rotary_embedding_dim = R rotates
the first R channels of each head (interleaved within them) and copies the rest.

Legality (the first that fails is the refusal's reason):

1. The two slices cut x's last axis with step 2, the even one from 0 and the odd one from 1, both to
   its end (>= D); the negated one is the odd one (the sign on the even one is the other rotation
   direction); both are unsqueezed at the new last axis and joined there, negated first.
2. x is rank 4 with D = 2h static; the Reshape of the pairs merges only their last two axes
   (its leading axes are x's, all but at most one provably, the last 2h).
3. Each table is rep(c) above: Unsqueeze of a rank-3 table at the heads axis (1 or 2) and at the new
   last axis, Expand or Tile by 2 on that last axis only, Reshape merging the last two axes; both
   tables unsqueezed at the same axis, the other two of x's leading axes being the table's
   [batch, seq] (provably equal: a table of batch 1 broadcast over x's batch is refused).
4. Both tables are the [h]-wide column blocks of one Gather (axis 0) or GatherND of a constant
   [P, 2h] table by position_ids [batch, seq] (Split along the last axis or a Slice of it, Casts
   allowed after the Gather). A position id must be in [0, P): past P both the Gather and the op fail
   (ONNX Runtime checks both); a negative one, which Gather reads from the table's end, is not a
   position a decoder produces, and ONNX Runtime's op rejects it with an error, not a wrong number.
5. The [B, S, H, D] layout needs H static (num_heads); the standard form needs opset 23.
"""

from __future__ import annotations

__all__ = ["InterleavedRotary", "PartialInterleaved3D", "stages"]

import numpy as np
import onnx
import onnx_ir as ir
from onnxscript.rewriter import pattern

from opfuse.core.ops import MS_DOMAIN, ONNX_DOMAINS
from opfuse.passes.patterns import constant_array, model_opset, opset_problem
from opfuse.passes.patterns import constant_int as _int
from opfuse.core.dims import same_dim


def _ints(value) -> list[int] | None:
    array = constant_array(value)
    return None if array is None else [int(a) for a in array.reshape(-1)]


def _onnx(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ONNX_DOMAINS


def _strided_problem(node: ir.Node, start: int, d: int, what: str) -> str | None:
    """Why Slice ``node`` is not x[..., start::2] over the whole last axis (of size ``d``)."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    s, e, axes, step = _int(inputs[1]), _int(inputs[2]), _int(inputs[3]), _int(inputs[4])
    if None in (s, e, axes, step):
        return f"the {what} slice's bounds, axis or step are not constants"
    if axes not in (-1, 3):
        return f"the {what} slice cuts axis {axes}, not the last"
    if step != 2 or s != start or e < d:
        return f"the {what} slice is [{s}:{e}:{step}], not [{start}::2] over the head's {d} channels"
    return None


def _own_leading_shape(reshape: ir.Node, sources: dict, k: int) -> bool:
    """The Reshape's target is ``Concat(Shape(v)[0:k], [-1])`` (TorchScript: Slice of Shape; dynamo: Shape with
    start and end) of a value v in ``sources`` (value -> rank) whose first k axes are the Reshape input's."""
    concat = reshape.inputs[1].producer()
    if not _onnx(concat, "Concat") or len(concat.inputs) != 2 or _ints(concat.inputs[1]) != [-1]:
        return False
    head = concat.inputs[0].producer()
    if _onnx(head, "Slice") and len(head.inputs) >= 4:
        step = _int(head.inputs[4]) if len(head.inputs) > 4 and head.inputs[4] is not None else 1
        shape = head.inputs[0].producer()
        if not (_onnx(shape, "Shape") and not shape.attributes and step == 1 and _int(head.inputs[1]) == 0
                and _int(head.inputs[3]) == 0):
            return False
        begin, stop = 0, _int(head.inputs[2])
    elif _onnx(head, "Shape"):
        shape, begin, stop = head, head.attributes.get_int("start", 0), head.attributes.get_int("end", None)
    else:
        return False
    rank = sources.get(shape.inputs[0])
    if rank is None or begin != 0 or stop is None:
        return False
    return (stop + rank if stop < 0 else stop) == k


def _merges_last_two(reshape: ir.Node, leading: list, last: int, sources: dict) -> bool:
    """Reshape ``reshape`` of a [*leading, last/2, 2] tensor writes [*leading, last]: its target's last entry
    is ``last``, and every leading entry copies or provably equals its input's, but at most one (or the
    target is its input's own leading shape and -1, :func:`_own_leading_shape`)."""
    if _own_leading_shape(reshape, sources, len(leading)):
        return True
    target = _ints(reshape.inputs[1])
    out = reshape.outputs[0].shape
    rank = len(leading) + 1
    if target is not None and len(target) != rank:
        return False
    if target is None and (out is None or len(out) != rank):
        return False
    last_dim = target[-1] if target is not None else out[-1]
    if last_dim not in (last, -1):
        return False
    zero_copies = reshape.attributes.get_int("allowzero", 0) == 0
    unknown = 0
    for i, dim in enumerate(leading):
        entry = target[i] if target is not None else None
        if entry == 0 and zero_copies:
            continue
        if entry is not None and entry > 0 and isinstance(dim, int) and entry == dim:
            continue
        if out is not None and len(out) == rank and same_dim(out[i], dim):
            continue
        unknown += 1
    return unknown == 0 or (unknown == 1 and last_dim == last)  # (-1: the pair, when every leading axis is kept)


def _repeated_problem(rep: ir.Value, h: int, what: str) -> tuple[ir.Value | None, int | None, str | None]:
    """(the [B, S, h] table c, its heads axis) when ``rep`` is rep(c) of the module docstring, else a reason."""
    reason = (f"its {what} table is not each angle repeated in two adjacent channels (Unsqueeze at the new last axis, "
              f"Expand or Tile by 2 there, Reshape merging the pair): a rotate-half table (Concat(freqs, freqs)) or "
              f"another layout pairs other channels, and the interleaved op's cache would differ")
    reshape = rep.producer()
    if not _onnx(reshape, "Reshape"):
        return None, None, reason
    widen = reshape.inputs[0].producer()
    if not (_onnx(widen, "Expand") or _onnx(widen, "Tile")) or _ints(widen.inputs[1]) != [1, 1, 1, 1, 2]:
        return None, None, reason
    value, axes, sources = widen.inputs[0], [], {widen.inputs[0]: 5, reshape.inputs[0]: 5}
    for _ in range(2):  # one Unsqueeze with axes [a, 4] or two, of a then 4
        node = value.producer()
        if not _onnx(node, "Unsqueeze"):
            break
        found = _ints(node.inputs[1]) if len(node.inputs) > 1 else None
        if found is None and node.attributes.get("axes") is not None:
            found = [int(a) for a in node.attributes["axes"].value]
        if found is None:
            return None, None, reason
        axes = found + axes
        value = node.inputs[0]
        sources[value] = 4  # (the table itself, rank 3, is dropped below)
        if sorted(axes) == axes and len(axes) == 2:
            break
    if len(axes) != 2 or axes[1] not in (4, -1) or axes[0] not in (1, 2):
        return None, None, reason
    table = value
    if table.shape is None or len(table.shape) != 3 or table.shape[2] != h:
        return None, None, f"its {what} table is not known to be [batch, seq, {h}]"
    leading = list(table.shape[:2])
    leading.insert(axes[0], 1)
    sources.pop(table, None)
    if not _merges_last_two(reshape, leading, 2 * h, sources):
        return None, None, reason
    return table, axes[0], None


def _cache_problem(table: ir.Value, h: int, what: str) -> tuple[tuple | None, str | None]:
    """((the gathered constant's columns as a [P, h] array, position ids), None), or (None, why)."""
    reason = (f"its {what} table is not a block of {h} columns of one constant table gathered by position ids "
              "(Gather(table, position_ids) then Split or Slice on the last axis)")
    node = table.producer()
    if _onnx(node, "Split"):
        axis = node.attributes.get_int("axis", 0)
        sizes = _ints(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        if axis not in (-1, 2) or (sizes is not None and len(set(sizes)) != 1):
            return None, reason
        k = list(node.outputs).index(table)
        begin, source = k * h, node.inputs[0]
    elif _onnx(node, "Slice"):
        s, e, axes = (_int(node.inputs[i]) if len(node.inputs) > i else None for i in (1, 2, 3))
        step = _int(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else 1
        if axes not in (-1, 2) or step != 1 or s is None or e is None or s < 0:
            return None, reason
        begin, source = s, node.inputs[0]
        if e - s < h:  # (an end past the table's width, as INT64_MAX, is checked against it below)
            return None, reason
    else:
        return None, reason
    casts = []
    while _onnx(source.producer(), "Cast"):
        casts.insert(0, source.producer().attributes.get_int("to"))
        source = source.producer().inputs[0]
    gather = source.producer()
    if _onnx(gather, "Gather") and gather.attributes.get_int("axis", 0) == 0:
        positions = gather.inputs[1]
    elif _onnx(gather, "GatherND") and gather.attributes.get_int("batch_dims", 0) == 0:
        squeeze = gather.inputs[1].producer()
        if not _onnx(squeeze, "Unsqueeze") or _ints(squeeze.inputs[1]) not in ([-1], [2]):
            return None, reason
        positions = squeeze.inputs[0]
    else:
        return None, reason
    array = constant_array(gather.inputs[0])
    if array is None or array.ndim != 2 or begin + h > array.shape[1] or positions.shape is None \
            or len(positions.shape) != 2 or positions.dtype != ir.DataType.INT64:
        return None, reason
    if _onnx(node, "Slice") and min(_int(node.inputs[2]), array.shape[1]) - begin != h:
        return None, reason
    block = array[:, begin:begin + h]
    for to in casts:
        block = block.astype(onnx.helper.tensor_dtype_to_np_dtype(to))
    name = f"{gather.inputs[0].name or 'rotary_table'}.columns_{begin}_{begin + h}"
    return (block, positions, name), None


class InterleavedRotary(pattern.RewriteRuleClassBase):
    """x * rep(cos) + rotate_every_two(x) * rep(sin) -> RotaryEmbedding(interleaved=1) over the whole head."""

    def __init__(self, name: str, form: str, own_shape: bool = False):
        super().__init__(name)
        self._form = form
        self._own_shape = own_shape  # TorchScript's: the pairs reshaped to Concat(Shape(pairs)[:-2], [-1])
        self._found: dict = {}

    def pattern(self, op, x, cos, sin, s1, e1, a1, t1, s2, e2, a2, t2, u1, u2, shape, c0, c1, c2, minus1):
        even = op.Slice(x, s1, e1, a1, t1, _outputs=["even"])
        odd = op.Slice(x, s2, e2, a2, t2, _outputs=["odd"])
        pairs = op.Concat(op.Unsqueeze(op.Neg(odd), u1), op.Unsqueeze(even, u2), _allow_other_attributes=True,
                          _outputs=["pairs"])
        if self._own_shape:
            shape = op.Concat(op.Slice(op.Shape(pairs), c0, c1, c2, _allow_other_inputs=True), minus1, axis=0)
        rotated = op.Reshape(pairs, shape, _allow_other_attributes=True, _outputs=["rotated"])
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))

    def check(self, context, x, cos, sin, u1, u2, even, odd, pairs, rotated, **_):
        result = pattern.MatchResult()
        problem = self._problem(context, x, cos, sin, u1, u2, even, odd, pairs, rotated)
        return result.fail(problem) if problem else result

    def _problem(self, context, x, cos, sin, u1, u2, even, odd, pairs, rotated) -> str | None:
        if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[3], int) or x.shape[3] % 2:
            return "x is not known to be rank 4 with an even static head size"
        d = x.shape[3]
        h = d // 2
        if _strided_problem(even.producer(), 1, d, "") is None and _strided_problem(odd.producer(), 0, d, "") is None:
            return ("the negated slice is the even channels: rotate_every_two negates the odd ones "
                    "(-x[2i+1], x[2i]), this is the other rotation direction")
        problem = _strided_problem(even.producer(), 0, d, "even") or _strided_problem(odd.producer(), 1, d, "odd")
        if problem:
            return problem
        if _ints(u1) not in ([-1], [4]) or _ints(u2) not in ([-1], [4]) \
                or pairs.producer().attributes.get_int("axis", 0) not in (-1, 4):
            return "its two slices are not paired along a new last axis (Unsqueeze at -1, Concat on -1)"
        if not _merges_last_two(rotated.producer(), list(x.shape[:3]), d, {pairs: 5}):
            return "the Reshape of its pairs does not provably merge only their last two axes back into the head"
        tables = {}
        for value, what in ((cos, "cos"), (sin, "sin")):
            table, heads_axis, problem = _repeated_problem(value, h, what)
            if problem:
                return problem
            seq_axis = 3 - heads_axis
            if not (same_dim(table.shape[0], x.shape[0]) and same_dim(table.shape[1], x.shape[seq_axis])):
                return (f"its {what} table is {list(table.shape)} and x is {list(x.shape)}: the table's batch and "
                        f"sequence are not provably x's axes 0 and {seq_axis}, as the fused op's positions must be")
            cache, problem = _cache_problem(table, h, what)
            if problem:
                return problem
            tables[what] = (heads_axis, *cache)
        if tables["cos"][0] != tables["sin"][0]:
            return "its cos and sin tables are broadcast over different axes of x"
        if tables["cos"][2] is not tables["sin"][2]:
            return "its cos and sin tables are gathered by different position ids"
        heads_axis = tables["cos"][0]
        if heads_axis == 2 and not isinstance(x.shape[2], int):
            return "x is [batch, seq, heads, head_dim] with the head count not static (the op's num_heads)"
        if self._form == "standard":
            problem = opset_problem(context, "RotaryEmbedding", 23)
            if problem:
                return problem
        self._found = {"layout": heads_axis, "cos": tables["cos"][1], "sin": tables["sin"][1],
                       "cos_name": tables["cos"][3], "sin_name": tables["sin"][3], "positions": tables["cos"][2],
                       "contrib": self._form != "standard" and model_opset(context) < 23}
        return None  # (read by the rewrite that follows this check)

    def rewrite(self, op, x, **_):
        found = self._found
        cos, sin = (_shared_initializer(op, x.graph, found[k], found[f"{k}_name"]) for k in ("cos", "sin"))
        heads = x.shape[2] if found["layout"] == 2 else (x.shape[1] if isinstance(x.shape[1], int) else 0)
        source = x if found["layout"] == 1 else op.Reshape(x, _const(op, [0, 0, -1]))
        extra = {"num_heads": heads} if found["layout"] == 2 or found["contrib"] else {}
        if found["contrib"]:
            out = op.RotaryEmbedding(source, found["positions"], cos, sin, interleaved=1, _domain=MS_DOMAIN, **extra)
        else:
            out = op.RotaryEmbedding(source, cos, sin, found["positions"], interleaved=1, **extra)
        return out if found["layout"] == 1 else op.Reshape(out, _const(op, [0, 0, heads, x.shape[3]]))


def _shared_initializer(op, graph, array: np.ndarray, name: str) -> ir.Value:
    """The cache as an initializer, the one an earlier rewrite wrote when it holds the same bytes (the query and
    key rotations of every layer read one table)."""
    existing = graph.initializers.get(name) if graph is not None else None
    if existing is not None and existing.const_value is not None and np.array_equal(existing.const_value.numpy(),
                                                                                   array):
        return existing
    return op.initializer(ir.tensor(np.ascontiguousarray(array)), name=name)


def _const(op, values: list[int]):
    return op.Constant(value=ir.tensor(np.array(values, np.int64)))


class PartialInterleaved3D(pattern.RewriteRuleClassBase):
    """Concat(Reshape(RotaryEmbedding(Reshape(x[..., :R], [0, 0, -1]))), x[..., R:]) on [B, S, H, D]
    -> Reshape(RotaryEmbedding(Reshape(x, [0, 0, -1]), rotary_embedding_dim=R)): the first stage's 3-D form."""

    def __init__(self, name: str, domain: str):
        super().__init__(name)
        self._domain = domain

    def pattern(self, op, x, start_rot, end_rot, start_pass, end_pass, flat_shape, back_shape):
        part = op.Slice(x, start_rot, end_rot, _allow_other_inputs=True, _outputs=["part"])
        rope = op.RotaryEmbedding(op.Reshape(part, flat_shape), _allow_other_inputs=True,
                                  _allow_other_attributes=True, _domain=self._domain, _outputs=["rope"])
        kept = op.Slice(x, start_pass, end_pass, _allow_other_inputs=True, _outputs=["kept"])
        return op.Concat(op.Reshape(rope, back_shape), kept, _allow_other_attributes=True, _outputs=["joined"])

    def check(self, context, x, start_rot, end_rot, start_pass, end_pass, flat_shape, back_shape, part, rope, kept,
              joined, **_):
        result = pattern.MatchResult()
        s0, r1, r2, end = (_int(v) for v in (start_rot, end_rot, start_pass, end_pass))
        node = rope.producer()
        steps_ok = all(len(n.inputs) < 5 or n.inputs[4] is None or _int(n.inputs[4]) == 1
                       for n in (part.producer(), kept.producer()))
        axes = [_int(n.inputs[3]) if len(n.inputs) > 3 and n.inputs[3] is not None else None
                for n in (part.producer(), kept.producer())]
        if x.shape is None or len(x.shape) != 4 or not all(isinstance(d, int) for d in x.shape[2:]):
            return result.fail("x is not known to be [batch, seq, heads, head_dim] with static heads and head size")
        heads, d = x.shape[2], x.shape[3]
        if None in (s0, r1, r2, end) or not steps_ok or any(a not in (-1, 3) for a in axes):
            return result.fail("its slices are not constant step-1 cuts of the last axis")
        if not (s0 == 0 and r1 == r2 and 0 < r1 <= d and end >= d):
            return result.fail(f"its slices [{s0}, {r1}) and [{r2}, {end}) are not the rotated [0, R) and "
                               f"passed-through [R, {d}) parts of one head")
        if joined.producer().attributes.get_int("axis", 0) not in (-1, 3):
            return result.fail("its parts are joined along another axis than the last")
        if _ints(flat_shape) != [0, 0, -1] or _ints(back_shape) != [0, 0, heads, r1]:
            return result.fail("the rotary op is not on the 3-D view of the rotated part of each head")
        if node.attributes.get_int("rotary_embedding_dim", 0) or node.attributes.get_int("num_heads", 0) != heads:
            return result.fail("the rotary op already rotates part of its input, or its head count is not x's")
        return result

    def rewrite(self, op, x, end_rot, rope, **_):
        node = rope.producer()
        attributes = {k: v for k, v in node.attributes.items()}
        if _int(end_rot) < x.shape[3]:  # (an empty pass-through: the whole head is rotated)
            attributes["rotary_embedding_dim"] = ir.AttrInt64("rotary_embedding_dim", _int(end_rot))
        out = op.RotaryEmbedding(op.Reshape(x, _const(op, [0, 0, -1])), *node.inputs[1:], _domain=self._domain,
                                 **{k: v.value for k, v in attributes.items()})
        return op.Reshape(out, _const(op, [0, 0, x.shape[2], x.shape[3]]))


def stages(form: str):
    """The first stage's rule and the second stage's partial rules (joined to rotary's stages)."""
    written = "RotaryEmbedding" if form == "standard" else "RotaryEmbedding (com.microsoft below opset 23)"
    # (TorchScript's form first: where it matches, its reason is the one a refusal records, not the general
    # form's "a tensor inside the pattern is used outside it" for the Shape that reads the pairs)
    return ([InterleavedRotary.rule(f"interleaved rotary (TorchScript's reshape)->{written}", form, True),
             InterleavedRotary.rule(f"interleaved rotary->{written}", form)],
            [PartialInterleaved3D.rule("partial interleaved rotary->RotaryEmbedding", ""),
             PartialInterleaved3D.rule("partial interleaved rotary->com.microsoft RotaryEmbedding", MS_DOMAIN)])
