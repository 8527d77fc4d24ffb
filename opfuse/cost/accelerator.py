"""An accelerator cost model: roofline plus launch overhead per kernel, with buffer spills.

These are **predictions of a model, not measurements**. A hardware profile
(``opfuse/cost/hardware/*.toml``, :mod:`opfuse.cost.profiles`) gives DRAM bandwidth, on-chip buffer
size, peak compute per dtype and per-kernel launch overhead; the model turns a
configuration's graph into one latency per kernel:

    bytes_k  = what the kernel reads and writes (the rule of :mod:`opfuse.cost.traffic`),
               costed at the profile's ``execution_dtype`` when it sets one (an NPU runs a
               float32 model in float16: every float tensor costs 2 bytes an element)
    flops_k  = 2 * MACs for Conv / Gemm / MatMul, window x outputs for pooling, inputs for
               global pooling, 2 per element for BatchNormalization, 1 per output element
               otherwise, plus 1 per output element for each step of a fused epilogue
    ws_k     = working set: one tile of every activation input + all weights (they stay
               resident, so each is read once) + one output tile; a tile is ``tile_rows``
               rows (axis 2 of an N,C,H,... tensor, axis 0 of a matrix) of one image,
               and for a windowed op (Conv, pooling) the input rows its window needs
    spill_k  = 0 when ws_k fits the on-chip buffer, otherwise
                 (ws_k - buffer) x (tiles_k - 1)   the part that does not fit, fetched again
                                                   for every further tile
               + 2 x output bytes x epilogue steps a fused kernel that spills also loses what
                                                   fusion was for: each intermediate goes
                                                   to DRAM and back, as if unfused
               Spilled bytes move at ``spill_efficiency`` x bandwidth (scattered evictions and
               refills, not streaming bursts), which is why a fused kernel that spills can
               be slower than the unfused sequence it replaced (the chapter's warning).
    t_k      = max(flops_k / peak[dtype], bytes_k / bandwidth + spill_k / (spill_efficiency
               x bandwidth)) + launch
    latency  = sum of t_k (kernels run one after another); bandwidth = DRAM bytes / latency

int8: a quantised (QDQ) graph is read as a chip that runs int8 natively runs it
(:mod:`opfuse.cost.int8`): each Conv / Gemm / Add / pooling between DQ and Q nodes is
one int8 kernel moving 1-byte activations and weights and int32 biases, computing at the
profile's ``int8`` peak; Q/DQ nodes cost nothing except where they convert to and from
float around an op that runs in float (an unfolded BatchNormalization: three kernels and
a float round trip instead of none).

Every term is non-increasing in bandwidth, buffer size, spill efficiency and peak compute
and non-decreasing in launch overhead, so a better chip is never predicted slower (tests check this).

:func:`fusion_veto` is the hook of ``opfuse optimize --hardware PROFILE``: a fused kernel
whose working set does not fit the buffer, and which the model therefore predicts slower
than the unfused sequence it replaces, is declined, with the sizes and times as the reason.
(A fusion that spills but still wins, because the unfused conv would spill anyway, stays.)

A kernel is the traffic rule's own record (:class:`opfuse.cost.traffic.Kernel`: one record for
what a node moves and what it launches); fused kernels are read through
:func:`opfuse.targets.kernels.read_kernel` when the traffic is analysed (each target declares its
kernels' encoding), and every op fact (weights, window, global reduction)
comes from the op table (:data:`opfuse.core.ops.OPS`); the chapter's modelled "Conv+ReLU" row lives with the
benchmark that reproduces the chapter (:mod:`opfuse.bench.chapter`).
"""


__all__ = [
    "HardwareProfile",
    "KernelCost",
    "Prediction",
    "load_profile",
    "list_profiles",
    "kernels_of",
    "predict",
    "cost_kernel",
    "working_set",
    "fusion_veto",
]

import dataclasses
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import onnx
import onnx_ir as ir

from opfuse.cost.int8 import int8_traffic, is_qdq
from opfuse.cost.profiles import HardwareProfile, list_profiles, load_profile
from opfuse.cost.traffic import Kernel, TensorInfo, Traffic, static_shape, tensor_info
from opfuse.core.ops import OPS, WEIGHTED_OPS, OpKind, plain_attributes
MIB = 1024 * 1024


