"""QNN's HTP backend: availability, the HTP options, and a session opened on it with its log.

The backend is ``onnxruntime-qnn`` (the ``opfuse[qnn]`` extra): ``libQnnHtp.so`` and
``libHtpPrepare.so``, QNN's Hexagon NPU compiler, emulating the NPU's arithmetic on x86
Linux. It loads into ONNX Runtime as a plugin execution provider (registered once per
process, :func:`qnn_devices`).

The HTP options opfuse uses (:class:`HtpOptions`, ``--htp KEY=VALUE``) are reported with
every result. The default, ``soc_model`` 57 (Snapdragon 8 Gen 3, HTP v75), is the one that
compiles PP-OCRv4 rec: on the backend's own defaults its graph fails to finalise
(``QNN_COMMON_ERROR_MEM_ALLOC``). Graph-input quantisation and graph-output dequantisation
run on the HTP (``offload_graph_io_quantization`` 0): with the provider's default they are
handed to the CPU, and a strict session would not open.

**Where the compile log comes from** (read by :mod:`.placement`):

- *placement* is ONNX Runtime's own record of which execution provider runs each node
  (``session.record_ep_graph_assignment_info`` and
  ``InferenceSession.get_provider_graph_assignment_info()``, ONNX Runtime 1.23+): one entry
  per partition, structured, no parsing. Its QNN nodes carry the names the NHWC layout
  transformation gave them (``conv_token_1``) and the Transposes it inserted; CPU nodes keep
  their own names;
- *QNN's reasons* exist only in the provider's verbose log ("Validation FAILED for 1 nodes
  in OrtNodeUnit (Erf) ... REASON : ..."), written by the C++ side to file descriptor 2.
  :func:`open_session` raises the session's log level to verbose and redirects fds 1 and 2
  to a temporary file while the session is created (QNN's libraries also print to fd 1),
  then keeps only the lines :func:`opfuse.targets.qnn.placement.is_log_line` wants (the verbose log
  also dumps every tensor, megabytes for a real model).

Strict mode (``session.disable_cpu_ep_fallback`` 1) makes the session fail to open when
any node would run on the CPU; :func:`open_session` opens non-strict by default so the log
says which nodes and why, and ``--require-npu`` turns any fallback into an error.
"""

from __future__ import annotations

__all__ = [
    "INSTALL_COMMAND",
    "HtpOptions",
    "HtpSession",
    "HtpCompileError",
    "HtpRunError",
    "available",
    "require_backend",
    "qnn_devices",
    "open_session",
]

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping

import onnx
import onnx_ir as ir
import onnxruntime as ort

from opfuse.errors import BadInputError, EXTRAS, OpfuseError, missing_extra, require_extra
from opfuse.targets.qnn.placement import Placement, is_log_line
from opfuse.runtime import model_source
from opfuse.targets import RUNTIME_LEVELS

EP_NAME = "QNNExecutionProvider"
INSTALL_COMMAND = EXTRAS["qnn"].command


class HtpCompileError(OpfuseError):
    """QNN could not compile or open the model (exit 1); carries the log's error lines."""

    exit_code = 1


class HtpRunError(OpfuseError):
    """QNN compiled the model, and running it on the HTP failed (exit 1): QNN's status in one line."""

    exit_code = 1


def available() -> bool:
    """Whether ``onnxruntime_qnn`` is installed (nothing is loaded)."""
    return not missing_extra("qnn")


def require_backend():
    """The ``onnxruntime_qnn`` module, or one line with the install command (exit 2)."""
    require_extra("qnn", "--target qnn (Qualcomm's QNN backend)")
    import onnxruntime_qnn  # (optional: an extra, found above)

    return onnxruntime_qnn


