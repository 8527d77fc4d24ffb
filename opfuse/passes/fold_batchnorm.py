"""Fold BatchNormalization into the Conv, ConvTranspose, Gemm or MatMul before it.

Algebra (inference mode; eps is the node's own attribute, 1e-5 only when it is absent):

    s  = gamma / sqrt(var + eps)          t  = beta - mean * s
    W' = s[o] * W[o]  per output channel   b' = s * b + t   (b = 0 without a bias)

computed in float64 and cast back to the weight's dtype (BatchNormalization-15 may carry
float32 statistics for float16 data; the result takes the weight's dtype).

Legality, beyond the common rules in :mod:`opfuse.passes.folding`:

1. Inference mode only: ``training_mode=1`` (opset 14+) and ``is_test=0`` (opset 6, where
   it is the default) are refused, and so is a node whose optional outputs (running or
   saved mean/variance) exist.
2. ``spatial=0`` (opsets 7-8: statistics per channel *and* position) is refused.
3. scale, B, mean and var are constants with one value per output channel, and
   var + eps > 0.
4. After MatMul, BatchNormalization's channel axis (1) must be the MatMul's last axis: the
   input must be known to be 2-D. The result is a Gemm.
5. Through layout ops (:mod:`opfuse.passes.layout_chain`), the producer's channels must land
   on axis 1 of BatchNormalization's input, the axis it normalises: ``Conv -> Transpose(0,1,3,2)
   -> BatchNormalization`` folds, an NHWC ``Transpose(0,2,3,1)`` does not.
"""

from __future__ import annotations

__all__ = ["FoldBatchNormPass"]

import numpy as np
import onnx_ir as ir

from opfuse.core import algebra
from opfuse.core.analysis import Scope, batchnorm_epsilon, describe, find_constant, trace_producer
from opfuse.passes.folding import ChannelAffine, FoldPass, ProducerShape
from opfuse.report import Reason


class FoldBatchNormPass(FoldPass):
    """Absorb inference-mode BatchNormalization into the producer's weights and bias."""

    name = "fold-batchnorm"
    consumer_ops = frozenset({"BatchNormalization"})

    def without_producer(self, node: ir.Node, scope: Scope) -> str | None:
        x = node.inputs[0]
        source, _ = trace_producer(x) if x is not None else (None, [])
        if source is None:
            where = "a graph input" if x is not None and x.is_graph_input() else "outside this graph"
            return f"its input comes from {where}, not from a layer with weights"
        return f"its input comes from {describe(source)}, which has no weights to fold into"

    def affine(self, cand, out: ProducerShape) -> ChannelAffine | Reason:
        node, opset = cand.consumer, cand.scope.opset
        problem = _mode_problem(node, opset)
        if problem:
            return Reason(problem)
        if cand.info.op_type == "MatMul" and cand.producer_out.rank != 2:
            return Reason(
                f"{describe(cand.producer)}'s output is not known to be 2-D, and "
                "BatchNormalization normalises axis 1, not necessarily the MatMul's last axis"
            )
        if cand.layout and (out.rank is None or out.rank < 2 or out.channel_axis % out.rank != 1):
            return Reason("it normalises axis 1 of its input, which is not the axis of the output channels")
        params = []
        for index, role in enumerate(("scale", "B", "mean", "var"), start=1):
            found = find_constant(node.inputs[index] if index < len(node.inputs) else None, role)
            if isinstance(found, Reason):
                return found
            array = found.array.astype(np.float64)
            if array.size != out.channels:
                return Reason(
                    f"its {role} has shape {list(array.shape)}, but {describe(cand.producer)} "
                    f"has {out.channels} output channels"
                )
            params.append(array.reshape(-1))
        gamma, beta, mean, var = params
        eps = batchnorm_epsilon(node)
        if not np.all(var + eps > 0):
            return Reason("its variance + epsilon is not positive for every channel")
        scale, shift = algebra.batchnorm_affine(gamma, beta, mean, var, eps)
        return ChannelAffine(scale, shift, detail=f"epsilon={eps:g}")


def _mode_problem(node: ir.Node, opset: int) -> str | None:
    attrs = node.attributes
    training = attrs.get("training_mode")
    if training is not None and int(training.value) != 0:
        return "it runs in training mode (training_mode=1): its statistics change per batch"
    if opset and opset < 7:
        is_test = attrs.get("is_test")
        if is_test is None or int(is_test.value) == 0:
            return "it runs in training mode (is_test=0, the default in opset 6)"
    spatial = attrs.get("spatial")
    if spatial is not None and int(spatial.value) == 0:
        return "spatial=0 keeps statistics per position, not per channel"
    extra = [v for v in node.outputs[1:] if v is not None and v.name]
    if extra:
        return (
            f"its optional outputs ({', '.join(v.name for v in extra)}) exist, "
            "so it computes training statistics"
        )
    return None
