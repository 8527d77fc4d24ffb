"""``rotary-table`` (``--target qnn``): a rotary embedding's Cos/Sin of angles computed from integer positions
become a Gather from a table, bounded by the graph's attention context; on decoders built in code the logits and
presents are the same on padded batches, and the static shapes are what the dims bind.

The oracle is ONNX Runtime's CPU running the unrewritten graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import opfuse
from decoder_nets import export_llama_step, export_tiny_llama, padded_prefill_feeds
from graphs import model, ops, ort_run, rng, tensor, vinfo
from qnn_graphs import needs_htp

n = helper.make_node
CONTEXT, D = 16, 8


def _angles(transpose=False, positions=(2, 5)) -> onnx.ModelProto:
    """positions [B, S] -> Cast -> Unsqueeze(-1) -> Mul(inv_freq) -> Concat(x, x) -> Cos, Sin [B, S, 2D];
    beside it a Softmax over CONTEXT keys (the attention context that bounds the positions). ``transpose``:
    the positions transposed first (square), which moves them: not position-wise."""
    inv = (1 / 10000 ** (np.arange(0, 2 * D, 2) / (2 * D))).astype(np.float32)
    source = "pos"
    nodes = []
    if transpose:
        nodes.append(n("Transpose", ["pos"], ["pos_t"], perm=[1, 0]))
        source = "pos_t"
    nodes += [n("Cast", [source], ["pf"], to=TensorProto.FLOAT), n("Unsqueeze", ["pf", "axis"], ["pu"]),
              n("Mul", ["pu", "inv"], ["freqs"]), n("Concat", ["freqs", "freqs"], ["angles"], axis=-1),
              n("Cos", ["angles"], ["cos"], name="cos"), n("Sin", ["angles"], ["sin"], name="sin"),
              n("Softmax", ["scores"], ["p"], axis=-1)]
    shape = list(positions)
    return model(nodes, [vinfo("pos", shape, TensorProto.INT64), vinfo("scores", [1, 1, 1, CONTEXT])],
                 [vinfo("cos", [*shape, 2 * D]), vinfo("sin", [*shape, 2 * D]), vinfo("p", [1, 1, 1, CONTEXT])],
                 [tensor("inv", inv), tensor("axis", np.array([-1], np.int64))], opset=18)


def _table(m):
    out, report = opfuse.optimize(m, passes=["rotary-table"], runtime_level="disabled", tune=False)
    assert report.verification.ok, report.verification
    return ir.to_proto(out), report


def test_cos_and_sin_become_gathers_from_a_table_with_the_same_values():
    original = _angles()
    out, report = _table(original)
    assert sorted(ops(out)) == ["Gather", "Gather", "Softmax"], ops(out)
    records = [r for r in report.records if r.pattern == "rotary Cos/Sin->table"]
    assert len(records) == 2 and all(f"[{CONTEXT}, {2 * D}] table" in r.detail for r in records)
    tables = [onnx.numpy_helper.to_array(i) for i in out.graph.initializer if i.name.endswith("_table")]
    assert [t.shape for t in tables] == [(CONTEXT, 2 * D)] * 2
    scores = rng(0).standard_normal((1, 1, 1, CONTEXT)).astype(np.float32)
    for positions in (np.arange(10).reshape(2, 5), rng(1).integers(0, CONTEXT, (2, 5)),
                      np.array([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])):  # (left padding: position 0 repeated)
        feeds = {"pos": positions.astype(np.int64), "scores": scores}
        expected, actual = ort_run(original, feeds), ort_run(out, feeds)
        for name in ("cos", "sin"):
            np.testing.assert_array_equal(actual[name], expected[name])  # the very float32 values


@pytest.mark.parametrize("case", ["moved positions", "no context"])
def test_what_stays(case):
    """A path that moves positions (a Transpose of square positions) is not position-wise: the draws say so;
    without a static attention context there is no bound on the positions, so no table."""
    if case == "moved positions":
        original = _angles(transpose=True, positions=(4, 4))
    else:
        original = _angles()
        del original.graph.node[-1]
        del original.graph.input[-1]
        del original.graph.output[-1]
    out, report = _table(original)
    assert "Cos" in ops(out) and "Sin" in ops(out)
    assert not [r for r in report.records if r.pattern == "rotary Cos/Sin->table"]
    reasons = " ".join(r.reason for r in report.refusals if r.pattern == "rotary Cos/Sin->table")
    assert ("not position-wise" if case == "moved positions" else "no bound on the positions") in reasons, reasons


def _qnn(path, dims):
    """At the exports' opset 18, where the rotary stays written out (at 23, the target's default for a graph
    with an RMSNorm, it becomes RotaryEmbedding)."""
    out, report = opfuse.optimize(str(path), target="qnn", dims=dims, opset=18, compile_for_device=False, tune=False)
    assert report.verification.ok, report.verification
    return out, report


def test_a_llama_prefill_on_padded_batches_computes_the_same(tmp_path):
    """The tiny Llama's prefill at batch 3, seq 8 (its context: 8 keys): left-padded rows, positions counted from
    each row's first real token; Cos and Sin gone, the logits the same as the original's on the CPU."""
    path = export_tiny_llama(tmp_path / "llama.onnx", mask="input", positions=True)
    original = onnx.load(path)
    out, report = _qnn(path, {"batch": 3, "seq": 8})
    assert sum(r.pattern == "rotary Cos/Sin->table" for r in report.records) == 2
    assert "Cos" not in ops(out) and "Sin" not in ops(out)
    feeds, real = padded_prefill_feeds()
    (expected,), (actual,) = ort_run(original, feeds).values(), ort_run(out, feeds).values()
    np.testing.assert_allclose(actual[real], expected[real], rtol=1e-5, atol=1e-5)


def test_a_llama_decode_step_at_a_fixed_context(tmp_path):
    """The one-layer Llama's decode step with a 15-token cache bound (--dim past_seq=15): static shapes (the
    cache [2, 2, 15, 16], the mask [2, 16], the presents [2, 2, 16, 16]), a [16, 16] table, and on a batch
    whose second row is left-padded by 5 the same logits and presents as the original's."""
    path = export_llama_step(tmp_path / "decode.onnx", "decode")
    original = ir.load(path)
    out, report = _qnn(path, {"batch": 2, "past_seq": 15})
    shapes = {v.name: list(v.shape) for v in [*out.graph.inputs, *out.graph.outputs]}
    assert shapes["past_key_values.0.key"] == [2, 2, 15, 16] and shapes["attention_mask"] == [2, 16]
    assert shapes["present.0.key"] == [2, 2, 16, 16] and shapes["position_ids"] == [2, 1]
    (table,) = {r.detail.split(" table")[0].split("-> a ")[1] for r in report.records
                if r.pattern == "rotary Cos/Sin->table"}
    assert table == "[16, 16]"
    r = rng(2)
    mask = np.ones((2, 16), np.int64)
    mask[1, :5] = 0
    feeds = {"input_ids": r.integers(0, 100, (2, 1)).astype(np.int64), "attention_mask": mask,
             "position_ids": np.array([[15], [10]], np.int64)}
    for name, shape in shapes.items():
        if name.startswith("past_key_values."):
            feeds[name] = r.standard_normal(shape).astype(np.float32)
    expected, actual = ort_run(original, feeds), ort_run(out, feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(actual[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


@needs_htp
def test_a_llama_decode_step_compiles_whole_with_its_table_and_presents_agree(tmp_path):
    """The one-layer Llama's decode step at a 255 + 1 context through the command line (a child process):
    every node on the HTP, a [256, 16] table, and its presents (rotated keys) on the HTP within 1e-2 of their
    scale of the original on the CPU at position 200 (float16 angles put them 9e-2 off there)."""
    pytest.importorskip("onnxruntime_qnn", reason="the qnn extra (onnxruntime-qnn) is not installed")
    import json
    import os
    import subprocess
    import sys

    from opfuse.targets.qnn.backend import open_session

    src = export_llama_step(tmp_path / "decode.onnx", "decode")
    out, log = tmp_path / "o.onnx", tmp_path / "log.json"
    done = subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(src), "-o", str(out), "--target", "qnn",
                           "--require-npu", "--dim", "batch=1", "--dim", "past_seq=255", "--report", str(log), "-q"],
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "OPFUSE_SUPERVISED_CHILD"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a [256, 16] table" in log.read_text()
    assert json.loads(log.read_text())["device"]["on_cpu"] == []
    r = rng(3)
    feeds = {"input_ids": np.array([[7]], np.int64), "attention_mask": np.ones((1, 256), np.int64),
             "position_ids": np.array([[200]], np.int64)}
    for i in range(1):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = r.standard_normal((1, 2, 255, 16)).astype(np.float32)
    expected = ort_run(ir.load(src), feeds)
    session = open_session(str(out), strict=True)
    names = [o.name for o in session.session.get_outputs()]
    actual = dict(zip(names, session.run(feeds, names)))
    new = expected["present.0.key"][:, :, -1]
    assert np.abs(actual["present.0.key"][:, :, -1] - new).max() / np.abs(new).max() < 1e-2


def test_a_llama_prefill_at_opset_23_takes_its_bound_from_the_attentions_keys(tmp_path):
    """At opset 23 the prefill's attention is one Attention with no present output (no cache) and no Softmax
    is left: the bound is its key input's length (8 keys); Cos and Sin go, the logits at real tokens stay."""
    path = export_tiny_llama(tmp_path / "llama.onnx", mask="input", positions=True)
    original = onnx.load(path)
    out, report = opfuse.optimize(str(path), target="qnn", dims={"batch": 3, "seq": 8}, opset=23,
                                  compile_for_device=False, tune=False)
    assert report.verification.ok, report.verification
    assert report.applied("attention->Attention") and report.applied("rotary Cos/Sin->table")
    assert "Cos" not in ops(out) and "Sin" not in ops(out) and "Softmax" not in ops(out)
    tables = {r.detail.split(" table")[0].split("-> a ")[1] for r in report.applied("rotary Cos/Sin->table")}
    assert all(t.startswith("[8, ") for t in tables), tables  # (one per cache the rotary reads: 8 rows each)
    feeds, real = padded_prefill_feeds()
    (expected,), (actual,) = ort_run(original, feeds).values(), ort_run(out, feeds).values()
    np.testing.assert_allclose(actual[real], expected[real], rtol=1e-4, atol=1e-4)
