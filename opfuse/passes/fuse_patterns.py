"""Fuse multi-op patterns into the op the target runs: one adapter for onnxscript's rewriter.

A pattern (LayerNorm, GELU, SiLU, HardSwish, attention...) is a set of onnxscript rewrite
rules, each ``pattern`` (what to match), ``check`` (is it legal here, with a reason) and
``rewrite`` (what to emit), in :mod:`opfuse.passes.patterns`, one module per pattern with
its algebra and legality rules. This pass runs, in the catalogue's order, the patterns the
target's policy says to ``fuse`` (:class:`~opfuse.targets.kernels.Target`), in the op form
the target runs (standard ONNX at the model's opset, or ONNX Runtime's contrib ops), and
makes each outcome opfuse's own:

1. **A rewrite** is a :class:`~opfuse.report.FusionRecord`: the nodes removed, the ones
   produced (named after the nodes they replace), and the tensor the result computes, which
   keeps the replaced tensor's name, so verification checks every rewrite at its own tensor
   like a fold.
2. **A match whose check fails** (the whole pattern is there, a legality condition is not)
   is a :class:`~opfuse.report.Refusal` with the rule's reason; so is a match of three or
   more nodes whose inner tensors are used outside it (a graph output, another consumer).
   Partial matches are not reported (they are not the pattern), nor are checks that answer
   a bare False (the rule's way to say "not this pattern": a MatMul of rank 3 for Gemm).
3. A match the pass rewrote through another rule (a commuted variant, a later round) keeps
   no refusal: only roots still in the graph at the end are reported.
4. **A rule that raises** (in its check or its rewrite) is a refusal with the exception's
   first line; the nodes its rewrite built are dropped, and the other rewrites go on.
5. **What a rule declares** is done as onnxscript's ``RewriteRuleSet`` does it:
   ``remove_nodes=False`` replaces only the match's outputs and keeps the matched nodes
   still used elsewhere (``ExtractDim``'s shape Concat feeding other Reshapes); the
   ``graph_pre_visitor``/``graph_post_visitor`` run before and after each graph or
   function; a ``verbose`` rule prints its matches. ``as_function`` (the match kept as a
   model-local function) is refused with a reason: opfuse does not write one.
6. **A record's label** is the pattern's source and the op type written ("SiLU->QuickGelu"),
   one record per node written: a rewrite of a node an earlier rewrite wrote (attention's
   intermediate SDPA, a LayerNormalization taking a scale) takes that record in.

A pattern the target fuses but whose policy does not hold in this graph (a
:class:`~opfuse.targets.kernels.PolicyException`: attention in a KV-cache decode step at
ONNX Runtime) is not run; each site the exception names is a refusal with its reason.

First, an op the target says to ``unfuse`` (:attr:`Target.unfused_ops`) is expanded into
its ONNX function body (:mod:`opfuse.passes.patterns.unfuse`), recorded like a rewrite.
Before the rules, a commutative op's constant operand is put second (exact; the rules that
onnxscript cannot commute are written that way). Rewrites inside functions that would add
initializers are skipped, as onnxscript does.
Approximations (a tanh GELU for an erf one) are never among the rules unless the caller
asks for them (``approximate``); then their records say so.
"""

from __future__ import annotations

__all__ = ["PatternFusionPass", "patterns_that_could_match"]

import collections
import dataclasses
import functools
import os

import onnx_ir as ir
from onnx_ir import convenience
from onnxscript.optimizer import basic_constant_propagation
from onnxscript.rewriter.pattern import MatchingTracer, MatchStatus
from onnxscript.rewriter._ir_utils import display_nodes  # (private: the display a verbose rule asks for)

