"""``dequantize-dynamic``: a model ONNX Runtime quantised dynamically, back to float ops with its int8 weights.

ONNX Runtime's ``quantize_dynamic`` keeps a model's weights in 8 bits and quantises each
activation at run time: ``DynamicQuantizeLinear(x) -> (xq, xs, xz)`` (uint8, the scale and
zero point of this very tensor), an integer kernel, and a float rescale. An NPU runs little
of it: QNN's provider (onnxruntime-qnn 2.7.0) fuses ``DynamicQuantizeLinear -> ConvInteger /
MatMulInteger -> Cast`` itself only when the integer result is read by that one Cast (not
the older quantiser's int32 bias below: "ConvInteger output is not consumed by a single
Cast"), and has no DynamicQuantizeLSTM, so ddddocr's ``common_old`` splits into 22
partitions; and a quantiser of float models finds nothing to quantise in it. This pass
writes the float ops back, with the weights the model shipped, dequantised, so a static
quantiser (``opfuse quantize``) can take the model. The rules, one per integer op
(:data:`opfuse.core.ops.INTEGER_OPS`):

1. ``ConvInteger(xq, Wq, xz, wz) -> Cast(to=FLOAT) -> Mul(., Mul(xs, ws))`` is
   ``Conv(x, W)``, same attributes, with ``W = (Wq - wz) * ws``. ONNX Runtime's older
   quantiser (``onnx.quantize`` 0.1.0, ddddocr's) also adds the bias in int32 before the
   Cast: ``Add(., Reshape(Cast(Floor(Div(b, Mul(xs, ws))), to=INT32), shape))``, which is
   ``Conv(x, W, b)``.
2. ``MatMulInteger(xq, Wq, xz, wz) -> Cast -> Mul(., Mul(xs, ws))`` is ``MatMul(x, W)``.
3. ``com.microsoft.DynamicQuantizeLSTM(X, Wq, Rq, B, sequence_lens, initial_h, initial_c, P,
   W_scale, W_zero_point, R_scale, R_zero_point)`` is ONNX ``LSTM(X, W, R, B, ...)`` with the
   same attributes; its weights are [directions, input, 4 * hidden], transposed against
   LSTM's [directions, 4 * hidden, input] (:func:`opfuse.core.algebra.dequantize_lstm_weight`).
4. ``com.microsoft.DynamicQuantizeMatMul(A, Bq, b_scale, b_zero_point, bias)`` (ONNX
   Runtime's fusion of rule 2) is ``MatMul(A, B)`` [``+ bias``]; ``MatMulIntegerToFloat(xq,
   Bq, xs, b_scale, xz, b_zero_point, bias)`` reading a DynamicQuantizeLinear is the same.

The ``DynamicQuantizeLinear`` goes when nothing reads it any more. Algebra: with x' = (xq -
xz) * xs the activation as the integer kernel sees it, every rule is the identity

    (sum (xq - xz)(Wq - wz)) * xs * ws  =  sum x' * ((Wq - wz) * ws)

per output channel o (ws, wz one value, or one per output channel: axis 1 of a Conv's
output, the last axis of a MatMul's, a column of an LSTM's gates), and the rewrite puts x
for x'. **So it is not exact**: it removes the activation's rounding (|x - x'| <= xs / 2
per element) and the int32 bias's floor (up to one step of xs * ws): the result is the float
model the int8 one approximates, with only its weights rounded to 8 bits, and no longer the
shipped model. The weights are the shipped ones, exactly (``(Wq - wz) * ws`` in float32
arithmetic, bit for bit).

Legality (otherwise the node stays, refused with the reason): the weights, zero points and
the weight scale are constants; the activation, its scale and its zero point are the same
DynamicQuantizeLinear's three outputs; the chain is exactly the pattern, each intermediate
tensor read only by the next node of the chain and no graph output; ``Cast`` is to float;
the weight's scale and zero point are one value or one per output channel, on the axis the
output's channels are; an LSTM's shapes agree with ``hidden_size`` and ``direction``, and
the opset has LSTM (7+).

Why it is opt-in and how it is verified. ``opfuse optimize`` proves each rewrite computes the
same numbers; this one does not, so it is in no target's default passes. ``opfuse quantize``
runs it first on a model that computes dynamic int8, and measures the output SQNR between
the shipped model and the dequantised one on the held-out samples (the report says so, and
the dequantised model is then the reference its SQNR is measured against). With ``opfuse
optimize --passes dequantize-dynamic`` the pass runs first (:attr:`exact` is False), the
dequantised model becomes the reference every later rewrite is verified against with the
usual tolerance, and the distance to the input model is measured on the verification's
inputs and reported as a figure, not as verified (:func:`opfuse.verify.verify_models`). No
tolerance would make it "verified" honestly: the bound above is per tensor, and what the
removed rounding does downstream (a Sigmoid, an LSTM's state) is the model's, not the pass's.
"""

