"""Memory traffic: the exact bytes every node reads and writes, from shape inference.

The rule (one for every op, including ``com.microsoft`` FusedConv / FusedGemm)
==============================================================================

1. A node reads each of its inputs once and writes each of its outputs once. An input that
   is an initializer (or the output of a ``Constant`` node) counts as a **weight** read,
   any other input as an **activation** read. Absent optional inputs count nothing.
   FusedConv ``(X, W, B, Z)`` therefore reads X and Z as activations and W, B as weights.
2. ``Shape`` and ``Size`` read no data (only metadata); ``Constant`` nodes move nothing
   (ONNX Runtime turns them into initializers when it loads the model).
3. Bytes are ``elements x bits / 8`` of the tensor's dtype, with shapes from ONNX shape
   inference run on a private copy whose symbolic input dimensions are bound to the
   benchmark's values (axis 0 to ``batch``; others by name from ``dims``). Fused
   ``com.microsoft`` ops are inferred as the standard op they extend (Conv, Gemm). A tensor
   whose shape is still unknown is reported by name and counted as zero: never guessed.
4. Subgraphs (If/Loop/Scan bodies) and function bodies are not opened: the calling node
   reads its inputs and writes its outputs like any other.
5. A quantised (QDQ) graph is counted as written by this rule; how an accelerator that
   runs int8 natively would run it (Q/DQ folded into int8 kernels that move 1-byte
   activations and weights and int32 biases, conversions only around float ops) is
   :func:`opfuse.cost.int8.int8_traffic`, which rewrites this module's node list.
6. Each node is one :class:`Kernel`, the record the accelerator model
   (:mod:`opfuse.cost.accelerator`) costs too: a fused node's main op and epilogue are read
   once, here, through :func:`opfuse.targets.kernels.read_kernel`.

The ideal lower bound
=====================

"Each activation written once and read once, each weight read once":

- an **activation** is a feature map as a layer produces it. Element-wise ops
  (the ELEMWISE and BROADCAST kinds of :mod:`opfuse.core.ops`: BatchNormalization in
  inference, the activations, Add/Mul/...)
  do not create a new activation: their output belongs to the activation of their input
  with the same shape (for a binary op, the first such input). Everything else (Conv, Gemm,
  pooling, Flatten, ...) creates new activations. A graph input is an activation that is
  read but never written; a graph output one that is written but (unless consumed) not read.
- an activation counts as read when a node other than the element-wise op continuing it
  reads it (a layer, or an Add taking it as its second operand); continuing it happens on
  chip, in the producing layer's epilogue.
- ideal = every weight read once + every activation written once and, if read, read once.

It is the traffic of a layer-by-layer executor that runs every element-wise op in the
epilogue of the layer producing its input and never re-reads a feature map. Fusion cannot
change the activations (a FusedConv writes exactly the activation its Conv started), so the
activation part is the same for every configuration of one model; the weight part is each
configuration's own (folding turns BatchNormalization's four vectors into one bias).
What stays above the ideal after full fusion is re-reads: a ResNet block's input is read by
its first conv and again, as the residual, by its last.

Every node is also assigned to a **layer** (the node that produced its activation), which
gives traffic per layer, comparable across configurations (see :func:`align_layers`).
"""

from __future__ import annotations

__all__ = [
    "TensorInfo",
    "tensor_info",
    "static_shape",
    "Kernel",
    "Traffic",
    "analyse_traffic",
    "align_layers",
    "with_layers",
    "INPUT_LAYER",
]

import dataclasses
import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import onnx
import onnx_ir as ir

from opfuse.core.analysis import initializers_as_inputs
from opfuse.targets.kernels import read_kernel
from opfuse.core.ops import ELEMENTWISE_KINDS, OPS, dtype_name, is_onnx, is_op, op_kind, op_label, plain_attributes

logger = logging.getLogger(__name__)

# Ops that read only their input's metadata (the op table's metadata_only), and ops that
# move no data at run time (Constant: the runtime turns it into an initializer on load).
METADATA_ONLY_OPS = frozenset(op for op, info in OPS.items() if info.metadata_only)
NO_TRAFFIC_OPS = frozenset({"Constant"})

