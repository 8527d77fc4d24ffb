"""Weight ranges chosen per layer by the error of the layer's output, not the weight's extremes.

ONNX Runtime's quantiser gives a weight the scale of its extremes: ``s = max|W| / 127``
(symmetric int8), or ``(max W - min W) / 255`` (uint8, asymmetric), per tensor or per
output channel. One large weight then sets the step for all the others. Here the scale is
shrunk by the factor ``f`` in :data:`FACTORS` (1 down to 0.5) that minimises the layer's
output error on calibration data, the rounding to nearest in place:

    Wq(f) = (clip(round(W / (f s)) + z, lo, hi) - z) * f s
    error(f) = mean over positions p of ( act(Wq(f) xq_p + b) - act(W x_p + b) )^2

with ``xq`` the layer's input in the QDQ model and ``x`` the float model's (the data
:mod:`.adaround` collects), ``act`` the Relu or Clip after the layer (nothing otherwise)
and ``b`` the float bias. Scaling a range by ``f`` keeps its zero point (``z = round(-lo /
s)`` is the same for ``f lo`` and ``f s``), so the asymmetric uint8 weights of the ``qnn``
preset shrink the same way. Per-tensor weights take one factor (the error summed over the
output channels); per-channel weights one per channel: with a per-channel clamp the error
is a sum over channels, so each channel's factor is chosen alone.

Legality: ``f = 1`` (ONNX Runtime's own scale) is a candidate, so the error on the data
searched never rises; the factor is kept only if the error on positions the search did
not see (:func:`choose_factors`' ``check``) does not rise either. The bias is int32 with
the scale ``x_scale * w_scale`` (what ONNX Runtime's QDQ-to-QLinearConv fusion assumes):
a new weight scale writes a new bias scale and the bias requantised to it
(:mod:`.adaround` does the writing).
"""

from __future__ import annotations

__all__ = ["FACTORS", "choose_factors", "layer_error"]

import numpy as np

FACTORS = np.round(np.linspace(1.0, 0.5, 26), 3)
SEARCH_POSITIONS = 4096  # positions the factor is chosen on (a fixed subset of the training ones)


def layer_error(wq: np.ndarray, x: np.ndarray, t: np.ndarray, b: np.ndarray, clamp) -> np.ndarray:
    """Mean squared output error per output channel, [groups, out/group], of the weights
    ``wq`` [g, o, K] on patches ``x`` [g, K, P] against the targets ``t`` [g, o, P]."""
    y = wq.astype(np.float32) @ x + b
    if clamp is not None:
        y = np.clip(y, *clamp)
    return np.mean(np.square(y - t, dtype=np.float32), axis=-1, dtype=np.float64)


def _rounded(w, scale, zero, levels):
    return (np.clip(np.rint(w / scale) + zero, *levels) - zero) * scale


def choose_factors(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, levels: tuple[int, int], per_channel: bool,
                   train: tuple, check: tuple, clamp) -> np.ndarray:
    """The factor per output channel, [groups, out/group] (one value repeated when the
    weight is quantised per tensor); 1 where the chosen factor does not hold on ``check``.
    ``train`` and ``check``: (patches, targets, bias) as :func:`layer_error` takes them."""
    x, t, b = train
    if x.shape[-1] > SEARCH_POSITIONS:
        x, t = x[..., :SEARCH_POSITIONS], t[..., :SEARCH_POSITIONS]
    errors = np.stack([layer_error(_rounded(w, scale * f, zero, levels), x, t, b, clamp) for f in FACTORS])
    if per_channel:
        best = FACTORS[np.argmin(errors, axis=0)]
    else:
        best = np.full(errors.shape[1:], FACTORS[np.argmin(errors.sum(axis=(1, 2)))])
    xc, tc, bc = check
    before = layer_error(_rounded(w, scale, zero, levels), xc, tc, bc, clamp)
    after = layer_error(_rounded(w, scale * best[..., None], zero, levels), xc, tc, bc, clamp)
    if per_channel:
        return np.where(after <= before, best, 1.0)
    return best if after.sum() <= before.sum() else np.ones_like(best)
