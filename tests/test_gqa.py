"""Attention with its KV cache (:mod:`opfuse.passes.patterns.kv_cache`) and packed projections
(:mod:`opfuse.passes.pack_projections`): a decode step's past Concat and grouped-query attention's
``repeat_kv`` go into ONNX Attention-23 as past_key/past_value with present outputs, for as many key
heads as query heads and for fewer; the presents stay the graph's outputs with their shapes; the
numbers are ONNX Runtime's for the export and for the rewrite at several past lengths; a grouping
the standard op does not run is refused with the reason.

The blocks are torch modules exported by the dynamo exporter (as ``benchmarks/decoders.py``
exports its decoders); the packing test builds its graph with onnx.helper."""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import extras
import opfuse
from decoder_nets import shared_export
from graphs import assert_outputs_close, model, ops, ort_run, rng, tensor, vinfo

HEADS, DH, HIDDEN = 4, 8, 32


def _decode_block(kv_heads: int, grouping: str = "repeat_kv", rotary: bool = False, window: int = 0,
                  present_windows: tuple[int, int] | None = None):
    """x [B, S, 32] -> q, k, v projections (4 query heads of 8, ``kv_heads`` key heads); keys and
    values after the past ones; the key heads repeated as transformers' ``repeat_kv`` does (each
    head n times in a row) or, with ``grouping="tiled"``, the whole set n times (head h % kv), or with
    ``grouping="rows"`` (one token, as transformers' TorchScript export writes it) the query's n heads
    per key head as that head's rows [B, kv, n, 8], no repeat;
    attention with the mask made additive from ``attention_mask`` [B, P + S]; the output
    projection; ``rotary``: q and k rotated as transformers' Llama does, at ``position_ids``;
    ``window``: a sliding-window cache as Mistral's exports keep it (the past's last window - 1
    positions before the new one); ``present_windows``: the presents cut to their last (key, value)
    positions as Mistral's exports write them. Returns y and the two presents."""
    torch = extras.require("torch")
    transformers = extras.require("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rope = LlamaRotaryEmbedding(transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS,
                                                         max_position_embeddings=64))
    torch.manual_seed(0)
    n = HEADS // kv_heads

    def repeat(t):
        b, h, s, d = t.shape
        if n == 1:
            return t
        if grouping == "tiled":
            return t[:, None].expand(b, n, h, s, d).reshape(b, h * n, s, d)
        return t[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(HIDDEN, HEADS * DH, bias=False)
            self.k = torch.nn.Linear(HIDDEN, kv_heads * DH, bias=False)
            self.v = torch.nn.Linear(HIDDEN, kv_heads * DH, bias=False)
            self.o = torch.nn.Linear(HEADS * DH, HIDDEN, bias=False)

        def forward(self, x, attention_mask, past_key, past_value, position_ids=None):
            b, s, _ = x.shape
            q = self.q(x).view(b, s, HEADS, DH).transpose(1, 2)
            k = self.k(x).view(b, s, kv_heads, DH).transpose(1, 2)
            if rotary:
                q, k = apply_rotary_pos_emb(q, k, *rope(x, position_ids))
            v = self.v(x).view(b, s, kv_heads, DH).transpose(1, 2)
            if window:
                past_key, past_value = past_key[:, :, -(window - 1):], past_value[:, :, -(window - 1):]
            present_key = torch.cat([past_key, k], dim=2)
            present_value = torch.cat([past_value, v], dim=2)
            kept = present_key, present_value
            bias = torch.where(attention_mask[:, None, None, :].bool(), 0.0, float("-inf"))
            if grouping == "rows":  # one token: the query heads as rows of their key head (no repeat)
                rows = q.reshape(b, kv_heads, n * s, DH)
                y = torch.nn.functional.scaled_dot_product_attention(rows, present_key, present_value, attn_mask=bias)
                y = y.reshape(b, HEADS, s, DH)
            else:
                y = torch.nn.functional.scaled_dot_product_attention(q, repeat(present_key), repeat(present_value),
                                                                     attn_mask=bias)
            if present_windows:
                kept = (present_key[:, :, -present_windows[0]:], present_value[:, :, -present_windows[1]:])
            return self.o(y.transpose(1, 2).reshape(b, s, HEADS * DH)), *kept

    return Block().eval()


def _export_block(tmp_path, kv_heads: int, grouping: str = "repeat_kv", rotary: bool = False, window: int = 0,
                  dynamo: bool = True, present_windows: tuple[int, int] | None = None) -> str:
    """The decode block's export at ``tmp_path / "block.onnx"`` (made once a session for its arguments)."""
    return str(shared_export(tmp_path / "block.onnx",
                             f"gqa_block|{kv_heads}|{grouping}|{rotary}|{window}|{dynamo}|{present_windows}",
                             lambda to: _write_block(to, kv_heads, grouping, rotary, window, dynamo, present_windows)))


def _write_block(path, kv_heads: int, grouping: str, rotary: bool, window: int, dynamo: bool,
                 present_windows: tuple[int, int] | None) -> str:
    torch = extras.require("torch")
    past = 5
    args = (torch.randn(2, 1, HIDDEN), torch.ones(2, past + 1, dtype=torch.int64),
            torch.randn(2, kv_heads, past, DH), torch.randn(2, kv_heads, past, DH))
    names = ["x", "attention_mask", "past_key", "past_value"]
    if rotary:
        args, names = (*args, torch.full((2, 1), past, dtype=torch.int64)), [*names, "position_ids"]
    batch, past_len = torch.export.Dim("batch"), torch.export.Dim("past")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        block = _decode_block(kv_heads, grouping, rotary, window, present_windows)
        if not dynamo:  # TorchScript, its axes named as benchmarks/decoders.py names them
            axes = {"x": {0: "batch"}, "attention_mask": {0: "batch", 1: "past + 1"},
                    "past_key": {0: "batch", 2: "past"}, "past_value": {0: "batch", 2: "past"},
                    "y": {0: "batch"}, "present_key": {0: "batch", 2: "past + 1"},
                    "present_value": {0: "batch", 2: "past + 1"}, **({"position_ids": {0: "batch"}} if rotary else {})}
            torch.onnx.export(block, args, str(path), dynamo=False, opset_version=18, input_names=names,
                              output_names=["y", "present_key", "present_value"], dynamic_axes=axes)
            return str(path)
        torch.onnx.export(block, args, str(path), dynamo=True, opset_version=18,
                          external_data=False, input_names=names, output_names=["y", "present_key", "present_value"],
                          dynamic_shapes=({0: batch}, {0: batch, 1: past_len + 1}, {0: batch, 2: past_len},
                                          {0: batch, 2: past_len}, *([{0: batch}] if rotary else [])))
    return str(path)


def _inputs(kv_heads: int, past: int, masked_out: int = 0, seed: int = 0, rotary: bool = False) -> dict:
    r = rng(seed)
    mask = np.ones((2, past + 1), np.int64)
    mask[1, :masked_out] = 0  # the second sequence left-padded
    positions = {"position_ids": np.array([[past], [past - masked_out]], np.int64)} if rotary else {}
    return {**positions, "x": r.standard_normal((2, 1, HIDDEN)).astype(np.float32), "attention_mask": mask,
            "past_key": r.standard_normal((2, kv_heads, past, DH)).astype(np.float32),
            "past_value": r.standard_normal((2, kv_heads, past, DH)).astype(np.float32)}


def _attention(out) -> list:
    return [n for n in out.graph if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]


@pytest.mark.parametrize("kv_heads, rotary", [(HEADS, False), (2, False), (1, False), (2, True)])
def test_the_cache_and_repeat_kv_go_into_attention_23(tmp_path, kv_heads, rotary):
    """... in its 3-D form: the head split and merge (Reshape, Transpose) go too, the rotations
    (RotaryEmbedding-23) taking [B, S, H*Dh] with their head count."""
    path = _export_block(tmp_path, kv_heads, rotary=rotary)
    out, report = opfuse.optimize(path, target="onnx", opset=23, runtime_level="disabled", tune=False)
    assert report.verification.ok
    (attention,) = _attention(out)
    heads = {k: attention.attributes[k].value for k in ("q_num_heads", "kv_num_heads")}
    assert heads == {"q_num_heads": HEADS, "kv_num_heads": kv_heads}
    assert not {"Reshape", "Transpose"} & {n.op_type for n in out.graph}, ops(out)
    rotations = [n for n in out.graph if n.op_type == "RotaryEmbedding"]
    assert sorted(n.attributes["num_heads"].value for n in rotations) == ([kv_heads, HEADS] if rotary else [])
    assert [v is not None and v.name for v in attention.inputs[4:6]] == ["past_key", "past_value"], ops(out)
    mask = attention.inputs[3]  # one token: the rank-4 mask as it is, no Expand to [1, 1, 1, 1]
    assert mask is not None and (mask.producer() is None or mask.producer().op_type != "Expand"), ops(out)
    assert [v.name for v in attention.outputs[1:]] == ["present_key", "present_value"]
    readers = [n.name for n in out.graph for v in n.inputs if v is not None and v.name in ("past_key", "past_value")]
    assert readers == [attention.name] * 2, ops(out)  # no Concat of the cache, no repeat of it
    assert not [n for n in out.graph if n.op_type in ("Expand", "Tile") and n.outputs[0].shape is not None
                and len(n.outputs[0].shape) == 5], ops(out)
    original = onnx.load(path)
    assert [o.name for o in out.graph.outputs] == [o.name for o in original.graph.output]
    declared = [[d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in original.graph.output]
    assert [[d if isinstance(d, int) else d.value for d in o.shape] for o in out.graph.outputs] == declared
    assert declared[1] == ["batch", kv_heads, "past + 1", DH]
    for past, masked_out in ((5, 0), (1, 0), (40, 3)):
        inputs = _inputs(kv_heads, past, masked_out, seed=past, rotary=rotary)
        assert_outputs_close(ort_run(original, inputs), ort_run(out, inputs), 1e-5, 1e-5)


def test_a_sliding_window_cache_goes_in_whole_where_the_mask_shows_it_within_the_window(tmp_path):
    """Mistral's cache: Concat(past[:, :, -4095:], new). The mask is ``past + 1`` long and the keys
    ``min(past, 4095) + 1``: wherever the export runs they are equal, so the past is within the window
    and the Slice keeps all of it. The op takes the past itself (no Slice, no mask expanded to the keys),
    and it computes what the export does, presents included."""
    path = _export_block(tmp_path, 2, rotary=True, window=4096)
    out, report = opfuse.optimize(path, target="onnx", opset=23, runtime_level="disabled", tune=False)
    assert report.verification.ok
    (attention,) = _attention(out)
    assert attention.attributes["kv_num_heads"].value == 2
    assert [v.name for v in attention.inputs[4:6]] == ["past_key", "past_value"], ops(out)
    assert "Slice" not in {n.op_type for n in out.graph if any(v is not None and v.name in ("past_key", "past_value")
                                                               for v in n.inputs)}, ops(out)
    assert [v.name for v in attention.outputs[1:]] == ["present_key", "present_value"]
    assert not [n for n in out.graph if n.op_type == "Shape"], ops(out)  # (the keys' length is no longer computed)
    original = onnx.load(path)
    for past_len, masked_out in ((5, 0), (1, 0), (40, 3)):
        inputs = _inputs(2, past_len, masked_out, seed=past_len, rotary=True)
        assert_outputs_close(ort_run(original, inputs), ort_run(out, inputs), 1e-5, 1e-5)


def test_a_window_slice_not_shown_to_keep_the_cache_stays_with_the_mask_expanded_to_the_keys(tmp_path):
    """The same export with the window's Slice ending before the window's length (end 4094 < 4095): the
    rule cannot show it keeps the whole past, so the Slice stays the op's past and the mask is expanded
    to the keys' length (``past - Max(0, past - 4095)``-style, not ``past + 1``): exact where it runs."""
    path = _export_block(tmp_path, 2, rotary=True, window=4096)
    m = onnx.load(path)
    window = [n for n in m.graph.node if n.op_type == "Slice" and n.input[0] in ("past_key", "past_value")]
    assert len(window) == 2
    m.graph.initializer.append(tensor("window_end", np.array([4094], np.int64)))
    for node in window:
        node.input[2] = "window_end"
    out, report = opfuse.optimize(m, target="onnx", opset=23, runtime_level="disabled", tune=False)
    assert report.verification.ok
    (attention,) = _attention(out)
    past = attention.inputs[4]
    assert past.producer() is not None and past.producer().op_type == "Slice", ops(out)
    mask = attention.inputs[3]
    assert "Expand" in {n.op_type for n in out.graph}, ops(out)
    assert mask is not None
    for past_len, masked_out in ((5, 0), (1, 0), (40, 3)):
        inputs = _inputs(2, past_len, masked_out, seed=past_len, rotary=True)
        assert_outputs_close(ort_run(m, inputs), ort_run(out, inputs), 1e-5, 1e-5)


@pytest.mark.parametrize("rotary", [False, True])
def test_query_heads_as_rows_of_their_key_head_go_into_the_3d_form(tmp_path, rotary):
    """TorchScript's one-token export (transformers' Llama and Mistral): the query heads regrouped as
    rows [B, kv, n, Dh] of their key head, the output back to [B, H, 1, Dh]. The 3-D form's grouping
    (query head h reads key head h // n) is the same, so the head split, regrouping and merge go and
    the rotations take [B, 1, H*Dh]; equal on ONNX Runtime at several past lengths, left padding too."""
    path = _export_block(tmp_path, 2, grouping="rows", rotary=rotary, dynamo=False)
    out, report = opfuse.optimize(path, target="onnx", opset=23, runtime_level="disabled", tune=False)
    assert report.verification.ok
    (attention,) = _attention(out)
    heads = {k: attention.attributes[k].value for k in ("q_num_heads", "kv_num_heads")}
    assert heads == {"q_num_heads": HEADS, "kv_num_heads": 2}
    assert not {"Reshape", "Transpose"} & {n.op_type for n in out.graph}, ops(out)
    rotations = [n for n in out.graph if n.op_type == "RotaryEmbedding"]
    assert sorted(n.attributes["num_heads"].value for n in rotations) == ([2, HEADS] if rotary else [])
    assert [v.name for v in attention.inputs[4:6]] == ["past_key", "past_value"], ops(out)
    original = onnx.load(path)
    for past, masked_out in ((5, 0), (1, 0), (40, 3)):
        inputs = _inputs(2, past, masked_out, seed=past, rotary=rotary)
        assert_outputs_close(ort_run(original, inputs), ort_run(out, inputs), 1e-5, 1e-5)


def test_query_heads_as_rows_read_elsewhere_are_refused_with_the_reason(tmp_path):
    """The same export whose 4-D query heads are also a graph output: the 3-D form would leave them to
    be computed apart, so the rule refuses with the reason and the attention keeps its 4-D form."""
    path = _export_block(tmp_path, 2, grouping="rows", dynamo=False)
    m = onnx.load(path)
    producer = {o: n for n in m.graph.node for o in n.output}
    readers = {i: [n for n in m.graph.node if i in n.input] for n in m.graph.node for i in n.output}
    # the query's head split: Transpose(Reshape(MatMul(x, wq))), regrouped by a Reshape
    (split,) = [n for n in m.graph.node if n.op_type == "Transpose" and producer[n.input[0]].op_type == "Reshape"
                and producer[producer[n.input[0]].input[0]].input[0] == "x"
                and [c.op_type for c in readers[n.output[0]]] == ["Reshape"]]
    m.graph.output.append(onnx.helper.make_tensor_value_info(split.output[0], TensorProto.FLOAT, None))
    out, report = opfuse.optimize(m, target="onnx", opset=23, runtime_level="disabled", tune=False)
    assert report.verification.ok
    reasons = [r.reason for r in report.refusals]
    assert any("4-D q heads are read outside the attention" in r for r in reasons), reasons
    (attention,) = _attention(out)
    assert "q_num_heads" not in attention.attributes
    inputs = _inputs(2, 7, seed=1)
    assert_outputs_close(ort_run(m, inputs), ort_run(out, inputs), 1e-5, 1e-5)


def test_heads_tiled_are_another_grouping_refused_with_the_reason(tmp_path):
    """Expanding a new axis 1 then merging repeats the whole set of key heads (query head h reads key
    head h % kv), which the standard op's grouping (h // n) is not: the attention is written without
    the cache, and the log says why."""
    path = _export_block(tmp_path, 2, grouping="tiled")
    out, report = opfuse.optimize(path, target="onnx", opset=23, runtime_level="disabled", tune=False)
    assert report.verification.ok
    (attention,) = _attention(out)
    assert len(attention.inputs) <= 4 or all(v is None for v in attention.inputs[4:])
    reasons = [r.reason for r in report.refusals]
    assert any("not repeated along a new axis 2" in r for r in reasons), reasons
    inputs = _inputs(2, 7, seed=1)
    assert_outputs_close(ort_run(onnx.load(path), inputs), ort_run(out, inputs), 1e-5, 1e-5)


# -- packed projections -------------------------------------------------------------------------------

def _siblings(shared_weight_rows: int = HIDDEN, input_weight: bool = False):
    """x [B, S, 32] read by three MatMuls (q 32, k 16, v 16 columns) whose outputs are graph outputs
    and feed an Add; ``input_weight``: v's weight is a graph input (not a constant)."""
    r = rng(11)
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_proj"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="k_proj"),
             helper.make_node("MatMul", ["x", "wv"], ["v"], name="v_proj"),
             helper.make_node("Add", ["k", "v"], ["kv"], name="kv_sum")]
    inits = [tensor("wq", r.standard_normal((HIDDEN, 32)).astype(np.float32)),
             tensor("wk", r.standard_normal((shared_weight_rows, 16)).astype(np.float32))]
    inputs = [vinfo("x", ["batch", "seq", HIDDEN])]
    if input_weight:
        inputs.append(vinfo("wv", [HIDDEN, 16]))
    else:
        inits.append(tensor("wv", r.standard_normal((HIDDEN, 16)).astype(np.float32)))
    outputs = [vinfo("q", ["batch", "seq", 32]), vinfo("kv", ["batch", "seq", 16])]
    return model(nodes, inputs, outputs, inits)


def _pack(m):
    return opfuse.optimize(m, target="onnxruntime", passes=["pack-projections"], runtime_level="disabled",
                           tune=False)


def test_projections_reading_one_input_become_one_matmul_and_a_split():
    m = _siblings()
    out, report = _pack(m)
    assert report.verification.ok
    assert [n.op_type for n in out.graph].count("MatMul") == 1 and any(n.op_type == "Split" for n in out.graph)
    (matmul,) = [n for n in out.graph if n.op_type == "MatMul"]
    assert matmul.inputs[1].const_value.shape == (HIDDEN, 64)  # q 32, k 16, v 16 side by side
    assert [o.name for o in out.graph.outputs] == ["q", "kv"]
    inputs = {"x": rng(2).standard_normal((2, 3, HIDDEN)).astype(np.float32)}
    assert_outputs_close(ort_run(m, inputs), ort_run(out, inputs), 1e-5, 1e-5)


def test_a_projection_whose_weight_is_an_input_is_left_with_the_reason():
    m = _siblings(input_weight=True)
    out, report = _pack(m)
    assert [n.op_type for n in out.graph].count("MatMul") == 2  # q and k packed, v left
    reasons = [r.reason for r in report.refusals if r.node == "v_proj"]
    assert reasons and "not a constant" in reasons[0], report.refusals
    inputs = {"x": rng(3).standard_normal((1, 2, HIDDEN)).astype(np.float32),
              "wv": rng(4).standard_normal((HIDDEN, 16)).astype(np.float32)}
    assert_outputs_close(ort_run(m, inputs), ort_run(out, inputs), 1e-5, 1e-5)
