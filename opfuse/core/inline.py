"""Large models whose weights are inline in the ``.onnx`` file: read without parsing the weights, and
written one tensor at a time.

A TorchScript export keeps its weights in the protobuf itself. Parsing such a file holds its bytes
and the parsed message at once (twice the weights), and onnx-ir's tensors then view the parsed
message for the whole run (the weights once more, in the process's own memory); serialising it
back builds the whole message, then its bytes (twice again). Both are avoidable, because a tensor's
``raw_data`` is a contiguous run of bytes in the file:

* :func:`read_mapped` scans the file's protobuf wire format (no parse of the weights) and returns
  the model without its large initializers' bytes, each replaced by a reference to where they are
  in the file; :func:`map_weights` then makes each a :class:`MappedTensor`, a read-only array over
  a memory map of the file, which the page cache holds, not the process (and whose resident pages
  :func:`opfuse.runtime.drop_resident_pages` gives back). The map holds the file's inode, so
  replacing the file (``--overwrite``) does not change the weights under the run. A tensor stored
  otherwise than in ``raw_data`` (or with a field this does not read) is parsed, as before; a file
  with external data anywhere, a repeated ``graph`` field or a layout this does not read is not
  mapped at all (None): it is read as a whole, as before.
* :func:`write_inline` writes a model as one protobuf, as ``onnx_ir.save`` without external data
  does and to the same bytes, but streamed: the model is serialised once without its main graph's
  initializers, then each initializer is written from its own bytes (a :class:`MappedTensor`'s
  read from its file, never through the map), with the lengths of the enclosing ``graph`` field
  computed first. Protobuf writes a message's fields in the order of their numbers, and the
  serialisation of a message is the concatenation of its fields', so the pieces (the model's
  fields before ``graph`` = 7; the graph's ``node`` = 1 and ``name`` = 2; each ``initializer`` =
  5; the graph's fields from ``doc_string`` = 10 on; the model's from ``opset_import`` = 8 on) make
  the one message. A single ``graph`` field is written: a reader that replaces a repeated message
  field rather than merging it (Netron's) would see only the last. At most one tensor is in the
  process's memory at a time, beyond the model itself.
"""

from __future__ import annotations

__all__ = ["read_mapped", "map_weights", "write_inline", "MappedTensor", "MAPPED_FILE_BYTES", "MAPPED_MIN_TENSOR",
           "STREAMED_BYTES", "MAPPED_LOCATION", "streams"]

import contextlib
import math
import mmap
import os
import sys

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

MAPPED_FILE_BYTES = 1 << 26  # a model file this large has its inline weights mapped (read_mapped)
MAPPED_MIN_TENSOR = 1 << 20  # an initializer this large is mapped (smaller ones, shapes among them, are parsed)
STREAMED_BYTES = 1 << 26  # a model whose main-graph initializers hold this much is written streamed (write_inline)
MAPPED_LOCATION = "opfuse-mapped-inline"  # the location of a mapped initializer's reference (never a file)
_COPY_CHUNK = 1 << 24  # bytes read from a mapped file at a time when one is written

# protobuf wire types
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
# the fields this module reads or writes: ModelProto.graph, GraphProto.initializer, and TensorProto's
_MODEL_GRAPH, _GRAPH_INITIALIZER = 7, 5
_DIMS, _DATA_TYPE, _NAME, _RAW_DATA, _DOC_STRING, _EXTERNAL_DATA, _DATA_LOCATION = 1, 2, 8, 9, 12, 13, 14
_MAPPABLE_FIELDS = {_DIMS, _DATA_TYPE, _NAME, _RAW_DATA, _DOC_STRING}  # a tensor with any other is parsed


class _Unusual(Exception):
    """The file is not laid out as :func:`read_mapped` maps (it is read as a whole instead)."""


# -- the wire format --------------------------------------------------------------------------------

def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise _Unusual("a varint longer than 10 bytes")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tag(number: int, wire: int) -> bytes:
    return _encode_varint(number << 3 | wire)


