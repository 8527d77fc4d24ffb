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
tensor exposed), so memory does not grow with the samples; each bin counts as its centre.
Candidates are ``(lo * a, hi * b)`` for shrink factors ``a``, ``b`` in :data:`SHRINK`
(1.0 is MinMax itself), and the tensor's 99.99th percentile range (what ``percentile``
would give it). The best candidate per tensor is kept (:func:`search_ranges`); the
choice of each tensor goes into the report as a count per kind.

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

from opfuse.runtime import create_session

BINS = 4096
SHRINK = np.array([1.0, 0.995, 0.99, 0.98, 0.97, 0.95, 0.93, 0.9, 0.87, 0.84, 0.8, 0.75, 0.7, 0.65, 0.6,
                   0.55, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2, 0.15, 0.1])
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
    """Sum of squared round-trip errors of a histogram (``centres``, ``counts``) for each
    candidate range ``(lo[i], hi[i])``, the ranges widened to contain 0 as ONNX Runtime does."""
    lo = np.minimum(np.asarray(lo, np.float64), 0.0)[:, None]
    hi = np.maximum(np.asarray(hi, np.float64), 0.0)[:, None]
    scale = np.where(hi - lo > 0, (hi - lo) / levels, 1.0)
    zero = np.clip(np.rint(-lo / scale), 0, levels)
    q = np.clip(np.rint(centres[None, :] / scale) + zero, 0, levels)
    error = (q - zero) * scale - centres[None, :]
    return (error * error * counts[None, :]).sum(axis=1)


def _histograms(model: onnx.ModelProto, samples: Iterable[Mapping[str, np.ndarray]],
                extremes: Mapping[str, tuple[float, float]]) -> dict[str, np.ndarray]:
    """A histogram of :data:`BINS` bins over each tensor's (lo, hi), over every sample."""
    from opfuse.quantization.sqnr import _exposed  # (sqnr imports calibration, which imports nothing of this)

    names = sorted(extremes)
    session = create_session(_exposed(model, names), "disabled")
    counts = {n: np.zeros(BINS, np.float64) for n in names}
    for sample in samples:
        for name, value in zip(names, session.run(names, dict(sample))):
            lo, hi = extremes[name]
            if hi > lo:
                v = np.asarray(value, np.float64).ravel()
                counts[name] += np.histogram(v[np.isfinite(v)], bins=BINS, range=(lo, hi))[0]
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
        a, b = np.meshgrid(SHRINK, SHRINK, indexing="ij")
        cand_lo, cand_hi = list((lo * a).ravel()), list((hi * b).ravel())
        kinds = ["clipped"] * len(cand_lo)
        kinds[0] = "minmax"  # SHRINK[0] == 1.0 on both ends
        p_lo, p_hi = _percentile_range(centres, hist)
        cand_lo.append(p_lo)
        cand_hi.append(p_hi)
        kinds.append("percentile")
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
    from opfuse.quantization.sqnr import sqnr_db

    return sqnr_db(signal, float(noise))
