"""Verification inputs built from the model: sizes that run, integer values that branch, a
padded batch and where its outputs are defined.

A model's inputs declare their shapes with fixed sizes and **free dimensions**
(:mod:`opfuse.core.dims`: named, unnamed, derived from others; ``--dim`` sizes).

- **Integer values that follow what they feed** (:func:`integer_ranges`). An integer
  input's readers are walked (through the ops that pass its value on: Cast, Reshape,
  Unsqueeze, Squeeze, Flatten, Expand, Slice, Transpose, Identity) and its values drawn
  from the smallest range any of them takes:

  - **a mask** (0/1): multiplied, subtracted from 1 (``(1 - mask) * finfo.min``: a 7 there
    overflows to inf and the softmax after it to NaN), cast to bool, a Where condition,
    a logical Not/And/Or/Xor, or named ``*mask*``; the first position of its last axis is
    1, as every real attention mask keeps one token;
  - **an index** into a table: the indices of a Gather or GatherElements, anywhere in
    the table's size along the gathered axis (an Embedding's vocabulary);
  - otherwise 0-7.

  **Position ids** are not drawn but counted: 0..n-1 along the last axis of every row,
  after the past length in a decode step (the size of axis -2 of the first float input of
  rank 3+ named ``*past*`` or ``*cache*``, a past key/value cache). Recognised by their use,
  which takes precedence over any mask or index reading of the same input (a rotary
  ``(inv_freq @ position_ids)``, which torch lowers to a Mul at one token, is also
  "multiplied"): the indices of a Gather into a cos/sin table (made by Cos/Sin, or named
  so), the position input of a RotaryEmbedding, the start of a Range, or a Mul/MatMul/Einsum
  whose result reaches a Cos or Sin within a few ops (rotary angles); else by the name
  ``*position*`` (``position_ids``, ``cache_position``; GPT-2's learned position table is
  gathered by them, which no use tells apart from token ids). A mask whose CumSum counts
  positions is a mask.
- **A padded batch** (:func:`padded_feeds`): where the model has an attention mask
  (:func:`attention_mask_input`), rows unpadded, left-padded and right-padded (a decode step:
  its past left-padded by k and by 1), position ids ``cumsum(mask) - 1`` (0 where masked), the
  last n of them for n new tokens; and where a tensor computed from it is defined
  (:func:`defined_positions`; the rule is :mod:`opfuse.verify`'s "Padded batches").
- **Integer values that branch.** A random integer in 0-7 rarely equals the sample rate
  an ``If`` tests for. Integer inputs that reach a comparison with a constant (``Equal``,
  ``Less``, ``Greater`` and their ``OrEqual`` forms, through reshapes, casts and gathers)
  give one extra input set per value that flips it (the constant itself for ``Equal``,
  one step either side for the ordered comparisons).
"""

from __future__ import annotations

__all__ = [
    "describe_sizes",
    "integer_cases",
    "IntegerRange",
    "integer_ranges",
    "past_cache",
    "make_feeds",
    "find_sizes",
    "Padding",
    "PADDED_SEQ",
    "attention_mask_input",
    "defined_positions",
    "padded_feeds",
]

import dataclasses
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import Constant, find_constant
from opfuse.core.dims import SIZE_STEPS, FreeDim, derive_sizes, dim_key, free_dims, runtime_inputs
from opfuse.errors import BadInputError
from opfuse.core.ops import first_line, is_op

MAX_INTEGER_CASES = 3  # extra input sets per model, from integer comparisons
# ops that pass an integer input's value on unchanged (for finding what it is compared with)
_VALUE_PRESERVING = ("Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Gather",
                     "Expand", "Slice")
_COMPARISONS = ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual")
# ops through which an integer input's value reaches what decides its range
_PASSES_VALUE_ON = ("Identity", "Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Slice",
                    "Transpose")
_LOGICAL = ("Not", "And", "Or", "Xor")
_INDEXING = ("Gather", "GatherElements")  # input 1 indexes input 0 along ``axis``
DEFAULT_INTEGER_HIGH = 8  # integers are drawn from 0..7 unless a reader takes fewer


# -- integer inputs ---------------------------------------------------------------------------

