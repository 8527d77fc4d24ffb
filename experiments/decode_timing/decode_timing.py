"""A sliding-window decode step with and without the present window's If, timed cold and warm.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python experiments/decode_timing/decode_timing.py \
        --model mistral --exporter dynamo --rounds 101 --copies 3

Two questions, one interleaved run each way:

1. What the If of :mod:`opfuse.passes.patterns.present_window` saves. opfuse ``--target onnxruntime
   --no-tune`` writes the decode step (the If in it); the same graph with each If replaced by its
   else-branch (the attention node and the export's two present Slices, always run: the graph before
   the rule) is the other row. Both are checked equal to the export on the timing inputs.
2. How the timing mode moves the "vs builder" ratio. ``repeat 1``: every round runs each session once,
   after the other sessions ran (its weights and caches cold, as ``benchmarks/decoders.py`` did before
   ``--repeat``); ``repeat 3``: three runs back to back, the fastest taken (as the tuner times, and as a
   decode loop runs one step after another). Both with an A/A of the export and of the builder.

Each row has ``--copies`` sessions (``opfuse.bench.measure``'s ``copies``), its round time their mean:
with one session each, the builder's A/A read 0.83-0.95 of the builder in runs of 301 rounds, and
the If and the Slices rows traded places from run to run.

The builder's graph and the exports are those ``benchmarks/decoders.py`` cached (run it once first).
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import onnx

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path[0:0] = [str(REPO), str(REPO / "benchmarks")]

import decoders  # noqa: E402
import genai_anchor  # noqa: E402

from opfuse.bench.measure import Variant, measure  # noqa: E402


def without_if(src: pathlib.Path, dst: pathlib.Path) -> int:
    """``src`` with each If replaced by its else-branch's nodes, writing the If's outputs; the count."""
    model = onnx.load(str(src))
    nodes, replaced = [], 0
    for node in model.graph.node:
        if node.op_type != "If":
            nodes.append(node)
            continue
        (branch,) = [a.g for a in node.attribute if a.name == "else_branch"]
        names = {out.name: outer for out, outer in zip(branch.output, node.output)}
        for inner in branch.node:
            copied = onnx.NodeProto()
            copied.CopyFrom(inner)
            copied.output[:] = [names.get(o, o) for o in inner.output]
            copied.input[:] = [names.get(i, i) for i in inner.input]
            nodes.append(copied)
        replaced += 1
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return replaced


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mistral", choices=sorted(decoders.MODELS))
    parser.add_argument("--exporter", default="dynamo", choices=decoders.EXPORTERS)
    parser.add_argument("--rounds", type=int, default=101)
    parser.add_argument("--copies", type=int, default=3, help="sessions per row, its round time their mean")
    parser.add_argument("--cache", type=pathlib.Path, default=decoders.DEFAULT_CACHE)
    args = parser.parse_args(argv)
    decoder = decoders.MODELS[args.model]
    path, error = decoders.exported(decoder, args.exporter, "decode", args.cache)
    if path is None:
        print(f"no export: {error}", file=sys.stderr)
        return 1
    built, error = genai_anchor.built(decoder, path.parent.parent)
    if built is None:
        print(f"no builder graph: {error}", file=sys.stderr)
        return 1
    inputs = decoders.feeds(path, "decode", decoder.config["vocab_size"], batch=1, seq=decoders.TIME_SEQ,
                            past=decoders.TIME_PAST, padded=0)
    own = genai_anchor.anchor_feeds(built, inputs, "decode")
    with tempfile.TemporaryDirectory(prefix="opfuse-decode-timing-") as tmp:
        written = pathlib.Path(tmp) / "if.onnx"
        subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(path), "-o", str(written),
                        "--target", "onnxruntime", "--no-tune", "-q"], check=True)
        plain = pathlib.Path(tmp) / "slices.onnx"
        count = without_if(written, plain)
        print(f"{args.model} {args.exporter} decode, past {decoders.TIME_PAST}: {count} If(s) in opfuse's graph")
        files = {"original": path, "original (A/A)": path, "opfuse, If": written, "opfuse, Slices": plain,
                 "builder": built, "builder (A/A)": built}
        variants = [Variant(k, k, str(v), level="all", kind="control" if "A/A" in k else "config",
                            feeds=own if k.startswith("builder") else None, exact=not k.startswith("builder"))
                    for k, v in files.items()]
        for repeat in (1, 3):
            result = measure(variants, inputs, threads=1, rounds=args.rounds, baseline="original", repeat=repeat,
                             copies=args.copies)
            if result.mismatches or result.errors:
                print(f"not equal or failed: {result.mismatches or result.errors}", file=sys.stderr)
                return 1
            print(f"repeat {repeat} ({args.rounds} rounds; the fastest of {repeat} run(s) per round; "
                  f"{args.copies} session(s) per row)")
            print(f"  {'row':<16} {'median ms':>9} {'min-max':>13}  {'vs original [IQR]':>22}  {'vs builder [IQR]':>22}")
            for label in files:
                timing = result.timings[label]
                paired = result.paired(label, "builder")
                lo, hi = timing.ratio_spread
                print(f"  {label:<16} {timing.median:>9.3f} {timing.min:>6.3f}-{timing.max:<6.3f}  "
                      f"{timing.ratio:>8.3f} [{lo:.3f}-{hi:.3f}]  {np.median(paired):>8.3f} "
                      f"[{np.percentile(paired, 25):.3f}-{np.percentile(paired, 75):.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
