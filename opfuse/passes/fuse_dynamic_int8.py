"""``fuse-dynamic-int8``: a dynamically quantised MatMul chain -> the runtime's integer MatMul kernel.

ONNX Runtime's ``quantize_dynamic`` (and the older ``onnx.quantize`` 0.1.0) writes each float
``MatMul(x, W) [+ b]`` as

    xq, xs, xz = DynamicQuantizeLinear(x)                   uint8, and x's own scale and zero point
    acc        = MatMulInteger(xq, Wq, xz, wz)              int32 [..., M, N]
    y          = Mul(Cast(acc, to=FLOAT), Mul(xs, ws))     [+ b]

six nodes where the runtime has one kernel (:attr:`opfuse.targets.kernels.Target.integer_matmul`;
ONNX Runtime's, :data:`opfuse.targets.onnxruntime.INTEGER_MATMUL`). The rules:

1. ``DynamicQuantizeMatMul(x, Wq, ws, wz, b)`` where the DynamicQuantizeLinear is this chain's
   alone: the kernel quantises x itself.
2. ``MatMulIntegerToFloat(xq, Wq, xs, ws, xz, wz, b)`` where the DynamicQuantizeLinear's outputs
   are read elsewhere too (two projections of one input): it stays, and each chain reading it
   becomes one kernel.

``b`` is the Add of a constant after the chain, when it is one value per output column (one
value is written as N); otherwise the Add stays after the kernel.

Algebra. Both kernels compute, per output column n,

    y[..., m, n] = float32(sum_k (xq[..., m, k] - xz) * (Wq[k, n] - wz[n])) * (xs * ws[n]) + b[n]

which is the chain's expression term for term: the sum is int32 in both (exact), converted to
float32 once; the multiplier is the float32 product ``xs * ws[n]`` in both (the graph's
``Mul(xs, ws)``; the kernel's ``a_scale * b_scale``: one rounding, and multiplication commutes
exactly); then the one product and the bias Add. ``DynamicQuantizeMatMul`` quantises x with
the same function as the runtime's DynamicQuantizeLinear kernel (range widened to hold 0,
scale (max - min) / 255, zero point round-half-even(-min / scale) clamped to [0, 255],
elements round-half-even(x / scale) + zero point, saturated), so xq, xs and xz are the same
bits. **The rewrite is exact**: the kernel may round ``acc * multiplier + b`` once where the
graph rounds twice (<= 1 ulp of y), the kind of difference verification's floor admits.

What is not exact is the quantisation's sensitivity to its input: where another rewrite
before the chain changes x by one rounding, an element of x on a half-step boundary takes the
next integer, and y moves by one quantum, ``xs * ws[n] * |Wq[k, n] - wz[n]|``. That is the
shipped model's own behaviour under any float32 re-evaluation (ONNX Runtime's own graph
optimisations do it too), not this rewrite's; verification measures it against the runtime's
own variation where it arises.

Legality (otherwise the chain stays, refused with the reason):

- the target has integer MatMul kernels (``--target onnxruntime``; portable ONNX has none);
- Wq is a constant 2-D [K, N] of a dtype the kernel takes (int8, uint8); wz absent or a
  constant of Wq's dtype; ws a float32 constant; each of wz and ws one value, or one per
  column (N values, every other dim 1) where the kernel takes that, and of a rank the chain's
  output already has (so the Mul's broadcast adds no axis);
- xq is the first output of a DynamicQuantizeLinear, its zero point the same node's third
  output (or absent: rule 2 only, the kernel's a_zero_point then absent too, 0), and the Mul's
  other operand is ``Mul(xs, ws)`` with xs that node's second output (static int8 is not this
  family: its scales are no run-time values);
- the chain is a chain: the int32 result read by the Cast alone, the float result by the Mul
  alone, neither a graph output; ``Cast`` is to float32;
- rule 1 only where nothing else reads the DynamicQuantizeLinear's outputs (else rule 2);
  rule 2 only for a quantised input dtype the kernel takes (uint8: ONNX Runtime 1.32
  registers MatMulIntegerToFloat for no other).
"""

