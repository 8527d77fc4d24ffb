"""What ONNX Runtime's CPU provider can execute in a convolution's epilogue, as data.

Kernels (contrib ops, domain ``com.microsoft``):

    FusedConv(X, W, B?, Z?)   Y = act(Conv(X, W, B) + Z)        float32, float16
    FusedGemm(A, B, C?)       Y = act(alpha * A'B' + beta * C)   float32

Activations each kernel accepts, and the parameters it needs (one row each; supporting
one more activation is one more row):

    op           FusedConv activation_params     FusedGemm activation_alpha/beta
    Relu         -                               -
    LeakyRelu    [alpha]                         alpha
    Sigmoid      -                               -
    Tanh         -                               -
    HardSigmoid  [alpha, beta]                   alpha, beta
    Clip         [min, max]                      (not supported by FusedGemm)

Read back (:func:`read_fused`): what a fused node computes, from its encoding: the
standard op it extends, how many of its inputs are that op's, and its epilogue steps. The
memory-traffic rule and the accelerator model read kernels through it, never by
re-parsing attributes themselves.

Consecutive activations merge before fusing when the result is one activation:
Relu then Clip(a, b) is Clip(max(a, 0), b); Clip(a, b) then Relu is Clip(max(a, 0),
max(b, 0)); Relu then Relu is Relu.

Interplay with the runtime's own optimiser: at ENABLE_ALL, ONNX Runtime on x86 rewrites
convs into its blocked NCHWc layout and absorbs Add and activations itself. A FusedConv
whose Z comes from outside that layout (a graph input, a Relu...) stays outside it, and
so does its conv: :func:`layout_losses` runs the runtime on both graphs and names the
fusions that would cost a conv its layout, so the pipeline can leave them to the runtime.

Only a residual input can cost the layout: the runtime's NCHWc pass
(``nchwc_transformer.cc``, ``TransformConv``) takes ``Conv`` and ``com.microsoft.FusedConv``
alike, on the same conditions (a constant float 4-D weight, the channel and group counts,
a constant bias) and keeps the activation attribute, so a FusedConv without Z gets the
layout exactly when its Conv does (checked on this machine for every activation opfuse
fuses). :func:`takes_residual` says whether a model can get a fusion with Z at all; when
it cannot, the pipeline builds no runtime session. That matters beyond the seconds: the
runtime names every node its layout pass creates by scanning all nodes
(``Graph::GenerateNodeName``), so a session at ENABLE_ALL costs O(convs x nodes): the two
sessions of the check took 44 s for a 16000-block Conv+BN+Relu chain and 3.8 s for 4000
(onnxruntime 1.32, 2 shared cores).
"""

from __future__ import annotations

__all__ = [
    "Activation",
    "EpilogueKernel",
    "ACTIVATIONS",
    "KERNELS",
    "read_activation",
    "merge_activations",
    "layout_losses",
    "takes_residual",
    "residual_add",
    "runtime_graph",
    "has_layout_pass",
    "FusedView",
    "read_fused",
    "EPILOGUE_ATTRIBUTES",
]

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import onnx_ir as ir

from opfuse.analyse import describe, find_constant, iter_scopes, trace_producer
from opfuse.runtime import optimized_graph
from opfuse.vocabulary import MS_DOMAIN, ONNX_DOMAINS, float_attr


@dataclasses.dataclass(frozen=True)
class Activation:
    """An activation in kernel terms: its name and its parameters."""

    kind: str
    params: tuple[float, ...] = ()

    def __str__(self) -> str:
        return self.kind + (f"({', '.join(f'{p:g}' for p in self.params)})" if self.params else "")


def _clip_bounds(node: ir.Node, opset: int) -> Activation | str:
    dtype = None
    x = node.inputs[0]
    if x is not None and x.dtype is not None:
        dtype = x.dtype.numpy()
    info = ml_dtypes.finfo(dtype or np.float32)
    lo, hi = float(info.min), float(info.max)
    if "min" in node.attributes or "max" in node.attributes or opset < 11:
        return Activation("Clip", (float_attr(node, "min", lo), float_attr(node, "max", hi)))
    bounds = [lo, hi]
    for i in (1, 2):
        if i < len(node.inputs) and node.inputs[i] is not None:
            found = find_constant(node.inputs[i], "bound" if i == 1 else "upper bound")
            if isinstance(found, str):
                return f"its {'lower' if i == 1 else 'upper'} bound is not a constant: {found}"
            bounds[i - 1] = float(found.array.reshape(-1)[0])
    return Activation("Clip", tuple(bounds))


