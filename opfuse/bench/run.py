"""``opfuse bench``'s run: one model, every configuration, measured, counted and predicted.

One run gives, per configuration of :data:`opfuse.bench.ablation.CONFIGS`:

1. measured: ONNX Runtime CPU latency (:mod:`opfuse.bench.measure`), runtime optimisations
   disabled so only opfuse's fusions count, with the runtime's own levels and an A/A
   control as extra rows, node counts, and kernel time per op type; with ``--int8`` the
   model quantised with BN folded and unfolded (:mod:`opfuse.bench.int8`), run at ORT all
   beside the float model at all, in the same interleaved rounds;
2. memory traffic from shapes (:mod:`opfuse.cost.traffic`) and its ideal lower bound;
3. predicted accelerator latency and bandwidth (:mod:`opfuse.cost.accelerator`), beside
   the chapter's numbers for ResNet-50 (:mod:`opfuse.bench.chapter`). Predictions of a
   model, labelled as such.

:func:`run_bench` is the Python API; :func:`run` the CLI entry (options in
:mod:`opfuse.bench.options`); rendering is in :mod:`opfuse.bench.table` and
:mod:`opfuse.bench.plot`.
"""

from __future__ import annotations

__all__ = ["run", "run_bench"]

import os
import re
import sys
import time
from collections import Counter
from typing import Any

import onnx_ir as ir
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from opfuse.bench.ablation import apply_config
from opfuse.bench.chapter import MODELLED_CONV_RELU, modelled_conv_relu
from opfuse.bench.int8 import CALIBRATION, FLOAT_AT_ALL, HELD_OUT, quantize_rows
from opfuse.bench.measure import Variant, measure, profile_op_types
from opfuse.bench.options import BASELINE, CONTROL, BenchOptions, options_from_args
from opfuse.bench.plot import plot_result
from opfuse.bench.result import BenchResult, Row
from opfuse.bench.table import print_result
from opfuse.errors import BadInputError
from opfuse.report import json_text
from opfuse.load import load_model
from opfuse.models import build
from opfuse.save import write_text_atomic
from opfuse.cost.accelerator import load_profile, predict
from opfuse.cost.int8 import float_ops, int8_traffic
from opfuse.cost.traffic import align_layers, analyse_traffic
from opfuse.verify import make_inputs
from opfuse.core.ops import dtype_name


def run(args) -> int:
    options = options_from_args(args)
    to_stdout_json = options.json_path == "-"
    stream = sys.stderr if to_stdout_json else sys.stdout
    # a pipe or file gets 120 columns rather than rich's 80, which would wrap the tables
    console = Console(stderr=to_stdout_json, soft_wrap=False, width=None if stream.isatty() else 120)
    progress_console = Console(stderr=True)
    result = run_bench(options, progress_console=progress_console)
    if options.json_path:
        text = json_text(result.to_dict())
        if to_stdout_json:
            sys.stdout.write(text + "\n")
        else:
            write_text_atomic(options.json_path, text + "\n")
    if options.plot_path:
        plot_result(result, options.plot_path)
    if not to_stdout_json:
        print_result(result, console, layers=options.layers)
        written = [p for p in (options.json_path, options.plot_path) if p]
        if written:
            console.print("wrote " + ", ".join(written))
    return 0


class _Progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, console):
        self.console = console
        self.bar = None
        self.task = None

    def __enter__(self):
        if self.console is None:
            return self
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description:<34}"), BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), console=self.console,
                            transient=True)
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def stage(self, description: str, total: int) -> None:
        if self.bar is None:
            return
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(description, total=max(total, 1))

    def update(self, description: str | None = None, completed: int | None = None, advance: int = 0) -> None:
        if self.bar is None or self.task is None:
            return
        kwargs: dict[str, Any] = {}
        if description is not None:
            kwargs["description"] = description
        if completed is not None:
            kwargs["completed"] = completed
        if advance:
            kwargs["advance"] = advance
        self.bar.update(self.task, **kwargs)


