"""The quantisation report: the fold log, then what int8 cost, layer by layer, and why.

A :class:`QuantReport` holds the :class:`~opfuse.report.FusionReport` of the folding
(and equalisation) stage unchanged, then the quantisation: the preset, each layer's SQNR
and cost with its precision and the reason for it, the steps of the mixed-precision
search, the bias correction, how much of the weights is stored in 8 bits, and the
verification on held-out samples. It renders as JSON (``to_json``) and as rich tables
(:func:`print_quant_report`).
"""

from __future__ import annotations

__all__ = ["LayerRow", "SearchStep", "RankedCandidate", "QuantVerification", "QuantReport", "print_quant_report"]

import dataclasses
from typing import Any

from rich.markup import escape
from rich.console import Console
from rich.table import Table

from opfuse.report import FusionReport, json_text, print_report

INFINITE_DB = 200.0  # the SQNR shown for identical outputs (opfuse.quantization.qdq.sqnr.INFINITE)


@dataclasses.dataclass
class LayerRow:
    """One quantised (or deliberately not quantised) node."""

    name: str
    op_type: str
    sqnr_db: float  # SQNR of its output against the float model, per channel, calibration samples
    own_sqnr_db: float  # SQNR of the noise it adds itself (lower is costlier; opfuse.quantization.qdq.sqnr)
    precision: str  # "int8", "float" or "int16 activations"
    reason: str = ""
    gain_db: float | None = None  # output SQNR gained by keeping it alone (measured when the search ran)


    @property
    def cost(self) -> str:
        """What this layer costs, as the search measured it, in a few words."""
        if self.gain_db is not None:
            return f"keeping it alone gains {self.gain_db:+.1f} dB"
        return f"its own noise at {self.own_sqnr_db:.1f} dB SQNR"


@dataclasses.dataclass
class SearchStep:
    """One trial of the mixed-precision search."""

    kept: list[str]  # layers kept out of int8 in this trial
    sqnr_db: float  # output SQNR on the tuning samples
    metric: float | None = None
    calibration: str = ""  # the calibration method of this trial
    added: list[str] = dataclasses.field(default_factory=list)  # what this trial adds to the kept set
    phase: str = ""  # "calibration", "base", "sensitivity" (a candidate alone) or "step" (the walk)
    accepted: bool | None = None  # a step: taken (the tuning SQNR rose) or not
    check_sqnr_db: float | None = None  # an accepted step: output SQNR on the check samples


@dataclasses.dataclass
class RankedCandidate:
    """One candidate of the sensitivity ranking, measured by re-quantising with it kept."""

    label: str  # a node, or "every OP"
    nodes: list[str]
    gain_db: float  # tuning output SQNR with it kept, minus without
    kept_before: int  # layers already kept when it was measured
    metric: float | None = None


@dataclasses.dataclass
class QuantVerification:
    """Output SQNR of the written model on samples the calibration never saw."""

    samples: int
    outputs: dict[str, float]  # output name -> SQNR in dB
    sqnr_db: float  # over all outputs
    min_sqnr_db: float | None
    runtime: str
    metric: float | None = None
    min_metric: float | None = None
    # a device (qnn, ethos-u): the figure above is the device's; these, the QDQ model on ONNX Runtime's CPU
    cpu_qdq_sqnr_db: float | None = None  # CPU QDQ vs float
    htp_vs_cpu_sqnr_db: float | None = None  # the HTP's outputs vs the CPU QDQ's
    floor_sqnr_db: float | None = None  # with no --min-sqnr: below it the result is no model of the float one
    unjudged: str | None = None  # why the SQNR cannot judge this quantisation (the floor then not applied)

    @property
    def ok(self) -> bool:
        sqnr_ok = self.min_sqnr_db is None or self.sqnr_db >= self.min_sqnr_db
        sqnr_ok = sqnr_ok and (self.floor_sqnr_db is None or self.sqnr_db >= self.floor_sqnr_db)
        metric_ok = self.min_metric is None or (self.metric is not None and self.metric >= self.min_metric)
        return sqnr_ok and metric_ok


