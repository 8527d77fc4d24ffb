"""Follow a producer's output-channel axis through the layout ops between it and a fold's consumer.

Exporters put data movement between a layer and its per-channel affine map: an NHWC export
writes ``Conv -> Transpose(0,2,3,1) -> Sub/Mul/Add`` (a Caffe model's BatchNorm re-exported
through TensorFlow), tf2onnx writes a Keras Conv1D as ``Conv -> Squeeze -> Add(bias)`` and a
1x1 head as ``Conv -> Reshape/Flatten -> Add``. A fold sees through them
(:mod:`opfuse.passes.folding`): the map moves into the producer, the layout ops stay and
read the folded output.

Algebra (:mod:`opfuse.core.algebra`, "Layout ops"): an op that only moves elements commutes with
a per-channel affine map when it keeps the channel axis as one whole axis; the map's
constant must then vary along that axis of the consumer's input, and only along it.

The ops, and when each keeps the channel axis (every failure is a reason):

1. Identity: always.
2. Transpose: ``perm`` (absent: the axes reversed) sends axis a to ``perm.index(a)``.
3. Squeeze / Unsqueeze: constant ``axes`` (an attribute before opset 13, an input from 13);
   Squeeze without axes needs a static shape (it removes the dims of size 1). Squeezing the
   channel axis loses it.
4. Slice: the channel axis is not sliced, or sliced whole (start 0, end >= C, step 1), with
   constant starts, ends, axes and steps.
5. Reshape / Flatten: the input's dims must be known (static, or symbolic names from shape
   inference) and the channel axis must provably land whole on one output axis; a dim that
   cannot be proven equal (an unknown size, a -1 beside a symbolic batch on both sides) is
   a refusal that says so. Reshape's target must be a constant, or (tf2onnx's Tensordot:
   ``Reshape(MatMul, Concat(Shape(x)[:2], [M]))``) its output's dims must be known from
   shape inference (ONNX Runtime's symbolic inference, run once when needed); then only their
   static sizes count (a symbolic name from one inference need not mean the same in another),
   so the proof is the sizes after the channel axis (a last axis stays last).

Every value along the chain must have this one consumer and not be a graph output; the
fold checks that (:func:`opfuse.core.analysis.sole_use_problem`), as for Identity nodes.
"""

from __future__ import annotations

__all__ = ["trace_through_layout", "has_layout_op", "follow_channel", "describe_chain"]

from collections.abc import Callable, Sequence

import onnx_ir as ir

from opfuse.core import algebra
from opfuse.core.analysis import describe, find_constant
from opfuse.report import Reason
from opfuse.core.ops import ONNX_DOMAINS, int_attr

ChannelAxis = tuple[int, int]  # (rank, channel axis) of a tensor along the chain


def _constant_ints(node: ir.Node, index: int, attribute: str | None, opset: int, since: int):
    """An int list from an attribute (before opset ``since``) or a constant input; None when
    absent; the :class:`Reason` when it is not a constant."""
    if attribute is not None and (opset and opset < since or attribute in node.attributes):
        attr = node.attributes.get(attribute)
        return None if attr is None else [int(v) for v in attr.value]
    value = node.inputs[index] if index < len(node.inputs) else None
    if value is None:
        return None
    found = find_constant(value, f"{attribute or 'input'} of {describe(node)}")
    if isinstance(found, Reason):
        return found
    return [int(v) for v in found.array.reshape(-1)]


def _read_dims(value: ir.Value | None) -> list[algebra.Dim] | None:
    if value is None or value.shape is None:
        return None
    return [d if isinstance(d, int) else (d.value if d.value else None) for d in value.shape]


class _Context:
    """What an axis map may ask: the opset, and a value's dims (shapes inferred on demand)."""

    def __init__(self, opset: int, ensure_shapes: Callable[..., None]):
        self.opset, self._ensure_shapes = opset, ensure_shapes

    def dims(self, value: ir.Value | None, symbolic: bool = False) -> list[algebra.Dim] | None:
        """``symbolic``: when onnx's inference leaves a size unknown, ask ONNX Runtime's."""
        if value is not None and value.shape is None:
            self._ensure_shapes()
        if value is not None and symbolic and (value.shape is None or not all(isinstance(d, int) for d in value.shape)):
            self._ensure_shapes(symbolic=True)
        return _read_dims(value)


