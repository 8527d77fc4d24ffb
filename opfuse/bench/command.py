"""``opfuse bench``: the chapter's ablation table for any model.

    opfuse bench                         built-in ResNet-50, batch 1, 224x224
    opfuse bench MODEL.onnx              any model (symbolic batch bound to --batch)
    opfuse bench --model mobilenetv2     another built-in
        [--configs none,conv-bn,conv-act,conv-bn-act,all] [--runtime-levels basic,extended,all]
        [--threads 2] [--reps 50] [--warmup 2] [--batch 1] [--image-size 224] [--dim NAME=N]
        [--hardware npu-chapter[,npu-small]] [--json FILE|-] [--plot FILE.png]
        [--[no-]profile-ops] [--layers N] [--no-measure] [--quick]

One run gives, per configuration of :data:`opfuse.ablation.CONFIGS`:

1. measured: ONNX Runtime CPU latency (:mod:`opfuse.bench.measure`), runtime optimisations
   disabled so only opfuse's fusions count, with the runtime's own levels and an A/A
   control as extra rows, node counts, and kernel time per op type;
2. memory traffic from shapes (:mod:`opfuse.bench.traffic`) and its ideal lower bound;
3. predicted accelerator latency and bandwidth (:mod:`opfuse.bench.costmodel`), beside
   the chapter's numbers for ResNet-50. Predictions of a model, labelled as such.

:func:`run_bench` is the Python API; :func:`run` the CLI entry; rendering is in
:mod:`opfuse.bench.table` and :mod:`opfuse.bench.plot`.
"""

from __future__ import annotations

__all__ = ["add_parser", "run", "run_bench", "BenchOptions", "BenchResult", "Row", "CHAPTER"]

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from typing import Any

from opfuse.errors import BadInputError

DEFAULT_CONFIGS = ("none", "conv-bn", "conv-act", "conv-bn-act", "all")
DEFAULT_LEVELS = ("basic", "extended", "all")
DEFAULT_MODEL = "resnet50"
DEFAULT_PROFILE = "npu-chapter"
BASELINE = "none"
CONTROL = "none-aa"
MODELLED_CONV_RELU = "npu-conv-relu"

# The chapter's section 4 (ResNet-50 on one NPU): row key -> (chapter row, ms, GB/s, speed-up)
CHAPTER: dict[str, tuple[str, float, float, float]] = {
    "none": ("none", 12.5, 18.2, 1.0),
    "conv-bn": ("Conv+BN", 10.1, 22.5, 1.24),
    MODELLED_CONV_RELU: ("Conv+ReLU", 11.3, 20.1, 1.11),
    "conv-bn-act": ("Conv+BN+ReLU", 9.2, 24.8, 1.36),
}


# -- the command line --------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="the chapter's ablation table for a model: measured here, predicted for an NPU",
        description="Measure every fusion configuration on ONNX Runtime CPU, count its memory "
                    "traffic, and predict its latency on an accelerator profile (predictions of "
                    "a cost model, not measurements).",
    )
    p.add_argument("model", nargs="?", help="an ONNX model (default: the built-in ResNet-50)")
    p.add_argument("--model", dest="builtin", metavar="NAME",
                   help="a built-in model: resnet18, resnet50, mobilenetv2, vgg")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated configurations (default: %(default)s)")
    p.add_argument("--runtime-levels", default=",".join(DEFAULT_LEVELS),
                   help="ONNX Runtime's own optimisation levels to add as rows, on the original "
                        "model; 'none' for no such rows (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default: %(default)s)")
    p.add_argument("--reps", type=int, default=None,
                   help="measured rounds; each runs every session once (default 50, --quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per session (default 2, --quick 1)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=None, help="input size of a built-in model (default 224)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=N",
                   help="value of a symbolic input dimension of a model file (axis 0 defaults to --batch)")
    shipped = sorted(f.stem for f in (pathlib.Path(__file__).resolve().parent.parent / "hardware").glob("*.toml"))
    p.add_argument("--hardware", default=DEFAULT_PROFILE, metavar="PROFILE[,PROFILE]",
                   help=f"accelerator profiles to predict for: {', '.join(shipped)}, or .toml paths "
                        "(default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON ('-' for stdout, no tables)")
    p.add_argument("--plot", metavar="FILE.png", help="write latency, traffic and traffic-per-layer plots")
    p.add_argument("--profile-ops", action=argparse.BooleanOptionalAction, default=None,
                   help="kernel time per op type from ONNX Runtime's profiler (default: on, off with --quick)")
    p.add_argument("--layers", type=int, default=0, metavar="N",
                   help="also print the N layers that move the most bytes unfused")
    p.add_argument("--no-measure", action="store_true", help="skip ONNX Runtime: traffic and predictions only")
    p.add_argument("--quick", action="store_true", help="fewer repetitions, no op profile (a smoke run)")


