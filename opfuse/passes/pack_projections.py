"""``pack-projections``: MatMuls that read one input with constant weights -> one MatMul, then Split.

A decoder's attention projects its input three times (q, k, v), and its MLP twice (gate,
up); each MatMul is a kernel launch that reads the input again. ONNX Runtime's model
builder writes one MatMul with the weights side by side (packed QKV).

Algebra, for x [..., K] and constant weights W_i [K, N_i] (i = 1..n, n >= 2):

    MatMul(x, W_i) = Split(MatMul(x, Concat(W_1, ..., W_n, axis=1)), [N_1, ..., N_n], axis=-1)[i]

exact: each output column is the same dot product of a row of x with a column of W_i (a
kernel may sum it in another order, within verification's tolerance). The packed weight
is new; each W_i is dropped when nothing else reads it. Each Split output keeps the name of
the MatMul output it replaces, so verification checks every packed projection at its own
tensor, and a graph output stays one.

Legality (a refusal, with the reason, for each MatMul left out of a group):

- the weight is a constant (an initializer or a Constant node, not a graph input) of rank 2;
- every weight of the group has x's dtype and the same K (rows);
- only the main graph (a function has no initializers; a subgraph's constant may be the
  outer graph's) is packed.

Not every packing pays: the Split copies the outputs, and a runtime that fuses a MatMul with
what follows loses that. At ``--target onnxruntime`` the measured choice (:mod:`opfuse.tune`,
family ``packed-projections``) times it on and off.
"""

from __future__ import annotations

__all__ = ["PackProjectionsPass"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import Constant, NameTable, find_constant, node_label, opset_of
from opfuse.core.edit import drop_if_unused
from opfuse.core.ops import is_op
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord

_PATTERN = "MatMul siblings->packed MatMul"


class PackProjectionsPass(OpfusePass):
    """Pack sibling MatMuls with constant weights into one MatMul and a Split (module docstring)."""

    name = "pack-projections"
    after_rewrites = True  # (a packed MatMul is no projection the patterns know: they go first)
    options = frozenset({"target", "exclude", "veto"})  # (what the fusion stage hands every pass; none used)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        names, modified = None, False
        values = [v for v in model.graph.inputs] + [o for n in model.graph for o in n.outputs]
        for x in values:
            group = self._group(x)
            if len(group) < 2:
                continue
            names = names or NameTable(model)
            self._pack(model, x, group, names)
            modified = True
        return ir.passes.PassResult(model, modified=modified)

    def _group(self, x: ir.Value) -> list[tuple[ir.Node, np.ndarray]]:
        """The MatMuls reading ``x`` as their first input that can be packed, with their weights;
        a refusal for each MatMul reading ``x`` that cannot be."""
        readers = [n for n, i in x.uses() if i == 0 and is_op(n, "MatMul") and n.graph is not None]
        if len(readers) < 2:
            return []
        group, left = [], []
        for node in readers:
            weight = find_constant(node.inputs[1], "weight")
            if not isinstance(weight, Constant):
                left.append((node, f"its weight is not a constant ({weight.sentence})"))
            elif weight.array.ndim != 2:
                left.append((node, f"its weight has rank {weight.array.ndim}, not 2"))
            elif x.dtype is not None and weight.array.dtype != np.dtype(x.dtype.numpy()):
                left.append((node, f"its weight is {weight.array.dtype}, not the input's {x.dtype}"))
            else:
                group.append((node, weight.array))
        if group and len({w.shape[0] for _, w in group}) != 1:
            rows = group[0][1].shape[0]
            left += [(n, f"its weight has {w.shape[0]} rows, the others {rows}")
                     for n, w in group if w.shape[0] != rows]
            group = [(n, w) for n, w in group if w.shape[0] == rows]
        for node, reason in left:  # (each round: the last one's refusals describe the graph written)
            self.refuse(_PATTERN, node, f"not packed with the other MatMuls reading {x.name}: {reason}")
        return group if len(group) >= 2 else []

    def _pack(self, model: ir.Model, x: ir.Value, group, names: NameTable) -> None:
        nodes = [n for n, _ in group]
        first = min(nodes, key=lambda n: list(model.graph).index(n))
        packed = np.concatenate([w for _, w in group], axis=1)
        weight_name = names.fresh(f"{first.name or 'MatMul'}_packed_weight")
        tensor = ir.Tensor(packed, name=weight_name)
        weight = ir.Value(name=weight_name, shape=ir.Shape(packed.shape), type=ir.TensorType(tensor.dtype),
                          const_value=tensor)
        model.graph.register_initializer(weight)
        matmul = ir.Node("", "MatMul", [x, weight], name=names.fresh(f"{first.name or 'MatMul'}_packed"))
        matmul.outputs[0].name = names.fresh(f"{matmul.name}_output")
        widths = np.array([w.shape[1] for _, w in group], np.int64)
        split_name = names.fresh(f"{matmul.name}_split")
        if opset_of(model.opset_imports) >= 13:
            sizes_name = names.fresh(f"{split_name}_sizes")
            sizes = ir.Value(name=sizes_name, shape=ir.Shape([len(widths)]), type=ir.TensorType(ir.DataType.INT64),
                             const_value=ir.Tensor(widths, name=sizes_name))
            model.graph.register_initializer(sizes)
            split = ir.Node("", "Split", [matmul.outputs[0], sizes], attributes=[ir.AttrInt64("axis", -1)],
                            num_outputs=len(group), name=split_name)
        else:
            split = ir.Node("", "Split", [matmul.outputs[0]], attributes=[
                ir.AttrInt64("axis", -1), ir.AttrInt64s("split", [int(w) for w in widths])],
                num_outputs=len(group), name=split_name)
        model.graph.insert_before(first, [matmul, split])
        old_weights = []
        for (node, w), out in zip(group, split.outputs):
            old = node.outputs[0]
            out.dtype, out.shape = old.dtype, old.shape
            old_name = old.name
            old_weights.append(node.inputs[1])
            if old.is_graph_output():
                index = list(model.graph.outputs).index(old)
                model.graph.outputs[index] = out
            old.replace_all_uses_with(out)
            old.name = None
            model.graph.remove(node, safe=True)
            out.name = old_name
        for value in old_weights:
            drop_if_unused(value)
        labels = tuple(node_label(n) for n in nodes)
        self.report.records.append(FusionRecord(
            pattern=_PATTERN, node=labels[0], removed=labels, produced=matmul.name, weight_bytes=packed.nbytes,
            detail=(f"{len(group)} MatMuls reading {x.name} -> one MatMul with their weights side by side "
                    f"[{packed.shape[0]}, {packed.shape[1]}], then Split into {', '.join(map(str, widths))}"),
            output=split.outputs[0].name or ""))
