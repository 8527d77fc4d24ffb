"""Reading a quantised (QDQ) graph as an accelerator that runs int8 natively would run it.

A QDQ model (``opfuse quantize``, ONNX Runtime's ``quantize_static``) is a float graph with
QuantizeLinear (Q) and DequantizeLinear (DQ) nodes saying which tensors are int8. Counted
as written (:func:`opfuse.cost.traffic.analyse_traffic`), every DQ writes a float
tensor and every Q reads one; an int8 accelerator does neither. :func:`int8_traffic`
rewrites the node list the way such a chip runs the graph:

1. **A DQ of an initializer** is a weight in its stored dtype: an int8 weight (1 byte an
   element), an int32 bias (4). No kernel.
2. **An int8 kernel** is an op of :data:`INT8_OPS` whose every float input comes from a DQ
   (or is the int8 output of another int8 kernel): a Conv whose inputs come from DQ
   nodes and whose output goes to a Q is one kernel, reading the quantised activation
   (1 byte an element) and weights, and writing the Q's output (requantisation is its
   epilogue). A data-movement op (:data:`INT8_MOVEMENT_OPS`: pooling by max, Flatten,
   Reshape, ...) with no Q after it writes int8 too (same scale); a compute op with no Q
   after it (the logits) writes float. It computes at the profile's int8 peak.
3. **Every other op runs in float**, as in the float graph: its DQ'd weights are
   dequantised when the model is compiled (read as float), and its activations are
   converted by kernels that stay: a DQ feeding it reads int8 and writes float, a Q after
   it reads float and writes int8. A BatchNormalization left unfolded between a conv's Q
   and the next DQ therefore costs three kernels (DQ, BN, Q) and a float round trip.
4. The Q/DQ nodes folded away in 1 and 2 launch nothing and move nothing. Their scales
   and zero points (a few bytes per channel) are not counted.

The float ops an int8 chip would run are :func:`float_ops`. A graph without Q/DQ nodes
comes back unchanged. Layers and the ideal bound of the result follow the traffic rule
(:func:`~opfuse.cost.traffic.with_layers`), at 1 byte an int8 element.
"""

from __future__ import annotations

__all__ = ["INT8_OPS", "INT8_MOVEMENT_OPS", "is_qdq", "int8_traffic", "float_ops"]

import dataclasses
from collections import Counter

from opfuse.cost.traffic import Kernel, TensorInfo, Traffic, with_layers
from opfuse.core.ops import FLOAT_DTYPES, MS_DOMAIN, ONNX_DOMAINS, OPS

# From the op table's ``int8`` column. "move": the output keeps its input's int8 form and
# scale (the op moves or selects values). "compute": an int8 accelerator runs it as an int8
# kernel: ONNX Runtime's own int8 set (QLinearConv, QGemm / MatMulInteger, QLinearAdd,
# QLinearMul, QLinearAveragePool, QLinearGlobalAveragePool, QLinearSigmoid,
# QLinearLeakyRelu, QLinearSoftmax) and the activations a requantisation clamps (Relu,
# Clip). Not BatchNormalization: no int8 kernel runs it; folded into the conv, it is gone.
INT8_MOVEMENT_OPS = frozenset(op for op, info in OPS.items() if info.int8 == "move")
INT8_OPS = frozenset(op for op, info in OPS.items() if info.int8)
QUANTIZE, DEQUANTIZE = "QuantizeLinear", "DequantizeLinear"
_QDQ_DOMAINS = (*ONNX_DOMAINS, MS_DOMAIN)  # ONNX Runtime also writes them in its own domain


def _is(node: Kernel, op: str) -> bool:
    return node.op_type == op and node.domain in _QDQ_DOMAINS


def _float(t: TensorInfo | None) -> bool:
    return t is not None and t.dtype in FLOAT_DTYPES


def is_qdq(traffic: Traffic) -> bool:
    """Whether the graph has QuantizeLinear / DequantizeLinear nodes."""
    return any(_is(n, QUANTIZE) or _is(n, DEQUANTIZE) for n in traffic.nodes)