def _transpose(node, rank, axis, channels, ctx):
    perm = node.attributes.get("perm")
    order = [int(p) for p in perm.value] if perm is not None else list(range(rank))[::-1]
    if sorted(p % rank for p in order) != list(range(rank)):
        return Reason(f"{describe(node)} has perm {order}, not a permutation of {rank} axes")
    return rank, algebra.permuted_axis(order, axis)


def _squeeze(node, rank, axis, channels, ctx):
    axes = _constant_ints(node, 1, "axes", ctx.opset, 13)
    if isinstance(axes, Reason):
        return axes
    if axes is None:  # the dims of size 1, which needs a static shape
        dims = ctx.dims(node.inputs[0])
        if dims is None or any(d is None or isinstance(d, str) for d in dims):
            return Reason(f"{describe(node)} has no axes and its input's shape is not static, so which axes go "
                          "is unknown")
        axes = [i for i, d in enumerate(dims) if d == 1]
    landed = algebra.squeezed_axis(axes, rank, axis)
    if landed is None:
        return Reason(f"{describe(node)} squeezes the channel axis {axis}")
    return rank - len(set(a % rank for a in axes)), landed


def _unsqueeze(node, rank, axis, channels, ctx):
    axes = _constant_ints(node, 1, "axes", ctx.opset, 13)
    if isinstance(axes, Reason):
        return axes
    if not axes:
        return Reason(f"{describe(node)} has no axes")
    return rank + len(axes), algebra.unsqueezed_axis(axes, rank, axis)


def _slice(node, rank, axis, channels, ctx):
    if ctx.opset and ctx.opset < 10:
        starts, ends, axes = (_constant_ints(node, 0, a, ctx.opset, 10) for a in ("starts", "ends", "axes"))
        steps = None
    else:
        starts, ends, axes, steps = (_constant_ints(node, i, None, ctx.opset, 0) for i in (1, 2, 3, 4))
    for found in (starts, ends, axes, steps):
        if isinstance(found, Reason):
            return found
    if starts is None or ends is None:
        return Reason(f"{describe(node)} has no starts or ends")
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    for a, start, end, step in zip(axes, starts, ends, steps):
        if a % rank != axis:
            continue
        start, end = (v + channels if v < 0 else v for v in (start, end))
        if step != 1 or max(start, 0) != 0 or end < channels:
            return Reason(f"{describe(node)} slices the channel axis {axis} "
                    f"(start {start}, end {end}, step {step}), keeping only some channels")
    return rank, axis


def _shown(dims) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _reshaped(node, in_dims, out_dims, axis):
    landed = algebra.reshaped_axis(in_dims, out_dims, axis)
    if landed is None:
        return Reason(f"{describe(node)} reshapes {_shown(in_dims)} to {_shown(out_dims)}: opfuse cannot prove "
                f"the channel axis {axis} stays one whole axis (a symbolic or unknown dim would have "
                "to equal another)")
    return len(out_dims), landed


def _reshape(node, rank, axis, channels, ctx):
    in_dims = ctx.dims(node.inputs[0])
    target = _constant_ints(node, 1, None, ctx.opset, 0)
    if isinstance(target, Reason):
        return _computed_reshape(node, rank, axis, channels, ctx, target)
    if target is None:
        return Reason(f"{describe(node)} has no shape input")
    if in_dims is None or len(in_dims) != rank:
        return Reason(f"the input shape of {describe(node)} is unknown")
    in_dims[axis] = channels  # (known from the weight even where inference lost it)
    allow_zero = int_attr(node, "allowzero", 0)
    out: list[algebra.Dim] = [in_dims[i] if t == 0 and not allow_zero and i < rank else t for i, t in enumerate(target)]
    if -1 in out:  # the one inferred size
        out[out.index(-1)] = algebra.inferred_dim(in_dims, [d for d in out if d != -1])
    return _reshaped(node, in_dims, out, axis)


