"""RMSNorm written out -> RMSNormalization (opset 23) or ONNX Runtime's
SimplifiedLayerNormalization.

Algebra (over the last axis; an optional Cast to a compute dtype before and back after):

    y = x * Reciprocal(Sqrt(ReduceMean(x^2) + eps)) * scale
      = RMSNormalization(x, scale, axis=-1, epsilon=eps, stash_type=compute dtype)

The rules are onnxscript's (``rules/fusion/_rms_normalization.py`` for the standard op,
``ort_fusions/rms_normalization.py`` for ONNX Runtime's, which its CPU provider registers
in the default domain); opfuse adds the checks they leave out.

Legality: eps is a float constant scalar; x and scale are float; the compute dtype is
float or double (onnxscript's checks); scale is a constant that varies along the last
axis only (a [D] tensor or a scalar; opfuse's check: a scale tensor computed at run time, or
one varying along other axes, is not the op's Scale); standard form needs opset 23.
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions import rms_normalization as ort_rms
from onnxscript.rewriter.rules.fusion import _rms_normalization as onnx_rms

from opfuse.passes.patterns import constant_array, opset_problem

TITLE = "RMSNorm->RMSNormalization"


def _scale_problem(scale) -> str | None:
    array = constant_array(scale)
    if array is None:
        return "its scale is not a constant"
    if array.size != 1 and (array.ndim < 1 or any(d != 1 for d in array.shape[:-1])):
        return f"its scale has shape {list(array.shape)}: it varies along more than the last axis"
    return None


class StandardRmsNorm(onnx_rms.RmsNormFusion):
    def check(self, context, x, scale, epsilon, compute_dtype, target_dtype, **rest):
        problem = opset_problem(context, "RMSNormalization", 23) or _scale_problem(scale)
        if problem:
            return pattern.MatchResult().fail(problem)
        return super().check(context, x, scale, epsilon, compute_dtype, target_dtype, **rest)


class OrtRmsNorm(ort_rms.RmsNormFusion):
    def check(self, context, x, scale, epsilon, compute_dtype, target_dtype, **rest):
        problem = _scale_problem(scale)
        if problem:
            return pattern.MatchResult().fail(problem)
        return super().check(context, x, scale, epsilon, compute_dtype, target_dtype, **rest)


def stages(form: str, approximate: bool = False):
    if form == "standard":
        return [[StandardRmsNorm.rule("RMSNorm->RMSNormalization", mul_order=order) for order in (True, False)]]
    return [[OrtRmsNorm.rule("RMSNorm->SimplifiedLayerNormalization", _mul_order=order) for order in (False, True)]]
