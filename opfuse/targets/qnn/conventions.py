"""The HTP's quantisation conventions: how ONNX Runtime's quantiser is configured for it.

``quantize --preset qnn`` (any preset whose target is ``qnn``) asks the device for the keyword
arguments of ``quantize_static`` (:func:`quantizer_config`): ONNX Runtime's
``get_qnn_qdq_config`` with the preset's activation and weight types (:func:`qnn_types`), the
layers the mixed-precision search keeps with 16-bit activations as tensor overrides, and, with
per-channel weights, LayerNormalization's scale and bias kept per tensor (the HTP refuses a
per-channel DequantizeLinear there), and MatMul's and Gemm's weights per channel, as the preset
says: ``get_qnn_qdq_config`` gives them one scale per tensor ("QNN does not support per-channel
MatMul"), and a decoder's int8 weights at one scale per tensor lose most of its accuracy while the
HTP of onnxruntime-qnn 2.7.0 takes per-channel int8 MatMul weights whole. The layers the search keeps with
16-bit weights (the presets with 16-bit activations: keeping a layer's activations at 16 bits would keep
nothing there) get int16 symmetric weights, per channel with a per-channel preset: the HTP of
onnxruntime-qnn 2.7.0 takes them for MatMul, Gemm and Conv, whole (tests/test_qnn_int16_weights.py). The portable
configuration is in :class:`opfuse.quantization.qdq.quantizer.Quantizer`.

A decoder's masked scores (``Where(allowed, scores, -65504)``, :mod:`opfuse.passes.mask_fill`): calibrated
as they are, their range runs from -65504 to the scores' maximum, and a 16-bit step is then 1.0, a coarse
grid for attention scores of a few units (docs/results/measurements.md). So where such a Where is in the model the quantiser is configured from the calibrated
ranges (:func:`wants_ranges`), and where calibration applied the mask (the Where's calibrated minimum
reaches the fill) the Where's output gets the range of its scores, widened below by
:data:`MASKED_MARGIN` (a mask calibration never applied, BERT's all-ones in ``benchmarks/qnn.py``, keeps
its calibrated range, as before): the fill saturates at that minimum, whose ``exp(min - max) <= exp(-20)`` (2e-9) is
below the Softmax's 16-bit output step (1.5e-5), so a masked position still weighs nothing, and a fully
masked row is still constant (uniform).

Attention-23's KV cache outputs (``present_key``, ``present_value``): onnxruntime-qnn builds the op's
presents as tensors the application reads (``QNN_TENSOR_TYPE_APP_READ``, a graph output of the QNN
graph) whatever reads them in the ONNX graph. In a QDQ model they are read by a QuantizeLinear (then a
DequantizeLinear, then the graph output), so QNN's graph holds an output tensor ONNX Runtime never binds:
the model compiles, and its first run fails with ``QNN_GRAPH_ERROR_INVALID_TENSOR: Invalid or NULL QNN
tensor`` (a decode step with a cache; a prefill without one runs). The provider computes the op in float
inside (its Q, K, V and presents are float32 tensors of the QNN graph, dequantised at its inputs), so
:func:`float_attention_presents` lets the Attention write such a graph output itself, float, as the
float model does; the Q/DQ pair in between goes. A present that something else reads as well keeps its
pair (and the run's error says what failed).
"""

from __future__ import annotations

__all__ = ["quantizer_config", "qnn_types", "wants_ranges", "float_attention_presents", "MASKED_MARGIN"]

import pathlib

import numpy as np
import onnx
from onnxruntime import quantization as ortq

from opfuse.core.ops import ONNX_DOMAINS

ACTIVATION_TYPES = {"uint8": ortq.QuantType.QUInt8, "uint16": ortq.QuantType.QUInt16}  # Preset.activation
WEIGHT_TYPES = {"int8": ortq.QuantType.QInt8, "uint8": ortq.QuantType.QUInt8,  # Preset.weight
                "int4": ortq.QuantType.QInt8}  # (int4: the MatMul/Gemm weights, by override; the rest int8)


MASKED_MARGIN = 20.0  # below the scores' minimum, where a masked score saturates (module docstring)
FILL = -65504.0  # opfuse.passes.mask_fill.FILL (float16's minimum: the passes load after the targets)


