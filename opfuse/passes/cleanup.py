"""``cleanup``: constant subexpressions folded, no Identity, no repeated node, nothing dead (before and after the folds).

Exporters write per-channel biases as ``Add(conv, Reshape(Constant))``, shapes as
``Shape -> Gather -> Unsqueeze`` on constants, and leave Identity nodes and, after
fusion, Constant nodes nothing reads. The folds see a constant only when it is one, so
the pipeline runs this pass before them (the Reshape of a constant becomes an
initializer the fold can absorb) and after them (what they left unused goes).

Steps, each a well-kept pass where one exists:

0. shape values - shape arithmetic on static dims becomes constants
   (:mod:`opfuse.passes.shape_values`, from ONNX Runtime's symbolic shape inference: what
   step 1 cannot fold, since onnxscript reads no dim through a scalar Gather, Unsqueeze,
   Slice or arithmetic); run when the graph reads a shape, and again only when the graph
   changed since;
1. constant folding - onnxscript's ``fold_constants``: every node whose inputs are all
   constant is evaluated and replaced by its value, including shape arithmetic on static
   shapes and the slices an exporter takes of a weight (inputs up to 4M elements,
   outputs within onnxscript's limit); never the quantisation ops, whose Q/DQ pairs a
   quantised runtime reads. The folder infers shapes node by node (onnx's inference per
   node, most of this stage's time) only where a folding decision can read one:
   when the model has an op whose partial evaluation reads a shape or a type (Reshape,
   Shape, Size, Cast, Concat, Expand...; see :data:`SHAPE_READERS`), or when the shapes
   are wanted in the output (``--keep-shapes``). Otherwise it folds the same nodes
   without, and a pass that needs a shape infers it. An ``If`` whose condition folds to
   a constant (an input bound with ``--constant-input``, a shape made static) is replaced
   by the branch it takes, nested ones too, each recorded
   (:mod:`opfuse.passes.constant_branches`: the rules, and the guard that makes
   onnxscript's inlining keep the graph's outputs). A model with an ``If`` always gets
   this step, since the folder evaluates ``If`` (:func:`_could_fold`). When an ``If``
   was resolved, steps 0 and 1 run again (up to :data:`BRANCH_ROUNDS` times): the shape
   arithmetic of its branch, now in the main graph, may decide the Ifs inside it;
2. constant lifting - onnx-ir's ``LiftConstantsToInitializersPass``: Constant nodes
   become initializers (ONNX Runtime does this itself when it loads a model);
3. Identity elimination - ``y = Identity(x)`` is removed and its readers read ``x``;
   where ``y`` is a graph output, ``x`` takes its name (the graph's contract is kept);
   an Identity between a graph input and a graph output stays. (onnx-ir's
   ``IdentityEliminationPass`` fails on a value that is the output of a subgraph and of
   its Identity, as silero-vad's If branches have; this step skips exactly those.)
4. common subexpressions - onnx-ir's ``CommonSubexpressionEliminationPass``: a node with
   the same op, attributes and inputs as one before it is removed and its readers read
   the first (ONNX Runtime's dynamically quantised models compute each ``x_scale * w_scale``
   twice: 22 Mul in a CRNN); main graph only, not in a model that draws random numbers
   (two draws are not one), and only when asked (``eliminate_common``: the pipeline's run
   after the rewrites; before them, two convs of one input and one weight merged into one
   conv with two readers would keep a BatchNormalization from folding into either, where
   a private copy of the shared weight folds). Before it, in the same run, small integer
   initializers of equal type, shape and bytes (up to :data:`SHARED_CONSTANT_LIMIT`
   elements: shapes, axes, indices) become one, as onnx-ir's ``DeduplicateInitializersPass``
   does for every type: the constants each rewrite writes for itself (a rotary rewrite's
   ``Reshape(.., [-1, h])`` and ``Range(0, rows, 1)``, once per query and key) are then one
   value, and the nodes reading them one node. Integers only: a float initializer is a
   weight, a bias or a scale, which a later step (quantisation, bias correction,
   equalisation) may change for one layer alone;
5. dead-code removal - onnx-ir's ``RemoveUnusedNodesPass``: nodes and initializers no
   output depends on;
6. unread optional outputs - after the rewrites (with step 4), an output the op's schema marks
   optional that no node reads and that is no graph output is written unnamed, the ONNX
   spelling of "not asked for" (onnxscript's rules name all four outputs of a fused
   ``SkipSimplifiedLayerNormalization``; the file then asks the runtime for a mean and an inverse
   deviation nothing reads). The schemas are onnx's for the standard domains
   and ONNX Runtime's registered ones for ``com.microsoft``; an op neither knows keeps its
   outputs. Main graph only (a subgraph's values may be read from an outer scope's name).

Legality: each step computes the same outputs from the same inputs; graph input and
output names never change. Folded values are computed by onnxscript's reference
evaluation, and verification compares the result with the unrewritten model like any
rewrite. Ops of unknown domains are never evaluated.
"""

