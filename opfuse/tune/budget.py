"""The work units of the measured choice: how many rounds a timed run gets, from the bytes a run of
the graph touches (:func:`work_units`), never from the clock, so the same graph always gets the same
rounds whatever the machine is doing (:mod:`opfuse.tune`, step 3)."""

from __future__ import annotations

__all__ = ["rounds_for", "work_units", "ROUND_BYTES", "REPEAT", "COPIES", "MIN_ROUNDS", "MAX_ROUNDS"]

from collections.abc import Mapping

import numpy as np
import onnx
import onnx_ir as ir

ROUND_BYTES = 24 * 2**30  # the work units of one timed run: the bytes all its sessions' runs touch
REPEAT = 3  # runs per session per round, the fastest taken (timing.measure)
COPIES = 2  # sessions per variant, a round's time their mean (timing.measure; experiments/decode_timing)
MIN_ROUNDS, MAX_ROUNDS = 9, 61  # the work units decide between them (a small graph gets many: a tight A/A)


def rounds_for(model: ir.Model, feeds: Mapping[str, np.ndarray], variants: int) -> int:
    """Rounds of a timed run from the graph's work units, not the clock: :data:`ROUND_BYTES` over
    the bytes one run of all ``variants`` touches (:func:`work_units`, times :data:`REPEAT` and
    :data:`COPIES`), between :data:`MIN_ROUNDS` and :data:`MAX_ROUNDS`. The same graph always
    gets the same rounds, whatever the machine is doing."""
    per_round = max(1, work_units(model, feeds)) * variants * REPEAT * COPIES
    return max(MIN_ROUNDS, min(MAX_ROUNDS, int(ROUND_BYTES // per_round)))


def work_units(model: ir.Model, feeds: Mapping[str, np.ndarray]) -> int:
    """The bytes one run of ``model`` on ``feeds`` reads and writes, as ONNX's shape inference sees
    them: its initializers, and every value whose shape it infers at the feeds' sizes (a value of
    unknown shape counts as the largest input)."""
    proto = ir.serde.serialize_model(model)
    for value in proto.graph.input:
        if value.name in feeds:
            shape = value.type.tensor_type.shape
            del shape.dim[:]
            for size in np.shape(feeds[value.name]):
                shape.dim.add().dim_value = int(size)
    weights = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    largest = max((np.asarray(f).nbytes for f in feeds.values()), default=0)
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - onnx raises its own types: a graph it cannot infer counts by node
        return weights + largest * len(proto.graph.node)
    known = {v.name: v for v in [*inferred.graph.value_info, *inferred.graph.output]}
    total = weights
    for node in inferred.graph.node:
        for out in node.output:
            info = known.get(out)
            dims = info.type.tensor_type.shape.dim if info is not None and info.type.HasField("tensor_type") else None
            if dims is None or any(not d.HasField("dim_value") for d in dims):
                total += largest
            else:
                total += 4 * int(np.prod([d.dim_value for d in dims], dtype=np.int64))
    return total
