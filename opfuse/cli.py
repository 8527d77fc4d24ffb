"""The ``opfuse`` command line.

    opfuse optimize IN.onnx -o OUT.onnx [--passes ...] [--report r.json] [--inputs x.npz]
                                        [--dim batch=4] [--constant-input sr=16000] [--no-verify]
    opfuse inspect IN.onnx [--json]
    opfuse llm SOURCE.gguf|HF_FOLDER -o DIR [--precision fp32|int4]
    opfuse demo [--model resnet50]
    opfuse quantize IN.onnx -o OUT.onnx --calibration DATA [--preset cpu|per-tensor|qnn|ethos-u]
                                        [--equalize] [--min-sqnr DB] [--report r.json]
                                        [--npu ethos-u55-128] [--context M_vela.tflite]

Exit codes: 0 success, 1 verification failed (nothing written), 2 bad input or usage.
Errors are one line on stderr.
"""

from __future__ import annotations

__all__ = ["main", "build_parser", "SUPERVISED_CHILD"]

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

from opfuse import __version__
from opfuse.bench.ablation import CONFIGS
from opfuse.bench import options as bench_options
from opfuse.errors import BadInputError, OpfuseError, VerificationError, extra_error
from opfuse.llm import command as llm_command
from opfuse.passes import PASS_NAMES
from opfuse.quantization.presets import DEFAULT_PRESET, PRESETS
from opfuse.quantization.report import QuantReport, print_quant_report
from opfuse.report import print_report
from opfuse.targets import RUNTIME_LEVELS, TARGET_DEFAULT_PASSES, TARGETS


