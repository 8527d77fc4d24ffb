"""The folding algebra, as pure functions of numpy arrays.

Everything opfuse folds is one identity. A linear producer computes, per output channel o,

    y[o] = W[o] (*) x + b[o]                (Conv, ConvTranspose, Gemm, MatMul)

and a per-channel affine map follows it:

    z[o] = s[o] * y[o] + t[o]

so the pair is one producer with

    W'[o] = s[o] * W[o]          (every weight that contributes to output channel o)
    b'[o] = s[o] * b[o] + t[o]   (b = 0 when the producer has no bias)

BatchNormalization in inference mode is such a map, with eps read from the node:

    s = gamma / sqrt(var + eps)
    t = beta - mean * s

and so are constant Add (s = 1, t = c), Sub (y - c: s = 1, t = -c; c - y: s = -1, t = c),
Mul (s = c, t = 0) and Div (y / c: s = 1 / c, t = 0) whose constant c varies along the
output-channel axis only.

Where "the slice of W for output channel o" lives depends on the producer's weight layout:

    "oihw"   Conv               W[C_out, C_in/group, k...]        channel axis 0
    "iohw"   ConvTranspose      W[C_in, C_out/group, k...]        axis 1 within each group
    "kn"     Gemm transB=0, MatMul   B[K, N]                      channel axis 1
    "nk"     Gemm transB=1      B[N, K]                           channel axis 0

All arithmetic is done in float64 and cast back once, by :func:`cast_back`, which also says
when the cast would overflow or flush the weights to zero (float16/bfloat16).

Layout ops between the producer and the map (an NHWC export's Transpose, a Keras Conv1D's
Squeeze, a classifier head's Flatten) only move elements. If such an op L sends every
element of channel o of y to channel position o of one axis j of L(y), then for a constant
k that varies along axis j only

    k_s (.) L(y) + k_t = L(s (.) y + t)      with s[o] = k_s[..., o, ...], t[o] = k_t[..., o, ...]

so the map folds into the producer and L stays, reading the folded output. Where the channel
axis lands (None: L does not keep it as one whole axis):

    Transpose(perm)       a -> perm.index(a)            (output axis i reads input axis perm[i])
    Squeeze(axes)         a -> a - #{axes < a}          (None when a is squeezed)
    Unsqueeze(axes)       a -> the a-th axis of the output that is not inserted
    Reshape, Flatten      a -> j with out[j] = in[a] = C and prod(in[:a]) = prod(out[:j])
                          (equivalently prod(in[a+1:]) = prod(out[j+1:])): row-major order
                          writes element (p, o, q) at offset (p * C + o) * Q + q on both sides
                          (:func:`reshaped_axis`, with dims that may be symbolic)

Dequantising a weight (:mod:`opfuse.passes.dequantize_dynamic`) is the one formula

    W = (Wq - zero_point) * scale        per tensor, or per index of the axes the scale varies on

computed in float64 and rounded once (:func:`dequantize`): an 8-bit difference (9 bits) times
a float32 scale (24 bits) is exact in float64, so the result is float32 arithmetic's own
``(Wq - zp) * scale``, bit for bit. ONNX Runtime's DynamicQuantizeLSTM keeps its weights as
[directions, input, 4 * hidden] (ONNX LSTM's [directions, 4 * hidden, input] transposed),
scaled per direction or per column (:func:`dequantize_lstm_weight`).
"""

from __future__ import annotations

__all__ = [
    "WeightLayout",
    "batchnorm_affine",
    "scale_output_channels",
    "fold_affine",
    "fold_bias",
    "fold_weight",
    "cast_back",
    "output_channels",
    "products_per_output",
    "channel_major",
    "permuted_axis",
    "squeezed_axis",
    "unsqueezed_axis",
    "reshaped_axis",
    "inferred_dim",
    "dequantize",
    "dequantize_lstm_weight",
]

from collections import Counter
from collections.abc import Sequence
from typing import Literal

import ml_dtypes
import numpy as np

WeightLayout = Literal["oihw", "iohw", "kn", "nk"]

# Share of a tensor's non-zero weights that may flush to zero in a narrow dtype before a
# fold is refused (a whole output channel flushing to zero is refused regardless).
UNDERFLOW_TOLERANCE = 0.01
MIN_SAFE_SCALE = 2.0**-20
CHUNK_ELEMENTS = 1 << 16  # float64 working block of the fused multiply-and-cast (512 KiB)


