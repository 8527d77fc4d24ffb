"""SiLU (Swish) written out -> Swish (opset 24) or ONNX Runtime's QuickGelu.

Algebra:

    x * Sigmoid(x)            = Swish(x, alpha=1)   = com.microsoft.QuickGelu(x, alpha=1)
    x * Sigmoid(alpha * x)    = Swish(x, alpha)     = com.microsoft.QuickGelu(x, alpha)

QuickGelu computes ``x * sigmoid(alpha * x)`` (its alpha defaults to 1.702, the GELU
approximation; with the matched alpha it is the same function, not an approximation).

Legality: x is floating point; alpha, when present, is a constant scalar; the Sigmoid's
output has no other consumer (the pass checks); standard form needs opset 24.
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

from onnxscript.rewriter import pattern

from opfuse.passes.patterns import constant_array, opset_problem
from opfuse.core.ops import FLOAT_DTYPES, MS_DOMAIN, dtype_name

TITLE = "SiLU->Swish"


class SiluFusion(pattern.RewriteRuleClassBase):
    def __init__(self, form: str, scaled: bool):
        super().__init__(name="x*Sigmoid(a*x)->Swish" if scaled else "x*Sigmoid(x)->Swish")
        self.form, self.scaled = form, scaled

    def pattern(self, op, x, alpha):
        return op.Mul(x, op.Sigmoid(op.Mul(x, alpha) if self.scaled else x))

    def check(self, context, x, alpha=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if dtype_name(x.dtype) not in FLOAT_DTYPES:
            return result.fail(f"its input is {dtype_name(x.dtype) or 'of unknown dtype'}, not floating point", x)
        self._alpha = 1.0
        if self.scaled:
            array = constant_array(alpha)
            if array is None or array.size != 1:
                return result.fail("the factor inside the Sigmoid is not a constant scalar", alpha)
            self._alpha = float(array.reshape(-1)[0])
        if self.form == "standard":
            problem = opset_problem(context, "Swish", 24)
            if problem:
                return result.fail(problem)
        return result

    def rewrite(self, op, x, **_):
        if self.form == "standard":
            return op.Swish(x, alpha=self._alpha)
        return op.QuickGelu(x, alpha=self._alpha, _domain=MS_DOMAIN)


def stages(form: str, approximate: bool = False):
    return [[SiluFusion.rule(form, scaled=True), SiluFusion.rule(form, scaled=False)]]
