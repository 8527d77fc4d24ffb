"""The torch interpreter of single ONNX nodes (:mod:`opfuse.quantization.interpreter.ops`) against
ONNX Runtime: every op as a one-node model on seeded random inputs, at the opsets where
its semantics differ; random Conv windows (hypothesis); refusals at build time; autograd.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from opfuse.quantization.interpreter.ops import Unsupported, node_function

R = np.random.default_rng(0)
FP16 = (1e-2, 2e-3)


def f32(*shape, low=None, high=None):
    if low is None:
        return R.standard_normal(shape).astype(np.float32)
    return R.uniform(low, high, shape).astype(np.float32)


def f16(*shape):
    return f32(*shape).astype(np.float16)


def i64(*values):
    return np.array(values, np.int64)


def one_node_model(node: onnx.NodeProto, inputs, opset: int) -> onnx.ModelProto:
    """A model whose inputs are the node's non-empty inputs; output types from shape inference."""
    graph_inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                    for name, v in zip(node.input, inputs) if name]
    outputs = [helper.make_empty_tensor_value_info(name) for name in node.output if name]
    m = helper.make_model(helper.make_graph([node], "one_node", graph_inputs, outputs),
                          opset_imports=[helper.make_opsetid("", opset)]
                          + [helper.make_opsetid(node.domain, 1)] * bool(node.domain), ir_version=10)
    inferred = onnx.shape_inference.infer_shapes(m)
    types = {v.name: v.type for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for out in m.graph.output:
        out.type.CopyFrom(types[out.name])
    return m


def ort_run(node, inputs, opset):
    m = one_node_model(node, inputs, opset)
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {name: v for name, v in zip(node.input, inputs) if name}
    return session.run(None, feeds)


def torch_run(node, inputs, opset):
    outputs = node_function(node, opset)([None if v is None else torch.from_numpy(v) for v in inputs])
    return [t.detach().numpy() for t in outputs if t is not None]


def compare(op, inputs, attrs, opset=17, outputs=1, tol=None):
    inputs = [None if v is None else np.asarray(v) for v in inputs]
    names = ["" if v is None else f"in{i}" for i, v in enumerate(inputs)]
    node = helper.make_node(op, names, [f"out{i}" for i in range(outputs)], **attrs)
    expected, got = ort_run(node, inputs, opset), torch_run(node, inputs, opset)
    assert len(got) == len(expected)
    is_fp16 = any(v is not None and v.dtype == np.float16 for v in inputs)
    rtol, atol = tol or (FP16 if is_fp16 else (1e-5, 1e-5))
    for e, g in zip(expected, got):
        assert g.shape == e.shape and g.dtype == e.dtype, f"{g.shape} {g.dtype} != {e.shape} {e.dtype}"
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)


def case(op, inputs, opset=17, id=None, outputs=1, tol=None, **attrs):
    return pytest.param(op, inputs, attrs, opset, outputs, tol, id=id or op)


def tensor_attr(array):
    return numpy_helper.from_array(np.asarray(array))


