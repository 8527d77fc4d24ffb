"""Verification inputs built from the model: sizes that run, integer values that branch.

A model's inputs declare their shapes with fixed sizes and **free dimensions**: a named
symbol (``batch``, ``height``), or an unnamed one (``-1``, ``'?'``, or no value at all).

- A named dimension is one value wherever it appears (``--dim batch=4``). An unnamed one
  is its own dimension, addressed by position (``--dim x:2=320``: input ``x``, axis 2).
  A name or position the model does not have is a usage error that lists the model's
  free dimensions.
- **Sizes that run.** Batch dimensions are 1; the others try the sizes of
  :data:`SIZE_STEPS` in order: small real sizes first, 8, 32, 64 (at 1x1 a 3x3
  convolution uses only its centre tap, so a transposed kernel would pass unseen; a
  detector may need a multiple of its stride), then 1, then larger sizes (a reflect Pad
  needs more samples than it pads, a Resize a real image). At each size,
  first all of them together, then each alone (so a dimension that must stay equal to
  the batch, like the ``[2, ?, 128]`` state of an RNN, is not forced up with the
  others). A dimension is *batch* when it is axis 0 of an input of rank 2 or more.
  Dimensions given with ``--dim`` never change. The sizes used are reported.
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
- **Integer values that branch.** A random integer in 0-7 rarely equals the sample rate
  an ``If`` tests for. Integer inputs that reach a comparison with a constant (``Equal``,
  ``Less``, ``Greater`` and their ``OrEqual`` forms, through reshapes, casts and gathers)
  give one extra input set per value that flips it (the constant itself for ``Equal``,
  one step either side for the ordered comparisons).
"""

from __future__ import annotations

__all__ = [
    "SIZE_STEPS",
    "FreeDim",
    "free_dims",
    "resolve_dims",
    "integer_cases",
    "IntegerRange",
    "integer_ranges",
    "make_feeds",
    "find_sizes",
]

import dataclasses
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnx_ir as ir

from opfuse.analyse import Constant, find_constant, iter_scopes
from opfuse.errors import BadInputError
from opfuse.vocabulary import first_line, is_op

SIZE_STEPS = (8, 32, 64, 1, 224, 320, 640)  # tried in this order
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


@dataclasses.dataclass(frozen=True)
class FreeDim:
    """One free dimension: its key (a name, or ``INPUT:AXIS``) and where it appears."""

    key: str
    places: tuple[tuple[str, int], ...]  # (input name, axis)
    named: bool
    batch: bool  # axis 0 of an input of rank 2 or more somewhere: stays 1


def runtime_inputs(model: ir.Model) -> list[ir.Value]:
    return [v for v in model.graph.inputs if not v.is_initializer()]


def dim_name(dim) -> str | None:
    """A symbolic dimension's name, None for a fixed or anonymous one: "" and "?" name no
    dimension (Paddle2ONNX writes "?" on every free axis: PP-OCR's classifier has H and W
    both "?", which are not one size)."""
    name = getattr(dim, "value", None)
    return None if isinstance(dim, int) or name is None or str(name) in ("", "?") else str(name)


def _dim_key(value: ir.Value, axis: int, dim) -> tuple[str, bool] | None:
    """(key, named) for a free dimension, None for a fixed one."""
    if isinstance(dim, int):
        return None if dim >= 0 else (f"{value.name}:{axis}", False)
    name = dim_name(dim)
    return (f"{value.name}:{axis}", False) if name is None else (name, True)


def free_dims(model: ir.Model) -> dict[str, FreeDim]:
    """The model's free input dimensions by key, in input order."""
    places: dict[str, list[tuple[str, int]]] = {}
    named: dict[str, bool] = {}
    batch_like: dict[str, bool] = {}
    for value in runtime_inputs(model):
        if value.shape is None:
            continue
        rank = len(value.shape)
        for axis, dim in enumerate(value.shape):
            found = _dim_key(value, axis, dim)
            if found is None:
                continue
            key, is_named = found
            places.setdefault(key, []).append((value.name, axis))
            named[key] = is_named
            batch_like[key] = batch_like.get(key, False) or (axis == 0 and rank >= 2)
    return {k: FreeDim(k, tuple(p), named[k], batch_like[k]) for k, p in places.items()}


