"""A decoder's Attention-23 with its head split and merge around it -> Attention-23 in its 3-D form.

After :mod:`opfuse.passes.patterns.kv_cache`, a decode step's attention is

    q4 = [RotaryEmbedding](Transpose(Reshape(q3, [B, S, H, Dh]), [0, 2, 1, 3]), cos, sin)   (k4, v4 alike)
    y4, present_k, present_v = Attention(q4, k4, v4, Expand(mask, [1, 1, S(q4), 1]), past_k, past_v)
    y3 = Reshape(Transpose([Reshape](y4, [B, H, S, Dh]), [0, 2, 1, 3]), [B, S, H * Dh])

Rewrite (ONNX ``Attention`` and ``RotaryEmbedding``, opset 23, their 3-D forms):

    y3, present_k, present_v = Attention([RotaryEmbedding](q3, cos, sin, num_heads=H), ..., v3, mask,
                                         past_k, past_v, q_num_heads=H, kv_num_heads=Hkv)

Algebra: the 3-D forms split [B, S, H * Dh] into heads [B, H, S, Dh] exactly as the
Reshape then Transpose does (the spec's definition of both ops), rotate each head as the 4-D
form does, and merge the output back as the Transpose then Reshape does; the cache inputs
and outputs stay 4-D. Six Reshape/Transpose nodes per layer go.

Legality (each failure a refusal with its reason):

- the mask is the graph's, expanded over the query's rows as the standard form's first stage
  writes it (``Expand(mask, [1, 1, S, 1])``, S read off the 4-D query: off q3's axis 1 after; for one
  token, S static 1, and a rank-4 mask, no Expand after: it would return the mask);
- the shapes show it: q3 [B, S, H * Dh] reshaped to [B, S, H, Dh] (the same B and S, static H
  and Dh), transposed by [0, 2, 1, 3]; the output transposed back and reshaped to [B, S, H * Dh];
- the rotation is the standard op without num_heads, on the 4-D heads;
- no 4-D head tensor is read by a node that reaches an output outside the match (a prefill's
  present is the 4-D keys: the 3-D form would compute them twice).

TorchScript's export of a one-token decode step (Llama, Mistral) writes grouped-query attention
another way: the query heads regrouped as rows of the key heads, and the output back,

    q4 = Reshape([RotaryEmbedding](Transpose(Reshape(q3, [B, 1, H, Dh])), cos, sin), [B, Hkv, n, Dh])
    y4, present_k, present_v = Attention(q4, k4, v4, Expand(mask, [1, 1, n, 1]), past_k, past_v)
    y3 = Reshape(Transpose(Reshape(y4, [B, H, 1, Dh]), [0, 2, 1, 3]), [B, 1, H * Dh])

(:class:`GroupedRowsIn3D`), rewritten to the same 3-D form. Algebra: with one token, row j of key
group g is query head g * n + j, which the 3-D form's grouping (query head h reads key head h // n)
pairs with key head g too; the output's Reshape puts row j of group g back as head g * n + j; the
mask, one row for every head (its axes 1 and 2 are 1), broadcasts over the heads as it did over the
rows. Legality: the query is one token long (static 1); the regrouping is [B, Hkv, n, Dh] with
Hkv the keys' heads and Hkv * n = H; the mask's Expand changes its rows axis only, from 1; the output
is reshaped to [B, H, 1, Dh], transposed and merged to [B, 1, H * Dh]; the rotations and the 4-D
tensors as above.
"""

from __future__ import annotations

__all__ = ["rules"]

from onnxscript.rewriter import pattern

from opfuse.core.dims import same_dim
from opfuse.core.ops import ONNX_DOMAINS
from opfuse.passes.patterns import constant_array

_HEAD_PERM = [0, 2, 1, 3]
_LIVE_HOPS = 12  # how far a use is followed to see that it reaches an output


def _live(value, matched: set, hops: int = _LIVE_HOPS) -> bool:
    """Whether ``value`` is a graph output or read by a node outside ``matched`` whose outputs
    reach one (dead shape arithmetic the earlier stages left does not count)."""
    if value.is_graph_output():
        return True
    if hops == 0:
        return bool(value.uses())
    return any(node not in matched and any(_live(out, set(), hops - 1) for out in node.outputs)
               for node, _ in value.uses())


