"""An ``If`` left on the CPU, and the graph inputs that decide it: the fix the compile log gives.

QNN compiles no control flow of its own. On the HTP backend (onnxruntime-qnn 2.7), ONNX
Runtime leaves an ``If`` on the CPU, with QNN's reason naming a value the ``If`` reads from
outside QNN's partition ("If implicit input `B` is produced outside the QNN partition
(cross-partition unsupported)"). Every node of its branches also goes to the CPU, with no
reason in QNN's log: the placement lists them under their own names, beside the main
graph's nodes.

:func:`branch_fixes` maps each such node to what a user can do about it. The fix applies
when the condition of the main-graph ``If`` that holds the node is computed from graph
inputs and constants only (:func:`opfuse.prepare.constant_inputs.deciding_inputs`; a shape read
counts as a constant, since static shapes fold it). A deployment that fixes those inputs
removes the ``If``, so the fix names them: "its condition is computed from input 'sr' only:
bind it with --constant-input sr=VALUE". In ``opfuse quantize``, when every calibration
sample carries one value for such an input, the fix gives that value.
"""

from __future__ import annotations

__all__ = ["branch_fixes"]

import os
from collections.abc import Iterable, Mapping

import numpy as np
import onnx
import onnx_ir as ir

from opfuse.prepare.constant_inputs import deciding_inputs, show_value
from opfuse.core.ops import is_op


def branch_fixes(model, cpu: Iterable[tuple[str, str]],
                 values: Mapping[str, np.ndarray] | None = None) -> dict[str, str]:
    """CPU node name -> the fix, for the nodes of ``cpu`` (placement's (name, op type)) that
    are an If or lie in one whose condition a binding decides (see the module docstring).
    ``model``: what was compiled (ModelProto, onnx-ir Model, bytes or path);
    ``values``: input name -> the one value every calibration sample has."""
    cpu = list(cpu)
    if not any(op == "If" for _, op in cpu):
        return {}
    graph = _main_graph(model)
    owner: dict[str, tuple[ir.Node, str]] = {}  # node name -> (main-graph If, its branch)
    for node in graph:
        if not is_op(node, "If"):
            continue
        owner[node.name] = (node, "")
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                for inner in attr.value.all_nodes():
                    owner.setdefault(inner.name, (node, attr.name))
    fixes: dict[str, str] = {}
    advice: dict[int, str | None] = {}
    for name, _ in cpu:
        if not name or name not in owner:
            continue
        node, branch = owner[name]
        if id(node) not in advice:
            advice[id(node)] = _bind_advice(node, graph, values or {})
        text = advice[id(node)]
        if text is None:
            continue
        fixes[name] = f"its {text}" if not branch else f"it is in the {branch} of If '{node.name}', whose {text}"
    return fixes


def _bind_advice(node: ir.Node, graph: ir.Graph, values: Mapping[str, np.ndarray]) -> str | None:
    """"condition is computed from input 'sr' only: ... bind it with ...", or None."""
    inputs = deciding_inputs(node.inputs[0] if node.inputs else None, graph)
    if not inputs:
        return None  # not from inputs alone, or from shapes and constants (static shapes fold those)
    named = ", ".join(f"'{n}'" for n in inputs)
    binds = " ".join(f"--constant-input {n}={_value(values.get(n))}" for n in inputs)
    known = [n for n in inputs if n in values]
    where = (" (the value every calibration sample has)" if len(known) == len(inputs)
             else f" ({', '.join(known)}: the value every calibration sample has)" if known
             else " (the value the deployment passes)")
    pronoun = "them" if len(inputs) > 1 else "it"
    return (f"condition is computed from input{'s' if len(inputs) > 1 else ''} {named} only: bind {pronoun} "
            f"with {binds}{where} and opfuse resolves the If to its branch")


def _value(array: np.ndarray | None) -> str:
    if array is None:
        return "VALUE"
    return show_value(array).strip("[]").replace(" ", "")


def _main_graph(model) -> ir.Graph:
    if isinstance(model, ir.Model):
        return model.graph
    if isinstance(model, bytes):
        model = onnx.load_model_from_string(model)
    elif isinstance(model, (str, os.PathLike)):
        model = onnx.load(os.fspath(model), load_external_data=False)
    return ir.serde.deserialize_model(model).graph
