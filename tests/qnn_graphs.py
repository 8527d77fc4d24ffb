"""Small graphs for the QNN HTP tests, and the skip for machines without the backend.

The HTP is emulated on x86 (slow): a few nodes, tensors of a few hundred elements.
``make test`` installs ``onnxruntime-qnn`` wherever its wheel exists (CPython 3.11+, Linux
x86_64) and declares the ``qnn`` extra installed: there a missing backend is a failure, not a
skip (``extras.needs``).
"""

from __future__ import annotations

import numpy as np
from onnx import helper

import extras
from graphs import model, rng, tensor, vinfo

needs_htp = extras.needs("onnxruntime_qnn")


def conv_then(op: str | None, *, batch="batch", c_in=3, c_out=4, size=6, opset=17, seed=0, **attrs):
    """x[batch, c_in, size, size] -> Conv 3x3 -> ``op`` (None: the Conv alone)."""
    r = rng(seed)
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c" if op else "y"], pads=[1, 1, 1, 1], name="conv")]
    if op:
        nodes.append(helper.make_node(op, ["c"], ["y"], name=op.lower(), **attrs))
    return model(nodes, [vinfo("x", [batch, c_in, size, size])], [vinfo("y", [batch, c_out, size, size])],
                 [tensor("W", r.normal(0, 0.3, (c_out, c_in, 3, 3)).astype(np.float32)),
                  tensor("B", r.normal(0, 0.1, c_out).astype(np.float32))], opset=opset)


def feeds(m, seed: int = 0, batch: int = 1) -> dict[str, np.ndarray]:
    r = rng(seed)
    out = {}
    for inp in m.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else batch for d in inp.type.tensor_type.shape.dim]
        out[inp.name] = r.normal(0, 1, shape).astype(np.float32)
    return out
