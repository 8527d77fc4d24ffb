"""Small graph edits every rewrite shares: add a private constant, drop one nobody reads.

- :func:`add_constant` - a new constant next to a node: an initializer in a graph, a
  ``Constant`` node inside a function (functions have no initializers).
- :func:`drop_if_unused` - remove a constant no node reads any more, and the Identity /
  Constant chain behind it; graph inputs and outputs are never removed.
"""

from __future__ import annotations

__all__ = ["add_constant", "drop_if_unused"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import NameTable, Scope
from opfuse.core.ops import is_op


def add_constant(scope: Scope, names: NameTable, before: ir.Node, array: np.ndarray, base: str) -> ir.Value:
    """A new private constant: an initializer, or a Constant node inside a function."""
    name = names.fresh(base)
    tensor = ir.Tensor(array, name=name)
    if scope.function is None:
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
        scope.graph.register_initializer(value)
        return value
    const = ir.Node("", "Constant", [], attributes=[ir.AttrTensor("value", tensor)], name=name)
    const.outputs[0].name = name
    scope.container.insert_before(before, const)
    return const.outputs[0]


def drop_if_unused(value: ir.Value | None, dropped: list[ir.Value] | None = None) -> bool | None:
    """Remove a constant nobody uses any more (and the Identity/Constant chain behind it).

    Returns False if it is still used (or is a graph input or output), None if it is not a
    constant this can remove, True when removed; every value removed is appended to
    ``dropped``.
    """
    if value is None:
        return None
    if value.uses() or value.is_graph_output() or value.is_graph_input():
        return False
    if value.is_initializer():
        graph = value.graph
        if graph is not None and value.name in graph.initializers:
            graph.initializers.pop(value.name)
        if dropped is not None:
            dropped.append(value)
        return True
    producer = value.producer()
    if is_op(producer, "Constant", "Identity") and producer.graph is not None:
        sources = [v for v in producer.inputs if v is not None]
        producer.graph.remove(producer, safe=True)
        if dropped is not None:
            dropped.append(value)
        for source in sources:
            drop_if_unused(source, dropped)
        return True
    return None


def drop_unread_nodes(nodes, ops: frozenset[str] | None = None) -> list[ir.Node]:
    """Remove each node, and then its producers, while nothing reads it (and, with ``ops``, while it
    is one of those ops); a node holding a subgraph stays. Returns the nodes removed."""
    removed, pending = [], list(nodes)
    while pending:
        node = pending.pop()
        if (node is None or node.graph is None or (ops is not None and not is_op(node, *ops))
                or any(v.uses() or v.is_graph_output() for v in node.outputs)
                or any(a.type == ir.AttributeType.GRAPH for a in node.attributes.values())):
            continue
        sources = [v.producer() for v in node.inputs if v is not None]
        node.graph.remove(node, safe=True)
        removed.append(node)
        pending += sources
    return removed


def remove_matched(container, nodes) -> list[ir.Node]:
    """Remove the nodes of a matched chain that nothing reads any more, consumers first, until none
    is left to remove (a node something else still reads stays: a shared DynamicQuantizeLinear);
    then the constants only they read. ``container`` is the graph or function holding them.
    Returns the nodes removed, in the order removed."""
    removed, inputs, pending = [], [], list(nodes)
    while True:
        dead = [n for n in pending if n.graph is not None
                and not any(v.uses() or v.is_graph_output() for v in n.outputs)]
        if not dead:
            break
        for node in dead:
            inputs.extend(v for v in node.inputs if v is not None)
            container.remove(node, safe=True)
            removed.append(node)
    for value in inputs:
        drop_if_unused(value)
    return removed
