"""Single ONNX nodes as differentiable torch functions: the float and fake-quantised forward
passes of block reconstruction and output sensitivities in :mod:`opfuse.quantization`.

    run = node_function(node, opset)    # built once per node
    outputs = run(inputs)               # torch tensors in, one torch tensor per node output

A node of the default domain becomes a function of its inputs (a list as long as
``node.input``, ``None`` where the name is empty). Float tensors go through pure torch ops,
so autograd reaches the weights that are fake-quantised upstream and trained with Adam;
integer tensors (shapes, indices) stay int64, and shape-like inputs (Reshape's shape,
Slice's starts, Pad's pads, Resize's scales...) are read as Python numbers at call time.
Arithmetic stays in the input's dtype (float16 in, float16 out) with ONNX's numpy-style
broadcasting, and the opset decides where semantics moved between versions: Clip's bounds
(attributes before 11, inputs from 11), Softmax's axis (1 on a 2-D view before 13, -1
from 13), axes and split sizes as attributes or inputs, Slice's attributes before 10.

What is interpreted is the table ``_OPS`` (op type -> builder); the neural-network
builders (Conv, pools, normalisations, Pad, Resize...) are in :mod:`.torch_nn_ops`. A
builder reads the node's attributes once and returns the function; it refuses with
:class:`Unsupported` when the node is built, not when it runs: an op not in the table, a
node of another domain, an attribute value it does not implement (Resize's cubic mode), an
attribute it never reads, or an output it does not compute (MaxPool's Indices). The reason
is one short sentence the caller can put in its report. ``tests/test_torch_ops.py`` checks
every op against ONNX Runtime.
"""

from __future__ import annotations

__all__ = ["Unsupported", "node_function"]

import functools
import math
from collections.abc import Callable

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, numpy_helper

from opfuse.quantization.interpreter.nn_ops import (
    _average_pool, _batch_norm, _conv, _conv_transpose, _depth_to_space, _einsum, _gemm, _global_pool,
    _instance_norm, _layer_norm, _max_pool, _pad, _resize, _space_to_depth,
)
from opfuse.quantization.interpreter.common import (  # noqa: F401 - Unsupported: the interface
    Function, Unsupported, _Attributes, _ints, _item, _optional, _output_name,
)
from opfuse.core.ops import MS_DOMAIN, ONNX_DOMAINS

def node_function(node: onnx.NodeProto, opset: int) -> Callable[[list], list]:
    """A function of the node's inputs (a list as long as ``node.input``: torch tensors,
    ``None`` where the input name is empty) returning the list of its outputs (torch
    tensors, one per ``node.output``; ``None`` for a trailing output with an empty name).
    Raises :class:`Unsupported` here, at build time, when the op or an attribute value
    is not handled."""
    default = node.domain in ONNX_DOMAINS
    build = _OPS.get(node.op_type) if default else _CONTRIB.get((node.domain, node.op_type))
    if build is None:
        raise Unsupported(f"{node.op_type}{'' if default else ' of domain ' + node.domain} is not interpreted")
    attrs = _Attributes(node, opset)
    compute = build(attrs)
    unread = attrs.unread()
    if unread:
        attrs.refuse(f"attribute {unread[0]}")
    multiple = node.op_type in _MULTIPLE_OUTPUTS
    if not multiple:
        extra = [i for i, name in enumerate(node.output) if i > 0 and name]
        if extra:
            attrs.refuse(f"output {_output_name(node.op_type, opset, extra[0])}")
    count = len(node.output)

    def run(inputs: list) -> list:
        outputs = list(compute(inputs)) if multiple else [compute(inputs)]
        return outputs + [None] * (count - len(outputs))

    return run


# -- reading inputs and attributes -----------------------------------------------------------

def _ints_attr_or_input(a: _Attributes, name: str, since: int, index: int) -> Callable[[list], list[int] | None]:
    """Ints that are attribute ``name`` before opset ``since`` and input ``index`` from it."""
    if a.opset < since:
        value = a(name)
        return lambda xs: value
    return lambda xs: _ints(_optional(xs, index))


_DTYPES = {
    TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16, TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.DOUBLE: torch.float64, TensorProto.INT8: torch.int8, TensorProto.UINT8: torch.uint8,
    TensorProto.INT16: torch.int16, TensorProto.INT32: torch.int32, TensorProto.INT64: torch.int64,
    TensorProto.BOOL: torch.bool,
}


