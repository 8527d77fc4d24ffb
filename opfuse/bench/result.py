"""The result of ``opfuse bench``: one row per configuration, and its JSON schema.

A :class:`Row` is a configuration, the A/A control, one of ONNX Runtime's own levels, a
modelled row (the chapter's Conv+ReLU, :mod:`opfuse.bench.chapter`), a configuration
refitted to a hardware profile, or an int8 row and its float reference at ORT all
(:mod:`opfuse.bench.int8`); each says at which ONNX Runtime level it ran (``level``).
For an Ethos-U profile, :attr:`BenchResult.vela_rows` are Vela's estimates per configuration
and NPU beside opfuse's prediction (:mod:`opfuse.bench.ethos_u`).
Measured numbers (``timing``) and predictions (``predictions``, a cost model's) are
separate fields, and :meth:`BenchResult.to_dict` labels predictions as such.
"""

from __future__ import annotations

__all__ = ["Row", "BenchResult"]

import dataclasses
from typing import Any

import numpy as np

from opfuse.bench.chapter import CHAPTER
from opfuse.bench.options import BASELINE, ORT_ALL, BenchOptions


@dataclasses.dataclass
class Row:
    """One line of the table: a configuration, a runtime level, the control, or a modelled row."""

    key: str
    label: str
    kind: str  # "config" | "control" | "runtime" | "modelled" | "hardware-fit" | "reference" | "int8"
    nodes: int | None = None
    same_as: str | None = None  # the row whose graph this one is identical to
    note: str = ""
    timing: Any = None  # measure.Timing
    traffic: Any = None  # traffic.Traffic
    predictions: dict[str, Any] = dataclasses.field(default_factory=dict)  # profile -> Prediction
    mismatch: str | None = None
    error: str | None = None
    report_summary: str = ""
    level: str = "disabled"  # the ONNX Runtime optimisation level it was measured at
    int8: Any = None  # int8.Int8Facts of an int8 row

    @property
    def chapter(self) -> tuple[str, float, float, float] | None:
        return CHAPTER.get(self.key)


@dataclasses.dataclass
class BenchResult:
    model: str
    builtin: bool
    options: BenchOptions
    rows: list[Row]
    profiles: dict[str, Any]  # name -> HardwareProfile
    ideal_bytes: int | None
    measurement: Any = None  # measure.Measurement
    op_profile: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    layer_labels: list[str] = dataclasses.field(default_factory=list)
    layer_bytes: dict[str, list[int | None]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0
    load_average: tuple[float, float, float] | None = None
    dtype: str = ""
    vela_rows: list[Any] = dataclasses.field(default_factory=list)  # ethos_u.VelaRow: Vela's figures per config x NPU

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)

    @property
    def chapter_applies(self) -> bool:
        """The chapter's table is ResNet-50 at batch 1, 224x224."""
        o = self.options
        return self.builtin and o.builtin == "resnet50" and o.batch == 1 and o.image_size == 224

    def to_dict(self) -> dict[str, Any]:
        opts = dataclasses.asdict(self.options)
        rows = []
        for r in self.rows:
            item: dict[str, Any] = {
                "key": r.key,
                "label": r.label,
                "kind": r.kind,
                "nodes": r.nodes,
                "same_as": r.same_as,
                "note": r.note,
                "level": r.level,
                "measured": None if r.timing is None else {**r.timing.to_dict(), **_vs_ort_all(self, r)},
                "outputs_match_baseline": None if r.timing is None or r.int8 is not None else r.mismatch is None,
                "mismatch": r.mismatch,
                "error": r.error,
                "fusion": r.report_summary,
                "int8": None if r.int8 is None else r.int8.to_dict(),
                "traffic": None if r.traffic is None else {
                    **r.traffic.summary(),
                    "ratio_to_ideal": (r.traffic.total / self.ideal_bytes) if self.ideal_bytes else None,
                    "per_node": [n.to_dict() for n in r.traffic.nodes],
                },
                "predicted": {
                    name: {**p.to_dict(), "speedup": _speedup(self, name, r.key),
                           "per_layer_ms": {k: v * 1e3 for k, v in p.per_layer().items()},
                           "note": "a cost model's prediction, not a measurement"}
                    for name, p in r.predictions.items()
                },
            }
            if r.timing is not None and r.traffic is not None and r.timing.median > 0:
                item["achieved_gbps"] = r.traffic.total / (r.timing.median * 1e-3) / 1e9
            if r.chapter is not None and self.chapter_applies:
                row, ms, gbps, speedup = r.chapter
                item["chapter"] = {"row": row, "latency_ms": ms, "bandwidth_gbps": gbps, "speedup": speedup}
            rows.append(item)
        return {
            "model": self.model,
            "dtype": self.dtype,
            "options": opts,
            "elapsed_s": self.elapsed_s,
            "load_average": self.load_average,
            "threads": self.options.threads,
            "ideal_traffic_bytes": self.ideal_bytes,
            "ideal_definition": "every weight read once + every activation written once and read once "
                                "(see opfuse.cost.traffic)",
            "rows": rows,
            "op_profile_ms_per_run": self.op_profile,
            "traffic_per_layer": {"layers": self.layer_labels, "bytes": self.layer_bytes},
            "hardware": {name: p.to_dict() for name, p in self.profiles.items()},
            "vela": [r.to_dict() for r in self.vela_rows],
            "notes": list(self.notes),
        }


def _vs_ort_all(result: BenchResult, row: Row) -> dict[str, Any]:
    """The paired ratio to the float model at ORT all, for a row measured at that level."""
    m = result.measurement
    if m is None or row.level != "all" or ORT_ALL not in m.timings or row.key == ORT_ALL:
        return {}
    ratios = m.paired(row.key, ORT_ALL)
    if not ratios:
        return {}
    lo, hi = np.percentile(ratios, [25, 75])
    return {"ratio_to_ort_all": m.ratio(row.key, ORT_ALL), "ratio_to_ort_all_iqr": [float(lo), float(hi)]}


def _speedup(result: BenchResult, profile: str, key: str) -> float | None:
    base = result.row(BASELINE)
    row = result.row(key)
    if base is None or row is None or profile not in base.predictions or profile not in row.predictions:
        return None
    return base.predictions[profile].latency_s / row.predictions[profile].latency_s

