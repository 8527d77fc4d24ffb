"""Interleaved rotary position embeddings (rotary): GPT-J's rotate_every_two, full and partial, as the dynamo
and the TorchScript exporter write it, becomes RotaryEmbedding(interleaved=1) at ``--target onnx --opset 23``
and com.microsoft RotaryEmbedding at ``--target onnxruntime``, its caches the model's constant table; it
computes the same numbers on ONNX Runtime in a prefill and in a decode step whose positions run
past_len..past_len+seq-1, and the forms that are not this rotation stay with a reason.

Graphs are built here from the formula (onnx.helper) in each exporter's spelling, and from a torch block using
transformers' GPT-J rotary, exported by both torch exporters."""

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
from graphs import assert_outputs_close, model, ops, ort_run, rng, tensor, vinfo

H, D, P = 2, 8, 64  # heads, head size, table rows (positions)
BIG = np.iinfo(np.int64).max


def _table(rotary_dim: int) -> np.ndarray:
    """GPT-J's ``embed_positions``: [P, rotary_dim] = Concat(sin(angles), cos(angles))."""
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(P)[:, None] * inv_freq
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)


def gptj_model(exporter="dynamo", rotary_dim=D, layout="bshd", opset=18, sign="odd", table="interleave",
               batch_positions="N", past=False, other_positions=False):
    """q (an input, [N, S, H, D] or [N, H, S, D]) rotated as GPT-J does, with its tables gathered from the
    constant [P, rotary_dim] table by position_ids [N, S] (or [1, S]: ``batch_positions=1``)."""
    r, h = rotary_dim, rotary_dim // 2
    heads_axis = 2 if layout == "bshd" else 1
    inits = [tensor("table", _table(r)), tensor("last", np.array([-1], np.int64)),
             tensor("zero", np.array([0], np.int64)), tensor("one", np.array([1], np.int64)),
             tensor("two", np.array([2], np.int64)), tensor("three", np.array([3], np.int64)),
             tensor("four", np.array([4], np.int64)), tensor("big", np.array([BIG], np.int64)),
             tensor("r", np.array([r], np.int64)), tensor("heads_axis", np.array([heads_axis], np.int64)),
             tensor("axes_h4", np.array([heads_axis, 4], np.int64)), tensor("minus2", np.array([-2], np.int64)),
             tensor("pair", np.array([1, 1, 1, 1, 2], np.int64)), tensor("halves", np.array([h, h], np.int64)),
             tensor("rep_shape", np.array([0, 0, 0, -1], np.int64)),
             tensor("pairs_shape", np.array([0, 0, 0, r], np.int64))]
    nodes = []
    if exporter == "dynamo":
        nodes += [helper.make_node("Unsqueeze", ["position_ids", "last"], ["pos_idx"]),
                  helper.make_node("GatherND", ["table", "pos_idx"], ["sincos"]),
                  helper.make_node("Split", ["sincos"], ["sin", "cos"], axis=2, num_outputs=2)]
    else:
        nodes += [helper.make_node("Gather", ["table", "position_ids"], ["sincos0"], axis=0),
                  helper.make_node("Cast", ["sincos0"], ["sincos"], to=TensorProto.FLOAT),
                  helper.make_node("Split", ["sincos", "halves"], ["sin", "cos"], axis=-1)]
    if other_positions:  # sin gathered by other positions than cos: not one rotation's tables
        inits.append(tensor("shift", np.array(1, np.int64)))
        nodes += [helper.make_node("Add", ["position_ids", "shift"], ["pos2"]),
                  helper.make_node("Gather", ["table", "pos2"], ["sincos2"], axis=0),
                  helper.make_node("Split", ["sincos2", "halves"], ["sin_other", "cos_unused"], axis=-1)]
    reps = {}
    for name in ("sin", "cos"):
        source = "sin_other" if other_positions and name == "sin" else name
        if table == "halves":  # the rotate-half layout (c0 .. c_{h-1} c0 .. c_{h-1}): another pairing
            nodes += [helper.make_node("Concat", [source, source], [f"{name}_cat"], axis=-1),
                      helper.make_node("Unsqueeze", [f"{name}_cat", "heads_axis"], [f"{name}_rep"])]
        elif exporter == "dynamo":
            nodes += [helper.make_node("Unsqueeze", [source, "axes_h4"], [f"{name}_u"]),
                      helper.make_node("Expand", [f"{name}_u", "pair"], [f"{name}_e"]),
                      helper.make_node("Reshape", [f"{name}_e", "rep_shape"], [f"{name}_rep"])]
        else:
            nodes += [helper.make_node("Unsqueeze", [source, "heads_axis"], [f"{name}_u1"]),
                      helper.make_node("Unsqueeze", [f"{name}_u1", "four"], [f"{name}_u"]),
                      helper.make_node("Tile", [f"{name}_u", "pair"], [f"{name}_e"]),
                      helper.make_node("Shape", [f"{name}_e"], [f"{name}_shape"]),
                      helper.make_node("Slice", [f"{name}_shape", "zero", "three", "zero"], [f"{name}_lead"]),
                      helper.make_node("Concat", [f"{name}_lead", "last"], [f"{name}_target"], axis=0),
                      helper.make_node("Reshape", [f"{name}_e", f"{name}_target"], [f"{name}_rep"])]
        reps[name] = f"{name}_rep"
    x = "q"
    if rotary_dim < D:
        nodes += [helper.make_node("Slice", ["q", "zero", "r", "three", "one"], ["q_rot"]),
                  helper.make_node("Slice", ["q", "r", "big", "three", "one"], ["q_pass"])]
        x = "q_rot"
    negated, kept = ("odd", "even") if sign == "odd" else ("even", "odd")
    nodes += [helper.make_node("Slice", [x, "zero", "big", "three", "two"], ["even"]),
              helper.make_node("Slice", [x, "one", "big", "three", "two"], ["odd"]),
              helper.make_node("Neg", [negated], ["neg"]),
              helper.make_node("Unsqueeze", ["neg", "last"], ["neg_u"]),
              helper.make_node("Unsqueeze", [kept, "last"], ["kept_u"]),
              helper.make_node("Concat", ["neg_u", "kept_u"], ["pairs"], axis=-1)]
    if exporter == "dynamo":
        nodes.append(helper.make_node("Reshape", ["pairs", "pairs_shape"], ["rotated"]))
    else:
        nodes += [helper.make_node("Shape", ["pairs"], ["pairs_shp"]),
                  helper.make_node("Slice", ["pairs_shp", "zero", "minus2", "zero"], ["pairs_lead"]),
                  helper.make_node("Concat", ["pairs_lead", "last"], ["pairs_target"], axis=0),
                  helper.make_node("Reshape", ["pairs", "pairs_target"], ["rotated"])]
    y = "y_rot" if rotary_dim < D else "y"
    nodes += [helper.make_node("Mul", [x, reps["cos"]], ["xc"]),
              helper.make_node("Mul", ["rotated", reps["sin"]], ["rs"]),
              helper.make_node("Add", ["xc", "rs"], [y])]
    if rotary_dim < D:
        nodes.append(helper.make_node("Concat", ["y_rot", "q_pass"], ["y"], axis=-1))
    q_shape = ["N", "S", H, D] if layout == "bshd" else ["N", H, "S", D]
    inputs = [vinfo("q", q_shape), vinfo("position_ids", [batch_positions, "S"], TensorProto.INT64)]
    out = "y"
    if past:  # a decode step's present: [N, H, P+S, D]
        inputs.append(vinfo("past_key", ["N", H, "Past", D]))
        if layout == "bshd":
            nodes.append(helper.make_node("Transpose", ["y"], ["y_t"], perm=[0, 2, 1, 3]))
        nodes.append(helper.make_node("Concat", ["past_key", "y_t" if layout == "bshd" else "y"], ["present"], axis=2))
        out = "present"
    return model(nodes, inputs, [vinfo(out, None)], inits, opset=opset)