def _from_proto(a: _Attributes, proto: onnx.TensorProto) -> torch.Tensor:
    if proto.data_type not in _DTYPES or proto.data_type == TensorProto.BFLOAT16:
        a.refuse(f"{TensorProto.DataType.Name(proto.data_type)} tensor")
    return torch.from_numpy(np.array(numpy_helper.to_array(proto)))


# -- element-wise ------------------------------------------------------------------------------

def _pointwise(fn: Callable) -> Callable[[_Attributes], Function]:
    """A builder for an op without attributes: ``fn`` of its inputs."""
    return lambda a: lambda xs: fn(*xs)


def _unary(fn: Callable, **defaults) -> Callable[[_Attributes], Function]:
    """A builder for ``fn(x, **attributes)``, the attributes read with their ONNX defaults."""
    def build(a: _Attributes) -> Function:
        values = {name: a(name, default) for name, default in defaults.items()}
        return lambda xs: fn(xs[0], **values)
    return build


def _div(x, y):
    return x / y if x.is_floating_point() else torch.div(x, y, rounding_mode="trunc")


def _variadic(fn: Callable) -> Callable[[_Attributes], Function]:
    return _pointwise(lambda *xs: functools.reduce(fn, xs))


def _mod(a: _Attributes) -> Function:
    fn = torch.fmod if a("fmod", 0) else torch.remainder
    return lambda xs: fn(xs[0], xs[1])


def _gelu(a: _Attributes) -> Function:
    approximate = a.choice("approximate", "none", ("none", "tanh"))
    return lambda xs: F.gelu(xs[0], approximate=approximate)


def _clip(a: _Attributes) -> Function:
    if a.opset < 11:
        low, high = a("min", -math.inf), a("max", math.inf)
        return lambda xs: torch.clamp(xs[0], low, high)

    def run(xs):
        low, high = _optional(xs, 1), _optional(xs, 2)
        return xs[0] if low is None and high is None else torch.clamp(xs[0], low, high)
    return run


def _cast(a: _Attributes) -> Function:
    to = a("to")
    a.ignore("saturate")
    if to not in _DTYPES:
        a.refuse(f"to {TensorProto.DataType.Name(to)}")
    dtype = _DTYPES[to]
    return lambda xs: xs[0].to(dtype)


def _cast_like(a: _Attributes) -> Function:
    a.ignore("saturate")
    return lambda xs: xs[0].to(xs[1].dtype)


def _dropout(a: _Attributes) -> Function:
    a.ignore("ratio", "seed", "is_test")
    return lambda xs: xs[0]


def _softmax(fn: Callable) -> Callable[[_Attributes], Function]:
    """Softmax and LogSoftmax: over ``axis`` from opset 13; before, over the 2-D view
    [prod(shape[:axis]), prod(shape[axis:])], axis 1 by default."""
    def build(a: _Attributes) -> Function:
        if a.opset >= 13:
            axis = a("axis", -1)
            return lambda xs: fn(xs[0], axis)
        axis = a("axis", 1)

        def run(xs):
            x = xs[0]
            k = axis % x.dim()
            flat = x.reshape(math.prod(x.shape[:k]), math.prod(x.shape[k:]))
            return fn(flat, 1).reshape(x.shape)
        return run
    return build


# -- reductions ------------------------------------------------------------------------------

def _prod(x, dims, keepdim):
    for d in sorted(dims, reverse=True):
        x = torch.prod(x, d, keepdim=keepdim)
    return x


_REDUCTIONS = {  # op: (fn(x, dims, keepdim), the opset from which axes is an input)
    "ReduceMean": (torch.mean, 18),
    "ReduceSum": (torch.sum, 13),
    "ReduceMax": (torch.amax, 18),
    "ReduceMin": (torch.amin, 18),
    "ReduceProd": (_prod, 18),
    "ReduceL1": (lambda x, dims, keepdim: torch.sum(x.abs(), dims, keepdim=keepdim), 18),
    "ReduceL2": (lambda x, dims, keepdim: torch.linalg.vector_norm(x, 2, dims, keepdim), 18),
    "ReduceSumSquare": (lambda x, dims, keepdim: torch.sum(x * x, dims, keepdim=keepdim), 18),
    "ReduceLogSumExp": (torch.logsumexp, 18),
}


