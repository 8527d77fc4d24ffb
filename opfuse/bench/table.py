"""Rendering ``opfuse bench`` results as rich tables: measured, predicted, per op type, per layer.

Measured numbers and predicted numbers never share a table: the measured one is what ONNX
Runtime did on this machine, the predicted ones are what a cost model says an accelerator
would do, and their titles say so.
"""

from __future__ import annotations

__all__ = ["print_result", "measured_table", "predicted_table", "vela_table", "int8_table", "op_profile_table", "layer_table"]

import math
import os

from rich import box
from rich.console import Console
from rich.table import Table

from opfuse.bench.ablation import CONFIGS
from opfuse.bench.int8 import FLOAT_SOURCE
from opfuse.bench.options import BASELINE, CONTROL, ORT_ALL

MB = 1e6
WATCHED_OPS = ("BatchNormalization", "Relu", "Clip", "Add")  # the ops fusion removes


def print_result(result, console: Console | None = None, *, layers: int = 0) -> None:
    """Print every table of a :class:`~opfuse.bench.result.BenchResult`, then the notes."""
    console = console or Console()
    console.print(f"[bold]opfuse bench[/bold]: {result.model}, {result.dtype or 'unknown dtype'}")
    if result.measurement is not None:
        console.print(measured_table(result))
    for name, prof in result.profiles.items():
        if getattr(prof, "vela", None) and any(r.profile == name for r in result.vela_rows):
            console.print(vela_table(result, name))  # the prediction is beside Vela's figures there
        else:
            console.print(predicted_table(result, name))
    if any(r.int8 is not None for r in result.rows):
        console.print(int8_table(result))
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
    at_all = ORT_ALL in m.timings and any(r.level == "all" and r.kind != "runtime" for r in result.rows)
    table.add_column("configuration")
    table.add_column("ORT\nlevel")
    table.add_column("nodes", justify="right")
    table.add_column("median\nms", justify="right")
    table.add_column("min-max\nms", justify="right")
    table.add_column("speed-up\nvs none", justify="right")
    if at_all:
        table.add_column("speed-up\nvs ORT all", justify="right")
    table.add_column("traffic MB\n(x ideal)", justify="right")
    table.add_column("achieved\nGB/s", justify="right")
    for r in result.rows:
        if r.kind in ("modelled", "hardware-fit"):
            continue
        # the runtime rewrites what it runs above "disabled": the graph's own count would mislead
        traffic = r.traffic.total if r.traffic is not None and r.level == "disabled" else None
        vs_all = ""
        if r.timing is not None:
            t = r.timing
            latency, spread = _ms(t.median), f"{_ms(t.min)}-{_ms(t.max)}"
            speed = "1.00x" if r.key == BASELINE else _speedup(t.ratio)
            achieved = f"{traffic / (t.median * 1e-3) / 1e9:.2f}" if traffic else "-"
            if r.level == "all":
                vs_all = "1.00x" if r.key == ORT_ALL else _speedup(m.ratio(r.key, ORT_ALL))
        elif r.same_as:
            latency, spread, speed, achieved = f"= {r.same_as}", "", "", ""
        else:
            latency, spread, speed, achieved = "-", "", "", ""
        label = r.label + (" [red]outputs differ![/red]" if r.mismatch else "")
        label += " [red]failed[/red]" if r.error else ""
        cells = [label, r.level, _int(r.nodes), latency, spread, speed]
        if at_all:
            cells.append(vs_all)
        table.add_row(*cells, _traffic(traffic, result.ideal_bytes), achieved)
    if result.ideal_bytes:
        cells = ["[dim]ideal bound[/dim]", "", "", "", "", ""] + ([""] if at_all else [])
        table.add_row(*cells, _traffic(result.ideal_bytes, result.ideal_bytes), "")
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
    int8_rows = any(r.int8 is not None and profile_name in r.predictions for r in result.rows)
    if int8_rows:
        table.add_column("int8 vs\nits float", justify="right")
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
            if int8_rows:
                cells.append("")
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
            if int8_rows:
                cells.append(_int8_gain(result, r, profile_name))
        if show_chapter:
            ch = r.chapter
            if ch is not None and not r.same_as:
                _, ms, gbps, speedup = ch
                cells += [f"{ms:g} ({speedup:.2f}x)", f"{gbps:g}", f"{(p.latency_s * 1e3 / ms - 1):+.1%}"]
            else:
                cells += ["", "", ""]
        table.add_row(*cells)
    return table