from __future__ import annotations

__all__ = ["DequantizeDynamicPass"]

import dataclasses

import numpy as np
import onnx_ir as ir

from opfuse.core import algebra
from opfuse.core.analysis import NameTable, Scope, describe, find_constant, iter_scopes, node_label
from opfuse.core.edit import add_constant, remove_matched
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord, Reason
from opfuse.core.ops import integer_op, int_attr, is_op, str_attr

LSTM_OPSET = 7  # the first opset whose LSTM this writes (its attributes have not changed since)


@dataclasses.dataclass
class Plan:
    """A matched pattern: the float op to write, and the nodes it replaces."""

    op: str  # "Conv", "MatMul" or "LSTM"
    inputs: list  # ir.Value (kept), np.ndarray (a new constant) or None (absent)
    attributes: list
    replaces: list  # the old outputs the new node's take over, in order
    nodes: list  # the matched nodes, consumers first (each removed once nothing reads it)
    bias: np.ndarray | ir.Value | None = None  # added after a MatMul (the contrib ops' bias input)
    detail: str = ""


class DequantizeDynamicPass(OpfusePass):
    """Dynamic int8 (ONNX Runtime's quantize_dynamic) back to float ops (module docstring)."""

    name = "dequantize-dynamic"
    exact = False

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        names, modified = NameTable(model), False
        for scope in list(iter_scopes(model)):
            for node in list(scope.graph):
                row = integer_op(node) if node.graph is not None else None
                if row is None or not row.dynamic or node.op_type not in RULES:
                    continue
                plan = RULES[node.op_type](node, scope)
                pattern = _pattern(node)
                if isinstance(plan, Reason):
                    self.refuse(pattern, node, plan.sentence, scope=scope)
                    continue
                self._apply(scope, names, node, plan, pattern)
                modified = True
            for node in scope.graph:
                if is_op(node, "DynamicQuantizeLinear"):
                    readers = sorted({describe(c) for v in node.outputs for c in v.consumers()})
                    self.refuse("DynamicQuantizeLinear", node, (
                        "it stays: its outputs are still read by " + ", ".join(readers[:3])
                        + (" ..." if len(readers) > 3 else "") + ", which this pass did not rewrite"
                        if readers else "it stays: its outputs are graph outputs"), scope=scope)
        return ir.passes.PassResult(model, modified=modified)

    def _apply(self, scope: Scope, names: NameTable, node: ir.Node, plan: Plan, pattern: str) -> None:
        anchor = plan.nodes[0]  # the chain's last node: everything the new node reads exists before it
        base = node.name[: -len("_quant")] if node.name.endswith("_quant") else (node.name or plan.op)
        inputs, weight_bytes = [], 0
        for i, value in enumerate(plan.inputs):
            if isinstance(value, np.ndarray):
                weight_bytes += value.nbytes
                role = "R" if plan.op == "LSTM" and i == 2 else ("W" if i == 1 else "B")
                value = add_constant(scope, names, anchor, value, f"{base}_{role}")
            inputs.append(value)
        while inputs and inputs[-1] is None:
            inputs.pop()
        new = ir.Node("", plan.op, inputs, attributes=plan.attributes, num_outputs=len(plan.replaces),
                      name=names.fresh(base))
        scope.container.insert_before(anchor, new)
        produced = list(new.outputs)
        if plan.bias is not None:
            bias = plan.bias if isinstance(plan.bias, ir.Value) else add_constant(
                scope, names, anchor, plan.bias, f"{base}_bias")
            new.outputs[0].name = names.fresh(f"{base}_output")
            add = ir.Node("", "Add", [new.outputs[0], bias], name=names.fresh(f"{base}_bias_add"))
            scope.container.insert_before(anchor, add)
            produced = [add.outputs[0]]
        renames = []
        for old, out in zip(plan.replaces, produced):
            renames.append((out, old.name))
            if old.dtype is not None:  # the same tensor, in float
                out.dtype, out.shape = old.dtype, old.shape
            if old.uses() or old.is_graph_output():
                old.replace_all_uses_with(out, replace_graph_outputs=True)
        removed = _remove_dead(scope, plan.nodes)
        for out, name in renames:
            out.name = name  # a rewrite's output keeps the name of the tensor it replaces
        self.report.records.append(FusionRecord(
            pattern=pattern, node=node_label(node), removed=tuple(node_label(n) for n in removed),
            produced=node_label(new), graph=scope.label, weight_bytes=weight_bytes,
            detail=plan.detail + "; approximate: the activation is no longer rounded to 8 bits",
        ))  # no output to check: the reference is the dequantised model (module docstring)