from opfuse.core.analysis import NameTable, Scope, describe, infer_shapes, iter_scopes, node_label
from opfuse.passes.base import OpfusePass
from opfuse.passes.pattern_gate import patterns_that_could_match, usable_rules, written_ops  # (the first re-exported)
from opfuse.passes.patterns import PATTERN_ORDER, forget_matches, pattern_rules
from opfuse.passes.patterns.unfuse import unfuse_ops
from opfuse.report import FusionRecord, Refusal
from opfuse.targets.kernels import Target, load_target
from opfuse.core.symbolic_shapes import infer_symbolic_shapes
from opfuse.core.edit import drop_if_unused
from opfuse.core.ops import ONNX_DOMAINS, is_op

_OTHER_USES = "Matched nodes have other uses"  # onnxscript's reason for an unremovable match
_NO_REASON = "Condition function check failed"  # onnxscript's message for a check that returned False
# an unremovable match this small (a layer and the op after it) is a use, not a pattern to explain
_MIN_PATTERN_NODES = 3
# ops a rule writes around the op it fuses (layouts, shapes); a record names the op they surround
_PLUMBING = frozenset({"Identity", "Reshape", "Transpose", "Expand", "Concat", "Shape", "Slice", "Squeeze",
                       "Unsqueeze", "Cast", "Gather"})


