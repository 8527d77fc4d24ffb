"""The decoder forms for ``benchmarks/qnn_ops.py``: rotary, attention with a KV cache, skip + RMSNorm,
each fused and written out, so the table compares the two on QNN's HTP.

Schemas as the installed runtimes declare them (``onnx.defs.get_schema``; ONNX Runtime's
``get_all_operator_schema`` for ``com.microsoft``):

- ``RotaryEmbedding`` (23): X [B, H, S, Dh] (or [B, S, H * Dh] with ``num_heads``), cos_cache and
  sin_cache [B, S, R / 2] without position_ids, [max_position + 1, R / 2] with position_ids [B, S];
  ``interleaved``, ``rotary_embedding_dim`` (R; 0: the whole head);
- ``com.microsoft`` ``RotaryEmbedding``: (input, position_ids, cos_cache, sin_cache), ``num_heads`` for 3-D;
- ``Attention`` (23): (Q, K, V, attn_mask, past_key, past_value) -> (Y, present_key, present_value);
  4-D [B, H, S, Dh], or 3-D [B, S, H * Dh] with ``q_num_heads`` and ``kv_num_heads``; the caches
  are [B, Hkv, P, Dh] in both; Hq a multiple of Hkv is grouped-query attention;
- ``com.microsoft`` ``GroupQueryAttention``: (query, key, value, past_key, past_value, seqlens_k,
  total_sequence_length) -> (output, present_key, present_value), 3-D q/k/v, BNSH caches;
  seqlens_k [B] int32 (total length - 1), total_sequence_length an int32 scalar;
- ``com.microsoft`` ``SkipSimplifiedLayerNormalization``: (input, skip, gamma) -> (output, -, -,
  input_skip_bias_sum); ``SkipLayerNormalization`` the same with beta.

Shapes are a decode step's (one new token after P = 4 past positions) or a 4-token prefill,
heads of 8, two query heads and one key/value head for the grouped forms.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"
F, I64, I32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
B, HQ, HKV, S, P, DH = 1, 2, 1, 4, 4, 8
MAXPOS = 16
_rng = np.random.default_rng(7)


def _v(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def _c(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _model(nodes, inputs, outputs, inits=(), opset=23, ms=False):
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(MS, 1)] if ms else [])
    m = helper.make_model(helper.make_graph(nodes, "probe", inputs, outputs, list(inits)), opset_imports=opsets)
    m.ir_version = 10
    return m


def _table(rows, half):
    """cos and sin tables [rows, half] of rotary angles (positions x inverse frequencies)."""
    angles = np.outer(np.arange(rows), 1.0 / 10000 ** (np.arange(half) / half))
    return _c("cos_cache", np.cos(angles)), _c("sin_cache", np.sin(angles))


# -- rotary ----------------------------------------------------------------------------------------

def rotary_23(interleaved=0, rotary_dim=0, positions=False, rank=4):
    """RotaryEmbedding-23 on x; caches [B, S, R/2] as graph inputs (the graph computes them, the form
    opfuse writes), or constant [MAXPOS, R/2] tables read at position_ids."""
    half = (rotary_dim or DH) // 2
    attrs = dict(interleaved=interleaved, rotary_embedding_dim=rotary_dim)
    shape = [B, HQ, S, DH] if rank == 4 else [B, S, HQ * DH]
    x, y = _v("x", shape), _v("y", shape)
    if rank == 3:
        attrs["num_heads"] = HQ
    if positions:
        node = helper.make_node("RotaryEmbedding", ["x", "cos_cache", "sin_cache", "position_ids"], ["y"],
                                name="rotary", **attrs)
        return _model([node], [x, _v("position_ids", [B, S], I64)], [y], _table(MAXPOS, half))
    node = helper.make_node("RotaryEmbedding", ["x", "cos_cache", "sin_cache"], ["y"], name="rotary", **attrs)
    return _model([node], [x, _v("cos_cache", [B, S, half]), _v("sin_cache", [B, S, half])], [y])


def ms_rotary(interleaved=0, rotary_dim=0):
    """com.microsoft RotaryEmbedding, 3-D input [B, S, H * Dh], tables [MAXPOS, R/2] at position_ids."""
    half = (rotary_dim or DH) // 2
    attrs = dict(interleaved=interleaved, num_heads=HQ, **({"rotary_embedding_dim": rotary_dim} if rotary_dim else {}))
    node = helper.make_node("RotaryEmbedding", ["x", "position_ids", "cos_cache", "sin_cache"], ["y"],
                            name="rotary", domain=MS, **attrs)
    return _model([node], [_v("x", [B, S, HQ * DH]), _v("position_ids", [B, S], I64)], [_v("y", [B, S, HQ * DH])],
                  _table(MAXPOS, half), opset=17, ms=True)


def rotary_written(interleaved=False, rotary_dim=DH):
    """Hugging Face's rotate-half (or GPT-J's rotate-every-two, ``interleaved``) written out on x
    [B, H, S, Dh] with tables [B, 1, S, R] as inputs; ``rotary_dim`` < Dh: the rest passed through."""
    r, h = rotary_dim, rotary_dim // 2
    ints = lambda n, v: _c(n, v, np.int64)  # noqa: E731
    inits = [ints("zero", [0]), ints("r", [r]), ints("last", [-1])]
    inits += [ints("end", [DH])] if r < DH else []
    inits += [ints("one", [1]), ints("two", [2]), ints("pairs", [B, HQ, S, r])] if interleaved else [ints("h", [h])]
    nodes = []
    x = "x"
    if r < DH:
        nodes += [helper.make_node("Slice", ["x", "zero", "r", "last"], ["xr"], name="rot_part"),
                  helper.make_node("Slice", ["x", "r", "end", "last"], ["xp"], name="pass_part")]
        x = "xr"
    if interleaved:  # rotate_every_two: (-x[1::2], x[::2]) stacked on a new last axis, flattened
        nodes += [helper.make_node("Slice", [x, "zero", "r", "last", "two"], ["x1"], name="even"),
                  helper.make_node("Slice", [x, "one", "r", "last", "two"], ["x2"], name="odd"),
                  helper.make_node("Neg", ["x2"], ["nx2"], name="neg"),
                  helper.make_node("Unsqueeze", ["nx2", "last"], ["a"], name="ua"),
                  helper.make_node("Unsqueeze", ["x1", "last"], ["b"], name="ub"),
                  helper.make_node("Concat", ["a", "b"], ["ab"], axis=-1, name="stack"),
                  helper.make_node("Reshape", ["ab", "pairs"], ["rot"], name="flatten")]
    else:
        nodes += [helper.make_node("Slice", [x, "zero", "h", "last"], ["x1"], name="first_half"),
                  helper.make_node("Slice", [x, "h", "r", "last"], ["x2"], name="second_half"),
                  helper.make_node("Neg", ["x2"], ["nx2"], name="neg"),
                  helper.make_node("Concat", ["nx2", "x1"], ["rot"], axis=-1, name="rotate_half")]
    out = "y" if r == DH else "yr"
    nodes += [helper.make_node("Mul", [x, "cos"], ["xc"], name="x_cos"),
              helper.make_node("Mul", ["rot", "sin"], ["rs"], name="rot_sin"),
              helper.make_node("Add", ["xc", "rs"], [out], name="add")]
    if r < DH:
        nodes.append(helper.make_node("Concat", ["yr", "xp"], ["y"], axis=-1, name="join"))
    return _model(nodes, [_v("x", [B, HQ, S, DH]), _v("cos", [B, 1, S, r]), _v("sin", [B, 1, S, r])],
                  [_v("y", [B, HQ, S, DH])], inits, opset=18)


# -- attention with a KV cache ---------------------------------------------------------------------

def attention_23_past(hkv=HQ, rank=4, seq=1, mask=False):
    """Attention-23 with past_key/past_value [B, Hkv, P, Dh] (a decode step: seq 1), present outputs;
    ``hkv`` < HQ: grouped-query; ``rank`` 3: q/k/v [B, S, H * Dh] with q_num_heads/kv_num_heads."""
    if rank == 4:
        q, k = _v("q", [B, HQ, seq, DH]), [_v("k", [B, hkv, seq, DH]), _v("v", [B, hkv, seq, DH])]
        attrs = {}
    else:
        q, k = _v("q", [B, seq, HQ * DH]), [_v("k", [B, seq, hkv * DH]), _v("v", [B, seq, hkv * DH])]
        attrs = dict(q_num_heads=HQ, kv_num_heads=hkv)
    inputs = [q, *k] + ([_v("mask", [B, 1, seq, P + seq])] if mask else [])
    inputs += [_v("past_key", [B, hkv, P, DH]), _v("past_value", [B, hkv, P, DH])]
    node = helper.make_node("Attention", ["q", "k", "v", "mask" if mask else "", "past_key", "past_value"],
                            ["y", "present_key", "present_value"], name="attention", **attrs)
    y = [B, HQ, seq, DH] if rank == 4 else [B, seq, HQ * DH]
    return _model([node], inputs, [_v("y", y), _v("present_key", [B, hkv, P + seq, DH]),
                                   _v("present_value", [B, hkv, P + seq, DH])])


def attention_23_gqa():
    """Attention-23, 4-D, two query heads over one key/value head, no cache."""
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attention")
    return _model([node], [_v("q", [B, HQ, S, DH]), _v("k", [B, HKV, S, DH]), _v("v", [B, HKV, S, DH])],
                  [_v("y", [B, HQ, S, DH])])


def group_query_attention():
    """com.microsoft GroupQueryAttention, a decode step: q [B, 1, HQ * Dh], k/v [B, 1, HKV * Dh], caches
    [B, HKV, P, Dh]; seqlens_k = P (total - 1) and total_sequence_length = P + 1 as constants."""
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "past_key", "past_value", "seqlens_k", "total"],
                            ["y", "present_key", "present_value"], name="gqa", domain=MS, num_heads=HQ,
                            kv_num_heads=HKV)
    return _model([node], [_v("q", [B, 1, HQ * DH]), _v("k", [B, 1, HKV * DH]), _v("v", [B, 1, HKV * DH]),
                           _v("past_key", [B, HKV, P, DH]), _v("past_value", [B, HKV, P, DH])],
                  [_v("y", [B, 1, HQ * DH]), _v("present_key", [B, HKV, P + 1, DH]),
                   _v("present_value", [B, HKV, P + 1, DH])],
                  [_c("seqlens_k", [P], np.int32), _c("total", P + 1, np.int32)], opset=17, ms=True)


def attention_written_past(hkv=HQ, mask=False):
    """A decode step's attention written out: present = Concat(past, new, axis 2) (graph outputs),
    grouped-query's repeat_kv (Unsqueeze, Expand, Reshape) when ``hkv`` < HQ, then q k^T * s
    [+ mask], Softmax, @ v."""
    n = HQ // hkv
    ints = lambda name, v: _c(name, v, np.int64)  # noqa: E731
    nodes = [helper.make_node("Concat", ["past_key", "k"], ["present_key"], axis=2, name="append_k"),
             helper.make_node("Concat", ["past_value", "v"], ["present_value"], axis=2, name="append_v")]
    inits = [_c("scale", DH ** -0.5)]
    keys, values = "present_key", "present_value"
    if n > 1:
        inits += [ints("axis2", [2]), ints("rep", [B, hkv, n, P + 1, DH]), ints("merged", [B, HQ, P + 1, DH])]
        for name in ("key", "value"):
            nodes += [helper.make_node("Unsqueeze", [f"present_{name}", "axis2"], [f"{name}_u"], name=f"{name}_u"),
                      helper.make_node("Expand", [f"{name}_u", "rep"], [f"{name}_e"], name=f"{name}_e"),
                      helper.make_node("Reshape", [f"{name}_e", "merged"], [f"{name}_r"], name=f"{name}_r")]
        keys, values = "key_r", "value_r"
    nodes += [helper.make_node("Transpose", [keys], ["kt"], perm=[0, 1, 3, 2], name="kt"),
              helper.make_node("MatMul", ["q", "kt"], ["qk"], name="qk"),
              helper.make_node("Mul", ["qk", "scale"], ["scores"], name="scale")]
    scores = "scores"
    if mask:
        nodes.append(helper.make_node("Add", ["scores", "mask"], ["masked"], name="add_mask"))
        scores = "masked"
    nodes += [helper.make_node("Softmax", [scores], ["p"], axis=-1, name="softmax"),
              helper.make_node("MatMul", ["p", values], ["y"], name="pv")]
    inputs = [_v("q", [B, HQ, 1, DH]), _v("k", [B, hkv, 1, DH]), _v("v", [B, hkv, 1, DH]),
              _v("past_key", [B, hkv, P, DH]), _v("past_value", [B, hkv, P, DH])]
    inputs += [_v("mask", [B, 1, 1, P + 1])] if mask else []
    return _model(nodes, inputs, [_v("y", [B, HQ, 1, DH]), _v("present_key", [B, hkv, P + 1, DH]),
                                  _v("present_value", [B, hkv, P + 1, DH])], inits, opset=18)


# -- residual Add + RMSNorm / LayerNorm ------------------------------------------------------------

def _gamma(name="g"):
    return _c(name, _rng.uniform(0.5, 1.5, DH))


def skip_norm(op, beta=False, sum_output=True):
    """com.microsoft Skip(Simplified)LayerNormalization on x, s [B, S, Dh]; ``sum_output``: the sum
    (output 3) is read too, as the next block's residual."""
    inits = [_gamma()] + ([_c("b", _rng.normal(0, 0.1, DH))] if beta else [])
    outs = ["y", "", "", "sum"] if sum_output else ["y"]
    node = helper.make_node(op, ["x", "s", "g", *(["b"] if beta else [])], outs, name="skip_norm", domain=MS,
                            epsilon=1e-6)
    outputs = [_v("y", [B, S, DH])] + ([_v("sum", [B, S, DH])] if sum_output else [])
    return _model([node], [_v("x", [B, S, DH]), _v("s", [B, S, DH])], outputs, inits, opset=17, ms=True)