def _consumers(value: ir.Value) -> Iterator[ir.Node]:
    for node, _ in value.uses():
        yield node


def _readers(value: ir.Value, passes_on: tuple[str, ...], stop=None) -> Iterator[tuple[ir.Node, ir.Value]]:
    """(reader, the value it reads) for every node reached from ``value`` through ops of
    ``passes_on`` that take it as their first input; a reader for which ``stop`` says
    something (not None) is not followed further."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        for node in _consumers(v):
            yield node, v
            if stop is not None and stop(node, v) is not None:
                continue
            if is_op(node, *passes_on) and node.inputs and node.inputs[0] is v:
                todo.extend(node.outputs)


def integer_cases(model: ir.Model) -> dict[str, list[int]]:
    """input name -> values that flip a comparison it reaches (see the module docstring)."""
    cases: dict[str, list[int]] = {}
    for value in runtime_inputs(model):
        if value.dtype is None or np.dtype(value.dtype.numpy()).kind not in "iu":
            continue
        found: list[int] = []
        for node, v in _readers(value, _VALUE_PRESERVING):
            if is_op(node, *_COMPARISONS) and len(node.inputs) == 2:
                other = node.inputs[1] if node.inputs[0] is v else node.inputs[0]
                const = find_constant(other)
                if isinstance(const, Constant) and const.array.size == 1:
                    c = int(np.asarray(const.array).reshape(()))
                    found += [c] if node.op_type == "Equal" else [c - 1, c + 1]
        unique = list(dict.fromkeys(found))
        if unique:
            cases[value.name] = unique
    return cases


@dataclasses.dataclass(frozen=True)
class IntegerRange:
    """The values drawn for one integer input: 0 .. high-1, and why (None: the default).

    ``positions``: not drawn but counted, 0..n-1 along the last axis of each row, after the
    past length (the size of axis -2 of the input ``after``, a past key/value cache) when
    there is one."""

    high: int
    why: str | None = None
    mask: bool = False  # a mask: one kept position per row (the first of the last axis)
    positions: bool = False
    after: str | None = None  # the past cache input whose axis -2 is the past length

    def describe(self, name: str) -> str:
        if self.positions:
            after = f", after the past length ({self.after} axis -2)" if self.after else ""
            return f"{name} 0..n-1 along the last axis{after} (positions: {self.why})"
        values = "0/1" if self.high == 2 else f"0-{self.high - 1}"
        return f"{name} {values} ({self.why})"


def _static_size(value: ir.Value | None, axis: int) -> int | None:
    """The size of ``value``'s ``axis`` when it is known and static."""
    if value is None:
        return None
    shape = value.const_value.shape if value.const_value is not None else value.shape
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    dim = shape[axis]
    return int(dim) if isinstance(dim, int) and dim > 0 else None


def _is_one(value: ir.Value | None) -> bool:
    const = find_constant(value)
    return isinstance(const, Constant) and const.array.size == 1 and float(const.array.reshape(())) == 1.0


def _range_from_reader(node: ir.Node, value: ir.Value) -> IntegerRange | None:
    """The range a reader of the integer value ``value`` takes, None when it takes any."""
    op = node.op_type
    if is_op(node, *_INDEXING) and len(node.inputs) > 1 and node.inputs[1] is value:
        axis = node.attributes.get_int("axis", 0)
        size = _static_size(node.inputs[0], axis)
        if size is not None:
            return IntegerRange(size, f"indexes {op} '{node.name}' of {size} along axis {axis}")
        return None
    if is_op(node, "Mul"):
        return IntegerRange(2, f"a mask: multiplied in '{node.name}'", mask=True)
    if is_op(node, "Sub") and len(node.inputs) == 2 and node.inputs[1] is value and _is_one(node.inputs[0]):
        return IntegerRange(2, f"a mask: subtracted from 1 in '{node.name}'", mask=True)
    if is_op(node, "Where") and node.inputs and node.inputs[0] is value:
        return IntegerRange(2, f"a mask: the condition of '{node.name}'", mask=True)
    if is_op(node, *_LOGICAL):
        return IntegerRange(2, f"a mask: read by {op} '{node.name}'", mask=True)
    if is_op(node, "Cast") and node.attributes.get_int("to", 0) == ir.DataType.BOOL:
        return IntegerRange(2, f"a mask: cast to bool in '{node.name}'", mask=True)
    if is_op(node, "CumSum") and node.inputs and node.inputs[0] is value:
        return IntegerRange(2, f"a mask: its CumSum '{node.name}' counts positions", mask=True)
    return None