def _fields(buf, start: int, end: int):
    """(number, wire type, start of the field, start of its value, end) of each field in ``buf[start:end]``."""
    pos = start
    while pos < end:
        tag, value_start = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            _, value_end = _varint(buf, value_start)
        elif wire == _I64:
            value_end = value_start + 8
        elif wire == _I32:
            value_end = value_start + 4
        elif wire == _LEN:
            length, value_start = _varint(buf, value_start)
            value_end = value_start + length
        else:  # (groups: not in ONNX)
            raise _Unusual(f"wire type {wire}")
        if value_end > end or number == 0:
            raise _Unusual("a field past the end of its message")
        yield number, wire, pos, value_start, value_end
        pos = value_end


# -- reading ------------------------------------------------------------------------------------------

class _MappedFile:
    """A model file mapped read-only, with a descriptor of its own (the writer reads it by ``pread``,
    not through the map, so writing a tensor does not make its pages resident in the process)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        try:
            self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(self.fd)
            raise

    def copy_to(self, out, offset: int, length: int) -> None:
        """``length`` bytes from ``offset`` written to the file object ``out``, a chunk at a time."""
        while length > 0:
            chunk = self._read(min(length, _COPY_CHUNK), offset)
            if not chunk:
                raise OSError(f"{self.path}: ended before its tensor's bytes")
            out.write(chunk)
            offset += len(chunk)
            length -= len(chunk)

    def _read(self, size: int, offset: int) -> bytes:
        if hasattr(os, "pread"):
            return os.pread(self.fd, size, offset)
        with open(self.path, "rb") as f:  # (no pread: Windows, where a mapped file cannot be replaced)
            f.seek(offset)
            return f.read(size)

    def drop_pages(self) -> None:
        """The map's resident pages given back (a later read faults them in again from the page cache)."""
        with contextlib.suppress(ValueError, OSError, AttributeError):  # (closed; no madvise on this platform)
            self.map.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """For a file nothing was mapped from (a tensor's array keeps the map open)."""
        with contextlib.suppress(BufferError):
            self.map.close()
        self.__del__()

    def __del__(self):
        with contextlib.suppress(OSError, AttributeError, TypeError):
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


class MappedTensor(ir.Tensor):
    """An initializer read where it is in the file it was loaded from: a read-only array over the
    file's map (:func:`map_weights`). A tensor like any other (immutable, as onnx-ir's tensors are);
    :meth:`tofile` copies its bytes from the file without reading them through the map."""

    __slots__ = ("source", "offset")

    def __init__(self, source: _MappedFile, offset: int, length: int, dtype: ir.DataType, shape: ir.Shape, *,
                 name: str | None = None, doc_string: str | None = None):
        count = length // int(dtype.itemsize)
        array = np.frombuffer(source.map, dtype=dtype.numpy(), count=count, offset=offset).reshape(shape.numpy())
        super().__init__(array, dtype=dtype, shape=shape, name=name, doc_string=doc_string)
        self.source, self.offset = source, offset

    def tofile(self, file) -> None:
        file.flush()
        self.source.copy_to(file, self.offset, self.nbytes)


def _mappable_dtype(data_type: int) -> ir.DataType | None:
    """The dtype of ``data_type`` where its ``raw_data`` is the array's own bytes (whole bytes per
    element, not strings), else None."""
    try:
        dtype = ir.DataType(data_type)
    except ValueError:
        return None
    if dtype in (ir.DataType.STRING, ir.DataType.UNDEFINED) or dtype.itemsize < 1 or dtype.itemsize % 1:
        return None
    try:
        dtype.numpy()
    except (TypeError, ValueError, NotImplementedError):
        return None
    return dtype


def _dims(buf, wire: int, start: int, end: int) -> list[int]:
    if wire == _VARINT:
        return [_varint(buf, start)[0]]
    dims, pos = [], start  # (packed)
    while pos < end:
        dim, pos = _varint(buf, pos)
        dims.append(dim)
    return dims