def vela_table(result, profile_name: str) -> Table:
    """One Ethos-U NPU: Vela's estimate per configuration, and opfuse's prediction beside it."""
    rows = [r for r in result.vela_rows if r.profile == profile_name]
    prof = result.profiles[profile_name]
    system = next((r.system for r in rows if r.system), "")
    title = (f"Ethos-U {rows[0].npu if rows else profile_name}: estimated by Arm's Vela compiler ({system}; "
             f"int8 TFLite per configuration), beside opfuse's cost model with the profile {prof.name} "
             "(a prediction)")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for name, justify in (("configuration", "left"), ("TFLite\nops", "right"), ("NPU\nops", "right"),
                          ("CPU\nops", "right"),
                          ("Vela\ncycles", "right"), ("Vela\nms", "right"), ("speed-up\nvs none", "right"),
                          ("off-chip\nMB", "right"), ("SRAM\nMB", "right"), ("model\nms", "right"),
                          ("model\nerror", "right")):
        table.add_column(name, justify=justify)
    base = next((r for r in rows if r.config == BASELINE and r.time_s), None)
    for r in rows:
        if r.error and r.cycles is None:
            table.add_row(r.label, "", "", "", f"[red]failed[/red]: {r.error}", *[""] * 6)
            continue
        speed = f"{base.time_s / r.time_s:.2f}x" if base is not None and r.time_s else "-"
        model_ms = f"{r.predicted_s * 1e3:.2f}" if r.predicted_s is not None else "-"
        err = f"{r.model_error:+.0%}" if r.model_error is not None else "-"
        label = r.label + (f" (= {r.same_as})" if r.same_as else "")
        table.add_row(label, _int(r.tflite_ops), _int(r.npu_ops), str(len(r.cpu_ops)), f"{r.cycles / 1e6:.2f} M",
                      f"{r.time_s * 1e3:.2f}", speed, _mb(r.offchip_bytes), _mb(r.sram_bytes), model_ms, err)
    return table


def _int8_gain(result, row, profile_name: str) -> str:
    """An int8 row's predicted speed-up over the float configuration it was quantised from."""
    source = FLOAT_SOURCE.get(row.key)
    if row.int8 is None or source is None:
        return ""
    float_row = result.row(source)
    while float_row is not None and float_row.same_as:
        float_row = result.row(float_row.same_as)
    p, f = row.predictions.get(profile_name), float_row.predictions.get(profile_name) if float_row else None
    if p is None or f is None or p.latency_s <= 0:
        return ""
    return f"{f.latency_s / p.latency_s:.2f}x"


def int8_table(result) -> Table:
    """What each int8 row is: its QDQ graph, how close to float, what runs where."""
    title = "int8 rows: QDQ graphs, output SQNR against float (dB, held-out inputs), what runs in float"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("configuration")
    table.add_column("QDQ\nnodes", justify="right")
    table.add_column("Quantize\nLinear", justify="right")
    table.add_column("SQNR dB\nheld out", justify="right")
    table.add_column("weights\n8-bit", justify="right")
    table.add_column("ORT all runs (measured)", no_wrap=True)
    table.add_column("in float on an int8\nNPU (predicted)")
    for r in result.rows:
        f = r.int8
        if f is None:
            continue
        if r.error and not f.qdq_nodes:
            table.add_row(f"{r.label} [red]failed[/red]", "-", "-", "-", "-", "", "")
            continue
        sqnr = f"{f.sqnr_db:.1f}" if math.isfinite(f.sqnr_db) else "-"
        weights = "-" if f.weights_8bit_fraction is None else f"{100 * f.weights_8bit_fraction:.0f}%"
        runs = ""
        if f.runtime_ops:
            runs = f"{f.runtime_int8} int8 kernels"
            bn = f.runtime_ops.get("BatchNormalization", 0)
            if bn:
                runs += f", {bn} BN in float"
        in_float = ", ".join(f"{n} {_short(op)}" for op, n in sorted(f.float_ops.items(), key=lambda kv: -kv[1]))
        table.add_row(r.label, str(f.qdq_nodes), str(f.quantize_linear), sqnr, weights, runs, in_float or "nothing")
    return table


