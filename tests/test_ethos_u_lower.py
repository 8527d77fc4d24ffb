"""The Ethos-U lowering (ONNX -> TFLite in NHWC) against real runtimes, on small graphs built in code.

Float: the TFLite run in LiteRT's interpreter against ONNX Runtime on the same ONNX model
(tolerance 1e-4 relative + 1e-4 absolute: float32 with another summation order).

Int8: the QDQ model ONNX Runtime's ``quantize_static`` writes (QDQ, int8 asymmetric activations,
int8 symmetric per-channel weights), run on ONNX Runtime, against its int8 TFLite in LiteRT.
Tolerance: at least 98% of the output elements within 1 step of the output scale, and none
beyond 2 steps (measured: every element of every case within 1 step, most cases exact). Why not exact: ONNX Runtime runs the QDQ graph as float ops between
DequantizeLinear and QuantizeLinear (one float rounding, half to even, per op), while LiteRT's
int8 kernels requantise with a fixed-point multiplier and shift (rounding half away from zero,
and LOGISTIC/TANH/SOFTMAX through lookup tables), so a value near a rounding boundary can land one
step over; a chain of ops can carry such a step into the next op's input.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

import extras

Interpreter = extras.require("ai_edge_litert.interpreter").Interpreter  # the ethos-u extra

from opfuse.targets.ethos_u.lower import LoweringError, lower_to_tflite  # noqa: E402 - after the extra's check

RNG = np.random.default_rng(0)


# --- building and running --------------------------------------------------------------------
def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_empty_tensor_value_info(n) for n in outputs],
        [numpy_helper.from_array(np.asarray(v, np.float32) if np.asarray(v).dtype.kind == "f" else np.asarray(v), k)
         for k, v in inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    for out in model.graph.output:
        out.CopyFrom(inferred[out.name]) if out.name in inferred else None
    onnx.checker.check_model(model, full_check=True)
    return model


def _w(*shape, scale=0.3):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _feeds(model, seed=1):
    rng = np.random.default_rng(seed)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input}


def run_ort(model, feeds, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL):
    """ONNX Runtime on one thread; at ORT_DISABLE_ALL a QDQ model runs as float ops between
    DequantizeLinear and QuantizeLinear, at ORT_ENABLE_ALL on the runtime's int8 kernels."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = level
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_tflite(flatbuffer: bytes, feeds: dict) -> list[np.ndarray]:
    """The TFLite on LiteRT: rank-4 inputs given NHWC, int8 inputs quantised with the model's own
    parameters; outputs dequantised and rank-4 ones returned NCHW."""
    interp = Interpreter(model_content=flatbuffer, num_threads=1)
    interp.allocate_tensors()
    for detail, x in zip(interp.get_input_details(), feeds.values()):
        if x.ndim == 4:
            x = x.transpose(0, 2, 3, 1)
        if detail["dtype"] == np.int8:
            scale, zp = detail["quantization"]
            x = np.clip(np.round(x / scale) + zp, -128, 127).astype(np.int8)
        interp.set_tensor(detail["index"], np.ascontiguousarray(x))
    interp.invoke()
    outs = []
    for detail in interp.get_output_details():
        y = interp.get_tensor(detail["index"])
        if detail["dtype"] == np.int8:
            scale, zp = detail["quantization"]
            y = (y.astype(np.float32) - zp) * scale
        outs.append(y.transpose(0, 3, 1, 2) if y.ndim == 4 else y)
    return outs


class _Reader(CalibrationDataReader):
    def __init__(self, model, n=16):
        self._it = iter([_feeds(model, seed=100 + i) for i in range(n)])

    def get_next(self):
        return next(self._it, None)


def quantise(model, tmp_path: Path, keep_activations=False) -> onnx.ModelProto:
    src, dst = tmp_path / "float.onnx", tmp_path / "qdq.onnx"
    onnx.save(model, src)
    extra = {"WeightSymmetric": True, "ActivationSymmetric": False}
    if keep_activations:
        extra["QDQKeepRemovableActivations"] = True
    # every op type quantised (the registry leaves Tanh and HardSwish float otherwise) but Slice
    ops = {n.op_type for n in model.graph.node} - {"Slice"}  # ONNX Runtime's default leaves Slice float
    quantize_static(str(src), str(dst), _Reader(model), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                    op_types_to_quantize=sorted(ops), extra_options=extra)
    return onnx.load(dst)