def run(args) -> int:
    options = options_from_args(args)
    from rich.console import Console

    to_stdout_json = options.json_path == "-"
    stream = sys.stderr if to_stdout_json else sys.stdout
    # a pipe or file gets 120 columns rather than rich's 80, which would wrap the tables
    console = Console(stderr=to_stdout_json, soft_wrap=False, width=None if stream.isatty() else 120)
    progress_console = Console(stderr=True)
    result = run_bench(options, progress_console=progress_console)
    if options.json_path:
        text = json.dumps(result.to_dict(), indent=2, default=_json_default)
        if to_stdout_json:
            sys.stdout.write(text + "\n")
        else:
            from opfuse.save import write_text_atomic

            write_text_atomic(options.json_path, text + "\n")
    if options.plot_path:
        from opfuse.bench.plot import plot_result

        plot_result(result, options.plot_path)
    if not to_stdout_json:
        from opfuse.bench.table import print_result

        print_result(result, console, layers=options.layers)
        written = [p for p in (options.json_path, options.plot_path) if p]
        if written:
            console.print("wrote " + ", ".join(written))
    return 0


@dataclasses.dataclass
class BenchOptions:
    model_path: str | None = None
    builtin: str | None = DEFAULT_MODEL
    configs: tuple[str, ...] = DEFAULT_CONFIGS
    runtime_levels: tuple[str, ...] = DEFAULT_LEVELS
    threads: int = 2
    reps: int = 50
    warmup: int = 2
    batch: int = 1
    image_size: int = 224
    dims: dict[str, int] = dataclasses.field(default_factory=dict)
    hardware: tuple[str, ...] = (DEFAULT_PROFILE,)
    json_path: str | None = None
    plot_path: str | None = None
    profile_ops: bool = True
    layers: int = 0
    measure: bool = True


