"""Running models on ONNX Runtime's CPU provider: sessions, levels, the runtime's own graph.

One place for what verification (:mod:`opfuse.verify`), the layout check
(:mod:`opfuse.targets.onnxruntime`) and the benchmarks (:mod:`opfuse.bench.measure`)
all need:

- :data:`RUNTIME_LEVELS` - graph-optimisation levels by the names the CLI uses (defined in
  :mod:`opfuse.targets`);
- :func:`create_session` - a session for an ``onnx_ir.Model``, ``ModelProto`` or bytes;
  a model too large for one protobuf (or with external data) goes through a temporary
  file with external data, or, with ``share_weights``, one with external data or large weights
  (:func:`weights_shared`) hands its weights to the runtime where they are (:func:`shared_weights`:
  no serialised copy, external data stays mapped from its own file);
- :func:`optimized_graph` - the graph the runtime actually runs at a level (its own
  fusions and layout changes applied), as a ``ModelProto`` without weights loaded.
"""

from __future__ import annotations

__all__ = ["RUNTIME_LEVELS", "session_options", "create_session", "serialized", "weights_shared", "optimized_graph",
           "shared_weights",
           "session_with_weights", "drop_resident_pages", "give_back_memory"]

import contextlib
import ctypes
import gc
import ctypes.util
import mmap
import os
import sys
import tempfile

import numpy as np

import onnx
import onnx_ir as ir
import onnxruntime as ort

from opfuse.core.analysis import tensor_nbytes
from opfuse.core.inline import MappedTensor
from opfuse.save import needs_external_data
from opfuse.targets import RUNTIME_LEVELS


def session_options(
    level: str = "disabled",
    threads: int | None = None,
    *,
    profile_prefix: str | None = None,
    optimized_path: str | None = None,
    prepack: bool = True,
    cpu_arena: bool = True,
):
    """SessionOptions: the level, threads (None: the runtime's default), no spinning,
    sequential execution, quiet logs; optionally profiling or dumping the optimised graph.
    ``prepack`` False: no kernel keeps its own repacked copy of a constant weight (MatMul's), so a
    session reads the weights where they are (external data stays mapped from its file): what
    verification wants, where time does not matter and a second copy of the weights would.
    ``cpu_arena`` False: memory a run frees goes back to the system, not to the runtime's arena
    (a run whose intermediate values are large and short-lived: the float64 reference's weights)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, RUNTIME_LEVELS[level])
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.log_severity_level = 4  # fatal only: its errors reach the user as exceptions, in one line
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    if optimized_path is not None:
        options.optimized_model_filepath = optimized_path
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    options.enable_cpu_mem_arena = cpu_arena
    return options


def model_source(model: ir.Model | onnx.ModelProto | bytes | str, workdir: str) -> bytes | str:
    """What ``InferenceSession`` accepts: bytes, or a path for models with external data."""
    if isinstance(model, (bytes, str)):
        return model
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString()
    if not needs_external_data(model):
        return ir.serde.serialize_model(model).SerializeToString()
    fd, path = tempfile.mkstemp(suffix=".onnx", dir=workdir)
    os.close(fd)
    ir.save(model, path, external_data=os.path.basename(path) + ".data")
    return path


def serialized(model: ir.Model) -> ir.Model | bytes:
    """``model`` as bytes for :func:`create_session`, serialised once for several sessions
    (a model whose sessions take its weights as they are, :func:`weights_shared`, stays as it is)."""
    if weights_shared(model):
        return model
    return ir.serde.serialize_model(model).SerializeToString()


SHARED_TOTAL_BYTES = 1 << 26  # a model whose initializers hold this much gives a session its weights as they are


def weights_shared(model: ir.Model) -> bool:
    """Whether ``create_session(model, share_weights=True)`` gives the runtime ``model``'s weights as
    they are (:func:`shared_weights`) rather than a serialised copy: a model that needs external data,
    or whose main-graph initializers hold :data:`SHARED_TOTAL_BYTES` or more (a serialised copy held
    for all of verification's sessions, and each session's own copy of it, would be two more)."""
    if needs_external_data(model):
        return True
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            total += tensor_nbytes(value.const_value)
    return total >= SHARED_TOTAL_BYTES


def create_session(model, level: str = "disabled", threads: int | None = None, *, share_weights: bool = False,
                   **options):
    """An InferenceSession on the CPU provider (the runtime keeps the weights it loaded).
    ``share_weights``: an ``onnx_ir.Model`` that :func:`weights_shared` says so of gives the runtime
    its weights as they are (:func:`shared_weights`), not a serialised copy of them."""
    if share_weights and isinstance(model, ir.Model) and weights_shared(model):
        shared = shared_weights(model)
        if shared is not None:
            return session_with_weights(*shared, level, threads, **options)
    with _source(model) as source:
        return ort.InferenceSession(source, session_options(level, threads, **options),
                                    providers=["CPUExecutionProvider"])


@contextlib.contextmanager
def _source(model):
    """:func:`model_source` of ``model``, with a temporary folder for the file only where the model
    needs one (external data): a session is made for every candidate, fold and check, and a folder
    made and removed for each of them costs more than a small model's session."""
    if not isinstance(model, ir.Model):
        yield model_source(model, "")  # (bytes, or the caller's own path)
    elif needs_external_data(model):
        with tempfile.TemporaryDirectory(prefix="opfuse-ort-") as tmp:
            yield model_source(model, tmp)
    else:
        yield ir.serde.serialize_model(model).SerializeToString()


