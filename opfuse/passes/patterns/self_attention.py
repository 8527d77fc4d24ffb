"""An encoder's self-attention as TorchScript writes it -> ONNX Runtime's Attention, packed QKV.

The graph (BERT's self-attention in eager form, as torch's TorchScript exporter writes it:
the sentence encoders shipped as ONNX files), for one input x [B, S, E], E = H * Dh:

    q = Transpose(Reshape(x Wq + bq, [0, 0, H, Dh]), [0, 2, 1, 3])          [B, H, S, Dh]
    k = Transpose(Reshape(x Wk + bk, [0, 0, H, Dh]), [0, 2, 3, 1])          [B, H, Dh, S]
    v = Transpose(Reshape(x Wv + bv, [0, 0, H, Dh]), [0, 2, 1, 3])          [B, H, S, Dh]
    y = Reshape(Transpose(Softmax(q k / c [+ mask]) v, [0, 2, 1, 3]), [0, 0, E])  [B, S, E]

is ``com.microsoft.Attention(x, [Wq | Wk | Wv], [bq | bk | bv], attention_bias=mask)`` with
``num_heads`` H and ``scale`` 1 / c (``* c``: scale c). Attention computes the three
projections as one GEMM of the packed weight [E, 3E] and writes [B, S, E] itself, so the
head split and merge (the Reshapes and Transposes) go with the match and nothing is added
around it. (onnxscript's rules take this graph through MultiHeadAttention and rebuild the
shapes it reads, which left the graph bigger: :mod:`opfuse.passes.patterns.attention`.)

The mask: Attention adds ``attention_bias`` [B or 1, H or 1, S, T] to the scores, as the
graph's Add does; ONNX Runtime 1.32 refuses one with a query axis of 1 ("dimension 2 should
be same as sequence_length"), which the exporter's extended mask [B, 1, 1, T] has. Its query
axis is then broadcast first, exactly: ``Expand(mask, Gather(Shape(mask), [2, 2, 3, 2]))``,
the target [1, 1, T, 1], and T = S in self-attention. That expansion depends on the mask
alone, so the layers reading one mask share it (three nodes per model, not per layer).
Taking the mask in as ``mask_index`` instead would drop the mask's arithmetic too, but is
exact only for a 0/1 mask, which the graph does not guarantee: not done.

Legality (each a refusal with its reason): one input x of rank 3 feeds the three projections;
weights [E, E] and biases [E] are constants; the head split's shapes are constants whose
first two entries copy B and S (0) and whose heads times head size is E; the merge's is [0, 0,
E] or [0, 0, -1]; the scale is a constant scalar; the Softmax is over the last axis; the mask,
if any, has the input's dtype, rank 4 and a key axis that is not 1, and a query axis that is
S or 1 (one it cannot tell is refused). ONNX Runtime only.
"""

from __future__ import annotations

__all__ = ["TITLE", "stages"]

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from opfuse.core.ops import MS_DOMAIN
from opfuse.passes.patterns import constant_array

TITLE = "self-attention->Attention"
_SCALINGS = ("Div", "Mul")  # how the exporter scales the scores: by 1 / c or by c


def _split(shape, hidden: int) -> tuple[int, int] | str:
    """(heads, head size) of a head split [0, 0, H, Dh] of ``hidden``, or why it is not one."""
    if shape is None:
        return "the head split's shape is computed at run time"
    dims = [int(d) for d in shape.reshape(-1)]
    if len(dims) != 4 or dims[:2] != [0, 0]:
        return f"the head split reshapes to {dims}, not [0, 0, heads, head size] (batch and sequence copied)"
    heads, size = dims[2:]
    if heads == -1 and size > 0 and hidden % size == 0:
        heads = hidden // size
    elif size == -1 and heads > 0 and hidden % heads == 0:
        size = hidden // heads
    if heads <= 0 or size <= 0 or heads * size != hidden:
        return f"the head split {dims} does not divide the hidden size {hidden}"
    return heads, size


