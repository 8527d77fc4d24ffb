"""Whether a pattern could match a graph, from the ops its rules name, without running a rule:
the gate of the measured choice (:mod:`opfuse.tune` builds no variant for a family none of whose
patterns could match: each build is a whole optimiser run).

The answer is a necessary condition, never a sufficient one: a rule's pattern needs, in the graph,
each node whose op is one fixed name, as many as the pattern has (SDPA: two MatMul), where an
alternative (onnxscript's ``OrValue``: ``Mul | Div | nothing`` for a scale) needs only what all
its branches need. A later stage's ops made by an earlier one are found there, since any stage's
rule may answer; except for a staged pattern that names its ``ENTRY_STAGE`` (attention: the SDPA
stage), whose earlier stages alone fuse nothing (attention's shape rule matches most CNNs): that
stage's rule must find its ops, less those an earlier stage's rules name (which they may have made).

The pattern pass asks the same of each rule as it runs (:func:`usable_rules`): a rule is tried at a
node only while the model holds the nodes its pattern needs, the ops its rewrites write counted in
(:func:`written_ops`) and none taken away, so a rule left out could not have matched.

A family's own pass is gated the same way by the ops it declares it needs
(:attr:`opfuse.passes.base.OpfusePass.requires_ops`: ``fuse-dynamic-int8`` needs a MatMulInteger).
"""

from __future__ import annotations

__all__ = ["patterns_that_could_match", "passes_that_could_run", "required_ops", "usable_rules", "written_ops"]

import collections
import functools

import onnx_ir as ir

from opfuse.core.analysis import iter_scopes
from opfuse.core.ops import ONNX_DOMAINS
from opfuse.passes import pass_class
from opfuse.passes.patterns import rules_in_form
from opfuse.targets.kernels import Target


def patterns_that_could_match(model: ir.Model, target: Target, patterns, *, forms=("standard", "onnxruntime"),
                              approximate: bool = False) -> set[str]:
    """The ``patterns`` some rule of which, in any of ``forms`` or the target's own, could match
    ``model`` (module docstring)."""
    present = collections.Counter(("" if n.domain in ONNX_DOMAINS else n.domain, n.op_type)
                                  for scope in iter_scopes(model) for n in scope.graph)
    found = set()
    for pattern in patterns:
        options = {target.form(pattern), *forms}
        if any(_stage_could_match(rules_in_form(pattern, form, approximate=approximate), present)
               for form in options):
            found.add(pattern)
    return found


def passes_that_could_run(model: ir.Model, names) -> set[str]:
    """The passes of ``names`` that could change ``model``: those declaring no required ops
    (:attr:`opfuse.passes.base.OpfusePass.requires_ops`), and those whose ops it holds."""
    required = {name: pass_class(name).requires_ops for name in names}
    if not any(required.values()):
        return set(names)
    present = {n.op_type for scope in iter_scopes(model) for n in scope.graph}
    return {name for name, ops in required.items() if not ops or ops & present}


def _stage_could_match(found, present: collections.Counter) -> bool:
    """Whether a rule of ``found`` finds its ops in ``present`` (module docstring)."""
    def finds(rule, earlier=frozenset()) -> bool:
        return all(n <= present[op] for op, n in required_ops(rule).items() if op not in earlier)

    if found.entry_stage is None:
        return any(finds(rule) for stage in found.stages for rule in stage)
    earlier = frozenset().union(*(required_ops(rule) for stage in found.stages[:found.entry_stage]
                                  for rule in stage))
    return any(finds(rule, earlier) for rule in found.stages[found.entry_stage])


def required_ops(rule) -> collections.Counter:
    """How many nodes of each (domain, op) every match of the rule's pattern needs, counting the
    nodes whose op is one fixed name: those behind the pattern's outputs, where an alternative
    (onnxscript's ``OrValue``: ``Mul | Div | nothing`` for a scale) needs only what all its branches
    need. Empty when the pattern is not onnxscript's, which then could match."""
    graph = getattr(rule, "_target_pattern", None)
    if graph is None:
        return collections.Counter()
    memo: dict = {}
    nodes: dict = {}
    for value in graph.outputs:
        nodes.update(_needed(value, memo))
    return collections.Counter(nodes.values())


def _needed(value, memo: dict) -> dict:
    """The nodes every match of the value pattern ``value`` needs, {key: (domain, op)} (a node's key
    is itself; an op all of an alternative's branches need, through different nodes, gets a key
    of its own per node it needs)."""
    if id(value) in memo:
        return memo[id(value)]
    branches = getattr(value, "_values", None)  # onnxscript's BacktrackingOr
    if branches is None and hasattr(value, "_op_to_pattern"):  # its OpIdDispatchOr
        branches = [branch for _, branch in value._op_to_pattern.values()]
    producer = getattr(value, "producer", None)
    node = producer() if callable(producer) and branches is None else None
    found: dict = {}
    if branches:
        each = [_needed(branch, memo) for branch in branches]
        shared = set.intersection(*(set(b) for b in each))  # the same node in every branch
        found = {key: each[0][key] for key in shared}
        counts = [collections.Counter(op for key, op in b.items() if key not in shared) for b in each]
        for op in set.intersection(*(set(c) for c in counts)):
            found.update({(id(value), op, i): op for i in range(min(c[op] for c in counts))})
    elif node is not None:
        op, domain = getattr(node, "op", None), getattr(node, "domain", None)
        if type(op).__name__ == "StringConstantPattern" and hasattr(domain, "value"):
            found[id(node)] = ("" if domain.value() in ONNX_DOMAINS else domain.value(), op.value())
        for v in node.inputs:
            if v is not None:
                found.update(_needed(v, memo))
    memo[id(value)] = found  # (an input or a constant: no node)
    return found


def usable_rules(rules: tuple, present: collections.Counter) -> tuple[tuple, frozenset]:
    """The ``rules`` whose pattern's nodes ``present`` ((domain, op) counts) holds (:func:`required_ops`:
    a necessary condition, so a rule left out could not match), and the ops the others wait for. A
    tanh GELU's rules need a Tanh: on a graph without one, its commuted variants are not tried at
    every Mul."""
    usable, waiting = [], set()
    for rule in rules:
        missing = [op for op, n in _required(rule).items() if present[op] < n]
        if missing:
            waiting.update(missing)
        else:
            usable.append(rule)
    return tuple(usable), frozenset(waiting)


def written_ops(nodes) -> list[tuple[str, str]]:
    """(domain, op) of ``nodes`` and of the nodes of their subgraphs (an If a rewrite wrote), the ONNX
    domain's aliases as ""."""
    found = []
    for node in nodes:
        found.append(("" if node.domain in ONNX_DOMAINS else node.domain, node.op_type))
        for attr in node.attributes.values():
            graphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
                list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])
            for graph in graphs:
                found += written_ops(list(graph))
    return found


@functools.cache
def _required(rule) -> collections.Counter:
    return required_ops(rule)
