"""How fast is the optimiser itself? (Not the model it produces: see ablation.py for that.)

1. Folding the built-in ResNet-50 in memory: opfuse's passes vs onnxscript's rewriter (the
   fastest Python peer; its default rule set, and its three BatchNorm rules alone) on the
   same onnx-ir model, interleaved, median of several repetitions, printed as ratios.
2. The whole CLI run (load, check, fold, save; verification excluded) on ResNet-50.
3. Scaling (issue 10): chains of Conv -> BatchNormalization -> Relu blocks, 4 channels,
   8x8, with unnamed nodes as many exporters write them (``--named`` names them), run
   through the real command as a user would, ``python -m opfuse optimize chain.onnx -o
   out.onnx --no-verify -q --target T``, for T in onnx and onnxruntime, each a fresh
   process. Start-up (Python, imports, a 1-block chain through the same command) is
   measured the same way and subtracted. Per row: median wall seconds (min-max over
   ``--reps``, interleaved so a busy machine slows every row alike), the same minus
   start-up, us per node, and the process's CPU seconds (user + system, from
   ``getrusage``: steadier than wall time on a shared machine). Then t(16000)/t(4000)
   (start-up subtracted) against the issue's limit of 5x and the linear 4x, and the
   clean-up stage alone, in process, for the largest chain. Verification is off
   (``--no-verify``): the issue is about the optimiser. ``--peers`` also runs
   onnxscript's optimizer and onnxslim in process on the chains up to 2000 blocks (both
   take minutes: they grow quadratically).

    python benchmarks/optimizer_speed.py [--reps 5] [--blocks 1000,4000,16000] [--named]
                                         [--targets onnx,onnxruntime] [--sections 1,2,3] [--peers]
"""

from __future__ import annotations

import argparse
import resource
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


def chain(blocks: int, channels: int = 4, named: bool = True) -> onnx.ModelProto:
    """blocks x (Conv -> BatchNormalization -> Relu), tiny tensors; ``named=False`` leaves
    the nodes without names (tensors keep theirs, as the ONNX format needs)."""
    r = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"

    def name(text: str) -> str:
        return text if named else ""

    for i in range(blocks):
        inits.append(numpy_helper.from_array((r.standard_normal((channels, channels, 3, 3)) * 0.2).astype(np.float32), f"w{i}"))
        for pname, arr in (("g", r.uniform(0.5, 1.5, channels)), ("b", r.normal(0, 0.1, channels)),
                           ("m", r.normal(0, 0.1, channels)), ("v", r.uniform(0.5, 1.5, channels))):
            inits.append(numpy_helper.from_array(arr.astype(np.float32), f"{pname}{i}"))
        nodes += [
            helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=name(f"conv{i}"), pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", [f"c{i}", f"g{i}", f"b{i}", f"m{i}", f"v{i}"], [f"n{i}"],
                             name=name(f"bn{i}")),
            helper.make_node("Relu", [f"n{i}"], [f"r{i}"], name=name(f"relu{i}")),
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


def cli_run(model: Path, out: Path, target: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one ``opfuse optimize`` process, as a user runs it."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(model), "-o", str(out), "--no-verify", "-q",
                    "--target", target], check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _spread(ts: list[float]) -> str:
    return f"{statistics.median(ts):7.2f} ({min(ts):.2f}-{max(ts):.2f})"


def cleanup_alone(proto: onnx.ModelProto) -> float:
    """Seconds of the first clean-up run (before the folds) on ``proto``, in process."""
    from opfuse.load import load_model
    from opfuse.passes.cleanup import CleanupPass

    model, _ = load_model(proto)
    return timed(lambda: CleanupPass(FusionReport())(model))