def _pattern(node: ir.Node) -> str:
    if node.op_type in ("ConvInteger", "MatMulInteger"):
        return f"DynamicQuantizeLinear+{node.op_type}"
    return node.op_type


def _remove_dead(scope: Scope, nodes: list[ir.Node]) -> list[ir.Node]:
    """Remove the matched nodes, and a DynamicQuantizeLinear they read, where nothing reads them any more."""
    sources = []
    for node in nodes:
        for v in node.inputs:
            p = v.producer() if v is not None else None
            if is_op(p, "DynamicQuantizeLinear") and p not in nodes and p not in sources:
                sources.append(p)
    return remove_matched(scope.container, [*nodes, *sources])


# -- matching: each rule returns a Plan, or the Reason it does not apply ----------------------

def _const(value: ir.Value | None, role: str) -> np.ndarray | Reason:
    found = find_constant(value, role)
    return found if isinstance(found, Reason) else found.array


def _only_reader(value: ir.Value, what: str) -> ir.Node | Reason:
    """The one node that reads ``value``, or why the chain cannot vanish there."""
    if value.is_graph_output():
        return Reason(f"{what} '{value.name}' is a graph output, so the chain must stay")
    readers = value.consumers()
    if len(readers) != 1 or len(value.uses()) != 1:
        shown = ", ".join(describe(r) for r in readers[:3])
        return Reason(f"{what} '{value.name}' is read by {len(value.uses())} consumers ({shown}), not by one, "
                      "so the chain stays")
    return readers[0]


def _dynamic_source(xq: ir.Value | None, xz: ir.Value | None, xs: ir.Value | None = None) -> ir.Node | Reason:
    """The DynamicQuantizeLinear whose outputs are (xq, xs, xz), or why there is none."""
    source = xq.producer() if xq is not None else None
    if not is_op(source, "DynamicQuantizeLinear") or xq is not source.outputs[0]:
        return Reason(f"its activation comes from {describe(source)}, not from a DynamicQuantizeLinear: "
                "its scale is not the activation's own run-time one")
    if xz is not source.outputs[2]:
        return Reason("its activation zero point is not the DynamicQuantizeLinear's own")
    if xs is not None and xs is not source.outputs[1]:
        return Reason("its activation scale is not the DynamicQuantizeLinear's own")
    return source


