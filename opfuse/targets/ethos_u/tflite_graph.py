"""The state of one Ethos-U lowering: the QDQ pairs read off, the ONNX tensors as TFLite tensors.

- :func:`read_qdq`: a QDQ model (as ONNX Runtime's ``quantize_static`` writes it) read as float
  nodes plus each tensor's quantisation: ``Q(T) -> DQ`` gives ``T`` the Q's scale and zero point,
  ``DQ(constant)`` is a constant that keeps its integers and scales. A float model reads as itself.
- :class:`Lowering`: the TFLite graph written so far, each ONNX tensor's :class:`Value` (tensor
  index, ONNX shape, layout: a rank-4 activation is NHWC, every other rank keeps ONNX's order),
  constants aligned to a layout, and the fused-activation decision (:meth:`Lowering.fused_activation`)
  against the target's table of epilogue kernels, each activation left unfused recorded with why.
- :class:`LoweringError`: the one-line refusal (node, op type, reason).
"""

from __future__ import annotations

__all__ = ["LoweringError", "Lowering", "Value", "QdqGraph", "read_qdq", "quantize_per_tensor",
           "NCHW_TO_NHWC", "ACTIVATION_BOUNDS"]

import dataclasses

import numpy as np
import onnx
from ai_edge_litert import schema_py_generated as schema
from onnx import numpy_helper

from opfuse.core.ops import ACTIVATION_OPS, OPS, proto_attr
from opfuse.quantization.qdq.layers import QDQ_OPS, QdqLayers
from opfuse.errors import BadInputError
from opfuse.targets.ethos_u.tflite_writer import Quant, TfliteWriter

_ACT = schema.ActivationFunctionType
_OP = schema.BuiltinOperator
# An activation op's TFLite name by its bounds (Clip's min, max); Relu is (0, None).
ACTIVATION_BOUNDS = {(0.0, None): _ACT.RELU, (0.0, 6.0): _ACT.RELU6, (-1.0, 1.0): _ACT.RELU_N1_TO_1}
NCHW_TO_NHWC = (0, 2, 3, 1)


class LoweringError(BadInputError):
    """An op the lowering cannot write as TFLite; str() is one line: node, op type, reason. A
    model the target cannot express is unsupported input: one line on stderr, exit 2."""

    def __init__(self, node: onnx.NodeProto | str | None, reason: str | None = None) -> None:
        if reason is None and isinstance(node, str):  # a message already made, re-raised with more said
            super().__init__(node)
            return
        where = f"node '{node.name or node.output[0]}' ({node.op_type}): " if node is not None else ""
        super().__init__(f"{where}{reason}".replace("\n", " "))


@dataclasses.dataclass
class Value:
    """An ONNX tensor as it lives in the TFLite graph: its tensor index, ONNX shape and layout."""

    index: int
    shape: tuple[int, ...]
    layout: tuple[int, ...]  # the ONNX axis at each TFLite position: NHWC is (0, 2, 3, 1)
    quant: Quant | None


@dataclasses.dataclass
class QdqGraph:
    """A model with its Q/DQ pairs read off: float nodes, constants and each tensor's quantisation."""

    nodes: list[onnx.NodeProto]
    constants: dict[str, np.ndarray]  # float values (a DQ'd weight: dequantised)
    quantised_constants: dict[str, tuple[np.ndarray, Quant]]  # a DQ'd constant's integers
    quant: dict[str, Quant]  # an activation tensor's quantisation (from its Q)
    inputs: list[str]
    outputs: list[str]
    output_names: dict[str, str]  # tensor -> the graph output name it is written as
    quantised: bool