# op type -> how to read it as an Activation (or a reason it cannot be one)
ACTIVATIONS: dict[str, Callable[[ir.Node, int], Activation | str]] = {
    "Relu": lambda n, opset: Activation("Relu"),
    "Sigmoid": lambda n, opset: Activation("Sigmoid"),
    "Tanh": lambda n, opset: Activation("Tanh"),
    "LeakyRelu": lambda n, opset: Activation("LeakyRelu", (float_attr(n, "alpha", 0.01),)),
    "HardSigmoid": lambda n, opset: Activation("HardSigmoid", (float_attr(n, "alpha", 0.2), float_attr(n, "beta", 0.5))),
    "Clip": _clip_bounds,
}


def read_activation(node: ir.Node, opset: int) -> Activation | str | None:
    """The node as an Activation; a reason when it is one but unusable; None when it is not."""
    if node.domain not in ONNX_DOMAINS or node.op_type not in ACTIVATIONS:
        return None
    return ACTIVATIONS[node.op_type](node, opset)


def merge_activations(first: Activation, then: Activation) -> Activation | None:
    """One activation computing ``then(first(x))``, or None when there is none."""
    if first.kind == "Relu" and then.kind == "Relu":
        return first
    if first.kind == "Relu" and then.kind == "Clip":
        lo, hi = then.params
        return Activation("Clip", (max(lo, 0.0), hi))
    if first.kind == "Clip" and then.kind == "Relu":
        lo, hi = first.params
        return Activation("Clip", (max(lo, 0.0), max(hi, 0.0)))
    return None


@dataclasses.dataclass(frozen=True)
class EpilogueKernel:
    """A fused kernel of the target: which op it replaces and what its epilogue runs."""

    anchor: str  # the op whose epilogue it extends
    op_type: str
    residual: bool  # accepts Z, added before the activation
    dtypes: frozenset[str]
    activations: frozenset[str]  # Activation kinds it accepts

    def emit(self, anchor: ir.Node, activation: Activation | None, z: ir.Value | None, name: str) -> ir.Node:
        """The fused node: the anchor's inputs and attributes plus the epilogue."""
        inputs = list(anchor.inputs)
        attributes = [attr for attr in anchor.attributes.values()]
        if self.op_type == "FusedConv":
            if z is not None:
                while len(inputs) < 3:
                    inputs.append(None)
                inputs.append(z)
            if activation is not None:
                attributes.append(ir.AttrString("activation", activation.kind))
                if activation.params:
                    attributes.append(ir.AttrFloat32s("activation_params", list(activation.params)))
        else:  # FusedGemm
            if activation is not None:
                attributes.append(ir.AttrString("activation", activation.kind))
                for key, value in zip(("activation_alpha", "activation_beta"), activation.params):
                    attributes.append(ir.AttrFloat32(key, value))
        return ir.Node(MS_DOMAIN, self.op_type, inputs, attributes=attributes, name=name, num_outputs=1)


