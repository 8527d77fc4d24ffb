"""Step 2 of the pipeline: read-only questions about a model's graphs.

Passes ask these instead of walking the graph themselves:

- :func:`iter_scopes` - every graph opfuse rewrites: the main graph, every subgraph of
  If/Loop/Scan (recursively) and every model-local function, each with a label for the log.
- :func:`find_constant` - is this value a constant (an initializer that is not also a graph
  input, or a ``Constant`` node, possibly behind Identity nodes)? If not, why not.
- :func:`trace_producer` - walk back from a value through Identity nodes to the node that
  computes it.
- :func:`sole_use_problem` - why a value cannot disappear (it is a graph output, or it has
  other consumers).
- :func:`op_counts`, :func:`epsilon_census` - what the model contains.
- :func:`tensor_nbytes` - a tensor's size in bytes, read from the proto's dims when the
  tensor came from a file (onnx-ir's ``nbytes`` builds an ``ir.Shape`` on every call).
- :func:`infer_shapes` - onnx's whole-model shape inference, merged into the values.

Every function here is O(size of what it touches); none rescans the whole graph.

Shape inference is onnx-ir's ``ShapeInferencePass`` done in O(model size): that pass
hands onnx a copy of the model whose initializers are graph inputs (the large ones without
their data) and, for each initializer, asks whether it is already an input by scanning the
input list (``initializer not in model.graph.inputs``), which is O(initializers x inputs): seconds
on a long chain (docs/results/measurements.md). :func:`infer_shapes` builds the same copy
with a set of the inputs, then merges the inferred types and shapes the same way.
"""

from __future__ import annotations

__all__ = [
    "Scope",
    "Constant",
    "iter_scopes",
    "find_constant",
    "trace_producer",
    "sole_use_problem",
    "describe",
    "label_unnamed",
    "node_label",
    "op_counts",
    "epsilon_census",
    "opset_of",
    "NameTable",
    "NameLedger",
    "infer_shapes",
    "initializers_as_inputs",
    "tensor_nbytes",
]

import dataclasses
import functools
import logging
import math
from collections import Counter
from collections.abc import Iterator

import numpy as np
import onnx
import onnx_ir as ir

from opfuse.report import Reason
from opfuse.core.ops import ONNX_DOMAINS, count_ops, is_op, op_label

logger = logging.getLogger(__name__)

BN_DEFAULT_EPSILON = 1e-5  # the ONNX spec's default, used only when the attribute is absent


@dataclasses.dataclass(frozen=True)
class Scope:
    """A graph opfuse rewrites, and where it sits in the model."""

    graph: ir.Graph  # for a function, the function's body graph
    label: str  # "main", "If_0/then_branch", "function:custom.f"
    function: ir.Function | None = None  # set when the graph is a function body
    opset: int = 0  # the default-domain opset in force

    @property
    def container(self) -> ir.Graph | ir.Function:
        return self.function if self.function is not None else self.graph


@dataclasses.dataclass(frozen=True)
class Constant:
    """A constant tensor and the value that holds it."""

    array: np.ndarray
    value: ir.Value  # the initializer or Constant-node output the data comes from


def opset_of(opset_imports: dict[str, int]) -> int:
    return next((opset_imports[d] for d in ONNX_DOMAINS if d in opset_imports), 0)


def iter_scopes(model: ir.Model) -> Iterator[Scope]:
    """The main graph, its subgraphs (recursively) and every function with its subgraphs."""
    opset = opset_of(model.opset_imports)
    yield from _graph_and_subgraphs(model.graph, "main", None, opset)
    for function in model.functions.values():
        f_opset = opset_of(function.opset_imports) or opset
        label = f"function:{function.domain}.{function.name}"
        yield from _graph_and_subgraphs(function.graph, label, function, f_opset)


_SUBGRAPH_ATTRIBUTES = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


def _graph_and_subgraphs(
    graph: ir.Graph, label: str, function: ir.Function | None, opset: int
) -> Iterator[Scope]:
    yield Scope(graph, label, function, opset)
    for node in graph:
        # A plain loop over the attributes' own dict (.data): most nodes have no subgraph,
        # and the mapping view or a generator costs a Python call per item.
        for attr in node.attributes.data.values():
            if attr.type in _SUBGRAPH_ATTRIBUTES:
                break
        else:
            continue
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from _graph_and_subgraphs(
                    attr.value, f"{label}/{node.name or node.op_type}/{attr.name}", None, opset
                )
            elif attr.type == ir.AttributeType.GRAPHS:
                for i, sub in enumerate(attr.value):
                    yield from _graph_and_subgraphs(
                        sub, f"{label}/{node.name or node.op_type}/{attr.name}[{i}]", None, opset
                    )


