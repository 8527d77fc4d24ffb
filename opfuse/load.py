"""Step 1 of the pipeline: read a model and decide whether opfuse can handle it.

Accepts a path, raw bytes, an ``onnx.ModelProto`` or an ``onnx_ir.Model`` and returns a
private ``onnx_ir.Model``: the caller's object is never mutated. Anything opfuse cannot
handle raises :class:`~opfuse.errors.BadInputError` with one line that says why: a missing
path, a directory, an empty file, bytes that are not an ONNX protobuf (truncated, random),
a model that fails ``onnx.checker``, a node that onnx's own shape inference rejects (a
BatchNormalization with ``training_mode=1`` and one output: onnx.checker alone does not infer
shapes, and ONNX Runtime refuses such a model when it builds a session, deep inside the
pipeline; :func:`_inference_problem`), or an IR version / opset outside the supported range.
External data is resolved relative to the model file and stays memory-mapped. A large file whose
weights are inline (a TorchScript export) has them mapped where they are in it, not parsed
(:mod:`opfuse.core.inline`): the run holds them as it holds an external-data model's, in the page cache,
and the model is still an inline one (written back inline). The checks are the same, run on the
model without those weights' bytes (:func:`_without_mapped`).
"""

from __future__ import annotations

__all__ = ["load_model", "read_model", "SUPPORTED_OPSETS", "MAX_IR_VERSION", "LOAD_NOTES"]

import os
import pathlib
from typing import Union

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from opfuse.errors import BadInputError
from opfuse.core.ops import MS_DOMAIN, ONNX_DOMAINS, first_line
from opfuse.core.inline import MAPPED_LOCATION, map_weights, read_mapped

ModelSource = Union[str, os.PathLike, bytes, onnx.ModelProto, ir.Model]

MAX_IR_VERSION = onnx.IR_VERSION
# BatchNormalization-6 is the oldest form opfuse folds; newer opsets than the installed
# onnx knows cannot be checked.
SUPPORTED_OPSETS = range(6, onnx.defs.onnx_opset_version() + 1)


def load_model(source: ModelSource, *, check: bool = True) -> tuple[ir.Model, str]:
    """Return (a private onnx_ir.Model, a display name) for ``source``."""
    if isinstance(source, ir.Model):
        return source.clone(), source.graph.name or "<model>"
    if isinstance(source, onnx.ModelProto):
        private = onnx.ModelProto()
        private.CopyFrom(source)  # onnx-ir's tensors view the proto: never touch the caller's
        notes = _check_proto(private, "<ModelProto>", check=check, path=None)
        return _with_notes(ir.serde.deserialize_model(private), notes), source.graph.name or "<ModelProto>"
    if isinstance(source, (bytes, bytearray)):
        proto = _parse(bytes(source), "<bytes>")
        notes = _check_proto(proto, "<bytes>", check=check, path=None)
        return _with_notes(ir.serde.deserialize_model(proto), notes), proto.graph.name or "<bytes>"
    if isinstance(source, (str, os.PathLike)):
        path = pathlib.Path(source)
        mapped = read_mapped(path) if path.is_file() else None
        if mapped is None:
            proto = _parse(_read(path), str(path))
            notes = _check_proto(proto, str(path), check=check, path=path)
        else:  # (its large inline weights mapped where they are: opfuse.core.inline)
            proto = mapped[0]
            _check_parsed(proto, str(path))
            notes = _check_proto(proto, str(path), check=check, path=None, mapped=True)
        model = _with_notes(ir.serde.deserialize_model(proto), notes)
        del proto
        if mapped is not None:
            map_weights(model, mapped[1])
        ir.external_data.set_base_dir(model.graph, str(path.resolve().parent))
        return model, str(path)
    raise BadInputError(
        f"cannot load a model from a {type(source).__name__}; "
        "give a path, bytes, an onnx.ModelProto or an onnx_ir.Model"
    )


def read_model(path: str | os.PathLike) -> ir.Model:
    """The model in ``path`` as ``onnx_ir.load`` reads it (external data from beside it), unchecked;
    a large file's inline weights mapped where they are (:mod:`opfuse.core.inline`), not parsed."""
    mapped = read_mapped(path)
    if mapped is None:
        return ir.load(path)
    model = ir.serde.deserialize_model(mapped[0])
    map_weights(model, mapped[1])
    ir.external_data.set_base_dir(model.graph, os.path.dirname(os.fspath(path)))
    return model


