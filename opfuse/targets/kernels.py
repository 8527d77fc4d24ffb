"""What a target is, as data: the fused kernels it executes and its pattern policy.

A :class:`Target` declares

- its **epilogue kernels** (:class:`EpilogueKernel`), one per anchor op: the op it extends
  (Conv, Gemm), the steps its epilogue runs in order (``("residual", "activation")``:
  ``Y = act(anchor(X...) + Z)``), the activations it runs, the dtypes, and how the kernel
  writes an activation into attributes (:class:`ActivationEncoding`). Adding an activation
  to a target is adding its name to a kernel's ``activations``; a new encoding is a new
  :class:`ActivationEncoding` row;
- its **pattern policy**: for each multi-op pattern (:mod:`opfuse.passes.patterns`),
  ``"fuse"`` (into the op the target runs), ``"keep"`` (leave as it is) or ``"unfuse"``
  (keyed by an op type: expand each such op the target cannot run into the primitives of
  its ONNX function body, :mod:`opfuse.passes.patterns.unfuse`), the op form its patterns
  become (``pattern_ops``, and per pattern ``pattern_forms``: the measured fusion choice of
  :mod:`opfuse.tune` writes Attention-23 at ONNX Runtime that way); and where a pattern's
  policy does not hold, a :class:`PolicyException`: a test of the graph (ONNX Runtime: a
  KV-cache decode step), the policy there and the measured reason;
- whether its compiler needs **static shapes** (:mod:`opfuse.prepare.static_shapes`);
- optionally its own **fusion driver** (ONNX Runtime: fuse, then undo the fusions that
  cost a conv the runtime's NCHWc layout).

One encoder (:meth:`EpilogueKernel.emit`) and one decoder (:func:`read_kernel`) per
kernel: the memory-traffic rule, the accelerator model, verification and the epilogue pass
read fused nodes through :func:`read_kernel`, never by their attributes.

The registry of targets is :mod:`opfuse.targets` (data, read at start-up); this module and
the target modules load onnx-ir.
"""

from __future__ import annotations

__all__ = [
    "ActivationEncoding",
    "EpilogueKernel",
    "IntegerMatMulKernels",
    "KernelView",
    "Target",
    "PolicyException",
    "POLICIES",
    "load_target",
    "read_kernel",
    "all_kernels",
]

import dataclasses
import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnx_ir as ir

from opfuse.core.activations import Activation
from opfuse.core.ops import op_label

POLICIES = ("fuse", "keep", "unfuse")
STEPS = ("residual", "activation")  # the epilogue steps a kernel may run, by name


@dataclasses.dataclass(frozen=True)
class ActivationEncoding:
    """How a kernel writes an activation: the op's name in ``op_attribute``, its float
    parameters either as one list (``params_attribute``) or one attribute each
    (``param_attributes``, in the parameters' order)."""

    op_attribute: str = "activation"
    params_attribute: str | None = None
    param_attributes: tuple[str, ...] = ()

    @property
    def attribute_names(self) -> frozenset[str]:
        names = {self.op_attribute, *self.param_attributes}
        if self.params_attribute:
            names.add(self.params_attribute)
        return frozenset(names)

    def problem(self, activation: Activation) -> str | None:
        """Why this encoding cannot carry ``activation`` (None when it can)."""
        if any(isinstance(p, str) for p in activation.params):
            return f"its parameters ({activation}) are not numbers the kernel's attributes can carry"
        if not self.params_attribute and len(activation.params) > len(self.param_attributes):
            return f"the kernel has attributes for {len(self.param_attributes)} activation parameters, not {len(activation.params)}"
        return None

    def encode(self, activation: Activation) -> list[ir.Attr]:
        attrs: list[ir.Attr] = [ir.AttrString(self.op_attribute, activation.op)]
        params = [float(p) for p in activation.params]
        if params and self.params_attribute:
            attrs.append(ir.AttrFloat32s(self.params_attribute, params))
        elif params:
            attrs += [ir.AttrFloat32(name, p) for name, p in zip(self.param_attributes, params)]
        return attrs

    def decode(self, attributes: Mapping[str, Any]) -> Activation | None:
        op = _plain(attributes.get(self.op_attribute))
        if op is None:
            return None
        if self.params_attribute:
            params = tuple(float(p) for p in (_plain(attributes.get(self.params_attribute)) or ()))
        else:
            values = [_plain(attributes.get(n)) for n in self.param_attributes]
            params = tuple(float(v) for v in values if v is not None)
        return Activation(str(op), params)


