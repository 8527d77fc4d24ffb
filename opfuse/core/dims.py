"""The free dimensions of a model's inputs: which there are, which derive from others, and
the sizes ``--dim`` gives them (verification and calibration draw inputs at these sizes,
:mod:`opfuse.verify.inputs`).

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
- **Derived dimensions.** A dimension whose name is arithmetic on others (torch's
  exporters write ``past_seq + 1``, ``2*seq``, ``seq - 1``, ``((past_seq + 1)//2)``,
  ``batch*past_seq``) is computed from them whenever every name in it is another free
  dimension of the inputs: never drawn, never searched (a KV-cache decode step's mask
  ``[batch, past_seq + 1]`` drawn apart from its past ``[batch, H, past_seq, D]`` runs on
  no model, or on the original and not on a fused attention that checks). The name is
  parsed by :mod:`ast` and only names, integers, ``+ - * //``, unary minus and
  parentheses are admitted (:func:`parse_dim_expression`); anything else is a dimension of
  its own. ``--dim`` may give a derived dimension: alone, it fixes the one name it reads
  (``--dim 'past_seq + 1=17'`` sets ``past_seq=16``); with its names, it must agree with
  them, and a contradiction is a usage error. A search assignment giving a derived
  dimension a size below 1 is skipped. The report says which sizes were derived.
- **The same dimension** (:func:`same_dim`): what the rewrites ask of two dims of inferred
  shapes before they fuse (an attention's batch and sequence, a rotary table against its
  input, ``Range(0, n)`` against the axis it indexes). One rule for all of them, below.
"""

from __future__ import annotations

__all__ = [
    "FreeDim",
    "DimExpression",
    "parse_dim_expression",
    "derive_sizes",
    "free_dims",
    "resolve_dims",
    "runtime_inputs",
    "dim_name",
    "dim_key",
    "symbol",
    "same_dim",
    "SIZE_STEPS",
]

import ast
import dataclasses
import operator
from collections.abc import Mapping

import onnx_ir as ir

from opfuse.errors import BadInputError

SIZE_STEPS = (8, 32, 64, 1, 224, 320, 640)  # tried in this order (opfuse.verify.inputs.find_sizes)


# -- dimensions named by an expression of others ----------------------------------------------

MAX_EXPRESSION_CHARS = 200  # a longer name is read as a name, never parsed
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


@dataclasses.dataclass(frozen=True)
class DimExpression:
    """A dimension named by arithmetic on others (``past_seq + 1``, ``2*seq``,
    ``((past_seq + 1)//2)``): names, integers, ``+ - * //``, unary minus and parentheses."""

    text: str
    tree: ast.expr
    names: tuple[str, ...]  # the dimensions it reads, in order of first appearance

    def evaluate(self, sizes: Mapping[str, int]) -> int:
        """Its size at ``sizes`` (which must hold every name; // by 0 raises ZeroDivisionError)."""
        return _evaluate(self.tree, sizes)


def _evaluate(node: ast.expr, sizes: Mapping[str, int]) -> int:
    if isinstance(node, ast.Name):
        return int(sizes[node.id])
    if isinstance(node, ast.Constant):
        return int(node.value)
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand, sizes)
    assert isinstance(node, ast.BinOp)  # parse_dim_expression admits nothing else
    return _ARITHMETIC[type(node.op)](_evaluate(node.left, sizes), _evaluate(node.right, sizes))


def _admitted(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return True
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.USub) and _admitted(node.operand)
    if isinstance(node, ast.BinOp):
        return type(node.op) in _ARITHMETIC and _admitted(node.left) and _admitted(node.right)
    return False


def parse_dim_expression(text: str) -> DimExpression | None:
    """The expression a dimension's name spells, None when it is a plain name or anything
    outside the grammar (a call, an attribute, a power, a float, a string: such a name is a
    dimension of its own, never evaluated). Parsed by :mod:`ast`, walked, never ``eval``-ed."""
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    try:
        if isinstance(tree, ast.Name) or not _admitted(tree):
            return None
    except RecursionError:
        return None
    names = tuple(dict.fromkeys(n.id for n in ast.walk(tree) if isinstance(n, ast.Name)))
    return DimExpression(text, tree, names) if names else None


