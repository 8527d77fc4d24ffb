"""Fuse a convolution's epilogue into one kernel: residual Add and activation.

One mechanism, not a list of pairs: an anchor (Conv, Gemm) absorbs the chain of
element-wise ops after it that the target's kernel can execute, in the order the kernel
computes them. For ONNX Runtime (:mod:`opfuse.targets.onnxruntime`):

    Conv -> [Add(Z)] -> [activation...]   =>  FusedConv(X, W, B, Z, activation)
    Gemm -> [activation...]               =>  FusedGemm(A, B, C, activation)

    Y = act(Conv(X, W, B) + Z)       (the Add happens before the activation)

Consecutive activations merge first when they make one (Relu then Clip is a Clip).
The bias is already the conv's own input (fold-arithmetic puts constant Adds there).

Legality, each failure a refusal with its reason:

1. The value leaving the anchor (and each absorbed op) has exactly one consumer and is not
   a graph output, so nothing else needs the intermediate tensor.
2. Clip bounds are constants; the activation is one the kernel runs; the dtype is one the
   kernel runs (FusedConv: float32 and float16; FusedGemm: float32).
3. Residual: Z has exactly the conv output's shape and dtype (no broadcasting), which
   needs shape information: a proven mismatch (two different integers, two ranks) and
   a match opfuse cannot prove (a symbolic or unknown dimension on one side, such as
   ``[1, 8, 1, 1]`` against ``[-1, 8, 1, 1]``) are refused with different reasons (onnx's
   shape inference runs at the start of the pass when the model has an Add after a conv,
   an anchor of unknown dtype, or a hardware veto). Z is computed before the fused node by
   construction (it feeds
   the Add, which the conv output reaches only through the Add), so no cycle can form; the
   fused node takes the place of the last op it absorbs. When both inputs of the Add come
   from convs that could absorb it, the later one in graph order does (nothing moves), and
   the record says which.
4. A fusion the caller excludes (the layout check at ENABLE_ALL, a hardware veto) is
   refused with the caller's reason.

Activations and Adds left in the graph are listed with why: their input is not a conv,
the conv feeds something else too, the Add comes after the activation...
"""

from __future__ import annotations

__all__ = ["EpilogueFusionPass", "ActivationFusionPass"]

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from opfuse.analyse import (
    NameTable,
    Scope,
    describe,
    find_constant,
    infer_shapes,
    iter_scopes,
    sole_use_problem,
)
from opfuse.passes.base import OpfusePass
from opfuse.passes.folding import add_constant
from opfuse.report import FusionRecord
from opfuse.targets.onnxruntime import (
    KERNELS,
    Activation,
    describe_epilogue,
    merge_activations,
    read_activation,
    residual_add,
)
from opfuse.vocabulary import MS_DOMAIN, ONNX_DOMAINS, OpKind, op_kind
from opfuse.vocabulary import is_op as _is_op

Veto = Callable[[ir.Node, list], "str | None"]


def _follow(value: ir.Value, owner: ir.Node) -> tuple[ir.Node | None, list[ir.Node], str | None]:
    """The sole consumer of ``value`` past Identity nodes: (node, identities, problem)."""
    identities: list[ir.Node] = []
    while True:
        consumers = value.consumers()
        if not consumers:
            return None, identities, None
        nxt = consumers[0] if len(consumers) == 1 else None
        problem = sole_use_problem(value, owner, nxt) if nxt is not None else sole_use_problem(value, owner, owner)
        if problem:
            return None, identities, problem
        if not _is_op(nxt, "Identity"):
            return nxt, identities, None
        identities.append(nxt)
        owner, value = nxt, nxt.outputs[0]


