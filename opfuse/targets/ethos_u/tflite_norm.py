"""A normalisation written out (LayerNorm decomposed) as TFLite's int8 kernels run it on the Ethos-U.

A decomposed LayerNorm (PaddleOCR's SVTR, exporters before opset 17) is
``d = x - ReduceMean(x)``, ``v = ReduceMean(Pow(d, 2))``, ``y = d / Sqrt(v + eps) * gamma + beta``.
TFLite's int8 kernels (and Vela 5.2 on the NPU) have MEAN, SUB, MUL, ADD and RSQRT (int8 input),
but no int8 SQRT, POW or division by a tensor. Before quantisation (:func:`rsqrt_form`) the float
model is rewritten into ops each of which is one int8 TFLite kernel:

0. ``LayerNormalization`` (opset 17) -> the written-out form above, already in the form of 1. and 2.
   (mean and variance over the axes from ``axis`` to the last; the node's optional Mean and
   InvStdDev outputs must be unused, and its input's rank known);
1. ``Pow(x, 2)`` -> ``Mul(x, x)`` (exact: both are one correctly rounded float32 product);
2. ``Div(a, Sqrt(y))`` -> ``Mul(a, Pow(y, -0.5))``, the Pow lowered as RSQRT (:func:`rsqrt`).
   Equal in exact arithmetic; in float32 ``a * (1/sqrt(y))`` rounds twice where ``a / sqrt(y)``
   rounds once (at most a few units in the last place apart).

Legality: the exponent must be the constant 2 (1.) or the Sqrt's output read by Divs only, as
their divisor, and not a graph output (2.); any other Pow, Sqrt or Div is left as it was.
:data:`QUANTISED_OPS` are the op types ONNX Runtime's static quantiser must then be told to
quantise: its default list (its QLinear and QDQ registries) has no ReduceMean, Sub or Pow, and an
op outside the list keeps float inputs and outputs, which the int8 lowering refuses. Listed, an op
with no registry entry is quantised by its generic ``QDQOperatorBase`` (every float input and output
through a Q/DQ pair; a constant input, such as the exponent -0.5, becomes an int8 weight that
:func:`rsqrt` reads back as about -0.5).
"""

from __future__ import annotations

__all__ = ["QUANTISED_OPS", "rsqrt_form", "rsqrt"]

import numpy as np
import onnx
from onnx import helper, numpy_helper

from opfuse.core.ops import ONNX_DOMAINS, proto_attr
from opfuse.targets.ethos_u.tflite_graph import Lowering
from opfuse.targets.ethos_u.tflite_ops import OP

# op types the quantiser is told to quantise beyond its default registries (module docstring)
QUANTISED_OPS = ("ReduceMean", "Sub", "Pow")


def _constant_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    values = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            values[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return values


def _written_out(node: onnx.NodeProto, opset: int, rank: int, graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """A LayerNormalization node (rule 0) as the ops of the written-out form, already in rules 1 and 2."""
    axis, eps = proto_attr(node, "axis", -1), proto_attr(node, "epsilon", 1e-5)
    axes = list(range((axis + rank) % rank, rank))
    p = f"{node.name or node.output[0]}/"
    graph.initializer.extend([numpy_helper.from_array(np.array(eps, np.float32), p + "eps"),
                              numpy_helper.from_array(np.array(-0.5, np.float32), p + "minus_half")])
    if opset >= 18:  # ReduceMean's axes became an input in opset 18
        graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), p + "axes"))

    def mean(x: str, y: str, name: str) -> onnx.NodeProto:
        if opset >= 18:
            return helper.make_node("ReduceMean", [x, p + "axes"], [y], name=p + name)
        return helper.make_node("ReduceMean", [x], [y], name=p + name, axes=axes)

    x, scale = node.input[0], node.input[1]
    nodes = [mean(x, p + "mean", "mean"),
             helper.make_node("Sub", [x, p + "mean"], [p + "centred"], name=p + "centre"),
             helper.make_node("Mul", [p + "centred", p + "centred"], [p + "squared"], name=p + "square"),
             mean(p + "squared", p + "variance", "variance"),
             helper.make_node("Add", [p + "variance", p + "eps"], [p + "variance_eps"], name=p + "add_eps"),
             helper.make_node("Pow", [p + "variance_eps", p + "minus_half"], [p + "rsqrt"], name=p + "rsqrt"),
             helper.make_node("Mul", [p + "centred", p + "rsqrt"], [p + "normalised"], name=p + "normalise")]
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    nodes.append(helper.make_node("Mul", [p + "normalised", scale], [p + "scaled" if bias else node.output[0]],
                                  name=p + "scale"))
    if bias:
        nodes.append(helper.make_node("Add", [p + "scaled", bias], [node.output[0]], name=p + "shift"))
    return nodes