def _computed_reshape(node, rank, axis, channels, ctx, why: Reason):
    """A Reshape whose target is computed at run time: its output's inferred dims, static
    sizes only (module docstring, rule 5)."""
    out_dims = ctx.dims(node.outputs[0], symbolic=True)
    in_dims = ctx.dims(node.inputs[0])
    if out_dims is None or in_dims is None or len(in_dims) != rank:
        return Reason(f"{why.sentence}, and shape inference does not give the dims it makes")
    static = lambda dims: [d if isinstance(d, int) else None for d in dims]  # noqa: E731
    in_dims, out_dims = static(in_dims), static(out_dims)
    in_dims[axis] = channels  # (known from the weight)
    landed = algebra.reshaped_axis(in_dims, out_dims, axis)
    if landed is None:
        return Reason(f"{why.sentence}, and the static sizes inferred, {_shown(in_dims)} to {_shown(out_dims)}, "
                      f"do not prove the channel axis {axis} stays one whole axis")
    return len(out_dims), landed


def _flatten(node, rank, axis, channels, ctx):
    """Flatten(k) makes [prod(in[:k]), prod(in[k:])]: the channel axis stays whole on the
    output axis of its group when every other dim of that group is a static 1."""
    in_dims = ctx.dims(node.inputs[0])
    if in_dims is None or len(in_dims) != rank:
        return Reason(f"the input shape of {describe(node)} is unknown")
    k = int_attr(node, "axis", 1)
    k = k + rank if k < 0 else k
    group = range(0, k) if axis < k else range(k, rank)
    others = [in_dims[i] for i in group if i != axis]
    if any(d != 1 for d in others):
        return Reason(f"{describe(node)} flattens {_shown(in_dims)} at axis {k}, merging the channel axis {axis} with "
                "other axes that are not known to be 1")
    return 2, 0 if axis < k else 1


# layout op -> how it moves the channel axis: (node, rank, axis, channels, context) -> (rank, axis) | Reason
AXIS_MAPS: dict[str, Callable] = {
    "Identity": lambda node, rank, axis, channels, ctx: (rank, axis),
    "Transpose": _transpose,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Slice": _slice,
    "Reshape": _reshape,
    "Flatten": _flatten,
}


def _is_layout(node: ir.Node | None) -> bool:
    return node is not None and node.domain in ONNX_DOMAINS and node.op_type in AXIS_MAPS


def trace_through_layout(value: ir.Value) -> tuple[ir.Node | None, list[ir.Node]]:
    """Walk back from ``value`` through Identity and layout ops (each reading its input 0);
    return (the node that computes it, the nodes passed, producer side first)."""
    chain: list[ir.Node] = []
    node = value.producer()
    while _is_layout(node):
        chain.append(node)
        source = node.inputs[0]
        node = source.producer() if source is not None else None
    return node, chain[::-1]


def has_layout_op(chain: Sequence[ir.Node]) -> bool:
    """Whether the chain moves data (anything but Identity)."""
    return any(n.op_type != "Identity" for n in chain)


def describe_chain(chain: Sequence[ir.Node]) -> str:
    return " -> ".join(describe(n) for n in chain if n.op_type != "Identity")


def follow_channel(chain: Sequence[ir.Node], rank: int, axis: int, channels: int, opset: int,
                   ensure_shapes: Callable[[], None]) -> ChannelAxis | Reason:
    """(rank, channel axis) of the chain's last output, given the producer's; or why the
    chain does not keep the channel axis whole. ``ensure_shapes`` infers shapes (once) when
    a Reshape, Flatten or Squeeze needs its input's dims and they are unknown."""
    ctx = _Context(opset, ensure_shapes)
    for node in chain:
        found = AXIS_MAPS[node.op_type](node, rank, axis, channels, ctx)
        if isinstance(found, Reason):
            return found
        rank, axis = found
    return rank, axis