INPUT_LAYER = "(graph input)"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor as a node sees it: its static shape (None = unknown) and dtype."""

    name: str
    shape: tuple[int, ...] | None
    dtype: str | None  # "float32", ...; None = unknown
    bits: int | None  # bits per element
    is_weight: bool

    @property
    def elements(self) -> int | None:
        return None if self.shape is None else math.prod(self.shape)

    @property
    def nbytes(self) -> int | None:
        if self.shape is None or self.bits is None:
            return None
        return (math.prod(self.shape) * self.bits + 7) // 8


@dataclasses.dataclass
class Kernel:
    """One node as both cost models see it: the bytes it moves (this module's rule) and the
    kernel it launches (:mod:`opfuse.cost.accelerator`): its main op and the epilogue steps it
    runs on chip.

    A node of a graph gets its kernel from :func:`opfuse.targets.kernels.read_kernel` (a
    FusedConv is ``op`` "Conv" with its epilogue); the accelerator model also builds kernels
    that no graph holds (a fusion it is asked to judge, the chapter's modelled rows), where
    ``op_type`` is the main op.
    """

    name: str
    op: str  # the main op: "Conv" for a FusedConv, "com.microsoft.X" outside the default domain
    inputs: tuple[TensorInfo | None, ...]  # by position; None for an absent optional input
    outputs: tuple[TensorInfo, ...]
    attributes: dict[str, Any]  # the main op's (a fused node's epilogue encoding removed)
    epilogue: tuple[str, ...] = ()  # e.g. ("Add", "Relu")
    layer: str = ""  # the node whose activation this node works on (itself for a layer)
    precision: str = ""  # "int8": an int8 kernel read from a QDQ graph (opfuse.cost.int8)
    residual_input: int | None = None  # the input index of a fused kernel's Z
    op_type: str = ""  # the node's own op ("FusedConv"); "" = ``op``
    domain: str = ""  # the node's domain ("" for the default one)
    metadata_only: bool = False  # Shape/Size: reads no data
    no_traffic: bool = False  # Constant

    def __post_init__(self):
        if not self.op_type:
            self.op_type = self.op

    @property
    def info(self):
        """The main op's row of the op table (None for an op it does not know)."""
        return OPS.get(self.op)

    @property
    def label(self) -> str:
        return "+".join((self.op, *self.epilogue))

    @property
    def is_layer(self) -> bool:
        return self.layer == self.name

    def _read(self, weights: bool) -> tuple[int, list[str]]:
        total, unknown = 0, []
        if self.metadata_only or self.no_traffic:
            return 0, unknown
        for t in self.inputs:
            if t is None or t.is_weight != weights:
                continue
            if t.nbytes is None:
                unknown.append(t.name)
            else:
                total += t.nbytes
        return total, unknown

    @property
    def activation_read(self) -> int:
        return self._read(False)[0]

    @property
    def weight_read(self) -> int:
        return self._read(True)[0]

    @property
    def written(self) -> int:
        if self.no_traffic:
            return 0
        return sum(t.nbytes or 0 for t in self.outputs)

    @property
    def total(self) -> int:
        return self.activation_read + self.weight_read + self.written

    @property
    def unknown(self) -> list[str]:
        """Names of tensors this node moves whose size is unknown (counted as zero)."""
        names = self._read(False)[1] + self._read(True)[1]
        if not self.no_traffic:
            names += [t.name for t in self.outputs if t.nbytes is None]
        return names

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op_type": self.op_type if not self.domain else f"{self.domain}.{self.op_type}",
            "layer": self.layer,
            "activation_read": self.activation_read,
            "weight_read": self.weight_read,
            "written": self.written,
            "total": self.total,
            "unknown": self.unknown,
            **({"precision": self.precision} if self.precision else {}),
        }


@dataclasses.dataclass
class Traffic:
    """The traffic of one model: per node, per layer, totals and the ideal lower bound."""

    model: str
    nodes: list[Kernel]
    ideal_activation_bytes: int  # every activation written once and read once
    ideal_weight_bytes: int  # every weight read once
    activations: int  # number of activations (see the module docstring)
    graph_outputs: tuple[str, ...] = ()
    graph_inputs: tuple[TensorInfo, ...] = ()  # the graph's (non-weight) inputs

    @property
    def kernels(self) -> list[Kernel]:
        """The nodes ONNX Runtime runs as kernels (Constant nodes become initializers)."""
        return [n for n in self.nodes if not n.no_traffic]

    @property
    def activation_read(self) -> int:
        return sum(n.activation_read for n in self.nodes)

    @property
    def weight_read(self) -> int:
        return sum(n.weight_read for n in self.nodes)

    @property
    def written(self) -> int:
        return sum(n.written for n in self.nodes)

    @property
    def total(self) -> int:
        return sum(n.total for n in self.nodes)

    @property
    def ideal(self) -> int:
        return self.ideal_activation_bytes + self.ideal_weight_bytes

    @property
    def unknown(self) -> dict[str, list[str]]:
        """node name -> tensors of unknown size (empty when every shape is known)."""
        return {n.name: n.unknown for n in self.nodes if n.unknown}

    def layers(self) -> list[Kernel]:
        """The layer nodes, in graph order."""
        return [n for n in self.nodes if n.is_layer]

    def per_layer(self) -> OrderedDict[str, int]:
        """layer name -> bytes moved by the layer and the element-wise nodes working on it."""
        out: OrderedDict[str, int] = OrderedDict()
        if any(n.layer == INPUT_LAYER for n in self.nodes):
            out[INPUT_LAYER] = 0
        for n in self.nodes:
            if n.is_layer:
                out.setdefault(n.name, 0)
        for n in self.nodes:
            out[n.layer] = out.get(n.layer, 0) + n.total
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "nodes": len(self.nodes),
            "kernels": len(self.kernels),
            "activation_read": self.activation_read,
            "weight_read": self.weight_read,
            "written": self.written,
            "total": self.total,
            "ideal": self.ideal,
            "ideal_activation_bytes": self.ideal_activation_bytes,
            "ideal_weight_bytes": self.ideal_weight_bytes,
            "activations": self.activations,
            "unknown": self.unknown,
        }