def output_scales(flatbuffer: bytes) -> list[float]:
    interp = Interpreter(model_content=flatbuffer)
    return [d["quantization"][0] for d in interp.get_output_details()]


def assert_int8_close(flatbuffer, qdq, feeds, within_one=0.98, worst=2):
    expected = run_ort(qdq, feeds)
    got = run_tflite(flatbuffer, feeds)
    for e, g, scale in zip(expected, got, output_scales(flatbuffer)):
        assert e.shape == g.shape
        steps = np.abs(e - g) / scale
        assert np.mean(steps <= 1.01) >= within_one, f"{np.mean(steps <= 1.01):.3f} within 1 step"
        assert steps.max() <= worst + 0.01, f"worst {steps.max():.2f} steps"


def assert_float_close(flatbuffer, model, feeds):
    for e, g in zip(run_ort(model, feeds), run_tflite(flatbuffer, feeds)):
        assert e.shape == g.shape
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


def tflite_ops(flatbuffer: bytes) -> list[str]:
    from ai_edge_litert import schema_py_generated as schema
    model = schema.ModelT.InitFromPackedBuf(flatbuffer, 0)
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    return [names[model.operatorCodes[o.opcodeIndex].builtinCode] for o in model.subgraphs[0].operators]


# --- the graphs ------------------------------------------------------------------------------
def conv_graph(bias=True, stride=1, pads=(1, 1, 1, 1), group=1, c_in=8, c_out=16, act=None, k=3):
    inits = [("W", _w(c_out, c_in // group, k, k))]
    inputs = ["x", "W"]
    if bias:
        inits.append(("B", _w(c_out)))
        inputs.append("B")
    nodes = [helper.make_node("Conv", inputs, ["c" if act else "y"], name="conv", strides=[stride, stride],
                              pads=list(pads), group=group, kernel_shape=[k, k])]
    if act == "relu":
        nodes.append(helper.make_node("Relu", ["c"], ["y"], name="relu"))
    elif act == "relu6":
        inits += [("lo", np.float32(0)), ("hi", np.float32(6))]
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"], name="clip"))
    return _model(nodes, [("x", [1, c_in, 12, 12])], ["y"], inits)


def bn_decomposed_graph():
    """Conv, then BatchNormalization decomposed as Mul + Add by [1, C, 1, 1] constants, then Relu."""
    c = 8
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("Mul", ["c", "s"], ["m"], name="bn_mul"),
             helper.make_node("Add", ["m", "t"], ["a"], name="bn_add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    inits = [("W", _w(c, 4, 3, 3)), ("s", 1 + 0.2 * _w(1, c, 1, 1)), ("t", _w(1, c, 1, 1))]
    return _model(nodes, [("x", [1, 4, 10, 10])], ["y"], inits)


def residual_graph():
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c2", "x"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu2")]
    inits = [("W1", _w(8, 8, 3, 3)), ("B1", _w(8)), ("W2", _w(8, 8, 3, 3)), ("B2", _w(8))]
    return _model(nodes, [("x", [1, 8, 10, 10])], ["y"], inits)


def flatten_gemm_graph(op="Flatten"):
    """A spatial tensor (C=4, H=W=3) flattened in NCHW order, then a Gemm: needs the TRANSPOSE."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[1, 1])]
    if op == "Flatten":
        nodes.append(helper.make_node("Flatten", ["c"], ["f"], name="flatten", axis=1))
    else:
        nodes.append(helper.make_node("Reshape", ["c", "shape"], ["f"], name="reshape"))
    nodes.append(helper.make_node("Gemm", ["f", "G", "GB"], ["y"], name="fc", transB=1))
    inits = [("W", _w(4, 3, 1, 1)), ("G", _w(5, 36)), ("GB", _w(5)), ("shape", np.array([1, 36], np.int64))]
    return _model(nodes, [("x", [1, 3, 3, 3])], ["y"], inits)


def pool_graph(op, **attrs):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node(op, ["r"], ["y"], name="pool", **attrs)]
    return _model(nodes, [("x", [1, 4, 9, 9])], ["y"], [("W", _w(6, 4, 1, 1))])


def gap_fc_graph():
    """The classifier head: GlobalAveragePool, Flatten (H=W=1: no TRANSPOSE), Gemm."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "G", "GB"], ["y"], name="fc", transB=1)]
    return _model(nodes, [("x", [1, 3, 8, 8])], ["y"], [("W", _w(16, 3, 3, 3)), ("G", _w(10, 16)), ("GB", _w(10))])


def unary_graph(op, **attrs):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[1, 1]),
             helper.make_node(op, ["c"], ["y"], name=op.lower(), **attrs)]
    return _model(nodes, [("x", [1, 4, 6, 6])], ["y"], [("W", _w(6, 4, 1, 1, scale=0.8))])


