"""What the measured choice times: the whole model when it is small, else its first repeated block.

A fusion family is one decision for the whole graph (:mod:`opfuse.tune.families`), and a model
that repeats a block (a decoder's layers, an encoder's, a ResNet stage's bottlenecks) makes the
same rewrites in every copy. So a large model is timed on a **prefix**: the nodes that compute
its first block's outputs (what precedes it, the embedding, the mask and rotary tables, and the
block itself), with the block's outputs as the prefix's graph outputs. Its shapes are the ones the
block sees in the whole model: the prefix is the model cut, not a block rebuilt. The decision taken
on it is applied to every copy (the pipeline rewrites the whole model with it, and verification
checks that model).

- **Blocks** are read off the names exporters write. A node's scope is its
  ``pkg.torch.onnx.name_scopes`` metadata (torch's dynamo exporter), else its name
  (``/model/layers.0/self_attn/MatMul``, ``layer1.0.conv1``). The first purely numeric component
  of a scope, with the components before it, is (container, index): ``model.layers``, 0. The
  container taken is the first in graph order with at least :data:`MIN_COPIES` indices; the block
  is its lowest index. No such container: no block (the log says so).
- **Small** (:func:`is_small`): at most :data:`SMALL_BYTES` of initializers and
  :data:`SMALL_NODES` nodes. A small model is timed whole; a large one on its prefix; a large one
  without a block is not timed (the target's policy applies, and the log says why): timing
  variants of it would cost what the tuning is meant to save.
- **A large lookup table** the prefix reads with a Gather of graph-input indices (a token
  embedding: 113 MB of SmolLM2's 538) is cut out (:func:`cut_lookups`): its output becomes a
  graph input, fed the rows the indices pick (``numpy.take``), so the variants' sessions do not
  each hold a copy. The table's Gather is the same in every variant: no family rewrites it.
"""

from __future__ import annotations

__all__ = ["Block", "find_block", "prefix_model", "is_small", "model_bytes", "cut_lookups", "Lookup",
           "SMALL_BYTES", "SMALL_NODES", "MIN_COPIES"]

import ast
import dataclasses
import re
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from opfuse.core.ops import is_op

SMALL_BYTES = 48 * 2**20  # a model timed whole: its initializers at most this...
SMALL_NODES = 3000  # ...and at most this many nodes
MIN_COPIES = 2  # a container with at least this many numbered children repeats a block
LOOKUP_BYTES = 2**20  # a Gather's table at least this large is cut out of the prefix
_SCOPES = "pkg.torch.onnx.name_scopes"
_SPLIT = re.compile(r"[/.]")


@dataclasses.dataclass(frozen=True)
class Block:
    """A repeated block: its container ("model.layers"), the index timed, and how many copies."""

    container: str
    index: str
    copies: int

    def describe(self) -> str:
        return f"{self.container}.{self.index} (1 of {self.copies} blocks)"


def _scope(node: ir.Node) -> str:
    """The node's deepest scope name (dynamo's name_scopes metadata), else its name."""
    scopes = node.metadata_props.get(_SCOPES)
    if scopes:
        try:
            parsed = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            parsed = None
        named = [s for s in parsed or [] if isinstance(s, str) and s]
        if len(named) >= 2:
            return named[-2]  # (the last one is the node's own op name)
    return node.name or ""


def _key(node: ir.Node) -> tuple[str, str] | None:
    """(container, index) of the first numeric component of the node's scope."""
    parts = [p for p in _SPLIT.split(_scope(node)) if p]
    for i, part in enumerate(parts):
        if part.isdigit() and i > 0:
            return ".".join(parts[:i]), part
    return None


def find_block(model: ir.Model) -> Block | None:
    """The first repeated block in graph order (None without one)."""
    keys = {node: _key(node) for node in model.graph}
    indices: dict[str, list[str]] = {}
    for key in keys.values():
        if key is not None and key[1] not in indices.setdefault(key[0], []):
            indices[key[0]].append(key[1])
    for container, found in indices.items():  # (insertion order: the graph's)
        if len(found) >= MIN_COPIES:
            return Block(container, min(found, key=int), len(found))
    return None