def feeds(layout="bshd", batch=2, seq=5, past=0, batch_positions=None):
    r = rng(11)
    shape = (batch, seq, H, D) if layout == "bshd" else (batch, H, seq, D)
    out = {"q": r.standard_normal(shape).astype(np.float32),
           "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch_positions or batch, 1))}
    if past:
        out["past_key"] = r.standard_normal((batch, H, past, D)).astype(np.float32)
    return out


def optimize(m, target, **kw):
    kw.setdefault("runtime_level", "disabled")
    kw.setdefault("tune", False)
    return opfuse.optimize(m, target=target, **kw)


def assert_same_on(original, optimised, inputs):
    assert_outputs_close(ort_run(original, inputs), ort_run(optimised, inputs), 1e-5, 1e-5)


TARGETS = [("onnxruntime", None, "com.microsoft"), ("onnx", 23, ""), ("onnxruntime", 23, "")]


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("rotary_dim", [D, 4])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("target, opset, domain", TARGETS)
def test_each_form_becomes_one_interleaved_rotary_embedding(exporter, rotary_dim, layout, target, opset, domain):
    m = gptj_model(exporter, rotary_dim, layout)
    out, report = optimize(m, target, opset=opset)
    rotary = [n for n in out.graph if n.op_type == "RotaryEmbedding"]
    assert len(rotary) == 1 and rotary[0].domain == domain, (ops(out), report.refusals)
    assert rotary[0].attributes.get_int("interleaved", 0) == 1
    assert rotary[0].attributes.get_int("rotary_embedding_dim", 0) == (rotary_dim if rotary_dim < D else 0)
    assert not {"Neg", "Add", "GatherND", "Gather", "Tile", "Expand"} & set(ops(out)), ops(out)
    if layout == "bshd":  # the 3-D view, with the head count
        assert rotary[0].attributes.get_int("num_heads", 0) == H
    caches = [v for v in rotary[0].inputs if v is not None and v.const_value is not None]
    assert [tuple(v.const_value.shape) for v in caches] == [(P, rotary_dim // 2)] * 2  # cos, sin: the table's columns
    assert len(report.applied("rotary->RotaryEmbedding")) == 1
    assert report.verification.ok
    for past, seq in ((0, 5), (17, 3)):
        assert_same_on(m, out, {**feeds(layout, seq=seq), "position_ids": np.tile(np.arange(past, past + seq), (2, 1))})


@pytest.mark.parametrize("target, opset, domain", TARGETS)
@pytest.mark.parametrize("rotary_dim", [D, 4])
@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_decode_step_reads_the_positions_after_the_past(target, opset, domain, rotary_dim, exporter):
    m = gptj_model(exporter, rotary_dim, past=True)
    out, report = optimize(m, target, opset=opset)
    assert [n.domain for n in out.graph if n.op_type == "RotaryEmbedding"] == [domain], report.refusals
    assert report.verification.ok
    for past, seq in ((7, 1), (3, 4), (P - 1, 1)):  # the last row of the table
        assert_same_on(m, out, feeds(seq=seq, past=past))


@pytest.mark.parametrize("target, opset", [("onnxruntime", None), ("onnx", 23)])
def test_positions_outside_the_table_fail_loudly_as_in_the_original(target, opset):
    """Past the table both the export's Gather and the fused op fail; a negative id (which Gather reads from
    the table's end) is not a position, and the fused op fails on it rather than write another number."""
    m = gptj_model(rotary_dim=4)
    out, _ = optimize(m, target, opset=opset)
    for position, original_runs in ((P, False), (-1, True)):
        inputs = {**feeds(seq=1), "position_ids": np.full((2, 1), position, np.int64)}
        if original_runs:
            assert np.isfinite(ort_run(m, inputs)["y"]).all()
        else:
            with pytest.raises(Exception, match="GatherND"):
                ort_run(m, inputs)
        with pytest.raises(Exception, match="out of range"):
            ort_run(out, inputs)


def test_below_opset_23_the_onnx_target_keeps_it_with_the_opset_named():
    m = gptj_model()
    out, report = optimize(m, "onnx")
    assert "RotaryEmbedding" not in ops(out)
    reasons = " ".join(r.reason for r in report.refusals if "rotary" in r.pattern)
    assert "opset 23" in reasons and "--opset 23" in reasons, report.refusals
    assert_same_on(m, out, feeds())


@pytest.mark.parametrize("case, reason", [
    (dict(table="halves"), "not each angle repeated in two adjacent channels"),
    (dict(exporter="torchscript", table="halves"), "not each angle repeated in two adjacent channels"),
    (dict(sign="even"), "the negated slice is the even channels"),
    (dict(other_positions=True), "gathered by different position ids"),
    (dict(batch_positions=1), "not provably x's axes 0 and 1"),
])
@pytest.mark.parametrize("target, opset", [("onnxruntime", None), ("onnx", 23)])
def test_what_is_not_this_rotation_stays_with_a_reason(case, reason, target, opset):
    m = gptj_model(**case)
    out, report = optimize(m, target, opset=opset)
    assert "RotaryEmbedding" not in ops(out), ops(out)
    reasons = " ".join(r.reason for r in report.refusals if "rotary" in r.pattern)
    assert reason in reasons, report.refusals
    assert_same_on(m, out, feeds(batch_positions=case.get("batch_positions")))


# -- torch, both exporters ------------------------------------------------------------------------

def _gptj_block(rotary_dim: int):
    """Query and key projections of x [B, S, 32] into 4 heads of 8, rotated by transformers' GPT-J rotary
    (its table of max_position_embeddings 32 rows, ``rotary_dim`` channels of each head), scores against the
    keys after the past keys."""
    torch = extras.require("torch")
    transformers = extras.require("transformers")
    from transformers.models.gptj.modeling_gptj import GPTJRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.GPTJConfig(n_embd=32, n_head=4, rotary_dim=rotary_dim, n_positions=32)
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.rope = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32), GPTJRotaryEmbedding(config)

        def forward(self, x, position_ids, past_key):
            b, s, _ = x.shape
            q, k = self.q(x).view(b, s, 4, 8), self.k(x).view(b, s, 4, 8)
            sin, cos = self.rope(x, position_ids)
            q_rot, q_pass = q[:, :, :, :rotary_dim], q[:, :, :, rotary_dim:]
            k_rot, k_pass = k[:, :, :, :rotary_dim], k[:, :, :, rotary_dim:]
            q = torch.cat([apply_rotary_pos_emb(q_rot, sin, cos), q_pass], dim=-1).transpose(1, 2)
            k = torch.cat([apply_rotary_pos_emb(k_rot, sin, cos), k_pass], dim=-1).transpose(1, 2)
            return q @ torch.cat([past_key, k], dim=2).transpose(-1, -2)

    return Block().eval()


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_transformers_gptj_rotary_from_both_exporters(tmp_path, exporter, rotary_dim):
    torch = extras.require("torch")
    block = _gptj_block(rotary_dim)
    names = ["x", "position_ids", "past_key"]
    args = (torch.randn(2, 3, 32), torch.arange(4, 7).repeat(2, 1), torch.randn(2, 4, 4, 8))
    dynamic = {"x": {0: "batch", 1: "seq"}, "position_ids": {0: "batch", 1: "seq"}, "past_key": {0: "batch", 2: "past"}}
    path = str(tmp_path / "block.onnx")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            shapes = tuple({a: torch.export.Dim(d) for a, d in dynamic[n].items()} for n in names)
            torch.onnx.export(block, args, path, dynamo=True, opset_version=18, external_data=False,
                              input_names=names, dynamic_shapes=shapes)
        else:
            torch.onnx.export(block, args, path, dynamo=False, opset_version=17, input_names=names,
                              output_names=["y"], dynamic_axes=dynamic)
    for target, target_opset, domain in TARGETS[:2]:
        out, report = opfuse.optimize(path, target=target, opset=target_opset, runtime_level="disabled", tune=False)
        rotary = [n for n in out.graph if n.op_type == "RotaryEmbedding"]
        assert len(rotary) == 2 and {n.domain for n in rotary} == {domain}, (ops(out), report.refusals)
        assert all(n.attributes.get_int("interleaved", 0) == 1 for n in rotary)
        assert report.verification.ok
        r = rng(3)
        for past_len, seq in ((4, 3), (0, 6), (31, 1)):
            inputs = {"x": r.standard_normal((2, seq, 32)).astype(np.float32),
                      "position_ids": np.tile(np.arange(past_len, past_len + seq), (2, 1)).astype(np.int64),
                      "past_key": r.standard_normal((2, 4, past_len, 8)).astype(np.float32)}
            assert_outputs_close(ort_run(onnx.load(path), inputs), ort_run(out, inputs), 1e-4, 1e-4)
