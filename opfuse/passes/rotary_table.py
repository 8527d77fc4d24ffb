"""``rotary-table``: a rotary embedding's ``Cos``/``Sin`` of the positions as a table read by position (``--target qnn``).

Decoders exported from transformers compute their rotary angles in the graph: ``position_ids``
(an integer input) is cast to float, multiplied by the inverse frequencies, concatenated with
itself, and ``Cos`` and ``Sin`` of that are taken. QNN's HTP computes a float graph in float16,
where the angle ``position * inv_freq`` is rounded to 11 bits: at position 127 it is off by up to
0.022 rad, and its sine by 0.09 (``python benchmarks/qnn_decoders.py --angles``), which moves
every rotated key by a few percent of its scale. This pass writes each such ``Cos(A)`` (and
``Sin(A)``) as ``Gather(table, position_ids, axis=0)``, the table computed once, in float32 on
the CPU, by the graph's own nodes: the HTP then reads values rounded once to float16 (5e-4 of
their scale) instead of computing them from a rounded angle.

The algebra. Let ``p`` be the integer input and ``A = f(p)`` the angles. When every element of
``A`` in the row ``A[i..., :]`` depends on ``p[i...]`` alone and on no other entry of ``p``
(``f`` is *position-wise*), there is a function ``g`` with ``Cos(A)[i..., :] = g(p[i...])``, and
``g(q)`` is the row any index holding ``q`` gets: ``table[q, :] = Cos(f(q))``. So
``Cos(A) = Gather(table, p, axis=0)`` for every ``p`` whose values lie in ``[0, P)``, the rows the
table holds; the table's values are the very float32 numbers the graph computes on ONNX Runtime's
CPU (the same nodes, run there), so the rewrite is exact there.

Legality, each checked:

- ``Cos``/``Sin`` in the main graph, its output's shape static and equal to ``p``'s shape plus one
  last axis (the row);
- every node between ``p`` and it is one of :data:`PATH_OPS` (casts, shape moves, ``Concat``,
  products and quotients with constants: no reduction over positions, no other input), every
  other leaf a constant, and ``p`` one integer graph input with a static shape;
- position-wise, by evaluation: the path, run on the CPU on draws of positions scattered over
  ``p``'s entries (two random draws), gives exactly the rows the table has for them (a path that
  moved or mixed positions would not);
- the bound ``P``: the deployment's context, the number of keys a query attends to, read from the
  graph once its dims are bound (the Softmax's last axis, or Attention-23's present key length, or
  without a present (a prefill with no cache) its key input's length; ``--dim past_seq=255`` gives 256,
  a 64-token prefill 64). A causal decoder's positions count the tokens before, so they
  stay below the context it attends over; a position at or past ``P`` is out of the table (ONNX
  Runtime's CPU raises on it). With no bound in the graph (symbolic dims, no attention) the site is
  left, and the refusal says so.

Both tables together hold ``2 * P * D`` floats (SmolLM2-135M at a 256-token context: 2 x 256 x 64).
"""

from __future__ import annotations

__all__ = ["RotaryTablePass", "PATH_OPS", "context_length"]

import numpy as np
import onnx
import onnx_ir as ir

from opfuse.core.analysis import NameTable, node_label
from opfuse.core.edit import drop_unread_nodes
from opfuse.core.ops import is_op
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord

# ops a position-wise path is made of: no reduction, no data-dependent shape, no other input
PATH_OPS = frozenset({"Cast", "Unsqueeze", "Squeeze", "Reshape", "Transpose", "Expand", "Concat", "Identity",
                      "Mul", "Div", "MatMul", "Constant"})
_INTEGER = {ir.DataType.INT64, ir.DataType.INT32, ir.DataType.INT16, ir.DataType.INT8, ir.DataType.UINT8,
            ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64}
_DRAWS = 2


