"""``index-arithmetic``: the index and mask arithmetic exporters write, in fewer nodes.

A decoder's attention mask is built at run time from ``attention_mask``, the cache length
and aranges. Transformers' masks (``masking_utils``: causal, sliding window, padding)
exported by torch's dynamo exporter take 30-35 nodes on tensors of a few hundred elements,
where each node's cost is ONNX Runtime's per-kernel overhead, not its arithmetic: on
Mistral's decode step they were a tenth of its time. The padding term alone,
``attention_mask[batch_arange[:, None, None, None], kv_arange[None, None, None, :]]``, is
eleven nodes. Four rules, each exact:

1. **GatherND over a separable index grid** (torch's advanced indexing with broadcast
   index vectors)::

       GatherND(x, Concat(Unsqueeze(Expand(g_0, S), -1), Unsqueeze(Expand(g_1, S), -1), axis=-1))

   where each ``g_i`` is a 1-D index vector ``v_i`` unsqueezed to rank R, varying along axis
   ``p_i`` only (``p_0 < p_1``), and ``S = Shape(B(g_0, g_1))`` for a broadcasting op B
   (Max, Min, Add, Mul: the export of ``broadcast_tensors``), so the grid is their broadcast
   and nothing more. Element-wise, ``y[.., i at p_0, .., j at p_1, .., t] = x[v_0[i], v_1[j],
   t]``, which is::

       Unsqueeze(Gather(Gather(x, v_0, axis=0), v_1, axis=1), axes = range(R) - {p_0, p_1})

   Gather takes the same indices GatherND does (negative ones counted from the end, out of
   range an error in both). ``batch_dims`` must be 0.
   **The same grid folded into a constant**: with static shapes (``--target qnn`` binds every
   dim before the passes run) the clean-up's constant folding turns the Shape, Range, Expand
   and Concat into one ``indices`` initializer, and QNN cannot run the GatherND left ("Failed
   to create GatherND node"). Each component ``indices[..., k]`` that varies along one axis
   only is the vector read along it; one that varies along none is a single index (a scalar
   Gather, which drops its axis; the Unsqueeze puts it back); every other axis of the grid
   must be of size 1 (else an Expand would be needed) and the vectors' axes in order. Only for
   a target that needs static shapes (``Target.static_shapes``: qnn, ethos-u), where the grid
   folds; on a model whose own dims are static, for another target, one GatherND is fewer nodes.
2. **A Gather of a whole axis in order**: ``Gather(x, Range(0, n, 1), axis=a)`` is ``x``
   when ``n`` is read off a dim (``Squeeze(Shape(t)[k:k+1])`` or ``Gather(Shape(t), k)``)
   that is ``x``'s dim ``a``: the same number, or the same named symbolic dim after shape
   inference (as ``reshape-dims`` reads them: dims the model declares under one name are
   taken to be equal, which its own graph already assumes where it meets them).
3. **Two Unsqueezes in a row** are one, its axes the second's and the first's at the
   positions the second leaves (``Unsqueeze(Unsqueeze(x, [1, 2]), [3])`` is
   ``Unsqueeze(x, [1, 2, 3])``); only when nothing else reads the first.
4. **Ops that return their input**: ``And(x, c)`` with ``c`` a constant of all True,
   ``Or(x, c)`` with all False, ``Expand(x, c)`` with ``c`` all ones; each only when ``c``
   does not broadcast ``x`` to a larger shape (its rank at most ``x``'s, each of its dims 1 or
   ``x``'s static dim).

Legality common to all: the main graph only; a node whose output is a graph output is left
(the output keeps its name and its producer); the ranks and dims come from onnx's shape
inference, and a rule whose rank or dim is unknown leaves the node. Rules 1 and 3 write a
node whose output keeps the name of the tensor it replaces, which verification compares;
rules 2 and 4 remove a node (its readers read its input) and the graph's outputs check
them. Nodes the rewrites leave unread (the index vectors' Unsqueezes, the Shape and the
broadcast) are removed with them.
"""