@dataclasses.dataclass(frozen=True)
class HtpOptions:
    """The QNN HTP provider options opfuse sets (None: the backend's own default)."""

    soc_model: str | None = "57"  # Snapdragon 8 Gen 3 (HTP v75): compiles PP-OCRv4 rec
    htp_arch: str | None = None  # e.g. "79"; with soc_model None, the architecture alone
    vtcm_mb: int | None = None  # on-chip memory the graph may use, MiB
    offload_graph_io_quantization: bool = False  # True: graph-input Q / output DQ on the CPU
    extra: tuple[tuple[str, str], ...] = ()  # any other provider option, as given

    KEYS = ("soc_model", "htp_arch", "vtcm_mb", "offload_graph_io_quantization")

    @classmethod
    def parse(cls, items: Mapping[str, str] | None) -> HtpOptions:
        """From ``--htp KEY=VALUE`` pairs; an empty value or ``default`` unsets a key."""
        fields: dict = {}
        extra = []
        for key, value in (items or {}).items():
            value = None if value in ("", "default") else value
            if key == "vtcm_mb":
                if value is not None and not value.isdigit():
                    raise BadInputError(f"--htp vtcm_mb={value}: expected a whole number of MiB")
                fields[key] = None if value is None else int(value)
            elif key == "offload_graph_io_quantization":
                fields[key] = value == "1"
            elif key in cls.KEYS:
                fields[key] = value
            elif value is not None:
                extra.append((key, value))
        return cls(**fields, extra=tuple(extra))

    def provider_options(self, backend_path: str) -> dict[str, str]:
        options = {"backend_path": backend_path,
                   "offload_graph_io_quantization": "1" if self.offload_graph_io_quantization else "0"}
        for key in ("soc_model", "htp_arch", "vtcm_mb"):
            value = getattr(self, key)
            if value is not None:
                options[key] = str(value)
        options.update(self.extra)
        return options

    def describe(self) -> str:
        """What the report prints: "soc_model 57, io quantisation on the HTP"."""
        parts = [f"{k} {getattr(self, k)}" for k in ("soc_model", "htp_arch", "vtcm_mb")
                 if getattr(self, k) is not None]
        parts += [f"{k} {v}" for k, v in self.extra]
        parts.append("graph I/O quantisation on the " + ("CPU" if self.offload_graph_io_quantization else "HTP"))
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.KEYS}, **dict(self.extra)}


_registered: list = []  # the QNN ep devices, once the library is registered (once per process)


def qnn_devices() -> list:
    """ONNX Runtime's QNN ep devices (the plugin library is registered on first use)."""
    qnn = require_backend()
    if not _registered:
        with _native_output_captured():  # (the libraries print a banner to fd 1 when loaded)
            with contextlib.suppress(Exception):  # already registered by the caller's own code
                ort.register_execution_provider_library(qnn.get_ep_name(), qnn.get_library_path())
        devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
        if not devices:
            raise HtpCompileError(f"ONNX Runtime {ort.__version__} lists no {EP_NAME} device after "
                                  f"registering {qnn.get_library_path()}")
        _registered.extend(devices)
    return list(_registered)


@dataclasses.dataclass
class HtpSession:
    """A session on the HTP backend and what opening it said."""

    session: ort.InferenceSession
    placement: Placement
    compile_seconds: float
    options: HtpOptions
    strict: bool

    def run(self, feeds: Mapping, names=None) -> list:
        with _native_stderr_silenced():  # (the session logs verbosely: its compile log needed it)
            try:
                return self.session.run(names, dict(feeds))
            except ort.capi.onnxruntime_pybind11_state.EPFail as e:  # (the QNN provider's own failure)
                raise HtpRunError(_run_failure(e)) from e

    @property
    def quiet(self) -> "QuietSession":
        """The session for code that calls ``InferenceSession.run`` itself (a user's metric)."""
        return QuietSession(self.session)


class QuietSession:
    """An InferenceSession whose ``run`` keeps the provider's verbose run log off fd 2."""

    def __init__(self, session: ort.InferenceSession):
        self._session = session

    def run(self, *args, **kwargs):
        with _native_stderr_silenced():
            return self._session.run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._session, name)


