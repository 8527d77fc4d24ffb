"""The layout ops of the Ethos-U lowering: where ONNX's NCHW order meets TFLite's NHWC.

One function per ONNX op (the table is :data:`opfuse.targets.ethos_u.lower.LOWERINGS`):

- Reshape, Flatten, Squeeze, Unsqueeze: RESHAPE in ONNX's data order. NHWC data is first
  transposed back to NCHW (TRANSPOSE [0, 3, 1, 2]) unless only dims of size 1 move (then the
  bytes are already in ONNX's order); a rank-4 result is reshaped in NCHW and transposed to NHWC.
- Transpose: the ONNX permutation composed with both tensors' layouts (an identity: RESHAPE).
- Concat, Split, Slice, Pad: their axes remapped to the TFLite layout; Concat's int8 inputs are
  rescaled to the output's quantisation (TFLite's int8 kernel does not rescale).
- Resize: nearest or bilinear, with ``coordinate_transformation_mode`` mapped onto TFLite's
  ``align_corners`` / ``half_pixel_centers`` where the two agree (refused elsewhere).
"""

from __future__ import annotations

__all__ = ["reshape", "transpose", "concat", "pad", "resize", "split", "slice_"]

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from opfuse.core.ops import proto_attr
from opfuse.targets.ethos_u.tflite_graph import NCHW_TO_NHWC, Lowering, Value
from opfuse.targets.ethos_u.tflite_ops import emit, make_options, requantised

OP = schema.BuiltinOperator
OPT = schema.BuiltinOptions


def _order_kept(shape, layout) -> bool:
    """Whether the TFLite data order of a tensor stored in ``layout`` is the ONNX order."""
    moved = [a for a in layout if shape[a] != 1]
    return moved == sorted(moved)


def _transpose(L: Lowering, x: Value, perm: list[int], out: Value) -> None:
    p = L.int_tensor(f"{L.w._tensors[out.index].name}/perm", perm)
    emit(L, OP.TRANSPOSE, [x.index, p], out, make_options(schema.TransposeOptionsT), OPT.TransposeOptions,
         quant=x.quant)


def _reshape(L: Lowering, x: Value, out: Value) -> None:
    new_shape = L.w.shape(out.index)
    shape = L.int_tensor(f"{L.w._tensors[out.index].name}/shape", new_shape)
    emit(L, OP.RESHAPE, [x.index, shape], out, make_options(schema.ReshapeOptionsT, newShape=new_shape),
         OPT.ReshapeOptions, quant=x.quant)


def reshape(L: Lowering, node) -> None:
    """Reshape, Flatten, Squeeze, Unsqueeze: RESHAPE in ONNX's (NCHW) data order."""
    x = L.value(node.input[0])
    identity_in = tuple(range(len(x.shape)))
    if x.layout != identity_in and not _order_kept(x.shape, x.layout):
        nchw = L.temp(x, f"{L.w._tensors[x.index].name}/nchw", layout=identity_in)
        _transpose(L, x, [x.layout.index(k) for k in identity_in], nchw)
        x = nchw
    out_shape = L.shape(node.output[0])
    out_layout = NCHW_TO_NHWC if len(out_shape) == 4 else tuple(range(len(out_shape)))
    if out_layout != tuple(range(len(out_shape))) and not _order_kept(out_shape, out_layout):
        out = L.new_value(node.output[0])
        tmp = L.temp(out, f"{L.w._tensors[out.index].name}/nchw", layout=tuple(range(4)), quant=x.quant)
        _reshape(L, x, tmp)
        _transpose(L, tmp, list(NCHW_TO_NHWC), out)
        return
    _reshape(L, x, L.new_value(node.output[0]))


def transpose(L: Lowering, node) -> None:
    x = L.value(node.input[0])
    rank = len(x.shape)
    perm = list(proto_attr(node, "perm", list(reversed(range(rank)))))
    out = L.new_value(node.output[0])
    tflite_perm = [x.layout.index(perm[out.layout[k]]) for k in range(rank)]
    if tflite_perm == list(range(rank)):
        return _reshape(L, x, out)
    _transpose(L, x, tflite_perm, out)


