"""int8 that holds: AdaRound, per-tensor ranges, the monotone search, and odd models.

The oracles run models on ONNX Runtime and compute round trips with numpy from ONNX's
definition of QuantizeLinear (``saturate(round(x / scale) + zero_point)``), never from
opfuse's own tables or error formulas.
"""

from __future__ import annotations

import tempfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

import opfuse
from graphs import model, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.errors import VerificationError
from opfuse.quantization.algorithms.adaround import adaround_layers, apply_rounding
from opfuse.quantization.presets import PRESETS
from opfuse.quantization.qdq.quantizer import Quantizer, prepare
from opfuse.quantization.algorithms.ranges import search_ranges
from opfuse.runtime import create_session
from test_quantize import samples, small_net


def smooth(count: int, shape, seed: int) -> list[np.ndarray]:
    """Images whose neighbouring pixels are correlated, as real ones are (bilinear upsampled noise)."""
    r = rng(seed)
    n, c, h, w = shape
    out = []
    for _ in range(count):
        x = np.zeros(shape, np.float32)
        for ch in range(c):
            cells = r.normal(0, 1, (4, 4)).astype(np.float32)
            x[0, ch] = np.asarray(Image.fromarray(cells, mode="F").resize((w, h), Image.Resampling.BILINEAR))
        out.append(x + r.normal(0, 0.05, shape).astype(np.float32))
    return out


def one_conv(seed: int = 0, cin: int = 8, cout: int = 16) -> onnx.ModelProto:
    r = rng(seed)
    w = r.normal(0, 0.3, (cout, cin, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], name="conv")]
    return model(nodes, [vinfo("x", ["N", cin, 12, 12])], [vinfo("y", ["N", cout, 12, 12])],
                 [tensor("w", w), tensor("b", np.zeros(cout, np.float32))], opset=17)


def output_error(float_model, qdq, samples) -> float:
    """Sum of squared differences of the only output, both models run on ONNX Runtime."""
    f, q = create_session(float_model), create_session(qdq)
    return float(sum(np.sum((q.run(None, s)[0].astype(np.float64) - f.run(None, s)[0]) ** 2) for s in samples))


@pytest.mark.parametrize("preset", ["cpu", "per-tensor"])
def test_adaround_lowers_the_layer_reconstruction_error_against_round_to_nearest(preset):
    """A conv's output error against the float conv on the float input, measured by running
    the QDQ model: the scale and rounding chosen are below ONNX Runtime's round-to-nearest,
    on the calibration samples and on samples they never saw; every weight stays within one
    step of its nearest integer at the scale written, and the bias is requantised to it."""
    net = one_conv()
    calib = [{"x": x} for x in smooth(16, (1, 8, 12, 12), 1)]
    held = [{"x": x} for x in smooth(8, (1, 8, 12, 12), 2)]
    float_model, _ = prepare(net, PRESETS[preset])
    with tempfile.TemporaryDirectory() as tmp:
        nearest = Quantizer(float_model, PRESETS[preset], calib, tmp).quantize()
    rounding = adaround_layers(float_model, nearest, calib)
    assert [r.layer for r in rounding.results] == ["conv"] and rounding.results[0].kept
    rounded = onnx.ModelProto()
    rounded.CopyFrom(nearest)
    assert apply_rounding(rounded, rounding) == 1
    after = {i.name: numpy_helper.to_array(i) for i in rounded.graph.initializer}
    dq = next(n for n in rounded.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in rounding.weights
              and after[n.input[0]].dtype == np.int8)
    q, scale = after[dq.input[0]].astype(np.int32), after[dq.input[1]].astype(np.float64)
    w = numpy_helper.to_array(next(i for i in float_model.graph.initializer if i.name == "w")).astype(np.float64)
    per_weight = scale.reshape(-1, 1, 1, 1) if scale.size > 1 else scale
    step = np.abs(q - np.clip(np.rint(w / per_weight), -128, 127))
    assert step.max() == 1 and step.mean() > 0.01  # some weights round the other way, none further
    for data, margin in ((calib, 0.97), (held, 1.0)):
        e_near, e_ada = output_error(float_model, nearest, data), output_error(float_model, rounded, data)
        assert e_ada < margin * e_near, (e_near, e_ada)


