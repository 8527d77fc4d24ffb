"""Attention's products of two activations as TFLite's BATCH_MATMUL, and the layouts around it.

A MatMul whose second input is computed (``Q @ K^T``, ``softmax(.) @ V``) is BATCH_MATMUL
(:func:`matmul`; a constant second input stays FULLY_CONNECTED, :func:`.tflite_ops.fully_connected`).
BATCH_MATMUL reads and writes ONNX's axis order: a rank-4 operand stored NHWC is transposed back
first (TRANSPOSE), and its rank-4 result stays in ONNX's order when every consumer reads any layout
(:data:`LAYOUT_AWARE`: Softmax over the last axis, another MatMul, Transpose, Reshape), else it
is transposed to NHWC. int8: both operands per tensor (their own scales and zero points), the
output in its QDQ quantisation; TFLite's int8 kernel accumulates in int32 and rescales.

Softmax over the last ONNX axis of a tensor stored NHWC (axis 3 of ``[B, heads, N, N]``) is
written in ONNX's order (TRANSPOSE, SOFTMAX) and kept there on the same terms (:func:`softmax`).

What Vela does with them is Vela's: its supported-operator checks name the reason for each op it
leaves on the CPU (``opfuse.targets.ethos_u.vela``).
"""

from __future__ import annotations

__all__ = ["LAYOUT_AWARE", "matmul", "softmax"]

import numpy as np
from ai_edge_litert import schema_py_generated as schema

from opfuse.core.ops import ONNX_DOMAINS, proto_attr
from opfuse.targets.ethos_u import tflite_ops
from opfuse.targets.ethos_u.tflite_graph import NCHW_TO_NHWC, Lowering, Value
from opfuse.targets.ethos_u.tflite_ops import FIXED_OUTPUT, OP, OPT, emit, make_options
from opfuse.targets.ethos_u.tflite_writer import Quant

# the ONNX ops whose lowering reads a rank-4 input in any layout (tflite_layout composes the layouts)
LAYOUT_AWARE = frozenset({"MatMul", "Softmax", "Transpose", "Reshape", "Flatten"})


def _ordered(L: Lowering, x: Value, name: str) -> Value:
    """``x`` in ONNX's axis order (itself when it is)."""
    rank = len(x.shape)
    identity = tuple(range(rank))
    if x.layout == identity:
        return x
    tmp = L.temp(x, f"{name}/onnx_order", layout=identity)
    perm = L.int_tensor(f"{name}/onnx_order/perm", [x.layout.index(k) for k in identity])
    L.w.op(OP.TRANSPOSE, [x.index, perm], [tmp.index], make_options(schema.TransposeOptionsT), OPT.TransposeOptions)
    return tmp


def _result(L: Lowering, name: str) -> tuple[Value, Value | None]:
    """(the tensor an op in ONNX's order writes, the NHWC value to transpose it into or None)."""
    shape = L.shape(name)
    identity = tuple(range(len(shape)))
    users = L.consumers.get(name, [])
    kept = len(shape) != 4 or (users and name not in L.g.output_names
                               and all(u.op_type in LAYOUT_AWARE for u in users))
    if kept:
        return L.new_value(name, layout=identity), None
    out = L.new_value(name)
    return L.temp(out, f"{name}/onnx_order", layout=identity), out


def _to_nhwc(L: Lowering, tmp: Value, out: Value | None) -> None:
    if out is None:
        return
    perm = L.int_tensor(f"{L.w._tensors[out.index].name}/perm", list(NCHW_TO_NHWC))
    L.w.op(OP.TRANSPOSE, [tmp.index, perm], [out.index], make_options(schema.TransposeOptionsT),
           OPT.TransposeOptions)


def matmul(L: Lowering, node) -> None:
    """MatMul: FULLY_CONNECTED with a constant second input, else BATCH_MATMUL (module docstring)."""
    if L.is_constant(node.input[1]):
        return tflite_ops.fully_connected(L, node)
    a, b = L.value(node.input[0]), L.value(node.input[1])
    if len(a.shape) != len(b.shape) or len(a.shape) < 2:
        raise L.refuse(f"a MatMul of rank-{len(a.shape)} by rank-{len(b.shape)} activations (BATCH_MATMUL is "
                       "lowered for two operands of one rank, 2 or more)")
    a, b = _ordered(L, a, f"{node.name}/a"), _ordered(L, b, f"{node.name}/b")
    target, out = _result(L, node.output[0])
    options = make_options(schema.BatchMatMulOptionsT, adjX=False, adjY=False, asymmetricQuantizeInputs=False)
    L.w.op(OP.BATCH_MATMUL, [a.index, b.index], [target.index], options, OPT.BatchMatMulOptions)
    _to_nhwc(L, target, out)


def softmax(L: Lowering, node) -> None:
    """Softmax: :func:`.tflite_ops.softmax` where its axis is last in the TFLite layout; over the last
    ONNX axis of a tensor stored otherwise, in ONNX's order (module docstring)."""
    x = L.value(node.input[0])
    rank = len(x.shape)
    opset = next((o.version for o in L.model.opset_import if o.domain in ONNX_DOMAINS), 13)
    axis = (int(proto_attr(node, "axis", -1 if opset >= 13 else 1)) + rank) % rank
    stored = NCHW_TO_NHWC if rank == 4 else tuple(range(rank))  # the layout new_value gives its output
    if (x.layout == stored and x.layout[-1] == axis) or axis != rank - 1:
        return tflite_ops.softmax(L, node)
    x = _ordered(L, x, f"{node.name}/x")
    target, out = _result(L, node.output[0])
    scale, zero = FIXED_OUTPUT["Softmax"]
    quant = Quant(np.array([scale]), np.array([zero]), 0)
    emit(L, OP.SOFTMAX, [x.index], target, make_options(schema.SoftmaxOptionsT, beta=1.0), OPT.SoftmaxOptions,
         quant=quant)
    _to_nhwc(L, target, out)
