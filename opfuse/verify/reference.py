"""The original model as verification's reference: the input sets it runs on, and whether
its outputs can be a reference at all.

- **Input sets** (:func:`input_sets`): the user's (an ``.npz`` keyed by input name), or
  seeded random ones built from the model (:mod:`opfuse.verify.inputs`: free dimensions at
  sizes that run, integer values that follow what they feed, extra sets for the values
  that take each branch). Inputs bound with ``--constant-input`` are not drawn (``model``
  is the bound one, ``run`` adds their values); the user's inputs may carry one, with
  exactly its bound value.
- **Finite outputs.** A float output of the original that holds NaN or inf proves
  nothing (a NaN "matches" a NaN wherever it sits): the inputs are drawn again with the
  next seeds (:data:`FINITE_RETRIES`) at the same sizes; when every draw still gives one,
  :class:`NoReference` says which output and what to do ("pass --inputs"). The same on
  the user's inputs. An extra set whose reference is not finite is dropped, with a note.
- **A padded batch** (:func:`padded_set`): a model with an attention mask
  (:func:`opfuse.verify.inputs.attention_mask_input`) runs once more on a batch of
  :data:`PADDED_ROWS` rows, unpadded, left-padded and right-padded (a decode step: its past
  left-padded), with position ids counted from the mask
  (:func:`opfuse.verify.inputs.padded_feeds`), at a mask length of
  :data:`opfuse.verify.inputs.PADDED_SEQ` (a size no head or hidden size is likely to share, so
  the position axes of the outputs are told apart), else at the main set's. Its outputs are
  compared only where defined (:func:`opfuse.verify.inputs.defined_positions`). When the model
  fixes the batch to 1, or ``--dim`` does, or the original does not run at that batch, the
  record says so (``padded_skipped``); never silently.
- **The user's inputs, padded** (:func:`given_padding`): inputs given whose attention mask holds
  zeros (a calibration sample left-padded into a fixed prefill, as ``opfuse quantize`` verifies its
  folds on one) are such a batch already, the user's own: their set is labelled
  :data:`GIVEN_PADDED_LABEL` and compared where defined by the same rule, and the record says
  so (``padded``). Their mask length is the user's, so an axis that only shares its size (a head
  size equal to the prefill's length) is compared where the mask is 1 as well: fewer elements
  compared, none excused that the rule defines.
- **Fresh runs** (:func:`rerun`): the sets run again in order from a new session, for
  models whose random ops keep a generator between runs (:mod:`opfuse.verify.random_ops`), and
  to tell a nondeterministic original from a wrong rewrite.
"""

from __future__ import annotations

__all__ = ["FINITE_RETRIES", "PADDED_LABEL", "GIVEN_PADDED_LABEL", "PADDED_ROWS", "given_padding", "CHUNK", "NoReference", "Runner", "ScaledOnce", "load_inputs",
           "input_sets", "padded_set", "rerun", "non_finite", "require_finite", "input_free", "permuted_scales",
           "finite_max_abs"]

import os
import pathlib
from collections.abc import Iterable, Mapping

import numpy as np
import onnx_ir as ir

from opfuse.prepare.constant_inputs import drop_bound
from opfuse.errors import BadInputError
from opfuse.core.dims import derive_sizes, dim_key, free_dims, resolve_dims, runtime_inputs
from opfuse.verify.inputs import (
    MAX_INTEGER_CASES,
    PADDED_SEQ,
    Padding,
    attention_mask_input,
    defined_positions,
    padded_feeds,
    describe_sizes,
    find_sizes,
    integer_cases,
    integer_ranges,
    make_feeds,
)
from opfuse.report import Verification
from opfuse.verify.random_ops import RANDOM_OPS
from opfuse.runtime import create_session
from opfuse.core.ops import first_line, is_onnx

FINITE_RETRIES = 3  # further seeds tried when the original's output is not finite
PADDED_LABEL = "padded batch"  # the padded batch's input-set label
GIVEN_PADDED_LABEL = "given, padded"  # the user's inputs when their attention mask holds zeros (given_padding)
PADDED_ROWS = 3  # unpadded, left-padded, right-padded (a decode step: its past padded by k, by 1)
CHUNK = 1 << 20  # elements read at a time where a large tensor is scanned or compared in float64


class NoReference(Exception):  # noqa: N818 - a verdict, not a failure of opfuse
    """The original's outputs cannot serve as a reference (the message says why)."""


