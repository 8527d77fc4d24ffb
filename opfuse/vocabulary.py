"""The ONNX vocabulary every part of opfuse shares: domains, dtypes, attributes, op kinds.

One fact, one place. The passes, the targets, the accelerator model, the memory-traffic
rule, the benchmarks and the PyTorch wing read these instead of keeping their own copies.

- **Domains**: :data:`ONNX_DOMAINS` is the one spelling of the default domain (``""`` and
  its alias ``"ai.onnx"``); :data:`MS_DOMAIN` is ONNX Runtime's contrib domain.
- **Dtypes**: :data:`FLOAT_BITS` (the floating-point dtypes by name, with their width).
- **Attributes**: :func:`int_attr`, :func:`float_attr`, :func:`str_attr`,
  :func:`plain_attributes`.
- **Op kinds**, in the style of TVM's pattern kinds (``relay/op/op_attr_types.h``); every
  fusion decision reads :data:`OP_KINDS` through :func:`op_kind`:

  ======================  ===================================================  ============
  kind                    meaning                                              examples
  ======================  ===================================================  ============
  ELEMWISE                one output element from the same input element       Relu, Tanh
  BROADCAST               element-wise over broadcast operands                 Add, Mul
  INJECTIVE               each output element reads one input element          Reshape
  COMM_REDUCE             a commutative reduction over some axes               ReduceMean
  OUT_ELEMWISE_FUSABLE    a heavy op whose output an element-wise chain can    Conv, Gemm
                          follow in its epilogue
  OPAQUE                  anything else; never fused                           Softmax, If
  ======================  ===================================================  ============

  BatchNormalization (inference) is a per-channel affine map over broadcast statistics:
  BROADCAST. An op of another domain, or one not in the table, is OPAQUE.
  :data:`ACTIVATION_OPS` are the activation functions among them (PRelu is BROADCAST: its
  slope is an operand).
- **Op counting**: :func:`op_label` (domain-qualified outside the default domain) and
  :func:`count_ops`.
- :func:`first_line` - the one line of an exception a user is shown.

This module imports nothing heavy (no onnx, numpy or onnx-ir): the command line reads it
at start-up.
"""

from __future__ import annotations

__all__ = [
    "ONNX_DOMAINS",
    "MS_DOMAIN",
    "FLOAT_BITS",
    "FLOAT_DTYPES",
    "OpKind",
    "OP_KINDS",
    "ACTIVATION_OPS",
    "ELEMENTWISE_KINDS",
    "op_kind",
    "is_onnx",
    "is_op",
    "op_label",
    "count_ops",
    "int_attr",
    "float_attr",
    "str_attr",
    "plain_attributes",
    "dtype_name",
    "first_line",
]

import enum
from collections import Counter
from collections.abc import Iterable
from typing import Any

ONNX_DOMAINS = ("", "ai.onnx")  # the default domain and its alias
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (FusedConv, FusedGemm, ...)

# floating-point dtypes by numpy/ml_dtypes name, with their width in bits
FLOAT_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}
FLOAT_DTYPES = frozenset(FLOAT_BITS)


class OpKind(enum.IntEnum):
    """TVM's pattern kinds (same order: a larger kind fuses less)."""

    ELEMWISE = 0
    BROADCAST = 1
    INJECTIVE = 2
    COMM_REDUCE = 3
    OUT_ELEMWISE_FUSABLE = 4
    OPAQUE = 8


_K = OpKind
# Default-domain ops by kind. One row per kind; supporting an op is adding its name.
_TABLE: dict[OpKind, tuple[str, ...]] = {
    _K.ELEMWISE: (
        "Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu",
        "Selu", "Celu", "Softplus", "Softsign", "Gelu", "Mish", "Erf", "Exp", "Log", "Neg",
        "Abs", "Sqrt", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Identity",
        "Dropout", "ThresholdedRelu", "Shrink",
    ),
    _K.BROADCAST: (
        "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "PRelu",
        "BatchNormalization",
    ),
    _K.INJECTIVE: (
        "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split",
        "Slice", "Gather", "Expand", "Tile", "Pad", "Cast", "DepthToSpace", "SpaceToDepth",
    ),
    _K.COMM_REDUCE: (
        "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceProd",
        "ReduceL1", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin",
    ),
    _K.OUT_ELEMWISE_FUSABLE: (
        "Conv", "ConvTranspose", "Gemm", "MatMul", "MaxPool", "AveragePool", "LpPool",
        "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool",
    ),
}
OP_KINDS: dict[str, OpKind] = {op: kind for kind, ops in _TABLE.items() for op in ops}

# Activation functions (what an epilogue may apply after a conv). All ELEMWISE but PRelu.
ACTIVATION_OPS = frozenset({
    "Relu", "LeakyRelu", "Clip", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Elu",
    "Selu", "Softplus", "Gelu", "PRelu",
})
# Kinds whose output continues the activation of its input (the traffic rule, epilogues).
ELEMENTWISE_KINDS = frozenset({OpKind.ELEMWISE, OpKind.BROADCAST})


def is_onnx(node: Any) -> bool:
    """Whether the node is in the default ONNX domain."""
    return node.domain in ONNX_DOMAINS


def is_op(node: Any, *op_types: str) -> bool:
    """Whether ``node`` is a default-domain op of one of ``op_types`` (None is not)."""
    return node is not None and node.op_type in op_types and node.domain in ONNX_DOMAINS


def op_kind(node: Any) -> OpKind:
    """The node's pattern kind; OPAQUE outside the default domain or the table."""
    if node.domain not in ONNX_DOMAINS:
        return OpKind.OPAQUE
    return OP_KINDS.get(node.op_type, OpKind.OPAQUE)


def op_label(domain: str, op_type: str) -> str:
    """``Conv`` in the default domain, ``com.microsoft.FusedConv`` elsewhere."""
    return op_type if domain in ONNX_DOMAINS else f"{domain}.{op_type}"


def count_ops(nodes: Iterable[Any]) -> Counter:
    """Node count per :func:`op_label` for anything with ``domain`` and ``op_type``."""
    return Counter(op_label(n.domain, n.op_type) for n in nodes)


# -- attributes (onnx-ir nodes) -------------------------------------------------------------

def int_attr(node: Any, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return int(attr.value) if attr is not None else default


def float_attr(node: Any, name: str, default: float) -> float:
    attr = node.attributes.get(name)
    return float(attr.value) if attr is not None else default


def str_attr(node: Any, name: str, default: str) -> str:
    attr = node.attributes.get(name)
    return str(attr.value) if attr is not None else default


def plain_attributes(node: Any) -> dict[str, Any]:
    """The node's numeric and string attributes as Python values (lists stay lists)."""
    out: dict[str, Any] = {}
    for name, attr in node.attributes.items():
        value = attr.value
        if isinstance(value, (int, float, str)):
            out[name] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(x, (int, float, str)) for x in value):
            out[name] = list(value)
    return out


def dtype_name(dtype: Any) -> str | None:
    """``"float32"``, ``"bfloat16"``... for an ``onnx_ir.DataType`` (None when unknown)."""
    if dtype is None:
        return None
    try:
        return str(dtype.numpy().name)
    except (TypeError, ValueError, AttributeError):
        return dtype.name.lower()


def first_line(exc: BaseException, limit: int | None = 300) -> str:
    """The first line of an exception's message (its type when it has none), cut at ``limit``."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__
