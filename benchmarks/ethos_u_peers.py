"""The standard Ethos-U user's flow, run by ``benchmarks/ethos_u.py`` in the peers' own venv.

    ~/.cache/opfuse-ethos-peers/bin/python benchmarks/ethos_u_peers.py onnx2tf MODEL.onnx CALIB.npz OUT.tflite
    ~/.cache/opfuse-ethos-peers/bin/python benchmarks/ethos_u_peers.py sqnr OUT.tflite HELD.npz FLOAT_OUTPUTS.npz

``onnx2tf`` turns the ONNX model into a TensorFlow SavedModel (NHWC; it folds BatchNormalization
and fuses activations itself), then the TFLite converter quantises it to full integer as Arm's
Ethos-U documentation asks: ``Optimize.DEFAULT``, a representative dataset (the calibration
samples of ``CALIB.npz``, NCHW as the ONNX model takes them, transposed to NHWC here), builtin
int8 ops only, int8 input and output. Prints one JSON line: {"ok": true} or {"ok": false,
"error": "..."}; ``sqnr`` runs the peer's TFLite in TensorFlow's own interpreter (the peer's
runtime) and prints {"ok": true, "sqnr_db": ...}. Setup: see ``benchmarks/ethos_u.py``. Not imported by opfuse (TensorFlow lives
in this venv only).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def onnx2tf_flow(model_path: str, calib_path: str, out_path: str) -> None:
    import numpy as np
    import onnx2tf
    import tensorflow as tf

    samples = np.load(calib_path)
    names = sorted(samples.files)
    with tempfile.TemporaryDirectory(prefix="opfuse-onnx2tf-") as tmp:
        # onnx2tf fetches 20 sample images from GitHub for its own checks of a 4-D image input and
        # reads them from the working directory first: a seeded stand-in there (no network here;
        # the quantisation below uses CALIB.npz, not these)
        os.chdir(tmp)
        stand_in = np.random.default_rng(0).random((20, 128, 128, 3), dtype=np.float32)
        np.save(os.path.join(tmp, "calibration_image_sample_data_20x128x128x3_float32.npy"), stand_in)
        saved = os.path.join(tmp, "saved_model")
        # output_integer_quantized_tflite: onnx2tf's documented switch for a model headed for int8 (its MaxPool
        # pad is then 0, not float32's minimum, which broke the int8 ranges: docs/results/ethos_u.md)
        onnx2tf.convert(input_onnx_file_path=os.path.abspath(model_path), output_folder_path=saved, non_verbose=True,
                        copy_onnx_input_output_names_to_tflite=True, output_integer_quantized_tflite=True)
        converter = tf.lite.TFLiteConverter.from_saved_model(saved)

        def representative():
            for name in names:
                x = samples[name]
                yield [np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if x.ndim == 4 else x]

        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = representative
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        converter.inference_input_type = tf.int8
        converter.inference_output_type = tf.int8
        data = converter.convert()
    with open(out_path, "wb") as f:
        f.write(data)


def sqnr(tflite_path: str, held_path: str, reference_path: str) -> float:
    """Output SQNR (dB) of the TFLite in TensorFlow's own interpreter against the float outputs of
    ``reference_path`` (arrays o000, o001... per sample, outputs concatenated flat), inputs from
    ``held_path`` (arrays s000... NCHW, transposed to NHWC here)."""
    import numpy as np
    import tensorflow as tf

    held, reference = np.load(held_path), np.load(reference_path)
    interpreter = tf.lite.Interpreter(model_path=tflite_path)
    interpreter.allocate_tensors()
    detail = interpreter.get_input_details()[0]
    signal = noise = 0.0
    for name, ref in zip(sorted(held.files), sorted(reference.files)):
        x = held[name]
        if x.ndim == 4 and tuple(x.shape) != tuple(detail["shape"]):
            x = x.transpose(0, 2, 3, 1)
        scale, zero = detail["quantization"]
        x = np.clip(np.round(x / scale) + zero, -128, 127) if scale else x
        interpreter.set_tensor(detail["index"], x.astype(detail["dtype"]))
        interpreter.reset_all_variables()  # each sample from a zero recurrent state (TFLite keeps it across runs)
        interpreter.invoke()
        got = []
        for out in interpreter.get_output_details():
            q = interpreter.get_tensor(out["index"]).astype(np.float64)
            s, z = out["quantization"]
            got.append(((q - z) * s if s else q).ravel())
        f = reference[ref].astype(np.float64).ravel()
        q = np.concatenate(got)[: f.size]
        signal += float(np.sum(f * f))
        noise += float(np.sum((q - f) ** 2))
    return float(10 * np.log10(signal / noise))


def main(argv: list[str]) -> int:
    flow, paths = argv[0], [os.path.abspath(a) for a in argv[1:4]]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    result: dict = {"ok": True}
    try:
        if flow == "onnx2tf":
            onnx2tf_flow(*paths)
        elif flow == "sqnr":
            result["sqnr_db"] = sqnr(*paths)
        else:
            raise ValueError(f"unknown peer flow {flow!r}")
    except Exception as e:  # noqa: BLE001 - a peer's failure is its row's result
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        said = lines[0] if lines else ""
        # a Keras layer's traced error opens with "in user code:"; the layer and what went wrong follow
        where = [i for i, line in enumerate(lines) if "Exception encountered when calling layer" in line]
        if said == "in user code:" and where and where[0] + 1 < len(lines):
            said = f"{lines[where[0]].split(': ', 1)[-1]} {lines[where[0] + 1]}"
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {said}"[:400]}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
