"""The ``qnn`` target: Qualcomm's HTP (Hexagon NPU) through ONNX Runtime's QNN provider, as data.

Every row below is what QNN's own compiler said (``python benchmarks/qnn_ops.py``: one-op
and one-pattern graphs with static shapes, compiled on the HTP backend of
onnxruntime-qnn 2.7.0, QNN API 2.40, soc_model 57, as float and as ONNX Runtime's QNN flow
quantises them); ``tests/test_qnn_target.py`` checks the table against the backend.

QNN takes whole (float and QDQ): Conv, and Conv followed by Relu, Clip, LeakyRelu,
Sigmoid, Tanh, HardSigmoid, HardSwish, Elu, Selu, Softplus, PRelu or Gelu; Gemm, MatMul,
BatchNormalization, LayerNormalization (17), RMSNormalization (23), Gelu (20, both
approximations), ``com.microsoft`` Gelu and QuickGelu, HardSwish, HardSigmoid, Swish (24),
x * Sigmoid(x), Softmax, InstanceNormalization, Resize, LSTM, Attention (23) and attention
written out (MatMul, scale, Softmax, MatMul).

QNN does not take: ``Erf`` in a quantised graph ("Operators of type `Erf` are not supported
by QNN EP"; in a float graph the provider fuses an Erf GELU itself, so float hides it);
ONNX Runtime's CPU fusions ``FusedConv``, ``FusedGemm``, ``SkipLayerNormalization``,
``BiasGelu``, ``FastGelu``, ``MultiHeadAttention`` (each "not supported by QNN EP");
``SimplifiedLayerNormalization`` (the graph fails to compile, and ONNX Runtime's quantiser
cannot calibrate it); ``GroupNormalization`` (21) quantised, or on a graph input even in
float: the NHWC layout transformation inserts it, then QNN rejects it and the session fails
to open ("was inserted using the NHWC format as requested by QNNExecutionProvider, but was
not selected by that EP").

So, per pattern (:data:`PATTERNS`):

    pattern          policy   becomes
    layer-norm       fuse     LayerNormalization (opset 17+; below, kept with the opset named)
    rms-norm         fuse     RMSNormalization (23+); never SimplifiedLayerNormalization
    gelu             fuse     Gelu-20, or com.microsoft Gelu below opset 20 (the form
                              ONNX Runtime's qnn_preprocess_model writes); an Erf GELU left
                              written out falls back in every quantised graph
    hardswish        fuse     HardSwish
    silu             fuse     Swish (24+); below, x * Sigmoid(x) already runs whole
    matmul-add       fuse     Gemm
    attention        keep     written out, QNN runs it; MultiHeadAttention it does not
    rotary           keep     written out (its Mul, Slice, Concat run; RotaryEmbedding unmeasured)
    skip-layer-norm  keep     (SkipLayerNormalization falls back)
    skip-rms-norm    keep     (no SimplifiedLayerNormalization to join: QNN runs neither)
    bias-gelu        keep     (BiasGelu falls back)
    GroupNormalization unfuse its ONNX function body (Reshape, InstanceNormalization...)

The op form is ``"qnn"`` (:mod:`opfuse.passes.patterns`: standard ops, with the Gelu
exception above). No epilogue kernels: QNN's compiler fuses Conv + activation from
standard ops itself, so opfuse writes them as they are.

Static shapes (:mod:`opfuse.prepare.static_shapes`): QNN refuses every node whose shape is
symbolic ("REASON : Cannot get shape"), so the target binds every dimension first.

The device beside the target (the package ``opfuse.targets.qnn``, :attr:`Target.device` names
:mod:`.device`): whether the backend is installed and the HTP options, opening a session on it
and capturing its compile log (:mod:`.backend`); reading that log, node by node (:mod:`.placement`);
an ``If`` left on the CPU and the inputs that decide it (:mod:`.branches`); compiling the
optimised model and the EPContext file (:mod:`.compile`); running samples on the HTP (:mod:`.runner`);
the quantiser's QNN conventions (:mod:`.conventions`); probing what QNN takes (:mod:`.probe`).
"""

from __future__ import annotations

__all__ = ["TARGET", "PATTERNS"]

from opfuse.targets.kernels import Target

PATTERNS: dict[str, str] = {
    "layer-norm": "fuse",
    "rms-norm": "fuse",
    "gelu": "fuse",
    "hardswish": "fuse",
    "silu": "fuse",
    "matmul-add": "fuse",
    "attention": "keep",
    "rotary": "keep",
    "skip-layer-norm": "keep",
    "skip-rms-norm": "keep",
    "bias-gelu": "keep",
    "GroupNormalization": "unfuse",  # QNN's layout transformation takes it, then QNN rejects it
}

TARGET = Target(name="qnn", title="Qualcomm QNN HTP", patterns=PATTERNS, pattern_ops="qnn", static_shapes=True,
                compiler_fuses_epilogues=True, device="opfuse.targets.qnn.device")
