"""Activation ranges chosen per tensor by the quantisation error of that tensor.

ONNX Runtime's calibrators give every tensor the range of one method (MinMax: the extremes
seen; Percentile: the 99.99th percentile), one method for the whole model. Here each
tensor's range is the clipping range whose 8-bit round trip is closest to the tensor's
own values on the calibration samples (an MSE search, as NNCF's and TensorRT's
"mse"-style calibrators do):

    error(lo, hi) = sum over values v of ( v - DQ(Q(v; lo, hi)) )^2

    Q(v) = clip(round(v / s) + z, 0, 255),   s = (hi - lo) / 255,   z = round(-lo / s)
    DQ(q) = (q - z) * s

which is what the uint8 QuantizeLinear/DequantizeLinear pair ONNX Runtime writes computes
for a range (lo, hi) that contains 0 (it widens a range to contain 0 itself).

The values of a tensor are summarised by a histogram of :data:`BINS` bins over its MinMax
range (the calibration samples run once more through the float model, every wanted
tensor exposed), so memory does not grow with the samples. Exact zeros are counted apart
(the zero point represents them exactly: a Relu's output is often half zeros); a value
inside the range costs the rounding error of a uniform step, ``s^2 / 12``, one outside it
its distance to the range squared (each bin counted at its centre), which holds whether
the step is finer or coarser than a bin. Candidates are MinMax itself, the tensor's
99.99th percentile range (what ``percentile`` would give it), and ranges clipped inside
MinMax by the factors :data:`SHRINK` (from 1 down to 0.005: one outlier in millions of
values can sit 100 times above the rest), searched by coordinate descent (the upper
bound, then the lower, then the upper again). The best candidate per tensor is kept
(:func:`search_ranges`); MinMax wins a tie; the choices go into the report as a count per
kind.

The result is written as ONNX Runtime's own calibration cache (``TensorsData``, method
MinMax, ``lowest``/``highest`` replaced), which its quantiser reads like any other.
"""

from __future__ import annotations

__all__ = ["RangeChoice", "search_ranges", "quantisation_error", "BINS", "SHRINK"]

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
from onnxruntime.quantization.calibrate import CalibrationMethod, TensorData, TensorsData

from opfuse.quantization.qdq.layers import exposed
from opfuse.quantization.qdq.sqnr import sqnr_db
from opfuse.runtime import create_session

BINS = 4096
SHRINK = np.concatenate([np.linspace(1.0, 0.3, 36), np.geomspace(0.28, 0.005, 30)])
PERCENTILE = 99.99
LEVELS = 255  # uint8 activations


@dataclasses.dataclass
class RangeChoice:
    """One tensor's range: the chosen (lo, hi), MinMax's, and which candidate won."""

    tensor: str
    lo: float
    hi: float
    minmax: tuple[float, float]
    kind: str  # "minmax", "percentile" or "clipped" (an MSE-search candidate inside MinMax)
    error_db: float  # the chosen range's SQNR on the tensor itself
    minmax_error_db: float


def quantisation_error(centres: np.ndarray, counts: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                       levels: int = LEVELS) -> np.ndarray:
    """Estimated sum of squared round-trip errors of the non-zero values of a histogram
    (``centres``, ``counts``) for each candidate range ``(lo[i], hi[i])`` (widened to
    contain 0, as ONNX Runtime does): ``s^2 / 12`` a value inside, the squared distance
    to the range a value outside."""
    lo = np.minimum(np.asarray(lo, np.float64), 0.0)[:, None]
    hi = np.maximum(np.asarray(hi, np.float64), 0.0)[:, None]
    scale = (hi - lo) / levels
    c = centres[None, :]
    outside = np.where(c < lo, lo - c, np.where(c > hi, c - hi, 0.0))
    inside = (c >= lo) & (c <= hi)
    return (counts[None, :] * np.where(inside, scale * scale / 12, outside * outside)).sum(axis=1)


