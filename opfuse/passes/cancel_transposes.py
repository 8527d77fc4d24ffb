"""``cancel-transposes``: Transposes moved past element-wise ops until they meet their inverse.

A model re-exported NHWC (a Caffe or TensorFlow model through tf2onnx) wraps every conv and
pool in ``Transpose(0,3,1,2) -> Conv -> Transpose(0,2,3,1)`` and runs its activations and
residual adds in NHWC between them. Once the folds have absorbed the affine ops
(:mod:`opfuse.passes.layout_chain`), what is left between two convs is
``Transpose(NHWC) -> Relu -> Transpose(NCHW)``: two copies of the map that cancel.

Algebra, with T_p the Transpose by perm p (output axis i reads input axis p[i]):

1. An element-wise op commutes with it: E(T_p(x)) = T_p(E(x)) (the op table's ELEMWISE kind:
   input 0 is the data, other inputs, like Clip's bounds, are scalars and stay).
2. A broadcasting op (the BROADCAST kind, every input data; not BatchNormalization, whose
   statistics belong to axis 1) whose every input is T_p of a value of the same rank, or a
   constant: B(T_p(a), T_p(b), c) = T_p(B(a, b, c')) with c' = T_{p^-1}(c) (c first given
   leading 1s up to the rank: the same broadcast, its axes permuted back).
3. Two in a row compose: T_q(T_p(x)) = T_r(x) with r[i] = p[q[i]]; when r is the identity,
   the readers of T_q read x.

Rules 1 and 2 move a Transpose one op later (the op then reads the untransposed values);
they apply only when that Transpose's output has no other reader and is not a graph output,
so no value is computed twice, and only where they lead somewhere: rule 2 with two or more
transposed inputs (one Transpose instead of several), else when the op's output reaches
another Transpose through ops these rules move past (where rule 3 then applies). A
Transpose with nowhere to go is not moved: a pattern after it keeps the form its rule reads. Rule 3 applies whenever the first Transpose feeds the second
(the first stays for its other readers). A moved op's output, and a cancelled pair's, keep
the name of the tensor they replace, which means the same values; verification checks it.
Nothing is refused: a Transpose that no rule moves stays where it was.
"""

from __future__ import annotations

