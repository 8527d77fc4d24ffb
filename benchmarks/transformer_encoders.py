"""Transformers through opfuse and its peers, side by side, in one interleaved run.

    python benchmarks/transformer_encoders.py                          small BERT and ViT, both exporters
    python benchmarks/transformer_encoders.py --models bert,bert-base,vit,encoder --rounds 30 --json out.json

Per model (``opfuse.models.transformers``: Hugging Face BertModel / ViTModel from configs
with random weights, torch's TransformerEncoder) and exporter (TorchScript at opset 17 with
symbolic batch and sequence, dynamo at opset 18 with static shapes), every configuration
a user could run:

    exported        the model as the exporter wrote it
    ort-tfm         onnxruntime.transformers.optimizer.optimize_model (its defaults)
    onnxscript      onnxscript.rewriter.ort_fusions.optimize_for_ort
    onnxslim        onnxslim.slim
    opfuse-onnx     opfuse optimize --target onnx --opset 20 (standard ops only)
    opfuse-ort      opfuse optimize --target onnxruntime

Printed per configuration: the node count of the file, the time the tool took, and the
latency at ONNX Runtime's ALL level measured interleaved (``opfuse.bench.measure``: every
round runs every configuration, in a rotating order), its median (min-max) over the
rounds, and the paired ratio to ort-tfm (median of the per-round ratios; below 1 is
faster). ``ort-tfm (A/A)`` is a second session of the same ort-tfm file: its ratio is the
noise floor of the run. Outputs are compared with the exported model's; a configuration
whose outputs differ says so. Not part of CI (minutes, and BERT-base is 440 MB).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import tempfile
import time

import onnx
import onnx_ir as ir

import opfuse
from opfuse.bench.measure import Variant, measure
from opfuse.models.transformers import BERT_BASE, SMALL_BERT, SMALL_VIT, example_feeds, export

EXPORTS = {"torchscript": 17, "dynamo": 18}
HEADS = {"bert": (SMALL_BERT["num_attention_heads"], SMALL_BERT["hidden_size"]),
         "bert-base": (BERT_BASE["num_attention_heads"], BERT_BASE["hidden_size"]),
         "vit": (SMALL_VIT["num_attention_heads"], SMALL_VIT["hidden_size"]),
         "encoder": (4, 32)}
MODEL_TYPE = {"bert": "bert", "bert-base": "bert", "vit": "vit", "encoder": "bert"}


def _ort_tfm(src: pathlib.Path, dst: pathlib.Path, kind: str) -> None:
    from onnxruntime.transformers.optimizer import optimize_model  # (the peer)

    heads, hidden = HEADS[kind]
    optimize_model(str(src), model_type=MODEL_TYPE[kind], num_heads=heads, hidden_size=hidden).save_model_to_file(
        str(dst), use_external_data_format=False)


def _onnxscript(src: pathlib.Path, dst: pathlib.Path, kind: str) -> None:
    from onnxscript.rewriter import ort_fusions  # (the peer)

    model, _ = ort_fusions.optimize_for_ort(ir.load(str(src)))
    ir.save(model, str(dst))


def _onnxslim(src: pathlib.Path, dst: pathlib.Path, kind: str) -> None:
    import onnxslim  # (the peer)

    onnx.save(onnxslim.slim(onnx.load(str(src))), str(dst))


def _opfuse(target: str, opset: int | None):
    def run(src: pathlib.Path, dst: pathlib.Path, kind: str) -> None:
        opfuse.optimize(str(src), target=target, opset=opset, output=dst, overwrite=True)
    return run


TOOLS = {
    "ort-tfm": _ort_tfm,
    "onnxscript": _onnxscript,
    "onnxslim": _onnxslim,
    "opfuse-onnx": _opfuse("onnx", 20),
    "opfuse-ort": _opfuse("onnxruntime", None),
}


def run_one(kind: str, exporter: str, folder: pathlib.Path, rounds: int) -> dict:
    exported = export(kind, exporter, EXPORTS[exporter], folder / f"{kind}-{exporter}.onnx")
    files = {"exported": exported}
    made = {"exported": {"seconds": 0.0}}
    for name, tool in TOOLS.items():
        dst = folder / f"{kind}-{exporter}-{name}.onnx"
        start = time.perf_counter()
        try:
            tool(exported, dst, kind)
            files[name] = dst
            made[name] = {"seconds": time.perf_counter() - start}
        except Exception as e:  # noqa: BLE001 - a peer's failure is a result, reported
            made[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    for name, path in files.items():
        proto = onnx.load(str(path), load_external_data=False)
        made[name]["nodes"] = len(proto.graph.node)
        made[name]["contrib"] = sorted({n.op_type for n in proto.graph.node if n.domain == "com.microsoft"})
    variants = [Variant(name, name, str(path), level="all") for name, path in files.items()]
    if "ort-tfm" in files:
        variants.append(Variant("ort-tfm (A/A)", "ort-tfm (A/A)", str(files["ort-tfm"]), level="all", kind="control"))
    feeds = example_feeds(kind) if kind != "bert-base" else _bert_base_feeds()
    result = measure(variants, feeds, rounds=rounds, baseline="exported")
    reference = "ort-tfm" if "ort-tfm" in result.timings else "exported"
    rows = {}
    for v in variants:
        row = dict(made.get(v.name, made.get("ort-tfm", {})))
        if v.name in result.errors:
            row["run_error"] = result.errors[v.name]
        if v.name in result.mismatches:
            row["mismatch"] = result.mismatches[v.name]
        timing = result.timings.get(v.name)
        if timing is not None:
            row.update(median_ms=timing.median, min_ms=timing.min, max_ms=timing.max,
                       ratio=result.ratio(v.name, reference), nodes_at_all=result.nodes(v.name))
        rows[v.name] = row
    for name, info in made.items():
        rows.setdefault(name, info)
    return {"model": kind, "exporter": exporter, "opset": EXPORTS[exporter], "reference": reference,
            "rounds": rounds, "rows": rows}


def _bert_base_feeds():
    from opfuse.models.transformers import example_feeds as feeds  # (bert-base: 128 tokens)

    return feeds("bert-base")


def show(result: dict) -> None:
    print(f"\n{result['model']} / {result['exporter']} (opset {result['opset']}), {result['rounds']} rounds at "
          f"ORT ALL; ratio = paired median time / {result['reference']}'s")
    print(f"  {'config':16s} {'nodes':>6s} {'at ALL':>7s} {'tool s':>7s} {'median ms':>10s} {'min-max':>15s} "
          f"{'ratio':>6s}  notes")
    for name, row in result["rows"].items():
        if "error" in row:
            print(f"  {name:16s} {'-':>6s} {'':>7s} {'':>7s} {'':>10s} {'':>15s} {'':>6s}  failed: {row['error']}")
            continue
        span = f"{row.get('min_ms', float('nan')):.2f}-{row.get('max_ms', float('nan')):.2f}"
        notes = ", ".join(row.get("contrib", []))
        for key in ("mismatch", "run_error"):
            if key in row:
                notes += f" {key}: {row[key]}"
        print(f"  {name:16s} {row.get('nodes', 0):6d} {row.get('nodes_at_all') or 0:7d} "
              f"{row.get('seconds', 0.0):7.2f} {row.get('median_ms', float('nan')):10.2f} {span:>15s} "
              f"{row.get('ratio', float('nan')):6.3f}  {notes}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,vit", help="comma-separated: bert, bert-base, vit, encoder")
    parser.add_argument("--exporters", default="torchscript,dynamo")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the peers log per fusion
    results = []
    with tempfile.TemporaryDirectory(prefix="opfuse-tfm-") as tmp:
        for kind in args.models.split(","):
            for exporter in args.exporters.split(","):
                result = run_one(kind, exporter, pathlib.Path(tmp), args.rounds)
                show(result)
                results.append(result)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