def test_a_weight_scale_shrinks_past_an_outlier_and_the_bias_follows():
    """Weights 20 times the others on an input channel that is nearly silent: ONNX Runtime's
    per-tensor scale spends its steps on them, though they move the output little; the
    range chosen by the layer's output error is clipped inside them, the int32 bias
    is requantised to x_scale * w_scale (the QDQ model, run by ONNX Runtime at its all
    level, where the QDQ conv becomes an integer kernel, matches the float conv better
    than round-to-nearest on samples the search never saw)."""
    net = one_conv(seed=4)
    w = next(i for i in net.graph.initializer if i.name == "w")
    values = numpy_helper.to_array(w).copy()
    values[:, 2] *= 20
    w.CopyFrom(numpy_helper.from_array(values, "w"))
    b = next(i for i in net.graph.initializer if i.name == "b")
    b.CopyFrom(numpy_helper.from_array(rng(5).normal(0, 0.5, 16).astype(np.float32), "b"))
    quiet = np.ones((1, 8, 1, 1), np.float32)
    quiet[0, 2] = 0.005
    calib = [{"x": x * quiet} for x in smooth(16, (1, 8, 12, 12), 1)]
    held = [{"x": x * quiet} for x in smooth(8, (1, 8, 12, 12), 2)]
    float_model, _ = prepare(net, PRESETS["per-tensor"])
    with tempfile.TemporaryDirectory() as tmp:
        nearest = Quantizer(float_model, PRESETS["per-tensor"], calib, tmp).quantize()
    rounding = adaround_layers(float_model, nearest, calib)
    assert rounding.results[0].kept and rounding.results[0].scale_factor < 1.0
    rounded = onnx.ModelProto()
    rounded.CopyFrom(nearest)
    apply_rounding(rounded, rounding)
    inits = {i.name: numpy_helper.to_array(i) for i in rounded.graph.initializer}
    conv = next(n for n in rounded.graph.node if n.op_type == "Conv")
    producer = {o: n for n in rounded.graph.node for o in n.output}
    w_dq, b_dq, x_dq = producer[conv.input[1]], producer[conv.input[2]], producer[conv.input[0]]
    x_scale = inits[x_dq.input[1]]
    assert inits[b_dq.input[1]] == np.float32(x_scale) * np.float32(inits[w_dq.input[1]])
    f, q, n = create_session(float_model), create_session(rounded, "all"), create_session(nearest, "all")
    error = {name: sum(float(np.sum((s.run(None, d)[0].astype(np.float64) - f.run(None, d)[0]) ** 2)) for d in held)
             for name, s in (("chosen", q), ("nearest", n))}
    assert error["chosen"] < 0.8 * error["nearest"], error