ELEMENTWISE = [
    case("Add", [f32(2, 3, 4), f32(3, 1)]),
    case("Sub", [f32(4), f32(2, 3, 4)]),
    case("Mul", [f32(2, 1, 4), f32(3, 1)]),
    case("Div", [f32(2, 3), f32(3, low=0.5, high=2)]),
    case("Div", [i64(-7, 7, -8, 9, 5), i64(2, -2, 3, -4, 5)], id="Div-int-truncates"),
    case("Pow", [f32(2, 3, low=0.5, high=2), f32(3)]),
    case("Pow", [f32(2, 3), i64(2)], id="Pow-int-exponent"),
    case("Mod", [i64(-7, 7, -8, 9), i64(3, -3, 5, 4)], id="Mod-int"),
    case("Mod", [f32(2, 3), f32(3, low=0.5, high=2)], id="Mod-fmod", fmod=1),
    case("Sum", [f32(2, 3), f32(3), f32(1, 3)]),
    case("Mean", [f32(2, 3), f32(3), f32(1, 3)]),
    case("Min", [f32(2, 3), f32(3), f32(1, 3)]),
    case("Max", [f32(2, 3), f32(3)]),
    case("Max", [f32(2, 3)], id="Max-one-input"),
    case("Sqrt", [f32(3, 4, low=0.1, high=3)]),
    case("Exp", [f32(3, 4)]),
    case("Log", [f32(3, 4, low=0.1, high=3)]),
    case("Abs", [f32(3, 4)]),
    case("Neg", [f32(3, 4)]),
    case("Neg", [i64(1, -2, 3)], id="Neg-int"),
    case("Reciprocal", [f32(3, 4, low=0.5, high=2)]),
    case("Erf", [f32(3, 4)]),
    case("Floor", [f32(3, 4)]),
    case("Ceil", [f32(3, 4)]),
    case("Round", [np.array([0.5, 1.5, 2.5, -0.5, -1.5, 0.4, 2.6], np.float32)]),
    case("Sign", [f32(3, 4)]),
    case("Sin", [f32(3, 4)]),
    case("Cos", [f32(3, 4)]),
    case("Tanh", [f32(3, 4)]),
    case("Sigmoid", [f32(3, 4)]),
    case("Relu", [f32(3, 4)]),
    case("LeakyRelu", [f32(3, 4)]),
    case("LeakyRelu", [f32(3, 4)], id="LeakyRelu-alpha", alpha=0.3),
    case("PRelu", [f32(2, 3, 4, 4), f32(3, 1, 1)]),
    case("Elu", [f32(3, 4)], alpha=0.7),
    case("Celu", [f32(3, 4)], alpha=1.3),
    case("Selu", [f32(3, 4)]),
    case("Selu", [f32(3, 4)], id="Selu-attributes", alpha=1.5, gamma=0.9),
    case("ThresholdedRelu", [f32(3, 4)], alpha=0.4),
    case("HardSigmoid", [f32(3, 4) * 4]),
    case("HardSigmoid", [f32(3, 4) * 4], id="HardSigmoid-attributes", alpha=0.3, beta=0.4),
    case("HardSwish", [f32(3, 4) * 4], opset=14),
    case("Softplus", [f32(3, 4) * 4]),
    case("Softsign", [f32(3, 4)]),
    case("Mish", [f32(3, 4)], opset=18),
    case("Gelu", [f32(3, 4)], opset=20),
    case("Gelu", [f32(3, 4)], opset=20, id="Gelu-tanh", approximate="tanh"),
    case("Clip", [f32(3, 4)], opset=6, id="Clip-6-attributes", min=-0.5, max=0.7),
    case("Clip", [f32(3, 4)], opset=6, id="Clip-6-min-only", min=-0.5),
    case("Clip", [f32(3, 4), np.float32(-0.5), np.float32(0.7)], opset=13, id="Clip-13-inputs"),
    case("Clip", [f32(3, 4), None, np.float32(0.7)], opset=13, id="Clip-13-max-only"),
    case("Clip", [f32(3, 4), np.float32(-0.2)], opset=11, id="Clip-11-min-only"),
    case("Clip", [f32(3, 4)], opset=13, id="Clip-13-no-bounds"),
    case("Clip", [i64(-5, 0, 5, 9), np.int64(-1), np.int64(6)], opset=13, id="Clip-13-int"),
    case("Softmax", [f32(2, 3, 4)], opset=11, id="Softmax-11-default-axis-1-as-2d"),
    case("Softmax", [f32(2, 3, 4)], opset=11, id="Softmax-11-axis-2", axis=2),
    case("Softmax", [f32(2, 3, 4)], opset=13, id="Softmax-13-default-last-axis"),
    case("Softmax", [f32(2, 3, 4)], opset=13, id="Softmax-13-axis-1", axis=1),
    case("LogSoftmax", [f32(2, 3, 4)], opset=11, id="LogSoftmax-11"),
    case("LogSoftmax", [f32(2, 3, 4)], opset=11, id="LogSoftmax-11-axis-neg", axis=-2),
    case("LogSoftmax", [f32(2, 3, 4)], opset=13, id="LogSoftmax-13"),
    case("Equal", [i64(1, 2, 3, 4), i64(1, 0, 3, 0)]),
    case("Less", [f32(2, 3), f32(3)]),
    case("LessOrEqual", [f32(2, 3), f32(3)]),
    case("Greater", [f32(2, 3), f32(3)]),
    case("GreaterOrEqual", [i64(1, 2, 3), i64(2)]),
    case("Not", [np.array([True, False, True])]),
    case("And", [np.array([[True, False], [True, True]]), np.array([True, False])]),
    case("Or", [np.array([[True, False], [False, False]]), np.array([False, True])]),
    case("Xor", [np.array([[True, False], [False, True]]), np.array([True, True])]),
    case("Where", [f32(2, 3) > 0, f32(2, 3), f32(3)]),
    case("IsNaN", [np.array([0.0, np.nan, -np.inf, 2.0], np.float32)]),
    case("IsInf", [np.array([0.0, np.nan, -np.inf, np.inf], np.float32)], id="IsInf-both"),
    case("IsInf", [np.array([0.0, np.nan, -np.inf, np.inf], np.float32)], id="IsInf-negative", detect_positive=0),
    case("IsInf", [np.array([0.0, np.nan, -np.inf, np.inf], np.float32)], id="IsInf-positive", detect_negative=0),
    case("Gelu", [f32(2, 3, 5) * 4], id="Gelu-com.microsoft", domain="com.microsoft"),  # qnn_preprocess_model's
]