def _listing(dims: Mapping[str, FreeDim]) -> str:
    if not dims:
        return "the model has no free input dimensions"
    parts = []
    for d in dims.values():
        where = ", ".join(f"{i}:{a}" for i, a in d.places)
        parts.append(f"{d.key} ({where})" if d.named else d.key)
    return "the model's free dimensions: " + ", ".join(parts)


def resolve_dims(model: ir.Model, given: Mapping[str, int] | None) -> dict[str, int]:
    """``--dim`` values by free-dimension key; an unknown name or position is a usage error.

    ``INPUT:AXIS`` may also address a named dimension (it then sets that name everywhere).
    """
    dims = free_dims(model)
    by_place = {f"{i}:{a}": d.key for d in dims.values() for i, a in d.places}
    out: dict[str, int] = {}
    for text, size in (given or {}).items():
        key = text if text in dims else by_place.get(text)
        if key is None:
            raise BadInputError(f"--dim {text}={size}: no such free dimension; {_listing(dims)}")
        if int(size) < 1:
            raise BadInputError(f"--dim {text}={size}: sizes must be at least 1")
        out[key] = int(size)
    return out


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
    """The values drawn for one integer input: 0 .. high-1, and why (None: the default)."""

    high: int
    why: str | None = None
    mask: bool = False  # a mask: one kept position per row (the first of the last axis)

    def describe(self, name: str) -> str:
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
    return None


def integer_ranges(model: ir.Model) -> dict[str, IntegerRange]:
    """Integer input name -> the values to draw for it (see the module docstring).

    Decided by walking the input's readers in the main graph, and by name for a mask no
    reader identifies; inputs with no such reader are left out (they take 0-7).
    """
    out: dict[str, IntegerRange] = {}
    for value in runtime_inputs(model):
        if value.dtype is None or np.dtype(value.dtype.numpy()).kind not in "iu":
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


def subgraph_labels(model: ir.Model) -> set[str]:
    return {scope.label for scope in iter_scopes(model)}


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
    feeds = {}
    for value in runtime_inputs(model):
        if value.type is None or value.shape is None or value.dtype is None:
            raise BadInputError(
                f"graph input '{value.name}' has no declared type or shape; "
                "give inputs with --inputs FILE.npz"
            )
        shape = []
        for axis, dim in enumerate(value.shape):
            found = _dim_key(value, axis, dim)
            shape.append(int(dim) if found is None else int(sizes.get(found[0], 1)))
        dtype = value.dtype.numpy()
        kind = np.dtype(dtype).kind
        if kind == "f" or str(dtype) == "bfloat16":
            data = rng.standard_normal(shape).astype(dtype)
        elif kind in "iu":
            if value.name in integers:
                data = np.full(shape, integers[value.name], dtype=dtype)
            else:
                taken = ranges.get(value.name, IntegerRange(DEFAULT_INTEGER_HIGH))
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
    """Size assignments to try, smallest first (see the module docstring)."""
    base = {k: fixed.get(k, 1) for k in dims}
    growable = [k for k, d in dims.items() if k not in fixed and not d.batch]
    if not growable:
        yield dict(base)
        return
    for step in SIZE_STEPS:
        yield {**base, **{k: step for k in growable}}
        if len(growable) > 1 and step != 1:
            for k in growable:
                yield {**base, k: step}


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
    shown = ", ".join(f"{k}" for k in dims) or "none"
    raise BadInputError(
        f"{purpose}: ONNX Runtime cannot run the input model on random inputs at any of "
        f"{tried} size(s) tried (free dimensions: {shown}; last error: "
        f"{first_line(last, limit=160) if last else 'none'}); {advice}"
    )