def _dim(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected NAME=POSITIVE_INT, got {text!r}")
    return name, int(value)


def _constant_input(text: str) -> tuple[str, str]:
    """NAME=VALUE as given; the value is read against the model's input (one line if it does not fit)."""
    name, sep, value = text.partition("=")
    return (name, value) if sep and name else ("", text)


def _constant_inputs(pairs: list[tuple[str, str]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in pairs:
        if not name:
            raise BadInputError(f"--constant-input {value}: expected NAME=VALUE (sr=16000, or a comma-separated list)")
        if name in out:
            raise BadInputError(f"--constant-input {name}: given twice ({out[name]} and {value})")
        out[name] = value
    return out


def _add_constant_input(p: argparse.ArgumentParser) -> None:
    p.add_argument("--constant-input", action="append", type=_constant_input, default=[], metavar="NAME=VALUE",
                   help="bind a graph input to the value a deployment fixes (a number or a comma-separated list, "
                        "read with its dtype and shape): it becomes a constant, leaves the model's inputs, and what "
                        "it decides folds (an If on it becomes its taken branch); repeatable")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opfuse",
        description="Fold and fuse operators in ONNX models, verify the result, explain every decision.",
    )
    parser.add_argument("--version", action="version", version=f"opfuse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    opt = sub.add_parser("optimize", help="rewrite a model, verify it, save it")
    opt.add_argument("input", help="the ONNX model to optimise")
    opt.add_argument("-o", "--output", required=True, help="where to write the optimised model")
    _add_target_options(opt)
    opt.add_argument("--report", metavar="FILE", help="write the fusion log as JSON")
    opt.add_argument("--inputs", metavar="FILE.npz", help="verify on these inputs (keyed by input name)")
    opt.add_argument(
        "--dim", action="append", type=_dim, default=[], metavar="NAME=N",
        help="value of a symbolic dimension for random verification inputs (default 1); with "
             "--target qnn it binds the dimension in the model (every one must be bound)",
    )
    _add_constant_input(opt)
    _add_npu_options(opt)
    opt.add_argument("--seed", type=int, default=0, help="seed of the random verification inputs")
    opt.add_argument("--no-verify", action="store_true", help="skip running both models on ONNX Runtime")
    opt.add_argument("--tune", action=argparse.BooleanOptionalAction, default=None,
                     help="time each fusion family the target fuses (attention's form, the norms, the activations, "
                          "the epilogues, the opset raise) on and off on ONNX Runtime here, at --runtime-level and "
                          "the --dim sizes (default: a decode step at past 256, else 128 per free dimension), on the "
                          "whole model when small, else on its first repeated block; turn off those slower beyond an "
                          "A/A control's noise (within it, the target's policy stands); never write a model slower "
                          "than the input. The decision is cached by graph and machine and replayed. "
                          "--no-tune follows the target's default policy (default: on, unless OPFUSE_TUNE=off)")
    opt.add_argument("--tune-threads", type=int, default=1, metavar="N",
                     help="intra-op threads while timing (default: %(default)s)")
    opt.add_argument("--tune-rounds", type=int, default=None, metavar="N",
                     help="timing rounds per interleaved run (default: from the graph's size, 9 to 61)")
    opt.add_argument("--tuning", metavar="FILE",
                     help="replay a tuning record (a --report JSON, or a record from the cache) instead of timing: "
                          "the same input and record write the same bytes")
    opt.add_argument("--retune", action="store_true",
                     help="time again even where a record of this graph on this machine is cached")
    opt.add_argument("--overwrite", action="store_true", help="allow the output to replace the input file")
    ext = opt.add_mutually_exclusive_group()
    ext.add_argument("--external-data", dest="external_data", action="store_true", default=None,
                     help="store weights in OUT.onnx.data (automatic above 2 GB or when the input did)")
    ext.add_argument("--no-external-data", dest="external_data", action="store_false")
    opt.add_argument("--keep-shapes", action="store_true",
                     help="write the shapes opfuse inferred (default: only those the input declared)")
    opt.add_argument("--no-cleanup", action="store_true",
                     help="keep constant subexpressions, Identity and unused nodes as they are")
    opt.add_argument("-v", "--verbose", action="store_true", help="list every rewrite and refusal")
    opt.add_argument("-q", "--quiet", action="store_true", help="print only the summary line")

    ins = sub.add_parser("inspect", help="list fusion candidates, their blockers and the BN epsilons")
    ins.add_argument("input")
    _add_target_options(ins)
    ins.add_argument("--json", action="store_true", help="print JSON instead of tables")

    bench_options.add_parser(sub)

    qnt = sub.add_parser("quantize", help="fold, then quantise to int8 (QDQ) and verify the SQNR")
    qnt.add_argument("input", help="the float ONNX model")
    qnt.add_argument("-o", "--output", required=True, help="where to write the quantised model")
    qnt.add_argument("--calibration", required=True, metavar="DATA",
                     help="DATA.npz (arrays named after the inputs, leading sample axis), a directory of "
                          "one-sample .npz files, or random:N (smoke tests only); the last quarter is held out")
    qnt.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET,
                     help="; ".join(f"{p.name}: {p.summary}" for p in PRESETS.values())
                          + " (default: %(default)s)")
    qnt.add_argument("--equalize", action=argparse.BooleanOptionalAction, default=None,
                     help="cross-layer equalisation of every conv pair first (exact; helps per-tensor weights; "
                          "by default the per-tensor preset equalises the pairs with no ReLU6 between)")
    qnt.add_argument("--min-sqnr", type=float, metavar="DB",
                     help="keep the costliest layers out of int8 until the output SQNR reaches DB; "
                          "below it on the held-out samples: exit 1, nothing written")
    qnt.add_argument("--holdout", type=int, metavar="N", help="samples held out for verification (default: a quarter)")
    qnt.add_argument("--no-bias-correction", action="store_true", help="skip the empirical bias correction")
    qnt.add_argument("--adaround", action=argparse.BooleanOptionalAction, default=None,
                     help="choose each weight's rounding to reconstruct its layer's float output (AdaRound); "
                          "kept only where it raises the output SQNR on the calibration samples (default: on "
                          "for the per-tensor preset, in place of block reconstruction)")
    qnt.add_argument("--reconstruct", nargs="?", choices=("auto", "on", "off"), const="on", default="auto",
                     help="learn the int8 rounding and activation scales block by block to reproduce the float "
                          "model's block outputs (needs torch; minutes), kept only where it raises the output "
                          "SQNR on the calibration samples; auto: when estimated under 15 min (for the qnn "
                          "presets, with the estimate multiplied by 8) and AdaRound is off (default: %(default)s)")
    qnt.add_argument("--calibrate", choices=("auto", "minmax", "percentile", "entropy"), default="auto",
                     help="how activation ranges are read off the calibration data; auto gives each tensor the "
                          "range of least round-trip error (minmax, percentile 99.99 or clipped); where block "
                          "reconstruction searches the scales (the qnn presets), minmax, and the search clips "
                          "(default: %(default)s)")
    qnt.add_argument("--max-steps", type=int, default=64,
                     help="mixed-precision walk steps at most, one candidate each (default: %(default)s)")
    qnt.add_argument("--search-candidates", type=int, metavar="N",
                     help="with --min-sqnr: the search re-quantises at most N candidates per ranking, the N whose "
                          "layers add the most noise (the per-layer table); for a large model, where each trial "
                          "quantises the whole model (default: every candidate)")
    qnt.add_argument("--dim", action="append", type=_dim, default=[], metavar="NAME=N",
                     help="with --preset qnn: bind a symbolic dimension (default: the calibration samples' size)")
    _add_constant_input(qnt)
    _add_npu_options(qnt)
    qnt.add_argument("--report", metavar="FILE", help="write the report as JSON (also on failure)")
    qnt.add_argument("--seed", type=int, default=0, help="seed for random:N calibration")
    qnt.add_argument("--overwrite", action="store_true", help="allow the output to replace the input file")
    qnt.add_argument("-v", "--verbose", action="store_true", help="list every layer")
    qnt.add_argument("-q", "--quiet", action="store_true", help="print only the summary line")

    llm_command.add_parser(sub)

    demo = sub.add_parser("demo", help="optimise a built-in model (no files needed) and report")
    demo.add_argument("--model", default="resnet50", help="built-in model (default: %(default)s)")
    _add_target_options(demo)
    return parser


def _htp_option(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (soc_model=57, htp_arch=79, vtcm_mb=8), got {text!r}")
    return name, value


def _vela_option(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (system_config=Ethos_U55_High_End_Embedded, "
                                         f"memory_mode=Shared_Sram), got {text!r}")
    return name, value


def _add_npu_options(p: argparse.ArgumentParser) -> None:
    """The flags of a target compiled for an NPU (--target qnn|ethos-u, --preset qnn|ethos-u)."""
    p.add_argument("--require-npu", action="store_true",
                   help="with qnn or ethos-u: any node the compiler leaves on the CPU is an error (exit 1, "
                        "nothing written)")
    p.add_argument("--htp", action="append", type=_htp_option, default=[], metavar="KEY=VALUE",
                   help="a QNN HTP option (soc_model, htp_arch, vtcm_mb, offload_graph_io_quantization, or any "
                        "provider option); default soc_model=57; KEY= unsets one")
    p.add_argument("--npu", metavar="CONFIG",
                   help="with ethos-u: the Ethos-U and its MAC count Vela compiles for (ethos-u55-128, "
                        "ethos-u65-256, ethos-u85-256, or another size Vela takes; default ethos-u55-128)")
    p.add_argument("--vela", action="append", type=_vela_option, default=[], metavar="KEY=VALUE",
                   help="with ethos-u: system_config or memory_mode from Vela's Arm/vela.ini (default: Vela's own "
                        "for the NPU, e.g. Ethos_U55_High_End_Embedded and Shared_Sram); float_ops=cpu lowers an "
                        "op the quantiser left float in float32 for the CPU instead of refusing it")
    p.add_argument("--context", metavar="FILE",
                   help="with qnn: also write the compiled model as an EPContext ONNX a device loads "
                        "without recompiling; with ethos-u: Vela's compiled TFLite (M_vela.tflite), and the "
                        "lowered TFLite beside it (M.tflite)")


def _device_options(args) -> dict[str, str]:
    """The device's KEY=VALUE options: --htp for qnn; --vela and --npu for ethos-u."""
    return {**dict(args.htp), **dict(args.vela), **({"npu": args.npu} if args.npu else {})}


def _add_target_options(p: argparse.ArgumentParser) -> None:
    defaults = "; ".join(f"{t}: {','.join(ps)}" for t, ps in TARGET_DEFAULT_PASSES.items())

    p.add_argument("--config", choices=sorted(CONFIGS),
                   help="an ablation row of the chapter's table by name (sets --passes and --target): "
                        + "; ".join(f"{c.name} = {c.label}" for c in CONFIGS.values()))
    p.add_argument("--target", choices=TARGETS, default="onnx",
                   help="onnx: portable ONNX, patterns as standard ops at the model's opset (default); "
                        "onnxruntime: ONNX Runtime's contrib ops for the patterns, epilogues fused into "
                        "com.microsoft.FusedConv/FusedGemm; qnn: Qualcomm's HTP NPU (static shapes, the ops "
                        "QNN runs, compiled on its HTP backend: needs opfuse[qnn]); ethos-u: Arm's Ethos-U "
                        "(lowered to int8 TFLite, compiled by Vela: needs opfuse[ethos-u])")
    p.add_argument("--passes", default=None,
                   help=f"comma-separated passes (known: {', '.join(PASS_NAMES)}; defaults per target: {defaults})")
    p.add_argument("--runtime-level", choices=RUNTIME_LEVELS, default="all",
                   help="ONNX Runtime graph-optimisation level the result will run at: at 'all' a fusion "
                        "that would cost a conv the runtime's NCHWc layout is left to the runtime; "
                        "lower levels fuse everything legal (default: %(default)s)")
    p.add_argument("--opset", type=int, metavar="N",
                   help="raise the model's opset to N first (onnx's version converter), so patterns can "
                        "become the standard ops that need it (LayerNormalization 17, Gelu 20, ...)")
    p.add_argument("--approximate", action="store_true",
                   help="let a pattern become an op that approximates it (an erf GELU as a tanh one); "
                        "each such rewrite is logged as an approximation")
    p.add_argument("--hardware", metavar="PROFILE",
                   help="accelerator profile (see opfuse bench): decline fusions whose working set "
                        "would spill its on-chip buffer")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None and _needs_supervision(args):  # QNN's compiler can die of a signal: one line, no core dump
        return _run_supervised(sys.argv[1:], args)
    try:
        return COMMANDS[args.command](args)
    except VerificationError as e:
        if e.report is not None and not getattr(args, "quiet", False):
            printer = print_quant_report if isinstance(e.report, QuantReport) else print_report
            printer(e.report, _console(stderr=True))
        print(f"opfuse: {e}", file=sys.stderr)
        return e.exit_code
    except OpfuseError as e:
        print(f"opfuse: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("opfuse: interrupted; nothing was written", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:  # an extra's module imported before its check could run
        missing = extra_error(e)
        if missing is None:
            return _internal_error(e)
        print(f"opfuse: error: {missing}", file=sys.stderr)
        return missing.exit_code
    except Exception as e:  # a bug of opfuse's or of a library under it: one line, not a traceback
        return _internal_error(e)


def _internal_error(e: Exception) -> int:
    if os.environ.get("OPFUSE_TRACEBACK"):
        raise e
    first = (str(e).strip().splitlines() or [""])[0][:300]
    print(f"opfuse: internal error: {type(e).__name__}: {first} (outputs are written whole or not at all; "
          "OPFUSE_TRACEBACK=1 shows the traceback, please report it)", file=sys.stderr)
    return 1


def _console(stderr: bool = False):
    # a pipe or file gets 120 columns, as opfuse bench does, rather than rich's 80, which
    # wraps the report's reasons a word per line
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, soft_wrap=False, width=None if stream.isatty() else 120)


def _apply_config(args) -> None:
    """--config NAME stands for that ablation row's passes and target."""
    if getattr(args, "config", None) is None:
        return
    if args.passes is not None:
        raise BadInputError("give either --config or --passes, not both")
    config = CONFIGS[args.config]
    args.passes, args.target = list(config.passes), config.target


def _optimize(args) -> int:
    from opfuse.pipeline import OptimizeOptions, optimize  # the pipeline loads onnx and ONNX Runtime: per command

    _apply_config(args)
    start = time.perf_counter()
    options = OptimizeOptions(
        passes=args.passes,
        target=args.target,
        runtime_level=args.runtime_level,
        hardware=args.hardware,
        verify=not args.no_verify,
        inputs=args.inputs,
        dims=dict(args.dim),
        constant_inputs=_constant_inputs(args.constant_input),
        seed=args.seed,
        output=args.output,
        report_path=args.report,
        external_data=args.external_data,
        overwrite=args.overwrite,
        cleanup=not args.no_cleanup,
        keep_shapes=args.keep_shapes,
        opset=args.opset,
        approximate=args.approximate,
        require_npu=args.require_npu,
        htp_options=_device_options(args),
        context=args.context,
        tune=args.tune,
        tune_threads=args.tune_threads,
        tune_rounds=args.tune_rounds,
        tuning=args.tuning,
        retune=args.retune,
    )
    _, report = optimize(args.input, options=options)
    return _print_result(args, report, print_report, time.perf_counter() - start)


def _print_result(args, report, printer, elapsed: float) -> int:
    """``-q``: the report's one-line summary; else the whole report, then what was written."""
    if args.quiet:
        print(report.summary())
    else:
        printer(report, _console(), verbose=args.verbose)
        print(f"wrote {args.output} in {elapsed:.2f} s")
    return 0


def _inspect(args) -> int:
    from opfuse.pipeline import inspect_model  # the pipeline loads onnx: per command

    _apply_config(args)
    result = inspect_model(args.input, passes=args.passes, target=args.target,
                           runtime_level=args.runtime_level, hardware=args.hardware,
                           opset=args.opset, approximate=args.approximate)
    report = result.report
    if args.json:
        print(json.dumps({
            "model": report.model,
            "foldable": [r.__dict__ for r in report.records],
            "blocked": [r.__dict__ for r in report.refusals],
            "epsilons": [{"node": n, "epsilon": e, "graph": g} for n, e, g in result.epsilons],
            "warnings": result.warnings,
        }, indent=2))
        return 0
    console = _console()
    table = Table(title=f"Candidates in {report.model}", title_justify="left")
    for col in ("pattern", "node", "into", "status"):
        table.add_column(col)
    for r in report.records:
        table.add_row(r.pattern, ", ".join(r.removed), r.node, "[green]foldable[/green]")
    for r in report.refusals:
        table.add_row(r.pattern, r.node, r.anchor, f"[yellow]blocked:[/yellow] {r.reason}")
    console.print(table)
    if result.epsilons:
        eps = Table(title="BatchNormalization epsilons", title_justify="left")
        eps.add_column("epsilon", justify="right")
        eps.add_column("nodes", justify="right")
        eps.add_column("examples")
        groups: dict[float, list[str]] = {}
        for name, e, _ in result.epsilons:
            groups.setdefault(e, []).append(name)
        for e, names in sorted(groups.items()):
            eps.add_row(f"{e:g}", str(len(names)), ", ".join(names[:4]) + (" ..." if len(names) > 4 else ""))
        console.print(eps)
    for w in result.warnings:
        console.print(f"[yellow]warning:[/yellow] {w}")
    return 0


def _demo(args) -> int:
    from opfuse.models import BUILTIN_MODELS, build  # the model zoo loads onnx: per command
    from opfuse.pipeline import OptimizeOptions, optimize  # the pipeline loads onnx and ONNX Runtime: per command

    if args.model not in BUILTIN_MODELS:
        raise BadInputError(f"unknown built-in model {args.model!r}; choose from {', '.join(BUILTIN_MODELS)}")
    _apply_config(args)
    console = _console()
    start = time.perf_counter()
    proto = build(args.model)
    console.print(f"built {args.model} in code ({time.perf_counter() - start:.1f} s); optimising...")
    start = time.perf_counter()
    _, report = optimize(proto, options=OptimizeOptions(passes=args.passes, target=args.target,
                                                        runtime_level=args.runtime_level, hardware=args.hardware,
                                                        opset=args.opset, approximate=args.approximate))
    report.model = f"built-in {args.model}"
    print_report(report, console)
    console.print(f"summary: {report.summary()}  ({time.perf_counter() - start:.1f} s with verification)")
    return 0


def _bench(args) -> int:
    from opfuse.bench.run import run  # heavy (onnx, ONNX Runtime): only for this command

    return run(args)


def _quantize(args) -> int:
    from opfuse.quantization.pipeline import QuantizeOptions, quantize  # onnx, ONNX Runtime's quantiser: per command

    start = time.perf_counter()
    options = QuantizeOptions(
        preset=args.preset, equalize=args.equalize, min_sqnr=args.min_sqnr,
        bias_correction=not args.no_bias_correction, adaround=args.adaround,
        reconstruct={"on": True, "off": False}.get(args.reconstruct, "auto"), calibrate=args.calibrate,
        holdout=args.holdout, max_steps=args.max_steps, search_candidates=args.search_candidates,
        output=args.output, report_path=args.report, overwrite=args.overwrite, seed=args.seed,
        dims=dict(args.dim), constant_inputs=_constant_inputs(args.constant_input),
        require_npu=args.require_npu, htp_options=_device_options(args), context=args.context,
    )
    _, report = quantize(args.input, args.calibration, options)
    return _print_result(args, report, print_quant_report, time.perf_counter() - start)


COMMANDS = {"optimize": _optimize, "inspect": _inspect, "demo": _demo, "bench": _bench, "quantize": _quantize,
            "llm": llm_command.run}


# -- a command whose native compiler may crash runs in a child interpreter ----------------------------
# QNN's HTP compiler (libQnnHtp.so inside ONNX Runtime) can die of a signal while a session is
# created (a tiny Llama exported by dynamo with position_ids as an input: SIGSEGV,
# docs/results/qnn.md). A signal cannot be caught in the process it kills, so a command line
# given to the process (`opfuse ...`, `python -m opfuse ...`, not main(argv) from a caller's own
# process) that opens a QNN session runs again in a child interpreter whose output passes
# through. Its exit code is the command's; when a signal ends it, one line names the signal, the
# staging files it left beside the outputs (`.opfuse-*`: opfuse.save commits outputs whole at
# the end, so nothing half-written reaches an output path) are removed, and the exit is 1. The
# child's temporary files go to a directory of its own (TMPDIR), removed when it ends.

SUPERVISED_CHILD = "OPFUSE_SUPERVISED_CHILD"  # set in the child's environment: it runs the command itself


def _needs_supervision(args) -> bool:
    """Whether this parsed command line opens a session on QNN's HTP (and is not the child)."""
    if os.environ.get(SUPERVISED_CHILD):
        return False
    preset = PRESETS.get(getattr(args, "preset", None) or "")
    return getattr(args, "target", None) == "qnn" or (preset is not None and preset.target == "qnn")


def _output_dirs(args) -> list[pathlib.Path]:
    paths = [getattr(args, name, None) for name in ("output", "context", "report")]
    return sorted({pathlib.Path(p).resolve().parent for p in paths if p})


def _entries(directory: pathlib.Path, prefixes: tuple[str, ...]) -> set[pathlib.Path]:
    try:
        return {p for p in directory.iterdir() if p.name.startswith(prefixes)}
    except OSError:
        return set()


def _remove(path: pathlib.Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _run_supervised(argv: list[str], args) -> int:
    """Run ``opfuse argv`` in a child interpreter; its exit code, or 1 with one line on stderr
    when a signal killed it (its staging files removed)."""
    watched = _output_dirs(args)
    before = {d: _entries(d, (".opfuse-",)) for d in watched}
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    with tempfile.TemporaryDirectory(prefix="opfuse-child-") as scratch:
        env = {**os.environ, SUPERVISED_CHILD: "1", "TMPDIR": scratch}
        child = subprocess.run([sys.executable, "-m", "opfuse", *argv], env=env, check=False)
    if child.returncode >= 0:
        return child.returncode
    for d in watched:
        for leftover in _entries(d, (".opfuse-",)) - before[d]:
            _remove(leftover)
    try:
        name = signal.Signals(-child.returncode).name
    except ValueError:
        name = f"signal {-child.returncode}"
    print(f"opfuse: error: the compiler crashed ({name}) while opening the model on QNN's HTP "
          "(inside onnxruntime-qnn); nothing was written", file=sys.stderr)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
