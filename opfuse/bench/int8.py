"""The int8 rows of ``opfuse bench``: the model quantised with and without folding first.

=================  =========================================================================
row                what runs
=================  =========================================================================
``int8``           BN folded: opfuse's default folds, then ``opfuse.quantize`` (preset cpu,
                   MinMax, bias correction off, so the two rows differ by the folding alone)
``int8-unfolded``  BN unfolded: ONNX Runtime's ``quantize_static`` on the model as given;
                   each BatchNormalization gets its own Q/DQ pair and runs in float
``all-ort-all``    the float reference at the same level: opfuse's ``all`` configuration as
                   written for ONNX Runtime's all level
=================  =========================================================================

Both int8 flows use the same settings (QDQ, int8 symmetric per-channel weights, uint8
asymmetric activations, MinMax calibration, the op types of opfuse's cpu preset) on the
same samples: the bench's own seeded
random inputs (:func:`opfuse.verify.make_inputs`), :data:`CALIBRATION` to calibrate and
:data:`HELD_OUT` held out for the output SQNR against the float model. Random data is
fine for latency (int8 kernels take as long whatever the scales), not for accuracy: the
SQNR says the rows computed roughly the right thing, nothing more.

A QDQ model gets ONNX Runtime's int8 kernels (QLinearConv, ...) only when the runtime's
optimisations are on (from extended; all also gives them their NHWC layout), so the int8
rows run at ORT all, beside the float model at all.
"""

from __future__ import annotations

__all__ = ["INT8", "INT8_UNFOLDED", "FLOAT_AT_ALL", "FLOAT_SOURCE", "CALIBRATION", "HELD_OUT", "Int8Facts", "Int8Model",
           "quantize_rows", "runtime_int8_kernels"]

import dataclasses
import math
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import onnx
import onnx_ir as ir

from opfuse.pipeline import optimize
from opfuse.quantization import quantize
from opfuse.quantization.presets import CPU_OPS, PRESETS
from opfuse.quantization.qdq.quantizer import Quantizer, weight_storage
from opfuse.quantization.qdq.sqnr import output_sqnr
from opfuse.verify import make_inputs
from opfuse.core.ops import first_line

INT8 = "int8"
INT8_UNFOLDED = "int8-unfolded"
FLOAT_AT_ALL = "all-ort-all"
CALIBRATION, HELD_OUT = 8, 4
# the float configuration each int8 row was quantised from (what its prediction compares with)
FLOAT_SOURCE = {INT8: "conv-bn", INT8_UNFOLDED: "none"}
INT8_RUNTIME_OPS = ("QLinear", "QGemm", "MatMulInteger", "ConvInteger", "QAttention")


@dataclasses.dataclass
class Int8Facts:
    """What one int8 row is: its flow, its QDQ graph, how close it stays to float."""

    flow: str
    qdq_nodes: int = 0  # nodes of the QDQ graph as written (Constant nodes not counted)
    quantize_linear: int = 0
    dequantize_linear: int = 0
    sqnr_db: float = float("nan")  # output SQNR on the held-out samples, run at ORT all
    calibration_samples: int = 0
    held_out_samples: int = 0
    weights_8bit_fraction: float | None = None
    quantize_s: float = 0.0
    float_ops: dict[str, int] = dataclasses.field(default_factory=dict)  # run in float on an int8 chip
    runtime_ops: dict[str, int] = dataclasses.field(default_factory=dict)  # as ONNX Runtime runs it at all

    @property
    def runtime_int8(self) -> int:
        return runtime_int8_kernels(self.runtime_ops)

    def to_dict(self) -> dict[str, Any]:
        data = {**dataclasses.asdict(self), "runtime_int8_kernels": self.runtime_int8}
        if not math.isfinite(self.sqnr_db):
            data["sqnr_db"] = None  # not measured (the flow failed): JSON has no NaN
        return data


@dataclasses.dataclass
class Int8Model:
    key: str
    label: str
    note: str
    model: ir.Model | onnx.ModelProto | None
    facts: Int8Facts
    error: str | None = None


def runtime_int8_kernels(op_counts: dict[str, int]) -> int:
    """How many of the runtime's nodes are int8 kernels (QLinearConv, QGemm, ...)."""
    return sum(n for op, n in op_counts.items() if op.rsplit(".", 1)[-1].startswith(INT8_RUNTIME_OPS))