class _Refusals(MatchingTracer):
    """onnxscript's tracer hook, keeping only full matches that failed (rule 2). A check
    that returns a bare False (no reason) says "not this pattern", not a refusal."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: dict[tuple[str, int], tuple] = {}  # (node, title, reason, matched nodes)
        self.title = ""  # the pattern being run

    def log(self, rule, container, node, match_result, status) -> None:
        reason = getattr(match_result, "reason", "") or ""
        unremovable = (status == MatchStatus.NO_MATCH and reason.startswith(_OTHER_USES)
                       and len(getattr(match_result, "nodes", ())) >= _MIN_PATTERN_NODES)
        if status == MatchStatus.CONDITION_FAILED and reason != _NO_REASON or unremovable:
            if reason.startswith(_OTHER_USES):
                reason = ("a tensor inside the pattern is used outside it (by another node or as a graph "
                          "output), so the pattern's nodes must stay")
            matched = tuple(n for n in getattr(match_result, "nodes", ()) if n is not node)
            self.failed.setdefault((self.title, id(node)), (node, self.title, reason, matched))


class PatternFusionPass(OpfusePass):
    """Rewrite the target's multi-op patterns with onnxscript rules (module docstring)."""

    name = "fuse-patterns"
    options = frozenset({"target", "approximate"})

    def __init__(self, report=None, *, target: Target | str = "onnx", approximate: bool = False):
        super().__init__(report)
        self.target = load_target(target) if isinstance(target, str) else target
        self.approximate = approximate
        self._made: dict[ir.Node, tuple[FusionRecord, str]] = {}  # node written -> its record, pattern

    def release(self) -> None:
        self._made.clear()

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        patterns = [p for p in PATTERN_ORDER if self.target.policy(p) == "fuse" and not self._excepted(model, p)]
        unfused = self._unfuse(model) if self.target.unfused_ops else False
        if not patterns:
            return ir.passes.PassResult(model, modified=unfused)
        present = collections.Counter(_key(n) for scope in iter_scopes(model) for n in scope.graph)
        if not any(_could_match(pattern_rules(p, self.target, approximate=self.approximate), present)
                   for p in patterns):  # (then no shape inference: on a 48k-node conv chain it was most of the run)
            return ir.passes.PassResult(model, modified=unfused)
        names = NameTable(model)
        _constants_second(model)
        _scalar_constants(model, names)
        infer_shapes(model)  # the rules check dtypes and shapes
        if {"attention", "rotary"} & set(patterns):
            infer_symbolic_shapes(model)  # attention's and rotary's checks compare [B, H, S, Dh] dims by name
        modified = False
        tracer = _Refusals()
        for name in patterns:
            found = pattern_rules(name, self.target, approximate=self.approximate)
            tracer.title = found.title
            if found.transactional:
                changed = self._transaction(model, found, tracer, present)
                if changed:
                    names = NameTable(model)  # the graph is the trial's now
            else:
                changed = self._stages(model, found, tracer, names, self.report.records, present)
            if changed:
                modified = True
                infer_shapes(model)  # new intermediate values for the next pattern's checks
        for node, rule, reason, matched in tracer.failed.values():
            if node.graph is not None:
                self.refuse(rule, node, reason, scope=_scope_of(model, node),
                            also=tuple(n for n in matched if n.graph is not None))
        return ir.passes.PassResult(model, modified=modified or unfused)

    def _excepted(self, model: ir.Model, pattern: str) -> bool:
        """Whether ``model`` is an exception to the target's policy for ``pattern``; if so, one
        refusal per site it names, with the exception's reason."""
        found = self.target.exception(pattern, model)
        if found is None:
            return False
        exception, sites = found
        title = pattern_rules(pattern, self.target, approximate=self.approximate).title
        for site, others in sites:
            self.refuse(title, site, exception.reason, also=others)
        return exception.policy != "fuse"

    def _unfuse(self, model: ir.Model) -> bool:
        """The ops the target cannot run, expanded into their ONNX function bodies
        (:mod:`opfuse.passes.patterns.unfuse`), each a record verified at its output."""
        infer_shapes(model)  # a context-dependent body needs its inputs' types

        def record(node, function):
            self.report.records.append(FusionRecord(
                pattern=f"unfuse {node.op_type}", node=node_label(node), removed=(node_label(node),),
                produced=f"{len(function)} nodes of its ONNX function body", detail=(
                    f"{self.target.title} cannot run {node.op_type}: expanded into its function body"),
                output=node.outputs[0].name or ""))

        def refuse(node, reason):
            self.refuse(f"unfuse {node.op_type}", node, f"{self.target.title} cannot run it, and {reason}")

        return unfuse_ops(model, self.target.unfused_ops, refuse, record)

    def _stages(self, model, found, tracer, names, records, present) -> bool:
        changed = False
        for stage in found.stages:
            for scope in list(iter_scopes(model)):
                if self._apply(model, scope, found, stage, tracer, names, records, present):
                    changed = True
        return changed

    def _transaction(self, model, found, tracer, present) -> bool:
        """Stages whose intermediate ops (``found.intermediate_domains``) must all be consumed
        by a later stage: run on a copy, kept only when none is left and the graph got
        smaller (a rewrite that adds nodes around the fused op is not the fusion asked for)."""
        trial = model.clone()
        records: list[FusionRecord] = []
        if not self._stages(trial, found, tracer, NameTable(trial), records, present):
            return False
        left = [n for scope in iter_scopes(trial) for n in scope.graph if n.domain in found.intermediate_domains]
        if left:
            for node in left:
                self.refuse(found.title, node, (
                    f"its first stage matched, but a later one did not take the intermediate "
                    f"{node.op_type}, so the whole {found.title} rewrite is left out"), scope=None)
            return False
        before, after = _node_count(model), _node_count(trial)
        if after >= before:
            roots = [n for n in model.graph if n.op_type == "Softmax"][:1] or list(model.graph)[:1]
            for node in roots:
                self.refuse(found.title, node, (
                    f"the rewrite matched, but the graph would have {after} nodes instead of {before} (the "
                    "exporter's shape arithmetic keeps reshapes around each attention op), so it is left out"),
                    scope=None)
            return False
        model.graph = trial.graph  # (an in-place pass: the model object stays the caller's)
        model.opset_imports.update(trial.opset_imports)
        self.report.records.extend(records)
        return True

    def _apply(self, model, scope: Scope, found, rules, tracer, names: NameTable, records,
               present: collections.Counter) -> bool:
        """One stage's rules over one graph or function, as onnxscript's ``RewriteRuleSet``
        applies them, honouring what each rule declares (:func:`_declared`). A rule is tried only
        while the model holds the nodes its pattern needs (:func:`~opfuse.passes.pattern_gate.usable_rules`; ``present``, the model's
        ops, only grows: the ops each rewrite writes are added, none taken away)."""
        container = scope.container
        rules = self._set_up(scope, found, rules)
        usable, waiting = usable_rules(rules, present)
        by_root, anywhere = _index(usable)
        changed = False
        for node in container:
            key = _key(node)
            for rule in (*by_root.get(key, ()), *anywhere):
                try:
                    delta = rule.try_rewrite(model, container, node, tracer=tracer)
                except Exception as error:  # a rule's own fault: its refusal, and the other rewrites go on
                    _drop_detached_uses(model)  # (nodes its rewrite built before it raised)
                    tracer.failed[(found.title, id(node))] = (
                        node, found.title, f"rule {rule.name or type(rule).__name__} failed: {_first_line(error)}", ())
                    continue
                if delta is None:
                    continue
                if delta.new_initializers and scope.function is not None:
                    _discard(delta)  # functions have no initializers (onnxscript skips these too)
                    continue
                if rule.as_function:
                    _discard(delta)
                    tracer.failed[(found.title, id(node))] = (node, found.title, (
                        f"rule {rule.name} asks for the matched nodes to become a model-local function "
                        "(as_function), which opfuse does not write"), tuple(delta.match.nodes))
                    continue
                for initializer in delta.new_initializers:
                    initializer.name = names.fresh(initializer.name or "pattern_constant")
                    scope.graph.register_initializer(initializer)
                basic_constant_propagation(delta.new_nodes)
                matched = list(delta.match.nodes)
                outputs = [v.name for v in delta.match.outputs]
                stem = _stem(matched)
                kept = {id(v) for v in delta.new_outputs}  # (these take the replaced tensors' names)
                for new in delta.new_nodes:
                    if not new.name:
                        new.name = names.fresh(f"{stem}{new.op_type}")
                    for i, value in enumerate(new.outputs):  # never a name the run has seen (NameLedger)
                        if not value.name and id(value) not in kept:
                            value.name = names.fresh(f"{new.name}_output_{i}")
                if getattr(rule, "_verbose", 0):  # (onnxscript's private attribute and display helper)
                    print(f"----{rule.name or ''}: matched nodes----")
                    display_nodes(matched)
                    print("++++replacement nodes++++")
                    display_nodes(delta.new_nodes)
                removed = _replace(container, node, rule, delta, names)
                for new in delta.new_nodes:
                    if new.domain and new.domain not in model.opset_imports:
                        model.opset_imports[new.domain] = 1
                present.update(written := written_ops(delta.new_nodes))
                if waiting and any(op in waiting for op in written):  # a rule may find its ops now
                    usable, waiting = usable_rules(rules, present)
                    by_root, anywhere = _index(usable)
                record, main = _record(scope, found, rule, matched, removed, delta, outputs)
                self._add_record(records, record, main, matched, found.title)
                changed = True
                break
        for rule in _unique_visitors(rules, "graph_post_visitor"):
            try:
                rule.graph_post_visitor()
            except Exception as error:
                self.refusals.append(Refusal(found.title, "", (
                    f"rule {rule.name or type(rule).__name__} could not clean up: {_first_line(error)}"),
                    graph=scope.label))
        forget_matches(rules)
        return changed

    def _set_up(self, scope: Scope, found, rules) -> tuple:
        """The stage's rules after their ``graph_pre_visitor`` (onnxscript calls it before
        each graph or function); a rule whose set-up raises is left out of this graph, with
        a refusal saying so."""
        failed = set()
        for rule in _unique_visitors(rules, "graph_pre_visitor"):
            try:
                rule.graph_pre_visitor()
            except Exception as error:
                failed.add(rule.graph_pre_visitor)
                self.refusals.append(Refusal(found.title, "", (
                    f"rule {rule.name or type(rule).__name__} could not set up: {_first_line(error)}"),
                    graph=scope.label))
        return rules if not failed else tuple(r for r in rules if r.graph_pre_visitor not in failed)

    def _add_record(self, records: list, record: FusionRecord, main, matched, title: str) -> None:
        """Append a rewrite's record; one that rewrote the node an earlier rewrite of this
        pass produced (attention's intermediate SDPA, a LayerNormalization taking a scale, an
        Add taken into a fused norm) takes that record in: one record per node written. A
        later stage of the same pattern keeps the first stage's source ("attention->"), a
        later pattern its own ("Add+LayerNormalization->")."""
        for node in matched:
            previous, previous_title = self._made.pop(node, (None, None))
            index = next((i for i, r in enumerate(records) if r is previous), None)
            if index is None:
                continue
            del records[index]
            label = record.pattern
            if previous_title == title:
                label = f"{previous.pattern.partition('->')[0]}->{record.pattern.partition('->')[2]}"
            kept = [n for n in record.removed if n != previous.node]
            record = dataclasses.replace(
                record, pattern=label, removed=tuple(dict.fromkeys((*previous.removed, *kept))),
                detail=f"{record.detail}; took in {previous.pattern} at '{previous.node}'")
        records.append(record)
        if main is not None:
            self._made[main] = (record, title)