# -- position ids ----------------------------------------------------------------------------

TRIG = ("Cos", "Sin")
POSITION_REACH = 10  # ops from a position input to the Cos/Sin of its rotary angles, at most
_TABLE_REACH = 6  # ops back from a gathered table to the Cos/Sin that made it, at most


def _trig_table(table: ir.Value | None) -> str | None:
    """How ``table`` is a cos/sin table (made by Cos/Sin, or named so), None when it is not."""
    seen = table
    for _ in range(_TABLE_REACH):
        if seen is None:
            return None
        if any(t in (seen.name or "").lower() for t in ("cos", "sin")):
            return f"'{seen.name}'"
        producer = seen.producer()
        if producer is None or not producer.inputs:
            return None
        if is_op(producer, *TRIG):
            return f"made by {producer.op_type} '{producer.name}'"
        seen = producer.inputs[0]
    return None


def _reaches_trig(value: ir.Value) -> ir.Node | None:
    """The Cos/Sin that ``value`` reaches within :data:`POSITION_REACH` ops (rotary angles),
    not through a Gather's indices (what a Gather returns is the table's, not the index)."""
    frontier, seen = [value], {id(value)}
    for _ in range(POSITION_REACH):
        following = []
        for v in frontier:
            for node, index in v.uses():
                if is_op(node, *_INDEXING) and index == 1:
                    continue
                if is_op(node, *TRIG):
                    return node
                for out in node.outputs:
                    if id(out) not in seen:
                        seen.add(id(out))
                        following.append(out)
        frontier = following
    return None


def _position_use(node: ir.Node, value: ir.Value) -> str | None:
    """How a reader of the integer value ``value`` reads positions, None when it does not."""
    if is_op(node, *_INDEXING) and len(node.inputs) > 1 and node.inputs[1] is value:
        table = _trig_table(node.inputs[0])
        return f"index the cos/sin table {table} in {node.op_type} '{node.name}'" if table else None
    if node.op_type == "RotaryEmbedding" and len(node.inputs) > 1 and node.inputs[1] is value:
        return f"the position ids of RotaryEmbedding '{node.name}'"
    if is_op(node, "Range") and node.inputs and node.inputs[0] is value:  # (a limit is a length, not a position)
        return f"the start of Range '{node.name}'"
    if is_op(node, "Mul", "MatMul", "Einsum"):
        trig = _reaches_trig(node.outputs[0])
        if trig is not None:
            return f"rotary angles, {node.op_type} '{node.name}' reaches {trig.op_type} '{trig.name}'"
    return None


def past_cache(model: ir.Model) -> ir.Value | None:
    """The first past key/value cache input (a float input of rank 3 or more named ``*past*``
    or ``*cache*``), whose axis -2 is the past sequence length; None when there is none."""
    for value in runtime_inputs(model):
        name = (value.name or "").lower()
        if (("past" in name or "cache" in name) and value.dtype is not None and value.dtype.is_floating_point()
                and value.shape is not None and len(value.shape) >= 3):
            return value
    return None


def integer_ranges(model: ir.Model) -> dict[str, IntegerRange]:
    """Integer input name -> the values to draw for it (see the module docstring).

    Decided by walking the input's readers in the main graph, and by name for a mask no
    reader identifies; inputs with no such reader are left out (they take 0-7). Position
    ids (a reader that reads positions, else a name ``*position*``) are counted, whatever
    other reader reads them as a mask or an index.
    """
    out: dict[str, IntegerRange] = {}
    past = past_cache(model)
    for value in runtime_inputs(model):
        if value.dtype is None or np.dtype(value.dtype.numpy()).kind not in "iu":
            continue
        uses = [u for node, v in _readers(value, _PASSES_VALUE_ON, stop=lambda node, v: _position_use(node, v))
                if (u := _position_use(node, v)) is not None]
        why = uses[0] if uses else "by the name" if "position" in value.name.lower() else None
        if why is not None:
            out[value.name] = IntegerRange(DEFAULT_INTEGER_HIGH, why, positions=True,
                                           after=past.name if past is not None else None)
            continue
        found: list[IntegerRange] = []
        for node, v in _readers(value, _PASSES_VALUE_ON, stop=lambda node, v: _range_from_reader(node, v)):
            taken = _range_from_reader(node, v)
            if taken is not None:
                found.append(taken)
        if not found and "mask" in value.name.lower():
            found.append(IntegerRange(2, "a mask by its name", mask=True))
        if found:
            best = min(found, key=lambda r: r.high)
            out[value.name] = dataclasses.replace(best, mask=any(r.mask for r in found))
    return out


