"""Step 5 of the pipeline: write the model and the report, atomically.

Everything is written into a temporary directory beside the destination and renamed into
place only when complete, so a failure leaves nothing half-written. A model whose tensors
would not fit in one protobuf (2 GiB), or whose input kept its weights as external data,
is saved with external data in ``OUT.onnx.data`` next to it.
"""

from __future__ import annotations

__all__ = ["save_model", "write_text_atomic", "needs_external_data"]

import os
import pathlib
import shutil
import tempfile

import onnx_ir as ir

from opfuse.errors import BadInputError

PROTOBUF_LIMIT = 2**31 - 2**26  # headroom below protobuf's 2 GiB for the graph itself


def _tensors(model: ir.Model):
    for graph in (model.graph, *(f.graph for f in model.functions.values())):
        for value in getattr(graph, "initializers", {}).values():
            if value.const_value is not None:
                yield value.const_value


def needs_external_data(model: ir.Model) -> bool:
    total, external = 0, False
    for tensor in _tensors(model):
        total += tensor.nbytes
        external = external or isinstance(tensor, ir.ExternalTensor)
    return external or total >= PROTOBUF_LIMIT


def save_model(
    model: ir.Model, path: str | os.PathLike, *, external_data: bool | None = None
) -> list[pathlib.Path]:
    """Save ``model`` to ``path``; returns the files written."""
    path = pathlib.Path(path)
    parent = path.resolve().parent
    if not parent.is_dir():
        raise BadInputError(f"{path}: the output directory does not exist")
    if path.is_dir():
        raise BadInputError(f"{path}: is a directory")
    if external_data is None:
        external_data = needs_external_data(model)
    data_name = path.name + ".data" if external_data else None
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".opfuse-", dir=parent))
    try:
        ir.save(model, tmp / path.name, external_data=data_name)
        written = []
        if data_name and (tmp / data_name).exists():
            os.replace(tmp / data_name, parent / data_name)
            written.append(parent / data_name)
        os.replace(tmp / path.name, parent / path.name)
        written.append(parent / path.name)
        return written
    except OSError as e:
        raise BadInputError(f"{path}: cannot write ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = pathlib.Path(path)
    parent = path.resolve().parent
    if not parent.is_dir():
        raise BadInputError(f"{path}: the directory does not exist")
    fd, tmp = tempfile.mkstemp(prefix=".opfuse-", dir=parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        raise BadInputError(f"{path}: cannot write ({e.strerror or e})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