from __future__ import annotations

__all__ = ["CleanupPass"]

import contextlib
import functools
from collections import Counter
import inspect
import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
import onnxscript.optimizer

from opfuse.core.analysis import iter_scopes, tensor_nbytes
from opfuse.passes.base import OpfusePass
from opfuse.passes.constant_branches import GUARD, RESOLVED, guard
from opfuse.passes.shape_values import fold_shape_values, standing
from opfuse.verify.random_ops import draws_random, random_nodes
from opfuse.report import FusionRecord
from opfuse.core.ops import MS_DOMAIN, ONNX_DOMAINS, count_ops, is_onnx, is_op

logger = logging.getLogger(__name__)


class CleanupPass(OpfusePass):
    name = "cleanup"
    options = frozenset({"fold_constants", "infer_shapes", "eliminate_common"})

    def __init__(self, report=None, fold_constants: bool = True, infer_shapes: bool = False,
                 eliminate_common: bool = False, **options):
        super().__init__(report, **options)
        self.fold_constants = fold_constants
        self.eliminate_common = eliminate_common  # step 4 (after the rewrites: see the module docstring)
        self.infer_shapes = infer_shapes  # node by node while folding, also where no decision reads one
        self.removed: dict[str, int] = {}  # op label -> nodes gone, over all runs
        self._shapes_seen: object = None  # the main graph's op counts after the last shape-value step
        self._shape_refusals: list = []  # that step's (node, index, refusal): a round that skips it re-reads them
        self._reported: list = []  # the refusals the last run put in the report

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        before, main = _op_counts(model)
        ops = before
        for _ in range(BRANCH_ROUNDS if self.fold_constants else 0):
            if self._shapes_seen != main:  # (the inference costs; its answer would not change)
                records, self._shape_refusals = fold_shape_values(model)
                self.report.records.extend(records)
                self._shapes_seen = count_ops(model.graph)
            infer = self.infer_shapes or _inference_matters(ops)
            if not infer and not _could_fold(model):  # (a pass that folds nothing still walks every node)
                break
            with _quiet_folder():
                records = _fold_constants(model, ops, infer)
            self.report.records.extend(records)
            _type_constant_outputs(model)
            if not any(r.pattern == RESOLVED for r in records):
                break
            ops, main = _op_counts(model)  # an If became its branch: the shapes inside it may now fold its Ifs
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
        _eliminate_identities(model)
        if self.eliminate_common and not random_nodes(model):  # (it skips RandomNormal and kin, not Bernoulli)
            _share_integer_constants(model)
            common.CommonSubexpressionEliminationPass()(model)
        common.RemoveUnusedNodesPass()(model)
        if self.eliminate_common:
            _unname_unread_optional_outputs(model)
        after, self._shapes_seen = _op_counts(model)
        self._report_refusals(standing(self._shape_refusals, model.graph))
        gone = before - after
        for op, n in gone.items():
            self.removed[op] = self.removed.get(op, 0) + n
        return ir.passes.PassResult(model, modified=before != after)

    def _report_refusals(self, refusals: list) -> None:
        """This run's refusals, in place of those the previous run reported (the pipeline
        calls this pass directly, before and after the rewrites: the report keeps the last
        run's, which describe the graph written)."""
        previous = {id(r) for r in self._reported}
        self.report.refusals[:] = [r for r in self.report.refusals if id(r) not in previous]
        self._reported = list(refusals)
        self.report.refusals.extend(self._reported)

    def summary(self) -> str:
        """One line for the report: how many nodes went, by op."""
        total = sum(self.removed.values())
        if not total:
            return ""
        shown = ", ".join(f"{n} {op}" for op, n in sorted(self.removed.items(), key=lambda kv: -kv[1])[:6])
        return (f"clean-up: {total} node(s) removed (constants folded into initializers, Identity "
                f"and unused nodes): {shown}{', ...' if len(self.removed) > 6 else ''}")


