"""Residual Add then LayerNormalization -> ONNX Runtime's SkipLayerNormalization.

Algebra (transformer blocks: the sublayer's output plus the block's input, normalised):

    s = input + skip [+ bias]       y = LayerNormalization(s, gamma, beta)
      = SkipLayerNormalization(input, skip, gamma, beta, bias) -> (y, ..., s)

The sum stays an output of the fused op (the next block reads it as its residual). The
rules are onnxscript's (``ort_fusions/skip_normalization.py``).

Legality (onnxscript's checks): input and skip have the same [B, S, D] shape, gamma,
beta and bias are [D]; LayerNormalization normalises the last axis with float32 statistics.
ONNX Runtime only: no standard op computes this.
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

from onnxscript.rewriter.ort_fusions import skip_normalization

TITLE = "Add+LayerNormalization->SkipLayerNormalization"


def stages(form: str, approximate: bool = False):
    if form != "onnxruntime":
        return []
    return [list(skip_normalization.skip_layer_normalization_ruleset.rules)]
