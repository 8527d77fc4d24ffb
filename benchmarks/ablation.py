"""The chapter's ablation, measured: what each fusion buys on ONNX Runtime CPU, and against whom.

For each built-in model (default ResNet-50, MobileNetV2 and VGG; batch 1, 224x224), every row
below runs in its own ONNX Runtime session, all measured together: warm-up, then rounds that
run every session once in a rotating order, so a busy neighbour slows every row alike. Each
row is printed as the median over rounds of (row / unfused in the same round), with the
inter-quartile range, the median and min-max in ms, its node count and its memory traffic.

    none / Conv+BN / Conv+act / Conv+BN+act / everything   opfuse configs, ORT optimisations off
    none A/A                                              the unfused model in a 2nd session:
                                                          the noise floor
    ORT BASIC / EXTENDED / ALL                            the runtime's own optimiser, original
    onnxslim / onnxscript                                 the peers' outputs, ORT optimisations off
    opfuse all @ ALL                                      opfuse's output (config all, for
                                                          runtime level "all") at ORT ALL

On ResNet-50 and MobileNetV2 BatchNormalization sits between each conv and its activation, so
Conv+act equals none there (said, not measured twice); VGG has no BN, so Conv+act differs.

Last, the NCHWc check: ONNX Runtime at ALL rewrites convs into its blocked layout
(``com.microsoft.nchwc.Conv``); opfuse's output must keep as many convs in it as the
original does, or the layout interplay has regressed.

    python benchmarks/ablation.py [--models resnet50,mobilenetv2,vgg] [--reps 30] [--warmup 3]
                                  [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import onnx
import onnx_ir as ir
from rich import box
from rich.console import Console
from rich.table import Table

from opfuse.bench.ablation import CONFIGS, apply_config
from opfuse.bench.measure import Variant, measure
from opfuse.runtime import optimized_graph
from opfuse.cost.traffic import analyse_traffic
from opfuse.models import build
from opfuse.verify import make_inputs

NCHWC_CONV = "com.microsoft.nchwc.Conv"
# the chapter's rows, named for any activation (MobileNetV2's is ReLU6, a Clip)
LABELS = {"none": "none", "conv-bn": "Conv+BN", "conv-act": "Conv+act", "conv-bn-act": "Conv+BN+act",
          "all": "everything"}


def variants_for(name: str, proto: onnx.ModelProto, console: Console) -> tuple[list[Variant], dict[str, str], dict]:
    """(variants to measure, rows equal to another row, traffic per row)."""
    variants: list[Variant] = []
    same: dict[str, str] = {}
    traffic: dict[str, object] = {}
    seen: dict[tuple, str] = {}
    original = proto.SerializeToString()
    for config in CONFIGS.values():
        model, _ = apply_config(proto, config.name, runtime_level="disabled")
        key = _fingerprint(model)
        traffic[config.name] = analyse_traffic(model, batch=1)
        if key in seen:
            same[config.name] = seen[key]
            continue
        seen[key] = config.name
        variants.append(Variant(config.name, LABELS.get(config.name, config.label), model, "disabled", "config"))
        if config.name == "none":
            variants.append(Variant("none-aa", "none A/A", model, "disabled", "control"))
            traffic["none-aa"] = traffic["none"]
    for level in ("basic", "extended", "all"):
        variants.append(Variant(f"ort-{level}", f"ORT {level.upper()}", original, level, "runtime"))
        graph = optimized_graph(original, level)
        traffic[f"ort-{level}"] = analyse_traffic(graph, batch=1)
    start = time.perf_counter()
    import onnxslim

    slim = onnxslim.slim(onnx.ModelProto.FromString(original))
    console.print(f"  onnxslim: {time.perf_counter() - start:.1f} s")
    variants.append(Variant("onnxslim", "onnxslim", slim.SerializeToString(), "disabled", "peer"))
    traffic["onnxslim"] = analyse_traffic(slim, batch=1)
    start = time.perf_counter()
    import onnxscript.optimizer

    osc = onnxscript.optimizer.optimize(onnx.ModelProto.FromString(original))
    console.print(f"  onnxscript optimizer: {time.perf_counter() - start:.1f} s")
    variants.append(Variant("onnxscript", "onnxscript", osc.SerializeToString(), "disabled", "peer"))
    traffic["onnxscript"] = analyse_traffic(osc, batch=1)
    fused_all, report = apply_config(proto, "all", runtime_level="all")
    variants.append(Variant("opfuse-all@ALL", "opfuse all @ ALL", fused_all, "all", "opfuse"))
    traffic["opfuse-all@ALL"] = analyse_traffic(optimized_graph(ir.serde.serialize_model(fused_all).SerializeToString(), "all"), batch=1)
    if report.refusals:
        console.print(f"  opfuse all for runtime level 'all': {report.summary()}")
    return variants, same, traffic


def _fingerprint(model: ir.Model) -> tuple:
    return tuple((n.domain, n.op_type, tuple(v.name if v else "" for v in n.inputs),
                  tuple(v.name for v in n.outputs)) for n in model.graph)


def bench_model(name: str, args, console: Console) -> dict:
    console.print(f"[bold]{name}[/bold] (batch 1, 224x224, float32): preparing...")
    proto = build(name, batch=1, image_size=224)
    variants, same, traffic = variants_for(name, proto, console)
    feeds = make_inputs(ir.serde.deserialize_model(proto), seed=0)
    load_before = os.getloadavg()
    start = time.perf_counter()

    def progress(stage, done, total):
        if done == total or done % 10 == 0:
            console.print(f"  {stage} {done}/{total} ({time.perf_counter() - start:.0f} s)", highlight=False)

    m = measure(variants, feeds, threads=args.threads, warmup=args.warmup, rounds=args.reps,
                baseline="none", progress=progress)
    load_after = os.getloadavg()
    none_traffic = traffic["none"].total

    table = Table(title=f"{name}: ratio to the unfused model with ONNX Runtime's optimisations disabled "
                        f"({args.threads} threads, {args.reps} interleaved rounds, median and IQR)",
                  title_justify="left", box=box.SIMPLE_HEAD)
    for col, justify in (("row", "left"), ("ORT level", "left"), ("nodes", "right"), ("time ratio", "right"),
                         ("IQR", "right"), ("median ms", "right"), ("min-max ms", "right"),
                         ("traffic MB", "right"), ("x none", "right")):
        table.add_column(col, justify=justify)
    rows = []
    order = list(CONFIGS) + [v.name for v in variants if v.name not in CONFIGS]
    levels = {v.name: v.level for v in variants}
    labels = {v.name: v.label for v in variants}
    for key in order:
        tr = traffic.get(key)
        traffic_mb = "-"
        ratio_tr = ""
        if tr is not None:
            if tr.unknown:
                traffic_mb = "n/a (NCHWc)"
            else:
                traffic_mb = f"{tr.total / 1e6:.1f}"
                ratio_tr = f"{tr.total / none_traffic:.2f}"
        if key in same:
            label = f"{LABELS.get(key, key)} ({key})"
            table.add_row(label, "disabled", str(len(traffic[key].kernels)), f"= {same[key]}", "", "", "",
                          traffic_mb, ratio_tr)
            rows.append({"row": key, "same_as": same[key]})
            continue
        timing = m.timings.get(key)
        label = labels.get(key, key)
        if key in CONFIGS and LABELS.get(key, key) != key:
            label = f"{LABELS[key]} ({key})"
        nodes = m.nodes(key)
        if timing is None:
            table.add_row(label, levels.get(key, ""), str(nodes or "-"), f"failed: {m.errors.get(key, '?')}")
            rows.append({"row": key, "error": m.errors.get(key)})
            continue
        lo, hi = timing.ratio_spread
        mismatch = m.mismatches.get(key)
        table.add_row(
            label + (" [red](outputs differ)[/red]" if mismatch else ""),
            levels.get(key, ""), str(nodes), f"{timing.ratio:.3f}", f"{lo:.3f}-{hi:.3f}",
            f"{timing.median:.1f}", f"{timing.min:.1f}-{timing.max:.1f}", traffic_mb, ratio_tr,
        )
        rows.append({"row": key, "level": levels.get(key), "nodes": nodes, **timing.to_dict(),
                     "traffic_bytes": None if tr is None or tr.unknown else tr.total, "mismatch": mismatch})
    console.print(table)
    aa = m.timings.get("none-aa")
    if aa is not None:
        console.print(f"  A/A control: {aa.ratio:.3f} (IQR {aa.ratio_spread[0]:.3f}-{aa.ratio_spread[1]:.3f}): "
                      "differences smaller than this are noise", highlight=False)
    original_nchwc = m.op_counts.get("ort-all", {}).get(NCHWC_CONV, 0)
    opfuse_nchwc = m.op_counts.get("opfuse-all@ALL", {}).get(NCHWC_CONV, 0)
    verdict = "OK" if opfuse_nchwc >= original_nchwc else "[red]REGRESSION: opfuse's output loses NCHWc convs[/red]"
    console.print(f"  NCHWc check: {NCHWC_CONV} nodes at ORT ALL: original {original_nchwc}, "
                  f"opfuse all @ ALL {opfuse_nchwc}  {verdict}", highlight=False)
    console.print(f"  load average: {load_before[0]:.2f} -> {load_after[0]:.2f} on {os.cpu_count()} CPUs; "
                  f"{time.perf_counter() - start:.0f} s measuring", highlight=False)
    return {"model": name, "rows": rows, "nchwc": {"original": original_nchwc, "opfuse": opfuse_nchwc},
            "aa_ratio": None if aa is None else aa.ratio, "load_average": [load_before[0], load_after[0]],
            "threads": args.threads, "reps": args.reps, "warmup": args.warmup}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,mobilenetv2,vgg")
    parser.add_argument("--reps", type=int, default=30, help="interleaved rounds (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 140)
    import onnxruntime

    console.print(f"onnxruntime {onnxruntime.__version__}, {os.cpu_count()} CPUs", highlight=False)
    results = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        results.append(bench_model(name, args, console))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2, default=lambda o: o.item() if hasattr(o, "item") else str(o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