def _key(node: ir.Node) -> tuple[str, str]:
    """(domain, op) of a node, the ONNX domain's aliases as ""."""
    return ("" if node.domain in ONNX_DOMAINS else node.domain), node.op_type


def _could_match(found, present: collections.Counter) -> bool:
    """Whether some stage of ``found`` has a rule whose root op is in the model (or a rule
    that can root anywhere)."""
    for stage in found.stages:
        by_root, anywhere = _index(stage)
        if anywhere or any(present[k] for k in by_root):
            return True
    return False


@functools.cache
def _index(rules: tuple) -> tuple[dict[tuple[str, str], tuple], tuple]:
    """The rules by the (domain, op) of their pattern's output node, which a match's root
    must be (onnxscript's matcher fails any other node first, but only after a Python call
    per rule per node; with several output nodes it matches the node given against the first);
    rules whose op is not one fixed name are tried everywhere."""
    by_root: dict[tuple[str, str], list] = {}
    anywhere = []
    for rule in rules:
        root = _root_op(rule)
        if root is None:
            anywhere.append(rule)
        else:
            by_root.setdefault(root, []).append(rule)
    return {k: tuple(v) for k, v in by_root.items()}, tuple(anywhere)


def _root_op(rule) -> tuple[str, str] | None:
    """(domain, op) the rule's output node (its first, with several) must have; None when its op
    is not one fixed name (onnxscript's private pattern objects; absent: None)."""
    graph = getattr(rule, "_target_pattern", None)
    if graph is None or not graph.output_nodes:
        return None
    node = graph.output_nodes[0]
    op, domain = getattr(node, "op", None), getattr(node, "domain", None)
    if not (hasattr(op, "value") and hasattr(domain, "value")) or type(op).__name__ != "StringConstantPattern":
        return None
    return ("" if domain.value() in ONNX_DOMAINS else domain.value()), op.value()


