"""Conv/ConvTranspose/Linear + BatchNorm folding, as pure functions of tensors.

This is the algebra the chapter's ``fuse_conv_bn`` sample meant, with its two bugs fixed:
eps is a required argument (the layer's own ``bn.eps``, never a 1e-5 default) and a
missing conv bias is b = 0. In inference, BatchNorm is a per-channel affine map

    s = gamma / sqrt(running_var + eps)          (gamma = 1 when affine=False)
    t = beta - running_mean * s                  (beta = 0 when affine=False)

and a producer followed by it is one producer with

    W'[o] = s[o] * W[o]        (every weight feeding output channel o)
    b'[o] = s[o] * b[o] + t[o] (b = 0 when the producer has no bias)

The arithmetic is :mod:`opfuse.core.algebra`'s, shared with the ONNX side: the tensors go to
numpy float64, ``batchnorm_affine`` and ``fold_affine`` do the work with the weight layout
of the producer, and the result is cast back once to the weight's dtype:

    Conv{1,2,3}d            W[C_out, C_in/groups, k...]    layout "oihw"
    ConvTranspose{1,2,3}d   W[C_in, C_out/groups, k...]    layout "iohw" with the group count
    Linear                  W[out_features, in_features]   layout "nk"

A fold whose cast back would overflow, produce NaN, or flush a channel's weights to zero
(possible in float16/bfloat16) raises :class:`FoldingError` with the reason, so a caller
can refuse it instead of shipping wrong weights. Nothing here looks at modules or graphs;
legality (eval mode, running statistics, a single consumer...) is decided in ``fuse.py``.
"""

from __future__ import annotations

__all__ = [
    "FoldingError",
    "batchnorm_scale_shift",
    "fold_affine_weights",
    "fold_conv_bn_weights",
    "fold_linear_bn_weights",
]

import ml_dtypes
import numpy as np
import torch

from opfuse.core.algebra import WeightLayout, batchnorm_affine, cast_back, fold_affine, output_channels


class FoldingError(ValueError):
    """A fold whose result cannot be represented in the weight's dtype."""


_NUMPY_DTYPES = {
    torch.float64: np.dtype(np.float64),
    torch.float32: np.dtype(np.float32),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
}


def _f64(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().to("cpu", torch.float64).numpy()


def _back(array: np.ndarray, like: torch.Tensor, what: str, layout, groups: int) -> torch.Tensor:
    """Cast a float64 result to ``like``'s dtype and device, or raise FoldingError."""
    np_dtype = _NUMPY_DTYPES.get(like.dtype)
    if np_dtype is None:
        raise FoldingError(f"cannot fold into a {like.dtype} {what}: not a floating-point dtype")
    _, problem = cast_back(array, np_dtype, what, layout, groups)
    if problem:
        raise FoldingError(problem)
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=like.device, dtype=like.dtype)


def batchnorm_scale_shift(
    bn_rm: torch.Tensor,
    bn_rv: torch.Tensor,
    bn_eps: float,
    bn_w: torch.Tensor | None = None,
    bn_b: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BatchNorm (inference) as z = s * y + t; returns (s, t) as float64 tensors.

    ``bn_w``/``bn_b`` None (affine=False) mean gamma = 1 and beta = 0.
    """
    mean, var = _f64(bn_rm), _f64(bn_rv)
    gamma = np.ones_like(mean) if bn_w is None else _f64(bn_w)
    beta = np.zeros_like(mean) if bn_b is None else _f64(bn_b)
    s, t = batchnorm_affine(gamma, beta, mean, var, float(bn_eps))
    return torch.from_numpy(s), torch.from_numpy(t)


def fold_affine_weights(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    layout: WeightLayout,
    groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorb z = scale * y + shift (per output channel) into (weight, bias).

    Returns the folded (weight, bias) in ``weight``'s dtype and device; the bias always
    exists afterwards (a producer without one gets ``shift``, or zeros).
    """
    w64, b64 = fold_affine(_f64(weight), _f64(bias), _f64(scale), _f64(shift), layout, groups)
    if b64 is None:  # no bias and no shift: the folded producer still gets an explicit one
        b64 = np.zeros(output_channels(tuple(weight.shape), layout, groups))
    return (
        _back(w64, weight, "weight", layout, groups),
        _back(b64, weight if bias is None else bias, "bias", None, 1),
    )


def fold_conv_bn_weights(
    conv_w: torch.Tensor,
    conv_b: torch.Tensor | None,
    bn_rm: torch.Tensor,
    bn_rv: torch.Tensor,
    bn_eps: float,
    bn_w: torch.Tensor | None,
    bn_b: torch.Tensor | None,
    *,
    transpose: bool = False,
    groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a BatchNorm into the Conv (or ConvTranspose, ``transpose=True``) before it.

    ``bn_eps`` is the BatchNorm's own ``eps``: there is deliberately no default.
    ``conv_b`` None means the conv has no bias; ``bn_w``/``bn_b`` None mean affine=False.
    ``groups`` matters only for ConvTranspose, whose output channels are laid out per
    group. Returns (W', b') in ``conv_w``'s dtype.
    """
    s, t = batchnorm_scale_shift(bn_rm, bn_rv, bn_eps, bn_w, bn_b)
    if transpose:
        return fold_affine_weights(conv_w, conv_b, s, t, "iohw", groups)
    return fold_affine_weights(conv_w, conv_b, s, t, "oihw")


def fold_linear_bn_weights(
    linear_w: torch.Tensor,
    linear_b: torch.Tensor | None,
    bn_rm: torch.Tensor,
    bn_rv: torch.Tensor,
    bn_eps: float,
    bn_w: torch.Tensor | None,
    bn_b: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a BatchNorm1d into the Linear before it (weight [out_features, in_features])."""
    s, t = batchnorm_scale_shift(bn_rm, bn_rv, bn_eps, bn_w, bn_b)
    return fold_affine_weights(linear_w, linear_b, s, t, "nk")
