"""The neural-network builders of :mod:`opfuse.quantization.interpreter.ops`: Conv, ConvTranspose,
Gemm and Einsum, the pools, the normalisations, Pad, Resize and Upsample, DepthToSpace and
SpaceToDepth, with their helpers (the sliding window, SAME padding, pooled lengths, resampling).

Each builder reads a node's attributes through torch_ops' reader and returns the function of
its inputs, as described there; the registry ``_OPS`` and the public interface are in torch_ops.
The helpers they share with torch_ops are in :mod:`.torch_ops_common`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from opfuse.quantization.interpreter.common import Function, Unsupported, _Attributes, _floats, _ints, _item, _optional


# -- helpers ---------------------------------------------------------------------------------

def _torch_pads(begin, end) -> list[int]:
    """F.pad's order: the last axis first, (begin, end) each."""
    return [p for b, e in zip(reversed(list(begin)), reversed(list(end))) for p in (b, e)]


def _by_rank(table: dict, x: torch.Tensor, op: str):
    if x.dim() - 2 not in table:
        raise Unsupported(f"{op} on a {x.dim()}-D input is not interpreted")
    return table[x.dim() - 2]


# -- linear layers ---------------------------------------------------------------------------

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_AUTO_PAD = ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER")


def _split_padding(total: int, auto_pad: str) -> tuple[int, int]:
    """(begin, end) of a SAME padding: the odd element at the end for SAME_UPPER."""
    small, large = total // 2, total - total // 2
    return (small, large) if auto_pad == "SAME_UPPER" else (large, small)


