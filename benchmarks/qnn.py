"""ONNX Runtime's documented QNN flow against ``opfuse quantize --preset qnn``, judged on the HTP.

    python benchmarks/qnn.py                       # every model (about an hour: emulation is slow)
    python benchmarks/qnn.py --models mobilenetv2,bert --calibration 16 --holdout 8 --json out.json
    python benchmarks/qnn.py --models vit --holdout 32 --seeds 3   # three draws of the samples
    python benchmarks/qnn.py --models vit,bert --preset qnn-a16-per-channel --flow-types preset
    python benchmarks/qnn.py --models bert --holdout 32 --reconstruct   # with block reconstruction

Per model, one run per sample draw (``--seeds N``: draws 0..N-1; random samples only, the
rendered text lines of PP-OCR rec are one set):

- **the flow** ONNX Runtime's QNN guide documents: fix the shapes
  (``make_dim_param_fixed`` / ``make_input_shape_fixed``, then shape inference),
  ``qnn_preprocess_model`` (when it crashes, the flow goes on without it and says so),
  ``get_qnn_qdq_config`` (uint8 activations and weights, MinMax) and ``quantize``. Its
  quantiser does not enter an ``If``: where the bound inputs make an ``If``'s condition
  constant (silero_vad), the flow is run a second time, like for like, on the model ONNX
  Runtime's own basic optimiser writes with that ``If`` inlined (``ort_flow_inlined``); with
  ``--flow-types preset``, ``get_qnn_qdq_config`` is given ``--preset``'s activation and
  weight types and per-channel choice, so a 16-bit or per-channel opfuse preset meets the
  flow at the same cost;
- **opfuse**: ``opfuse.quantize(model, samples, preset="qnn")`` (static shapes from the
  samples, folding, patterns as QNN runs them, ORT's quantiser with QNN's config,
  calibration and bias correction chosen on the calibration samples, block reconstruction
  where ``--reconstruct auto`` runs it: under its budget, the qnn presets' estimate
  multiplied by ``QNN_FIT_FACTOR``); ``--reconstruct`` forces it on. It is kept only if it
  raises the tuning SQNR on the HTP; its row gives the tuning SQNR before and after.

Each quantised model is compiled on the HTP backend (soc_model 57, graph I/O quantisation
on the HTP) and reported: nodes on the HTP / partitions / nodes on the CPU with QNN's
reasons, compile seconds, whether it opens with CPU fallback disabled, and the output SQNR
against the float model on the held-out samples, measured on the HTP's outputs (the CPU
QDQ figure beside). PP-OCRv4/v6 rec (``rapidocr-onnxruntime`` / the wild cache) add exact
match on rendered text lines (``benchmarks/ocr_text.py``), read on the HTP.

Models: the built-in ResNet-18/50, MobileNetV2 and VGG (random N(0,1) images), BERT and
ViT from ``opfuse.models.transformers`` (TorchScript export, opset 17; random tokens), and
the ONNX files of the wheels of ``benchmarks/wild.py`` (``--only`` picks some by label; their
samples come from opfuse's own ``random:N`` generator, shared by both flows; the inputs a
wheel's deployment fixes are bound for both, :data:`DEPLOYED_CONSTANTS`), and PP-OCRv6 rec
small (``ppocrv6``, rendered lines like PP-OCRv4 rec).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time
import traceback

import numpy as np
import onnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from opfuse.targets.qnn.backend import HtpCompileError, HtpOptions, open_session  # noqa: E402
from opfuse.targets.qnn.probe import quantize_like_qnn_flow  # noqa: E402
from opfuse.targets.qnn.runner import htp_accuracy  # noqa: E402
from opfuse.quantization.presets import PRESETS  # noqa: E402
from opfuse.quantization.qdq.quantizer import CALIBRATION_METHODS  # noqa: E402
from opfuse.prepare.static_shapes import make_static_proto  # noqa: E402

BUILTIN = ("resnet18", "resnet50", "mobilenetv2", "vgg")
TRANSFORMERS = ("bert", "vit")


def _samples(proto: onnx.ModelProto, count: int, seed: int, wild: bool = False, dims=None) -> list[dict]:
    """Random samples: for a wheel model, opfuse's own ``random:N`` generator (the smallest
    sizes at which the model runs; integer inputs by what they feed), which both flows
    then share; for the built-in and transformer models, N(0, 1) images and tokens 0-49, a
    symbolic dimension at its size in ``dims`` (the model's traits: BERT's ``seq``, the tokens it
    was exported with; before, 1, and its attention had one token) or else 1."""
    if wild:
        import onnx_ir as ir

        from opfuse.quantization.calibration import load_calibration

        return load_calibration(f"random:{count}", ir.serde.deserialize_model(proto), seed=seed)[0]
    rng = np.random.default_rng(seed)
    inits = {i.name for i in proto.graph.initializer}
    out = []
    for _ in range(count):
        s = {}
        for inp in proto.graph.input:
            if inp.name in inits:
                continue
            t = inp.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else (dims or {}).get(d.dim_param, 1) for d in t.shape.dim]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
            if np.issubdtype(dtype, np.floating):
                s[inp.name] = rng.normal(0, 1, shape).astype(dtype)
            elif "mask" in inp.name:
                s[inp.name] = np.ones(shape, dtype)
            else:
                s[inp.name] = rng.integers(0, 50, shape).astype(dtype)
        out.append(s)
    return out


def _models(names: list[str], tmp: pathlib.Path, cache: pathlib.Path, only: list[str] = ()):
    """(label, path, traits) per model (traits: {"wild": True} for a wheel model; a transformer's
    ``dims``, the sizes of its symbolic dimensions as it was exported)."""
    for name in names:
        if name in BUILTIN:
            from opfuse.models import build

            path = tmp / f"{name}.onnx"
            onnx.save(build(name), path)
            yield name, path, {}
        elif name in TRANSFORMERS:
            from opfuse.models.transformers import SEQ, export

            yield name, export(name, "torchscript", 17, tmp / f"{name}.onnx"), {"dims": {"seq": SEQ}}
        elif name == "ppocrv6":  # (not a wild.py wheel: rapidocr 3.10.0, as benchmarks/quantize.py)
            from ocr_text import rec_model

            yield "ppocrv6 rec small (rapidocr 3.10.0)", rec_model(cache, "ppocrv6"), {}
        elif name == "wild":
            from wild import extract, fetch

            for label, path in extract(fetch(cache), tmp):
                if not only or any(o in label for o in only):
                    yield label, path, {"wild": True}


# The input sizes a wheel feeds its model where the smallest size at which the model runs
# is outside the model's domain: at 8x8 the PP-OCR classifier's last MaxPool (2x2, stride 2)
# reads a 1-row map, a window ONNX gives no output for; ONNX Runtime's CPU takes the rows
# that exist and the HTP computes something else (-1.6 dB there, 37 dB just before it).
# rapidocr feeds it 3 x 48 x 192 (its cls_image_shape).
DEPLOYED_DIMS = {"ch_ppocr_mobile_v2.0_cls": {"x:0": 1, "x:2": 48, "x:3": 192}}
# The inputs a wheel's deployment fixes, bound for both flows (keys match those files only):
# silero-vad's wrapper passes its sample rate with every call, and the model branches on it
# (If(Equal(sr, 16000))), which QNN cannot place. opfuse gets ``constant_inputs=``; ONNX
# Runtime's flow gets the model after opfuse's binding step alone (sr an initializer, the If
# left as it is), and its samples (shared) carry no sr.
DEPLOYED_CONSTANTS = {"silero_vad.onnx": {"sr": 16000}, "silero_vad_op18_ifless": {"sr": 16000}}


def _placement(session) -> dict:
    p = session.placement
    return {"on_htp": len(p.on_qnn), "nodes": len(p.model_nodes), "partitions": len(p.partitions),
            "cpu": [f"{f.name} ({f.op_type}): {f.reason}" for f in p.fallbacks], "compile_s": round(session.compile_seconds, 1)}


def _judge(label, float_model, qdq, held, ocr=None) -> dict:
    out = {}
    try:
        session = open_session(qdq, HtpOptions())
    except HtpCompileError as e:
        return {"error": str(e)[:300]}
    out.update(_placement(session))
    try:
        open_session(qdq, HtpOptions(), strict=True)
        out["strict_open"] = True
    except HtpCompileError:
        out["strict_open"] = False
    acc = htp_accuracy(float_model, qdq, held, session=session)
    out.update(htp_sqnr=round(acc.htp_vs_float, 2), cpu_sqnr=round(acc.cpu_vs_float, 2),
               htp_vs_cpu=round(acc.htp_vs_cpu, 2))
    if ocr is not None:
        out["exact_match_htp"] = ocr(session)
    return out


def _renders_lines(label: str) -> bool:
    """A PP-OCR recogniser: judged on rendered text lines (exact match), not random samples."""
    return "rec" in label.lower() and "ocr" in label.lower()


def _ocr_tools(path: pathlib.Path, lines: int):
    """(calibration samples, held-out samples, exact match on the HTP) for a PP-OCR rec model."""
    from ocr_text import CALIBRATION_SEED, EVAL_SEED, characters, ctc_greedy, preprocess, render_lines

    chars = characters(path)
    evaluation = render_lines(lines, EVAL_SEED)

    def exact(session) -> float:
        name = session.quiet.get_inputs()[0].name
        hits = 0
        for text, image in evaluation:
            hits += ctc_greedy(session.run({name: preprocess(image)})[0][0], chars) == text
        return round(100 * hits / len(evaluation), 1)

    def float_exact() -> float:
        from ocr_text import accuracy

        return round(100 * accuracy(path, evaluation, chars=chars, batch=1), 1)

    calib = [{"x": preprocess(image)} for _, image in render_lines(24, CALIBRATION_SEED)]
    return calib, exact, float_exact


def _ort_flow(progress, label, fixed, calib, held, ocr, preprocess=True, preset=None) -> dict:
    """ONNX Runtime's QNN guide: preprocess, quantise with its QNN config, judged on the HTP."""
    flow: dict = {}
    start = time.perf_counter()
    pre = fixed
    try:
        if not preprocess:
            raise RuntimeError("skipped: it killed the process")
        from onnxruntime.quantization.execution_providers.qnn import qnn_preprocess_model

        progress("qnn_preprocess_model")
        with tempfile.TemporaryDirectory() as tmp:
            given = onnx.ModelProto()
            given.CopyFrom(fixed)  # (it rewrites the proto it is given to point at external data)
            if qnn_preprocess_model(given, f"{tmp}/pre.onnx"):
                pre = onnx.load(f"{tmp}/pre.onnx")
        flow["preprocess"] = "ok"
    except Exception as e:  # noqa: BLE001 - the flow's own crash is a result
        flow["preprocess"] = f"crashed: {type(e).__name__}: {str(e)[:120]}"
    try:
        progress("quantize (get_qnn_qdq_config, quantize)")
        qdq = quantize_like_qnn_flow(pre, calib, preset=preset)
        flow["quantize_s"] = round(time.perf_counter() - start, 1)
        flow["quantize_linear"] = sum(n.op_type == "QuantizeLinear" for n in qdq.graph.node)
        progress("judging on the HTP")
        flow.update(_judge(label, fixed, qdq, held, ocr))
    except Exception as e:  # noqa: BLE001
        flow["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return flow


def _inlined_by_ort(fixed: onnx.ModelProto) -> onnx.ModelProto | None:
    """The model as ONNX Runtime's basic optimiser (constant folding: an If whose condition is a
    constant becomes its branch) writes it, or None where it writes no smaller graph of Ifs."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(fixed, f"{tmp}/fixed.onnx")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = f"{tmp}/basic.onnx"
        options.log_severity_level = 3
        try:
            ort.InferenceSession(f"{tmp}/fixed.onnx", options, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - then there is no inlined variant to give the flow
            return None
        basic = onnx.load(f"{tmp}/basic.onnx")
    before = sum(n.op_type == "If" for n in fixed.graph.node)
    return basic if sum(n.op_type == "If" for n in basic.graph.node) < before else None


def _flow_on_inlined(progress, label, fixed, calib, held, ocr, like) -> dict:
    """:func:`_ort_flow` on the model :func:`_inlined_by_ort` writes; ``skipped`` where it inlines nothing."""
    progress("ONNX Runtime's basic optimiser (inlining the If)")
    inlined = _inlined_by_ort(fixed)
    if inlined is None:
        return {"skipped": "ONNX Runtime's basic optimiser left every If"}
    return {**_ort_flow(progress, label, inlined, calib, held, ocr, True, like),
            "ifs_left": sum(n.op_type == "If" for n in inlined.graph.node)}


def _isolated(fn, *args) -> dict:
    """``fn(progress, *args)`` in a forked child; a child killed by a signal is a row saying
    so and at which step (``progress(step)`` reports the step it is in)."""
    import multiprocessing
    import signal

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child():
        try:
            result = fn(lambda step: send.send(("step", step)), *args)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            result = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        send.send(("done", result))

    process = context.Process(target=child)
    process.start()
    steps: list[str] = []
    result = None
    while result is None:
        if receive.poll(1.0):
            kind, value = receive.recv()
            if kind == "done":
                result = value
            else:
                steps.append(value)
        elif not process.is_alive():
            break
    process.join()
    if result is not None:
        return result
    code = process.exitcode or 0
    how = f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
    return {"error": f"ONNX Runtime's process died: {how} during {steps[-1] if steps else 'start-up'}"}


def run_model(label, path, traits, args, seed: int = 0) -> dict:
    import opfuse

    row: dict = {"model": label}
    proto = onnx.load(path)
    deployed = next((dims for key, dims in DEPLOYED_DIMS.items() if key in label), None)
    if deployed:  # sampled, and quantised by both flows, at the size the wheel runs it
        proto, _ = make_static_proto(proto, deployed)
        path = pathlib.Path(path).with_suffix(".deployed.onnx")
        onnx.save(proto, path)
        row["dims"] = deployed
    constants = next((c for key, c in DEPLOYED_CONSTANTS.items() if key in label), None)
    if constants:  # both flows take the model without the input (opfuse binds it itself, below)
        import onnx_ir as ir

        from opfuse.prepare.constant_inputs import bind_inputs, resolve_constant_inputs

        bound = ir.serde.deserialize_model(proto)
        bind_inputs(bound, resolve_constant_inputs(bound, constants))
        proto = ir.serde.serialize_model(bound)
        row["constant_inputs"] = constants
    ocr = None
    if _renders_lines(label):
        samples, ocr, float_exact = _ocr_tools(path, args.lines)
        row["exact_match_float"] = float_exact()
        held = samples[-args.holdout:]
        calib = samples[:-args.holdout]
    else:
        samples = _samples(proto, args.calibration + args.holdout, seed, wild=traits.get("wild", False),
                           dims=traits.get("dims"))
        calib, held = samples[:args.calibration], samples[args.calibration:]
    import onnx_ir as ir

    from opfuse.prepare.static_shapes import dims_from_samples

    shape_dims = dims_from_samples(ir.serde.deserialize_model(proto), samples)
    fixed, _ = make_static_proto(proto, shape_dims)
    # ONNX Runtime's documented flow, in a child process: ONNX Runtime itself may crash on a
    # model (1.32 segfaults optimising silero_vad.onnx once sr is bound), which is a result
    like = PRESETS[args.preset] if args.flow_types == "preset" else None
    flow = _isolated(_ort_flow, label, fixed, calib, held, ocr, True, like)
    if "during qnn_preprocess_model" in flow.get("error", ""):  # the guide's next steps, without it
        flow = {**_isolated(_ort_flow, label, fixed, calib, held, ocr, False, like), "preprocess": flow["error"]}
    if like is not None:
        flow["types"] = f"get_qnn_qdq_config with --preset {args.preset}'s types: {like.summary}"
    if constants:
        flow["binding"] = ("opfuse's binding step only: " + ", ".join(f"{k}={v}" for k, v in constants.items())
                           + " as an initializer, no other rewrite")
    row["ort_flow"] = flow
    if constants and any(n.op_type == "If" for n in fixed.graph.node):
        # ONNX Runtime's quantiser does not enter an If, so the flow above leaves its branch in
        # float; like for like, the flow is also given the model ONNX Runtime's own basic
        # optimiser writes, which inlines an If whose condition the binding made constant
        # (in a child too: ONNX Runtime 1.32 segfaults optimising silero_vad.onnx once sr is bound)
        inlined = _isolated(_flow_on_inlined, label, fixed, calib, held, ocr, like)
        if "skipped" not in inlined:
            row["ort_flow_inlined"] = inlined
    # opfuse
    ours: dict = {}
    start = time.perf_counter()
    try:
        q, report = opfuse.quantize(str(path), samples, preset=args.preset, holdout=len(held), adaround=args.adaround,
                                    calibrate=args.calibrate, constant_inputs=constants,
                                    reconstruct=True if args.reconstruct else "auto")
        ours["quantize_s"] = round(time.perf_counter() - start, 1)
        qdq = ir.serde.serialize_model(q)
        ours["quantize_linear"] = sum(n.op_type == "QuantizeLinear" for n in qdq.graph.node)
        ours.update(_judge(label, fixed, qdq, held, ocr))
        ours["report_htp_sqnr"] = round(report.verification.sqnr_db, 2)
        if args.adaround:
            ours["adaround_layers"] = report.adaround_layers
        if report.reconstruction is not None:
            r = report.reconstruction
            ours["reconstruction"] = {"kept": r.kept, "tuning_db": [round(x, 2) for x in r.sqnr_db],
                                      "seconds": round(r.seconds, 1)}
    except Exception as e:  # noqa: BLE001
        ours["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    row["opfuse"] = ours
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join((*BUILTIN, *TRANSFORMERS, "wild", "ppocrv6")))
    parser.add_argument("--calibration", type=int, default=16)
    parser.add_argument("--holdout", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=1,
                        help="draws of the random samples per model (seeds 0..N-1), each a row; the summary gives "
                             "opfuse's HTP SQNR minus the flow's per draw, its median and range")
    parser.add_argument("--lines", type=int, default=30, help="rendered text lines for PP-OCR rec exact match")
    parser.add_argument("--cache", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "opfuse-wild")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--only", default="", help="wheel models whose label contains one of these (comma-separated)")
    parser.add_argument("--preset", default="qnn", help="opfuse's preset (default qnn)")
    parser.add_argument("--adaround", action="store_true", help="opfuse with --adaround (layer-wise weight rounding)")
    parser.add_argument("--reconstruct", action="store_true",
                        help="opfuse with --reconstruct on (block reconstruction; by default it runs where "
                             "estimated under its budget)")
    parser.add_argument("--calibrate", default="auto", choices=tuple(CALIBRATION_METHODS),
                        help="opfuse's --calibrate (default auto: a range per tensor)")
    parser.add_argument("--flow-types", choices=("guide", "preset"), default="guide",
                        help="the flow's quantisation types: the guide's get_qnn_qdq_config defaults (uint8 "
                             "activations and weights per tensor), or those of opfuse's --preset (like for like: "
                             "e.g. 16-bit activations and per-channel weights for qnn-a16-per-channel)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's thread count for block reconstruction, whose result moves with it "
                             "(default: torch's own, which follows OMP_NUM_THREADS); recorded in each row")
    args = parser.parse_args(argv)
    try:
        import torch

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        threads = torch.get_num_threads()
    except ImportError:
        threads = None
    rows = []
    with tempfile.TemporaryDirectory(prefix="opfuse-qnn-bench-") as tmp:
        for label, path, traits in _models(args.models.split(","), pathlib.Path(tmp), args.cache,
                                         [o for o in args.only.split(",") if o]):
            for seed in range(1 if _renders_lines(label) else args.seeds):  # (rendered lines: one set)
                start = time.perf_counter()
                try:
                    row = run_model(label, path, traits, args, seed)
                except Exception as e:  # noqa: BLE001 - one model's failure is a row
                    row = {"model": label, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                row["seed"] = seed
                row["seconds"] = round(time.perf_counter() - start, 1)
                row["torch_threads"] = threads
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    pathlib.Path(args.json).write_text(json.dumps(rows, indent=2))
    for line in _margins(rows):
        print(line)
    return 0


def _margins(rows: list[dict]) -> list[str]:
    """Per model: opfuse's HTP SQNR minus the flow's, per draw of the samples, median and range."""
    by_model: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        ours = row.get("opfuse", {}).get("htp_sqnr")
        inlined = " (the flow given the If inlined by ONNX Runtime)"
        for key, suffix in (("ort_flow", ""), ("ort_flow_inlined", inlined)):
            flow = row.get(key, {}).get("htp_sqnr")
            if isinstance(ours, (int, float)) and isinstance(flow, (int, float)):
                by_model.setdefault(row["model"] + suffix, []).append((row.get("seed", 0), ours - flow))
    lines = []
    for model, margins in by_model.items():
        values = sorted(m for _, m in margins)
        each = ", ".join(f"seed {s}: {m:+.2f}" for s, m in margins)
        lines.append(f"{model}: opfuse - flow on the HTP, median {float(np.median(values)):+.2f} dB "
                     f"(min {values[0]:+.2f}, max {values[-1]:+.2f}; {each})")
    return lines


if __name__ == "__main__":
    sys.exit(main())