def _weight_scale(value: ir.Value | None, xs: ir.Value, what: str) -> np.ndarray | Reason:
    """ws from ``value = Mul(xs, ws)`` with ws a constant."""
    mul = value.producer() if value is not None else None
    if not is_op(mul, "Mul") or len(mul.inputs) != 2:
        return Reason(f"{what} is {describe(mul)}, not Mul(activation scale, weight scale)")
    a, b = mul.inputs
    if a is xs or b is xs:
        return _const(b if a is xs else a, "weight scale")
    return Reason(f"{what} {describe(mul)} does not multiply the DynamicQuantizeLinear's scale")


def _per_channel(array: np.ndarray, role: str, rank: int, axis: int, channels: int) -> np.ndarray | Reason:
    """``array`` as one value or ``channels`` values; as it broadcasts against a tensor of
    ``rank`` (right-aligned), they must lie on ``axis``."""
    if array.size == 1:
        return array.reshape(())
    dims = (1,) * (rank - array.ndim) + tuple(array.shape)
    if array.ndim > rank or dims[axis] != channels or array.size != channels:
        return Reason(f"its {role} has shape {list(array.shape)}, which is not one value or one per output channel "
                f"({channels}) on axis {axis} of the output")
    return array.reshape(-1)


def _integer_bias(value: ir.Value, xs: ir.Value, ws: np.ndarray, rank: int, channels: int):
    """(b, the nodes that compute the term, consumers first) of ``Reshape(Cast(Floor(Div(b,
    Mul(xs, ws))), to=INT32), shape)``, the older quantiser's int32 bias; or why not."""
    reshape = value.producer()
    cast = reshape.inputs[0].producer() if is_op(reshape, "Reshape") else None
    floor = cast.inputs[0].producer() if is_op(cast, "Cast") else None
    div = floor.inputs[0].producer() if is_op(floor, "Floor") else None
    if not is_op(div, "Div"):
        return Reason(f"the int32 term added to its result comes from {describe(reshape)}, not from "
                "Reshape(Cast(Floor(Div(bias, scales))))")
    if int_attr(cast, "to", 0) != ir.DataType.INT32:
        return Reason(f"the int32 bias's {describe(cast)} is not to int32")
    scale = _weight_scale(div.inputs[1], xs, "the bias's divisor")
    if isinstance(scale, Reason):
        return scale
    if scale.shape != ws.shape or not np.array_equal(scale, ws):
        return Reason("the bias is divided by another weight scale than the one its result is multiplied by")
    b, shape = _const(div.inputs[0], "bias"), _const(reshape.inputs[1], "bias shape")
    for found in (b, shape):
        if isinstance(found, Reason):
            return found
    dims = [int(d) for d in shape.reshape(-1)]
    try:
        divided = np.broadcast_shapes(b.shape, ws.shape)  # Div(b, xs * ws), xs one value
    except ValueError:
        divided = None
    if divided is None or int(np.prod(divided)) != channels:
        return Reason(f"its bias {list(b.shape)} divided by the weight scale {list(ws.shape)} is not one value per "
                "output channel")
    if 0 in dims or dims.count(-1) > 1 or b.size != channels:
        return Reason(f"its bias of shape {list(b.shape)}, reshaped to {dims}, is not one value per output channel")
    placed = _per_channel(b.reshape(dims), "bias (as reshaped)", rank, 1, channels)
    if isinstance(placed, Reason):
        return placed
    return placed.astype(np.float32).reshape(channels), [reshape, cast, floor, div, div.inputs[1].producer()]