def int8_traffic(traffic: Traffic) -> Traffic:
    """The node list of a QDQ graph as an int8 accelerator runs it (the module docstring)."""
    if not is_qdq(traffic):
        return traffic
    nodes = traffic.nodes
    producer = {t.name: n for n in nodes for t in n.outputs}
    consumers: dict[str, list[Kernel]] = {}
    for n in nodes:
        for t in n.inputs:
            if t is not None:
                consumers.setdefault(t.name, []).append(n)
    graph_outputs = set(traffic.graph_outputs)
    stored: dict[str, TensorInfo] = {}  # a DQ'd weight -> the initializer as stored (int8, int32)
    int8_form: dict[str, TensorInfo] = {}  # a float activation -> the int8 tensor that holds it
    int8_kernels: set[int] = set()

    def quantizer_of(t: TensorInfo) -> Kernel | None:
        return next((c for c in consumers.get(t.name, ()) if _is(c, QUANTIZE)), None)

    for n in nodes:  # graph order: producers first
        if _is(n, DEQUANTIZE):
            if n.inputs and n.inputs[0] is not None and n.outputs:
                (stored if n.inputs[0].is_weight else int8_form)[n.outputs[0].name] = n.inputs[0]
            continue
        if _is(n, QUANTIZE) or n.op_type not in INT8_OPS or n.domain not in ONNX_DOMAINS:
            continue
        floats = [t for t in n.inputs if _float(t)]
        if not floats or not all(t.name in int8_form or t.name in stored for t in floats):
            continue
        int8_kernels.add(id(n))
        source = next((int8_form[t.name] for t in floats if t.name in int8_form), None)
        for out in n.outputs:
            q = quantizer_of(out) if _float(out) else None
            if q is not None and q.outputs:
                int8_form[out.name] = q.outputs[0]
            elif (_float(out) and n.op_type in INT8_MOVEMENT_OPS and source is not None
                  and out.name not in graph_outputs):
                int8_form[out.name] = dataclasses.replace(out, dtype=source.dtype, bits=source.bits)

    def float_consumer(t: TensorInfo) -> bool:
        if t.name in graph_outputs:
            return True
        return any(id(c) not in int8_kernels for c in consumers.get(t.name, ()))

    out_nodes: list[Kernel] = []
    for n in nodes:
        if _is(n, DEQUANTIZE):
            src = n.inputs[0] if n.inputs else None
            if src is None or src.is_weight or not any(float_consumer(t) for t in n.outputs):
                continue  # a weight, or read in int8 by int8 kernels: folded away
            out_nodes.append(n)  # converts for a float op: a kernel
        elif _is(n, QUANTIZE):
            src = n.inputs[0] if n.inputs else None
            made_by = producer.get(src.name) if src is not None else None
            if made_by is not None and id(made_by) in int8_kernels:
                continue  # the requantisation in its producer's epilogue
            out_nodes.append(n)  # converts a float op's output (or a graph input): a kernel
        elif id(n) in int8_kernels:
            inputs = tuple(None if t is None else int8_form.get(t.name) or stored.get(t.name) or t
                           for t in n.inputs)
            outputs: list[TensorInfo] = []
            for out in n.outputs:
                q = quantizer_of(out) if _float(out) else None
                if q is not None and q.outputs:
                    outputs.append(q.outputs[0])
                    if out.name in graph_outputs or any(not _is(c, QUANTIZE) for c in consumers.get(out.name, ())):
                        outputs.append(out)  # something also reads it in float
                else:
                    outputs.append(int8_form.get(out.name, out))
            out_nodes.append(dataclasses.replace(n, inputs=inputs, outputs=tuple(outputs), precision="int8"))
        else:
            inputs = tuple(dataclasses.replace(t, is_weight=True) if t is not None and t.name in stored else t
                           for t in n.inputs)
            out_nodes.append(dataclasses.replace(n, inputs=inputs))
    # fresh Kernel objects: with_layers assigns their layers without touching the caller's
    out_nodes = [dataclasses.replace(n) for n in out_nodes]
    return with_layers(Traffic(
        model=traffic.model,
        nodes=out_nodes,
        ideal_activation_bytes=0,
        ideal_weight_bytes=0,
        activations=0,
        graph_outputs=traffic.graph_outputs,
        graph_inputs=traffic.graph_inputs,
    ))


def float_ops(traffic: Traffic) -> Counter:
    """Ops of an :func:`int8_traffic` node list that run in float (conversions not counted)."""
    return Counter(
        n.op_type for n in traffic.nodes
        if not n.precision and not n.no_traffic and not n.metadata_only
        and not (_is(n, QUANTIZE) or _is(n, DEQUANTIZE))
        and any(_float(t) for t in (*n.inputs, *n.outputs))
    )