def _record(scope, found, rule, matched, removed, delta, outputs) -> tuple[FusionRecord, ir.Node | None]:
    """The rewrite's record and the node it wrote (the last one not :data:`_PLUMBING`, else the
    producer of its first output). Its label
    is the pattern's source (the module's ``TITLE`` or ``RECORD_TITLES`` before "->") and the op
    type actually written ("SiLU->QuickGelu"); a title without "->" is kept when it is that op."""
    produced = delta.new_nodes
    real = [n for n in produced if n.op_type != "Constant"]
    computing = [n for n in real if n.op_type not in _PLUMBING]  # (an MHA's Transpose/Reshape around it aside)
    main = next((v.producer() for v in delta.new_outputs if v.producer() in produced), None)
    main = computing[-1] if computing else (main or (real[-1] if real else (produced[-1] if produced else None)))
    title = found.record_titles.get(rule.name, found.title)
    source, _, written = title.partition("->")
    op = main.op_type if main is not None else "nothing"
    if op == "If":  # (a branch chosen at run time: the ops its then-branch writes, "If(Attention)")
        inner = [n.op_type for n in main.attributes["then_branch"].value if n.op_type not in _PLUMBING]
        op = f"If({', '.join(dict.fromkeys(inner))})"
    label = title if not written and source == op else f"{source}->{op}"
    approximate = "approximat" in (rule.name or "")
    kept = len(matched) - len(removed)
    return FusionRecord(
        pattern=label,
        node=node_label(main) if main is not None else "",
        removed=tuple(node_label(n) for n in removed),
        produced=", ".join(describe(n) for n in real),
        graph=scope.label,
        detail=("an approximation (asked for with --approximate); " if approximate else "")
               + f"rule {rule.name}: {len(matched)} nodes -> {len(real)}"
               + (f" ({kept} matched node(s) kept: still used outside the match)" if kept else ""),
        output=outputs[0] if outputs else "",
    ), main


