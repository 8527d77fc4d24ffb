"""Fitting a hardware profile's rates to a compiler's per-op figures (least squares).

What is fitted: the three numbers of :mod:`opfuse.cost.accelerator`'s kernel model,

    t_op = max(ops_op / peak, bytes_op / bandwidth) + launch

(``peak`` in operations per second, ``bandwidth`` in bytes per second, ``launch`` in
seconds), to one measured time per op, ``t_op = cycles_op / clock``. Each sample is one
op as a compiler reported it (Arm's Vela: its per-layer cycles at the system's clock)
with the op's work counted the way the cost model counts it: ``ops`` = 2 x MACs (or one
per output element for an op without MACs), ``bytes`` = the bytes of every tensor the op
reads and writes (int8 activations and weights, int32 biases).

How: least squares on the absolute times (so the ops that take the most time weigh the
most, as they do in a network's total), over a logarithmic grid of ``peak`` x
``bandwidth`` refined twice around the best point; for each grid point the best
``launch`` is closed-form (the mean residual, clipped at zero). The model is a max, not
a sum, so a linear solver does not apply; the grid is exhaustive over 4 decades of each
rate, so the fit cannot stop in a local minimum wider than one grid step.
"""

from __future__ import annotations

__all__ = ["OpSample", "RooflineFit", "fit_roofline"]

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class OpSample:
    """One op as a compiler measured it: its time, and its work as the cost model counts it."""

    name: str
    op: str
    seconds: float
    ops: float  # operations: 2 x MACs, or output elements
    bytes: float  # bytes read and written


@dataclasses.dataclass(frozen=True)
class RooflineFit:
    peak_ops_per_s: float
    bandwidth_bytes_per_s: float
    launch_s: float
    samples: int
    predicted_s: tuple[float, ...]  # per sample, in input order
    measured_s: tuple[float, ...]

    @property
    def total_error(self) -> float:
        """(sum predicted - sum measured) / sum measured over the samples."""
        measured = sum(self.measured_s)
        return (sum(self.predicted_s) - measured) / measured if measured else 0.0

    @property
    def median_op_error(self) -> float:
        """The median over ops of |predicted - measured| / measured."""
        errors = [abs(p - m) / m for p, m in zip(self.predicted_s, self.measured_s) if m > 0]
        return float(np.median(errors)) if errors else 0.0

    @property
    def rms_s(self) -> float:
        diff = np.asarray(self.predicted_s) - np.asarray(self.measured_s)
        return float(np.sqrt(np.mean(diff ** 2))) if len(diff) else 0.0


def fit_roofline(samples: Sequence[OpSample], *, grid: int = 81, refinements: int = 2) -> RooflineFit:
    """Least-squares fit of (peak, bandwidth, launch) to the samples (see the module docstring)."""
    if not samples:
        raise ValueError("no samples to fit")
    t = np.array([s.seconds for s in samples], dtype=np.float64)
    ops = np.array([s.ops for s in samples], dtype=np.float64)
    nbytes = np.array([s.bytes for s in samples], dtype=np.float64)
    # the grid is centred a decade above the median op's own rates (ops or bytes over its time)
    peak0 = max(float(np.median(ops[t > 0] / t[t > 0])), 1.0)
    bw0 = max(float(np.median(nbytes[t > 0] / t[t > 0])), 1.0)
    lo_p, hi_p = np.log10(peak0) - 1.0, np.log10(peak0) + 3.0
    lo_b, hi_b = np.log10(bw0) - 1.0, np.log10(bw0) + 3.0
    best = None
    for _ in range(refinements + 1):
        peaks = np.logspace(lo_p, hi_p, grid)
        bws = np.logspace(lo_b, hi_b, grid)
        # [peak, bw, sample]
        body = np.maximum(ops[None, None, :] / peaks[:, None, None], nbytes[None, None, :] / bws[None, :, None])
        launch = np.clip(np.mean(t[None, None, :] - body, axis=2), 0.0, None)
        sse = np.sum((body + launch[:, :, None] - t[None, None, :]) ** 2, axis=2)
        i, j = np.unravel_index(int(np.argmin(sse)), sse.shape)
        best = (float(peaks[i]), float(bws[j]), float(launch[i, j]))
        step_p = (hi_p - lo_p) / (grid - 1)
        step_b = (hi_b - lo_b) / (grid - 1)
        lo_p, hi_p = np.log10(best[0]) - 2 * step_p, np.log10(best[0]) + 2 * step_p
        lo_b, hi_b = np.log10(best[1]) - 2 * step_b, np.log10(best[1]) + 2 * step_b
    peak, bw, launch_s = best
    predicted = np.maximum(ops / peak, nbytes / bw) + launch_s
    return RooflineFit(peak, bw, launch_s, len(samples), tuple(float(p) for p in predicted),
                       tuple(float(x) for x in t))