from __future__ import annotations

__all__ = ["FuseDynamicInt8Pass"]

import dataclasses

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import Constant, NameTable, Scope, describe, find_constant, iter_scopes, node_label
from opfuse.core.edit import add_constant, remove_matched
from opfuse.core.ops import int_attr, is_op
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord, Reason
from opfuse.targets.kernels import IntegerMatMulKernels, Target, load_target

PATTERN = "DynamicQuantizeLinear+MatMulInteger"

Operand = ir.Value | np.ndarray | None  # kept as is, a new constant, or absent


@dataclasses.dataclass
class Plan:
    """A matched chain and the kernel's inputs."""

    op: str  # the kernel's op type
    inputs: list[Operand]
    output: ir.Value  # the tensor the kernel computes (the Mul's, or the bias Add's)
    nodes: list[ir.Node]  # the chain, consumers first; each removed once nothing reads it
    detail: str


class FuseDynamicInt8Pass(OpfusePass):
    """DynamicQuantizeLinear + MatMulInteger + Cast + Mul [+ Add] -> the target's kernel (module docstring)."""

    name = "fuse-dynamic-int8"
    emits_contrib_ops = True
    options = frozenset({"exclude", "veto", "target"})  # (what the fusion stage hands every pass)
    requires_ops = frozenset({"MatMulInteger"})

    def __init__(self, report=None, *, exclude=None, veto=None, target: Target | str = "onnxruntime"):
        super().__init__(report)
        self.target = load_target(target) if isinstance(target, str) else target

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        kernels = self.target.integer_matmul
        names, modified = None, False
        for scope in list(iter_scopes(model)):
            for node in list(scope.graph):
                if node.graph is None or not is_op(node, "MatMulInteger"):
                    continue
                if kernels is None:
                    self.refuse(PATTERN, node, f"{self.target.title} (--target {self.target.name}) has no integer "
                                "MatMul kernel; --target onnxruntime writes DynamicQuantizeMatMul", scope=scope)
                    continue
                plan = _match(node, kernels)
                if isinstance(plan, Reason):
                    self.refuse(PATTERN, node, plan.sentence, scope=scope)
                    continue
                names = names or NameTable(model)
                self._apply(scope, names, node, plan, kernels)
                modified = True
                if scope.function is not None:
                    scope.function.opset_imports.setdefault(kernels.domain, 1)
        if modified:
            model.opset_imports.setdefault(kernels.domain, 1)
        return ir.passes.PassResult(model, modified=modified)

    def _apply(self, scope: Scope, names: NameTable, node: ir.Node, plan: Plan, kernels: IntegerMatMulKernels) -> None:
        anchor = plan.nodes[0]  # the chain's last node: everything the kernel reads exists before it
        base = node.name[: -len("_quant")] if node.name.endswith("_quant") else (node.name or plan.op)
        roles = ("A", "B", "a_scale", "b_scale", "a_zero_point", "b_zero_point", "bias")
        if plan.op == kernels.quantizes:
            roles = ("A", "B", "b_scale", "b_zero_point", "bias")
        inputs = []
        for role, value in zip(roles, plan.inputs):
            if isinstance(value, np.ndarray):
                value = add_constant(scope, names, anchor, value, f"{base}_{role}")
            inputs.append(value)
        while inputs and inputs[-1] is None:
            inputs.pop()
        new = ir.Node(kernels.domain, plan.op, inputs, num_outputs=1, name=names.fresh(f"{base}_{plan.op}"))
        scope.container.insert_before(anchor, new)
        old, out = plan.output, new.outputs[0]
        out.dtype, out.shape = ir.DataType.FLOAT, old.shape
        name = old.name
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        removed = remove_matched(scope.container, plan.nodes)
        out.name = name  # the kernel's output keeps the name of the tensor it computes
        self.report.records.append(FusionRecord(
            pattern=f"{PATTERN}->{plan.op}", node=node_label(node), removed=tuple(node_label(n) for n in removed),
            produced=node_label(new), graph=scope.label, detail=plan.detail, output=name,
        ))