def branch_conditions(model: ir.Model) -> dict[str, str]:
    """Scope label of each main-graph ``If`` -> the name of its condition tensor."""
    out = {}
    labels: dict[str, int] = {}
    for node in model.graph:
        if is_op(node, "If") and node.inputs and node.inputs[0] is not None:
            label = f"main/{node.name or node.op_type}"
            labels[label] = labels.get(label, 0) + 1
            out[label] = node.inputs[0].name
    # an unnamed If shares its label with others: which branch ran cannot be told apart
    return {k: v for k, v in out.items() if labels[k] == 1}


# -- feeds -----------------------------------------------------------------------------------

def make_feeds(
    model: ir.Model,
    sizes: Mapping[str, int],
    *,
    seed: int = 0,
    integers: Mapping[str, int] | None = None,
    ranges: Mapping[str, IntegerRange] | None = None,
) -> dict[str, np.ndarray]:
    """Seeded random inputs at ``sizes`` (free-dimension key -> size; missing keys are 1).

    Floats are standard normal; integers uniform in the range their readers take
    (``ranges``, by default :func:`integer_ranges` of the model; else 0-7) unless
    ``integers`` fixes an input's value; booleans fair coins.
    """
    rng = np.random.default_rng(seed)
    integers = dict(integers or {})
    ranges = integer_ranges(model) if ranges is None else ranges
    dims = free_dims(model)
    sizes = derive_sizes(dims, {**{k: 1 for k, d in dims.items() if d.derived is None}, **sizes})
    shapes = {}
    for value in runtime_inputs(model):
        if value.type is None or value.shape is None or value.dtype is None:
            raise BadInputError(
                f"graph input '{value.name}' has no declared type or shape; "
                "give inputs with --inputs FILE.npz"
            )
        shape = []
        for axis, dim in enumerate(value.shape):
            found = dim_key(value, axis, dim)
            shape.append(int(dim) if found is None else max(int(sizes.get(found[0], 1)), 0))
        shapes[value.name] = shape
    feeds = {}
    for value in runtime_inputs(model):
        shape = shapes[value.name]
        dtype = value.dtype.numpy()
        kind = np.dtype(dtype).kind
        if kind == "f" or str(dtype) == "bfloat16":
            data = rng.standard_normal(shape).astype(dtype)
        elif kind in "iu":
            if value.name in integers:
                data = np.full(shape, integers[value.name], dtype=dtype)
            else:
                taken = ranges.get(value.name, IntegerRange(DEFAULT_INTEGER_HIGH))
                if taken.positions:
                    start = shapes[taken.after][-2] if taken.after in shapes else 0
                    count = shape[-1] if shape else 1
                    data = np.broadcast_to(np.arange(start, start + count).reshape(shape[-1:]), shape).astype(dtype)
                else:
                    data = rng.integers(0, taken.high, size=shape).astype(dtype)
                if taken.mask and data.ndim:
                    data[..., :1] = 1
        elif kind == "b":
            data = rng.random(shape) < 0.5
        else:
            raise BadInputError(
                f"cannot make random data for input '{value.name}' of type {dtype}; "
                "give inputs with --inputs FILE.npz"
            )
        feeds[value.name] = np.asarray(data)
    return feeds


