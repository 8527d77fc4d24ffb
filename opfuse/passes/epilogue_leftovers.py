"""Why an element-wise op the epilogue pass met is still in the graph.

After :mod:`opfuse.passes.fuse_epilogue` has walked every anchor, each op it could have
absorbed and did not gets one reason (a refusal), so the log never stays silent about an
op that commonly fuses. The ops explained (:func:`is_epilogue_op`):

- every element-wise op (ELEMWISE, BROADCAST) whose input comes, past Identity nodes, from
  a layer (an OUT_ELEMWISE_FUSABLE op) or from a fused kernel;
- every activation (:data:`opfuse.core.ops.ACTIVATION_OPS`), wherever it is.

An op the walk already refused keeps that refusal; the reasons here are for the ones it
did not reach: an activation after a Concat, an Add after a fused activation, a Relu after
a MaxPool (which the target has no kernel for).
"""

from __future__ import annotations

__all__ = ["explain_leftovers", "is_epilogue_op", "layer_input"]

import onnx_ir as ir

from opfuse.core.analysis import Scope, describe, trace_producer
from opfuse.targets.kernels import read_kernel
from opfuse.core.ops import ELEMENTWISE_KINDS, OpKind, is_onnx, is_op, op_info, op_kind


def layer_input(node: ir.Node) -> ir.Node | None:
    """The layer or fused kernel one of ``node``'s inputs comes from (past Identity)."""
    for value in node.inputs:
        producer = trace_producer(value)[0] if value is not None else None
        if producer is None:
            continue
        if op_kind(producer) is OpKind.OUT_ELEMWISE_FUSABLE or _kernel_view(producer) is not None:
            return producer
    return None


def is_epilogue_op(node: ir.Node) -> bool:
    """Whether the epilogue pass owes ``node`` a reason when it stays (module docstring)."""
    info = op_info(node)
    if info is None or info.kind not in ELEMENTWISE_KINDS or is_op(node, "Identity"):
        return False
    return info.activation is not None or layer_input(node) is not None


def explain_leftovers(fusion_pass, scope: Scope, explained: set) -> None:
    """Give every :func:`is_epilogue_op` left in ``scope`` and not yet explained a reason."""
    for node in scope.graph:
        if node in explained or not is_epilogue_op(node):
            continue
        explained.add(node)
        fusion_pass.refuse(node.op_type, node, _reason(fusion_pass, node), scope=scope)


def _reason(fusion_pass, node: ir.Node) -> str:
    target = fusion_pass.target
    source = layer_input(node)
    if source is None:
        first = node.inputs[0] if node.inputs else None
        producer = trace_producer(first)[0] if first is not None else None
        if producer is None:
            return "its input is a graph input or a constant, not a layer's output"
        return f"its input comes from {describe(producer)}, not a layer with an epilogue"
    view = _kernel_view(source)
    if view is not None:
        if is_op(node, "Add") and view.activation is not None:
            return (f"it comes after {describe(source)}, whose epilogue already applies an activation; "
                    "the kernel computes act(conv + Z), not act(conv) + Z")
        held = "+".join(view.epilogue) or "nothing"
        return f"its input comes from {describe(source)}, whose epilogue already holds {held}"
    kernel = target.kernel_for(source.op_type) if is_onnx(source) else None
    if kernel is None:
        return (f"{target.title} has no fused {source.op_type} kernel, so the {node.op_type} after "
                f"{describe(source)} runs as its own kernel")
    if is_op(node, "Add") and not fusion_pass.fuses_residual:
        return "residual Add fusion is not part of this configuration (fuse-activation only)"
    return f"it was not fused into {describe(source)} (see that layer's other entries)"


def _kernel_view(node: ir.Node):
    if is_onnx(node):
        return None
    return read_kernel(node.domain, node.op_type, node.inputs, node.attributes)
