"""One index over a QDQ model and the float model it was made from: every step reads it.

:class:`QdqLayers` indexes the pair once (initializers of both models, producers, readers,
the float model's nodes by name) and answers the questions the steps ask of a QDQ graph:

- :meth:`QdqLayers.layers`: every non-Q/DQ node that reads or writes a quantised tensor, with
  where its values live in both models (the per-layer SQNR table, the search's ranking);
- :meth:`QdqLayers.const` and :meth:`QdqLayers.dequantised`: a constant of the QDQ model, and
  what a weight's or bias's DequantizeLinear computes (bias correction);
- :meth:`QdqLayers.input_quantizer`: the QuantizeLinear feeding a layer's activation input
  (AdaRound and bias correction read its scale);
- :meth:`QdqLayers.removed_activations`: the Relu/Clip ONNX Runtime's quantiser folded into a
  layer's output range (the interpreter computes them again).

- :meth:`QdqLayers.quantisation`: a QuantizeLinear's or DequantizeLinear's scale, zero point and
  axis, the one place a Q/DQ pair's parameters are read.

AdaRound's weight sites (:func:`.adaround.weight_sites`, which the block reconstruction's
program reads too) and bias correction's sites are views built from it. Without a float model
(``QdqLayers(None, qdq)``) it reads a QDQ model alone (the Ethos-U lowering,
:func:`opfuse.targets.ethos_u.tflite_graph.read_qdq`): everything but :meth:`QdqLayers.layers`
and :meth:`QdqLayers.removed_activations`, which compare with the float model. :func:`exposed`
makes a copy of a model with intermediate tensors as outputs, for the steps that read them.
This module imports nothing else of :mod:`opfuse.quantization`.
"""

from __future__ import annotations

__all__ = ["QDQ_OPS", "REMOVABLE_ACTIVATIONS", "QdqLayer", "QdqLayers", "qdq_layers", "exposed"]

import dataclasses
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from opfuse.core.ops import ONNX_DOMAINS, proto_attr

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
REMOVABLE_ACTIVATIONS = ("Relu", "Clip")  # what ONNX Runtime's quantiser folds into the layer's output range


@dataclasses.dataclass
class QdqLayer:
    """A quantised node of the QDQ model and where its values live in both models."""

    name: str
    op_type: str
    inputs: list[tuple[str, str]]  # (float-model tensor, QDQ-model tensor) per activation input
    outputs: list[tuple[str, str]]  # (float-model tensor, QDQ-model tensor the next layer sees)


