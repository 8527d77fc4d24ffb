"""``reciprocal-div``: ``Reciprocal(x)`` written as ``Div(1, x)`` (``--target qnn``).

QNN's HTP computes a quantised ``Reciprocal`` wrongly when its input's scale is small (an RMSNorm's
``1 / sqrt(mean(x^2) + eps)`` for small hidden states, w8a16 as ``get_qnn_qdq_config`` writes it), where
``Div(1, x)`` on the same input agrees with ONNX Runtime's CPU (docs/results/measurements.md).
``Div(1, x)`` is ``Reciprocal(x)`` by definition: IEEE division of 1 by x is the correctly rounded
reciprocal, so the rewrite is exact in float32.

Legality: a Reciprocal in the main graph with a float input whose dtype is known; the constant 1 takes that dtype.
"""

from __future__ import annotations

__all__ = ["ReciprocalDivPass"]

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import NameTable, node_label
from opfuse.core.ops import is_op
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord

_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16}


class ReciprocalDivPass(OpfusePass):
    """Reciprocal(x) -> Div(1, x) (module docstring)."""

    name = "reciprocal-div"
    after_rewrites = True  # (after the patterns: an RMSNorm spelled with Reciprocal stays matchable until then)
    options = frozenset({"target", "exclude", "veto"})  # (what the fusion stage hands every pass; none used)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        names = NameTable(model)
        modified = False
        for node in list(model.graph):
            x = node.inputs[0] if is_op(node, "Reciprocal") and node.inputs else None
            if x is None or x.type is None or x.type.dtype not in _FLOATS:
                continue
            one = ir.Value(name=names.fresh(f"{node.name or 'Reciprocal'}_one"), shape=ir.Shape([]),
                           type=ir.TensorType(x.type.dtype),
                           const_value=ir.tensor(np.array(1, dtype=x.type.dtype.numpy())))
            model.graph.register_initializer(one)
            out = node.outputs[0]
            div = ir.Node("", "Div", [one, x], name=names.fresh(f"{node.name or 'Reciprocal'}_div"),
                          outputs=[ir.Value(name=names.fresh(f"{out.name}_div"), type=out.type, shape=out.shape)])
            model.graph.insert_before(node, [div])
            name = out.name
            out.replace_all_uses_with(div.outputs[0], replace_graph_outputs=True)
            model.graph.remove(node, safe=True)
            div.outputs[0].name = name
            self.report.records.append(FusionRecord(
                pattern="Reciprocal->Div", node=node_label(node), removed=(node_label(node),),
                produced=node_label(div), graph="main", output=name,
                detail="1 / x as Div(1, x): the same float32 values; QNN's HTP computes a quantised Reciprocal of a "
                       "small-scaled input wrongly (opfuse.passes.reciprocal_div)"))
            modified = True
        return ir.passes.PassResult(model, modified=modified)
