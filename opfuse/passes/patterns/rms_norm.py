"""RMSNorm written out, in every exporter's spelling -> RMSNormalization (opset 23) or ONNX
Runtime's SimplifiedLayerNormalization.

Algebra (over the last axis; an optional Cast to a compute dtype before and back after):

    y = x * Reciprocal(Sqrt(ReduceMean(x^2) + eps)) * scale
      = RMSNormalization(x, scale, axis=-1, epsilon=eps, stash_type=compute dtype)

The spellings (each with the scale Mul's operands either way round, the Casts present or not):

    normalised = x * Reciprocal(rms)          dynamo (torch.rsqrt as Reciprocal(Sqrt))
    normalised = x * Div(1, rms)              TorchScript (torch.rsqrt as Div(1, Sqrt))
    ReduceMean's axes an attribute (opset < 18) or a constant input (18+)

The check and the rewrite are onnxscript's (``rules/fusion/_rms_normalization.py`` for the
standard op, ``ort_fusions/rms_normalization.py`` for ONNX Runtime's, which its CPU provider
registers in the default domain); opfuse writes the pattern wider than theirs (the spellings
above, with the constants and the reduction as variables) and adds the checks they leave out.
``Div(x, rms)`` is not among them: no exporter writes an RMSNorm so, and a LayerNorm whose
centred x is used elsewhere would become an RMSNorm of it in place of LayerNorm's refusal.

Legality (the rule that fails is the refusal's reason):

1. The exponent is a constant equal to 2, and Div(1, rms)'s numerator a constant equal to 1.
2. ReduceMean reduces the last axis alone ([-1], or [r - 1] for x of known rank r), from an
   attribute or a constant input, and keeps it (keepdims 1).
3. eps is a constant with one element (onnxscript: a float); a per-element eps, or one
   computed at run time, is not the op's epsilon attribute.
4. x and scale are float; the compute dtype is float or double (onnxscript's checks).
5. scale is a constant that varies along the last axis only (a [D] tensor or a scalar; a
   scale computed at run time, or varying along other axes, is not the op's Scale).
6. The standard form needs opset 23.
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

import numpy as np
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions import rms_normalization as ort_rms
from onnxscript.rewriter.rules.fusion import _rms_normalization as onnx_rms

from opfuse.passes.patterns import constant_array, opset_problem, reduce_axes, trailing_axis

TITLE = "RMSNorm->RMSNormalization"
# how rsqrt is spelled: x * Reciprocal(rms), x * Div(1, rms); x first or second in the Mul
_SPELLINGS = (("reciprocal", True), ("reciprocal", False), ("div-one", True), ("div-one", False))


def _scale_problem(scale) -> str | None:
    array = constant_array(scale)
    if array is None:
        return "its scale is not a constant"
    if array.size != 1 and (array.ndim < 1 or any(d != 1 for d in array.shape[:-1])):
        return f"its scale has shape {list(array.shape)}: it varies along more than the last axis"
    return None


def _constant_problem(value, expected: float, what: str) -> str | None:
    array = constant_array(value)
    if array is None or array.size != 1 or float(array.reshape(-1)[0]) != expected:
        found = "computed at run time" if array is None else f"{array.reshape(-1)[:4].tolist()}"
        return f"its {what} is {found}, not the constant {expected:g}"
    return None


def _epsilon_problem(epsilon) -> str | None:
    array = constant_array(epsilon)
    if array is None:
        return "its epsilon is computed at run time: the op's epsilon is a constant attribute"
    if array.size != 1:
        return f"its epsilon has shape {list(array.shape)}: the op's epsilon is one number"
    if not np.issubdtype(array.dtype, np.floating):
        return f"its epsilon is {array.dtype}, not a float"
    return None


def _reduction_problem(x, mean_square) -> str | None:
    node = mean_square.producer()
    axes = reduce_axes(node)
    if axes is None:
        return "its ReduceMean axes are not constants"
    keep = node.attributes.get("keepdims")
    if keep is not None and keep.value != 1:
        return "its ReduceMean drops the reduced axis (keepdims=0)"
    rank = len(x.shape) if x.shape is not None else None
    if len(axes) != 1 or trailing_axis(axes, rank) != -1:
        return f"its ReduceMean reduces axes {axes}: RMSNorm normalises the last axis alone"
    return None


class _Spellings:
    """The pattern of every spelling (mixed into onnxscript's rule, whose check and rewrite it keeps)."""

    cast_scale = False  # ONNX Runtime's rule also takes Cast(scale) (onnxscript's float16 support)

    def __init__(self, name: str, mul_order: bool, rsqrt: str, x_first: bool):
        super().__init__(name, mul_order)
        self._rsqrt, self._x_first = rsqrt, x_first

    def pattern(self, op, x, scale, epsilon, compute_dtype, target_dtype, exponent, one):
        x = pattern.OrValue([op.Cast(x, to=compute_dtype), x])
        mean_square = op.ReduceMean(op.Pow(x, exponent), _allow_other_inputs=True, _allow_other_attributes=True,
                                    _outputs=["mean_square"])
        rms = op.Sqrt(op.Add(mean_square, epsilon))
        inverse = op.Reciprocal(rms) if self._rsqrt == "reciprocal" else op.Div(one, rms)
        normalized = op.Mul(x, inverse) if self._x_first else op.Mul(inverse, x)
        normalized = pattern.OrValue([op.Cast(normalized, to=target_dtype), normalized])
        if self.cast_scale:
            scale = pattern.OrValue([op.Cast(scale, to=compute_dtype), scale])
        return op.Mul(normalized, scale) if self._mul_order else op.Mul(scale, normalized)

    def check(self, context, x, scale, epsilon, compute_dtype, target_dtype, exponent, one=None, mean_square=None,
              **rest):
        problem = (self._form_problem(context) or _constant_problem(exponent, 2.0, "exponent")
                   or (_constant_problem(one, 1.0, "numerator") if self._rsqrt == "div-one" else None)
                   or _reduction_problem(x, mean_square) or _epsilon_problem(epsilon) or _scale_problem(scale))
        if problem:
            return pattern.MatchResult().fail(problem)
        return super().check(context, x, scale, epsilon, compute_dtype, target_dtype, **rest)

    def _form_problem(self, context) -> str | None:
        return None


class StandardRmsNorm(_Spellings, onnx_rms.RmsNormFusion):
    def _form_problem(self, context) -> str | None:
        return opset_problem(context, "RMSNormalization", 23)


class OrtRmsNorm(_Spellings, ort_rms.RmsNormFusion):
    cast_scale = True


def stages(form: str, approximate: bool = False):
    rule, name = ((StandardRmsNorm, "RMSNorm->RMSNormalization") if form == "standard"
                  else (OrtRmsNorm, "RMSNorm->SimplifiedLayerNormalization"))
    return [[rule.rule(f"{name} ({rsqrt}{'' if x_first else ', x second'})", order, rsqrt, x_first)
             for rsqrt, x_first in _SPELLINGS for order in (True, False)]]