# -- matching: a Plan, or the Reason the chain stays ----------------------------------------

def _only_reader(value: ir.Value, what: str) -> ir.Node | Reason:
    if value.is_graph_output():
        return Reason(f"{what} '{value.name}' is a graph output, so the chain must stay")
    uses = value.uses()
    if len(uses) != 1:
        shown = ", ".join(describe(n) for n in value.consumers()[:3])
        return Reason(f"{what} '{value.name}' is read by {len(uses)} consumers ({shown}), not by one")
    return uses[0].node


def _rank(value: ir.Value | None) -> int | None:
    shape = value.shape if value is not None else None
    return len(shape) if shape is not None else None


def _parameter(found: Constant, role: str, columns: int, out_rank: int | None,
               kernels: IntegerMatMulKernels) -> tuple[Operand, str] | Reason:
    """A weight scale or zero point as the kernel takes it: the value itself when it is one
    value or [N], else the same numbers as a new constant of that shape; and "per tensor" or
    "per column". The chain's broadcast of it must add no axis (its rank at most the output's)."""
    array = found.array
    if array.ndim > 1 and (out_rank is None or array.ndim > out_rank):
        return Reason(f"its {role} has shape {list(array.shape)}, and the rank of the chain's output is "
                      + ("unknown" if out_rank is None else f"{out_rank}")
                      + ": its broadcast could add axes the kernel's output does not have")
    if array.size == 1:
        return (found.value if array.ndim <= 1 else array.reshape(())), "per tensor"
    if not kernels.b_per_column:
        return Reason(f"its {role} has {array.size} values and the kernel takes one")
    if array.size != columns or array.shape[-1] != columns:
        return Reason(f"its {role} has shape {list(array.shape)}, neither one value nor one per output column "
                      f"({columns}) on the last axis")
    return (found.value if array.ndim == 1 else array.reshape(columns)), "per column"


def _bias(mul: ir.Node, columns: int, out_rank: int | None) -> tuple[ir.Node, Operand] | None:
    """The Add of a constant after the chain, and the bias as the kernel takes it ([N]), when it
    is one; None leaves any Add after the kernel."""
    y = mul.outputs[0]
    if y.is_graph_output() or len(y.uses()) != 1:
        return None
    add = y.uses()[0].node
    if not is_op(add, "Add") or len(add.inputs) != 2:
        return None
    other = add.inputs[1] if add.inputs[0] is y else add.inputs[0]
    found = find_constant(other, "bias")
    if isinstance(found, Reason) or found.array.dtype != np.float32:
        return None
    array = found.array
    if array.ndim > 1 and (out_rank is None or array.ndim > out_rank):
        return None
    if array.size == columns and array.shape[-1] == columns:
        return add, (found.value if array.ndim == 1 else array.reshape(columns))
    if array.size == 1:  # one value for every column: the kernel's bias is per column
        return add, np.full((columns,), array.reshape(()), np.float32)
    return None


