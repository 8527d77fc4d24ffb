"""MatMul with a 2-D input then a bias Add -> Gemm.

Algebra: ``MatMul(A, B) + C = Gemm(A, B, C)`` when A is [M, K], B is [K, N] and C
broadcasts to [M, N] the way Gemm's C does (unidirectionally: a scalar, [N], [1, N],
[M, 1] or [M, N]); exact. The rule is onnxscript's ``matmul_add_to_gemm_rule``, which
checks the ranks of A and B; opfuse adds the check on C it leaves out (an Add that
broadcasts the product up, to [2, M, N] say, is not a Gemm). A Gemm's bias is where the
folds put per-channel constants and where ONNX Runtime's FusedGemm takes an activation.
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.common import _matmul_add_to_gemm

TITLE = "MatMul+Add->Gemm"


class MatMulAddToGemm(_matmul_add_to_gemm.MatMulAddToGemm):
    def check(self, context, input_a, input_b, input_c=None, **rest):
        result = super().check(context, input_a, input_b, **rest)
        if not result:
            return False  # a MatMul of other ranks: not this pattern (nothing to refuse)
        a, b, c = input_a.shape, input_b.shape, input_c.shape if input_c is not None else None
        if c is None:
            return pattern.MatchResult().fail("the shape of the added operand is unknown", input_c)
        out = [a[0], b[1]]
        if len(c) > 2 or any(not (d == 1 or d == o) for d, o in zip(reversed(list(c)), reversed(out))):
            return pattern.MatchResult().fail(
                f"the added operand has shape {list(c)}, which Gemm's C cannot broadcast to {out}", input_c)
        return result


def stages(form: str, approximate: bool = False):
    return [[MatMulAddToGemm().rule()]]