def _replace(container, root: ir.Node, rule, delta, names: NameTable) -> list[ir.Node]:
    """Put the delta in place as onnxscript's ``RewriteRuleSet`` does, and return the nodes
    removed. A rule declared ``remove_nodes`` (onnxscript checked them removable) loses all
    its matched nodes; one declared ``remove_nodes=False`` (``ExtractDim``, whose matched
    shape Concat may feed other Reshapes) only has its outputs replaced, and keeps the
    matched nodes still used: onnxscript removes the unused ones afterwards, here right
    away (the same nodes). A kept node's replaced output gives its name to the new value
    (which computes the same tensor) and takes a fresh one. The graph is sorted when a node
    before the new ones reads one of their outputs (a KV cache's present,
    :mod:`~opfuse.passes.patterns.kv_cache`)."""
    matched = list(delta.match.nodes)
    if rule.remove_nodes:
        convenience.replace_nodes_and_values(container, root, matched, delta.new_nodes,
                                             delta.match.outputs, delta.new_outputs)
        _sort_if_read_before(container, delta)
        return matched
    old_names = [v.name for v in delta.match.outputs]
    convenience.replace_nodes_and_values(container, root, [], delta.new_nodes, delta.match.outputs,
                                         delta.new_outputs)
    removed, pending = [], [n for n in matched if n.graph is not None]
    while True:
        dead = [n for n in pending if all(not v.uses() and not v.is_graph_output() for v in n.outputs)]
        if not dead:
            break
        container.remove(dead, safe=True)
        removed += dead
        pending = [n for n in pending if n not in dead]
    for old, name in zip(delta.match.outputs, old_names):
        if old.producer() in pending and name:
            old.name = names.fresh(name)
    _sort_if_read_before(container, delta)
    return removed


def _sort_if_read_before(container, delta) -> None:
    """The new nodes sit where the match's root was; with several outputs (a KV cache's
    presents), an earlier one may be read by a node before that place: sort the graph then."""
    if len(delta.new_outputs) < 2 or not hasattr(container, "sort"):
        return
    position = {node: i for i, node in enumerate(container)}
    first = min((position[n] for n in delta.new_nodes if n in position), default=None)
    if first is not None and any(position.get(use.node, first) < first
                                 for value in delta.new_outputs for use in value.uses()):
        container.sort()


def _discard(delta) -> None:
    """Detach the nodes a delta built (the TapeBuilder made them users of graph values)."""
    for node in delta.new_nodes:
        for i in range(len(node.inputs)):
            node.replace_input_with(i, None)


def _drop_detached_uses(model: ir.Model) -> None:
    """After a rule raised midway through its rewrite: the nodes it built are in no graph but
    are still users of graph values, which would make the matched nodes look used; drop
    those uses."""
    for scope in iter_scopes(model):
        values = [*scope.container.inputs, *scope.graph.initializers.values(),
                  *(v for n in scope.graph for v in n.outputs)]
        for value in values:
            for user, index in list(value.uses()):
                if user.graph is None:
                    user.replace_input_with(index, None)


