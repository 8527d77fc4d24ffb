"""Empirical bias correction: remove each layer's mean quantisation error, per output channel.

Rounding weights and inputs to 8 bits shifts a layer's output on average, not only
scatters it (Nagel et al., ICCV 2019, section 4.2). For a Conv or Gemm with float weight
W, bias b and input x, and its quantised form (Wq, bq, xq = DQ(Q(x)) with the input's
scale and zero point), the mean error of output channel o over the calibration data is

    e[o] = mean over samples and positions of ( op(xq; Wq, bq) - op(x; W, b) )[o]
         = mean over positions of ( op(E[xq]; Wq, bq) - op(E[x]; W, b) )[o]

The second line holds because Conv and Gemm are linear in their input: only the
per-position means E[x] and E[xq] over the calibration samples are needed, which one
pass of the float model collects (x is the float model's tensor, so each layer's error
is its own, not the sum of the errors upstream, and all layers can be corrected at once).
The correction subtracts e from the quantised bias: ``bq_int -= round(e / bias_scale)``.

Each layer's error is measured alone, against the float model's input; upstream errors and
the activations the quantiser folds into a conv's output range make the shift the
network really sees differ, and on PP-OCRv4 rec some single corrections lower the output
SQNR as much as others raise it (docs/results/measurements.md). So :func:`select_corrections`
keeps a layer's correction only if it raises the output SQNR on the calibration samples,
layer by layer in graph order (greedy, each one measured with those kept before it).

Legality: the layer's input is per-tensor quantised, its weight and bias are constant
DequantizeLinear inputs (ONNX Runtime quantises a bias as int32 with scale x_scale *
w_scale), and every calibration sample has the same shape (the means are per position).
A layer without a bias, a MatMul (no bias input) or one whose samples differ in shape is
left as it is, with the reason in the report. The pipeline keeps only the
corrections that raise the output SQNR on the calibration samples.
"""

from __future__ import annotations

__all__ = ["BiasCorrection", "compute_corrections", "apply_corrections", "select_corrections"]

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from opfuse.quantization.qdq.layers import QdqLayers, exposed
from opfuse.runtime import create_session

CORRECTABLE = ("Conv", "Gemm")


@dataclasses.dataclass
class BiasCorrection:
    layers: dict[str, np.ndarray]  # node name -> error per output channel (float)
    skipped: dict[str, str]  # node name -> why it was not corrected


@dataclasses.dataclass
class _Site:
    node: onnx.NodeProto  # the QDQ model's node
    float_node: onnx.NodeProto
    x: str  # the float model's input tensor
    x_scale: float
    x_zero: int
    x_dtype: np.dtype
    weight: np.ndarray  # dequantised
    bias: np.ndarray  # dequantised
    bias_int: str  # the int32 initializer
    bias_scale: np.ndarray
    float_weight: np.ndarray
    float_bias: np.ndarray


def _sites(layers: QdqLayers, skipped: dict[str, str]) -> list[_Site]:
    const, inits, float_inits = layers.const, layers.inits, layers.float_inits
    sites = []
    for node in layers.qdq.graph.node:
        if node.op_type not in CORRECTABLE:
            continue
        float_node = layers.float_nodes.get(node.name)
        if float_node is None or float_node.input[0] in float_inits:
            continue
        if len(node.input) < 3 or not node.input[2]:
            skipped[node.name] = "no bias to correct"
            continue
        q_x = layers.input_quantizer(node)
        w, b = layers.dequantised(node.input[1]), layers.dequantised(node.input[2])
        if q_x is None or w is None or b is None:
            skipped[node.name] = "its input, weight or bias is not quantised"
            continue
        x_scale, x_zero = const(q_x.input[1]), const(q_x.input[2]) if len(q_x.input) > 2 else None
        if x_scale is None or x_scale.size != 1:
            skipped[node.name] = "its input is not quantised per tensor"
            continue
        b_dq = b[1]
        bias_scale = const(b_dq.input[1])
        if inits[b_dq.input[0]].data_type != TensorProto.INT32 or bias_scale is None:
            skipped[node.name] = "its bias is not an int32 DequantizeLinear"
            continue
        f_w = float_inits.get(float_node.input[1])
        f_b = float_inits.get(float_node.input[2]) if len(float_node.input) > 2 else None
        if f_w is None or f_b is None:
            skipped[node.name] = "its float weight or bias is not an initializer"
            continue
        zero = np.zeros((), np.uint8) if x_zero is None else x_zero
        sites.append(_Site(node, float_node, float_node.input[0], float(x_scale.reshape(())),
                           int(zero.reshape(())), zero.dtype, w[0], b[0].reshape(-1), b_dq.input[0],
                           bias_scale.astype(np.float64).reshape(-1),
                           numpy_helper.to_array(f_w), numpy_helper.to_array(f_b)))
    return sites


