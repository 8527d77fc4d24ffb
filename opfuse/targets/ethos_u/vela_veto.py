"""``opfuse optimize --hardware ethos-u55-128``: each fusion decided by Arm's Vela, not by the model.

For an Ethos-U profile (a ``[vela]`` table, :mod:`opfuse.cost.profiles`) with Vela installed,
:func:`vela_fusion_veto` replaces the cost model's veto (:func:`opfuse.cost.accelerator.fusion_veto`;
the choice is :func:`opfuse.pipeline.hardware_veto`).
For each fusion the epilogue pass proposes (a Conv or Gemm and the ops it would absorb):

1. the candidate alone is written as a small float ONNX model: the anchor with its weights, then
   the absorbed ops in order, every other operand (a residual) a graph input of its shape;
2. quantised with TFLite's int8 conventions on two seeded random inputs
   (:func:`quantize_for_ethos_u`, which ``opfuse bench``'s Ethos-U rows use too), lowered twice (:func:`opfuse.targets.ethos_u.lower.lower_to_tflite`), the
   activation fused into the op before it and not, and both compiled by Vela for the profile's NPU;
3. declined when Vela's cycles for the fused form exceed the unfused form's, with both figures
   as the reason. A candidate Vela or the lowering cannot take (a residual Add has no TFLite
   form inside a conv) is not objected to: Vela has no figure for it. Only those failures are
   (:func:`_no_figure`): a bug in the lowering (a TypeError, a KeyError...) is raised, not
   taken for "no objection".

Candidates with equal shapes, attributes and absorbed ops share one answer (ResNet-50 repeats its
blocks), so a model costs one pair of Vela runs per distinct candidate.
"""

from __future__ import annotations

__all__ = ["vela_fusion_veto", "VelaVerdict", "quantize_for_ethos_u"]

import dataclasses
import tempfile
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from opfuse.cost.profiles import HardwareProfile
from opfuse.core.ops import first_line
from opfuse.errors import OpfuseError
from opfuse.targets.ethos_u.tflite_norm import QUANTISED_OPS, rsqrt_form


@dataclasses.dataclass(frozen=True)
class VelaVerdict:
    fused_cycles: int | None
    unfused_cycles: int | None
    note: str = ""  # why Vela has no figure, when it has none


def vela_fusion_veto(profile: HardwareProfile) -> Callable[[ir.Node, list[ir.Node]], str | None]:
    """The veto ``opfuse optimize --hardware`` applies with an Ethos-U profile (the module docstring).
    The returned function keeps its verdicts in ``.verdicts`` (candidate signature -> VelaVerdict)."""
    verdicts: dict[tuple, VelaVerdict] = {}

    def veto(anchor: ir.Node, absorbed: list[ir.Node]) -> str | None:
        key = _signature(anchor, absorbed)
        if key is None:
            return None
        if key not in verdicts:
            verdicts[key] = _measure(anchor, absorbed, profile)
        v = verdicts[key]
        if v.fused_cycles is None or v.unfused_cycles is None or v.fused_cycles <= v.unfused_cycles:
            return None
        return (f"Vela ({profile.vela['npu']}) estimates the fused form slower: {v.fused_cycles} cycles "
                f"against {v.unfused_cycles} with the {'+'.join(n.op_type for n in absorbed)} as its own op")

    veto.verdicts = verdicts  # type: ignore[attr-defined]
    return veto


def _signature(anchor: ir.Node, absorbed: list[ir.Node]) -> tuple | None:
    shapes = []
    for v in (*anchor.inputs, *(x for n in absorbed for x in n.inputs), anchor.outputs[0]):
        if v is None:
            continue
        if v.shape is None or not all(isinstance(d, int) for d in v.shape):
            return None  # Vela needs static shapes
        shapes.append(tuple(v.shape))
    attrs = tuple(sorted((k, repr(a.value)) for k, a in anchor.attributes.items()))
    return anchor.op_type, attrs, tuple(shapes), tuple(n.op_type for n in absorbed)


def _measure(anchor: ir.Node, absorbed: list[ir.Node], profile: HardwareProfile) -> VelaVerdict:
    # the lowering and Vela load the TFLite schema and run a subprocess: only for an Ethos-U profile
    from opfuse.targets.ethos_u.lower import lower_to_tflite
    from opfuse.targets.ethos_u.vela import compile_with_vela  # runs Vela in a subprocess

    float_model = _candidate_model(anchor, absorbed)
    try:
        qdq = _quantize(float_model)
        cycles = []
        for fuse in (True, False):
            tflite = lower_to_tflite(qdq, fuse_activations=fuse)
            result = compile_with_vela(tflite, npu=profile.vela["npu"], system_config=profile.vela.get("system_config"),
                                       memory_mode=profile.vela.get("memory_mode"))
            cycles.append(result.cycles)
    except _no_figure() as e:  # a candidate Vela cannot take has no figure; the reason is kept
        return VelaVerdict(None, None, first_line(e))
    return VelaVerdict(cycles[0], cycles[1])


