"""The ablation measured by Arm's Vela compiler: ``opfuse bench --hardware ethos-u55-128``.

For an Ethos-U profile (one with a ``[vela]`` table, :mod:`opfuse.cost.profiles`) each
configuration of the chapter's ablation is built as int8 TFLite keeping that
configuration's structure, compiled by Vela for the profile's NPU, and Vela's own
estimate (cycles, time at the system's clock, off-chip and SRAM bytes, ops on the CPU)
is printed beside what opfuse's cost model predicts for the same graph on the same
profile, with the model's error against Vela.

=============  ==========================  =====================================================
name           BatchNormalization          activations (Relu, Clip)
=============  ==========================  =====================================================
none           decomposed into Mul + Add   a separate RELU op everywhere
conv-bn        folded into the conv        a separate RELU op everywhere
conv-act       decomposed into Mul + Add   fused into the op before it (here the BN's ADD: the
                                           chapter's Conv+ReLU, BN kept, ReLU in its epilogue)
conv-bn-act    folded into the conv        fused into the op before it
all            folded, arithmetic folded   fused into the op before it
=============  ==========================  =====================================================

The lowering fuses an activation into the op before it wherever TFLite can (CONV_2D,
DEPTHWISE_CONV_2D, FULLY_CONNECTED, ADD, MUL: the residual ADD too), or nowhere; so
conv-bn-act and all differ only where fold-arithmetic changes the graph.

How each model is made, the same for every configuration:

1. the float model with the configuration's structure: BatchNormalization folded by
   opfuse's fold-batchnorm, or decomposed into a Mul and an Add by per-channel constants
   (``gamma / sqrt(var + eps)`` and ``beta - mean * gamma / sqrt(var + eps)``), which is
   how a compiler that does not fold runs it;
2. quantised by ONNX Runtime's ``quantize_static`` to QDQ with TFLite's conventions: int8
   asymmetric activations, int8 symmetric per-channel weights, int32 bias, MinMax over
   :data:`CALIBRATION` seeded random inputs (the same inputs for every configuration), every
   activation kept as its own node (``QDQKeepRemovableActivations``) so that fusing it is
   the lowering's decision, not the quantiser's;
3. lowered to int8 TFLite (:func:`opfuse.targets.ethos_u.lower.lower_to_tflite`), the
   activations fused into the op before them or not, as the configuration says;
4. compiled by Vela (:func:`opfuse.targets.ethos_u.vela.compile_with_vela`).

opfuse's prediction reads the same QDQ graph as an int8 chip runs it
(:func:`opfuse.cost.int8.int8_traffic`), with each activation merged into the kernel
before it where the lowering fused it, and costs it with the profile
(:func:`opfuse.cost.accelerator.predict`). The random calibration data makes the scales
meaningless for accuracy; Vela's cycles do not depend on the scales.
"""

from __future__ import annotations

__all__ = ["CALIBRATION", "ETHOS_CONFIGS", "EthosConfig", "VelaRow", "decompose_batchnorm", "config_float_model",
           "quantize_for_ethos_u", "predicted_kernels", "vela_ablation", "cpu_ops"]

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from opfuse.cost.accelerator import kernels_of, predict
from opfuse.cost.int8 import int8_traffic
from opfuse.cost.profiles import HardwareProfile
from opfuse.cost.traffic import Kernel, analyse_traffic
from opfuse.core.ops import ONNX_DOMAINS, first_line, proto_attr
from opfuse.targets.ethos_u import FUSED_ACTIVATIONS
from opfuse.targets.ethos_u.vela_veto import quantize_for_ethos_u

CALIBRATION = 8
# the ONNX activations a TFLite op can carry as its fused_activation_function (the target's data)
TFLITE_ACTIVATIONS = frozenset(op for op, _ in FUSED_ACTIVATIONS)


@dataclasses.dataclass(frozen=True)
class EthosConfig:
    name: str
    label: str
    fold_batchnorm: bool
    fuse: bool  # activations run in the epilogue of the op before them
    passes: tuple[str, ...] = ()  # opfuse's float passes before quantisation


