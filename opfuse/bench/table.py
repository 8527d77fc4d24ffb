"""Rendering ``opfuse bench`` results as rich tables: measured, predicted, per op type, per layer.

Measured numbers and predicted numbers never share a table: the measured one is what ONNX
Runtime did on this machine, the predicted ones are what a cost model says an accelerator
would do, and their titles say so.
"""

from __future__ import annotations

__all__ = ["print_result", "measured_table", "predicted_table", "op_profile_table", "layer_table"]

import math
import os

from rich import box
from rich.console import Console
from rich.table import Table

from opfuse.ablation import CONFIGS

MB = 1e6
WATCHED_OPS = ("BatchNormalization", "Relu", "Clip", "Add")  # the ops fusion removes


def print_result(result, console: Console | None = None, *, layers: int = 0) -> None:
    """Print every table of a :class:`~opfuse.bench.result.BenchResult`, then the notes."""
    console = console or Console()
    console.print(f"[bold]opfuse bench[/bold]: {result.model}, {result.dtype or 'unknown dtype'}")
    if result.measurement is not None:
        console.print(measured_table(result))
    for name in result.profiles:
        console.print(predicted_table(result, name))
    if result.op_profile:
        console.print(op_profile_table(result))
    if layers:
        console.print(layer_table(result, layers))
    for line in footnotes(result):
        console.print(line, highlight=False)


def measured_table(result) -> Table:
    m = result.measurement
    title = (f"Measured on this machine: ONNX Runtime CPU, {m.threads} threads, {m.rounds} interleaved "
             f"rounds after {m.warmup} warm-up runs")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("configuration")
    table.add_column("nodes", justify="right")
    table.add_column("median\nms", justify="right")
    table.add_column("min-max\nms", justify="right")
    table.add_column("speed-up\nvs none", justify="right")
    table.add_column("traffic MB\n(x ideal)", justify="right")
    table.add_column("achieved\nGB/s", justify="right")
    for r in result.rows:
        if r.kind in ("modelled", "hardware-fit"):
            continue
        traffic = r.traffic.total if r.traffic is not None and r.kind != "runtime" else None
        if r.timing is not None:
            t = r.timing
            latency, spread = _ms(t.median), f"{_ms(t.min)}-{_ms(t.max)}"
            speed = "1.00x" if r.key == "none" else _speedup(t.ratio)
            achieved = f"{traffic / (t.median * 1e-3) / 1e9:.2f}" if traffic else "-"
        elif r.same_as:
            latency, spread, speed, achieved = f"= {r.same_as}", "", "", ""
        else:
            latency, spread, speed, achieved = "-", "", "", ""
        label = r.label + (" [red]outputs differ![/red]" if r.mismatch else "")
        label += " [red]failed[/red]" if r.error else ""
        table.add_row(label, _int(r.nodes), latency, spread, speed, _traffic(traffic, result.ideal_bytes), achieved)
    if result.ideal_bytes:
        table.add_row("[dim]ideal bound[/dim]", "", "", "", "", _traffic(result.ideal_bytes, result.ideal_bytes), "")
    return table


def predicted_table(result, profile_name: str) -> Table:
    prof = result.profiles[profile_name]
    dtype = f"{prof.execution_dtype}, " if prof.execution_dtype else ""
    title = (f"Predicted for {prof.name}: a cost model's predictions, NOT measurements "
             f"({dtype}{prof.dram_bandwidth_gbps:g} GB/s DRAM, {_kib(prof.onchip_buffer_kib)} buffer, "
             f"{prof.launch_overhead_us:g} us/kernel)")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    show_chapter = result.chapter_applies and prof.name == "npu-chapter"
    table.add_column("configuration")
    table.add_column("kernels", justify="right")
    table.add_column("ms", justify="right")
    table.add_column("speed-up", justify="right")
    table.add_column("DRAM\nMB", justify="right")
    table.add_column("GB/s", justify="right")
    table.add_column("spills", justify="right")
    if show_chapter:
        table.add_column("chapter\nms (speed-up)", justify="right")
        table.add_column("chapter\nGB/s", justify="right")
        table.add_column("vs\nchapter", justify="right")
    base = result.row("none")
    base_pred = base.predictions.get(profile_name) if base is not None else None
    for r in result.rows:
        p = r.predictions.get(profile_name)
        if p is None:
            continue
        if r.same_as:
            cells = [r.label, _int(r.nodes), f"= {r.same_as}", "", "", "", ""]
        else:
            speed = base_pred.latency_s / p.latency_s if base_pred is not None else float("nan")
            cells = [
                r.label,
                str(len(p.kernels)),
                f"{p.latency_s * 1e3:.2f}",
                f"{speed:.2f}x",
                _mb(p.traffic_bytes),
                f"{p.bandwidth_gbps:.1f}",
                str(len(p.spilling)) if p.spilling else "-",
            ]
        if show_chapter:
            ch = r.chapter
            if ch is not None and not r.same_as:
                _, ms, gbps, speedup = ch
                cells += [f"{ms:g} ({speedup:.2f}x)", f"{gbps:g}", f"{(p.latency_s * 1e3 / ms - 1):+.1%}"]
            else:
                cells += ["", "", ""]
        table.add_row(*cells)
    return table