def _strip_tensor(buf, start: int, end: int) -> bytes | None:
    """The TensorProto at ``buf[start:end]`` with its ``raw_data`` replaced by a reference to where it
    is (:data:`MAPPED_LOCATION`, its offset in ``buf``); None for a tensor that stays as it is
    (small, or anything unusual)."""
    seen: dict[int, int] = {}
    raw = None
    data_type = 0
    dims: list[int] = []
    for number, wire, _, value_start, value_end in _fields(buf, start, end):
        seen[number] = seen.get(number, 0) + 1
        if number not in _MAPPABLE_FIELDS:
            return None
        if number == _RAW_DATA:
            raw = (value_start, value_end)
        elif number == _DATA_TYPE and wire == _VARINT:
            data_type = _varint(buf, value_start)[0]
        elif number == _DIMS:
            dims.extend(_dims(buf, wire, value_start, value_end))
    if raw is None or any(seen.get(n, 0) > 1 for n in (_DATA_TYPE, _NAME, _RAW_DATA, _DOC_STRING)):
        return None
    length = raw[1] - raw[0]
    dtype = _mappable_dtype(data_type)
    if length < MAPPED_MIN_TENSOR or dtype is None or any(d >= 1 << 63 for d in dims):  # (a negative dim)
        return None
    if math.prod(dims) * int(dtype.itemsize) != length:
        return None
    kept = bytearray()
    for number, _, field_start, _, value_end in _fields(buf, start, end):
        if number != _RAW_DATA:
            kept += buf[field_start:value_end]
    kept += _tag(_DATA_LOCATION, _VARINT) + _encode_varint(onnx.TensorProto.EXTERNAL)
    for key, value in (("location", MAPPED_LOCATION), ("offset", str(raw[0])), ("length", str(length))):
        entry = onnx.StringStringEntryProto(key=key, value=value).SerializeToString()
        kept += _tag(_EXTERNAL_DATA, _LEN) + _encode_varint(len(entry)) + entry
    return bytes(kept)


def _external_elsewhere(proto: onnx.ModelProto) -> bool:
    """Whether a tensor of ``proto`` other than a mapped one has external data (in a graph, a subgraph,
    a function or an attribute)."""
    def external(t: onnx.TensorProto) -> bool:
        return t.data_location == onnx.TensorProto.EXTERNAL and not any(
            e.key == "location" and e.value == MAPPED_LOCATION for e in t.external_data)

    def nodes_external(nodes) -> bool:
        for node in nodes:
            for a in node.attribute:
                if a.HasField("t") and external(a.t) or any(external(t) for t in a.tensors):
                    return True
                if a.HasField("g") and graph_external(a.g) or any(graph_external(g) for g in a.graphs):
                    return True
        return False

    def graph_external(graph: onnx.GraphProto) -> bool:
        return any(external(t) for t in graph.initializer) or any(
            external(t.values) or external(t.indices) for t in graph.sparse_initializer) or nodes_external(graph.node)

    return graph_external(proto.graph) or any(nodes_external(f.node) for f in proto.functions)