ETHOS_CONFIGS: dict[str, EthosConfig] = {
    c.name: c
    for c in (
        EthosConfig("none", "none", False, False),
        EthosConfig("conv-bn", "Conv+BN", True, False, ("fold-batchnorm",)),
        EthosConfig("conv-act", "Conv+ReLU", False, True),
        EthosConfig("conv-bn-act", "Conv+BN+ReLU", True, True, ("fold-batchnorm",)),
        EthosConfig("all", "everything", True, True, ("fold-batchnorm", "fold-arithmetic")),
    )
}


@dataclasses.dataclass
class VelaRow:
    """One configuration compiled by Vela for one NPU, beside opfuse's prediction."""

    config: str
    label: str
    profile: str
    npu: str
    cycles: float | None = None
    time_s: float | None = None
    offchip_bytes: float | None = None
    sram_bytes: float | None = None
    npu_ops: int | None = None  # Vela's NPU operations that take cycles
    cpu_ops: list[str] = dataclasses.field(default_factory=list)  # "OP: Vela's reason"
    tflite_ops: int | None = None  # ops of the TFLite Vela was given
    predicted_s: float | None = None
    predicted_offchip_bytes: float | None = None
    system: str = ""  # Vela's system config and memory mode
    same_as: str | None = None  # the configuration whose TFLite is byte-identical
    error: str | None = None

    @property
    def model_error(self) -> float | None:
        """(predicted - Vela) / Vela, of the time."""
        if self.predicted_s is None or not self.time_s:
            return None
        return (self.predicted_s - self.time_s) / self.time_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "model_error": self.model_error,
                "note": "cycles, time and bytes: Vela's estimate; predicted_s: opfuse's cost model"}


# -- the float model of a configuration ---------------------------------------------------