# -- kernels -----------------------------------------------------------------------------

def kernels_of(traffic: Traffic) -> list[Kernel]:
    """The kernels a configuration's graph launches: its traffic's nodes (Constant nodes launch nothing).

    A quantised (QDQ) graph is read as an int8 accelerator runs it
    (:func:`opfuse.cost.int8.int8_traffic`): Q/DQ folded into int8 kernels.
    """
    if is_qdq(traffic) and not any(n.precision for n in traffic.nodes):
        traffic = int8_traffic(traffic)
    return traffic.kernels


# -- the model ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class KernelCost:
    """The prediction for one kernel."""

    name: str
    label: str
    layer: str
    flops: int
    bytes: int  # DRAM bytes without spills
    spill_bytes: int
    working_set: int
    tiles: int
    compute_s: float
    memory_s: float
    launch_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.launch_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def spills(self) -> bool:
        return self.spill_bytes > 0


@dataclasses.dataclass
class Prediction:
    """A configuration's predicted latency on one profile (a model's prediction)."""

    profile: str
    kernels: list[KernelCost]
    unknown: list[str] = dataclasses.field(default_factory=list)  # kernels with unknown sizes

    @property
    def latency_s(self) -> float:
        return sum(k.time_s for k in self.kernels)

    @property
    def traffic_bytes(self) -> int:
        """DRAM bytes including spills."""
        return sum(k.bytes + k.spill_bytes for k in self.kernels)

    @property
    def spill_bytes(self) -> int:
        return sum(k.spill_bytes for k in self.kernels)

    @property
    def spilling(self) -> list[KernelCost]:
        return [k for k in self.kernels if k.spills]

    @property
    def bandwidth_gbps(self) -> float:
        lat = self.latency_s
        return self.traffic_bytes / lat / 1e9 if lat > 0 else 0.0

    @property
    def launch_s(self) -> float:
        return sum(k.launch_s for k in self.kernels)

    def per_layer(self) -> OrderedDict[str, float]:
        """layer -> predicted seconds."""
        out: OrderedDict[str, float] = OrderedDict()
        for k in self.kernels:
            out[k.layer] = out.get(k.layer, 0.0) + k.time_s
        return out

    def to_dict(self, per_kernel: bool = False) -> dict[str, Any]:
        data = {
            "profile": self.profile,
            "latency_ms": self.latency_s * 1e3,
            "kernels": len(self.kernels),
            "traffic_bytes": self.traffic_bytes,
            "spill_bytes": self.spill_bytes,
            "spilling_kernels": [k.name for k in self.spilling],
            "bandwidth_gbps": self.bandwidth_gbps,
            "launch_ms": self.launch_s * 1e3,
            "compute_bound_kernels": sum(k.bound == "compute" for k in self.kernels),
            "unknown": list(self.unknown),
        }
        if per_kernel:
            data["per_kernel"] = [
                {**dataclasses.asdict(k), "time_s": k.time_s, "bound": k.bound} for k in self.kernels
            ]
        return data


def predict(source: Traffic | Sequence[Kernel], profile: HardwareProfile | str) -> Prediction:
    """Predicted latency of a configuration (its Traffic, or kernels) on ``profile``."""
    profile = load_profile(profile)
    kernels = kernels_of(source) if isinstance(source, Traffic) else list(source)
    costs, unknown = [], []
    for k in kernels:
        if any(t is not None and (t.shape is None or t.bits is None) for t in (*k.inputs, *k.outputs)):
            unknown.append(k.name)
        costs.append(cost_kernel(k, profile))
    return Prediction(profile.name, costs, unknown)


