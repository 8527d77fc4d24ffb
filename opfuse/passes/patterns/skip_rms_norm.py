"""Residual Add then RMSNorm -> ONNX Runtime's SkipSimplifiedLayerNormalization.

Algebra (a decoder block: the sublayer's output plus the block's input, RMS-normalised):

    s = input + skip [+ bias]       y = SimplifiedLayerNormalization(s, gamma, epsilon)
      = SkipSimplifiedLayerNormalization(input, skip, gamma [, bias]) -> (y, _, _, s)

The pattern's RMSNorm is the SimplifiedLayerNormalization ``rms-norm`` wrote just before
(every exporter's spelling reaches it so). The sum stays the fused op's output 3
(input_skip_bias_sum) when the next block reads it as its residual. The rules are
onnxscript's (``ort_fusions/skip_normalization.py``, ``SkipRmsNormFusion``).

Legality (onnxscript's checks, the failing one is the refusal's reason):

1. input and skip have the same [B, S, D] shape (rank 3, as ONNX Runtime's kernel wants);
2. gamma and bias are [D];
3. the SimplifiedLayerNormalization normalises the last axis with float32 statistics
   (stash_type 1).

ONNX Runtime only: no standard op computes this, and QNN does not run it.
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

from onnxscript.rewriter.ort_fusions import skip_normalization

TITLE = "Add+RMSNorm->SkipSimplifiedLayerNormalization"


def stages(form: str, approximate: bool = False):
    if form != "onnxruntime":
        return []
    return [list(skip_normalization.skip_rms_normalization_ruleset.rules)]