def _candidates(dims: Mapping[str, FreeDim], fixed: Mapping[str, int]) -> Iterator[dict[str, int]]:
    """Size assignments to try, smallest first (see the module docstring): the free base
    dimensions vary, the derived ones follow (an assignment giving one a size below 1 is
    skipped)."""
    base = {k: fixed.get(k, 1) for k, d in dims.items() if d.derived is None}
    growable = [k for k, d in dims.items() if k not in fixed and not d.batch and d.derived is None]
    steps: list[dict[str, int]] = [dict(base)] if not growable else []
    for step in SIZE_STEPS if growable else ():
        steps.append({**base, **{k: step for k in growable}})
        if len(growable) > 1 and step != 1:
            steps.extend({**base, k: step} for k in growable)
    for sizes in steps:
        full = derive_sizes(dims, {**sizes, **fixed})
        if all(v >= 1 for v in full.values()):
            yield full


def describe_sizes(dims: Mapping[str, FreeDim], sizes: Mapping[str, int]) -> str:
    """``batch=1, past_seq=8; derived: past_seq + 1=9`` (the derived dimensions said apart)."""
    drawn = ", ".join(f"{k}={v}" for k, v in sizes.items() if k not in dims or dims[k].derived is None)
    derived = ", ".join(f"{k}={v}" for k, v in sizes.items() if k in dims and dims[k].derived is not None)
    return drawn + (f"; derived: {derived}" if derived else "")


def find_sizes(
    model: ir.Model,
    run: Callable[[dict[str, np.ndarray]], object],
    *,
    fixed: Mapping[str, int] | None = None,
    seed: int = 0,
    integers: Mapping[str, int] | None = None,
    purpose: str = "cannot verify",
    advice: str = ("set sizes with --dim NAME=N or --dim INPUT:AXIS=N, or give inputs with "
                   "--inputs FILE.npz (or skip with --no-verify)"),
) -> tuple[dict[str, np.ndarray], dict[str, int], object]:
    """The smallest sizes at which ``run(feeds)`` succeeds: (feeds, sizes, run's result).

    Raises :class:`BadInputError` (one line naming the dimensions, ``purpose: ...;
    advice``) when none does.
    """
    dims = free_dims(model)
    fixed = dict(fixed or {})
    ranges = integer_ranges(model)
    last: Exception | None = None
    tried = 0
    for sizes in _candidates(dims, fixed):
        tried += 1
        feeds = make_feeds(model, sizes, seed=seed, integers=integers, ranges=ranges)
        try:
            return feeds, sizes, run(feeds)
        except BadInputError:
            raise
        except Exception as e:  # noqa: BLE001 - ONNX Runtime raises its own exception types
            last = e
    shown = ", ".join(k for k, d in dims.items() if d.derived is None) or "none"
    derived = [k for k, d in dims.items() if d.derived is not None]
    shown += f"; derived from them: {', '.join(derived)}" if derived else ""
    raise BadInputError(
        f"{purpose}: ONNX Runtime cannot run the input model on random inputs at any of "
        f"{tried} size(s) tried (free dimensions: {shown}; last error: "
        f"{first_line(last, limit=160) if last else 'none'}); {advice}"
    )


# -- a padded batch ----------------------------------------------------------------------------

PADDED_SEQ = (11, 13)  # the mask's length in the padded batch, tried in order (then the main run's)


@dataclasses.dataclass(frozen=True)
class Padding:
    """A padded batch: the attention-mask input, its value (rows x positions), each row's kind.

    Row kinds: ``unpadded``; ``left-padded k`` (the mask's first k positions 0, as a batch
    padded on the left for generation); ``right-padded k`` (the last k 0, as a tokenizer pads);
    in a decode step with a past, ``past left-padded k`` (the first k positions of the past 0:
    the prompt was left-padded)."""

    mask: str
    value: np.ndarray  # [rows, positions], 0/1
    rows: tuple[str, ...]
    positions: str = ""  # the position-ids input made consistent with the mask, "" when none

    def describe(self) -> str:
        rows, length = self.value.shape
        made = f"; {self.positions} = cumsum({self.mask}) - 1, 0 where masked" if self.positions else ""
        return f"{self.mask} [{rows}, {length}]: rows " + ", ".join(self.rows) + made