__all__ = ["CancelTransposesPass"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import Constant, NameTable, Scope, find_constant, iter_scopes, node_label
from opfuse.core.edit import add_constant, drop_if_unused
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord
from opfuse.core.ops import OpKind, is_op, op_kind

MAX_SCANS = 16  # passes over a graph per call; one usually suffices (a moved Transpose is met again downstream)


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    if attr is None:  # the default reverses the axes: needs the rank
        x = node.inputs[0] if node.inputs else None
        return list(range(len(x.shape)))[::-1] if x is not None and x.shape is not None else None
    return [int(p) for p in attr.value]


def _sole_transpose(value: ir.Value | None) -> tuple[ir.Node, list[int]] | None:
    """The Transpose computing ``value``, if it is one and nothing else reads ``value``."""
    node = value.producer() if value is not None else None
    if not is_op(node, "Transpose") or value.is_graph_output() or len(value.uses()) != 1:
        return None
    perm = _perm(node)
    return (node, perm) if perm is not None else None


def _broadcasts(node: ir.Node) -> bool:
    """A broadcasting op of rule 2 (every input data; BatchNormalization's are per axis 1)."""
    return op_kind(node) is OpKind.BROADCAST and not is_op(node, "BatchNormalization") and len(node.outputs) == 1


MAX_LOOKAHEAD = 64  # ops followed from a Transpose to the next one


def _reaches_transpose(value: ir.Value) -> bool:
    """Whether some reader of ``value``, or of what rules 1 and 2 move past after it, is a
    Transpose (where rule 3 will apply once this one has moved down to it)."""
    seen, todo = 0, [value]
    while todo and seen < MAX_LOOKAHEAD:
        value = todo.pop()
        seen += 1
        if value.is_graph_output():
            continue
        for use in value.uses():
            reader = use.node
            if is_op(reader, "Transpose"):
                return True
            if len(reader.outputs) != 1:
                continue
            if op_kind(reader) is OpKind.ELEMWISE and use.idx == 0:
                todo.append(reader.outputs[0])
            elif _broadcasts(reader) and all(
                    v is value or v is None or is_op(v.producer(), "Transpose")
                    or isinstance(find_constant(v), Constant)
                    for v in reader.inputs):
                todo.append(reader.outputs[0])
    return False


class CancelTransposesPass(OpfusePass):
    """Move Transposes past element-wise ops and cancel inverse pairs (module docstring)."""

    name = "cancel-transposes"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self._names = NameTable(model)
        modified = False
        for scope in list(iter_scopes(model)):
            for _ in range(MAX_SCANS):
                if not self._scan(scope):
                    break
                modified = True
        return ir.passes.PassResult(model, modified=modified)

    def _scan(self, scope: Scope) -> bool:
        """One pass over the graph in order; a Transpose moved past a node is met again at
        the node's readers, later in the same scan."""
        changed = False
        for node in list(scope.graph):
            if node.graph is None:
                continue
            if is_op(node, "Transpose"):
                changed |= self._compose(node, scope)
            elif len(node.outputs) == 1:
                changed |= self._move_past(node, scope)
        return changed

    # -- rule 3 ---------------------------------------------------------------------------
    def _compose(self, node: ir.Node, scope: Scope) -> bool:
        first = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        if not is_op(first, "Transpose") or first.graph is not node.graph:
            return False
        p, q = _perm(first), _perm(node)
        if p is None or q is None or len(p) != len(q):
            return False
        r = [p[i] for i in q]
        x = first.inputs[0]
        if r == list(range(len(r))):
            out = node.outputs[0]
            detail = f"perm {p} then {q} is the identity"
            if out.is_graph_output():  # an Identity keeps the output's name (clean-up removes it where it can)
                name = out.name or ""
                self._replace(node, scope, "Identity", [x], [])
                self._record("Transpose+Transpose", node, [node], scope, detail, name)
            else:
                out.replace_all_uses_with(x)
                self._record("Transpose+Transpose", node, [node], scope, detail, "")
                scope.container.remove(node, safe=True)
        else:
            name = node.outputs[0].name or ""
            self._replace(node, scope, "Transpose", [x], [ir.AttrInt64s("perm", r)])
            self._record("Transpose+Transpose", node, [node], scope, f"perm {p} then {q} is {r}", name)
        if not first.outputs[0].uses() and not first.outputs[0].is_graph_output():
            scope.container.remove(first, safe=True)
        return True

    # -- rules 1 and 2 --------------------------------------------------------------------
    def _move_past(self, node: ir.Node, scope: Scope) -> bool:
        kind = op_kind(node)
        if kind is OpKind.ELEMWISE and node.inputs and node.inputs[0] is not None:
            found = _sole_transpose(node.inputs[0])
            if found is None or found[0].graph is not node.graph or not _reaches_transpose(node.outputs[0]):
                return False
            t, perm = found
            inputs = [t.inputs[0], *node.inputs[1:]]
        elif _broadcasts(node):
            planned = self._broadcast_inputs(node, scope)
            if planned is None:
                return False
            inputs, perm, moved = planned
            if len(moved) < 2 and not _reaches_transpose(node.outputs[0]):
                return False
        else:
            return False
        transposes = [v.producer() for v in node.inputs if v is not None and is_op(v.producer(), "Transpose")]
        label, name = f"Transpose->{node.op_type}", node.outputs[0].name or ""
        self._replace(node, scope, node.op_type, inputs, list(node.attributes.values()), then_perm=perm)
        self._record(label, node, transposes, scope, f"perm {perm} moved after it", name)
        for t in dict.fromkeys(transposes):  # (each once, in order)
            if t.graph is not None and not t.outputs[0].uses() and not t.outputs[0].is_graph_output():
                scope.container.remove(t, safe=True)
        return True

    def _broadcast_inputs(self, node: ir.Node, scope: Scope):
        """(new inputs, perm, transposes) when every input is a sole-use T_p of the same p, or
        a constant; None otherwise."""
        perm, sources = None, []
        for value in node.inputs:
            found = _sole_transpose(value) if value is not None else None
            if found is not None and found[0].graph is node.graph:
                if perm is not None and found[1] != perm:
                    return None
                perm = found[1]
                sources.append(("moved", found[0]))
                continue
            const = find_constant(value, "operand")
            if not isinstance(const, Constant):
                return None
            sources.append(("constant", const))
        if perm is None:
            return None
        rank, back = len(perm), list(np.argsort(perm))
        inputs = []
        for what, source in sources:
            if what == "moved":
                inputs.append(source.inputs[0])
                continue
            array = source.array
            if array.ndim > rank:
                return None
            full = array.reshape((1,) * (rank - array.ndim) + array.shape)
            inputs.append(add_constant(scope, self._names, node, np.ascontiguousarray(np.transpose(full, back)),
                                       f"{source.value.name or 'constant'}_untransposed"))
        return inputs, perm, [s for w, s in sources if w == "moved"]

    # -- shared ---------------------------------------------------------------------------
    def _replace(self, node: ir.Node, scope: Scope, op: str, inputs, attributes, then_perm=None) -> None:
        """A new ``op`` node (and Transpose(then_perm) after it) takes over ``node``'s output."""
        out = node.outputs[0]
        name = out.name
        made = ir.Node(node.domain, op, inputs, attributes=attributes, name=self._names.fresh(node.name or op),
                       outputs=[ir.Value(name=self._names.fresh(f"{name or op}_untransposed"), type=out.type)])
        new = [made]
        result = made.outputs[0]
        if then_perm is not None:
            after = ir.Node("", "Transpose", [result], attributes=[ir.AttrInt64s("perm", then_perm)],
                            name=self._names.fresh(f"{node.name or op}_transpose"),
                            outputs=[ir.Value(name=self._names.fresh(f"{name or op}_t"), type=out.type)])
            new.append(after)
            result = after.outputs[0]
        result.shape = out.shape
        scope.container.insert_before(node, new)
        out.replace_all_uses_with(result, replace_graph_outputs=True)
        former = [v for v in node.inputs if v is not None]
        scope.container.remove(node, safe=True)
        for value in former:
            drop_if_unused(value)
        if name:
            result.name = name

    def _record(self, pattern: str, node: ir.Node, removed, scope: Scope, detail: str, output: str) -> None:
        self.report.records.append(FusionRecord(
            pattern=pattern, node=node_label(node), removed=tuple(node_label(n) for n in removed),
            produced="", graph=scope.label, detail=detail, output=output))