def _match_integer(node: ir.Node, scope: Scope) -> Plan | Reason:
    """Rules 1 and 2: ConvInteger / MatMulInteger -> [int32 bias] -> Cast -> Mul(., Mul(xs, ws))."""
    conv = node.op_type == "ConvInteger"
    xq, wq_value, xz, wz_value = (list(node.inputs) + [None] * 4)[:4]
    source = _dynamic_source(xq, xz)
    if isinstance(source, Reason):
        return source
    xs = source.outputs[1]
    wq = _const(wq_value, "weight")
    if isinstance(wq, Reason):
        return wq
    wz = np.zeros((), wq.dtype) if wz_value is None else _const(wz_value, "weight zero point")
    if isinstance(wz, Reason):
        return wz
    if conv and wq.ndim < 3 or not conv and wq.ndim != 2:
        return Reason(f"its weight has shape {list(wq.shape)}, not a {'Conv' if conv else 'MatMul [K, N]'} weight")
    channels, rank = (wq.shape[0], wq.ndim) if conv else (wq.shape[1], 2)
    chain = [node]  # producers first here; reversed in the plan
    result = node.outputs[0]
    step = _only_reader(result, "its int32 result")
    if isinstance(step, Reason):
        return step
    added = None
    if is_op(step, "Add") and conv:  # the older quantiser's int32 bias
        added = step.inputs[1] if step.inputs[0] is result else step.inputs[0]
        chain.append(step)
        step = _only_reader(step.outputs[0], "its int32 sum with the bias")
        if isinstance(step, Reason):
            return step
    if not is_op(step, "Cast") or int_attr(step, "to", 0) != ir.DataType.FLOAT:
        return Reason(f"its integer result goes to {describe(step)}, not to a Cast to float")
    chain.append(step)
    mul = _only_reader(step.outputs[0], "its result cast to float")
    if isinstance(mul, Reason):
        return mul
    if not is_op(mul, "Mul"):
        return Reason(f"its result cast to float goes to {describe(mul)}, not to a Mul by the scales")
    scales = mul.inputs[1] if mul.inputs[0] is step.outputs[0] else mul.inputs[0]
    ws = _weight_scale(scales, xs, "the scale it is multiplied by")
    if isinstance(ws, Reason):
        return ws
    ws_c = _per_channel(ws, "weight scale", rank, 1, channels)
    wz_c = _per_channel(wz, "weight zero point", 1, 0, channels)
    for found in (ws_c, wz_c):
        if isinstance(found, Reason):
            return found
    bias, extra = None, [scales.producer()]
    if added is not None:
        found = _integer_bias(added, xs, ws, rank, channels)
        if isinstance(found, Reason):
            return found
        bias, bias_nodes = found
        extra = [*extra, *(n for n in bias_nodes if n not in extra)]
    shape = (-1,) + (1,) * (wq.ndim - 1) if conv else (1, -1)
    weight = algebra.dequantize(wq, wz_c.reshape(shape) if wz_c.ndim else wz_c,
                                ws_c.reshape(shape) if ws_c.ndim else ws_c)
    per = "per output channel" if ws_c.ndim else "per tensor"
    detail = f"W = (Wq - wz) * ws {per}" + (", bias b (its int32 floor(b / (xs * ws)) undone)"
                                             if bias is not None else "")
    attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()] if conv else []
    return Plan("Conv" if conv else "MatMul", [source.inputs[0], weight, bias], attributes, [mul.outputs[0]],
                [mul, *chain[::-1], *extra], detail=detail)


