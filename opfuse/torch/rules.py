"""The torch wing's rules, as data: what folds, which activations fuse, what an add is.

- :data:`CONV_TYPES`, :data:`CONV_TRANSPOSE_TYPES`, :data:`BATCHNORM_TYPES`: the modules
  a fold accepts (exact types: a subclass may compute something else);
  :data:`FOLD_PATTERNS` names each "producer + BatchNorm" pattern as the ONNX side does.
- :data:`ACTIVATIONS`: every module, function, aten op and tensor method recognised as an
  activation epilogue -> (the ONNX op it is, a maker of the oneDNN :class:`Unary`, or
  None when the arguments are not constants). The ONNX names are checked against the
  shared vocabulary (:data:`opfuse.core.ops.ACTIVATION_OPS`) at import; the names
  torch has and ONNX does not are declared in :data:`TORCH_ONLY_ACTIVATIONS`.
- :data:`ADDS`, :data:`INPLACE_ADDS`: the spellings of a two-tensor addition.

Below them, the small torch.fx helpers the capture and the fuser share (package-internal).
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from opfuse.torch.kernels import Unary
from opfuse.core.ops import ACTIVATION_OPS

aten = torch.ops.aten

# -- what opfuse recognises (rules as data) ------------------------------------------------

CONV_TYPES = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}
CONV_TRANSPOSE_TYPES = {nn.ConvTranspose1d: 1, nn.ConvTranspose2d: 2, nn.ConvTranspose3d: 3}
BATCHNORM_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

# producer kind -> pattern name of "producer + BatchNorm"
FOLD_PATTERNS = {
    "Conv": "Conv+BatchNormalization",
    "ConvTranspose": "ConvTranspose+BatchNormalization",
    "Linear": "Linear+BatchNormalization",
}


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _const(*values: Any) -> bool:
    return all(_number(v) for v in values)


# Activation epilogues: target -> (ONNX-style pattern suffix, node/module -> Unary or None).
# None means "not with these arguments" (e.g. a bound that is a tensor). Adding an
# activation is adding a row, provided oneDNN has an algorithm for it.
def _fixed(attr: str, *scalars: float) -> Callable:
    return lambda node, module=None: Unary(attr, scalars)


def _hardtanh_fn(node, module=None):
    lo, hi = _arg(node, 1, "min_val", -1.0), _arg(node, 2, "max_val", 1.0)
    return Unary("hardtanh", (float(lo), float(hi))) if _const(lo, hi) else None


def _clamp_fn(node, module=None):
    lo, hi = _arg(node, 1, "min"), _arg(node, 2, "max")
    return Unary("hardtanh", (float(lo), float(hi))) if _const(lo, hi) else None


def _leaky_fn(node, module=None):
    slope = _arg(node, 1, "negative_slope", 0.01)
    return Unary("leaky_relu", (float(slope),)) if _const(slope) else None


def _gelu_fn(node, module=None):
    approximate = _arg(node, 1, "approximate", "none")
    return Unary("gelu", (), approximate) if approximate in ("none", "tanh") else None


_RELU = ("Relu", _fixed("relu"))
_RELU6 = ("Clip", _fixed("hardtanh", 0.0, 6.0))
_SIGMOID = ("Sigmoid", _fixed("sigmoid"))
_TANH = ("Tanh", _fixed("tanh"))
_SILU = ("SiLU", _fixed("swish"))
_HARDSWISH = ("HardSwish", _fixed("hardswish"))
_HARDSIGMOID = ("HardSigmoid", _fixed("hardsigmoid"))

ACTIVATIONS: dict[Any, tuple[str, Callable]] = {
    # modules
    nn.ReLU: _RELU,
    nn.ReLU6: _RELU6,
    nn.Hardtanh: ("Clip", lambda n, m: Unary("hardtanh", (float(m.min_val), float(m.max_val)))),
    nn.LeakyReLU: ("LeakyRelu", lambda n, m: Unary("leaky_relu", (float(m.negative_slope),))),
    nn.Sigmoid: _SIGMOID,
    nn.Tanh: _TANH,
    nn.SiLU: _SILU,
    nn.GELU: ("Gelu", lambda n, m: Unary("gelu", (), m.approximate)),
    nn.Hardswish: _HARDSWISH,
    nn.Hardsigmoid: _HARDSIGMOID,
    # functions (torch.fx records F.* and torch.*; torch.export records aten ops)
    F.relu: _RELU, torch.relu: _RELU, torch.relu_: _RELU,
    aten.relu.default: _RELU, aten.relu_.default: _RELU,
    F.relu6: _RELU6, aten.relu6.default: _RELU6,
    F.hardtanh: ("Clip", _hardtanh_fn), aten.hardtanh.default: ("Clip", _hardtanh_fn),
    aten.hardtanh_.default: ("Clip", _hardtanh_fn),
    torch.clamp: ("Clip", _clamp_fn), torch.clip: ("Clip", _clamp_fn),
    aten.clamp.default: ("Clip", _clamp_fn),
    F.leaky_relu: ("LeakyRelu", _leaky_fn), aten.leaky_relu.default: ("LeakyRelu", _leaky_fn),
    aten.leaky_relu_.default: ("LeakyRelu", _leaky_fn),
    torch.sigmoid: _SIGMOID, F.sigmoid: _SIGMOID, aten.sigmoid.default: _SIGMOID,
    torch.tanh: _TANH, F.tanh: _TANH, aten.tanh.default: _TANH,
    F.silu: _SILU, aten.silu.default: _SILU, aten.silu_.default: _SILU,
    F.gelu: ("Gelu", _gelu_fn), torch._C._nn.gelu: ("Gelu", _gelu_fn),
    aten.gelu.default: ("Gelu", _gelu_fn),
    F.hardswish: _HARDSWISH, aten.hardswish.default: _HARDSWISH,
    F.hardsigmoid: _HARDSIGMOID, aten.hardsigmoid.default: _HARDSIGMOID,
    # tensor methods: x.relu(), x.clamp(0, 6)...
    ("method", "relu"): _RELU, ("method", "relu_"): _RELU,
    ("method", "sigmoid"): _SIGMOID, ("method", "tanh"): _TANH,
    ("method", "clamp"): ("Clip", _clamp_fn), ("method", "clip"): ("Clip", _clamp_fn),
}

# Activations torch has as one op and ONNX does not (SiLU is Sigmoid then Mul in ONNX).
TORCH_ONLY_ACTIVATIONS = frozenset({"SiLU"})
_unknown = {name for name, _ in ACTIVATIONS.values()} - ACTIVATION_OPS - TORCH_ONLY_ACTIVATIONS
assert not _unknown, f"activations outside the ONNX vocabulary: {sorted(_unknown)}"

# Additions of two tensors: x + y, x += y, torch.add, x.add(y), x.add_(y), aten.add.
ADDS = {operator.add, operator.iadd, torch.add, aten.add.Tensor, aten.add_.Tensor,
        ("method", "add"), ("method", "add_")}
INPLACE_ADDS = {operator.iadd, aten.add_.Tensor, ("method", "add_")}


# -- small graph helpers (shared by capture.py and fuse.py) -------------------------------------------------------------------


def _key(node: fx.Node) -> Any:
    if node.op == "call_method":
        return ("method", node.target)
    return node.target


def _module(gm: fx.GraphModule, node: Any) -> nn.Module | None:
    if isinstance(node, fx.Node) and node.op == "call_module":
        return gm.get_submodule(node.target)
    return None


def _name(node: fx.Node) -> str:
    """A name a user recognises: the module path for module calls ("layer1.0.relu", with
    "(call 2 of 3)" when the module is called at several sites), else the node name."""
    if node.op != "call_module":
        return node.name
    calls = [n for n in node.graph.nodes if n.op == "call_module" and n.target == node.target]
    if len(calls) == 1:
        return str(node.target)
    return f"{node.target} (call {calls.index(node) + 1} of {len(calls)})"


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _producer_kind(m: nn.Module | None) -> str | None:
    t = type(m)
    if t in CONV_TYPES:
        return "Conv"
    if t in CONV_TRANSPOSE_TYPES:
        return "ConvTranspose"
    if t is nn.Linear:
        return "Linear"
    return None


def _match_activation(gm: fx.GraphModule, node: fx.Node) -> tuple[str, Unary] | None:
    module = _module(gm, node)
    rule = ACTIVATIONS.get(type(module)) if module is not None else None
    if rule is None and node.op in ("call_function", "call_method"):
        try:
            rule = ACTIVATIONS.get(_key(node))
        except TypeError:  # unhashable target
            rule = None
    if rule is None:
        return None
    pattern, make = rule
    unary = make(node, module)
    return None if unary is None else (pattern, unary)


def _is_add(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    try:
        return _key(node) in ADDS
    except TypeError:
        return False


def _exists(gm: nn.Module, target: str) -> bool:
    try:
        gm.get_submodule(target)
        return True
    except AttributeError:
        return False


def _set_submodule(gm: nn.Module, target: str, module: nn.Module) -> None:
    parent_path, _, field = target.rpartition(".")
    parent = gm.get_submodule(parent_path) if parent_path else gm
    setattr(parent, field, module)


def _op_counts(gm: fx.GraphModule) -> Counter:
    counts: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_module":
            counts[type(gm.get_submodule(n.target)).__name__] += 1
        elif n.op == "call_function":
            counts[getattr(n.target, "__name__", str(n.target))] += 1
        elif n.op == "call_method":
            counts[f"Tensor.{n.target}"] += 1
    return counts