def scaling(blocks_list: list[int], reps: int, targets: list[str], named: bool) -> None:
    kind = "named" if named else "unnamed"
    print(f"\n3. Scaling on Conv+BN+Relu chains, {kind} nodes, through the CLI "
          f"(optimize --no-verify -q; a fresh process per run), {reps} interleaved rounds")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for blocks in [1, *blocks_list]:
            paths[blocks] = Path(tmp) / f"chain{blocks}.onnx"
            onnx.save(chain(blocks, named=named), paths[blocks])
        out = Path(tmp) / "out.onnx"
        wall = {(t, b): [] for t in targets for b in paths}
        cpu = {(t, b): [] for t in targets for b in paths}
        for _ in range(reps):  # interleaved: every round runs every size and target once
            for target in targets:
                for blocks, path in paths.items():
                    w, c = cli_run(path, out, target)
                    wall[target, blocks].append(w)
                    cpu[target, blocks].append(c)
        for target in targets:
            start_w = statistics.median(wall[target, 1])
            start_c = statistics.median(cpu[target, 1])
            print(f"\n   --target {target}: start-up (1 block) {_spread(wall[target, 1])} s wall, "
                  f"{start_c:.2f} s CPU")
            print(f"   {'blocks':>7} {'nodes':>7} {'wall s (min-max)':>22} {'- start-up':>10} {'us/node':>8} "
                  f"{'CPU s':>7} {'- start-up':>10}")
            net = {}
            for blocks in blocks_list:
                w = statistics.median(wall[target, blocks])
                c = statistics.median(cpu[target, blocks])
                net[blocks] = (w - start_w, c - start_c)
                print(f"   {blocks:7d} {3 * blocks:7d} {_spread(wall[target, blocks]):>22} {w - start_w:10.2f} "
                      f"{(w - start_w) / (3 * blocks) * 1e6:8.1f} {c:7.2f} {c - start_c:10.2f}")
            if 4000 in net and 16000 in net:
                rw, rc = net[16000][0] / net[4000][0], net[16000][1] / net[4000][1]
                verdict = "within" if rw <= 5 else "OVER"
                print(f"   t(16000)/t(4000), start-up subtracted: {rw:.2f}x wall, {rc:.2f}x CPU "
                      f"({verdict} the 5x limit; 4x is linear)")
            big = max(blocks_list)
            print(f"   {big} blocks under 15 s (wall, with start-up): "
                  f"{'yes' if statistics.median(wall[target, big]) < 15 else 'NO'}")
    big = max(blocks_list)
    t = cleanup_alone(chain(big, named=named))
    print(f"\n   clean-up stage alone (in process, its first run, {big} blocks): {t:.2f} s")


def peers_scaling(blocks_list: list[int]) -> None:
    import onnxscript.optimizer
    import onnxslim

    print("\n3b. Peers in process on the named chains: opfuse.optimize (no verification), onnxscript's "
          "optimizer, onnxslim")
    print(f"   {'blocks':>7} {'opfuse s':>9} {'onnxscript s':>13} {'onnxslim s':>11}")
    for blocks in [b for b in blocks_list if b <= 2000]:
        proto = chain(blocks)
        t = timed(lambda: optimize(proto, verify=False, tune=False))
        t_os = timed(lambda: onnxscript.optimizer.optimize(ir.serde.deserialize_model(proto)))
        t_sl = timed(lambda: onnxslim.slim(proto))
        print(f"   {blocks:7d} {t:9.2f} {t_os:13.2f} {t_sl:11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--blocks", default="1000,4000,16000")
    parser.add_argument("--targets", default="onnx,onnxruntime")
    parser.add_argument("--named", action="store_true", help="scaling chains with named nodes")
    parser.add_argument("--sections", default="1,2,3", help="which sections to run (1,2,3)")
    parser.add_argument("--peers", action="store_true", help="also time onnxscript/onnxslim on chains <= 2000 blocks")
    args = parser.parse_args()
    sections = {int(x) for x in args.sections.split(",")}
    if 1 in sections:
        fold_speed(args.reps)
    if 2 in sections:
        cli_speed(max(3, args.reps // 2))
    if 3 in sections:
        blocks = [int(b) for b in args.blocks.split(",")]
        scaling(blocks, args.reps, args.targets.split(","), args.named)
        if args.peers:
            peers_scaling(blocks)


if __name__ == "__main__":
    main()
