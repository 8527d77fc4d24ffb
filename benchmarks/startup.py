"""Start-up and end-to-end time of the ``opfuse`` command, this tree against an older one.

    python benchmarks/startup.py                    against the commit before the layout change
    python benchmarks/startup.py --before REV --runs 7
    python benchmarks/startup.py --before REV --chain 16000     also the 48k-node chain (and 1 block)
    python benchmarks/startup.py --before REV --chain 16000 --targets onnx,onnxruntime

Each command runs as a fresh process (what a user waits for), for both trees in turn,
``--runs`` rounds, interleaved so that a busy machine slows both alike. Commands:
``opfuse --version``, ``opfuse --help`` and ``opfuse optimize`` on the built-in ResNet-50
(saved to a temporary file first; verification on, as by default). The older tree is
extracted with ``git archive`` into a temporary folder and run from there, with the
editable install's import hook removed so that its own ``opfuse`` package is the one
imported. An A/A row (this tree against itself) gives the noise floor. Prints median and
min-max seconds and the ratio of medians. Not part of CI.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BEFORE_LAYOUT = "eab64d2"  # the last commit before the layout restructuring (issue 8)

# Runs opfuse's CLI from the tree given as argv[1], never from the editable install.
RUNNER = """
import sys
src = sys.argv[1]
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, src)
import opfuse
assert opfuse.__file__.startswith(src), opfuse.__file__
from opfuse.cli import main
sys.exit(main(sys.argv[2:]))
"""


def extract(rev: str, into: pathlib.Path) -> pathlib.Path:
    archive = into / "tree.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", rev], stdout=f, check=True)
    tree = into / rev
    with tarfile.open(archive) as tar:
        # a symlink to an absolute path (a local venv committed by mistake) is not source: skip it
        tar.extractall(tree, filter=lambda member, dest: None if member.issym() and member.linkname.startswith("/")
                       else tarfile.data_filter(member, dest))
    return tree


def timed(tree: pathlib.Path, args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", RUNNER, str(tree), *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE_LAYOUT, help="the older revision (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--chain", type=int, metavar="BLOCKS",
                        help="also time optimize --no-verify on an unnamed Conv+BN+Relu chain of BLOCKS "
                             "blocks (optimizer_speed.py's), for both trees: tells a slower machine from "
                             "slower code")
    parser.add_argument("--targets", default="onnx", help="targets of the chain command, comma-separated "
                        "(default: %(default)s)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="opfuse-startup-") as tmp:
        tmp = pathlib.Path(tmp)
        trees = {"after": ROOT, "after (A/A)": ROOT, "before": extract(args.before, tmp)}
        sys.path.insert(0, str(ROOT))
        from opfuse.models import build

        import onnx

        model = tmp / "resnet50.onnx"
        onnx.save(build("resnet50"), model)
        commands = {
            "opfuse --version": ["--version"],
            "opfuse --help": ["--help"],
            "opfuse optimize resnet50": ["optimize", str(model), "-o", str(tmp / "out.onnx"), "-q"],
        }
        if args.chain:
            from optimizer_speed import chain

            path = tmp / "chain.onnx"
            onnx.save(chain(args.chain, named=False), path)
            one = tmp / "chain1.onnx"
            onnx.save(chain(1, named=False), one)
            for target in args.targets.split(","):
                for blocks, source in ((1, one), (args.chain, path)):
                    commands[f"chain {blocks} --target {target}"] = [
                        "optimize", str(source), "-o", str(tmp / "chain.out.onnx"), "--no-verify", "-q",
                        "--target", target]
        times: dict[tuple[str, str], list[float]] = {}
        for label, cmd in commands.items():
            for tree in trees.values():
                timed(tree, cmd)  # warm the file cache once per tree and command
            for _ in range(args.runs):
                for name, tree in trees.items():
                    times.setdefault((label, name), []).append(timed(tree, cmd))

    print(f"{args.runs} runs each, interleaved; before = {args.before}, after = the working tree")
    print(f"{'command':<34} {'tree':<12} {'median s':>9} {'min-max s':>13} {'x before':>9}")
    for label in commands:
        before = statistics.median(times[(label, "before")])
        for name in trees:
            t = times[(label, name)]
            med = statistics.median(t)
            print(f"{label:<34} {name:<12} {med:>9.3f} {min(t):>6.3f}-{max(t):<6.3f} {med / before:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
