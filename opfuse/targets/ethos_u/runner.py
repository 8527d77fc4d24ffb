"""The lowered TFLite run in LiteRT's interpreter, and its accuracy three ways.

Vela's compiled model needs the NPU (its ``ethos-u`` custom op runs on the device or Arm's
FVP), so the figures here run the *lowered* int8 TFLite (:mod:`.lower`) on LiteRT's CPU
reference kernels: the same int8 graph, the same quantisation parameters, TFLite's own
requantisation arithmetic, which the Ethos-U implements (Vela's ops are bit-exact to TFLite
Micro's reference kernels by Arm's design, not checked here).

The TFLite takes NHWC int8 tensors where the ONNX model takes NCHW float: :class:`TfliteSession`
matches inputs and outputs by name (else by position), transposes a rank-4 tensor whose NHWC
shape is the TFLite's, and quantises and dequantises with the tensor's own scale and zero point.

The held-out SQNRs (:func:`tflite_accuracy`; the device interface's names in brackets):

- **TFLite vs float** (``htp_vs_float``): the lowered TFLite in LiteRT against the float model
  on ONNX Runtime, the figure ``quantize --preset ethos-u`` judges ``--min-sqnr`` by;
- **QDQ vs float** (``cpu_vs_float``): the QDQ ONNX it was lowered from, on ONNX Runtime's CPU;
- **TFLite vs QDQ** (``htp_vs_cpu``): how far the two runtimes of one quantised model are apart.
"""

from __future__ import annotations

__all__ = ["TfliteSession", "TfliteRunner", "TfliteAccuracy", "tflite_accuracy"]

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx

from opfuse.quantization.qdq.sqnr import three_way

NCHW_TO_NHWC = (0, 2, 3, 1)
NHWC_TO_NCHW = (0, 3, 1, 2)


