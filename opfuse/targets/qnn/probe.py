"""Asking QNN's compiler what it takes: compile a small graph, float and quantised, and read
where each node went.

:func:`probe` opens a model on the HTP backend twice: as given (float; QNN's HTP runs float
graphs in float16 on v68+ architectures) and quantised the way ONNX Runtime's QNN flow
does (``get_qnn_qdq_config``, uint8 activations and weights, a few random calibration
samples), and returns for each form whether every original op went to QNN, and QNN's
reason for each one that did not. The op lists it is asked about live in
``benchmarks/qnn_ops.py`` (the evidence behind :mod:`opfuse.targets.qnn`) and in the
tests that check that table.
"""

from __future__ import annotations

__all__ = ["ProbeResult", "probe", "quantize_like_qnn_flow"]

import contextlib
import dataclasses
import io
import logging
import tempfile

import numpy as np
import onnx

from opfuse.targets.qnn.backend import HtpCompileError, HtpOptions, open_session


@dataclasses.dataclass
class ProbeResult:
    """One form (float or QDQ) of one probe graph on the HTP."""

    form: str  # "float" or "qdq"
    whole: bool  # every node of the graph on QNN
    on_cpu: list[tuple[str, str, str]]  # (node, op, QNN's reason)
    error: str = ""  # QNN could not compile it at all
    seconds: float = 0.0

    def verdict(self) -> str:
        if self.error:
            return f"error: {self.error}"
        if self.whole:
            return "QNN"
        return "; ".join(f"{op} on CPU ({reason or 'no reason logged'})" for _, op, reason in self.on_cpu)


def _random_feeds(model: onnx.ModelProto, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    initializers = {i.name for i in model.graph.initializer}
    out = []
    for _ in range(count):
        sample = {}
        for inp in model.graph.input:
            if inp.name in initializers:
                continue
            t = inp.type.tensor_type
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
            shape = [d.dim_value for d in t.shape.dim]
            sample[inp.name] = (rng.normal(0, 1, shape).astype(dtype) if np.issubdtype(dtype, np.floating)
                                else rng.integers(0, 2, shape).astype(dtype))
        out.append(sample)
    return out


def quantize_like_qnn_flow(model: onnx.ModelProto, samples=None, *, overrides=None, preset=None) -> onnx.ModelProto:
    """``model`` quantised as ONNX Runtime's QNN guide does: ``get_qnn_qdq_config`` then
    ``quantize`` (MinMax over ``samples``, default four random ones). ``preset`` (an opfuse
    QNN :class:`~opfuse.quantization.presets.Preset`) passes its activation and weight types
    and per-channel choice to ``get_qnn_qdq_config``, as a user of the guide would ask for
    them (``activation_type``, ``weight_type``, ``per_channel``, symmetric per-channel
    weights); by default the guide's uint8 per tensor."""
    from onnxruntime.quantization import CalibrationDataReader, quantize  # (the quantiser: heavy, on use)
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config  # (its QNN helpers)

    samples = list(samples) if samples is not None else _random_feeds(model, 4)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(samples)

        def get_next(self):
            return next(self.it, None)

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="opfuse-qnn-q-") as tmp, contextlib.redirect_stdout(io.StringIO()):
            src, dst = f"{tmp}/float.onnx", f"{tmp}/qdq.onnx"
            onnx.save(model, src)
            types = {}
            if preset is not None:
                from opfuse.targets.qnn.conventions import qnn_types  # (the quantiser: heavy, on use)

                types = qnn_types(preset)  # as opfuse's Quantizer passes them
            config = get_qnn_qdq_config(src, Reader(), init_overrides=overrides, **types)
            quantize(src, dst, config)
            return onnx.load(dst)
    finally:
        root.setLevel(level)


def probe(model: onnx.ModelProto, options: HtpOptions | None = None, *, forms=("float", "qdq")) -> dict[str, ProbeResult]:
    """Where QNN puts each node of ``model`` (static shapes), as float and as QDQ."""
    out = {}
    for form in forms:
        try:
            m = model if form == "float" else quantize_like_qnn_flow(model)
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's quantiser raises many kinds
            out[form] = ProbeResult(form, False, [], error=f"ONNX Runtime's quantiser failed: {str(e).splitlines()[0][:160]}")
            continue
        try:
            s = open_session(m, options)
        except HtpCompileError as e:
            out[form] = ProbeResult(form, False, [], error=str(e)[:300])
            continue
        p = s.placement
        out[form] = ProbeResult(form, p.all_on_npu, [(f.name, f.op_type, f.reason) for f in p.fallbacks],
                                seconds=s.compile_seconds)
    return out