class Runner:
    """One ONNX Runtime session; runs return {name: array} for every output. Its kernels keep no
    repacked copy of the weights (``prepack=False``), and a model kept with external data gives the
    runtime its weights where they are (``share_weights``: mapped from their file, not copied):
    verification's sessions hold a model's weights once, not twice. Without the runtime's memory
    arena (``cpu_arena=False``): what a run frees goes back to the system, where the arena keeps its
    largest chunk (a tied head's transposed table, the size of the embedding) resident after the
    session is gone, beside the next model's session."""

    def __init__(self, model):  # an ir.Model or what runtime.serialized made of one
        self.session = create_session(model, "disabled", prepack=False, share_weights=True, cpu_arena=False)
        self.names = [o.name for o in self.session.get_outputs()]

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self.names, self.session.run(self.names, dict(feeds))))


def load_inputs(model: ir.Model, path: str | os.PathLike,
                bound: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Inputs from an .npz file keyed by graph input name (a ``bound`` input, when the file
    has it, must hold its bound value and is dropped)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise BadInputError(f"{path}: no such inputs file")
    try:
        with np.load(path, allow_pickle=False) as data:
            feeds = {k: data[k] for k in data.files}
    except Exception as e:  # noqa: BLE001 - numpy raises many kinds for a bad file
        raise BadInputError(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") from None
    if bound:
        feeds = drop_bound([feeds], bound, str(path), numbered=False)[0]
    expected = {v.name for v in runtime_inputs(model)}
    missing = sorted(expected - set(feeds))
    unknown = sorted(set(feeds) - expected)
    if missing or unknown:
        raise BadInputError(
            f"{path}: inputs do not match the model"
            + (f"; missing {missing}" if missing else "")
            + (f"; not inputs of the model {unknown}" if unknown else "")
        )
    return feeds


def rerun(original_x, sets):
    """The input sets with the original's outputs from a fresh session, run in order."""
    runner = Runner(original_x)
    return [(label, feeds, runner(feeds)) for label, feeds, _ in sets]


def non_finite(outputs: Mapping[str, np.ndarray], names: Iterable[str], mask: np.ndarray | None = None) -> str | None:
    """A sentence naming the first float output among ``names`` that holds NaN or inf (``mask``:
    a padded batch's, only where the output is defined)."""
    for name in names:
        array = np.asarray(outputs.get(name))
        if array.dtype.kind != "f" or array.size == 0:
            continue
        where = defined_positions(array.shape, mask) if mask is not None else None
        array = array[where] if where is not None else array
        finite = np.isfinite(array)
        if finite.all():
            continue
        what = "NaN" if np.isnan(array).any() else "infinite"
        count = int(array.size - finite.sum())
        amount = "is" if count == array.size else f"has {count} of {array.size} values"
        return f"the original's output '{name}' {amount} {what}"
    return None


def require_finite(outputs, names, where: str, mask: np.ndarray | None = None) -> None:
    problem = non_finite(outputs, names, mask)
    if problem:
        raise NoReference(f"{problem} {where}; pass --inputs FILE.npz with inputs on which its outputs "
                          "are finite (or --no-verify)")


def input_sets(original, run, inputs, dims, seed, result: Verification, graph_outputs, bound=None):
    """[(label, feeds, expected outputs)]: the user's inputs, or random ones that run, on
    which the original's outputs are finite (:class:`NoReference` when none are).
    ``bound``: the values of the inputs bound with ``--constant-input`` (not in the feeds)."""
    if inputs is not None:
        if isinstance(inputs, Mapping):
            feeds, result.inputs = drop_bound([dict(inputs)], bound or {}, "inputs", numbered=False)[0], "given"
        else:
            feeds, result.inputs = load_inputs(original, inputs, bound), str(inputs)
        try:
            expected = run(feeds)
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise BadInputError(
                "cannot verify: ONNX Runtime cannot run the input model on the given inputs "
                f"({first_line(e)}); pass --no-verify to skip verification"
            ) from None
        mask_input = attention_mask_input(original, integer_ranges(original))
        padding = given_padding(mask_input, feeds)
        if padding is not None:
            require_finite(expected, graph_outputs, "on the given inputs", padding.value)
            result.padded, result.padded_input = padding.describe(), padding.mask
            return [(GIVEN_PADDED_LABEL, feeds, expected)]
        require_finite(expected, graph_outputs, "on the given inputs")
        if mask_input is not None:
            result.padded_skipped = ("the inputs are the user's, unpadded (a padded batch is verified on generated "
                                     "inputs only)")
        return [("", feeds, expected)]
    fixed = resolve_dims(original, dims)
    feeds, sizes, expected = find_sizes(original, run, fixed=fixed, seed=seed)
    ranges = integer_ranges(original)
    used = seed
    while non_finite(expected, graph_outputs) and used < seed + FINITE_RETRIES:
        used += 1  # the same sizes, other values
        feeds = make_feeds(original, sizes, seed=used, ranges=ranges)
        try:
            expected = run(feeds)
        except Exception:  # noqa: BLE001 - these values do not run: the next seed
            continue
    require_finite(expected, graph_outputs,
                   f"on generated inputs (seeds {seed}-{used})" if used > seed else "on generated inputs")
    result.sizes = dict(sizes)
    sets = [("", feeds, expected)]
    for name, values in integer_cases(original).items():
        for value in values:
            if len(sets) > MAX_INTEGER_CASES:
                break
            try:
                more = find_sizes(original, run, fixed=fixed, seed=used, integers={name: value})
            except BadInputError:
                continue  # the value does not run at any size: no extra set
            problem = non_finite(more[2], graph_outputs)
            if problem:
                result.notes.append(f"input set {name}={value} dropped: {problem} on it")
                continue
            sets.append((f"{name}={value}", more[0], more[2]))
            result.input_sets.append(f"{name}={value}")
    padded = padded_set(original, run, fixed, sizes, used, graph_outputs)
    if isinstance(padded, tuple):
        feeds_padded, expected_padded, padding = padded
        sets.append((PADDED_LABEL, feeds_padded, expected_padded))
        result.input_sets.append(PADDED_LABEL)
        result.padded, result.padded_input = padding.describe(), padding.mask
    elif padded:
        result.padded_skipped = padded
        result.notes.append(f"no padded batch verified: {padded}")
    shown = describe_sizes(free_dims(original), sizes)
    result.inputs = f"random (seed {used})" + (f" at {shown}" if shown else "")
    if used > seed:
        result.notes.append(f"seed {used} used: the original's outputs were not finite on seed(s) "
                            f"{seed}-{used - 1}")
    if ranges:
        result.notes.append("integer inputs drawn by what they feed: "
                            + "; ".join(r.describe(n) for n, r in ranges.items()))
    if result.input_sets:
        result.inputs += "; again with " + ", ".join(result.input_sets)
    return sets


def given_padding(mask_input: ir.Value | None, feeds: Mapping[str, np.ndarray]) -> Padding | None:
    """The padding of the user's inputs (module docstring): their attention mask when it is [rows, T]
    of 0 and 1 with at least one 0, each row described by where its zeros are; None otherwise."""
    if mask_input is None or mask_input.name not in feeds:
        return None
    value = np.asarray(feeds[mask_input.name])
    if value.ndim != 2 or value.size == 0 or value.all() or not np.isin(value, (0, 1)).all():
        return None
    rows = []
    for row in value.astype(bool):
        zeros = int((~row).sum())
        if not zeros:
            rows.append("unpadded")
        elif not row[:zeros].any():
            rows.append(f"left-padded {zeros}")
        elif row[:row.size - zeros].all():
            rows.append(f"right-padded {zeros}")
        else:
            rows.append(f"{zeros} masked")
    return Padding(mask_input.name, value.astype(np.int64), tuple(rows))


def padded_set(original, run, fixed: Mapping[str, int], sizes: Mapping[str, int], seed: int,
               graph_outputs) -> tuple[dict, dict, Padding] | str:
    """(feeds, the original's outputs, the padding) of the padded batch (module docstring), or
    why there is none: "" for a model without an attention mask, else a sentence."""
    ranges = integer_ranges(original)
    mask_input = attention_mask_input(original, ranges)
    if mask_input is None:
        return ""
    dims = free_dims(original)
    batch = dim_key(mask_input, 0, mask_input.shape[0])
    if batch is None and mask_input.shape[0] < 2:
        return f"the batch of '{mask_input.name}' is fixed to {mask_input.shape[0]} in the model"
    if batch is not None and batch[0] in fixed and fixed[batch[0]] < 2:
        return f"--dim fixes the batch of '{mask_input.name}' ({batch[0]}) to {fixed[batch[0]]}"
    base = {k: v for k, v in sizes.items() if k in dims and dims[k].derived is None}
    rows = {k: PADDED_ROWS for k, d in dims.items() if d.batch and k not in fixed}
    length = dim_key(mask_input, 1, mask_input.shape[1])
    growing: list[str] = []
    if length is not None:
        growing = list(dims[length[0]].derived.names) if dims[length[0]].derived else [length[0]]
        main = {base.get(n) for n in growing}
        growing += [k for k, d in dims.items() if d.derived is None and not d.batch and k not in growing
                    and base.get(k) in main]
        growing = [n for n in growing if n not in fixed]
    tried, last = [], None
    for size in (*PADDED_SEQ, None) if growing else (None,):
        chosen = derive_sizes(dims, {**base, **rows, **({n: size for n in growing} if size else {})})
        made = padded_feeds(original, chosen, seed=seed, ranges=ranges)
        if isinstance(made, str):
            return made
        feeds, padding = made
        tried.append(str(padding.value.shape[1]))
        try:
            expected = run(feeds)
        except Exception as e:  # noqa: BLE001 - ONNX Runtime raises its own exception types
            last = e
            continue
        problem = non_finite(expected, graph_outputs, padding.value)
        if problem:
            return f"{problem} where defined on the padded batch"
        return feeds, expected, padding
    return (f"the original does not run on a padded batch of {PADDED_ROWS} rows (mask length "
            f"{', '.join(tried)}: {first_line(last, limit=160) if last else 'no error'})")


class ScaledOnce:
    """The original's runner, where the tensors in ``free`` (no input reaches them: the same on every
    input set; read only for a graph output's floor, :func:`opfuse.verify._floor`, which takes their largest finite
    magnitude) are fetched on the first run only, and stand in every result as that magnitude, a
    0-d array (a tied head's transposed table: 113 MB of SmolLM2's, 545 MB of Qwen2-0.5B's, per set).
    ``known``: those whose magnitude :func:`permuted_scales` read from the weight they rearrange, never
    fetched (not even once: the run does not hand over a copy of the table)."""

    def __init__(self, runner, free: set[str], known: Mapping[str, np.ndarray] | None = None):
        self.runner, self.free, self.proxies = runner, free, dict(known or {})
        self.fetched = False
        if self.proxies:
            self.runner.names = [n for n in self.runner.names if n not in self.proxies]

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = self.runner(feeds)
        if not self.fetched:
            self.fetched = True
            for name in self.free & set(out):
                scale = finite_max_abs(np.asarray(out[name]))
                self.proxies[name] = np.array(np.nan if scale is None else scale, dtype=np.asarray(out[name]).dtype)
            self.runner.names = [n for n in self.runner.names if n not in self.proxies]
        out.update(self.proxies)
        return out


PERMUTATIONS = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})  # same elements


