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

The inference decides *which* values are static; ONNX's reference implementation of each
op (``onnx.reference.ops``, what onnxscript's folder evaluates with) decides *what* they
are (:func:`_evaluated`): the chain is evaluated from the dims the Shape and Size nodes
read (as the inference gives them), twice, with every symbol in them bound to a different
number each time. A value is written only when the two evaluations agree (it does not
follow a symbol), and it is the evaluated value that is written. The inference's own
arithmetic carries its values flat, whatever their rank: it slices a [4, 2] tensor as 8
elements, so torch's ``F.pad`` pads (``Reshape[-1, 2] -> Slice(step -1) -> Transpose ->
Reshape[-1]``) came out on the other side (open_nsfw's ``/Pad_1``); where it and the
evaluation differ, the record says so. A value the inference knows that the evaluation
does not confirm is a refusal, with its reason.

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

__all__ = ["fold_shape_values", "has_shape_reads", "standing"]

import logging

import numpy as np
import onnx
import onnx.reference.ops
import onnx_ir as ir

from opfuse.core.analysis import NameTable, _inference_proto, node_label, opset_of
from opfuse.report import FusionRecord, Refusal
from opfuse.core.symbolic_shapes import run_tool
from opfuse.core.ops import MS_DOMAIN, ONNX_DOMAINS, int_attr, is_onnx, is_op, op_info

logger = logging.getLogger(__name__)

PATTERN = "shape arithmetic->constant"
EVALUATED_LIMIT = 1 << 16  # elements of a value the check evaluates (shape tensors are small)


def has_shape_reads(graph: ir.Graph) -> bool:
    """Whether the graph reads a tensor's shape (the only source of these chains)."""
    return any(info is not None and info.metadata_only for info in map(op_info, graph))


def fold_shape_values(model: ir.Model) -> tuple[list[FusionRecord], list[tuple[ir.Node, int, Refusal]]]:
    """Replace static shape values in the main graph by constants (module docstring);
    the records of the consumers that now read a constant, and (consumer, input index,
    refusal) for those whose value the inference knew but the evaluation did not confirm
    (:func:`standing` keeps the ones still true after later folding)."""
    if not has_shape_reads(model.graph):
        return [], []
    tool = run_tool(_with_shape_twins(_inference_proto(model)), auto_merge=True)
    if tool is None or _assumed(tool):
        return [], []
    known = _known_values(model.graph, tool)
    opset = opset_of(model.opset_imports)
    evaluations = [_evaluated(model.graph, tool, opset, numbers) for numbers in _bindings(model.graph, tool)]
    confirmed = {key: _confirmed(array, [e.get(key) for e in evaluations]) for key, array in known.items()}
    names = NameTable(model)
    records, refusals = [], []
    outputs = {id(v) for v in model.graph.outputs}
    for node in list(model.graph):
        for index, value in enumerate(node.inputs):
            if value is None or id(value) in outputs or confirmed.get(id(node.outputs[0])) is not None:
                continue  # (a value read only inside the chain: its reader folds too)
            array = confirmed.get(id(value))
            if array is None and id(value) in known:
                if id(node.outputs[0]) in known:
                    continue  # inside the chain: its end's reader has the refusal
                refusals.append((node, index, Refusal(PATTERN, node_label(node), (
                    f"input {index} ('{value.name}') stays computed: ONNX Runtime's symbolic shape inference "
                    f"gives it {known[id(value)].reshape(-1).tolist()}, which evaluating its chain with ONNX's "
                    f"reference ops at two sizes of the symbolic dims does not confirm "
                    f"({_evaluated_text(value, evaluations)})"))))
                continue
            if array is None and is_op(node, "Reshape") and index == 1 and int_attr(node, "allowzero", 0) == 0:
                array = _open_target(node, tool, [e.get(id(value)) for e in evaluations])
            if array is None:
                continue
            constant = ir.Value(name=names.fresh(f"{value.name}.value"), shape=ir.Shape(array.shape),
                                type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                                const_value=ir.tensor(array))
            model.graph.register_initializer(constant)
            source = value.producer()
            node.replace_input_with(index, constant)
            inferred = known.get(id(value))
            differs = inferred is not None and not np.array_equal(inferred, array)
            records.append(FusionRecord(
                pattern=PATTERN, node=node_label(node), removed=(node_label(source),) if source else (),
                produced=f"{node.op_type} input {index} = {array.reshape(-1).tolist()}", graph="main",
                detail="the shape arithmetic before it reads static dims (ONNX Runtime's symbolic shape "
                       "inference, no dims assumed equal; evaluated by ONNX's reference ops)"
                       + ("; -1: the one dim it leaves open" if (array == -1).any() else "")
                       + (f"; the inference's own arithmetic gave {inferred.reshape(-1).tolist()}" if differs else ""),
                output=node.outputs[0].name or ""))
    return records, refusals


def standing(declined: list[tuple[ir.Node, int, Refusal]], graph: ir.Graph) -> list[Refusal]:
    """The refusals of :func:`fold_shape_values` whose input is still computed in ``graph``
    (constant folding may have evaluated the chain since, from a part that was confirmed)."""
    out = []
    for node, index, refusal in declined:
        value = node.inputs[index] if node.graph is graph and index < len(node.inputs) else None
        if value is not None and value.const_value is None and not is_op(value.producer(), "Constant"):
            out.append(refusal)
    return out


def _confirmed(inferred: np.ndarray, evaluated: list[np.ndarray | None]) -> np.ndarray | None:
    """The evaluated value (in the inferred value's dtype) when every evaluation gave one
    and they agree with each other; else None."""
    if not evaluated or any(e is None or e.shape != inferred.shape for e in evaluated):
        return None
    if any(not np.array_equal(e, evaluated[0]) for e in evaluated[1:]):
        return None
    return evaluated[0].astype(inferred.dtype)


def _evaluated_text(value: ir.Value, evaluations: list[dict[int, np.ndarray]]) -> str:
    got = [e.get(id(value)) for e in evaluations]
    if any(g is None for g in got):
        return "the evaluation did not reach it"
    return "it gives " + " and ".join(str(g.reshape(-1).tolist()) for g in got)


def _reads_dims(node: ir.Node) -> bool:
    """A node that reads only its input's dims (Shape, Size: the op table's metadata_only)."""
    info = op_info(node)
    return is_onnx(node) and info is not None and info.metadata_only


def _bindings(graph: ir.Graph, tool) -> list[dict[str, int]]:
    """Two bindings of the symbols in the dims the graph's Shape and Size nodes read, each
    symbol to a different number in each (none 0 or 1, no two symbols equal in one)."""
    symbols = set()
    for node in graph:
        if _reads_dims(node):
            data = tool.sympy_data_.get(node.outputs[0].name)
            for element in (data if isinstance(data, (list, tuple)) else [data]):
                symbols |= {s.name for s in getattr(element, "free_symbols", ())}
    ordered = sorted(symbols)
    return [{name: 3 + 2 * i for i, name in enumerate(ordered)}, {name: 4 + 3 * i for i, name in enumerate(ordered)}]


def _evaluated(graph: ir.Graph, tool, opset: int, numbers: dict[str, int]) -> dict[int, np.ndarray]:
    """id(value) -> its value evaluated by ONNX's reference ops, for the outputs of the
    default-domain nodes the inference has a value for, from the dims Shape and Size read
    (the inference's, each symbol bound to ``numbers``), constants and initializers.

    A node with an input not reached, a subgraph, an op the reference does not have, or a
    failure is not evaluated (nor, then, what follows it); values above
    :data:`EVALUATED_LIMIT` elements are not kept.
    """
    out: dict[int, np.ndarray] = {}

    def read(value: ir.Value | None):
        if value is None:
            return None
        if id(value) in out:
            return out[id(value)]
        if value.const_value is not None and value.const_value.size <= EVALUATED_LIMIT:
            return value.const_value.numpy()
        return _MISSING

    for node in graph:
        if not is_onnx(node) or not any(v.name in tool.sympy_data_ for v in node.outputs):
            continue
        if _reads_dims(node):
            bound = _bound(tool.sympy_data_.get(node.outputs[0].name), numbers)
            if bound is not None:
                out[id(node.outputs[0])] = bound
            continue
        if node.op_type == "Constant":  # (a weight written as a Constant: not read, not copied)
            attribute = node.attributes.get("value")
            if attribute is not None and attribute.type == ir.AttributeType.TENSOR:
                if attribute.value.size <= EVALUATED_LIMIT:
                    out[id(node.outputs[0])] = attribute.value.numpy()
                continue
        inputs = [read(v) for v in node.inputs]
        if any(i is _MISSING for i in inputs) or any(a.type in _GRAPH_ATTRIBUTES for a in node.attributes.values()):
            continue
        results = _run_op(node, opset, inputs)
        for value, result in zip(node.outputs, results or ()):
            if result is not None and np.size(result) <= EVALUATED_LIMIT:
                out[id(value)] = np.asarray(result)
    return out


_MISSING = object()
_GRAPH_ATTRIBUTES = (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)


def _run_op(node: ir.Node, opset: int, inputs: list) -> list | None:
    """The node's outputs by ONNX's reference implementation of its op (as onnxscript's
    folder calls it), or None when there is none or it fails."""
    try:
        implementation = onnx.reference.ops.load_op("", node.op_type, opset)
        attributes = {name: ir.serde.serialize_tensor(a.value) if a.type == ir.AttributeType.TENSOR else a.value
                      for name, a in node.attributes.items()}
        results = implementation.eval(*inputs, **attributes)
    except Exception as e:  # noqa: BLE001 - the reference raises many kinds; the value stays unconfirmed
        logger.debug("shape values: %s not evaluated: %s", node_label(node), e)
        return None
    return list(results) if isinstance(results, (tuple, list)) else [results]


def _bound(data, numbers: dict[str, int]) -> np.ndarray | None:
    """The inference's value of a Shape or Size output with each symbol bound to its number."""
    if data is None:
        return None
    elements = data if isinstance(data, (list, tuple)) else [data]
    ints = []
    for element in elements:
        if isinstance(element, (int, np.integer)) and not isinstance(element, (bool, np.bool_)):
            ints.append(int(element))
            continue
        symbols = getattr(element, "free_symbols", None)
        if symbols is None or any(s.name not in numbers for s in symbols):
            return None
        value = element.subs({s: numbers[s.name] for s in symbols})
        if not getattr(value, "is_Integer", False):
            return None
        ints.append(int(value))
    array = np.array(ints, dtype=np.int64)
    return array if isinstance(data, (list, tuple)) else array.reshape(())


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


def _open_target(node: ir.Node, tool, evaluated: list[np.ndarray | None]) -> np.ndarray | None:
    """A Reshape target known but for one element -> that target with -1 there.

    An element is known when the inference gives it an integer and its evaluations
    (``evaluated``: at two sizes of the symbolic dims) agree on it (their number is
    written), or when it is open (a symbol, or -1) and the inferred output dim at its
    position is static; one open element may stay.
    """
    data = tool.sympy_data_.get(node.inputs[1].name)
    info = tool.known_vi_.get(node.outputs[0].name)
    if not isinstance(data, (list, tuple)) or not data:
        return None
    if any(e is None or e.shape != (len(data),) for e in evaluated) or not evaluated:
        return None
    dims = _dims(info, tool)
    ints = [_integer(e) for e in data]
    for i, v in enumerate(ints):
        if v is not None and len({int(e[i]) for e in evaluated}) == 1:
            ints[i] = int(evaluated[0][i])
        elif v is not None:
            return None  # the inference's integer follows a symbol
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