def _no_figure() -> tuple[type[Exception], ...]:
    """What a candidate Vela has no figure for raises: the lowering's refusal (``LoweringError``),
    Vela's failure (``VelaError``) or absence (``BadInputError``), all :class:`OpfuseError`; and
    ONNX Runtime's own errors when its quantiser cannot run the candidate model. Anything else is
    a bug and is raised."""
    # ONNX Runtime's C++ errors as its Python binding raises them: loaded only when a candidate is measured
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument, InvalidGraph, RuntimeException
    from onnxruntime.capi.onnxruntime_pybind11_state import NotImplemented as OrtNotImplemented  # (as above)

    return OpfuseError, Fail, InvalidArgument, InvalidGraph, OrtNotImplemented, RuntimeException


def _candidate_model(anchor: ir.Node, absorbed: list[ir.Node]) -> onnx.ModelProto:
    """The anchor and the absorbed ops as a model of their own (weights copied, other operands inputs)."""
    inputs, inits, nodes, seen = [], [], [], {}

    def name_of(v: ir.Value) -> str:
        if v in seen:
            return seen[v]
        name = f"t{len(seen)}"
        seen[v] = name
        if v.const_value is not None:
            inits.append(onnx.numpy_helper.from_array(v.const_value.numpy(), name))
        else:
            elem = v.dtype.value if v.dtype is not None else onnx.TensorProto.FLOAT
            inputs.append(helper.make_tensor_value_info(name, elem, list(v.shape)))
        return name

    chain = [anchor, *absorbed]
    produced: dict[ir.Value, str] = {}
    for i, node in enumerate(chain):
        ins = [produced.get(v) or name_of(v) if v is not None else "" for v in node.inputs]
        out = f"y{i}"
        produced[node.outputs[0]] = out
        attrs = {k: a.value for k, a in node.attributes.items()}
        nodes.append(helper.make_node(node.op_type, ins, [out], name=f"n{i}", **attrs))
    last = chain[-1].outputs[0]
    output = helper.make_tensor_value_info(produced[last], onnx.TensorProto.FLOAT,
                                           list(last.shape) if last.shape is not None else None)
    graph = helper.make_graph(nodes, "candidate", inputs, [output], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def quantize_for_ethos_u(float_proto: onnx.ModelProto, calibration) -> onnx.ModelProto:
    """ONNX Runtime's ``quantize_static`` with TFLite's int8 conventions: QDQ, int8 asymmetric
    activations, int8 symmetric per-channel weights (int32 bias), MinMax over ``calibration`` (a
    sequence of feeds), every Relu/Clip kept as its own node (``QDQKeepRemovableActivations``) so
    that fusing it is the lowering's decision; a LayerNorm written out is rewritten first and its ops
    quantised (:mod:`.tflite_norm`). The bench's configurations use it too."""
    # ORT's quantiser loads a lot: only when a model is quantised
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    class Samples(CalibrationDataReader):
        def __init__(self):
            self.it = iter(calibration)

        def get_next(self):
            return next(self.it, None)

    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry  # (its default op list)

    model = onnx.ModelProto()
    model.CopyFrom(float_proto)
    rsqrt_form(model)  # a LayerNorm written out, as TFLite's int8 kernels run it (tflite_norm)
    with tempfile.TemporaryDirectory(prefix="opfuse-ethos-q-") as tmp:
        onnx.save(model, f"{tmp}/float.onnx")
        quantize_static(f"{tmp}/float.onnx", f"{tmp}/qdq.onnx", Samples(), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=sorted({*QLinearOpsRegistry, *QDQRegistry, *QUANTISED_OPS}),
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                        calibrate_method=CalibrationMethod.MinMax,
                        extra_options={"ActivationSymmetric": False, "WeightSymmetric": True,
                                       "QDQKeepRemovableActivations": True})
        return onnx.load(f"{tmp}/qdq.onnx")


def _quantize(model: onnx.ModelProto) -> onnx.ModelProto:
    """The candidate quantised on two seeded random inputs."""
    rng = np.random.default_rng(0)
    samples = [{i.name: rng.normal(0, 1, [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
                for i in model.graph.input} for _ in range(2)]
    return quantize_for_ethos_u(model, samples)