from __future__ import annotations

__all__ = ["IndexArithmeticPass"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import Constant, NameTable, find_constant, infer_shapes, node_label, opset_of
from opfuse.core.dims import same_dim, symbol
from opfuse.core.edit import drop_unread_nodes
from opfuse.passes.base import OpfusePass
from opfuse.passes.patterns import constant_int
from opfuse.report import FusionRecord
from opfuse.core.ops import int_attr, is_op
from opfuse.targets.kernels import Target, load_target

_BROADCASTS = frozenset({"Max", "Min", "Add", "Mul"})  # what an export of broadcast_tensors writes
_IDENTITY_CONSTANT = {"And": True, "Or": False}  # op -> the constant it returns x with


class IndexArithmeticPass(OpfusePass):
    """Index and mask arithmetic in fewer nodes (module docstring)."""

    name = "index-arithmetic"
    options = frozenset({"target"})

    def __init__(self, report=None, *, target: Target | str = "onnx"):
        super().__init__(report)
        target = load_target(target) if isinstance(target, str) else target
        # rule 1 on a folded grid: only where every dim is bound (the grid folds) and one GatherND is
        # what the compiler refuses; elsewhere one GatherND is fewer nodes than the Gathers
        self._folded_grids = target.static_shapes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self._names = NameTable(model)
        self._opset = opset_of(model.opset_imports)
        modified = self._one_dim_one_read(graph)
        candidates = [n for n in graph if _could_apply(n)]
        if candidates:
            infer_shapes(model)  # (once, and only where a rule's structure is there: it reads the whole model)
        for node in candidates:
            if node.graph is None or any(v.is_graph_output() for v in node.outputs):
                continue
            if is_op(node, "GatherND"):
                modified |= self._gather_nd(node)
            elif is_op(node, "Gather"):
                modified |= self._whole_axis(node)
            elif is_op(node, "Unsqueeze"):
                modified |= self._unsqueezes(node)
            else:
                modified |= self._returns_input(node)
        return ir.passes.PassResult(model, modified=modified)

    # -- rule 5 -------------------------------------------------------------------------------
    def _one_dim_one_read(self, graph: ir.Graph) -> bool:
        """Shape nodes reading one dim of graph inputs declared under one name: the first serves all."""
        first: dict[str, ir.Node] = {}
        modified = False
        for node in list(graph):
            dim = _input_dim_read(node)
            if dim is None:
                continue
            kept = first.setdefault(dim, node)
            if kept is node:
                continue
            detail = (f"'{node.inputs[0].name}' and '{kept.inputs[0].name}' are graph inputs whose declared "
                      f"dims read here are both '{dim}'")
            node.outputs[0].replace_all_uses_with(kept.outputs[0])
            graph.remove(node, safe=True)
            self.report.records.append(FusionRecord(
                pattern="Shape(same dim)", node=node_label(node), removed=(node_label(node),),
                produced=node_label(kept), graph="main", detail=detail))
            modified = True
        return modified

    # -- rule 1 -------------------------------------------------------------------------------
    def _gather_nd(self, node: ir.Node) -> bool:
        if int_attr(node, "batch_dims", 0) != 0 or len(node.inputs) != 2 or None in node.inputs:
            return False
        x, indices = node.inputs
        grid = _grid(indices) or (self._constant_grid(indices) if self._folded_grids else None)
        if grid is None or x.shape is None or len(x.shape) < len(grid.vectors):
            return False
        graph, out = node.graph, node.outputs[0]
        for vector in grid.vectors if grid.constant else ():
            graph.register_initializer(vector)
        made, value, axis = [], x, 0
        for vector in grid.vectors:
            gather = ir.Node("", "Gather", [value, vector], attributes=[ir.AttrInt64("axis", axis)],
                             name=self._names.fresh(f"{node.name or 'GatherND'}_gather{axis}"),
                             outputs=[ir.Value(name=self._names.fresh(f"{out.name or 'gathered'}_{axis}"),
                                               type=out.type)])
            made.append(gather)
            value = gather.outputs[0]
            axis += 0 if vector.shape is not None and len(vector.shape) == 0 else 1  # a scalar index drops its axis
        ones = [a for a in range(grid.rank) if a not in grid.positions]
        if ones:
            unsqueeze = self._unsqueeze_node(graph, value, ones, f"{node.name or 'GatherND'}_unsqueeze", out)
            made.append(unsqueeze)
            value = unsqueeze.outputs[0]
        value.shape = out.shape
        graph.insert_before(node, made)
        name = out.name
        out.replace_all_uses_with(value)
        graph.remove(node, safe=True)
        value.name = name
        removed = [node, *drop_unread_nodes([indices.producer()] if indices.producer() is not None else [])]
        scalars = len(grid.vectors) - len(grid.positions)
        self.report.records.append(FusionRecord(
            pattern="GatherND(index grid)->Gather", node=node_label(node),
            removed=tuple(node_label(n) for n in removed), produced=node_label(made[-1]), graph="main",
            detail=(("a constant grid: " if grid.constant else "")
                    + f"indices: {len(grid.positions)} index vectors along axes {list(grid.positions)}"
                    + (f" and {scalars} single index(es)" if scalars else "") + f" of a rank-"
                    f"{grid.rank} grid; {len(made) - (1 if ones else 0)} Gather(s)"
                    + (f" and an Unsqueeze at axes {ones}" if ones else "")),
            output=name))
        return True

    def _constant_grid(self, indices: ir.Value) -> _Grid | None:
        """Rule 1 on a grid already folded into a constant (static shapes fold the Shape, Range and
        Expand that build it): component ``k`` of ``indices[..., k]`` varying along one axis ``p_k`` is
        the vector read along it; one varying along none is a single index (a scalar Gather drops the axis,
        the Unsqueeze puts it back); every axis no component varies along must be of size 1."""
        found = find_constant(indices)
        if not isinstance(found, Constant) or found.array.ndim < 2 or found.array.dtype.kind not in "iu":
            return None
        array = found.array.astype(np.int64)
        grid_shape, rank = array.shape[:-1], array.ndim - 1
        vectors, positions = [], []
        for k in range(array.shape[-1]):
            component = array[..., k]
            varying = [a for a in range(rank) if not np.all(component == np.take(component, [0], axis=a))]
            if len(varying) > 1:
                return None
            if varying:
                p = varying[0]
                line = component[tuple(slice(None) if a == p else 0 for a in range(rank))]
                positions.append(p)
                vectors.append(self._index_constant(np.ascontiguousarray(line), f"{indices.name or 'indices'}_{k}"))
            else:
                vectors.append(self._index_constant(np.array(component.reshape(-1)[0] if component.size else 0,
                                                             np.int64), f"{indices.name or 'indices'}_{k}"))
        if positions != sorted(set(positions)) or any(grid_shape[a] != 1 for a in range(rank) if a not in positions):
            return None  # (out of x's axis order would need a Transpose; a broadcast axis an Expand)
        return _Grid(vectors, tuple(positions), rank, constant=True)

    def _index_constant(self, array: np.ndarray, base: str) -> ir.Value:
        value = ir.Value(name=self._names.fresh(base), shape=ir.Shape(list(array.shape)),
                         type=ir.TensorType(ir.DataType.INT64), const_value=ir.tensor(array.astype(np.int64)))
        return value  # (registered by _gather_nd once the rule applies)

    def _unsqueeze_node(self, graph: ir.Graph, x: ir.Value, axes: list[int], base: str, like: ir.Value) -> ir.Node:
        name = self._names.fresh(base)
        output = ir.Value(name=self._names.fresh(f"{like.name or 'unsqueezed'}_unsqueezed"), type=like.type)
        if self._opset >= 13:
            const = ir.Value(name=self._names.fresh(f"{name}.axes"), shape=ir.Shape([len(axes)]),
                             type=ir.TensorType(ir.DataType.INT64),
                             const_value=ir.tensor(np.array(axes, np.int64)))
            graph.register_initializer(const)
            return ir.Node("", "Unsqueeze", [x, const], name=name, outputs=[output])
        return ir.Node("", "Unsqueeze", [x], attributes=[ir.AttrInt64s("axes", axes)], name=name, outputs=[output])

    # -- rule 2 -------------------------------------------------------------------------------
    def _whole_axis(self, node: ir.Node) -> bool:
        if len(node.inputs) != 2 or None in node.inputs:
            return False
        x, indices = node.inputs
        producer = indices.producer()
        if not is_op(producer, "Range") or x.shape is None or None in producer.inputs:
            return False
        axis = int_attr(node, "axis", 0)
        axis = axis + len(x.shape) if axis < 0 else axis
        if not 0 <= axis < len(x.shape) or constant_int(producer.inputs[0]) != 0 or constant_int(producer.inputs[2]) != 1:
            return False
        dim = _dim_read(producer.inputs[1])
        if dim is None or not same_dim(dim, x.shape[axis]):
            return False
        return self._bypass(node, x, "Gather(Range)", (
            f"Range(0, {_dim_text(dim)}, 1) takes axis {axis} of '{x.name}' whole and in order"), [producer])

    # -- rule 3 -------------------------------------------------------------------------------
    def _unsqueezes(self, node: ir.Node) -> bool:
        inner_out = node.inputs[0] if node.inputs else None
        inner = inner_out.producer() if inner_out is not None else None
        if (not is_op(inner, "Unsqueeze") or inner.graph is not node.graph or inner_out.is_graph_output()
                or len(inner_out.uses()) != 1 or inner.inputs[0] is None):
            return False
        first, second = _axes(inner), _axes(node)
        if first is None or second is None:
            return False
        x = inner.inputs[0]
        rank = len(x.shape) if x.shape is not None else None
        if min(first + second) < 0 and rank is None:
            return False
        if rank is not None:
            first = [a % (rank + len(first)) for a in first]
            second = [a % (rank + len(first) + len(second)) for a in second]
        if len(set(first)) != len(first) or len(set(second)) != len(second):
            return False
        slots, position = [], 0  # the final positions the first Unsqueeze's output occupies, in order
        while len(slots) <= max(first):
            if position not in second:
                slots.append(position)
            position += 1
        axes = sorted(set(second) | {slots[a] for a in first})
        graph, out = node.graph, node.outputs[0]
        merged = self._unsqueeze_node(graph, x, axes, node.name or "Unsqueeze", out)
        merged.outputs[0].shape = out.shape
        graph.insert_before(node, [merged])
        name = out.name
        out.replace_all_uses_with(merged.outputs[0])
        graph.remove(node, safe=True)
        merged.outputs[0].name = name
        removed = [node, *drop_unread_nodes([inner])]
        self.report.records.append(FusionRecord(
            pattern="Unsqueeze+Unsqueeze", node=node_label(node), removed=tuple(node_label(n) for n in removed),
            produced=node_label(merged), graph="main", detail=f"one Unsqueeze at axes {axes}", output=name))
        return True

    # -- rule 4 -------------------------------------------------------------------------------
    def _returns_input(self, node: ir.Node) -> bool:
        if len(node.inputs) != 2 or None in node.inputs:
            return False
        if is_op(node, "Expand"):
            x, c = node.inputs
            found = find_constant(c)
            if (not isinstance(found, Constant) or found.array.ndim != 1 or not np.all(found.array == 1)
                    or x.shape is None or found.array.size > len(x.shape)):
                return False
            return self._bypass(node, x, "Expand(ones)", f"every dim of the target shape is 1: '{x.name}' unchanged")
        keep = _IDENTITY_CONSTANT[node.op_type]
        for x, c in (node.inputs, node.inputs[::-1]):
            found = find_constant(c)
            if (isinstance(found, Constant) and found.array.dtype == np.bool_ and np.all(found.array == keep)
                    and _broadcasts_into(found.array.shape, x.shape)):
                return self._bypass(node, x, f"{node.op_type}({keep})",
                                    f"{node.op_type} with a constant of all {keep} returns '{x.name}'")
        return False

    def _bypass(self, node: ir.Node, x: ir.Value, pattern: str, detail: str, also=()) -> bool:
        """Readers of ``node``'s output read ``x``; ``node`` (and ``also`` left unread) removed."""
        node.outputs[0].replace_all_uses_with(x)
        graph = node.graph
        graph.remove(node, safe=True)
        removed = [node, *drop_unread_nodes(list(also))]
        # no tensor of its own to check (x is unchanged): the graph outputs and later rewrites check it
        self.report.records.append(FusionRecord(
            pattern=pattern, node=node_label(node), removed=tuple(node_label(n) for n in removed),
            produced="", graph="main", detail=detail))
        return True


def _could_apply(node: ir.Node) -> bool:
    """A cheap look at the structure of rules 1-4 (before shape inference, which reads the whole model)."""
    def made_by(value, *ops):
        return value is not None and is_op(value.producer(), *ops)

    if is_op(node, "GatherND"):
        return len(node.inputs) == 2 and (made_by(node.inputs[1], "Concat")
                                          or isinstance(find_constant(node.inputs[1]), Constant))
    if is_op(node, "Gather"):
        return len(node.inputs) == 2 and made_by(node.inputs[1], "Range")
    if is_op(node, "Unsqueeze"):
        return bool(node.inputs) and made_by(node.inputs[0], "Unsqueeze")
    if is_op(node, "Expand", *_IDENTITY_CONSTANT):
        return len(node.inputs) == 2 and any(isinstance(find_constant(v), Constant) for v in node.inputs)
    return False


class _Grid:
    def __init__(self, vectors: list[ir.Value], positions: tuple[int, ...], rank: int, constant: bool = False):
        self.vectors, self.positions, self.rank, self.constant = vectors, positions, rank, constant


def _grid(indices: ir.Value) -> _Grid | None:
    """Rule 1's index grid behind GatherND's ``indices``, or None."""
    concat = indices.producer()
    if not is_op(concat, "Concat") or len(concat.inputs) < 1 or None in concat.inputs:
        return None
    expands, shape = [], None
    for piece in concat.inputs:
        unsqueeze = piece.producer()
        axes = _axes(unsqueeze) if is_op(unsqueeze, "Unsqueeze") else None
        expand = unsqueeze.inputs[0].producer() if axes is not None and unsqueeze.inputs[0] is not None else None
        if axes is None or len(axes) != 1 or not is_op(expand, "Expand") or None in expand.inputs:
            return None
        if shape is not None and expand.inputs[1] is not shape:
            return None
        shape = expand.inputs[1]
        expands.append((axes[0], expand.inputs[0]))
    factors = [_unsqueezed_vector(g) for _, g in expands]
    if None in factors:
        return None
    rank = factors[0][2]
    if any(f[2] != rank for f in factors):
        return None
    # the Unsqueeze appends the last axis (-1 or the rank) and the Concat joins along it
    if any(a not in (-1, rank) for a, _ in expands) or int_attr(concat, "axis", 0) not in (-1, rank):
        return None
    positions = tuple(f[1] for f in factors)
    if list(positions) != sorted(set(positions)):
        return None  # each index vector on its own axis, in x's axis order (else a Transpose would be needed)
    broadcast = shape.producer()
    if not _whole_shape(broadcast):
        return None
    joined = broadcast.inputs[0].producer() if broadcast.inputs[0] is not None else None
    if not is_op(joined, *_BROADCASTS) or {id(v) for v in joined.inputs} != {id(g) for _, g in expands} \
            or len(joined.inputs) != len(expands):
        return None
    return _Grid([f[0] for f in factors], positions, rank)


def _input_dim_read(node: ir.Node) -> str | None:
    """The declared dim name a ``Shape(t, start=k, end=k+1)`` of a graph input ``t`` reads, or None."""
    if not is_op(node, "Shape") or not node.inputs or node.inputs[0] is None or "end" not in node.attributes:
        return None
    t = node.inputs[0]
    if not t.is_graph_input() or t.is_initializer() or t.shape is None or node.outputs[0].is_graph_output():
        return None
    rank = len(t.shape)
    start, end = int_attr(node, "start", 0), int_attr(node, "end", 0)
    start, end = start + rank if start < 0 else start, end + rank if end < 0 else end
    if not 0 <= start < rank or end != start + 1:
        return None
    return symbol(t.shape[start])


def _whole_shape(node: ir.Node | None) -> bool:
    """Whether ``node`` is a Shape of its whole input (start 0, no end)."""
    return is_op(node, "Shape") and int_attr(node, "start", 0) == 0 and "end" not in node.attributes


def _unsqueezed_vector(value: ir.Value) -> tuple[ir.Value, int, int] | None:
    """(v, the axis it varies along, the rank) for ``value = Unsqueeze(...(v))`` with ``v`` 1-D."""
    chain = []
    while is_op(value.producer(), "Unsqueeze"):
        node = value.producer()
        axes = _axes(node)
        if axes is None or node.inputs[0] is None:
            return None
        chain.append(axes)
        value = node.inputs[0]
    if not chain or value.shape is None or len(value.shape) != 1:
        return None
    rank, position = 1, 0
    for axes in reversed(chain):
        rank += len(axes)
        axes = sorted(a % rank for a in axes)
        for a in axes:  # inserting at a (in increasing order) shifts what was at a or beyond
            if a <= position:
                position += 1
    return value, position, rank


def _axes(node: ir.Node | None) -> list[int] | None:
    """An Unsqueeze's axes (its input from opset 13, its attribute before), when constant."""
    if node is None:
        return None
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        found = find_constant(node.inputs[1])
        return [int(a) for a in found.array.reshape(-1)] if isinstance(found, Constant) else None
    attr = node.attributes.get("axes")
    return [int(a) for a in attr.value] if attr is not None else None


def _dim_read(value: ir.Value) -> int | ir.SymbolicDim | None:
    """The dim a scalar is read off: ``Squeeze(Shape(t)[k:k+1])``, ``Gather(Shape(t), k)``, a constant."""
    constant = constant_int(value)
    if constant is not None:
        return constant
    producer = value.producer()
    if is_op(producer, "Squeeze") and producer.inputs[0] is not None:
        shape = producer.inputs[0].producer()
        if not is_op(shape, "Shape") or shape.inputs[0] is None or shape.inputs[0].shape is None:
            return None
        dims = list(shape.inputs[0].shape)
        start, end = int_attr(shape, "start", 0), shape.attributes.get("end")
        picked = dims[start:int(end.value)] if end is not None else dims[start:]
        return picked[0] if len(picked) == 1 else None
    if is_op(producer, "Gather") and int_attr(producer, "axis", 0) == 0 and producer.inputs[0] is not None:
        shape = producer.inputs[0].producer()
        index = find_constant(producer.inputs[1])
        if (not _whole_shape(shape) or not isinstance(index, Constant) or index.array.ndim != 0
                or shape.inputs[0] is None or shape.inputs[0].shape is None):
            return None
        dims = list(shape.inputs[0].shape)
        k = int(index.array)
        return dims[k] if -len(dims) <= k < len(dims) else None
    return None


def _dim_text(dim) -> str:
    return str(dim) if isinstance(dim, int) else f"'{dim.value}'"


def _broadcasts_into(shape: tuple[int, ...], target: ir.Shape | None) -> bool:
    """Whether a constant of ``shape`` broadcasts into ``target`` without enlarging it."""
    if target is None or len(shape) > len(target):
        return False
    for d, t in zip(reversed(shape), reversed(list(target))):
        if d != 1 and not (isinstance(t, int) and t == d):
            return False
    return True