def decompose_batchnorm(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``proto`` with each inference BatchNormalization of constant parameters written
    as ``Mul(x, a) -> Add(., b)``, ``a = gamma / sqrt(var + eps)``, ``b = beta - mean * a``,
    shaped ``[C, 1, ..., 1]`` to broadcast over the channel axis. A BatchNormalization whose
    parameters are not initializers, or with training outputs, is kept as it is."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    inits = {t.name: t for t in graph.initializer}
    ranks = _ranks(out)
    nodes = []
    for node in graph.node:
        params = [inits.get(name) for name in node.input[1:5]]
        if (node.op_type != "BatchNormalization" or node.domain not in ONNX_DOMAINS or len(node.output) != 1
                or len(params) != 4 or any(p is None for p in params)):
            nodes.append(node)
            continue
        gamma, beta, mean, var = (numpy_helper.to_array(p).astype(np.float64) for p in params)
        eps = proto_attr(node, "epsilon", 1e-5)
        a = gamma / np.sqrt(var + eps)
        b = beta - mean * a
        shape = (len(a),) + (1,) * max(ranks.get(node.input[0], 4) - 2, 0)
        base = node.name or node.output[0]
        names = (f"{base}_bn_scale", f"{base}_bn_shift", f"{base}_bn_scaled")
        dtype = helper.tensor_dtype_to_np_dtype(params[0].data_type)
        graph.initializer.append(numpy_helper.from_array(a.reshape(shape).astype(dtype), names[0]))
        graph.initializer.append(numpy_helper.from_array(b.reshape(shape).astype(dtype), names[1]))
        nodes.append(helper.make_node("Mul", [node.input[0], names[0]], [names[2]], name=f"{base}_bn_mul"))
        nodes.append(helper.make_node("Add", [names[2], names[1]], [node.output[0]], name=f"{base}_bn_add"))
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    return out


def _ranks(proto: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(proto)
    ranks = {}
    for v in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            ranks[v.name] = len(v.type.tensor_type.shape.dim)
    return ranks


def config_float_model(model: ir.Model, name: str) -> onnx.ModelProto:
    """The float model with configuration ``name``'s structure (see the module docstring)."""
    from opfuse.pipeline import optimize  # loads the passes; this module is read by bench.run

    config = ETHOS_CONFIGS[name]
    if config.passes:
        model, _ = optimize(model, passes=config.passes, target="onnx", runtime_level="disabled", verify=False)
    proto = ir.serde.serialize_model(model)
    return proto if config.fold_batchnorm else decompose_batchnorm(proto)


# -- opfuse's prediction ------------------------------------------------------------------------

def predicted_kernels(qdq: onnx.ModelProto, unfused: Iterable[str] | None = None) -> list[Kernel]:
    """The QDQ graph's int8 kernels as the TFLite runs them: no QuantizeLinear/DequantizeLinear at
    the edges (the TFLite's IO is int8), and each activation the lowering fused (every Relu/Clip
    not named in ``unfused``, the lowering's refusals; None: none fused) merged into the kernel
    before it."""
    traffic = int8_traffic(analyse_traffic(qdq, batch=1))
    kernels = [k for k in kernels_of(traffic) if k.op not in ("QuantizeLinear", "DequantizeLinear")]
    if unfused is None:
        return kernels
    kept = set(unfused)
    return merge_activations(kernels, [k.name for k in kernels if k.op in TFLITE_ACTIVATIONS and k.name not in kept])


def merge_activations(kernels: Sequence[Kernel], fused: Iterable[str]) -> list[Kernel]:
    """Each kernel named in ``fused`` (an activation) runs in the epilogue of the kernel that
    writes its input (TFLite's fused activation); one whose input has no producing kernel stays."""
    names = set(fused)
    producer = {k.outputs[0].name: i for i, k in enumerate(kernels) if k.outputs}
    merged: list[Kernel | None] = list(kernels)
    for i, k in enumerate(kernels):
        if k.name not in names or not k.inputs or k.inputs[0] is None:
            continue
        j = producer.get(k.inputs[0].name)
        host = merged[j] if j is not None else None
        if host is None:
            continue
        merged[j] = dataclasses.replace(host, outputs=(k.outputs[0], *host.outputs[1:]),
                                        epilogue=(*host.epilogue, k.op))
        merged[i] = None
    return [k for k in merged if k is not None]


# -- the run ----------------------------------------------------------------------------------

def vela_ablation(
    model: ir.Model,
    configs: Sequence[str],
    profiles: Sequence[HardwareProfile],
    calibration: Sequence[dict[str, np.ndarray]],
    *,
    progress: Callable[[str], None] | None = None,
) -> list[VelaRow]:
    """Every configuration x every Ethos-U profile: Vela's figures and opfuse's prediction.

    A configuration that fails (quantisation, lowering, Vela) gives rows with ``error`` set;
    the others still run. Configurations whose TFLite is byte-identical are compiled once.
    """
    from opfuse.targets.ethos_u.lower import lower_to_tflite  # loads the TFLite schema: only for an Ethos-U run

    rows: list[VelaRow] = []
    built: dict[bytes, str] = {}
    figures: dict[tuple[str, str], VelaRow] = {}
    for name in configs:
        config = ETHOS_CONFIGS[name]
        if progress is not None:
            progress(f"Ethos-U: {name}: int8 TFLite")
        tflite, kernels, error = None, None, None
        try:
            qdq = quantize_for_ethos_u(config_float_model(model, name), calibration)
            refusals: list[dict] = []
            tflite = lower_to_tflite(qdq, refusals=refusals, fuse_activations=config.fuse)
            kernels = predicted_kernels(qdq, [r["node"] for r in refusals])
        except Exception as e:  # noqa: BLE001 - the quantiser, the lowering raise many kinds
            error = first_line(e)
        same = built.get(tflite) if tflite is not None else None
        tflite_ops = _tflite_op_count(tflite) if tflite is not None else None
        if tflite is not None and same is None:
            built[tflite] = name
        for prof in profiles:
            row = VelaRow(name, config.label, prof.name, prof.vela.get("npu", ""), error=error, same_as=same,
                          tflite_ops=tflite_ops)
            if kernels is not None:
                prediction = predict(kernels, prof)
                row.predicted_s = prediction.latency_s
                row.predicted_offchip_bytes = prediction.traffic_bytes
            if tflite is not None:
                if same is not None:
                    _copy_figures(figures[(same, prof.name)], row)
                else:
                    if progress is not None:
                        progress(f"Ethos-U: {name}: Vela {row.npu}")
                    _compile(tflite, prof, row)
                figures[(name, prof.name)] = row
            rows.append(row)
    return rows


def cpu_ops(result) -> list[str]:
    """Every op Vela leaves to the CPU, "name: reason" (:func:`opfuse.targets.ethos_u.vela.cpu_placement`:
    its per-layer rows off the NPU, with the reason Vela printed)."""
    return [f"{name}: {reason}" for name, reason in result.cpu_ops.items()]


def _copy_figures(src: VelaRow, dst: VelaRow) -> None:
    for field in ("cycles", "time_s", "offchip_bytes", "sram_bytes", "npu_ops", "cpu_ops", "system", "error"):
        setattr(dst, field, getattr(src, field))


def _tflite_op_count(tflite: bytes) -> int:
    from ai_edge_litert import schema_py_generated as schema  # the ethos-u extra: on use

    return schema.Model.GetRootAs(tflite, 0).Subgraphs(0).OperatorsLength()


def _compile(tflite: bytes, prof: HardwareProfile, row: VelaRow) -> None:
    from opfuse.targets.ethos_u.vela import compile_with_vela  # Vela's wrapper: only for an Ethos-U run

    try:
        result = compile_with_vela(tflite, npu=prof.vela["npu"], system_config=prof.vela.get("system_config"),
                                   memory_mode=prof.vela.get("memory_mode"))
    except Exception as e:  # noqa: BLE001 - Vela raises many kinds
        row.error = first_line(e)
        return
    row.cycles = result.cycles
    row.time_s = result.seconds
    row.offchip_bytes = result.off_chip_bytes
    row.sram_bytes = result.sram_bytes
    row.npu_ops = sum(1 for op in result.npu_ops if op.cycles > 0)  # a fused activation's row has none
    row.cpu_ops = cpu_ops(result)
    row.system = f"{result.system_config}, {result.memory_mode}"


# -- the profile's fit ------------------------------------------------------------------------

_TFLITE_BYTES = {"INT8": 1, "UINT8": 1, "INT16": 2, "FLOAT16": 2, "INT32": 4, "FLOAT32": 4, "INT64": 8, "BOOL": 1}


def vela_op_samples(tflite: bytes, result) -> list:
    """One :class:`~opfuse.cost.fit.OpSample` per op Vela ran on the NPU: Vela's cycles at its clock,
    and the op's work as the cost model counts it (2 x Vela's MACs, or the output's elements for an op
    without MACs; the bytes of every tensor of the TFLite op that writes the row's output). A row
    whose output is not a TFLite op's (an op Vela inserted) is left out."""
    from ai_edge_litert import schema_py_generated as schema  # the ethos-u extra: on use

    from opfuse.cost.fit import OpSample  # numpy-only, but only the fit needs it

    names = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    model = schema.ModelT.InitFromPackedBuf(tflite, 0)
    graph = model.subgraphs[0]

    def size(i: int) -> tuple[int, int]:
        t = graph.tensors[i]
        elems = int(np.prod(t.shape)) if t.shape is not None else 0
        return elems * _TFLITE_BYTES.get(names.get(t.type, ""), 4), elems

    by_output = {}
    for op in graph.operators:
        if op.outputs is None or not len(op.outputs):
            continue
        moved = sum(size(i)[0] for i in (*op.inputs, *op.outputs) if i >= 0)
        name = graph.tensors[op.outputs[0]].name
        by_output[name.decode() if isinstance(name, bytes) else name] = (moved, size(op.outputs[0])[1])
    samples = []
    for row in result.npu_ops:
        found = by_output.get(row.name)
        if found is None or row.cycles <= 0:
            continue
        moved, out_elems = found
        samples.append(OpSample(row.name, row.tflite_op, row.cycles / result.clock_hz,
                                2.0 * row.macs if row.macs else float(out_elems), float(moved)))
    return samples