@dataclasses.dataclass(frozen=True)
class FreeDim:
    """One free dimension: its key (a name, or ``INPUT:AXIS``) and where it appears.

    ``derived``: the expression its name spells, when every name in it is another free
    dimension of the model's inputs (its size follows from theirs: never drawn)."""

    key: str
    places: tuple[tuple[str, int], ...]  # (input name, axis)
    named: bool
    batch: bool  # axis 0 of an input of rank 2 or more somewhere: stays 1
    derived: DimExpression | None = None


def runtime_inputs(model: ir.Model) -> list[ir.Value]:
    return [v for v in model.graph.inputs if not v.is_initializer()]


def dim_name(dim) -> str | None:
    """A symbolic dimension's name, None for a fixed or anonymous one: "" and "?" name no
    dimension (Paddle2ONNX writes "?" on every free axis: PP-OCR's classifier has H and W
    both "?", which are not one size)."""
    name = getattr(dim, "value", None)
    return None if isinstance(dim, int) or name is None or str(name) in ("", "?") else str(name)


ANONYMOUS_PREFIX = "unk__"  # onnx's shape inference: the name of a dim it could not determine


def symbol(dim) -> str | None:
    """The name a dim of an inferred shape is known by, None when it has none: a fixed size, no
    name, "" or "?" (:func:`dim_name`), or onnx's ``unk__N``.

    ``unk__N`` is a placeholder, not a name: onnx's inference writes a fresh one for each dim it
    could not determine (ONNX Runtime's symbolic inference reads them as unknown). Two values
    carrying the same ``unk__N`` are equal only as far as one run of one tool propagated it;
    nothing the model states says so (opfuse infers shapes many times, a file may carry another
    tool's). A model's input may still be given one (``--dim unk__0=4``: :func:`dim_key`)."""
    name = dim_name(dim)
    return None if name is None or name.startswith(ANONYMOUS_PREFIX) else name


def same_dim(a, b) -> bool:
    """Whether two dims of inferred shapes are provably equal: the same integer, or the same
    :func:`symbol` (``batch``, ``past_seq + 1``).

    An anonymous dim (no :func:`symbol`: none, "", "?", ``unk__N``) is the same as no other,
    itself included: Paddle2ONNX writes "?" on every free axis, and ``unk__N`` proves nothing
    (:func:`symbol`). A rewrite that needs two dims equal refuses then: that costs a fusion,
    never a wrong one. An integer is never the same as a symbol (``batch`` may be 1 at run time,
    but nothing says it is)."""
    if isinstance(a, int) or isinstance(b, int):
        return isinstance(a, int) and isinstance(b, int) and a == b
    name = symbol(a)
    return name is not None and name == symbol(b)


def dim_key(value: ir.Value, axis: int, dim) -> tuple[str, bool] | None:
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
            found = dim_key(value, axis, dim)
            if found is None:
                continue
            key, is_named = found
            places.setdefault(key, []).append((value.name, axis))
            named[key] = is_named
            batch_like[key] = batch_like.get(key, False) or (axis == 0 and rank >= 2)
    parsed = {k: parse_dim_expression(k) for k in places if named[k]}
    bases = {k for k in places if named[k] and parsed[k] is None}
    derived = {k: e for k, e in parsed.items() if e is not None and set(e.names) <= bases}
    return {k: FreeDim(k, tuple(p), named[k], batch_like[k] and k not in derived, derived.get(k))
            for k, p in places.items()}


def _listing(dims: Mapping[str, FreeDim]) -> str:
    if not dims:
        return "the model has no free input dimensions"
    parts = []
    for d in dims.values():
        where = ", ".join(f"{i}:{a}" for i, a in d.places)
        where += f"; derived from {', '.join(d.derived.names)}" if d.derived else ""
        parts.append(f"{d.key} ({where})" if d.named else d.key)
    return "the model's free dimensions: " + ", ".join(parts)