class _Window:
    """The sliding window of a Conv or a pool: strides, dilations and padding per spatial axis."""

    def __init__(self, a: _Attributes):
        self.auto_pad = a.choice("auto_pad", "NOTSET", _AUTO_PAD)
        self.strides, self.dilations, self.pads = a("strides"), a("dilations"), a("pads")

    def resolve(self, sizes, kernel, output_padding=None) -> tuple[list[int], list[int], list[int], list[int]]:
        """strides, dilations, and the padding at the beginning and end of each axis. SAME
        pads to ceil(size / stride) outputs, or to ``size * stride`` for a transposed
        convolution (``output_padding`` given), and never below zero (ONNX Runtime's rule:
        ONNX's reference pads a transposed convolution negatively when its kernel is
        shorter than the stride)."""
        n = len(sizes)
        strides, dilations = self.strides or [1] * n, self.dilations or [1] * n
        if self.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            if output_padding is None:
                totals = [(-(-size // s) - 1) * s + (k - 1) * d + 1 - size
                          for size, k, s, d in zip(sizes, kernel, strides, dilations)]
            else:
                totals = [s * (size - 1) + o + (k - 1) * d + 1 - size * s
                          for size, k, s, d, o in zip(sizes, kernel, strides, dilations, output_padding)]
            begin, end = zip(*(_split_padding(max(t, 0), self.auto_pad) for t in totals))
        elif self.auto_pad == "VALID" or not self.pads:
            begin = end = [0] * n
        else:
            begin, end = self.pads[:n], self.pads[n:]
        return list(strides), list(dilations), list(begin), list(end)


def _conv(a: _Attributes) -> Function:
    window, group = _Window(a), a("group", 1)
    a.ignore("kernel_shape")

    def run(xs):
        x, w, b = xs[0], xs[1], _optional(xs, 2)
        conv = _by_rank(_CONV, x, "Conv")
        strides, dilations, begin, end = window.resolve(x.shape[2:], w.shape[2:])
        if begin != end:
            x, begin = F.pad(x, _torch_pads(begin, end)), [0] * len(begin)
        return conv(x, w, b, strides, begin, dilations, group)
    return run


def _conv_transpose(a: _Attributes) -> Function:
    """The full transposed convolution, then ``pads`` cropped and ``output_padding`` added
    at the end of each axis as zeros before the bias (what ONNX's output shape formula says)."""
    window, group, output_padding = _Window(a), a("group", 1), a("output_padding")
    a.ignore("kernel_shape")
    if a("output_shape") is not None:
        a.refuse("output_shape")

    def run(xs):
        x, w, b = xs[0], xs[1], _optional(xs, 2)
        conv = _by_rank(_CONV_TRANSPOSE, x, "ConvTranspose")
        n = x.dim() - 2
        extra = output_padding or [0] * n
        strides, dilations, begin, end = window.resolve(x.shape[2:], w.shape[2:], extra)
        y = conv(x, w, None, strides, 0, 0, group, dilations)
        y = F.pad(y, _torch_pads([-p for p in begin], [o - p for o, p in zip(extra, end)]))
        return y if b is None else y + b.reshape(-1, *[1] * n)
    return run


def _gemm(a: _Attributes) -> Function:
    alpha, beta, trans_a, trans_b = a("alpha", 1.0), a("beta", 1.0), a("transA", 0), a("transB", 0)
    a.ignore("broadcast")

    def run(xs):
        x, w, c = xs[0], xs[1], _optional(xs, 2)
        y = (x.T if trans_a else x) @ (w.T if trans_b else w)
        y = y if alpha == 1.0 else alpha * y
        return y if c is None else y + (c if beta == 1.0 else beta * c)
    return run


def _einsum(a: _Attributes) -> Function:
    equation = a("equation").replace(" ", "")
    return lambda xs: torch.einsum(equation, *xs)


# -- pooling ---------------------------------------------------------------------------------

_AVERAGE_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def _pooled_count(size: int, kernel: int, stride: int, dilation: int, begin: int, end: int, ceil_mode: int) -> int:
    """ONNX Runtime's output length: its floor mode divides truncating toward zero (C's integer
    division), so a window longer than the padded input by less than a stride still gives one
    output (ONNX's floor would give none); windows that ceil_mode adds must start inside the
    input or the padding at its beginning. Zero when no window fits."""
    span = size + begin + end - (kernel - 1) * dilation - 1
    if not ceil_mode:
        return max((span // stride if span >= 0 else -(-span // stride)) + 1, 0)
    count = -(-span // stride) + 1
    if (count - 1) * stride >= size + begin:
        count -= 1
    return max(count, 0)


def _pooled_ends(x: torch.Tensor, kernel, strides, dilations, begin, end, ceil_mode) -> tuple[list[int], list[int]]:
    """The output length of each axis, and the padding at its end that gives that length with
    floor-mode windows and no other padding (the part of a window past it is left out)."""
    windows = list(zip(x.shape[2:], kernel, strides, dilations, begin, end))
    counts = [_pooled_count(*w, ceil_mode) for w in windows]
    return counts, [(c - 1) * s + (k - 1) * d + 1 - size - b for c, (size, k, s, d, b, _) in zip(counts, windows)]


def _lowest(dtype: torch.dtype) -> float:
    """MaxPool's padding: what a window over padding alone gives in ONNX Runtime, the type's
    lowest value (float16's: -inf, as it pools in float32)."""
    if not dtype.is_floating_point:
        return torch.iinfo(dtype).min
    return -math.inf if torch.finfo(dtype).bits < 32 else torch.finfo(dtype).min


def _max_pool(a: _Attributes) -> Function:
    window, kernel, ceil_mode = _Window(a), a("kernel_shape"), a("ceil_mode", 0)
    a.ignore("storage_order")

    def run(xs):
        x = xs[0]
        pool = _by_rank(_MAX_POOL, x, "MaxPool")
        strides, dilations, begin, end = window.resolve(x.shape[2:], kernel)
        counts, ends = _pooled_ends(x, kernel, strides, dilations, begin, end, ceil_mode)
        if 0 in counts:  # no window on some axis: an empty output, as ONNX Runtime gives
            return x.new_zeros((*x.shape[:2], *counts))
        x = F.pad(x, _torch_pads(begin, ends), value=_lowest(x.dtype))
        return pool(x, kernel, strides, 0, dilations)
    return run


def _average_pool(a: _Attributes) -> Function:
    """The padded sums divided by the count of what each window covers: the input alone,
    or with count_include_pad the ``pads`` too (never ceil_mode's extra windows), and in floor
    mode the whole window (ONNX Runtime's divisor when a window overhangs the padded input)."""
    window, kernel, ceil_mode = _Window(a), a("kernel_shape"), a("ceil_mode", 0)
    include_pad = a("count_include_pad", 0)
    if any(d != 1 for d in window.dilations or []):
        a.refuse("dilations")

    def run(xs):
        x = xs[0]
        pool = _by_rank(_AVERAGE_POOL, x, "AveragePool")
        sizes = x.shape[2:]
        strides, dilations, begin, end = window.resolve(sizes, kernel)
        counts, ends = _pooled_ends(x, kernel, strides, dilations, begin, end, ceil_mode)
        if 0 in counts:  # no window on some axis: an empty output, as ONNX Runtime gives
            return x.new_zeros((*x.shape[:2], *counts))
        counted = torch.ones((1, 1, *sizes), dtype=x.dtype)
        if include_pad:
            padded = end if ceil_mode else ends
            counted = F.pad(counted, _torch_pads(begin, padded), value=1.0)
            counted = F.pad(counted, _torch_pads([0] * len(sizes), [p - e for p, e in zip(ends, padded)]))
        else:
            counted = F.pad(counted, _torch_pads(begin, ends))
        return pool(F.pad(x, _torch_pads(begin, ends)), kernel, strides) / pool(counted, kernel, strides)
    return run


def _global_pool(fn: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """GlobalAveragePool's and GlobalMaxPool's function: ``fn`` over the spatial axes."""
    return lambda x: fn(x, tuple(range(2, x.dim())), keepdim=True)


# -- normalisation ---------------------------------------------------------------------------

def _channels(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A per-channel [C] tensor shaped to broadcast over [N, C, ...] of ``rank``."""
    return t.reshape(-1, *[1] * (rank - 2))


def _batch_norm(a: _Attributes) -> Function:
    epsilon = a("epsilon", 1e-5)
    a.ignore("momentum", "is_test")
    if a("training_mode", 0):
        a.refuse("training_mode 1")
    if not a("spatial", 1):
        a.refuse("spatial 0")

    def run(xs):
        x, scale, bias, mean, var = xs[:5]
        r = x.dim()
        return (x - _channels(mean, r)) * _channels(scale * torch.rsqrt(var + epsilon), r) + _channels(bias, r)
    return run


def _instance_norm(a: _Attributes) -> Function:
    epsilon = a("epsilon", 1e-5)

    def run(xs):
        x, scale, bias = xs
        var, mean = torch.var_mean(x, tuple(range(2, x.dim())), correction=0, keepdim=True)
        r = x.dim()
        return (x - mean) * torch.rsqrt(var + epsilon) * _channels(scale, r) + _channels(bias, r)
    return run


def _layer_norm(a: _Attributes) -> Function:
    """Statistics in float32 for a float16 input (stash_type 1, the only one ONNX Runtime has)."""
    axis, epsilon = a("axis", -1), a("epsilon", 1e-5)
    a.choice("stash_type", 1, (1,))

    def run(xs):
        x, scale, bias = xs[0], xs[1], _optional(xs, 2)
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        var, mean = torch.var_mean(h, tuple(range(axis % x.dim(), x.dim())), correction=0, keepdim=True)
        y = ((h - mean) * torch.rsqrt(var + epsilon)).to(x.dtype) * scale
        return y if bias is None else y + bias
    return run


# -- padding and pixel rearrangement ----------------------------------------------------------

def _pad_indices(mode: str, size: int, begin: int, end: int) -> torch.Tensor:
    """The source index of each position of an axis padded by ``begin`` and ``end`` (both
    non-negative: negative pads crop first), for the modes that copy values."""
    i = torch.arange(-begin, size + end)
    if mode == "edge" or size == 1:
        return i.clamp(0, size - 1)
    if mode == "wrap":
        return i % size
    period = 2 * (size - 1)
    i = i.abs() % period
    return torch.where(i >= size, period - i, i)


def _pad(a: _Attributes) -> Function:
    mode = a.choice("mode", "constant", ("constant", "reflect", "edge", "wrap"))
    attributes = (a("pads") or a("paddings"), a("value", 0.0), None) if a.opset < 11 else None

    def run(xs):
        x = xs[0]
        pads, value, axes = attributes or (_ints(xs[1]), _item(_optional(xs, 2), 0), _ints(_optional(xs, 3)))
        axes = [d % x.dim() for d in axes] if axes else range(x.dim())
        begin, end = [0] * x.dim(), [0] * x.dim()
        for i, d in enumerate(axes):
            begin[d], end[d] = pads[i], pads[len(axes) + i]
        if mode == "constant":
            return F.pad(x, _torch_pads(begin, end), value=value)
        for d in axes:
            crop_begin, crop_end = max(-begin[d], 0), max(-end[d], 0)
            x = x.narrow(d, crop_begin, x.shape[d] - crop_begin - crop_end)
            x = x.index_select(d, _pad_indices(mode, x.shape[d], max(begin[d], 0), max(end[d], 0)))
        return x
    return run


def _depth_to_space(a: _Attributes) -> Function:
    block, mode = a("blocksize"), a.choice("mode", "DCR", ("DCR", "CRD"))

    def run(xs):
        x = xs[0]
        n, c, h, w = x.shape
        if mode == "DCR":
            y = x.reshape(n, block, block, c // block**2, h, w).permute(0, 3, 4, 1, 5, 2)
        else:
            y = x.reshape(n, c // block**2, block, block, h, w).permute(0, 1, 4, 2, 5, 3)
        return y.reshape(n, c // block**2, h * block, w * block)
    return run


def _space_to_depth(a: _Attributes) -> Function:
    block = a("blocksize")

    def run(xs):
        x = xs[0]
        n, c, h, w = x.shape
        y = x.reshape(n, c, h // block, block, w // block, block).permute(0, 3, 5, 1, 2, 4)
        return y.reshape(n, c * block**2, h // block, w // block)
    return run


# -- resizing --------------------------------------------------------------------------------

_COORDINATES = {  # output index x (float32) -> the input coordinate it reads
    "half_pixel": lambda x, scale, size, out: (x + 0.5) / scale - 0.5,
    "pytorch_half_pixel": lambda x, scale, size, out: (x + 0.5) / scale - 0.5 if out > 1 else 0 * x,
    "asymmetric": lambda x, scale, size, out: x / scale,
    "align_corners": lambda x, scale, size, out: x * np.float32(size - 1) / np.float32(out - 1) if out > 1 else 0 * x,
    "tf_half_pixel_for_nn": lambda x, scale, size, out: (x + 0.5) / scale,
}
_NEAREST = {  # input coordinate -> index, before clamping to the input
    "floor": np.floor,
    "ceil": np.ceil,
    "round_prefer_floor": lambda v: np.ceil(v - 0.5),
    "round_prefer_ceil": lambda v: np.floor(v + 0.5),
}


def _resample(x, axis: int, out: int, scale, mode: str, coordinates: str, nearest: str):
    """One axis resized; ``nearest`` "simple" is Upsample's and Resize-10's floor when
    enlarging, ceil when shrinking."""
    size = x.shape[axis]
    source = _COORDINATES[coordinates](np.arange(out, dtype=np.float32), scale, size, out)
    if mode == "nearest":
        rounding = (np.floor if scale >= 1 else np.ceil) if nearest == "simple" else _NEAREST[nearest]
        return x.index_select(axis, torch.from_numpy(np.clip(rounding(source), 0, size - 1).astype(np.int64)))
    position = np.clip(source, 0, size - 1)
    low = np.floor(position)
    high = np.minimum(low + 1, size - 1)
    shape = [1] * x.dim()
    shape[axis] = out
    weight = torch.from_numpy((position - low).astype(np.float32)).to(x.dtype).reshape(shape)
    return (x.index_select(axis, torch.from_numpy(low.astype(np.int64))) * (1 - weight)
            + x.index_select(axis, torch.from_numpy(high.astype(np.int64))) * weight)


def _resize(a: _Attributes) -> Function:
    """Resize (and Upsample): nearest or linear (any axes, one after the other); cubic,
    antialias, tf_crop_and_resize and keep_aspect_ratio_policy other than stretch refused.
    An output of the input's shape is the input, whatever the scales (ONNX Runtime's rule)."""
    mode = a.choice("mode", "nearest", ("nearest", "linear"))
    if a.op == "Upsample" or a.opset < 11:
        coordinates, nearest = "asymmetric", "simple"
    else:
        coordinates = a.choice("coordinate_transformation_mode", "half_pixel", tuple(_COORDINATES))
        nearest = a.choice("nearest_mode", "round_prefer_floor", tuple(_NEAREST))
    a.choice("antialias", 0, (0,))
    a.choice("keep_aspect_ratio_policy", "stretch", ("stretch",))
    a.ignore("cubic_coeff_a", "exclude_outside", "extrapolation_value")
    axes = a("axes")
    scales_attribute = a("scales") if a.op == "Upsample" and a.opset < 9 else None
    with_sizes = a.op == "Resize" and a.opset >= 11  # inputs X, roi, scales, sizes; before: X, scales

    def run(xs):
        x = xs[0]
        scales = scales_attribute or _floats(_optional(xs, 2 if with_sizes else 1))
        sizes = _ints(_optional(xs, 3)) if with_sizes else None
        dims = [d % x.dim() for d in axes] if axes else range(x.dim())
        if sizes:
            plan = [(d, out, np.float32(out) / np.float32(x.shape[d])) for d, out in zip(dims, sizes)]
        else:
            scales = [np.float32(s) for s in scales]
            plan = [(d, int(np.floor(np.float32(x.shape[d]) * s)), s) for d, s in zip(dims, scales)]
        if all(out == x.shape[d] for d, out, _ in plan):
            return x
        for d, out, scale in plan:
            if out != x.shape[d] or scale != 1:
                x = _resample(x, d, out, scale, mode, coordinates, nearest)
        return x
    return run