def _unique_visitors(rules, visitor: str) -> list:
    """One rule per distinct ``graph_pre_visitor``/``graph_post_visitor`` (a rule's commuted
    variants share their instance's), skipping rules that declare none."""
    seen, found = set(), []
    for rule in rules:
        method = getattr(rule, visitor, None)
        if method is not None and method not in seen:
            seen.add(method)
            found.append(rule)
    return found


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _node_count(model: ir.Model) -> int:
    """Nodes the main graph's outputs depend on (dead ones, which clean-up removes, not
    counted), Constants aside."""
    live, stack = set(), [v.producer() for v in model.graph.outputs]
    while stack:
        node = stack.pop()
        if node is None or node in live:
            continue
        live.add(node)
        stack += [v.producer() for v in node.inputs if v is not None]
        for attr in node.attributes.values():  # a subgraph's outer reads keep their producers
            graphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
                list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])
            for graph in graphs:
                stack += [v.producer() for n in graph for v in n.inputs if v is not None and v.graph is not graph]
    return sum(1 for n in live if n.op_type != "Constant")


def _constants_second(model: ir.Model) -> None:
    """Put the constant operand of a commutative binary op (Add, Mul) second, as most rules
    are written (exact: IEEE addition and multiplication commute). onnxscript commutes a
    rule's own operands, but not those of rules written with its OrValue (SkipLayerNorm's)."""
    for scope in iter_scopes(model):
        for node in scope.graph:
            if not (is_op(node, "Add", "Mul") and len(node.inputs) == 2):
                continue
            a, b = node.inputs
            if a is not None and b is not None and _is_constant(a) and not _is_constant(b):
                node.replace_input_with(0, b)
                node.replace_input_with(1, a)


def _scalar_constants(model: ir.Model, names: NameTable) -> None:
    """A one-element constant of shape [1] read by a Where beside a tensor of rank 1 or more
    becomes a scalar (exact: the output's rank and values are the same), as attention's rule
    matches it (the TorchScript exporter writes its NaN guard ``Where(IsNaN(p), [0.0], p)``)."""
    made: dict[int, ir.Value] = {}
    replaced = []
    for node in model.graph:
        if not is_op(node, "Where"):
            continue
        ranks = [len(v.shape) if v is not None and v.shape is not None else None for v in node.inputs]
        for i, value in enumerate(node.inputs):
            tensor = value.const_value if value is not None and _is_constant(value) else None
            if tensor is None or tuple(tensor.shape) != (1,):
                continue
            if not any(r is not None and r >= 1 for j, r in enumerate(ranks) if j != i):
                continue
            if id(value) not in made:
                scalar = ir.Value(name=names.fresh(f"{value.name}_scalar"), shape=ir.Shape([]), type=value.type,
                                  const_value=ir.tensor(tensor.numpy().reshape(())))
                model.graph.register_initializer(scalar)
                made[id(value)] = scalar
                replaced.append(value)
            node.replace_input_with(i, made[id(value)])
    for value in replaced:
        drop_if_unused(value)


def _is_constant(value: ir.Value) -> bool:
    producer = value.producer()
    return (value.is_initializer() and not value.is_graph_input()) or is_op(producer, "Constant")


def _stem(nodes) -> str:
    """The matched nodes' common name prefix up to a '/', so the new node sits beside them
    in the exporter's hierarchy ("/encoder/layer.0/ln/"); empty when they share none."""
    named = [n.name for n in nodes if n.name]
    if not named:
        return ""
    prefix = os.path.commonprefix(named)
    return prefix[: prefix.rfind("/") + 1] if "/" in prefix else ""


def _scope_of(model: ir.Model, node: ir.Node) -> Scope | None:
    for scope in iter_scopes(model):
        if node.graph is scope.graph:
            return scope
    return None

