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

What is verified is what is written (:class:`StagedModel`): the model is serialised into the
temporary directory exactly as it will be written (after every post-processing step:
declared types, shapes, opset, external data), loaded back from there, and that model is the
one verification runs. The files are renamed into place only if nothing changed since: a
model that changed after it was staged (its :func:`fingerprint` differs) is staged and
verified again, and staged bytes that changed on disk are never committed.

A large model written inline is written a tensor at a time (:func:`opfuse.core.inline.write_inline`: the
bytes ``onnx_ir.save`` writes, without the whole model serialised in memory twice over), and read
back for verification with its weights mapped where they are in the staged file
(:func:`opfuse.load.read_model`): the same bytes verified, then renamed into place.
"""

from __future__ import annotations

__all__ = ["save_model", "write_text_atomic", "needs_external_data", "declared_types",
           "restore_declared_types", "check_destinations", "StagedModel", "fingerprint", "commit_staged_files"]

import hashlib
from collections.abc import Sequence
import os
import pathlib
import shutil
import tempfile

import onnx_ir as ir

from opfuse.core.analysis import iter_scopes, tensor_nbytes
from opfuse.errors import BadInputError, OpfuseError
from opfuse.core.inline import streams, write_inline
from opfuse.load import read_model

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
    with StagedModel(model, path, external_data=external_data) as staged:
        return staged.commit()


class StagedModel:
    """``model`` serialised as it will be written to ``path``, in a temporary directory beside
    it (a private temporary directory when ``path`` is None: nothing is to be written, but the
    bytes are still what is verified), not yet in place.

    :meth:`load` reads the staged bytes back (what verification runs); :meth:`commit` renames
    them into place, refusing bytes that changed on disk since staging; :meth:`discard` (or
    leaving the ``with`` block) removes what was not committed. ``fingerprint`` is the
    model's :func:`fingerprint` when it was staged (None with ``fingerprinted=False``: the
    caller runs nothing between staging and committing that could change the model): the
    caller compares it with the model's before committing, and stages again if the model changed.
    """

    def __init__(self, model: ir.Model, path: str | os.PathLike | None, *, external_data: bool | None = None,
                 fingerprinted: bool = True, release: bool = False):
        self.destination = None if path is None else pathlib.Path(path)
        if self.destination is not None:
            check_destinations(self.destination)
            parent = self.destination.resolve().parent
            name = self.destination.name
        else:
            parent, name = None, "model.onnx"
        if external_data is None:
            external_data = needs_external_data(model)
        self.data_name = name + ".data" if external_data else None
        self.fingerprint = fingerprint(model) if fingerprinted else None
        try:
            self.directory = pathlib.Path(tempfile.mkdtemp(prefix=".opfuse-", dir=parent))
            self.path = self.directory / name
            if self.data_name is None and streams(model):
                write_inline(model, self.path)
            else:
                ir.save(model, self.path, external_data=self.data_name)
        except OSError as e:
            self.discard()
            raise BadInputError(f"{path or 'a temporary file'}: cannot write ({e.strerror or e})") from None
        except BaseException:
            self.discard()
            raise
        self.digest = self._digest()
        self.released: list[ir.ExternalTensor] = []
        if release and self.data_name is not None and self.destination is not None:
            self._release(model)

    def _release(self, model: ir.Model) -> None:
        """The model's in-memory weights written to the staged data file become references to it
        (the same bytes: what was written), so the process does not hold them twice while the staged
        model is verified; :meth:`commit` points them at the file's destination. The fingerprint
        follows (a tensor stands by identity)."""
        import onnx  # (the staged graph's external-data entries: where each tensor was written)

        entries = {}
        for t in onnx.load(self.path, load_external_data=False).graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                info = {e.key: e.value for e in t.external_data}
                if info.get("location") == self.data_name:
                    entries[t.name] = (int(info.get("offset", 0)), int(info["length"]))
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None or isinstance(tensor, ir.ExternalTensor) or value.name not in entries:
                continue
            offset, length = entries[value.name]
            if length != tensor.nbytes:
                continue
            value.const_value = ir.ExternalTensor(self.data_name, offset, length, tensor.dtype, shape=tensor.shape,
                                                  name=tensor.name or value.name, base_dir=str(self.directory))
            self.released.append(value.const_value)
        if self.released:
            self.fingerprint = fingerprint(model)

    def _files(self) -> list[pathlib.Path]:
        data = [self.directory / self.data_name] if self.data_name else []
        return [p for p in data if p.exists()] + [self.path]

    def _digest(self) -> str:
        h = hashlib.sha256()
        for file in self._files():
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        return h.hexdigest()

    def load(self) -> ir.Model:
        """The staged bytes, loaded back as a model (external data from the staged folder; a large
        inline model's weights mapped where they are in the staged file)."""
        return read_model(self.path)

    def commit(self) -> list[pathlib.Path]:
        """Rename the staged files into place; returns the files written."""
        if self.destination is None:
            raise ValueError("a model staged without a destination cannot be committed")
        if self._digest() != self.digest:
            raise RuntimeError(f"{self.path}: the staged bytes changed after they were verified; not written")
        parent = self.destination.resolve().parent
        written = []
        try:
            for file in self._files():  # the data first: the model file never points at missing data
                os.replace(file, parent / file.name)
                written.append(parent / file.name)
        except OSError as e:
            raise BadInputError(f"{self.destination}: cannot write ({e.strerror or e})") from None
        finally:
            self.discard()
        for tensor in self.released:  # (the staged data file is now the destination's)
            tensor.base_dir = str(parent)
        return written

    def discard(self) -> None:
        if getattr(self, "directory", None) is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def __enter__(self) -> StagedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.discard()


def fingerprint(model: ir.Model) -> str:
    """A digest of everything :func:`save_model` writes of ``model`` except tensor bytes,
    which stand by identity (a rewrite replaces a tensor, it does not edit one in place):
    opsets, metadata, and per graph its inputs, outputs, initializers and nodes with their
    names, types, shapes and attributes. Equal fingerprints: the same file."""
    h = hashlib.sha256()

    def put(*parts) -> None:
        h.update(repr(parts).encode())

    def value(v: ir.Value | None) -> None:
        put("v") if v is None else put(v.name, str(v.type), str(v.shape), id(v.const_value))

    def graph(g) -> None:
        put("graph", g.name)
        for v in g.inputs:
            value(v)
        for v in getattr(g, "initializers", {}).values():
            value(v)
        for node in g:
            put(node.domain, node.op_type, node.overload, node.name)
            for v in node.inputs:
                value(v)
            for v in node.outputs:
                value(v)
            for name, attr in node.attributes.items():
                if attr.type == ir.AttributeType.GRAPH:
                    graph(attr.value)
                elif attr.type == ir.AttributeType.GRAPHS:
                    for sub in attr.value:
                        graph(sub)
                elif attr.type in (ir.AttributeType.TENSOR, ir.AttributeType.TENSORS):
                    put(name, id(attr.value))
                else:
                    put(name, attr.type, attr.value)
        for v in g.outputs:
            value(v)

    put(sorted(model.opset_imports.items()), model.ir_version, model.producer_name, model.producer_version,
        sorted(model.metadata_props.items()))
    graph(model.graph)
    for function in model.functions.values():
        put("function", function.domain, function.name, function.overload, sorted(function.opset_imports.items()))
        graph(function)
    return h.hexdigest()


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


def commit_staged_files(directory: pathlib.Path, moves: Sequence[tuple[str, str | os.PathLike]]) -> None:
    """A device's compiled files (``moves``: a name in ``directory``, its destination) renamed
    into place, after the model and the report; ``directory`` is removed whatever happens. A
    destination that cannot be written is one line (:class:`OpfuseError`)."""
    destination = None
    try:
        for name, destination in moves:
            os.replace(directory / name, destination)
    except OSError as e:
        raise OpfuseError(f"{os.fspath(destination)}: cannot write ({e.strerror or e})") from None
    finally:
        shutil.rmtree(directory, ignore_errors=True)
