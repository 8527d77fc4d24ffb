"""The ``qnn`` target: Qualcomm's HTP (Hexagon NPU) through ONNX Runtime's QNN provider, as data.

Every row below is what QNN's own compiler said (``python benchmarks/qnn_ops.py``: one-op
and one-pattern graphs with static shapes, compiled on the HTP backend of
onnxruntime-qnn 2.7.0, QNN API 2.40, soc_model 57, as float and as ONNX Runtime's QNN flow
quantises them); ``tests/test_qnn_target.py`` checks the table against the backend, and
``tests/test_qnn_decoder.py`` the decoder forms on a decoder block.

QNN takes whole (float and QDQ): Conv, and Conv followed by Relu, Clip, LeakyRelu,
Sigmoid, Tanh, HardSigmoid, HardSwish, Elu, Selu, Softplus, PRelu or Gelu; Gemm, MatMul,
BatchNormalization, LayerNormalization (17), RMSNormalization (23), Gelu (20, both
approximations), ``com.microsoft`` Gelu and QuickGelu, HardSwish, HardSigmoid, Swish (24),
x * Sigmoid(x), Softmax, InstanceNormalization, Resize, LSTM, Attention (23) and attention
written out (MatMul, scale, Softmax, MatMul).

The decoder forms (``benchmarks/qnn_decoder_ops.py``; ``--numerics`` runs each float graph on
the HTP against ONNX Runtime's CPU: every one QNN takes agrees to 2e-3 of the output's scale,
the HTP computing float graphs in float16): QNN takes whole RotaryEmbedding (23) in every form
(rotate-half and interleaved, full and partial ``rotary_embedding_dim``, [B, S, R/2] caches or
tables at ``position_ids``, 4-D and 3-D), Attention (23) with ``past_key``/``past_value`` and the
present outputs (as many key heads as query heads or fewer, 4-D and 3-D with
``q_num_heads``/``kv_num_heads``, with a mask, a decode step or a prefill after a past), an
Add before RMSNormalization (23) or LayerNormalization (17), and the written-out forms of each
(rotate-half, rotate-every-two, partial; the past Concat and ``repeat_kv``; RMSNorm spelled as
the exporters do).

QNN does not take: ``Erf`` in a quantised graph ("Operators of type `Erf` are not supported
by QNN EP"; in a float graph the provider fuses an Erf GELU itself, so float hides it);
ONNX Runtime's CPU fusions ``FusedConv``, ``FusedGemm``, ``SkipLayerNormalization``,
``BiasGelu``, ``FastGelu``, ``MultiHeadAttention`` (each "not supported by QNN EP");
``SimplifiedLayerNormalization`` (the graph fails to compile, and ONNX Runtime's quantiser
cannot calibrate it); ``SkipSimplifiedLayerNormalization`` and ``SkipLayerNormalization`` (with
the sum as output 3 too: "not supported by QNN EP"); ``com.microsoft`` ``RotaryEmbedding`` ("QNN
EP only supports standard ONNX RotaryEmbedding (opset 23+), not com.microsoft.RotaryEmbedding");
``GroupQueryAttention`` ("filtered off QNN by the op_affinity provider option": the provider's
default affinity keeps it off the HTP); ``GroupNormalization`` (21) quantised, or on a graph input even in
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
    attention        fuse     Attention (23), its KV cache as past_key/past_value and grouped-query
                              heads taken in, then its 3-D form (the standard form's stages:
                              :mod:`opfuse.passes.patterns.kv_cache`, ``heads_3d``); never
                              MultiHeadAttention or GroupQueryAttention (neither runs)
    rotary           fuse     RotaryEmbedding (23); never the com.microsoft op (it falls back)
    skip-layer-norm  keep     Add then LayerNormalization, which runs (SkipLayerNormalization falls back)
    skip-rms-norm    keep     Add then RMSNormalization, which runs (SkipSimplifiedLayerNormalization
                              falls back; the standard form has no skip op to write)
    bias-gelu        keep     (BiasGelu falls back)
    GroupNormalization unfuse its ONNX function body (Reshape, InstanceNormalization...)

The op form is ``"qnn"`` (:mod:`opfuse.passes.patterns`: standard ops, with the Gelu
exception above). Attention and RotaryEmbedding exist from opset 23: below it each site is
refused with the opset named (``--opset 23`` upgrades the model first), and its written-out form,
which QNN also runs whole, stays. A graph with an RMSNorm written out is raised to opset 23 unless
``--opset`` says otherwise (``rms_norm_opset``): the HTP runs the written-out norm whole but, in
float16, loses the mean of squares of a real decoder's hidden states (docs/targets/qnn.md), where
it computes RMSNormalization-23 right; at 23 the attention and rotary become the standard ops too. No epilogue kernels: QNN's compiler fuses Conv + activation from
standard ops itself, so opfuse writes them as they are.

Static shapes (:mod:`opfuse.prepare.static_shapes`): QNN refuses every node whose shape is
symbolic ("REASON : Cannot get shape"), so the target binds every dimension first.

A decoder's mask: QNN does not take ``GatherND`` ("Failed to create GatherND node"), which
transformers' padding mask is read with; ``index-arithmetic`` writes it as Gathers (its index
grid folded into a constant once the dims are bound, too). Its fill value, float32's minimum, is
outside the HTP's float16 and any 16-bit range, so ``mask-fill`` (this target's pass list,
:data:`opfuse.targets.TARGET_DEFAULT_PASSES`) writes ``Where(allowed, scores, -65504)`` before the
Softmax, the same Softmax on every row (:mod:`opfuse.passes.mask_fill`); quantised, that Where's
output takes the scores' range, widened below (:mod:`.conventions`). At opset 23, where the attention is
one ``Attention`` and the mask its ``attn_mask``, the mask's fill becomes -32768 (added to the scores,
it stays finite in float16; a 16-bit range holds it exactly). The rotary angles the HTP would
compute in float16 (``Cos``/``Sin`` of ``position * inv_freq``, off by 0.09 at position 127) become a
table read by position, bounded by the attention context the bound dims give
(:mod:`opfuse.passes.rotary_table`); ``Reciprocal``, which the HTP computes wrongly quantised on a
small-scaled input, becomes ``Div(1, x)`` (:mod:`opfuse.passes.reciprocal_div`). A mixture of experts'
weights read at its router's indices, ``GatherND(w, Unsqueeze(idx, -1))`` on a constant ``w``, kill QNN's
compiler while it finalises the graph; the same read as ``Gather(w, idx, axis=0)`` compiles
(:mod:`opfuse.passes.gathernd_gather`). An Attention's present outputs the HTP binds only as the graph's own
outputs (QNN declares them graph outputs whatever reads them: through a sliding-window cache's Slice,
every run fails with ``QNN_GRAPH_ERROR_INVALID_TENSOR``); a Slice of the whole axis there goes
(:mod:`opfuse.passes.attention_presents`). A per-head q/k norm (``RMSNormalization`` over the head dim of a
[B, S, H, D] tensor: Qwen3, Gemma3) the HTP computes wrongly as QNN's rank-4 ``RmsNorm``, and right on
the same rows as [1, N, D]: :mod:`opfuse.passes.rms_norm_rows` writes that. Weights: the HTP takes
int4 MatMul and Gemm weights, per channel and per tensor, at opset 21 (``--preset qnn-w4a16``).

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
    "attention": "fuse",  # Attention-23, with its KV cache: runs whole (benchmarks/qnn_decoder_ops.py)
    "rotary": "fuse",  # RotaryEmbedding-23: runs whole; com.microsoft RotaryEmbedding falls back
    "skip-layer-norm": "keep",  # SkipLayerNormalization falls back; Add + LayerNormalization runs
    "skip-rms-norm": "keep",  # SkipSimplifiedLayerNormalization falls back; Add + RMSNormalization runs
    "bias-gelu": "keep",
    "GroupNormalization": "unfuse",  # QNN's layout transformation takes it, then QNN rejects it
}

TARGET = Target(name="qnn", title="Qualcomm QNN HTP", patterns=PATTERNS, pattern_ops="qnn", static_shapes=True,
                compiler_fuses_epilogues=True, device="opfuse.targets.qnn.device", rms_norm_opset=23)
