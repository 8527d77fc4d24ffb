"""Fold a constant Add, Sub, Mul or Div, or a Neg, into the Conv, ConvTranspose or Gemm before it.

Algebra, with y the producer's output and c a constant per output channel:

    y + c, c + y  ->  s = 1,    t = c          y * c, c * y  ->  s = c,    t = 0
    y - c         ->  s = 1,    t = -c         y / c         ->  s = 1/c,  t = 0
    c - y         ->  s = -1,   t = c          c / y            not affine: refused
    -y (Neg)      ->  s = -1,   t = 0          (tf2onnx writes it between a conv and a Transpose)

then W' = s[o] * W[o], b' = s * b + t as for every fold (float64, cast back once).

Legality, beyond the common rules in :mod:`opfuse.passes.folding`:

1. The other operand is a constant (an initializer that is not a graph input, or a
   Constant node).
2. It broadcasts along the output-channel axis only: a scalar, or a shape whose entries
   are all 1 except the channel axis (C or 1) once right-aligned with the output:
   [C,1,1] or [1,C,1,1] after a 2-D Conv, [C] or [1,C] after Gemm. Anything else is
   refused even when a length equals C: a rank-1 [C] after a Conv aligns with the last
   (width) axis, [1,1,1,C] and [1,1,H,1] vary along space, and a constant of higher rank
   than the output would change the output's shape. Through layout ops
   (:mod:`opfuse.passes.layout_chain`) "the channel axis" is where they put it: after
   ``Conv -> Transpose(0,2,3,1)`` a [C] or [1,1,1,C] constant is per channel, [C,1,1] is not.
3. Division by a constant with a zero entry is refused.
4. A MatMul producer (only through layout ops: ``MatMul -> Reshape -> Add``, TensorFlow's
   Dense on 3-D input) keeps its op for a scale (Mul, Div: its weight's columns scale) and
   becomes a Gemm for a shift, which needs its input to be known to be 2-D.
"""

from __future__ import annotations

__all__ = ["FoldArithmeticPass"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import describe, find_constant, trace_producer
from opfuse.passes.folding import ChannelAffine, FoldPass, ProducerShape
from opfuse.report import Reason
from opfuse.core.ops import FLOAT_DTYPES, OPS, WEIGHTED_OPS, is_op

AXIS_NAMES = {0: "batch", 1: "channel"}


class FoldArithmeticPass(FoldPass):
    """Absorb constant Add/Sub/Mul/Div along the output-channel axis."""

    name = "fold-arithmetic"
    consumer_ops = frozenset({"Add", "Sub", "Mul", "Div", "Neg"})
    # a bias to absorb t; and MatMul through layout ops (it becomes a Gemm: see is_candidate)
    producer_ops = frozenset(op for op in WEIGHTED_OPS if OPS[op].weights.bias is not None or OPS[op].weights.batched)

    def producer_sides(self, node: ir.Node):
        return (0,) if len(node.inputs) == 1 else (0, 1)

    def is_candidate(self, cand) -> bool:
        """Only a constant, or a parameter that looks like one (a graph input), is a
        candidate: an operand computed by another node (a residual branch) is not. A MatMul
        is one only through layout ops (TensorFlow's Dense on 3-D input: MatMul -> Reshape ->
        Add); MatMul + Add is the matmul-add pattern's (:mod:`opfuse.passes.patterns.matmul_add`)."""
        if cand.info.spec.bias is None and not cand.layout:
            return False
        if cand.consumer.op_type == "Neg":
            return True
        other = cand.consumer.inputs[1 - cand.side]
        if other is None:
            return False
        source, _ = trace_producer(other)
        return source is None or is_op(source, "Constant")

    def affine(self, cand, out: ProducerShape) -> ChannelAffine | Reason:
        node, side = cand.consumer, cand.side
        op = node.op_type
        if op == "Neg":
            return ChannelAffine(np.array([-1.0]), None, detail="negated")
        other = node.inputs[1 - side]
        const = find_constant(other, "other operand")
        if isinstance(const, Reason):
            return const
        c = const.array
        if str(c.dtype) not in FLOAT_DTYPES:
            return Reason(f"its constant is {c.dtype}, not floating point")
        per_channel = _per_channel(c, out, describe(cand.producer), through_layout=bool(cand.layout))
        if isinstance(per_channel, Reason):
            return per_channel
        shown = _show(c)
        if op == "Add":
            return ChannelAffine(None, per_channel, detail=f"+ {shown}")
        if op == "Mul":
            return ChannelAffine(per_channel, None, detail=f"* {shown}")
        if op == "Sub":
            if side == 0:
                return ChannelAffine(None, -per_channel, detail=f"- {shown}")
            return ChannelAffine(-np.ones_like(per_channel), per_channel, detail=f"{shown} - y")
        # Div
        if side == 1:
            return Reason("the producer's output is the divisor (c / y is not affine in y)")
        if np.any(per_channel == 0):
            return Reason("its constant divisor has a zero entry")
        return ChannelAffine(1.0 / per_channel, None, detail=f"/ {shown}")


def _per_channel(c: np.ndarray, out: ProducerShape, producer: str, through_layout: bool = False) -> np.ndarray | Reason:
    """The constant as float64 values per output channel, or the :class:`Reason` it is not one. ``out`` is
    the consumer's view: after layout ops, the rank and channel axis they leave."""
    values = c.astype(np.float64)
    if values.ndim == 0 or values.size == 1:
        if out.rank is not None and values.ndim > out.rank:
            return Reason(f"its constant has rank {values.ndim}, which would raise the output's rank")
        return values.reshape(1)
    if out.rank is None:
        return Reason(f"the rank of {producer}'s output is unknown")
    if values.ndim > out.rank:
        return Reason(
            f"its constant has shape {list(c.shape)}, of higher rank than the "
            f"{out.rank}-D output, so it would change the output's shape"
        )
    aligned = (1,) * (out.rank - values.ndim) + values.shape
    axis = out.channel_axis % out.rank
    varying = [i for i, n in enumerate(aligned) if n != 1 and i != axis]
    if varying:
        i = varying[0]
        what = "other" if through_layout else AXIS_NAMES.get(i, "spatial")
        hint = ""
        if values.ndim == 1 and c.shape[0] == out.channels and not through_layout:
            hint = (
                f" (a rank-1 constant aligns with the last axis, not the channel axis; "
                f"write it as [{out.channels}" + ", 1" * (out.rank - 2) + "])"
            )
        return Reason(
            f"its constant of shape {list(c.shape)} varies along the {what} axis {i} "
            f"of {'its input' if through_layout else 'the output'}, not only along the channel axis {axis}{hint}"
        )
    if aligned[axis] not in (1, out.channels):
        return Reason(
            f"its constant has {aligned[axis]} values along the channel axis, but "
            f"{producer} has {out.channels} output channels"
        )
    return values.reshape(-1)


def _show(c: np.ndarray) -> str:
    if c.size == 1:
        return f"{float(c.reshape(-1)[0]):g}"
    return f"constant{list(c.shape)}"
