"""``cleanup``: constant subexpressions folded, no Identity, nothing dead (before and after the folds).

Exporters write per-channel biases as ``Add(conv, Reshape(Constant))``, shapes as
``Shape -> Gather -> Unsqueeze`` on constants, and leave Identity nodes and, after
fusion, Constant nodes nothing reads. The folds see a constant only when it is one, so
the pipeline runs this pass before them (the Reshape of a constant becomes an
initializer the fold can absorb) and after them (what they left unused goes).

Steps, each a well-kept pass where one exists:

1. constant folding - onnxscript's ``fold_constants``: every node whose inputs are all
   constant is evaluated and replaced by its value, including shape arithmetic on static
   shapes and the slices an exporter takes of a weight (inputs up to 4M elements,
   outputs within onnxscript's limit); never the quantisation ops, whose Q/DQ pairs a
   quantised runtime reads;
2. constant lifting - onnx-ir's ``LiftConstantsToInitializersPass``: Constant nodes
   become initializers (ONNX Runtime does this itself when it loads a model);
3. Identity elimination - ``y = Identity(x)`` is removed and its readers read ``x``;
   where ``y`` is a graph output, ``x`` takes its name (the graph's contract is kept);
   an Identity between a graph input and a graph output stays. (onnx-ir's
   ``IdentityEliminationPass`` fails on a value that is the output of a subgraph and of
   its Identity, as silero-vad's If branches have; this step skips exactly those.)
4. dead-code removal - onnx-ir's ``RemoveUnusedNodesPass``: nodes and initializers no
   output depends on.

Legality: each step computes the same outputs from the same inputs; graph input and
output names never change. Folded values are computed by onnxscript's reference
evaluation, and verification compares the result with the unrewritten model like any
rewrite. Ops of unknown domains are never evaluated.
"""

from __future__ import annotations

__all__ = ["CleanupPass"]

import logging

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common
import onnxscript.optimizer

from opfuse.analyse import iter_scopes
from opfuse.passes.base import OpfusePass
from opfuse.vocabulary import count_ops, is_onnx, is_op

logger = logging.getLogger(__name__)


class CleanupPass(OpfusePass):
    name = "cleanup"
    options = frozenset({"fold_constants"})

    def __init__(self, report=None, fold_constants: bool = True, **options):
        super().__init__(report, **options)
        self.fold_constants = fold_constants
        self.removed: dict[str, int] = {}  # op label -> nodes gone, over all runs

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        before = _all_ops(model)
        if self.fold_constants:
            _fold_constants(model)
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
        _eliminate_identities(model)
        common.RemoveUnusedNodesPass()(model)
        after = _all_ops(model)
        gone = before - after
        for op, n in gone.items():
            self.removed[op] = self.removed.get(op, 0) + n
        return ir.passes.PassResult(model, modified=before != after)

    def summary(self) -> str:
        """One line for the report: how many nodes went, by op."""
        total = sum(self.removed.values())
        if not total:
            return ""
        shown = ", ".join(f"{n} {op}" for op, n in sorted(self.removed.items(), key=lambda kv: -kv[1])[:6])
        return (f"clean-up: {total} node(s) removed (constants folded into initializers, Identity "
                f"and unused nodes): {shown}{', ...' if len(self.removed) > 6 else ''}")


KEEP = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")  # a quantised model's structure
FILL_LIMIT = 1 << 16  # ConstantOfShape outputs folded up to this many elements
INPUT_LIMIT = 1 << 22  # constant inputs up to this many elements (a weight sliced by an exporter)
GROWTH_LIMIT = 1.01  # folding may grow the stored constants by 1% at most


def _constant_bytes(model: ir.Model) -> int:
    total = 0
    for scope in iter_scopes(model):
        for value in getattr(scope.graph, "initializers", {}).values():
            if value.const_value is not None:
                total += value.const_value.nbytes
        for node in scope.graph:
            if is_op(node, "Constant") and node.outputs[0].const_value is not None:
                total += node.outputs[0].const_value.nbytes
    return total


def _fold_constants(model: ir.Model) -> None:
    """Fold with large inputs allowed, unless that grows the weights (a weight another
    branch still reads in full would be stored twice); then with onnxscript's own limit."""
    before = _constant_bytes(model)
    for limit in (INPUT_LIMIT, None):
        work = model.clone() if limit is not None else model
        try:
            onnxscript.optimizer.fold_constants(
                work, should_fold=_foldable,
                onnx_shape_inference=True, **({"input_size_limit": limit} if limit else {}))
        except Exception as e:  # noqa: BLE001 - a folding failure only leaves constants unfolded
            logger.info("constant folding skipped: %s", e)
            return
        if limit is None:
            return
        common.RemoveUnusedNodesPass()(work)
        if _constant_bytes(work) <= before * GROWTH_LIMIT + 4096:
            _adopt(model, work)
            return


def _adopt(model: ir.Model, work: ir.Model) -> None:
    """Make ``model`` the folded copy (the pipeline holds ``model`` by reference)."""
    model.graph = work.graph
    functions = dict(work.functions)  # the copy's (the two may share the container)
    model.functions.clear()
    model.functions.update(functions)


def _foldable(node: ir.Node) -> bool | None:
    """Which nodes constant folding may evaluate (None: onnxscript's own size rules).

    Only default-domain ops; never the quantisation ops (their Q/DQ pairs are the model's
    meaning for a quantised runtime); a ConstantOfShape only when what it fills is small.
    """
    if not is_onnx(node) or node.op_type in KEEP:
        return False
    if node.op_type == "ConstantOfShape":
        shape = node.inputs[0].const_value if node.inputs and node.inputs[0] is not None else None
        if shape is None:
            return False
        return int(np.prod(shape.numpy(), dtype=np.int64)) <= FILL_LIMIT
    return None


def _all_ops(model: ir.Model):
    return count_ops(node for scope in iter_scopes(model) for node in scope.graph)


def _eliminate_identities(model: ir.Model) -> int:
    outputs_anywhere = {id(v) for scope in iter_scopes(model) for v in scope.graph.outputs}
    removed = 0
    for scope in iter_scopes(model):
        graph = scope.graph
        for node in list(graph):
            if not is_op(node, "Identity") or not node.inputs or node.inputs[0] is None:
                continue
            x, y = node.inputs[0], node.outputs[0]
            if id(y) not in outputs_anywhere:
                y.replace_all_uses_with(x)
                graph.remove(node, safe=True)
                removed += 1
                continue
            # y is an output: x can take its place only if x is this graph's own computed value
            if (y not in graph.outputs or id(x) in outputs_anywhere or x.is_graph_input()
                    or x.is_initializer() or x.producer() is None or x.producer().graph is not graph):
                continue
            positions = [i for i, v in enumerate(graph.outputs) if v is y]
            name, shape, type_ = y.name, y.shape, y.type
            y.replace_all_uses_with(x)
            for i in positions:
                graph.outputs[i] = x
            graph.remove(node, safe=True)
            x.name = name
            if x.type is None:
                x.type = type_
            if x.shape is None:
                x.shape = shape
            outputs_anywhere.add(id(x))
            removed += 1
    return removed
