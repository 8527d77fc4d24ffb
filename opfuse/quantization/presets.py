"""The quantisation presets, as data (the command line lists them without loading anything).

- ``cpu``: uint8 asymmetric activations, int8 symmetric weights per channel; a costly
  layer is kept in float.
- ``per-tensor``: the same with one weight scale per tensor.
- ``qnn``: ONNX Runtime's ``get_qnn_qdq_config`` (uint8 activations, uint8 weights per
  tensor: its Qualcomm NPU defaults); a costly layer is kept with 16-bit activations.
- ``qnn-per-channel``: ``qnn`` with int8 symmetric per-channel weights (QNN's own option,
  ``get_qnn_qdq_config(per_channel=True)``).
- ``qnn-a16``: ``qnn`` with uint16 activations (QNN's "w8a16": the HTP runs 16-bit
  activations natively, at a cost in speed).
- ``qnn-a16-per-channel``: ``qnn-a16`` with ``qnn-per-channel``'s weights.

All of them write QDQ (QuantizeLinear/DequantizeLinear pairs around float ops) through
ONNX Runtime's quantiser, calibrated as ``--calibrate`` says (by default ``auto``: each
tensor the range of least round-trip error among MinMax, the 99.99th percentile and
ranges clipped inside MinMax; :mod:`.ranges`).

What ``cpu`` and ``per-tensor`` quantise (:data:`CPU_OPS`): the layers with weights, the
activations ONNX Runtime folds into them (Relu, Clip), and the ops that only move or pool
8-bit values. Element-wise arithmetic (Add, Mul, Div, Sub, Pow, Softmax, Sigmoid, the
pieces of a decomposed LayerNorm or HardSwish) stays in float: in 8 bits each such op
rounds its result again, which costs accuracy for little time saved on a CPU
(docs/quantization.md gives the measurement). That includes residual Adds (and a Relu
after one): ONNX Runtime could run them as QLinearAdd, but ResNet-style skip connections
run in float between a DequantizeLinear and a QuantizeLinear: a few more kernels per
block, measured in the int8 rows of ``opfuse bench``.
``qnn-a16`` calibrates with MinMax when ``--calibrate`` is ``auto``: auto's per-tensor search
judges a range by its 8-bit round trip (:mod:`.ranges`), which is not what a 16-bit tensor
loses. ``qnn`` quantises everything ONNX Runtime's QNN configuration does: an NPU runs no float. Per-channel weights need
DequantizeLinear's ``axis`` (opset 13); ONNX Runtime's quantiser wants opset 11 or later
(:attr:`Preset.min_opset`). An NPU cannot run float, so ``qnn`` keeps a costly layer in
int8 weights with 16-bit activations instead of leaving it in float.

``per-tensor`` also equalises the conv pairs first (:mod:`opfuse.passes.equalize`) and rounds
each layer with AdaRound (:mod:`.adaround`, which chooses the layer's weight scale too) in place
of block reconstruction (``Preset.equalize``, ``Preset.adaround``; ``--no-equalize``,
``--no-adaround``). One scale per weight tensor spends its steps on a layer's widest channel;
equalisation evens the channels' ranges, and AdaRound's scale search and rounding recover what
is left. It equalises only the pairs that need no new op (``equalize-homogeneous``: a ReLU6
between would become a Relu and a per-channel Min, which ONNX Runtime's int8 conv does not
absorb; ``--equalize`` takes every pair). The cost is AdaRound's minutes; what it gains per
model is in docs/results/quantize.md.

Block reconstruction (:mod:`.reconstruction`) learns the activation scales in its fit for
``cpu`` and ``per-tensor`` (LSQ), and searches them before it for the ``qnn`` presets, which
quantise the residual stream too: there LSQ's gradient misleads, while for the CPU presets
the search costs more and reads no better (docs/quantization.md).
"""

from __future__ import annotations

__all__ = ["Preset", "PRESETS", "DEFAULT_PRESET", "CPU_OPS"]

import dataclasses


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    activation: str  # "uint8" or "uint16"
    weight: str  # "int8" or "uint8"
    per_channel: bool
    qnn: bool = False  # the configuration comes from ONNX Runtime's get_qnn_qdq_config
    keep_as: str = "float"  # how the mixed-precision search keeps a layer: "float" or "int16"
    op_types: tuple[str, ...] | None = None  # what ONNX Runtime's quantiser may touch (None: its default)
    scale_fit: str = "learned"  # how block reconstruction chooses activation scales (.reconstruction.SCALE_FITS)
    equalize: str = ""  # the equalisation pass run unless the caller says otherwise ("": none; --no-equalize)
    adaround: bool = False  # AdaRound unless the caller says otherwise (--no-adaround); auto reconstruction then off

    @property
    def min_opset(self) -> int:
        return 13 if self.per_channel else 11


CPU_OPS = (
    "Conv", "ConvTranspose", "Gemm", "MatMul",  # the layers with weights
    "Relu", "Clip",  # folded into the conv's output range
    "MaxPool", "AveragePool", "GlobalAveragePool", "Concat", "Reshape", "Transpose", "Flatten",
    "Squeeze", "Unsqueeze", "Resize", "Split", "Slice", "Pad", "Gather",  # move or pool 8-bit values
)

PRESETS: dict[str, Preset] = {
    "cpu": Preset("cpu", "int8 symmetric per-channel weights, uint8 activations",
                  "uint8", "int8", per_channel=True, op_types=CPU_OPS),
    "per-tensor": Preset("per-tensor", "int8 symmetric per-tensor weights, uint8 activations; equalised, "
                         "weights rounded by AdaRound", "uint8", "int8", per_channel=False, op_types=CPU_OPS,
                         equalize="equalize-homogeneous", adaround=True),
    "qnn": Preset("qnn", "ONNX Runtime's get_qnn_qdq_config: uint8 activations and weights, per tensor",
                  "uint8", "uint8", per_channel=False, qnn=True, keep_as="int16", scale_fit="search"),
    "qnn-per-channel": Preset("qnn-per-channel", "as qnn with int8 symmetric per-channel weights",
                              "uint8", "int8", per_channel=True, qnn=True, keep_as="int16", scale_fit="search"),
    "qnn-a16": Preset("qnn-a16", "as qnn with uint16 activations (QNN's w8a16)",
                      "uint16", "uint8", per_channel=False, qnn=True, keep_as="int16", scale_fit="search"),
    "qnn-a16-per-channel": Preset("qnn-a16-per-channel", "as qnn-a16 with int8 symmetric per-channel weights",
                                  "uint16", "int8", per_channel=True, qnn=True, keep_as="int16", scale_fit="search"),
}
DEFAULT_PRESET = "cpu"