@dataclasses.dataclass
class ReconstructionFacts:
    """What block reconstruction (:mod:`.reconstruction`) did: per block, its layers and its
    outputs' SQNR before and after; the tuning output SQNR without and with it."""

    blocks: list[dict]
    layers: int
    sqnr_db: tuple[float, float]
    kept: bool
    stopped: str  # why it ends before the graph does ("": it covers it)
    weighted: bool  # errors weighted by the float outputs' sensitivity
    unweighted_reason: str
    seconds: float
    samples: int


@dataclasses.dataclass
class QuantReport:
    model: str = ""
    preset: str = ""
    calibration: str = ""  # the calibration method used: minmax, percentile or entropy
    fusion: FusionReport = dataclasses.field(default_factory=FusionReport)
    calibration_samples: int = 0
    tuning_samples: int = 0  # with a search: the calibration samples it tuned on
    check_samples: int = 0  # with a search: those its stopping test ran on
    notes: list[str] = dataclasses.field(default_factory=list)
    layers: list[LayerRow] = dataclasses.field(default_factory=list)
    search: list[SearchStep] = dataclasses.field(default_factory=list)
    ranking: list[RankedCandidate] = dataclasses.field(default_factory=list)
    search_stopped: str = ""  # with a search: why it ended (met, out of steps, no candidate left)
    range_kinds: dict[str, int] = dataclasses.field(default_factory=dict)  # --calibrate auto: tensors per chosen kind of range
    adaround_layers: int = 0  # layers whose AdaRound rounding was kept
    adaround_sqnr_db: tuple[float, float] | None = None  # tuning output SQNR without -> with
    adaround_errors: list[dict] = dataclasses.field(default_factory=list)  # per layer: nearest vs AdaRound
    reconstruction: ReconstructionFacts | None = None
    steps: list[dict] = dataclasses.field(default_factory=list)  # each step's outcome: step, ran, reason
    bias_corrected: int = 0
    bias_skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    bias_sqnr_db: tuple[float, float] | None = None  # calibration output SQNR without -> with
    weights_8bit: int = 0
    weights_total: int = 0
    bytes_float: int = 0
    bytes_quantized: int = 0
    quantize_linear: int = 0
    shipped_sqnr_db: float | None = None  # a dynamic int8 model: the dequantised reference against the shipped one
    verification: QuantVerification | None = None
    device: Any = None  # qnn: the HTP compile log of the quantised model (opfuse.targets.qnn.compile.HtpCompileLog)

    @property
    def weights_8bit_fraction(self) -> float:
        return self.weights_8bit / self.weights_total if self.weights_total else 0.0

    @property
    def size_ratio(self) -> float:
        return self.bytes_quantized / self.bytes_float if self.bytes_float else 0.0

    def kept(self) -> list[LayerRow]:
        return [r for r in self.layers if r.precision != "int8"]

    def costliest(self, n: int = 5) -> list[LayerRow]:
        """By the output SQNR keeping them alone would gain where the search measured it,
        else by the noise they add."""
        if any(r.gain_db is not None for r in self.layers):
            return sorted((r for r in self.layers if r.gain_db is not None), key=lambda r: -r.gain_db)[:n]
        return sorted(self.layers, key=lambda r: r.own_sqnr_db)[:n]

    @property
    def nothing_quantised(self) -> bool:
        return self.quantize_linear == 0

    def summary(self) -> str:
        v = self.verification
        sqnr = f"output SQNR {v.sqnr_db:.1f} dB on {v.samples} held-out sample(s)" if v else "not verified"
        if self.nothing_quantised:
            return f"{self.preset}: nothing was quantised (no QuantizeLinear in the model written); " + \
                ("the outputs equal the float model's" if v and v.sqnr_db >= INFINITE_DB else sqnr)
        return (f"{self.preset}: {len(self.layers) - len(self.kept())} of {len(self.layers)} layers in int8, "
                f"{len(self.kept())} kept; weights {100 * self.weights_8bit_fraction:.0f}% 8-bit; "
                f"size {self.size_ratio:.2f}x; {sqnr}")

    def to_dict(self) -> dict[str, Any]:
        out = {
            "model": self.model,
            "preset": self.preset,
            "calibration_method": self.calibration,
            "summary": {
                "layers": len(self.layers),
                "kept": len(self.kept()),
                "weights_8bit_fraction": self.weights_8bit_fraction,
                "size_ratio": self.size_ratio,
                "quantize_linear": self.quantize_linear,
                "output_sqnr_db": None if self.verification is None or self.nothing_quantised
                else self.verification.sqnr_db,
                "nothing_quantised": self.nothing_quantised,
                "verified": None if self.verification is None else self.verification.ok,
            },
            "fusion": self.fusion.to_dict(),
            "calibration_samples": self.calibration_samples,
            "tuning_samples": self.tuning_samples,
            "check_samples": self.check_samples,
            "notes": list(self.notes),
            "steps": [dict(s) for s in self.steps],
            "layers": [dataclasses.asdict(r) for r in self.layers],
            "search": [dataclasses.asdict(s) for s in self.search],
            "ranking": [dataclasses.asdict(r) for r in self.ranking],
            "search_stopped": self.search_stopped,
            "ranges": dict(self.range_kinds),
            "adaround": {"layers": self.adaround_layers, "output_sqnr_db": self.adaround_sqnr_db,
                         "per_layer": list(self.adaround_errors)},
            "reconstruction": None if self.reconstruction is None else dataclasses.asdict(self.reconstruction),
            "bias_correction": {"layers": self.bias_corrected, "skipped": dict(self.bias_skipped),
                                "output_sqnr_db": self.bias_sqnr_db},
            "weights": {"8bit": self.weights_8bit, "total": self.weights_total},
            "bytes": {"float": self.bytes_float, "quantized": self.bytes_quantized},
            "shipped_sqnr_db": self.shipped_sqnr_db,
            "verification": None if self.verification is None else self._verification_dict(),
            **({"device": self.device.to_dict()} if self.device is not None else {}),
        }
        return out

    def _verification_dict(self) -> dict[str, Any]:
        """The verification, where an SQNR of :data:`INFINITE_DB` (outputs equal to the float
        model's, as when nothing was quantised) is null and said by ``outputs_equal_float``."""
        v = self.verification
        out = {**dataclasses.asdict(v), "ok": v.ok, "outputs_equal_float": v.sqnr_db >= INFINITE_DB}
        out["sqnr_db"] = None if v.sqnr_db >= INFINITE_DB else v.sqnr_db
        out["outputs"] = {name: None if db >= INFINITE_DB else db for name, db in v.outputs.items()}
        return out

    def to_json(self, indent: int = 2) -> str:
        return json_text(self.to_dict(), indent)


