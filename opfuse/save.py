"""Step 5 of the pipeline: write the model and the report, atomically.

Everything is written into a temporary directory beside the destination and renamed into
place only when complete, so a failure leaves nothing half-written. A model whose tensors
would not fit in one protobuf (2 GiB), or whose input kept its weights as external data,
is saved with external data in ``OUT.onnx.data`` next to it.

Shape information is written back as the input declared it: the rewrites infer shapes
for their checks, but the output carries only what the input had (:func:`declared_types`
before, :func:`restore_declared_types` after), so it does not grow by a value_info per
tensor, and a dimension the user left unnamed is not given a name like ``unk__54``.
``opfuse optimize --keep-shapes`` keeps the inferred shapes instead.
"""

from __future__ import annotations

__all__ = ["save_model", "write_text_atomic", "needs_external_data", "declared_types",
           "restore_declared_types", "check_destinations"]

import os
import pathlib
import shutil
import tempfile

import onnx_ir as ir

from opfuse.analyse import iter_scopes, tensor_nbytes
from opfuse.errors import BadInputError

PROTOBUF_LIMIT = 2**31 - 2**26  # headroom below protobuf's 2 GiB for the graph itself


def _tensors(model: ir.Model):
    for graph in (model.graph, *(f.graph for f in model.functions.values())):
        for value in getattr(graph, "initializers", {}).values():
            if value.const_value is not None:
                yield value.const_value


def _all_values(model: ir.Model):
    for scope in iter_scopes(model):
        graph = scope.graph
        yield from scope.container.inputs
        yield from getattr(graph, "initializers", {}).values()
        yield from graph.outputs
        for node in graph:
            yield from node.outputs


Declared = dict[str, tuple]  # value name -> (type, shape) as the input model declared them


def declared_types(model: ir.Model) -> Declared:
    """The type and shape of every value that had them, by name, as the model declares them."""
    out: Declared = {}
    for value in _all_values(model):
        if value.is_initializer() and not value.is_graph_input():
            continue  # restored to none (its tensor says both), so nothing would read it
        if value.name and (value.type is not None or value.shape is not None):
            shape = None if value.shape is None else ir.Shape(list(value.shape))
            out.setdefault(value.name, (value.type, shape))
    return out


def restore_declared_types(model: ir.Model, declared: Declared) -> None:
    """Give every value back the type and shape it was declared with (none if it had none).

    A rewrite's result keeps the name of the tensor it replaces, so it gets that tensor's
    declaration. Initializers need none (their tensors carry dtype and shape).
    """
    for value in _all_values(model):
        if value.is_initializer():
            # (an input keeps the input's declaration; an output needs a type, ONNX says)
            if not value.is_graph_input() and not value.is_graph_output():
                value.type, value.shape = None, None  # its tensor says both; no value_info
            continue
        type_, shape = declared.get(value.name, (None, None))
        value.type = type_
        value.shape = None if shape is None else ir.Shape(list(shape))


def needs_external_data(model: ir.Model) -> bool:
    total, external = 0, False
    for tensor in _tensors(model):
        total += tensor_nbytes(tensor)
        external = external or isinstance(tensor, ir.ExternalTensor)
    return external or total >= PROTOBUF_LIMIT


def check_destinations(*paths: str | os.PathLike | None) -> None:
    """Before any work: each path given can be written (its directory exists, it is not a
    directory), so a long run does not end in an error with half its files written."""
    for path in paths:
        if path is None:
            continue
        path = pathlib.Path(path)
        if not path.resolve().parent.is_dir():
            raise BadInputError(f"{path}: the directory does not exist")
        if path.is_dir():
            raise BadInputError(f"{path}: is a directory")


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
