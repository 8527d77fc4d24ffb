"""``--target qnn``: the table (targets/qnn.py) against QNN's own compiler, and the command line.

The oracle is the HTP backend: each case is a small graph built here, compiled on it as
ONNX Runtime's QNN flow quantises it (``get_qnn_qdq_config``), and what QNN said decides;
no case reads the target's tables.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import helper

import extras
from graphs import model, ort_run, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.pipeline import optimize
from opfuse.targets.qnn import backend
from opfuse.targets.qnn.backend import open_session
from opfuse.targets.qnn.probe import probe, quantize_like_qnn_flow
from opfuse.quantization.presets import PRESETS
from qnn_graphs import conv_then, feeds, needs_htp

pytestmark = needs_htp
MS = "com.microsoft"


def _erf_gelu(opset=17):
    """MatMul -> x * 0.5 * (1 + erf(x / sqrt 2)), as torch exports GELU."""
    r = rng(1)
    c = lambda n, v: tensor(n, np.array(v, np.float32))  # noqa: E731
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Div", ["h", "sqrt2"], ["d"], name="div"),
             helper.make_node("Erf", ["d"], ["e"], name="erf"),
             helper.make_node("Add", ["e", "one"], ["a"], name="add"),
             helper.make_node("Mul", ["h", "a"], ["m"], name="mul"),
             helper.make_node("Mul", ["m", "half"], ["y"], name="mul_half")]
    return model(nodes, [vinfo("x", [1, 4, 8])], [vinfo("y", [1, 4, 6])],
                 [tensor("W", r.normal(0, 0.4, (8, 6)).astype(np.float32)),
                  c("sqrt2", np.sqrt(2)), c("one", 1.0), c("half", 0.5)], opset=opset)


def _group_norm():
    r = rng(2)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("GroupNormalization", ["c", "g", "b"], ["y"], num_groups=2, name="gn")]
    return model(nodes, [vinfo("x", [1, 3, 6, 6])], [vinfo("y", [1, 4, 6, 6])],
                 [tensor("W", r.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32)),
                  tensor("g", r.uniform(0.5, 1.5, 4).astype(np.float32)),
                  tensor("b", r.normal(0, 0.3, 4).astype(np.float32))], opset=21)


def _proto(m):
    import onnx_ir as ir

    return ir.serde.serialize_model(m)


@pytest.mark.parametrize("opset, op", [(17, (MS, "Gelu")), (20, ("", "Gelu"))])
def test_an_erf_gelu_falls_back_in_qdq_and_opfuses_gelu_runs_whole(opset, op):
    original = _erf_gelu(opset)
    before = probe(original, forms=("qdq",))["qdq"]
    assert not before.whole and any(o == "Erf" and "not supported by QNN EP" in r for _, o, r in before.on_cpu)
    fused, report = optimize(original, target="qnn")
    assert op in {(n.domain, n.op_type) for n in fused.graph} and "Erf" not in {n.op_type for n in fused.graph}
    assert report.device.placement.all_on_npu  # float, as compiled by optimize
    after = probe(_proto(fused), forms=("qdq",))["qdq"]
    assert after.whole, after.verdict()


def test_the_contrib_fusions_the_target_keeps_out_fall_back_on_qnn():
    """skip-layer-norm, bias-gelu and attention are "keep": their ONNX Runtime ops do not run on QNN."""
    shape = [1, 4, 8]
    ones, zeros = tensor("g", np.ones(8, np.float32)), tensor("b", np.zeros(8, np.float32))
    cases = {
        "SkipLayerNormalization": model([helper.make_node("SkipLayerNormalization", ["x", "s", "g", "b"], ["y"],
                                                          name="sln", domain=MS)],
                                        [vinfo("x", shape), vinfo("s", shape)], [vinfo("y", shape)], [ones, zeros],
                                        extra_opsets=[helper.make_opsetid(MS, 1)]),
        "BiasGelu": model([helper.make_node("BiasGelu", ["x", "b"], ["y"], name="bg", domain=MS)],
                          [vinfo("x", shape)], [vinfo("y", shape)], [zeros], extra_opsets=[helper.make_opsetid(MS, 1)]),
        "MultiHeadAttention": model([helper.make_node("MultiHeadAttention", ["x", "x", "x"], ["y"], num_heads=2,
                                                      name="mha", domain=MS)],
                                    [vinfo("x", shape)], [vinfo("y", shape)], extra_opsets=[helper.make_opsetid(MS, 1)]),
    }
    for op, m in cases.items():
        (node,) = open_session(m).placement.fallbacks
        assert node.op_type == op and f"Operators of type `{op}` are not supported by QNN EP" in node.reason


def test_group_normalization_is_unfused_into_its_function_body_and_then_opens_strictly():
    original = _group_norm()
    quantized = probe(original, forms=("qdq",))["qdq"]  # the layout transformation takes it, then QNN rejects it
    assert "GroupNormalization" in quantized.error and "was not selected by that EP" in quantized.error
    fused, report = optimize(original, target="qnn", require_npu=True)
    assert "GroupNormalization" not in {n.op_type for n in fused.graph}
    assert report.applied("unfuse GroupNormalization") and report.device.strict
    assert probe(_proto(fused), forms=("qdq",))["qdq"].whole
    x = feeds(original)
    want = ort_run(original, x)["y"]
    got = open_session(fused, strict=True).run(x)[0]
    assert np.allclose(got, want, atol=2e-2 * np.abs(want).max())


# -- the command line ------------------------------------------------------------------------------

def test_cli_missing_backend_is_one_line_exit_2_nothing_written(tmp_path, monkeypatch, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(conv_then("Relu", batch=1), src)
    monkeypatch.setitem(sys.modules, "onnxruntime_qnn", None)  # as on a machine without it
    assert main(["optimize", str(src), "-o", str(tmp_path / "o.onnx"), "--target", "qnn"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pip install 'opfuse[qnn]'" in err and not (tmp_path / "o.onnx").exists()


def test_cli_unbound_dimension_is_one_line_exit_2_nothing_written(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(conv_then("Relu"), src)
    assert main(["optimize", str(src), "-o", str(tmp_path / "o.onnx"), "--target", "qnn", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("opfuse: error: dimension(s) batch (x axis 0) not bound: the target compiles static shapes "
                   "only; give each a value with --dim batch=N")
    assert list(tmp_path.iterdir()) == [src]


def test_cli_require_npu_with_a_fallback_is_exit_1_nothing_written(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(conv_then("Erf", batch=1), src)
    code = main(["optimize", str(src), "-o", str(tmp_path / "o.onnx"), "--target", "qnn", "--require-npu", "-q",
                 "--context", str(tmp_path / "ctx.onnx")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and err.startswith("opfuse: --require-npu: erf (Erf) runs on the CPU; QNN:")
    assert err.endswith("nothing was written") and list(tmp_path.iterdir()) == [src]


def test_cli_context_writes_an_epcontext_model_that_opens_on_the_htp_with_the_same_outputs(tmp_path, capsys):
    src, out, ctx = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "ctx.onnx"
    onnx.save(conv_then("HardSwish"), src)
    assert main(["optimize", str(src), "-o", str(out), "--target", "qnn", "--dim", "batch=1", "--context", str(ctx),
                 "--report", str(tmp_path / "r.json")]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # (rich wraps at 120 columns)
    assert "QNN HTP compile log" in printed and "2 of 2 nodes on the HTP in 1 partition(s)" in printed
    context = onnx.load(ctx)
    assert [n.op_type for n in context.graph.node] == ["EPContext"]
    x = feeds(conv_then("HardSwish"))
    compiled = open_session(str(out)).run(x)[0]
    loaded = open_session(str(ctx), strict=True)
    assert np.array_equal(loaded.run(x)[0], compiled)
    import json

    device = json.loads((tmp_path / "r.json").read_text())["device"]
    assert device["on_qnn"] == 2 and device["on_cpu"] == [] and device["compile_seconds"] > 0
    assert device["options"]["soc_model"] == "57"


# -- quantize --preset qnn -------------------------------------------------------------------------

def test_quantize_qnn_binds_dims_from_the_samples_runs_whole_on_the_htp_and_measures_sqnr_there(tmp_path):
    from opfuse.quantization.pipeline import quantize

    m = conv_then("Relu", size=6)  # symbolic batch: bound by the samples
    r = np.random.default_rng(3)
    samples = [{"x": r.normal(0, 1, (1, 3, 6, 6)).astype(np.float32)} for _ in range(8)]
    ctx = tmp_path / "ctx.onnx"
    q, report = quantize(m, samples, preset="qnn", holdout=2, require_npu=True, context=ctx,
                         output=tmp_path / "q.onnx", adaround=True)  # its guard runs on the HTP
    assert report.adaround_sqnr_db is not None and report.bias_sqnr_db is not None
    assert any("bound batch=1 (from the calibration samples' shapes (batch))" in n for n in report.notes)
    assert report.reconstruction is None and any("AdaRound rounds the weights" in n for n in report.notes)
    assert report.device.placement.all_on_npu and report.device.strict
    v = report.verification
    assert v.runtime.startswith("QNN HTP backend") and v.cpu_qdq_sqnr_db is not None
    # the figure is the HTP's own: recomputed here from the written model, independently
    qdq = onnx.load(tmp_path / "q.onnx")
    session = open_session(qdq)
    f = [ort_run(m, s)["y"] for s in samples[-2:]]
    h = [session.run(s)[0] for s in samples[-2:]]
    signal = sum(float(np.sum(a.astype(np.float64) ** 2)) for a in f)
    noise = sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in zip(f, h))
    assert abs(v.sqnr_db - 10 * np.log10(signal / noise)) < 1e-3
    assert v.sqnr_db > 20 and ctx.exists()


def test_reconstruction_on_the_qnn_preset_searches_the_scales_and_is_judged_on_the_htp(tmp_path, monkeypatch):
    extras.require("torch")
    import opfuse.quantization.algorithms.reconstruction as reconstruction
    from opfuse.quantization.pipeline import quantize

    searched = []
    search = reconstruction._search_scales
    monkeypatch.setattr(reconstruction, "_search_scales", lambda logs, measure: searched.append(len(logs)) or
                        search(logs, measure))
    m = conv_then("Relu", size=6)
    r = np.random.default_rng(4)
    samples = [{"x": r.normal(0, 1, (1, 3, 6, 6)).astype(np.float32)} for _ in range(8)]
    from opfuse.quantization.presets import QNN_FIT_FACTOR

    monkeypatch.setattr(reconstruction, "estimated_seconds", lambda *a, **k: (200.0, ""))
    q, report = quantize(m, samples, preset="qnn", holdout=2)  # by default: over the budget once multiplied
    assert report.reconstruction is None and any(f"it would take about {200 * QNN_FIT_FACTOR / 60:.0f} min"
                                                 in n for n in report.notes)
    assert report.calibration == "auto"  # no search to leave the clipping to
    q, report = quantize(m, samples, preset="qnn", holdout=2, reconstruction_budget_s=200 * QNN_FIT_FACTOR,
                         reconstruction_iterations=40)  # (what is checked: the search ran, the HTP judged)
    # the search judges each scale by its block's output: it starts from MinMax, not auto's clipping
    assert report.calibration == "minmax" and any("starts from MinMax ranges" in n for n in report.notes)
    facts = report.reconstruction
    assert facts is not None and facts.layers >= 1 and searched and all(searched)
    before, after = facts.sqnr_db
    assert facts.kept == (after > before)
    assert report.verification.runtime.startswith("QNN HTP backend")


def test_the_a16_preset_writes_16_bit_activations_and_runs_them_on_the_htp_more_exactly(tmp_path):
    # no weights: every error is an activation's (x * Sigmoid(x), as SiLU is written out)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 6, 6])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3, 6, 6])
    m = helper.make_model(helper.make_graph([helper.make_node("Sigmoid", ["x"], ["s"]),
                                             helper.make_node("Mul", ["x", "s"], ["y"])], "silu", [x], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    figures = {}
    for preset, qdq, report in _on_the_htp(m, ("qnn", "qnn-a16"), tmp_path):
        inits = {i.name: i for i in qdq.graph.initializer}
        # the activations' zero points
        zeros = {inits[n.input[2]].data_type for n in qdq.graph.node
                 if n.op_type == "QuantizeLinear" and n.input[0] not in inits}
        assert zeros == {onnx.TensorProto.UINT16 if preset == "qnn-a16" else onnx.TensorProto.UINT8}
        figures[preset] = report.verification.sqnr_db
    assert any("MinMax ranges for uint16" in n for n in report.notes)
    assert figures["qnn-a16"] > figures["qnn"] + 3, figures


def _on_the_htp(model, presets, tmp_path, shape=(1, 3, 6, 6)):
    """(preset, the written QDQ model, its report) per preset: 8 samples of N(0, 1) of
    ``shape``, 2 held out, quantised with --require-npu (each result runs whole on the HTP)."""
    from opfuse.quantization.pipeline import quantize

    r = np.random.default_rng(3)
    samples = [{model.graph.input[0].name: r.normal(0, 1, shape).astype(np.float32)} for _ in range(8)]
    for preset in presets:
        _, report = quantize(model, samples, preset=preset, holdout=2, require_npu=True,
                             output=tmp_path / f"{preset}.onnx", reconstruct=False)
        assert report.device.placement.all_on_npu and report.device.strict
        yield preset, onnx.load(tmp_path / f"{preset}.onnx"), report


def test_the_per_channel_qnn_preset_writes_int8_channel_scales_and_is_more_exact_on_the_htp(tmp_path):
    """One output channel's weights 50x the others' (a channel the Relu after it then
    silences, so the output's own range is the small channels'): one uint8 scale for the
    whole weight leaves the small channels a step or two; per-channel int8 scales (QNN's
    symmetric per-channel weights) give each its own, and the HTP runs it whole."""

    m = conv_then("Relu", c_out=4, size=6)
    inits = {i.name: i for i in m.graph.initializer}
    w = onnx.numpy_helper.to_array(inits["W"]) * np.array([50, 1, 1, 1], np.float32).reshape(4, 1, 1, 1)
    b = onnx.numpy_helper.to_array(inits["B"]).copy()
    b[0] = -1e3
    inits["W"].CopyFrom(onnx.numpy_helper.from_array(w, "W"))
    inits["B"].CopyFrom(onnx.numpy_helper.from_array(b, "B"))
    figures = {}
    for preset, qdq, report in _on_the_htp(m, ("qnn", "qnn-per-channel", "qnn-a16-per-channel"), tmp_path):
        inits = {i.name: onnx.numpy_helper.to_array(i) for i in qdq.graph.initializer}
        (dq,) = [n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
                 and inits[n.input[0]].ndim == 4]
        figures[preset] = (inits[dq.input[0]].dtype, inits[dq.input[1]].size, report.verification.sqnr_db)
    assert figures["qnn"][:2] == (np.uint8, 1) and figures["qnn-per-channel"][:2] == (np.int8, 4)
    assert figures["qnn-per-channel"][2] > figures["qnn"][2] + 6, figures  # (about 26 against 13 dB)
    assert figures["qnn-a16-per-channel"][:2] == (np.int8, 4)  # the same weights, 16-bit activations
    assert figures["qnn-a16-per-channel"][2] > figures["qnn-per-channel"][2], figures


def test_per_channel_qnn_presets_keep_layernorm_constants_per_tensor_so_the_htp_takes_them(tmp_path):
    """ONNX Runtime's quantiser gives LayerNormalization's scale and bias per-channel scales
    when per_channel is on; QNN's HTP refuses their DequantizeLinear ("Failed to add node"),
    and ViT split into 5 partitions. opfuse gives them per-tensor overrides."""
    r = np.random.default_rng(5)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    inits = [onnx.numpy_helper.from_array(r.normal(0, 0.5, (8, 8)).astype(np.float32), "W"),
             onnx.numpy_helper.from_array(r.uniform(0.5, 2.0, 8).astype(np.float32), "gamma"),
             onnx.numpy_helper.from_array(r.normal(0, 0.5, 8).astype(np.float32), "beta")]
    m = helper.make_model(helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 8])],
                                            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 8])], inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    for preset, qdq, report in _on_the_htp(m, ("qnn-per-channel", "qnn-a16-per-channel"), tmp_path, shape=(1, 4, 8)):
        consts = {i.name: i for i in qdq.graph.initializer}
        (ln,) = [n for n in qdq.graph.node if n.op_type == "LayerNormalization"]
        ln_dq = [n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.output[0] in ln.input[1:3]]
        assert ln_dq and all(onnx.numpy_helper.to_array(consts[n.input[1]]).size == 1 for n in ln_dq), preset
        assert report.verification.sqnr_db > 20, (preset, report.verification.sqnr_db)
        # ONNX Runtime's flow asked for the same types (benchmarks/qnn.py --flow-types preset) writes
        # them, and its LayerNormalization constants (gamma int8, beta int32) leave the HTP
        flow = quantize_like_qnn_flow(m, preset=PRESETS[preset])
        zeros = {onnx.numpy_helper.to_array(i).dtype for i in flow.graph.initializer
                 if any(n.op_type == "QuantizeLinear" and n.input[2] == i.name for n in flow.graph.node)}
        assert zeros == {np.dtype(np.uint16 if "a16" in preset else np.uint8)}, (preset, zeros)
        with pytest.raises(backend.HtpCompileError, match="gamma_DequantizeLinear .*Failed to add node"):
            open_session(flow, strict=True)