def add_then_norm(op="RMSNormalization", opset=23, sum_output=True):
    """x + s, then RMSNormalization-23 (or LayerNormalization-17) of the sum."""
    beta = op == "LayerNormalization"
    inits = [_gamma()] + ([_c("b", _rng.normal(0, 0.1, DH))] if beta else [])
    nodes = [helper.make_node("Add", ["x", "s"], ["sum"], name="residual"),
             helper.make_node(op, ["sum", "g", *(["b"] if beta else [])], ["y"], axis=-1, epsilon=1e-6, name="norm")]
    outputs = [_v("y", [B, S, DH])] + ([_v("sum", [B, S, DH])] if sum_output else [])
    return _model(nodes, [_v("x", [B, S, DH]), _v("s", [B, S, DH])], outputs, inits, opset=opset)


def add_then_rms_written(sum_output=True):
    """x + s, then RMSNorm written out as the exporters do: s * 1/sqrt(mean(s^2) + eps) * gamma."""
    nodes = [helper.make_node("Add", ["x", "s"], ["sum"], name="residual"),
             helper.make_node("Pow", ["sum", "two"], ["sq"], name="square"),
             helper.make_node("ReduceMean", ["sq", "last"], ["ms"], keepdims=1, name="mean"),
             helper.make_node("Add", ["ms", "eps"], ["mse"], name="add_eps"),
             helper.make_node("Sqrt", ["mse"], ["rms"], name="sqrt"),
             helper.make_node("Reciprocal", ["rms"], ["inv"], name="reciprocal"),
             helper.make_node("Mul", ["sum", "inv"], ["n"], name="normalise"),
             helper.make_node("Mul", ["n", "g"], ["y"], name="gamma")]
    outputs = [_v("y", [B, S, DH])] + ([_v("sum", [B, S, DH])] if sum_output else [])
    return _model(nodes, [_v("x", [B, S, DH]), _v("s", [B, S, DH])], outputs,
                  [_gamma(), _c("two", 2.0), _c("eps", 1e-6), _c("last", [-1], np.int64)], opset=18)


