"""Unfuse: an op the target cannot run, expanded into the primitives of its ONNX function body.

Algebra: many ONNX ops are defined by a function body in their schema (GroupNormalization
as Reshape -> InstanceNormalization-style moments -> Reshape -> Mul -> Add; LayerNormalization;
Gelu...). The body computes the op by definition, so replacing a node by its body, inlined,
is exact up to float rounding. A target that cannot run an op (QNN's HTP and
GroupNormalization-21) says ``"unfuse"`` for it (:attr:`Target.unfused_ops`) and
:class:`~opfuse.passes.fuse_patterns.PatternFusionPass` expands each such node here,
before any pattern is fused.

How: the body comes from onnx's schema at the model's opset (a context-dependent one is
built for the node's attributes and input types); it becomes a model-local function in
the domain :data:`UNFUSED_DOMAIN`, the node a call to it, and onnx-ir's ``InlinePass``
inlines the call. Verification checks the result at the node's output tensor, like every
rewrite.

Legality (each a refusal with the reason): the op has a function body at the model's
opset; its input types are known (a context-dependent body needs them).
"""

from __future__ import annotations

__all__ = ["UNFUSED_DOMAIN", "function_body", "unfuse_ops"]

import onnx
import onnx_ir as ir
from onnx_ir.passes.common import InlinePass

from opfuse.core.analysis import opset_of
from opfuse.report import Reason

UNFUSED_DOMAIN = "opfuse.unfused"


def function_body(node: ir.Node, opset: int) -> onnx.FunctionProto | Reason:
    """The schema's function body for ``node`` at ``opset``, or the :class:`Reason` there is none."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return Reason(f"onnx has no schema for {node.op_type} at opset {opset}")
    if schema.has_function and schema.since_version in schema.function_opset_versions:
        return schema.get_function_with_opset_version(schema.since_version)
    if not schema.has_context_dependent_function:
        return Reason(f"{node.op_type}-{schema.since_version} has no function body in its ONNX schema to expand into")
    proto = ir.serde.serialize_node(node)
    types = []
    for value in node.inputs:
        if value is None or value.type is None:
            return Reason(f"the type of an input of {node.op_type} is unknown, and its function body depends on it")
        t = onnx.TypeProto()
        t.tensor_type.elem_type = value.dtype.value
        types.append(t.SerializeToString())
    versions = schema.context_dependent_function_opset_versions
    version = max((v for v in versions if v <= opset), default=None)
    if version is None:
        return Reason(f"{node.op_type}'s function body needs opset {min(versions)} or later")
    body = schema.get_context_dependent_function_with_opset_version(version, proto.SerializeToString(), types)
    function = onnx.FunctionProto()
    function.ParseFromString(body)
    return function


def unfuse_ops(model: ir.Model, op_types, refuse, record) -> bool:
    """Expand every main-graph node of ``op_types`` (default domain); ``refuse(node, reason)``
    and ``record(node, function)`` report each. Returns whether the graph changed."""
    wanted = set(op_types)
    opset = opset_of(model.opset_imports)
    calls = []
    for node in list(model.graph):
        if node.op_type not in wanted or node.domain not in ("", "ai.onnx"):
            continue
        body = function_body(node, opset)
        if isinstance(body, Reason):
            refuse(node, body.sentence)
            continue
        function = ir.serde.deserialize_function(body)
        function.domain, function.name = UNFUSED_DOMAIN, f"{node.op_type}_{len(calls)}"
        for domain, version in function.opset_imports.items():
            model.opset_imports.setdefault(domain, version)
        model.functions[function.identifier()] = function
        record(node, function)
        node.domain, node.op_type = UNFUSED_DOMAIN, function.name
        calls.append(node)
    if not calls:
        return False
    model.opset_imports.setdefault(UNFUSED_DOMAIN, 1)
    InlinePass()(model)
    model.opset_imports.pop(UNFUSED_DOMAIN, None)
    return True
