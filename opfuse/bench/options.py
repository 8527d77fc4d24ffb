"""``opfuse bench``'s options: the parser, the defaults, and their validation.

    opfuse bench                         built-in ResNet-50, batch 1, 224x224
    opfuse bench MODEL.onnx              any model (symbolic batch bound to --batch)
    opfuse bench --model mobilenetv2     another built-in
        [--configs none,conv-bn,conv-act,conv-bn-act,all] [--runtime-levels basic,extended,all]
        [--threads 2] [--reps 50] [--warmup 2] [--batch 1] [--image-size 224] [--dim NAME=N]
        [--hardware npu-chapter[,npu-small]] [--json FILE|-] [--plot FILE.png]
        [--[no-]profile-ops] [--[no-]int8] [--layers N] [--no-measure] [--quick]

This module is light (the command line builds its parser at start-up); the run is
:mod:`opfuse.bench.run`, the result :mod:`opfuse.bench.result`.
"""

from __future__ import annotations

__all__ = ["add_parser", "options_from_args", "BenchOptions", "DEFAULT_CONFIGS", "DEFAULT_LEVELS",
           "BASELINE", "CONTROL", "ORT_ALL"]

import argparse
import dataclasses
import pathlib

from opfuse.bench.ablation import CONFIGS
from opfuse.errors import BadInputError, require_extra
from opfuse.targets import RUNTIME_LEVELS
from opfuse.cost.profiles import list_profiles, load_profile

DEFAULT_CONFIGS = ("none", "conv-bn", "conv-act", "conv-bn-act", "all")
DEFAULT_LEVELS = ("basic", "extended", "all")
DEFAULT_MODEL = "resnet50"
DEFAULT_PROFILE = "npu-chapter"
BASELINE = "none"  # the configuration every ratio is taken against
CONTROL = "none-aa"  # the A/A control: the baseline again, in its own session
ORT_ALL = "ort-all"  # the float model at ONNX Runtime's all level: what the int8 rows compare with


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
    shipped = list_profiles()
    p.add_argument("--hardware", default=DEFAULT_PROFILE, metavar="PROFILE[,PROFILE]",
                   help=f"accelerator profiles to predict for: {', '.join(shipped)}, or .toml paths "
                        "(default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON ('-' for stdout, no tables)")
    p.add_argument("--plot", metavar="FILE.png", help="write latency, traffic and traffic-per-layer plots")
    p.add_argument("--profile-ops", action=argparse.BooleanOptionalAction, default=None,
                   help="kernel time per op type from ONNX Runtime's profiler (default: on, off with --quick)")
    p.add_argument("--int8", action=argparse.BooleanOptionalAction, default=None,
                   help="int8 rows: the model quantised with BN folded (opfuse quantize) and unfolded "
                        "(ONNX Runtime's quantize_static), measured at ORT all beside the float model at "
                        "all, and predicted (default: on for the built-in models when measuring)")
    p.add_argument("--layers", type=int, default=0, metavar="N",
                   help="also print the N layers that move the most bytes unfused")
    p.add_argument("--no-measure", action="store_true", help="skip ONNX Runtime: traffic and predictions only")
    p.add_argument("--quick", action="store_true", help="fewer repetitions, no op profile (a smoke run)")


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
    int8: bool = True  # the CLI turns it off for model files and --no-measure


def options_from_args(args) -> BenchOptions:
    """Validate the command line; every problem is a one-line BadInputError."""
    from opfuse.models import BUILTIN_MODELS  # heavy (onnx): only when the command runs

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
        if load_profile(name).compiler == "vela":  # (load_profile: BadInputError for an unknown profile)
            require_extra("ethos-u", f"--hardware {name} (Arm's Vela compiler and LiteRT)")
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
    if args.plot:  # before any measuring
        require_extra("plot", "--plot")
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
        int8=args.int8 if args.int8 is not None else (not args.model and not args.no_measure),
    )


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]
