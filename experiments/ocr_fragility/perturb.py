"""How far PP-OCRv4 rec's exact match moves under perturbations that are not int8: a control
for the 1.5-point bar of issue 18.

    python experiments/ocr_fragility/perturb.py --mode bf16 --lines 400
    python experiments/ocr_fragility/perturb.py --mode int8-conv-dc --model ppocrv6

Perturbs only the float model's weights (every Conv and MatMul weight of at least 64 values;
PP-OCR ships them as Constant nodes), runs the rest in float on ONNX Runtime's CPU, and reads
the evaluation lines of ``benchmarks/quantize.py`` (the same renderings and seed). Modes:

- ``fp16`` / ``bf16``: each weight rounded to the nearest half / bfloat16;
- ``int8-conv``: each Conv weight rounded to int8, symmetric, one scale per output channel
  (max |w| / 127), round to nearest: what the ``cpu`` preset stores, before any fitting;
- ``int8-conv-dc``: the same, then in each k x k kernel slice (one output channel, one input
  channel) the entries nearest their rounding boundary moved one step until the slice's sum
  is within half a step of the float sum: the kernel's response to a uniform patch (the
  background, the zero padding) kept.

``--only NODE`` perturbs one Conv's weight. Prints the output SQNR against the float model over all lines and, per rendering, the exact
match, its drop from float, and the lines lost (float right, perturbed wrong) / gained.
"""

import argparse
import pathlib
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import quantize as bench  # noqa: E402

MODES = ("fp16", "bf16", "int8-conv", "int8-conv-dc")


def dc_kept(q: np.ndarray, r: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``q`` integers, ``r`` their real targets, [slices, k]: per slice, the entries whose move
    toward ``r``'s sum costs least moved one step each until |sum r - sum q| <= 0.5."""
    q = q.copy()
    gap = r.sum(-1) - q.sum(-1)
    need = np.where(np.abs(gap) > 0.5, np.round(gap), 0).astype(int)
    for step in (1, -1):
        count = np.where(np.sign(need) == step, np.abs(need), 0)
        if not count.any():
            continue
        cost = np.abs(q + step - r) - np.abs(q - r)
        cost = np.where((q + step >= lo) & (q + step <= hi), cost, np.inf)
        rank = np.argsort(np.argsort(cost, axis=-1), axis=-1)
        q = q + step * ((rank < count[:, None]) & np.isfinite(cost))
    return q


def perturbed(w: np.ndarray, mode: str) -> np.ndarray | None:
    """The weight as ``mode`` rounds it, or None where the mode leaves it."""
    if mode == "fp16":
        return w.astype(np.float16).astype(np.float32)
    if mode == "bf16":
        bits = w.astype(np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32)
    if w.ndim != 4:
        return None
    scale = np.abs(w).reshape(w.shape[0], -1).max(1).reshape(-1, 1, 1, 1) / 127 + 1e-12
    q = np.clip(np.round(w / scale), -127, 127)
    spatial = w.shape[2] * w.shape[3]
    if mode == "int8-conv-dc" and spatial > 1:
        q = dc_kept(q.reshape(-1, spatial), (w / scale).reshape(-1, spatial), -127, 127).reshape(w.shape)
    return (q * scale).astype(np.float32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--model", choices=("ppocrv4", "ppocrv6"), default="ppocrv4")
    parser.add_argument("--lines", type=int, default=400, help="lines per evaluation rendering")
    parser.add_argument("--only", help="perturb only this Conv's weight (node name, e.g. p2o.Conv.1)")
    parser.add_argument("--cache", type=pathlib.Path, default=bench.DEFAULT_CACHE)
    args = parser.parse_args()
    ort.set_default_logger_severity(3)
    case = bench.ocr_case(args.cache, pathlib.Path(tempfile.mkdtemp(prefix="perturb-")), args.model, args.lines)
    proto = onnx.load(case.path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1

    def outputs(model: onnx.ModelProto) -> np.ndarray:
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return bench.run_all(session, case.held_out)[0]

    reference = outputs(proto)
    tensors = list(proto.graph.initializer) + [a.t for n in proto.graph.node if n.op_type == "Constant"
                                               for a in n.attribute if a.name == "value"]
    if args.only:
        node = next((n for n in proto.graph.node if n.name == args.only and n.op_type == "Conv"), None)
        if node is None:
            parser.error(f"no Conv named {args.only}")
        tensors = [t for t in tensors if t.name == node.input[1]]
    changed = 0
    for tensor in tensors:
        w = numpy_helper.to_array(tensor)
        if w.dtype != np.float32 or w.ndim < 2 or w.size < 64:
            continue
        new = perturbed(w, args.mode)
        if new is not None:
            tensor.CopyFrom(numpy_helper.from_array(new, tensor.name))
            changed += 1
    got = outputs(proto)
    sqnr = bench.output_db([reference], [got])
    base, read = case.right([reference]), case.right([got])
    print(f"{args.model}, {args.mode}: {changed} weights perturbed, output SQNR {sqnr:.1f} dB, {args.lines} lines "
          "per rendering")
    for rendering, right in base.items():
        lost = sum(f and not q for f, q in zip(right, read[rendering]))
        gained = sum(q and not f for f, q in zip(right, read[rendering]))
        f_acc, q_acc = 100 * np.mean(right), 100 * np.mean(read[rendering])
        print(f"  {rendering:13s} float {f_acc:6.2f}  perturbed {q_acc:6.2f}  drop {f_acc - q_acc:+5.2f}  "
              f"lines lost/gained {lost}/{gained}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