class EpilogueFusionPass(OpfusePass):
    """Fuse residual Add and activations into FusedConv / FusedGemm."""

    name = "fuse-epilogue"
    emits_contrib_ops = True
    options = frozenset({"exclude", "veto"})
    residual = True

    def __init__(self, report=None, *, exclude: dict[str, str] | None = None, veto: Veto | None = None):
        super().__init__(report)
        self.exclude = dict(exclude or {})  # anchor name -> the caller's reason to leave it
        self.veto = veto  # (anchor, absorbed) -> a reason to decline, or None

    # -- the pass ----------------------------------------------------------------------
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self._names = NameTable(model)
        if self.veto is not None or _reads_inferred_types(model, self.residual):
            infer_shapes(model)  # before any rewrite: onnx cannot infer through the contrib ops
        modified = False
        explained: set[ir.Node] = set()
        for scope in list(iter_scopes(model)):
            order = {node: i for i, node in enumerate(scope.graph)}
            for node in list(scope.graph):
                if node.graph is None or op_kind(node) is not OpKind.OUT_ELEMWISE_FUSABLE:
                    continue
                if node.op_type not in KERNELS:
                    continue
                if self._fuse(node, scope, order, explained):
                    modified = True
                    if scope.function is not None:
                        scope.function.opset_imports.setdefault(MS_DOMAIN, 1)
            self._explain_leftovers(scope, explained)
        if modified:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
        return ir.passes.PassResult(model, modified=modified)

    def _refuse(self, scope: Scope, node: ir.Node, anchor: ir.Node | None, pattern: str, reason: str,
                explained: set) -> None:
        explained.add(node)
        self.refuse(pattern, node, reason, anchor=anchor, scope=scope)

    def _fuse(self, anchor: ir.Node, scope: Scope, order: dict, explained: set) -> bool:
        kernel = KERNELS[anchor.op_type]
        value, absorbed, identities = anchor.outputs[0], [], []
        z: ir.Value | None = None
        activation: Activation | None = None
        detail = ""
        owner = anchor
        pattern = anchor.op_type
        while True:
            nxt, skipped, problem = _follow(value, owner)
            candidates = [c for c in value.consumers() if _is_epilogue_op(c)] if problem else []
            if problem:
                for c in candidates:
                    self._refuse(scope, c, anchor, f"{pattern}+{c.op_type}", problem, explained)
                break
            if nxt is None:
                break
            if _is_op(nxt, "Add") and not absorbed and activation is None:
                if not (kernel.residual and self.residual):
                    break  # explained with the leftovers
                side = 0 if _same(nxt.inputs[0], value, skipped) else 1
                other = nxt.inputs[1 - side]
                reason, deferred = self._residual_problem(anchor, value, other, order, skipped, nxt)
                if deferred:
                    return False  # the other conv takes this Add
                if reason:
                    self._refuse(scope, nxt, anchor, f"{pattern}+Add", reason, explained)
                    break
                z = other
                producer = other.producer()
                if _is_op(producer, "Conv") and len(other.uses()) == 1:
                    detail = (f"both inputs of {describe(nxt)} come from convs; fused into the later one, "
                              f"{describe(anchor)}, so nothing is reordered; {describe(producer)} feeds Z")
                absorbed.append(nxt)
                identities += skipped
                value, owner, pattern = nxt.outputs[0], nxt, pattern + "+Add"
                continue
            act = read_activation(nxt, scope.opset)
            if act is None:
                if _is_op(nxt, "Add") and activation is not None:
                    self._refuse(scope, nxt, anchor, f"{pattern}+Add",
                                 "the Add comes after the activation; the fused kernel computes "
                                 "act(conv + Z), not act(conv) + Z", explained)
                break
            if isinstance(act, str):
                self._refuse(scope, nxt, anchor, f"{pattern}+{nxt.op_type}", act, explained)
                break
            merged = act if activation is None else merge_activations(activation, act)
            if merged is None:
                break  # a second activation that does not merge stays as it is
            if merged.kind not in kernel.activations:
                self._refuse(scope, nxt, anchor, f"{pattern}+{nxt.op_type}",
                             f"{kernel.op_type} does not run {merged.kind} in its epilogue", explained)
                break
            activation = merged
            absorbed.append(nxt)
            identities += skipped
            value, owner, pattern = nxt.outputs[0], nxt, pattern + f"+{nxt.op_type}"
        if not absorbed:
            return False

        reason = self._kernel_problem(anchor, kernel)
        if reason is None and anchor.name in self.exclude:
            reason = self.exclude[anchor.name]
        if reason is None and self.veto is not None:
            reason = self.veto(anchor, absorbed)
        if reason:
            for node in absorbed:
                self._refuse(scope, node, anchor, pattern, reason, explained)
            return False
        self._rewrite(scope, anchor, absorbed, identities, kernel, activation, z, pattern, detail)
        return True

    def _residual_problem(self, anchor, value, other, order, skipped, add) -> tuple[str | None, bool]:
        """(reason the Add cannot become Z, whether another conv should take it instead)."""
        if other is None or _same(other, value, skipped):
            return "both inputs of the Add are the conv's own output", False
        producer, through = other.producer(), []
        while _is_op(producer, "Identity"):
            through.append(producer)
            producer = producer.inputs[0].producer() if producer.inputs[0] is not None else None
        if (
            producer is not None
            and producer.domain in ONNX_DOMAINS
            and producer.op_type == anchor.op_type
            and order.get(producer, -1) > order.get(anchor, -1)
            and producer.name not in self.exclude
            and _follow(producer.outputs[0], producer)[0] is add
            and self._kernel_problem(producer, KERNELS[anchor.op_type]) is None
        ):
            return None, True
        a, b = value.shape, other.shape
        if a is None or b is None:
            return "the shapes of the conv output and the other operand are unknown", False
        if len(a) != len(b) or any(
            isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(a, b)
        ):
            return (f"the other operand has shape {_show(b)}, not the conv output's {_show(a)} "
                    "(the kernel's Z does not broadcast)"), False
        unproven = [i for i, (x, y) in enumerate(zip(a, b)) if not _dims_equal(x, y)]
        if unproven:
            return (f"opfuse cannot prove that the other operand's shape {_show(b)} equals the conv "
                    f"output's {_show(a)} (axis {', '.join(map(str, unproven))} is symbolic or unknown "
                    "on one side); the kernel's Z does not broadcast, so they must be equal"), False
        if value.dtype is not None and other.dtype is not None and value.dtype != other.dtype:
            return f"the other operand is {other.dtype}, the conv output {value.dtype}", False
        return None, False

    def _kernel_problem(self, anchor: ir.Node, kernel) -> str | None:
        weight = anchor.inputs[1] if len(anchor.inputs) > 1 else None
        dtype = _dtype_of(anchor, weight)  # output, weight and input share one dtype (T)
        if dtype is None:
            return f"the dtype of {describe(anchor)} is unknown"
        name = str(dtype.numpy()) if dtype != ir.DataType.BFLOAT16 else "bfloat16"
        if name not in kernel.dtypes:
            return f"{kernel.op_type} runs {'/'.join(sorted(kernel.dtypes))}, not {name}"
        return None

    def _rewrite(self, scope, anchor, absorbed, identities, kernel, activation, z, pattern, detail) -> None:
        last = absorbed[-1]
        tail = last.outputs[0]
        if z is not None and (len(anchor.inputs) < 3 or anchor.inputs[2] is None):
            # An explicit zero bias: ONNX Runtime's NCHWc layout pass skips a FusedConv
            # that has Z but no B (measured with onnxruntime 1.32).
            channels, dtype = _out_channels(anchor), anchor.inputs[1].dtype
            if channels is not None and dtype is not None:
                zero = add_constant(scope, self._names, anchor, np.zeros(channels, dtype.numpy()),
                                    f"{anchor.name or 'conv'}.bias_zero")
                if len(anchor.inputs) < 3:
                    anchor.resize_inputs(3)
                anchor.replace_input_with(2, zero)
        fused = kernel.emit(anchor, activation, z, name=anchor.name or self._names.fresh(kernel.op_type))
        fused.outputs[0].type = tail.type
        fused.outputs[0].shape = tail.shape
        scope.container.insert_before(last, fused)
        tail_name = tail.name
        tail.replace_all_uses_with(fused.outputs[0], replace_graph_outputs=True)
        removed = [anchor, *identities, *absorbed]
        scope.container.remove(removed, safe=True)
        if tail_name:
            fused.outputs[0].name = tail_name
        epilogue = describe_epilogue(activation, z)
        self.emitted[fused.name] = epilogue
        self.report.records.append(FusionRecord(
            pattern=pattern,
            node=anchor.name or "",
            removed=tuple(n.name or n.op_type for n in removed if n is not anchor),
            produced=f"{MS_DOMAIN}.{kernel.op_type} '{fused.name}'",
            graph=scope.label,
            detail="; ".join(p for p in (epilogue, detail) if p),
            output=fused.outputs[0].name or "",
        ))

    def _explain_leftovers(self, scope: Scope, explained: set) -> None:
        """Every activation and Add still in the graph gets a reason."""
        for node in scope.graph:
            if node in explained or not _is_epilogue_op(node):
                continue
            reason = self._leftover_reason(node, scope)
            if reason:
                self._refuse(scope, node, None, node.op_type, reason, explained)

    def _leftover_reason(self, node: ir.Node, scope: Scope) -> str | None:
        if _is_op(node, "Add"):
            sources = [i.producer() if i is not None else None for i in node.inputs]
            fused = [s for s in sources if s is not None and s.domain == MS_DOMAIN and "activation" in s.attributes]
            if fused:
                return (f"it comes after {describe(fused[0])}, whose epilogue already applies an activation; "
                        "the kernel computes act(conv + Z), not act(conv) + Z")
            if not any(s is not None and s.domain in ONNX_DOMAINS and s.op_type in KERNELS for s in sources):
                names = ", ".join(describe(s) if s is not None else "a graph input or constant" for s in sources)
                return f"neither input comes from a conv ({names})"
            if not self.residual:
                return "residual Add fusion is not part of this configuration (fuse-activation only)"
            return "it was not fused (see the entries of the convs that feed it)"
        source = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
        if source is None:
            return "its input is a graph input, not a conv's output"
        if source.domain == MS_DOMAIN:
            return f"its input comes from {describe(source)}, whose epilogue already holds an activation"
        if source.domain in ONNX_DOMAINS and source.op_type in KERNELS:
            return f"it was not fused into {describe(source)} (see that conv's other entries)"
        return f"its input comes from {describe(source)}, not a conv"


