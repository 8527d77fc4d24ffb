"""The op table: everything opfuse knows about an ONNX operator, in one row per op.

One fact, one place. The folds, the epilogue pass, the pattern rules, the memory-traffic
rule, the accelerator model, verification, quantisation and the PyTorch wing read
:data:`OPS` (through :func:`op_info` and the views below) instead of keeping their own
lists; ``tests/test_layout.py`` fails when a module spells one of these facts itself.

A row (:class:`OpInfo`) says:

- **kind**, in the style of TVM's pattern kinds (``relay/op/op_attr_types.h``):

  ======================  ===================================================  ============
  kind                    meaning                                              examples
  ======================  ===================================================  ============
  ELEMWISE                one output element from the same input element       Relu, Cast
  BROADCAST               element-wise over broadcast operands                 Add, PRelu
  INJECTIVE               each output element reads one input element          Reshape
  COMM_REDUCE             a commutative reduction over some axes               ReduceMean
  OUT_ELEMWISE_FUSABLE    a heavy op whose output an element-wise chain can    Conv, Gemm
                          follow in its epilogue
  OPAQUE                  anything else; never fused                           Softmax, If
  ======================  ===================================================  ============

  BatchNormalization (inference) is a per-channel affine map over broadcast statistics:
  BROADCAST. An op of another domain, or one not in the table, is OPAQUE.
- **activation** (:class:`ActivationSpec`): the op is an activation function, with its
  parameters (attribute name and the schema's default) in the order a kernel takes them.
- **weights** (:class:`WeightSpec`): a layer with a weight input: where the weight and the
  bias are, and the weight's layout (what the folds scale, what verification's rounding
  floor counts, what quantisation calls a weighted layer).
- **commutative**: a binary op whose operands may be swapped.
- **footprint**: how much of its input one output row needs (the accelerator's working
  set): ``"window"`` (the rows under a sliding window: Conv, pooling), ``"global"`` (the
  whole map: global pooling, reductions), ``""`` (the same rows).
- **metadata_only**: it reads only its input's shape, not its data (Shape, Size).
- **int8**: what an int8 accelerator does with it (``"compute"``: runs it as an int8
  kernel; ``"move"``: moves or selects 8-bit values, keeping their scale; ``""``: float).
- **output_range**: the interval its values lie in whatever its input (Sigmoid, HardSigmoid,
  Softmax: [0, 1]; Tanh: [-1, 1]), the range an int8 output of it divides into 256 steps.

A second, smaller table, :data:`INTEGER_OPS`, names the ops of a model that was quantised
before opfuse sees it (by domain and op: two live in ONNX Runtime's ``com.microsoft``): the
float op each computes, and whether ONNX Runtime's ``quantize_dynamic`` writes it (its
activations are quantised at run time, :mod:`opfuse.passes.dequantize_dynamic`).

Also here: the domains (:data:`ONNX_DOMAINS`, :data:`MS_DOMAIN`), the float dtypes,
attribute readers, op labels and :func:`first_line`.

This module imports nothing heavy (no onnx, numpy or onnx-ir): the command line reads it
at start-up.
"""

from __future__ import annotations

__all__ = [
    "ONNX_DOMAINS",
    "MS_DOMAIN",
    "FLOAT_DTYPES",
    "OpKind",
    "ActivationSpec",
    "WeightSpec",
    "OpInfo",
    "OPS",
    "IntegerOp",
    "INTEGER_OPS",
    "integer_op",
    "OP_KINDS",
    "ACTIVATION_OPS",
    "WEIGHTED_OPS",
    "ELEMENTWISE_KINDS",
    "op_info",
    "op_kind",
    "weight_spec",
    "is_onnx",
    "is_op",
    "op_label",
    "count_ops",
    "int_attr",
    "float_attr",
    "str_attr",
    "plain_attributes",
    "proto_attr",
    "dtype_name",
    "first_line",
]

import dataclasses
import enum
from collections import Counter
from collections.abc import Iterable
from typing import Any

ONNX_DOMAINS = ("", "ai.onnx")  # the default domain and its alias
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (FusedConv, FusedGemm, ...)