SOLVE_LIMIT = 1 << 16  # the largest base size tried when a --dim gives a derived dimension


def _solve(expression: DimExpression, known: Mapping[str, int], name: str, target: int) -> int | None:
    """The smallest size >= 1 of ``name`` at which ``expression`` is ``target`` (the others
    ``known``): read off a line through 0 and 1 when it is one, else searched."""
    def at(x: int) -> int | None:
        try:
            return expression.evaluate({**known, name: x})
        except ZeroDivisionError:
            return None

    low, high = at(0), at(1)
    if low is not None and high is not None and high != low and (target - low) % (high - low) == 0:
        x = (target - low) // (high - low)
        if x >= 1 and at(x) == target:
            return x
    return next((x for x in range(1, SOLVE_LIMIT) if at(x) == target), None)


def derive_sizes(dims: Mapping[str, FreeDim], sizes: Mapping[str, int]) -> dict[str, int]:
    """``sizes`` with each derived dimension whose names all have a size, and that is not
    in ``sizes`` already, computed from them (a // by 0 gives 0: no size)."""
    out = dict(sizes)
    for key, dim in dims.items():
        if dim.derived is not None and key not in out and all(n in out for n in dim.derived.names):
            try:
                out[key] = dim.derived.evaluate(out)
            except ZeroDivisionError:
                out[key] = 0
    return out


def _settle(dims: Mapping[str, FreeDim], given: Mapping[str, int]) -> dict[str, int]:
    """Given sizes with the bases a given derived dimension fixes solved for (when one of its
    names is left) and every derived dimension they decide computed; a contradiction, or a
    derived size below 1, is a usage error."""
    sizes = {k: v for k, v in given.items() if dims[k].derived is None}
    pending = {k: v for k, v in given.items() if dims[k].derived is not None}
    progress = True
    while progress:
        progress = False
        for key, size in pending.items():
            expression = dims[key].derived
            unknown = [n for n in expression.names if n not in sizes]
            if len(unknown) != 1:
                continue
            solved = _solve(expression, sizes, unknown[0], size)
            if solved is None:
                raise BadInputError(f"--dim '{key}={size}': no size of {unknown[0]} makes {key} = {size}; "
                                    f"give {unknown[0]} with --dim {unknown[0]}=N (the other follows)")
            sizes[unknown[0]] = solved
            progress = True
    out = derive_sizes(dims, sizes)
    for key, size in pending.items():
        expression = dims[key].derived
        if key not in out:
            left = [n for n in expression.names if n not in sizes]
            raise BadInputError(f"--dim '{key}={size}': {key} is derived from {', '.join(left)}, which it "
                                f"does not decide alone; give them with --dim {left[0]}=N (its size follows)")
        if out[key] != size:
            at = ", ".join(f"{n}={out[n]}" for n in expression.names)
            raise BadInputError(f"--dim '{key}={size}' contradicts {at}, at which {key} is {out[key]}; "
                                "give only the dimensions it is made of (its size follows)")
    for key, size in out.items():
        if size < 1:
            at = ", ".join(f"{n}={out[n]}" for n in dims[key].derived.names)
            raise BadInputError(f"--dim: at {at} the derived dimension {key} is {size}; sizes must be at least 1")
    return out


def resolve_dims(model: ir.Model, given: Mapping[str, int] | None) -> dict[str, int]:
    """``--dim`` values by free-dimension key, with the derived dimensions they decide; an
    unknown name or position, or a size that contradicts a derived one, is a usage error.

    ``INPUT:AXIS`` may also address a named dimension (it then sets that name everywhere).
    A derived dimension given alone fixes the one name it reads (``--dim 'past_seq + 1=17'``
    sets ``past_seq`` to 16); given with its names, it must agree with them.
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
    return _settle(dims, out)
