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

For the standard form (opset 23 and later), stage 2's SDPA becomes ONNX's own
``Attention`` in its 4-D form (Q, K, V as [B, H, S, Dh]; a key written [B, S, H, Dh] is
transposed first), with the same scale and the mask as ``attn_mask``. ONNX Runtime's CPU
kernel wants the mask's query axis present (it does not broadcast it, against the spec),
so the mask is expanded to [.., S, Skv] first: ``Expand(mask, [1, 1, S, 1])``, exact.
A KV cache around it (the past Concat, grouped-query attention's ``repeat_kv``) then goes
into the same op as its past_key/past_value inputs and present outputs
(:mod:`opfuse.passes.patterns.kv_cache`, a later stage), and then the op with its cache takes
its 3-D form, the head split and merge around it gone (:mod:`opfuse.passes.patterns.heads_3d`), and a
sliding window's present Slices go under an If that skips them while the cache fits the window
(:mod:`opfuse.passes.patterns.present_window`; not for QNN, whose HTP runs no control flow).

Legality: onnxscript's checks (shapes [B, S, H, Dh] that agree, a head size that is
static, dropout none, the scale a constant...); the standard form needs opset 23. The
intermediate SDPA op exists only between the stages: when one is left after them, the
whole rewrite is left out (the stages run on a copy), and so is a rewrite that leaves the
graph bigger than it found it.
"""

from __future__ import annotations

__all__ = ["TITLE", "RECORD_TITLES", "FORMS", "stages", "INTERMEDIATE_DOMAINS", "ENTRY_STAGE"]

from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions import attention, mha, mha_bias, mha_scale, sdpa, sdpa_via_mha, shape_optimization

from opfuse.passes.patterns import heads_3d, kv_cache, opset_problem, present_window

TITLE = "attention->Attention"
# stage 1's rule slices dims out of a Shape of a reshape: its records say so, not "attention"
RECORD_TITLES = {"ExtractDim": "Shape+Slice->dims", "PresentWindow->If": "present window->If"}
# "qnn": the standard ops without the present window's If (control flow leaves QNN's HTP)
FORMS = ("standard", "onnxruntime", "qnn")
INTERMEDIATE_DOMAINS = frozenset({"ai.onnxruntime._fusion"})
# the stage that finds attention in the graph's own ops (the SDPA stage: MatMul, Softmax...); stage 1's
# shape rule matches most CNNs, so the measured choice asks for this stage's ops before it builds a form
ENTRY_STAGE = 1


_FUSION = "ai.onnxruntime._fusion"  # onnxscript's domain for the intermediate SDPA


class SdpaToAttention(pattern.RewriteRuleClassBase):
    """onnxscript's intermediate SDPA -> ONNX Attention (opset 23), 4-D form."""

    def __init__(self, masked: bool):
        super().__init__(name="SDPA->Attention")
        self.masked = masked

    def pattern(self, op, query, key, value, mask):
        inputs = (query, key, value, mask) if self.masked else (query, key, value)
        return op.SDPA(*inputs, _domain=_FUSION, _allow_other_attributes=True, _outputs=["sdpa"])

    def check(self, context, sdpa, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        problem = opset_problem(context, "Attention", 23)
        if problem:
            return result.fail(problem)
        node = sdpa.producer()
        self._format = node.attributes["key_format"].value if "key_format" in node.attributes else "BHSd"
        self._scale = node.attributes["scale"].value if "scale" in node.attributes else None
        if self._format not in ("BHSd", "BSHd"):
            return result.fail(f"its key is laid out {self._format}")
        return result

    def rewrite(self, op, query, key, value, mask=None, **_):
        if self._format == "BSHd":
            key = op.Transpose(key, perm=[0, 2, 1, 3])
        inputs = [query, key, value]
        if self.masked:
            one = op.Constant(value_ints=[1])
            rows = op.Concat(one, one, op.Shape(query, start=2, end=3), one, axis=0)
            inputs.append(op.Expand(mask, rows))
        attributes = {"scale": self._scale} if self._scale is not None else {}
        return op.Attention(*inputs, **attributes)


class MhaKeepingItsOutputShape(mha.MultiHeadAttention):
    """onnxscript's SDPA -> MultiHeadAttention, which takes the Reshape after the head merge
    as the merge to [B, S, D] without reading its shape (its TODO); the dynamo exporter's
    GPT-2 reshapes to [B*S, D] there for a Gemm, which MultiHeadAttention's output is not."""

    def check(self, op, **bindings) -> pattern.MatchResult:
        result = super().check(op, **bindings)
        out, query = bindings.get("attention_reshaped"), bindings.get("query_BSD")
        if result and (out is None or out.shape is None or query.shape is None
                       or list(out.shape) != list(query.shape)):
            return result.fail(f"the heads are merged into shape {out.shape if out is not None else None}, "
                               f"not the query's {query.shape} ([B, S, D]) that MultiHeadAttention writes")
        return result


def _mha_rules(has_past_present: bool) -> list:
    """onnxscript's ``mha._make_rule_set``, with :class:`MhaKeepingItsOutputShape`."""
    return [MhaKeepingItsOutputShape.rule(
        f"MHA{'_Rotary' if rotary else ''}{'_Past' if has_past_present else ''}{'_CrossAttention' if cross else ''}",
        is_rotary=rotary, has_past_present=has_past_present, is_cross_attention=cross)
        for rotary in (False, True) for cross in ((False,) if has_past_present else (False, True))]


def stages(form: str, approximate: bool = False):
    if form in ("standard", "qnn"):
        return [
            list(shape_optimization.rules.rules),
            list(sdpa.sdpa_rules.rules),
            [SdpaToAttention.rule(masked=True), SdpaToAttention.rule(masked=False)],
            kv_cache.rules(),
            heads_3d.rules(),
            *([present_window.rules()] if form == "standard" else []),
        ]
    return [
        list(shape_optimization.rules.rules),
        list(sdpa.sdpa_rules.rules),
        _mha_rules(has_past_present=True),
        _mha_rules(has_past_present=False),
        list(mha_scale._mha_scale_rules.rules),
        list(mha_bias.mha_bias_rules.rules),
        list(attention.attention_rules.rules),
        list(sdpa_via_mha._rules.rules),
    ]
