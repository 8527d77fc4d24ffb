"""Scaled dot-product attention written out -> ONNX Runtime's MultiHeadAttention / Attention.

Algebra (per head; Q, K, V projections of the input, split into heads):

    Attention(Q, K, V) = Softmax(Q K^T * scale + mask) V

with the scale as one factor, or split as sqrt(scale) on Q and on K (as torch's exporter
writes it); the mask added before the Softmax. onnxscript's rules do the matching, in
stages (``ort_fusions``, as its ``fuse_xformers`` orders them):

1. the shape sub-expressions made plain (``shape_optimization``);
2. the decomposition -> an intermediate ``SDPA`` op (``sdpa``);
3. SDPA with its head split and merge -> ``com.microsoft.MultiHeadAttention`` (``mha``);
   a scale folded in (``mha_scale``), the projections' biases taken in (``mha_bias``);
4. MultiHeadAttention whose Q, K and V come from one input -> ``com.microsoft.Attention``
   with the three projections packed into one weight (``attention``);
5. any SDPA left -> MultiHeadAttention (``sdpa_via_mha``).

Legality: onnxscript's checks (shapes [B, S, H, Dh] that agree, a head size that is
static, dropout none, the scale a constant...). The intermediate SDPA op exists only for
ONNX Runtime's fusions: when one is left after the stages, the whole rewrite is left out
(the stages run on a copy). ONNX Runtime only; a standard Attention (opset 23) is not
emitted yet.
"""

from __future__ import annotations

__all__ = ["TITLE", "stages", "INTERMEDIATE_DOMAINS"]

from onnxscript.rewriter.ort_fusions import attention, mha, mha_bias, mha_scale, sdpa, sdpa_via_mha, shape_optimization

TITLE = "attention->MultiHeadAttention/Attention"
INTERMEDIATE_DOMAINS = frozenset({"ai.onnxruntime._fusion"})


def stages(form: str, approximate: bool = False):
    if form != "onnxruntime":
        return []
    return [
        list(shape_optimization.rules.rules),
        list(sdpa.sdpa_rules.rules),
        list(mha.mha_rules_with_past.rules),
        list(mha.mha_rules_no_past.rules),
        list(mha_scale._mha_scale_rules.rules),
        list(mha_bias.mha_bias_rules.rules),
        list(attention.attention_rules.rules),
        list(sdpa_via_mha._rules.rules),
    ]