NODE_LABEL = "opfuse.label"  # node meta: the stable label of an unnamed node (never serialised)


def label_unnamed(model: ir.Model) -> None:
    """Give every unnamed node a stable label for the log: its op type and its position in
    its graph as loaded (``Conv #12``). The model's names are not changed."""
    for scope in iter_scopes(model):
        for i, node in enumerate(scope.graph):
            if not node.name:
                node.meta[NODE_LABEL] = f"{node.op_type} #{i}"


def node_label(node: ir.Node) -> str:
    """The node's name, else its label from :func:`label_unnamed`, else its op type."""
    return node.name or node.meta.get(NODE_LABEL) or node.op_type


def describe(node: ir.Node | None) -> str:
    """How a node is named in a sentence: ``Conv 'layer1.0.conv1'``."""
    if node is None:
        return "nothing"
    op = op_label(node.domain, node.op_type)
    if node.name:
        return f"{op} '{node.name}'"
    label = node.meta.get(NODE_LABEL)
    return f"{op} ({label.rpartition(' ')[2]})" if label else op


def _is_identity(node: ir.Node | None) -> bool:
    return is_op(node, "Identity")


def find_constant(value: ir.Value | None, role: str = "operand") -> Constant | Reason:
    """The constant behind ``value``, or the :class:`~opfuse.report.Reason` it is not one."""
    if value is None:
        return Reason(f"the {role} is absent")
    seen = value
    while True:
        if seen.is_graph_input():
            extra = (
                "an initializer that is also a graph input, so it can be overridden at run time"
                if seen.is_initializer()
                else "a graph input, set at run time"
            )
            return Reason(f"the {role} '{value.name}' is {extra}")
        if seen.const_value is not None:
            return Constant(_as_array(seen.const_value), seen)
        producer = seen.producer()
        if producer is None:
            return Reason(f"the {role} '{value.name}' is not a constant (it comes from an outer scope)")
        if _is_identity(producer):
            seen = producer.inputs[0]
            if seen is None:
                return Reason(f"the {role} '{value.name}' is not a constant")
            continue
        if is_op(producer, "Constant"):
            try:
                tensor = ir.convenience.get_const_tensor(seen)
            except ValueError:
                tensor = None
            if tensor is None:
                return Reason(f"the {role} '{value.name}' comes from a Constant node opfuse cannot read")
            return Constant(_as_array(tensor), seen)
        return Reason(f"the {role} '{value.name}' is computed at run time by {describe(producer)}")


def _as_array(tensor: ir.TensorProtocol) -> np.ndarray:
    return np.asarray(tensor.numpy())


def trace_producer(value: ir.Value) -> tuple[ir.Node | None, list[ir.Node]]:
    """Walk back from ``value`` through Identity nodes; return (producer, identities)."""
    through: list[ir.Node] = []
    node = value.producer()
    while _is_identity(node):
        through.append(node)
        source = node.inputs[0]
        node = source.producer() if source is not None else None
    return node, through


def sole_use_problem(value: ir.Value, owner: ir.Node, allowed: ir.Node) -> str | None:
    """Why ``owner``'s output ``value`` cannot vanish into ``allowed``, or None if it can."""
    if value.is_graph_output():
        return f"the output of {describe(owner)} is a graph output, so it must stay"
    consumers = value.consumers()
    if len(consumers) == 1 and consumers[0] is allowed and len(value.uses()) == 1:
        return None
    others = [c for c in consumers if c is not allowed]
    names = ", ".join(describe(c) for c in others[:3]) + (" ..." if len(others) > 3 else "")
    return (
        f"the output of {describe(owner)} feeds {len(value.uses())} consumers"
        + (f" (also {names})" if names else "")
        + ", so it must stay"
    )


def op_counts(model: ir.Model) -> Counter:
    """Node count per operator (domain-qualified outside the ONNX domain), all scopes."""
    counts: Counter = Counter()
    for scope in iter_scopes(model):
        counts.update(count_ops(scope.graph))
    return counts


def epsilon_census(model: ir.Model) -> list[tuple[str, float, str]]:
    """(node name, epsilon in force, scope label) for every BatchNormalization."""
    found = []
    for scope in iter_scopes(model):
        for node in scope.graph:
            if is_op(node, "BatchNormalization"):
                found.append((node.name or "", batchnorm_epsilon(node), scope.label))
    return found


