"""Rotary position embeddings (rotary): Hugging Face's rotate-half form, full and partial, becomes
RotaryEmbedding-23 at ``--target onnx --opset 23`` and com.microsoft RotaryEmbedding at
``--target onnxruntime``, computes the same numbers on ONNX Runtime in a prefill and in a decode
step whose positions run past_len..past_len+seq-1, and the illegal variants stay with a reason.

Graphs are built here from the formula (onnx.helper), from a torch module exported by both
torch exporters, and from transformers' tiny Llama and Phi."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import extras
import opfuse
from decoder_nets import export_tiny_llama, shared_export
from graphs import assert_outputs_close, model, ops, ort_run, rng, tensor, vinfo

H, D = 2, 8
BIG = np.iinfo(np.int64).max


def rotary_model(opset=18, rotary_dim=D, scaling=None, cast=False, sign="second", cos_halves="same",
                 table_batch="N", slice_axis=-1, second_end=BIG, past=False):
    """q [N, H, S, D] (an input) rotated by Hugging Face's rotate-half with tables from position_ids
    [N, S]; ``rotary_dim`` < D: Phi's partial form (the rest passed through); ``past``: the result
    joined after past keys [N, H, P, D], as a decode step's present."""
    h = rotary_dim // 2
    inv_freq = (1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)).astype(np.float32)
    inits = [tensor("inv_freq", inv_freq), tensor("last", np.array([-1], np.int64)),
             tensor("one", np.array([1], np.int64)), tensor("zero", np.array([0], np.int64)),
             tensor("h", np.array([h], np.int64)), tensor("big", np.array([second_end], np.int64)),
             tensor("axis", np.array([slice_axis], np.int64)), tensor("r", np.array([rotary_dim], np.int64)),
             tensor("dend", np.array([BIG], np.int64)), tensor("three", np.array([3], np.int64))]
    nodes = [helper.make_node("Unsqueeze", ["position_ids", "last"], ["pos3"]),
             helper.make_node("Cast", ["pos3"], ["posf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["posf", "inv_freq"], ["freqs"])]
    if cos_halves == "same":
        nodes.append(helper.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1))
        sin_emb = "emb"
    else:  # sin's second half from other angles: its halves differ
        nodes += [helper.make_node("Concat", ["freqs", "freqs"], ["emb"], axis=-1),
                  helper.make_node("Add", ["freqs", "freqs"], ["other"]),
                  helper.make_node("Concat", ["freqs", "other"], ["emb2"], axis=-1)]
        sin_emb = "emb2"
    nodes += [helper.make_node("Cos", ["emb"], ["cos0"]), helper.make_node("Sin", [sin_emb], ["sin0"])]
    cos, sin = "cos0", "sin0"
    if scaling is not None:
        inits.append(tensor("scaling", np.float32(scaling)))
        nodes += [helper.make_node("Mul", [cos, "scaling"], ["cos1"]),
                  helper.make_node("Mul", [sin, "scaling"], ["sin1"])]
        cos, sin = "cos1", "sin1"
    if cast:
        nodes += [helper.make_node("Cast", [cos], ["cos2"], to=TensorProto.FLOAT),
                  helper.make_node("Cast", [sin], ["sin2"], to=TensorProto.FLOAT)]
        cos, sin = "cos2", "sin2"
    if table_batch == 1:  # tables of batch 1, broadcast over x's batch
        nodes += [helper.make_node("Slice", [cos, "zero", "one", "zero"], ["cos3"]),
                  helper.make_node("Slice", [sin, "zero", "one", "zero"], ["sin3"])]
        cos, sin = "cos3", "sin3"
    nodes += [helper.make_node("Unsqueeze", [cos, "one"], ["cos4"]),
              helper.make_node("Unsqueeze", [sin, "one"], ["sin4"])]
    x = "q"
    if rotary_dim < D:
        nodes += [helper.make_node("Slice", ["q", "zero", "r", "last"], ["q_rot"]),
                  helper.make_node("Slice", ["q", "r", "dend", "last"], ["q_pass"])]
        x = "q_rot"
    first, second = (("zero", "h"), ("h", "big")) if sign == "second" else (("h", "big"), ("zero", "h"))
    nodes += [helper.make_node("Slice", [x, *first, "axis"], ["x1"]),
              helper.make_node("Slice", [x, *second, "axis"], ["x2"]),
              helper.make_node("Neg", ["x2"], ["neg"]),
              helper.make_node("Concat", ["neg", "x1"], ["rotated"], axis=-1),
              helper.make_node("Mul", [x, "cos4"], ["xc"]),
              helper.make_node("Mul", ["rotated", "sin4"], ["rs"]),
              helper.make_node("Add", ["xc", "rs"], ["y_rot" if rotary_dim < D else "y"])]
    if rotary_dim < D:
        nodes.append(helper.make_node("Concat", ["y_rot", "q_pass"], ["y"], axis=-1))
    inputs = [vinfo("q", ["N", H, "S", D]), vinfo("position_ids", ["N", "S"], TensorProto.INT64)]
    out = "y"
    if past:
        inputs.append(vinfo("past_key", ["N", H, "P", D]))
        nodes.append(helper.make_node("Concat", ["past_key", "y"], ["present"], axis=2))
        out = "present"
    return model(nodes, inputs, [vinfo(out, None)], inits, opset=opset)


def feeds(batch=2, seq=5, past=0):
    r = rng(7)
    out = {"q": r.standard_normal((batch, H, seq, D)).astype(np.float32),
           "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1))}
    if past:
        out["past_key"] = r.standard_normal((batch, H, past, D)).astype(np.float32)
    return out


def optimize(m, target, **kw):
    kw.setdefault("runtime_level", "disabled")
    return opfuse.optimize(m, target=target, **kw)


def assert_same_on(original, optimised, inputs):
    assert_outputs_close(ort_run(original, inputs), ort_run(optimised, inputs), 1e-5, 1e-5)


TARGETS = [("onnxruntime", None, "com.microsoft"), ("onnx", 23, ""), ("onnxruntime", 23, "")]
FORMS = [
    dict(),  # dynamo's: Slice axes [-1], ends INT64_MAX
    dict(opset=17, slice_axis=3, second_end=D),  # TorchScript's axes [3], a head-size end
    dict(scaling=1.0, cast=True),  # * attention_scaling, then .to(dtype)
    dict(scaling=0.75),
    dict(rotary_dim=4),  # Phi's partial rotary: half of the head rotated
    dict(rotary_dim=4, opset=17, scaling=1.0),
]


@pytest.mark.parametrize("case", FORMS)
@pytest.mark.parametrize("target, opset, domain", TARGETS)
def test_each_form_becomes_one_rotary_embedding(case, target, opset, domain):
    m = rotary_model(**case)
    out, report = optimize(m, target, opset=opset)
    rotary = [n for n in out.graph if n.op_type == "RotaryEmbedding"]
    assert len(rotary) == 1 and rotary[0].domain == domain, (ops(out), report.refusals)
    assert not {"Neg", "Add"} & set(ops(out)), ops(out)
    rotary_dim = case.get("rotary_dim", D)
    assert rotary[0].attributes.get_int("rotary_embedding_dim", 0) == (rotary_dim if rotary_dim < D else 0)
    assert len(report.applied("rotary->RotaryEmbedding")) == 1
    assert report.verification.ok
    assert_same_on(m, out, feeds())


@pytest.mark.parametrize("target, opset, domain", TARGETS)
@pytest.mark.parametrize("rotary_dim", [D, 4])
def test_a_decode_step_counts_positions_after_the_past(target, opset, domain, rotary_dim):
    m = rotary_model(rotary_dim=rotary_dim, past=True)
    out, report = optimize(m, target, opset=opset)
    assert [n.domain for n in out.graph if n.op_type == "RotaryEmbedding"] == [domain], report.refusals
    assert report.verification.ok
    for past, seq in ((7, 1), (3, 4), (300, 1)):  # past the table of any max_position_embeddings guess
        assert_same_on(m, out, feeds(batch=2, seq=seq, past=past))


def test_below_opset_23_the_onnx_target_keeps_it_with_the_opset_named():
    m = rotary_model()
    out, report = optimize(m, "onnx")
    assert "RotaryEmbedding" not in ops(out)
    reasons = " ".join(r.reason for r in report.refusals if "rotary" in r.pattern)
    assert "opset 23" in reasons and "--opset 23" in reasons, report.refusals
    assert_same_on(m, out, feeds())


def test_qnn_writes_the_standard_op_which_it_runs():
    """QNN runs RotaryEmbedding-23 whole and its com.microsoft op not at all (benchmarks/qnn_ops.py;
    tests/test_qnn_decoder.py checks the placement): the target writes the standard op."""
    m = rotary_model(opset=23)
    out, report = optimize(m, "qnn", dims={"N": 2, "S": 5})
    rotary = [n for n in out.graph if n.op_type == "RotaryEmbedding"]
    assert len(rotary) == 1 and rotary[0].domain in ("", "ai.onnx") and "Neg" not in ops(out), ops(out)
    assert_same_on(m, out, feeds())


@pytest.mark.parametrize("case, reason", [
    (dict(sign="first"), "the negated slice is the first half"),
    (dict(cos_halves="differ"), "its sin table is not one tensor of angles repeated in both halves"),
    (dict(table_batch=1), "not provably x's axes 0 and 2"),
])
@pytest.mark.parametrize("target, opset", [("onnxruntime", None), ("onnx", 23)])
def test_illegal_variants_stay_with_a_reason(case, reason, target, opset):
    m = rotary_model(**case)
    out, report = optimize(m, target, opset=opset)
    assert "RotaryEmbedding" not in ops(out), ops(out)
    reasons = " ".join(r.reason for r in report.refusals if "rotary" in r.pattern)
    assert reason in reasons, report.refusals
    assert_same_on(m, out, feeds())


# -- torch modules, both exporters --------------------------------------------------------------

def _export(module, args, names, dynamic, path, exporter, opset):
    torch = extras.require("torch")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            shapes = {name: {axis: torch.export.Dim(dim) for axis, dim in axes.items()}
                      for name, axes in dynamic.items()}
            torch.onnx.export(module, args, str(path), dynamo=True, opset_version=opset, external_data=False,
                              input_names=names, dynamic_shapes=tuple(shapes[n] for n in names))
        else:
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=opset, input_names=names,
                              output_names=["y"], dynamic_axes=dynamic)
    return str(path)


def _rotary_block(rotary_dim: int, past: bool):
    """A query/key projection of x [B, S, 32] into 4 heads of 8, rotated as transformers' Llama (rotary_dim
    8) or Phi (rotary_dim 4, its own tables) does, attention scores against the keys (after the past keys,
    if any); max_position_embeddings 16, which the decode step's positions run past."""
    torch = extras.require("torch")
    transformers = extras.require("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    if rotary_dim < 8:  # Phi: its rotary tables cover the first rotary_dim channels of each head
        from transformers.models.phi.modeling_phi import PhiRotaryEmbedding

        config = transformers.PhiConfig(hidden_size=32, num_attention_heads=4, partial_rotary_factor=rotary_dim / 8,
                                        max_position_embeddings=16)
        rope = PhiRotaryEmbedding(config)
    else:
        config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, max_position_embeddings=16)
        rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.rope = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), rope

        def forward(self, x, position_ids, past_key=None):
            b, s, _ = x.shape
            q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
            k = self.k(x).view(b, s, 4, 8).transpose(1, 2)
            cos, sin = self.rope(x, position_ids)
            if rotary_dim < 8:  # Phi's partial form
                q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
                k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
                q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)
                q, k = torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1)
            else:
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if past_key is not None:
                k = torch.cat([past_key, k], dim=2)
            return q @ k.transpose(-1, -2)

    return Block().eval(), rope


