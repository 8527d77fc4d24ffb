"""``dequantize-dynamic`` (opfuse/passes/dequantize_dynamic.py): dynamic int8 back to float ops.

The oracle is ONNX Runtime's own quantiser: each case is a small float graph built here and
quantised by ``onnxruntime.quantization.quantize_dynamic`` (its graph optimiser writes the
contrib forms), so the pattern is the real one. What the rewrite must equal is computed here,
from the shipped initializers alone: the float graph with each weight replaced by
``(Wq - wz) * ws`` in float32 arithmetic.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic

from graphs import assert_outputs_close, model, ort_run, rng, tensor, vinfo
from opfuse.passes.dequantize_dynamic import DequantizeDynamicPass
from opfuse.pipeline import optimize
from opfuse.report import FusionReport
from opfuse.core.ops import integer_op
from qnn_graphs import needs_htp

HIDDEN, STEPS, ROWS = 8, 6, 8  # the LSTM: 6 steps of 8 values (the conv's 4 x 2 x 6 output, reshaped)


def _float_model():
    """x[1,1,2,6] -> Conv 3x3 (4 channels, bias) -> Relu -> [6,1,8] -> bidirectional LSTM -> [6,16] -> MatMul [16,5]."""
    r = rng(0)
    nodes = [helper.make_node("Conv", ["x", "Wc", "Bc"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Reshape", ["r", "to_steps"], ["s"], name="to_steps"),
             helper.make_node("LSTM", ["s", "W", "R", "B"], ["y"], hidden_size=HIDDEN, direction="bidirectional",
                              name="lstm"),
             helper.make_node("Reshape", ["y", "to_rows"], ["h"], name="to_rows"),
             helper.make_node("MatMul", ["h", "Wm"], ["z"], name="mm")]
    return model(nodes, [vinfo("x", [1, 1, 2, 6])], [vinfo("z", [STEPS, 5])],
                 [tensor("Wc", r.normal(0, 0.5, (4, 1, 3, 3)).astype(np.float32)),
                  tensor("Bc", r.normal(0, 0.1, 4).astype(np.float32)),
                  tensor("to_steps", np.array([STEPS, 1, ROWS], np.int64)),
                  tensor("W", r.normal(0, 0.3, (2, 4 * HIDDEN, ROWS)).astype(np.float32)),
                  tensor("R", r.normal(0, 0.3, (2, 4 * HIDDEN, HIDDEN)).astype(np.float32)),
                  tensor("B", r.normal(0, 0.1, (2, 8 * HIDDEN)).astype(np.float32)),
                  tensor("to_rows", np.array([STEPS, 2 * HIDDEN], np.int64)),
                  tensor("Wm", r.normal(0, 0.3, (2 * HIDDEN, 5)).astype(np.float32))])


def _dynamic(tmp_path, m, per_channel=False, weight_type=QuantType.QInt8) -> onnx.ModelProto:
    src, dst = tmp_path / "float.onnx", tmp_path / "dynamic.onnx"
    onnx.save(m, src)
    quantize_dynamic(src, dst, per_channel=per_channel, weight_type=weight_type)
    return onnx.load(dst)


def _fused_by_ort(tmp_path, proto) -> onnx.ModelProto:
    """The model as ONNX Runtime's graph optimiser (EXTENDED) writes it: its contrib fusions."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "fused.onnx")
    ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return onnx.load(tmp_path / "fused.onnx")


def _dequantise(proto):
    m = ir.serde.deserialize_model(proto)
    report = FusionReport()
    rewrite = DequantizeDynamicPass(report)
    rewrite(m)
    return m, report, rewrite


def _expected_weights(shipped: onnx.ModelProto) -> dict[str, np.ndarray]:
    """float weight name -> (Wq - wz) * ws in float32, from ORT's initializers (``<W>_quantized``,
    ``<W>_scale``, ``<W>_zero_point``); LSTM weights transposed to [directions, 4 * hidden, rows]."""
    inits = {t.name: numpy_helper.to_array(t) for t in shipped.graph.initializer}
    out = {}
    for name in ("Wc", "Wm", "W", "R", "W1", "W2"):
        if f"{name}_quantized" not in inits:
            continue
        q = inits[f"{name}_quantized"].astype(np.float32)
        s, z = inits[f"{name}_scale"], inits[f"{name}_zero_point"].astype(np.float32)
        if name in ("W", "R"):  # DynamicQuantizeLSTM: [directions, rows, 4 * hidden], scale per direction or column
            s, z = (s[:, None, None], z[:, None, None]) if s.ndim == 1 else (s[:, None, :], z[:, None, :])
            out[name] = ((q - z) * s).transpose(0, 2, 1)
        else:  # per tensor, or per column of a MatMul [K, N]
            out[name] = (q - z) * s
    return out