def context_length(graph: ir.Graph) -> int | None:
    """The number of keys a query attends to, once the dims are bound: the largest static last axis of a
    Softmax input, or of an Attention-23's present key sequence; None when the graph has neither."""
    found = []
    for node in graph:
        if is_op(node, "Softmax") and node.inputs[0] is not None and node.inputs[0].shape is not None:
            last = node.inputs[0].shape[-1] if len(node.inputs[0].shape) else None
            if isinstance(last, int):
                found.append(last)
        elif is_op(node, "Attention"):
            found.append(_attention_keys(node))
    return max((f for f in found if f is not None), default=None)


def _attention_keys(node: ir.Node) -> int | None:
    """The keys an Attention-23 attends over: its present key's sequence length; without a present
    output (a prefill with no cache), its key input's (3-D [B, S, H*D] or 4-D [B, H, S, D]: axis -2) plus
    a past key's, when it reads one."""
    def length(value):
        shape = value.shape if value is not None else None
        return shape[-2] if shape is not None and len(shape) >= 3 and isinstance(shape[-2], int) else None

    if len(node.outputs) > 1 and length(node.outputs[1]) is not None:
        return length(node.outputs[1])
    keys = length(node.inputs[1]) if len(node.inputs) > 1 else None
    past = node.inputs[4] if len(node.inputs) > 4 else None
    if keys is None or (past is not None and length(past) is None):
        return None
    return keys + (length(past) if past is not None else 0)


class RotaryTablePass(OpfusePass):
    """Cos/Sin of position-wise angles of an integer input -> Gather from a constant table (module docstring)."""

    name = "rotary-table"
    after_rewrites = True  # (after the folds have settled the path into its constants)
    options = frozenset({"target", "exclude", "veto"})  # (what the fusion stage hands every pass; none used)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self._names = NameTable(model)
        self._opset = model.opset_imports.get("", 18)
        sites = [n for n in graph if is_op(n, "Cos", "Sin")]
        if not sites:
            return ir.passes.PassResult(model, modified=False)
        bound = context_length(graph)
        modified = False
        for node in sites:
            modified |= self._rewrite(node, bound)
        return ir.passes.PassResult(model, modified=modified)

    def _rewrite(self, node: ir.Node, bound: int | None) -> bool:
        pattern = "rotary Cos/Sin->table"
        out = node.outputs[0]
        path = _path(node)
        if isinstance(path, str):
            self.refuse(pattern, node, path)
            return False
        positions, nodes = path
        shape = list(positions.shape)
        if (out.shape is None or not all(isinstance(d, int) for d in out.shape)
                or list(out.shape)[:-1] != shape):
            self.refuse(pattern, node, f"its output's shape {out.shape} is not the positions' {shape} plus a row")
            return False
        if bound is None:
            self.refuse(pattern, node, "no bound on the positions: the graph has no static attention context "
                                       "(bind the dims, e.g. --dim past_seq=255)")
            return False
        try:
            table = _table(nodes, positions, out, bound, self._opset)
        except Exception as error:  # noqa: BLE001 (the CPU could not run the path: the site stays as it is)
            self.refuse(pattern, node, f"its path does not run on the CPU alone ({type(error).__name__}: {error})")
            return False
        if isinstance(table, str):
            self.refuse(pattern, node, table)
            return False
        value = ir.Value(name=self._names.fresh(f"{out.name}_table"), shape=ir.Shape(list(table.shape)),
                         type=ir.TensorType(out.type.dtype), const_value=ir.tensor(table))
        node.graph.register_initializer(value)
        gather = ir.Node("", "Gather", [value, positions], attributes=[ir.AttrInt64("axis", 0)],
                         name=self._names.fresh(f"{node.name or node.op_type}_table"),
                         outputs=[ir.Value(name=self._names.fresh(f"{out.name}_gathered"), type=out.type,
                                           shape=out.shape)])
        node.graph.insert_before(node, [gather])
        name = out.name
        out.replace_all_uses_with(gather.outputs[0], replace_graph_outputs=True)
        node.graph.remove(node, safe=True)
        gather.outputs[0].name = name
        removed = [node, *drop_unread_nodes([v.producer() for v in node.inputs if v is not None])]
        self.report.records.append(FusionRecord(
            pattern=pattern, node=node_label(node), removed=tuple(node_label(n) for n in removed),
            produced=node_label(gather), graph="main", weight_bytes=table.nbytes, output=name,
            detail=(f"{node.op_type} of angles computed from '{positions.name}' position by position "
                    f"({len(nodes) - 1} nodes) -> a [{bound}, {table.shape[1]}] table read at '{positions.name}': "
                    f"the same float32 values for positions 0..{bound - 1} (the graph's attention context); "
                    f"a position at or past {bound} is outside the table")))
        return True