def _masked_wheres(float_model: onnx.ModelProto) -> dict[str, str]:
    """{Where output: its scores input} of each mask-fill Where (a branch the one-element -65504 constant)."""
    fills = {i.name for i in float_model.graph.initializer
             if onnx.numpy_helper.to_array(i).size == 1 and float(onnx.numpy_helper.to_array(i).reshape(-1)[0]) == FILL}
    out = {}
    for n in float_model.graph.node:
        if n.op_type == "Where" and len(n.input) == 3:
            if n.input[1] in fills and n.input[2] not in fills:
                out[n.output[0]] = n.input[2]
            elif n.input[2] in fills and n.input[1] not in fills:
                out[n.output[0]] = n.input[1]
    return out


def wants_ranges(float_model: onnx.ModelProto) -> bool:
    """Whether :func:`quantizer_config` reads the calibrated ranges: for a model with masked scores."""
    return bool(_masked_wheres(float_model))


def qnn_types(preset) -> dict:
    """``get_qnn_qdq_config``'s type arguments for a QNN ``preset``: its activation and weight
    types, and per-channel weights symmetric (QNN's int8 per-channel form)."""
    return dict(activation_type=ACTIVATION_TYPES[preset.activation], weight_type=WEIGHT_TYPES[preset.weight],
                per_channel=preset.per_channel, weight_symmetric=True if preset.per_channel else None)


def quantizer_config(float_path: pathlib.Path, float_model: onnx.ModelProto, preset, *, reader, sample_reader,
                     method, extra: dict, sixteen: list[str], excluded: list[str], ranges=None,
                     sixteen_weights: dict[str, int] | None = None) -> dict:
    """``quantize_static``'s keyword arguments for the HTP: ``reader`` the calibration reader
    (None: the ranges are cached), ``sample_reader`` a fresh one for ``get_qnn_qdq_config``,
    ``method`` and ``extra`` the calibration method and its options, ``sixteen`` the tensors
    kept with 16-bit activations, ``excluded`` the nodes kept in float; ``ranges`` the calibrated ranges
    (ONNX Runtime's ``TensorsData``), read for the masked scores (module docstring); ``sixteen_weights``
    {weight: its output-channel axis} the weights kept in int16 (symmetric, per channel with a per-channel
    preset; the HTP of onnxruntime-qnn 2.7.0 takes int16 MatMul, Gemm and Conv weights whole, probed), whatever
    the preset writes the others in."""
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config  # (its QNN helpers: on use)

    overrides = {t: [{"quant_type": ortq.QuantType.QUInt16}] for t in sixteen}
    overrides.update({w: [{"quant_type": ortq.QuantType.QInt16, "symmetric": True,
                           **({"axis": axis} if preset.per_channel else {})}]
                      for w, axis in (sixteen_weights or {}).items()})
    if preset.per_channel:  # QNN takes LayerNormalization's scale and bias per tensor only
        overrides.update({name: [{"quant_type": WEIGHT_TYPES[preset.weight], "symmetric": True}]
                          for name in _layernorm_constants(float_model) if name not in overrides})
    for out, scores in _masked_wheres(float_model).items() if ranges is not None else ():
        masked = out in ranges.data and float(np.asarray(ranges.data[out].range_value[0]).reshape(-1)[0]) <= FILL / 2
        if masked and scores in ranges.data:  # (a mask never applied in calibration keeps its range)
            low, high = (float(np.asarray(v).reshape(-1)[0]) for v in ranges.data[scores].range_value)
            entry = overrides.setdefault(out, [{}])[0]
            entry.update(rmin=np.float32(min(low, 0.0) - MASKED_MARGIN), rmax=np.float32(max(high, 0.0)))
    if preset.per_channel:  # each MatMul/Gemm weight one scale per output channel (get_qnn_qdq_config: per tensor);
        # w4a16 writes them in int4, the other per-channel presets in their weight type
        kind = ortq.QuantType.QInt4 if preset.weight == "int4" else WEIGHT_TYPES[preset.weight]
        overrides.update({name: [{"quant_type": kind, "symmetric": True, "axis": axis}]
                          for name, axis in _matmul_weights(float_model).items() if name not in overrides})
    config = get_qnn_qdq_config(str(float_path), reader or sample_reader, calibrate_method=method,
                                init_overrides=overrides or None, **qnn_types(preset))
    return dict(
        calibration_data_reader=reader, quant_format=config.quant_format,
        activation_type=config.activation_type, weight_type=config.weight_type,
        op_types_to_quantize=config.op_types_to_quantize,
        nodes_to_exclude=[*(config.nodes_to_exclude or []), *excluded],
        per_channel=config.per_channel, calibrate_method=config.calibrate_method,
        extra_options={**config.extra_options, **extra},
    )