def quantize_rows(
    model: ir.Model,
    dims: dict[str, int],
    *,
    calibration: int = CALIBRATION,
    held_out: int = HELD_OUT,
    progress: Callable[[str], None] | None = None,
) -> list[Int8Model]:
    """The two int8 models (folded by opfuse, unfolded by ONNX Runtime), each with its facts.

    A flow that fails gives a row with ``error`` set and no model; the other still runs.
    """
    samples = [make_inputs(model, dims=dims, seed=i) for i in range(calibration + held_out)]
    calib, held = samples[:calibration], samples[calibration:]
    float_proto = ir.serde.serialize_model(model)
    rows = []
    if progress is not None:
        progress("quantising: opfuse (BN folded)")
    rows.append(_opfuse_flow(model, samples, held_out))
    if progress is not None:
        progress("quantising: ONNX Runtime (unfolded)")
    rows.append(_ort_flow(float_proto, calib, held))
    return rows


def _opfuse_flow(model: ir.Model, samples, held_out: int) -> Int8Model:
    facts = Int8Facts(flow="opfuse quantize (preset cpu, bias correction off)",
                      calibration_samples=len(samples) - held_out, held_out_samples=held_out)
    note = ("BN folded by opfuse's default folds, then opfuse.quantize (preset cpu: ONNX Runtime's quantiser, QDQ, "
            "int8 per-channel weights, uint8 activations, MinMax; bias correction off, so this row and "
            "the unfolded one differ by the folding alone)")
    start = time.perf_counter()
    try:
        # Folded here without verification, like every bench configuration (the bench compares
        # outputs as it measures; this row reports its SQNR): opfuse.quantize then finds nothing
        # left to fold, and its own float check of the folds cannot stop the row.
        folded, _ = optimize(model, target="onnx", verify=False, tune=False)
        qmodel, report = quantize(folded, samples, preset="cpu", holdout=held_out, bias_correction=False,
                                  calibrate="minmax")
    except Exception as e:  # noqa: BLE001 - the quantiser and ONNX Runtime raise many kinds
        return Int8Model(INT8, "int8 folded", note, None, facts, error=first_line(e))
    facts.quantize_s = time.perf_counter() - start
    _count(facts, ir.serde.serialize_model(qmodel))
    facts.sqnr_db = report.verification.sqnr_db  # (quantize always verifies)
    facts.weights_8bit_fraction = report.weights_8bit_fraction
    return Int8Model(INT8, "int8 folded", note, qmodel, facts)


def _ort_flow(float_proto: onnx.ModelProto, calib, held) -> Int8Model:
    facts = Int8Facts(flow="ONNX Runtime quantize_static on the model as given",
                      calibration_samples=len(calib), held_out_samples=len(held))
    note = ("BN unfolded: ONNX Runtime's quantize_static on the model as given (QDQ, int8 per-channel weights, "
            "uint8 activations, MinMax, the same samples): each BatchNormalization gets its own Q/DQ "
            "pair and runs in float")
    start = time.perf_counter()
    try:
        qdq = _quantize_static(float_proto, calib)
        facts.quantize_s = time.perf_counter() - start
        _, facts.sqnr_db = output_sqnr(float_proto, qdq, held, qdq_level="all")
        eight_bit, total = weight_storage(float_proto, qdq)
        facts.weights_8bit_fraction = eight_bit / total if total else None
    except Exception as e:  # noqa: BLE001 - the quantiser and ONNX Runtime raise many kinds
        return Int8Model(INT8_UNFOLDED, "int8 unfolded", note, None, facts, error=first_line(e))
    _count(facts, qdq)
    return Int8Model(INT8_UNFOLDED, "int8 unfolded", note, qdq, facts)


# ORT's quantiser as the cpu preset runs it, on the model as given, with BatchNormalization
# quantised too as ORT does by default (opfuse folds it away; here each BN keeps its Q/DQ)
UNFOLDED = dataclasses.replace(PRESETS["cpu"], op_types=(*CPU_OPS, "BatchNormalization"))


def _quantize_static(float_proto: onnx.ModelProto, calib) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory(prefix="opfuse-bench-int8-") as tmp:
        return Quantizer(float_proto, UNFOLDED, calib, tmp, method="minmax").quantize()


def _count(facts: Int8Facts, proto: onnx.ModelProto) -> None:
    ops = Counter(n.op_type for n in proto.graph.node if n.op_type != "Constant")
    facts.qdq_nodes = sum(ops.values())
    facts.quantize_linear = ops["QuantizeLinear"]
    facts.dequantize_linear = ops["DequantizeLinear"]
