"""A LayerNorm written out and attention's MatMuls, lowered to TFLite for the Ethos-U, against real runtimes.

Small graphs built in code, in the manner of ``test_ethos_u_lower`` (whose helpers and tolerances
these tests use): float TFLite in LiteRT against ONNX Runtime on the same ONNX model; int8 TFLite
against the QDQ model ONNX Runtime's ``quantize_static`` writes, with the op types
the ``ethos-u`` device lists (:data:`opfuse.targets.ethos_u.tflite_norm.QUANTISED_OPS`).

The RSQRT form (``Div(a, Sqrt(y))`` -> ``Mul(a, Pow(y, -0.5))``) is checked against the model as
written on ONNX Runtime (float32: a few units in the last place), and Vela (U55-128) compiles
each int8 model.
"""

from __future__ import annotations

import subprocess

import numpy as np
import onnx
import pytest
from onnx import helper
from onnxruntime.quantization import QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry
import extras
from test_ethos_u_lower import (_feeds, _model, _Reader, _w, assert_float_close, assert_int8_close, run_ort,
                                tflite_ops)

from opfuse.targets.ethos_u.lower import LoweringError, lower_to_tflite
from opfuse.targets.ethos_u.tflite_norm import QUANTISED_OPS, rsqrt_form

N, C, HEADS = 10, 16, 2


def layer_norm_graph(rank4: bool = False):
    """PaddleOCR's SVTR LayerNorm as exported (ReduceMean's axes an attribute, as up to opset 17) after a
    token projection: x [1, N, C] -> MatMul -> LayerNorm over C; ``rank4``: a [1, C, N, 1] NCHW
    tensor normalised over C (axis 1), NHWC in TFLite."""
    shape = [1, C, N, 1] if rank4 else [1, N, C]
    axis = 1 if rank4 else -1
    first = (helper.make_node("Conv", ["x", "W"], ["t"], name="proj", kernel_shape=[1, 1]) if rank4
             else helper.make_node("MatMul", ["x", "W"], ["t"], name="proj"))
    nodes = [first,
             helper.make_node("ReduceMean", ["t"], ["mu"], name="mean", axes=[axis]),
             helper.make_node("Sub", ["t", "mu"], ["d"], name="centre"),
             helper.make_node("Pow", ["d", "two"], ["d2"], name="square"),
             helper.make_node("ReduceMean", ["d2"], ["var"], name="variance", axes=[axis]),
             helper.make_node("Add", ["var", "eps"], ["ve"], name="add_eps"),
             helper.make_node("Sqrt", ["ve"], ["sd"], name="sqrt"),
             helper.make_node("Div", ["d", "sd"], ["n"], name="normalise"),
             helper.make_node("Mul", ["n", "gamma"], ["g"], name="gamma"),
             helper.make_node("Add", ["g", "beta"], ["y"], name="beta")]
    affine = [C, 1, 1] if rank4 else [C]
    inits = [("W", _w(C, C, 1, 1) if rank4 else _w(C, C)), ("two", np.array(2.0, np.float32)),
             ("eps", np.array(1e-6, np.float32)), ("gamma", 1 + _w(*affine, scale=0.2)), ("beta", _w(*affine))]
    return _model(nodes, [("x", shape)], ["y"], inits, opset=13)