def _weights_of(m: ir.Model) -> dict[str, np.ndarray]:
    """The float weights the rewrite wrote, keyed as in the float model."""
    found = {}
    for node in m.graph:
        key = {"Conv": ["Wc"], "LSTM": ["W", "R"], "MatMul": ["Wm" if node.name == "mm" else node.name.replace("mm", "W")]}
        for k, value in zip(key.get(node.op_type, []), node.inputs[1:]):
            found[k] = value.const_value.numpy()
    return found


def _with_weights(m: onnx.ModelProto, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(m)
    for init in out.graph.initializer:
        if init.name in weights:
            init.CopyFrom(numpy_helper.from_array(weights[init.name].astype(np.float32), init.name))
    return out


def _sqnr(ref: np.ndarray, got: np.ndarray) -> float:
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    return float(10 * np.log10(np.sum(ref ** 2) / np.sum((ref - got) ** 2)))


def _x(seed: int = 1) -> dict[str, np.ndarray]:
    return {"x": rng(seed).normal(0, 1, (1, 1, 2, 6)).astype(np.float32)}


# -- the rewrite ---------------------------------------------------------------------------------

@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("weight_type", [QuantType.QInt8, QuantType.QUInt8])
def test_quantize_dynamic_output_becomes_float_ops_with_exactly_the_shipped_weights(tmp_path, per_channel,
                                                                                    weight_type):
    original = _float_model()
    shipped = _dynamic(tmp_path, original, per_channel, weight_type)
    inits = {t.name: numpy_helper.to_array(t) for t in shipped.graph.initializer}
    assert inits["Wm_scale"].shape == ((5,) if per_channel else ())  # the per-column path is exercised
    assert inits["W_scale"].shape == ((2, 4 * HIDDEN) if per_channel else (2,))
    m, report, rewrite = _dequantise(shipped)
    assert not [n.op_type for n in m.graph if integer_op(n) is not None]  # no integer op is left
    assert sorted(n.op_type for n in m.graph if n.op_type in ("Conv", "LSTM", "MatMul")) == ["Conv", "LSTM", "MatMul"]
    assert [r.pattern for r in report.records] == ["DynamicQuantizeLinear+ConvInteger", "DynamicQuantizeLSTM",
                                                   "DynamicQuantizeLinear+MatMulInteger"]
    assert not rewrite.refusals
    expected, written = _expected_weights(shipped), _weights_of(m)
    assert set(written) == {"Wc", "W", "R", "Wm"}
    for name, w in expected.items():
        assert written[name].dtype == np.float32 and np.array_equal(written[name], w), name  # bit for bit
    # what the model computes is the float model with those weights (float32 rounding only)
    assert_outputs_close(ort_run(_with_weights(original, expected), _x()), ort_run(m, _x()))


def test_the_result_is_the_float_model_up_to_its_8_bit_weights_and_not_the_shipped_model(tmp_path):
    original = _float_model()
    shipped = _dynamic(tmp_path, original)
    m, _, _ = _dequantise(shipped)
    f, s, d = (ort_run(x, _x(2))["z"] for x in (original, shipped, m))
    # Per-tensor 8-bit weights round each weight by at most half a step (max |W| / 127): an error
    # some 40 dB below the weights, compounding over three layers; 30 dB leaves room for that.
    assert _sqnr(f, d) > 30
    # the activations' run-time rounding is gone: the shipped model computes something else
    assert 20 < _sqnr(s, d) < 80


@pytest.mark.parametrize("shared", [False, True], ids=["DynamicQuantizeMatMul", "MatMulIntegerToFloat"])
def test_onnx_runtimes_fused_contrib_forms_become_matmul_and_bias_add(tmp_path, shared):
    """ORT fuses DynamicQuantizeLinear + MatMulInteger + Cast + Mul into DynamicQuantizeMatMul,
    or, when the quantised activation is shared, into MatMulIntegerToFloat (the bias too)."""
    r = rng(3)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"], name="mm1"),
             helper.make_node("Add", ["m1", "b1"], ["y1"], name="add1")]
    outputs = [vinfo("y1", [2, 5])]
    inits = [tensor("W1", r.normal(0, 0.3, (8, 5)).astype(np.float32)), tensor("b1", r.normal(0, 0.3, 5).astype(np.float32))]
    if shared:
        nodes.append(helper.make_node("MatMul", ["x", "W2"], ["y2"], name="mm2"))
        outputs.append(vinfo("y2", [2, 4]))
        inits.append(tensor("W2", r.normal(0, 0.3, (8, 4)).astype(np.float32)))
    original = model(nodes, [vinfo("x", [2, 8])], outputs, inits)
    fused = _fused_by_ort(tmp_path, _dynamic(tmp_path, original, per_channel=True))
    kinds = {n.op_type for n in fused.graph.node}
    assert ("MatMulIntegerToFloat" if shared else "DynamicQuantizeMatMul") in kinds
    m, report, rewrite = _dequantise(fused)
    assert not [n.op_type for n in m.graph if integer_op(n) is not None] and not rewrite.refusals
    assert sorted(n.op_type for n in m.graph) == ["Add", "MatMul"] + ["MatMul"] * shared
    feeds = {"x": rng(4).normal(0, 1, (2, 8)).astype(np.float32)}
    assert_outputs_close(ort_run(_with_weights(original, _expected_weights(fused)), feeds), ort_run(m, feeds))


