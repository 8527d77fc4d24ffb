"""Scaled dot-product attention written out -> ONNX Runtime's MultiHeadAttention / Attention.

Algebra (per head; Q, K, V projections of the input, split into heads):

    Attention(Q, K, V) = Softmax(Q K^T * scale + mask) V

with the scale as one factor, or split as sqrt(scale) on Q and on K (as torch's exporter
writes it); the mask added before the Softmax. onnxscript's rules do the matching, in
stages (``ort_fusions``, as its ``fuse_xformers`` orders them):

1. the shape sub-expressions made plain (``shape_optimization``);
2. the decomposition -> an intermediate ``SDPA`` op (``sdpa``; where it takes the export's NaN guard after
   the Softmax and the mask is ``Where(allowed, 0, -inf)``, the mask's fill written finite:
   :class:`SdpaFiniteFill`);
3. SDPA with its head split and merge -> ``com.microsoft.MultiHeadAttention`` (``mha``);
   a scale folded in (``mha_scale``), the projections' biases taken in (``mha_bias``);
4. MultiHeadAttention whose Q, K and V come from one input -> ``com.microsoft.Attention``
   with the three projections packed into one weight (``attention``);
5. any SDPA left -> MultiHeadAttention on [B, S, D] (``sdpa_via_mha``, as grouped-query attention's
   expanded key and value leave it): one whose output only has its heads merged takes the merge
   (:class:`SdpaMergedToMha`), any other is transposed back (:class:`SdpaToMha`); the mask is expanded on
   its query axis only where it lacks it.

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

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern
from onnxscript.rewriter.ort_fusions import attention, mha, mha_bias, mha_scale, sdpa, sdpa_via_mha, shape_optimization

from opfuse.core.ops import MS_DOMAIN, is_op
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


class SdpaFiniteFill(sdpa.SDPA):
    """onnxscript's decomposition -> SDPA, which takes the export's NaN guard ``Where(IsNaN(p), 0, p)`` after
    the Softmax into the op, where the fused kernels have none. With a mask ``Where(allowed, 0, -inf)`` (the
    TorchScript exporter's, from a boolean mask) a fully masked row is ``-inf`` throughout: the guard makes its
    output 0, a fused kernel NaN, which the next layer's real queries read through the padded keys (0 x NaN).
    So where the guard is taken and the mask is that Where, the SDPA reads ``Where(allowed, 0, finfo.min)``
    instead (the dynamo exporter's fill): exact on every row with an allowed position (a masked score is
    ``s + finfo.min``, whose ``exp`` less the row's maximum is 0, as ``-inf``'s is) and finite on a fully
    masked row (uniform there: a padded query's own row, whose output is undefined and reaches no real
    token; :mod:`opfuse.verify`, "Padded batches"). Either branch order of the Where; its other readers
    keep the old one."""

    def check(self, context, **bindings) -> pattern.MatchResult:
        result = super().check(context, **bindings)
        self._fill = None
        if result and any(n.op_type == "IsNaN" for n in context.nodes):
            self._fill = _minus_inf_fill(bindings.get("mask"))
        return result

    def rewrite(self, op, mask=None, **bindings):
        if self._fill is not None:
            condition, zero, fill_index, array = self._fill
            finite = op.Constant(value=ir.tensor(np.full(array.shape, np.finfo(array.dtype).min, array.dtype)))
            old, mask = mask, op.Where(condition, *((zero, finite) if fill_index == 2 else (finite, zero)))
            mask.type, mask.shape = old.type, old.shape  # (the same broadcast: a later stage reads its shape)
        return super().rewrite(op, mask=mask, **bindings)


def _minus_inf_fill(mask: ir.Value | None):
    """(condition, the zero, the index of the -inf operand, its array) where ``mask`` is ``Where(c, 0, -inf)``
    or ``Where(c, -inf, 0)`` of one-element float constants; else None."""
    node = mask.producer() if mask is not None else None
    if node is None or not is_op(node, "Where") or len(node.inputs) != 3:
        return None
    arrays = [_ir_utils.get_numpy_value(v) for v in node.inputs[1:]]
    if any(a is None or a.size != 1 or a.dtype.kind != "f" for a in arrays):
        return None
    for fill_index, (zero, fill) in ((2, arrays), (1, arrays[::-1])):
        if float(zero.reshape(())) == 0.0 and float(fill.reshape(())) == -np.inf:
            return node.inputs[0], node.inputs[3 - fill_index], fill_index, fill
    return None


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


class SdpaToMha(sdpa_via_mha.SDPAImplementation):
    """onnxscript's fallback, any SDPA left -> MultiHeadAttention on [B, S, D] (Q, K, V transposed and reshaped
    to it, the output reshaped and transposed back), with the mask's query axis expanded to S only where
    the mask does not have it already (onnxscript expands it always: its TODO), so an exporter's
    [B, 1, S, T] mask is read as it is."""

    def rewrite(self, op, query, key, value, key_format, sdpa_output):
        output = _mha(op, query, key, value, key_format, sdpa_output.producer(), self._num_heads)
        output_4d = op.Reshape(output, op.Constant(value_ints=[0, 0, self._num_heads, -1]))
        return op.Transpose(output_4d, perm=[0, 2, 1, 3])


class SdpaMergedToMha(sdpa_via_mha.SDPAImplementation):
    """An SDPA whose output only has its heads merged, ``Reshape(Transpose(sdpa, [0, 2, 1, 3]), shape)`` to
    [B, S, H * Dv] (after a Reshape that keeps [B, H, S, Dv], as the TorchScript exporter writes one), ->
    MultiHeadAttention, whose output is that [B, S, H * Dv] (:class:`SdpaToMha` would reshape and transpose
    it back to [B, H, S, Dv] for the merge to undo). The shapes are checked against the query's B and S and
    the value's H and Dv, not assumed."""

    def pattern(self, op, query, key, value, key_format):
        output = op.SDPA(query, key, value, key_format=key_format, _allow_other_inputs=True, _outputs=["sdpa_output"],
                         _domain=_FUSION)
        kept = op.Reshape(output, pattern.ANY_VALUE, _allow_other_attributes=True, _outputs=["kept"])
        output = pattern.OrValue([kept, output], tag_var="reshaped", tag_values=[True, False])
        return op.Reshape(op.Transpose(output, perm=[0, 2, 1, 3]), pattern.ANY_VALUE, _allow_other_attributes=True,
                          _outputs=["merged"])

    def check(self, context, query, key, value, key_format, sdpa_output, merged, reshaped=False, kept=None,
              **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if not super().check(context, query, key, value, key_format, sdpa_output):
            return result.fail("the query, key and value are not [B, H, S, Dh] with a static H")
        q, v, out = query.shape, value.shape, merged.shape
        heads = [q[0], self._num_heads, q[2], v[3]]
        if reshaped and (kept.shape is None or list(kept.shape) != heads):
            return result.fail(f"the SDPA's output is reshaped to {kept.shape}, not kept [B, H, S, Dv] = {heads}")
        width = self._num_heads * v[3] if isinstance(v[3], int) else None
        if out is None or len(out) != 3 or width is None or list(out) != [q[0], q[2], width]:
            return result.fail(f"the heads are merged into shape {out}, not [B, S, H * Dv] = "
                               f"{[q[0], q[2], width]}")
        return result

    def rewrite(self, op, query, key, value, key_format, sdpa_output, **_):
        return _mha(op, query, key, value, key_format, sdpa_output.producer(), self._num_heads)


def _mha(op, query, key, value, key_format, sdpa_node, num_heads: int):
    """MultiHeadAttention of the SDPA ``sdpa_node`` of query and value [B, H, S, D], key ``key_format``:
    each as [B, S, H * D]; its mask expanded on its query axis to S only where that axis is not S already."""
    to_3d = op.Constant(value_ints=[0, 0, -1])
    query_3d = op.Reshape(op.Transpose(query, perm=[0, 2, 1, 3]), to_3d)
    value_3d = op.Reshape(op.Transpose(value, perm=[0, 2, 1, 3]), to_3d)
    key_3d = op.Reshape(op.Transpose(key, perm=[0, 2, 1, 3]) if key_format.value == "BHSd" else key, to_3d)
    inputs = [query_3d, key_3d, value_3d]
    if len(sdpa_node.inputs) > 3 and sdpa_node.inputs[3] is not None:
        mask = sdpa_node.inputs[3]
        shape = mask.shape
        if shape is None or len(shape) != 4 or not _ir_utils.same_dim(shape[2], query.shape[2]):
            one = op.Constant(value_ints=[1])
            mask = op.Expand(mask, op.Concat(one, one, op.Shape(query, start=2, end=3), one, axis=0))
        inputs.extend([None, None, mask])
    scale = sdpa_node.attributes.get("scale", None)
    return op.MultiHeadAttention(*inputs, num_heads=num_heads, scale=scale, _domain=MS_DOMAIN)


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
            [SdpaFiniteFill.rule(name="SDPA")],
            [SdpaToAttention.rule(masked=True), SdpaToAttention.rule(masked=False)],
            kv_cache.rules(),
            heads_3d.rules(),
            *([present_window.rules()] if form == "standard" else []),
        ]
    return [
        list(shape_optimization.rules.rules),
        [SdpaFiniteFill.rule(name="SDPA")],
        _mha_rules(has_past_present=True),
        _mha_rules(has_past_present=False),
        list(mha_scale._mha_scale_rules.rules),
        list(mha_bias.mha_bias_rules.rules),
        list(attention.attention_rules.rules),
        [SdpaMergedToMha.rule(name="SDPA merged->MHA")],  # (a stage of its own: the next rule's root, the SDPA,
        [SdpaToMha.rule(name="SDPAImplementation")],      # comes before this one's, the merge, in graph order)
    ]
