"""``mask-fill`` (``--target qnn``): an additive mask of float32's minimum before a Softmax becomes
``Where(allowed, scores, -65504)``; and a Llama's decode and prefill steps, exported as
``benchmarks/decoders.py`` exports them, compile whole on QNN's HTP.

The oracle is ONNX Runtime's CPU running the unrewritten graph (and, for the compile, QNN's own
placement, read from its log by ``--require-npu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import opfuse
from decoder_nets import export_llama_step, export_tiny_llama, padded_prefill_feeds
from graphs import model, ops, ort_run, rng, tensor, vinfo
from opfuse.targets import TARGET_DEFAULT_PASSES
from qnn_graphs import needs_htp

n = helper.make_node
MIN = float(np.finfo(np.float32).min)
B, H, S, T = 2, 3, 4, 6


def _masked_softmax(fill: float, *, masked_when_true=False, mask_first=False, reader="Softmax") -> onnx.ModelProto:
    """scores [B, H, S, T] + Where(allowed [B, 1, S, T], 0, fill) -> Softmax (or ``reader``)."""
    branches = ["fill", "zero"] if masked_when_true else ["zero", "fill"]
    add = ["mask", "scores"] if mask_first else ["scores", "mask"]
    nodes = [n("Where", ["cond", *branches], ["mask"], name="mask"), n("Add", add, ["masked"], name="add_mask"),
             n(reader, ["masked"], ["p"], name="softmax", **({"axis": -1} if reader == "Softmax" else {}))]
    inits = [tensor("zero", np.array(0.0, np.float32)), tensor("fill", np.array(fill, np.float32))]
    return model(nodes, [vinfo("scores", [B, H, S, T]), vinfo("cond", [B, 1, S, T], TensorProto.BOOL)],
                 [vinfo("p", None)], inits, opset=18)


def _inputs(masked_when_true=False, seed=0, full_row=False) -> dict:
    r = rng(seed)
    allowed = r.random((B, 1, S, T)) > 0.5
    allowed[..., 0] = True  # every row has an allowed position...
    if full_row:
        allowed[1, 0, 2] = False  # ...but this one (a left-padded query's own row)
    scores = (r.standard_normal((B, H, S, T)) * 8).astype(np.float32)
    return {"scores": scores, "cond": ~allowed if masked_when_true else allowed}


def _mask_fill(m):
    out, report = opfuse.optimize(m, passes=["mask-fill"], runtime_level="disabled", tune=False)
    assert report.verification.ok, report.verification
    return ir.to_proto(out), report


@pytest.mark.parametrize("fill", [MIN, -1e30, float("-inf")], ids=["finfo.min", "-1e30", "-inf"])
@pytest.mark.parametrize("masked_when_true, mask_first", [(False, False), (True, False), (False, True)],
                         ids=["Where(allowed,0,F)", "Where(masked,F,0)", "Add(mask,scores)"])
def test_the_fill_becomes_minus_65504_and_the_softmax_is_the_same(fill, masked_when_true, mask_first):
    original = _masked_softmax(fill, masked_when_true=masked_when_true, mask_first=mask_first)
    out, report = _mask_fill(original)
    assert ops(out) == ["Where", "Softmax"], ops(out)
    fills = [float(onnx.numpy_helper.to_array(i)) for i in out.graph.initializer]
    assert fills == [-65504.0], fills
    (record,) = [r for r in report.records if r.pattern == "mask fill->-65504"]
    assert "-65504" in record.detail and not record.output  # (the Add's own values change, by design)
    for seed in range(3):
        inputs = _inputs(masked_when_true, seed)
        np.testing.assert_array_equal(ort_run(original, inputs)["p"], ort_run(out, inputs)["p"])


def test_a_fully_masked_row_stays_uniform_and_minus_inf_loses_its_nan():
    """float32's minimum absorbs the scores (s + F == F), so the original's fully masked row is uniform,
    and so is the rewritten one; with -inf the original's row is NaN (the exporters' IsNaN guard makes it 0),
    the rewritten one uniform: the one documented difference, on padding rows only."""
    inputs = _inputs(full_row=True)
    for fill in (MIN, float("-inf")):
        original = _masked_softmax(fill)
        out, _ = _mask_fill(original)
        expected, actual = ort_run(original, inputs)["p"], ort_run(out, inputs)["p"]
        np.testing.assert_array_equal(actual[1, :, 2], np.full((H, T), 1 / T, np.float32))
        if fill == MIN:
            np.testing.assert_array_equal(expected, actual)
        else:
            assert np.isnan(expected[1, :, 2]).all()
            others = np.ones(S, bool)
            others[2] = False
            np.testing.assert_array_equal(expected[0], actual[0])
            np.testing.assert_array_equal(expected[1][:, others], actual[1][:, others])


@pytest.mark.parametrize("case", ["a finite fill", "read by no Softmax"])
def test_other_masks_stay(case):
    """-1e4 (as BERT writes it) is held by float16 already and not absorbed in float32 (s + F != F), so a
    fully masked row would change; an Add read by another op than Softmax exposes the fill value itself."""
    original = _masked_softmax(-1e4) if case == "a finite fill" else _masked_softmax(MIN, reader="Relu")
    out, report = _mask_fill(original)
    assert ops(out) == ["Where", "Add", ops(original)[-1]], ops(out)
    assert not report.records


def test_a_llama_with_padded_batches_computes_the_same(tmp_path):
    """The tiny Llama's prefill (attention_mask and position_ids inputs), left-padded and not: the logits
    are the same numbers after the qnn target's passes (its mask-fill among them), on the CPU."""
    path = export_tiny_llama(tmp_path / "llama.onnx", mask="input", positions=True)
    original = onnx.load(path)
    out, report = opfuse.optimize(original, passes=list(TARGET_DEFAULT_PASSES["qnn"]), runtime_level="disabled",
                                  tune=False)
    out = ir.to_proto(out)
    assert sum(r.pattern == "mask fill->-65504" for r in report.records) == 2, [r.pattern for r in report.records]
    assert MIN not in {float(v) for i in out.graph.initializer if i.data_type == TensorProto.FLOAT
                       for v in onnx.numpy_helper.to_array(i).reshape(-1)[:1]}
    padded, _ = padded_prefill_feeds()
    unpadded = dict(padded, attention_mask=np.ones((3, 8), np.int64),
                    position_ids=np.tile(np.arange(8), (3, 1)).astype(np.int64))
    for inputs in (padded, unpadded):
        (expected,), (actual,) = ort_run(original, inputs).values(), ort_run(out, inputs).values()
        real = inputs["attention_mask"].astype(bool)
        np.testing.assert_allclose(actual[real], expected[real], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)  # padded rows too (uniform both)


