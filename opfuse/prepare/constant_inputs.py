"""Input binding: a graph input the deployment fixes, made a constant of the model.

A deployment often fixes an input that the model's interface leaves open. silero-vad takes
its sample rate ``sr`` (an int64 scalar) on every call and branches on ``Equal(sr, 16000)``,
but a device that records at 16 kHz always passes 16000. ``--constant-input NAME=VALUE``
(``constant_inputs={"sr": 16000}`` in Python) records that fact, and opfuse makes the value
part of the model:

1. **Read** (:func:`resolve_constant_inputs`). VALUE is one number or a comma-separated
   list. It is read with the input's declared dtype and reshaped to the input's declared
   shape: a scalar takes one number, and a single free dimension takes the size the count
   implies. A value that does not fit fails with one line and exit 2 before any work. The
   cases are an unknown input (the line lists the model's inputs), a count the shape cannot
   take, a token that is not a finite number, a fraction for an integer input, and a number
   outside the dtype's range.
2. **Bind** (:func:`bind_inputs`). The input becomes an initializer holding that value and
   is removed from the graph's inputs, so the written model no longer takes it (its
   interface changes, and the report records that).
3. **Fold.** The clean-up's constant folding (:mod:`opfuse.passes.cleanup`) then evaluates
   whatever the value decides. ``Equal(sr, 16000)`` becomes a constant, and the ``If`` that
   reads it is replaced by the branch it takes (:mod:`opfuse.passes.branches`).
4. **Verify** (:mod:`opfuse.verify`). The original model is fed the bound value for that
   input and the rewritten one is not. Their outputs must match, as for any rewrite.
5. **Calibrate** (:func:`drop_bound`). In ``opfuse quantize`` a calibration sample may
   carry the bound input, but only with exactly the bound value. Any other value fails with
   one line naming the sample (exit 2). The input is then dropped from the feeds, and
   ``random:N`` does not generate it.

:func:`deciding_inputs` answers the reverse question for the compile log. When an ``If``
stays on the CPU, it names the graph inputs whose values decide the condition, which a
binding would fix.
"""

from __future__ import annotations

__all__ = ["resolve_constant_inputs", "bind_inputs", "bound_view", "drop_bound", "show_value",
           "deciding_inputs", "BINDING"]

import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from opfuse.errors import BadInputError
from opfuse.report import FusionRecord
from opfuse.core.ops import op_info

BINDING = "constant input"  # the records' pattern
SOURCE = "--constant-input"
SHOWN = 8  # numbers of a bound value shown in a sentence


def show_value(array: np.ndarray) -> str:
    """``16000``, ``[1, 2, 3]``, ``[1, 2, ... (12 values)]``."""
    flat = np.asarray(array).reshape(-1).tolist()
    if np.ndim(array) == 0:
        return str(flat[0])
    if len(flat) <= SHOWN:
        return "[" + ", ".join(map(str, flat)) + "]"
    return "[" + ", ".join(map(str, flat[:SHOWN])) + f", ... ({len(flat)} values)]"


def _inputs(model: ir.Model) -> dict[str, ir.Value]:
    return {v.name: v for v in model.graph.inputs if not v.is_initializer()}


def _tokens(text: str, where: str) -> list[str]:
    tokens = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in tokens):
        raise BadInputError(f"{where}: expected a number or a comma-separated list of numbers")
    return tokens


def _number(token, dtype: np.dtype, where: str):
    """One element read as ``dtype``, or one line saying why it is not one."""
    kind = dtype.kind
    if kind == "b":
        text = str(token).strip().lower()
        if text in ("1", "true"):
            return True
        if text in ("0", "false"):
            return False
        raise BadInputError(f"{where}: {token!r} is not a boolean (0, 1, true, false)")
    if isinstance(token, str):
        try:
            number = int(token, 10) if kind in "iu" else float(token)
        except ValueError:
            try:
                number = float(token)
            except ValueError:
                raise BadInputError(f"{where}: {token!r} is not a number") from None
    else:
        number = token.item() if hasattr(token, "item") else token
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise BadInputError(f"{where}: {token!r} is not a number")
    if isinstance(number, float) and not math.isfinite(number):
        raise BadInputError(f"{where}: {token!r} is not a finite number")
    if kind in "iu":
        if isinstance(number, float):
            if not number.is_integer():
                raise BadInputError(f"{where}: {token!r} is not a whole number, and the input is {dtype}")
            number = int(number)
        info = np.iinfo(dtype)
        if not info.min <= number <= info.max:
            raise BadInputError(f"{where}: {number} is outside the range of {dtype} ({info.min}..{info.max})")
        return number
    if kind == "f" or str(dtype) == "bfloat16":
        return float(number)
    raise BadInputError(f"{where}: the input is {dtype}; only numeric and boolean inputs can be bound")


