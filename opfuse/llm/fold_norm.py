"""Fold an RMSNorm's scale into the projections that read it, before int4 quantisation.

Algebra: an RMSNorm (``SimplifiedLayerNormalization``, or ``SkipSimplifiedLayerNormalization`` whose
first output is the norm of ``input + skip``) computes ``y = x / rms(x) * g`` with a scale ``g`` of K
values, one per channel of the last axis. For a projection ``MatMul(y, W)`` with ``W`` [K, N],

    MatMul(x / rms(x) * g, W) = MatMul(x / rms(x), diag(g) W)     (row k of W times g[k])

so ``g`` becomes ones and each consumer's weight ``diag(g) W``. The quantiser then puts ``diag(g) W``
on its grid once, instead of ``W`` with ``g`` applied to the activations in float: the blocks (along K)
see the scaled rows, which changes the grid (it may help or hurt; measured in docs/results/llm.md).

Legality (each checked; a norm that fails one is left as it is):

1. ``g`` is a 1-D float32 initializer of K values (the norm's ``scale`` / ``gamma`` input).
2. Every reader of the norm's first output is a ``MatMul`` taking it as its first input, with a 2-D
   float32 initializer of K rows as its second; the output is not a graph output. Then nothing reads
   ``x / rms(x) * g`` but the projections, and each of them reads ``x / rms(x)`` times ``diag(g) W``.
3. The other outputs are untouched: SkipSimplifiedLayerNormalization's sum ``input + skip`` (the
   residual stream) and its statistics do not depend on ``g``.

A weight read by another node as well gets a scaled copy of its own (the other reader keeps ``W``); the
norm gets a new initializer of ones (``g`` may be read elsewhere). The rewrite is exact up to float
rounding (one product per weight, in float64, rounded to float32).

:func:`fold_norm_scales` returns the scale of each norm output it folded, so a Hessian of that
output measured before the fold, ``E[y y^T]``, can be carried over: ``E[x' x'^T] = H / (g g^T)`` for
``x' = y / g`` (:func:`rescale_hessians`); a scale with a zero is therefore not folded.
"""

from __future__ import annotations

__all__ = ["NORMS", "fold_norm_scales", "rescale_hessians"]

import numpy as np
import onnx
from onnx import numpy_helper

from opfuse.core.ops import ONNX_DOMAINS

NORMS = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2}  # op -> its scale input


def fold_norm_scales(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Fold each legal RMSNorm scale of ``model``'s main graph into its projections (module docstring);
    ``model`` is changed in place. Returns {the norm's first output: its scale g}, for each fold."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in set(node.input):
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    folded: dict[str, np.ndarray] = {}
    new_inits: list[onnx.TensorProto] = []
    rewritten: dict[str, str] = {}  # a weight already scaled in place -> the norm output it was scaled for
    for node in list(graph.node):
        where = NORMS.get(node.op_type)
        if where is None or len(node.input) <= where or node.input[where] not in inits or not node.output:
            continue
        g = numpy_helper.to_array(inits[node.input[where]])
        y = node.output[0]
        if g.ndim != 1 or g.dtype != np.float32 or not np.all(g != 0) or y in outputs or not readers.get(y):
            continue
        k = g.shape[0]
        consumers = readers[y]
        if not all(c.op_type == "MatMul" and c.domain in ONNX_DOMAINS and list(c.input).count(y) == 1
                   and c.input[0] == y and c.input[1] in inits and list(inits[c.input[1]].dims)[:1] == [k]
                   and len(inits[c.input[1]].dims) == 2 and inits[c.input[1]].data_type == onnx.TensorProto.FLOAT
                   for c in consumers):
            continue
        for c in consumers:
            w = numpy_helper.to_array(inits[c.input[1]])
            scaled = (g.astype(np.float64)[:, None] * w.astype(np.float64)).astype(np.float32)
            shared = any(r is not c for r in readers[c.input[1]]) or c.input[1] in rewritten
            if shared:
                name = f"{c.input[1]}_norm_folded_{len(new_inits)}"
                new_inits.append(numpy_helper.from_array(scaled, name))
                c.input[1] = name
            else:
                inits[c.input[1]].CopyFrom(numpy_helper.from_array(scaled, c.input[1]))
                rewritten[c.input[1]] = y
        ones = f"{node.name or y}_norm_folded_ones"
        new_inits.append(numpy_helper.from_array(np.ones(k, np.float32), ones))
        node.input[where] = ones
        folded[y] = g
    graph.initializer.extend(new_inits)
    return folded


def rescale_hessians(hessians: dict[str, np.ndarray], folded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``hessians`` (input name -> E[x x^T], measured before the fold) with each folded norm output's
    Hessian divided by ``g g^T`` (module docstring); the others as they are."""
    out = dict(hessians)
    for name, g in folded.items():
        if name in out:
            g64 = g.astype(np.float64)
            out[name] = out[name] / np.outer(g64, g64)
    return out