def _match_lstm(node: ir.Node, scope: Scope) -> Plan | Reason:
    """Rule 3: DynamicQuantizeLSTM -> LSTM with W and R dequantised and transposed."""
    if scope.opset and scope.opset < LSTM_OPSET:
        return Reason(f"the model's opset {scope.opset} has no LSTM (opset {LSTM_OPSET}+)")
    ins = (list(node.inputs) + [None] * 12)[:12]
    arrays = {}
    for index, role in ((1, "W"), (2, "R"), (8, "W_scale"), (9, "W_zero_point"), (10, "R_scale"), (11, "R_zero_point")):
        found = _const(ins[index], role)
        if isinstance(found, Reason):
            return found
        arrays[role] = found
    hidden = int_attr(node, "hidden_size", 0)
    directions = 2 if str_attr(node, "direction", "forward") == "bidirectional" else 1
    w, r = arrays["W"], arrays["R"]
    if w.ndim != 3 or w.shape[0] != directions or w.shape[2] != 4 * hidden or r.shape != (directions, hidden, 4 * hidden):
        return Reason(f"its W {list(w.shape)} and R {list(r.shape)} are not [directions, rows, 4 * hidden] for "
                f"hidden_size {hidden} and {directions} direction(s)")
    for role in ("W_scale", "W_zero_point", "R_scale", "R_zero_point"):
        if arrays[role].shape not in ((directions,), (directions, 4 * hidden)):
            return Reason(f"its {role} has shape {list(arrays[role].shape)}, neither [directions] nor "
                    "[directions, 4 * hidden]")
    weights = [algebra.dequantize_lstm_weight(arrays[k], arrays[f"{k}_zero_point"], arrays[f"{k}_scale"]) for k in "WR"]
    per = "per column" if arrays["W_scale"].ndim == 2 else "per direction"
    attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
    return Plan("LSTM", [ins[0], *weights, *ins[3:8]], attributes, list(node.outputs), [node],
                detail=f"W, R = transpose((Wq - wz) * ws) {per}, as LSTM's [directions, 4 * hidden, rows]")


def _match_contrib_matmul(node: ir.Node, scope: Scope) -> Plan | Reason:
    """Rule 4: DynamicQuantizeMatMul(A, B, b_scale, b_zp, bias) and MatMulIntegerToFloat(A, B,
    a_scale, b_scale, a_zp, b_zp, bias) -> MatMul (+ bias)."""
    if node.op_type == "DynamicQuantizeMatMul":
        a, bq_value, ws_value, wz_value, bias_value = (list(node.inputs) + [None] * 5)[:5]
        x, chain = a, [node]
    else:
        xq, bq_value, xs, ws_value, xz, wz_value, bias_value = (list(node.inputs) + [None] * 7)[:7]
        source = _dynamic_source(xq, xz, xs)
        if isinstance(source, Reason):
            return source
        x, chain = source.inputs[0], [node]
    found = [_const(v, role) for v, role in ((bq_value, "weight"), (ws_value, "weight scale"))]
    found.append(np.zeros((), np.int8) if wz_value is None else _const(wz_value, "weight zero point"))
    found.append(None if bias_value is None else _const(bias_value, "bias"))
    for f in found:
        if isinstance(f, Reason):
            return f
    wq, ws, wz, bias = found
    if wq.ndim != 2:
        return Reason(f"its weight has shape {list(wq.shape)}, not a MatMul [K, N]")
    ws_c = _per_channel(ws, "weight scale", 1, 0, wq.shape[1])
    wz_c = _per_channel(wz, "weight zero point", 1, 0, wq.shape[1])
    for f in (ws_c, wz_c):
        if isinstance(f, Reason):
            return f
    weight = algebra.dequantize(wq, wz_c.reshape(1, -1) if wz_c.ndim else wz_c, ws_c.reshape(1, -1) if ws_c.ndim else ws_c)
    per = "per column" if ws_c.ndim else "per tensor"
    return Plan("MatMul", [x, weight], [], list(node.outputs[:1]), chain,
                bias=bias_value if bias is not None else None, detail=f"W = (Wq - wz) * ws {per}")


RULES = {
    "ConvInteger": _match_integer,
    "MatMulInteger": _match_integer,
    "DynamicQuantizeLSTM": _match_lstm,
    "DynamicQuantizeMatMul": _match_contrib_matmul,
    "MatMulIntegerToFloat": _match_contrib_matmul,
}