def _read(path: pathlib.Path) -> bytes:
    if not path.exists():
        raise BadInputError(f"{path}: no such file")
    if path.is_dir():
        raise BadInputError(f"{path}: is a directory, not an ONNX file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BadInputError(f"{path}: cannot read ({e.strerror or e})") from None
    if not data:
        raise BadInputError(f"{path}: the file is empty")
    return data


def _parse(data: bytes, where: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise BadInputError(
            f"{where}: not an ONNX model (the protobuf does not parse: truncated or another "
            f"format; {first_line(e, limit=None)})"
        ) from None
    _check_parsed(proto, where)
    return proto


def _check_parsed(proto: onnx.ModelProto, where: str) -> None:
    # Random bytes sometimes parse as a protobuf full of unknown fields.
    if not proto.HasField("graph") or proto.ir_version <= 0:
        raise BadInputError(f"{where}: not an ONNX model (no graph or no IR version in the file)")


def _check_proto(
    proto: onnx.ModelProto, where: str, *, check: bool, path: pathlib.Path | None, mapped: bool = False
) -> list[str]:
    """The notes of what loading repaired (in place: missing graph-output types), after the checks;
    :class:`BadInputError` for what fails them. ``mapped``: ``proto`` is from
    :func:`opfuse.core.inline.read_mapped`, checked as :func:`_without_mapped` has it."""
    checked = _without_mapped if mapped else (lambda p: p)
    if proto.ir_version > MAX_IR_VERSION:
        raise BadInputError(
            f"{where}: IR version {proto.ir_version} is newer than the {MAX_IR_VERSION} "
            f"this installation understands (onnx {onnx.__version__})"
        )
    for opset in proto.opset_import:
        if opset.domain in ONNX_DOMAINS and opset.version not in SUPPORTED_OPSETS:
            raise BadInputError(
                f"{where}: ONNX opset {opset.version} is outside the supported range "
                f"{SUPPORTED_OPSETS.start}-{SUPPORTED_OPSETS.stop - 1}"
            )
    if not check:
        return []
    try:
        # Checking the file lets the checker resolve external data and >2 GB models.
        onnx.checker.check_model(str(path) if path is not None else checked(proto))
    except (onnx.checker.ValidationError, onnx.onnx_cpp2py_export.checker.ValidationError) as e:
        message = first_line(e, limit=None)
        if _runtime_op_unknown(message):  # ONNX Runtime's own op in the ONNX domain (opfuse writes them)
            return _check_runtime_ops(proto, where)
        if "is required but missing" not in message or not _fill_output_types(proto):
            raise BadInputError(f"{where}: invalid ONNX model: {message}") from None
        try:
            onnx.checker.check_model(checked(proto))
        except Exception:  # noqa: BLE001 - the repair did not satisfy the checker
            raise BadInputError(f"{where}: invalid ONNX model: {message}") from None
        return [f"{where}: {message} (onnx.checker); the missing graph-output types and shapes "
                "were inferred"]
    except (ValueError, OSError, RuntimeError) as e:
        raise BadInputError(f"{where}: invalid ONNX model: {first_line(e, limit=None)}") from None
    problem = _inference_problem(proto)
    if problem:
        raise BadInputError(f"{where}: invalid ONNX model: {problem}")
    return []


# ONNX Runtime registers a few ops of its own in the ONNX domain, which onnx's schemas do not have:
# SimplifiedLayerNormalization (what ``--target onnxruntime`` writes for an RMSNorm, as ONNX Runtime's
# own fusion does) and, below opset 17, its LayerNormalization. onnx.checker refuses a node of them
# ("No Op registered for ..."), so opfuse's own output could not be its input.
RUNTIME_ONNX_DOMAIN_OPS = frozenset({"SimplifiedLayerNormalization", "LayerNormalization"})
_STAND_IN_DOMAIN = MS_DOMAIN  # (the checker and shape inference pass over an op of another domain)


def _runtime_op_unknown(message: str) -> bool:
    return message.startswith("No Op registered for ") and message.split()[4] in RUNTIME_ONNX_DOMAIN_OPS


def _check_runtime_ops(proto: onnx.ModelProto, where: str) -> list[str]:
    """The checks of :func:`_check_proto` on a stand-in of ``proto`` whose ONNX Runtime ops
    (:data:`RUNTIME_ONNX_DOMAIN_OPS`) are in another domain, so that the checker passes over
    them and checks everything else; the model loaded keeps them as they are. The main graph's
    initializers with external data are graph inputs of the stand-in: the check of the file, which
    stopped at such a node, had checked them, as it checks initializers before nodes, and the
    stand-in, checked in memory, cannot reach the files beside the model."""
    stand_in = onnx.ModelProto()
    stand_in.CopyFrom(proto)
    moved = 0
    for graph in _graphs(stand_in):
        for node in graph.node:
            if node.domain in ONNX_DOMAINS and node.op_type in RUNTIME_ONNX_DOMAIN_OPS and (
                    node.op_type != "LayerNormalization" or not onnx.defs.has(node.op_type, _onnx_opset(stand_in))):
                node.domain = _STAND_IN_DOMAIN
                moved += 1
    if not any(o.domain == _STAND_IN_DOMAIN for o in stand_in.opset_import):
        stand_in.opset_import.append(onnx.helper.make_opsetid(_STAND_IN_DOMAIN, 1))
    external = [t for t in stand_in.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    for tensor in external:
        stand_in.graph.initializer.remove(tensor)
        stand_in.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims))
    try:
        onnx.checker.check_model(stand_in)
    except (onnx.checker.ValidationError, onnx.onnx_cpp2py_export.checker.ValidationError, ValueError) as e:
        raise BadInputError(f"{where}: invalid ONNX model: {first_line(e, limit=None)}") from None
    problem = _inference_problem(stand_in)
    if problem:
        raise BadInputError(f"{where}: invalid ONNX model: {problem}")
    return []


def _onnx_opset(proto: onnx.ModelProto) -> int:
    return next((o.version for o in proto.opset_import if o.domain in ONNX_DOMAINS), 1)


def _graphs(proto: onnx.ModelProto):
    """Every graph of ``proto``: the main graph, its subgraphs, and the functions' bodies (as
    graphs of nodes) with theirs."""
    def walk(graph):
        yield graph
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from walk(attr.g)
                for sub in attr.graphs:
                    yield from walk(sub)
    yield from walk(proto.graph)
    for function in proto.functions:
        yield from walk(function)


def _inference_problem(proto: onnx.ModelProto) -> str:
    """What onnx's strict shape inference rejects in a node of ``proto`` ("" when nothing).

    Only a node's own check counts (an op's outputs against its attributes, an input's type
    against its schema): the graph's ``value_info`` annotations are taken out for the run (and
    put back), since a stale annotation that disagrees with the inferred shape is the
    exporter's note, which ONNX Runtime runs past; an error that is such a merge with a
    declared output shape (onnx says "existing") is not counted either. The main graph's large
    initializers (above :data:`INFERENCE_DATA_LIMIT`: weights, whose values no op's inference
    reads, unlike a shape's) go to the inference as typed graph inputs without their bytes
    (:func:`_weightless`): the same checks, without the serialised copies of the weights onnx's
    inference makes (the model in and the model out, each in Python and in C++). A model whose
    serialised graph still exceeds protobuf's 2 GB cannot be inferred in memory: not checked."""
    light = _weightless(proto)
    annotations = list(light.graph.value_info) if light is proto else []
    del light.graph.value_info[:]
    try:
        onnx.shape_inference.infer_shapes(light, strict_mode=True)
    except onnx.shape_inference.InferenceError as e:
        message = first_line(e, limit=None)
        return "" if "existing" in message else message
    except (ValueError, RuntimeError):  # too large to serialise, or not inferable at all: not our verdict
        return ""
    finally:
        if light is proto:
            proto.graph.value_info.extend(annotations)
    return ""


INFERENCE_DATA_LIMIT = 1 << 20  # bytes: a main-graph initializer above this goes to the strict inference as a typed input


def _weightless(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` itself when no main-graph initializer is above :data:`INFERENCE_DATA_LIMIT`; else a
    model of the same opsets, functions and graph (nodes, inputs, outputs, the small initializers)
    whose large initializers are typed graph inputs of their dtype and shape, without their bytes,
    and with no ``value_info`` (what :func:`_inference_problem` runs on)."""
    graph = proto.graph
    large = [t for t in graph.initializer if _is_mapped(t)
             or t.data_location != onnx.TensorProto.EXTERNAL and t.ByteSize() > INFERENCE_DATA_LIMIT]
    if not large:
        return proto
    light = onnx.ModelProto(ir_version=proto.ir_version, domain=proto.domain, model_version=proto.model_version)
    light.opset_import.extend(proto.opset_import)
    light.functions.extend(proto.functions)
    light.graph.name = graph.name
    light.graph.node.extend(graph.node)
    light.graph.input.extend(graph.input)
    light.graph.output.extend(graph.output)
    light.graph.sparse_initializer.extend(graph.sparse_initializer)
    skipped = {t.name for t in large}
    light.graph.initializer.extend(t for t in graph.initializer if t.name not in skipped)
    inputs = {v.name for v in graph.input}
    light.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims)
                             for t in large if t.name not in inputs)
    return light


LOAD_NOTES = "opfuse.load_notes"  # model.meta key: what loading repaired, one line each


def _is_mapped(tensor: onnx.TensorProto) -> bool:
    """Whether ``tensor`` is one :func:`opfuse.core.inline.read_mapped` left as a reference to its bytes."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL and any(
        e.key == "location" and e.value == MAPPED_LOCATION for e in tensor.external_data)


def _without_mapped(proto: onnx.ModelProto) -> onnx.ModelProto:
    """What the checker checks of a model from :func:`opfuse.core.inline.read_mapped`: ``proto`` with its
    mapped initializers as typed graph inputs (the checker, checking in memory, would look for their
    reference's file in the working directory; their bytes were found the size their dtype and dims
    say when they were mapped), else as it is."""
    mapped = [t for t in proto.graph.initializer if _is_mapped(t)]
    if not mapped:
        return proto
    stand_in = onnx.ModelProto()
    stand_in.CopyFrom(proto)
    names = {t.name for t in mapped}
    kept = [t for t in stand_in.graph.initializer if t.name not in names]
    del stand_in.graph.initializer[:]
    stand_in.graph.initializer.extend(kept)
    inputs = {v.name for v in stand_in.graph.input}
    stand_in.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims)
                                for t in mapped if t.name not in inputs)
    return stand_in


def _with_notes(model: ir.Model, notes: list[str]) -> ir.Model:
    if notes:
        model.meta[LOAD_NOTES] = list(notes)
    return model


def _fill_output_types(proto: onnx.ModelProto) -> bool:
    """Give graph outputs without a type or shape the ones onnx infers (in place).

    ONNX Runtime runs such models; onnx.checker and other tools want the fields. Returns
    whether every output could be completed.
    """
    incomplete = [o for o in proto.graph.output
                  if not o.type.HasField("tensor_type") or not o.type.tensor_type.HasField("shape")]
    if not incomplete:
        return False
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False)
    except Exception:  # noqa: BLE001 - onnx raises many kinds here
        return False
    known = {v.name: v for v in [*inferred.graph.output, *inferred.graph.value_info]}
    users = {d.dim_param for v in [*proto.graph.input, *proto.graph.output, *proto.graph.value_info]
             for d in v.type.tensor_type.shape.dim if d.dim_param}
    for out in incomplete:
        found = known.get(out.name)
        if found is None or not found.type.HasField("tensor_type") or not found.type.tensor_type.elem_type:
            return False
        if not out.type.HasField("tensor_type") or not out.type.tensor_type.elem_type:
            out.type.tensor_type.elem_type = found.type.tensor_type.elem_type
        if found.type.tensor_type.HasField("shape"):
            out.type.tensor_type.shape.CopyFrom(found.type.tensor_type.shape)
            for d in out.type.tensor_type.shape.dim:
                if d.dim_param and d.dim_param not in users:  # onnx's unk__N: left unnamed
                    d.ClearField("dim_param")
        else:  # rank unknown: an explicit shape of free dimensions cannot be written either
            return False
    return True
