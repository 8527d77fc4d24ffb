"""Fold before you quantise: int8 QDQ flows side by side, one table per model, one run.

    python benchmarks/quantize.py
    python benchmarks/quantize.py --models ocr,mobilenetv2,resnet18,torch-mobilenetv2,torch-resnet18 \\
        --rounds 30 --cache ~/.cache/opfuse-wild --json quantize.json

The chapter's claim: in quantised models folding matters most; quantising gamma and W
separately compounds the error, after folding the weights are quantised once. Every row
makes an int8 model from the same float model and the same calibration samples; all use
ONNX Runtime's quantiser in QDQ format with MinMax calibration, uint8 activations and int8
weights (``quantize_static``), unless it is opfuse's own command:

- float: the model itself; "float (A/A)" is the same file timed as a second entry, its
  distance from 1.00x is the noise floor of the timing (its outputs are not re-scored);
- ORT, as shipped: ``quantize_static`` on the model as it comes (BatchNormalization in it);
  no opset change, whatever ORT makes of it is the result;
- no fold, constants lifted (a diagnostic): opfuse's clean-up only (Constant nodes become
  initializers, as the folding rows get them; BatchNormalization kept), opset raised to 13
  for per-channel when below, then ``quantize_static``: separates "the weights are
  initializers ORT can quantise as weights" from "BN is folded";
- ORT pre_process: ORT's recommended ``quant_pre_process`` (symbolic shape inference, its
  basic graph optimisations, ONNX shape inference), then ``quantize_static``;
- quant W, fold, requant: the float model's weights (Conv/Gemm/MatMul, int8 symmetric per
  output channel) and BatchNorm scales (gamma, int8 per tensor, as ORT quantises the scale
  of a BatchNormalization it keeps) rounded to int8 and back, then BN folded with
  ``opfuse.optimize(verify=False)``, then ``quantize_static`` again: the weights are
  quantised twice, gamma once more inside them;
- fold, ORT: ``opfuse.optimize`` first (opset raised to 13 for per-channel when below),
  then ``quantize_static``: the weights are quantised once;
- opfuse quantize: ``opfuse.quantize(model, calibration, preset=..., equalize=...)``;
  when it raises, the row says "error" and why. The ``cpu`` preset's default includes block
  reconstruction where it is estimated under 15 minutes (PP-OCRv4 rec, MobileNetV2, ResNet-18
  at 160x160); the ``per-tensor`` preset's, cross-layer equalisation and AdaRound instead
  (``--no-equalize --no-adaround``: the preset as it was before 2026-12-05): the row's
  summary says what ran and was kept;

- opfuse quantize cpu --no-bias-correction: the default without its empirical bias correction;
- opfuse quantize ... --reconstruct: block reconstruction (learned rounding and activation scales);
- opfuse quantize cpu --calibrate minmax / percentile: one range method for every tensor,
  against ``auto``'s per-tensor MSE choice (the default);
- opfuse quantize cpu --min-sqnr 20: the mixed-precision search's target;
- AIMET (CLE + AdaRound) and NNCF (``quantize`` with defaults; ``quantize_with_accuracy_control``
  with the benchmark's own metric) per channel and per tensor, run by
  ``benchmarks/int8_peers.py`` in a venv of their own (``--peers-python``; setup:
  ``python3 -m venv .venv-peers && .venv-peers/bin/pip install -c constraints.txt -e ".[int8-peers]"``),
  on the same float model and calibration samples; a peer that fails is a cell with its error.

Measures: for PP-OCRv4 rec (``ocr``) and PP-OCRv6 rec (``ocr-v6``; see
``benchmarks/ocr_text.py``), exact-match accuracy on ``--lines`` text lines (400; the first 100 are
the 100 of runs before 2026-12-05) of each
evaluation rendering (default, grey-words, serif-blur, mono-noise, inverse-sans; seed 1),
calibrated on 64 lines of another rendering (bold-mixed, seed 2), the worst rendering and
its drop from float reported, with the lines behind each drop (per rendering, lines lost:
read right by float and wrong by the flow, and lines gained: the reverse; a drop of 3 may
be 3 lost or 12 lost and 9 gained); ``--calibration-draws N`` repeats the OCR models' tables with
calibration lines of N draws (seeds 2, 1002, 2002...; the evaluation lines stay the same) and
prints, per flow, the worst drop of every draw, their median and maximum (fonts: ``apt-get install fonts-dejavu-core fonts-dejavu-extra
fonts-liberation fonts-noto-core``), and for every model
the output SQNR in dB against the float model on held-out inputs (10 log10 sum f^2 /
sum (q - f)^2 over all outputs; the OCR rows on all the evaluation lines, the image models
on 32 smooth random images normalised like ImageNet, calibrated on 64 others), the number
of QuantizeLinear nodes, Conv/Gemm/MatMul whose weight is stored as an int8 initializer,
BatchNormalization left, the file size as a share of the float file, and latency on ONNX
Runtime CPU (ORT_ENABLE_ALL, ``--threads`` intra-op threads, batch 1): every entry runs once
per round in a rotating order for ``--rounds`` rounds; median and min-max per entry.
A model ORT cannot load or that fails to run is a cell with the first line of its error.

Image models: ``opfuse.models.build("mobilenetv2" | "resnet18")`` (seeded weights,
calibrated BN statistics), and the torch nets of ``tests/torch_nets.py`` (torchvision
layouts, randomised BN affine parameters and some eps=1e-3), their BN running statistics
re-estimated in train mode on 64 other smooth images, then exported by torch's TorchScript
exporter with ``TrainingMode.PRESERVE`` (BatchNormalization kept, checked). Image size
``--image-size`` (160 by default, to keep the default run near 15 minutes on 2 shared
cores; ``--image-size 224`` took 27 minutes there with other jobs running). The OCR model
takes the largest share (200 lines per row, opfuse's own steps). Progress goes to stderr;
the tables to stdout.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import logging
import pathlib
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import numpy_helper, version_converter
from onnxruntime import quantization as ortq
from onnxruntime.quantization.shape_inference import quant_pre_process
from PIL import Image
from rich.console import Console
from rich.table import Table

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ocr_text  # noqa: E402
from wild import DEFAULT_CACHE  # noqa: E402

import opfuse  # noqa: E402
from opfuse.quantization.qdq.quantizer import SampleReader  # noqa: E402
from opfuse.quantization.qdq.sqnr import sqnr_db  # noqa: E402
from opfuse.report import json_text  # noqa: E402
from opfuse.runtime import create_session  # noqa: E402

MODELS = ("ocr", "ocr-v6", "mobilenetv2", "resnet18", "torch-mobilenetv2", "torch-resnet18")
CALIBRATION_RENDERING = "bold-mixed"
DRAW_STEP = 1000  # --calibration-draws: draw i calibrates on the lines of seed CALIBRATION_SEED + DRAW_STEP * i
EVAL_RENDERINGS = ("default", "grey-words", "serif-blur", "mono-noise", "inverse-sans")
VALIDATION_SAMPLES = 32  # NNCF's accuracy control: the calibration rendering (OCR) or smooth images, seed 3 / 103
PEERS_PYTHON = HERE.parent / ".venv-peers" / "bin" / "python"
CALIBRATION_SAMPLES, HELD_OUT_SAMPLES = 64, 32
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)[:, None, None]
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)[:, None, None]
WEIGHT_OPS = {"Conv": 0, "ConvTranspose": 1, "Gemm": None, "MatMul": -1}  # op -> output-channel axis
START = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def first_line(exc: BaseException, limit: int = 400) -> str:
    """The error's type and message on one line (ORT breaks its messages after the path); a
    long one keeps its start and its end, where ORT puts the reason."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else f"{text[:limit // 3]} ... {text[-(2 * limit) // 3:]}"


# -- the models and their data ------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """One float model, its calibration and held-out feeds, and how to score its outputs."""

    name: str
    path: pathlib.Path
    calibration: list[dict[str, np.ndarray]]
    held_out: list[dict[str, np.ndarray]]
    opfuse_calibration: object  # what opfuse.quantize gets: an .npz path or the feed dicts
    score: Callable[[list[np.ndarray]], dict[str, float]] | None = None  # accuracy per rendering
    right: Callable[[list[np.ndarray]], dict[str, list[bool]]] | None = None  # each line read right, per rendering
    note: str = ""
    notes: dict[str, str] = dataclasses.field(default_factory=dict)  # flow family -> what happened
    graphs: dict[str, onnx.ModelProto] = dataclasses.field(default_factory=dict)  # shared float graphs
    validation: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)  # NNCF's accuracy control
    metric: dict = dataclasses.field(default_factory=dict)  # int8_peers.py --metric


def smooth_images(count: int, size: int, seed: int) -> list[np.ndarray]:
    """``count`` images [1, 3, size, size]: three octaves of bilinear-upsampled uniform noise
    (4, 16 and 64 cells a side, amplitudes 1, 0.5, 0.25) scaled to [0, 1], then normalised
    with ImageNet's mean and std. Deterministic for ``seed``."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(count):
        image = np.zeros((3, size, size), dtype=np.float32)
        for cells, amplitude in ((4, 1.0), (16, 0.5), (64, 0.25)):
            noise = rng.random((3, cells, cells), dtype=np.float32)
            for c in range(3):
                up = Image.fromarray(noise[c], mode="F").resize((size, size), Image.Resampling.BILINEAR)
                image[c] += amplitude * np.asarray(up)
        image = (image - image.min()) / (image.max() - image.min() + 1e-6)
        images.append(((image - IMAGENET_MEAN) / IMAGENET_STD)[None].astype(np.float32))
    return images


def draw_seed(draw: int) -> int:
    """The seed of calibration draw ``draw`` (``--calibration-draws``): 2, 1002, 2002..."""
    return ocr_text.CALIBRATION_SEED + DRAW_STEP * draw


def ocr_case(cache: pathlib.Path, work: pathlib.Path, which: str, lines: int, draw: int = 0) -> Case:
    """The OCR case; ``draw`` > 0: the same model and evaluation lines, calibration lines
    drawn with :func:`draw_seed`."""
    path = ocr_text.rec_model(cache, which)
    chars = ocr_text.characters(path)
    evaluation = {r: ocr_text.render(r, lines, ocr_text.EVAL_SEED) for r in EVAL_RENDERINGS}
    calibration_seed = draw_seed(draw)
    calibration = ocr_text.render(CALIBRATION_RENDERING, 64, calibration_seed)
    validation = ocr_text.render(CALIBRATION_RENDERING, VALIDATION_SAMPLES, 3)
    npz = ocr_text.calibration_npz(work / "ocr-calibration.npz", calibration)
    order = [(r, text) for r, group in evaluation.items() for text, _ in group]

    def right(outputs: list[np.ndarray]) -> dict[str, list[bool]]:
        got = ocr_text.decode_batch(outputs[0], chars)
        read: dict[str, list[bool]] = {r: [] for r in evaluation}
        for g, (r, text) in zip(got, order):
            read[r].append(g == text)
        return read

    def score(outputs: list[np.ndarray]) -> dict[str, float]:
        return {r: sum(v) / len(v) for r, v in right(outputs).items()}

    name = {"ppocrv4": "PP-OCRv4 rec (rapidocr-onnxruntime 1.4.4)", "ppocrv6": "PP-OCRv6 rec small (rapidocr 3.10.0)"}
    label = ("ocr" if which == "ppocrv4" else "ocr-v6") + (f"-draw{draw}" if draw else "")
    return Case(label, path, [{"x": ocr_text.preprocess(im)} for _, im in calibration],
                [{"x": ocr_text.preprocess(im)} for group in evaluation.values() for _, im in group], npz, score, right,
                f"{name[which]}, {lines} lines per rendering ({', '.join(EVAL_RENDERINGS)}), calibrated on 64 "
                f"{CALIBRATION_RENDERING} lines (seed {calibration_seed})",
                validation=[{"x": ocr_text.preprocess(im)} for _, im in validation],
                metric={"kind": "ocr", "texts": [t for t, _ in validation], "chars": chars})


def image_feeds(name: str, size: int) -> tuple[list[dict], list[dict]]:
    return ([{name: x} for x in smooth_images(CALIBRATION_SAMPLES, size, 100)],
            [{name: x} for x in smooth_images(HELD_OUT_SAMPLES, size, 101)])


def builtin_case(name: str, size: int, work: pathlib.Path) -> Case:
    from opfuse.models import build

    path = work / f"{name}.onnx"
    onnx.save(build(name, image_size=size), path)
    calibration, held = image_feeds("input", size)
    return with_validation(Case(name, path, calibration, held, calibration,
                                note=f"opfuse.models.build({name!r}, image_size={size})"), size)


def with_validation(case: Case, size: int) -> Case:
    """NNCF's accuracy control on images: agreement of the top class with the float model's."""
    case.validation = [{"input": x} for x in smooth_images(VALIDATION_SAMPLES, size, 103)]
    float_session = create_session(str(case.path), "disabled")
    case.metric = {"kind": "agreement",
                   "labels": [int(float_session.run(None, f)[0].argmax()) for f in case.validation]}
    return case


def torch_case(name: str, size: int, work: pathlib.Path) -> Case:
    import torch

    sys.path.insert(0, str(HERE.parent / "tests"))
    import torch_nets

    arch = name.removeprefix("torch-")
    model = torch_nets.build(arch, seed=0)  # randomised BN affine parameters, some eps=1e-3
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for bn in bns:  # running statistics re-estimated on the data: cumulative average
        bn.reset_running_stats()
        bn.momentum = None
    model.train()
    with torch.no_grad():
        stats = np.concatenate(smooth_images(64, size, 102))
        for start in range(0, len(stats), 16):
            model(torch.from_numpy(stats[start:start + 16]))
    model.eval()
    path = work / f"{name}.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(stats[:1]),), str(path), dynamo=False,
                          training=torch.onnx.TrainingMode.PRESERVE, opset_version=17,
                          input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    kept = sum(n.op_type == "BatchNormalization" for n in onnx.load(path).graph.node)
    if kept != len(bns):
        raise SystemExit(f"{name}: the export kept {kept} BatchNormalization nodes of {len(bns)}")
    calibration, held = image_feeds("input", size)
    return with_validation(Case(name, path, calibration, held, calibration,
                                note=f"tests/torch_nets.py {arch}, BN statistics from train mode, exported with "
                                     f"{kept} BatchNormalization (opset 17)"), size)


# -- the flows ----------------------------------------------------------------------------------


@contextlib.contextmanager
def quiet():
    """ORT's quantiser logs a warning per missing bias and per hint; keep stderr for progress."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(level)


def ort_static(model: pathlib.Path | onnx.ModelProto, out: pathlib.Path, case: Case, per_channel: bool,
               graph_key: str) -> pathlib.Path:
    """``quantize_static`` (QDQ, uint8 activations, int8 weights, MinMax). Both granularities of
    one graph (``graph_key``) share one calibration: ORT's own calibration cache (JSON ranges)."""
    if isinstance(model, onnx.ModelProto):
        saved = out.parent / f"{graph_key}.float.onnx"
        onnx.save(model, saved)
        model = saved
    with quiet():
        ortq.quantize_static(str(model), str(out), SampleReader(case.calibration),
                             quant_format=ortq.QuantFormat.QDQ, per_channel=per_channel,
                             activation_type=ortq.QuantType.QUInt8, weight_type=ortq.QuantType.QInt8,
                             calibrate_method=ortq.CalibrationMethod.MinMax,
                             calibration_cache_path=str(out.parent / f"{graph_key}.ranges.json"))
    return out


def opset(proto: onnx.ModelProto) -> int:
    return next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))