def run_bench(options: BenchOptions, *, progress_console=None) -> BenchResult:
    """Build or load the model, apply every configuration, measure, count, predict."""
    start = time.perf_counter()
    profiles = {p.name: p for p in (load_profile(h) for h in options.hardware)}
    with _Progress(progress_console) as bar:
        bar.stage("preparing the model", len(options.configs) + 2 + 3 * options.int8)
        if options.model_path:
            model, display = load_model(options.model_path)
            builtin = False
        else:
            try:
                proto = build(options.builtin, batch=options.batch, image_size=options.image_size)
            except ValueError as e:
                raise BadInputError(str(e)) from None
            model, _ = load_model(proto)
            display = f"built-in {options.builtin} (batch {options.batch}, {options.image_size}x{options.image_size})"
            builtin = True
        bar.update(advance=1)
        dims = _bind_dims(model, options)
        notes: list[str] = []

        rows: list[Row] = []
        fingerprints: dict[Any, str] = {}
        config_fp: dict[str, Any] = {}
        models: dict[str, ir.Model] = {}
        for name in options.configs:
            bar.update(description=f"applying {name}")
            fused, report = apply_config(model, name, runtime_level="disabled", verify=False)
            row = Row(key=name, label=name, kind="config", report_summary=report.summary())
            fp = config_fp[name] = _fingerprint(fused)
            if fp in fingerprints:
                row.same_as = fingerprints[fp]
                row.note = _same_note(report, row.same_as)
            else:
                fingerprints[fp] = name
                models[name] = fused
            row.traffic = analyse_traffic(fused, batch=options.batch, dims=dims)
            row.nodes = len(row.traffic.kernels)
            rows.append(row)
            bar.update(advance=1)

        none_row = next(r for r in rows if r.key == BASELINE)
        # the chapter's Conv+ReLU, as its NPU compiler ran it (see opfuse.bench.chapter)
        modelled, modelled_note = modelled_conv_relu(none_row.traffic)
        if modelled_note is not None:
            modelled_row = Row(key=MODELLED_CONV_RELU, label=MODELLED_CONV_RELU, kind="modelled",
                               nodes=len(modelled), note=modelled_note)
            keys = [r.key for r in rows]  # beside opfuse's own Conv+ReLU row, or after Conv+BN
            anchor = "conv-act" if "conv-act" in keys else "conv-bn" if "conv-bn" in keys else BASELINE
            rows.insert(keys.index(anchor) + 1, modelled_row)
        # "all" with each profile's veto: the fusions that would spill are declined
        if "all" in options.configs:
            for pname, prof in profiles.items():
                fitted, report = apply_config(model, "all", runtime_level="disabled", verify=False, hardware=prof.source)
                if _fingerprint(fitted) == config_fp["all"]:
                    continue  # every fusion fits this profile's buffer
                vetoed = sum(1 for r in report.refusals if "on-chip buffer" in r.reason)
                fit_row = Row(key=f"all-fit-{pname}", label=f"all-fit-{pname}", kind="hardware-fit",
                              note=f"all as `opfuse optimize --hardware {pname}` makes it: {vetoed} fusions declined "
                                   "because their working set would not fit the on-chip buffer",
                              report_summary=report.summary())
                fit_row.traffic = analyse_traffic(fitted, batch=options.batch, dims=dims)
                fit_row.nodes = len(fit_row.traffic.kernels)
                rows.append(fit_row)
        bar.update(advance=1)

        # an Ethos-U profile: every configuration as int8 TFLite, compiled by Vela (opfuse.bench.ethos_u)
        vela_rows = []
        vela_profiles = [p for p in profiles.values() if p.compiler == "vela"]
        if vela_profiles:
            # the Ethos-U rows need ORT's quantiser, the lowering and Vela: loaded only for such a profile
            from opfuse.bench.ethos_u import CALIBRATION as VELA_CALIBRATION, ETHOS_CONFIGS, vela_ablation

            calibration = [make_inputs(model, dims=dims, seed=1000 + i) for i in range(VELA_CALIBRATION)]
            configs = [c for c in options.configs if c in ETHOS_CONFIGS]
            vela_rows = vela_ablation(model, configs, vela_profiles, calibration,
                                      progress=lambda s: bar.update(description=s[:34]))
            notes.append(f"Ethos-U rows: calibrated on {VELA_CALIBRATION} seeded random inputs (the same for every "
                         "configuration); Vela's cycles do not depend on the scales")

        # int8: the model quantised with BN folded and unfolded, and the float reference at ORT all
        late: list[Row] = []  # after the runtime's own rows
        int8_models = []
        reference = None
        if options.int8:
            bar.update(description="applying all for ORT all")
            reference, _ = apply_config(model, "all", runtime_level="all", verify=False)
            late.append(Row(key=FLOAT_AT_ALL, label="all, for ORT all", kind="reference", level="all",
                            note="the float reference for the int8 rows: opfuse's all configuration as "
                                 "written for ONNX Runtime's all level (fusions that would keep a conv out of "
                                 "its NCHWc layout are left to the runtime), run at all"))
            bar.update(advance=1)
            int8_models = quantize_rows(model, dims, progress=lambda s: bar.update(description=s, advance=1))
            for q in int8_models:
                row = Row(key=q.key, label=q.label, kind="int8", level="all", note=q.note, int8=q.facts,
                          error=q.error)
                if q.model is not None:
                    row.traffic = int8_traffic(analyse_traffic(q.model, batch=options.batch, dims=dims))
                    q.facts.float_ops = dict(float_ops(row.traffic))
                late.append(row)
            notes.append(
                f"int8 rows: calibrated on {CALIBRATION} seeded random inputs, output SQNR on {HELD_OUT} more "
                "held out; int8 latency does not depend on calibration quality (the same kernels run whatever "
                "the scales), so random data serves the timing; the SQNR only shows each row computes "
                "roughly the float model's function"
            )

        # traffic: ideal and per layer
        ideals = [r.traffic.ideal for r in rows if r.traffic is not None and not r.traffic.unknown]
        ideal = min(ideals) if ideals else None
        unknown = none_row.traffic.unknown
        if unknown:
            first, names = next(iter(unknown.items()))
            notes.append(
                f"shapes unknown for {len(unknown)} nodes (e.g. {first}: {', '.join(names[:3])}); their "
                "tensors are counted as zero bytes, so traffic is a lower figure than the truth"
            )
        labels, per_layer = align_layers({r.key: r.traffic for r in rows
                                          if r.kind == "config" and r.same_as is None and r.traffic is not None})

        # predictions
        for r in (*rows, *late):
            source = modelled if r.kind == "modelled" else r.traffic
            if source is None:
                continue
            for pname, prof in profiles.items():
                r.predictions[pname] = predict(source, prof)

        # measurement
        measurement = None
        op_profile: dict[str, dict[str, float]] = {}
        load_average = None
        if options.measure:
            feeds = make_inputs(model, dims=dims, seed=0)
            variants = []
            for r in rows:
                if r.kind == "config" and r.same_as is None:
                    variants.append(Variant(r.key, r.label, models[r.key], "disabled", "config"))
            variants.append(Variant(CONTROL, "none A/A", models[BASELINE], "disabled", "control"))
            proto_bytes = ir.serde.serialize_model(model).SerializeToString()
            levels = list(options.runtime_levels)
            if options.int8 and "all" not in levels:
                levels.append("all")  # the int8 rows are compared with the float model at all
            for level in levels:
                variants.append(Variant(f"ort-{level}", f"ORT {level}",
                                        proto_bytes, level, "runtime"))
            if reference is not None:
                variants.append(Variant(FLOAT_AT_ALL, "all, for ORT all", reference, "all", "reference"))
            for q in int8_models:
                if q.model is not None:
                    variants.append(Variant(q.key, q.label, q.model, "all", "int8", exact=False))
            total = len(variants) + options.warmup + options.reps
            bar.stage("measuring on ONNX Runtime", total)

            def on_progress(stage: str, done: int, _total: int) -> None:
                bar.update(description=stage[:34], completed=done)

            load_before = _loadavg()
            measurement = measure(variants, feeds, threads=options.threads, warmup=options.warmup,
                                  rounds=options.reps, baseline=BASELINE, progress=on_progress)
            load_after = _loadavg()
            if load_before and load_after:
                load_average = tuple(round(max(a, b), 2) for a, b in zip(load_before, load_after))
            control = Row(key=CONTROL, label="none A/A", kind="control",
                          nodes=none_row.nodes, traffic=none_row.traffic,
                          note="A/A control: the unfused model again, in a separate session; its "
                               "distance from 1.00x is the noise floor")
            insert_at = max(i for i, r in enumerate(rows) if r.kind == "config") + 1
            rows.insert(insert_at, control)
            for level in levels:
                rows.append(Row(key=f"ort-{level}", label=f"ORT {level}", kind="runtime", level=level,
                                note="ONNX Runtime's own optimiser at this level, on the original model"))
            rows += late
            for r in rows:
                if r.same_as is None and r.key in measurement.timings:
                    r.timing = measurement.timings[r.key]
                if r.level != "disabled":
                    r.nodes = measurement.nodes(r.key)
                if r.int8 is not None and r.key in measurement.op_counts:
                    r.int8.runtime_ops = dict(measurement.op_counts[r.key])
                r.mismatch = measurement.mismatches.get(r.key)
                r.error = measurement.errors.get(r.key) or r.error
            if options.profile_ops:
                targets = {v.name: v.model for v in variants if v.kind == "config"}
                runs = 10 if options.reps >= 10 else 2
                bar.stage("profiling op types", runs)
                op_profile = profile_op_types(
                    targets, feeds, threads=options.threads, runs=runs,
                    progress=lambda _s, done, _t: bar.update(completed=done),
                )
        else:
            rows += late
        dtype = _input_dtype(model)
    return BenchResult(
        model=display,
        builtin=builtin,
        options=options,
        rows=rows,
        profiles=profiles,
        ideal_bytes=ideal,
        measurement=measurement,
        op_profile=op_profile,
        layer_labels=labels,
        layer_bytes=per_layer,
        notes=notes,
        elapsed_s=time.perf_counter() - start,
        load_average=load_average,
        dtype=dtype,
        vela_rows=vela_rows,
    )


