"""Float islands in an int8 lowering: the ops ONNX Runtime's quantiser left float, for the host CPU.

By default an int8 lowering refuses an op whose tensors the QDQ model leaves float (the quantiser
quantises only the op types it is given: a chain of ops it does not know stays float, and an op
between quantised ops reads and writes its neighbours' Q/DQ pairs, so it is int8 already). With
``float_islands`` (``lower_to_tflite(..., float_islands=True)``, ``--vela float_ops=cpu``) such an
op is written in float32 instead (:func:`lower_float`):

1. each int8 input through a DEQUANTIZE to float32 (one per tensor, reused by every island op);
2. the op's own float TFLite kernels (the lowering's function for it, run as in a float model:
   its constants dequantised);
3. each output the QDQ model quantises (a quantised consumer reads it) through a QUANTIZE to that
   int8 tensor; an output it leaves float stays float for the next island op or the graph output.

Vela runs no float op: it leaves the DEQUANTIZE, the float ops and the QUANTIZE to the CPU and
names its reason for each (the compile report's CPU fallbacks). Legality: a node is an island when
one of its computed inputs or outputs has no quantisation (:func:`is_island`); a graph of no Q/DQ
at all is a float lowering, not islands.
"""

from __future__ import annotations

__all__ = ["is_island", "lower_float"]

from collections.abc import Callable

import numpy as np

from opfuse.targets.ethos_u.tflite_graph import Lowering, Value
from opfuse.targets.ethos_u.tflite_ops import OP


def is_island(L: Lowering, node) -> bool:
    """Whether ``node`` of a QDQ model has a computed input or an output with no quantisation."""
    if not L.g.quantised:
        return False
    names = [n for n in node.input if n and not L.is_constant(n)] + [o for o in node.output if o]
    return any(n not in L.g.quant for n in names)


def _dequantised(L: Lowering, name: str, v: Value) -> Value:
    cache = L.float_values
    if name not in cache:
        index = L.w.tensor(f"{name}/float", [v.shape[a] for a in v.layout], np.float32)
        L.w.op(OP.DEQUANTIZE, [v.index], [index])
        cache[name] = Value(index, v.shape, v.layout, None)
    return cache[name]


def lower_float(L: Lowering, node, lower: Callable) -> None:
    """``node`` written in float32 between DEQUANTIZE and QUANTIZE (module docstring, 1. to 3.)."""
    int8_inputs = {}
    for name in dict.fromkeys(n for n in node.input if n and not L.is_constant(n)):
        v = L.value(name)
        if v.quant is not None:
            int8_inputs[name] = v
            L.values[name] = _dequantised(L, name, v)
    before = set(L.values)
    L.g.quantised = False
    try:
        lower(L, node)
    finally:
        L.g.quantised = True
        L.values.update(int8_inputs)
    for name in [n for n in L.values if n not in before]:
        if name not in L.g.quant:
            continue  # left float: read by the next island op, or a float graph output
        f = L.values[name]
        L.w._tensors[f.index].name = f"{L.w._tensors[f.index].name}/float"
        q = L.new_value(name, layout=f.layout)
        L.w.op(OP.QUANTIZE, [f.index], [q.index])