def _matmul_weights(float_model: onnx.ModelProto) -> dict[str, int]:
    """{weight: its output-channel axis} of the MatMul (a [K, N] initializer as input 1: axis 1) and Gemm
    (axis 0 with transB, else 1) weights: what ``qnn-w4a16`` writes in int4, and the per-channel presets in int8
    per channel. get_qnn_qdq_config would give a
    MatMul's weight a per-tensor override ("QNN does not support per-channel MatMul"); the HTP of
    onnxruntime-qnn 2.7.0 takes per-channel int4 and int8 MatMul weights whole at opset 21 (probed)."""
    inits = {i.name: len(i.dims) for i in float_model.graph.initializer}
    out: dict[str, int] = {}
    for n in float_model.graph.node:
        if n.op_type == "MatMul" and len(n.input) > 1 and inits.get(n.input[1]) == 2:
            out[n.input[1]] = 1
        elif n.op_type == "Gemm" and len(n.input) > 1 and inits.get(n.input[1]) == 2:
            trans_b = next((a.i for a in n.attribute if a.name == "transB"), 0)
            out[n.input[1]] = 0 if trans_b else 1
    return out


def _layernorm_constants(float_model: onnx.ModelProto) -> list[str]:
    """LayerNormalization's scale and bias initializers: with ``per_channel``, ONNX Runtime's
    quantiser gives them per-channel scales, whose DequantizeLinear QNN's HTP refuses ("Failed
    to add node"; ViT and BERT then split into 5 partitions). ``get_qnn_qdq_config`` gives
    MatMul's weights per-tensor overrides for the same reason, not LayerNormalization's."""
    inits = {i.name for i in float_model.graph.initializer}
    return sorted({name for n in float_model.graph.node if n.op_type == "LayerNormalization"
                   for name in n.input[1:3] if name in inits})


def float_attention_presents(qdq: onnx.ModelProto) -> list[str]:
    """Each Attention's present output that reaches a graph output through a QuantizeLinear and a
    DequantizeLinear alone becomes that graph output, written in float by the Attention (module
    docstring); the pair goes (in place). A note when any did."""
    graph = qdq.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    moved, constants = [], set()
    for node in list(graph.node):
        if node.op_type != "Attention" or node.domain not in ONNX_DOMAINS:
            continue
        for index in (1, 2):  # present_key, present_value
            if index >= len(node.output) or not node.output[index] or node.output[index] in outputs:
                continue
            (q, *others) = readers.get(node.output[index], [None])
            if others or q is None or q.op_type != "QuantizeLinear":
                continue
            (dq, *others) = readers.get(q.output[0], [None])
            if others or dq is None or dq.op_type != "DequantizeLinear" or dq.output[0] not in outputs \
                    or readers.get(dq.output[0]):
                continue
            node.output[index] = dq.output[0]
            graph.node.remove(q)
            graph.node.remove(dq)
            moved.append(dq.output[0])
            constants.update(q.input[1:], dq.input[1:])
    if not moved:
        return []
    read = _read_anywhere(graph) | outputs
    kept = [i for i in graph.initializer if i.name not in constants or i.name in read]  # (the pairs' scales)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return [f"Attention's KV cache outputs ({', '.join(moved[:4])}{', ...' if len(moved) > 4 else ''}; "
            f"{len(moved)} in all) are written in float, without QuantizeLinear/DequantizeLinear: QNN's HTP "
            "builds an Attention's presents as graph outputs, and a quantised pair after them leaves an output "
            "it never binds (QNN_GRAPH_ERROR_INVALID_TENSOR at the first run); it computes the op in float inside"]


def _read_anywhere(graph: onnx.GraphProto) -> set[str]:
    """The names the nodes of ``graph`` and of every graph nested in them read."""
    read = set()
    for node in graph.node:
        read.update(node.input)
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                read |= _read_anywhere(sub)
    return read