def _split_heads(b, inside: set, one_token: bool) -> tuple[str | None, dict[str, int]]:
    """Each of q, k, v split [B, S, H*Dh] -> [B, S, H, Dh] (S = 1 where ``one_token``), its 4-D heads (and
    their standard rotation) read by the ``inside`` nodes only: (None, the head counts), or (why not, {})."""
    form = "[B, 1, H*Dh] -> [B, 1, H, Dh]" if one_token else "[B, S, H*Dh] -> [B, S, H, Dh]"
    heads = {}
    for prefix in ("q", "k", "v"):
        x3, split, four = b[f"{prefix}3"], b[f"{prefix}_split"], b[f"{prefix}_heads"]
        s3, s4 = x3.shape, split.shape
        if s3 is None or s4 is None or len(s3) != 3 or len(s4) != 4:
            return f"the {prefix} head split's shapes are not known ({form})", {}
        h, dh = s4[2], s4[3]
        tokens = s3[1] == 1 and s4[1] == 1 if one_token else same_dim(s4[1], s3[1])
        if not (isinstance(h, int) and isinstance(dh, int) and same_dim(s4[0], s3[0]) and tokens and s3[2] == h * dh):
            token = "one token's " if one_token else ""
            return f"the {prefix} head split {list(s3)} -> {list(s4)} is not {token}{form}", {}
        heads[prefix] = h
        last = b.get(f"{prefix}_rotated") or four
        if _live(four, inside | {last.producer()}) or (last is not four and _live(last, inside)):
            return f"the 4-D {prefix} heads are read outside the attention (a present output, say)", {}
        if last is not four:
            rope = last.producer()
            if rope.domain not in ONNX_DOMAINS or rope.attributes.get_int("num_heads", 0):
                return f"the {prefix} rotation is not the standard RotaryEmbedding on 4-D heads", {}
    return None, heads