def _match(node: ir.Node, kernels: IntegerMatMulKernels) -> Plan | Reason:
    xq, wq_value, xz, wz_value = (list(node.inputs) + [None] * 4)[:4]
    source = xq.producer() if xq is not None else None
    if not is_op(source, "DynamicQuantizeLinear") or xq is not source.outputs[0]:
        return Reason(f"its input comes from {describe(source)}, not from a DynamicQuantizeLinear: its scale is "
                      "no run-time value (static int8 is not this rewrite's)")
    if xz is not None and xz is not source.outputs[2]:
        return Reason("its input's zero point is not the DynamicQuantizeLinear's own")
    wq = find_constant(wq_value, "weight")
    if isinstance(wq, Reason):
        return wq
    if wq.array.ndim != kernels.b_rank:
        return Reason(f"its weight has shape {list(wq.array.shape)}, not [K, N]")
    if str(wq.array.dtype) not in kernels.b_dtypes:
        return Reason(f"its weight is {wq.array.dtype}; the kernel takes {', '.join(sorted(kernels.b_dtypes))}")
    columns = int(wq.array.shape[1])
    out_rank = _rank(xq)  # a MatMul's output has its first input's rank (B is 2-D)
    # the chain: MatMulInteger -> Cast(to=FLOAT) -> Mul(., Mul(xs, ws))
    cast = _only_reader(node.outputs[0], "its int32 result")
    if isinstance(cast, Reason):
        return cast
    if not is_op(cast, "Cast") or int_attr(cast, "to", 0) != ir.DataType.FLOAT:
        return Reason(f"its int32 result goes to {describe(cast)}, not to a Cast to float32")
    mul = _only_reader(cast.outputs[0], "its result cast to float")
    if isinstance(mul, Reason):
        return mul
    if not is_op(mul, "Mul") or len(mul.inputs) != 2:
        return Reason(f"its result cast to float goes to {describe(mul)}, not to a Mul by the scales")
    scales = mul.inputs[1] if mul.inputs[0] is cast.outputs[0] else mul.inputs[0]
    product = scales.producer() if scales is not None else None
    xs = source.outputs[1]
    if not is_op(product, "Mul") or len(product.inputs) != 2 or xs not in product.inputs:
        return Reason(f"its result is multiplied by {describe(product) if product else repr(scales.name)}, not by "
                      "Mul(the DynamicQuantizeLinear's scale, the weight's scale)")
    ws = find_constant(product.inputs[1] if product.inputs[0] is xs else product.inputs[0], "weight scale")
    if isinstance(ws, Reason):
        return ws
    if ws.array.dtype != np.float32:
        return Reason(f"its weight scale is {ws.array.dtype}, not float32")
    b_scale = _parameter(ws, "weight scale", columns, out_rank, kernels)
    if isinstance(b_scale, Reason):
        return b_scale
    b_zero, zero_per = None, "no zero point"
    if wz_value is not None:
        wz = find_constant(wz_value, "weight zero point")
        if isinstance(wz, Reason):
            return wz
        if wz.array.dtype != wq.array.dtype:
            return Reason(f"its weight zero point is {wz.array.dtype}, its weight {wq.array.dtype}")
        found = _parameter(wz, "weight zero point", columns, 1, kernels)  # (MatMulInteger's own: [N] or one)
        if isinstance(found, Reason):
            return found
        b_zero, zero_per = found[0], f"zero point {found[1]}"
    bias = _bias(mul, columns, out_rank)
    add, b = bias if bias is not None else (None, None)
    chain = [*([add] if add is not None else []), mul, cast, node, product]
    output = (add or mul).outputs[0]
    detail = f"scale {b_scale[1]}, {zero_per}" + (", bias" if b is not None else "")
    # rule 1 where the DynamicQuantizeLinear is this chain's alone, else rule 2
    readers = {use.node for v in source.outputs for use in v.uses()}
    alone = (xz is source.outputs[2] and readers <= {node, product} and len(product.outputs[0].uses()) == 1
             and not any(v.is_graph_output() for v in (*source.outputs, product.outputs[0])))
    if alone:
        return Plan(kernels.quantizes, [source.inputs[0], wq.value, b_scale[0], b_zero, b], output,
                    [*chain, source], detail + "; quantises its input itself")
    if xq.dtype is not None and str(np.dtype(xq.dtype.numpy())) not in kernels.a_dtypes:
        return Reason(f"its quantised input is {xq.dtype}; {kernels.reads_quantized} takes "
                      + ", ".join(sorted(kernels.a_dtypes)))
    shared = ("the DynamicQuantizeLinear's outputs are read elsewhere too" if xz is not None
              else "its input's zero point is absent (0), not the DynamicQuantizeLinear's")
    return Plan(kernels.reads_quantized, [xq, wq.value, xs, b_scale[0], xz, b_zero, b], output, chain,
                detail + f"; {shared}, so it stays and the kernel reads its outputs")
