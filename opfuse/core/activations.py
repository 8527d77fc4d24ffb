"""Activations as values: read off a node by the op table, merged, shown.

An :class:`Activation` is what a fused kernel's epilogue applies: the ONNX op it computes
and its parameters, in the order of the op's :class:`~opfuse.core.ops.ActivationSpec`
(LeakyRelu: alpha; HardSigmoid: alpha, beta; Clip: min, max; Gelu: approximate). A target
encodes it into its kernel's attributes (:mod:`opfuse.targets.kernels`); nothing else
knows an activation's parameters.

Reading (:func:`read_activation`):

- attribute parameters take the node's value, else the schema's default (from the table);
- Clip's bounds (:func:`clip_bounds`) are attributes below opset 11 and constant inputs 1
  and 2 from opset 11; an absent bound is the dtype's own limit. A bound that is not a
  constant scalar, a NaN bound, or a lower bound above the upper one is a reason, not an
  activation;
- PRelu's slope is an operand (input 1), not a parameter: it reads as ``PRelu`` with no
  parameters, and no kernel opfuse knows takes it.

Merging (:func:`merge_activations`), when two consecutive activations are one:

    Relu then Relu               = Relu
    Clip(c, d) then Clip(a, b)   = Clip(clamp(c, a, b), clamp(d, a, b))
                                   (Relu is Clip(0, inf): Relu then Clip(a, b) is
                                   Clip(clamp(0, a, b), b); Clip(c, d) then Relu is
                                   Clip(max(c, 0), max(d, 0)))
"""

from __future__ import annotations

__all__ = ["Activation", "read_activation", "clip_bounds", "merge_activations", "clamp_of"]

import dataclasses
import math

import ml_dtypes
import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import describe, find_constant
from opfuse.report import Reason
from opfuse.core.ops import float_attr, op_info, str_attr


@dataclasses.dataclass(frozen=True)
class Activation:
    """An activation in kernel terms: the ONNX op it computes and its parameters."""

    op: str
    params: tuple[float | str, ...] = ()

    def __str__(self) -> str:
        shown = ", ".join(f"{p:g}" if isinstance(p, float) else str(p) for p in self.params)
        return self.op + (f"({shown})" if self.params else "")


def clip_bounds(node: ir.Node, opset: int) -> tuple[float, float] | Reason:
    """(lo, hi) of a Clip, -inf/inf for an absent bound; the :class:`Reason` when they are unusable."""
    if "min" in node.attributes or "max" in node.attributes or (opset and opset < 11):
        bounds = [float_attr(node, "min", -math.inf), float_attr(node, "max", math.inf)]
    else:
        bounds = [-math.inf, math.inf]
        for i, which in ((1, "lower"), (2, "upper")):
            if i < len(node.inputs) and node.inputs[i] is not None:
                found = find_constant(node.inputs[i], f"{which} bound of {describe(node)}")
                if isinstance(found, Reason):
                    return Reason(f"its {which} bound is not a constant: {found.sentence}")
                if found.array.size != 1:
                    return Reason(f"the {which} bound of {describe(node)} is not a scalar")
                bounds[i - 1] = float(found.array.reshape(-1)[0])
    if any(math.isnan(b) for b in bounds):
        return Reason(f"{describe(node)} has a NaN bound")
    if bounds[0] > bounds[1]:
        return Reason(f"the lower bound of {describe(node)} ({bounds[0]:g}) exceeds its upper bound ({bounds[1]:g})")
    return bounds[0], bounds[1]


def read_activation(node: ir.Node, opset: int) -> Activation | str | None:
    """The node as an Activation; a reason when it is one but unusable; None when it is not."""
    info = op_info(node)
    spec = info.activation if info is not None else None
    if spec is None:
        return None
    if spec.bounds_from_inputs:
        bounds = clip_bounds(node, opset)
        if isinstance(bounds, Reason):
            return bounds.sentence
        limit = float(ml_dtypes.finfo(_dtype(node)).max)
        return Activation(node.op_type, tuple(float(np.clip(b, -limit, limit)) for b in bounds))
    params = tuple(
        str_attr(node, name, default) if isinstance(default, str) else float_attr(node, name, default)
        for name, default in spec.params
    )
    return Activation(node.op_type, params)


def merge_activations(first: Activation, then: Activation) -> Activation | None:
    """One activation computing ``then(first(x))``, or None when there is none.

    Relu is Clip(0, inf), and clamping to [c, d] then to [a, b] is clamping to
    [clamp(c, a, b), clamp(d, a, b)]."""
    if first.op == "Relu" and then.op == "Relu":
        return first
    if {first.op, then.op} <= {"Relu", "Clip"}:
        (c, d), (a, b) = _clamp(first), _clamp(then)
        return Activation("Clip", (min(max(c, a), b), min(max(d, a), b)))
    return None


def _clamp(act: Activation) -> tuple[float, float]:
    return (0.0, math.inf) if act.op == "Relu" else (float(act.params[0]), float(act.params[1]))


def clamp_of(act: Activation) -> tuple[float, float] | None:
    """(lo, hi) of an activation that clamps (Relu, Clip), None for any other."""
    return _clamp(act) if act.op in ("Relu", "Clip") else None


def _dtype(node: ir.Node):
    x = node.inputs[0] if node.inputs else None
    if x is not None and x.dtype is not None:
        try:
            return x.dtype.numpy()
        except TypeError:
            pass
    return np.float32
