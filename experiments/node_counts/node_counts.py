"""Node counts of opfuse against its peers, without the timed run (issue 40's node-count criterion).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python experiments/node_counts/node_counts.py \
        --decoders llama,qwen2,phi3,mistral --encoders bert,vit --json counts.json

Per graph: the original's node count; opfuse ``optimize --target onnxruntime`` with its default
tuning and with ``--no-tune`` (in a subprocess, as a user runs it); onnxscript's
``optimize_for_ort``; ONNX Runtime's transformers optimizer at each model type tried, the row
being the fewest nodes among the types whose model equals the original. Decoders are the cached
exports of ``benchmarks/decoders.py`` (its small check inputs); encoders the TorchScript BERT and
ViT of ``benchmarks/transformer_encoders.py`` (their example inputs). ``--json`` keeps every row's
op histogram, so the ops a peer fused and opfuse did not can be read off.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import tempfile

import numpy as np
import onnx

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path[0:0] = [str(REPO), str(REPO / "benchmarks")]

import decoders  # noqa: E402
import transformer_encoders  # noqa: E402

ENCODER_TYPES = {"bert": ("bert",), "vit": ("vit", "bert")}


def _counts(path: pathlib.Path) -> tuple[int, dict[str, int]]:
    proto = onnx.load(str(path), load_external_data=False)
    return len(proto.graph.node), decoders.op_counts(proto)


def _reference(path: pathlib.Path, feeds: dict) -> dict:
    session = decoders._session(path)
    return {"feeds": feeds, "names": [o.name for o in session.get_outputs()], "outputs": session.run(None, feeds)}


def _opfuse_rows(path: pathlib.Path, work: pathlib.Path, tuned: bool) -> dict:
    rows = {}
    variants = {"opfuse ort --no-tune": ("--no-tune",)}
    if tuned:
        variants["opfuse ort (tuned)"] = ()
    for name, extra in variants.items():
        tag = name.split()[-1].strip("()-")
        row = decoders.optimise(path, "onnxruntime", work, extra, tag=tag)
        if row["rc"] == 0 and row["written"]:
            row["nodes"], row["ops"] = _counts(pathlib.Path(row["written"]))
        report = work / f"report-{tag}.json"
        if report.exists():  # the tuner's decision per family: kept, refused (why), not in this graph
            tuning = json.loads(report.read_text()).get("tuning") or {}
            row["tuning"] = [f"{f.get('family')} {f.get('candidate')}: {f.get('decision')}"
                             for f in tuning.get("families", [])]
            row["tuning_s"] = tuning.get("seconds")
        rows[name] = row
    return rows


def _peer_rows(path: pathlib.Path, work: pathlib.Path, reference: dict, tools: dict) -> dict:
    """{row: {nodes, ops, status}}; ``tools``: {row: [(variant, callable(src, dst)), ...]}, best verifying kept."""
    rows = {}
    for name, variants in tools.items():
        best = None
        tried = []
        for variant, tool in variants:
            dst = work / f"{variant.replace(' ', '_').replace('(', '').replace(')', '')}.onnx"
            try:
                tool(path, dst)
            except Exception as e:  # noqa: BLE001 - a peer that fails is a row
                tried.append(f"{variant}: failed: {decoders._first_line(e)}")
                continue
            why = decoders._equal_on(dst, reference)
            if why:
                tried.append(f"{variant}: {why}")
                continue
            nodes, ops = _counts(dst)
            if best is None or nodes < best["nodes"]:
                best = {"variant": variant, "nodes": nodes, "ops": ops}
        rows[name] = best or {"status": "; ".join(tried)}
        if best is not None and tried:
            best["others"] = tried
    return rows


def decoder_graphs(models, exporters, graphs, tuned: bool):
    for model in models:
        decoder = decoders.MODELS[model]
        for exporter in exporters:
            for graph in graphs:
                path, failed = decoders.exported(decoder, exporter, graph, decoders.DEFAULT_CACHE)
                if path is None:
                    yield {"graph": f"{model} {exporter} {graph}", "status": failed}
                    continue
                feeds = decoders.feeds(path, graph, decoder.config["vocab_size"], batch=1, padded=0)
                tools = {"onnxscript": [("onnxscript", lambda s, d: decoders._onnxscript(s, d, decoder))],
                         "ort-tfm": [(f"ort-tfm ({t})", lambda s, d, t=t: decoders._ort_transformers(s, d, decoder, t))
                                     for t in ("gpt2", "bert")]}
                yield _rows(f"{model} {exporter} {graph}", path, feeds, tools, tuned)


def encoder_graphs(kinds, tuned: bool, folder: pathlib.Path):
    from opfuse.models.transformers import example_feeds, export

    for kind in kinds:
        path = export(kind, "torchscript", transformer_encoders.EXPORTS["torchscript"], folder / f"{kind}-ts.onnx")
        feeds = example_feeds(kind)
        tools = {"onnxscript": [("onnxscript", lambda s, d: transformer_encoders._onnxscript(s, d, kind))]}
        heads, hidden = transformer_encoders.HEADS[kind]

        def tfm(s, d, t):
            from onnxruntime.transformers.optimizer import optimize_model

            optimize_model(str(s), model_type=t, num_heads=heads, hidden_size=hidden).save_model_to_file(str(d))
        tools["ort-tfm"] = [(f"ort-tfm ({t})", lambda s, d, t=t: tfm(s, d, t)) for t in ENCODER_TYPES[kind]]
        yield _rows(f"{kind} torchscript", path, feeds, tools, tuned)


def _rows(title: str, path: pathlib.Path, feeds: dict, tools: dict, tuned: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="opfuse-counts-") as tmp:
        work = pathlib.Path(tmp)
        reference = _reference(path, {k: np.asarray(v) for k, v in feeds.items()})
        nodes, ops = _counts(path)
        rows = {"original": {"nodes": nodes, "ops": ops}}
        rows.update(_opfuse_rows(path, work, tuned))
        rows.update(_peer_rows(path, work, reference, tools))
    for row in rows.values():
        row.pop("written", None)
    return {"graph": title, "rows": rows}


COLUMNS = ("original", "opfuse ort (tuned)", "opfuse ort --no-tune", "onnxscript", "ort-tfm")


def show(result: dict) -> str:
    rows = result.get("rows", {})
    cells = [str(rows[c].get("nodes", "-")) if c in rows else "" for c in COLUMNS]
    peers = [rows[c]["nodes"] for c in ("onnxscript", "ort-tfm") if "nodes" in rows.get(c, {})]
    mine = [rows[c]["nodes"] for c in COLUMNS[1:3] if "nodes" in rows.get(c, {})]
    gap = f"{min(mine) - min(peers):+d}" if peers and mine else "-"
    return f"| {result['graph']} | " + " | ".join(cells) + f" | {gap} |"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decoders", default="llama,qwen2,phi3,mistral")
    parser.add_argument("--exporters", default="dynamo,torchscript")
    parser.add_argument("--graphs", default="prefill,decode")
    parser.add_argument("--encoders", default="bert,vit")
    parser.add_argument("--no-tuned", action="store_true", help="skip the tuned opfuse row (minutes per graph)")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    print("| graph | " + " | ".join(COLUMNS) + " | best opfuse - best peer |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    results = []
    with tempfile.TemporaryDirectory(prefix="opfuse-enc-") as tmp:
        generators = (decoder_graphs(split(args.decoders), split(args.exporters), split(args.graphs),
                                     not args.no_tuned),
                      encoder_graphs(split(args.encoders), not args.no_tuned, pathlib.Path(tmp)))
        for generator in generators:
            for result in generator:
                results.append(result)
                print(show(result), flush=True)
                if args.json:  # (after every graph: a long run stopped early keeps what it measured)
                    args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
