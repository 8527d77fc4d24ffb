"""What is left: the ops that commonly fuse and are still in the graph, each with why.

After the rewrites, every op of :data:`COMMONLY_FUSED` left in the main graph has either a
refusal (some pass looked at it and said why) or gets a note here saying why no pass
applies, so the log never reads "nothing to do" where there is something a user expects:

- an activation after a layer when the target has no fused kernels (``--target onnx``):
  portable ONNX has no conv-with-epilogue op, ``--target onnxruntime`` fuses it;
- an activation whose input is not a layer's output;
- the primitives of a pattern (Erf, ReduceMean, Pow, Sqrt...) that no pattern's spelling
  matched (a variant opfuse does not know yet, or one the target keeps).
"""

from __future__ import annotations

__all__ = ["COMMONLY_FUSED", "leftover_notes"]

from collections import defaultdict

import onnx_ir as ir

from opfuse.core.analysis import node_label, trace_producer
from opfuse.report import FusionReport
from opfuse.targets.kernels import Target
from opfuse.core.ops import ACTIVATION_OPS, OpKind, is_onnx, op_kind

# the primitives the patterns consume (opfuse.passes.patterns), by the pattern they belong to
PATTERN_PRIMITIVES = {"Erf": "GELU", "ReduceMean": "LayerNorm or RMSNorm", "Softmax": "attention"}
COMMONLY_FUSED = ACTIVATION_OPS | {"BatchNormalization"} | set(PATTERN_PRIMITIVES)


def leftover_notes(model: ir.Model, report: FusionReport, target: Target) -> list[str]:
    """One note per kind of op left without a reason (see the module docstring)."""
    explained = {r.node for r in report.refusals} | {n for r in report.refusals for n in r.also}
    why: dict[str, list[str]] = defaultdict(list)
    for node in model.graph:
        if not is_onnx(node) or node.op_type not in COMMONLY_FUSED or node_label(node) in explained:
            continue
        why[_reason(node, target)].append(node_label(node))
    notes = []
    for reason, labels in why.items():
        shown = ", ".join(labels[:3]) + (", ..." if len(labels) > 3 else "")
        notes.append(f"left without a rewrite: {len(labels)} node(s) ({shown}): {reason}")
    return notes


def _reason(node: ir.Node, target: Target) -> str:
    if node.op_type in PATTERN_PRIMITIVES:
        pattern = PATTERN_PRIMITIVES[node.op_type]
        if pattern == "attention" and target.policy("attention") != "fuse":
            return f"{target.title} keeps attention as it is (no standard op at this opset it fuses into)"
        return (f"part of no {pattern} spelling opfuse matches here (or one whose check failed without "
                "matching the whole pattern); it stays as written")
    source = trace_producer(node.inputs[0])[0] if node.inputs and node.inputs[0] is not None else None
    if source is not None and op_kind(source) is OpKind.OUT_ELEMWISE_FUSABLE:
        if target.compiler_fuses_epilogues:
            return (f"{target.title}'s own compiler fuses a {node.op_type} after a layer into it, from standard "
                    "ops, so opfuse writes it as it is (the compile log shows what the compiler took)")
        if not target.kernels:
            return (f"{target.title} (--target {target.name}) has no fused kernels, so a {node.op_type} after a "
                    "layer stays a separate op (--target onnxruntime fuses it into the layer's kernel)")
        return f"the {node.op_type} follows {source.op_type}, and no fusion pass of this run looked at it"
    if source is None:
        return "its input is a graph input or a constant, not a layer's output"
    return f"its input comes from {source.op_type}, not a layer whose epilogue could run it"
