"""LayerNorm written out in primitives -> LayerNormalization.

Algebra (over the normalised axes, the last k of x's r axes):

    mean = ReduceMean(x)            d   = x - mean
    var  = ReduceMean(d * d)        (or Pow(d, 2))
    y    = d / Sqrt(var + eps)      (or d * Reciprocal(Sqrt(var + eps)))
         [* scale] [+ bias]

is ``LayerNormalization(x, scale, bias, axis=r-k, epsilon=eps)`` exactly: the op's
definition is this computation (ONNX's function body), with the statistics in float32
(``stash_type``) for float16 / bfloat16 inputs, which the primitives compute in the input's
dtype (the fused op is then the more accurate one; the difference is float16 rounding).

Legality, each failure a refusal:

1. Both ReduceMeans reduce the same axes, keeping them (keepdims 1), and those axes are the
   trailing ones: [-1], [-2, -1]..., or [r-k, ..., r-1] when x's rank r is known. Axes come
   as an attribute (opset < 18) or a constant input (opset 18+).
2. eps is a constant scalar; x is floating point.
3. scale and bias, when present, are constants that vary only along the normalised axes
   (after leading 1s, their shape is the normalised shape, or they are scalars, which are
   broadcast to it: the normalised dims must then be static). They join in a second stage,
   each a rule of its own, so the core fuses even where a scale does not (a per-position
   Mul stays after it, with the reason): ``LN(x, s, b) * c = LN(x, s c, b c)`` and
   ``LN(x, s, b) + c = LN(x, s, b + c)``, computed in float64 and cast once; the same
   rules take constants into a LayerNormalization the exporter wrote.
4. The intermediate tensors have no consumer outside the pattern (the pass checks).
5. Standard form: the model's opset is 17 or more (ONNX Runtime runs LayerNormalization at
   any opset).
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

TITLE = "LayerNorm->LayerNormalization"
RECORD_TITLES = {"LayerNormalization*c->scale": "LayerNormalization+Mul->scale",
                 "LayerNormalization+c->bias": "LayerNormalization+Add->bias"}

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from opfuse.passes.patterns import constant_array, opset_problem, reduce_axes as _axes, trailing_axis as _trailing
from opfuse.report import Reason
from opfuse.core.ops import FLOAT_DTYPES, dtype_name

_STASH_FLOAT = 1  # LayerNormalization's stash_type for float32 statistics


class LayerNormFusion(pattern.RewriteRuleClassBase):
    """The primitives of a LayerNorm's core -> LayerNormalization with scale 1 (stage 1)."""

    def __init__(self, form: str, axes_as_input: bool, divide: bool, power: bool):
        super().__init__(name="LayerNorm->LayerNormalization")
        self.form, self.axes_as_input, self.divide, self.power = form, axes_as_input, divide, power

    def _mean(self, op, value, axes, name):
        if self.axes_as_input:
            return op.ReduceMean(value, axes, _allow_other_attributes=True, _outputs=[name])
        return op.ReduceMean(value, _allow_other_attributes=True, _outputs=[name])

    def pattern(self, op, x, axes, axes2, epsilon):
        mean = self._mean(op, x, axes, "mean")
        d = op.Sub(x, mean)
        dd = op.Pow(d, 2.0) if self.power else op.Mul(d, d)
        var = self._mean(op, dd, axes2, "var")
        std = op.Sqrt(op.Add(var, epsilon))
        return op.Div(d, std) if self.divide else op.Mul(d, op.Reciprocal(std))

    def check(self, context, x, epsilon, mean, var, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if self.form == "standard":
            problem = opset_problem(context, "LayerNormalization", 17)
            if problem:
                return result.fail(problem)
        if dtype_name(x.dtype) not in FLOAT_DTYPES:
            return result.fail(f"its input is {dtype_name(x.dtype) or 'of unknown dtype'}, not floating point", x)
        axes, axes2 = _axes(mean.producer()), _axes(var.producer())
        if axes is None or axes2 is None:
            return result.fail("its ReduceMean axes are not constants", mean)
        for node in (mean.producer(), var.producer()):
            keep = node.attributes.get("keepdims")
            if keep is not None and int(keep.value) != 1:
                return result.fail("a ReduceMean drops the reduced axes (keepdims=0)", node)
        rank = len(x.shape) if x.shape is not None else None
        first, first2 = _trailing(axes, rank), _trailing(axes2, rank)
        if first is None or first != first2:
            return result.fail(f"it reduces axes {axes} and {axes2}: not the same trailing axes "
                               f"(rank {rank if rank is not None else 'unknown'})", mean)
        eps = constant_array(epsilon)
        if eps is None or eps.size != 1:
            return result.fail("its epsilon is not a constant scalar", epsilon)
        ones = _fit(np.ones(1), list(x.shape)[first:] if x.shape is not None else None)
        if isinstance(ones, Reason):
            return result.fail(f"LayerNormalization needs a scale, and one of 1 {ones.sentence}")
        self._scale = ones.astype(np.dtype(x.dtype.numpy()))
        self._axis, self._epsilon = first, float(eps.reshape(-1)[0])
        return result

    def rewrite(self, op, x, **_):
        scale = op.initializer(ir.tensor(self._scale), name="ln_scale")
        return op.LayerNormalization(x, scale, axis=self._axis, epsilon=self._epsilon, stash_type=_STASH_FLOAT)


class LayerNormAffine(pattern.RewriteRuleClassBase):
    """LayerNormalization then a constant Mul or Add over its normalised axes -> its scale
    and bias (stage 2; exact: LN(x, s, b) * c = LN(x, s c, b c), LN(x, s, b) + c = LN(x, s, b + c))."""

    def __init__(self, multiply: bool, biased: bool):
        super().__init__(name="LayerNormalization*c->scale" if multiply else "LayerNormalization+c->bias")
        self.multiply, self.biased = multiply, biased

    def pattern(self, op, x, scale, bias, c):
        inputs = (x, scale, bias) if self.biased else (x, scale)
        ln = op.LayerNormalization(*inputs, _allow_other_attributes=True, _outputs=["ln"])
        return op.Mul(ln, c) if self.multiply else op.Add(ln, c)

    def check(self, context, x, scale, ln, c, bias=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        node = ln.producer()
        axis = int(node.attributes["axis"].value) if "axis" in node.attributes else -1
        if x.shape is None and axis >= 0:
            return result.fail("the rank of its input is unknown", x)
        first = axis if axis < 0 else axis - len(x.shape)
        normalized = list(x.shape)[first:] if x.shape is not None else None
        arrays = {"scale": constant_array(scale), "constant": constant_array(c)}
        if self.biased:
            arrays["bias"] = constant_array(bias)
        for role, array in arrays.items():
            if array is None:
                return result.fail(f"its {role} is not a constant", c if role == "constant" else scale)
        fitted = {}
        for role, array in arrays.items():
            fit = _fit(array, normalized)
            if isinstance(fit, Reason):
                what = f"the constant it is {'multiplied by' if self.multiply else 'added to'}"
                return result.fail(f"{what if role == 'constant' else 'its ' + role} {fit.sentence}", c)
            fitted[role] = fit.astype(np.float64)
        dtype = np.dtype(x.dtype.numpy())
        s, b, k = fitted["scale"], fitted.get("bias", 0.0), fitted["constant"]
        self._scale = (s * k if self.multiply else s).astype(dtype)
        if self.multiply:
            bias = b * k if self.biased else None
        else:
            bias = b + k
        self._bias = None if bias is None else np.broadcast_to(bias, self._scale.shape).astype(dtype)
        self._attributes = {k: v for k, v in node.attributes.items()}
        return result

    def rewrite(self, op, x, **_):
        inputs = [x, op.initializer(ir.tensor(self._scale), name="ln_scale")]
        if self._bias is not None:
            inputs.append(op.initializer(ir.tensor(self._bias), name="ln_bias"))
        return op.LayerNormalization(*inputs, **self._attributes)


def _fit(array: np.ndarray, normalized: list | None) -> np.ndarray | Reason:
    """``array`` as a tensor of the normalised shape, or why it does not vary along it only."""
    shape = list(array.shape)
    while shape and shape[0] == 1 and (normalized is None or len(shape) > len(normalized)):
        shape.pop(0)
    if normalized is not None and all(isinstance(d, int) for d in normalized):
        if shape == list(normalized):
            return array.reshape(normalized)
        if array.size == 1:
            return np.full(normalized, array.reshape(-1)[0])
        return Reason(f"has shape {list(array.shape)}, not the normalised shape {list(normalized)}")
    if array.size != 1 and len(shape) == 1 and normalized is not None and len(normalized) == 1:
        return array.reshape(shape)  # [D] over a symbolic last axis: LayerNormalization checks D
    return Reason(f"has shape {list(array.shape)} over normalised axes of unknown size")


def stages(form: str, approximate: bool = False):
    # (explicit variants, not onnxscript's OrValue: its commuted copies fail to clone one)
    core = [LayerNormFusion.rule(form, axes_as_input, divide, power)
            for axes_as_input in (False, True) for divide in (True, False) for power in (True, False)]
    affine = [LayerNormAffine.rule(multiply, biased) for multiply in (True, False) for biased in (True, False)]
    return [core, affine]