def concat_graph():
    nodes = [helper.make_node("Conv", ["x", "W1"], ["a"], name="conv1", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["x", "W2"], ["b"], name="conv2", kernel_shape=[1, 1]),
             helper.make_node("Concat", ["a", "b"], ["y"], name="concat", axis=1)]
    return _model(nodes, [("x", [1, 4, 6, 6])], ["y"], [("W1", _w(3, 4, 1, 1)), ("W2", _w(5, 4, 1, 1, scale=1.0))])


def resize_graph(mode, ctm, nearest_mode="floor", size=(12, 12)):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[1, 1]),
             helper.make_node("Resize", ["c", "", "", "sizes"], ["y"], name="resize", mode=mode,
                              coordinate_transformation_mode=ctm, nearest_mode=nearest_mode)]
    inits = [("W", _w(4, 3, 1, 1)), ("sizes", np.array([1, 4, *size], np.int64))]
    return _model(nodes, [("x", [1, 3, 6, 6])], ["y"], inits)


def softmax_graph():
    nodes = [helper.make_node("Gemm", ["x", "G", "GB"], ["l"], name="fc", transB=1),
             helper.make_node("Softmax", ["l"], ["y"], name="softmax", axis=-1)]
    return _model(nodes, [("x", [1, 16])], ["y"], [("G", _w(10, 16, scale=0.5)), ("GB", _w(10))])


def se_block_graph():
    """Squeeze-excitation as PP-OCR writes it: GlobalAveragePool, 1x1 convs, HardSigmoid, Mul by x."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["c"], ["g"], name="gap"),
             helper.make_node("Conv", ["g", "W1", "B1"], ["s1"], name="squeeze", kernel_shape=[1, 1]),
             helper.make_node("Relu", ["s1"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "W2", "B2"], ["s2"], name="excite", kernel_shape=[1, 1]),
             helper.make_node("HardSigmoid", ["s2"], ["h"], name="hsig", alpha=0.2, beta=0.5),
             helper.make_node("Mul", ["c", "h"], ["y"], name="scale")]
    inits = [("W", _w(8, 3, 3, 3)), ("W1", _w(4, 8, 1, 1)), ("B1", _w(4)), ("W2", _w(8, 4, 1, 1, scale=2.0)),
             ("B2", _w(8))]
    return _model(nodes, [("x", [1, 3, 8, 8])], ["y"], inits)


def silu_sub_div_graph():
    """SiLU (x * sigmoid(x)), then Sub and Div by constants (a normalisation written out)."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[1, 1]),
             helper.make_node("Sigmoid", ["c"], ["s"], name="sigmoid"),
             helper.make_node("Mul", ["c", "s"], ["m"], name="silu"),
             helper.make_node("Sub", ["m", "mu"], ["d"], name="sub"),
             helper.make_node("Div", ["d", "sd"], ["y"], name="div")]
    inits = [("W", _w(6, 4, 1, 1, scale=0.8)), ("mu", _w(6, 1, 1)), ("sd", 1 + np.abs(_w(1, 6, 1, 1)))]
    return _model(nodes, [("x", [1, 4, 5, 5])], ["y"], inits)


