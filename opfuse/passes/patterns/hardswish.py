"""HardSwish and HardSigmoid written out -> HardSwish (opset 14) / HardSigmoid.

Algebra:

    Clip(x + 3, 0, 6) / 6  = clamp(x/6 + 1/2, 0, 1)      = HardSigmoid(x, alpha=1/6, beta=1/2)
    x * HardSigmoid(x; 1/6, 1/2)                          = HardSwish(x)
    x * Clip(x + 3, 0, 6) / 6                             = HardSwish(x)

Exporters write the division as ``Div(., 6)`` or ``Mul(., 1/6)``, apply it to the Clip or
to the product with x (tf2onnx: ``x * Relu6(x + 3) * 0.16666667``), and write the clamp as
Clip with bound inputs (opset 11+) or attributes (before). Constants match within
relative 1e-4 (0.16666667 is 1/6 in float32), so the fused op differs by rounding only.

Legality: x is floating point; the bounds are the constants 0 and 6, the shift 3, the
divisor 6; a HardSigmoid's alpha and beta are 1/6 and 1/2; HardSwish needs opset 14 (both
forms: ONNX Runtime runs the standard op, and its FusedConv can then take it as epilogue).
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

from onnxscript.rewriter import pattern

from opfuse.passes.patterns import constant_array, opset_problem
from opfuse.core.ops import FLOAT_DTYPES, dtype_name, float_attr

TITLE = "HardSwish"
_TOLERANCE = 1e-4


def _near(value, expected: float) -> bool:
    array = constant_array(value)
    return array is not None and array.size == 1 and abs(float(array.reshape(-1)[0]) - expected) <= _TOLERANCE * max(1.0, abs(expected))


def _clip(op, x, shift, lo, hi, attrs: bool):
    shifted = op.Add(x, shift)
    if attrs:
        return op.Clip(shifted, _allow_other_attributes=True, _outputs=["clip"])
    return op.Clip(shifted, lo, hi, _outputs=["clip"])


def _clip_problem(clip_value, shift, lo, hi) -> str | None:
    node = clip_value.producer()
    if "min" in node.attributes or "max" in node.attributes:
        bounds = (float_attr(node, "min", float("nan")), float_attr(node, "max", float("nan")))
        if abs(bounds[0]) > _TOLERANCE or abs(bounds[1] - 6.0) > 6 * _TOLERANCE:
            return f"its Clip bounds are {bounds}, not (0, 6)"
    elif not (_near(lo, 0.0) and _near(hi, 6.0)):
        return "its Clip bounds are not the constants 0 and 6"
    if not _near(shift, 3.0):
        return "the shift before its Clip is not the constant 3"
    return None


class HardSwishFusion(pattern.RewriteRuleClassBase):
    """x * Clip(x + 3, 0, 6) / 6 in one of its spellings, or x * HardSigmoid(x)."""

    def __init__(self, spelling: str, attrs: bool = False):
        super().__init__(name=f"HardSwish({spelling})")
        self.spelling, self.attrs = spelling, attrs

    def pattern(self, op, x, shift, lo, hi, six):
        if self.spelling == "hardsigmoid":
            return op.Mul(x, op.HardSigmoid(x, _allow_other_attributes=True, _outputs=["hsig"]))
        clip = _clip(op, x, shift, lo, hi, self.attrs)
        if self.spelling == "div-clip":
            return op.Mul(x, op.Div(clip, six))
        if self.spelling == "mul-clip":
            return op.Mul(x, op.Mul(clip, six))
        if self.spelling == "div-product":
            return op.Div(op.Mul(x, clip), six)
        return op.Mul(op.Mul(x, clip), six)  # "mul-product"

    def check(self, context, x, shift=None, lo=None, hi=None, six=None, clip=None, hsig=None, **_):
        result = pattern.MatchResult()
        if dtype_name(x.dtype) not in FLOAT_DTYPES:
            return result.fail(f"its input is {dtype_name(x.dtype) or 'of unknown dtype'}, not floating point", x)
        if hsig is not None:
            node = hsig.producer()
            alpha, beta = float_attr(node, "alpha", 0.2), float_attr(node, "beta", 0.5)
            if abs(alpha - 1 / 6) > _TOLERANCE or abs(beta - 0.5) > _TOLERANCE:
                return result.fail(f"its HardSigmoid has alpha {alpha:g} and beta {beta:g}, not 1/6 and 1/2")
        else:
            problem = _clip_problem(clip, shift, lo, hi)
            expected = 6.0 if self.spelling.startswith("div") else 1 / 6
            if problem is None and not _near(six, expected):
                problem = f"its divisor is not the constant {'6' if expected == 6.0 else '1/6'}"
            if problem:
                return result.fail(problem)
        problem = opset_problem(context, "HardSwish", 14)
        if problem:
            return result.fail(problem)
        return result

    def rewrite(self, op, x, **_):
        return op.HardSwish(x)


class HardSigmoidFusion(pattern.RewriteRuleClassBase):
    """Clip(x + 3, 0, 6) / 6 on its own -> HardSigmoid(1/6, 1/2) (any opset)."""

    def __init__(self, divide: bool, attrs: bool):
        super().__init__(name="Clip(x+3,0,6)/6->HardSigmoid")
        self.divide, self.attrs = divide, attrs

    def pattern(self, op, x, shift, lo, hi, six):
        clip = _clip(op, x, shift, lo, hi, self.attrs)
        return op.Div(clip, six) if self.divide else op.Mul(clip, six)

    def check(self, context, x, shift, lo=None, hi=None, six=None, clip=None, **_):
        result = pattern.MatchResult()
        if dtype_name(x.dtype) not in FLOAT_DTYPES:
            return result.fail(f"its input is {dtype_name(x.dtype) or 'of unknown dtype'}, not floating point", x)
        problem = _clip_problem(clip, shift, lo, hi)
        if problem is None and not _near(six, 6.0 if self.divide else 1 / 6):
            problem = "its divisor is not the constant 6"
        return result.fail(problem) if problem else result

    def rewrite(self, op, x, **_):
        return op.HardSigmoid(x, alpha=1 / 6, beta=0.5)


def stages(form: str, approximate: bool = False):
    swish = [HardSwishFusion.rule("hardsigmoid")]
    for attrs in (False, True):
        swish += [HardSwishFusion.rule(s, attrs) for s in ("div-clip", "mul-clip", "div-product", "mul-product")]
    sigmoid = [HardSigmoidFusion.rule(divide, attrs) for divide in (True, False) for attrs in (False, True)]
    # HardSwish first (it contains the HardSigmoid spelling), then the HardSigmoids left,
    # then x * HardSigmoid(x) over the HardSigmoids the second stage made.
    return [swish, sigmoid, [HardSwishFusion.rule("hardsigmoid")]]