class ActivationFusionPass(EpilogueFusionPass):
    """Only activations directly after a conv (no residual Add): the chapter's Conv+ReLU."""

    name = "fuse-activation"
    residual = False


def _reads_inferred_types(model: ir.Model, residual: bool) -> bool:
    """Whether the pass will read a shape or dtype only onnx's inference gives: an Add reads
    a conv's output (the residual check, when ``residual``), or an anchor's dtype is
    unknown. (The hardware veto reads shapes too: with a veto, the pass always infers.)"""
    for scope in iter_scopes(model):
        for node in scope.graph:
            if residual and residual_add(node):
                return True
            if node.op_type in KERNELS and node.domain in ONNX_DOMAINS:
                if _dtype_of(node, node.inputs[1] if len(node.inputs) > 1 else None) is None:
                    return True
    return False


def _dtype_of(anchor: ir.Node, weight: ir.Value | None):
    for v in (anchor.outputs[0], weight, anchor.inputs[0]):
        if v is not None and v.dtype is not None:
            return v.dtype
    return None


def _is_epilogue_op(node: ir.Node) -> bool:
    return node.domain in ONNX_DOMAINS and (node.op_type == "Add" or read_activation(node, 0) is not None)


def _same(a: ir.Value | None, b: ir.Value, skipped: list[ir.Node]) -> bool:
    return a is b or (bool(skipped) and a is skipped[-1].outputs[0])


def _dims_equal(x, y) -> bool:
    """Provably equal: the same integer, or the same named symbolic dimension."""
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    if isinstance(x, int) or isinstance(y, int):
        return False
    return x.value is not None and x.value == y.value


def _show(shape) -> str:
    return "[" + ", ".join(str(d if isinstance(d, int) else (d.value or "?")) for d in shape) + "]"


def _out_channels(conv: ir.Node) -> int | None:
    """Output channels from the constant weight, else from the inferred output shape."""
    weight = conv.inputs[1] if len(conv.inputs) > 1 else None
    found = find_constant(weight) if weight is not None else "absent"
    if not isinstance(found, str):
        return int(found.array.shape[0])
    shape = conv.outputs[0].shape
    return shape[1] if shape is not None and len(shape) > 1 and isinstance(shape[1], int) else None


