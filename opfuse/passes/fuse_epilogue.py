"""Fuse a layer's epilogue into the target's kernel: residual Add, then activation.

One rule over the op kinds, as TVM's ``FuseOps``: an anchor (an OUT_ELEMWISE_FUSABLE op,
:mod:`opfuse.core.ops`) absorbs the chain of element-wise ops (ELEMWISE, BROADCAST)
after it that the target's kernel for it runs, in the order the kernel computes them
(:class:`~opfuse.targets.kernels.EpilogueKernel`). For ONNX Runtime
(:mod:`opfuse.targets.onnxruntime`):

    Conv -> [Add(Z)] -> [activation...]   =>  FusedConv(X, W, B, Z, activation)
    Gemm -> [activation...]               =>  FusedGemm(A, B, C, activation)

    Y = act(Conv(X, W, B) + Z)       (the Add happens before the activation)

Consecutive activations merge first when they make one (Relu then Clip is a Clip,
:func:`opfuse.core.activations.merge_activations`). The bias is already the conv's own input
(fold-arithmetic puts constant Adds there).

Legality, each failure a refusal with its reason, for every element-wise op that follows
an anchor:

1. The value leaving the anchor (and each absorbed op) has exactly one consumer and is not
   a graph output, so nothing else needs the intermediate tensor.
2. The target's kernel runs the op at that place in its epilogue: an activation it runs
   ("ONNX Runtime's FusedConv runs no HardSwish epilogue"), an Add where its residual step
   is, one activation (two that do not merge are refused), activation parameters its
   attributes can carry, Clip bounds that are constants; and the anchor's dtype is one the
   kernel runs (FusedConv: float32 and float16; FusedGemm: float32).
3. Residual: Z has exactly the conv output's shape and dtype (no broadcasting), which
   needs shape information: a proven mismatch (two different integers, two ranks) and a
   match opfuse cannot prove (a symbolic or unknown dimension on one side, such as
   ``[1, 8, 1, 1]`` against ``[-1, 8, 1, 1]``) are refused with different reasons (onnx's
   shape inference runs at the start of the pass when the model has an Add after a conv,
   an anchor of unknown dtype, or a hardware veto). Z is computed before the fused node by
   construction (it feeds the Add, which the conv output reaches only through the Add), so
   no cycle can form; the fused node takes the place of the last op it absorbs. When both
   inputs of the Add come from convs that could absorb it, the later one in graph order
   does (nothing moves), and the record says which.
4. A fusion the caller excludes (the layout check at ENABLE_ALL, a hardware veto) is
   refused with the caller's reason.

Element-wise ops left in the graph whose input comes from a layer, and activations
anywhere, are listed with why (:mod:`opfuse.passes.epilogue_leftovers`).
"""

from __future__ import annotations

__all__ = ["EpilogueFusionPass", "ActivationFusionPass"]

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from opfuse.core.activations import Activation, merge_activations, read_activation
from opfuse.core.analysis import (
    Constant,
    NameTable,
    Scope,
    describe,
    find_constant,
    infer_shapes,
    iter_scopes,
    node_label,
    sole_use_problem,
)
from opfuse.core.edit import add_constant
from opfuse.passes.base import OpfusePass
from opfuse.passes.epilogue_leftovers import explain_leftovers
from opfuse.report import FusionRecord
from opfuse.targets.kernels import EpilogueKernel, Target, load_target
from opfuse.targets.onnxruntime import residual_add
from opfuse.core.ops import ELEMENTWISE_KINDS, OpKind, dtype_name, is_op, op_info, op_kind

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
        if not is_op(nxt, "Identity"):
            return nxt, identities, None
        identities.append(nxt)
        owner, value = nxt, nxt.outputs[0]