class SelfAttention(pattern.RewriteRuleClassBase):
    """Self-attention written out -> com.microsoft.Attention (module docstring)."""

    def __init__(self, scaled_by: str, masked: bool):
        super().__init__(name=f"SelfAttention({scaled_by}{', masked' if masked else ''})", remove_nodes=True)
        self.scaled_by, self.masked = scaled_by, masked
        self._expanded: dict[int, ir.Value] = {}  # mask -> its query axis broadcast, shared by the layers

    def setup(self):
        self._expanded = {}

    def pattern(self, op, x, wq, bq, wk, bk, wv, bv, shape_q, shape_k, shape_v, c, mask, shape_out):
        def heads(w, b, shape, perm):
            return op.Transpose(op.Reshape(op.Add(op.MatMul(x, w), b), shape), perm=perm)

        q = heads(wq, bq, shape_q, [0, 2, 1, 3])
        k = heads(wk, bk, shape_k, [0, 2, 3, 1])
        v = heads(wv, bv, shape_v, [0, 2, 1, 3])
        scores = getattr(op, self.scaled_by)(op.MatMul(q, k), c)
        if self.masked:
            scores = op.Add(scores, mask)
        context = op.MatMul(op.Softmax(scores, _outputs=["probs"]), v)
        return op.Reshape(op.Transpose(context, perm=[0, 2, 1, 3]), shape_out)

    def check(self, context, x, wq, bq, wk, bk, wv, bv, shape_q, shape_k, shape_v, c, shape_out, probs,
              mask=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.shape is None or len(x.shape) != 3:
            return result.fail(f"its input has shape {x.shape}, not [batch, sequence, hidden] that Attention reads")
        weights = [constant_array(w) for w in (wq, wk, wv)]
        biases = [constant_array(b) for b in (bq, bk, bv)]
        if any(w is None for w in weights) or any(b is None for b in biases):
            return result.fail("a projection's weight or bias is computed at run time; Attention packs constants")
        hidden = weights[0].shape[-1]
        if any(w.shape != (hidden, hidden) for w in weights) or any(b.shape != (hidden,) for b in biases):
            return result.fail(f"the projections are {[w.shape for w in weights]} with biases "
                               f"{[b.shape for b in biases]}, not [E, E] and [E] alike (E = {hidden})")
        splits = [_split(constant_array(s), hidden) for s in (shape_q, shape_k, shape_v)]
        problem = next((s for s in splits if isinstance(s, str)), None)
        if problem or len(set(splits)) != 1:
            return result.fail(problem or f"query, key and value are split into heads differently: {splits}")
        merge = constant_array(shape_out)
        if merge is None or [int(d) for d in merge.reshape(-1)] not in ([0, 0, hidden], [0, 0, -1]):
            return result.fail(f"the heads are merged by a Reshape to {None if merge is None else merge.tolist()}, "
                               f"not [0, 0, {hidden}] ([batch, sequence, hidden], what Attention writes)")
        factor = constant_array(c)
        if factor is None or factor.size != 1:
            return result.fail("the scale of the scores is not a constant scalar (Attention's scale is an attribute)")
        factor = float(factor.reshape(-1)[0])
        if factor == 0 or not np.isfinite(factor):
            return result.fail(f"the scores are scaled by {self.scaled_by} {factor}")
        softmax = probs.producer()
        axis = softmax.attributes.get_int("axis", -1)
        if axis not in (-1, 3):
            return result.fail(f"the Softmax is over axis {axis}, not over the keys (the last axis) as in Attention")
        if self.masked:
            problem = self._mask_problem(mask, x)
            if problem:
                return result.fail(problem)
        self._heads = splits[0][0]
        self._scale = 1.0 / factor if self.scaled_by == "Div" else factor
        self._weight = np.concatenate(weights, axis=1)
        self._bias = np.concatenate(biases)
        return result

    def _mask_problem(self, mask: ir.Value, x: ir.Value) -> str | None:
        """Why ``mask`` cannot be Attention's attention_bias (module docstring), else None; sets
        whether its query axis must be broadcast first."""
        if mask.dtype != x.dtype:
            return f"the mask is {mask.dtype}, the input {x.dtype}: attention_bias has the input's type"
        if mask.shape is None or len(mask.shape) != 4:
            return f"the mask has shape {mask.shape}, not rank 4 [B or 1, H or 1, S or 1, T] as attention_bias"
        query, key = mask.shape[2], mask.shape[3]
        if key == 1:
            return "the mask is broadcast along the keys (its last axis is 1); attention_bias has them all"
        sequence = x.shape[1]
        if query == 1:
            self._broadcast = True
        elif query == sequence or (isinstance(query, int) and isinstance(sequence, int) and query == sequence):
            self._broadcast = False
        else:
            return (f"the mask's query axis is {query}, which cannot be told to be the sequence ({sequence}) or 1; "
                    "attention_bias needs it whole")
        return None

    def rewrite(self, op, x, mask=None, **_):
        weight = op.initializer(ir.tensor(self._weight), name="qkv_weight")
        bias = op.initializer(ir.tensor(self._bias), name="qkv_bias")
        inputs = [x, weight, bias]
        if self.masked:
            if self._broadcast:
                mask = self._broadcast_queries(op, mask)
            inputs += [None, None, mask]  # (mask_index, past: none)
        return op.Attention(*inputs, num_heads=self._heads, scale=self._scale, _domain=MS_DOMAIN)

    def _broadcast_queries(self, op, mask: ir.Value) -> ir.Value:
        """``mask`` [B, H|1, 1, T] as [B, H|1, T, T] (T = S here), made once per mask."""
        made = self._expanded.get(id(mask))
        if made is not None and made.producer() is not None and made.producer().graph is not None:
            return made
        rows = op.Gather(op.Shape(mask), op.Constant(value=ir.tensor(np.array([2, 2, 3, 2], dtype=np.int64))),
                         axis=0)
        made = op.Expand(mask, rows)
        self._expanded[id(mask)] = made
        return made


def stages(form: str, approximate: bool = False):
    if form != "onnxruntime":
        return []
    return [[SelfAttention.rule(scaled_by=s, masked=m) for s in _SCALINGS for m in (True, False)]]