def read_qdq(model: onnx.ModelProto) -> QdqGraph:
    """The graph with its QuantizeLinear/DequantizeLinear pairs read off (see the module docstring),
    by the quantisation's own QDQ index (:class:`opfuse.quantization.qdq.layers.QdqLayers`, without
    a float model): each Q/DQ's parameters and each dequantised constant come from it."""
    graph = model.graph
    index = QdqLayers(None, model)
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    constants.update({name: index.const(name) for name in index.constant_nodes})
    nodes = [node for node in graph.node if node.op_type != "Constant"]
    quantised = any(n.op_type in QDQ_OPS for n in nodes)
    alias: dict[str, str] = {}
    quant: dict[str, Quant] = {}
    qconsts: dict[str, tuple[np.ndarray, Quant]] = {}
    kept: list[onnx.NodeProto] = []
    for node in nodes:
        if node.op_type not in QDQ_OPS:
            kept.append(node)
            continue
        params = index.quantisation(node)
        if params is None:
            raise LoweringError(node, "its scale is not a constant")
        scale, zp, axis = params
        source = alias.get(node.input[0], node.input[0])
        if node.op_type == "QuantizeLinear":
            if source in constants:
                raise LoweringError(node, "a QuantizeLinear of a constant (expected the integers in the model)")
            if zp.dtype != np.int8:
                raise LoweringError(node, f"zero point of type {zp.dtype}, not int8 (TFLite's int8 conventions)")
            if scale.size != 1:
                raise LoweringError(node, "an activation quantised per channel "
                                          "(TFLite quantises activations per tensor)")
            q = Quant(scale.reshape(1), zp.reshape(1), 0)
            if source in quant and not np.array_equal(quant[source].scale, q.scale):
                raise LoweringError(node, f"tensor '{source}' is quantised twice with different scales")
            quant[source] = q
            alias[node.output[0]] = source
        elif source in constants and index.is_const(source):
            data = constants[source]
            real, _ = index.dequantised(node.output[0])
            constants[node.output[0]] = real.reshape(data.shape).astype(np.float32)
            ax = (axis + data.ndim) % data.ndim if scale.size > 1 else 0
            qconsts[node.output[0]] = (data, Quant(scale.reshape(-1), zp.reshape(-1), ax))
        elif source in constants:
            raise LoweringError(node, "a DequantizeLinear of a computed constant (expected an initializer)")
        else:
            alias[node.output[0]] = source
    for node in kept:
        for i, name in enumerate(node.input):
            if name in alias:
                node.input[i] = alias[name]
    _spread_through_moves(kept, constants, quant)
    outputs = [alias.get(o.name, o.name) for o in graph.output]
    output_names = {alias.get(o.name, o.name): o.name for o in graph.output}
    inputs = [i.name for i in graph.input if i.name not in constants]
    return QdqGraph(kept, constants, qconsts, quant, inputs, outputs, output_names, quantised)


def _spread_through_moves(nodes: list[onnx.NodeProto], constants: dict, quant: dict[str, Quant]) -> None:
    """A float tensor the quantiser left between an int8 tensor and an op that only moves values
    (the op table's ``int8="move"``: Slice, Concat, Reshape...) takes that tensor's quantisation:
    quantising before or after a move gives the same integers (ONNX Runtime leaves such chains
    float at a graph input: YOLOX's Slice/Concat "Focus"). Resize is left out (bilinear mixes)."""
    moves = [n for n in nodes if OPS.get(n.op_type) is not None and OPS[n.op_type].int8 == "move"
             and n.op_type != "Resize"]
    changed = True
    while changed:
        changed = False
        for node in moves:
            data = [i for i in (node.input if node.op_type == "Concat" else node.input[:1])
                    if i and i not in constants]
            known = [quant[t] for t in (*node.output, *data) if t in quant]
            if not known:
                continue
            for t in (*node.output, *data):
                if t and t not in quant:
                    quant[t] = known[0]
                    changed = True


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every tensor's static shape by onnx's inference (a graph output declared with a free or
    negative dim is inferred again)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for out in probe.graph.output:
        dims = out.type.tensor_type.shape.dim
        if not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            out.type.tensor_type.ClearField("shape")
    inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False, data_prop=True)
    shapes = {}
    for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            shapes[vi.name] = tuple(int(d.dim_value) for d in dims)
    return shapes