def batchnorm_epsilon(node: ir.Node) -> float:
    """The node's own epsilon; the spec's default only when the attribute is absent."""
    attr = node.attributes.get("epsilon")
    return float(attr.value) if attr is not None else BN_DEFAULT_EPSILON


class NameTable:
    """Every value and node name in the model, to mint fresh ones in O(1).

    The model's names are read when the first fresh name is asked for, not before: a pass
    that mints none never scans the model (opfuse's passes ask before their first rewrite,
    so they read the names the model had when the pass began). Inside a run with a
    :class:`NameLedger`, every name the run has seen is taken too (a removed value's name is
    never minted again), and what is minted here is recorded there.
    """

    def __init__(self, model: ir.Model):
        self._model = model
        self._next: dict[str, int] = {}  # base -> the suffix to try next (O(1) per name)
        self._seen: set[str] | None = model.graph.meta.get(NAMES_SEEN)  # the run's ledger, if any

    @functools.cached_property
    def _taken(self) -> set[str]:
        """The set of taken names, read from the model on first use."""
        taken: set[str] = set(self._seen or ())
        for scope in iter_scopes(self._model):
            container = scope.container
            taken.update(v.name for v in container.inputs if v.name)
            if scope.function is None:
                taken.update(scope.graph.initializers)
            for node in scope.graph:
                if node.name:
                    taken.add(node.name)
                taken.update(v.name for v in node.outputs if v.name)
        return taken

    def fresh(self, base: str) -> str:
        """``base`` if free, else ``base_N`` with the next N not yet tried for this base."""
        name, n = base, self._next.get(base, 0)
        if n == 0 and name not in self._taken:
            self._next[base] = 1
            self._taken.add(name)
            if self._seen is not None:
                self._seen.add(name)
            return name
        n = max(n, 1)
        name = f"{base}_{n}"
        while name in self._taken:  # only names the model itself already had
            n += 1
            name = f"{base}_{n}"
        self._next[base] = n + 1
        self._taken.add(name)
        if self._seen is not None:
            self._seen.add(name)
        return name


NAMES_SEEN = "opfuse.names_seen"  # graph meta: the set of every name the run has seen (NameLedger)


def _value_names(model: ir.Model) -> dict[str, list[ir.Value]]:
    """Every named value of every scope, by name (inputs, initializers, node outputs)."""
    found: dict[str, list[ir.Value]] = {}
    for scope in iter_scopes(model):
        values = list(scope.container.inputs)
        if scope.function is None:
            values += scope.graph.initializers.values()
        for node in scope.graph:
            values += node.outputs
        for v in values:
            name = v.name
            if name:
                if name in found:
                    found[name].append(v)
                else:
                    found[name] = [v]
    return found


class NameLedger:
    """Every value name one run has seen, so that no new value takes a removed one's name.

    A rewrite's result keeps the name of the tensor it replaces (verification compares it
    there), and the file keeps the type the input *declared* for each name
    (:func:`opfuse.save.restore_declared_types`). A new value that takes the name of a value
    removed earlier would be given that value's declaration: an int64 shape tensor's type on
    a float tensor, a model ONNX Runtime refuses to load. onnx-ir mints ``val_N`` names per
    graph object, so a clone (a trial, a fusion attempt) forgets the names removed before it.

    :meth:`settle` is called between the run's steps: a name present at one call and absent
    at a later one is *retired*; a value that carries a retired name at a later call is new
    (the tensor it names is gone), and is renamed to a name the run has never seen. Graph
    inputs and outputs are never renamed. Returns the renames, which the caller applies to
    whatever refers to values by name (the rewrite records).
    """

    def __init__(self, model: ir.Model):
        self.present = set(_value_names(model))
        self.retired: set[str] = set()
        self.seen = set(self.present)  # shared with every NameTable of the run (graph meta)
        model.graph.meta[NAMES_SEEN] = self.seen

    def settle(self, model: ir.Model) -> dict[str, str]:
        model.graph.meta[NAMES_SEEN] = self.seen  # (a model rebuilt by a step starts without it)
        values = _value_names(model)
        now = set(values)
        self.retired |= self.present - now
        renamed: dict[str, str] = {}
        fixed = {v.name for v in (*model.graph.inputs, *model.graph.outputs)}
        for name in sorted(now & self.retired - fixed):
            new = self._fresh(name)
            for value in values[name]:
                value.name = new
            renamed[name] = new
        self.present = (now - set(renamed)) | set(renamed.values())
        self.seen |= self.present
        return renamed

    def _fresh(self, base: str) -> str:
        n = 1
        while f"{base}_{n}" in self.seen:
            n += 1
        self.seen.add(f"{base}_{n}")
        return f"{base}_{n}"