class AttentionIn3D(pattern.RewriteRuleClassBase):
    """Attention-23 with a cache, its heads split and merged around it -> its 3-D form (docstring)."""

    def __init__(self, rotary: bool, same_shape_reshape: bool):
        super().__init__(name=f"Attention heads{'+rotary' if rotary else ''}->3-D form")
        self.rotary, self.same_shape_reshape = rotary, same_shape_reshape
        self.remove_nodes = False  # (dead shape arithmetic may still read a 4-D head tensor)

    def _heads(self, op, x3, shape, cos, sin, prefix: str, rotate: bool):
        split = op.Reshape(x3, shape, _allow_other_attributes=True, _outputs=[f"{prefix}_split"])
        heads = op.Transpose(split, perm=_HEAD_PERM, _outputs=[f"{prefix}_heads"])
        if rotate:
            return op.RotaryEmbedding(heads, cos, sin, _allow_other_attributes=True, _outputs=[f"{prefix}_rotated"])
        return heads

    def pattern(self, op, q3, k3, v3, q_shape, k_shape, v_shape, q_cos, q_sin, k_cos, k_sin, mask, mask_one,
                past_key, past_value, out_shape):
        q = self._heads(op, q3, q_shape, q_cos, q_sin, "q", self.rotary)
        k = self._heads(op, k3, k_shape, k_cos, k_sin, "k", self.rotary)
        v = self._heads(op, v3, v_shape, None, None, "v", False)
        # the mask over the query's rows, as the standard form's first stage wrote it (attention.py)
        rows = op.Concat(mask_one, mask_one, op.Shape(q, start=2, end=3, _outputs=["q_rows"]), mask_one, axis=0)
        mask = op.Expand(mask, rows, _outputs=["mask_rows"])
        y, present_key, present_value = op.Attention(q, k, v, mask, past_key, past_value, _allow_other_attributes=True,
                                                     _outputs=["attention", "present_key", "present_value"])
        if self.same_shape_reshape:  # (the dynamo exporter's view of the output as it is)
            y = op.Reshape(y, pattern.ANY_VALUE, _allow_other_attributes=True, _outputs=["y_view"])
        merged = op.Reshape(op.Transpose(y, perm=_HEAD_PERM, _outputs=["merged_t"]), out_shape,
                            _allow_other_attributes=True, _outputs=["merged"])
        return merged, present_key, present_value

    def check(self, context, attention, merged, **bindings) -> pattern.MatchResult:
        result = pattern.MatchResult()
        problem = self._problem(attention, merged, bindings)
        return result.fail(problem) if problem else result

    def _problem(self, attention, merged, b) -> str | None:
        node = attention.producer()
        if node.domain not in ONNX_DOMAINS or any(a in node.attributes for a in ("q_num_heads", "kv_num_heads")):
            return "the attention is not the standard op in its 4-D form"
        problem, heads = _split_heads(b, {node, b["q_rows"].producer()}, one_token=False)
        if problem:
            return problem
        if heads["k"] != heads["v"] or heads["q"] % heads["k"]:
            return f"the head counts (q {heads['q']}, k {heads['k']}, v {heads['v']}) do not group"
        out, q3, dh = merged.shape, b["q3"].shape, b["v_split"].shape[3]
        view = b.get("y_view")  # (the attention's own output shape is not inferred yet: [B, Hq, S, Dh] from q)
        if view is not None and (view.shape is None or len(view.shape) != 4 or not (
                same_dim(view.shape[0], q3[0]) and view.shape[1] == heads["q"] and same_dim(view.shape[2], q3[1])
                and view.shape[3] == dh)):
            return "the output is reshaped to another shape before its heads are merged"
        if out is None or len(out) != 3 or not (same_dim(out[0], q3[0]) and same_dim(out[1], q3[1])):
            return f"the output's merge to {out} is not [B, S, H*Dh] of the query's B and S"
        if out[2] != heads["q"] * dh:
            return f"the output's merge to {list(out)} is not [B, S, {heads['q']}*{dh}]"
        self._heads_q, self._heads_kv = heads["q"], heads["k"]
        return None

    def _rotate3(self, op, x3, rotated, heads: int):
        if rotated is None:
            return x3
        node = rotated.producer()
        attributes = {k: a.value for k, a in node.attributes.items()}
        return op.RotaryEmbedding(x3, *node.inputs[1:], num_heads=heads, **attributes)

    def rewrite(self, op, q3, k3, v3, mask, mask_one, past_key, past_value, attention, q_rotated=None, k_rotated=None,
                **_):
        node = attention.producer()
        attributes = {k: a.value for k, a in node.attributes.items()}
        q = self._rotate3(op, q3, q_rotated, self._heads_q)
        k = self._rotate3(op, k3, k_rotated, self._heads_kv)
        if q3.shape is not None and len(q3.shape) == 3 and q3.shape[1] == 1 and mask.shape is not None \
                and len(mask.shape) == 4:
            rows_mask = mask  # one token: Expand(mask, [1, 1, 1, 1]) of a rank-4 mask is the mask
        else:
            rows_mask = op.Expand(mask, op.Concat(mask_one, mask_one, op.Shape(q3, start=1, end=2), mask_one, axis=0))
        return op.Attention(q, k, v3, rows_mask, past_key, past_value, q_num_heads=self._heads_q,
                            kv_num_heads=self._heads_kv, _outputs=3, **attributes)