def _path(node: ir.Node):
    """(the integer input, the path's nodes in graph order with ``node`` last), or why there is none."""
    positions, nodes, seen = None, [], set()
    stack = [node]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if current is not node and not is_op(current, *PATH_OPS):
            return f"its angles go through {node_label(current)} ({current.op_type}), not a position-wise op"
        if current.graph is None or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                                        for a in current.attributes.values()):
            return "it is not in the main graph"
        nodes.append(current)
        for value in current.inputs:
            if value is None or value.const_value is not None:
                continue
            if value.is_graph_input():
                if value.type is None or value.type.dtype not in _INTEGER:
                    return f"its angles read the input '{value.name}', which is not integer positions"
                if value.shape is None or not all(isinstance(d, int) for d in value.shape):
                    return f"the positions '{value.name}' have no static shape (bind the dims)"
                if positions is not None and positions is not value:
                    return f"its angles read two inputs, '{positions.name}' and '{value.name}'"
                positions = value
                continue
            producer = value.producer()
            if producer is None:
                return f"'{value.name}' has no producer and is no constant"
            stack.append(producer)
    if positions is None:
        return "its angles are constant (the constant folding's, not this pass's)"
    order = {id(n): i for i, n in enumerate(node.graph)}
    return positions, sorted(nodes, key=lambda n: order[id(n)])


def _table(nodes: list[ir.Node], positions: ir.Value, out: ir.Value, bound: int, opset: int):
    """The [bound, row] table of ``out`` over positions 0..bound-1, computed by ``nodes`` on ONNX Runtime's
    CPU; or why the path is not position-wise (two draws of scattered positions)."""
    import onnxruntime as ort  # (the CPU runs the path: only where a site is found)

    initializers, seen = [], set()
    for n in nodes:
        for v in n.inputs:
            if v is not None and v.const_value is not None and v.name not in seen and v.producer() is None:
                seen.add(v.name)
                initializers.append(onnx.numpy_helper.from_array(v.const_value.numpy(), v.name))
    dtype = positions.type.dtype.numpy()
    shape = [int(d) for d in positions.shape]
    graph = onnx.helper.make_graph(
        [ir.serde.serialize_node(n) for n in nodes], "rotary_path",
        [onnx.helper.make_tensor_value_info(positions.name, int(positions.type.dtype), shape)],
        [onnx.helper.make_tensor_value_info(out.name, int(out.type.dtype), None)], initializers)
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    proto.ir_version = 10
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    count = int(np.prod(shape)) if shape else 1
    rows = []
    for start in range(0, bound, count):
        chunk = np.minimum(np.arange(start, start + count), bound - 1).astype(dtype).reshape(shape)
        (result,) = session.run(None, {positions.name: chunk})
        rows.append(result.reshape(count, -1))
    table = np.concatenate(rows)[:bound]
    rng = np.random.default_rng(0)
    for _ in range(_DRAWS):
        draw = rng.integers(0, bound, shape).astype(dtype)
        (result,) = session.run(None, {positions.name: draw})
        if not np.array_equal(result.reshape(count, -1), table[draw.reshape(-1)], equal_nan=True):
            return "its angles are not position-wise: a draw of scattered positions gives other rows than the table's"
    return np.ascontiguousarray(table)