def attention_mask_input(model: ir.Model, ranges: Mapping[str, IntegerRange]) -> ir.Value | None:
    """The model's attention-mask input: a rank-2 input named ``*attention_mask*`` (the
    encoder's before a decoder's), else a rank-2 integer input its readers show to be a mask
    (:func:`integer_ranges`); None when it has none."""
    candidates = [v for v in runtime_inputs(model) if v.shape is not None and len(v.shape) == 2]
    named = [v for v in candidates if "attention_mask" in (v.name or "").lower()]
    named.sort(key=lambda v: "decoder" in v.name.lower())
    if named:
        return named[0]
    return next((v for v in candidates if v.name in ranges and ranges[v.name].mask), None)


def defined_positions(shape: tuple[int, ...], mask: np.ndarray) -> np.ndarray | None:
    """Where a tensor computed from a padded batch is defined: a boolean array of ``shape``,
    None when every element is (the rule of :mod:`opfuse.verify`'s "Padded batches").

    ``mask`` is [rows, T]. A tensor whose axis 0 is the rows (or a multiple of them, batch-major,
    read as [rows, m, ...]: heads [rows * heads, S, D], or tokens flattened [rows * T, D]) has as
    *position axes* its other axes of size T; an element is defined where the mask is 1 at its
    index on every position axis of its row. A tensor with no
    position axis (a decode step's logits [rows, 1, V], a pooled output) is defined everywhere."""
    rows, length = mask.shape
    if len(shape) < 2 or shape[0] == 0 or shape[0] % rows:
        return None
    view = (rows, shape[0] // rows, *shape[1:]) if shape[0] != rows else tuple(shape)
    axes = [a for a in range(1, len(view)) if view[a] == length]
    if not axes:
        return None
    keep = np.ones(view, dtype=bool)
    kept = mask.astype(bool)
    for axis in axes:
        index = [1] * len(view)
        index[0], index[axis] = rows, length
        keep &= kept.reshape(index)
    return keep.reshape(shape)


def padded_feeds(model: ir.Model, sizes: Mapping[str, int], *, seed: int = 0,
                 ranges: Mapping[str, IntegerRange] | None = None) -> tuple[dict[str, np.ndarray], Padding] | str:
    """Inputs at ``sizes`` (the batch and the mask's length already chosen) with the attention
    mask padded row by row, and position ids counted as transformers counts them for a padded
    batch (``cumsum(mask) - 1``, 0 where masked; the last ``n`` of them for ``n`` new tokens);
    a sentence saying why not, when the model cannot take one (:class:`Padding` for the rows)."""
    ranges = integer_ranges(model) if ranges is None else ranges
    mask_input = attention_mask_input(model, ranges)
    if mask_input is None:
        return "the model has no attention mask input"
    feeds = make_feeds(model, sizes, seed=seed, ranges=ranges)
    rows, length = feeds[mask_input.name].shape
    past = past_cache(model)
    past_length = feeds[past.name].shape[-2] if past is not None and past.name in feeds else 0
    if rows < 2:
        return f"the batch of '{mask_input.name}' is fixed to {rows} in the model"
    if length < 2:
        return f"'{mask_input.name}' has {length} position(s) at the sizes that run"
    mask = np.ones((rows, length), dtype=np.int64)
    if 0 < past_length < length:
        k = max(1, min(past_length, length // 2))
        kinds = ["unpadded", f"past left-padded {k}", "past left-padded 1"]
        pads = [None, slice(0, k), slice(0, 1)]
    else:
        k = max(1, min(length - 1, length // 2))
        kinds = ["unpadded", f"left-padded {k}", f"right-padded {k}"]
        pads = [None, slice(0, k), slice(length - k, length)]
    names = []
    for row in range(rows):
        if pads[row % len(pads)] is not None:
            mask[row, pads[row % len(pads)]] = 0
        names.append(kinds[row % len(kinds)])
    feeds[mask_input.name] = mask.astype(feeds[mask_input.name].dtype)
    counted = np.where(mask == 1, np.cumsum(mask, axis=-1) - 1, 0)
    positions = []
    for name, taken in ranges.items():
        value = feeds.get(name)
        if taken.positions and value is not None and value.ndim == 2 and value.shape[0] == rows \
                and value.shape[1] <= length:
            feeds[name] = counted[:, length - value.shape[1]:].astype(value.dtype)
            positions.append(name)
    return feeds, Padding(mask_input.name, mask, tuple(names), ", ".join(positions))
