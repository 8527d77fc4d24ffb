"""Shape arithmetic on static dims -> constants (a step of clean-up, before constant folding).

Exporters compute shapes at run time even where the dims read are static::

    Shape(t) -> Gather(0) -> Unsqueeze -> Concat([.., 256]) -> ConstantOfShape   (an LSTM's h0)
    Shape(t) -> Gather(1) -> Mul(Gather(2)) -> Unsqueeze -> Concat -> Reshape    (CRNN: C*H)

onnxscript's folder (clean-up's step 1) does not fold these: it reads a dim off a shape
only for a Gather with 1-D indices (exporters write a scalar index), and has no
evaluator that carries a shape value through Unsqueeze, Slice or arithmetic. ONNX
Runtime's symbolic shape inference (``symbolic_shape_infer``, sympy-based) does: it keeps
the *value* of every shape tensor it follows (Shape, Size, Gather, Slice, Unsqueeze,
Squeeze, Concat, Cast, Add/Sub/Mul/Div, Range, ...), with a symbol for each dim that is
not static. This step reads those values:

1. A tensor whose value is known in full (every element an integer) and that is computed
   by a default-domain node becomes an int constant (an initializer) for every reader
   outside the chain; the chain then has no reader and goes (dead-code removal), and its
   readers (ConstantOfShape, Expand, Range, Reshape...) see a constant, which constant
   folding evaluates where small.
2. A Reshape target whose value is known except for one element (a symbolic dim) becomes
   a constant with -1 there: Reshape computes that element from the input's size, and it
   is the only element the target leaves open, so it is the same number (when the other
   elements multiply to a non-zero number and none is already -1 or 0; ``allowzero`` 0).
3. Symbolic dims stay symbolic; a value with a symbol in it is never a constant (but 2).

Ops the inference does not know stop it (it gives up at the first output it cannot
shape); the few that have a standard twin with the same shape rule are shown to it as
that twin (:data:`SHAPE_TWINS`: ConvInteger as Conv, ONNX Runtime's DynamicQuantizeLSTM
as LSTM), in the private copy it reads.

Legality: an integer in a value is read off a static dim or computed from such. The
inference runs with auto-merge (without it, it stops at the first node it cannot infer
in full, such as a ConvInteger), which assumes two dims equal where an op meets them;
its values are not used at all when it assumed a dim that follows the model's inputs
equal to a number (where a broadcast meets it, it may be 1 at run time) or two of the
inputs' own dims equal (:func:`_assumed`). Dims it made up for an op it does not know,
merged with the number the next op needs, are the op's own (a ConvInteger's channels). Graph outputs
keep their producers; subgraphs are left alone. The inference is best effort: a model it
cannot infer folds nothing here. Each consumer that now reads a constant is a record,
compared by verification at its own tensor like every rewrite.
"""

from __future__ import annotations

__all__ = ["fold_shape_values", "has_shape_reads"]

import numpy as np
import onnx
import onnx_ir as ir

from opfuse.analyse import NameTable, _inference_proto, node_label
from opfuse.report import FusionRecord
from opfuse.symbolic_shapes import run_tool
from opfuse.vocabulary import MS_DOMAIN, ONNX_DOMAINS, int_attr, is_onnx, is_op, op_info

PATTERN = "shape arithmetic->constant"


def has_shape_reads(graph: ir.Graph) -> bool:
    """Whether the graph reads a tensor's shape (the only source of these chains)."""
    return any(info is not None and info.metadata_only for info in map(op_info, graph))


def fold_shape_values(model: ir.Model) -> list[FusionRecord]:
    """Replace static shape values in the main graph by constants (module docstring);
    the records of the consumers that now read a constant."""
    if not has_shape_reads(model.graph):
        return []
    tool = run_tool(_with_shape_twins(_inference_proto(model)), auto_merge=True)
    if tool is None or _assumed(tool):
        return []
    known = _known_values(model.graph, tool)
    names = NameTable(model)
    records = []
    outputs = {id(v) for v in model.graph.outputs}
    for node in list(model.graph):
        for index, value in enumerate(node.inputs):
            if value is None or id(value) in outputs:
                continue
            array = known.get(id(value))
            if array is None and is_op(node, "Reshape") and index == 1 and int_attr(node, "allowzero", 0) == 0:
                array = _open_target(node, tool)
            if array is None or id(node.outputs[0]) in known:
                continue  # not known, or read only inside the chain (its reader folds too)
            constant = ir.Value(name=names.fresh(f"{value.name}.value"), shape=ir.Shape(array.shape),
                                type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                                const_value=ir.tensor(array))
            model.graph.register_initializer(constant)
            source = value.producer()
            node.replace_input_with(index, constant)
            records.append(FusionRecord(
                pattern=PATTERN, node=node_label(node), removed=(node_label(source),) if source else (),
                produced=f"{node.op_type} input {index} = {array.reshape(-1).tolist()}", graph="main",
                detail="the shape arithmetic before it reads static dims (ONNX Runtime's symbolic shape "
                       "inference, no dims assumed equal)" + ("; -1: the one dim it leaves open"
                                                             if (array == -1).any() else ""),
                output=node.outputs[0].name or ""))
    return records


# ops the inference does not know -> (the op with the same output shape rule, its inputs
# that rule reads): an integer conv is shaped like a conv, ONNX Runtime's dynamically
# quantised LSTM like an LSTM (its hidden_size attribute sets the width; the weights, stored
# transposed, are not read when it is set)
SHAPE_TWINS = {
    ("", "ConvInteger"): ("Conv", 2),
    (MS_DOMAIN, "DynamicQuantizeLSTM"): ("LSTM", 8),
}