class TfliteSession:
    """A TFLite model in LiteRT's interpreter, fed and read as its ONNX model is."""

    def __init__(self, tflite: bytes, model: onnx.ModelProto | None = None):
        from ai_edge_litert.interpreter import Interpreter  # (the ethos-u extra: on use)

        self.tflite = tflite
        self.shapes = _output_shapes(model) if model is not None else {}  # the ONNX outputs' layout
        self.interpreter = Interpreter(model_content=tflite)
        self.interpreter.allocate_tensors()
        self.inputs = self.interpreter.get_input_details()
        self.outputs = self.interpreter.get_output_details()
        self.quiet = self  # (the device interface's InferenceSession-like view: run(names, feeds))

    def run(self, names: Sequence[str] | None, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """ONNX Runtime's signature: the outputs ``names`` (None: all, in the TFLite's order)."""
        given = list(feeds)
        for i, detail in enumerate(self.inputs):
            key = detail["name"] if detail["name"] in feeds else given[i]
            self.interpreter.set_tensor(detail["index"], _to_tflite(np.asarray(feeds[key]), detail))
        self.interpreter.reset_all_variables()  # each run from a zero LSTM state, as ONNX's LSTM starts
        self.interpreter.invoke()
        by_name = {d["name"]: d for d in self.outputs}
        order = list(self.shapes)
        names = list(names) if names else order or [d["name"] for d in self.outputs]
        wanted = [by_name.get(n) or self.outputs[order.index(n) if n in order else i] for i, n in enumerate(names)]
        return [_from_tflite(self.interpreter.get_tensor(d["index"]), d, self.shapes.get(n))
                for n, d in zip(names, wanted)]


def _to_tflite(value: np.ndarray, detail: dict) -> np.ndarray:
    shape = tuple(detail["shape"])
    if value.ndim == 4 and tuple(value.transpose(NCHW_TO_NHWC).shape) == shape:  # the lowering's rank 4 is NHWC
        value = value.transpose(NCHW_TO_NHWC)  # (also where C == H == W, when the two shapes are equal)
    scale, zero = detail["quantization"]
    dtype = detail["dtype"]
    if np.issubdtype(dtype, np.integer) and scale:
        info = np.iinfo(dtype)
        value = np.clip(np.round(value / scale) + zero, info.min, info.max)
    return np.ascontiguousarray(value.reshape(shape).astype(dtype))


def _from_tflite(value: np.ndarray, detail: dict, onnx_shape: tuple | None) -> np.ndarray:
    scale, zero = detail["quantization"]
    out = (value.astype(np.float32) - zero) * np.float32(scale) if scale else value
    if onnx_shape is None:
        return out
    if out.ndim == 4 and out.transpose(NHWC_TO_NCHW).shape == onnx_shape:  # NHWC back to the ONNX model's NCHW
        return out.transpose(NHWC_TO_NCHW)  # (also where C == H == W: the lowering's rank 4 is NHWC)
    if out.shape == onnx_shape:
        return out
    return out.reshape(onnx_shape)


def _output_shapes(model: onnx.ModelProto) -> dict[str, tuple | None]:
    """Output name -> its static shape (None where a dimension is not a number)."""
    shapes = {}
    for o in model.graph.output:
        dims = o.type.tensor_type.shape.dim
        shapes[o.name] = tuple(d.dim_value for d in dims) if all(d.HasField("dim_value") for d in dims) else None
    return shapes


class TfliteRunner:
    """Runs ONNX models as the device does: lowered to TFLite, then in LiteRT (one lowering per call)."""

    def __init__(self, options=None):
        self.options = options

    def session(self, model) -> TfliteSession:
        from opfuse.targets.ethos_u.lower import lower_to_tflite  # (the lowering loads the TFLite schema)

        proto = _proto(model)
        islands = bool(getattr(self.options, "float_islands", False))  # --vela float_ops=cpu
        return TfliteSession(lower_to_tflite(proto, float_islands=islands), proto)

    def outputs(self, model, samples: Iterable[Mapping[str, np.ndarray]], names: Sequence[str] | None = None,
                session: TfliteSession | None = None) -> list[list[np.ndarray]]:
        session = session or self.session(model)
        return [session.run(names, sample) for sample in samples]


@dataclasses.dataclass
class TfliteAccuracy:
    """Output SQNR (dB) over the held-out samples, three ways (module docstring)."""

    samples: int
    tflite_vs_float: float
    qdq_vs_float: float
    tflite_vs_qdq: float
    outputs: dict[str, float]  # per output, TFLite vs float

    # the device interface's names (opfuse.targets.qnn.device): the device's run, ONNX Runtime's CPU QDQ
    @property
    def htp_vs_float(self) -> float:
        return self.tflite_vs_float

    @property
    def cpu_vs_float(self) -> float:
        return self.qdq_vs_float

    @property
    def htp_vs_cpu(self) -> float:
        return self.tflite_vs_qdq

    def sentence(self) -> str:
        return (f"the TFLite in LiteRT {self.tflite_vs_float:.1f} dB against float; the QDQ ONNX on ONNX Runtime's "
                f"CPU {self.qdq_vs_float:.1f} dB; the two agree to {self.tflite_vs_qdq:.1f} dB "
                f"({self.samples} held-out sample(s))")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def tflite_accuracy(float_model: onnx.ModelProto, qdq_model: onnx.ModelProto,
                    samples: Sequence[Mapping[str, np.ndarray]], *, session: TfliteSession | None = None,
                    runner: TfliteRunner | None = None) -> TfliteAccuracy:
    """The three SQNRs of ``qdq_model`` over ``samples`` (``session``: its TFLite already open;
    else ``runner`` lowers it)."""
    names = [o.name for o in float_model.graph.output]
    samples = [dict(s) for s in samples]
    on_tflite = (runner or TfliteRunner()).outputs(qdq_model, samples, names, session=session)
    return TfliteAccuracy(len(samples), *three_way(float_model, qdq_model, samples, on_tflite, names))


def _proto(model) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    import onnx_ir as ir  # (an onnx-ir model from optimize)

    return ir.serde.serialize_model(model)