def analyse_traffic(
    model: ir.Model | onnx.ModelProto,
    *,
    batch: int | None = None,
    dims: Mapping[str, int] | None = None,
) -> Traffic:
    """Bytes read and written by every node of ``model``'s main graph (see the module docstring).

    ``batch`` binds a symbolic axis 0 of every graph input; ``dims`` binds symbolic
    dimensions by name (it wins over ``batch``). The caller's model is not modified.
    """
    if isinstance(model, onnx.ModelProto):
        model = ir.serde.deserialize_model(model)
    shapes = _infer_shapes(model, batch=batch, dims=dict(dims or {}))
    graph = model.graph
    weights = _weight_values(graph)
    nodes: list[Kernel] = []
    for node in graph:
        domain = "" if is_onnx(node) else node.domain
        inputs = tuple(None if v is None else _info(v, shapes, v in weights) for v in node.inputs)
        attributes = plain_attributes(node)
        view = read_kernel(domain, node.op_type, inputs, attributes)
        nodes.append(Kernel(
            name=node.name or f"{node.op_type}_{len(nodes)}",
            op=view.anchor if view is not None else op_label(domain, node.op_type),
            inputs=inputs,
            outputs=tuple(_info(v, shapes, False) for v in node.outputs),
            attributes=view.anchor_attributes if view is not None else attributes,
            epilogue=view.epilogue if view is not None else (),
            residual_input=view.residual_input if view is not None else None,
            op_type=node.op_type,
            domain=domain,
            metadata_only=is_op(node, *METADATA_ONLY_OPS),
            no_traffic=is_op(node, *NO_TRAFFIC_OPS),
        ))
    inputs = tuple(_info(v, shapes, False) for v in graph.inputs if v not in weights)
    return with_layers(Traffic(
        model=graph.name or "<model>",
        nodes=nodes,
        ideal_activation_bytes=0,
        ideal_weight_bytes=0,
        activations=0,
        graph_outputs=tuple(v.name for v in graph.outputs),
        graph_inputs=inputs,
    ))