def _older_quantiser_conv(per_channel_scale: bool, scale_shape=None):
    """DynamicQuantizeLinear -> ConvInteger with the int32 bias of ONNX Runtime's older quantiser
    (``onnx.quantize`` 0.1.0, as ddddocr's common_old ships it)::

        Div(b, Mul(xs, ws)) -> Floor -> Cast(int32) -> Reshape([1,-1,1,1]) -> Add(ConvInteger, .)
        -> Cast(float) -> Mul(., Mul(xs, ws))
    """
    r = rng(5)
    wq = r.integers(0, 256, (4, 2, 3, 3)).astype(np.uint8)
    ws = (r.uniform(0.002, 0.01, (4, 1, 1)) if per_channel_scale else np.array(0.004)).astype(np.float32)
    if scale_shape is not None:
        ws = ws.reshape(scale_shape)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="x_quantize"),
             helper.make_node("Mul", ["xs", "ws"], ["bias_scale"], name="bias_scale"),
             helper.make_node("Div", ["b", "bias_scale"], ["b_div"], name="bias_div"),
             helper.make_node("Floor", ["b_div"], ["b_floor"], name="bias_floor"),
             helper.make_node("Cast", ["b_floor"], ["b_int"], to=TensorProto.INT32, name="bias_cast"),
             helper.make_node("Reshape", ["b_int", "bias_shape"], ["b_col"], name="bias_reshape"),
             helper.make_node("ConvInteger", ["xq", "wq", "xz", "wz"], ["acc"], pads=[1, 1, 1, 1], name="conv_quant"),
             helper.make_node("Add", ["acc", "b_col"], ["acc_b"], name="bias_add"),
             helper.make_node("Cast", ["acc_b"], ["acc_f"], to=TensorProto.FLOAT, name="acc_cast"),
             helper.make_node("Mul", ["xs", "ws"], ["scales"], name="scales"),
             helper.make_node("Mul", ["acc_f", "scales"], ["y"], name="rescale")]
    inits = [tensor("wq", wq), tensor("wz", np.array(128, np.uint8)), tensor("ws", ws),
             tensor("b", r.normal(0, 0.2, (4, 1, 1) if per_channel_scale else 4).astype(np.float32)),
             tensor("bias_shape", np.array([1, -1, 1, 1], np.int64))]
    return model(nodes, [vinfo("x", [1, 2, 5, 5])], [vinfo("y", [1, 4, 5, 5])], inits, opset=12)


@pytest.mark.parametrize("per_channel_scale", [False, True])
def test_the_older_quantisers_int32_bias_becomes_the_convs_float_bias(per_channel_scale):
    shipped = _older_quantiser_conv(per_channel_scale)
    inits = {t.name: numpy_helper.to_array(t) for t in shipped.graph.initializer}
    m, report, rewrite = _dequantise(shipped)
    assert [n.op_type for n in m.graph] == ["Conv"] and not rewrite.refusals
    conv = next(iter(m.graph))
    assert conv.name == "conv" and list(conv.attributes["pads"].value) == [1, 1, 1, 1]  # ORT's "_quant" suffix dropped
    weight, bias = (v.const_value.numpy() for v in conv.inputs[1:])
    ws = inits["ws"].reshape(-1, 1, 1, 1) if per_channel_scale else inits["ws"]  # [M,1,1]: the output's channels
    expected = (inits["wq"].astype(np.float32) - np.float32(128)) * ws
    assert np.array_equal(weight, expected) and np.array_equal(bias, inits["b"].reshape(-1))
    float_conv = model([helper.make_node("Conv", ["x", "W", "B"], ["y"], pads=[1, 1, 1, 1])],
                       [vinfo("x", [1, 2, 5, 5])], [vinfo("y", [1, 4, 5, 5])],
                       [tensor("W", expected), tensor("B", inits["b"].reshape(-1))], opset=12)
    feeds = {"x": rng(6).normal(0, 1, (1, 2, 5, 5)).astype(np.float32)}
    assert_outputs_close(ort_run(float_conv, feeds), ort_run(m, feeds))
    # and it is what the shipped model computes, less the activation's and the bias's rounding
    assert 25 < _sqnr(ort_run(shipped, feeds)["y"], ort_run(m, feeds)["y"]) < 80