@contextlib.contextmanager
def _quiet_folder():
    """onnxscript's folder logs each node it fails to evaluate ("Evaluation failed: ...")
    as a warning, which reaches stderr with no handler set: a node left unfolded is no
    problem of the user's (the log still has it at debug level through opfuse's logger)."""
    folder = logging.getLogger("onnxscript.optimizer._constant_folding")
    level = folder.level
    folder.setLevel(logging.ERROR)
    try:
        yield
    finally:
        folder.setLevel(level)


def _share_integer_constants(model: ir.Model) -> None:
    """Step 4's first half: each graph's small integer initializers of equal type, shape and bytes
    made one (the first in the graph's order is kept; graph inputs and outputs are never touched)."""
    for graph in model.graphs():
        kept: dict[tuple, ir.Value] = {}
        for value in tuple(graph.initializers.values()):
            tensor = value.const_value
            if (tensor is None or not tensor.dtype.is_integer() or tensor.size > SHARED_CONSTANT_LIMIT
                    or value.is_graph_input() or value.is_graph_output()):
                continue
            key = (tensor.dtype, tuple(tensor.shape), tensor.tobytes())
            if key not in kept:
                kept[key] = value
                continue
            value.replace_all_uses_with(kept[key])
            graph.initializers.pop(value.name)


BRANCH_ROUNDS = 8  # shape values and folding again while Ifs become their branches (silero-vad: 2)
KEEP = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")  # a quantised model's structure
FILL_LIMIT = 1 << 16  # ConstantOfShape outputs folded up to this many elements
INPUT_LIMIT = 1 << 22  # constant inputs up to this many elements (a weight sliced by an exporter)
SHARED_CONSTANT_LIMIT = 1024  # initializers up to this many elements made one where equal (step 4)


def _default_input_limit() -> int:
    """onnxscript's own input limit (8192 elements in 0.7), the default of its public
    fold_constants; 8192 when its signature says otherwise."""
    try:
        default = inspect.signature(onnxscript.optimizer.fold_constants_ir).parameters["input_size_limit"].default
    except (KeyError, ValueError, TypeError, AttributeError):
        return 8192
    return default if isinstance(default, int) else 8192


DEFAULT_INPUT_LIMIT = _default_input_limit()
GROWTH_LIMIT = 1.01  # folding may grow the stored constants by 1% at most


def _constant_bytes(model: ir.Model) -> int:
    total = 0
    for scope in iter_scopes(model):
        for value in getattr(scope.graph, "initializers", {}).values():
            if value.const_value is not None:
                total += tensor_nbytes(value.const_value)
        for node in scope.graph:
            if is_op(node, "Constant") and node.outputs[0].const_value is not None:
                total += tensor_nbytes(node.outputs[0].const_value)
    return total


# Ops onnxscript's folder evaluates partially (0.7) without reading any value's shape or
# type: symbolic shape values (Abs, Add, Gather, Squeeze), sequences, If on a constant,
# Dropout at inference, Identity (it only copies shapes backwards).
SHAPE_FREE = frozenset({"Abs", "Add", "ConcatFromSequence", "Dropout", "Gather", "Identity", "If",
                        "SequenceAt", "SequenceConstruct", "Squeeze"})


def _evaluated_ops() -> frozenset[tuple[str, str]] | None:
    """(domain, op) of every op onnxscript's folder evaluates partially (its registry:
    private, so None when it cannot be read: then the folder always runs)."""
    try:
        from onnxscript.optimizer import _constant_folding  # private: inside the try

        return frozenset(("" if d in ONNX_DOMAINS else d, op) for d, op in _constant_folding.registry.op_evaluators)
    except Exception:  # noqa: BLE001 - another onnxscript: fold everywhere
        return None