def _short(op: str) -> str:
    return "BN" if op == "BatchNormalization" else op


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
        control = result.row(CONTROL)
        if control is not None and control.timing is not None and len(control.timing.ratios) > 1:
            lo, hi = control.timing.ratio_spread
            lines.append(f"- A/A control: {_speedup(control.timing.ratio)}, half of its rounds between "
                         f"{_speedup(hi)} and {_speedup(lo)}: differences of that size are noise")
        if any(r.level == "all" and r.kind != "runtime" for r in result.rows):
            lines.append("- ORT level: the ONNX Runtime graph-optimisation level a row ran at; speed-up vs ORT "
                         "all: the same paired ratio against the original model at all, the like-for-like "
                         "comparison for rows at all (a QDQ model gets ONNX Runtime's int8 kernels only with "
                         "its optimisations on: from extended, and at all in the NHWC layout they prefer)")
    if result.profiles:
        lines.append("- predicted rows: roofline (max of compute and DRAM time) + launch overhead per "
                     "kernel, plus spills; a model of an accelerator, not a measurement "
                     "(opfuse/cost/accelerator.py)")
        if any(r.int8 is not None and r.predictions for r in result.rows):
            peaks = ", ".join(f"{p.name} {p.peak('int8') / 1e9:g}" for p in result.profiles.values())
            lines.append("- predicted int8 rows: the QDQ graph as an NPU that runs int8 natively would run it "
                         "(opfuse/cost/int8.py): each conv, add or pooling between DequantizeLinear and "
                         "QuantizeLinear one int8 kernel moving 1-byte activations and weights (int32 bias); "
                         "an op with no int8 kernel (BatchNormalization) runs in float with conversion "
                         f"kernels around it. int8 peak GOP/s ({peaks}) is an assumption of each profile, "
                         "not calibrated: the chapter gives float only. int8 vs its float: against the "
                         "float configuration it was quantised from ("
                         + ", ".join(f"{r.label} vs {FLOAT_SOURCE[r.key]}" for r in result.rows
                                     if r.key in FLOAT_SOURCE and r.int8 is not None)
                         + "; ONNX Runtime's quantiser also drops each Relu into the requantisation)")
    if result.vela_rows:
        lines.append("- Ethos-U tables: each configuration written as int8 TFLite keeping its structure (BN folded, "
                     "or a MUL and an ADD by per-channel constants; ReLU fused into the op before it, or a RELU op; "
                     "opfuse/bench/ethos_u.py) and compiled by Arm's Vela: cycles, ms and bytes are Vela's own "
                     "estimate; NPU ops: Vela's NPU operations that take cycles (Vela itself runs a RELU after a "
                     "conv or ADD in that op's epilogue where it can). model ms: opfuse's cost model on the same int8 graph with the profile; model "
                     "error = (model - Vela) / Vela")
        for r in result.vela_rows:
            if r.cpu_ops and not r.same_as:
                lines.append(f"- {r.profile} {r.label}: {len(r.cpu_ops)} ops on the CPU, e.g. {r.cpu_ops[0]}")
            if r.error and not r.same_as:
                lines.append(f"- [red]{r.profile} {r.label}: {r.error}[/red]")
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