def optimized_graph(model, level: str = "all", threads: int | None = None) -> onnx.ModelProto:
    """The graph ONNX Runtime runs at ``level``, as it dumps it (weights not loaded)."""
    with tempfile.TemporaryDirectory(prefix="opfuse-ort-") as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        create_session(model, level, threads, optimized_path=path)
        return onnx.load(path, load_external_data=False)


# -- weights handed to the runtime where they are ----------------------------------------------

SHARED_MIN_BYTES = 1 << 16  # a main-graph initializer this large is shared, not serialised (a small one may
# be a shape the runtime reads when it loads the graph: it stays in it)
PLACEHOLDER = "opfuse-shared-weights.bin"  # the sparse file the graph's shared initializers point at
_SHAREABLE = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.INT8, ir.DataType.UINT8,
              ir.DataType.INT16, ir.DataType.UINT16, ir.DataType.INT32, ir.DataType.UINT32, ir.DataType.INT64,
              ir.DataType.UINT64, ir.DataType.BOOL}


def shared_weights(model: ir.Model, min_bytes: int | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
    """(``model`` as a ModelProto whose large main-graph initializers hold no data, {their name: the
    array}): each array is the tensor's own (an external tensor's is a view of its mapped file, read
    where it is), for :func:`session_with_weights`. Initializers that are also graph inputs, small
    ones and dtypes the runtime cannot take from numpy stay in the proto (their bytes inline). None
    where a subgraph or function holds external data (not shared). ``model`` is left as it was."""
    min_bytes = SHARED_MIN_BYTES if min_bytes is None else min_bytes
    inputs = {id(v) for v in model.graph.inputs}
    swapped: list[tuple[ir.Value, object]] = []
    weights: dict[str, np.ndarray] = {}
    try:
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None:
                continue
            if id(value) in inputs or tensor.dtype not in _SHAREABLE or tensor.nbytes < min_bytes:
                if isinstance(tensor, ir.ExternalTensor):  # kept in the graph: its bytes inline
                    swapped.append((value, tensor))
                    value.const_value = ir.Tensor(tensor.numpy(), dtype=tensor.dtype, name=value.name)
                continue
            array = tensor.numpy()
            if not array.flags.c_contiguous or array.dtype.byteorder == ">":
                array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("="))
            weights[value.name] = array
            swapped.append((value, tensor))
            value.const_value = ir.ExternalTensor(PLACEHOLDER, offset=0, length=tensor.nbytes, dtype=tensor.dtype,
                                                  shape=tensor.shape, name=value.name)
        proto = ir.serde.serialize_model(model)
    finally:
        for value, tensor in swapped:
            value.const_value = tensor
    if any(_external_elsewhere(g) for g in [proto.graph, *(n for f in proto.functions for n in _subgraphs(f.node))]):
        return None  # a subgraph's external tensor: the caller serialises the model whole
    return proto, weights


