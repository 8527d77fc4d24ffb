"""Lowering for the Ethos-U target: an ONNX graph (float, or QDQ as ONNX Runtime writes it) as TFLite in NHWC.

Entry point: :func:`lower_to_tflite` (returns the flatbuffer's bytes; nothing is written here).

What it reads
    - a float ONNX model (static shapes): the TFLite is float32;
    - a QDQ ONNX model as ONNX Runtime's ``quantize_static`` writes it (int8 asymmetric
      activations, int8 symmetric per-channel weights, int32 bias at input scale x weight
      scale): the TFLite is int8. The QDQ pairs are read first (:func:`read_qdq`): every float
      tensor ``T`` with ``Q(T) -> DQ`` gets the Q's scale and zero point, every ``DQ(constant)``
      becomes a constant that keeps its integers and scales, and each float op between them
      becomes one int8 TFLite op that writes ``T``'s quantisation.

Int8 IO: the graph's inputs and outputs stay int8, with the scale and zero point of the first
Q (input) and the last DQ (output); no QUANTIZE/DEQUANTIZE at the edges (Vela wants int8 IO,
and the caller quantises with the input's parameters, as LiteRT's interpreter reports them).

Layout: a rank-4 activation is NHWC in TFLite (ONNX NCHW, axes (0, 2, 3, 1)); every other rank
keeps ONNX's order. An op that reads axes (Concat, Softmax, ReduceMean, Pad, Transpose) has
them remapped; a Reshape/Flatten of NHWC data is preceded by a TRANSPOSE back to NCHW order
(and a rank-4 result is transposed to NHWC), unless only dims of size 1 move, where the data
order is the same and one RESHAPE is exact. A constant broadcast against NHWC data (BatchNorm
decomposed: ``[1, C, 1, 1]``) is permuted the same way and written as ``[C]``.

Fused activations (:data:`FUSED_ACTIVATIONS`, the target's epilogue kernels as data): a Relu,
Clip(0, 6) or Clip(-1, 1) whose input is the only output use of a CONV_2D, DEPTHWISE_CONV_2D,
FULLY_CONNECTED, ADD or MUL becomes that op's ``fused_activation_function``; in a QDQ model
the fused op writes the activation's output quantisation. An activation that cannot fuse
stays its own op, and when ``refusals`` is given the reason is appended to it.

LSTM: a UNIDIRECTIONAL_SEQUENCE_LSTM per direction, float or TFLite's integer (8x8->16) form
(:mod:`opfuse.targets.ethos_u.tflite_lstm`; Vela 5.2 runs the integer one on the NPU).

An op with no lowering is refused (:class:`LoweringError`, one line); for an op this module does
not write but a user may expect (:data:`NOT_WRITTEN`: GRU) the line says why and what to do
meanwhile.

Refusal: an op it cannot lower raises :class:`LoweringError`, one line naming the node, its op
type and the reason. The op functions live in :mod:`opfuse.targets.ethos_u.tflite_ops`; the
flatbuffer (tensors, buffers, quantisation) in :mod:`opfuse.targets.ethos_u.tflite_writer`.
"""

from __future__ import annotations

__all__ = ["lower_to_tflite", "LoweringError", "FUSED_ACTIVATIONS", "LOWERINGS"]

import onnx
from ai_edge_litert import schema_py_generated as schema

from opfuse.targets.ethos_u import tflite_attention, tflite_islands, tflite_layout, tflite_lstm, tflite_norm, tflite_ops
from opfuse.targets.ethos_u.tflite_graph import Lowering, LoweringError

_ACT = schema.ActivationFunctionType
_OP = schema.BuiltinOperator

# The epilogue kernels: which TFLite ops run which fused activation (TFLite's schema lets every
# op below carry any of the three; this is the set the lowering emits, and Vela runs on the NPU).
FUSED_ACTIVATIONS: dict[int, frozenset[int]] = {
    _OP.CONV_2D: frozenset({_ACT.RELU, _ACT.RELU6, _ACT.RELU_N1_TO_1}),
    _OP.DEPTHWISE_CONV_2D: frozenset({_ACT.RELU, _ACT.RELU6, _ACT.RELU_N1_TO_1}),
    _OP.FULLY_CONNECTED: frozenset({_ACT.RELU, _ACT.RELU6, _ACT.RELU_N1_TO_1}),
    _OP.ADD: frozenset({_ACT.RELU, _ACT.RELU6, _ACT.RELU_N1_TO_1}),
    _OP.MUL: frozenset({_ACT.RELU, _ACT.RELU6, _ACT.RELU_N1_TO_1}),
}

