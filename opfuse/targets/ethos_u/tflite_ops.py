"""The ONNX ops the Ethos-U lowering writes as TFLite: one function per op (its table is `lower.LOWERINGS`).

Each function reads one ONNX node through the :class:`~opfuse.targets.ethos_u.tflite_graph.Lowering`
state and writes its TFLite op(s). Conventions (the module docstring of ``lower`` gives the layout):

- Conv: weights OIHW -> OHWI (CONV_2D, int8 per-channel ``quantized_dimension`` 0); a
  depthwise conv (group == C_in, C_out = C_in x M, one input channel per group) -> DEPTHWISE_CONV_2D
  with weights 1HW(C*M) (``quantized_dimension`` 3) and ``depth_multiplier`` M; any other group
  count is refused. Pads equal to TFLite's SAME (or zero: VALID) are written as that padding,
  any other pads as an explicit PAD before a VALID conv (int8: padded with the zero point, real 0).
- Gemm / MatMul with a constant weight -> FULLY_CONNECTED with weights [N, K].
- Pools: MaxPool pads are written as PAD/PADV2 with the lowest value; AveragePool's pads as
  SAME (count_include_pad=0, SAME pads), or PAD then VALID (count_include_pad=1).
- BatchNormalization (left unfolded) -> MUL and ADD by [C] constants.
- ConvTranspose -> TRANSPOSE_CONV (weights [C_out, kH, kW, C_in]); HardSigmoid -> a 1x1
  DEPTHWISE_CONV_2D (alpha, beta) and its clamp.
- int8 ops whose TFLite kernel fixes its output quantisation (SOFTMAX, LOGISTIC: 1/256, -128;
  TANH: 1/128, 0) or needs it equal to the input's (pools, RESHAPE) write that quantisation
  and a QUANTIZE (int8 -> int8 rescale) to the QDQ model's own, when they differ (:func:`emit`).

The layout ops (Reshape, Transpose, Concat, Pad, Split, Slice, Resize) are in
:mod:`opfuse.targets.ethos_u.tflite_layout`; the table of both is ``lower.LOWERINGS``.
"""

from __future__ import annotations

__all__ = ["FIXED_OUTPUT", "emit", "requantised", "make_options", "conv", "fully_connected", "binary", "activation",
           "unary", "identity", "pool", "reduce_mean", "softmax", "transpose_conv", "hard_sigmoid", "batch_norm"]

import math

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from opfuse.core.ops import ONNX_DOMAINS, proto_attr
from opfuse.targets.ethos_u.tflite_graph import NCHW_TO_NHWC, Lowering, Value
from opfuse.targets.ethos_u.tflite_writer import Quant

OP = schema.BuiltinOperator
OPT = schema.BuiltinOptions
ACT = schema.ActivationFunctionType
PAD = schema.Padding
# ONNX op -> (scale, zero point) of its TFLite int8 kernel's output, which the kernel fixes
FIXED_OUTPUT: dict[str, tuple[float, int]] = {"Sigmoid": (1 / 256, -128), "Softmax": (1 / 256, -128),
                                              "Tanh": (1 / 128, 0)}


def make_options(cls, **fields):
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def _same_quant(a: Quant | None, b: Quant | None) -> bool:
    if a is None or b is None:
        return a is b
    return bool(np.allclose(a.scale, b.scale, rtol=1e-6) and np.array_equal(a.zero_point, b.zero_point))


def emit(L: Lowering, builtin: int, inputs: list[int], out: Value, options=None, options_type=0,
         quant: Quant | None = None) -> None:
    """Write ``builtin`` into ``out``; when the kernel needs quantisation ``quant`` and ``out``
    has another, through a temporary with ``quant`` and a QUANTIZE (rescale) to ``out``."""
    if quant is None or not L.g.quantised or _same_quant(quant, out.quant):
        L.w.op(builtin, inputs, [out.index], options, options_type)
        return
    tmp = L.temp(out, f"{L.w._tensors[out.index].name}/requant", quant=quant)
    L.w.op(builtin, inputs, [tmp.index], options, options_type)
    L.w.op(OP.QUANTIZE, [tmp.index], [out.index])


def requantised(L: Lowering, x: Value, quant: Quant | None, name: str) -> Value:
    """``x`` in quantisation ``quant`` (itself when it already is)."""
    if quant is None or _same_quant(x.quant, quant):
        return x
    tmp = L.temp(x, f"{name}/requant", quant=quant)
    L.w.op(OP.QUANTIZE, [x.index], [tmp.index])
    return tmp