class EpilogueFusionPass(OpfusePass):
    """Fuse residual Add and activations into the target's epilogue kernels."""

    name = "fuse-epilogue"
    emits_contrib_ops = True
    fuses_residual = True
    options = frozenset({"exclude", "veto", "target"})

    def __init__(self, report=None, *, exclude: dict[str, str] | None = None, veto: Veto | None = None,
                 target: Target | str = "onnxruntime"):
        super().__init__(report)
        self.exclude = dict(exclude or {})  # anchor name -> the caller's reason to leave it
        self.veto = veto  # (anchor, absorbed) -> a reason to decline, or None
        self.target = load_target(target) if isinstance(target, str) else target

    # -- the pass ----------------------------------------------------------------------
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self._names = NameTable(model)
        if self.veto is not None or _reads_inferred_types(model, self.fuses_residual, self.target):
            infer_shapes(model)  # before any rewrite: onnx cannot infer through the contrib ops
        modified = False
        domains: set[str] = set()
        explained: set[ir.Node] = set()
        for scope in list(iter_scopes(model)):
            order = {node: i for i, node in enumerate(scope.graph)}
            for node in list(scope.graph):
                if node.graph is None or op_kind(node) is not OpKind.OUT_ELEMWISE_FUSABLE:
                    continue
                kernel = self.target.kernel_for(node.op_type)
                if kernel is not None and self._fuse(node, kernel, scope, order, explained):
                    modified = True
                    domains.add(kernel.domain)
                    if scope.function is not None:
                        scope.function.opset_imports.setdefault(kernel.domain, 1)
            explain_leftovers(self, scope, explained)
        for domain in domains:
            model.opset_imports.setdefault(domain, 1)
        return ir.passes.PassResult(model, modified=modified)

    def _refuse(self, scope: Scope, node: ir.Node, anchor: ir.Node | None, pattern: str, reason: str,
                explained: set) -> None:
        explained.add(node)
        self.refuse(pattern, node, reason, anchor=anchor, scope=scope)

    def _fuse(self, anchor: ir.Node, kernel: EpilogueKernel, scope: Scope, order: dict, explained: set) -> bool:
        value, owner, pattern = anchor.outputs[0], anchor, anchor.op_type
        absorbed: list[ir.Node] = []
        identities: list[ir.Node] = []
        z: ir.Value | None = None
        activation: Activation | None = None
        step = -1  # the kernel step reached so far (index into kernel.steps)
        detail = ""
        while True:
            nxt, skipped, problem = _follow(value, owner)
            if problem:
                for c in value.consumers():
                    if op_kind(c) in ELEMENTWISE_KINDS:
                        self._refuse(scope, c, anchor, f"{pattern}+{c.op_type}", problem, explained)
                break
            if nxt is None or op_kind(nxt) not in ELEMENTWISE_KINDS:
                break  # not an epilogue: the chain ends here
            where = _step_of(nxt, kernel)
            label = f"{pattern}+{nxt.op_type}"
            if where is None:
                self._refuse(scope, nxt, anchor, label, self._not_run(kernel, nxt), explained)
                break
            if where == "residual" and not self.fuses_residual:
                break  # explained with the leftovers
            if kernel.steps.index(where) < step or (where == "residual" and step >= 0):
                self._refuse(scope, nxt, anchor, label, _out_of_order(kernel, nxt, absorbed), explained)
                break
            if where == "residual":
                side = 0 if _same(nxt.inputs[0], value, skipped) else 1
                other = nxt.inputs[1 - side]
                reason, deferred = self._residual_problem(anchor, kernel, value, other, order, skipped, nxt)
                if deferred:
                    return False  # the other conv takes this Add
                if reason:
                    self._refuse(scope, nxt, anchor, label, reason, explained)
                    break
                z = other
                producer = other.producer()
                if is_op(producer, anchor.op_type) and len(other.uses()) == 1:
                    detail = (f"both inputs of {describe(nxt)} come from convs; fused into the later one, "
                              f"{describe(anchor)}, so nothing is reordered; {describe(producer)} feeds Z")
            else:
                act = read_activation(nxt, scope.opset)
                reason = act if isinstance(act, str) else None
                merged = None
                if reason is None:
                    merged = act if activation is None else merge_activations(activation, act)
                    if merged is None:
                        reason = (f"{self._kernel_name(kernel)} runs one activation, and {act} after "
                                  f"{activation} is not one")
                    elif merged.op not in kernel.activations:
                        reason = self._not_run(kernel, nxt)
                    else:
                        reason = kernel.encoding.problem(merged)
                if reason:
                    self._refuse(scope, nxt, anchor, label, reason, explained)
                    break
                activation = merged
            step = kernel.steps.index(where)
            absorbed.append(nxt)
            identities += skipped
            value, owner, pattern = nxt.outputs[0], nxt, label
        if not absorbed:
            return False

        reason = self._kernel_problem(anchor, kernel)
        if reason is None and anchor.name in self.exclude:
            reason = self.exclude[anchor.name]
        if reason is None and self.veto is not None:
            reason = self.veto(anchor, absorbed)
        if reason:  # one decision on the whole fusion: one entry, naming every node it leaves
            explained.update(absorbed)
            self.refuse(pattern, absorbed[0], reason, anchor=anchor, scope=scope, also=tuple(absorbed[1:]))
            return False
        explained.update(absorbed)
        self._rewrite(scope, anchor, absorbed, identities, kernel, activation, z, pattern, detail)
        return True

    def _kernel_name(self, kernel: EpilogueKernel) -> str:
        return f"{self.target.title}'s {kernel.op_type}"

    def _not_run(self, kernel: EpilogueKernel, node: ir.Node) -> str:
        runs = ", ".join(sorted(kernel.activations)) or "no activation"
        extra = " and a residual Add" if "residual" in kernel.steps else ""
        return (f"{self._kernel_name(kernel)} runs no {node.op_type} epilogue (it runs {runs}{extra}); "
                f"the {node.op_type} stays a separate kernel")

    def _residual_problem(self, anchor, kernel, value, other, order, skipped, add) -> tuple[str | None, bool]:
        """(reason the Add cannot become Z, whether another conv should take it instead)."""
        if other is None or _same(other, value, skipped):
            return "both inputs of the Add are the conv's own output", False
        producer = other.producer()
        while is_op(producer, "Identity"):
            producer = producer.inputs[0].producer() if producer.inputs[0] is not None else None
        if (
            is_op(producer, anchor.op_type)
            and order.get(producer, -1) > order.get(anchor, -1)
            and producer.name not in self.exclude
            and _follow(producer.outputs[0], producer)[0] is add
            and self._kernel_problem(producer, kernel) is None
        ):
            return None, True
        a, b = value.shape, other.shape
        if a is None or b is None:
            return "the shapes of the conv output and the other operand are unknown", False
        if len(a) != len(b) or any(
            isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(a, b)
        ):
            return (f"the other operand has shape {_shape_text(b)}, not the conv output's {_shape_text(a)} "
                    "(the kernel's Z does not broadcast)"), False
        unproven = [i for i, (x, y) in enumerate(zip(a, b)) if not _dims_equal(x, y)]
        if unproven:
            return (f"opfuse cannot prove that the other operand's shape {_shape_text(b)} equals the conv "
                    f"output's {_shape_text(a)} (axis {', '.join(map(str, unproven))} is symbolic or unknown "
                    "on one side); the kernel's Z does not broadcast, so they must be equal"), False
        if value.dtype is not None and other.dtype is not None and value.dtype != other.dtype:
            return f"the other operand is {other.dtype}, the conv output {value.dtype}", False
        return None, False

    def _kernel_problem(self, anchor: ir.Node, kernel: EpilogueKernel) -> str | None:
        weight = anchor.inputs[1] if len(anchor.inputs) > 1 else None
        dtype = _dtype_of(anchor, weight)  # output, weight and input share one dtype (T)
        if dtype is None:
            return f"the dtype of {describe(anchor)} is unknown"
        name = dtype_name(dtype)
        if name not in kernel.dtypes:
            return f"{kernel.op_type} runs {'/'.join(sorted(kernel.dtypes))}, not {name}"
        return None

    def _rewrite(self, scope, anchor, absorbed, identities, kernel, activation, z, pattern, detail) -> None:
        last = absorbed[-1]
        tail = last.outputs[0]
        bias = op_info(anchor).weights.bias
        if z is not None and bias is not None and (len(anchor.inputs) <= bias or anchor.inputs[bias] is None):
            # An explicit zero bias: ONNX Runtime's NCHWc layout pass skips a FusedConv
            # that has Z but no B (measured with onnxruntime 1.32).
            channels, dtype = _out_channels(anchor), anchor.inputs[1].dtype
            if channels is not None and dtype is not None:
                zero = add_constant(scope, self._names, anchor, np.zeros(channels, dtype.numpy()),
                                    f"{anchor.name or 'conv'}.bias_zero")
                if len(anchor.inputs) <= bias:
                    anchor.resize_inputs(bias + 1)
                anchor.replace_input_with(bias, zero)
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
        epilogue = _describe_epilogue(activation, z)
        self.emitted[fused.name] = epilogue
        self.report.records.append(FusionRecord(
            pattern=pattern,
            node=node_label(anchor),
            removed=tuple(node_label(n) for n in removed if n is not anchor),
            produced=f"{kernel.label} '{fused.name}'",
            graph=scope.label,
            detail="; ".join(p for p in (epilogue, detail) if p),
            output=fused.outputs[0].name or "",
        ))


