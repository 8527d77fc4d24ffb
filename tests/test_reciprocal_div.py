"""``reciprocal-div`` (``--target qnn``): Reciprocal(x) becomes Div(1, x), the same float32 values; and
the HTP computes the quantised Div right where its quantised Reciprocal of a small-scaled input is wrong."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper

import opfuse
from graphs import model, ops, ort_run, rng, vinfo
from qnn_graphs import needs_htp

n = helper.make_node


def _rsqrt(shape=(1, 64, 1)):
    return model([n("Sqrt", ["x"], ["s"]), n("Reciprocal", ["s"], ["r"]), n("Mul", ["r", "y"], ["z"])],
                 [vinfo("x", list(shape)), vinfo("y", [*shape[:-1], 16])], [vinfo("z", [*shape[:-1], 16])], opset=18)


def _feeds(low, high, seed=0):
    r = rng(seed)
    return {"x": r.uniform(low, high, (1, 64, 1)).astype(np.float32),
            "y": r.standard_normal((1, 64, 16)).astype(np.float32)}


def test_reciprocal_becomes_div_with_the_same_values():
    original = _rsqrt()
    out, report = opfuse.optimize(original, passes=["reciprocal-div"], target="qnn", compile_for_device=False, tune=False,
                                  inputs=_feeds(0.05, 2.0))
    assert report.verification.ok
    assert ops(out) == ["Sqrt", "Div", "Mul"], ops(out)
    assert [r.pattern for r in report.records] == ["Reciprocal->Div"]
    for low, high in ((2e-4, 5e-4), (0.05, 2.0)):
        feeds = _feeds(low, high)
        np.testing.assert_array_equal(ort_run(out, feeds)["z"], ort_run(original, feeds)["z"])


@needs_htp
def test_the_htp_quantised_div_is_right_where_its_reciprocal_is_not():
    pytest.importorskip("onnxruntime_qnn", reason="the qnn extra (onnxruntime-qnn) is not installed")
    import onnxruntime as ort

    from opfuse.quantization.presets import PRESETS
    from opfuse.targets.qnn.backend import open_session
    from opfuse.targets.qnn.probe import quantize_like_qnn_flow

    samples = [_feeds(2e-4, 5e-4, seed) for seed in range(4)]
    original = _rsqrt()
    rewritten = ir.to_proto(opfuse.optimize(original, passes=["reciprocal-div"], target="qnn", compile_for_device=False, tune=False, inputs=samples[0])[0])

    def htp_vs_cpu(m):
        qdq = quantize_like_qnn_flow(m, samples, preset=PRESETS["qnn-a16-per-channel"])
        cpu = ort.InferenceSession(qdq.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, samples[0])[0]
        htp = open_session(qdq, strict=True).run(samples[0])[0]
        return 10 * np.log10((cpu.astype(np.float64) ** 2).sum() / ((cpu - htp).astype(np.float64) ** 2).sum())

    assert htp_vs_cpu(rewritten) > 60
    assert htp_vs_cpu(original) < 10  # (the HTP's own error this pass avoids; if it is fixed, the pass can go)