# floating-point dtypes by numpy/ml_dtypes name (widths come from onnx_ir.DataType.bitwidth)
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


class OpKind(enum.IntEnum):
    """TVM's pattern kinds (same order: a larger kind fuses less)."""

    ELEMWISE = 0
    BROADCAST = 1
    INJECTIVE = 2
    COMM_REDUCE = 3
    OUT_ELEMWISE_FUSABLE = 4
    OPAQUE = 8


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """An activation function's parameters: (attribute, default) in kernel order.

    ``bounds_from_inputs``: Clip (opset 11+) takes min and max as inputs 1 and 2.
    ``slope_input``: PRelu's slope is its input 1 (an operand, not a parameter).
    """

    params: tuple[tuple[str, float | str], ...] = ()
    bounds_from_inputs: bool = False
    slope_input: int | None = None


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """Where a weighted layer keeps its weight and bias, and the weight's layout.

    ``layout`` names the weight's axes (:data:`opfuse.core.algebra.WeightLayout`): ``oihw``
    (Conv: [out, in/group, k...]), ``iohw`` (ConvTranspose: [in, out/group, k...]),
    ``kn`` (Gemm, MatMul: [in, out]); ``transposed_by`` is the attribute that turns
    ``kn`` into ``nk`` (Gemm's transB).
    """

    weight: int
    bias: int | None
    layout: str
    transposed_by: str | None = None
    grouped: bool = False  # the op has a ``group`` attribute
    batched: bool = False  # broadcasts over leading axes; channels are the last (MatMul)

    def layout_of(self, node: Any) -> str:
        """The layout of this node's weight (Gemm with transB=1: ``nk``)."""
        if self.transposed_by is not None and int_attr(node, self.transposed_by, 0):
            return self.layout[::-1]
        return self.layout

    def group_of(self, node: Any) -> int:
        return int_attr(node, "group", 1) if self.grouped else 1


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """Everything opfuse knows about one default-domain op (see the module docstring)."""

    kind: OpKind
    activation: ActivationSpec | None = None
    weights: WeightSpec | None = None
    commutative: bool = False
    int8: str = ""  # "compute", "move" or ""
    footprint: str = ""  # "window", "global" or ""
    metadata_only: bool = False  # reads its input's shape, not its data
    output_range: tuple[float, float] | None = None  # its values' interval whatever its input


_E, _B, _I, _R, _W, _O = (OpKind.ELEMWISE, OpKind.BROADCAST, OpKind.INJECTIVE, OpKind.COMM_REDUCE,
                          OpKind.OUT_ELEMWISE_FUSABLE, OpKind.OPAQUE)
_A = ActivationSpec


def _rows(kind: OpKind, *names: str, **fields: Any) -> dict[str, OpInfo]:
    return {name: OpInfo(kind, **fields) for name in names}