def _with_shape_twins(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` (a private copy) with each op of :data:`SHAPE_TWINS` as its twin, for the
    inference only."""
    for node in proto.graph.node:
        twin = SHAPE_TWINS.get(("" if node.domain in ONNX_DOMAINS else node.domain, node.op_type))
        if twin is None or (twin[0] == "LSTM" and not any(a.name == "hidden_size" for a in node.attribute)):
            continue
        node.op_type, node.domain = twin[0], ""
        del node.input[twin[1]:]
    return proto


def _assumed(tool) -> str | None:
    """The assumption that makes the inference's integers unsafe, if it made one: a dim
    that follows the model's inputs merged with a number (where a broadcast meets it, it
    may be 1 at run time), or two of the inputs' own dims merged."""
    inputs = set(tool.input_symbols_)
    for key, target in tool.suggested_merge_.items():
        expression = tool.symbolic_dims_.get(key)
        follows = {str(s) for s in getattr(expression, "free_symbols", ())} & inputs or ({key} & inputs)
        if follows and (isinstance(target, int) or str(target).lstrip("-").isdigit()):
            return f"{key} = {target}"
        if key in inputs and str(target) in inputs:
            return f"{key} = {target}"
    return None


def _known_values(graph: ir.Graph, tool) -> dict[int, np.ndarray]:
    """id(value) -> its value, for the outputs of default-domain nodes the inference knows
    in full (integers of the value's own integer dtype, rank 0 or 1)."""
    out = {}
    for node in graph:
        if not is_onnx(node) or is_op(node, "Constant"):
            continue
        for value in node.outputs:
            data = tool.sympy_data_.get(value.name)
            info = tool.known_vi_.get(value.name)
            if data is None or info is None or not info.type.HasField("tensor_type"):
                continue
            array = _as_array(data, info.type.tensor_type)
            if array is not None:
                out[id(value)] = array
    return out


def _integer(element) -> int | None:
    """``element`` as an int when it is an integer (a Python, numpy or sympy one, or a
    sympy expression that cancels to one: the inference writes the size Reshape infers
    for a -1 as ``floor((1024*a + 1024)/(a + 1))``, which is 1024 for every ``a >= 0``)."""
    if isinstance(element, (bool, np.bool_)):
        return None
    if isinstance(element, (int, np.integer)):
        return int(element)
    if getattr(element, "is_Integer", False):
        return int(element)
    if getattr(element, "free_symbols", None):
        simpler = _cancelled(element)
        if simpler is not None and getattr(simpler, "is_Integer", False):
            return int(simpler)
    return None


def _cancelled(expression):
    """``expression`` with every floor / ceiling argument, and the whole, reduced by sympy's
    ``cancel`` (common factors of a ratio of polynomials); None when sympy cannot."""
    import sympy  # (the inference imported it already)

    try:
        rounded = expression.replace(lambda e: e.func in (sympy.floor, sympy.ceiling),
                                     lambda e: e.func(sympy.cancel(e.args[0])))
        return sympy.cancel(rounded)
    except Exception:  # noqa: BLE001 - sympy raises many kinds; the value stays unknown
        return None


def _as_array(data, tensor_type) -> np.ndarray | None:
    elem = tensor_type.elem_type
    if elem not in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
        return None
    rank = len(tensor_type.shape.dim) if tensor_type.HasField("shape") else None
    elements = list(np.asarray(data, dtype=object).reshape(-1)) if isinstance(data, (list, tuple, np.ndarray)) else [data]
    ints = [_integer(e) for e in elements]
    if any(i is None for i in ints):
        return None
    is_scalar = not isinstance(data, (list, tuple)) and np.ndim(data) == 0
    if rank == 0 and is_scalar:
        return np.array(ints[0], dtype=onnx.helper.tensor_dtype_to_np_dtype(elem))
    if rank == 1 and not is_scalar and len(tensor_type.shape.dim) == 1:
        dim = tensor_type.shape.dim[0]
        if dim.HasField("dim_value") and dim.dim_value != len(ints):
            return None
        return np.array(ints, dtype=onnx.helper.tensor_dtype_to_np_dtype(elem))
    return None


def _open_target(node: ir.Node, tool) -> np.ndarray | None:
    """A Reshape target known but for one element -> that target with -1 there.

    An element is known when its value is an integer, or when it is open (a symbol, or
    -1) and the inferred output dim at its position is static; one open element may stay.
    """
    data = tool.sympy_data_.get(node.inputs[1].name)
    info = tool.known_vi_.get(node.outputs[0].name)
    if not isinstance(data, (list, tuple)) or not data:
        return None
    dims = _dims(info, tool)
    ints = [_integer(e) for e in data]
    for i, v in enumerate(ints):
        if (v is None or v == -1) and dims is not None and len(dims) == len(ints) and dims[i] is not None:
            ints[i] = dims[i]
    open_ = [i for i, v in enumerate(ints) if v is None or v == -1]
    if len(open_) != 1 or any(v is not None and v == 0 or (v is not None and v < -1) for v in ints):
        return None
    ints[open_[0]] = -1
    return np.array(ints, dtype=np.int64)


def _dims(info, tool) -> list[int | None] | None:
    """The static dims of an inferred value (None where a dim is symbolic)."""
    if info is None or not info.type.HasField("tensor_type") or not info.type.tensor_type.HasField("shape"):
        return None
    out = []
    for d in info.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        else:
            expression = tool.symbolic_dims_.get(d.dim_param) if d.dim_param else None
            out.append(_integer(expression) if expression is not None else None)
    return out
