"""Static shapes: every symbolic dimension bound to a value, a shape inferred for every tensor.

An NPU compiler takes static shapes only: QNN's HTP backend refuses every node of a model
whose batch is symbolic ("REASON : Cannot get shape"), and runs the whole graph once it is
fixed. A target that needs them (:attr:`opfuse.targets.kernels.Target.static_shapes`) gets
them here, before any rewrite:

1. **Bind.** Every free input dimension (:func:`opfuse.core.dims.free_dims`: a named one such
   as ``batch``, or an unnamed one addressed as ``INPUT:AXIS``) takes a value: from
   ``--dim NAME=VALUE``, or in ``opfuse quantize`` from the calibration samples' shapes
   (:func:`dims_from_samples`; samples that disagree are an error, since one static graph
   cannot take both). A dimension left unbound is one line naming it, exit 2.
2. **Fix.** ONNX Runtime's own tools do the rewriting, as its QNN guide does:
   ``make_dim_param_fixed`` for a named dimension (every value of the graph that uses the
   name), ``make_input_shape_fixed`` for an unnamed one.
3. **Infer.** The shapes the graph had inferred are dropped (they may carry the old
   symbols) and inferred again: onnx's shape inference with data propagation (so a shape
   computed by ``Shape -> Gather -> Concat`` is known), then, for a tensor still not
   static (contrib ops), ONNX Runtime's symbolic shape inference. Graph outputs get their
   inferred shapes (``fix_output_shapes``). A tensor whose shape depends on data
   (``NonZero``) stays unknown and is named in the note: QNN will refuse it with its reason.

Nothing else in the graph changes: the model computes what it did at those sizes.
"""

from __future__ import annotations

__all__ = ["StaticShapes", "make_static", "make_static_proto", "dims_from_samples", "not_static"]

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from opfuse.errors import BadInputError
from opfuse.core.dims import free_dims, resolve_dims
from opfuse.core.ort_tools import ort_tool
from opfuse.core.symbolic_shapes import tool_quiet


@dataclasses.dataclass
class StaticShapes:
    """What was bound, from where, and which tensors still have no static shape."""

    bound: dict[str, int]  # free-dimension key -> value
    source: str  # "--dim", "the calibration samples"
    unknown: list[str] = dataclasses.field(default_factory=list)  # tensors left without a static shape

    def note(self) -> str:
        if not self.bound:
            text = "static shapes: the model's inputs have no free dimensions"
        else:
            shown = ", ".join(f"{k}={v}" for k, v in self.bound.items())
            text = f"static shapes: bound {shown} (from {self.source}); shapes inferred for every tensor"
        if self.unknown:
            names = ", ".join(self.unknown[:5]) + (", ..." if len(self.unknown) > 5 else "")
            text += (f", except {len(self.unknown)} whose shape depends on the data ({names}): "
                     "a compiler of static shapes refuses their consumers")
        return text

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def dims_from_samples(model: ir.Model, samples: Sequence[Mapping[str, np.ndarray]]) -> dict[str, int]:
    """Each free input dimension's value, read off the samples' shapes; samples that
    disagree on one are a usage error (a static graph takes one size)."""
    found: dict[str, int] = {}
    where: dict[str, str] = {}
    for dim in free_dims(model).values():
        for index, sample in enumerate(samples):
            for name, axis in dim.places:
                if name not in sample or np.ndim(sample[name]) <= axis:
                    continue
                size = int(np.shape(sample[name])[axis])
                if dim.key in found and found[dim.key] != size:
                    raise BadInputError(
                        f"the calibration samples disagree on dimension {dim.key}: {found[dim.key]} "
                        f"({where[dim.key]}) and {size} (sample {index}, {name} axis {axis}); a static "
                        f"graph takes one size: give samples of one shape or bind it with --dim {dim.key}=N")
                found.setdefault(dim.key, size)
                where.setdefault(dim.key, f"sample {index}, {name} axis {axis}")
    return found


def make_static(model: ir.Model, given: Mapping[str, int] | None, *, source: str = "--dim") -> tuple[ir.Model, StaticShapes]:
    """``model`` with every free dimension bound and shapes inferred (a new model). Weights kept
    as external data stay where they are, read relative to the model file (not the working
    directory)."""
    proto, static = make_static_proto(ir.serde.serialize_model(model), given, source=source, ir_model=model)
    out = ir.serde.deserialize_model(proto)
    base = next((t.base_dir for t in _external_tensors(model) if t.base_dir), None)
    if base is not None:
        ir.external_data.set_base_dir(out.graph, base)
    return out, static


def _external_tensors(model: ir.Model):
    for value in model.graph.initializers.values():
        if isinstance(value.const_value, ir.ExternalTensor):
            yield value.const_value


