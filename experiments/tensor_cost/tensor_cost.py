"""What part of a decode step costs what: named tensors replaced by inputs fed their values, timed.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python experiments/tensor_cost/tensor_cost.py WRITTEN.onnx \
        --replace "mask=Expand_4_output_0" --replace "rotary caches=Slice_output_0,Slice_1_output_0" \
        --model mistral --exporter dynamo --rounds 41

``WRITTEN.onnx`` is a decode step opfuse wrote from the export ``benchmarks/decoders.py`` cached (the
same inputs feed both). Each ``--replace LABEL=T1,T2`` is a row: the tensors T1, T2 become graph inputs
fed the values the graph computes for them on the timing inputs, and every node only they needed goes.
What that row saves against the graph as written is what computing those tensors costs (an upper bound
of what a rewrite of them can save). The rows, the graph's A/A and the builder's graph are timed in one
interleaved run (``opfuse.bench.measure``, the fastest of 3 runs per round, ``--copies`` sessions per row).

docs/results/decoders.md ("The mask arithmetic in fewer nodes") has the run on Mistral's dynamo decode
step as opfuse wrote it at 8c60d61 (before ``index-arithmetic``), whose mask was ``Expand_4_output_0``.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys

import numpy as np
import onnx
import onnxruntime as ort

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path[0:0] = [str(REPO), str(REPO / "benchmarks")]

import decoders  # noqa: E402
import genai_anchor  # noqa: E402

from opfuse.bench.measure import Variant, measure  # noqa: E402


def values(model: onnx.ModelProto, names: list[str], inputs: dict) -> dict[str, np.ndarray]:
    exposed = copy.deepcopy(model)
    exposed.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    session = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip(names, session.run(names, inputs)))


def fed(model: onnx.ModelProto, names: list[str], inputs: dict) -> tuple[bytes, dict, int]:
    """``model`` with ``names`` as inputs and the nodes only they needed gone; its feeds; its node count."""
    computed = values(model, names, inputs)
    cut = copy.deepcopy(model)
    cut.graph.input.extend(onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(v.dtype),
                                                             list(v.shape)) for n, v in computed.items())
    kept = [n for n in cut.graph.node if not set(n.output) & set(names)]
    wanted = {o.name for o in cut.graph.output}
    while True:
        read = set(wanted)
        for node in kept:
            read.update(node.input)
            read.update(i for a in node.attribute if a.type == onnx.AttributeProto.GRAPH for n in a.g.node
                        for i in n.input)
        still = [n for n in kept if set(n.output) & read]
        if len(still) == len(kept):
            break
        kept = still
    del cut.graph.node[:]
    cut.graph.node.extend(kept)
    graph_inputs = [i for i in cut.graph.input if i.name in read or i.name in names]
    del cut.graph.input[:]
    cut.graph.input.extend(graph_inputs)
    feeds = {k: v for k, v in inputs.items() if k in read} | computed
    return cut.SerializeToString(), feeds, len(kept)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("written", type=pathlib.Path)
    parser.add_argument("--replace", action="append", default=[], metavar="LABEL=T1,T2")
    parser.add_argument("--model", default="mistral", choices=sorted(decoders.MODELS))
    parser.add_argument("--exporter", default="dynamo", choices=decoders.EXPORTERS)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--cache", type=pathlib.Path, default=decoders.DEFAULT_CACHE)
    args = parser.parse_args(argv)
    decoder = decoders.MODELS[args.model]
    path, error = decoders.exported(decoder, args.exporter, "decode", args.cache)
    built, built_error = genai_anchor.built(decoder, path.parent.parent) if path else (None, error)
    if path is None or built is None:
        print(f"no export or builder graph: {error or built_error}", file=sys.stderr)
        return 1
    inputs = decoders.feeds(path, "decode", decoder.config["vocab_size"], batch=1, seq=decoders.TIME_SEQ,
                            past=decoders.TIME_PAST, padded=0)
    written = onnx.load(str(args.written))
    rows = {"written": (written.SerializeToString(), None, len(written.graph.node))}
    rows["written (A/A)"] = rows["written"]
    for spec in args.replace:
        label, _, names = spec.partition("=")
        rows[label] = fed(written, names.split(","), inputs)
    variants = [Variant(k, k, model, level="all", kind="control" if "A/A" in k else "config", feeds=feeds)
                for k, (model, feeds, _) in rows.items()]
    variants.append(Variant("builder", "builder", str(built), level="all", exact=False,
                            feeds=genai_anchor.anchor_feeds(built, inputs, "decode")))
    result = measure(variants, inputs, threads=1, rounds=args.rounds, baseline="written", repeat=3,
                     copies=args.copies)
    if result.mismatches or result.errors:
        print(f"not equal or failed: {result.mismatches or result.errors}", file=sys.stderr)
        return 1
    print(f"{args.model} {args.exporter} decode at past {decoders.TIME_PAST}, {args.rounds} rounds, "
          f"{args.copies} session(s) per row")
    print(f"  {'row':<28} {'nodes':>5} {'median ms':>9}  {'vs written [IQR]':>22}")
    for label in [*rows, "builder"]:
        paired = result.paired(label, "written")
        nodes = rows[label][2] if label in rows else "-"
        print(f"  {label:<28} {nodes:>5} {result.timings[label].median:>9.4f}  {np.median(paired):>8.3f} "
              f"[{np.percentile(paired, 25):.3f}-{np.percentile(paired, 75):.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