def align_layers(traffics: Mapping[str, Traffic]) -> tuple[list[str], dict[str, list[int | None]]]:
    """Per-layer bytes of several configurations of one model, row by row.

    Fusion keeps every layer (a Conv becomes a FusedConv in place) and only removes
    element-wise nodes, so the k-th layer of each configuration is the same layer. Returns
    (layer labels from the first configuration, {config: bytes per layer}); a configuration
    whose layers do not line up (a different count) gets None everywhere, and is listed
    under its own layer names by :meth:`Traffic.per_layer` instead.
    """
    names = list(traffics)
    if not names:
        return [], {}
    first = traffics[names[0]].per_layer()
    labels = list(first)
    out: dict[str, list[int | None]] = {}
    for name in names:
        per = traffics[name].per_layer()
        values = list(per.values())
        keys = list(per)
        if INPUT_LAYER in first and INPUT_LAYER not in per:
            keys, values = [INPUT_LAYER, *keys], [0, *values]
        elif INPUT_LAYER in per and INPUT_LAYER not in first:
            # bytes spent on the graph input before its first layer: add them to that layer
            head = values[0]
            keys, values = keys[1:], values[1:]
            if values:
                values[0] += head
        out[name] = list(values) if len(values) == len(labels) else [None] * len(labels)
    return labels, out


# -- shapes ----------------------------------------------------------------------------

def _infer_shapes(
    model: ir.Model, *, batch: int | None, dims: dict[str, int]
) -> dict[str, tuple[tuple[int, ...] | None, ir.DataType | None]]:
    """name -> (static shape or None, dtype) for every value of the main graph."""
    work = model.clone()  # shares the tensors; only the structure is copied
    graph = work.graph
    for value in graph.inputs:
        if value.shape is None:
            continue
        bound = []
        for axis, dim in enumerate(value.shape):
            if isinstance(dim, int):
                bound.append(dim)
                continue
            name = str(dim.value) if dim.value is not None else None
            if name is not None and name in dims:
                bound.append(int(dims[name]))
            elif axis == 0 and batch is not None:
                bound.append(int(batch))
            else:
                bound.append(dim)
        value.shape = ir.Shape(bound)
    for node in graph:
        view = read_kernel(node.domain, node.op_type, node.inputs, node.attributes)
        if view is not None:  # shape inference knows the standard op it extends
            node.op_type, node.domain = view.anchor, ""
            if len(node.inputs) > view.anchor_inputs:
                node.resize_inputs(view.anchor_inputs)
            kept = view.anchor_attributes
            for attr in [a for a in node.attributes if a not in kept]:
                node.attributes.pop(attr)
    # Initializers become typed inputs without data: shape inference needs only their shapes.
    initializers = list(graph.initializers.values())
    initializers_as_inputs(graph, initializers)
    for value in initializers:
        graph.initializers.pop(value.name)
        value.const_value = None
    # The values' own (declared) shapes first, then whatever inference adds.
    known: dict[str, tuple[tuple[int, ...] | None, ir.DataType | None]] = {}
    for value in _all_values(graph):
        known[value.name] = (static_shape(value.shape), value.dtype)
    try:
        proto = ir.serde.serialize_model(work)
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception as e:  # noqa: BLE001 - onnx raises several types; we keep declared shapes
        logger.warning("shape inference failed (%s); using declared shapes only", e)
        return known
    for info in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        shape, dtype = _from_value_info(info)
        old_shape, old_dtype = known.get(info.name, (None, None))
        known[info.name] = (old_shape if old_shape is not None else shape, old_dtype or dtype)
    return known


def _all_values(graph: ir.Graph):
    seen = set()
    for value in graph.inputs:
        if value.name not in seen:
            seen.add(value.name)
            yield value
    for node in graph:
        for value in node.outputs:
            if value.name not in seen:
                seen.add(value.name)
                yield value