def cost_kernel(k: Kernel, profile: HardwareProfile) -> KernelCost:
    moved = sum(profile.nbytes(t) for t in k.inputs if t is not None)
    moved += sum(profile.nbytes(t) for t in k.outputs)
    ws, tiles, _ = working_set(k, profile)
    spill = 0
    if ws > profile.buffer_bytes:
        spill = int(math.ceil((ws - profile.buffer_bytes) * (tiles - 1)))
        if k.epilogue and k.outputs:
            spill += 2 * profile.nbytes(k.outputs[0]) * len(k.epilogue)
    dtype = k.precision or (k.outputs[0].dtype if k.outputs else None)
    flops = kernel_flops(k)
    return KernelCost(
        name=k.name,
        label=k.label,
        layer=k.layer,
        flops=flops,
        bytes=moved,
        spill_bytes=spill,
        working_set=int(ws),
        tiles=tiles,
        compute_s=flops / profile.peak(dtype),
        memory_s=moved / profile.bandwidth + spill / (profile.bandwidth * profile.spill_efficiency),
        launch_s=profile.launch_s,
    )


def kernel_flops(k: Kernel) -> int:
    """Floating-point operations of one kernel (see the module docstring), by the main op's
    row of the op table: multiply-adds for a weighted layer, the window for windowed ops,
    the input for global ones."""
    out = k.outputs[0] if k.outputs else None
    out_elems = out.elements if out is not None and out.shape is not None else 0
    x = k.inputs[0] if k.inputs else None
    w = k.inputs[1] if len(k.inputs) > 1 else None
    info = k.info
    spec = info.weights if info is not None else None
    flops = out_elems
    if spec is not None and spec.layout == "iohw":  # each input element scatters over the weights
        if w is not None and w.shape is not None and x is not None and x.shape:
            flops = 2 * math.prod(x.shape) * math.prod(w.shape[1:])
    elif spec is not None and spec.layout == "oihw":  # Conv
        if w is not None and w.shape is not None:
            flops = 2 * out_elems * math.prod(w.shape[1:])
    elif spec is not None and x is not None and x.shape:  # Gemm, MatMul: the depth of x
        transposed = not spec.batched and k.attributes.get("transA", 0)
        if spec.batched or len(x.shape) == 2:
            flops = 2 * out_elems * (x.shape[0] if transposed else x.shape[-1])
    elif _footprint(k) == "window":
        flops = out_elems * math.prod(k.attributes.get("kernel_shape", [1]))
    elif _footprint(k) == "global" and x is not None and x.shape is not None:
        flops = math.prod(x.shape)
    elif k.op == "BatchNormalization":
        flops = 2 * out_elems
    if (spec is not None and spec.layout != "iohw" and spec.bias is not None and len(k.inputs) > spec.bias
            and k.inputs[spec.bias] is not None):
        flops += out_elems  # the bias add (Conv, Gemm)
    return int(flops + out_elems * len(k.epilogue))


def _footprint(k: Kernel) -> str:
    return k.info.footprint if k.info is not None else ""


def working_set(k: Kernel, profile: HardwareProfile) -> tuple[float, int, dict[str, float]]:
    """(bytes the kernel must hold on chip at once, number of tiles, the parts by name)."""
    rows = profile.tile_rows
    out = k.outputs[0] if k.outputs else None
    tiles, out_tile, out_rows, out_h = 1, 0.0, 1, 1
    if out is not None and out.shape is not None and len(out.shape) > 0:
        if len(out.shape) >= 3:
            n, out_h = max(out.shape[0], 1), max(out.shape[2], 1)
        else:
            n, out_h = 1, max(out.shape[0], 1)
        out_rows = min(rows, out_h)
        tiles = n * math.ceil(out_h / out_rows)
        out_tile = profile.nbytes(out) / (n * out_h) * out_rows
    parts = {"input tile": 0.0, "residual tile": 0.0, "weights": 0.0, "output tile": out_tile}
    for out_extra in k.outputs[1:]:
        parts["output tile"] += profile.nbytes(out_extra) / tiles
    for i, t in enumerate(k.inputs):
        if t is None:
            continue
        size = profile.nbytes(t)
        if t.is_weight:
            parts["weights"] += size
            continue
        if i == k.residual_input:  # Z: read row for row with the output, no window
            parts["residual tile"] += _input_tile(dataclasses.replace(k, op="Add", residual_input=None), t,
                                                  size, out, out_rows, out_h, tiles)
        else:
            parts["input tile"] += _input_tile(k, t, size, out, out_rows, out_h, tiles)
    return sum(parts.values()), tiles, parts


