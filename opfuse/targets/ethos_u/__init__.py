"""The ``ethos-u`` target: Arm's Ethos-U NPUs (U55, U65, U85) through int8 TFLite and Vela, as data.

The model the passes leave is lowered to int8 TFLite in NHWC (:mod:`.lower`), compiled by Arm's
Vela (:mod:`.vela`) and run in LiteRT's interpreter (:mod:`.runner`); :mod:`.device` is the
device interface both pipelines reach it through (:mod:`opfuse.targets.qnn.device` names it).

What the NPUs run is Vela's own table (``vela --supported-ops-report``, ethos-u-vela 5.2.0):
CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED, TRANSPOSE_CONV, the pools, ADD, SUB, MUL, MEAN,
SUM, RESHAPE, CONCATENATION, PAD, SOFTMAX, the RESIZEs, LOGISTIC, TANH, HARD_SWISH, GELU,
LEAKY_RELU, PRELU, TRANSPOSE, SLICE, SPLIT, ... on all three; DIV, GATHER, CAST, SELECT and
the comparisons on the U85 alone. TFLite has no LayerNorm, RMSNorm or GroupNorm op: they are
written out (MEAN, SUB, MUL, RSQRT, ADD all run on the NPU).

So, per pattern (:data:`PATTERNS`):

    pattern          policy   becomes
    hardswish        fuse     HardSwish (HARD_SWISH)
    gelu             fuse     Gelu-20 where the opset has it (GELU); below, kept written out
    matmul-add       fuse     Gemm (FULLY_CONNECTED with its bias)
    layer-norm       keep     written out (no TFLite op); a LayerNormalization: unfused
    rms-norm         keep     likewise; a RMSNormalization: unfused
    silu             keep     LOGISTIC then MUL (no TFLite Swish)
    attention        keep     written out
    LayerNormalization, RMSNormalization, GroupNormalization   unfuse  (their ONNX function bodies)

No epilogue kernels in the ONNX graph: a TFLite op carries its activation in its own
``fused_activation_function`` (:data:`FUSED_ACTIVATIONS`), which the lowering writes from the
Relu or Clip that follows the layer; that is the epilogue the TFLite form fuses, so opfuse
writes it as standard ops (``compiler_fuses_epilogues``). Vela fuses further itself on the
U85 (element-wise chains); the U55 and U65 run each remaining op as its own pass.

Static shapes: TFLite tensors and Vela's schedule have fixed shapes, so the target binds every
dimension first (:mod:`opfuse.prepare.static_shapes`).
"""

from __future__ import annotations

__all__ = ["TARGET", "PATTERNS", "FUSED_ACTIVATIONS", "EPILOGUE_ANCHORS"]

from opfuse.targets.kernels import Target

PATTERNS: dict[str, str] = {
    "hardswish": "fuse",
    "gelu": "fuse",
    "matmul-add": "fuse",
    "layer-norm": "keep",
    "rms-norm": "keep",
    "silu": "keep",
    "attention": "keep",
    "skip-layer-norm": "keep",
    "skip-rms-norm": "keep",
    "bias-gelu": "keep",
    "LayerNormalization": "unfuse",  # no TFLite op: MEAN, SUB, MUL, RSQRT, ADD
    "RMSNormalization": "unfuse",
    "GroupNormalization": "unfuse",
}

# ONNX activation after a layer (with Clip's bounds) -> TFLite's ActivationFunctionType name
FUSED_ACTIVATIONS: dict[tuple[str, tuple[float, ...]], str] = {
    ("Relu", ()): "RELU",
    ("Clip", (0.0, 6.0)): "RELU6",
    ("Clip", (-1.0, 1.0)): "RELU_N1_TO_1",
    ("Clip", (0.0, float("inf"))): "RELU",
}
# the TFLite ops whose options carry fused_activation_function (the schema's *Options with that field)
EPILOGUE_ANCHORS: tuple[str, ...] = (
    "CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "TRANSPOSE_CONV", "AVERAGE_POOL_2D", "MAX_POOL_2D",
    "ADD", "SUB", "MUL", "CONCATENATION",
)

TARGET = Target(name="ethos-u", title="Arm Ethos-U (TFLite through Vela)", patterns=PATTERNS, static_shapes=True,
                compiler_fuses_epilogues=True, device="opfuse.targets.ethos_u.device")