def static_shape(shape: ir.Shape | None) -> tuple[int, ...] | None:
    """``shape`` as a tuple of ints, or None where it is unknown or has a symbolic dim."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _from_value_info(info: onnx.ValueInfoProto) -> tuple[tuple[int, ...] | None, ir.DataType | None]:
    if not info.type.HasField("tensor_type"):
        return None, None
    tt = info.type.tensor_type
    dtype = ir.DataType(tt.elem_type) if tt.elem_type else None
    if not tt.HasField("shape"):
        return None, dtype
    dims = []
    for d in tt.shape.dim:
        if d.HasField("dim_value") and d.dim_value >= 0:
            dims.append(int(d.dim_value))
        else:
            return None, dtype
    return tuple(dims), dtype


def tensor_info(value: ir.Value, is_weight: bool, shape: tuple[int, ...] | None = None,
                dtype: ir.DataType | None = None) -> TensorInfo:
    """The one :class:`TensorInfo` builder (this module's traffic and the accelerator model's
    veto): ``shape`` and ``dtype`` where the caller knows them (here: inferred on a private copy
    with the dims bound), else the shape of the value's constant, and the value's own dtype, else
    its constant's. An unknown dtype has no bits (the tensor is then counted as unknown)."""
    if shape is None and value.const_value is not None:
        shape = tuple(value.const_value.shape)
    if dtype is None:
        dtype = value.dtype
    if dtype is None and value.const_value is not None:
        dtype = value.const_value.dtype
    if dtype is None or dtype == ir.DataType.UNDEFINED:
        return TensorInfo(value.name or "", shape, None, None, is_weight)
    return TensorInfo(value.name or "", shape, dtype_name(dtype), dtype.bitwidth, is_weight)


def _info(value: ir.Value, shapes, is_weight: bool) -> TensorInfo:
    return tensor_info(value, is_weight, *shapes.get(value.name, (None, None)))


def _weight_values(graph: ir.Graph) -> set[ir.Value]:
    """Initializers that are not also graph inputs, and Constant-node outputs."""
    weights = {v for v in graph.initializers.values() if not v.is_graph_input()}
    for node in graph:
        if is_op(node, *NO_TRAFFIC_OPS):
            weights.update(node.outputs)
    return weights



# -- activations, layers and the ideal bound ------------------------------------------

def with_layers(traffic: Traffic) -> Traffic:
    """``traffic`` with every node's layer assigned and the ideal bound computed (in place).

    Works on the node list alone (tensor names, shapes, dtypes, which inputs are weights),
    so a rewritten node list (:func:`opfuse.cost.int8.int8_traffic`) gets its layers
    and ideal by the same rule as a graph.
    """
    root: dict[str, str] = {}  # tensor name -> name of the tensor that started its activation
    layer_of_root: dict[str, str] = {}  # activation root -> layer (producer node) name
    size: dict[str, int | None] = {}
    read: set[str] = set()
    written: set[str] = set()

    for t in traffic.graph_inputs:
        root[t.name] = t.name
        layer_of_root[t.name] = INPUT_LAYER
        size[t.name] = t.nbytes

    weight_bytes: dict[str, int] = {}
    for info in traffic.nodes:
        if info.no_traffic:
            info.layer = info.name
            continue
        acts = [t for t in info.inputs if t is not None and not t.is_weight]
        for t in info.inputs:
            if t is not None and t.is_weight and not info.metadata_only:
                weight_bytes[t.name] = t.nbytes or 0
        joined, carrier = None, None
        if (op_kind(info) in ELEMENTWISE_KINDS
                and len(info.outputs) >= 1 and info.outputs[0].shape is not None):
            out = info.outputs[0]
            for k, t in enumerate(acts):
                if t.shape == out.shape and t.dtype == out.dtype and t.name in root:
                    joined, carrier = root[t.name], k
                    break
        if not info.metadata_only:
            # an element-wise op continuing an activation works on it on chip: not a read
            for k, t in enumerate(acts):
                if k != carrier:
                    read.add(root.get(t.name, t.name))
        if joined is not None:
            info.layer = layer_of_root[joined]
            root[info.outputs[0].name] = joined
            for t in info.outputs[1:]:  # e.g. BatchNormalization's training outputs
                _new_activation(t, info.name, root, layer_of_root, size, written)
        else:
            info.layer = info.name
            for t in info.outputs:
                _new_activation(t, info.name, root, layer_of_root, size, written)

    roots = set(root.values())
    traffic.ideal_activation_bytes = sum((size.get(r) or 0) * ((r in written) + (r in read)) for r in roots)
    traffic.ideal_weight_bytes = sum(weight_bytes.values())
    traffic.activations = len(roots)
    return traffic


def _new_activation(t: TensorInfo, producer: str, root, layer_of_root, size, written) -> None:
    root[t.name] = t.name
    layer_of_root[t.name] = producer
    size[t.name] = t.nbytes
    written.add(t.name)