LINEAR = [
    case("Conv", [f32(2, 4, 9), f32(6, 4, 3), f32(6)], id="Conv-1d", pads=[1, 2], strides=[2]),
    case("Conv", [f32(1, 4, 7, 8), f32(6, 2, 3, 3), f32(6)], id="Conv-2d-group-dilation",
         group=2, dilations=[2, 1], strides=[1, 2], pads=[1, 0, 2, 1]),
    case("Conv", [f32(1, 4, 7, 8), f32(4, 1, 3, 3)], id="Conv-2d-depthwise-no-bias", group=4, pads=[1, 1, 1, 1]),
    case("Conv", [f32(1, 2, 5, 6, 4), f32(3, 2, 3, 2, 2), f32(3)], id="Conv-3d", pads=[1, 0, 1, 1, 1, 0]),
    case("Conv", [f32(1, 3, 7, 8), f32(4, 3, 3, 3)], id="Conv-VALID", auto_pad="VALID", strides=[2, 2]),
    case("Conv", [f32(1, 3, 7, 8), f32(4, 3, 4, 4)], id="Conv-SAME_UPPER", auto_pad="SAME_UPPER", strides=[2, 1]),
    case("Conv", [f32(1, 3, 7, 8), f32(4, 3, 4, 2)], id="Conv-SAME_LOWER", auto_pad="SAME_LOWER", strides=[2, 3]),
    case("ConvTranspose", [f32(1, 4, 5, 6), f32(4, 3, 3, 3), f32(3)], id="ConvTranspose-2d",
         strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 0]),
    case("ConvTranspose", [f32(1, 4, 5, 6), f32(4, 2, 3, 2), f32(4)], id="ConvTranspose-group-dilation",
         group=2, dilations=[2, 1], strides=[1, 2], pads=[0, 1, 2, 0]),
    case("ConvTranspose", [f32(2, 3, 7), f32(3, 2, 4)], id="ConvTranspose-1d", strides=[3], output_padding=[2]),
    case("ConvTranspose", [f32(1, 2, 3, 4, 3), f32(2, 2, 2, 3, 2), f32(2)], id="ConvTranspose-3d",
         strides=[2, 1, 2], pads=[1, 0, 0, 0, 1, 1]),
    case("ConvTranspose", [f32(1, 2, 5, 6), f32(2, 3, 3, 3)], id="ConvTranspose-SAME_UPPER",
         auto_pad="SAME_UPPER", strides=[2, 2]),
    case("Gemm", [f32(3, 4), f32(4, 5), f32(5)]),
    case("Gemm", [f32(4, 3), f32(5, 4), f32(3, 5)], id="Gemm-transposed-alpha-beta",
         transA=1, transB=1, alpha=0.5, beta=2.0),
    case("Gemm", [f32(3, 4), f32(5, 4)], id="Gemm-no-C", transB=1),
    case("Gemm", [f32(3, 4), f32(4, 5), f32(1)], opset=11, id="Gemm-11-scalar-C", beta=0.3),
    case("MatMul", [f32(3, 4), f32(4, 5)]),
    case("MatMul", [f32(2, 1, 3, 4), f32(3, 4, 5)], id="MatMul-broadcast"),
    case("MatMul", [f32(4), f32(2, 4, 5)], id="MatMul-1d"),
    case("Einsum", [f32(2, 3, 4), f32(2, 4, 5)], equation="bij,bjk->bik"),
    case("Einsum", [f32(2, 3, 4), f32(4, 5)], id="Einsum-ellipsis", equation="...ij, jk -> ...ik"),
    case("Einsum", [f32(3, 4)], id="Einsum-implicit", equation="ij"),
]

