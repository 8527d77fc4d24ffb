"""The device interface of the ``ethos-u`` target (:attr:`opfuse.targets.kernels.Target.device`).

The names :mod:`opfuse.targets.qnn.device` lists, for Arm's Ethos-U through Vela:

- ``require_backend()``: ``ethos-u-vela`` and ``ai-edge-litert`` installed, or one line with
  ``pip install 'opfuse[ethos-u]'`` (exit 2; :func:`.vela.require_vela`);
- ``Options.parse(pairs)``: :class:`EthosOptions` from ``--npu`` and ``--vela KEY=VALUE`` pairs
  (``npu``, ``system_config``, ``memory_mode``; the defaults are Vela's own per NPU family,
  :data:`.vela.DEFAULTS`; :class:`.vela.EthosOptions`);
- ``compile(...)``: lowered to TFLite, compiled by Vela, the report's ``device`` section
  (:func:`.compile.compile_for_ethos_u`);
- ``quantizer_config(...)``: TFLite's int8 conventions as ``quantize_static``'s keywords
  (:func:`quantizer_config`);
- ``prepare_float(model)``: the float model rewritten before quantisation so that each op is one
  int8 TFLite kernel (a LayerNorm's ``Div(a, Sqrt(y))`` as ``Mul(a, Pow(y, -0.5))``, RSQRT;
  :func:`.tflite_norm.rsqrt_form`), in place; returns the report's notes;
- ``ROUNDS_LSTM_WEIGHTS``: the quantiser rounds each LSTM's weights on the integer LSTM's grid (one
  int8 scale per gate matrix), GPTQ's way, from the calibration data
  (:mod:`opfuse.quantization.algorithms.lstm_rounding`): ONNX Runtime's quantiser leaves the LSTM float;
- ``Runner``: the lowered TFLite in LiteRT's interpreter (:class:`.runner.TfliteRunner`);
- ``accuracy(...)``: the held-out SQNRs, TFLite vs float, QDQ vs float, TFLite vs QDQ
  (:func:`.runner.tflite_accuracy`; in the interface's names ``htp_vs_float``, ``cpu_vs_float``,
  ``htp_vs_cpu``).

TFLite's int8 quantisation conventions (the TFLite converter's full-integer mode, which
TFLite Micro and Vela expect): activations int8 asymmetric, one scale and zero point per
tensor; weights int8 symmetric (zero point 0), per output channel for the layers with weights;
bias int32 at the input scale times the weight scale, zero point 0. ONNX Runtime's quantiser
writes that with ``activation_type=QInt8``, ``weight_type=QInt8``, ``per_channel=True``,
``ActivationSymmetric`` False and ``WeightSymmetric`` True; its bias is int32 at that scale
already. Every op it can quantise is quantised: the NPU runs no float. A layer the
mixed-precision search keeps goes to 16-bit activations, symmetric (TFLite's 16x8 mode). The
quantisations TFLite's int8 kernels fix (LOGISTIC's output, CONCATENATION's inputs...) are
overrides (:mod:`.tflite_quant`): without them the lowering pays a QUANTIZE for each; block
reconstruction keeps those scales (``kept_scales(float_model)``: the tensors whose scale it must not learn).
"""

from __future__ import annotations

__all__ = ["TITLE", "NAME", "EthosOptions", "Options", "require_backend", "compile", "quantizer_config",
           "prepare_float", "WANTS_RANGES", "ROUNDS_LSTM_WEIGHTS", "kept_scales", "Runner", "accuracy"]

import pathlib

import onnx

from opfuse.targets.ethos_u.vela import EthosOptions
from opfuse.targets.ethos_u.vela import require_vela as require_backend

# the lowering's modules below import LiteRT's schema: without the extra, this module is the
# one line with the install command (exit 2), not an ImportError
require_backend()

from opfuse.targets.ethos_u.compile import compile_for_ethos_u as compile  # noqa: A001,E402 - the interface's name
from opfuse.targets.ethos_u.runner import TfliteRunner as Runner  # noqa: E402
from opfuse.targets.ethos_u.runner import tflite_accuracy as accuracy  # noqa: E402
from opfuse.targets.ethos_u.tflite_norm import QUANTISED_OPS  # noqa: E402
from opfuse.targets.ethos_u.tflite_norm import rsqrt_form as prepare_float  # noqa: E402
from opfuse.targets.ethos_u.tflite_quant import kept_scales, tflite_overrides  # noqa: E402

TITLE = "Arm Ethos-U through Vela"
NAME = "Ethos-U (the lowered TFLite in LiteRT)"


Options = EthosOptions  # (the interface's name)


WANTS_RANGES = True  # quantizer_config reads the calibrated ranges (ranges=), so they are calibrated first
# its LSTM is TFLite's integer one (one int8 scale per gate matrix, .tflite_lstm), which ONNX Runtime's quantiser
# leaves float: the quantiser rounds the LSTM's weights on that grid (opfuse.quantization.algorithms.lstm_rounding)
ROUNDS_LSTM_WEIGHTS = True


def quantizer_config(float_path: pathlib.Path, float_model: onnx.ModelProto, preset, *, reader, sample_reader,
                     method, extra: dict, sixteen: list[str], excluded: list[str], ranges=None) -> dict:
    """``quantize_static``'s keyword arguments by TFLite's int8 conventions (module docstring);
    ``sixteen``: tensors kept with 16-bit symmetric activations, ``excluded``: nodes kept in float,
    ``ranges``: the calibrated ranges (ONNX Runtime's ``TensorsData``), for the quantisations
    TFLite's kernels fix (:func:`.tflite_quant.tflite_overrides`)."""
    from onnxruntime import quantization as ortq  # (the quantiser: heavy, on use)
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry  # (its default op list)

    overrides = tflite_overrides(float_model, ranges, sixteen)
    overrides.update({t: [{"quant_type": ortq.QuantType.QInt16, "symmetric": True}] for t in sixteen})
    options = {"ActivationSymmetric": False, "WeightSymmetric": True, **extra}
    if overrides:
        options["TensorQuantOverrides"] = overrides
    return dict(calibration_data_reader=reader, quant_format=ortq.QuantFormat.QDQ,
                activation_type=ortq.QuantType.QInt8, weight_type=ortq.QuantType.QInt8,
                per_channel=preset.per_channel, calibrate_method=method,
                op_types_to_quantize=sorted({*QLinearOpsRegistry, *QDQRegistry, *QUANTISED_OPS}),
                nodes_to_exclude=list(excluded), extra_options=options)
