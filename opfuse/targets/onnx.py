"""The ``onnx`` target (the default): portable ONNX at the model's opset, no contrib ops.

It has no epilogue kernels: a standard ONNX runtime fuses a conv's epilogue itself, if it
can. Its multi-op patterns (:data:`PATTERNS`, :mod:`opfuse.passes.patterns`) become the
standard op that computes them, where the model's opset has it, and stay otherwise (with
the opset that would have it in the reason; ``--opset N`` upgrades the model first):

    pattern      standard op                     opset
    layer-norm   LayerNormalization              17
    gelu         Gelu (approximate none / tanh)  20
    hardswish    HardSwish                       14
    silu         Swish                           24
    rms-norm     RMSNormalization                23
    attention    Attention (4-D form)            23
    rotary       RotaryEmbedding                 23
"""

from __future__ import annotations

__all__ = ["TARGET", "PATTERNS"]

from opfuse.targets.kernels import Target

PATTERNS: dict[str, str] = {
    "layer-norm": "fuse",
    "gelu": "fuse",
    "hardswish": "fuse",
    "silu": "fuse",
    "rms-norm": "fuse",
    "rotary": "fuse",
    "attention": "fuse",
    "matmul-add": "fuse",
}

TARGET = Target(name="onnx", title="portable ONNX", patterns=PATTERNS, runs_here=True)