def conv_transpose_graph(pads=(0, 0, 0, 0), k=2):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[1, 1]),
             helper.make_node("ConvTranspose", ["c", "T", "TB"], ["y"], name="up", strides=[2, 2],
                              kernel_shape=[k, k], pads=list(pads))]
    inits = [("W", _w(4, 3, 1, 1)), ("T", _w(4, 6, k, k)), ("TB", _w(6))]
    return _model(nodes, [("x", [1, 3, 5, 5])], ["y"], inits)


def split_slice_graph():
    """Split on channels (YOLOv8's C2f), Slice of H and W, Concat back, a Pad and a Transpose."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[1, 1]),
             helper.make_node("Split", ["c", "sizes"], ["a", "b"], name="split", axis=1),
             helper.make_node("Slice", ["a", "starts", "ends", "axes"], ["sa"], name="slice"),
             helper.make_node("Slice", ["b", "starts", "ends", "axes"], ["sb"], name="slice2"),
             helper.make_node("Concat", ["sb", "sa"], ["cat"], name="concat", axis=1),
             helper.make_node("Pad", ["cat", "pads"], ["p"], name="pad"),
             helper.make_node("Transpose", ["p"], ["y"], name="transpose", perm=[0, 2, 3, 1])]
    inits = [("W", _w(6, 3, 1, 1)), ("sizes", np.array([2, 4], np.int64)), ("starts", np.array([1, 0], np.int64)),
             ("ends", np.array([5, -1], np.int64)), ("axes", np.array([2, 3], np.int64)),
             ("pads", np.array([0, 0, 1, 0, 0, 0, 0, 2], np.int64))]
    return _model(nodes, [("x", [1, 3, 6, 6])], ["y"], inits)


def reduce_mean_graph(keepdims=1):
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[1, 1]),
             helper.make_node("ReduceMean", ["c"], ["y"], name="mean", axes=[2, 3], keepdims=keepdims)]
    return _model(nodes, [("x", [1, 3, 6, 6])], ["y"], [("W", _w(5, 3, 1, 1))], opset=17)


def focus_graph():
    """YOLOX's Focus: the graph input sliced into four phases and concatenated before the first
    conv; ONNX Runtime's quantiser leaves the Slice/Concat float (a move: same integers)."""
    nodes = [helper.make_node("Slice", ["x", "s0", "end", "ax3", "st"], ["a"], name="slice_w0"),
             helper.make_node("Slice", ["x", "s1", "end", "ax3", "st"], ["b"], name="slice_w1"),
             helper.make_node("Slice", ["a", "s0", "end", "ax2", "st"], ["a0"], name="slice_a0"),
             helper.make_node("Slice", ["a", "s1", "end", "ax2", "st"], ["a1"], name="slice_a1"),
             helper.make_node("Slice", ["b", "s0", "end", "ax2", "st"], ["b0"], name="slice_b0"),
             helper.make_node("Slice", ["b", "s1", "end", "ax2", "st"], ["b1"], name="slice_b1"),
             helper.make_node("Concat", ["a0", "b0", "a1", "b1"], ["f"], name="focus", axis=1),
             helper.make_node("Conv", ["f", "W"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    big = np.iinfo(np.int64).max
    inits = [("s0", np.array([0], np.int64)), ("s1", np.array([1], np.int64)), ("end", np.array([big], np.int64)),
             ("ax2", np.array([2], np.int64)), ("ax3", np.array([3], np.int64)), ("st", np.array([2], np.int64)),
             ("W", _w(8, 12, 3, 3))]
    return _model(nodes, [("x", [1, 3, 8, 8])], ["y"], inits)


def batchnorm_graph():
    """Conv, BatchNormalization left unfolded, Relu (an unfused graph a benchmark lowers)."""
    c = 8
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["n"], name="bn", epsilon=1e-5),
             helper.make_node("Relu", ["n"], ["y"], name="relu")]
    inits = [("W", _w(c, 4, 3, 3)), ("g", 1 + 0.3 * _w(c)), ("b", _w(c)), ("m", _w(c)), ("v", 0.5 + np.abs(_w(c)))]
    return _model(nodes, [("x", [1, 4, 10, 10])], ["y"], inits)


def head_graph():
    """GlobalMaxPool, a MatMul by a constant on a rank-3 tensor, Softmax over channels of NCHW data."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", kernel_shape=[1, 1]),
             helper.make_node("Softmax", ["c"], ["s"], name="softmax_c", axis=1),
             helper.make_node("GlobalMaxPool", ["s"], ["g"], name="gmp"),
             helper.make_node("Reshape", ["g", "shape"], ["r"], name="reshape"),
             helper.make_node("MatMul", ["r", "M"], ["y"], name="matmul")]
    inits = [("W", _w(6, 3, 1, 1, scale=1.0)), ("shape", np.array([1, 2, 3], np.int64)), ("M", _w(3, 5))]
    return _model(nodes, [("x", [1, 3, 5, 5])], ["y"], inits)


CASES = {
    "conv_bias": lambda: conv_graph(),
    "conv_no_bias": lambda: conv_graph(bias=False),
    "conv_stride2_same": lambda: conv_graph(stride=2, pads=(0, 0, 1, 1)),
    "conv_stride2_pad1": lambda: conv_graph(stride=2),
    "conv_asymmetric_pads": lambda: conv_graph(pads=(0, 2, 1, 0)),
    "conv_valid": lambda: conv_graph(pads=(0, 0, 0, 0)),
    "depthwise": lambda: conv_graph(group=8, c_in=8, c_out=8),
    "depthwise_multiplier2_relu6": lambda: conv_graph(group=8, c_in=8, c_out=16, act="relu6"),
    "conv_relu": lambda: conv_graph(act="relu"),
    "conv_relu6": lambda: conv_graph(act="relu6"),
    "bn_as_mul_add": bn_decomposed_graph,
    "residual_add_relu": residual_graph,
    "flatten_gemm": lambda: flatten_gemm_graph("Flatten"),
    "reshape_gemm": lambda: flatten_gemm_graph("Reshape"),
    "gap_flatten_gemm": gap_fc_graph,
    "maxpool_resnet_pads": lambda: pool_graph("MaxPool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
    "maxpool_valid": lambda: pool_graph("MaxPool", kernel_shape=[2, 2], strides=[2, 2]),
    "avgpool_valid": lambda: pool_graph("AveragePool", kernel_shape=[3, 3], strides=[3, 3]),
    "avgpool_include_pad": lambda: pool_graph("AveragePool", kernel_shape=[3, 3], strides=[2, 2],
                                              pads=[1, 1, 1, 1], count_include_pad=1),
    "global_average_pool": lambda: pool_graph("GlobalAveragePool"),
    "concat_channels": concat_graph,
    "resize_nearest": lambda: resize_graph("nearest", "asymmetric"),
    "resize_bilinear_half_pixel": lambda: resize_graph("linear", "half_pixel"),
    "resize_bilinear_align_corners": lambda: resize_graph("linear", "align_corners", size=(11, 11)),
    "softmax": softmax_graph,
    "sigmoid": lambda: unary_graph("Sigmoid"),
    "tanh": lambda: unary_graph("Tanh"),
    "hard_swish": lambda: unary_graph("HardSwish"),
    "leaky_relu": lambda: unary_graph("LeakyRelu", alpha=0.1),
    "se_block_hard_sigmoid": se_block_graph,
    "silu_sub_div": silu_sub_div_graph,
    "conv_transpose_valid": conv_transpose_graph,
    "conv_transpose_same": lambda: conv_transpose_graph(pads=(0, 0, 1, 1), k=3),
    "split_slice_concat_pad_transpose": split_slice_graph,
    "reduce_mean_keepdims": reduce_mean_graph,
    "reduce_mean_to_2d": lambda: reduce_mean_graph(keepdims=0),
    "focus_strided_slices_at_the_input": focus_graph,
    "batchnorm_unfolded": batchnorm_graph,
    "softmax_channels_gmp_matmul": head_graph,
    "resize_nearest_half_pixel": lambda: resize_graph("nearest", "half_pixel", "round_prefer_ceil", size=(9, 9)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_float_matches_onnxruntime(case):
    model = CASES[case]()
    tfl = lower_to_tflite(model)
    assert_float_close(tfl, model, _feeds(model))


@pytest.mark.parametrize("case", sorted(CASES))
def test_int8_matches_the_qdq_model_on_onnxruntime(case, tmp_path):
    qdq = quantise(CASES[case](), tmp_path)
    tfl = lower_to_tflite(qdq)
    assert_int8_close(tfl, qdq, _feeds(qdq))


# --- what the lowering writes ----------------------------------------------------------------
def test_batchnorm_as_mul_add_writes_per_channel_vectors():
    """BatchNormalization decomposed (Mul, Add by [1, C, 1, 1]) stays MUL and ADD by a [C] constant."""
    from ai_edge_litert import schema_py_generated as schema
    tfl = lower_to_tflite(bn_decomposed_graph(), fuse_activations=False)
    assert tflite_ops(tfl) == ["CONV_2D", "MUL", "ADD", "RELU"]
    model = schema.ModelT.InitFromPackedBuf(tfl, 0)
    sub = model.subgraphs[0]
    for op in sub.operators[1:3]:
        constant = sub.tensors[op.inputs[1]]
        assert list(constant.shape) == [8]
        assert model.buffers[constant.buffer].data is not None


def test_relu_fuses_into_its_producer_and_unfused_when_asked():
    model = residual_graph()
    before = model.SerializeToString()
    assert tflite_ops(lower_to_tflite(model)) == ["CONV_2D", "CONV_2D", "ADD"]
    assert model.SerializeToString() == before  # the caller's model is not modified
    refusals = []
    tfl = lower_to_tflite(model, refusals=refusals, fuse_activations=False)
    assert tflite_ops(tfl) == ["CONV_2D", "RELU", "CONV_2D", "ADD", "RELU"]
    assert [r["node"] for r in refusals] == ["relu1", "relu2"]
    assert_float_close(tfl, model, _feeds(model))


def test_relu_after_a_shared_output_stays_separate_with_its_reason():
    """The conv's output feeds the Relu and a residual Add: the Relu cannot fuse."""
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Add", ["r", "c"], ["y"], name="add")]
    model = _model(nodes, [("x", [1, 4, 6, 6])], ["y"], [("W", _w(4, 4, 3, 3))])
    refusals = []
    tfl = lower_to_tflite(model, refusals=refusals)
    assert tflite_ops(tfl) == ["CONV_2D", "RELU", "ADD"]
    assert refusals == [{"node": "relu", "op": "Relu",
                         "reason": "left a separate op: its producer's output 'c' has 2 consumers"}]
    assert_float_close(tfl, model, _feeds(model))


def test_int8_relu_kept_by_the_quantiser_is_fused_with_its_output_quantisation(tmp_path):
    """With QDQKeepRemovableActivations the QDQ model keeps Conv -> Q/DQ -> Relu -> Q/DQ; the
    fused CONV_2D writes the Relu's output quantisation (the unfused lowering keeps a RELU op)."""
    model = residual_graph()
    qdq = quantise(model, tmp_path, keep_activations=True)
    assert sum(n.op_type == "Relu" for n in qdq.graph.node) == 2
    fused = lower_to_tflite(qdq)
    assert tflite_ops(fused) == ["CONV_2D", "CONV_2D", "ADD"]
    assert_int8_close(fused, qdq, _feeds(qdq))
    unfused = lower_to_tflite(qdq, fuse_activations=False)
    assert tflite_ops(unfused) == ["CONV_2D", "RELU", "CONV_2D", "ADD", "RELU"]
    assert_int8_close(unfused, qdq, _feeds(qdq))


def test_int8_weights_are_per_channel_on_the_output_axis(tmp_path):
    from ai_edge_litert import schema_py_generated as schema
    for graph, axis in ((conv_graph(), 0), (conv_graph(group=8, c_in=8, c_out=16), 3), (softmax_graph(), 0)):
        tfl = lower_to_tflite(quantise(graph, tmp_path))
        model = schema.ModelT.InitFromPackedBuf(tfl, 0)
        sub = model.subgraphs[0]
        op = sub.operators[0]
        weight, bias = sub.tensors[op.inputs[1]], sub.tensors[op.inputs[2]]
        assert weight.quantization.quantizedDimension == axis
        assert len(weight.quantization.scale) == weight.shape[axis] > 1
        assert all(z == 0 for z in weight.quantization.zeroPoint)
        assert bias.type == schema.TensorType.INT32
        x_scale = sub.tensors[op.inputs[0]].quantization.scale[0]
        np.testing.assert_allclose(bias.quantization.scale, np.asarray(weight.quantization.scale) * x_scale,
                                   rtol=1e-6)
        assert sub.tensors[sub.inputs[0]].type == schema.TensorType.INT8
        assert sub.tensors[sub.outputs[0]].type == schema.TensorType.INT8


# --- refusals --------------------------------------------------------------------------------
def test_refused_ops_raise_one_line_naming_node_op_and_reason():
    erf = _model([helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
                  helper.make_node("Erf", ["c"], ["y"], name="erf1")],
                 [("x", [1, 4, 6, 6])], ["y"], [("W", _w(4, 4, 1, 1))])
    with pytest.raises(LoweringError) as info:
        lower_to_tflite(erf)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("node 'erf1' (Erf): no TFLite lowering is written for Erf")
    grouped = conv_graph(group=2, c_in=8, c_out=16)
    with pytest.raises(LoweringError) as info:
        lower_to_tflite(grouped)
    assert str(info.value).startswith("node 'conv' (Conv): groups=2 is neither a plain nor a depthwise convolution")
    assert "\n" not in str(info.value)


def test_a_gru_is_refused_with_what_tflite_has_and_what_to_do():
    # (an LSTM is lowered: tests/test_ethos_u_lstm.py); a GRU over [T=5, N=1, I=4], hidden 3
    gru = _model([helper.make_node("GRU", ["x", "W", "R"], ["y"], name="gru", hidden_size=3)],
                 [("x", [5, 1, 4])], ["y"], [("W", _w(1, 9, 4)), ("R", _w(1, 9, 3))])
    with pytest.raises(LoweringError) as info:
        lower_to_tflite(gru)
    said = str(info.value)
    assert "\n" not in said and said.startswith("node 'gru' (GRU): no TFLite lowering is written for GRU")
    assert "TFLite has no GRU op" in said and "onnx.utils.extract_model" in said


def test_clip_with_other_bounds_is_refused():
    model = _model([helper.make_node("Clip", ["x", "lo", "hi"], ["y"], name="clip")], [("x", [1, 4])], ["y"],
                   [("lo", np.float32(0)), ("hi", np.float32(3))])
    with pytest.raises(LoweringError, match=r"^node 'clip' \(Clip\): Clip bounds"):
        lower_to_tflite(model)


def test_an_op_the_quantiser_left_float_is_refused_in_an_int8_model(tmp_path):
    """ONNX Runtime's default registry leaves Erf... here Tanh float: the int8 TFLite has no float op."""
    model = unary_graph("Tanh")
    src, dst = tmp_path / "f.onnx", tmp_path / "q.onnx"
    onnx.save(model, src)
    quantize_static(str(src), str(dst), _Reader(model), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                    op_types_to_quantize=["Conv"])
    with pytest.raises(LoweringError, match=r"^node 'tanh' \(Tanh\): tensor 'y' is not quantised"):
        lower_to_tflite(onnx.load(dst))


# --- Vela ------------------------------------------------------------------------------------
# A case Vela leaves on the CPU, with the reason it prints (U55: nearest resize by 2x/4x/8x only).
VELA_CPU = {"resize_nearest_half_pixel": ("RESIZE_NEAREST_NEIGHBOR", "unsupported scale-factor=1.5")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_vela_compiles_the_int8_model_with_every_op_on_the_npu(case, tmp_path):
    """Vela (U55-128) compiles each int8 model; every op is on the NPU but the forced fallback,
    which Vela reports with its reason."""
    tfl = tmp_path / f"{case}.tflite"
    tfl.write_bytes(lower_to_tflite(quantise(CASES[case](), tmp_path)))
    result = subprocess.run([*extras.vela(), "--accelerator-config", "ethos-u55-128", str(tfl),
                             "--output-dir", str(tmp_path / "vela")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    if case in VELA_CPU:
        op, reason = VELA_CPU[case]
        assert f"operator: {op}" in result.stdout and reason in result.stdout, result.stdout
        assert "CPU operators = 1 (50.0%)" in result.stdout, result.stdout
    else:
        assert "CPU operators = 0 (0.0%)" in result.stdout, result.stdout


# --- the built-in ResNet-18, folded and quantised --------------------------------------------
def test_resnet18_folded_and_quantised_runs_in_litert_close_to_the_qdq_model(tmp_path):
    """ResNet-18 (64x64) folded by ``opfuse optimize --target onnx``, quantised by ONNX Runtime on
    random calibration data, lowered: its SQNR against the QDQ model on ONNX Runtime."""
    from opfuse.models import build
    from opfuse.pipeline import optimize
    folded = tmp_path / "folded.onnx"
    optimize(build("resnet18", batch=1, image_size=64), target="onnx", output=folded)
    model = onnx.load(folded)
    assert not any(n.op_type == "BatchNormalization" for n in model.graph.node)
    qdq = quantise(model, tmp_path)
    tfl = lower_to_tflite(qdq)
    assert tflite_ops(tfl).count("CONV_2D") == 20
    signal = {"float": 0.0, "qdq": 0.0, "qdq_int8_kernels": 0.0}
    noise = dict.fromkeys(signal, 0.0)
    for seed in (7, 8, 9):
        feeds = _feeds(qdq, seed=seed)
        got = run_tflite(tfl, feeds)[0]
        for name, out in (("float", run_ort(model, feeds)[0]), ("qdq", run_ort(qdq, feeds)[0]),
                          ("qdq_int8_kernels", run_ort(qdq, feeds, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)[0])):
            signal[name] += float(np.sum(out ** 2))
            noise[name] += float(np.sum((out - got) ** 2))
        qdq_noise = float(np.sum((run_ort(model, feeds)[0] - run_ort(qdq, feeds)[0]) ** 2))
        noise["qdq_vs_float"] = noise.get("qdq_vs_float", 0.0) + qdq_noise
    sqnr = {k: 10 * np.log10(signal[k] / max(noise[k], 1e-30)) for k in signal}
    sqnr["qdq_vs_float"] = 10 * np.log10(signal["float"] / noise["qdq_vs_float"])
    print("ResNet-18 64x64 int8 TFLite SQNR (dB):", {k: round(v, 1) for k, v in sqnr.items()})
    assert sqnr["qdq_int8_kernels"] > 30 and sqnr["qdq"] > 25
    assert sqnr["float"] > sqnr["qdq_vs_float"] - 1.0  # as accurate as the QDQ model, within 1 dB
    float_tfl = lower_to_tflite(model)
    assert_float_close(float_tfl, model, _feeds(model, seed=7))


def test_int8_clip_0_6_kept_by_the_quantiser_fuses_as_relu6(tmp_path):
    from ai_edge_litert import schema_py_generated as schema
    qdq = quantise(conv_graph(act="relu6"), tmp_path, keep_activations=True)
    assert any(n.op_type == "Clip" for n in qdq.graph.node)
    tfl = lower_to_tflite(qdq)
    model = schema.ModelT.InitFromPackedBuf(tfl, 0)
    (op,) = model.subgraphs[0].operators
    assert op.builtinOptions.fusedActivationFunction == schema.ActivationFunctionType.RELU6
    assert_int8_close(tfl, qdq, _feeds(qdq))