def _shape_for(value: ir.Value, count: int, where: str) -> tuple[int, ...]:
    """The declared shape the ``count`` numbers fill (one free dimension takes the rest)."""
    if value.shape is None:
        return () if count == 1 else (count,)
    dims = list(value.shape)
    free = [i for i, d in enumerate(dims) if not (isinstance(d, int) and d >= 0)]
    fixed = int(np.prod([d for i, d in enumerate(dims) if i not in free], dtype=np.int64))
    shown = "[" + ", ".join(str(d) if isinstance(d, int) else (getattr(d, "value", None) or "?")
                            for d in dims) + "]"
    if not free:
        if count != fixed:
            what = "a scalar: give one number" if not dims else f"shape {shown}: give {fixed} numbers"
            raise BadInputError(f"{where}: {count} number(s) given; the input is {what}")
        return tuple(int(d) for d in dims)
    if len(free) > 1:
        raise BadInputError(f"{where}: the input's shape {shown} has {len(free)} free dimensions; "
                            "a constant fills at most one")
    if fixed == 0 or count % fixed:
        raise BadInputError(f"{where}: {count} number(s) do not fill shape {shown}")
    return tuple(count // fixed if i in free else int(d) for i, d in enumerate(dims))


def resolve_constant_inputs(model: ir.Model, given: Mapping[str, object] | None,
                            *, source: str = SOURCE) -> dict[str, np.ndarray]:
    """Each bound input's value as an array of its declared dtype and shape.

    ``given`` maps input names to text ("16000", "1,2,3", as the command line gives them),
    numbers, sequences or arrays. Anything that does not fit raises :class:`BadInputError`
    with one line (see the module docstring).
    """
    inputs = _inputs(model)
    out: dict[str, np.ndarray] = {}
    for name, raw in (given or {}).items():
        where = f"{source} {name}={raw if isinstance(raw, str) else show_value(np.asarray(raw, dtype=object))}"
        value = inputs.get(name)
        if value is None:
            listed = ", ".join(inputs) or "none"
            raise BadInputError(f"{where}: the model has no input '{name}' (its inputs: {listed})")
        if value.dtype is None:
            raise BadInputError(f"{where}: input '{name}' declares no element type")
        dtype = np.dtype(value.dtype.numpy())
        elements = _tokens(raw, where) if isinstance(raw, str) else list(np.asarray(raw, dtype=object).reshape(-1))
        if not elements:
            raise BadInputError(f"{where}: no value given")
        numbers = [_number(e, dtype, where) for e in elements]
        with np.errstate(over="ignore"):
            array = np.asarray(numbers, dtype=dtype)
        if dtype.kind == "f" and not np.isfinite(array).all():
            raise BadInputError(f"{where}: a number is outside the range of {dtype}")
        out[name] = array.reshape(_shape_for(value, len(numbers), where))
    return out


def bind_inputs(model: ir.Model, values: Mapping[str, np.ndarray], *, source: str = SOURCE) -> list[FusionRecord]:
    """Make each input an initializer with its value, removed from the graph's inputs (in
    place); one record per input."""
    inputs = _inputs(model)
    records = []
    for name, array in values.items():
        value = inputs[name]
        model.graph.inputs.remove(value)
        value.const_value = ir.tensor(np.asarray(array), name=name)
        value.shape = ir.Shape(np.shape(array))
        model.graph.register_initializer(value)
        records.append(FusionRecord(
            pattern=BINDING, node=name, removed=(), produced="initializer", graph="main",
            detail=f"input '{name}' bound to {show_value(array)} ({source}): removed from the graph's inputs"))
    return records


def bound_view(model: ir.Model, values: Mapping[str, np.ndarray]) -> ir.Model:
    """A copy of ``model`` with ``values`` bound (what the rewritten model takes as inputs)."""
    if not values:
        return model
    view = model.clone()
    bind_inputs(view, values)
    return view


def drop_bound(samples: Sequence[dict[str, np.ndarray]], values: Mapping[str, np.ndarray],
               where: str = "calibration", *, numbered: bool = True) -> list[dict[str, np.ndarray]]:
    """The samples without the bound inputs; a sample that carries one with any other
    value is a usage error naming it (by its index, unless not ``numbered``: one set of inputs)."""
    out = []
    for index, sample in enumerate(samples):
        kept = dict(sample)
        for name, array in values.items():
            if name not in kept:
                continue
            got = np.asarray(kept.pop(name))
            if got.size != array.size or not np.array_equal(got.reshape(array.shape), array):
                which = f"sample {index} has " if numbered else ""
                raise BadInputError(
                    f"{where}: {which}{name}={show_value(got)}, but {SOURCE} binds it to "
                    f"{show_value(array)}; the bound model computes only that value")
        out.append(kept)
    return out


def deciding_inputs(value: ir.Value | None, main: ir.Graph) -> list[str] | None:
    """The inputs of the graph ``main`` whose values ``value`` is computed from, when it is
    computed from those inputs and constants only; None when it reads anything else (a
    loop's state, a subgraph's own input). A shape read (Shape, Size) depends on the shape,
    not the values, of what it reads, so the walk stops there: a condition on shapes and
    constants alone gives ``[]``."""
    found: dict[str, None] = {}
    seen: set[int] = set()
    todo: list[ir.Value | None] = [value]
    while todo:
        v = todo.pop()
        if v is None or id(v) in seen:
            continue
        seen.add(id(v))
        if v.const_value is not None:
            continue
        producer = v.producer()
        if producer is None:
            if not (v.is_graph_input() and v.graph is main):
                return None  # a subgraph's own input (a Loop's iteration), or unattached
            found[v.name] = None
            continue
        info = op_info(producer)
        if info is not None and info.metadata_only:
            continue
        todo.extend(producer.inputs)
        todo.extend(_outer_reads(producer))
    return list(found)


def _outer_reads(node: ir.Node) -> list[ir.Value]:
    """The values of enclosing graphs that ``node``'s subgraphs read."""
    graphs = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs.extend(attr.value)
    out = []
    for graph in graphs:
        nodes = list(graph.all_nodes())
        inside = {id(o) for n in nodes for o in n.outputs}
        inside |= {id(v) for n in nodes for a in n.attributes.values() if a.type == ir.AttributeType.GRAPH
                   for v in a.value.inputs}
        inside |= {id(v) for v in graph.inputs}
        out += [v for n in nodes for v in n.inputs if v is not None and id(v) not in inside]
    return out
