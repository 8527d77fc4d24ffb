"""The TFLite flatbuffer a lowering writes: tensors, buffers, quantisation, op codes.

Everything goes through the object API of the schema ``ai_edge_litert`` ships
(``schema_py_generated``: ``ModelT``, ``SubGraphT``, ``TensorT``...), packed by
``flatbuffers.Builder`` with the file identifier ``TFL3``; no schema code is written here.

- buffer 0 is the empty buffer every activation tensor points at (the schema's convention);
- a constant gets a buffer of its own, little-endian, C order;
- a quantised tensor carries ``scale``/``zero_point`` lists (one entry per-tensor, one per
  channel with ``quantized_dimension`` for a per-channel weight or bias);
- an op code is registered once per builtin operator; codes above 127 are written in
  ``builtin_code`` with ``deprecated_builtin_code`` set to 127 (the schema's placeholder).
"""

from __future__ import annotations

__all__ = ["Quant", "TfliteWriter", "TFLITE_DTYPES"]

import dataclasses

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

TFLITE_DTYPES = {
    np.dtype(np.float32): schema.TensorType.FLOAT32,
    np.dtype(np.int8): schema.TensorType.INT8,
    np.dtype(np.uint8): schema.TensorType.UINT8,
    np.dtype(np.int32): schema.TensorType.INT32,
    np.dtype(np.int64): schema.TensorType.INT64,
    np.dtype(np.int16): schema.TensorType.INT16,
}
_PLACEHOLDER_CODE = 127  # BuiltinOperator.PLACEHOLDER_FOR_GREATER_OP_CODES


@dataclasses.dataclass(frozen=True)
class Quant:
    """Affine quantisation of one tensor: ``real = scale * (q - zero_point)``.

    ``scale`` and ``zero_point`` hold one value (per-tensor) or one per channel along ``axis``."""

    scale: np.ndarray
    zero_point: np.ndarray
    axis: int = 0

    @property
    def per_channel(self) -> bool:
        return self.scale.size > 1

    def scalar(self) -> tuple[float, int]:
        """(scale, zero point) of a per-tensor quantisation."""
        return float(self.scale.reshape(-1)[0]), int(self.zero_point.reshape(-1)[0])


class TfliteWriter:
    """One subgraph under construction; :meth:`finish` packs the model."""

    def __init__(self, description: str = "opfuse") -> None:
        self._description = description
        self._tensors: list[schema.TensorT] = []
        self._buffers: list[schema.BufferT] = [schema.BufferT()]
        self._opcodes: dict[int, int] = {}
        self._operators: list[schema.OperatorT] = []

    def tensor(self, name: str, shape, dtype, *, data: np.ndarray | None = None,
               quant: Quant | None = None) -> int:
        """Add a tensor (a constant when ``data`` is given) and return its index."""
        t = schema.TensorT()
        t.name = name
        t.shape = [int(d) for d in shape]
        t.type = TFLITE_DTYPES[np.dtype(dtype)]
        t.buffer = 0
        if data is not None:
            array = np.ascontiguousarray(data, dtype=np.dtype(dtype).newbyteorder("<"))
            assert tuple(array.shape) == tuple(t.shape), (name, array.shape, t.shape)
            buf = schema.BufferT()
            buf.data = np.frombuffer(array.tobytes(), dtype=np.uint8)
            self._buffers.append(buf)
            t.buffer = len(self._buffers) - 1
        if quant is not None:
            q = schema.QuantizationParametersT()
            q.scale = [float(s) for s in np.asarray(quant.scale, np.float64).reshape(-1)]
            q.zeroPoint = [int(z) for z in np.asarray(quant.zero_point).reshape(-1)]
            q.quantizedDimension = int(quant.axis) if quant.per_channel else 0
            t.quantization = q
        self._tensors.append(t)
        return len(self._tensors) - 1

    def shape(self, index: int) -> list[int]:
        return list(self._tensors[index].shape)

    def dtype(self, index: int) -> int:
        return self._tensors[index].type

    def op(self, builtin: int, inputs: list[int], outputs: list[int],
           options=None, options_type: int = 0) -> None:
        """Add an operator; ``-1`` in ``inputs`` is an omitted optional input."""
        if builtin not in self._opcodes:
            self._opcodes[builtin] = len(self._opcodes)
        o = schema.OperatorT()
        o.opcodeIndex = self._opcodes[builtin]
        o.inputs = list(inputs)
        o.outputs = list(outputs)
        if options is not None:
            o.builtinOptionsType = options_type
            o.builtinOptions = options
        self._operators.append(o)

    @property
    def op_count(self) -> int:
        return len(self._operators)

    def finish(self, inputs: list[int], outputs: list[int]) -> bytes:
        """The model as TFLite flatbuffer bytes."""
        sub = schema.SubGraphT()
        sub.tensors = self._tensors
        sub.inputs = list(inputs)
        sub.outputs = list(outputs)
        sub.operators = self._operators
        sub.name = "main"
        model = schema.ModelT()
        model.version = 3
        model.description = self._description
        model.buffers = self._buffers
        model.subgraphs = [sub]
        codes = [None] * len(self._opcodes)
        for builtin, index in self._opcodes.items():
            code = schema.OperatorCodeT()
            code.builtinCode = builtin
            code.deprecatedBuiltinCode = min(builtin, _PLACEHOLDER_CODE)
            code.version = 1
            codes[index] = code
        model.operatorCodes = codes
        builder = flatbuffers.Builder(1024)
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())