EVALUATED_OPS = _evaluated_ops()
# Default-domain ops whose partial evaluation may read a shape or a type: every op the folder
# has an evaluator for that is not known to read neither (a new evaluator counts as a
# reader). None when its registry cannot be read: always infer.
SHAPE_READERS = None if EVALUATED_OPS is None else frozenset(op for d, op in EVALUATED_OPS if d == "") - SHAPE_FREE


def _could_fold(model: ir.Model) -> bool:
    """Whether onnxscript's folder (without shape inference) can change anything: some node
    has an op it evaluates partially, or only constant inputs (initializers, Constant
    outputs; no inputs at all counts). Otherwise its visit of every node does nothing."""
    if EVALUATED_OPS is None:
        return True
    for scope in iter_scopes(model):
        for node in scope.graph:
            if node.op_type == "Constant":
                continue
            if ("" if node.domain in ONNX_DOMAINS else node.domain, node.op_type) in EVALUATED_OPS:
                return True
            for value in node.inputs:
                if value is not None and value.const_value is None and not is_op(value.producer(), "Constant"):
                    break
            else:
                return True
    return False


def _inference_matters(ops) -> bool:
    """Whether per-node shape inference can change what the folder does in a model with
    these op counts (by :func:`~opfuse.core.ops.op_label`: a default-domain op by name)."""
    return SHAPE_READERS is None or any(op in SHAPE_READERS for op in ops)


def _fold_constants(model: ir.Model, ops, infer: bool) -> list[FusionRecord]:
    """Fold with large inputs allowed, unless that grows the weights (a weight another
    branch still reads in full would be stored twice); then with onnxscript's own limit.

    The two differ only where a node with all-constant inputs has one above onnxscript's
    limit, so the model is folded in place with onnxscript's limit first, noting whether
    such a node came up; only then is a copy folded again with large inputs allowed and
    adopted if its weights are not larger than the model's after the first fold (O(model)
    either way; no copy and no size count for most models).
    A failure keeps what was folded before it (``ops``: the op counts before folding).
    ``infer``: with per-node shape inference. Returns the records of the Ifs replaced by
    their taken branch (in the model it keeps).
    """
    large: list[ir.Node] = []

    def should_fold(node: ir.Node) -> bool | None:
        verdict = _foldable(node)
        if verdict is None and not large and _has_large_input(node):
            large.append(node)  # the input limit decides this node
        return verdict

    folded, records = _try_fold(model, should_fold, None, ops, infer)
    if not folded or not large:
        return records
    before = _constant_bytes(model)  # (only here: summing every tensor's size is O(model))
    work = model.clone()
    folded, more = _try_fold(work, _foldable, INPUT_LIMIT, None, infer)
    if not folded:
        return records
    common.RemoveUnusedNodesPass()(work)
    if _constant_bytes(work) <= before * GROWTH_LIMIT + 4096:
        _adopt(model, work)
        records += more
    return records


def _try_fold(model: ir.Model, should_fold, limit: int | None, ops, infer: bool) -> tuple[bool, list[FusionRecord]]:
    """onnxscript's constant folding (``infer``: with per-node shape inference): whether it
    finished, and the records of the Ifs it replaced by their taken branch.

    onnxscript gives the values it creates unique names when it finishes; after a failure
    in the middle, the same is done here if anything was folded (the op counts changed).
    """
    watch = guard(model)  # (the Ifs' branch outputs made safe to inline; taken out again after)
    try:
        onnxscript.optimizer.fold_constants(
            model, should_fold=should_fold,
            onnx_shape_inference=infer, **({"input_size_limit": limit} if limit else {}))
    except Exception as e:  # noqa: BLE001 - a folding failure only leaves constants unfolded
        logger.info("constant folding stopped: %s", e)
        records = watch.finish()
        if ops is not None and _all_ops(model) != ops:
            common.NameFixPass()(model)
        return False, records
    return True, watch.finish()


def _has_large_input(node: ir.Node) -> bool:
    return any(v is not None and v.const_value is not None and v.const_value.size > DEFAULT_INPUT_LIMIT
               for v in node.inputs)