def _subgraphs(nodes):
    for node in nodes:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield a.g
            elif a.type == onnx.AttributeProto.GRAPHS:
                yield from a.graphs


def _external_elsewhere(graph: onnx.GraphProto) -> bool:
    """Whether a tensor of ``graph`` (its subgraphs too) has external data other than the placeholder."""
    def external(t):
        return t.data_location == onnx.TensorProto.EXTERNAL and not any(
            e.key == "location" and e.value == PLACEHOLDER for e in t.external_data)

    if any(external(t) for t in graph.initializer):
        return True
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR and external(a.t) or any(external(t) for t in a.tensors):
                return True
    return any(_external_elsewhere(g) for g in _subgraphs(graph.node))


def session_with_weights(proto: onnx.ModelProto, weights: dict[str, np.ndarray], level: str = "disabled",
                         threads: int | None = None, **options):
    """A session of ``proto`` (from :func:`shared_weights`) with ``weights`` given to the runtime as
    its own (``SessionOptions.add_initializer``: not copied; the session keeps them alive). The
    initializers they replace point at a sparse placeholder file, never read."""
    session_opts = session_options(level, threads, **options)
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in weights.items()}
    for name, value in values.items():
        session_opts.add_initializer(name, value)
    with tempfile.TemporaryDirectory(prefix="opfuse-ort-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        with open(os.path.join(tmp, PLACEHOLDER), "wb") as f:  # sparse: no disk, no memory
            f.truncate(max((a.nbytes for a in weights.values()), default=0))
        onnx.save_model(proto, path)
        session = ort.InferenceSession(path, session_opts, providers=["CPUExecutionProvider"])
    session._opfuse_weights = (values, weights)  # (alive as long as the session: the runtime reads them)
    return session


def drop_resident_pages(model: ir.Model | None) -> None:
    """Give back the pages of ``model``'s external tensors (and of a large inline file's mapped ones,
    :mod:`opfuse.core.inline`) that reading them made resident (their mapped files stay mapped: a
    later read faults them in again from the page cache). Between one model's sessions and another's,
    so the process holds one model's weights, not two; and the C heap's free pages with them
    (:func:`give_back_memory`), after a full garbage collection when ``model``'s weights are large
    (:func:`weights_shared`): the pipeline runs with full collections off
    (:func:`opfuse.pipeline.young_collections_only`), and the graphs a step left behind (the timing's
    variants, a fold's discarded copy) are cycles that hold their arrays and the mapped pages of their
    own loads of the weights until one runs."""
    give_back_memory(collect=model is not None and weights_shared(model))
    if model is None:
        return
    files = {}
    for graph in (model.graph, *(f.graph for f in model.functions.values())):
        for value in getattr(graph, "initializers", {}).values():
            raw = getattr(value.const_value, "raw", None)
            if isinstance(value.const_value, ir.ExternalTensor) and isinstance(raw, mmap.mmap):
                with contextlib.suppress(ValueError, OSError):  # (closed meanwhile)
                    raw.madvise(mmap.MADV_DONTNEED)
            elif isinstance(value.const_value, MappedTensor):  # (an inline file's, mapped: once per file)
                files[id(value.const_value.source)] = value.const_value.source
    for file in files.values():
        file.drop_pages()


def _libc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # (not glibc: musl has no malloc_trim)
        return None


_TRIM = _libc_trim()


def give_back_memory(collect: bool = False) -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``; elsewhere nothing).
    What ONNX Runtime's sessions and numpy's arrays of a few MB free stays in the process's heap
    otherwise, counted in its resident set: after the measured choice's sessions on Qwen2-0.5B, 1.9
    GB of a 2.0 GB process; on a 200 MB model, 0.11 of 0.29 GB. Called where a phase's sessions and
    arrays are gone (after the timing, the writing, each of verification's sessions). ``collect``: a
    full garbage collection first (what only cycles still hold), unless no younger collection ran
    since the last full one."""
    if collect and gc.get_count()[2]:  # (none since the last full one: nothing has grown old since)
        gc.collect()
    if _TRIM is not None:
        _TRIM(0)
