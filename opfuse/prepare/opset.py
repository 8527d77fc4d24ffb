"""Raising a model's opset: onnx's version converter, opt-in (``opfuse optimize --opset N``).

A standard op a pattern becomes may need a newer opset than the model has
(LayerNormalization 17, Gelu 20, RMSNormalization and Attention 23, Swish 24). ``--opset N``
asks for it, and the converter's adapters rewrite the ops whose signature changed (ReduceMean's
axes become an input at 18...). The upgrade is checked with the rewrites: verification runs the
original against the result. opfuse raises the opset on its own in two places only: a timed
configuration of ``--target onnxruntime`` (:mod:`opfuse.tune`), and a target whose device
computes an RMSNorm written out wrongly where it computes the standard op right
(:attr:`opfuse.targets.kernels.Target.rms_norm_opset`: QNN's HTP, whose float16 loses a real
decoder's mean of squares); :func:`written_out_rms_norm` finds such a norm, and ``--opset`` with
the model's own opset keeps it.

A lower ``N`` than the model's is refused (opfuse does not lower opsets), as is a model
the converter cannot upgrade (one line with its reason).

The converter reads and writes a protobuf, so it is given the graph without the weights: every
initializer larger than :data:`STAND_IN_BYTES` goes in as a reference to external data that is
never read (the converter's adapters rewrite ops and attributes, not weights), and the model it
returns takes back the very tensors it had, by name. A 0.5 GB model is not copied three times to
raise its opset.
"""

from __future__ import annotations

__all__ = ["upgrade_opset", "kernels_lost", "written_out_rms_norm", "raise_for_rms_norm"]

import functools

import onnx
import onnx.version_converter
import onnx_ir as ir

from opfuse.core.analysis import Constant, find_constant, iter_scopes, opset_of
from opfuse.errors import BadInputError
from opfuse.core.ops import ONNX_DOMAINS, first_line


STAND_IN_BYTES = 4096  # initializers larger than this go through the converter as references only
STAND_IN = "opfuse-weight-stand-in"  # (the location of their references: never a file)


def upgrade_opset(model: ir.Model, opset: int) -> tuple[ir.Model, str | None]:
    """``model`` at default-domain ``opset`` (a new model when converted), and a note."""
    current = opset_of(model.opset_imports)
    if opset < current:
        raise BadInputError(f"--opset {opset} is below the model's opset {current}; opfuse does not lower opsets")
    if opset == current:
        return model, None
    if opset > onnx.defs.onnx_opset_version():
        raise BadInputError(f"--opset {opset}: this onnx knows opsets up to {onnx.defs.onnx_opset_version()}")
    weights = {name: v.const_value for name, v in model.graph.initializers.items()
               if v.const_value is not None and v.const_value.nbytes > STAND_IN_BYTES}
    for graph in (model.graph, *(a.value for n in ir.traversal.RecursiveGraphIterator(model.graph)
                                 for a in n.attributes.values() if a.type == ir.AttributeType.GRAPH)):
        for name, value in graph.initializers.items():  # the small ones external: read, as the proto holds them
            if isinstance(value.const_value, ir.ExternalTensor) and not (graph is model.graph and name in weights):
                value.const_value = ir.Tensor(value.const_value.numpy(), name=name)
    for name, tensor in weights.items():  # references the converter copies, never reads
        model.graph.initializers[name].const_value = ir.ExternalTensor(
            STAND_IN, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape, name=name)
    try:
        proto = ir.serde.serialize_model(model)
    finally:
        for name, tensor in weights.items():
            model.graph.initializers[name].const_value = tensor
    try:
        proto = onnx.version_converter.convert_version(proto, opset)
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds
        raise BadInputError(f"onnx's version converter cannot raise the model from opset {current} to "
                            f"{opset}: {first_line(e, 200)}") from None
    upgraded = ir.serde.deserialize_model(proto)
    for name, tensor in weights.items():
        if name in upgraded.graph.initializers:
            upgraded.graph.initializers[name].const_value = tensor
    left = [v.name for v in upgraded.graph.initializers.values()
            if isinstance(v.const_value, ir.ExternalTensor) and v.const_value.location == STAND_IN]
    if left:  # the converter renamed or moved a weight: raised with every weight in memory instead
        ir.external_data.load_to_model(model)
        upgraded = ir.serde.deserialize_model(onnx.version_converter.convert_version(ir.serde.serialize_model(model),
                                                                                     opset))
    return upgraded, f"opset raised {current} -> {opset} with onnx's version converter (--opset)"