def _input_tile(k: Kernel, t: TensorInfo, size: int, out, out_rows: int, out_h: int, tiles: int) -> float:
    if t.shape is None or out is None or out.shape is None:
        return float(size)
    if len(t.shape) < 3 or len(out.shape) < 3:
        return size / tiles
    n_in, h_in = max(t.shape[0], 1), max(t.shape[2], 1)
    per_row = size / (n_in * h_in)
    if _footprint(k) == "window":
        strides = k.attributes.get("strides") or [1]
        dilations = k.attributes.get("dilations") or [1]
        kernel_h = _kernel_height(k)
        if k.op == "ConvTranspose":
            rows_in = math.ceil(out_rows / strides[0]) + kernel_h - 1
        else:
            rows_in = (out_rows - 1) * strides[0] + (kernel_h - 1) * dilations[0] + 1
    elif out_h == 1 and h_in > 1:
        rows_in = h_in  # a global reduction needs the whole map per output row
    else:
        rows_in = math.ceil(out_rows * h_in / out_h)
    return per_row * min(h_in, rows_in)


def _kernel_height(k: Kernel) -> int:
    shape = k.attributes.get("kernel_shape")
    if shape:
        return int(shape[0])
    w = k.inputs[1] if len(k.inputs) > 1 else None
    if w is not None and w.shape is not None and len(w.shape) >= 3:
        return int(w.shape[2])
    return 1


# -- the --hardware hook -----------------------------------------------------------------

def fusion_veto(profile: str | os.PathLike | HardwareProfile) -> Callable[[ir.Node, list[ir.Node]], str | None]:
    """The check ``opfuse optimize --hardware PROFILE`` applies to each fusion.

    The returned function takes the anchor (Conv or Gemm, shapes inferred) and the nodes it
    would absorb, and returns None when the fused kernel's working set fits the profile's
    on-chip buffer, else one sentence saying what does not fit. Unknown shapes: None (the
    model cannot tell, so it does not object). For an Ethos-U profile with Vela installed, the
    optimiser asks Vela instead (:func:`opfuse.targets.ethos_u.vela_veto.vela_fusion_veto`).
    """
    prof = load_profile(profile)

    def veto(anchor: ir.Node, absorbed: list[ir.Node]) -> str | None:
        kernel = _kernel_from_nodes(anchor, absorbed)
        if kernel is None:
            return None
        ws, _, parts = working_set(kernel, prof)
        if ws <= prof.buffer_bytes:
            return None
        # It spills; decline only if the model predicts the spilling fused kernel slower
        # than the unfused sequence (conv alone, then each absorbed op as its own kernel).
        fused_s = cost_kernel(kernel, prof).time_s
        unfused_s = sum(cost_kernel(k, prof).time_s for k in _unfused_kernels(kernel, anchor, absorbed))
        if fused_s <= unfused_s:
            return None
        shown = " + ".join(f"{name} {_mib(v)}" for name, v in parts.items() if v > 0)
        dtype = f" at {prof.execution_dtype}" if prof.execution_dtype else ""
        return (
            f"the fused kernel's working set ({shown} = {_mib(ws)}{dtype}) exceeds "
            f"{prof.name}'s {_mib(prof.buffer_bytes)} on-chip buffer; it would spill, and "
            f"{prof.name} is predicted slower fused ({fused_s * 1e6:.0f} us) than unfused "
            f"({unfused_s * 1e6:.0f} us)"
        )

    return veto


def _unfused_kernels(fused: Kernel, anchor: ir.Node, absorbed: list[ir.Node]) -> list[Kernel]:
    """The kernels the same work takes unfused: the anchor alone, then one per absorbed op."""
    out = fused.outputs[0]
    alone = dataclasses.replace(fused, inputs=fused.inputs[:3], epilogue=())
    kernels = [alone]
    extra = list(fused.inputs[3:])  # residual operands, in absorption order
    for node in absorbed:
        inputs: tuple = (out,)
        if _binary(node) and extra:
            inputs = (out, extra.pop(0))
        kernels.append(Kernel(node.name or node.op_type, node.op_type, inputs, (out,), {}, (), fused.layer))
    return kernels