def _histograms(model: onnx.ModelProto, samples: Iterable[Mapping[str, np.ndarray]],
                extremes: Mapping[str, tuple[float, float]]) -> dict[str, np.ndarray]:
    """A histogram of :data:`BINS` bins over each tensor's (lo, hi), over every sample."""
    names = sorted(extremes)
    session = create_session(exposed(model, names), "disabled")
    counts = {n: np.zeros(BINS, np.float64) for n in names}
    for sample in samples:
        for name, value in zip(names, session.run(names, dict(sample))):
            lo, hi = extremes[name]
            if hi > lo:
                v = np.asarray(value, np.float64).ravel()
                v = v[np.isfinite(v) & (v != 0)]  # exact zeros cost nothing (the zero point)
                counts[name] += np.histogram(v, bins=BINS, range=(lo, hi))[0]
    return counts


def search_ranges(model: onnx.ModelProto, samples, minmax: TensorsData) -> tuple[TensorsData, list[RangeChoice]]:
    """(ONNX Runtime ranges with each tensor's best clipping range, the choice per tensor).

    ``minmax``: ONNX Runtime's MinMax ranges of the tensors it calibrates (their names are
    the tensors searched). A tensor that is constant on the samples keeps its range."""
    extremes = {}
    for name, data in minmax.items():
        lo, hi = (float(np.asarray(v).reshape(-1)[0]) for v in data.range_value)
        extremes[name] = (lo, hi)
    counts = _histograms(model, samples, extremes)
    ranges, choices = {}, []
    for name, (lo, hi) in extremes.items():
        hist = counts.get(name)
        if hist is None or hi <= lo or hist.sum() == 0:
            ranges[name] = minmax[name]
            continue
        edges = np.linspace(lo, hi, BINS + 1)
        centres = (edges[:-1] + edges[1:]) / 2
        p_lo, p_hi = _percentile_range(centres, hist)
        best_lo, best_hi = lo, hi
        for _ in range(3):  # coordinate descent: the upper bound, the lower, the upper again
            for bound in ("hi", "lo"):
                if (bound == "hi" and hi <= 0) or (bound == "lo" and lo >= 0):
                    continue
                grid_lo = lo * SHRINK if bound == "lo" else np.full(len(SHRINK), best_lo)
                grid_hi = hi * SHRINK if bound == "hi" else np.full(len(SHRINK), best_hi)
                pick = int(np.argmin(quantisation_error(centres, hist, grid_lo, grid_hi)))
                best_lo, best_hi = float(grid_lo[pick]), float(grid_hi[pick])
        cand_lo, cand_hi = [lo, p_lo, best_lo], [hi, p_hi, best_hi]
        kinds = ["minmax", "percentile", "clipped"]
        errors = quantisation_error(centres, hist, np.array(cand_lo), np.array(cand_hi))
        best = int(np.argmin(errors))  # the first of equals: MinMax wins a tie
        signal = float((centres * centres * hist).sum())
        choice = RangeChoice(name, cand_lo[best], cand_hi[best], (lo, hi), kinds[best],
                             _db(signal, errors[best]), _db(signal, errors[0]))
        choices.append(choice)
        dtype = np.asarray(minmax[name].range_value[0]).dtype
        ranges[name] = TensorData(lowest=np.array(choice.lo, dtype=dtype), highest=np.array(choice.hi, dtype=dtype))
    return TensorsData(CalibrationMethod.MinMax, ranges), choices


def _percentile_range(centres: np.ndarray, hist: np.ndarray) -> tuple[float, float]:
    """The range that leaves out the rarest (100 - PERCENTILE)% of the values, half each side."""
    cdf = np.cumsum(hist) / hist.sum()
    tail = (100.0 - PERCENTILE) / 200.0
    lo = centres[min(int(np.searchsorted(cdf, tail)), len(centres) - 1)]
    hi = centres[min(int(np.searchsorted(cdf, 1.0 - tail)), len(centres) - 1)]
    return float(min(lo, 0.0) if centres[0] >= 0 else lo), float(hi)


def _db(signal: float, noise: float) -> float:
    return sqnr_db(signal, float(noise))
