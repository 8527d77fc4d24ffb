"""GELU written out in primitives -> Gelu (opset 20) or ONNX Runtime's Gelu / FastGelu.

Algebra, exact forms only:

    erf form    GELU(x)  = x * 0.5 * (1 + erf(x / sqrt(2)))          -> Gelu(approximate="none")
                                                                       / com.microsoft.Gelu
    tanh form   GELU~(x) = x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
                                                                     -> Gelu(approximate="tanh")
                                                                       / com.microsoft.FastGelu

Exporters spell them differently, and every spelling is a rule: ``x / sqrt(2)`` or
``x * (1/sqrt(2))``; the 0.5 applied to x, to ``1 + erf``, or to the product; x^3 as
``Pow(x, 3)`` or ``x * x * x``; operands of Add and Mul in either order (commuted variants).
Constants match within onnxscript's tolerance (relative 1e-5: float32 rounding of sqrt(2)
and 1/sqrt(2)), so the fused op differs from the primitives by rounding only.

The tanh form is an approximation of the erf form, not the same function (they differ by up
to 4.7e-4 at x = -2.70): each form becomes its own op, and the erf form becomes a tanh op
only with ``approximate`` (``opfuse optimize --approximate``), recorded as an approximation.

Legality: x is floating point; standard form needs opset 20. The ``qnn`` form writes Gelu-20
where the opset has it, else ``com.microsoft`` Gelu (erf form; a tanh one needs opset 20).
"""

from __future__ import annotations

__all__ = ["TITLE", "FORMS", "stages"]

import math

from onnxscript.rewriter import pattern

from opfuse.passes.patterns import opset_problem
from opfuse.core.ops import FLOAT_DTYPES, MS_DOMAIN, dtype_name

TITLE = "GELU->Gelu"
# "qnn": Gelu-20 where the opset has it, else com.microsoft Gelu (erf form only: QNN runs no
# FastGelu), which is what ONNX Runtime's qnn_preprocess_model writes (targets/qnn.py)
FORMS = ("standard", "onnxruntime", "qnn")
_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _erf_term(op, x, divide: bool):
    scaled = op.Div(x, _SQRT2) if divide else op.Mul(x, 1.0 / _SQRT2)
    return op.Add(op.Erf(scaled), 1.0)


def _tanh_term(op, x, cube_as_pow: bool):
    cube = op.Pow(x, 3.0) if cube_as_pow else op.Mul(op.Mul(x, x), x)
    inner = op.Add(x, op.Mul(cube, 0.044715))
    return op.Add(op.Tanh(op.Mul(inner, _SQRT_2_OVER_PI)), 1.0)


class GeluFusion(pattern.RewriteRuleClassBase):
    """One spelling of GELU (the form and where the 0.5 sits) -> the fused op."""

    def __init__(self, form: str, tanh: bool, half_on: str, cube_as_pow: bool = True, approximate=False,
                 divide: bool = True):
        source = "tanh" if tanh else "erf"
        made = "tanh" if (tanh or approximate) else "none"
        super().__init__(name=f"GELU({source})->Gelu({made})" + (" approximation" if approximate else ""))
        self.form, self.tanh, self.half_on, self.cube_as_pow, self.made = form, tanh, half_on, cube_as_pow, made
        self.divide = divide

    def pattern(self, op, x):
        term = _tanh_term(op, x, self.cube_as_pow) if self.tanh else _erf_term(op, x, self.divide)
        if self.half_on == "x":
            return op.Mul(op.Mul(x, 0.5), term)
        if self.half_on == "term":
            return op.Mul(x, op.Mul(term, 0.5))
        return op.Mul(op.Mul(x, term), 0.5)

    def check(self, context, x, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if dtype_name(x.dtype) not in FLOAT_DTYPES:
            return result.fail(f"its input is {dtype_name(x.dtype) or 'of unknown dtype'}, not floating point", x)
        problem = opset_problem(context, "Gelu", 20) if self.form != "onnxruntime" else None
        if problem and (self.form == "standard" or self.made == "tanh"):
            return result.fail(problem)
        self._standard_op = self.form != "onnxruntime" and problem is None  # (read by rewrite, next)
        return result

    def rewrite(self, op, x, **_):
        if self._standard_op:
            return op.Gelu(x, approximate=self.made)
        return op.FastGelu(x, _domain=MS_DOMAIN) if self.made == "tanh" else op.Gelu(x, _domain=MS_DOMAIN)


def stages(form: str, approximate: bool = False):
    rules = []
    for half_on in ("x", "term", "product"):
        for divide in (True, False):
            rules.append(GeluFusion.rule(form, tanh=False, half_on=half_on, approximate=approximate, divide=divide))
        for cube_as_pow in (True, False):
            rules.append(GeluFusion.rule(form, tanh=True, half_on=half_on, cube_as_pow=cube_as_pow))
    return [rules]