class ActivationFusionPass(EpilogueFusionPass):
    """Only activations directly after a conv (no residual Add): the chapter's Conv+ReLU."""

    name = "fuse-activation"
    fuses_residual = False


def _step_of(node: ir.Node, kernel: EpilogueKernel) -> str | None:
    """Which of the kernel's epilogue steps ``node`` would be (None: none of them)."""
    info = op_info(node)
    if "activation" in kernel.steps and info is not None and info.activation is not None:
        return "activation"
    if "residual" in kernel.steps and is_op(node, "Add"):
        return "residual"
    return None


def _out_of_order(kernel: EpilogueKernel, node: ir.Node, absorbed: list[ir.Node]) -> str:
    if is_op(node, "Add") and absorbed and is_op(absorbed[-1], "Add"):
        return f"{kernel.op_type} takes one residual input Z, and the Add before this one is it"
    if is_op(node, "Add"):
        return ("the Add comes after the activation; the fused kernel computes act(conv + Z), "
                "not act(conv) + Z")
    return (f"{kernel.op_type} computes {kernel.formula}; a {node.op_type} after "
            f"{absorbed[-1].op_type if absorbed else kernel.anchor} is not in that order")


def _reads_inferred_types(model: ir.Model, residual: bool, target: Target) -> bool:
    """Whether the pass will read a shape or dtype only onnx's inference gives: an Add reads
    a conv's output (the residual check, when ``residual``), or an anchor's dtype is
    unknown. (The hardware veto reads shapes too: with a veto, the pass always infers.)"""
    for scope in iter_scopes(model):
        for node in scope.graph:
            if residual and residual_add(node):
                return True
            if is_op(node, *target.kernels):
                if _dtype_of(node, node.inputs[1] if len(node.inputs) > 1 else None) is None:
                    return True
    return False


