"""``--target qnn`` on a decoder block: the forms it writes, where QNN puts them, and their numbers.

The block is a torch module exported by the dynamo exporter (opset 18, as ``benchmarks/decoders.py``
exports): RMSNorm, q/k/v projections with fewer key heads than query heads, rotate-half rotary at
``position_ids``, a KV-cache decode step (past Concat, ``repeat_kv``, additive mask), the output
projection, the residual Add and the next RMSNorm, all written out. The oracles are QNN's compiler
(:func:`opfuse.targets.qnn.probe.probe`, what it says decides, as ``benchmarks/qnn_ops.py`` measured
it) and ONNX Runtime's CPU provider running the original; no case reads the target's table.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

import extras
import opfuse
from graphs import assert_outputs_close, model, ort_run, rng, tensor, vinfo
from opfuse.targets.qnn.backend import open_session
from opfuse.targets.qnn.probe import probe
from qnn_graphs import needs_htp

pytestmark = needs_htp
MS = "com.microsoft"
HIDDEN, HEADS, KV_HEADS, DH, PAST = 32, 4, 2, 8, 5


def _decoder_block():
    torch = extras.require("torch")
    transformers = extras.require("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    rope = LlamaRotaryEmbedding(transformers.LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS,
                                                         max_position_embeddings=64))
    torch.manual_seed(0)
    n = HEADS // KV_HEADS

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def repeat_kv(t):
        b, h, s, d = t.shape
        return t[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = torch.nn.Parameter(torch.rand(HIDDEN) + 0.5)
            self.norm2 = torch.nn.Parameter(torch.rand(HIDDEN) + 0.5)
            self.q = torch.nn.Linear(HIDDEN, HEADS * DH, bias=False)
            self.k = torch.nn.Linear(HIDDEN, KV_HEADS * DH, bias=False)
            self.v = torch.nn.Linear(HIDDEN, KV_HEADS * DH, bias=False)
            self.o = torch.nn.Linear(HEADS * DH, HIDDEN, bias=False)

        def forward(self, x, attention_mask, past_key, past_value, position_ids):
            b, s, _ = x.shape
            h = rms(x, self.norm1)
            q = self.q(h).view(b, s, HEADS, DH).transpose(1, 2)
            k = self.k(h).view(b, s, KV_HEADS, DH).transpose(1, 2)
            v = self.v(h).view(b, s, KV_HEADS, DH).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *rope(x, position_ids))
            present_key = torch.cat([past_key, k], dim=2)
            present_value = torch.cat([past_value, v], dim=2)
            bias = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
            scores = q @ repeat_kv(present_key).transpose(-1, -2) * DH ** -0.5 + bias
            y = torch.softmax(scores, dim=-1) @ repeat_kv(present_value)
            residual = x + self.o(y.transpose(1, 2).reshape(b, s, HEADS * DH))
            return rms(residual, self.norm2), residual, present_key, present_value

    return Block().eval()


@pytest.fixture(scope="module")
def block_path(tmp_path_factory):
    torch = extras.require("torch")
    path = tmp_path_factory.mktemp("qnn_decoder") / "block.onnx"
    args = (torch.randn(1, 1, HIDDEN), torch.ones(1, PAST + 1, dtype=torch.int64),
            torch.randn(1, KV_HEADS, PAST, DH), torch.randn(1, KV_HEADS, PAST, DH),
            torch.full((1, 1), PAST, dtype=torch.int64))
    batch, past = torch.export.Dim("batch"), torch.export.Dim("past")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(_decoder_block(), args, str(path), dynamo=True, opset_version=18, external_data=False,
                          input_names=["x", "attention_mask", "past_key", "past_value", "position_ids"],
                          output_names=["y", "residual", "present_key", "present_value"],
                          dynamic_shapes=({0: batch}, {0: batch, 1: past + 1}, {0: batch, 2: past},
                                          {0: batch, 2: past}, {0: batch}))
    return str(path)


DIMS = {"batch": 1, "past": PAST}


def _inputs(seed: int) -> dict:
    r = rng(seed)
    return {"x": r.standard_normal((1, 1, HIDDEN)).astype(np.float32),
            "attention_mask": np.ones((1, PAST + 1), np.int64),
            "past_key": r.standard_normal((1, KV_HEADS, PAST, DH)).astype(np.float32),
            "past_value": r.standard_normal((1, KV_HEADS, PAST, DH)).astype(np.float32),
            "position_ids": np.array([[PAST]], np.int64)}


def test_at_opset_23_the_block_becomes_the_standard_decoder_ops_and_runs_whole_on_the_htp(block_path):
    out, report = opfuse.optimize(block_path, target="qnn", opset=23, dims=DIMS, require_npu=True)
    written = Counter((n.domain or "", n.op_type) for n in out.graph)
    assert written[("", "RotaryEmbedding")] == 2 and written[("", "Attention")] == 1, written
    assert written[("", "RMSNormalization")] == 2, written
    assert not [k for k in written if k[0] == MS], written  # no contrib op: QNN runs none of these
    (attention,) = [n for n in out.graph if n.op_type == "Attention"]
    assert [v is not None and v.name for v in attention.inputs[4:6]] == ["past_key", "past_value"]
    assert [v.name for v in attention.outputs[1:3]] == ["present_key", "present_value"]
    assert {k: attention.attributes[k].value for k in ("q_num_heads", "kv_num_heads")} == {
        "q_num_heads": HEADS, "kv_num_heads": KV_HEADS}
    assert report.verification.ok and report.device.placement.all_on_npu and report.device.strict
    # QNN's compiler, asked again on the written model, float and as the QNN flow quantises it
    placed = probe(ir.serde.serialize_model(out))
    assert placed["float"].whole and placed["qdq"].whole, {k: v.verdict() for k, v in placed.items()}
    original = onnx.load(block_path)
    for seed in (0, 1):
        x = _inputs(seed)
        assert_outputs_close(ort_run(original, x), ort_run(out, x), 1e-5, 1e-5)
    # and on the HTP itself (float16 arithmetic): the written model against the original on the CPU
    x = _inputs(2)
    want = ort_run(original, x)
    got = open_session(out, strict=True).run(x)
    for name, value in zip([o.name for o in original.graph.output], got):
        assert np.abs(value - want[name]).max() <= 5e-3 * np.abs(want[name]).max(), name


def test_below_opset_23_the_block_stays_written_out_with_the_opset_named_and_runs_whole_too(block_path):
    # --opset 18, the model's own: without it the target raises a graph with an RMSNorm to 23 (test_qnn_rms_opset)
    out, report = opfuse.optimize(block_path, target="qnn", dims=DIMS, opset=18)
    ops = {n.op_type for n in out.graph}
    assert not {"RotaryEmbedding", "Attention"} & ops and {"Neg", "Softmax", "Concat"} <= ops, ops
    reasons = " ".join(r.reason for r in report.refusals)
    assert "RotaryEmbedding exists from opset 23" in reasons and "--opset 23" in reasons, report.refusals
    assert report.device.placement.all_on_npu  # the written-out forms run: keeping them costs no placement
    placed = probe(ir.serde.serialize_model(out), forms=("qdq",))["qdq"]
    assert placed.whole, placed.verdict()
    x = _inputs(3)
    assert_outputs_close(ort_run(onnx.load(block_path), x), ort_run(out, x), 1e-5, 1e-5)


def _contrib(op: str, inputs, outputs, inits=(), **attrs):
    return model([helper.make_node(op, [i.name for i in inputs] + [t.name for t in inits], [o.name for o in outputs],
                                   name=op.lower(), domain=MS, **attrs)],
                 inputs, outputs, list(inits), extra_opsets=[helper.make_opsetid(MS, 1)])


def test_the_contrib_decoder_ops_fall_back_with_qnns_reason_and_the_standard_form_as_the_fix():
    """The forms the target never writes: on QNN each runs on the CPU, and the log names the standard op."""
    r = rng(4)
    shape = [1, 4, 8]
    gamma = tensor("gamma", r.uniform(0.5, 1.5, 8).astype(np.float32))
    table = np.cos(np.outer(np.arange(16), np.arange(4) / 4)).astype(np.float32)
    cases = {
        "SkipSimplifiedLayerNormalization": _contrib("SkipSimplifiedLayerNormalization",
                                                     [vinfo("x", shape), vinfo("s", shape)], [vinfo("y", shape)],
                                                     [gamma]),
        "RotaryEmbedding": model([helper.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], num_heads=1,
                                                   name="rotary", domain=MS)],
                                 [vinfo("x", shape), vinfo("pos", [1, 4], np.int64)], [vinfo("y", shape)],
                                 [tensor("cos", table), tensor("sin", table)],
                                 extra_opsets=[helper.make_opsetid(MS, 1)]),
    }
    fixes = {"SkipSimplifiedLayerNormalization": "RMSNormalization (opset 23)",
             "RotaryEmbedding": "standard RotaryEmbedding (opset 23)"}
    for op, m in cases.items():
        (node,) = open_session(m).placement.fallbacks
        assert node.op_type == op and node.reason, node
        assert fixes[op] in node.fix, node