@pytest.mark.parametrize("exporter, opset", [("dynamo", 18), ("torchscript", 17)])
@pytest.mark.parametrize("rotary_dim", [8, 4])
@pytest.mark.parametrize("past", [False, True])
@pytest.mark.parametrize("target, target_opset, domain", TARGETS[:2])
def test_torch_rotary_blocks_from_both_exporters(tmp_path, exporter, opset, rotary_dim, past, target, target_opset,
                                                 domain):
    torch = extras.require("torch")
    block, _ = _rotary_block(rotary_dim, past)
    x, pos = torch.randn(2, 3, 32), torch.arange(3).repeat(2, 1)
    names, args = ["x", "position_ids"], (x, pos)
    dynamic = {"x": {0: "batch", 1: "seq"}, "position_ids": {0: "batch", 1: "seq"}}
    if past:
        names.append("past_key")
        args = (x, pos + 4, torch.randn(2, 4, 4, 8))
        dynamic["past_key"] = {0: "batch", 2: "past"}
    path = str(shared_export(tmp_path / "block.onnx", f"rotary_block|{exporter}|{opset}|{rotary_dim}|{past}",
                             lambda to: _export(block, args, names, dynamic, to, exporter, opset)))
    out, report = opfuse.optimize(path, target=target, opset=target_opset, runtime_level="disabled")
    rotary = [n for n in out.graph if n.op_type == "RotaryEmbedding"]
    assert len(rotary) == 2 and {n.domain for n in rotary} == {domain}, (ops(out), report.refusals)
    assert report.verification.ok
    r = rng(3)
    for past_len, seq in ((4, 3), (20, 1)) if past else ((0, 3), (0, 6)):
        inputs = {"x": r.standard_normal((2, seq, 32)).astype(np.float32),
                  "position_ids": np.tile(np.arange(past_len, past_len + seq), (2, 1)).astype(np.int64)}
        if past:
            inputs["past_key"] = r.standard_normal((2, 4, past_len, 8)).astype(np.float32)
        assert_outputs_close(ort_run(onnx.load(path), inputs), ort_run(out, inputs), 1e-4, 1e-4)


