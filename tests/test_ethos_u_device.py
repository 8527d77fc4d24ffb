"""The ``ethos-u`` device: Vela's output read back, a CPU fallback with Vela's reason, the LiteRT
runner against numpy, TFLite's int8 conventions in ONNX Runtime's quantiser, the missing-package
line, and ``quantize --preset ethos-u`` / ``optimize --target ethos-u`` end to end (these two need
the lowering, :mod:`opfuse.targets.ethos_u.lower`).

The TFLite models below are written with LiteRT's own schema (``ai_edge_litert.schema_py_generated``,
object API) and checked in LiteRT's interpreter, never by opfuse's code."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import pytest
from onnx import helper

import extras
from graphs import model, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.errors import BadInputError

extras.require("ethosu.vela")
schema = extras.require("ai_edge_litert.schema_py_generated")
flatbuffers = extras.require("flatbuffers")

from opfuse.targets.ethos_u import device  # noqa: E402 - after the skips
from opfuse.targets.ethos_u.runner import TfliteSession  # noqa: E402
from opfuse.targets.ethos_u.vela import EthosOptions, compile_with_vela, cpu_reasons  # noqa: E402

X_SCALE, X_ZERO, Y_SCALE, Y_ZERO = 0.05, -3, 0.1, -128


def _quant(scale, zero, axis=0):
    q = schema.QuantizationParametersT()
    q.scale = [float(s) for s in np.atleast_1d(scale)]
    q.zeroPoint = [int(z) for z in np.atleast_1d(zero)]
    q.quantizedDimension = axis
    return q


def conv_tflite(weights: np.ndarray, w_scale: np.ndarray, bias: np.ndarray, *, then: int | None = None,
                y_scale: float = Y_SCALE) -> bytes:
    """int8 CONV_2D (3x3, SAME, fused RELU) on a 1x8x8xC NHWC input; ``then``: a binary op of the
    conv's output with itself after it (DIV: the U85 runs it, the U55 does not); ``y_scale``: the
    conv output's scale."""
    buffers, tensors, codes = [schema.BufferT()], [], []

    def add_tensor(name, shape, kind, quant, data=None):
        t = schema.TensorT()
        t.name, t.shape, t.type, t.quantization = name, list(shape), kind, quant
        t.buffer = 0
        if data is not None:
            b = schema.BufferT()
            b.data = list(np.ascontiguousarray(data).tobytes())
            buffers.append(b)
            t.buffer = len(buffers) - 1
        tensors.append(t)
        return len(tensors) - 1

    def operator(code, inputs, outputs, options_type=0, options=None):
        c = schema.OperatorCodeT()
        c.builtinCode, c.deprecatedBuiltinCode, c.version = code, min(code, 127), 1
        codes.append(c)
        op = schema.OperatorT()
        op.opcodeIndex, op.inputs, op.outputs = len(codes) - 1, inputs, outputs
        op.builtinOptionsType, op.builtinOptions = options_type, options
        return op

    cout, cin = weights.shape[0], weights.shape[3]
    x = add_tensor("x", [1, 8, 8, cin], schema.TensorType.INT8, _quant(X_SCALE, X_ZERO))
    w = add_tensor("w", weights.shape, schema.TensorType.INT8, _quant(w_scale, np.zeros(cout)), weights)
    b = add_tensor("b", [cout], schema.TensorType.INT32, _quant(X_SCALE * w_scale, np.zeros(cout)), bias)
    y = add_tensor("y", [1, 8, 8, cout], schema.TensorType.INT8, _quant(y_scale, Y_ZERO))
    options = schema.Conv2DOptionsT()
    options.padding, options.strideW, options.strideH = schema.Padding.SAME, 1, 1
    options.fusedActivationFunction = schema.ActivationFunctionType.RELU
    ops = [operator(schema.BuiltinOperator.CONV_2D, [x, w, b], [y], schema.BuiltinOptions.Conv2DOptions, options)]
    out = y
    if then is not None:
        out = add_tensor("z", [1, 8, 8, cout], schema.TensorType.INT8, _quant(Y_SCALE, 0))
        ops.append(operator(then, [y, y], [out]))
    graph = schema.SubGraphT()
    graph.tensors, graph.inputs, graph.outputs, graph.operators, graph.name = tensors, [x], [out], ops, "main"
    m = schema.ModelT()
    m.version, m.subgraphs, m.buffers, m.operatorCodes, m.description = 3, [graph], buffers, codes, "test"
    builder = flatbuffers.Builder(1024)
    builder.Finish(m.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def _conv_weights(cout=4, cin=3):
    r = np.random.default_rng(0)
    return r.integers(-127, 128, (cout, 3, 3, cin)).astype(np.int8), r.uniform(0.005, 0.02, cout), \
        r.integers(-500, 500, cout).astype(np.int32)


def test_vela_output_is_read_per_op_and_in_total(tmp_path):
    w, s, b = _conv_weights()
    result = compile_with_vela(conv_tflite(w, s, b), npu="ethos-u55-128", output_dir=tmp_path)
    assert (result.system_config, result.memory_mode) == ("Ethos_U55_High_End_Embedded", "Shared_Sram")
    assert result.compiled.exists() and result.compiled.read_bytes()[4:8] == b"TFL3"
    assert result.ops and all(op.on_npu for op in result.ops) and not result.cpu_ops
    assert result.ops[0].tflite_op == "Conv2D" and result.ops[0].macs == 8 * 8 * 4 * 27  # Vela's MACs: the conv's
    assert result.cycles == sum(op.cycles for op in result.ops) > 0  # the total is the ops' sum
    assert abs(sum(op.cycle_share for op in result.ops) - 1) < 1e-6
    assert result.seconds == pytest.approx(result.cycles / result.clock_hz) and result.clock_hz == 500e6
    assert result.sram_bytes > 0 and result.off_chip_bytes > 0  # weights from flash, feature maps in SRAM
    # the summary's own columns, read back as numbers
    assert result.off_chip_bytes == int(float(result.summary["off_chip_flash_total_bytes"]))


def test_a_cpu_fallback_carries_vela_reason_and_a_fix(tmp_path):
    w, s, b = _conv_weights()
    tflite = conv_tflite(w, s, b, then=schema.BuiltinOperator.DIV)
    u55 = compile_with_vela(tflite, npu="ethos-u55-128", output_dir=tmp_path / "u55")
    assert [op.name for op in u55.ops if not op.on_npu] == ["z"]
    assert u55.cpu_ops == {"z": "DIV: Unsupported opType"}
    u85 = compile_with_vela(tflite, npu="ethos-u85-256", output_dir=tmp_path / "u85")
    assert all(op.on_npu for op in u85.ops) and not u85.cpu_ops  # the U85 runs DIV
    from opfuse.targets.ethos_u.compile import EthosCompileLog

    log = EthosCompileLog(u55, EthosOptions(), len(tflite), 0.1)
    assert log.placement.cpu == ["z"]
    assert "ethos-u85" in log.fallbacks[0]["fix"] and "Unsupported opType" in log.warnings[0]


def test_every_op_vela_leaves_on_the_cpu_is_counted_with_the_message_that_names_no_op(tmp_path):
    # a conv output scale of 1.33e36 (a range reaching float32's minimum over 255 steps, as a
    # MaxPool padded with -FLT_MAX gets from TFLite's converter): Vela 5.2 leaves the conv and
    # the ADD that reads it to the CPU and says why in a line without the op's name
    w, s, b = _conv_weights()
    tflite = conv_tflite(w, s, b, then=schema.BuiltinOperator.ADD, y_scale=1.33e36)
    result = compile_with_vela(tflite, npu="ethos-u55-128", output_dir=tmp_path)
    assert "Warning (supported operators)" not in result.log  # no named warning: only the placement says it
    assert sorted(op.name for op in result.ops if not op.on_npu) == ["y", "z"]
    assert sorted(result.cpu_ops) == ["y", "z"]
    assert all("Quantization scale of any tensor must be positive" in why for why in result.cpu_ops.values())
    assert result.cpu_ops["y"].startswith("Conv2D: ") and result.cpu_ops["z"].startswith("Add: ")


def test_cpu_reasons_read_every_warning_and_its_lines():
    log = ("Warning (supported operators) operator: COS, ofm: 'a'\nReason: Unsupported opType\n\n"
           "Warning (supported operators) operator: CONV_2D, ofm: 'b/c'\nReason: Stride values must be <= 3\n"
           "Op has stride WxH as: 4x4\n")
    assert cpu_reasons(log) == {"a": "COS: Unsupported opType",
                                "b/c": "CONV_2D: Stride values must be <= 3; Op has stride WxH as: 4x4"}


def test_litert_session_feeds_nchw_float_and_returns_it():
    w, s, b = _conv_weights()
    layout = helper.make_model(helper.make_graph([], "g", [vinfo("x", [1, 3, 8, 8])], [vinfo("y", [1, 4, 8, 8])]))
    session = TfliteSession(conv_tflite(w, s, b), layout)  # (the ONNX model's outputs: their NCHW shapes)
    x = rng(3).normal(0, 1, (1, 3, 8, 8)).astype(np.float32)  # NCHW, as the ONNX model takes it
    (y,) = session.run(None, {"x": x})
    # numpy's reference: TFLite's int8 conv on the quantised input, with real-valued requantisation
    xq = np.clip(np.round(x.transpose(0, 2, 3, 1) / X_SCALE) + X_ZERO, -128, 127)[0] - X_ZERO
    padded = np.pad(xq, ((1, 1), (1, 1), (0, 0)))
    acc = np.stack([np.einsum("hwc,ohwc->o", padded[i:i + 3, j:j + 3], w.astype(np.float64))
                    for i in range(8) for j in range(8)]).reshape(8, 8, 4) + b
    ref = np.clip(np.round(acc * X_SCALE * s / Y_SCALE) + Y_ZERO, Y_ZERO, 127)  # fused RELU: from the zero point
    expected = ((ref - Y_ZERO) * Y_SCALE).transpose(2, 0, 1)[None]
    assert y.shape == (1, 4, 8, 8)  # NHWC back to the ONNX model's layout
    assert np.max(np.abs(y - expected)) <= Y_SCALE + 1e-6  # one step: TFLite's fixed-point multiplier


def test_options_from_pairs():
    assert EthosOptions.parse({}).describe() == "ethos-u55-128, Ethos_U55_High_End_Embedded, Shared_Sram"
    u65 = EthosOptions.parse({"npu": "ethos-u65-256", "memory_mode": "Dedicated_Sram"})
    assert u65.to_dict() == {"npu": "ethos-u65-256", "system_config": "Ethos_U65_Client_Server",
                             "memory_mode": "Dedicated_Sram"}
    with pytest.raises(BadInputError, match="unknown Ethos-U configuration"):
        EthosOptions.parse({"npu": "ethos-u99-1"})
    with pytest.raises(BadInputError, match="unknown option"):
        EthosOptions.parse({"soc_model": "57"})


def two_convs() -> onnx.ModelProto:
    r = rng(1)
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["y1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "W2", "B2"], ["y2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["y2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "W3", "B3"], ["out"], name="fc", transB=1)]
    inits = [tensor("W1", r.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32)),
             tensor("B1", r.normal(0, 0.1, 8).astype(np.float32)),
             tensor("W2", r.normal(0, 0.2, (8, 8, 3, 3)).astype(np.float32)),
             tensor("B2", r.normal(0, 0.1, 8).astype(np.float32)),
             tensor("W3", r.normal(0, 0.3, (5, 8)).astype(np.float32)),
             tensor("B3", r.normal(0, 0.1, 5).astype(np.float32))]
    return model(nodes, [vinfo("x", [1, 3, 16, 16])], [vinfo("out", [1, 5])], inits)


def test_quantizer_config_writes_tflite_int8_conventions(tmp_path):
    from onnxruntime import quantization as ortq

    from opfuse.quantization.presets import PRESETS

    path = tmp_path / "f.onnx"
    onnx.save(two_convs(), path)
    samples = [{"x": rng(i).normal(0, 1, (1, 3, 16, 16)).astype(np.float32)} for i in range(4)]

    class Reader(ortq.CalibrationDataReader):
        def __init__(self):
            self.it = iter(samples)

        def get_next(self):
            return next(self.it, None)

    config = device.quantizer_config(path, two_convs(), PRESETS["ethos-u"], reader=Reader(), sample_reader=Reader(),
                                     method=ortq.CalibrationMethod.MinMax, extra={}, sixteen=[], excluded=[])
    ortq.quantize_static(str(path), str(tmp_path / "q.onnx"), **config)
    q = onnx.load(tmp_path / "q.onnx")
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in q.graph.initializer}
    dq_of = {n.output[0]: n for n in q.graph.node if n.op_type == "DequantizeLinear"}
    conv = next(n for n in q.graph.node if n.op_type == "Conv" and n.name.startswith("conv1"))
    x_dq, w_dq, b_dq = (dq_of[i] for i in conv.input)
    assert inits[x_dq.input[2]].dtype == np.int8  # activations int8
    assert inits[w_dq.input[0]].dtype == np.int8 and not inits[w_dq.input[2]].any()  # weights int8, symmetric
    assert inits[w_dq.input[1]].shape == (8,)  # per output channel
    assert inits[b_dq.input[0]].dtype == np.int32  # bias int32 at the input scale times the weight scale
    np.testing.assert_allclose(inits[b_dq.input[1]], inits[x_dq.input[1]] * inits[w_dq.input[1]], rtol=1e-6)
    assert "Relu" not in {n.op_type for n in q.graph.node}  # folded into the conv's int8 output range
    assert {"GlobalAveragePool", "Gemm"} <= {n.op_type for n in q.graph.node
                                             if any(i in dq_of for i in n.input)}  # every op the NPU runs: int8


def test_a_missing_package_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.split(".")[0] == "ethosu" else real(name, *a))
    path = tmp_path / "f.onnx"
    onnx.save(two_convs(), path)
    code = main(["quantize", str(path), "-o", str(tmp_path / "q.onnx"), "--calibration", "random:4",
                 "--preset", "ethos-u"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "pip install 'opfuse[ethos-u]'" in err[0] and "ethos-u-vela" in err[0]
    assert not (tmp_path / "q.onnx").exists()


def _lowering():
    from opfuse.targets.ethos_u import lower  # (merged: an import that fails is a failure, not a skip)

    return lower


def test_quantize_preset_ethos_u_end_to_end(tmp_path, capsys):
    _lowering()
    path = tmp_path / "f.onnx"
    onnx.save(two_convs(), path)
    out, context, report = tmp_path / "q.onnx", tmp_path / "m_vela.tflite", tmp_path / "r.json"
    code = main(["quantize", str(path), "-o", str(out), "--calibration", "random:16", "--preset", "ethos-u",
                 "--context", str(context), "--report", str(report), "--reconstruct", "off"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert out.exists() and context.read_bytes()[4:8] == b"TFL3" and (tmp_path / "m.tflite").exists()
    data = json.loads(report.read_text())
    dev, v = data["device"], data["verification"]
    assert dev["npu"] == "ethos-u55-128" and dev["cycles"] > 0 and dev["ops"] and not dev["fallbacks"]
    assert dev["sram_bytes"] > 0 and dev["off_chip_bytes"] > 0
    assert v["runtime"].startswith("Arm Ethos-U through Vela")
    assert v["sqnr_db"] > 15 and v["cpu_qdq_sqnr_db"] > 15 and v["htp_vs_cpu_sqnr_db"] > 20
    assert "Vela compile log" in printed.out
    assert not list(tmp_path.glob(".opfuse-vela-*"))  # Vela's working directory is gone


@pytest.mark.parametrize("command", [
    ["optimize", "--target", "ethos-u"],
    ["quantize", "--calibration", "random:8", "--preset", "ethos-u", "--reconstruct", "off"],
])
def test_an_unlowerable_op_is_refused_in_one_line(command, tmp_path, capsys):
    """An op the lowering does not write (a GRU; an Einsum here) is unsupported
    input, for optimize and quantize alike: one line, exit 2, nothing written, not an internal error."""
    _lowering()
    nodes = [helper.make_node("Conv", ["x", "W"], ["y"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Einsum", ["y", "y"], ["out"], name="einsum", equation="nchw,nchw->nchw")]
    m = model(nodes, [vinfo("x", [1, 3, 8, 8])], [vinfo("out", [1, 4, 8, 8])],
              [tensor("W", rng(2).normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32))])
    path, out, context = tmp_path / "f.onnx", tmp_path / "o.onnx", tmp_path / "o_vela.tflite"
    onnx.save(m, path)
    code = main([command[0], str(path), "-o", str(out), *command[1:], "--context", str(context), "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Einsum" in err[0] and "internal error" not in err[0], err
    assert not out.exists() and not context.exists() and not list(tmp_path.glob(".opfuse-vela-*"))


def silu_concat():
    """YOLOX's pattern: two conv branches with SiLU (x * Sigmoid(x)) concatenated, a MaxPool of the
    concatenation and a conv: each Sigmoid output and each Concat input a quantisation TFLite fixes."""
    r = rng(7)
    nodes = []
    for b in ("a", "b"):
        nodes += [helper.make_node("Conv", ["x", f"W{b}", f"B{b}"], [f"c{b}"], name=f"conv_{b}", pads=[1, 1, 1, 1]),
                  helper.make_node("Sigmoid", [f"c{b}"], [f"s{b}"], name=f"sigmoid_{b}"),
                  helper.make_node("Mul", [f"c{b}", f"s{b}"], [f"m{b}"], name=f"mul_{b}")]
    nodes += [helper.make_node("Concat", ["ma", "mb"], ["cat"], name="concat", axis=1),
              helper.make_node("MaxPool", ["cat"], ["pool"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
              helper.make_node("Conv", ["pool", "Wo", "Bo"], ["out"], name="conv_out")]
    inits = [tensor("Wa", r.normal(0, 0.3, (6, 3, 3, 3)).astype(np.float32)),
             tensor("Ba", r.normal(0, 0.1, 6).astype(np.float32)),
             tensor("Wb", r.normal(0, 0.8, (4, 3, 3, 3)).astype(np.float32)),  # a wider range than branch a
             tensor("Bb", r.normal(0, 0.1, 4).astype(np.float32)),
             tensor("Wo", r.normal(0, 0.3, (5, 10, 1, 1)).astype(np.float32)),
             tensor("Bo", r.normal(0, 0.1, 5).astype(np.float32))]
    return model(nodes, [vinfo("x", [1, 3, 16, 16])], [vinfo("out", [1, 5, 8, 8])], inits)


def test_tflite_overrides_fix_sigmoid_and_share_a_concat_range():
    from onnxruntime.quantization.calibrate import TensorData

    from opfuse.targets.ethos_u.tflite_quant import tflite_overrides

    ranges = {"x": (-2.0, 2.0), "ca": (-1.0, 3.0), "cb": (-4.0, 2.0), "sa": (0.0, 1.0), "sb": (0.0, 1.0),
              "ma": (-0.3, 3.0), "mb": (-0.3, 5.0), "cat": (-0.3, 5.0), "pool": (-0.2, 5.0), "out": (-1.0, 1.0)}
    data = {k: TensorData(lowest=np.float32(lo), highest=np.float32(hi)) for k, (lo, hi) in ranges.items()}
    got = tflite_overrides(silu_concat(), data)
    for s in ("sa", "sb"):  # LOGISTIC's int8 output
        assert float(got[s][0]["scale"]) == 1 / 256 and int(got[s][0]["zero_point"]) == -128
    for t in ("ma", "mb", "cat", "pool"):  # one range: the union of the four
        assert (float(got[t][0]["rmin"]), float(got[t][0]["rmax"])) == (np.float32(-0.3), np.float32(5.0))
    assert not {"x", "ca", "cb", "out"} & set(got)
    only_fixed = tflite_overrides(silu_concat(), None, sixteen=["sb"])  # no ranges yet; sb kept in 16 bits
    assert set(only_fixed) == {"sa"}


@pytest.mark.parametrize("reconstruct", ["off", "on"])
def test_quantize_preset_ethos_u_writes_no_requantisation(reconstruct, tmp_path, capsys, monkeypatch):
    """With TFLite's fixed and shared quantisations chosen by the quantiser, the lowered TFLite has
    no QUANTIZE (each one a pass Vela runs: ddddocr det paid 15 M cycles for 124 of them), and
    agrees with the QDQ model as before; with block reconstruction on too (it learns no scale of
    those tensors: the device's ``kept_scales``; 60 steps a block, what is checked is the lowering)."""
    _lowering()
    if reconstruct == "on":
        from test_reconstruction import fewer_steps

        fewer_steps(monkeypatch)
    path = tmp_path / "f.onnx"
    onnx.save(silu_concat(), path)
    out, context, report = tmp_path / "q.onnx", tmp_path / "m_vela.tflite", tmp_path / "r.json"
    code = main(["quantize", str(path), "-o", str(out), "--calibration", "random:16", "--preset", "ethos-u",
                 "--context", str(context), "--report", str(report), "--reconstruct", reconstruct])
    assert code == 0, capsys.readouterr().err
    tflite = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel((tmp_path / "m.tflite").read_bytes(), 0))
    codes = [max(c.builtinCode, c.deprecatedBuiltinCode) for c in tflite.operatorCodes]
    used = [codes[op.opcodeIndex] for op in tflite.subgraphs[0].operators]
    op = schema.BuiltinOperator
    assert used.count(op.LOGISTIC) == 2 and used.count(op.CONCATENATION) == 1
    assert op.QUANTIZE not in used
    v = json.loads(report.read_text())["verification"]
    assert v["sqnr_db"] > 20 and v["htp_vs_cpu_sqnr_db"] > 30, v
