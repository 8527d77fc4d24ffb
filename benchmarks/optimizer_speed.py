"""How fast is the optimiser itself? (Not the model it produces: see ablation.py for that.)

1. Folding the built-in ResNet-50 in memory: opfuse's passes vs onnxscript's rewriter (the
   fastest Python peer; its default rule set, and its three BatchNorm rules alone) on the
   same onnx-ir model, interleaved, median of several repetitions, printed as ratios.
2. The whole CLI run (load, check, fold, save; verification excluded) on ResNet-50.
3. Scaling: chains of Conv+BN+Relu blocks of growing length; a linear pass keeps the time
   per block constant. ``--peers`` also runs onnxscript's optimizer and onnxslim on the
   smaller chains (both take minutes: they grow quadratically).

    python benchmarks/optimizer_speed.py [--reps 5] [--blocks 1000,2000,4000,8000] [--peers]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from opfuse.models import build
from opfuse.passes import DEFAULT_PASSES
from opfuse.pipeline import optimize, run_passes
from opfuse.report import FusionReport


def chain(blocks: int, channels: int = 4) -> onnx.ModelProto:
    """blocks x (Conv -> BatchNormalization -> Relu), tiny tensors."""
    r = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(blocks):
        inits.append(numpy_helper.from_array((r.standard_normal((channels, channels, 3, 3)) * 0.2).astype(np.float32), f"w{i}"))
        for name, arr in (("g", r.uniform(0.5, 1.5, channels)), ("b", r.normal(0, 0.1, channels)),
                          ("m", r.normal(0, 0.1, channels)), ("v", r.uniform(0.5, 1.5, channels))):
            inits.append(numpy_helper.from_array(arr.astype(np.float32), f"{name}{i}"))
        nodes += [
            helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", [f"c{i}", f"g{i}", f"b{i}", f"m{i}", f"v{i}"], [f"n{i}"], name=f"bn{i}"),
            helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        x = f"r{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 8, 8])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, channels, 8, 8])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def opfuse_fold(model: ir.Model) -> None:
    run_passes(model, DEFAULT_PASSES, FusionReport())


def onnxscript_fold(model: ir.Model) -> None:
    """onnxscript's three BatchNorm rules alone (they compute in float32)."""
    from onnxscript import rewriter
    from onnxscript.rewriter.rules.common import _fuse_batchnorm

    rewriter.rewrite(model, pattern_rewrite_rules=_fuse_batchnorm.rules)


def onnxscript_rewrite(model: ir.Model) -> None:
    """onnxscript's rewriter as a user runs it: the default rule set (folds BN too)."""
    from onnxscript import rewriter

    rewriter.rewrite(model)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fold_speed(reps: int) -> None:
    base = ir.serde.deserialize_model(build("resnet50"))
    contenders = {
        "opfuse passes": opfuse_fold,
        "onnxscript rewriter": onnxscript_rewrite,
        "onnxscript BN rules": onnxscript_fold,
    }
    times = {name: [] for name in contenders}
    for _ in range(reps):  # interleaved: each round runs every contender once
        for name, fn in contenders.items():
            model = base.clone()
            times[name].append(timed(lambda: fn(model)))
    print("\n1. Fold ResNet-50 in memory (53 Conv+BN), median of", reps)
    ours = statistics.median(times["opfuse passes"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"   {name:22s} {med * 1000:7.1f} ms  (min {min(ts) * 1000:.1f}, max {max(ts) * 1000:.1f})  "
              f"opfuse is {med / ours:.2f}x as fast")
    print("   (opfuse folds in float64 and checks the cast; onnxscript's rules compute in float32)")


def cli_speed(reps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "resnet50.onnx"
        onnx.save(build("resnet50"), src)
        ts = []
        for _ in range(reps):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(src), "-o", str(Path(tmp) / "o.onnx"),
                            "--no-verify", "-q"], check=True, capture_output=True)
            ts.append(time.perf_counter() - start)
        print(f"\n2. CLI run on ResNet-50 (load, check, fold, save; no verification), "
              f"including Python start-up: median {statistics.median(ts):.2f} s (min {min(ts):.2f}, max {max(ts):.2f})")


def scaling(blocks_list: list[int], peers: bool) -> None:
    print("\n3. Scaling on Conv+BN+Relu chains (optimize: load, check, fold; no verification)")
    print(f"   {'blocks':>7} {'nodes':>7} {'opfuse s':>9} {'us/node':>8}" + ("  onnxscript s  onnxslim s" if peers else ""))
    for blocks in blocks_list:
        proto = chain(blocks)
        t = timed(lambda: optimize(proto, verify=False))
        row = f"   {blocks:7d} {3 * blocks:7d} {t:9.2f} {t / (3 * blocks) * 1e6:8.1f}"
        if peers and blocks <= 2000:
            import onnxscript.optimizer
            import onnxslim

            t_os = timed(lambda: onnxscript.optimizer.optimize(ir.serde.deserialize_model(proto)))
            t_sl = timed(lambda: onnxslim.slim(proto))
            row += f"  {t_os:12.2f}  {t_sl:10.2f}"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--blocks", default="1000,2000,4000,8000")
    parser.add_argument("--peers", action="store_true", help="also time onnxscript/onnxslim on chains <= 2000 blocks")
    args = parser.parse_args()
    fold_speed(args.reps)
    cli_speed(max(3, args.reps // 2))
    scaling([int(b) for b in args.blocks.split(",")], args.peers)


if __name__ == "__main__":
    main()