# Default-domain ops. Supporting an op is adding its row; an op that is not here is OPAQUE.
OPS: dict[str, OpInfo] = {
    # -- activations (ELEMWISE unless an operand joins: PRelu) --------------------------------
    "Relu": OpInfo(_E, _A(), int8="compute"),                   # max(x, 0)
    "LeakyRelu": OpInfo(_E, _A((("alpha", 0.01),)), int8="compute"),
    "Clip": OpInfo(_E, _A(bounds_from_inputs=True), int8="compute"),  # min/max: attrs < opset 11
    "Sigmoid": OpInfo(_E, _A(), int8="compute", output_range=(0.0, 1.0)),
    "HardSigmoid": OpInfo(_E, _A((("alpha", 0.2), ("beta", 0.5))), output_range=(0.0, 1.0)),  # max(0, min(1, a*x + b))
    "HardSwish": OpInfo(_E, _A()),                              # x * HardSigmoid(x; 1/6, 1/2)
    "Tanh": OpInfo(_E, _A(), output_range=(-1.0, 1.0)),
    "Elu": OpInfo(_E, _A((("alpha", 1.0),))),
    "Selu": OpInfo(_E, _A((("alpha", 1.67326319217681884765625), ("gamma", 1.05070102214813232421875)))),
    "Celu": OpInfo(_E, _A((("alpha", 1.0),))),
    "Softplus": OpInfo(_E, _A()),                               # log(1 + exp(x))
    "Softsign": OpInfo(_E, _A()),
    "Gelu": OpInfo(_E, _A((("approximate", "none"),))),         # opset 20
    "Swish": OpInfo(_E, _A((("alpha", 1.0),))),                 # x * sigmoid(alpha * x), opset 24
    "Mish": OpInfo(_E, _A()),
    "ThresholdedRelu": OpInfo(_E, _A((("alpha", 1.0),))),
    "PRelu": OpInfo(_B, _A(slope_input=1)),                     # x < 0 ? slope * x : x
    # -- other element-wise ops --------------------------------------------------------------
    **_rows(_E, "Erf", "Exp", "Log", "Neg", "Abs", "Sqrt", "Reciprocal", "Floor", "Ceil", "Round",
            "Sign", "Dropout", "Shrink", "Not", "IsNaN", "IsInf", "Sin", "Cos"),
    **_rows(_E, "Identity", int8="move"),
    "Cast": OpInfo(_E),
    **_rows(_B, "Add", "Mul", commutative=True, int8="compute"),
    **_rows(_B, "Sum", "Max", "Min", "And", "Or", "Xor", "Equal", commutative=True),
    **_rows(_B, "Sub", "Div", "Pow", "Mod", "Where", "Less", "Greater", "LessOrEqual",
            "GreaterOrEqual", "BatchNormalization"),
    # -- data movement -----------------------------------------------------------------------
    **_rows(_I, "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split",
            "Slice", "Gather", "Pad", "DepthToSpace", "SpaceToDepth", int8="move"),
    **_rows(_I, "Expand", "Tile", "GatherElements", "GatherND", "ScatterND", "ScatterElements"),
    # -- reductions --------------------------------------------------------------------------
    **_rows(_R, "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceProd",
            "ReduceL1", "ReduceLogSumExp", "ReduceSumSquare", footprint="global"),
    **_rows(_R, "ArgMax", "ArgMin"),
    # -- heavy ops an epilogue can follow ---------------------------------------------------
    "Conv": OpInfo(_W, weights=WeightSpec(1, 2, "oihw", grouped=True), int8="compute", footprint="window"),
    "ConvTranspose": OpInfo(_W, weights=WeightSpec(1, 2, "iohw", grouped=True), int8="compute",
                            footprint="window"),
    "Gemm": OpInfo(_W, weights=WeightSpec(1, 2, "kn", transposed_by="transB"), int8="compute"),
    "MatMul": OpInfo(_W, weights=WeightSpec(1, None, "kn", batched=True), int8="compute"),
    "AveragePool": OpInfo(_W, int8="compute", footprint="window"),
    "MaxPool": OpInfo(_W, int8="move", footprint="window"),
    "LpPool": OpInfo(_W, footprint="window"),
    "GlobalAveragePool": OpInfo(_W, int8="compute", footprint="global"),
    **_rows(_W, "GlobalMaxPool", "GlobalLpPool", footprint="global"),
    # -- opaque ops opfuse names (everything not in the table is opaque too) ----------------
    "Softmax": OpInfo(_O, int8="compute", output_range=(0.0, 1.0)),
    **_rows(_O, "Resize", int8="move"),
    **_rows(_O, "LayerNormalization", "RMSNormalization", "GroupNormalization",
            "InstanceNormalization", "LogSoftmax", "Attention", "LSTM", "GRU", "RNN", "If", "Loop",
            "Scan", "Constant", "ConstantOfShape", "Range", "TopK", "NonZero"),
    **_rows(_O, "Shape", "Size", metadata_only=True),
}



@dataclasses.dataclass(frozen=True)
class IntegerOp:
    """An op of a model quantised before opfuse sees it."""

    computes: str  # the float op it is the integer form of ("" for the quantisers themselves)
    dynamic: bool  # written by ONNX Runtime's quantize_dynamic: its activation is quantised at run time