def at_least_13(proto: onnx.ModelProto, per_channel: bool) -> tuple[onnx.ModelProto, str]:
    """DequantizeLinear's ``axis`` (per-channel weights) needs opset 13: raised only for those."""
    if per_channel and opset(proto) < 13:
        return version_converter.convert_version(proto, 13), "-opset13"
    return proto, ""


def fold(proto: onnx.ModelProto) -> onnx.ModelProto:
    folded, _ = opfuse.optimize(proto, verify=False, tune=False)
    return ir.serde.serialize_model(folded)


def _fake_quant(w: np.ndarray, axis: int | None) -> np.ndarray:
    """int8 symmetric round trip as ORT computes it for symmetric weights (range [-127, 127],
    scale max|w| / 127, zero point 0), per slice along ``axis`` or per tensor."""
    w64 = w.astype(np.float64)
    if axis is None:
        absmax = np.abs(w64).max(keepdims=True)
    else:
        axis %= w.ndim
        absmax = np.abs(w64).max(axis=tuple(a for a in range(w.ndim) if a != axis), keepdims=True)
    scale = np.where(absmax > 0, absmax / 127, 1.0)
    return (np.clip(np.round(w64 / scale), -127, 127) * scale).astype(w.dtype)


def fake_quantized(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """A copy of ``proto`` whose Conv/Gemm/MatMul weights (per output channel) and
    BatchNormalization scales (per tensor) went through int8 and back; weights may be
    initializers or Constant nodes. Returns the copy and how many tensors it changed."""
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    inits = {t.name: t for t in proto.graph.initializer}
    constants = {n.output[0]: n for n in proto.graph.node if n.op_type == "Constant"
                 and n.attribute and n.attribute[0].name == "value"}

    def replace(name: str, axis: int | None) -> bool:
        tensor = inits.get(name) or (constants[name].attribute[0].t if name in constants else None)
        if tensor is None or tensor.data_type != onnx.TensorProto.FLOAT:
            return False
        array = numpy_helper.to_array(tensor)
        if array.ndim < 1:
            return False
        tensor.CopyFrom(numpy_helper.from_array(_fake_quant(array, axis), tensor.name))
        return True

    changed = 0
    for node in proto.graph.node:
        if node.op_type in WEIGHT_OPS and len(node.input) > 1:
            axis = WEIGHT_OPS[node.op_type]
            if node.op_type == "Gemm":
                trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
                axis = 0 if trans_b else 1
            changed += replace(node.input[1], axis)
        elif node.op_type == "BatchNormalization":
            changed += replace(node.input[1], None)
    return proto, changed


def flow_as_shipped(case: Case, out: pathlib.Path, per_channel: bool) -> pathlib.Path:
    return ort_static(case.path, out, case, per_channel, "shipped")


def flow_lifted(case: Case, out: pathlib.Path, per_channel: bool) -> pathlib.Path:
    """The diagnostic row: opfuse's clean-up only (``passes=[]``: Constant nodes lifted into
    initializers, constant subexpressions folded), BatchNormalization left in place."""
    if "lifted" not in case.graphs:
        lifted, _ = opfuse.optimize(onnx.load(case.path), passes=[], verify=False, tune=False)
        case.graphs["lifted"] = ir.serde.serialize_model(lifted)
    model, suffix = at_least_13(case.graphs["lifted"], per_channel)
    return ort_static(model, out, case, per_channel, "lifted" + suffix)


def flow_pre_process(case: Case, out: pathlib.Path, per_channel: bool) -> pathlib.Path:
    """ORT's recommended pre-processing; when its symbolic shape inference gives up, ORT's own
    advice is to skip it (``skip_symbolic_shape=True``): the row says so."""
    prepared = out.parent / "pre_process.onnx"
    if not prepared.exists():
        with quiet():
            try:
                quant_pre_process(str(case.path), str(prepared))
            except Exception as exc:  # noqa: BLE001 - retried the way ORT suggests, and noted
                case.notes["pre_process"] = (f"quant_pre_process raised {first_line(exc)}; "
                                             "retried with skip_symbolic_shape=True")
                quant_pre_process(str(case.path), str(prepared), skip_symbolic_shape=True)
    return ort_static(prepared, out, case, per_channel, "pre_process")


def flow_requantize(case: Case, out: pathlib.Path, per_channel: bool) -> pathlib.Path:
    if "requantize" not in case.graphs:
        rounded, changed = fake_quantized(onnx.load(case.path))
        case.notes["requant"] = f"{changed} weight and BN-scale tensors rounded to int8 before folding"
        case.graphs["requantize"] = fold(rounded)
    model, suffix = at_least_13(case.graphs["requantize"], per_channel)
    return ort_static(model, out, case, per_channel, "requantize" + suffix)


def flow_fold_first(case: Case, out: pathlib.Path, per_channel: bool) -> pathlib.Path:
    if "fold" not in case.graphs:
        case.graphs["fold"] = fold(onnx.load(case.path))
    model, suffix = at_least_13(case.graphs["fold"], per_channel)
    return ort_static(model, out, case, per_channel, "fold" + suffix)


def flow_opfuse(case: Case, out: pathlib.Path, preset: str, equalize: bool | None = None,
                **options) -> tuple[pathlib.Path, str]:
    """(the quantised model's path, its report's summary); a failed --min-sqnr keeps the
    reason and writes the best model the search found nowhere: the row is an error."""
    with quiet():
        _, report = opfuse.quantize(str(case.path), calibration=case.opfuse_calibration, preset=preset,
                                    equalize=equalize, output=str(out), **options)
    steps = [s for s in report.search if s.phase in ("base", "step")]
    walk = "; walk " + " ".join(f"{s.sqnr_db:.1f}" + ("" if s.accepted else "x") for s in steps) if len(steps) > 1 else ""
    rounding = ""
    if report.adaround_sqnr_db is not None:  # what AdaRound did, kept or not (the guard's reading)
        before, after = report.adaround_sqnr_db
        better = sum(e["adaround"] < e["nearest"] for e in report.adaround_errors)
        rounding = (f"; AdaRound: {better} of {len(report.adaround_errors)} layers' errors lowered, tuning SQNR "
                    f"{before:.2f} -> {after:.2f} dB, {'kept' if report.adaround_layers else 'left out'}")
    if report.reconstruction is not None:  # what block reconstruction did, kept or not
        r = report.reconstruction
        rounding += (f"; reconstruction: {len(r.blocks)} blocks, tuning SQNR {r.sqnr_db[0]:.2f} -> {r.sqnr_db[1]:.2f} dB, "
                     f"{'kept' if r.kept else 'left out'}, {r.seconds:.0f} s" + (f", stops at {r.stopped}" if r.stopped else ""))
    return out, report.summary() + rounding + walk


PEERS_SETUP = 'python3 -m venv .venv-peers && .venv-peers/bin/pip install -c constraints.txt -e ".[int8-peers]"'
PEER_OPTIONS: dict = {"python": PEERS_PYTHON, "adaround_iterations": 1000}


def flow_peer(case: Case, out: pathlib.Path, flow: str, per_tensor: bool) -> tuple[pathlib.Path, str]:
    """AIMET's or NNCF's flow by benchmarks/int8_peers.py in the peers' venv; (path, what it did)."""
    import json
    import subprocess

    python = pathlib.Path(PEER_OPTIONS["python"])
    if not python.exists():
        raise RuntimeError(f"{python}: no peers venv; set it up with: {PEERS_SETUP}")
    calib = out.parent / "peers-calibration.npz"
    if not calib.exists():
        np.savez(calib, **{k: np.stack([s[k] for s in case.calibration]) for k in case.calibration[0]})
    command = [str(python), str(HERE / "int8_peers.py"), flow, str(case.path), str(calib), str(out),
               "--adaround-iterations", str(PEER_OPTIONS["adaround_iterations"])]
    if per_tensor:
        command.append("--per-tensor")
    if flow == "nncf-ac":
        validation, metric = out.parent / "peers-validation.npz", out.parent / "peers-metric.json"
        np.savez(validation, **{k: np.stack([s[k] for s in case.validation]) for k in case.validation[0]})
        metric.write_text(json.dumps(case.metric))
        command += ["--validation", str(validation), "--metric", str(metric)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise RuntimeError(f"{flow} exited {done.returncode}: " + " | ".join(lines[-3:]))
    return out, done.stdout.strip().splitlines()[-1]


# label -> build function (case, output path) -> quantised model path (or (path, summary));
# None: the float model
FLOWS: list[tuple[str, Callable | None]] = [
    ("float", None),
    ("float (A/A)", None),
    ("ORT as shipped, per-channel", lambda c, o: flow_as_shipped(c, o, True)),
    ("ORT as shipped, per-tensor", lambda c, o: flow_as_shipped(c, o, False)),
    ("no fold, constants lifted, ORT, per-channel", lambda c, o: flow_lifted(c, o, True)),
    ("no fold, constants lifted, ORT, per-tensor", lambda c, o: flow_lifted(c, o, False)),
    ("ORT pre_process, per-channel", lambda c, o: flow_pre_process(c, o, True)),
    ("ORT pre_process, per-tensor", lambda c, o: flow_pre_process(c, o, False)),
    ("quant W, fold, requant, per-channel", lambda c, o: flow_requantize(c, o, True)),
    ("quant W, fold, requant, per-tensor", lambda c, o: flow_requantize(c, o, False)),
    ("fold, ORT, per-channel", lambda c, o: flow_fold_first(c, o, True)),
    ("fold, ORT, per-tensor", lambda c, o: flow_fold_first(c, o, False)),
    ("opfuse quantize cpu", lambda c, o: flow_opfuse(c, o, "cpu")),
    ("opfuse quantize cpu + equalize", lambda c, o: flow_opfuse(c, o, "cpu", True)),
    ("opfuse quantize per-tensor", lambda c, o: flow_opfuse(c, o, "per-tensor")),
    ("opfuse quantize per-tensor --no-equalize --no-adaround",
     lambda c, o: flow_opfuse(c, o, "per-tensor", False, adaround=False)),
    ("opfuse quantize per-tensor + equalize --no-adaround",
     lambda c, o: flow_opfuse(c, o, "per-tensor", True, adaround=False)),
    ("opfuse quantize cpu --no-bias-correction", lambda c, o: flow_opfuse(c, o, "cpu", bias_correction=False)),
    ("opfuse quantize cpu --calibrate minmax", lambda c, o: flow_opfuse(c, o, "cpu", calibrate="minmax")),
    ("opfuse quantize cpu --calibrate percentile", lambda c, o: flow_opfuse(c, o, "cpu", calibrate="percentile")),
    ("opfuse quantize cpu + adaround", lambda c, o: flow_opfuse(c, o, "cpu", adaround=True)),
    ("opfuse quantize cpu --reconstruct", lambda c, o: flow_opfuse(c, o, "cpu", reconstruct=True)),
    ("opfuse quantize per-tensor --no-equalize --no-adaround --reconstruct",
     lambda c, o: flow_opfuse(c, o, "per-tensor", False, adaround=False, reconstruct=True)),
    ("opfuse quantize per-tensor --no-adaround --reconstruct",
     lambda c, o: flow_opfuse(c, o, "per-tensor", adaround=False, reconstruct=True)),
    ("opfuse quantize qnn", lambda c, o: flow_opfuse(c, o, "qnn")),
    ("opfuse quantize cpu --min-sqnr 20", lambda c, o: flow_opfuse(c, o, "cpu", min_sqnr=20)),
    ("AIMET CLE+AdaRound, per-channel", lambda c, o: flow_peer(c, o, "aimet", False)),
    ("AIMET CLE+AdaRound, per-tensor", lambda c, o: flow_peer(c, o, "aimet", True)),
    ("NNCF quantize, per-channel", lambda c, o: flow_peer(c, o, "nncf", False)),
    ("NNCF quantize, per-tensor", lambda c, o: flow_peer(c, o, "nncf", True)),
    ("NNCF accuracy control, per-channel", lambda c, o: flow_peer(c, o, "nncf-ac", False)),
    ("NNCF accuracy control, per-tensor", lambda c, o: flow_peer(c, o, "nncf-ac", True)),
]


# -- measuring ------------------------------------------------------------------------------


def session(path: pathlib.Path, threads: int) -> ort.InferenceSession:
    return create_session(str(path), "all", threads)


def run_all(sess: ort.InferenceSession, feeds: list[dict[str, np.ndarray]], batch: int = 8) -> list[np.ndarray]:
    """Every output over every feed, concatenated along the batch axis (one feed per run
    where the model's batch is fixed: the ``qnn`` preset's static shapes)."""
    shape = sess.get_inputs()[0].shape
    if shape and isinstance(shape[0], int) and shape[0] > 0:
        batch = shape[0]
    total = sum(next(iter(f.values())).shape[0] for f in feeds)
    outputs: list[np.ndarray] = []  # filled in place: 400 lines of 5 renderings read 2-6 GB per copy
    row = 0
    for start in range(0, len(feeds), batch):
        chunk = feeds[start:start + batch]
        got = sess.run(None, {k: np.concatenate([f[k] for f in chunk]) for k in chunk[0]})
        if not outputs:
            outputs = [np.empty((total, *g.shape[1:]), g.dtype) for g in got]
        for out, g in zip(outputs, got):
            out[row:row + g.shape[0]] = g
        row += got[0].shape[0]
    return outputs


def output_db(reference: list[np.ndarray], got: list[np.ndarray]) -> float:
    """SQNR over all outputs, as opfuse quantize reports it."""
    signal = noise = 0.0
    for f, q in zip(reference, got):  # in slices of 64 along the batch: no float64 copy of the whole output
        for start in range(0, max(len(f), 1), 64):
            a, b = f[start:start + 64].astype(np.float64), q[start:start + 64].astype(np.float64)
            signal += float(np.sum(np.square(a)))
            noise += float(np.sum(np.square(b - a)))
    return sqnr_db(signal, noise)


def structure(path: pathlib.Path) -> dict:
    """QuantizeLinear count, int8-stored weights of Conv/Gemm/MatMul, BN left, op types that
    read a dequantised tensor (what ORT quantised) and those that read none."""
    proto = onnx.load(path)
    g = proto.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    int8 = {onnx.TensorProto.INT8, onnx.TensorProto.UINT8}
    weighted = [n for n in g.node if n.op_type in WEIGHT_OPS and len(n.input) > 1]

    def int8_weight(node) -> bool:
        dq = producer.get(node.input[1])
        return (dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in inits
                and inits[dq.input[0]].data_type in int8)

    reads_dq, float_only = collections.Counter(), collections.Counter()
    for n in g.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear", "Constant"):
            continue
        fed = any(producer.get(i) is not None and producer[i].op_type == "DequantizeLinear" for i in n.input)
        (reads_dq if fed else float_only)[n.op_type] += 1
    return {
        "quantize_linear": sum(n.op_type == "QuantizeLinear" for n in g.node),
        "int8_weights": sum(map(int8_weight, weighted)), "weighted_ops": len(weighted),
        "batchnorm": sum(n.op_type == "BatchNormalization" for n in g.node),
        "opset": opset(proto), "ops_reading_dq": dict(reads_dq), "ops_float_only": dict(float_only),
    }


def time_rounds(sessions: dict[str, ort.InferenceSession], feed: dict[str, np.ndarray], rounds: int,
                warmup: int = 3) -> dict[str, list[float]]:
    """Milliseconds per run: every session once per round, the order rotating each round."""
    for s in sessions.values():
        for _ in range(warmup):
            s.run(None, feed)
    labels = list(sessions)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds):
        shift = r % len(labels)
        for label in labels[shift:] + labels[:shift]:
            start = time.perf_counter()
            sessions[label].run(None, feed)
            times[label].append((time.perf_counter() - start) * 1e3)
    return times


def measure_case(case: Case, flows, work: pathlib.Path, *, rounds: int, threads: int) -> list[dict]:
    float_size = case.path.stat().st_size
    float_session = session(case.path, threads)
    reference = run_all(float_session, case.held_out)
    float_read = case.right(reference) if case.right is not None else {}
    rows, sessions = [], {}
    for label, build in flows:
        row: dict = {"model": case.name, "flow": label}
        rows.append(row)
        start = time.perf_counter()
        if build is None:
            path, sess = case.path, (float_session if label == "float" else session(case.path, threads))
        else:
            out = work / f"{case.name}.{label.replace(' ', '_').replace(',', '').replace('+', 'plus')}.onnx"
            try:
                built = build(case, out)
            except Exception as exc:  # noqa: BLE001 - a flow's failure is its cell
                row["error"] = f"error: {first_line(exc)}"
                progress(f"{case.name}: {label}: {row['error']}")
                continue
            path, row["opfuse_summary"] = built if isinstance(built, tuple) else (built, None)
            try:
                sess = session(path, threads)
            except Exception as exc:  # noqa: BLE001 - an invalid model is a result
                row["error"] = f"invalid model: {first_line(exc)}"
                row.update(structure(path))
                progress(f"{case.name}: {label}: {row['error']}")
                continue
        row["build_s"] = time.perf_counter() - start
        row.update(structure(path))
        row["size_ratio"] = path.stat().st_size / float_size
        try:
            outputs = reference if build is None else run_all(sess, case.held_out)
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"fails to run: {first_line(exc)}"
            progress(f"{case.name}: {label}: {row['error']}")
            continue
        row["sqnr_db"] = None if build is None else output_db(reference, outputs)  # None: a float row
        # a flow that hands back its input unquantised (NNCF's accuracy control when no int8
        # model meets its drop) is said to, not shown as the float model's 200 dB
        row["not_quantised"] = build is not None and row["quantize_linear"] == 0 and row["int8_weights"] == 0
        if case.score is not None:
            row["accuracy"] = case.score(outputs)  # per rendering
            row["worst"] = min(row["accuracy"].values())
            if build is not None and "accuracy" in rows[0]:
                row["worst_drop"] = max(rows[0]["accuracy"][r] - a for r, a in row["accuracy"].items())
        if case.right is not None and build is not None:  # the lines behind each drop: lost (float read
            read = case.right(outputs)  # it right, this flow wrong) and gained
            row["lines_lost_gained"] = {r: [sum(f and not q for f, q in zip(float_read[r], v)),
                                            sum(q and not f for f, q in zip(float_read[r], v))]
                                        for r, v in read.items()}
        sessions[label] = sess
        shown = (f", exact match {' '.join(f'{a:.1%}' for a in row['accuracy'].values())}"
                 + (f", worst drop {100 * row['worst_drop']:.1f} points" if "worst_drop" in row else "")
                 + (", lines lost/gained " + " ".join(f"{a}/{b}" for a, b in row["lines_lost_gained"].values())
                    if "lines_lost_gained" in row else "")
                 if "accuracy" in row else "")
        db = ("float" if row["sqnr_db"] is None else "nothing was quantised" if row["not_quantised"]
              else f"SQNR {row['sqnr_db']:.1f} dB")
        progress(f"{case.name}: {label}: {db}{shown} ({time.perf_counter() - start:.1f} s)")
    progress(f"{case.name}: timing {len(sessions)} entries, {rounds} interleaved rounds")
    times = time_rounds(sessions, case.held_out[0], rounds)
    for row in rows:
        if row["flow"] in times:
            t = times[row["flow"]]
            row["latency_ms"] = {"median": statistics.median(t), "min": min(t), "max": max(t), "runs": len(t)}
    base = rows[0].get("latency_ms", {}).get("median")
    for row in rows:
        if base and "latency_ms" in row:
            row["speedup"] = base / row["latency_ms"]["median"]
    return rows


# -- presenting -----------------------------------------------------------------------------


def table(case: Case, rows: list[dict], rounds: int, threads: int) -> tuple[Table, list[str]]:
    """The model's table, and one line per row that produced no measurable model."""
    t = Table(title=f"{case.name}: {case.note}", title_justify="left",
              caption=f"latency: batch 1, ORT CPU ORT_ENABLE_ALL, {threads} threads, {rounds} interleaved rounds; "
                      "SQNR vs the float model on held-out inputs", caption_justify="left")
    t.add_column("flow")
    renderings = list(next((r["accuracy"] for r in rows if "accuracy" in r), {}))
    for r in renderings:
        t.add_column(r, justify="right")
    if renderings:
        t.add_column("worst drop", justify="right")
    for name in ("SQNR dB", "QuantizeLinear", "int8 W", "BN", "size", "median ms", "min-max ms", "vs float"):
        t.add_column(name, justify="right")
    width = len(t.columns)
    notes = []
    for row in rows:
        if "sqnr_db" not in row:
            notes.append(f"({len(notes) + 1}) {row['flow']}: {row.get('error', '')}")
            t.add_row(row["flow"], f"({len(notes)})", *[""] * (width - 2))
            continue
        cells = [row["flow"]]
        if renderings:
            cells += [f"{100 * row['accuracy'][r]:.1f}" for r in renderings]
            cells.append(f"{100 * row['worst_drop']:.1f}" if "worst_drop" in row else "-")
        lat = row.get("latency_ms")
        cells += [
            "float" if row["sqnr_db"] is None else "not quantised" if row.get("not_quantised") else f"{row['sqnr_db']:.1f}",
            str(row["quantize_linear"]), f"{row['int8_weights']}/{row['weighted_ops']}", str(row["batchnorm"]),
            f"{row['size_ratio']:.2f}x",
            f"{lat['median']:.2f}" if lat else "-", f"{lat['min']:.2f}-{lat['max']:.2f}" if lat else "-",
            f"{row['speedup']:.2f}x" if "speedup" in row else "-",
        ]
        t.add_row(*cells)
    flips = [f"{row['flow']}: " + ", ".join(f"{r} {a}/{b}" for r, (a, b) in row["lines_lost_gained"].items())
             for row in rows if "lines_lost_gained" in row]
    if flips:  # a drop is lines lost minus lines gained: how many moved says how near the bar it is
        t.caption += "\nlines lost / gained against float (read right by float and not by the flow / the reverse): " \
            + "; ".join(flips)
    return t, notes


def over_draws(name: str, per_draw: list[list[dict]]) -> str:
    """Per flow, over the calibration draws: the worst drop of each draw, then its median and
    maximum, and the output SQNR's median (min-max)."""
    lines = [f"{name} over {len(per_draw)} calibration draws (seeds "
             f"{', '.join(str(draw_seed(d)) for d in range(len(per_draw)))}):"]
    for label in dict.fromkeys(row["flow"] for rows in per_draw for row in rows):
        got = [row for rows in per_draw for row in rows if row["flow"] == label]
        drops = [100 * row["worst_drop"] for row in got if "worst_drop" in row]
        dbs = [row["sqnr_db"] for row in got if row.get("sqnr_db") is not None]
        if not drops:
            continue
        lines.append(f"  {label}: worst drop {' / '.join(f'{d:.0f}' for d in drops)} points "
                     f"(median {statistics.median(drops):.0f}, max {max(drops):.0f}); SQNR median "
                     f"{statistics.median(dbs):.1f} dB ({min(dbs):.1f}-{max(dbs):.1f})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved timing rounds (default 30)")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads, and torch's (default 2)")
    parser.add_argument("--image-size", type=int, default=160, help="image models' input size (default 160)")
    parser.add_argument("--cache", type=pathlib.Path, default=DEFAULT_CACHE, help="wheel and model cache")
    parser.add_argument("--flows", default="", help="only flows whose label contains one of these (comma-separated; '=LABEL' for that label alone)")
    parser.add_argument("--json", type=pathlib.Path, help="also write every row as JSON")
    parser.add_argument("--lines", type=int, default=400,
                        help="OCR lines per evaluation rendering (default 400; 100 until 2026-12-05: there 1.5 points "
                             "was one line, and a quantised model moved 30-40 of the 500 lines both ways)")
    parser.add_argument("--calibration-draws", type=int, default=1,
                        help="OCR models: calibrate on N draws of the calibration lines, a table each, then the "
                             "worst drop per flow over the draws (default 1: the lines of seed 2 alone)")
    parser.add_argument("--peers-python", type=pathlib.Path, default=PEERS_PYTHON,
                        help="the python of the venv with aimet-onnx and nncf (default: .venv-peers)")
    parser.add_argument("--adaround-iterations", type=int, default=1000,
                        help="AIMET's AdaRound iterations per layer (AIMET recommends 10000; default 1000)")
    args = parser.parse_args()
    names = [m for m in args.models.split(",") if m]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    wanted = [f for f in args.flows.split(",") if f]
    flows = [(label, build) for label, build in FLOWS
             if build is None or not wanted or any(label == w[1:] if w.startswith("=") else w in label for w in wanted)]
    PEER_OPTIONS.update(python=args.peers_python, adaround_iterations=args.adaround_iterations)
    peers = [label for label, _ in flows if label.startswith(("AIMET", "NNCF"))]
    if peers and not args.peers_python.exists():  # before any model is built: an hour's run would end in error rows
        parser.error(f"{args.peers_python}: no peers venv for {', '.join(peers)}; set it up with: {PEERS_SETUP} "
                     "(or pass --peers-python, or leave the peers out with --flows)")
    ort.set_default_logger_severity(3)
    try:  # block reconstruction runs in torch, whose result moves with its thread count (README)
        import torch

        torch.set_num_threads(args.threads)
    except ImportError:
        pass
    console = Console(width=None if sys.stdout.isatty() else 160)
    everything: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="opfuse-quantize-bench-") as tmp:
        for name in names:
            work = pathlib.Path(tmp) / name
            work.mkdir()
            progress(f"{name}: preparing the float model and its data")
            draws = args.calibration_draws if name in ("ocr", "ocr-v6") else 1
            per_draw = []
            for draw in range(draws):
                if name in ("ocr", "ocr-v6"):
                    case = ocr_case(args.cache, work, "ppocrv4" if name == "ocr" else "ppocrv6", args.lines, draw)
                elif name.startswith("torch-"):
                    case = torch_case(name, args.image_size, work)
                else:
                    case = builtin_case(name, args.image_size, work)
                rows = measure_case(case, flows, work, rounds=args.rounds, threads=args.threads)
                printed, notes = table(case, rows, args.rounds, args.threads)
                console.print(printed)
                for note in notes + [f"{family}: {text}" for family, text in case.notes.items()] + [
                        f"{row['flow']}: {row['opfuse_summary']}" for row in rows if row.get("opfuse_summary")]:
                    console.print(note, highlight=False, markup=False)
                console.print()
                everything.append({"model": case.name, "about": case.note, "notes": case.notes, "rows": rows})
                per_draw.append(rows)
            if draws > 1:
                console.print(over_draws(name, per_draw), highlight=False, markup=False)
                console.print()
    if args.json:
        args.json.write_text(json_text({"command": sys.argv, "rounds": args.rounds, "threads": args.threads,
                                        "image_size": args.image_size, "onnxruntime": ort.__version__,
                                        "models": everything}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