# -- transformers' tiny decoders ------------------------------------------------------------------

@pytest.mark.parametrize("exporter, opset", [("dynamo", 18), ("torchscript", 17)])
@pytest.mark.parametrize("target, target_opset, domain", TARGETS[:2])
def test_tiny_llama_rotaries_are_fused(tmp_path, exporter, opset, target, target_opset, domain):
    """Two layers, a query and a key rotation each: four RotaryEmbedding, where position_ids [batch, seq]
    are an input (as ``benchmarks/decoders.py`` exports them)."""
    path = export_tiny_llama(tmp_path / "llama.onnx", exporter=exporter, opset=opset,
                             mask="input" if exporter == "torchscript" else "none", positions=True)
    out, report = opfuse.optimize(str(path), target=target, opset=target_opset)
    assert report.verification.ok
    written = Counter((n.domain, n.op_type) for n in out.graph)
    assert written[(domain, "RotaryEmbedding")] == 4, (written, report.refusals)
    assert report.pattern_counts()["rotary->RotaryEmbedding"] == 4
    # the half-width caches are Cos(freqs) and Sin(freqs): no Slice of Cos(Concat(freqs, freqs)) left
    trig = {v.name for n in out.graph if n.op_type in ("Cos", "Sin") for v in n.outputs}
    assert not [n.name for n in out.graph if n.op_type == "Slice" and n.inputs[0] is not None
                and n.inputs[0].name in trig], ops(out)
    assert not [n.name for n in out.graph if n.op_type == "Concat" and len(n.inputs) == 2
                and n.inputs[0] is n.inputs[1]], ops(out)


def test_tables_of_batch_one_are_refused_with_the_reason(tmp_path):
    """Without a position_ids input transformers makes them [1, seq]: the tables broadcast over the batch,
    which the fused op's [batch, seq, dim/2] cache does not (each site refused, saying so)."""
    path = export_tiny_llama(tmp_path / "llama.onnx", exporter="dynamo", opset=18)
    out, report = opfuse.optimize(str(path), target="onnxruntime")
    assert report.verification.ok and "RotaryEmbedding" not in ops(out)
    reasons = [r.reason for r in report.refusals if "rotary" in r.pattern]
    assert len(reasons) == 4 and all("not provably x's axes 0 and 2" in r and "[1, " in r for r in reasons), reasons