def _dtype_of(anchor: ir.Node, weight: ir.Value | None):
    for v in (anchor.outputs[0], weight, anchor.inputs[0]):
        if v is not None and v.dtype is not None:
            return v.dtype
    return None


def _describe_epilogue(activation: Activation | None, z: ir.Value | None) -> str:
    parts = []
    if z is not None:
        source = z.producer()
        parts.append(f"Z from {describe(source) if source is not None else 'graph input ' + repr(z.name)}")
    if activation is not None:
        parts.append(f"activation {activation}")
    return " and ".join(parts) or "no epilogue"


def _same(a: ir.Value | None, b: ir.Value, skipped: list[ir.Node]) -> bool:
    return a is b or (bool(skipped) and a is skipped[-1].outputs[0])


def _dims_equal(x, y) -> bool:
    """Provably equal: the same integer, or the same named symbolic dimension."""
    if isinstance(x, int) and isinstance(y, int):
        return x == y
    if isinstance(x, int) or isinstance(y, int):
        return False
    return x.value is not None and x.value == y.value


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(d if isinstance(d, int) else (d.value or "?")) for d in shape) + "]"


def _out_channels(conv: ir.Node) -> int | None:
    """Output channels from the constant weight, else from the inferred output shape."""
    weight = conv.inputs[1] if len(conv.inputs) > 1 else None
    found = find_constant(weight)
    if isinstance(found, Constant):
        return int(found.array.shape[0])
    shape = conv.outputs[0].shape
    return shape[1] if shape is not None and len(shape) > 1 and isinstance(shape[1], int) else None