# -- refusals ------------------------------------------------------------------------------------

def test_an_integer_result_read_by_another_node_is_refused_and_the_rest_still_rewritten(tmp_path):
    shipped = _dynamic(tmp_path, _float_model())
    acc = next(n.output[0] for n in shipped.graph.node if n.op_type == "ConvInteger")
    shipped.graph.node.append(helper.make_node("Cast", [acc], ["spy"], to=TensorProto.FLOAT, name="spy"))
    shipped.graph.output.append(vinfo("spy", [1, 4, 2, 6]))
    m, report, rewrite = _dequantise(shipped)
    reasons = {r.node: r.reason for r in rewrite.refusals}
    assert re.search(rf"its int32 result '{acc}' is read by 2 consumers .*Cast 'spy'", reasons["conv_quant"])
    assert "still read by ConvInteger 'conv_quant'" in reasons["x_QuantizeLinear"]
    left = sorted(n.op_type for n in m.graph if integer_op(n) is not None)
    assert left == ["ConvInteger", "DynamicQuantizeLinear"]  # the LSTM and the MatMul were rewritten
    assert [r.pattern for r in report.records] == ["DynamicQuantizeLSTM", "DynamicQuantizeLinear+MatMulInteger"]
    assert np.array_equal(ort_run(shipped, _x())["spy"], ort_run(m, _x())["spy"])  # the refused chain is untouched


def test_a_weight_scale_on_the_wrong_axis_and_a_weight_given_at_run_time_are_refused():
    wrong = _older_quantiser_conv(True, scale_shape=(4,))  # [M]: it would scale the output's last axis, not channels
    m, _, rewrite = _dequantise(wrong)
    assert any(n.op_type == "ConvInteger" for n in m.graph)
    assert "its weight scale has shape [4], which is not one value or one per output channel (4) on axis 1" in \
        rewrite.refusals[0].reason
    given = _older_quantiser_conv(False)
    given.graph.input.append(vinfo("wq", [4, 2, 3, 3], TensorProto.UINT8))
    given.graph.initializer.remove(next(i for i in given.graph.initializer if i.name == "wq"))
    m, _, rewrite = _dequantise(given)
    assert any(n.op_type == "ConvInteger" for n in m.graph)
    assert rewrite.refusals[0].reason == "the weight 'wq' is a graph input, set at run time"


# -- the pipelines -------------------------------------------------------------------------------

def test_optimize_dequantises_only_when_asked_and_measures_rather_than_verifies_it(tmp_path):
    shipped = _dynamic(tmp_path, _float_model())
    plain, plain_report = optimize(shipped)
    assert plain_report.ops_after["ConvInteger"] == 1  # not in the default passes: it is not exact
    out, report = optimize(shipped, passes=["dequantize-dynamic", "fold-arithmetic"])
    assert not [n for n in out.graph if integer_op(n) is not None]
    assert report.ops_before["ConvInteger"] == 1 and report.ops_after["Conv"] == 1
    v = report.verification
    assert v.ok and 20 < v.approximation_sqnr_db < 80  # the later fold checked against the dequantised model
    assert [(c.rewrite, c.ok) for c in v.rewrites] == [("Conv+Add at 'conv'", True)]
    assert any(re.search(r"the input model's outputs differ from it by \d+\.\d dB output SQNR", n) for n in v.notes)
    assert any("dequantize-dynamic is not exact" in n for n in report.notes)


