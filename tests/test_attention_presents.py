"""``attention-presents`` (``--target qnn``): an Attention-23 decode step whose KV cache reaches the graph's
outputs through a sliding window's Slice (the whole axis, the window longer than the context) has the Slice
removed and its presents as the graph outputs, the same numbers; QNN's HTP runs it on padded batches, where
the graph as written compiles and fails at run (QNN_GRAPH_ERROR_INVALID_TENSOR)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import opfuse
from graphs import model, ops, ort_run, rng, tensor, vinfo
from qnn_graphs import needs_htp

n = helper.make_node
PATTERN = "Attention present->graph output"
B, HQ, HK, P, D = 2, 4, 2, 15, 8  # batch, query heads, key heads, past length, head size


def _decode_step(window_start=-4095) -> onnx.ModelProto:
    """One token's Attention-23 over a past of P, its mask from ``attention_mask`` [B, P + 1] (0 where padded,
    filled with -32768 as ``mask-fill`` leaves it), and each present as ``Slice(present, window_start, end,
    axis 2)``: the export of transformers' sliding-window cache."""
    nodes = [n("Cast", ["attention_mask"], ["allowed"], to=TensorProto.BOOL),
             n("Unsqueeze", ["allowed", "axes12"], ["allowed4"]),
             n("Where", ["allowed4", "zero", "fill"], ["bias"]),
             n("Attention", ["q", "k", "v", "bias", "past_key", "past_value"], ["y", "cat_key", "cat_value"],
               q_num_heads=HQ, kv_num_heads=HK, name="attention"),
             n("Slice", ["cat_key", "start", "end", "axis", "step"], ["present_key"], name="window_key"),
             n("Slice", ["cat_value", "start", "end", "axis", "step"], ["present_value"], name="window_value")]
    inits = [tensor("axes12", np.array([1, 2], np.int64)), tensor("zero", np.array(0.0, np.float32)),
             tensor("fill", np.array(-32768.0, np.float32)), tensor("start", np.array([window_start], np.int64)),
             tensor("end", np.array([2**63 - 1], np.int64)), tensor("axis", np.array([2], np.int64)),
             tensor("step", np.array([1], np.int64))]
    inputs = [vinfo("q", [B, 1, HQ * D]), vinfo("k", [B, 1, HK * D]), vinfo("v", [B, 1, HK * D]),
              vinfo("attention_mask", [B, P + 1], TensorProto.INT64),
              vinfo("past_key", [B, HK, P, D]), vinfo("past_value", [B, HK, P, D])]
    return model(nodes, inputs, [vinfo(x, None) for x in ("y", "present_key", "present_value")], inits, opset=23)


def _inputs(seed=0) -> dict:
    r = rng(seed)
    mask = np.ones((B, P + 1), np.int64)
    mask[1, :6] = 0  # the second row left-padded by 6
    return {"q": r.standard_normal((B, 1, HQ * D)).astype(np.float32),
            "k": r.standard_normal((B, 1, HK * D)).astype(np.float32),
            "v": r.standard_normal((B, 1, HK * D)).astype(np.float32), "attention_mask": mask,
            "past_key": r.standard_normal((B, HK, P, D)).astype(np.float32),
            "past_value": r.standard_normal((B, HK, P, D)).astype(np.float32)}


def _rewrite(m):
    out, report = opfuse.optimize(m, passes=["attention-presents"], target="qnn", compile_for_device=False,
                                  tune=False, inputs=_inputs())
    assert report.verification.ok, report.verification
    return ir.to_proto(out), report


def test_the_whole_window_slices_go_and_the_presents_are_the_outputs_with_the_same_values():
    original = _decode_step()
    out, report = _rewrite(original)
    assert [r.pattern for r in report.records] == [PATTERN, PATTERN]
    assert "Slice" not in ops(out), ops(out)
    (attention,) = [x for x in out.graph.node if x.op_type == "Attention"]
    assert list(attention.output) == ["y", "present_key", "present_value"]
    assert [o.name for o in out.graph.output] == ["y", "present_key", "present_value"]
    for seed in range(3):
        feeds = _inputs(seed)
        expected, actual = ort_run(original, feeds), ort_run(out, feeds)
        for name in expected:
            np.testing.assert_array_equal(actual[name], expected[name])


@pytest.mark.parametrize("start", [-(P + 1), 0])
def test_a_slice_from_the_first_position_is_the_whole_axis(start):
    out, report = _rewrite(_decode_step(start))
    assert "Slice" not in ops(out) and len(report.records) == 2


def test_a_window_shorter_than_the_context_stays_with_the_reason():
    """A Slice that keeps the last 8 of 16 positions cuts the cache: nothing to remove, the refusal says so."""
    out, report = _rewrite(_decode_step(-8))
    assert ops(out).count("Slice") == 2 and not report.records
    reasons = [r.reason for r in report.refusals if r.pattern == PATTERN]
    assert len(reasons) == 2 and all("keeps [8, 16)" in r and "INVALID_TENSOR" in r for r in reasons), reasons


@needs_htp
def test_the_htp_runs_the_decode_step_on_padded_batches_and_agrees():
    """The rewritten step runs on the HTP, its output and presents the CPU's within 1e-2 of their scale on a
    left-padded batch; the step as written compiles and then fails at its first run."""
    pytest.importorskip("onnxruntime_qnn", reason="the qnn extra (onnxruntime-qnn) is not installed")
    from opfuse.targets.qnn.backend import HtpRunError, open_session

    original = _decode_step()
    out, _ = _rewrite(original)
    session = open_session(out, strict=True)
    names = ["y", "present_key", "present_value"]
    for seed in range(2):
        feeds = _inputs(seed)
        expected = ort_run(original, feeds)
        for name, actual in zip(names, session.run(feeds, names)):
            scale = np.abs(expected[name]).max()
            assert np.abs(actual - expected[name]).max() / scale < 1e-2, name
    # (the HTP's own failure this pass avoids; if a new onnxruntime-qnn binds the presents, the pass can go)
    with pytest.raises(HtpRunError, match="QNN_GRAPH_ERROR_INVALID_TENSOR"):
        open_session(original, strict=True).run(_inputs(), names)