def _reduce(fn: Callable, since: int) -> Callable[[_Attributes], Function]:
    def build(a: _Attributes) -> Function:
        keepdims = bool(a("keepdims", 1))
        noop = a("noop_with_empty_axes", 0) if a.opset >= since else 0
        axes_of = _ints_attr_or_input(a, "axes", since, 1)

        def run(xs):
            x, axes = xs[0], axes_of(xs)
            if not axes:
                if noop or x.dim() == 0:
                    return x
                axes = range(x.dim())
            return fn(x, tuple(sorted({d % x.dim() for d in axes})), keepdim=keepdims)
        return run
    return build


def _arg_reduce(fn: Callable) -> Callable[[_Attributes], Function]:
    def build(a: _Attributes) -> Function:
        axis, keepdims = a("axis", 0), bool(a("keepdims", 1))
        if a("select_last_index", 0):
            a.refuse("select_last_index 1")
        return lambda xs: fn(xs[0], axis, keepdim=keepdims)
    return build


# -- shapes and indexing ---------------------------------------------------------------------

def _reshape(a: _Attributes) -> Function:
    allowzero = a("allowzero", 0)
    shape_of = _ints_attr_or_input(a, "shape", 5, 1)

    def run(xs):
        x, shape = xs[0], shape_of(xs)
        if not allowzero:
            shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
        return x.reshape(shape)
    return run


def _transpose(a: _Attributes) -> Function:
    perm = a("perm")
    return lambda xs: xs[0].permute(perm or list(reversed(range(xs[0].dim()))))


def _flatten(a: _Attributes) -> Function:
    axis = a("axis", 1)

    def run(xs):
        x = xs[0]
        k = axis if axis >= 0 else axis + x.dim()
        return x.reshape(math.prod(x.shape[:k]), math.prod(x.shape[k:]))
    return run


def _concat(a: _Attributes) -> Function:
    axis = a("axis", 1)
    return lambda xs: torch.cat([x for x in xs if x is not None], axis)