def _round_trip(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """uint8 QuantizeLinear then DequantizeLinear for the range (lo, hi), from ONNX's
    definition, with ONNX Runtime's widening of the range to contain 0."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / 255
    zero = np.clip(np.rint(-lo / scale), 0, 255)
    return (np.clip(np.rint(values / scale) + zero, 0, 255) - zero) * scale


def test_the_adaround_guard_judges_on_the_runner_it_is_given():
    """AdaRound is kept for the model only if the output SQNR rises where the guard measures
    it: on ONNX Runtime's CPU by default, on the runner given (the qnn preset gives the
    HTP's). A runner that sees the rounded model as worse leaves the weights at nearest."""
    from opfuse.quantization.algorithms.trials import TrialMaker

    net = one_conv()
    calib = [{"x": x} for x in smooth(16, (1, 8, 12, 12), 1)]
    float_model, _ = prepare(net, PRESETS["cpu"])
    judged = []

    def sceptic(candidate, feeds):  # the nearest model as it is; any other one made worse
        session = create_session(candidate, "disabled")
        worse = len(judged) % 2 == 1  # the guard measures without, then with
        judged.append(worse)
        return [[o + (1.0 if worse else 0.0) for o in session.run(None, s)] for s in feeds]

    with tempfile.TemporaryDirectory() as tmp:
        quantizer = Quantizer(float_model, PRESETS["cpu"], calib, tmp)
        cpu = TrialMaker(quantizer, float_model, calib, bias_correction=False)
        cpu.make()
        other = TrialMaker(quantizer, float_model, calib, bias_correction=False, runner=sceptic)
        other._rounding_cache = cpu._rounding_cache  # the same layer fit: what differs is the guard's judge
        other.make()
    on_cpu, on_runner = cpu.facts[quantizer.method], other.facts[quantizer.method]
    assert on_cpu.adaround and on_cpu.adaround_sqnr_db[1] > on_cpu.adaround_sqnr_db[0]
    assert judged == [False, True] and not on_runner.adaround
    assert on_runner.adaround_sqnr_db[1] < on_runner.adaround_sqnr_db[0]


def test_the_mse_range_beats_minmax_on_a_tensor_with_outliers():
    """A tensor of four million values with one outlier: its chosen range is inside
    MinMax's and its round trip is closer to the values than MinMax's, on the calibration
    values and on new ones; a tensor without outliers (uniform) keeps a range near MinMax's."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

    r = rng(3)
    size = 1 << 19
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"), helper.make_node("Neg", ["u"], ["b"], name="neg")]
    net = model(nodes, [vinfo("x", [1, size]), vinfo("u", [1, 4096])], [vinfo("a", [1, size]), vinfo("b", [1, 4096])])
    data = [{"x": r.normal(0, 1, (1, size)).astype(np.float32),
             "u": r.uniform(-1, 1, (1, 4096)).astype(np.float32)} for _ in range(8)]
    data[3]["x"][0, 7] = 400.0  # one value in four million: MinMax spends its steps on it
    fresh = r.normal(0, 1, (1, size)).astype(np.float32)
    a = np.maximum(np.concatenate([d["x"] for d in data]), 0)
    b = -np.concatenate([d["u"] for d in data])
    minmax = TensorsData(CalibrationMethod.MinMax, {
        "a": TensorData(lowest=np.float32(a.min()), highest=np.float32(a.max())),
        "b": TensorData(lowest=np.float32(b.min()), highest=np.float32(b.max()))})
    ranges, choices = search_ranges(net, data, minmax)
    lo, hi = (float(v) for v in ranges["a"].range_value)
    assert 0 < hi < 0.5 * a.max()
    for values in (a, np.maximum(fresh, 0)):
        mse = np.mean((_round_trip(values, lo, hi) - values) ** 2)
        mse_minmax = np.mean((_round_trip(values, 0.0, float(a.max())) - values) ** 2)
        assert mse < 0.5 * mse_minmax, (mse, mse_minmax)
    blo, bhi = (float(v) for v in ranges["b"].range_value)
    assert bhi > 0.9 * b.max() and blo < 0.9 * b.min()
    assert {c.tensor: c.kind for c in choices}["a"] in ("clipped", "percentile")


def test_the_search_never_accepts_a_step_that_lowers_the_measured_sqnr(tmp_path):
    """An unreachable target: the search walks its ranking; the SQNR of the accepted steps
    rises strictly, every step not taken measured no higher than the model it would have
    replaced, the ranking is in the report, and the check samples (never tuned on) decide
    the stop: the run fails with the report written, as the target is out of reach."""
    net = small_net(outlier_conv=1)
    with pytest.raises(VerificationError) as failed:
        opfuse.quantize(net, samples(20), preset="per-tensor", min_sqnr=90, max_steps=4, adaround=False,
                        equalize=False, report_path=tmp_path / "r.json", reconstruct=False)
    report = failed.value.report
    assert report.ranking and all(r.kept_before >= 0 for r in report.ranking)
    assert report.tuning_samples + report.check_samples == report.calibration_samples
    walk = [s for s in report.search if s.phase in ("base", "step")]
    assert walk[0].phase == "base" and len(walk) > 2
    current = walk[0].sqnr_db
    for step in walk[1:]:
        if step.accepted:
            assert step.sqnr_db > current and step.check_sqnr_db is not None
            current = step.sqnr_db
        else:
            assert step.sqnr_db <= current
    assert (tmp_path / "r.json").exists()
    best = max(report.ranking, key=lambda r: r.gain_db)
    first = next(s for s in report.search if s.phase == "step")
    assert first.added == best.nodes


def test_the_keep_action_and_the_runner_are_pluggable():
    """Keeping a layer "int16" gives its output 16-bit Q/DQ, "float" runs it on its float weight;
    a runner of one's own evaluates every candidate of the search, and qnn's kept layers
    are reported with 16-bit activations."""
    net = small_net()
    data = samples(16)
    float_model, _ = prepare(net, PRESETS["qnn"])
    with tempfile.TemporaryDirectory() as tmp:
        quantizer = Quantizer(float_model, PRESETS["qnn"], data, tmp)
        sixteen = quantizer.quantize(["conv1"], keep_as="int16")
        excluded = quantizer.quantize(["conv1"], keep_as="float")
    producer = {o: n for n in float_model.graph.node for o in n.output}
    conv1_out = next(o for o in producer if producer[o].name == "conv1")

    def quant_types(proto, tensor_name):
        inits = {i.name: i.data_type for i in proto.graph.initializer}
        return {inits.get(n.input[2]) for n in proto.graph.node
                if n.op_type == "QuantizeLinear" and n.input[0] == tensor_name and len(n.input) > 2}

    assert quant_types(sixteen, conv1_out) == {TensorProto.UINT16}
    assert TensorProto.UINT16 not in quant_types(excluded, conv1_out)
    float_inits = {i.name for i in excluded.graph.initializer if i.data_type == TensorProto.FLOAT}
    (conv1,) = [n for n in excluded.graph.node if n.name == "conv1"]
    assert conv1.input[1] in float_inits  # its weight is read as float, no DequantizeLinear

    calls = []

    def runner(candidate, feeds):
        calls.append(len(feeds))
        session = create_session(candidate, "disabled")
        return [session.run(None, s) for s in feeds]

    with pytest.raises(VerificationError) as failed:
        opfuse.quantize(net, data, preset="qnn", min_sqnr=90, max_steps=2, runner=runner, adaround=False,
                        reconstruct=False)
    report = failed.value.report
    assert report.search_stopped.startswith("it took its 2 steps (max_steps); with ")
    assert "the search stopped: it took its 2 steps" in str(failed.value)
    assert len(calls) >= len(report.search) + 1  # each trial, and the check of the base
    assert report.kept() and all(r.precision == "int16 activations" for r in report.kept())


def cancelling_net() -> onnx.ModelProto:
    """y = conv_a(x) - conv_b(x), the two convs' weights 0.3% apart: the difference is far
    below what 8-bit steps of either output resolve."""
    r = rng(7)
    w = r.normal(0, 1, (4, 3, 3, 3)).astype(np.float32)
    wb = (w + 3e-3 * r.normal(0, 1, w.shape)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "wa"], ["a"], pads=[1, 1, 1, 1], name="conv_a"),
             helper.make_node("Conv", ["x", "wb"], ["b"], pads=[1, 1, 1, 1], name="conv_b"),
             helper.make_node("Sub", ["a", "b"], ["y"], name="sub")]
    return model(nodes, [vinfo("x", [1, 3, 8, 8])], [vinfo("y", [1, 4, 8, 8])],
                 [tensor("wa", w), tensor("wb", wb)])


def test_a_held_out_sqnr_under_3_db_without_a_target_exits_1_with_the_report(tmp_path, capsys):
    src, calib = tmp_path / "m.onnx", tmp_path / "c.npz"
    onnx.save(cancelling_net(), src)
    np.savez(calib, x=rng(1).normal(0, 1, (8, 1, 3, 8, 8)).astype(np.float32))
    rc = main(["quantize", "--reconstruct", "off", str(src), "-o", str(tmp_path / "q.onnx"), "--calibration",
               str(calib),
               "--report", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 1 and not (tmp_path / "q.onnx").exists() and (tmp_path / "r.json").exists()
    last = err.strip().splitlines()[-1]
    assert "below 3 dB" in last and "--min-sqnr" in last and "only the report was written" in last


def dynamic_int8_net(kept: bool = False) -> onnx.ModelProto:
    """What ONNX Runtime's dynamic quantiser leaves: t -> DynamicQuantizeLinear (named
    't_QuantizeLinear', outputs 't_quantized', 't_scale', 't_zero_point') -> MatMulInteger
    -> Cast -> Mul; t also feeds a float MatMul, which the static quantiser quantises.
    ``kept``: the int32 result is a graph output too, so the dynamic part cannot be
    dequantised (opfuse.passes.dequantize_dynamic) and stays."""
    r = rng(8)
    w1 = r.normal(0, 0.3, (8, 8)).astype(np.float32)
    w2 = r.normal(0, 0.3, (8, 8)).astype(np.float32)
    wq = r.integers(0, 255, (8, 8)).astype(np.uint8)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["t"], name="mm1"),
             helper.make_node("DynamicQuantizeLinear", ["t"], ["t_quantized", "t_scale", "t_zero_point"],
                              name="t_QuantizeLinear"),
             helper.make_node("MatMulInteger", ["t_quantized", "wq", "t_zero_point", "wq_zero"], ["i32"], name="mmi"),
             helper.make_node("Cast", ["i32"], ["f"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Mul", ["t_scale", "wq_scale"], ["s"], name="scales"),
             helper.make_node("Mul", ["f", "s"], ["y1"], name="rescale"),
             helper.make_node("MatMul", ["t", "w2"], ["y2"], name="mm2")]
    outputs = [vinfo("y1", [4, 8]), vinfo("y2", [4, 8])] + [vinfo("i32", [4, 8], TensorProto.INT32)] * kept
    return model(nodes, [vinfo("x", [4, 8])], outputs,
                 [tensor("w1", w1), tensor("w2", w2), tensor("wq", wq), tensor("wq_zero", np.uint8(128)),
                  tensor("wq_scale", np.float32(0.01))])


@pytest.mark.parametrize("kept", [True, False], ids=["dynamic-part-kept", "dequantised"])
def test_a_model_quantised_before_by_ort_is_not_a_cycle_any_more(kept):
    """ONNX Runtime's static quantiser names the scale of t 't_scale', a tensor the dynamic
    quantiser already wrote: its QDQ graph then reads its own output ('Graph is not a DAG').
    Where the dynamic part stays, the clashing tensors are renamed first, the note says why,
    and the model runs; where it is dequantised first, no such tensor is left to clash."""
    net = dynamic_int8_net(kept)
    data = [{"x": x} for x in rng(2).normal(0, 1, (12, 4, 8)).astype(np.float32)]
    q, report = opfuse.quantize(net, data, adaround=False, reconstruct=False)
    assert any("Graph is not a DAG" in n and "renamed" in n for n in report.notes) == kept
    assert any(n.startswith("the model shipped dynamic int8 (1 MatMulInteger)") for n in report.notes)
    import onnx_ir as ir

    proto = ir.serde.serialize_model(q)
    assert any(n.op_type == "QuantizeLinear" for n in proto.graph.node)
    create_session(proto, "all").run(None, data[0])
    assert report.verification.sqnr_db > 20


def test_nothing_quantised_is_said_in_those_words_not_as_200_db(tmp_path, capsys):
    """Only integer kernels and element-wise float ops: nothing for the quantiser to take."""
    r = rng(9)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="dq"),
             helper.make_node("MatMulInteger", ["xq", "wq", "xz", "wz"], ["i32"], name="mmi"),
             helper.make_node("Cast", ["i32"], ["f"], to=TensorProto.FLOAT, name="cast"),
             helper.make_node("Mul", ["f", "xs"], ["y"], name="rescale")]
    net = model(nodes, [vinfo("x", [4, 8])], [vinfo("y", [4, 8])],
                [tensor("wq", r.integers(0, 255, (8, 8)).astype(np.uint8)), tensor("wz", np.uint8(128))])
    src, calib = tmp_path / "m.onnx", tmp_path / "c.npz"
    onnx.save(net, src)
    np.savez(calib, x=r.normal(0, 1, (8, 4, 8)).astype(np.float32))
    assert main(["quantize", "--reconstruct", "off", str(src), "-o", str(tmp_path / "q.onnx"), "--calibration",
                 str(calib), "-q"]) == 0
    out = capsys.readouterr().out
    assert "nothing was quantised" in out and "200" not in out
    _, report = opfuse.quantize(net, str(calib), reconstruct=False)
    data = report.to_dict()
    assert data["summary"]["output_sqnr_db"] is None and data["summary"]["nothing_quantised"]
    assert data["verification"]["sqnr_db"] is None and data["verification"]["outputs_equal_float"]
    assert set(data["verification"]["outputs"].values()) == {None} and "200.0" not in report.to_json()
    assert any("already computes in integers" in n for n in report.notes)