def rsqrt_form(model: onnx.ModelProto) -> list[str]:
    """Rewrites ``model`` in place (module docstring, rules 0 to 2); returns notes for the report."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ONNX_DOMAINS), 17)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in [*graph.input, *graph.value_info, *graph.output]
             if v.type.tensor_type.HasField("shape")}
    if any(n.op_type == "LayerNormalization" and n.input[0] not in ranks for n in graph.node):
        inferred = onnx.shape_inference.infer_shapes(model).graph
        ranks.update({v.name: len(v.type.tensor_type.shape.dim) for v in inferred.value_info
                      if v.type.tensor_type.HasField("shape")})
    layer_norms = []
    written: list[onnx.NodeProto] = []
    for node in graph.node:
        if (node.op_type == "LayerNormalization" and node.domain in ONNX_DOMAINS and node.input[0] in ranks
                and not any(node.output[1:])):  # its Mean and InvStdDev outputs unused
            written.extend(_written_out(node, opset, ranks[node.input[0]], graph))
            layer_norms.append(node.name or node.output[0])
        else:
            written.append(node)
    if layer_norms:
        del graph.node[:]
        graph.node.extend(written)
    constants = _constant_values(model)
    outputs = {o.name for o in graph.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)
    squares = rsqrts = 0
    for i, node in enumerate(list(graph.node)):
        if node.op_type == "Pow" and node.domain in ONNX_DOMAINS and len(node.input) == 2:
            e = constants.get(node.input[1])
            if e is not None and e.size == 1 and float(e.reshape(())) == 2.0:
                node.op_type = "Mul"
                node.input[1] = node.input[0]
                squares += 1
        elif node.op_type == "Sqrt" and node.domain in ONNX_DOMAINS and node.output[0] not in outputs:
            users = consumers.get(node.output[0], [])
            if not users or any(u.op_type != "Div" or list(u.input).count(node.output[0]) != 1
                                or u.input[1] != node.output[0] for u in users):
                continue
            exponent = f"{node.output[0]}/minus_half"
            graph.initializer.append(numpy_helper.from_array(np.array(-0.5, np.float32), exponent))
            node.op_type = "Pow"
            node.input.append(exponent)
            for u in users:
                u.op_type = "Mul"
            rsqrts += 1
    notes = []
    if layer_norms:
        notes.append(f"{len(layer_norms)} LayerNormalization written out (ReduceMean, Sub, Mul, ReduceMean, Add, "
                     "Pow(-0.5), Mul, Mul, Add): TFLite has no int8 layer normalisation")
    if squares:
        notes.append(f"{squares} Pow(x, 2) written as Mul(x, x): TFLite's int8 kernels have no POW")
    if rsqrts:
        notes.append(f"{rsqrts} Div(a, Sqrt(y)) written as Mul(a, Pow(y, -0.5)), lowered as TFLite's int8 RSQRT: "
                     "TFLite has no int8 SQRT or division by a tensor")
    return notes


def rsqrt(L: Lowering, node) -> None:
    """``Pow(y, e)`` with the constant ``e = -0.5`` (rule 2, or written so) -> RSQRT; any other Pow
    is refused. int8: the exponent may come back from the quantiser as an int8 weight, so it is
    read to within 1e-3 of -0.5 (int8 symmetric: -127 steps of 0.5/127)."""
    if not L.is_constant(node.input[1]):
        raise L.refuse("a Pow with a computed exponent (TFLite has no POW kernel Vela runs)")
    e = L.constant(node.input[1]).astype(np.float64)
    if e.size != 1 or abs(float(e.reshape(())) + 0.5) > 1e-3:
        raise L.refuse(f"a Pow with exponent {e.reshape(-1)[:4].tolist()} (only -0.5 is lowered, as RSQRT; "
                       "x ** 2 is written Mul(x, x) before quantisation)")
    x = L.value(node.input[0])
    out = L.new_value(node.output[0])
    L.w.op(OP.RSQRT, [x.index], [out.index])