@needs_htp
@pytest.mark.parametrize("graph, dim", [("decode", "past_seq=15"), ("prefill", "seq=16")])
def test_a_llama_step_compiles_whole_on_the_htp(tmp_path, graph, dim):
    """Its mask's GatherND (the index grid, folded into a constant by static shapes) fell back ("Failed to
    create GatherND node"); now ``--require-npu`` passes: every node on the HTP, one partition. Run as the
    command line (a child interpreter), so a compiler crash is a failed test, not a dead test run. At the
    export's opset 18 (``--opset 18``), where the mask stays written out: at 23, the target's default for a
    graph with an RMSNorm, the mask goes into Attention."""
    pytest.importorskip("onnxruntime_qnn", reason="the qnn extra (onnxruntime-qnn) is not installed")
    src = export_llama_step(tmp_path / f"{graph}.onnx", graph)
    out, log = tmp_path / "o.onnx", tmp_path / "log.json"
    done = subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(src), "-o", str(out), "--target", "qnn",
                           "--require-npu", "--dim", "batch=1", "--dim", dim, "--opset", "18", "--report", str(log), "-q"],
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "OPFUSE_SUPERVISED_CHILD"})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(log.read_text())
    text = json.dumps(report)
    assert "GatherND(index grid)->Gather" in text and "mask fill->-65504" in text
    assert "GatherND" not in ops(onnx.load(out))


def test_the_quantised_masked_scores_take_the_scores_range_where_calibration_masked():
    """The qnn quantiser configuration: a mask-fill Where whose calibrated minimum reaches -65504 gets its scores'
    range widened by 20 below (the fill saturates there, not a 16-bit step of 1.0); one calibration never masked
    keeps its own range."""
    pytest.importorskip("onnxruntime")
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    from opfuse.quantization.presets import PRESETS
    from opfuse.targets.qnn import conventions

    out, _ = _mask_fill(_masked_softmax(MIN))
    (where,) = [n for n in out.graph.node if n.op_type == "Where"]
    assert conventions._masked_wheres(out) == {where.output[0]: "scores"}
    assert conventions.wants_ranges(out) and not conventions.wants_ranges(_masked_softmax(MIN))

    def overrides(low):
        ranges = TensorsData(CalibrationMethod.MinMax, {
            "scores": TensorData(lowest=np.float32(-7.0), highest=np.float32(9.0)),
            where.output[0]: TensorData(lowest=np.float32(low), highest=np.float32(9.0))})
        captured = {}

        def fake(path, reader, **kwargs):
            captured.update(kwargs)
            raise StopIteration

        return ranges, captured, fake

    for low, expected in ((-65504.0, (-27.0, 9.0)), (-7.0, None)):
        ranges, captured, fake = overrides(low)
        import onnxruntime.quantization.execution_providers.qnn as qnn_module

        original = qnn_module.get_qnn_qdq_config
        qnn_module.get_qnn_qdq_config = fake
        try:
            with pytest.raises(StopIteration):
                conventions.quantizer_config("m.onnx", out, PRESETS["qnn-a16"],
                                             reader=None, sample_reader=None, method=None, extra={}, sixteen=[],
                                             excluded=[], ranges=ranges)
        finally:
            qnn_module.get_qnn_qdq_config = original
        got = (captured.get("init_overrides") or {}).get(where.output[0])
        if expected is None:
            assert got is None, got
        else:
            assert (float(got[0]["rmin"]), float(got[0]["rmax"])) == expected, got