CASES = {
    "rotary-23": rotary_23,
    "rotary-23-interleaved": lambda: rotary_23(interleaved=1),
    "rotary-23-partial": lambda: rotary_23(rotary_dim=4),
    "rotary-23-position-ids": lambda: rotary_23(positions=True),
    "rotary-23-interleaved-position-ids": lambda: rotary_23(interleaved=1, positions=True),
    "rotary-23-partial-position-ids": lambda: rotary_23(rotary_dim=4, positions=True),
    "rotary-23-3d-position-ids": lambda: rotary_23(positions=True, rank=3),
    "ms-rotary-embedding": ms_rotary,
    "ms-rotary-embedding-interleaved": lambda: ms_rotary(interleaved=1),
    "ms-rotary-embedding-partial": lambda: ms_rotary(rotary_dim=4),
    "rotary-written": rotary_written,
    "rotary-written-interleaved": lambda: rotary_written(interleaved=True),
    "rotary-written-partial": lambda: rotary_written(rotary_dim=4),
    "attention-23-gqa": attention_23_gqa,
    "attention-23-past": attention_23_past,
    "attention-23-past-mask": lambda: attention_23_past(mask=True),
    "attention-23-past-gqa": lambda: attention_23_past(hkv=HKV),
    "attention-23-past-gqa-3d": lambda: attention_23_past(hkv=HKV, rank=3),
    "attention-23-past-3d": lambda: attention_23_past(rank=3),
    "attention-23-past-prefill": lambda: attention_23_past(seq=S),
    "ms-group-query-attention": group_query_attention,
    "attention-written-past": attention_written_past,
    "attention-written-past-mask": lambda: attention_written_past(mask=True),
    "attention-written-past-gqa": lambda: attention_written_past(hkv=HKV),
    "ms-skip-simplified-layer-norm": lambda: skip_norm("SkipSimplifiedLayerNormalization"),
    "ms-skip-layer-norm+sum": lambda: skip_norm("SkipLayerNormalization", beta=True),
    "add+rms-norm-23": add_then_norm,
    "add+layer-norm-17": lambda: add_then_norm("LayerNormalization", opset=17),
    "add+rms-norm-written": add_then_rms_written,
}
