"""Eager CPU latency: unfused vs torch.fx's fuse vs opfuse.torch.fuse (vs torch.compile).

    python benchmarks/torch_fusion.py --model resnet50 --threads 2 --reps 30

Every configuration runs the same input once per round, in a rotating order, for
``--reps`` rounds (interleaved, so drift and noisy neighbours hit all of them alike);
the table gives median / min / max latency and the speed-up over the unfused eager
model (median unfused / median config). "unfused (A/A)" is a second copy of the unfused
model: its distance from 1.00x is the noise floor of the run. Ablations: opfuse folding
only (``kernels=False``), and the fused kernels without pre-packed weights.
torch.compile runs with ``torch._inductor.config.freezing = True`` (constant-folds the
weights and pre-packs them too); its compile time is reported, and it is skipped with a
message if it fails here (``--no-compile`` skips it outright).
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import sys
import time

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import torch_nets  # noqa: E402

import opfuse.torch  # noqa: E402


def build_configs(model, x, *, compile_: bool, console: Console):
    configs = {"unfused": model, "unfused (A/A)": copy.deepcopy(model)}
    from torch.fx.experimental.optimization import fuse as fx_fuse

    configs["torch.fx fuse"] = fx_fuse(model)
    t = time.perf_counter()
    fused, report = opfuse.torch.fuse(model, (x,))
    console.print(f"opfuse.torch.fuse: {time.perf_counter() - t:.2f} s; {report.summary()}")
    configs["opfuse"] = fused
    configs["opfuse, fold only"] = opfuse.torch.fuse(model, (x,), kernels=False)[0]
    configs["opfuse, no prepack"] = opfuse.torch.fuse(model, (x,), prepack=False)[0]
    extra = {}
    if compile_:
        try:
            import torch._inductor.config as inductor_config

            inductor_config.freezing = True
            compiled = torch.compile(copy.deepcopy(model))
            t = time.perf_counter()
            with torch.no_grad():
                compiled(x)
            extra["compile_s"] = time.perf_counter() - t
            configs["torch.compile (freezing)"] = compiled
        except Exception as exc:  # noqa: BLE001 - report and carry on without it
            console.print(f"[yellow]torch.compile skipped:[/yellow] {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200]}")
    return configs, extra


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["resnet50", "mobilenetv2", "resnet18"],
                        default="resnet50")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    args = parser.parse_args(argv)

    console = Console(width=130)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model = torch_nets.build(args.model)
    x = torch.randn(args.batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    configs, extra = build_configs(model, x, compile_=not args.no_compile, console=console)

    with torch.no_grad():
        reference = model(x)
        scale = float(reference.abs().max())
        errors = {name: float((f(x) - reference).abs().max()) / scale
                  for name, f in configs.items()}
        for _ in range(args.warmup):
            for f in configs.values():
                f(x)
        times: dict[str, list[float]] = {name: [] for name in configs}
        names = list(configs)
        for r in range(args.reps):
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotate the order
                t = time.perf_counter()
                configs[name](x)
                times[name].append(time.perf_counter() - t)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    low = {name: min(ts) for name, ts in times.items()}
    table = Table(title=(f"{args.model}, batch {args.batch}, {args.threads} threads, eager CPU, "
                         f"torch {torch.__version__}, {args.reps} interleaved rounds"),
                  title_justify="left")
    for col in ("configuration", "median ms", "min ms", "max ms", "speed-up (median)",
                "speed-up (min)", "max |diff| / scale"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for name, ts in times.items():
        table.add_row(name, f"{med[name] * 1e3:.2f}", f"{low[name] * 1e3:.2f}",
                      f"{max(ts) * 1e3:.2f}", f"{med['unfused'] / med[name]:.2f}x",
                      f"{low['unfused'] / low[name]:.2f}x", f"{errors[name]:.1e}")
    console.print(table)
    console.print(f"load average (1 min) before/after: {load_before[0]:.2f} / "
                  f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (above the CPU count, "
                  "medians are contended: trust the A/A row and the min column)")
    if "compile_s" in extra:
        console.print(f"torch.compile (freezing): first call (compile) took "
                      f"{extra['compile_s']:.1f} s")
    compiled = "torch.compile (freezing)"
    if compiled in times:
        console.print(f"opfuse latency / compiled latency: {med['opfuse'] / med[compiled]:.2f} "
                      f"(median), {low['opfuse'] / low[compiled]:.2f} (min)")
    console.print(f"opfuse speed-up over torch.fx fuse: "
                  f"{med['torch.fx fuse'] / med['opfuse']:.2f}x (median), "
                  f"{low['torch.fx fuse'] / low['opfuse']:.2f}x (min)")


if __name__ == "__main__":
    main()