def read_mapped(path: str | os.PathLike) -> tuple[onnx.ModelProto, _MappedFile] | None:
    """The model in ``path`` with its main graph's large inline initializers (:data:`MAPPED_MIN_TENSOR`
    and more) as references to where their bytes are in the file (external data at
    :data:`MAPPED_LOCATION`, offsets in the file), and the file mapped (for :func:`map_weights`).
    None where the file is small (below :data:`MAPPED_FILE_BYTES`), the host is big-endian, nothing
    is mapped, a tensor has external data (the checker reads its file beside the model's), or the
    file is laid out otherwise than this reads (it is then read as a whole)."""
    if sys.byteorder != "little":
        return None
    try:
        if os.path.getsize(path) < MAPPED_FILE_BYTES:
            return None
        source = _MappedFile(path)
    except (OSError, ValueError):
        return None
    buf = source.map
    try:
        top = list(_fields(buf, 0, len(buf)))
        graphs = [f for f in top if f[0] == _MODEL_GRAPH]
        if len(graphs) != 1 or graphs[0][1] != _LEN:
            source.close()
            return None
        _, _, graph_field, graph_start, graph_end = graphs[0]
        pieces: list[bytes] = []
        span = graph_start
        mapped = 0
        for number, wire, field_start, value_start, value_end in _fields(buf, graph_start, graph_end):
            if number != _GRAPH_INITIALIZER or wire != _LEN:
                continue
            stripped = _strip_tensor(buf, value_start, value_end)
            if stripped is None:
                continue
            pieces.append(buf[span:field_start])
            pieces.append(_tag(_GRAPH_INITIALIZER, _LEN) + _encode_varint(len(stripped)) + stripped)
            span = value_end
            mapped += 1
        if not mapped:
            source.close()
            return None
        pieces.append(buf[span:graph_end])
        graph = b"".join(pieces)
        del pieces
        model = buf[:graph_field] + _tag(_MODEL_GRAPH, _LEN) + _encode_varint(len(graph)) + graph + buf[graph_end:]
        del graph
        proto = onnx.ModelProto()
        proto.ParseFromString(model)
        if _external_elsewhere(proto):  # (checked with its files, by path: read as a whole)
            source.close()
            return None
    except (_Unusual, IndexError, ValueError, RuntimeError, DecodeError):  # (read as a whole, which says why)
        source.close()
        return None
    return proto, source


def map_weights(model: ir.Model, source: _MappedFile) -> None:
    """Each main-graph initializer :func:`read_mapped` left as a reference becomes a :class:`MappedTensor`
    over ``source`` (in place)."""
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if isinstance(tensor, ir.ExternalTensor) and os.fspath(tensor.location) == MAPPED_LOCATION:
            value.const_value = MappedTensor(source, tensor.offset, tensor.length, tensor.dtype, tensor.shape,
                                             name=tensor.name, doc_string=tensor.doc_string)


# -- writing ------------------------------------------------------------------------------------------

def streams(model: ir.Model) -> bool:
    """Whether :class:`opfuse.save.StagedModel` writes ``model`` inline with :func:`write_inline`: its
    main graph's initializers hold :data:`STREAMED_BYTES` or more (below, ``onnx_ir.save``, whose bytes
    are the same)."""
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            total += value.const_value.nbytes
            if total >= STREAMED_BYTES:
                return True
    return False


def _split(message, number: int) -> tuple[bytes, bytes]:
    """``message``'s serialisation as (its fields numbered below ``number``, those above)."""
    low, high = type(message)(), type(message)()
    low.CopyFrom(message)
    high.CopyFrom(message)
    for field, _ in message.ListFields():
        (high if field.number < number else low).ClearField(field.name)
    return low.SerializeToString(), high.SerializeToString()


class _Header:
    """What ``onnx_ir.serde.serialize_tensor_into`` reads of a tensor, without its bytes."""

    def __init__(self, tensor, name: str):
        self.name, self.doc_string, self.dtype, self.shape = name, tensor.doc_string, tensor.dtype, tensor.shape
        self.metadata_props = tensor.metadata_props

    def tobytes(self) -> bytes:
        return b""

    def __repr__(self) -> str:
        return f"the header of tensor {self.name!r}"


def _plain(tensor) -> bool:
    """Whether onnx-ir serialises ``tensor`` as its fields and ``raw_data = tensor.tobytes()`` (not a
    parsed proto's copy, an external reference, or strings)."""
    return not isinstance(tensor, (ir.serde.TensorProtoTensor, ir.ExternalTensor, ir.StringTensor))