KERNELS: dict[str, EpilogueKernel] = {
    "Conv": EpilogueKernel(
        "Conv", "FusedConv", residual=True, dtypes=frozenset({"float32", "float16"}),
        activations=frozenset({"Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "Clip"}),
    ),
    "Gemm": EpilogueKernel(
        "Gemm", "FusedGemm", residual=False, dtypes=frozenset({"float32"}),
        activations=frozenset({"Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid"}),
    ),
}



# --- reading fused kernels back -------------------------------------------------------------

# attributes a fused kernel adds to the op it extends
EPILOGUE_ATTRIBUTES = frozenset({
    "activation", "activation_params", "activation_alpha", "activation_beta", "activation_gamma",
})
# fused op -> (the standard op it extends, how many leading inputs are that op's). FusedMatMul
# is ONNX Runtime's own (opfuse does not emit it) and appears in the runtime's graphs.
_FUSED_BASE = {"FusedConv": ("Conv", 3), "FusedGemm": ("Gemm", 3), "FusedMatMul": ("MatMul", 2)}


@dataclasses.dataclass(frozen=True)
class FusedView:
    """What a fused node computes, read back from its encoding."""

    base_op: str  # the standard op it extends: "Conv" for FusedConv
    base_inputs: int  # its leading inputs that are the standard op's (X, W, B)
    epilogue: tuple[str, ...]  # steps after the base op, in order: ("Add", "Relu")

    def base_attributes(self, attributes: Mapping[str, Any]) -> dict[str, Any]:
        """The standard op's attributes: the epilogue's removed (FusedMatMul's all)."""
        if self.base_op == "MatMul":
            return {}
        return {k: v for k, v in attributes.items() if k not in EPILOGUE_ATTRIBUTES}


def read_fused(domain: str, op_type: str, inputs: Sequence[Any], attributes: Mapping[str, Any]) -> FusedView | None:
    """The :class:`FusedView` of a ``com.microsoft`` fused node; None for any other node.

    ``inputs`` is the node's input list (None or absent = no input); ``attributes`` maps
    names to plain values or to onnx-ir attributes.
    """
    if domain != MS_DOMAIN or op_type not in _FUSED_BASE:
        return None
    base, n_inputs = _FUSED_BASE[op_type]
    steps = []
    if op_type == "FusedConv" and len(inputs) > 3 and inputs[3] is not None:
        steps.append("Add")  # Z, added before the activation
    act = attributes.get("activation")
    if act is not None:
        steps.append(str(getattr(act, "value", act)))
    return FusedView(base, n_inputs, tuple(steps))


# --- the runtime's own layout pass --------------------------------------------------------

def runtime_graph(model: ir.Model) -> list[tuple[str, str, str]]:
    """(domain, op_type, name) of the graph ONNX Runtime runs at ENABLE_ALL."""
    return [(n.domain, n.op_type, n.name) for n in optimized_graph(model, "all").graph.node]


def has_layout_pass(baseline_graph: list[tuple[str, str, str]]) -> bool:
    return any(domain.endswith("nchwc") for domain, _, _ in baseline_graph)


_RESIDUAL_ANCHORS = frozenset(op for op, kernel in KERNELS.items() if kernel.residual)


def residual_add(node: ir.Node) -> bool:
    """Whether ``node`` is an Add that reads, past Identity nodes, the output of an op whose
    kernel takes a residual input Z (Conv): a candidate for a fused Z."""
    if node.op_type != "Add" or node.domain not in ONNX_DOMAINS:
        return False
    for value in node.inputs:
        producer = trace_producer(value)[0] if value is not None else None
        if producer is not None and producer.domain in ONNX_DOMAINS and producer.op_type in _RESIDUAL_ANCHORS:
            return True
    return False


def takes_residual(model: ir.Model) -> bool:
    """Whether an epilogue fusion could give a kernel a residual input Z (the one way a
    FusedConv can lose the NCHWc layout): the model has a :func:`residual_add`."""
    return any(residual_add(node) for scope in iter_scopes(model) for node in scope.graph)


def layout_losses(
    baseline_graph: list[tuple[str, str, str]], fused: ir.Model, emitted: dict[str, str]
) -> dict[str, str]:
    """Fusions that keep a conv out of ONNX Runtime's NCHWc layout at ENABLE_ALL.

    ``baseline_graph`` is :func:`runtime_graph` of the unfused model; ``emitted`` maps each
    fused node's name to a description of its epilogue. Returns {fused node name: reason}
    for those the runtime leaves outside the layout although it converts the unfused conv.
    Empty when the runtime has no NCHWc layout on this machine.
    """
    if not emitted or not has_layout_pass(baseline_graph):
        return {}
    outside = {name for domain, op, name in baseline_graph if "Conv" in op and not domain.endswith("nchwc")}
    losses = {}
    for domain, op, name in runtime_graph(fused):
        if name in emitted and op in ("FusedConv", "Conv") and not domain.endswith("nchwc") and name not in outside:
            losses[name] = (
                f"ONNX Runtime at ENABLE_ALL keeps a FusedConv with {emitted[name]} out of its "
                "NCHWc layout, which it gives the unfused conv (and then fuses the epilogue "
                "itself); left to the runtime (--runtime-level below all fuses it anyway)"
            )
    return losses


def describe_epilogue(activation: Activation | None, z: ir.Value | None) -> str:
    parts = []
    if z is not None:
        source = z.producer()
        parts.append(f"Z from {describe(source) if source is not None else 'graph input ' + repr(z.name)}")
    if activation is not None:
        parts.append(f"activation {activation}")
    return " and ".join(parts) or "no epilogue"
