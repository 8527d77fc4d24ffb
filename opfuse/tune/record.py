"""Tuning decisions as data: a record of what was timed and decided, replayed without timing.

A **record** is JSON: the format version, the graph's signature, the machine (ONNX Runtime's
version, the CPU, the threads, the runtime level), the target, the shapes timed, each family's
ratios with their spread, the decision, and the configuration written. ``--tuning FILE`` (a record,
or a report whose ``tuning`` section is one) replays it: the configuration is written without any
timing, so the same input and record give the same bytes.

The **signature** (:func:`signature`) is a hash of what decides the rewrites and their timing, not
of the weights: every node's op, domain, attributes and wiring, every input's and initializer's
name, type and shape, the opsets, with the target, the runtime level, the opset asked for and the
``--dim`` sizes. Re-exporting a model with other weights keeps its record; changing a layer does not.

The **cache** (:func:`cache_path`): each timed record is also written to
``$OPFUSE_CACHE_DIR/tuning/`` (default ``~/.cache/opfuse/tuning``), named by the signature and the
machine's key (runtime version, CPU, threads). A second run of the same model on the same machine
replays it: deterministic and fast. ``--retune`` times again (and replaces it).
"""

from __future__ import annotations

__all__ = ["signature", "machine", "cache_path", "load_record", "save_record", "FORMAT", "ENVIRONMENT_CACHE"]

import hashlib
import json
import os
import pathlib
import platform
import tempfile
from collections.abc import Mapping

import onnx_ir as ir
import onnxruntime as ort

from opfuse.errors import BadInputError

FORMAT = 1
ENVIRONMENT_CACHE = "OPFUSE_CACHE_DIR"


def _cpu() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(threads: int) -> dict:
    """What the timing depends on besides the graph: the runtime, the CPU, the threads."""
    return {"onnxruntime": ort.__version__, "cpu": _cpu(), "threads": threads}


def _graph_text(graph: ir.Graph, out: list[str]) -> None:
    for value in graph.inputs:
        out.append(f"in {value.name} {value.type} {value.shape}")
    for name, value in sorted(graph.initializers.items()):
        tensor = value.const_value
        small = tensor.tobytes().hex() if tensor is not None and tensor.nbytes <= 64 else ""
        out.append(f"init {name} {value.type} {value.shape} {small}")
    for node in graph:
        attrs = []
        for name, attr in sorted(node.attributes.items()):
            if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                for sub in (attr.value if attr.type == ir.AttributeType.GRAPHS else [attr.value]):
                    sub_out: list[str] = []
                    _graph_text(sub, sub_out)
                    attrs.append(f"{name}={{{';'.join(sub_out)}}}")
            elif attr.type == ir.AttributeType.TENSOR:
                tensor = attr.value
                data = tensor.tobytes() if tensor.nbytes <= 4096 else f"{tensor.dtype}{tensor.shape}"
                attrs.append(f"{name}={hashlib.sha256(data if isinstance(data, bytes) else data.encode()).hexdigest()[:16]}")
            else:
                attrs.append(f"{name}={attr.value!r}")
        inputs = ",".join("" if v is None else (v.name or "?") for v in node.inputs)
        outputs = ",".join(v.name or "?" for v in node.outputs)
        out.append(f"node {node.domain}::{node.op_type} ({inputs})->({outputs}) {' '.join(attrs)}")
    for value in graph.outputs:
        out.append(f"out {value.name}")


def signature(model: ir.Model, **context) -> str:
    """The hash of ``model``'s graph structure and ``context`` (target, level, opset, dims...)."""
    lines = [f"opset {d}:{v}" for d, v in sorted(model.opset_imports.items())]
    _graph_text(model.graph, lines)
    lines.append(json.dumps(context, sort_keys=True, default=str))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def cache_dir() -> pathlib.Path:
    root = os.environ.get(ENVIRONMENT_CACHE)
    base = pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "opfuse"
    return base / "tuning"


def cache_path(graph_signature: str, threads: int) -> pathlib.Path:
    """Where the record of ``graph_signature`` timed on this machine at ``threads`` is cached."""
    key = hashlib.sha256(json.dumps(machine(threads), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"{graph_signature}-{key}.json"


def save_record(record: Mapping, path: pathlib.Path) -> None:
    """Write ``record`` atomically (a cache that cannot be written is no error: returns quietly)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        return


def load_record(path: str | os.PathLike) -> dict:
    """A record from ``path`` (a record, or a report with a ``tuning`` section holding one);
    a file that is neither raises :class:`BadInputError`."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except FileNotFoundError:
        raise BadInputError(f"{path}: no such tuning record") from None
    except (OSError, ValueError) as e:
        raise BadInputError(f"{path}: not a tuning record ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("tuning"), dict) and "record" in data["tuning"]:
        data = data["tuning"]["record"]
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("configuration"), (dict,
                                                                                                             type(None))):
        raise BadInputError(f"{path}: not a tuning record of format {FORMAT} (write one with "
                            "`opfuse optimize ... --report R.json`)")
    return data