def op_profile_table(result) -> Table:
    configs = list(result.op_profile)
    table = Table(title="Kernel time per op type (ONNX Runtime profiler, ms per run, measured)",
                  title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("op type")
    for c in configs:
        table.add_column(c, justify="right")
    ops: dict[str, float] = {}
    for prof in result.op_profile.values():
        for op, ms in prof.items():
            ops[op] = max(ops.get(op, 0.0), ms)
    order = sorted(ops, key=lambda op: (op not in WATCHED_OPS, -ops[op]))
    for op in order:
        if ops[op] < 0.005:
            continue
        cells = []
        for c in configs:
            ms = result.op_profile[c].get(op)
            cells.append("-" if ms is None else f"{ms:.2f}")
        name = f"[bold]{op}[/bold]" if op in WATCHED_OPS else op
        table.add_row(name, *cells)
    totals = [f"{sum(result.op_profile[c].values()):.2f}" for c in configs]
    table.add_row("[dim]all kernels[/dim]", *totals)
    return table


def layer_table(result, count: int) -> Table:
    labels, data = result.layer_labels, result.layer_bytes
    configs = [c for c, values in data.items() if any(v is not None for v in values)]
    table = Table(title=f"Traffic per layer, MB (the {count} heaviest unfused layers)", title_justify="left",
                  box=box.SIMPLE_HEAD)
    table.add_column("layer")
    for c in configs:
        table.add_column(c, justify="right")
    base = data.get("none") or next(iter(data.values()), [])
    order = sorted(range(len(labels)), key=lambda i: -(base[i] or 0))[:count]
    for i in sorted(order):
        table.add_row(labels[i], *[_mb(data[c][i]) for c in configs])
    return table


def footnotes(result) -> list[str]:
    lines = []
    shown = [r.key for r in result.rows if r.kind == "config"]
    legend = "; ".join(
        f"{k} = {CONFIGS[k].label if CONFIGS[k].label != k else 'the model as given'}"
        + (f" ({', '.join(CONFIGS[k].passes)})" if CONFIGS[k].passes else "")
        for k in shown if k in CONFIGS
    )
    if legend:
        lines.append(f"- configurations: {legend}; ONNX Runtime optimisations disabled for all of them")
    for r in result.rows:
        if r.note and r.kind != "runtime":
            lines.append(f"- {r.label}: {r.note}")
        if r.mismatch:
            lines.append(f"- [red]{r.label}: outputs differ from none's: {r.mismatch}[/red]")
        if r.error:
            lines.append(f"- [red]{r.label}: could not run: {r.error}[/red]")
    if result.ideal_bytes:
        lines.append("- traffic: exact bytes each node reads and writes, from shape inference, in the "
                     "model's dtype; ideal = every weight read once + every activation written once and "
                     "read once (element-wise ops kept on chip, no feature map read twice)")
    if result.measurement is not None:
        lines.append("- speed-up vs none: median over rounds of none's time / this row's in the same "
                     "round; the A/A control row shows how far from 1.00x noise alone goes")
    if result.profiles:
        lines.append("- predicted rows: roofline (max of compute and DRAM time) + launch overhead per "
                     "kernel, plus spills; a model of an accelerator, not a measurement "
                     "(opfuse/targets/accelerator.py)")
    if result.chapter_applies and "npu-chapter" in result.profiles:
        lines.append("- the chapter's GB/s column is one byte count (~227 MB) over each latency, as if "
                     "fusion moved no fewer bytes; the model's is each configuration's own traffic")
    for note in result.notes:
        lines.append(f"- {note}")
    tail = f"took {result.elapsed_s:.0f} s"
    if result.load_average:
        tail += f"; load average during measurement {result.load_average[0]:.2f} (1 min) on {_cpus()} CPUs"
    lines.append(tail)
    return lines


def _speedup(ratio: float) -> str:
    if ratio is None or not math.isfinite(ratio) or ratio <= 0:
        return "-"
    return f"{1 / ratio:.2f}x"


def _ms(ms: float) -> str:
    return f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _traffic(n, ideal) -> str:
    if n is None:
        return "-"
    return f"{n / MB:.1f} ({n / ideal:.2f})" if ideal else f"{n / MB:.1f}"


def _mb(n) -> str:
    return "-" if n is None else f"{n / MB:.1f}"


def _int(n) -> str:
    return "-" if n is None else str(n)


def _kib(kib: float) -> str:
    return f"{kib / 1024:g} MiB" if kib >= 1024 else f"{kib:g} KiB"


def _cpus() -> int:
    return os.cpu_count() or 0