_ITEMSIZE: dict[int, float] = {}  # TensorProto data type -> bytes per element (0.5 for 4-bit types)


def tensor_nbytes(tensor: ir.TensorProtocol) -> int:
    """``tensor.nbytes``, from the proto's dims for a tensor deserialised from a file."""
    if type(tensor) is ir.serde.TensorProtoTensor:
        raw = tensor.raw
        data_type = raw.data_type
        itemsize = _ITEMSIZE.get(data_type)
        if itemsize is None and data_type != onnx.TensorProto.STRING:
            itemsize = _ITEMSIZE[data_type] = ir.DataType(data_type).itemsize
        if itemsize is not None:
            return math.ceil(itemsize * math.prod(raw.dims))
    return tensor.nbytes


_BIG_TENSOR = 1000  # bytes; larger initializers reach onnx's inference without their data (as onnx-ir does)


def infer_shapes(model: ir.Model) -> None:
    """Attach inferred shapes to values (onnx's inference); the graph is not changed.

    Best effort: a model onnx cannot infer keeps the shapes it had, and the rewrites that
    need a shape refuse with a reason. O(model size) (see the module docstring).
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(
            _inference_proto(model), check_type=True, strict_mode=False, data_prop=True)
    except Exception as e:  # noqa: BLE001 - onnx raises many kinds here
        logger.info("shape inference failed: %s", e)
        return
    _merge_inferred(model, ir.serde.deserialize_model(inferred))


def initializers_as_inputs(graph: ir.Graph, initializers) -> None:
    """Make ``initializers`` typed graph inputs, as onnx's shape inference reads them:
    each gets its tensor's dtype and shape where it has none. O(inputs + initializers)."""
    present = {id(v) for v in graph.inputs}  # (a set: membership in the list is O(inputs))
    for value in initializers:
        tensor = value.const_value
        if tensor is not None:
            if value.shape is None:
                value.shape = tensor.shape
            if value.dtype is None:
                value.dtype = tensor.dtype
        if id(value) not in present:
            graph.inputs.append(value)
            present.add(id(value))


def _inference_proto(model: ir.Model) -> onnx.ModelProto:
    """The model as onnx's inference needs it: initializers as typed graph inputs, those
    above 1 KB without data. The model is left as it was (initializers get the dtype and
    shape of their tensor if they had none, as onnx-ir's pass does)."""
    graph = model.graph
    initializers = tuple(graph.initializers.values())
    tensors = {v.name: v.const_value for v in initializers}
    n_inputs = len(graph.inputs)
    try:
        initializers_as_inputs(graph, initializers)
        for value in initializers:
            tensor = value.const_value
            if tensor is None:
                graph.initializers.pop(value.name)
            elif tensor_nbytes(tensor) > _BIG_TENSOR:
                value.const_value = None
                graph.initializers.pop(value.name)
        return ir.serde.serialize_model(model)
    finally:
        for value in initializers:
            value.const_value = tensors[value.name]
        if len(graph.initializers) != len(initializers):  # all put back in their order (a second run
            for value in initializers:                    # of opfuse on its output writes the same file)
                graph.initializers.pop(value.name, None)
            for value in initializers:
                if value.const_value is not None:
                    graph.register_initializer(value)
                else:
                    graph.initializers.add(value)
        kept = graph.inputs[:n_inputs]
        graph.inputs.clear()
        graph.inputs.extend(kept)


def _merge_inferred(model: ir.Model, inferred: ir.Model) -> None:
    """Give each value the type and shape onnx inferred for the value of its name (where
    onnx inferred one and it differs), graph by graph, subgraphs included."""
    for graph, inferred_graph in zip(model.graphs(), inferred.graphs()):
        found = ir.convenience.create_value_mapping(inferred_graph)
        for name, value in ir.convenience.create_value_mapping(graph).items():
            other = found.get(name)
            if other is None:
                continue
            if other.shape is not None and value.shape != other.shape:
                value.shape = other.shape
            if other.dtype is not None and value.dtype != other.dtype:
                value.dtype = other.dtype
