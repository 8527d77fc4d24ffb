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
- ``qnn-w4a16``: ``qnn-a16-per-channel`` with the MatMul and Gemm weights in int4, symmetric, one
  scale per output channel (QNN's "w4a16"); the other weights (norm scales, gathered tables) int8.
  int4 needs DequantizeLinear-21, so the model is raised to opset 21. What the HTP takes, probed on
  one MatMul and one Gemm (onnxruntime-qnn 2.7.0, soc_model 57): int4 weights per channel and per
  tensor, whole on the HTP, as it takes int8 per channel.
- ``ethos-u``: TFLite's int8 conventions for Arm's Ethos-U (int8 asymmetric activations, int8
  symmetric per-channel weights, int32 bias), every op ONNX Runtime can quantise quantised (an NPU
  runs no float; :mod:`opfuse.targets.ethos_u.device`); the result is lowered to TFLite, compiled
  by Vela and verified in LiteRT's interpreter. A costly layer is kept with 16-bit activations.

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
loses. ``qnn`` quantises everything ONNX Runtime's QNN configuration does: an NPU runs no float.
Per-channel weights need DequantizeLinear's ``axis`` (opset 13); ONNX Runtime's quantiser wants
opset 11 or later (:attr:`Preset.min_opset`). An NPU cannot run float, so ``qnn`` keeps a costly
layer in int8 weights with 16-bit activations instead of leaving it in float; the presets whose activations
are 16-bit already (``qnn-a16``, ``qnn-a16-per-channel``, ``qnn-w4a16``) keep it with 16-bit weights
(int16, symmetric, per channel where the preset's are), which the HTP of onnxruntime-qnn 2.7.0 takes for
MatMul, Gemm and Conv (probed: whole on the HTP).

``per-tensor`` also equalises the conv pairs first (:mod:`opfuse.passes.equalize`) and rounds
each layer with AdaRound (:mod:`.adaround`, which chooses the layer's weight scale too) in place
of block reconstruction (the steps ``Equalize`` and ``AdaRound``; ``--no-equalize``,
``--no-adaround``). One scale per weight tensor spends its steps on a layer's widest channel;
equalisation evens the channels' ranges, and AdaRound's scale search and rounding recover what
is left. It equalises only the pairs that need no new op (``equalize-homogeneous``: a ReLU6
between would become a Relu and a per-channel Min, which ONNX Runtime's int8 conv does not
absorb; ``--equalize`` takes every pair). The cost is AdaRound's minutes; what it gains per
model is in docs/results/quantize.md.

A preset is data: its number formats, the target it quantises for (``Preset.target``: the
``qnn`` presets name ``"qnn"``, whose device module compiles and verifies the result,
:mod:`opfuse.targets.qnn.device`), and the list of its steps with their settings
(``Preset.steps``, run in order by :mod:`.steps`). The caller's ``equalize``, ``adaround``,
``bias_correction`` and ``reconstruct`` add or drop a step of that list
(:meth:`.options.QuantizeOptions.steps`).

Block reconstruction (:mod:`.reconstruction`) learns the activation scales in its fit for
``cpu`` and ``per-tensor`` (LSQ), and searches them before it for the ``qnn`` presets, which
quantise the residual stream too: there LSQ's gradient misleads, while for the CPU presets
the search costs more and reads no better (docs/quantization.md).
"""

from __future__ import annotations

__all__ = ["Preset", "PRESETS", "DEFAULT_PRESET", "CPU_OPS", "StepSetting", "Equalize", "Ranges", "AdaRound",
           "BiasCorrection", "MixedPrecision", "Reconstruction", "QNN_FIT_FACTOR"]

import dataclasses
from typing import Literal

ScaleFit = Literal["learned", "search"]  # .reconstruction.SCALE_FITS
# The qnn presets' reconstruction searches each activation scale before the rounding fit, and
# estimated_seconds does not count that search, which takes several times the estimate (docs/quantization.md).
# So auto runs it for qnn when the estimate is at most a budget's eighth.
QNN_FIT_FACTOR = 8


@dataclasses.dataclass(frozen=True)
class Equalize:
    """Cross-layer equalisation, run with the folds (:mod:`opfuse.passes.equalize`)."""

    name = "equalize"
    pass_name: str = "equalize"  # "equalize-homogeneous": only the pairs that need no new op


@dataclasses.dataclass(frozen=True)
class Ranges:
    """Calibration: each activation's range (:mod:`.qdq`, :mod:`.ranges`)."""

    name = "ranges"


@dataclasses.dataclass(frozen=True)
class AdaRound:
    """Layer-wise rounding of each int8 weight (:mod:`.adaround`), in every candidate."""

    name = "adaround"


@dataclasses.dataclass(frozen=True)
class BiasCorrection:
    """Empirical bias correction (:mod:`.bias_correction`), in every candidate."""

    name = "bias-correction"


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """The candidate model: with a target (``min_sqnr``, ``metric``), the search (:mod:`.search`)."""

    name = "mixed-precision"


@dataclasses.dataclass(frozen=True)
class Reconstruction:
    """Block reconstruction (:mod:`.reconstruction`) of the model the search chose."""

    name = "reconstruction"
    scale_fit: ScaleFit = "learned"  # how it chooses the activation scales
    budget_factor: float = 1  # reconstruct="auto" compares the estimate times this with the budget


StepSetting = Equalize | Ranges | AdaRound | BiasCorrection | MixedPrecision | Reconstruction


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    summary: str
    activation: Literal["uint8", "uint16", "int8"]
    weight: Literal["int8", "uint8", "int4"]  # int4: the MatMul/Gemm weights only, the rest int8
    per_channel: bool
    steps: tuple[StepSetting, ...]  # in order
    target: str = "onnx"  # whose passes fold the model and whose device (if any) compiles and verifies it
    keep_as: Literal["float", "int16", "int16-weights"] = "float"  # how the mixed-precision search keeps a layer
    op_types: tuple[str, ...] | None = None  # what ONNX Runtime's quantiser may touch (None: its default)

    @property
    def min_opset(self) -> int:
        if self.weight == "int4":
            return 21  # (int4 in DequantizeLinear)
        return 13 if self.per_channel else 11

    def device(self):
        """The device module of :attr:`target` (:mod:`opfuse.targets.qnn.device`'s interface), None for a
        target without one (the model then runs on ONNX Runtime's CPU)."""
        import importlib  # (the device and its backend load only for a preset whose target has one)

        from opfuse.targets.kernels import load_target  # (likewise: the target's module on use)

        module = load_target(self.target).device
        return importlib.import_module(module) if module else None

    def step(self, kind: type) -> StepSetting | None:
        """The setting of the step of type ``kind`` in :attr:`steps` (None: the preset has none)."""
        return next((s for s in self.steps if isinstance(s, kind)), None)

    @property
    def scale_fit(self) -> str:
        """How the preset's block reconstruction chooses activation scales."""
        step = self.step(Reconstruction)
        return step.scale_fit if step is not None else "learned"


CPU_OPS = (
    "Conv", "ConvTranspose", "Gemm", "MatMul",  # the layers with weights
    "Relu", "Clip",  # folded into the conv's output range
    "MaxPool", "AveragePool", "GlobalAveragePool", "Concat", "Reshape", "Transpose", "Flatten",
    "Squeeze", "Unsqueeze", "Resize", "Split", "Slice", "Pad", "Gather",  # move or pool 8-bit values
)

_CPU_STEPS = (Ranges(), BiasCorrection(), MixedPrecision(), Reconstruction())
_PER_TENSOR_STEPS = (Equalize("equalize-homogeneous"), Ranges(), AdaRound(), BiasCorrection(), MixedPrecision(),
                     Reconstruction())
_QNN_STEPS = (Ranges(), BiasCorrection(), MixedPrecision(), Reconstruction("search", QNN_FIT_FACTOR))
_ETHOS_U_STEPS = _CPU_STEPS  # opfuse's own calibration and rounding, as for the CPU

PRESETS: dict[str, Preset] = {
    "cpu": Preset("cpu", "int8 symmetric per-channel weights, uint8 activations",
                  "uint8", "int8", per_channel=True, steps=_CPU_STEPS, op_types=CPU_OPS),
    "per-tensor": Preset("per-tensor", "int8 symmetric per-tensor weights, uint8 activations; equalised, "
                         "weights rounded by AdaRound", "uint8", "int8", per_channel=False, steps=_PER_TENSOR_STEPS,
                         op_types=CPU_OPS),
    "qnn": Preset("qnn", "ONNX Runtime's get_qnn_qdq_config: uint8 activations and weights, per tensor",
                  "uint8", "uint8", per_channel=False, steps=_QNN_STEPS, target="qnn", keep_as="int16"),
    "qnn-per-channel": Preset("qnn-per-channel", "as qnn with int8 symmetric per-channel weights",
                              "uint8", "int8", per_channel=True, steps=_QNN_STEPS, target="qnn", keep_as="int16"),
    "qnn-a16": Preset("qnn-a16", "as qnn with uint16 activations (QNN's w8a16)",
                      "uint16", "uint8", per_channel=False, steps=_QNN_STEPS, target="qnn", keep_as="int16-weights"),
    "qnn-a16-per-channel": Preset("qnn-a16-per-channel", "as qnn-a16 with int8 symmetric per-channel weights",
                                  "uint16", "int8", per_channel=True, steps=_QNN_STEPS, target="qnn",
                                  keep_as="int16-weights"),
    "qnn-w4a16": Preset("qnn-w4a16", "as qnn-a16-per-channel with int4 symmetric per-channel MatMul and Gemm "
                        "weights (QNN's w4a16; opset 21)", "uint16", "int4", per_channel=True, steps=_QNN_STEPS,
                        target="qnn", keep_as="int16-weights"),
    "ethos-u": Preset("ethos-u", "TFLite's int8 for Arm Ethos-U: int8 asymmetric activations, int8 symmetric "
                      "per-channel weights, lowered to TFLite and compiled by Vela", "int8", "int8", per_channel=True,
                      steps=_ETHOS_U_STEPS, target="ethos-u", keep_as="int16"),
}
DEFAULT_PRESET = "cpu"