def test_quantize_dequantises_first_quantises_and_reports_the_distance_to_the_shipped_model(tmp_path):
    from opfuse.quantization.pipeline import quantize

    shipped = _dynamic(tmp_path, _float_model())
    samples = [_x(10 + i) for i in range(12)]
    q, report = quantize(shipped, samples, holdout=4, reconstruct=False)
    assert report.quantize_linear > 0 and not report.nothing_quantised
    assert not [n for n in q.graph if (row := integer_op(n)) is not None and row.dynamic]
    note = next(n for n in report.notes if n.startswith("the model shipped dynamic int8"))
    found = re.fullmatch(r"the model shipped dynamic int8 \(1 ConvInteger, 1 DynamicQuantizeLSTM, 1 MatMulInteger\): "
                         r"dequantised to float ops with its int8 weights \(the reference below is that model; it "
                         r"differs from the shipped model by (\d+\.\d) dB output SQNR on the held-out samples\)", note)
    assert found
    # the figure, recomputed here: the shipped model as reference, the dequantised one against it
    m, _, _ = _dequantise(shipped)
    ref = np.concatenate([ort_run(shipped, s)["z"].ravel() for s in samples[-4:]])
    got = np.concatenate([ort_run(m, s)["z"].ravel() for s in samples[-4:]])
    assert abs(float(found.group(1)) - _sqnr(ref, got)) < 0.06
    assert report.shipped_sqnr_db == pytest.approx(_sqnr(ref, got), abs=0.01)
    assert [r.pattern for r in report.fusion.records[:3]] == [
        "DynamicQuantizeLinear+ConvInteger", "DynamicQuantizeLSTM", "DynamicQuantizeLinear+MatMulInteger"]
    assert not any("already computes in integers" in n for n in report.notes)


@needs_htp
def test_on_qnn_the_shipped_model_splits_and_the_dequantised_quantised_one_runs_whole_lstm_included(tmp_path):
    """What QNN's provider (onnxruntime-qnn 2.7.0) says of the shipped forms, then of opfuse's result.
    It fuses DynamicQuantizeLinear -> ConvInteger/MatMulInteger -> Cast itself (its
    DQConvIntegerFusion), but not when the integer result goes anywhere but one Cast (the older
    quantiser's int32 bias Add, ddddocr's form), and it has no DynamicQuantizeLSTM."""
    from opfuse.targets.qnn.backend import open_session
    from opfuse.quantization.pipeline import quantize

    shipped = _dynamic(tmp_path, _float_model())
    refused = {f.op_type: f.reason for f in open_session(shipped).placement.fallbacks}
    assert list(refused) == ["DynamicQuantizeLSTM"]
    assert refused["DynamicQuantizeLSTM"].startswith("Operators of type `DynamicQuantizeLSTM` are not supported by QNN EP")
    older = {f.op_type for f in open_session(_older_quantiser_conv(False)).placement.fallbacks}
    assert older == {"DynamicQuantizeLinear", "ConvInteger"}
    q, report = quantize(shipped, [_x(20 + i) for i in range(8)], preset="qnn", holdout=2, require_npu=True,
                         reconstruct=False)
    assert report.device.placement.all_on_npu and report.device.strict
    assert "LSTM" in {n.op_type for n in q.graph} and report.quantize_linear > 0
    assert any(n.startswith("the model shipped dynamic int8 (1 ConvInteger") for n in report.notes)


def test_quantize_says_so_when_none_of_the_dynamic_int8_is_in_a_form_it_dequantises(tmp_path):
    from opfuse.quantization.pipeline import quantize

    r = rng(7)
    conv = model([helper.make_node("Conv", ["x", "W"], ["y"], pads=[1, 1, 1, 1], name="conv")],
                 [vinfo("x", [1, 1, 2, 6])], [vinfo("y", [1, 4, 2, 6])],
                 [tensor("W", r.normal(0, 0.5, (4, 1, 3, 3)).astype(np.float32))])
    shipped = _dynamic(tmp_path, conv)
    acc = next(n.output[0] for n in shipped.graph.node if n.op_type == "ConvInteger")
    shipped.graph.node.append(helper.make_node("Cast", [acc], ["spy"], to=TensorProto.FLOAT, name="spy"))
    shipped.graph.output.append(vinfo("spy", [1, 4, 2, 6]))
    q, report = quantize(shipped, [_x(30 + i) for i in range(8)], holdout=2, reconstruct=False)
    assert ("the model shipped dynamic int8 (1 ConvInteger), and none of it is in a form opfuse dequantises "
            "(the fusion log's refusals say why): it is quantised as it is") in report.notes
    assert report.shipped_sqnr_db is None and any(n.op_type == "ConvInteger" for n in q.graph)
    assert any(r.pattern == "DynamicQuantizeLinear+ConvInteger" for r in report.fusion.refusals)