class _Piece:
    """One initializer as written: its TensorProto before and after ``raw_data``, and the tensor whose
    bytes go between (a plain tensor); or the whole serialised TensorProto (``whole``)."""

    def __init__(self, value: ir.Value):
        tensor = value.const_value
        self.tensor, self.whole = tensor, None
        if _plain(tensor):
            header = onnx.TensorProto()
            ir.serde.serialize_tensor_into(header, _Header(tensor, value.name))
            header.ClearField("raw_data")
            self.low, self.high = _split(header, _RAW_DATA)
            self.nbytes = tensor.nbytes
            self.size = len(self.low) + len(_tag(_RAW_DATA, _LEN)) + len(_encode_varint(self.nbytes)) + self.nbytes
            self.size += len(self.high)
        else:
            self.size = ir.serde.serialize_tensor(tensor).ByteSize()

    def write(self, f) -> None:
        f.write(_tag(_GRAPH_INITIALIZER, _LEN) + _encode_varint(self.size))
        if not _plain(self.tensor):
            data = ir.serde.serialize_tensor(self.tensor).SerializeToString()
            if len(data) != self.size:
                raise RuntimeError(f"tensor {self.tensor.name!r}: {len(data)} bytes, {self.size} expected")
            f.write(data)
            return
        f.write(self.low + _tag(_RAW_DATA, _LEN) + _encode_varint(self.nbytes))
        f.flush()
        before = f.tell()
        self.tensor.tofile(f)
        f.flush()
        if f.tell() - before != self.nbytes:
            raise RuntimeError(f"tensor {self.tensor.name!r}: {f.tell() - before} bytes written, {self.nbytes} "
                               "expected")
        f.write(self.high)


def _refuse_own_source(tensors, path: str | os.PathLike) -> None:
    """A :class:`MappedTensor`'s bytes are read from its file while the model is written: writing over
    that file would truncate them first (:class:`opfuse.save.StagedModel` writes to a new file)."""
    try:
        written = os.stat(path)
    except OSError:
        return
    for tensor in tensors:
        if isinstance(tensor, MappedTensor):
            source = os.fstat(tensor.source.fd)
            if (source.st_dev, source.st_ino) == (written.st_dev, written.st_ino):
                raise ValueError(f"{os.fspath(path)}: the file the model's weights are read from; write to another "
                                 "path and rename it")


def write_inline(model: ir.Model, path: str | os.PathLike) -> None:
    """Write ``model`` to ``path`` as one protobuf with its weights inline: the bytes ``onnx_ir.save(model,
    path)`` writes, with at most one tensor in memory at a time beyond the model (the module's
    docstring says how). Each main-graph initializer's tensor is named as its value, as onnx-ir's
    serialiser names it."""
    values = [v for v in model.graph.initializers.values() if v.const_value is not None]
    tensors = [v.const_value for v in values]
    _refuse_own_source(tensors, path)
    try:  # (the model serialised with a reference in place of each of these tensors: no bytes)
        for value, tensor in zip(values, tensors):
            value.const_value = ir.ExternalTensor(MAPPED_LOCATION, None, None, tensor.dtype, shape=tensor.shape,
                                                  name=value.name)
        proto = ir.serde.serialize_model(model)
    finally:
        for value, tensor in zip(values, tensors):
            value.const_value = tensor
    has_graph = proto.HasField("graph")
    if [t.name for t in proto.graph.initializer] != [v.name for v in values]:
        raise RuntimeError("the serialised graph's initializers are not the model's")
    for value, tensor in zip(values, tensors):
        tensor.name = value.name  # (as onnx-ir's serialiser does)
    graph = onnx.GraphProto()
    graph.CopyFrom(proto.graph)
    graph.ClearField("initializer")
    proto.ClearField("graph")
    model_low, model_high = _split(proto, _MODEL_GRAPH)
    graph_low, graph_high = _split(graph, _GRAPH_INITIALIZER)
    del proto, graph
    pieces = [_Piece(v) for v in values]
    graph_size = len(graph_low) + len(graph_high) + sum(
        len(_tag(_GRAPH_INITIALIZER, _LEN)) + len(_encode_varint(p.size)) + p.size for p in pieces)
    with open(path, "wb") as f:
        f.write(model_low)
        if has_graph or graph_size:
            f.write(_tag(_MODEL_GRAPH, _LEN) + _encode_varint(graph_size) + graph_low)
        for piece in pieces:
            piece.write(f)
        f.write(graph_high + model_high)