def options_from_args(args) -> BenchOptions:
    """Validate the command line; every problem is a one-line BadInputError."""
    from opfuse.ablation import CONFIGS
    from opfuse.bench.costmodel import load_profile
    from opfuse.runtime import RUNTIME_LEVELS
    from opfuse.models import BUILTIN_MODELS

    if args.model and args.builtin:
        raise BadInputError("give either a model file or --model NAME, not both")
    if args.builtin and args.builtin not in BUILTIN_MODELS:
        raise BadInputError(
            f"unknown built-in model {args.builtin!r}; choose from {', '.join(BUILTIN_MODELS)}"
        )
    if args.model:
        path = pathlib.Path(args.model)
        if not path.exists():
            raise BadInputError(f"{path}: no such file")
        if path.is_dir():
            raise BadInputError(f"{path}: is a directory, not an ONNX file")
        if args.image_size is not None:
            raise BadInputError("--image-size applies to the built-in models only")
    configs = _split(args.configs)
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise BadInputError(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    if not configs:
        raise BadInputError("--configs is empty")
    if BASELINE not in configs:
        configs.insert(0, BASELINE)  # the baseline every ratio is taken against
    levels = [] if args.runtime_levels.strip().lower() in ("", "none") else _split(args.runtime_levels)
    bad = [lvl for lvl in levels if lvl not in RUNTIME_LEVELS or lvl == "disabled"]
    if bad:
        raise BadInputError(f"unknown runtime level {bad[0]!r}; choose from basic, extended, all")
    profiles = _split(args.hardware)
    for name in profiles:
        load_profile(name)  # raises BadInputError for an unknown profile
    for flag, value, minimum in (("--threads", args.threads, 1), ("--batch", args.batch, 1),
                                 ("--reps", args.reps, 1), ("--warmup", args.warmup, 0),
                                 ("--layers", args.layers, 0)):
        if value is not None and value < minimum:
            raise BadInputError(f"{flag} must be at least {minimum}, not {value}")
    dims = {}
    for text in args.dim:
        name, sep, value = text.partition("=")
        if not sep or not name or not value.isdigit() or int(value) < 1:
            raise BadInputError(f"--dim expects NAME=POSITIVE_INT, got {text!r}")
        dims[name] = int(value)
    for target in (args.json, args.plot):
        if target and target != "-":
            parent = pathlib.Path(target).resolve().parent
            if not parent.is_dir():
                raise BadInputError(f"{target}: directory {parent} does not exist")
    if args.plot and args.plot == "-":
        raise BadInputError("--plot needs a file name")
    quick = args.quick
    return BenchOptions(
        model_path=args.model,
        builtin=None if args.model else (args.builtin or DEFAULT_MODEL),
        configs=tuple(dict.fromkeys(configs)),
        runtime_levels=tuple(dict.fromkeys(levels)),
        threads=args.threads,
        reps=args.reps if args.reps is not None else (5 if quick else 50),
        warmup=args.warmup if args.warmup is not None else (1 if quick else 2),
        batch=args.batch,
        image_size=args.image_size or 224,
        dims=dims,
        hardware=tuple(dict.fromkeys(profiles)),
        json_path=args.json,
        plot_path=args.plot,
        profile_ops=(not quick) if args.profile_ops is None else args.profile_ops,
        layers=args.layers,
        measure=not args.no_measure,
    )


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


# -- the result --------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    """One line of the table: a configuration, a runtime level, the control, or a modelled row."""

    key: str
    label: str
    kind: str  # "config" | "control" | "runtime" | "modelled" | "hardware-fit"
    nodes: int | None = None
    same_as: str | None = None  # the row whose graph this one is identical to
    note: str = ""
    timing: Any = None  # measure.Timing
    traffic: Any = None  # traffic.Traffic
    predictions: dict[str, Any] = dataclasses.field(default_factory=dict)  # profile -> Prediction
    mismatch: str | None = None
    error: str | None = None
    report_summary: str = ""

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

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)

    @property
    def chapter_applies(self) -> bool:
        """The chapter's table is ResNet-50 at batch 1, 224x224."""
        o = self.options
        return self.builtin and o.builtin == "resnet50" and o.batch == 1 and o.image_size == 224

    def baseline_ms(self) -> float | None:
        row = self.row(BASELINE)
        return row.timing.median if row is not None and row.timing is not None else None

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
                "measured": None if r.timing is None else r.timing.to_dict(),
                "outputs_match_baseline": None if r.timing is None else r.mismatch is None,
                "mismatch": r.mismatch,
                "error": r.error,
                "fusion": r.report_summary,
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
                                "(see opfuse.bench.traffic)",
            "rows": rows,
            "op_profile_ms_per_run": self.op_profile,
            "traffic_per_layer": {"layers": self.layer_labels, "bytes": self.layer_bytes},
            "hardware": {name: p.to_dict() for name, p in self.profiles.items()},
            "notes": list(self.notes),
        }