class QdqLayers:
    """A float model and the QDQ model made from it, indexed once (module docstring); with
    ``float_model`` None, the QDQ model alone."""

    def __init__(self, float_model: onnx.ModelProto | None, qdq: onnx.ModelProto):
        self.float_model, self.qdq = float_model, qdq
        self.inits = {i.name: i for i in qdq.graph.initializer}
        self.constant_nodes = {n.output[0]: n for n in qdq.graph.node if n.op_type == "Constant" and n.output}
        self.float_inits = {i.name: i for i in float_model.graph.initializer} if float_model is not None else {}
        self.producer = {o: n for n in qdq.graph.node for o in n.output}
        self.float_nodes = {n.name: n for n in float_model.graph.node if n.name} if float_model is not None else {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in qdq.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)

    def readers(self, name: str) -> int:
        """How many node inputs of the QDQ model read ``name``."""
        return len(self.consumers.get(name, ()))

    def const(self, name: str) -> np.ndarray | None:
        """The QDQ model's constant ``name`` (an initializer, or a Constant node's value) as an
        array (None: neither)."""
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        node = self.constant_nodes.get(name)
        return None if node is None else numpy_helper.to_array(proto_attr(node, "value"))

    def is_const(self, name: str) -> bool:
        return name in self.inits or name in self.constant_nodes

    def quantisation(self, node: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray, int] | None:
        """(scale as float64, zero point as stored, axis) of a QuantizeLinear or DequantizeLinear;
        a zero point left out reads as int8 zeros, the axis as 1; None where the scale is not a
        constant."""
        if len(node.input) < 2 or not self.is_const(node.input[1]):
            return None
        scale = self.const(node.input[1]).astype(np.float64)
        has_zero = len(node.input) > 2 and node.input[2]
        zero = self.const(node.input[2]) if has_zero else np.zeros_like(scale, np.int8)
        return scale, zero, proto_attr(node, "axis", 1)

    def dequantised(self, name: str) -> tuple[np.ndarray, onnx.NodeProto] | None:
        """(float64 values, the DequantizeLinear) of a constant's DequantizeLinear output ``name``,
        per-channel scales broadcast on their axis; None where ``name`` is no such output."""
        dq = self.producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear" or not self.is_const(dq.input[0]):
            return None
        q = self.const(dq.input[0]).astype(np.float64)
        scale, zero, axis = self.quantisation(dq)
        zero = zero.astype(np.float64)
        if scale.ndim == 1 and scale.size > 1:
            shape = [1] * q.ndim
            shape[axis] = -1
            scale, zero = scale.reshape(shape), zero.reshape(shape)
        return (q - zero) * scale, dq

    def input_quantizer(self, node: onnx.NodeProto) -> onnx.NodeProto | None:
        """The QuantizeLinear whose DequantizeLinear feeds ``node``'s first input (None: not quantised)."""
        dq_x = self.producer.get(node.input[0])
        q_x = self.producer.get(dq_x.input[0]) if dq_x is not None and dq_x.op_type == "DequantizeLinear" else None
        return q_x if q_x is not None and q_x.op_type == "QuantizeLinear" else None

    def removed_activations(self) -> dict[str, onnx.NodeProto]:
        """Tensor of the QDQ model -> the float model's Relu/Clip that ONNX Runtime's quantiser
        removed after the layer computing it. The layer's output takes the activation's name, or,
        when that is a graph output (which a DequantizeLinear then writes), a name of the
        quantiser's own; either way it is the output of the node named as the layer was."""
        return removed_activations(self.qdq, self._float())

    def layers(self, also: Iterable[str] = ()) -> list[QdqLayer]:
        """Every non-Q/DQ node of the QDQ model that reads or writes a quantised tensor (and the
        nodes named in ``also``, the layers kept out of int8), in graph order.

        A tensor is compared only where both models hold the same values: where the quantiser
        removed an activation, the conv's output carries the activation's name but not its
        values (the producers' op types differ), so only its DequantizeLinear output counts.
        """
        also = set(also)
        float_producer = {o: n.op_type for n in self._float().graph.node for o in n.output}
        float_values = _value_names(self.float_model)

        def same_values(name: str) -> bool:
            made = self.producer.get(name)
            return name in float_values and (made is None or float_producer.get(name, made.op_type) == made.op_type)

        layers = []
        for node in self.qdq.graph.node:
            if node.op_type in QDQ_OPS or node.domain not in ONNX_DOMAINS:
                continue
            ins, in_quantised = self._layer_inputs(node, float_values, same_values)
            outs, out_quantised = self._layer_outputs(node, float_values, same_values)
            if in_quantised or out_quantised or node.name in also:
                layers.append(QdqLayer(node.name, node.op_type, ins, outs))
        return layers

    def _float(self) -> onnx.ModelProto:
        if self.float_model is None:
            raise ValueError("this QDQ index has no float model to compare with")
        return self.float_model

    def _layer_inputs(self, node, float_values, same_values) -> tuple[list[tuple[str, str]], bool]:
        ins, quantised = [], False
        for name in node.input:
            if not name or name in self.inits:
                continue
            dq = self.producer.get(name)
            if dq is not None and dq.op_type == "DequantizeLinear":
                quantised = True
                if dq.input[0] in self.inits:
                    continue  # a weight or bias
                q = self.producer.get(dq.input[0])
                source = q.input[0] if q is not None and q.op_type == "QuantizeLinear" else None
                if source in float_values:
                    ins.append((source, name))
            elif same_values(name):
                ins.append((name, name))
        return ins, quantised

    def _layer_outputs(self, node, float_values, same_values) -> tuple[list[tuple[str, str]], bool]:
        outs, quantised = [], False
        for name in node.output:
            q = next((c for c in self.consumers.get(name, []) if c.op_type == "QuantizeLinear"), None)
            dq = next((c for c in self.consumers.get(q.output[0], []) if c.op_type == "DequantizeLinear"),
                      None) if q else None
            if dq is not None:
                quantised = True
                # a graph output keeps its name on the DequantizeLinear ("y_QuantizeLinear_Input" -> Q -> DQ -> "y")
                float_name = name if name in float_values else dq.output[0]
                if float_name in float_values:
                    outs.append((float_name, dq.output[0]))
            elif same_values(name):
                outs.append((name, name))
        return outs, quantised


def qdq_layers(float_model: onnx.ModelProto, qdq: onnx.ModelProto, also: Iterable[str] = ()) -> list[QdqLayer]:
    """:meth:`QdqLayers.layers` of a new index over the pair."""
    return QdqLayers(float_model, qdq).layers(also)


def removed_activations(model: onnx.ModelProto, float_model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    """:meth:`QdqLayers.removed_activations` for a model being built (no index yet)."""
    float_producer = {o: n for n in float_model.graph.node for o in n.output}
    present = {n.name for n in model.graph.node}
    layer_of = {float_producer[a.input[0]].name: a for a in float_model.graph.node
                if a.op_type in REMOVABLE_ACTIVATIONS and a.name not in present and a.input[0] in float_producer}
    return {n.output[0]: layer_of[n.name] for n in model.graph.node if n.name in layer_of and n.output}


def exposed(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` with the tensors ``names`` among its graph outputs."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    present = {o.name for o in out.graph.output}
    for name in dict.fromkeys(names):
        if name not in present:
            out.graph.output.append(helper.make_empty_tensor_value_info(name))
            present.add(name)
    return out


def _value_names(model: onnx.ModelProto) -> set[str]:
    names = {i.name for i in model.graph.input}
    for node in model.graph.node:
        names.update(o for o in node.output if o)
    return names