def permuted_scales(model: ir.Model, names: set[str]) -> dict[str, np.ndarray]:
    """name -> the largest finite magnitude (a 0-d array of its dtype, NaN for none) of those of ``names``
    (main-graph tensors) that are a constant rearranged by ops that keep every element and add none
    (:data:`PERMUTATIONS`: a tied head's Transpose of the embedding), read from the constant itself (the
    same elements, so the same magnitude, :func:`finite_max_abs`), a chunk at a time where it is."""
    out = {}
    producers = {v.name: node for node in model.graph for v in node.outputs}
    for name in names:
        node, value = producers.get(name), None
        while node is not None and is_onnx(node) and node.op_type in PERMUTATIONS and node.inputs \
                and node.inputs[0] is not None:
            value = node.inputs[0]
            node = value.producer()
        if value is None:
            continue
        if node is None:  # an initializer
            tensor = value.const_value
        elif is_onnx(node) and node.op_type == "Constant" and "value" in node.attributes:
            tensor = node.attributes["value"].value
        else:
            continue
        if tensor is None:
            continue
        try:
            array = tensor.numpy()
        except Exception:  # noqa: BLE001 - a dtype numpy cannot hold: fetched from the run instead
            continue
        if array.dtype.kind != "f":
            continue
        scale = finite_max_abs(array)
        out[name] = np.array(np.nan if scale is None else scale, dtype=array.dtype)
    return out


def input_free(model: ir.Model, names: set[str]) -> set[str]:
    """Those of ``names`` (main-graph tensors) that no graph input reaches: computed from initializers
    and constants alone, by nodes that draw nothing random and hold no subgraph."""
    if not names:
        return set()
    reached = {v.name for v in model.graph.inputs}
    for node in model.graph:  # (in order: a node's inputs come before it)
        if (not is_onnx(node) or node.op_type in RANDOM_OPS or not node.inputs and node.op_type != "Constant"
                or any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
                or any(v is not None and v.name in reached for v in node.inputs)):
            reached.update(v.name for v in node.outputs)
    return {n for n in names if n not in reached}


def finite_max_abs(values: np.ndarray) -> float | None:
    """The largest finite magnitude in ``values`` (None: none), a chunk at a time in their own dtype
    (exact: no float64 copy of a large tensor, a tied head's transposed table)."""
    values = values.reshape(-1)
    best = None
    for start in range(0, values.size, CHUNK):
        chunk = np.abs(values[start:start + CHUNK])
        chunk = chunk[np.isfinite(chunk)]
        if chunk.size:
            best = max(float(chunk.max()), best if best is not None else 0.0)
    return best