POOLING = [
    case("GlobalAveragePool", [f32(2, 3, 4, 5)]),
    case("GlobalAveragePool", [f32(2, 3, 7)], id="GlobalAveragePool-1d"),
    case("GlobalMaxPool", [f32(2, 3, 4, 5)]),
    case("AveragePool", [f32(1, 2, 7, 8)], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
    case("AveragePool", [f32(1, 2, 7, 8)], id="AveragePool-count-include-pad",
         kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1),
    case("AveragePool", [f32(1, 2, 8, 8)], id="AveragePool-ceil", kernel_shape=[3, 2], strides=[2, 3], ceil_mode=1),
    case("AveragePool", [f32(1, 2, 8, 8)], id="AveragePool-ceil-pads-include", kernel_shape=[3, 3], strides=[2, 2],
         pads=[1, 0, 1, 2], ceil_mode=1, count_include_pad=1),
    case("AveragePool", [f32(1, 2, 8, 9)], id="AveragePool-asymmetric-pads", kernel_shape=[2, 3], pads=[0, 1, 1, 2]),
    case("AveragePool", [f32(2, 3, 10)], id="AveragePool-1d", kernel_shape=[4], strides=[3], pads=[2, 1]),
    case("AveragePool", [f32(1, 2, 5, 6, 4)], id="AveragePool-3d", kernel_shape=[2, 3, 2], pads=[1, 1, 0, 0, 1, 1]),
    case("AveragePool", [f32(1, 2, 7, 8)], id="AveragePool-SAME_UPPER", kernel_shape=[3, 2], strides=[2, 2],
         auto_pad="SAME_UPPER"),
    case("MaxPool", [f32(1, 2, 7, 8)], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
    case("MaxPool", [f32(1, 2, 9, 8)], id="MaxPool-dilations-ceil", kernel_shape=[2, 3], strides=[2, 2],
         dilations=[2, 1], ceil_mode=1),
    case("MaxPool", [f32(1, 2, 8, 9)], id="MaxPool-asymmetric-pads", kernel_shape=[3, 3], pads=[0, 2, 1, 0]),
    case("MaxPool", [f32(2, 3, 10)], id="MaxPool-1d", kernel_shape=[3], strides=[2], ceil_mode=1),
    case("MaxPool", [f32(1, 2, 5, 6, 4)], id="MaxPool-3d", kernel_shape=[2, 2, 2], strides=[2, 2, 2]),
    case("MaxPool", [f32(1, 2, 7, 8)], id="MaxPool-SAME_LOWER", kernel_shape=[3, 2], strides=[2, 3],
         auto_pad="SAME_LOWER"),
    # a window longer than the input by less than a stride: ONNX Runtime's floor mode truncates
    # toward zero, so one output (ch_ppocr_mobile_v2.0_cls on an 8x8 input), with count_include_pad
    # divided by the whole window; none when no window fits; a window over padding alone
    case("MaxPool", [f32(1, 3, 1, 4)], id="MaxPool-window-past-input", kernel_shape=[2, 2], strides=[2, 2]),
    case("AveragePool", [f32(1, 2, 3, 5)], id="AveragePool-window-past-input-include-pad", kernel_shape=[4, 2],
         strides=[3, 2], count_include_pad=1),
    case("AveragePool", [f32(1, 2, 2, 5)], id="AveragePool-window-past-input", kernel_shape=[3, 2], strides=[2, 2]),
    case("MaxPool", [f32(1, 2, 1, 4)], id="MaxPool-no-window", kernel_shape=[3, 3], strides=[2, 2]),
    case("MaxPool", [f32(1, 2, 1, 4)], id="MaxPool-window-over-padding-alone", kernel_shape=[2, 1], strides=[2, 1],
         dilations=[2, 1], pads=[1, 0, 0, 0]),
]

REDUCTIONS = [
    case("ReduceMean", [f32(2, 3, 4)], opset=13, id="ReduceMean-13-axes-attribute", axes=[1, -1]),
    case("ReduceMean", [f32(2, 3, 4), i64(1, -1)], opset=18, id="ReduceMean-18-axes-input", keepdims=0),
    case("ReduceMean", [f32(2, 3, 4)], opset=18, id="ReduceMean-18-all"),
    case("ReduceMean", [f32(2, 3, 4)], opset=18, id="ReduceMean-18-noop", noop_with_empty_axes=1),
    case("ReduceSum", [f32(2, 3, 4)], opset=11, id="ReduceSum-11-axes-attribute", axes=[0], keepdims=0),
    case("ReduceSum", [f32(2, 3, 4), i64(0, 2)], opset=13, id="ReduceSum-13-axes-input"),
    case("ReduceSum", [f32(2, 3, 4)], opset=13, id="ReduceSum-13-all", keepdims=0),
    case("ReduceMax", [f32(2, 3, 4)], opset=13, id="ReduceMax-13", axes=[2]),
    case("ReduceMax", [f32(2, 3, 4), i64(1)], opset=18, id="ReduceMax-18", keepdims=0),
    case("ReduceMin", [f32(2, 3, 4), i64(0, 1)], opset=18, id="ReduceMin-18"),
    case("ReduceL2", [f32(2, 3, 4)], opset=13, id="ReduceL2-13", axes=[-1]),
    case("ReduceL2", [f32(2, 3, 4), i64(1)], opset=18, id="ReduceL2-18", keepdims=0),
    case("ReduceL1", [f32(2, 3, 4), i64(1)], opset=18),
    case("ReduceSumSquare", [f32(2, 3, 4), i64(2)], opset=18),
    case("ReduceLogSumExp", [f32(2, 3, 4), i64(0, 2)], opset=18),
    case("ReduceProd", [f32(2, 3, 4), i64(0, 2)], opset=18),
    case("ArgMax", [f32(2, 3, 4)], axis=1),
    case("ArgMin", [f32(2, 3, 4)], id="ArgMin-keepdims-0", axis=-1, keepdims=0),
]

NORMALISATION = [
    case("BatchNormalization", [f32(2, 3, 4, 5), f32(3), f32(3), f32(3), f32(3, low=0.5, high=2)], opset=15),
    case("BatchNormalization", [f32(2, 3, 4), f32(3), f32(3), f32(3), f32(3, low=0.5, high=2)], opset=9,
         id="BatchNormalization-9-1d", epsilon=1e-3),
    case("InstanceNormalization", [f32(2, 3, 4, 5), f32(3), f32(3)]),
    case("InstanceNormalization", [f32(2, 3, 6), f32(3), f32(3)], id="InstanceNormalization-1d", epsilon=1e-3),
    case("LayerNormalization", [f32(2, 3, 8), f32(8), f32(8)]),
    case("LayerNormalization", [f32(2, 3, 4), f32(3, 4)], id="LayerNormalization-axis-1-no-bias", axis=1),
    case("LayerNormalization", [f32(2, 3, 4) * 3 + 1, f32(4), f32(4)], id="LayerNormalization-epsilon", epsilon=0.1),
]

SHAPES = [
    case("Reshape", [f32(2, 3, 4), i64(0, -1, 2)]),
    case("Reshape", [f32(2, 3, 4), i64(4, 0, 2)], id="Reshape-zero-copies"),
    case("Reshape", [f32(0, 3), i64(3, 0)], opset=14, id="Reshape-allowzero", allowzero=1),
    case("Transpose", [f32(2, 3, 4)]),
    case("Transpose", [f32(2, 3, 4)], id="Transpose-perm", perm=[1, 2, 0]),
    case("Flatten", [f32(2, 3, 4, 5)]),
    case("Flatten", [f32(2, 3, 4, 5)], id="Flatten-0", axis=0),
    case("Flatten", [f32(2, 3, 4, 5)], id="Flatten-negative", axis=-1),
    case("Flatten", [f32(2, 3, 4, 5)], id="Flatten-rank", axis=4),
    case("Concat", [f32(2, 3), f32(2, 1), f32(2, 2)], axis=1),
    case("Concat", [i64(1, 2), i64(3)], id="Concat-int", axis=-1),
    case("Split", [f32(2, 6)], opset=11, outputs=3, id="Split-11-equal", axis=1),
    case("Split", [f32(2, 6)], opset=11, outputs=2, id="Split-11-attribute", axis=1, split=[2, 4]),
    case("Split", [f32(6, 2), i64(1, 5)], opset=13, outputs=2, id="Split-13-input"),
    case("Split", [f32(6, 2)], opset=13, outputs=3, id="Split-13-equal"),
    case("Split", [f32(2, 7)], opset=18, outputs=3, id="Split-18-num-outputs-uneven", axis=-1, num_outputs=3),
    case("Slice", [f32(5, 6)], opset=9, id="Slice-9-attributes", starts=[1, -4], ends=[100, -1], axes=[0, 1]),
    case("Slice", [f32(5, 6)], opset=9, id="Slice-9-no-axes", starts=[1, 0], ends=[3, 4]),
    case("Slice", [f32(5, 6), i64(1, -4), i64(100, -1)], opset=13, id="Slice-13-clamped"),
    case("Slice", [f32(5, 6, 4), i64(-1, 5), i64(-100, 0), i64(0, -2), i64(-2, -1)], opset=13,
         id="Slice-13-negative-steps"),
    case("Slice", [f32(5, 6), i64(0), i64(6), i64(1), i64(2)], opset=13, id="Slice-13-step-2"),
    case("Slice", [f32(5, 6), i64(-100), i64(-100), i64(0), i64(-1)], opset=13, id="Slice-13-negative-step-clamped"),
    case("Slice", [f32(5, 6), i64(4), i64(1), i64(0)], opset=13, id="Slice-13-empty"),
    case("Slice", [f32(5, 6), i64(1), i64(3), i64(0), i64(-1)], opset=13, id="Slice-13-empty-negative-step"),
    case("Slice", [f32(5, 6), i64(-2, 4), i64(2**63 - 1, 2**31 - 1), i64(0, 1), i64(-1, -2)], opset=13,
         id="Slice-13-int-max-end-negative-step"),
    case("Squeeze", [f32(2, 1, 3, 1)], opset=11, id="Squeeze-11-attribute", axes=[-1]),
    case("Squeeze", [f32(2, 1, 3, 1), i64(1)], opset=13, id="Squeeze-13-input"),
    case("Squeeze", [f32(2, 1, 3, 1)], opset=13, id="Squeeze-13-all"),
    case("Unsqueeze", [f32(2, 3)], opset=11, id="Unsqueeze-11-attribute", axes=[0, 3]),
    case("Unsqueeze", [f32(2, 3), i64(-1, 1)], opset=13, id="Unsqueeze-13-input"),
    case("Shape", [f32(2, 3, 4)]),
    case("Shape", [f32(2, 3, 4)], opset=15, id="Shape-start-end", start=1, end=-1),
    case("Shape", [f32(2, 3, 4)], opset=15, id="Shape-negative-start", start=-2),
    case("Size", [f32(2, 3, 4)]),
    case("Gather", [f32(5, 3), i64(0, -1, 2)]),
    case("Gather", [f32(2, 5, 3), np.array([[1, -2], [4, 0]], np.int64)], id="Gather-axis-1-2d", axis=1),
    case("Gather", [f32(2, 5, 3), np.int64(-1)], id="Gather-scalar", axis=-1),
    case("Gather", [i64(2, 3, 4), np.array([2, 0], np.int32)], id="Gather-int"),
    case("GatherElements", [f32(3, 4), np.array([[0, -1], [2, 1], [3, 0]], np.int64)], axis=1),
    case("Cast", [f32(3, 4)], id="Cast-float16", to=TensorProto.FLOAT16),
    case("Cast", [f32(3, 4) * 5], id="Cast-int64-truncates", to=TensorProto.INT64),
    case("Cast", [f32(3, 4) * 5], id="Cast-int32", to=TensorProto.INT32),
    case("Cast", [np.array([0.0, -1.5, 2.0, 0.0], np.float32)], id="Cast-bool", to=TensorProto.BOOL),
    case("Cast", [i64(1, -2, 3)], id="Cast-int-to-float", to=TensorProto.FLOAT),
    case("Cast", [np.array([True, False])], id="Cast-bool-to-float", to=TensorProto.FLOAT),
    case("Cast", [f16(3, 4)], id="Cast-float16-to-float", to=TensorProto.FLOAT),
    case("CastLike", [f32(3, 4), np.zeros(1, np.float16)], opset=15),
    case("Identity", [f32(3, 4)]),
    case("Dropout", [f32(3, 4)], opset=7, id="Dropout-7", ratio=0.3),
    case("Dropout", [f32(3, 4)], opset=13),
    case("Expand", [f32(3, 1), i64(2, 3, 4)]),
    case("Expand", [f32(2, 3, 1), i64(4)], id="Expand-bidirectional"),
    case("Tile", [f32(2, 3), i64(2, 3)]),
    case("Pad", [f32(3, 4)], opset=2, id="Pad-2-constant", pads=[1, 0, 2, 1], value=1.5),
    case("Pad", [f32(3, 4)], opset=2, id="Pad-2-reflect", pads=[1, 2, 1, 0], mode="reflect"),
    case("Pad", [f32(3, 4)], opset=2, id="Pad-2-edge", pads=[1, 2, 1, 0], mode="edge"),
    case("Pad", [f32(3, 4), i64(1, 0, 2, 1), np.float32(-2)], opset=13, id="Pad-13-constant-value"),
    case("Pad", [f32(1, 2, 3, 4), i64(0, 0, 1, 3, 0, 0, 0, 0)], opset=13, id="Pad-13-default-value"),
    case("Pad", [f32(3, 4), i64(2, 3, 1, 2)], opset=13, id="Pad-13-reflect", mode="reflect"),
    case("Pad", [f32(3, 4), i64(2, 3, 1, 2)], opset=13, id="Pad-13-edge", mode="edge"),
    case("Pad", [f32(3, 4), i64(-1, 1, 1, -2)], opset=13, id="Pad-13-negative"),
    case("Pad", [i64(1, 2, 3), i64(1, 2), np.int64(7)], opset=13, id="Pad-13-int"),
    case("Pad", [f32(2, 3, 4), i64(1, 2, 0, 3), None, i64(0, -1)], opset=18, id="Pad-18-axes", mode="edge"),
    case("Pad", [f32(3, 4), i64(2, 5, 1, 2)], opset=19, id="Pad-19-wrap", mode="wrap"),
    case("Pad", [f32(3, 4), i64(4, -1, -1, 3)], opset=19, id="Pad-19-wrap-cropped", mode="wrap"),
    case("Pad", [f32(3, 5), i64(-1, 2, 1, -2)], opset=19, id="Pad-19-reflect-cropped", mode="reflect"),
    case("DepthToSpace", [f32(1, 8, 2, 3)], blocksize=2),
    case("DepthToSpace", [f32(1, 8, 2, 3)], id="DepthToSpace-CRD", blocksize=2, mode="CRD"),
    case("SpaceToDepth", [f32(1, 2, 4, 6)], blocksize=2),
    case("CumSum", [f32(3, 4), np.int64(1)]),
    case("CumSum", [f32(3, 4), np.int64(0)], id="CumSum-exclusive-reverse", exclusive=1, reverse=1),
    case("CumSum", [f32(3, 4), np.int32(-1)], id="CumSum-exclusive", exclusive=1),
    case("CumSum", [i64(1, 2, 3, 4), np.int64(0)], id="CumSum-reverse-int", reverse=1),
    case("Trilu", [f32(2, 4, 5)]),
    case("Trilu", [f32(4, 5), np.int64(1)], id="Trilu-upper-k"),
    case("Trilu", [f32(4, 5), np.int64(-1)], id="Trilu-lower-k", upper=0),
]

CONSTANTS = [
    case("Constant", [], id="Constant-value", value=tensor_attr(f32(2, 3))),
    case("Constant", [], id="Constant-value-int", value=tensor_attr(i64(4, 5))),
    case("Constant", [], id="Constant-value-float", value_float=2.5),
    case("Constant", [], id="Constant-value-floats", value_floats=[1.0, 2.5]),
    case("Constant", [], id="Constant-value-int-scalar", value_int=3),
    case("Constant", [], id="Constant-value-ints", value_ints=[3, -1]),
    case("ConstantOfShape", [i64(2, 3)]),
    case("ConstantOfShape", [i64(2, 3)], id="ConstantOfShape-int", value=tensor_attr(i64(7))),
    case("ConstantOfShape", [i64(3)], id="ConstantOfShape-float", value=tensor_attr(np.array([1.5], np.float32))),
    case("Range", [np.int64(2), np.int64(11), np.int64(3)]),
    case("Range", [np.float32(1.0), np.float32(-2.0), np.float32(-0.75)], id="Range-float"),
]

RESIZE = [
    case("Resize", [f32(1, 2, 3, 4), None, np.array([1, 1, 2, 2], np.float32)], opset=13, id="nearest-asymmetric-floor",
         mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    case("Resize", [f32(1, 2, 4, 5), None, np.array([1, 1, 1.5, 1.7], np.float32)], opset=13,
         id="nearest-half-pixel-round-floor"),
    case("Resize", [f32(1, 2, 4, 5), None, None, i64(1, 2, 7, 3)], opset=13, id="nearest-sizes-half-pixel-prefer-ceil",
         nearest_mode="round_prefer_ceil"),
    case("Resize", [f32(1, 2, 4, 5), None, None, i64(1, 2, 7, 9)], opset=13, id="nearest-align-corners-prefer-ceil",
         coordinate_transformation_mode="align_corners", nearest_mode="round_prefer_ceil"),
    case("Resize", [f32(1, 2, 6, 8), None, np.array([1, 1, 0.5, 0.6], np.float32)], opset=13,
         id="nearest-downsample-asymmetric-ceil", coordinate_transformation_mode="asymmetric", nearest_mode="ceil"),
    case("Resize", [f32(1, 2, 3, 4), np.zeros(0, np.float32), np.array([1, 1, 2, 3], np.float32)], opset=11,
         id="nearest-11", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    case("Resize", [f32(1, 2, 4, 5), None, np.array([1, 1, 2, 2], np.float32)], opset=13, id="linear-half-pixel",
         mode="linear"),
    case("Resize", [f32(1, 2, 4, 5), None, np.array([1, 1, 1.5, 0.6], np.float32)], opset=13,
         id="linear-half-pixel-mixed", mode="linear"),
    case("Resize", [f32(1, 2, 4, 5), None, None, i64(1, 2, 7, 9)], opset=13, id="linear-align-corners",
         mode="linear", coordinate_transformation_mode="align_corners"),
    case("Resize", [f32(1, 2, 4, 5), None, np.array([1, 1, 2, 1.5], np.float32)], opset=13, id="linear-asymmetric",
         mode="linear", coordinate_transformation_mode="asymmetric"),
    case("Resize", [f32(1, 2, 6, 5), None, None, i64(1, 2, 1, 3)], opset=13, id="linear-pytorch-half-pixel",
         mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
    case("Resize", [f32(3, 4), None, np.array([2, 1.5], np.float32)], opset=13, id="linear-2d-tensor", mode="linear"),
    case("Resize", [f32(1, 2, 2, 3), None, np.array([1, 1, 1.25, 1.25], np.float32)], opset=13,
         id="linear-same-shape-is-identity", mode="linear"),
    case("Resize", [f32(1, 2, 2, 3), None, np.array([1, 1, 1.25, 2], np.float32)], opset=13,
         id="linear-one-axis-same-length", mode="linear"),
    case("Resize", [f32(1, 2, 3, 4), None, None, i64(6, 5)], opset=18, id="nearest-18-axes", axes=[2, 3]),
    case("Resize", [f32(1, 2, 3, 4), np.array([1, 1, 2, 2.5], np.float32)], opset=10, id="nearest-10"),
    case("Resize", [f32(1, 2, 3, 4), np.array([1, 1, 2, 2], np.float32)], opset=10, id="linear-10", mode="linear"),
    case("Upsample", [f32(1, 2, 3, 4), np.array([1, 1, 2, 3], np.float32)], opset=9, id="Upsample-9-nearest"),
    case("Upsample", [f32(1, 2, 3, 4), np.array([1, 1, 2, 2], np.float32)], opset=9, id="Upsample-9-linear",
         mode="linear"),
    case("Upsample", [f32(1, 2, 3, 4)], opset=7, id="Upsample-7-attribute", scales=[1.0, 1.0, 2.0, 2.0]),
]

FLOAT16 = [
    case("Add", [f16(2, 3, 4), f16(4)], id="fp16-Add"),
    case("Mul", [f16(2, 3, 4), f16(4)], id="fp16-Mul"),
    case("Relu", [f16(2, 3, 4)], id="fp16-Relu"),
    case("Sigmoid", [f16(2, 3, 4)], id="fp16-Sigmoid"),
    case("Softmax", [f16(2, 3, 4)], opset=13, id="fp16-Softmax"),
    case("MatMul", [f16(2, 3, 4), f16(4, 5)], id="fp16-MatMul"),
    case("Conv", [f16(1, 4, 6, 6), f16(4, 2, 3, 3), f16(4)], id="fp16-Conv", group=2, pads=[1, 1, 1, 1]),
    case("LayerNormalization", [f16(2, 3, 8), f16(8), f16(8)], id="fp16-LayerNormalization"),
    case("ReduceMean", [f16(2, 3, 4), i64(1)], opset=18, id="fp16-ReduceMean"),
    case("Resize", [f16(1, 2, 4, 5), None, np.array([1, 1, 2, 2], np.float32)], opset=13, id="fp16-Resize-linear",
         mode="linear"),
]


@pytest.mark.parametrize("op, inputs, attrs, opset, outputs, tol",
                         ELEMENTWISE + LINEAR + POOLING + REDUCTIONS + NORMALISATION + SHAPES + CONSTANTS + RESIZE
                         + FLOAT16)
def test_matches_onnxruntime(op, inputs, attrs, opset, outputs, tol):
    compare(op, inputs, attrs, opset, outputs, tol)


def _window(draw):
    """(spatial rank, group, in and out channels, kernel, dilations, strides) of a random
    convolution."""
    spatial = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2]))
    c_in, c_out = group * draw(st.integers(1, 2)), group * draw(st.integers(1, 2))

    def per_axis(high):
        return draw(st.lists(st.integers(1, high), min_size=spatial, max_size=spatial))

    return spatial, group, c_in, c_out, per_axis(3), per_axis(2), per_axis(3)


@st.composite
def conv_windows(draw):
    spatial, group, c_in, c_out, kernel, dilations, strides = _window(draw)
    auto_pad = draw(st.sampled_from(["NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"]))
    pads = draw(st.lists(st.integers(0, 2), min_size=2 * spatial, max_size=2 * spatial))
    sizes = [(k - 1) * d + 1 + draw(st.integers(0, 4)) for k, d in zip(kernel, dilations)]
    attrs = dict(group=group, kernel_shape=kernel, dilations=dilations, strides=strides)
    if auto_pad == "NOTSET":
        attrs["pads"] = pads
    else:
        attrs["auto_pad"] = auto_pad
        if auto_pad.startswith("SAME"):  # ONNX Runtime refuses dilations with SAME padding
            attrs["dilations"] = [1] * spatial
    bias = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return spatial, c_in, c_out, kernel, sizes, attrs, bias, seed


@settings(max_examples=60, deadline=None)
@given(conv_windows())
def test_conv_windows_match_onnxruntime(window):
    spatial, c_in, c_out, kernel, sizes, attrs, bias, seed = window
    r = np.random.default_rng(seed)
    group = attrs["group"]
    inputs = [r.standard_normal((1, c_in, *sizes)).astype(np.float32),
              r.standard_normal((c_out, c_in // group, *kernel)).astype(np.float32)]
    if bias:
        inputs.append(r.standard_normal(c_out).astype(np.float32))
    compare("Conv", inputs, attrs)


@st.composite
def conv_transpose_windows(draw):
    spatial, group, c_in, c_out, kernel, dilations, strides = _window(draw)
    output_padding = [draw(st.integers(0, s - 1)) for s in strides]
    attrs = dict(group=group, kernel_shape=kernel, dilations=dilations, strides=strides, output_padding=output_padding)
    auto_pad = draw(st.sampled_from(["NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"]))
    if auto_pad == "NOTSET":
        attrs["pads"] = [draw(st.integers(0, (k - 1) * d)) for k, d in zip(kernel * 2, dilations * 2)]
    else:
        attrs["auto_pad"] = auto_pad
    sizes = draw(st.lists(st.integers(1, 4), min_size=spatial, max_size=spatial))
    pads = attrs.get("pads", [0] * 2 * spatial)
    full = [(n - 1) * s + (k - 1) * d + 1 + o
            for n, s, k, d, o in zip(sizes, strides, kernel, dilations, output_padding)]
    assume(all(f > b + e for f, b, e in zip(full, pads[:spatial], pads[spatial:])))
    return c_in, c_out, kernel, sizes, attrs, draw(st.booleans()), draw(st.integers(0, 2**16))


@st.composite
def pool_windows(draw):
    op = draw(st.sampled_from(["AveragePool", "MaxPool"]))
    spatial = draw(st.integers(1, 3))
    kernel = draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial))
    strides = draw(st.lists(st.integers(1, 3), min_size=spatial, max_size=spatial))
    dilations = (draw(st.lists(st.integers(1, 2), min_size=spatial, max_size=spatial)) if op == "MaxPool"
                 else [1] * spatial)
    attrs = dict(kernel_shape=kernel, strides=strides, ceil_mode=int(draw(st.booleans())))
    if op == "MaxPool":
        attrs["dilations"] = dilations
    else:
        attrs["count_include_pad"] = int(draw(st.booleans()))
    auto_pad = draw(st.sampled_from(["NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"]))
    if auto_pad == "NOTSET":
        attrs["pads"] = [draw(st.integers(0, k - 1)) for k in kernel * 2]
    else:
        attrs["auto_pad"] = auto_pad
        attrs.pop("dilations", None)
        dilations = [1] * spatial
        attrs["strides"] = [min(s, k) for s, k in zip(strides, kernel)]  # ONNX Runtime refuses negative SAME pads
    sizes = [(k - 1) * d + 1 + draw(st.integers(0, 4)) for k, d in zip(kernel, dilations)]
    return op, sizes, attrs, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(conv_transpose_windows())
def test_conv_transpose_windows_match_onnxruntime(window):
    c_in, c_out, kernel, sizes, attrs, bias, seed = window
    r = np.random.default_rng(seed)
    inputs = [r.standard_normal((1, c_in, *sizes)).astype(np.float32),
              r.standard_normal((c_in, c_out // attrs["group"], *kernel)).astype(np.float32)]
    if bias:
        inputs.append(r.standard_normal(c_out).astype(np.float32))
    compare("ConvTranspose", inputs, attrs)


@settings(max_examples=80, deadline=None)
@given(pool_windows())
def test_pool_windows_match_onnxruntime(window):
    op, sizes, attrs, seed = window
    compare(op, [np.random.default_rng(seed).standard_normal((1, 2, *sizes)).astype(np.float32)], attrs)


@pytest.mark.parametrize("node, opset, reason", [
    (helper.make_node("NonMaxSuppression", ["b", "s"], ["i"]), 17, "NonMaxSuppression is not interpreted"),
    (helper.make_node("FusedConv", ["x", "w"], ["y"], domain="com.microsoft"), 17, "FusedConv of domain com.microsoft"),
    (helper.make_node("Resize", ["x", "", "s"], ["y"], mode="cubic"), 13, "Resize mode 'cubic'"),
    (helper.make_node("Resize", ["x", "", "s"], ["y"], coordinate_transformation_mode="tf_crop_and_resize"), 13,
     "tf_crop_and_resize"),
    (helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2]), 17, "MaxPool output Indices"),
    (helper.make_node("Dropout", ["x"], ["y", "mask"]), 13, "Dropout output mask"),
    (helper.make_node("LayerNormalization", ["x", "s"], ["y", "mean"]), 17, "LayerNormalization output Mean"),
    (helper.make_node("BatchNormalization", list("xsbmv"), ["y"], training_mode=1), 15, "training_mode"),
    (helper.make_node("ConvTranspose", ["x", "w"], ["y"], output_shape=[8, 8]), 17, "output_shape"),
    (helper.make_node("Conv", ["x", "w"], ["y"], unknown=1), 17, "Conv attribute unknown"),
    (helper.make_node("Squeeze", ["x"], ["y"], axes=[0]), 13, "Squeeze attribute axes"),
    (helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2], dilations=[2]), 19, "AveragePool dilations"),
    (helper.make_node("Cast", ["x"], ["y"], to=TensorProto.STRING), 17, "Cast to STRING"),
    (helper.make_node("Gelu", ["x"], ["y"], approximate="erf"), 20, "Gelu approximate 'erf'"),
])
def test_refused_at_build_time(node, opset, reason):
    with pytest.raises(Unsupported, match=reason):
        node_function(node, opset)


def test_outputs_follow_the_node_outputs():
    run = node_function(helper.make_node("Dropout", ["x", "", ""], ["y", ""]), 13)
    x = torch.randn(2, 3)
    y, mask = run([x, None, None])
    assert y is x and mask is None


def test_gradients_reach_the_conv_weight():
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2])
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    (y,) = node_function(node, 17)([torch.randn(1, 3, 8, 8), w, b])
    y.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    assert b.grad is not None


def test_gradients_flow_through_a_chain():
    """Resize (linear), Pad (reflect), Slice with a negative step, MaxPool and Gather are
    index-based here: autograd still reaches the input."""
    x = torch.randn(1, 2, 4, 4, requires_grad=True)
    chain = [
        (helper.make_node("Resize", ["x", "", "s"], ["y"], mode="linear"), [None, torch.tensor([1, 1, 2, 2.0])]),
        (helper.make_node("Pad", ["x", "p"], ["y"], mode="reflect"), [torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])]),
        (helper.make_node("Slice", ["x", "s", "e", "a", "t"], ["y"]),
         [torch.tensor([-1]), torch.tensor([-100]), torch.tensor([3]), torch.tensor([-1])]),
        (helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], pads=[1, 1, 0, 0]), []),
        (helper.make_node("Gather", ["x", "i"], ["y"], axis=1), [torch.tensor([1, 0])]),
    ]
    y = x
    for node, extra in chain:
        (y,) = node_function(node, 17)([y, *extra])
    y.square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
