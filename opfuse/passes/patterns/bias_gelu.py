"""Bias Add then Gelu -> ONNX Runtime's BiasGelu.

Algebra: ``Gelu(x + bias) = BiasGelu(x, bias)`` for a bias over the last axis (a
Linear layer's bias left as an Add after its MatMul). The rules are onnxscript's
(``ort_fusions/bias_gelu.py``): they take the standard Gelu (erf) and ONNX Runtime's
Gelu, refuse the tanh Gelu, and check the bias is 1-D. ONNX Runtime only.
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

from onnxscript.rewriter.ort_fusions import bias_gelu

TITLE = "Add+Gelu->BiasGelu"


def stages(form: str, approximate: bool = False):
    if form != "onnxruntime":
        return []
    return [list(bias_gelu.bias_gelu_rules.rules)]
