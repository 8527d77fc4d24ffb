"""AIMET's and NNCF's post-training int8 flows on one ONNX model (run by benchmarks/quantize.py).

    .venv-peers/bin/python benchmarks/int8_peers.py FLOW MODEL.onnx CALIB.npz OUT.onnx \\
        [--per-tensor] [--validation VAL.npz --metric METRIC.json] [--adaround-iterations N]

Runs in a venv of its own (aimet-onnx pulls bokeh, pandas, onnx2torch, scikit-learn...):

    python3 -m venv .venv-peers
    .venv-peers/bin/pip install -c constraints.txt -e ".[int8-peers]"

(``constraints.txt`` pins what the two share with opfuse; pip resolves the rest.) Flows,
each its library's documented post-training recipe on the same calibration samples:

- ``aimet``: aimet-onnx 2.42: cross-layer equalisation (``equalize_model``: BatchNorm folded,
  ReLU6 -> ReLU, cross-layer scaling, high-bias absorption), then ``QuantizationSimModel``
  (int8 weights and activations, ``post_training_tf_enhanced`` ranges, its ``default``
  per-channel config or the per-tensor ``default_config.json``), AdaRound
  (``apply_adaround``, ``--adaround-iterations`` per layer; AIMET recommends 10000, which
  on two shared cores takes hours for PP-OCR: the default here is 1000), then
  ``compute_encodings`` and ``to_onnx_qdq``. aimet-onnx 2.42 has no bias correction for
  ONNX models (its ``bias_correction`` lives in aimet-torch only): the flow says so.
- ``nncf``: NNCF 3.4 ``nncf.quantize`` with its defaults (performance preset, fast bias
  correction, per-channel weights), or with ``per_channel=False`` weights (``--per-tensor``).
- ``nncf-ac``: ``nncf.quantize_with_accuracy_control`` with the metric of
  ``--metric`` on ``--validation``, ``max_drop`` 0.01 absolute: the same metric the
  benchmark reports (exact match for OCR lines, agreement of the top class with the
  float model's for image models).

``--metric`` is a JSON file: ``{"kind": "ocr", "texts": [...], "chars": [...]}`` or
``{"kind": "agreement", "labels": [...]}``. Prints one JSON line with what was done.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort


def samples(path: pathlib.Path) -> list[dict[str, np.ndarray]]:
    with np.load(path) as data:
        names = list(data.files)
        count = data[names[0]].shape[0]
        return [{n: np.asarray(data[n][i]) for n in names} for i in range(count)]


def metric_fn(spec: dict):
    """validation_fn(model, data) -> (metric, None) as NNCF's accuracy control calls it."""

    def outputs(model, data) -> list[np.ndarray]:
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model)
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return [session.run(None, feed)[0] for feed in data]

    if spec["kind"] == "ocr":
        chars = spec["chars"]

        def decode(logits: np.ndarray) -> str:
            best = logits.argmax(axis=-1)
            keep = np.ones(best.shape, dtype=bool)
            keep[1:] = best[1:] != best[:-1]
            keep &= best != 0
            return "".join(chars[i] for i in best[keep])

        def validate(model, data):
            got = [decode(o[0]) for o in outputs(model, data)]
            return float(np.mean([g == t for g, t in zip(got, spec["texts"])])), None
    else:
        def validate(model, data):
            got = [int(o.reshape(-1).argmax()) for o in outputs(model, data)]
            return float(np.mean([g == t for g, t in zip(got, spec["labels"])])), None
    return validate


def run_aimet(model: onnx.ModelProto, calib, per_tensor: bool, iterations: int) -> tuple[onnx.ModelProto, dict]:
    from aimet_onnx import QuantizationSimModel, apply_adaround, int8
    from aimet_onnx.common.defs import QuantScheme
    from aimet_onnx.cross_layer_equalization import equalize_model

    equalize_model(model)
    config = None
    if per_tensor:
        import aimet_onnx.common.quantsim_config as qc

        config = str(pathlib.Path(qc.__file__).parent / "default_config.json")
    sim = QuantizationSimModel(model, param_type=int8, activation_type=int8,
                               quant_scheme=QuantScheme.post_training_tf_enhanced,
                               config_file=config or "default", dummy_input=calib[0])
    apply_adaround(sim, calib, num_iterations=iterations)
    sim.compute_encodings(calib)
    return sim.to_onnx_qdq(prequantize_constants=True), {
        "steps": "CLE, AdaRound, compute_encodings (no bias correction: aimet-onnx 2.42 has none for ONNX)",
        "adaround_iterations": iterations}


def run_nncf(model: onnx.ModelProto, calib, per_tensor: bool, accuracy: tuple | None) -> tuple[onnx.ModelProto, dict]:
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, QuantizationParameters

    advanced = AdvancedQuantizationParameters(
        weights_quantization_params=QuantizationParameters(per_channel=False)) if per_tensor else None
    dataset = nncf.Dataset(calib)
    if accuracy is None:
        return nncf.quantize(model, dataset, subset_size=len(calib), advanced_parameters=advanced), {
            "steps": "nncf.quantize, defaults" + (", per-tensor weights" if per_tensor else "")}
    validation, validate = accuracy
    quantized = nncf.quantize_with_accuracy_control(
        model, dataset, nncf.Dataset(validation), validate, max_drop=0.01, subset_size=len(calib),
        advanced_quantization_parameters=advanced)
    return quantized, {"steps": "nncf.quantize_with_accuracy_control, max_drop 0.01 absolute",
                       "metric_float": validate(model, validation)[0], "metric_int8": validate(quantized, validation)[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("flow", choices=("aimet", "nncf", "nncf-ac"))
    parser.add_argument("model", type=pathlib.Path)
    parser.add_argument("calibration", type=pathlib.Path)
    parser.add_argument("output", type=pathlib.Path)
    parser.add_argument("--per-tensor", action="store_true")
    parser.add_argument("--validation", type=pathlib.Path)
    parser.add_argument("--metric", type=pathlib.Path)
    parser.add_argument("--adaround-iterations", type=int, default=1000)
    args = parser.parse_args()
    start = time.perf_counter()
    model = onnx.load(args.model)
    calib = samples(args.calibration)
    if args.flow == "aimet":
        quantized, facts = run_aimet(model, calib, args.per_tensor, args.adaround_iterations)
    else:
        accuracy = None
        if args.flow == "nncf-ac":
            if not (args.validation and args.metric):
                parser.error("nncf-ac needs --validation and --metric")
            accuracy = (samples(args.validation), metric_fn(json.loads(args.metric.read_text())))
        quantized, facts = run_nncf(model, calib, args.per_tensor, accuracy)
    onnx.save(quantized, args.output)
    print(json.dumps({"flow": args.flow, "seconds": time.perf_counter() - start, **facts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