def _binary(node: ir.Node) -> bool:
    """An element-wise op over broadcast operands (Add, Mul...): its other operand is read."""
    info = OPS.get(node.op_type)
    return info is not None and info.kind is OpKind.BROADCAST and info.activation is None


def _mib(n: float) -> str:
    if n >= MIB:
        return f"{n / MIB:.1f} MiB"
    return f"{n / 1024:.0f} KiB"


def _tensor_info(value: ir.Value | None, is_weight: bool, shape: tuple[int, ...] | None = None) -> TensorInfo | None:
    """The traffic rule's TensorInfo of an optimiser's value: ``shape``, else its own static shape."""
    if value is None:
        return None
    return tensor_info(value, is_weight, shape if shape is not None else static_shape(value.shape))


def _kernel_from_nodes(anchor: ir.Node, absorbed: list[ir.Node]) -> Kernel | None:
    if anchor.op_type not in WEIGHTED_OPS or not anchor.inputs:
        return None
    attrs = plain_attributes(anchor)
    inputs = [
        _tensor_info(v, i > 0 and v is not None and (v.is_initializer() or v.const_value is not None))
        for i, v in enumerate(anchor.inputs)
    ]
    x = inputs[0]
    if x is None or x.shape is None:
        return None
    out_value = (absorbed[-1] if absorbed else anchor).outputs[0]
    out = _tensor_info(out_value, False)
    if out is None or out.shape is None:
        out = _tensor_info(anchor.outputs[0], False)
    if (out is None or out.shape is None) and anchor.op_type == "Conv":
        shape = _conv_output_shape(x, inputs[1], attrs)
        if shape is None:
            return None
        out = dataclasses.replace(x, name=out_value.name or "", shape=shape)
    if out is None or out.shape is None:
        return None
    if out.bits is None:
        out = dataclasses.replace(out, dtype=x.dtype, bits=x.bits)
    steps: list[str] = []
    while len(inputs) < 3:
        inputs.append(None)
    residual = None
    for node in absorbed:
        steps.append(node.op_type)
        if _binary(node):
            if residual is None and not _is_weight_operand(node, anchor, absorbed):
                residual = len(inputs)  # the first activation operand read is the kernel's Z
            chain = {anchor.outputs[0], *(n.outputs[0] for n in absorbed)}
            for v in node.inputs:
                if v is not None and v not in chain:
                    is_w = v.is_initializer() or v.const_value is not None
                    info = _tensor_info(v, is_w, None if is_w else out.shape)
                    if info is not None and info.bits is None:
                        info = dataclasses.replace(info, dtype=out.dtype, bits=out.bits)
                    inputs.append(info)
        else:
            for v in node.inputs[1:]:
                if v is not None and (v.is_initializer() or v.const_value is not None):
                    inputs.append(_tensor_info(v, True))
    return Kernel(anchor.name or anchor.op_type, anchor.op_type, tuple(inputs), (out,), attrs,
                  tuple(steps), anchor.name or "", residual_input=residual)


def _is_weight_operand(node: ir.Node, anchor: ir.Node, absorbed: list[ir.Node]) -> bool:
    chain = {anchor.outputs[0], *(n.outputs[0] for n in absorbed)}
    others = [v for v in node.inputs if v is not None and v not in chain]
    return bool(others) and all(v.is_initializer() or v.const_value is not None for v in others)


def _conv_output_shape(x: TensorInfo, w: TensorInfo | None, attrs: dict) -> tuple[int, ...] | None:
    """The Conv's output shape by ONNX's own shape inference of the one node (x and w known)."""
    if w is None or w.shape is None or x.shape is None or len(x.shape) < 3:
        return None
    node = onnx.helper.make_node("Conv", ["x", "w"], ["y"], **attrs)
    types = {name: onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, shape)
             for name, shape in (("x", x.shape), ("w", w.shape))}
    try:
        inferred = onnx.shape_inference.infer_node_outputs(onnx.defs.get_schema("Conv"), node, types)
    except onnx.shape_inference.InferenceError:
        return None  # attributes that do not fit the shapes: the model cannot tell
    dims = inferred["y"].tensor_type.shape.dim
    if not all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
        return None  # (a window larger than the padded input: no output to cost)
    return tuple(int(d.dim_value) for d in dims)