def _split(a: _Attributes) -> Function:
    """Sizes from ``split`` (an input from opset 13), else ``num_outputs`` (opset 18) or as
    many parts as outputs, of ceil(length / parts) each but the last."""
    axis = a("axis", 0)
    sizes_of = _ints_attr_or_input(a, "split", 13, 1)
    parts = (a("num_outputs") if a.opset >= 18 else None) or len(a.node.output)

    def run(xs):
        x, sizes = xs[0], sizes_of(xs)
        if not sizes:
            length = x.shape[axis]
            chunk = -(-length // parts)
            sizes = [chunk] * (parts - 1) + [length - chunk * (parts - 1)]
        return torch.split(x, sizes, axis)
    return run


_TO_THE_END = (2**31 - 1, 2**63 - 1)  # an end read as numpy's None with either step sign, as ONNX Runtime does


def _slice_range(start: int, end: int, step: int, size: int) -> range:
    """ONNX's clamping: [0, size] with a positive step, [0, size - 1] and [-1, size - 1] with a negative one."""
    start = start + size if start < 0 else start
    if end in _TO_THE_END:
        end = size if step > 0 else -1
    elif end < 0:
        end += size
    if step > 0:
        return range(min(max(start, 0), size), min(max(end, 0), size), step)
    return range(min(max(start, 0), size - 1), min(max(end, -1), size - 1), step)


def _slice(a: _Attributes) -> Function:
    attributes = (a("starts"), a("ends"), a("axes"), None) if a.opset < 10 else None

    def run(xs):
        x = xs[0]
        starts, ends, axes, steps = attributes or [_ints(_optional(xs, i)) for i in range(1, 5)]
        axes, steps = axes or range(len(starts)), steps or [1] * len(starts)
        for axis, start, end, step in zip(axes, starts, ends, steps):
            axis %= x.dim()
            r = _slice_range(start, end, step, x.shape[axis])
            if step > 0:
                x = x[(slice(None),) * axis + (slice(r.start, r.stop, r.step),)]
            else:
                x = x.index_select(axis, torch.tensor(r, dtype=torch.int64))
        return x
    return run


def _squeeze(a: _Attributes) -> Function:
    axes_of = _ints_attr_or_input(a, "axes", 13, 1)

    def run(xs):
        x, axes = xs[0], axes_of(xs)
        dims = {d % x.dim() for d in axes} if axes else {i for i, s in enumerate(x.shape) if s == 1}
        return x.reshape([s for i, s in enumerate(x.shape) if i not in dims])
    return run


def _unsqueeze(a: _Attributes) -> Function:
    axes_of = _ints_attr_or_input(a, "axes", 13, 1)

    def run(xs):
        x, axes = xs[0], axes_of(xs)
        shape = list(x.shape)
        for d in sorted(d % (x.dim() + len(axes)) for d in axes):
            shape.insert(d, 1)
        return x.reshape(shape)
    return run


def _shape(a: _Attributes) -> Function:
    start, end = a("start", 0), a("end")
    return lambda xs: torch.tensor(list(xs[0].shape)[start:end], dtype=torch.int64)


def _gather(a: _Attributes) -> Function:
    axis = a("axis", 0)

    def run(xs):
        x, indices = xs[0], xs[1].long()
        k = axis % x.dim()
        indices = torch.where(indices < 0, indices + x.shape[k], indices)
        picked = x.index_select(k, indices.reshape(-1))
        return picked.reshape(x.shape[:k] + indices.shape + x.shape[k + 1:])
    return run


def _gather_elements(a: _Attributes) -> Function:
    axis = a("axis", 0)

    def run(xs):
        x, indices = xs[0], xs[1].long()
        indices = torch.where(indices < 0, indices + x.shape[axis], indices)
        return torch.gather(x, axis, indices)
    return run


def _expand(x, shape):
    return x.expand(torch.broadcast_shapes(tuple(x.shape), tuple(_ints(shape))))


def _tile(x, repeats):
    return x.repeat(_ints(repeats))


def _cumsum(a: _Attributes) -> Function:
    exclusive, reverse = a("exclusive", 0), a("reverse", 0)

    def run(xs):
        x = xs[0]
        axis = int(xs[1].item()) % x.dim()
        y = torch.cumsum(x.flip(axis) if reverse else x, axis, dtype=x.dtype)
        if exclusive:
            y = torch.cat([torch.zeros_like(y.narrow(axis, 0, 1)), y.narrow(axis, 0, y.shape[axis] - 1)], axis)
        return y.flip(axis) if reverse else y
    return run


def _trilu(a: _Attributes) -> Function:
    fn = torch.triu if a("upper", 1) else torch.tril

    return lambda xs: fn(xs[0], int(_item(_optional(xs, 1), 0)))


# -- constants -------------------------------------------------------------------------------

def _constant(a: _Attributes) -> Function:
    for name in ("sparse_value", "value_string", "value_strings"):
        if a(name) is not None:
            a.refuse(name)
    value, value_float, value_floats, value_int, value_ints = (
        a(name) for name in ("value", "value_float", "value_floats", "value_int", "value_ints"))
    if value is not None:
        t = _from_proto(a, value)
    elif value_float is not None or value_floats is not None:
        t = torch.tensor(value_float if value_floats is None else value_floats, dtype=torch.float32)
    elif value_int is not None or value_ints is not None:
        t = torch.tensor(value_int if value_ints is None else value_ints, dtype=torch.int64)
    else:
        a.refuse("without a value")
    return lambda xs: t


def _constant_of_shape(a: _Attributes) -> Function:
    value = a("value")
    fill = torch.zeros((), dtype=torch.float32) if value is None else _from_proto(a, value).reshape(())
    return lambda xs: torch.full(_ints(xs[0]), fill.item(), dtype=fill.dtype)


def _range(start, limit, delta):
    return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


# -- the table -------------------------------------------------------------------------------

_OPS: dict[str, Callable[[_Attributes], Function]] = {
    "Add": _pointwise(torch.add),
    "Sub": _pointwise(torch.sub),
    "Mul": _pointwise(torch.mul),
    "Div": _pointwise(_div),
    "Pow": _pointwise(lambda x, y: torch.pow(x, y).to(x.dtype)),
    "Mod": _mod,
    "Sum": _variadic(torch.add),
    "Mean": _pointwise(lambda *xs: functools.reduce(torch.add, xs) / len(xs)),
    "Min": _variadic(torch.minimum),
    "Max": _variadic(torch.maximum),
    "Sqrt": _pointwise(torch.sqrt),
    "Exp": _pointwise(torch.exp),
    "Log": _pointwise(torch.log),
    "Abs": _pointwise(torch.abs),
    "Neg": _pointwise(torch.neg),
    "Reciprocal": _pointwise(torch.reciprocal),
    "Erf": _pointwise(torch.erf),
    "Floor": _pointwise(torch.floor),
    "Ceil": _pointwise(torch.ceil),
    "Round": _pointwise(torch.round),
    "Sign": _pointwise(torch.sign),
    "Sin": _pointwise(torch.sin),
    "Cos": _pointwise(torch.cos),
    "Tanh": _pointwise(torch.tanh),
    "Sigmoid": _pointwise(torch.sigmoid),
    "Relu": _pointwise(torch.relu),
    "LeakyRelu": _unary(lambda x, alpha: F.leaky_relu(x, alpha), alpha=0.01),
    "PRelu": _pointwise(lambda x, slope: torch.where(x < 0, x * slope, x)),
    "Elu": _unary(lambda x, alpha: F.elu(x, alpha), alpha=1.0),
    "Celu": _unary(lambda x, alpha: F.celu(x, alpha), alpha=1.0),
    "Selu": _unary(lambda x, alpha, gamma: gamma * torch.where(x > 0, x, alpha * torch.expm1(x)),
                   alpha=1.67326319217681884765625, gamma=1.05070102214813232421875),
    "ThresholdedRelu": _unary(lambda x, alpha: torch.where(x > alpha, x, torch.zeros_like(x)), alpha=1.0),
    "HardSigmoid": _unary(lambda x, alpha, beta: torch.clamp(alpha * x + beta, 0, 1), alpha=0.2, beta=0.5),
    "HardSwish": _pointwise(F.hardswish),
    "Softplus": _pointwise(F.softplus),
    "Softsign": _pointwise(F.softsign),
    "Mish": _pointwise(F.mish),
    "Gelu": _gelu,
    "Clip": _clip,
    "Softmax": _softmax(torch.softmax),
    "LogSoftmax": _softmax(torch.log_softmax),

    "Equal": _pointwise(torch.eq),
    "Less": _pointwise(torch.lt),
    "LessOrEqual": _pointwise(torch.le),
    "Greater": _pointwise(torch.gt),
    "GreaterOrEqual": _pointwise(torch.ge),
    "Not": _pointwise(torch.logical_not),
    "And": _pointwise(torch.logical_and),
    "Or": _pointwise(torch.logical_or),
    "Xor": _pointwise(torch.logical_xor),
    "Where": _pointwise(torch.where),
    "IsNaN": _pointwise(torch.isnan),
    "IsInf": _unary(lambda x, detect_negative, detect_positive: (torch.isneginf(x) & bool(detect_negative))
                    | (torch.isposinf(x) & bool(detect_positive)), detect_negative=1, detect_positive=1),

    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "Gemm": _gemm,
    "MatMul": _pointwise(torch.matmul),
    "Einsum": _einsum,

    "GlobalAveragePool": _pointwise(_global_pool(torch.mean)),
    "GlobalMaxPool": _pointwise(_global_pool(torch.amax)),
    "AveragePool": _average_pool,
    "MaxPool": _max_pool,
    **{op: _reduce(fn, since) for op, (fn, since) in _REDUCTIONS.items()},
    "ArgMax": _arg_reduce(torch.argmax),
    "ArgMin": _arg_reduce(torch.argmin),

    "BatchNormalization": _batch_norm,
    "InstanceNormalization": _instance_norm,
    "LayerNormalization": _layer_norm,

    "Identity": _pointwise(lambda x: x),
    "Dropout": _dropout,
    "Cast": _cast,
    "CastLike": _cast_like,
    "Reshape": _reshape,
    "Transpose": _transpose,
    "Flatten": _flatten,
    "Concat": _concat,
    "Split": _split,
    "Slice": _slice,
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Shape": _shape,
    "Size": _pointwise(lambda x: torch.tensor(x.numel(), dtype=torch.int64)),
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "Expand": _pointwise(_expand),
    "Tile": _pointwise(_tile),
    "Pad": _pad,
    "DepthToSpace": _depth_to_space,
    "SpaceToDepth": _space_to_depth,
    "CumSum": _cumsum,
    "Trilu": _trilu,
    "Resize": _resize,
    "Upsample": _resize,

    "Constant": _constant,
    "ConstantOfShape": _constant_of_shape,
    "Range": _pointwise(_range),
}

_MULTIPLE_OUTPUTS = {"Split"}
# ONNX Runtime's contrib ops its own tools write (qnn_preprocess_model: Erf's pattern -> Gelu)
_CONTRIB = {(MS_DOMAIN, "Gelu"): _pointwise(lambda x: F.gelu(x, approximate="none"))}