class Lowering:
    """The state of one lowering: the TFLite graph written so far and the ONNX tensors in it."""

    def __init__(self, model: onnx.ModelProto, refusals: list | None, fuse_activations: bool,
                 epilogues: dict[int, frozenset[int]]) -> None:
        self.model = model
        self.g = read_qdq(model)
        self.shapes = _shapes(model)
        self.w = TfliteWriter("opfuse ethos-u lowering")
        self.values: dict[str, Value] = {}
        self.refusals = refusals
        self.fuse_activations = fuse_activations
        self.epilogues = epilogues
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.g.nodes:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.absorbed: set[int] = set()  # ids of nodes written as a fused activation
        self.float_values: dict[str, Value] = {}  # an int8 tensor DEQUANTIZEd for a float island (tflite_islands)
        self.node: onnx.NodeProto | None = None

    # --- tensors ---------------------------------------------------------------------------
    @property
    def dtype(self):
        return np.int8 if self.g.quantised else np.float32

    def refuse(self, reason: str) -> LoweringError:
        return LoweringError(self.node, reason)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.g.constants:
            return tuple(self.g.constants[name].shape)
        if name not in self.shapes:
            raise self.refuse(f"the shape of '{name}' is not static (bind the dims first)")
        return self.shapes[name]

    def is_constant(self, name: str) -> bool:
        return name in self.g.constants

    def constant(self, name: str) -> np.ndarray:
        if name not in self.g.constants:
            raise self.refuse(f"input '{name}' must be a constant")
        return self.g.constants[name]

    def value(self, name: str) -> Value:
        if name in self.values:
            return self.values[name]
        if name in self.g.constants:
            raise self.refuse(f"input '{name}' is a constant where TFLite needs a tensor computed by the graph")
        raise self.refuse(f"input '{name}' is not computed before this node")

    def quant_of(self, name: str) -> Quant | None:
        if not self.g.quantised:
            return None
        if name not in self.g.quant:
            raise self.refuse(f"tensor '{name}' is not quantised (no QuantizeLinear after it): the int8 TFLite "
                              "has no float ops; quantise every op's output (or run it on the host CPU between "
                              "DEQUANTIZE and QUANTIZE: --vela float_ops=cpu)")
        return self.g.quant[name]

    def new_value(self, name: str, layout: tuple[int, ...] | None = None) -> Value:
        """The TFLite tensor of ONNX tensor ``name`` (NHWC when rank 4, unless ``layout`` is given:
        the ops that read every layout, :mod:`.tflite_attention`), in its quantisation."""
        shape = tuple(self.shape(name))
        if layout is None:
            layout = NCHW_TO_NHWC if len(shape) == 4 else tuple(range(len(shape)))
        quant = self.quant_of(name)
        index = self.w.tensor(self.g.output_names.get(name, name), [shape[a] for a in layout], self.dtype,
                              quant=quant)
        v = Value(index, shape, layout, quant)
        self.values[name] = v
        return v

    def temp(self, like: Value, name: str, shape=None, layout=None, quant="same") -> Value:
        """An intermediate tensor (not an ONNX tensor) in ``like``'s dtype."""
        shape = tuple(like.shape if shape is None else shape)
        layout = tuple(like.layout if layout is None else layout)
        q = like.quant if quant == "same" else quant
        index = self.w.tensor(name, [shape[a] for a in layout], self.dtype, quant=q)
        return Value(index, shape, layout, q)

    def int_tensor(self, name: str, data, dtype=np.int32) -> int:
        array = np.asarray(data, dtype=dtype)
        return self.w.tensor(name, array.shape, dtype, data=array)

    def const_operand(self, name: str, out_rank: int, layout: tuple[int, ...], squeeze: bool = True,
                      real: np.ndarray | None = None) -> Value:
        """A constant operand of an element-wise op, broadcast-aligned to the output's layout
        (``real``: a value computed from the constant, e.g. a divisor's reciprocal)."""
        computed = real is not None
        real = (self.constant(name) if real is None else real).astype(np.float32)
        qdata = None
        quant = None
        if self.g.quantised:
            if (not computed and name in self.g.quantised_constants
                    and self.g.quantised_constants[name][1].scale.size == 1):
                qdata, quant = self.g.quantised_constants[name]
            else:
                qdata, quant = quantize_per_tensor(real)
            quant = Quant(quant.scale.reshape(1), quant.zero_point.reshape(1), 0)
        arrays = [real] if qdata is None else [real, qdata]
        arrays = [_align(a, out_rank, layout, squeeze) for a in arrays]
        data = arrays[-1].astype(self.dtype)
        index = self.w.tensor(f"{name}/{'nhwc' if len(layout) == 4 else 'const'}", data.shape, self.dtype,
                              data=data, quant=quant)
        return Value(index, tuple(arrays[0].shape), tuple(range(arrays[0].ndim)), quant)

    def record(self, node: onnx.NodeProto, reason: str) -> None:
        if self.refusals is not None:
            self.refusals.append({"node": node.name or node.output[0], "op": node.op_type, "reason": reason})

    # --- fused activations ------------------------------------------------------------------
    def activation_of(self, node: onnx.NodeProto) -> int | None:
        """The TFLite activation a Relu or Clip node is, None when it is neither (or other bounds)."""
        if node.op_type == "Relu":
            return _ACT.RELU
        if node.op_type != "Clip":
            return None
        lo, hi = proto_attr(node, "min"), proto_attr(node, "max")
        if len(node.input) > 1 and node.input[1]:
            lo = float(self.g.constants[node.input[1]]) if node.input[1] in self.g.constants else "?"
        if len(node.input) > 2 and node.input[2]:
            hi = float(self.g.constants[node.input[2]]) if node.input[2] in self.g.constants else "?"
        return ACTIVATION_BOUNDS.get((None if lo is None else lo, None if hi is None else hi))

    def fused_activation(self, builtin: int, output: str) -> tuple[int, str]:
        """The activation to fuse into ``builtin`` writing ``output``: (code, tensor it writes)."""
        users = self.consumers.get(output, [])
        acts = [u for u in users if u.op_type in ACTIVATION_OPS]
        if not acts:
            return _ACT.NONE, output
        act_node = acts[0]
        code = self.activation_of(act_node)
        reason = None
        if not self.fuse_activations:
            reason = "activations are not fused in this lowering (fuse_activations=False)"
        elif code is None:
            reason = "TFLite fuses only RELU, RELU6 and RELU_N1_TO_1 (Relu, Clip(0, 6), Clip(-1, 1))"
        elif len(users) > 1:
            reason = f"its producer's output '{output}' has {len(users)} consumers"
        elif output in self.g.output_names:
            reason = f"its producer's output '{output}' is a graph output"
        elif code not in self.epilogues.get(builtin, ()):
            reason = f"{_name(builtin)} runs no fused {_act_name(code)}"
        if reason is not None:
            for a in acts:
                self.record(a, f"left a separate op: {reason}")
            return _ACT.NONE, output
        self.absorbed.add(id(act_node))
        return code, act_node.output[0]



def quantize_per_tensor(real: np.ndarray) -> tuple[np.ndarray, Quant]:
    """A constant the QDQ model left float, quantised symmetric per tensor to int8."""
    peak = float(np.max(np.abs(real))) if real.size else 0.0
    scale = peak / 127.0 if peak > 0 else 1.0
    q = np.clip(np.round(real / scale), -127, 127).astype(np.int8)
    return q, Quant(np.array([scale]), np.array([0], np.int64), 0)


def _align(array: np.ndarray, rank: int, layout: tuple[int, ...], squeeze: bool) -> np.ndarray:
    """A broadcast operand aligned to an output of ``rank`` stored in ``layout``, leading 1s dropped."""
    a = np.asarray(array)
    if a.ndim < rank:
        a = a.reshape((1,) * (rank - a.ndim) + a.shape)
    a = np.transpose(a, layout)
    if squeeze:
        while a.ndim > 1 and a.shape[0] == 1:
            a = a[0]
    return np.ascontiguousarray(a)


def _name(builtin: int) -> str:
    return next(k for k, v in vars(_OP).items() if v == builtin and not k.startswith("_"))


def _act_name(code: int) -> str:
    return next(k for k, v in vars(_ACT).items() if v == code and not k.startswith("_"))