def concat(L: Lowering, node) -> None:
    out_shape = L.shape(node.output[0])
    rank = len(out_shape)
    axis = (int(proto_attr(node, "axis")) + rank) % rank
    out = L.new_value(node.output[0])
    inputs = []
    for name in node.input:
        if L.is_constant(name):
            v = L.const_operand(name, rank, out.layout, squeeze=False)
        else:
            v = L.value(name)
        inputs.append(requantised(L, v, out.quant, f"{node.name}/{name}").index)
    options = make_options(schema.ConcatenationOptionsT, axis=out.layout.index(axis))
    L.w.op(OP.CONCATENATION, inputs, [out.index], options, OPT.ConcatenationOptions)


def pad(L: Lowering, node) -> None:
    x = L.value(node.input[0])
    mode = proto_attr(node, "mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    if mode != "constant":
        raise L.refuse(f"mode={mode} (only constant padding is lowered)")
    rank = len(x.shape)
    pads = proto_attr(node, "pads")
    if pads is None:
        pads = L.constant(node.input[1]).tolist()
    if len(node.input) > 3 and node.input[3]:
        raise L.refuse("padding a subset of axes (the axes input)")
    value = float(proto_attr(node, "value", 0.0))
    if len(node.input) > 2 and node.input[2]:
        value = float(L.constant(node.input[2]).reshape(-1)[0])
    if any(p < 0 for p in pads):
        raise L.refuse("negative pads (a crop)")
    paddings = [[pads[a], pads[a + rank]] for a in x.layout]
    out = L.new_value(node.output[0])
    p = L.int_tensor(f"{node.name}/paddings", paddings)
    if value == 0.0:
        emit(L, OP.PAD, [x.index, p], out, make_options(schema.PadOptionsT), OPT.PadOptions, quant=x.quant)
        return
    if L.g.quantised:
        s, z = x.quant.scalar()
        fill = np.array([np.clip(np.round(value / s) + z, -128, 127)], np.int8)
    else:
        fill = np.array([value], np.float32)
    v = L.w.tensor(f"{node.name}/pad_value", [1], fill.dtype, data=fill, quant=x.quant)
    emit(L, OP.PADV2, [x.index, p, v], out, make_options(schema.PadV2OptionsT), OPT.PadV2Options, quant=x.quant)


def resize(L: Lowering, node) -> None:
    x = L.value(node.input[0])
    if len(x.shape) != 4:
        raise L.refuse("a resize of a tensor that is not rank 4")
    out_shape = L.shape(node.output[0])
    if out_shape[:2] != x.shape[:2]:
        raise L.refuse("a resize of the batch or channel axis")
    mode = proto_attr(node, "mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    ctm = proto_attr(node, "coordinate_transformation_mode", b"half_pixel")
    ctm = ctm.decode() if isinstance(ctm, bytes) else ctm
    nearest_mode = proto_attr(node, "nearest_mode", b"round_prefer_floor")
    nearest_mode = nearest_mode.decode() if isinstance(nearest_mode, bytes) else nearest_mode
    factors = [o / i for o, i in zip(out_shape[2:], x.shape[2:])]
    align = half = False
    if mode == "linear":
        if ctm == "align_corners":
            align = True
        elif ctm in ("half_pixel", "pytorch_half_pixel") and min(out_shape[2:]) > 1:
            half = True
        elif ctm != "asymmetric":
            raise L.refuse(f"linear resize with coordinate_transformation_mode={ctm} (TFLite has align_corners, "
                           "half_pixel_centers and asymmetric)")
        builtin, cls, opt = OP.RESIZE_BILINEAR, schema.ResizeBilinearOptionsT, OPT.ResizeBilinearOptions
    elif mode == "nearest":
        integer_up = all(f == int(f) and f >= 1 for f in factors)
        if ctm == "asymmetric" and (nearest_mode == "floor" or (
                nearest_mode == "round_prefer_floor" and integer_up and max(factors) <= 2)):
            pass
        elif ctm == "half_pixel" and nearest_mode == "round_prefer_ceil":
            half = True
        elif ctm == "align_corners" and nearest_mode == "round_prefer_ceil":
            align = True
        elif ctm in ("half_pixel", "pytorch_half_pixel") and integer_up and nearest_mode in (
                "round_prefer_floor", "floor", "round_prefer_ceil") and max(factors) <= 2:
            half = True  # an exact integer upsampling: every rounding mode reads the same pixel
        else:
            raise L.refuse(f"nearest resize with coordinate_transformation_mode={ctm}, nearest_mode={nearest_mode} "
                           f"and scale {factors} has no TFLite equivalent")
        builtin, cls, opt = (OP.RESIZE_NEAREST_NEIGHBOR, schema.ResizeNearestNeighborOptionsT,
                             OPT.ResizeNearestNeighborOptions)
    else:
        raise L.refuse(f"mode={mode} (TFLite resizes nearest or bilinear)")
    out = L.new_value(node.output[0])
    size = L.int_tensor(f"{node.name}/size", list(out_shape[2:]))
    emit(L, builtin, [x.index, size], out, make_options(cls, alignCorners=align, halfPixelCenters=half), opt,
         quant=x.quant)


def _axis_values(L: Lowering, node, name: str, index: int):
    value = proto_attr(node, name)
    if value is None and len(node.input) > index and node.input[index]:
        value = L.constant(node.input[index]).tolist()
    return value


def split(L: Lowering, node) -> None:
    """Split -> SPLIT_V along the remapped axis; each output keeps the input's quantisation."""
    x = L.value(node.input[0])
    rank = len(x.shape)
    axis = (int(proto_attr(node, "axis", 0)) + rank) % rank
    sizes = _axis_values(L, node, "split", 1)
    if sizes is None:
        sizes = [L.shape(o)[axis] for o in node.output]
    outs = []
    for name in node.output:
        out = L.new_value(name)
        tmp = out if not L.g.quantised or out.quant == x.quant else L.temp(out, f"{name}/split", quant=x.quant)
        outs.append((out, tmp))
    size_t = L.int_tensor(f"{node.name}/sizes", sizes)
    axis_t = L.int_tensor(f"{node.name}/axis", [x.layout.index(axis)])
    L.w.op(OP.SPLIT_V, [x.index, size_t, axis_t], [t.index for _, t in outs],
           make_options(schema.SplitVOptionsT, numSplits=len(sizes)), OPT.SplitVOptions)
    for out, tmp in outs:
        if tmp is not out:
            L.w.op(OP.QUANTIZE, [tmp.index], [out.index])


def slice_(L: Lowering, node) -> None:
    """Slice -> SLICE (steps of 1) or STRIDED_SLICE, begins and ends in the TFLite layout."""
    x = L.value(node.input[0])
    rank = len(x.shape)
    starts, ends = _axis_values(L, node, "starts", 1), _axis_values(L, node, "ends", 2)
    axes = _axis_values(L, node, "axes", 3) or list(range(len(starts)))
    steps = _axis_values(L, node, "steps", 4) or [1] * len(starts)
    begin, end, stride = [0] * rank, list(x.shape), [1] * rank
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = (a + rank) % rank
        if st <= 0:
            raise L.refuse(f"step {st} on axis {a} (only positive steps are lowered)")
        n = x.shape[a]
        s = min(max(s + n if s < 0 else s, 0), n)
        e = min(max(e + n if e < 0 else e, 0), n)
        begin[a], end[a], stride[a] = s, e, st
    out = L.new_value(node.output[0])
    order = list(x.layout)
    b = L.int_tensor(f"{node.name}/begin", [begin[a] for a in order])
    if all(st == 1 for st in stride):
        size = L.int_tensor(f"{node.name}/size", [end[a] - begin[a] for a in order])
        emit(L, OP.SLICE, [x.index, b, size], out, make_options(schema.SliceOptionsT), OPT.SliceOptions, quant=x.quant)
        return
    e_t = L.int_tensor(f"{node.name}/end", [end[a] for a in order])
    s_t = L.int_tensor(f"{node.name}/strides", [stride[a] for a in order])
    emit(L, OP.STRIDED_SLICE, [x.index, b, e_t, s_t], out, make_options(schema.StridedSliceOptionsT),
         OPT.StridedSliceOptions, quant=x.quant)