def _fixed(scale: float, zero_point: int) -> Quant:
    return Quant(np.array([scale]), np.array([zero_point]), 0)


# --- padding ---------------------------------------------------------------------------------
def _spatial_padding(node, in_hw, out_hw, kernel, strides, dilations,
                     allow_same: bool = True) -> tuple[int, list[tuple[int, int]]]:
    """TFLite padding for ONNX pads: (SAME or VALID, explicit (before, after) per spatial dim
    to write as a PAD first; all zero when the padding alone is exact). ``allow_same=False``:
    SAME is not exact (an average that counts the padding)."""
    auto_pad = proto_attr(node, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    n = len(in_hw)
    pads = list(proto_attr(node, "pads", [0] * (2 * n)))
    begins = pads[:n]  # the end pads are what the windows read (``after`` below)
    explicit = []
    same = valid = True
    for i in range(n):
        k_eff = (kernel[i] - 1) * dilations[i] + 1
        total = (out_hw[i] - 1) * strides[i] + k_eff - in_hw[i]
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            b = max(total, 0) // 2 if auto_pad == "SAME_UPPER" else (max(total, 0) + 1) // 2
        elif auto_pad == "VALID":
            b = 0
        else:
            b = begins[i]
        after = max(total - b, 0)  # the padding at the end the windows actually read
        explicit.append((b, after))
        same &= out_hw[i] == math.ceil(in_hw[i] / strides[i]) and total >= 0 and b == total // 2
        valid &= b == 0 and out_hw[i] == (in_hw[i] - k_eff) // strides[i] + 1
    if valid:
        return PAD.VALID, [(0, 0)] * n
    if same and allow_same:
        return PAD.SAME, [(0, 0)] * n
    return PAD.VALID, explicit


def _explicit_pad(L: Lowering, x: Value, spatial: list[tuple[int, int]], fill: str) -> Value:
    """``x`` (NHWC) padded on H and W; ``fill`` is "zero" (real 0) or "lowest"."""
    if not any(b or a for b, a in spatial):
        return x
    n, c, h, w = x.shape
    shape = (n, c, h + sum(spatial[0]), w + sum(spatial[1]))
    out = L.temp(x, f"{L.w._tensors[x.index].name}/pad", shape=shape)
    paddings = L.int_tensor(f"{L.node.name}/paddings", [[0, 0], list(spatial[0]), list(spatial[1]), [0, 0]])
    if fill == "zero" or (L.g.quantised and int(x.quant.zero_point[0]) == -128):
        L.w.op(OP.PAD, [x.index, paddings], [out.index], make_options(schema.PadOptionsT), OPT.PadOptions)
    else:
        low = np.array([-128], np.int8) if L.g.quantised else np.array([np.finfo(np.float32).min], np.float32)
        value = L.w.tensor(f"{L.node.name}/pad_value", [1], low.dtype, data=low, quant=x.quant)
        L.w.op(OP.PADV2, [x.index, paddings, value], [out.index], make_options(schema.PadV2OptionsT), OPT.PadV2Options)
    return out


def _spatial_attrs(L: Lowering, node, x: Value, kernel):
    n = len(kernel)
    strides = list(proto_attr(node, "strides", [1] * n))
    dilations = list(proto_attr(node, "dilations", [1] * n))
    out_hw = L.shape(node.output[0])[2:]
    return strides, dilations, out_hw


# --- convolution and fully connected ---------------------------------------------------------
def _weights(L: Lowering, name: str, real: np.ndarray, axis: int):
    """int8 weights (the QDQ model's integers, else quantised symmetric per channel) or float."""
    if not L.g.quantised:
        return real.astype(np.float32), None
    if name in L.g.quantised_constants:
        data, q = L.g.quantised_constants[name]
        if np.any(q.zero_point != 0):
            raise L.refuse(f"weight '{name}' has a non-zero zero point (TFLite int8 weights are symmetric)")
        if data.dtype != np.int8:
            raise L.refuse(f"weight '{name}' is {data.dtype}, not int8")
        if q.per_channel and q.axis != axis:
            raise L.refuse(f"weight '{name}' is quantised along axis {q.axis}, not the output channels ({axis})")
        return data, q
    peak = np.max(np.abs(np.moveaxis(real, axis, 0).reshape(real.shape[axis], -1)), axis=1)
    scale = np.where(peak > 0, peak / 127.0, 1.0)
    shape = [1] * real.ndim
    shape[axis] = -1
    data = np.clip(np.round(real / scale.reshape(shape)), -127, 127).astype(np.int8)
    return data, Quant(scale, np.zeros(scale.size, np.int64), axis)


def _bias(L: Lowering, name: str | None, n: int, x: Value, wq: Quant | None, scale: float = 1.0):
    real = L.constant(name).reshape(-1).astype(np.float64) * scale if name else np.zeros(n)
    if real.size != n:
        raise L.refuse(f"bias '{name}' has {real.size} values for {n} output channels")
    if not L.g.quantised:
        return L.w.tensor(f"{L.node.name}/bias", [n], np.float32, data=real.astype(np.float32))
    if name and name in L.g.quantised_constants and L.g.quantised_constants[name][0].dtype == np.int32:
        data, q = L.g.quantised_constants[name]
        data = data.reshape(-1)
    else:
        bias_scale = float(x.quant.scale[0]) * np.broadcast_to(wq.scale, (n,))
        data = np.round(real / bias_scale).astype(np.int32)
        q = Quant(bias_scale, np.zeros(n, np.int64), 0)
    q = Quant(np.broadcast_to(q.scale, (n,)) if q.scale.size > 1 else q.scale, np.zeros(q.scale.size, np.int64), 0)
    return L.w.tensor(f"{L.node.name}/bias", [n], np.int32, data=data.astype(np.int32), quant=q)


def conv(L: Lowering, node) -> None:
    x = L.value(node.input[0])
    if len(x.shape) != 4:
        raise L.refuse(f"a {len(x.shape) - 2}-D convolution (only 2-D convolutions are lowered)")
    w = L.constant(node.input[1])
    c_out, c_per_group, kh, kw = w.shape
    c_in = x.shape[1]
    group = int(proto_attr(node, "group", 1))
    depthwise = group > 1 and group == c_in and c_per_group == 1 and c_out % c_in == 0
    if group != 1 and not depthwise:
        raise L.refuse(f"groups={group} is neither a plain nor a depthwise convolution "
                       f"(C_in={c_in}, C_out={c_out}); split it into {group} convolutions first")
    strides, dilations, out_hw = _spatial_attrs(L, node, x, (kh, kw))
    padding, explicit = _spatial_padding(node, x.shape[2:], out_hw, (kh, kw), strides, dilations)
    x = _explicit_pad(L, x, explicit, "zero")
    builtin = OP.DEPTHWISE_CONV_2D if depthwise else OP.CONV_2D
    if depthwise:
        data, wq = _weights(L, node.input[1], w, 0)
        data = data.reshape(c_out, kh, kw).transpose(1, 2, 0)[None]
        wq = wq and Quant(wq.scale, wq.zero_point, 3)
    else:
        data, wq = _weights(L, node.input[1], w, 0)
        data = data.transpose(0, 2, 3, 1)
    weight = L.w.tensor(f"{node.name}/weight", data.shape, data.dtype, data=data, quant=wq)
    bias = _bias(L, node.input[2] if len(node.input) > 2 and node.input[2] else None, c_out, x, wq)
    act, out_name = L.fused_activation(builtin, node.output[0])
    out = L.new_value(out_name)
    common = dict(padding=padding, strideH=strides[0], strideW=strides[1], dilationHFactor=dilations[0],
                  dilationWFactor=dilations[1], fusedActivationFunction=act)
    if depthwise:
        options = make_options(schema.DepthwiseConv2DOptionsT, depthMultiplier=c_out // c_in, **common)
        L.w.op(builtin, [x.index, weight, bias], [out.index], options, OPT.DepthwiseConv2DOptions)
    else:
        L.w.op(builtin, [x.index, weight, bias], [out.index], make_options(schema.Conv2DOptionsT, **common),
               OPT.Conv2DOptions)


def fully_connected(L: Lowering, node) -> None:
    x = L.value(node.input[0])
    if x.layout != tuple(range(len(x.shape))):
        raise L.refuse("a MatMul of NHWC (rank-4) activations; only a 2-D or 3-D input is lowered")
    b = L.constant(node.input[1])
    alpha, beta = 1.0, 1.0
    if node.op_type == "Gemm":
        if proto_attr(node, "transA", 0):
            raise L.refuse("transA=1 (FULLY_CONNECTED reads its input untransposed)")
        alpha, beta = float(proto_attr(node, "alpha", 1.0)), float(proto_attr(node, "beta", 1.0))
        trans_b = bool(proto_attr(node, "transB", 0))
    else:
        trans_b = False
        if b.ndim != 2:
            raise L.refuse(f"a MatMul with a rank-{b.ndim} weight (FULLY_CONNECTED takes a 2-D one)")
    if L.g.quantised and (alpha != 1.0 or beta != 1.0):
        raise L.refuse(f"alpha={alpha}, beta={beta} in an int8 model (fold them into the weights first)")
    data, wq = _weights(L, node.input[1], b * alpha if not L.g.quantised else b, 0 if trans_b else 1)
    if not trans_b:
        data = data.T
        wq = wq and Quant(wq.scale, wq.zero_point, 0)
    data = np.ascontiguousarray(data)
    n = data.shape[0]
    weight = L.w.tensor(f"{node.name}/weight", data.shape, data.dtype, data=data, quant=wq)
    bias_name = node.input[2] if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2] else None
    bias = _bias(L, bias_name, n, x, wq, beta)
    act, out_name = L.fused_activation(OP.FULLY_CONNECTED, node.output[0])
    out = L.new_value(out_name)
    options = make_options(schema.FullyConnectedOptionsT, fusedActivationFunction=act, keepNumDims=len(x.shape) > 2)
    L.w.op(OP.FULLY_CONNECTED, [x.index, weight, bias], [out.index], options, OPT.FullyConnectedOptions)


# --- element-wise ----------------------------------------------------------------------------
_BINARY = {
    "Add": (OP.ADD, schema.AddOptionsT, OPT.AddOptions),
    "Sub": (OP.SUB, schema.SubOptionsT, OPT.SubOptions),
    "Mul": (OP.MUL, schema.MulOptionsT, OPT.MulOptions),
    "Div": (OP.MUL, schema.MulOptionsT, OPT.MulOptions),  # by a constant: MUL by its reciprocal
}


def binary(L: Lowering, node) -> None:
    builtin, options_cls, options_type = _BINARY[node.op_type]
    out_shape = L.shape(node.output[0])
    rank = len(out_shape)
    layout = NCHW_TO_NHWC if rank == 4 else tuple(range(rank))
    operands = []
    for i, name in enumerate(node.input[:2]):
        if L.is_constant(name):
            real = L.constant(name)
            if node.op_type == "Div" and i == 1:
                if np.any(real == 0):
                    raise L.refuse(f"division by a constant '{name}' with zeros")
                operands.append(L.const_operand(name, rank, layout, real=1.0 / real.astype(np.float64)))
            else:
                operands.append(L.const_operand(name, rank, layout))
            continue
        if node.op_type == "Div" and i == 1:
            raise L.refuse("a division by a computed tensor (only a division by a constant is lowered, as MUL)")
        v = L.value(name)
        if len(v.shape) != rank:
            raise L.refuse(f"input '{name}' of rank {len(v.shape)} broadcast to rank {rank} "
                           "(only constants are broadcast across ranks)")
        operands.append(v)
    act, out_name = L.fused_activation(builtin, node.output[0])
    out = L.new_value(out_name)
    L.w.op(builtin, [v.index for v in operands], [out.index],
           make_options(options_cls, fusedActivationFunction=act), options_type)


def activation(L: Lowering, node) -> None:
    code = L.activation_of(node)
    if code is None:
        raise L.refuse("Clip bounds other than (0, 6), (-1, 1) or (0, none) have no TFLite activation op")
    x = L.value(node.input[0])
    out = L.new_value(node.output[0])
    builtin = {ACT.RELU: OP.RELU, ACT.RELU6: OP.RELU6, ACT.RELU_N1_TO_1: OP.RELU_N1_TO_1}[code]
    L.w.op(builtin, [x.index], [out.index])


def unary(L: Lowering, node) -> None:
    x = L.value(node.input[0])
    out = L.new_value(node.output[0])
    if node.op_type == "Sigmoid":
        emit(L, OP.LOGISTIC, [x.index], out, quant=_fixed(*FIXED_OUTPUT["Sigmoid"]))
    elif node.op_type == "Tanh":
        emit(L, OP.TANH, [x.index], out, quant=_fixed(*FIXED_OUTPUT["Tanh"]))
    elif node.op_type == "HardSwish":
        L.w.op(OP.HARD_SWISH, [x.index], [out.index])
    elif node.op_type == "LeakyRelu":
        alpha = float(proto_attr(node, "alpha", 0.01))
        L.w.op(OP.LEAKY_RELU, [x.index], [out.index], make_options(schema.LeakyReluOptionsT, alpha=alpha),
               OPT.LeakyReluOptions)


def identity(L: Lowering, node) -> None:
    x = L.value(node.input[0])
    out = L.new_value(node.output[0])
    shape = L.int_tensor(f"{node.name}/shape", L.w.shape(out.index))
    emit(L, OP.RESHAPE, [x.index, shape], out, make_options(schema.ReshapeOptionsT, newShape=L.w.shape(out.index)),
         OPT.ReshapeOptions, quant=x.quant)


# --- pools and reductions --------------------------------------------------------------------
def pool(L: Lowering, node) -> None:
    x = L.value(node.input[0])
    if len(x.shape) != 4:
        raise L.refuse(f"a {len(x.shape) - 2}-D pool (only 2-D pools are lowered)")
    if node.op_type == "GlobalAveragePool":
        return _mean(L, node, x, [1, 2], True)
    if node.op_type == "GlobalMaxPool":
        kernel, strides, padding, explicit = list(x.shape[2:]), [1, 1], PAD.VALID, [(0, 0)] * 2
    else:
        kernel = list(proto_attr(node, "kernel_shape"))
        strides, dilations, out_hw = _spatial_attrs(L, node, x, kernel)
        if any(d != 1 for d in dilations):
            raise L.refuse(f"dilations={dilations} (TFLite pools are not dilated)")
        include_pad = node.op_type == "AveragePool" and bool(proto_attr(node, "count_include_pad", 0))
        padding, explicit = _spatial_padding(node, x.shape[2:], out_hw, kernel, strides, dilations,
                                             allow_same=not include_pad)
    if node.op_type == "AveragePool" and any(b or a for b, a in explicit):
        if not proto_attr(node, "count_include_pad", 0):
            raise L.refuse("pads that are not TFLite's SAME with count_include_pad=0 (the padded "
                           "average would count the padding)")
        pads = list(proto_attr(node, "pads", [0, 0, 0, 0]))
        if [a for _, a in explicit] != pads[2:]:
            raise L.refuse("ceil_mode windows that read past the pads with count_include_pad=1")
        x = _explicit_pad(L, x, explicit, "zero")
    else:
        x = _explicit_pad(L, x, explicit, "lowest")
    builtin = OP.AVERAGE_POOL_2D if node.op_type == "AveragePool" else OP.MAX_POOL_2D
    out = L.new_value(node.output[0])
    options = make_options(schema.Pool2DOptionsT, padding=padding, strideH=strides[0], strideW=strides[1],
                       filterHeight=kernel[0], filterWidth=kernel[1])
    emit(L, builtin, [x.index], out, options, OPT.Pool2DOptions, quant=x.quant)


def _mean(L: Lowering, node, x: Value, tflite_axes: list[int], keep: bool) -> None:
    out = L.new_value(node.output[0])
    axes = L.int_tensor(f"{node.name}/axes", sorted(tflite_axes))
    L.w.op(OP.MEAN, [x.index, axes], [out.index], make_options(schema.ReducerOptionsT, keepDims=keep),
           OPT.ReducerOptions)


def reduce_mean(L: Lowering, node) -> None:
    x = L.value(node.input[0])
    rank = len(x.shape)
    axes = proto_attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        axes = L.constant(node.input[1]).tolist()
    if axes is None:
        axes = list(range(rank))
    axes = [(a + rank) % rank for a in axes]
    keep = bool(proto_attr(node, "keepdims", 1))
    tflite_axes = [x.layout.index(a) for a in axes]
    if not keep:
        kept = [a for a in x.layout if a not in axes]
        if kept != sorted(kept) and len(kept) == 4:
            raise L.refuse("a reduction whose remaining axes change order in NHWC")
        if len(kept) == 4 or kept != sorted(kept):
            raise L.refuse("a reduction whose remaining axes change order in NHWC")
    _mean(L, node, x, tflite_axes, keep)


def softmax(L: Lowering, node) -> None:
    x = L.value(node.input[0])
    rank = len(x.shape)
    opset = next((o.version for o in L.model.opset_import if o.domain in ONNX_DOMAINS), 13)
    axis = (int(proto_attr(node, "axis", -1 if opset >= 13 else 1)) + rank) % rank
    if opset < 13 and axis != rank - 1:
        raise L.refuse(f"opset {opset} Softmax over axis {axis}: it flattens the axes after it, TFLite's does not")
    if x.layout[-1] != axis:
        raise L.refuse(f"softmax over axis {axis}, which is not the last axis in TFLite's layout")
    out = L.new_value(node.output[0])
    emit(L, OP.SOFTMAX, [x.index], out, make_options(schema.SoftmaxOptionsT, beta=1.0), OPT.SoftmaxOptions,
         quant=_fixed(*FIXED_OUTPUT["Softmax"]))


def hard_sigmoid(L: Lowering, node) -> None:
    """HardSigmoid ``clip(alpha * x + beta, 0, 1)`` as a 1x1 DEPTHWISE_CONV_2D (weight alpha, bias
    beta) and the clamp: int8, the clamp is the output's own saturation when its range lies in
    [0, 1] (as calibration gives it), else a MAXIMUM/MINIMUM pair; float, MAXIMUM then MINIMUM."""
    x = L.value(node.input[0])
    if len(x.shape) != 4:
        raise L.refuse(f"HardSigmoid of a rank-{len(x.shape)} tensor (lowered for rank 4, as a depthwise conv)")
    alpha, beta = float(proto_attr(node, "alpha", 0.2)), float(proto_attr(node, "beta", 0.5))
    c = x.shape[1]
    w = np.full((c, 1, 1, 1), alpha, np.float32)
    data, wq = _weights_of(L, w)
    weight = L.w.tensor(f"{node.name}/alpha", [1, 1, 1, c], data.dtype, data=data.reshape(1, 1, 1, c),
                        quant=wq and Quant(wq.scale, wq.zero_point, 3))
    out = L.new_value(node.output[0])
    clamp = True
    if L.g.quantised:
        s, z = out.quant.scalar()
        clamp = s * (-128 - z) < -s / 2 or s * (127 - z) > 1 + s / 2
    target = L.temp(out, f"{L.w._tensors[out.index].name}/affine") if clamp else out
    bias_name = f"{node.name}/beta"
    L.g.constants[bias_name] = np.full(c, beta, np.float32)
    bias = _bias(L, bias_name, c, x, wq)
    conv_options = make_options(schema.DepthwiseConv2DOptionsT, padding=PAD.VALID, strideH=1, strideW=1,
                           depthMultiplier=1)
    L.w.op(OP.DEPTHWISE_CONV_2D, [x.index, weight, bias], [target.index], conv_options, OPT.DepthwiseConv2DOptions)
    if clamp:
        low = L.temp(out, f"{L.w._tensors[out.index].name}/max0")
        zero, one = (L.const_operand(name, 4, NCHW_TO_NHWC, real=np.array(v, np.float32))
                     for name, v in ((f"{node.name}/zero", 0.0), (f"{node.name}/one", 1.0)))
        L.w.op(OP.MAXIMUM, [target.index, zero.index], [low.index])
        L.w.op(OP.MINIMUM, [low.index, one.index], [out.index])


def _weights_of(L: Lowering, real: np.ndarray):
    """A computed weight (no QDQ integers): int8 symmetric per output channel, or float."""
    if not L.g.quantised:
        return real, None
    peak = np.abs(real).reshape(real.shape[0], -1).max(axis=1)
    scale = np.where(peak > 0, peak / 127.0, 1.0)
    data = np.clip(np.round(real / scale.reshape(-1, *([1] * (real.ndim - 1)))), -127, 127).astype(np.int8)
    return data, Quant(scale, np.zeros(scale.size, np.int64), 0)


def transpose_conv(L: Lowering, node) -> None:
    """ConvTranspose -> TRANSPOSE_CONV: weights [C_in, C_out, kH, kW] -> [C_out, kH, kW, C_in];
    pads equal to TFLite's SAME or VALID offset (the output size given), others refused."""
    x = L.value(node.input[0])
    if len(x.shape) != 4:
        raise L.refuse("a ConvTranspose that is not 2-D")
    if int(proto_attr(node, "group", 1)) != 1:
        raise L.refuse(f"group={proto_attr(node, 'group')} (TRANSPOSE_CONV is not grouped)")
    w = L.constant(node.input[1])
    c_in, c_out, kh, kw = w.shape
    strides = list(proto_attr(node, "strides", [1, 1]))
    if any(d != 1 for d in proto_attr(node, "dilations", [1, 1])):
        raise L.refuse("dilated ConvTranspose (TRANSPOSE_CONV is not dilated)")
    out_shape = L.shape(node.output[0])
    padding = None
    for mode in (PAD.VALID, PAD.SAME):
        ok = True
        for i, k in enumerate((kh, kw)):
            total = (x.shape[2 + i] - 1) * strides[i] + k - out_shape[2 + i]
            pads = list(proto_attr(node, "pads", [0, 0, 0, 0]))
            begin = pads[i] if proto_attr(node, "auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET") else None
            if mode == PAD.VALID:  # TFLite: the output is (in - 1) * stride + kernel, nothing cropped
                ok &= begin == 0 and total == 0
            else:  # TFLite: in = ceil(out / stride), cropped total // 2 at the start
                ok &= begin == total // 2 and total >= 0 and -(-out_shape[2 + i] // strides[i]) == x.shape[2 + i]
        if ok:
            padding = mode
            break
    if padding is None:
        raise L.refuse("pads that are neither TFLite's SAME nor VALID for TRANSPOSE_CONV")
    data, wq = _weights(L, node.input[1], w, 1)
    data = np.ascontiguousarray(data.transpose(1, 2, 3, 0))
    wq = wq and Quant(wq.scale, wq.zero_point, 0)
    weight = L.w.tensor(f"{node.name}/weight", data.shape, data.dtype, data=data, quant=wq)
    bias = _bias(L, node.input[2] if len(node.input) > 2 and node.input[2] else None, c_out, x, wq)
    out = L.new_value(node.output[0])
    size = L.int_tensor(f"{node.name}/output_shape", [out_shape[0], out_shape[2], out_shape[3], out_shape[1]])
    L.w.op(OP.TRANSPOSE_CONV, [size, weight, x.index, bias], [out.index],
           make_options(schema.TransposeConvOptionsT, padding=padding, strideH=strides[0], strideW=strides[1]),
           OPT.TransposeConvOptions)


def batch_norm(L: Lowering, node) -> None:
    """BatchNormalization (inference) unfolded: MUL by ``s = gamma / sqrt(var + eps)`` then ADD
    ``t = beta - mean * s``, both [C] constants (the ADD takes a following activation). int8: the
    product's quantisation covers the output's range less ``t`` (every value the ADD can still
    write), 256 steps."""
    x = L.value(node.input[0])
    if len(x.shape) != 4:
        raise L.refuse(f"BatchNormalization of a rank-{len(x.shape)} tensor (lowered for rank 4)")
    gamma, beta, mean, var = (L.constant(n).astype(np.float64) for n in node.input[1:5])
    s = gamma / np.sqrt(var + float(proto_attr(node, "epsilon", 1e-5)))
    t = beta - mean * s
    act, out_name = L.fused_activation(OP.ADD, node.output[0])
    out = L.new_value(out_name)
    mid_quant = None
    if L.g.quantised:
        scale, zp = out.quant.scalar()
        lo, hi = scale * (-128 - zp) - float(t.max()), scale * (127 - zp) - float(t.min())
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        step = (hi - lo) / 255.0 or 1.0
        mid_quant = Quant(np.array([step]), np.array([int(np.clip(np.round(-128 - lo / step), -128, 127))]), 0)
    mid = L.temp(out, f"{node.name}/scaled", quant=mid_quant)
    cs = L.const_operand(f"{node.name}/scale", 4, NCHW_TO_NHWC, real=s.reshape(1, -1, 1, 1))
    ct = L.const_operand(f"{node.name}/shift", 4, NCHW_TO_NHWC, real=t.reshape(1, -1, 1, 1))
    L.w.op(OP.MUL, [x.index, cs.index], [mid.index], make_options(schema.MulOptionsT), OPT.MulOptions)
    L.w.op(OP.ADD, [mid.index, ct.index], [out.index], make_options(schema.AddOptionsT, fusedActivationFunction=act),
           OPT.AddOptions)
