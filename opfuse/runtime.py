"""Running models on ONNX Runtime's CPU provider: sessions, levels, the runtime's own graph.

One place for what verification (:mod:`opfuse.verify`), the layout check
(:mod:`opfuse.targets.onnxruntime`) and the benchmarks (:mod:`opfuse.bench.measure`)
all need:

- :data:`RUNTIME_LEVELS` - graph-optimisation levels by the names the CLI uses (defined in
  :mod:`opfuse.targets`);
- :func:`create_session` - a session for an ``onnx_ir.Model``, ``ModelProto`` or bytes;
  a model too large for one protobuf (or with external data) goes through a temporary
  file with external data;
- :func:`optimized_graph` - the graph the runtime actually runs at a level (its own
  fusions and layout changes applied), as a ``ModelProto`` without weights loaded.
"""

from __future__ import annotations

__all__ = ["RUNTIME_LEVELS", "session_options", "create_session", "serialized", "optimized_graph"]

import os
import tempfile

import onnx
import onnx_ir as ir
import onnxruntime as ort

from opfuse.save import needs_external_data
from opfuse.targets import RUNTIME_LEVELS


def session_options(
    level: str = "disabled",
    threads: int | None = None,
    *,
    profile_prefix: str | None = None,
    optimized_path: str | None = None,
    prepack: bool = True,
):
    """SessionOptions: the level, threads (None: the runtime's default), no spinning,
    sequential execution, quiet logs; optionally profiling or dumping the optimised graph.
    ``prepack`` False: no kernel keeps its own repacked copy of a constant weight (MatMul's), so a
    session reads the weights where they are (external data stays mapped from its file): what
    verification wants, where time does not matter and a second copy of the weights would."""
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
    (a model that needs external data stays as it is)."""
    if needs_external_data(model):
        return model
    return ir.serde.serialize_model(model).SerializeToString()


def create_session(model, level: str = "disabled", threads: int | None = None, **options):
    """An InferenceSession on the CPU provider (the runtime keeps the weights it loaded)."""
    with tempfile.TemporaryDirectory(prefix="opfuse-ort-") as tmp:
        return ort.InferenceSession(
            model_source(model, tmp),
            session_options(level, threads, **options),
            providers=["CPUExecutionProvider"],
        )


def optimized_graph(model, level: str = "all", threads: int | None = None) -> onnx.ModelProto:
    """The graph ONNX Runtime runs at ``level``, as it dumps it (weights not loaded)."""
    with tempfile.TemporaryDirectory(prefix="opfuse-ort-") as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        create_session(model, level, threads, optimized_path=path)
        return onnx.load(path, load_external_data=False)
