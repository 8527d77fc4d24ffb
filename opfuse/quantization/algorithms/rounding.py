"""AdaRound's relaxation, defined once for the two fits that learn an int8 weight's rounding:
the layer-wise one (:mod:`.adaround`, numpy) and block reconstruction (:mod:`.reconstruction`, torch).

Nagel et al., "Up or Down? Adaptive Rounding for Post-Training Quantization" (ICML 2020):

    Wq = s * (floor(W / s) + h),   h = h(V) = clip(sigmoid(V) (ZETA - GAMMA) + GAMMA, 0, 1)
    loss = E / E(round to nearest) + REGULARISER * mean(1 - |2 h - 1|^beta)

V starts where h(V) is the fractional part of W / s (so that Wq = W, :func:`initial_v`); no
regulariser for the first :data:`WARMUP` share of the steps, then beta falls linearly from
``BETA[0]`` to ``BETA[1]`` (:func:`beta_at`); at the end h is set to 0 or 1 (h >= 0.5 rounds up).
The functions take numpy arrays or torch tensors alike (``log`` is the library's own).

V is fitted by torch's Adam (:func:`optimiser`, at :data:`LEARNING_RATE`) in both fits: block
reconstruction differentiates its loss in torch; AdaRound computes its layer's gradient in numpy
(two matrix products a step) and hands it to the same optimiser. Without torch neither runs: the
step is refused with :func:`torch_missing`'s reason and the weights stay rounded to nearest.
"""

from __future__ import annotations

__all__ = ["ZETA", "GAMMA", "BETA", "WARMUP", "REGULARISER", "FRACTION_CLIP", "LEARNING_RATE", "initial_v",
           "warmup_steps", "beta_at", "optimiser", "torch_missing"]

import importlib.util

ZETA, GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch
BETA = (20.0, 2.0)  # the regulariser's exponent, annealed from the first to the second
WARMUP = 0.2  # share of the iterations without the regulariser
REGULARISER = 100.0  # lambda, against the loss normalised to round-to-nearest's
FRACTION_CLIP = (1e-4, 1 - 1e-4)  # W / s - floor(W / s), kept off 0 and 1 (V would be infinite)
LEARNING_RATE = 3e-3  # Adam's, for V: it bounds how far a weight travels from its float value


def initial_v(rest, log):
    """V with h(V) = ``rest`` (the fraction of W / s, clipped to :data:`FRACTION_CLIP`): ``log`` is
    numpy's or torch's."""
    return -log((ZETA - GAMMA) / (rest - GAMMA) - 1)


def warmup_steps(iterations: int) -> int:
    """Steps without the regulariser."""
    return int(iterations * WARMUP)


def beta_at(done: int, remaining: int) -> float:
    """The regulariser's exponent ``done`` steps after the warm-up, of ``remaining`` (at least 1)."""
    return BETA[1] + (BETA[0] - BETA[1]) * (1 - done / remaining)


def optimiser(groups):
    """The one optimiser of the rounding variables: ``torch.optim.Adam`` over ``groups`` (tensors, or
    torch's parameter groups with their own ``lr``), at :data:`LEARNING_RATE` where a group sets none."""
    import torch  # (torch: only a fit needs it; torch_missing says why not before)

    return torch.optim.Adam(groups, lr=LEARNING_RATE)


def torch_missing(step: str) -> str:
    """Why ``step`` (a fit of the rounding) cannot run here, or "" when torch is installed."""
    if importlib.util.find_spec("torch") is not None:
        return ""
    return (f"{step} did not run: torch is not installed (pip install 'opfuse[torch]'); "
            "the weights stay rounded to nearest")