def layer_norm_node_graph(opset: int = 17):
    """A LayerNormalization node (opset 17; 18 gives ReduceMean its axes as an input) after a projection."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["t"], name="proj"),
             helper.make_node("LayerNormalization", ["t", "gamma", "beta"], ["y"], name="ln", axis=-1, epsilon=1e-5)]
    inits = [("W", _w(C, C)), ("gamma", 1 + _w(C, scale=0.2)), ("beta", _w(C))]
    return _model(nodes, [("x", [1, N, C])], ["y"], inits, opset=opset)


def attention_graph(masked: bool = False):
    """One head split, attention and merge as SVTR writes it: q, k, v from projections,
    [1, N, heads, d] -> [1, heads, N, d], softmax(q k^T) v over the last axis, merged back;
    ``masked``: a constant [1, 1, N, N] added to the scores (an op that reads them NHWC)."""
    d = C // HEADS
    nodes, inits = [], [("split", np.array([1, N, HEADS, d], np.int64)), ("merge", np.array([1, N, C], np.int64)),
                        ("scale", np.array(d ** -0.5, np.float32)), ("mask", _w(1, 1, N, N, scale=0.5))]
    for name in "qkv":
        nodes += [helper.make_node("MatMul", ["x", f"W{name}"], [f"{name}0"], name=f"proj_{name}"),
                  helper.make_node("Reshape", [f"{name}0", "split"], [f"{name}1"], name=f"split_{name}")]
        inits.append((f"W{name}", _w(C, C)))
    nodes += [helper.make_node("Transpose", ["q1"], ["q2"], name="q_heads", perm=[0, 2, 1, 3]),
              helper.make_node("Mul", ["q2", "scale"], ["q"], name="q_scale"),
              helper.make_node("Transpose", ["k1"], ["kt"], name="k_heads_t", perm=[0, 2, 3, 1]),
              helper.make_node("Transpose", ["v1"], ["v"], name="v_heads", perm=[0, 2, 1, 3]),
              helper.make_node("MatMul", ["q", "kt"], ["s0" if masked else "s"], name="scores"),
              *([helper.make_node("Add", ["s0", "mask"], ["s"], name="mask")] if masked else []),
              helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=3),
              helper.make_node("MatMul", ["p", "v"], ["o"], name="mix"),
              helper.make_node("Transpose", ["o"], ["o1"], name="merge_heads", perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["o1", "merge"], ["y"], name="merge")]
    if not masked:
        inits = [(k, v) for k, v in inits if k != "mask"]
    return _model(nodes, [("x", [1, N, C])], ["y"], inits, opset=13)


CASES = {"layer_norm_tokens": layer_norm_graph, "layer_norm_channels_nhwc": lambda: layer_norm_graph(rank4=True),
         "attention": attention_graph, "attention_masked": lambda: attention_graph(masked=True),
         "layer_norm_node": layer_norm_node_graph,
         "layer_norm_node_opset18": lambda: layer_norm_node_graph(18)}


def rewritten(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    rsqrt_form(copy)
    return copy


def quantise(model, tmp_path) -> onnx.ModelProto:
    """ONNX Runtime's quantiser as the ethos-u device calls it: its registries' ops and QUANTISED_OPS."""
    src, dst = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(rewritten(model), src)
    quantize_static(str(src), str(dst), _Reader(model), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                    op_types_to_quantize=sorted({*QLinearOpsRegistry, *QDQRegistry, *QUANTISED_OPS}),
                    extra_options={"WeightSymmetric": True, "ActivationSymmetric": False})
    return onnx.load(dst)


@pytest.mark.parametrize("case", ["layer_norm_tokens", "layer_norm_node", "layer_norm_node_opset18"])
def test_the_rsqrt_form_computes_the_model_as_written(case):
    model = CASES[case]()
    form = rewritten(model)
    assert not {"Sqrt", "Div", "LayerNormalization"} & {n.op_type for n in form.graph.node}
    onnx.checker.check_model(form, full_check=True)
    feeds = _feeds(model)
    np.testing.assert_allclose(run_ort(form, feeds)[0], run_ort(model, feeds)[0], rtol=1e-5, atol=1e-6)


def test_a_sqrt_read_otherwise_than_as_a_divisor_is_left_as_it_was():
    model = layer_norm_graph()
    model.graph.node.append(helper.make_node("Identity", ["sd"], ["sd_out"], name="also"))
    model.graph.output.append(helper.make_empty_tensor_value_info("sd_out"))
    form = rewritten(model)
    assert [n.op_type for n in form.graph.node].count("Sqrt") == 1


@pytest.mark.parametrize("case", sorted(CASES))
def test_float_matches_onnxruntime(case):
    model = rewritten(CASES[case]())
    assert_float_close(lower_to_tflite(model), model, _feeds(model))


@pytest.mark.parametrize("case", sorted(CASES))
def test_int8_matches_the_qdq_model_on_onnxruntime(case, tmp_path):
    qdq = quantise(CASES[case](), tmp_path)
    assert not {"Sqrt", "Div"} & {n.op_type for n in qdq.graph.node}
    tfl = lower_to_tflite(qdq)
    ops = set(tflite_ops(tfl))
    assert ({"MEAN", "SUB", "RSQRT"} <= ops) if case.startswith("layer_norm") else ("BATCH_MATMUL" in ops)
    assert_int8_close(tfl, qdq, _feeds(qdq))


def test_a_pow_other_than_minus_one_half_is_refused():
    model = layer_norm_graph()
    two = next(i for i in model.graph.initializer if i.name == "two")
    two.CopyFrom(onnx.numpy_helper.from_array(np.array(3.0, np.float32), "two"))
    with pytest.raises(LoweringError, match=r"^node 'square' \(Pow\): a Pow with exponent \[3.0\]"):
        lower_to_tflite(model)


@pytest.mark.parametrize("case", sorted(CASES))
def test_vela_compiles_the_int8_model_with_every_op_on_the_npu(case, tmp_path):
    tfl = tmp_path / f"{case}.tflite"
    tfl.write_bytes(lower_to_tflite(quantise(CASES[case](), tmp_path)))
    result = subprocess.run([*extras.vela(), "--accelerator-config", "ethos-u55-128", str(tfl),
                             "--output-dir", str(tmp_path / "vela")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "CPU operators = 0 (0.0%)" in result.stdout, result.stdout