def batchnorm_affine(
    gamma: np.ndarray, beta: np.ndarray, mean: np.ndarray, var: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """BatchNormalization (inference) as z = s * y + t; returns (s, t) in float64."""
    gamma, beta, mean, var = (np.asarray(a, dtype=np.float64) for a in (gamma, beta, mean, var))
    s = gamma / np.sqrt(var + np.float64(eps))
    return s, beta - mean * s


def output_channels(weight_shape: tuple[int, ...], layout: WeightLayout, group: int = 1) -> int:
    """Number of output channels of a producer with this weight shape and layout."""
    if layout == "oihw" or layout == "nk":
        return int(weight_shape[0])
    if layout == "iohw":
        return int(weight_shape[1]) * group
    return int(weight_shape[1])  # "kn"


def products_per_output(weight_shape: tuple[int, ...], layout: WeightLayout, group: int = 1) -> int:
    """How many products one output element sums, at most (the weights that reach it):
    C_in/group x k... for a Conv (``oihw``) and a ConvTranspose (``iohw``, whose weight is
    [C_in, C_out/group, k...]; a stride makes fewer of them land on each output), K for
    Gemm and MatMul (``kn``: [K, N]; ``nk``: [N, K])."""
    if layout == "oihw":
        return int(np.prod(weight_shape[1:]))
    if layout == "iohw":
        return int(weight_shape[0] // max(group, 1) * np.prod(weight_shape[2:]))
    if layout == "kn":
        return int(weight_shape[-2])
    return int(weight_shape[-1])


def _channel_broadcast(scale: np.ndarray, shape: tuple[int, ...], layout: WeightLayout, group: int):
    """``scale`` reshaped to broadcast over a weight of ``shape`` (grouped view for iohw)."""
    s = np.asarray(scale, dtype=np.float64).reshape(-1)
    ndim = len(shape)
    if layout == "oihw" or layout == "nk":
        return shape, s.reshape((-1,) + (1,) * (ndim - 1))
    if layout == "kn":
        return shape, s.reshape(1, -1)
    # ConvTranspose: W[C_in, C_out/g, k...]; input channels of group g feed output
    # channels g*C_out/g .. (g+1)*C_out/g - 1, so the scale is laid out per group.
    grouped = (group, shape[0] // group, shape[1]) + tuple(shape[2:])
    return grouped, s.reshape((group, 1, shape[1]) + (1,) * (ndim - 2))


def scale_output_channels(
    weight: np.ndarray,
    scale: np.ndarray,
    layout: WeightLayout,
    group: int = 1,
    out_dtype: np.dtype | None = None,
) -> np.ndarray:
    """W' with output channel o's weights times scale[o], computed in float64.

    Returned in float64, or, with ``out_dtype``, cast to it chunk by chunk as numpy's
    buffered loop produces it (the same values, without a float64 copy of the weight).
    """
    weight = np.asarray(weight)
    view_shape, s = _channel_broadcast(scale, weight.shape, layout, group)
    if out_dtype is None:
        return np.multiply(weight.reshape(view_shape), s, dtype=np.float64).reshape(weight.shape)
    out = np.empty(weight.shape, dtype=out_dtype)
    w_view, o_view = weight.reshape(view_shape), out.reshape(view_shape)
    # Blocks along the first axis keep each float64 intermediate in cache.
    rows = max(1, CHUNK_ELEMENTS // max(1, w_view[0].size)) if w_view.shape[0] else 1
    s_rows = s.shape[0] > 1
    with np.errstate(over="ignore", invalid="ignore"):
        for i in range(0, w_view.shape[0], rows):
            block = w_view[i:i + rows].astype(np.float64)
            block *= s[i:i + rows] if s_rows else s
            o_view[i:i + rows] = block
    return out


def fold_bias(
    bias: np.ndarray | None, scale: np.ndarray | None, shift: np.ndarray | None, channels: int
) -> np.ndarray | None:
    """b' = scale * b + shift per output channel, in float64 (None: no bias results).

    A bias is one value per channel (a scalar broadcasts), or, for Gemm's C, a matrix
    [M, 1] or [M, channels] whose rows each get the same per-channel map.
    """
    b = None
    if bias is not None:
        b = np.asarray(bias, np.float64)
        b = np.broadcast_to(b, (b.shape[0], channels) if b.ndim == 2 else (channels,))
    per_channel = (lambda v: np.broadcast_to(np.asarray(v, np.float64).reshape(-1), (channels,)))
    if scale is not None and b is not None:
        b = b * per_channel(scale)
    if shift is not None:
        t = per_channel(shift)
        b = t.copy() if b is None else b + t
    return None if b is None else np.array(b, dtype=np.float64)


def fold_affine(
    weight: np.ndarray,
    bias: np.ndarray | None,
    scale: np.ndarray | None,
    shift: np.ndarray | None,
    layout: WeightLayout,
    group: int = 1,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Absorb z = scale * y + shift into (weight, bias); returns float64 (W', b').

    ``scale`` None means 1, ``shift`` None means 0, ``bias`` None means the producer has
    none. b' is None only when there was no bias and nothing creates one.
    """
    channels = output_channels(np.shape(weight), layout, group)
    if scale is None:
        w = np.array(weight, dtype=np.float64)
    else:
        s = np.broadcast_to(np.asarray(scale, np.float64).reshape(-1), (channels,))
        w = scale_output_channels(weight, s, layout, group)
    return w, fold_bias(bias, scale, shift, channels)


def fold_weight(
    weight: np.ndarray, scale: np.ndarray, layout: WeightLayout, group: int = 1
) -> tuple[np.ndarray, str | None]:
    """W' = scale (.) W computed in float64 and cast back to W's dtype; (W', problem).

    The same values and checks as ``cast_back(scale_output_channels(...))``; float32 and
    float64 weights under scales >= MIN_SAFE_SCALE take one pass with no float64 copy.
    """
    weight = np.asarray(weight)
    dtype = weight.dtype
    channels = output_channels(weight.shape, layout, group)
    s = np.broadcast_to(np.asarray(scale, np.float64).reshape(-1), (channels,))
    min_abs_scale = float(np.min(np.abs(s))) if s.size else 1.0
    if dtype in (np.float32, np.float64) and min_abs_scale >= MIN_SAFE_SCALE:
        out = scale_output_channels(weight, s, layout, group, out_dtype=dtype)
        if np.isfinite(out).all():
            return out, None
    folded = scale_output_channels(weight, s, layout, group)
    return cast_back(folded, dtype, "weight", layout, group, min_abs_scale)


def channel_major(array: np.ndarray, layout: WeightLayout, group: int = 1) -> np.ndarray:
    """View a weight as [output channel, everything else]."""
    if layout == "oihw" or layout == "nk":
        return array.reshape(array.shape[0], -1)
    if layout == "kn":
        return array.T
    c_in, c_out_per_group = array.shape[0], array.shape[1]
    grouped = array.reshape((group, c_in // group, c_out_per_group, -1))
    return np.moveaxis(grouped, 2, 1).reshape(group * c_out_per_group, -1)


def cast_back(
    folded: np.ndarray,
    dtype: np.dtype,
    what: str = "weight",
    layout: WeightLayout | None = None,
    group: int = 1,
    min_abs_scale: float | None = None,
) -> tuple[np.ndarray, str | None]:
    """Cast a float64 result to ``dtype``; return (array, problem or None).

    The problem is a sentence when the cast loses the tensor: a finite value that becomes
    inf (overflow), a NaN, an output channel whose non-zero weights all flush to zero, or
    more than UNDERFLOW_TOLERANCE of the non-zero weights flushing to zero. ``layout`` says
    where the output channels are (a bias is one value per channel when it is None).
    ``min_abs_scale`` is the smallest |scale| the fold applied, when known: in float32 and
    float64 a scale of at least 2**-20 can only flush weights that were already below the
    smallest normal number (1e-38, numerically nothing), so the count is skipped.
    """
    dtype = np.dtype(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        out = folded.astype(dtype)
    if not np.isfinite(out).all():  # inf/NaN in the result: from the algebra or the cast
        if not np.isfinite(folded).all():
            return out, f"folded {what} is not finite (inf or NaN in the algebra)"
        worst = float(np.max(np.abs(folded)))
        limit = float(ml_dtypes.finfo(dtype).max)  # knows bfloat16 too
        return out, (
            f"folded {what} reaches {worst:.3g}, beyond {dtype.name}'s largest value "
            f"{limit:.5g} (overflow to inf)"
        )
    if dtype.itemsize >= 4 and min_abs_scale is not None and min_abs_scale >= MIN_SAFE_SCALE:
        return out, None
    if np.count_nonzero(out) == np.count_nonzero(folded):
        return out, None  # nothing flushed to zero
    nonzero = folded != 0
    flushed = nonzero & (out == 0)
    if layout is None:
        nz_rows, fl_rows = nonzero.reshape(-1, 1), flushed.reshape(-1, 1)
    else:
        nz_rows = channel_major(nonzero, layout, group)
        fl_rows = channel_major(flushed, layout, group)
    lost = np.flatnonzero(nz_rows.any(axis=1) & (fl_rows == nz_rows).all(axis=1))
    share = flushed.sum() / max(int(nonzero.sum()), 1)
    if (layout is not None and lost.size) or share > UNDERFLOW_TOLERANCE:
        where = f"; output channel {int(lost[0])} becomes all zeros" if lost.size else ""
        return out, (
            f"{share:.1%} of the folded {what}'s non-zero values underflow to zero "
            f"in {dtype.name}{where}"
        )
    return out, None


# -- where the channel axis goes through a layout op (module docstring) ----------------------

Dim = int | str | None  # a static size, a symbolic one (its name), or unknown


def permuted_axis(perm: Sequence[int], axis: int) -> int:
    """The output axis of Transpose(perm) that reads input ``axis``."""
    return [int(p) % len(perm) for p in perm].index(axis)


def squeezed_axis(axes: Sequence[int], rank: int, axis: int) -> int | None:
    """Where input ``axis`` of a rank-``rank`` tensor lands after Squeeze(axes); None if squeezed."""
    gone = {int(a) % rank for a in axes}
    return None if axis in gone else axis - sum(1 for a in gone if a < axis)


def unsqueezed_axis(axes: Sequence[int], rank: int, axis: int) -> int:
    """Where input ``axis`` of a rank-``rank`` tensor lands after Unsqueeze(axes)."""
    out_rank = rank + len(axes)
    inserted = {int(a) % out_rank for a in axes}
    return [i for i in range(out_rank) if i not in inserted][axis]


def _product(dims: Sequence[Dim]) -> tuple[int, Counter] | None:
    """A product of dims as (static part, symbolic factors); None when a dim is unknown."""
    static, symbols = 1, Counter()
    for d in dims:
        if d is None:
            return None
        if isinstance(d, str):
            symbols[d] += 1
        else:
            static *= int(d)
    return static, symbols


def reshaped_axis(in_dims: Sequence[Dim], out_dims: Sequence[Dim], axis: int) -> int | None:
    """The output axis of a row-major reshape from ``in_dims`` to ``out_dims`` that holds
    input ``axis`` whole (same size, same product of the dims before it, or after it); None
    when no output axis provably does. A symbolic dim equals only itself."""
    size = in_dims[axis]
    if not isinstance(size, int) or size == 0:
        return None
    before, after = _product(in_dims[:axis]), _product(in_dims[axis + 1:])
    for j, d in enumerate(out_dims):
        if d != size:
            continue
        if before is not None and _product(out_dims[:j]) == before:
            return j
        if after is not None and _product(out_dims[j + 1:]) == after:
            return j
    return None


def inferred_dim(in_dims: Sequence[Dim], known: Sequence[Dim]) -> Dim:
    """Reshape's -1: prod(in_dims) / prod(known), as a static size or one symbolic dim;
    None when that quotient is not one of those (or a dim is unknown)."""
    total, part = _product(in_dims), _product(known)
    if total is None or part is None or part[0] == 0 or total[0] % part[0]:
        return None
    if part[1] - total[1]:
        return None  # a symbol of the known dims is not a factor of the total
    rest = total[1] - part[1]
    static = total[0] // part[0]
    if not rest:
        return static
    if static == 1 and sum(rest.values()) == 1:
        return next(iter(rest))
    return None


def dequantize(q: np.ndarray, zero_point, scale, dtype=np.float32) -> np.ndarray:
    """``(q - zero_point) * scale`` rounded once to ``dtype`` (module docstring); the zero
    point and the scale broadcast against ``q`` (one value, or shaped along its axes)."""
    zp, s = np.asarray(zero_point, dtype=np.float64), np.asarray(scale, dtype=np.float64)
    return ((np.asarray(q).astype(np.float64) - zp) * s).astype(dtype)


def dequantize_lstm_weight(q: np.ndarray, zero_point, scale, dtype=np.float32) -> np.ndarray:
    """A DynamicQuantizeLSTM weight ``q`` [directions, rows, 4 * hidden] (its W or R) as ONNX
    LSTM's [directions, 4 * hidden, rows]. The scale and the zero point each have shape
    [directions] (per direction) or [directions, 4 * hidden] (per column)."""
    def spread(v):
        v = np.asarray(v)
        return v.reshape(v.shape[0], 1, 1) if v.ndim == 1 else v.reshape(v.shape[0], 1, v.shape[1])

    w = dequantize(q, spread(zero_point), spread(scale), dtype)
    return np.ascontiguousarray(w.transpose(0, 2, 1))
