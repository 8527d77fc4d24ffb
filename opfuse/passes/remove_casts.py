"""``remove-casts``: Casts that cannot change a value, removed.

Exporters leave casts that do nothing: tf2onnx writes ``Cast(x, to=FLOAT)`` on tensors that
are float already, and a model re-exported through float64 arithmetic carries
``Cast(Cast(x, to=DOUBLE), to=FLOAT)``. Every one costs a kernel launch and a copy.

Algebra, with T the dtype of x (from the model, or onnx's shape inference):

1. ``Cast(x, to=T) = x``: a cast to the dtype a value has copies it.
2. ``Cast(Cast(x, to=W), to=T) = x`` when W holds every value of T exactly (a widening): the
   first cast is exact, and the second rounds a value that is already in T. Exact widenings
   (:func:`holds_exactly`, read from numpy's and ml_dtypes' type limits):

   - float to float: W has at least T's mantissa bits and exponent range, subnormals
     included (float16 and bfloat16 into float32 and float64, float32 into float64);
   - integer to integer: W's range contains T's;
   - integer to float: every integer of T is below 2**(W's mantissa bits + 1) (int8 and
     uint8 into float16; int16 into float32; int32 into float64; int64 into none);
   - bool into every numeric type (0 and 1 come back as False and True).

Refused, with the reason (the casts stay): ``Cast(Cast(x, to=N), to=T)`` back to T where N
does not hold T exactly (a narrowing first: float32 to float16 and back rounds x to float16).

onnxscript's ``CastIdentity`` rule is rule 1 with the same legality. Its ``CastCast`` rule
(``Cast(Cast(x, W), T) -> Cast(x, T)`` for W float32 and T float16 or bfloat16) is not used:
for x float64 or int64 it replaces two roundings by one, which can differ (double rounding),
and it never removes a round trip.

Legality: the cast's output is read through its value, so its readers read x instead; where
it is a graph output, x takes its name when x is a value this graph computes and is not an
output itself, else the cast stays (refused: an output keeps its name, so one copy must stay).
The inner Cast of rule 2 stays when something else reads it. Each removal is a record; the
graph outputs and every later rewrite's tensor check it.
"""

from __future__ import annotations

__all__ = ["NoOpCastPass", "holds_exactly"]

import ml_dtypes
import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import infer_shapes, iter_scopes, node_label
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord
from opfuse.core.ops import FLOAT_DTYPES, dtype_name, is_op


def _limits(dtype: np.dtype):
    if dtype.kind == "b":
        return "bool", None
    if dtype.kind in "iu":
        return "int", np.iinfo(dtype)
    if dtype.name in FLOAT_DTYPES:
        return "float", ml_dtypes.finfo(dtype)
    return None, None


def holds_exactly(narrow: ir.DataType, wide: ir.DataType) -> bool:
    """Whether every value of ``narrow`` is a value of ``wide`` (the cast is exact)."""
    if narrow == wide:
        return True
    try:
        a, b = np.dtype(narrow.numpy()), np.dtype(wide.numpy())
    except (TypeError, ValueError, AttributeError):
        return False
    (kind_a, lim_a), (kind_b, lim_b) = _limits(a), _limits(b)
    if kind_a is None or kind_b is None or kind_b == "bool":
        return False
    if kind_a == "bool":
        return True
    if kind_a == "int" and kind_b == "int":
        return int(lim_b.min) <= int(lim_a.min) and int(lim_a.max) <= int(lim_b.max)
    if kind_a == "int":  # into a float: every integer up to 2**(mantissa + 1) is exact
        return max(-int(lim_a.min), int(lim_a.max)) <= 2 ** (int(lim_b.nmant) + 1)
    if kind_b == "int":
        return False
    smallest = lambda f: int(f.minexp) - int(f.nmant)  # noqa: E731 - the exponent of the smallest subnormal
    return (int(lim_b.nmant) >= int(lim_a.nmant) and int(lim_b.maxexp) >= int(lim_a.maxexp)
            and smallest(lim_b) <= smallest(lim_a))


def _cast_to(node: ir.Node) -> ir.DataType | None:
    attr = node.attributes.get("to")
    try:
        return ir.DataType(int(attr.value)) if attr is not None else None
    except ValueError:
        return None


def _name(dtype: ir.DataType) -> str:
    return dtype_name(dtype) or dtype.name.lower()


class NoOpCastPass(OpfusePass):
    """Remove casts to a value's own dtype and exact round trips (module docstring)."""

    name = "remove-casts"

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self._model, self._inferred = model, False
        modified = False
        for scope in list(iter_scopes(model)):
            for node in list(scope.graph):
                if node.graph is not None and is_op(node, "Cast") and self._remove(node, scope):
                    modified = True
        return ir.passes.PassResult(model, modified=modified)

    def _dtype(self, value: ir.Value) -> ir.DataType | None:
        if value.dtype is None and not self._inferred:
            infer_shapes(self._model)  # once per pass, only when a dtype is unknown
            self._inferred = True
        return value.dtype

    def _remove(self, node: ir.Node, scope) -> bool:
        to = _cast_to(node)
        if to is None or not node.inputs or node.inputs[0] is None:
            return False
        inner = node.inputs[0].producer()
        if is_op(inner, "Cast") and inner.inputs and inner.inputs[0] is not None and inner.graph is node.graph:
            x, mid = inner.inputs[0], _cast_to(inner)
            t = self._dtype(x)
            if t is None or mid is None or t != to or mid == to:
                pass  # not a round trip (or a cast to its own dtype: rule 1 below)
            elif not holds_exactly(t, mid):
                self.refuse("Cast+Cast", node, (
                    f"{_name(t)} -> {_name(mid)} -> {_name(t)} rounds '{x.name}' to {_name(mid)}, which does "
                    f"not hold every {_name(t)} value: the round trip changes values, so both casts stay"),
                    anchor=inner, scope=scope)
                return False
            else:
                detail = f"{_name(t)} -> {_name(mid)} -> {_name(t)} is exact"
                return self._bypass(node, x, scope, "Cast+Cast", (node, inner), detail)
        x = node.inputs[0]
        t = self._dtype(x)
        if t is None or t != to:
            return False
        return self._bypass(node, x, scope, "Cast", (node,), f"to {_name(t)}, which '{x.name}' already is")

    def _bypass(self, node: ir.Node, x: ir.Value, scope, pattern: str, chain, detail: str) -> bool:
        y = node.outputs[0]
        if y.is_graph_output():
            graph = scope.graph
            own = x.producer() is not None and x.producer().graph is graph
            if not own or x.is_graph_output() or x.is_graph_input() or x.is_initializer():
                self.refuse(pattern, node, (
                    f"its output '{y.name}' is a graph output and its input '{x.name}' is not a value this "
                    "graph computes (or is an output too): an output keeps its name, so one copy must stay"),
                    scope=scope)
                return False
        name, was_output = y.name, y.is_graph_output()
        y.replace_all_uses_with(x, replace_graph_outputs=True)
        removed = []
        for cast in chain:  # the outer cast, then the inner one if nothing else reads it
            out = cast.outputs[0]
            if out.uses() or out.is_graph_output():
                break
            scope.container.remove(cast, safe=True)
            removed.append(cast)
        if was_output:
            x.name = name  # the graph's contract: its outputs keep their names
        # no tensor of its own to check (x is unchanged): the graph outputs and later rewrites check it
        self.report.records.append(FusionRecord(
            pattern=pattern, node=node_label(node), removed=tuple(node_label(n) for n in removed),
            produced="", graph=scope.label, detail=detail,
        ))
        return True