def print_quant_report(report: QuantReport, console=None, *, verbose: bool = False) -> None:
    console = console or Console()
    print_report(report.fusion, console, verbose=verbose)
    console.print(f"[bold]quantisation[/bold]  preset={report.preset}  "
                  f"calibration={report.calibration_samples} sample(s), {report.calibration}")
    rows = report.layers if verbose else report.costliest(12)
    if rows:
        title = "Layers" if verbose else f"Layers, costliest first ({len(report.layers)} in all; -v lists every one)"
        table = Table(title=title, title_justify="left")
        for col, justify in (("layer", "left"), ("op", "left"), ("SQNR dB", "right"),
                             ("own SQNR dB", "right"), ("kept alone +dB", "right"), ("precision", "left"),
                             ("why", "left")):
            table.add_column(col, justify=justify)
        for r in rows:
            style = "yellow" if r.precision != "int8" else ""
            gain = "" if r.gain_db is None else f"{r.gain_db:+.2f}"
            table.add_row(r.name, r.op_type, f"{r.sqnr_db:.1f}", f"{r.own_sqnr_db:.1f}", gain, r.precision,
                          r.reason, style=style)
        console.print(table)
    if report.ranking:
        top = sorted(report.ranking, key=lambda r: -r.gain_db)[:8]
        console.print(f"sensitivity (each candidate kept alone, re-quantised; {len(report.ranking)} measured): "
                      + ", ".join(f"{r.label} {r.gain_db:+.2f} dB" for r in top))
    walk = [s for s in report.search if s.phase in ("base", "step")]
    if len(walk) > 1:
        steps = "; ".join(f"+{','.join(s.added) or '-'} {s.sqnr_db:.1f} dB "
                          + (f"(check {s.check_sqnr_db:.1f})" if s.accepted else "(not taken)")
                          for s in walk)
        console.print(f"mixed precision, tuning SQNR per step: {steps}")
    if report.range_kinds:
        console.print("activation ranges per tensor: " + ", ".join(f"{n} {k}" for k, n in report.range_kinds.items()))
    if report.adaround_sqnr_db is not None:
        before, after = report.adaround_sqnr_db
        console.print(f"AdaRound: {report.adaround_layers} layer(s) rounded to reconstruct their float output; "
                      f"tuning output SQNR {before:.1f} -> {after:.1f} dB"
                      + ("" if after > before else " (not applied: it did not raise it)"))
    if report.reconstruction is not None:
        r = report.reconstruction
        before, after = r.sqnr_db
        console.print(f"block reconstruction: {len(r.blocks)} block(s), {r.layers} layer(s) on {r.samples} sample(s) "
                      f"in {r.seconds:.0f} s; tuning output SQNR {before:.1f} -> {after:.1f} dB"
                      + ("" if r.kept else " (not applied: it did not raise it)")
                      + (f"; it stops at {r.stopped}" if r.stopped else "")
                      + ("" if r.weighted else f"; every channel weighted alike ({r.unweighted_reason})"))
    if report.bias_sqnr_db is not None:
        before, after = report.bias_sqnr_db
        console.print(f"bias correction: {report.bias_corrected} layer(s); calibration output SQNR "
                      f"{before:.1f} -> {after:.1f} dB")
    console.print(f"weights: {100 * report.weights_8bit_fraction:.1f}% of Conv/ConvTranspose/Gemm/MatMul "
                  f"weight elements stored as 8-bit integers; file {report.size_ratio:.2f}x the float model; "
                  f"{report.quantize_linear} QuantizeLinear")
    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {escape(note)}")  # (a note may hold "[torch]": text, not markup)
    if report.device is not None:
        report.device.render(console)
    v = report.verification
    if v is not None and report.nothing_quantised:
        console.print(f"verification: nothing was quantised; output SQNR {v.sqnr_db:.1f} dB on {v.samples} "
                      "held-out sample(s)" if v.sqnr_db < INFINITE_DB else
                      "verification: nothing was quantised; the outputs equal the float model's")
    elif v is not None:
        status = "[green]passed[/green]" if v.ok else "[red]FAILED[/red]"
        if v.ok and v.unjudged:
            status = "[yellow]not judged[/yellow] (the float outputs are below one int8 step: see the note)"
        limit = f" (minimum {v.min_sqnr_db:g} dB)" if v.min_sqnr_db is not None else " (no minimum set)"
        per = ", ".join(f"{k} {x:.1f}" for k, x in list(v.outputs.items())[:4])
        metric = f"; metric {v.metric:.4g} (minimum {v.min_metric:g})" if v.min_metric is not None else ""
        console.print(f"verification: {status}: output SQNR {v.sqnr_db:.1f} dB{limit} on {v.samples} held-out "
                      f"sample(s), {v.runtime} [{per}]{metric}")
        if v.cpu_qdq_sqnr_db is not None:
            console.print(f"  beside it: ONNX Runtime's CPU runs the same QDQ model at {v.cpu_qdq_sqnr_db:.1f} dB "
                          f"({v.sqnr_db - v.cpu_qdq_sqnr_db:+.1f} dB on the device); the device's and the CPU's "
                          f"outputs agree to {v.htp_vs_cpu_sqnr_db:.1f} dB")
        if not v.ok:
            worst = ", ".join(f"{r.name} ({r.cost})" for r in report.costliest(5))
            console.print(f"  [red]costliest layers:[/red] {worst}")
