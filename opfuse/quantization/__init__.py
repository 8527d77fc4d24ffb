"""``opfuse quantize``: fold first, then int8 QDQ that keeps the model's accuracy.

    model, report = opfuse.quantize("model.onnx", "calibration.npz", output="model.int8.onnx")
    print(report.summary())

Files, in pipeline order: ``calibration.py`` (what ``--calibration`` reads),
``options.py`` (``QuantizeOptions``: what quantize is asked), ``presets.py`` (cpu,
per-tensor, qnn, as data: their formats, target and list of steps), ``steps.py`` (each
algorithm as a step with one interface), ``qdq.py`` (preparing the float model,
ONNX Runtime's quantiser), ``layers.py`` (the one index over a QDQ graph and its float model
that every step reads), ``ranges.py`` (each tensor's range by
its own round-trip error: ``--calibrate auto``), ``adaround.py`` (layer-wise weight
rounding), ``bias_correction.py`` (empirical, per output channel), ``trials.py`` (one
candidate model: QDQ, AdaRound, bias correction), ``search.py`` (the exact sensitivity
ranking and the monotone mixed-precision search, with pluggable runner and keep action),
``sqnr.py`` (per-layer and output SQNR), ``reconstruction.py`` with ``qdq_program.py`` (block
reconstruction in torch) on the interpreter ``torch_ops.py``, ``torch_nn_ops.py`` and
``torch_ops_common.py``, ``pipeline.py`` (the steps in order:
:func:`quantize`), ``report.py`` (the quantisation table). Cross-layer
equalisation is a rewrite like the folds: :mod:`opfuse.passes.equalize`.

``quantize`` loads on first use (PEP 562), so the command line can read the presets
without loading onnx or ONNX Runtime.
"""

from __future__ import annotations

__all__ = ["quantize", "QuantizeOptions", "QuantReport"]


def __getattr__(name: str):
    if name == "quantize":
        from opfuse.quantization.pipeline import quantize  # heavy: onnx, ONNX Runtime

        return quantize
    if name == "QuantizeOptions":
        from opfuse.quantization.options import QuantizeOptions  # light: the presets only

        return QuantizeOptions
    if name == "QuantReport":
        from opfuse.quantization.report import QuantReport  # light, but loaded only when asked for

        return QuantReport
    raise AttributeError(f"module 'opfuse.quantization' has no attribute {name!r}")