class GroupedRowsIn3D(AttentionIn3D):
    """TorchScript's one-token attention, query heads as rows of the key heads -> its 3-D form (docstring)."""

    def __init__(self, rotary: bool):
        name = f"Attention heads as rows{'+rotary' if rotary else ''}->3-D form"
        pattern.RewriteRuleClassBase.__init__(self, name=name)
        self.rotary, self.remove_nodes = rotary, False

    def pattern(self, op, q3, k3, v3, q_shape, k_shape, v_shape, q_cos, q_sin, k_cos, k_sin, group_shape, mask,
                rows_shape, past_key, past_value, heads_shape, out_shape):
        q = op.Reshape(self._heads(op, q3, q_shape, q_cos, q_sin, "q", self.rotary), group_shape,
                       _allow_other_attributes=True, _outputs=["q_grouped"])
        k = self._heads(op, k3, k_shape, k_cos, k_sin, "k", self.rotary)
        v = self._heads(op, v3, v_shape, None, None, "v", False)
        y, present_key, present_value = op.Attention(q, k, v, op.Expand(mask, rows_shape, _outputs=["mask_rows"]),
                                                     past_key, past_value, _allow_other_attributes=True,
                                                     _outputs=["attention", "present_key", "present_value"])
        y = op.Reshape(y, heads_shape, _allow_other_attributes=True, _outputs=["y_heads"])
        merged = op.Reshape(op.Transpose(y, perm=_HEAD_PERM, _outputs=["merged_t"]), out_shape,
                            _allow_other_attributes=True, _outputs=["merged"])
        return merged, present_key, present_value

    def _problem(self, attention, merged, b) -> str | None:
        node = attention.producer()
        if node.domain not in ONNX_DOMAINS or any(a in node.attributes for a in ("q_num_heads", "kv_num_heads")):
            return "the attention is not the standard op in its 4-D form"
        problem, heads = _split_heads(b, {node, b["q_grouped"].producer()}, one_token=True)
        if problem:
            return problem
        dh, hq, hkv = b["q_split"].shape[3], heads["q"], heads["k"]
        if heads["v"] != hkv or hq % hkv or b["v_split"].shape[3] != dh or b["k_split"].shape[3] != dh:
            return f"the head counts (q {hq}, k {hkv}, v {heads['v']}) do not group"
        n, grouped = hq // hkv, b["q_grouped"].shape
        if grouped is None or len(grouped) != 4 or not (same_dim(grouped[0], b["q3"].shape[0]) and grouped[1] == hkv
                                                        and grouped[2] == n and grouped[3] == dh):
            return f"the query's regrouping {grouped} is not [B, {hkv}, {n}, {dh}] (its heads as rows of the keys')"
        problem = self._mask_problem(b["mask"], b["rows_shape"], b["q_grouped"], n)
        if problem:
            return problem
        y4, out = b["y_heads"].shape, merged.shape
        if y4 is None or len(y4) != 4 or not (same_dim(y4[0], b["q3"].shape[0]) and y4[1] == hq and y4[2] == 1
                                                 and y4[3] == dh):
            return f"the output's reshape to {y4} is not the heads' [B, {hq}, 1, {dh}]"
        if out is None or len(out) != 3 or not (same_dim(out[0], b["q3"].shape[0]) and out[1] == 1 and out[2] == hq * dh):
            return f"the output's merge to {out} is not [B, 1, {hq}*{dh}]"
        self._heads_q, self._heads_kv = hq, hkv
        return None

    @staticmethod
    def _mask_problem(mask, rows_shape, grouped, n: int) -> str | None:
        """Why the mask is not one row for every head, expanded over the query's rows only (to a constant
        [1, 1, n, 1], or as the standard form's first stage writes it: Concat(1, 1, Shape(q)[2:3], 1))."""
        shape = mask.shape
        if shape is None or len(shape) != 4 or shape[1] != 1 or shape[2] != 1:
            return f"the mask {shape} is not known to be one row for every head ([B, 1, 1, T])"
        rows = constant_array(rows_shape)
        if rows is not None:
            ok = rows.shape == (4,) and [int(r) for r in rows] in ([1, 1, n, 1], [1, 1, 1, 1])
        else:
            node = rows_shape.producer()
            parts = list(node.inputs) if node is not None and node.op_type == "Concat" else []
            ones = [constant_array(parts[i]) for i in (0, 1, 3)] if len(parts) == 4 else [None]
            rows_of = parts[2].producer() if len(parts) == 4 and parts[2] is not None else None
            ok = (all(o is not None and o.size == 1 and int(o.reshape(-1)[0]) == 1 for o in ones)
                  and rows_of is not None and rows_of.op_type == "Shape" and rows_of.inputs[0] is grouped
                  and rows_of.attributes.get_int("start", 0) == 2 and rows_of.attributes.get_int("end", 0) == 3)
        return None if ok else "the mask's Expand is not over the query's rows only ([1, 1, rows, 1])"

    def rewrite(self, op, q3, k3, v3, mask, past_key, past_value, attention, q_rotated=None, k_rotated=None, **_):
        node = attention.producer()
        attributes = {k: a.value for k, a in node.attributes.items()}
        q = self._rotate3(op, q3, q_rotated, self._heads_q)
        k = self._rotate3(op, k3, k_rotated, self._heads_kv)
        return op.Attention(q, k, v3, mask, past_key, past_value, q_num_heads=self._heads_q,
                            kv_num_heads=self._heads_kv, _outputs=3, **attributes)


def rules() -> list:
    return [*(AttentionIn3D.rule(rotary=r, same_shape_reshape=v) for r in (True, False) for v in (True, False)),
            *(GroupedRowsIn3D.rule(rotary=r) for r in (True, False))]
