"""Constant branches: an ``If`` whose condition is constant is replaced by the branch it takes.

This is a step of the clean-up's constant folding (:mod:`opfuse.passes.cleanup`). A
condition becomes constant when what feeds it folds: an input bound with
``--constant-input`` (``Equal(sr, 16000)``), or shape arithmetic on static shapes
(``Equal(Gather(Shape(x), -1), 1)``). The inlining itself is onnxscript's constant folder
(its ``If`` evaluator, onnxscript 0.7). This module makes that inlining safe, and it
records each replacement.

Rules:

1. An ``If`` whose condition is a constant is replaced, in its place, by the nodes of the
   branch that condition selects. The ``If``'s outputs keep their names and their readers,
   and a graph output stays a graph output under its own name.
2. A branch node that reads a value of an enclosing graph keeps reading that same value
   (onnx-ir shares one Value object across scopes, so no name is resolved). The branch's
   own values keep their names. If two names collide, onnx-ir's NameFixPass makes them
   unique after the fold. A branch's initializers move to the enclosing graph.
3. Nested Ifs: the inlined nodes are folded in the same sweep, so an ``If`` inside the
   branch whose condition is now known resolves too.
4. Guard (:func:`guard`, before the fold). A branch output that the branch does not
   compute, either a value of an enclosing graph or the branch's own initializer, gets an
   ``Identity`` inside the branch. So does an output that repeats an earlier output of the
   same branch. onnxscript 0.7 would otherwise make such a graph output an input ("Graph
   output 'y' is not an output of any node") or give two outputs one name. After the fold,
   the guards are taken out of every ``If`` that stayed, so a model with no constant
   condition is exactly as it was.
5. Record (:meth:`Watch.finish`, after the fold). Each ``If`` that left its graph is one
   record: "If 'X' resolved to its then_branch: N nodes inlined". The branch not taken
   drops its readers, so weights that only it read are removed as unused.

Not touched: an ``If`` whose condition is not constant, and ``Loop`` and ``Scan`` (whose
bodies run a number of times that the graph decides).

Legality: with its condition constant, an ``If`` computes exactly what its taken branch
computes from the same values. Verification compares the result with the original, which
is fed the bound inputs, like any rewrite.
"""

from __future__ import annotations

__all__ = ["RESOLVED", "GUARD", "Watch", "guard"]

import dataclasses

import onnx_ir as ir

from opfuse.core.analysis import iter_scopes, node_label
from opfuse.report import FusionRecord
from opfuse.core.ops import is_op

RESOLVED = "If resolved"  # the records' pattern
GUARD = "opfuse.branch_guard"  # node meta key: an Identity this module put in a branch
BRANCHES = ("then_branch", "else_branch")


@dataclasses.dataclass
class _Watched:
    node: ir.Node
    label: str  # its node label
    outputs: list[ir.Value]  # the If's outputs
    formal: dict[str, list[ir.Value]]  # branch -> its outputs, before the fold
    nodes: dict[str, int]  # branch -> its nodes (top level)


@dataclasses.dataclass
class Watch:
    """The Ifs of a model before a fold (see the module docstring)."""

    model: ir.Model
    watched: list[_Watched]
    guards: list[tuple[ir.Graph, int, ir.Node, ir.Value]]  # (branch, output index, the Identity, the original output)

    def finish(self) -> list[FusionRecord]:
        """Guards out of the Ifs that stayed; one record per If the fold replaced."""
        for graph, index, identity, original in self.guards:
            identity.meta.pop(GUARD, None)  # (inlined, it is an Identity like any other)
            if identity.graph is graph and index < len(graph.outputs) and graph.outputs[index] is identity.outputs[0]:
                graph.outputs[index] = original
                graph.remove(identity, safe=True)
        labels = {id(scope.graph): scope.label for scope in iter_scopes(self.model)}
        records = []
        for w in self.watched:
            if w.node.graph is not None:
                continue  # still there: its condition is not constant
            taken = next((b for b in BRANCHES if w.formal.get(b) and not _branch(w.node, b).outputs), None)
            if taken is None:
                continue  # gone by some other rewrite: not this module's record
            for other in BRANCHES:
                if other != taken and _branch(w.node, other) is not None:
                    _drop_readers(_branch(w.node, other))
            values = w.formal[taken]
            producer = values[0].producer() if values else None
            graph = labels.get(id(producer.graph), "main") if producer is not None and producer.graph else "main"
            records.append(FusionRecord(
                pattern=RESOLVED, node=w.label, removed=(w.label,), produced=taken, graph=graph,
                detail=f"If '{w.label}' resolved to its {taken}: {w.nodes[taken]} nodes inlined",
                output=values[0].name or "" if values else ""))
        return records


def _branch(node: ir.Node, name: str) -> ir.Graph | None:
    attr = node.attributes.get(name)
    return attr.value if attr is not None and attr.type == ir.AttributeType.GRAPH else None


def _drop_readers(graph: ir.Graph) -> None:
    """The nodes of a branch no longer read anything (so what only they read is unused)."""
    for node in graph.all_nodes():
        for i in range(len(node.inputs)):
            node.replace_input_with(i, None)


def guard(model: ir.Model) -> Watch:
    """Guard every If's branch outputs (rule 4) and note the Ifs (rule 5), before a fold."""
    watched, guards = [], []
    for scope in list(iter_scopes(model)):
        for node in scope.graph:
            if not is_op(node, "If"):
                continue
            formal, sizes = {}, {}
            for name in BRANCHES:
                branch = _branch(node, name)
                if branch is None:
                    continue
                guards += _guard_outputs(branch, node_label(node), name)
                formal[name], sizes[name] = list(branch.outputs), len(branch)
            watched.append(_Watched(node, node_label(node), list(node.outputs), formal, sizes))
    return Watch(model, watched, guards)


def _guard_outputs(branch: ir.Graph, owner: str, name: str) -> list[tuple[ir.Graph, int, ir.Node, ir.Value]]:
    guards = []
    seen: set[int] = set()
    for index, value in enumerate(list(branch.outputs)):
        producer = value.producer()
        computed = producer is not None and producer.graph is branch
        if computed and id(value) not in seen:
            seen.add(id(value))
            continue
        identity = ir.node("Identity", [value], name=f"{owner}/{name}/output_{index}",
                           outputs=[ir.Value(name=f"{value.name}.{owner}.{name}.{index}", shape=value.shape,
                                             type=value.type)])
        identity.meta[GUARD] = True
        branch.append(identity)
        branch.outputs[index] = identity.outputs[0]
        guards.append((branch, index, identity, value))
    return guards