@dataclasses.dataclass(frozen=True)
class KernelView:
    """What a fused node computes, read back from its encoding."""

    anchor: str  # the standard op it extends: "Conv" for FusedConv
    anchor_inputs: int  # its leading inputs that are the anchor's (X, W, B)
    epilogue: tuple[str, ...]  # the steps after the anchor, in order, as ops: ("Add", "Relu")
    activation: Activation | None
    residual_input: int | None  # the input index of Z when the node has one
    anchor_attributes: dict[str, Any]  # the anchor op's attributes (the epilogue's removed)


@dataclasses.dataclass(frozen=True)
class EpilogueKernel:
    """A fused kernel of a target: the anchor op it extends and the epilogue it runs."""

    anchor: str  # the default-domain op whose epilogue it extends
    domain: str
    op_type: str
    dtypes: frozenset[str]
    steps: tuple[str, ...]  # of STEPS, in the order the kernel computes them
    activations: frozenset[str] = frozenset()  # the activation ops it runs
    residual_input: int | None = None  # where Z goes (added before the activation)
    anchor_inputs: int = 3  # how many leading inputs are the anchor's
    encoding: ActivationEncoding = ActivationEncoding()
    keeps_anchor_attributes: bool = True  # False: its attributes are its own (FusedMatMul)
    emitted: bool = True  # False: the runtime writes it, opfuse only reads it

    @property
    def label(self) -> str:
        return op_label(self.domain, self.op_type)

    @property
    def formula(self) -> str:
        y = f"{self.anchor}(...)"
        if "residual" in self.steps:
            y = f"{y} + Z"
        return f"act({y})" if "activation" in self.steps else y

    def emit(self, anchor: ir.Node, activation: Activation | None, z: ir.Value | None, name: str) -> ir.Node:
        """The fused node: the anchor's inputs and attributes plus the epilogue."""
        inputs = list(anchor.inputs)
        attributes = list(anchor.attributes.values())
        if z is not None:
            if self.residual_input is None:
                raise ValueError(f"{self.label} takes no residual input")
            while len(inputs) < self.residual_input:
                inputs.append(None)
            inputs.append(z)
        if activation is not None:
            attributes += self.encoding.encode(activation)
        return ir.Node(self.domain, self.op_type, inputs, attributes=attributes, name=name, num_outputs=1)

    def view(self, inputs: Sequence[Any], attributes: Mapping[str, Any]) -> KernelView:
        """Decode a node of this kernel (``inputs``: its input list, None or absent = no
        input; ``attributes``: names to plain values or onnx-ir attributes)."""
        steps: list[str] = []
        z = self.residual_input
        has_z = z is not None and len(inputs) > z and inputs[z] is not None
        if has_z:
            steps.append("Add")
        activation = self.encoding.decode(attributes) if "activation" in self.steps else None
        if activation is not None:
            steps.append(activation.op)
        own = self.encoding.attribute_names
        anchor_attrs = ({k: _plain(v) for k, v in attributes.items() if k not in own}
                        if self.keeps_anchor_attributes else {})
        return KernelView(self.anchor, self.anchor_inputs, tuple(steps), activation,
                          z if has_z else None, anchor_attrs)


@dataclasses.dataclass(frozen=True)
class IntegerMatMulKernels:
    """A runtime's kernels for a dynamically quantised MatMul (ONNX Runtime's quantize_dynamic
    writes ``DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul(., Mul(xs, ws)) [-> Add(bias)]``;
    :mod:`opfuse.passes.fuse_dynamic_int8` matches it): the op quantising its float input itself
    (``quantizes``: ``(A, B, b_scale, b_zero_point, bias)``), the one reading an already quantised
    input (``reads_quantized``: ``(A, B, a_scale, b_scale, a_zero_point, b_zero_point, bias)``),
    what their inputs may be, as data."""

    domain: str
    quantizes: str  # "DynamicQuantizeMatMul"
    reads_quantized: str  # "MatMulIntegerToFloat"
    a_dtypes: frozenset[str]  # the quantised input A reads_quantized takes ("uint8": the CPU kernel's only)
    b_dtypes: frozenset[str]  # the weight's ("int8", "uint8")
    b_per_column: bool  # a scale and zero point per column of B ([N]), besides one value
    b_rank: int = 2  # the weight's rank the rewrite writes (its kernel packs a 2-D B once)


@dataclasses.dataclass(frozen=True)
class PolicyException:
    """Where a target's policy for ``pattern`` does not hold: ``sites(model)`` finds the
    graph's places that make it an exception (empty: the policy holds); there the pattern's
    policy is ``policy``, for ``reason`` (what was measured, and what to use instead).
    ``untimed``: where the policy is not timed, the fusion families' options
    (:mod:`opfuse.tune.families`) that replace it in such a graph, and ``untimed_note`` says so
    in the log; empty: ``policy`` applies."""

    pattern: str
    sites: Callable[[ir.Model], Sequence[tuple[ir.Node, tuple[ir.Node, ...]]]]  # (site, other nodes)
    policy: str
    reason: str
    untimed: tuple[tuple[str, str], ...] = ()  # ((family, option), ...), e.g. (("attention", "Attention-23"),)
    untimed_note: str = ""
    untimed_where: Callable[[ir.Model], Sequence] | None = None  # the sites ``untimed`` needs (None: ``sites``)


