"""The activation quantisations TFLite's int8 kernels fix, as ONNX Runtime quantiser overrides for Ethos-U.

The lowering (:mod:`.lower`) is exact to the QDQ model: where the QDQ model quantises a tensor
otherwise than the TFLite kernel writing it must, it writes the kernel's quantisation and a
QUANTIZE (an int8 rescale) to the model's (:func:`.tflite_ops.emit`). Vela runs each QUANTIZE as
one more pass over the tensor. The TFLite converter's full-integer mode never needs them: it
chooses the quantisations the kernels want. :func:`tflite_overrides` makes ONNX Runtime's
quantiser choose the same, as ``TensorQuantOverrides`` (``quantize_static``'s extra options):

1. fixed output quantisation (:data:`.tflite_ops.FIXED_OUTPUT`): LOGISTIC (Sigmoid) and SOFTMAX write scale
   1/256 and zero point -128, TANH 1/128 and 0, whatever their input (TFLite's int8 kernels);
   the override gives the op's output exactly that scale and zero point;
2. one quantisation across the ops that only move values (the op table's ``int8="move"``, as
   :func:`.tflite_graph.read_qdq` reads them: CONCATENATION's int8 kernel reads its inputs in its
   output's quantisation; RESHAPE, TRANSPOSE, the slices, pads, MAX_POOL_2D and nearest resizes
   write their input's): the tensors joined by such ops form a
   group, and every tensor of a group gets the group's range, the union of its members'
   calibrated ranges (``rmin``, ``rmax``), so ONNX Runtime gives them one scale and zero point.
   The union covers every member's own range: nothing is clipped that was not, a narrower
   member is quantised in coarser steps (as the TFLite converter does).

Legality: a tensor with a fixed quantisation (1.), kept with 16-bit activations by the
mixed-precision search, or without a calibrated range joins no group (the lowering keeps its
QUANTIZE there). A Pad joins its group only when it pads with 0 (the union range includes 0:
the quantiser's ranges always do); a Resize only when it is nearest. The ranges are ONNX
Runtime's calibration cache (``TensorsData``), so the overrides exist only once it is written.

Block reconstruction keeps these scales as written (:func:`kept_scales`, the device's
``kept_scales``): a scale it learned there would cost the QUANTIZE again.
"""

from __future__ import annotations

__all__ = ["tflite_overrides", "move_groups", "kept_scales"]

import numpy as np
import onnx

from opfuse.core.ops import ONNX_DOMAINS, OPS, proto_attr
from opfuse.targets.ethos_u.tflite_ops import FIXED_OUTPUT


def _moves_values(node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]) -> bool:
    info = OPS.get(node.op_type)
    if node.domain not in ONNX_DOMAINS or info is None or info.int8 != "move":
        return False
    if node.op_type == "Resize":
        mode = proto_attr(node, "mode", b"nearest")
        return (mode.decode() if isinstance(mode, bytes) else mode) == "nearest"
    if node.op_type == "Pad":
        mode = proto_attr(node, "mode", b"constant")
        if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
            return False
        value = constants.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        return value is None or not np.any(onnx.numpy_helper.to_array(value))
    return True


def move_groups(model: onnx.ModelProto, excluded: set[str] = frozenset()) -> list[list[str]]:
    """The tensors joined by value-moving ops (module docstring, 2.), each group sorted, groups
    of two or more; tensors in ``excluded`` and constants join none."""
    constants = {i.name: i for i in model.graph.initializer}
    constants.update({n.output[0]: proto_attr(n, "value") for n in model.graph.node if n.op_type == "Constant"})
    parent: dict[str, str] = {}

    def find(t: str) -> str:
        while parent.setdefault(t, t) != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    for node in model.graph.node:
        if not _moves_values(node, constants):
            continue
        data = node.input if node.op_type == "Concat" else node.input[:1]
        members = [t for t in (*data, *node.output) if t and t not in constants and t not in excluded]
        for t in members[1:]:
            parent[find(t)] = find(members[0])
    groups: dict[str, list[str]] = {}
    for t in parent:
        groups.setdefault(find(t), []).append(t)
    return [sorted(g) for g in groups.values() if len(g) > 1]


def tflite_overrides(model: onnx.ModelProto, ranges, sixteen: list[str] = ()) -> dict[str, list[dict]]:
    """``TensorQuantOverrides`` for ``model`` (module docstring): the fixed outputs always, the
    groups' shared ranges when ``ranges`` (ONNX Runtime's ``TensorsData``, or None) is given.
    Tensors in ``sixteen`` get neither."""
    keep16 = set(sixteen)
    overrides: dict[str, list[dict]] = {}
    for node in model.graph.node:
        if node.domain in ONNX_DOMAINS and node.op_type in FIXED_OUTPUT and node.output[0] not in keep16:
            scale, zero = FIXED_OUTPUT[node.op_type]
            overrides[node.output[0]] = [{"scale": np.array(scale, np.float32), "zero_point": np.array(zero, np.int8)}]
    if ranges is None:
        return overrides
    data = getattr(ranges, "data", ranges)
    tensors = {i.name for i in model.graph.input} | {t for n in model.graph.node for t in n.output if t}
    excluded = keep16 | set(overrides) | {t for t in tensors if t not in data}
    for group in move_groups(model, excluded):
        lows, highs = zip(*(tuple(data[t].range_value) for t in group))
        low, high = np.float32(min(np.min(v) for v in lows)), np.float32(max(np.max(v) for v in highs))
        for t in group:
            overrides[t] = [{"rmin": np.array(low, np.float32), "rmax": np.array(high, np.float32)}]
    return overrides


def kept_scales(model: onnx.ModelProto) -> set[str]:
    """The tensors whose activation scale is TFLite's (module docstring): every fixed output and
    every member of a group; block reconstruction leaves their scales as written."""
    fixed = {n.output[0] for n in model.graph.node if n.domain in ONNX_DOMAINS and n.op_type in FIXED_OUTPUT}
    return fixed | {t for group in move_groups(model) for t in group}