def _fake_quant(x: np.ndarray, scale: float, zero: int, dtype: np.dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    q = np.clip(np.rint(x / scale) + zero, info.min, info.max)  # rint: half to even, as ONNX
    return ((q - zero) * scale).astype(np.float32)


def compute_corrections(float_model: onnx.ModelProto, qdq: onnx.ModelProto, samples) -> BiasCorrection:
    """Per-channel mean errors of every correctable layer, from the calibration samples."""
    skipped: dict[str, str] = {}
    sites = _sites(QdqLayers(float_model, qdq), skipped)
    if not sites:
        return BiasCorrection({}, skipped)
    names = sorted({s.x for s in sites})
    session = create_session(exposed(float_model, names), "disabled")
    mean_x: dict[str, np.ndarray] = {}
    mean_xq: dict[str, np.ndarray] = {}
    count = 0
    for sample in samples:
        values = dict(zip(names, session.run(names, dict(sample))))
        for site in sites:
            x = values[site.x].astype(np.float64)
            xq = _fake_quant(values[site.x], site.x_scale, site.x_zero, site.x_dtype).astype(np.float64)
            key = site.node.name
            if key in mean_x and mean_x[key].shape != x.shape:
                skipped[key] = "its input's shape differs between calibration samples"
                continue
            mean_x[key] = mean_x.get(key, 0.0) + x
            mean_xq[key] = mean_xq.get(key, 0.0) + xq
        count += 1
    sites = [s for s in sites if s.node.name not in skipped]
    errors = _probe(sites, {k: v / count for k, v in mean_x.items()}, {k: v / count for k, v in mean_xq.items()})
    return BiasCorrection(errors, skipped)


def _probe(sites: list[_Site], mean_x, mean_xq) -> dict[str, np.ndarray]:
    """Run every layer on the mean inputs, float and quantised, in one small model;
    returns the mean error per output channel (axis 1 of a Conv's or a Gemm's output)."""
    nodes, inputs, inits, feeds = [], [], [], {}
    for i, site in enumerate(sites):
        attrs = {a.name: helper.get_attribute_value(a) for a in site.float_node.attribute}
        feeds[f"fx{i}"] = mean_x[site.node.name].astype(np.float32)
        feeds[f"qx{i}"] = mean_xq[site.node.name].astype(np.float32)
        for name in (f"fx{i}", f"qx{i}"):
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, feeds[name].shape))
        for name, array in ((f"fw{i}", site.float_weight), (f"fb{i}", site.float_bias),
                            (f"qw{i}", site.weight), (f"qb{i}", site.bias)):
            inits.append(numpy_helper.from_array(array.astype(np.float32), name))
        nodes += [helper.make_node(site.node.op_type, [f"fx{i}", f"fw{i}", f"fb{i}"], [f"fy{i}"], **attrs),
                  helper.make_node(site.node.op_type, [f"qx{i}", f"qw{i}", f"qb{i}"], [f"qy{i}"], **attrs),
                  helper.make_node("Sub", [f"qy{i}", f"fy{i}"], [f"e{i}"])]
    outputs = [helper.make_empty_tensor_value_info(f"e{i}") for i in range(len(sites))]
    graph = helper.make_graph(nodes, "bias_probe", inputs, outputs, inits)
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    probe.ir_version = 8
    session = create_session(probe, "disabled")
    names = [f"e{i}" for i in range(len(sites))]
    errors = {}
    for site, e in zip(sites, session.run(names, feeds)):
        axes = tuple(a for a in range(e.ndim) if a != 1)
        errors[site.node.name] = e.astype(np.float64).mean(axis=axes)
    return errors


def apply_corrections(qdq: onnx.ModelProto, correction: BiasCorrection) -> int:
    """Subtract each layer's mean error from its int32 bias (in place); returns how many
    layers changed. Layers no longer quantised (kept in float) are left alone."""
    inits = {i.name: i for i in qdq.graph.initializer}
    producer = {o: n for n in qdq.graph.node for o in n.output}
    changed = 0
    for node in qdq.graph.node:
        error = correction.layers.get(node.name)
        if error is None or node.op_type not in CORRECTABLE or len(node.input) < 3:
            continue
        dq = producer.get(node.input[2])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits or dq.input[1] not in inits:
            continue
        tensor = inits[dq.input[0]]
        if tensor.data_type != TensorProto.INT32:
            continue
        values = numpy_helper.to_array(tensor).astype(np.int64)
        scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float64).reshape(-1)
        shift = np.rint(error / scale).astype(np.int64)
        info = np.iinfo(np.int32)
        new = np.clip(values.reshape(-1) - shift, info.min, info.max).astype(np.int32).reshape(values.shape)
        tensor.CopyFrom(numpy_helper.from_array(new, tensor.name))
        changed += 1
    return changed


def select_corrections(qdq: onnx.ModelProto, correction: BiasCorrection, score) -> tuple[onnx.ModelProto, BiasCorrection]:
    """(a copy of ``qdq`` with the helpful corrections applied, those corrections): each
    layer's, in graph order, kept when ``score(model)`` (higher is better) rises."""
    current = onnx.ModelProto()
    current.CopyFrom(qdq)
    best = score(current)
    kept: dict[str, np.ndarray] = {}
    skipped = dict(correction.skipped)
    for name, error in correction.layers.items():
        trial = onnx.ModelProto()
        trial.CopyFrom(current)
        apply_corrections(trial, BiasCorrection({name: error}, {}))
        value = score(trial)
        if value > best:
            current, best, kept[name] = trial, value, error
        else:
            skipped[name] = "its correction did not raise the output SQNR on the calibration samples"
    return current, BiasCorrection(kept, skipped)