def _speedup(result: BenchResult, profile: str, key: str) -> float | None:
    base = result.row(BASELINE)
    row = result.row(key)
    if base is None or row is None or profile not in base.predictions or profile not in row.predictions:
        return None
    return base.predictions[profile].latency_s / row.predictions[profile].latency_s


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


# -- the run -----------------------------------------------------------------------------

class _Progress:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, console):
        self.console = console
        self.bar = None
        self.task = None

    def __enter__(self):
        if self.console is None:
            return self
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                   TextColumn, TimeElapsedColumn)

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
    import onnx_ir as ir

    from opfuse.ablation import apply_config
    from opfuse.bench.costmodel import fuse_activation_into_batchnorm, kernels_of, load_profile, predict
    from opfuse.bench.measure import Variant, measure, profile_op_types
    from opfuse.bench.traffic import align_layers, analyse_traffic
    from opfuse.load import load_model
    from opfuse.verify import make_inputs

    start = time.perf_counter()
    profiles = {p.name: p for p in (load_profile(h) for h in options.hardware)}
    with _Progress(progress_console) as bar:
        bar.stage("preparing the model", len(options.configs) + 2)
        if options.model_path:
            model, display = load_model(options.model_path)
            builtin = False
        else:
            from opfuse.models import build

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
        # The chapter's Conv+ReLU, as its NPU compiler ran it (see opfuse.bench.costmodel)
        modelled = fuse_activation_into_batchnorm(kernels_of(none_row.traffic), none_row.traffic.graph_outputs)
        if len(modelled) < len(kernels_of(none_row.traffic)):
            fused_count = len(kernels_of(none_row.traffic)) - len(modelled)
            modelled_row = Row(
                key=MODELLED_CONV_RELU, label="npu-conv-relu", kind="modelled",
                nodes=len(modelled),
                note=f"the chapter's Conv+ReLU as its NPU compiler must have run it (modelled, predicted "
                     f"only): BN kept, each of {fused_count} activations runs in the epilogue of the "
                     "BatchNormalization kernel before it",
            )
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
        for r in rows:
            source = modelled if r.key == MODELLED_CONV_RELU else r.traffic
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
            for level in options.runtime_levels:
                variants.append(Variant(f"ort-{level}", f"ORT {level}",
                                        proto_bytes, level, "runtime"))
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
            for level in options.runtime_levels:
                rows.append(Row(key=f"ort-{level}", label=f"ORT {level}", kind="runtime",
                                note="ONNX Runtime's own optimiser at this level, on the original model"))
            for r in rows:
                if r.same_as is None and r.key in measurement.timings:
                    r.timing = measurement.timings[r.key]
                if r.kind == "runtime":
                    r.nodes = measurement.nodes(r.key)
                r.mismatch = measurement.mismatches.get(r.key)
                r.error = measurement.errors.get(r.key)
            if options.profile_ops:
                targets = {v.name: v.model for v in variants if v.kind == "config"}
                runs = 10 if options.reps >= 10 else 2
                bar.stage("profiling op types", runs)
                op_profile = profile_op_types(
                    targets, feeds, threads=options.threads, runs=runs,
                    progress=lambda _s, done, _t: bar.update(completed=done),
                )
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
        from collections import Counter

        reason, count = Counter(_generic(r) for r in reasons).most_common(1)[0]
        return f"= {same_as}: nothing fused; {count} candidates refused, e.g. {reason}"
    return f"= {same_as}: nothing to fuse"


def _generic(reason: str) -> str:
    """A refusal reason without the node names, so equal reasons group."""
    import re

    return re.sub(r"'[^']*'", "'...'", reason)


def _input_dtype(model) -> str:
    for v in model.graph.inputs:
        if v.dtype is not None:
            try:
                import numpy as np

                return str(np.dtype(v.dtype.numpy()).name)
            except (TypeError, ValueError):
                return v.dtype.name.lower()
    return ""


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:  # pragma: no cover - not on every platform
        return None