# The ONNX ops the lowering writes, one function each (tflite_ops: compute, tflite_layout: layout).
LOWERINGS = {
    "Conv": tflite_ops.conv,
    "Gemm": tflite_ops.fully_connected,
    "MatMul": tflite_attention.matmul,  # a constant weight: FULLY_CONNECTED, else BATCH_MATMUL
    "Add": tflite_ops.binary,
    "Sub": tflite_ops.binary,
    "Mul": tflite_ops.binary,
    "Div": tflite_ops.binary,
    "Relu": tflite_ops.activation,
    "Clip": tflite_ops.activation,
    "Sigmoid": tflite_ops.unary,
    "Tanh": tflite_ops.unary,
    "HardSwish": tflite_ops.unary,
    "LeakyRelu": tflite_ops.unary,
    "Identity": tflite_ops.identity,
    "MaxPool": tflite_ops.pool,
    "AveragePool": tflite_ops.pool,
    "GlobalAveragePool": tflite_ops.pool,
    "GlobalMaxPool": tflite_ops.pool,
    "ReduceMean": tflite_ops.reduce_mean,
    "Reshape": tflite_layout.reshape,
    "Flatten": tflite_layout.reshape,
    "Squeeze": tflite_layout.reshape,
    "Unsqueeze": tflite_layout.reshape,
    "Transpose": tflite_layout.transpose,
    "Concat": tflite_layout.concat,
    "Pad": tflite_layout.pad,
    "Softmax": tflite_attention.softmax,  # over an axis NHWC does not keep last: in ONNX's order
    "Resize": tflite_layout.resize,
    "Split": tflite_layout.split,
    "Slice": tflite_layout.slice_,
    "HardSigmoid": tflite_ops.hard_sigmoid,
    "ConvTranspose": tflite_ops.transpose_conv,
    "BatchNormalization": tflite_ops.batch_norm,
    "LSTM": tflite_lstm.lstm,
    # a LayerNorm written out (tflite_norm): Pow(y, -0.5) as RSQRT
    "Pow": tflite_norm.rsqrt,
}


# ONNX ops TFLite cannot express as one op that this lowering does not write: why, and what to do meanwhile
NOT_WRITTEN = {
    "GRU": ("TFLite has no GRU op (its recurrent builtins are LSTMs and plain RNNs), so it would be a loop of "
            "FULLY_CONNECTED, LOGISTIC and TANH per step, which opfuse does not write. "
            "Meanwhile cut the model before the GRU (onnx.utils.extract_model) and run the GRU on the host CPU"),
}


def _walk(self: Lowering, float_islands: bool = False) -> bytes:
    """Every node lowered in order (an activation fused into its producer is skipped); with
    ``float_islands``, an op the QDQ model leaves float in float32 (:mod:`.tflite_islands`)."""
    graph = self.model.graph
    inputs = []
    for name in self.g.inputs:
        v = self.new_value(name)
        inputs.append(v.index)
    for node in self.g.nodes:
        if id(node) in self.absorbed:
            continue
        self.node = node
        lower = LOWERINGS.get(node.op_type)
        if lower is None:
            why = NOT_WRITTEN.get(node.op_type,
                                  f"{len(LOWERINGS)} ONNX ops are: opfuse.targets.ethos_u.lower.LOWERINGS")
            raise self.refuse(f"no TFLite lowering is written for {node.op_type} ({why})")
        if float_islands and tflite_islands.is_island(self, node):
            tflite_islands.lower_float(self, node, lower)
        else:
            lower(self, node)
    outputs = []
    for name, original in zip(self.g.outputs, (o.name for o in graph.output)):
        self.node = None
        if name not in self.values:
            raise LoweringError(None, f"graph output '{original}' is not computed by an op TFLite runs")
        outputs.append(self.values[name].index)
    return self.w.finish(inputs, outputs)


def lower_to_tflite(model: onnx.ModelProto, *, refusals: list | None = None,
                    fuse_activations: bool = True, float_islands: bool = False) -> bytes:
    """``model`` (float, or QDQ as ONNX Runtime writes it) as a TFLite flatbuffer in NHWC.

    Raises :class:`LoweringError` (one line: node, op type, reason) for an op it cannot lower.
    ``refusals``, when given, receives one ``{"node", "op", "reason"}`` record per activation
    left unfused. ``fuse_activations=False`` keeps every Relu/Clip its own op (to measure what
    fusing them pays). ``float_islands=True``: an op a QDQ model leaves float is written in float32
    between DEQUANTIZE and QUANTIZE (for the host CPU, :mod:`.tflite_islands`) instead of refused.
    The model is not modified."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return _walk(Lowering(copy, refusals, fuse_activations, FUSED_ACTIVATIONS), float_islands)