# (domain, op) -> row. The dynamic ones are ONNX Runtime's quantize_dynamic output (ConvInteger and
# MatMulInteger read a DynamicQuantizeLinear; its graph optimiser fuses them into the contrib ops).
INTEGER_OPS: dict[tuple[str, str], IntegerOp] = {
    ("", "DynamicQuantizeLinear"): IntegerOp("", dynamic=True),
    ("", "ConvInteger"): IntegerOp("Conv", dynamic=True),
    ("", "MatMulInteger"): IntegerOp("MatMul", dynamic=True),
    (MS_DOMAIN, "DynamicQuantizeLSTM"): IntegerOp("LSTM", dynamic=True),
    (MS_DOMAIN, "DynamicQuantizeMatMul"): IntegerOp("MatMul", dynamic=True),
    (MS_DOMAIN, "MatMulIntegerToFloat"): IntegerOp("MatMul", dynamic=True),
    ("", "QLinearConv"): IntegerOp("Conv", dynamic=False),
    ("", "QLinearMatMul"): IntegerOp("MatMul", dynamic=False),
    ("", "QuantizeLinear"): IntegerOp("", dynamic=False),
    ("", "DequantizeLinear"): IntegerOp("", dynamic=False),
}

OP_KINDS: dict[str, OpKind] = {op: info.kind for op, info in OPS.items()}
ACTIVATION_OPS = frozenset(op for op, info in OPS.items() if info.activation is not None)
WEIGHTED_OPS = frozenset(op for op, info in OPS.items() if info.weights is not None)
# Kinds whose output continues the activation of its input (the traffic rule, epilogues).
ELEMENTWISE_KINDS = frozenset({OpKind.ELEMWISE, OpKind.BROADCAST})


def is_onnx(node: Any) -> bool:
    """Whether the node is in the default ONNX domain."""
    return node.domain in ONNX_DOMAINS


def is_op(node: Any, *op_types: str) -> bool:
    """Whether ``node`` is a default-domain op of one of ``op_types`` (None is not)."""
    return node is not None and node.op_type in op_types and node.domain in ONNX_DOMAINS


def op_info(node: Any) -> OpInfo | None:
    """The node's row of :data:`OPS`; None outside the default domain or the table."""
    if node.domain not in ONNX_DOMAINS:
        return None
    return OPS.get(node.op_type)


def integer_op(node: Any) -> IntegerOp | None:
    """The node's row of :data:`INTEGER_OPS` (None for a float op)."""
    domain = "" if node.domain in ONNX_DOMAINS else node.domain
    return INTEGER_OPS.get((domain, node.op_type))


def op_kind(node: Any) -> OpKind:
    """The node's pattern kind; OPAQUE outside the default domain or the table."""
    info = op_info(node)
    return info.kind if info is not None else OpKind.OPAQUE


def weight_spec(node: Any) -> WeightSpec | None:
    """Where the node's weight is, for a weighted layer in the default domain."""
    info = op_info(node)
    return info.weights if info is not None else None


def op_label(domain: str, op_type: str) -> str:
    """``Conv`` in the default domain, ``com.microsoft.FusedConv`` elsewhere."""
    return op_type if domain in ONNX_DOMAINS else f"{domain}.{op_type}"


def count_ops(nodes: Iterable[Any]) -> Counter:
    """Node count per :func:`op_label` for anything with ``domain`` and ``op_type``."""
    counts: Counter = Counter()
    for (domain, op_type), n in Counter((n.domain, n.op_type) for n in nodes).items():
        counts[op_label(domain, op_type)] += n  # (a label per distinct op, not per node; first-seen order kept)
    return counts


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


# -- attributes (protobuf nodes) ------------------------------------------------------------

def proto_attr(node: Any, name: str, default: Any = None) -> Any:
    """A ``NodeProto``'s attribute ``name`` as onnx gives it (``onnx.helper.get_attribute_value``:
    bytes for a string, a list for repeated values, a ``TensorProto`` for a tensor), ``default``
    when the node has none (``onnx.helper.get_node_attr_value`` raises then)."""
    from onnx import helper  # (onnx is heavy: start-up imports this module, not onnx)

    found = next((a for a in node.attribute if a.name == name), None)
    return default if found is None else helper.get_attribute_value(found)


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