@dataclasses.dataclass(frozen=True)
class Target:
    """A deployment target: what it executes and what to do with each pattern."""

    name: str
    title: str  # "ONNX Runtime", for messages
    kernels: Mapping[str, EpilogueKernel] = dataclasses.field(default_factory=dict)  # by anchor op
    patterns: Mapping[str, str] = dataclasses.field(default_factory=dict)  # pattern -> policy
    pattern_ops: str = "standard"  # the op form its patterns become: "standard" or "onnxruntime"
    # pattern -> the op form it becomes where not ``pattern_ops`` (measured choice: Attention-23 at onnxruntime)
    pattern_forms: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # (model, names, report, run_passes, runtime_level, veto) -> model; None: run the passes once
    run_fusion: Callable[..., ir.Model] | None = None
    reads: tuple[EpilogueKernel, ...] = ()  # kernels the runtime writes itself (read, never emitted)
    static_shapes: bool = False  # its compiler takes static shapes only (opfuse.prepare.static_shapes binds them)
    compiler_fuses_epilogues: bool = False  # its own compiler fuses a layer's activation from standard ops
    device: str | None = None  # the module compiling for its own backend (opfuse.targets.qnn.device's interface)
    exceptions: tuple[PolicyException, ...] = ()  # graphs where a pattern's policy does not hold
    runs_here: bool = False  # ONNX Runtime's CPU provider runs what it writes: its fusions are timed (opfuse.tune)
    integer_matmul: IntegerMatMulKernels | None = None  # its dynamic-int8 MatMul kernels (None: it has none)
    # the opset a graph holding an RMSNorm written out is raised to when no --opset is given: the
    # device computes the standard RMSNormalization right and the written-out form wrongly (None: never)
    rms_norm_opset: int | None = None

    def __post_init__(self):
        bad = {p: v for p, v in self.patterns.items() if v not in POLICIES}
        bad.update({e.pattern: e.policy for e in self.exceptions if e.policy not in POLICIES})
        if bad:
            raise ValueError(f"target {self.name}: unknown pattern policies {bad}")
        for kernel in self.kernels.values():
            if not set(kernel.steps) <= set(STEPS):
                raise ValueError(f"target {self.name}: {kernel.label} has unknown steps {kernel.steps}")

    def kernel_for(self, op_type: str) -> EpilogueKernel | None:
        return self.kernels.get(op_type)

    def policy(self, pattern: str) -> str:
        return self.patterns.get(pattern, "keep")

    def form(self, pattern: str) -> str:
        """The op form ``pattern`` is written in ("standard", "onnxruntime", "qnn")."""
        return self.pattern_forms.get(pattern, self.pattern_ops)

    def exception(self, pattern: str, model: ir.Model) -> tuple[PolicyException, list] | None:
        """The first exception to ``pattern``'s policy that ``model`` is, with its sites; else None."""
        for exception in self.exceptions:
            if exception.pattern == pattern:
                sites = list(exception.sites(model))
                if sites:
                    return exception, sites
        return None

    @property
    def unfused_ops(self) -> tuple[str, ...]:
        """The ops it expands into their function bodies (policy ``"unfuse"``)."""
        return tuple(op for op, policy in self.patterns.items() if policy == "unfuse")


def load_target(name: str) -> Target:
    """The :class:`Target` registered as ``name`` (its module is imported on first use)."""
    from opfuse.targets import TARGET_MODULES  # (the registry is data; this module is not)

    return importlib.import_module(TARGET_MODULES[name]).TARGET


@functools.cache
def all_kernels() -> dict[tuple[str, str], EpilogueKernel]:
    """(domain, op_type) -> kernel, over every registered target's kernels."""
    from opfuse.targets import TARGET_MODULES  # (the registry is data; this module is not)

    out: dict[tuple[str, str], EpilogueKernel] = {}
    for name in TARGET_MODULES:
        target = load_target(name)
        for kernel in (*target.kernels.values(), *target.reads):
            out[(kernel.domain, kernel.op_type)] = kernel
    return out


def read_kernel(domain: str, op_type: str, inputs: Sequence[Any], attributes: Mapping[str, Any]) -> KernelView | None:
    """The :class:`KernelView` of a fused node of any target; None for any other node."""
    kernel = all_kernels().get((domain, op_type))
    return kernel.view(inputs, attributes) if kernel is not None else None


def _plain(value: Any) -> Any:
    """An onnx-ir attribute's value, or the value itself."""
    return getattr(value, "value", value)