def _adopt(model: ir.Model, work: ir.Model) -> None:
    """Make ``model`` the folded copy (the pipeline holds ``model`` by reference)."""
    model.graph = work.graph
    functions = dict(work.functions)  # the copy's (the two may share the container)
    model.functions.clear()
    model.functions.update(functions)


def _foldable(node: ir.Node) -> bool | None:
    """Which nodes constant folding may evaluate (None: onnxscript's own size rules).

    Only default-domain ops; never the quantisation ops (their Q/DQ pairs are the model's
    meaning for a quantised runtime), nor an op that draws random numbers (onnxscript
    skips RandomNormal and its kin, not Bernoulli or a training-mode Dropout); a
    ConstantOfShape only when what it fills is small; never the Identity that guards an
    If's branch output (:mod:`~opfuse.passes.constant_branches`: it is taken out again).
    """
    if not is_onnx(node) or node.op_type in KEEP or draws_random(node) or GUARD in node.meta:
        return False
    if node.op_type == "ConstantOfShape":
        shape = node.inputs[0].const_value if node.inputs and node.inputs[0] is not None else None
        if shape is None:
            return False
        return int(np.prod(shape.numpy(), dtype=np.int64)) <= FILL_LIMIT
    return None


def _type_constant_outputs(model: ir.Model) -> None:
    """A graph output folded into a constant gets the constant's type and shape (onnxscript's
    new initializer has none, and ONNX requires an output's type)."""
    for value in model.graph.outputs:
        if value.type is None and value.const_value is not None:
            value.type = ir.TensorType(value.const_value.dtype)
            value.shape = value.shape or ir.Shape(value.const_value.shape)


def _all_ops(model: ir.Model):
    return _op_counts(model)[0]


def _op_counts(model: ir.Model) -> tuple[Counter, Counter]:
    """(the op counts of every graph, those of the main graph), in one walk."""
    total = main = None
    for scope in iter_scopes(model):  # (the main graph first)
        counts = count_ops(scope.graph)
        if main is None:
            main, total = counts, Counter(counts)
        else:
            total.update(counts)
    return total, main


def _eliminate_identities(model: ir.Model) -> int:
    scopes = list(iter_scopes(model))
    outputs_anywhere = {id(v) for scope in scopes for v in scope.graph.outputs}
    removed = 0
    for scope in scopes:
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


@functools.cache
def _optional_outputs(domain: str, op_type: str, version: int) -> frozenset[int]:
    """Positions of the op's outputs its schema marks optional (step 6); empty when no schema is known."""
    schema = None
    if domain in ONNX_DOMAINS:
        try:
            schema = onnx.defs.get_schema(op_type, version, "")
        except onnx.defs.SchemaError:
            schema = None
    elif domain == MS_DOMAIN:
        schema = _ort_schemas().get((op_type, domain))
    if schema is None or any(p.option.name == "Variadic" for p in schema.outputs):
        return frozenset()
    return frozenset(i for i, p in enumerate(schema.outputs) if p.option.name == "Optional")


@functools.cache
def _ort_schemas() -> dict:
    """ONNX Runtime's registered schemas of its own domain, the newest of each op."""
    try:
        # (lazy: only a model with an op of ONNX Runtime's domain reads its schemas)
        from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema
    except ImportError:
        return {}
    newest: dict = {}
    for schema in get_all_operator_schema():
        key = (schema.name, schema.domain)
        if schema.domain == MS_DOMAIN and (key not in newest
                                                 or schema.since_version > newest[key].since_version):
            newest[key] = schema
    return newest


def _unname_unread_optional_outputs(model: ir.Model) -> int:
    """Step 6: unread optional outputs of the main graph's nodes written unnamed; how many."""
    graph_outputs = {id(v) for v in model.graph.outputs}
    count = 0
    for node in model.graph:
        if len(node.outputs) < 2:
            continue
        version = model.opset_imports.get(node.domain if node.domain not in ONNX_DOMAINS else "", None)
        if version is None:
            continue
        optional = _optional_outputs(node.domain, node.op_type, version)
        for i, value in enumerate(node.outputs):
            if i in optional and value.name and not value.uses() and id(value) not in graph_outputs:
                value.name = ""
                count += 1
    return count