def _bind_dims(model, options: BenchOptions) -> dict[str, int]:
    """Symbolic input dimensions -> values: --dim by name, axis 0 -> --batch."""
    dims = dict(options.dims)
    for value in model.graph.inputs:
        if value.is_initializer() or value.shape is None:
            continue
        for axis, dim in enumerate(value.shape):
            if isinstance(dim, int):
                continue
            name = str(dim.value) if dim.value is not None else None
            if name and name not in dims:
                if axis == 0:
                    dims[name] = options.batch
                else:
                    raise BadInputError(
                        f"input '{value.name}' has a symbolic dimension '{name}' (axis {axis}); "
                        f"give its value with --dim {name}=N"
                    )
    return dims


def _fingerprint(model) -> tuple:
    """The graph's structure: two configurations with equal fingerprints run the same graph."""
    return tuple(
        (n.domain, n.op_type, tuple(v.name if v is not None else "" for v in n.inputs),
         tuple(v.name for v in n.outputs),
         tuple(sorted((k, repr(a.value)) for k, a in n.attributes.items())))
        for n in model.graph
    )


def _same_note(report, same_as: str) -> str:
    if report.records:
        return f"same graph as {same_as}"
    reasons = [r.reason for r in report.refusals]
    if reasons:
        reason, count = Counter(_generic(r) for r in reasons).most_common(1)[0]
        return f"= {same_as}: nothing fused; {count} candidates refused, e.g. {reason}"
    return f"= {same_as}: nothing to fuse"


def _generic(reason: str) -> str:
    """A refusal reason without the node names, so equal reasons group."""
    return re.sub(r"'[^']*'", "'...'", reason)


def _input_dtype(model) -> str:
    for v in model.graph.inputs:
        if v.dtype is not None:
            return dtype_name(v.dtype) or ""
    return ""


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:  # pragma: no cover - not on every platform
        return None
