"""SmolLM2-135M's four exports against what the default command writes at ``--target onnx`` (no other flag),
timed as ``benchmarks/decoders.py`` times its rows: ORT all, 1 thread, the same timing inputs (decode: past
256; prefill: seq 128), interleaved rounds of ``--repeat`` runs (the fastest), ``--copies`` sessions a row,
an A/A copy of the export beside it, every written model checked equal to the export first (the benchmark's
rule). ``benchmarks/decoders.py`` times ``--target onnxruntime`` and ``--target onnx --opset 23``, not the
default ``onnx`` target at the export's own opset; this fills that row.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python experiments/onnx_target_timing/time_onnx_target.py \
        --written DIR          # DIR/<exporter>-<graph>-onnx/out.onnx, written by `opfuse optimize X -o .. --target onnx`

The exports are those ``benchmarks/decoders.py`` cached (run it once first).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path[0:0] = [str(REPO), str(REPO / "benchmarks")]

import decoders  # noqa: E402
from opfuse.bench.measure import Variant, measure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--written", type=pathlib.Path, required=True)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--copies", type=int, default=2)
    args = parser.parse_args()
    decoder = decoders.MODELS["smollm2-135m"]
    for exporter in ("dynamo", "torchscript"):
        for graph in ("decode", "prefill"):
            path, why = decoders.exported(decoder, exporter, graph, decoders.DEFAULT_CACHE)
            if path is None:
                print(f"{exporter} {graph}: no export: {why}")
                continue
            written = args.written / f"{exporter}-{graph}-onnx" / "out.onnx"
            inputs = decoders.feeds(path, graph, decoder.config["vocab_size"], batch=1, seq=decoders.TIME_SEQ,
                                    past=decoders.TIME_PAST, padded=0)
            variants = [Variant("export", "export", str(path), level="all"),
                        Variant("export (A/A)", "export (A/A)", str(path), level="all", kind="control"),
                        Variant("opfuse onnx", "opfuse onnx", str(written), level="all")]
            result = measure(variants, inputs, threads=1, rounds=args.rounds, baseline="export",
                             repeat=args.repeat, copies=args.copies)
            for label in ("export", "export (A/A)", "opfuse onnx"):
                t = result.timings.get(label)
                status = result.errors.get(label) or result.mismatches.get(label) or "ok"
                if t is None:
                    print(f"{exporter:11s} {graph:7s} {label:13s} {status}")
                    continue
                lo, hi = t.ratio_spread
                print(f"{exporter:11s} {graph:7s} {label:13s} {t.median:8.2f} ms ({t.min:.2f}-{t.max:.2f})  "
                      f"ratio {t.ratio:.3f} [{lo:.3f}-{hi:.3f}]  nodes {result.nodes(label)}  {status}", flush=True)


if __name__ == "__main__":
    main()