_OPEN = 2 ** 31 - 1  # a kernel registered "from version V on"


@functools.cache
def _cpu_kernels() -> dict[str, tuple[tuple[int, int], ...]]:
    """ONNX Runtime's CPU kernels of the ONNX domain: op -> their version ranges (empty without
    ONNX Runtime, or where this build does not list them)."""
    try:
        from onnxruntime.capi import _pybind_state  # ONNX Runtime is an optional import here

        defs = _pybind_state.get_all_opkernel_def()
    except Exception:  # noqa: BLE001 - no list, no verdict
        return {}
    found: dict[str, list] = {}
    for k in defs:
        if k.provider == "CPUExecutionProvider" and k.domain in ONNX_DOMAINS:
            found.setdefault(k.op_name, []).append(tuple(k.version_range))
    return {op: tuple(ranges) for op, ranges in found.items()}


def _runs(op: str, version: int) -> bool:
    """Whether a CPU kernel takes ``op``'s schema of ``version`` (its since-version). ONNX Runtime
    matches a kernel registered from V on to version V only (a newer version of the op may be one
    it does not support), and a kernel with an end version to every version in its range."""
    return any(start == version or (end != _OPEN and start <= version <= end)
               for start, end in _cpu_kernels().get(op, ()))


def kernels_lost(model: ir.Model, opset: int) -> list[str]:
    """The default-domain ops of ``model`` (every graph) that ONNX Runtime's CPU provider runs at the
    model's opset and would not run at ``opset``: "RandomNormalLike (version 22)" for a VITS
    vocoder at opset 15 raised to 23 (its kernel is registered for version 1 only)."""
    if not _cpu_kernels():
        return []
    lost: dict[str, int] = {}
    for scope in iter_scopes(model):
        for op in {n.op_type for n in scope.graph if n.domain in ONNX_DOMAINS} - set(lost):
            try:
                now = onnx.defs.get_schema(op, scope.opset).since_version
                then = onnx.defs.get_schema(op, opset).since_version
            except onnx.defs.SchemaError:
                continue
            if then != now and _runs(op, now) and not _runs(op, then):
                lost[op] = then
    return [f"{op} (version {version})" for op, version in sorted(lost.items())]


def written_out_rms_norm(model: ir.Model) -> ir.Node | None:
    """The first ReduceMean of the main graph that is an RMSNorm's mean of squares written out as
    the exporters write it and the rms-norm pattern reads it (``ReduceMean(Pow(x, 2))`` read by an
    Add, then a Sqrt), or None."""
    for node in model.graph:
        if node.op_type != "ReduceMean" or node.domain not in ONNX_DOMAINS or not node.inputs or node.inputs[0] is None:
            continue
        square = node.inputs[0].producer()
        if square is None or square.domain not in ONNX_DOMAINS:
            continue
        exponent = find_constant(square.inputs[1]) if square.op_type == "Pow" and len(square.inputs) == 2 else None
        squared = isinstance(exponent, Constant) and exponent.array.size == 1 and float(exponent.array.reshape(-1)[0]) == 2.0
        adds = [u.node for u in node.outputs[0].uses() if u.node.op_type == "Add"]
        if squared and any(u.node.op_type == "Sqrt" for a in adds for u in a.outputs[0].uses()):
            return node
    return None


def raise_for_rms_norm(model: ir.Model, target) -> tuple[ir.Model, str] | None:
    """No --opset: (the model at ``target.rms_norm_opset``, the note) where the target computes an RMSNorm
    written out wrongly and the graph holds one; (the model as it is, why not) where ONNX Runtime's CPU
    would lose a kernel at that opset; None where nothing is to be raised."""
    wanted = target.rms_norm_opset
    current = opset_of(model.opset_imports)
    if wanted is None or current >= wanted:
        return None
    norm = written_out_rms_norm(model)
    if norm is None:
        return None
    lost = kernels_lost(model, wanted)
    if lost:
        return model, (f"opset not raised to {wanted} for the RMSNorm at '{norm.name}': ONNX Runtime's CPU kernels "
                       f"do not run {', '.join(lost)}; {target.title} may compute it wrongly written out")
    raised, _ = upgrade_opset(model, wanted)
    return raised, (f"opset raised {current} -> {wanted} for {target.title}: the graph holds an RMSNorm written out "
                    f"(at '{norm.name}'), which it computes wrongly in float16 on a real decoder's hidden states, and "
                    f"RMSNormalization-{wanted} right (--opset {current} keeps the opset)")