def model_bytes(model: ir.Model) -> int:
    """The bytes of the model's initializers (main graph)."""
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def is_small(model: ir.Model) -> bool:
    """Whether the model is timed whole (module docstring)."""
    if len(model.graph) > SMALL_NODES:  # (its main graph alone: no walk of 48k nodes to count them)
        return False
    nodes = sum(1 for _ in ir.traversal.RecursiveGraphIterator(model.graph))
    return nodes <= SMALL_NODES and model_bytes(model) <= SMALL_BYTES


def prefix_model(model: ir.Model, block: Block) -> ir.Model:
    """``model`` (mutated: pass a private copy) cut to what computes ``block``: its outputs (the
    values the block's nodes produce that a node outside it, or the graph, reads) are the graph's
    outputs; every node and initializer that does not reach them, and every input no node reads,
    is removed."""
    graph = model.graph
    nodes = {n for n in graph if _key(n) == (block.container, block.index)}
    outside_users = []
    graph_outputs = set(map(id, graph.outputs))
    for node in graph:
        if node not in nodes:
            continue
        for value in node.outputs:
            users = {u for u, _ in value.uses()}
            if id(value) in graph_outputs or any(u not in nodes for u in users):
                outside_users.append(value)
    graph.outputs.clear()
    graph.outputs.extend(outside_users)
    RemoveUnusedNodesPass()(model)
    for value in list(graph.inputs):
        if not value.uses():
            graph.inputs.remove(value)
    return model


@dataclasses.dataclass(frozen=True)
class Lookup:
    """A Gather cut out of the prefix: its output is the graph input ``name``, fed
    ``numpy.take(table, feeds[indices], axis)``."""

    name: str
    indices: str
    axis: int
    table: np.ndarray

    def feed(self, feeds: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.take(self.table, feeds[self.indices], axis=self.axis)


def _looked_up_shape(table: ir.Shape, indices: ir.Shape | None, axis: int) -> ir.Shape | None:
    """The shape of ``Gather(table, indices, axis)``'s output (None where the indices' is not known)."""
    if indices is None:
        return None
    axis = axis % len(table) if len(table) else 0
    dims = list(table)
    return ir.Shape(dims[:axis] + list(indices) + dims[axis + 1:])


def cut_lookups(model: ir.Model) -> list[Lookup]:
    """Every Gather of a constant table of at least :data:`LOOKUP_BYTES` by a graph input's indices
    becomes a graph input (``model`` is mutated); the indices input stays (other nodes may read it,
    and the feeds are drawn for it). The input has the type and shape the Gather's output declares,
    else (an export that declares none for intermediate values: TorchScript's) the table's dtype and
    the shape the Gather gives, where the indices' is known (:func:`_looked_up_shape`)."""
    graph = model.graph
    inputs = {v.name: v for v in graph.inputs}
    found = []
    for node in list(graph):
        if not is_op(node, "Gather") or len(node.inputs) < 2:
            continue
        table, indices = node.inputs[0], node.inputs[1]
        if (table is None or indices is None or table.const_value is None or indices.name not in inputs
                or table.const_value.nbytes < LOOKUP_BYTES):
            continue
        axis = node.attributes.get_int("axis", 0)
        out = node.outputs[0]
        type_ = out.type or ir.TensorType(table.const_value.dtype)
        shape = out.shape if out.type is not None else _looked_up_shape(table.const_value.shape, indices.shape, axis)
        fed = ir.Value(name=f"{out.name}__looked_up", type=type_, shape=shape)
        out.replace_all_uses_with(fed, replace_graph_outputs=True)
        graph.inputs.append(fed)
        graph.remove(node, safe=True)
        found.append(Lookup(fed.name, indices.name, axis, table.const_value.numpy()))
    if found:
        RemoveUnusedNodesPass()(model)
    return found