def open_session(
    model,
    options: HtpOptions | None = None,
    *,
    strict: bool = False,
    level: str = "all",
    session_config: Mapping[str, str] | None = None,
) -> HtpSession:
    """Compile ``model`` (ModelProto, onnx-ir Model, bytes or path) on the HTP backend.

    ``strict``: the session opens only when QNN takes every node. ``level``: ONNX
    Runtime's graph optimisations before placement ("all", as deployed).
    ``session_config``: extra session entries (the EPContext keys of :mod:`.context`).
    Raises :class:`HtpCompileError` (exit 1) when QNN cannot compile the graph or, strict,
    a node would fall back; its message names QNN's reasons.
    """
    options = options or HtpOptions()
    qnn = require_backend()
    devices = qnn_devices()
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, RUNTIME_LEVELS[level])
    so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    if strict:
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    for key, value in (session_config or {}).items():
        so.add_session_config_entry(key, value)
    so.log_severity_level = 0  # verbose: QNN's per-node validation is logged at this level only
    so.add_provider_for_devices(devices, options.provider_options(qnn.get_qnn_htp_path()))
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix="opfuse-qnn-") as tmp:
        source = model_source(model, tmp)
        start = time.perf_counter()
        error = None
        with _native_output_captured(log):
            try:
                session = ort.InferenceSession(source, so)
            except Exception as e:  # (ONNX Runtime raises its own Fail / RuntimeException)
                error = e
        seconds = time.perf_counter() - start
    if error is not None:
        placement = Placement.from_log(log, [], _model_nodes(model))
        raise HtpCompileError(_compile_failure(error, placement, strict)) from error
    session.disable_fallback()
    placement = Placement.from_log(log, session.get_provider_graph_assignment_info(), _model_nodes(model))
    return HtpSession(session, placement, seconds, options, strict)


def _model_nodes(model) -> list[tuple[str, str]]:
    """(name, op type) of the main graph's nodes, in order."""
    if isinstance(model, ir.Model):
        return [(n.name or "", n.op_type) for n in model.graph]
    if isinstance(model, (bytes, str, os.PathLike)):
        model = (onnx.load_model_from_string(model) if isinstance(model, bytes)
                 else onnx.load(os.fspath(model), load_external_data=False))
    return [(n.name, n.op_type) for n in model.graph.node]


def _run_failure(error: Exception) -> str:
    """One line for a compiled model whose run fails on the HTP: QNN's own status, from ONNX Runtime's
    message (``... Status Message: QNN graph execute error. Error: QNN_GRAPH_ERROR_...``)."""
    text = " ".join(str(error).split())
    status = text.split("Status Message: ", 1)[-1] if "Status Message: " in text else text.split(" : ", 2)[-1]
    return f"QNN compiled the model but its HTP could not run it: {status[:300]}"


def _compile_failure(error: Exception, placement: Placement, strict: bool) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    text = text.split(" : ", 2)[-1] if text.startswith("[ONNXRuntimeError]") else text
    reasons = placement.failed_checks()
    if strict and reasons:
        shown = "; ".join(f"{c.label}: {c.reason}" for c in reasons[:3])
        more = f" (and {len(reasons) - 3} more)" if len(reasons) > 3 else ""
        return f"QNN does not take every node, and CPU fallback is disabled: {shown}{more}"
    errors = placement.errors[-2:]
    return "QNN could not compile the model: " + (" | ".join(errors) if errors else text)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 goes to the null device inside. A session's log level is fixed when
    it is created, and the QNN provider ignores RunOptions' level, so the verbose level the
    compile log needs would print a dozen lines per run."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    saved = os.dup(2)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


@contextlib.contextmanager
def _native_output_captured(into: list[str] | None = None) -> Iterator[None]:
    """File descriptors 1 and 2 go to a temporary file inside (C++ logs bypass sys.stderr);
    the lines :func:`is_log_line` keeps are appended to ``into``."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(1), os.dup(2)
        try:  # (inside: a failed second dup2 still restores the first)
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            if into is not None:
                sink.seek(0)
                for raw in sink:
                    line = raw.decode("utf-8", "replace").rstrip("\n")
                    if is_log_line(line):
                        into.append(line)