def _fix_output_shapes(proto: onnx.ModelProto) -> None:
    """ONNX Runtime's ``fix_output_shapes`` (inference, the checker, the outputs' shapes), run on
    a copy whose external-data weights are inputs of their declared shape: the checker would
    look for their files relative to the working directory, and shapes do not need their bytes."""
    fix_output_shapes = ort_tool("onnx_model_utils").fix_output_shapes  # (ONNX Runtime's tools: loaded on use)

    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        fix_output_shapes(proto)
        return
    view = onnx.ModelProto()
    view.CopyFrom(proto)  # (the external tensors are references: the copy is small)
    names = {t.name for t in external}
    kept = [t for t in view.graph.initializer if t.name not in names]
    del view.graph.initializer[:]
    view.graph.initializer.extend(kept)
    view.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in external)
    fix_output_shapes(view)
    for mine, fixed in zip(proto.graph.output, view.graph.output):
        mine.type.CopyFrom(fixed.type)


def make_static_proto(proto: onnx.ModelProto, given: Mapping[str, int] | None, *, source: str = "--dim",
                      ir_model: ir.Model | None = None) -> tuple[onnx.ModelProto, StaticShapes]:
    """:func:`make_static` on a ModelProto (a copy; the argument is not changed)."""
    utils = ort_tool("onnx_model_utils")  # (ONNX Runtime's tools: loaded on use)
    make_dim_param_fixed, make_input_shape_fixed = utils.make_dim_param_fixed, utils.make_input_shape_fixed

    ir_model = ir_model if ir_model is not None else ir.serde.deserialize_model(proto)
    dims = free_dims(ir_model)
    bound = resolve_dims(ir_model, given)
    unbound = [d for k, d in dims.items() if k not in bound]
    if unbound:
        names = ", ".join(f"{d.key} ({', '.join(f'{i} axis {a}' for i, a in d.places)})" for d in unbound)
        first = unbound[0].key
        raise BadInputError(f"dimension(s) {names} not bound: the target compiles static shapes only; "
                            f"give each a value with --dim {first}=N")
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    for key, value in bound.items():
        if dims[key].named:
            make_dim_param_fixed(graph, key, value)
    by_input: dict[str, dict[int, int]] = {}
    for key, value in bound.items():
        if not dims[key].named:
            for name, axis in dims[key].places:
                by_input.setdefault(name, {})[axis] = value
    for inp in graph.input:
        if inp.name in by_input:
            given_axes = by_input[inp.name]
            dims_of = inp.type.tensor_type.shape.dim
            for axis, value in given_axes.items():
                # an unnamed dim may still carry a placeholder name shared by several axes
                # (Paddle writes "?" for each): make_input_shape_fixed would fix it by name,
                # binding every "?" in the graph to the first axis's value, so it is set here
                if dims_of[axis].HasField("dim_param"):
                    dims_of[axis].Clear()
                    dims_of[axis].dim_value = value
            shape = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else given_axes.get(i, 0)
                     for i, d in enumerate(dims_of)]
            make_input_shape_fixed(graph, inp.name, shape)
    del graph.value_info[:]
    for output in graph.output:  # their symbols may be stale; inference gives them anew
        if output.type.HasField("tensor_type") and output.type.tensor_type.HasField("shape"):
            for d in output.type.tensor_type.shape.dim:
                if not d.HasField("dim_value"):
                    d.Clear()
    out = _infer(out)
    _fix_output_shapes(out)
    return out, StaticShapes(bound, source, not_static(out))


def _infer(proto: onnx.ModelProto) -> onnx.ModelProto:
    inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
    if not not_static(inferred):
        return inferred
    SymbolicShapeInference = ort_tool("symbolic_shape_infer").SymbolicShapeInference  # (sympy: heavy, rarely needed)

    with contextlib.suppress(Exception), tool_quiet():  # (it raises many kinds; it prints nothing, it logs)
        better = SymbolicShapeInference.infer_shapes(inferred, auto_merge=False, guess_output_rank=False)
        if better is not None and len(not_static(better)) < len(not_static(inferred)):
            return better
    return inferred


def not_static(proto: onnx.ModelProto) -> list[str]:
    """The main graph's node outputs with no static tensor shape (in node order)."""
    known = {}
    for info in (*proto.graph.value_info, *proto.graph.output, *proto.graph.input):
        t = info.type.tensor_type if info.type.HasField("tensor_type") else None
        if t is None:
            known[info.name] = True  # not a tensor (a sequence, a map): not ours to fix
            continue
        known[info.name] = t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim)
    initializers = {i.name for i in proto.graph.initializer}
    return [o for n in proto.graph.node for o in n.output
            if o and o not in initializers and not known.get(o, False)]
