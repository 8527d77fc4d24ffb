"""Step 4 of the pipeline: prove the rewritten model computes the same numbers.

Both models run on ONNX Runtime's CPU provider with the runtime's own graph optimisations
disabled (so only opfuse's rewrites differ), on the same inputs: the user's (an ``.npz``
keyed by input name) or seeded random ones built from the model (:mod:`opfuse.verify.inputs`:
free dimensions at sizes that run, integer values that follow what they feed and take
each branch, and a padded batch where the model has an attention mask;
:mod:`opfuse.verify.reference` chooses the sets).

What is compared
----------------
- **Every rewrite, at its own tensor.** A rewrite's output keeps the name of the tensor
  it replaces, so that tensor is exposed as an extra output of both models and compared
  with a tolerance scaled to *it*. A wrong fold is named precisely, and whatever follows
  it (a Sigmoid that squashes the error, a Softmax) cannot hide it or fake one. Rewrites
  inside subgraphs cannot be exposed this way; they are checked through the graph
  outputs, and the coverage says whether the inputs reached them.
- **Every graph output.**

The tolerance, per dtype (:data:`TOLERANCES`), relative to the tensor's scale (its
largest magnitude), with an absolute floor for graph outputs::

    |optimised - original| <= max(atol * scale + rtol * |original|, floor)
    floor = atol * scale_in   (graph outputs only; 0 for a rewrite's own tensor)

``scale_in`` is the largest magnitude among the values entering the operator that
produces the output (in the original model). A saturating last operator (Sigmoid,
Softmax, Tanh, Clip) maps inputs of scale 10 to outputs of scale 1e-4, where its own
rounding (steps of about 6e-8 in float32) exceeds ``atol * scale``; its inputs are
allowed ``atol * scale_in`` of difference, and so is what it computes from them. A
wrong rewrite still fails at its own tensor, where no floor applies.

A rewrite's own tensor gets a floor too when the rewritten node sums many products (a
Conv, ConvTranspose, Gemm or MatMul, fused or not)::

    floor = 8 * eps(dtype) * sqrt(K) * scale      K = the products summed per output

(A layout op after such a node, a Transpose a fold reached through, moves the same sums: its
output gets the same floor.) Two exact-in-theory computations of a K-term sum (the folded weights against the original
conv and BatchNormalization; a FusedConv against Conv then Relu) round in different
places, and float32 rounding grows like eps * sqrt(K) times the size of the terms, which
exceeds the result's where the terms cancel: ResNet-50's last 3x3 convs (K = 4608) differ
by 1.04e-5 of their scale, a torch-exported MobileNetV2's 1x1 convs with statistics from
data (K = 576) by 1.36e-5, both over ``atol`` (the floor: 6.5e-5 and 2.3e-5 of the scale).
A wrong fold (a shifted bias, a wrong epsilon, a transposed weight) is off by 1e-3 of the
scale or more.

The original's own variation
----------------------------
Where the terms cancel harder still (BatchNormalization statistics from data, small
variances, large scales), or a deep model carries float32 rounding through many layers
(at a token where a 30-layer decoder's state is sensitive, its own float32 logits stray from
the exact ones by as much as a fused attention's stray from its), the rounding is
measured instead of modelled: the original's own float32 variation ``d0``, per input set
and tensor, is the distance from its float32 run to

- the same model in float64 (:mod:`opfuse.verify.variation`: every float32 initializer, constant,
  Cast and declared type widened; a model kept with external data keeps its weights float32 where
  they are, each cast to float64 as the run reads it: the same numbers), its float32 error; or,
  where ONNX Runtime cannot build or run that (an op without a double kernel),
- the original at ONNX Runtime's :data:`VARIATION_LEVEL` (ALL: its own fusions, the same
  Conv+BatchNormalization, Conv+activation and LayerNorm rewrites, and its reorderings;
  it reorders no attention, so it underestimates a decoder's variation).

A check may differ from the original by :data:`VARIATION_FACTOR` (k = 4) times it::

    floor = max(modelled floor, k * d0)

k = 4: a correct rewrite is another float32 evaluation of the same function, off the exact
value by about as much as the original, so the two differ by up to 2 d0; twice that again
leaves room for a rewrite whose order rounds somewhat more than the export's without
admitting one that computes something else (a weight 1% off in a 30-layer net, or a
transposed one, stays far over the bound: tests/test_padded_verification.py). The extra run happens
only when some check exceeds its modelled floor (a check that passes on the fixed one
passes on the larger one), once per input set; ``d0`` is recorded on every check it was
measured for (``OutputCheck.variation``; the bound used in ``floor``), and the reference and
k on the result (``variation_level``: "float64" or "all"; ``variation_factor``).
:func:`runtime_variation` gives the same ``d0`` to another caller (the measured choice's
comparisons of variants, with ``compare_outputs(..., variation=d0)``).

Padded batches
--------------
A model with an attention mask is also verified on a padded batch, as callers feed it
(:func:`opfuse.verify.reference.padded_set`): rows unpadded, left-padded and right-padded
(a decode step: its past left-padded), position ids counted from the mask as transformers
counts them. Outputs there are compared only where they are defined
(:func:`opfuse.verify.inputs.defined_positions`), exactly:

- a tensor whose axis 0 is the batch (or a multiple of it, batch-major, read as [B, m, ...]:
  batch x heads, or batch x tokens flattened) has as *position axes* its other axes whose size
  is the mask's length T (the padded run picks T = 11 or 13, a
  size no head or hidden size is likely to share);
- an element is compared where the mask is 1 at its index on every position axis of its row
  (logits and hidden states [B, S, ...] at real query tokens; present keys/values
  [B, H, T, D] at real key positions); a tensor with no position axis is compared whole (a
  decode step's logits [B, 1, V]: its one query is never padded).

The output of a padded query is undefined: transformers' own exports give it whatever their
mask arithmetic gives (the dynamo export's guard ``Softmax -> IsNaN -> Where(isnan, 0, p)``
makes a fully masked row 0; ONNX's Attention-23 gives another value there; the TorchScript
export's finfo.min mask a uniform average), and whatever a padded query computes reaches no
real token (its keys and values are masked out of every real query's attention). A left
padding makes a causal model's padded queries fully masked rows; a fully masked row that is
not a padded query (a mask that hides a real token from everything) is compared like any
other, so a fusion that drops the guard's semantics there fails verification. The unpadded
set is compared whole; given inputs whose mask holds zeros by this rule (:mod:`opfuse.verify.reference`).

Integer and boolean tensors must match exactly; NaNs must sit in the same places.

An inexact step
---------------
``dequantize-dynamic`` does not compute the same numbers (it removes a dynamic int8 model's
run-time rounding), so nothing here "verifies" it: its result is ``original``, the reference
every later rewrite is held to, and the model it started from runs on the same inputs for one
measured figure, its output SQNR (the input model as reference), noted in the result.

A reference that is no reference
--------------------------------
- **Non-finite outputs** (:mod:`opfuse.verify.reference`). A float output of the original that
  holds NaN or inf proves nothing: other inputs are drawn, and when none gives finite
  outputs verification fails ("not verified: the original's output 'X' is NaN on
  generated inputs; pass --inputs").
- **Random ops** (:mod:`opfuse.verify.random_ops`): private copies of both models give each
  random node the same fixed seed, and both run in fresh sessions on the same input sets
  in the same order, so each draws the same numbers; the report says which nodes.
- **A rewrite is blamed only when measured at fault.** When a check fails, the original
  runs again in a fresh session on the same inputs; if it differs from itself as much,
  the model is nondeterministic and no rewrite is blamed (not verified, with the tensor
  named).
- **Only inputs the original runs on.** Every input set is one the original ran on
  (sizes at which it fails are passed over by the size search, and a set it fails on is
  dropped); the inputs are consistent with its own declared shapes where they say so (a
  dimension named ``past_seq + 1`` is derived, :mod:`opfuse.core.dims`). So when the
  optimised model cannot run on a set, that is its failure, and the message says so:
  "ONNX Runtime cannot run the optimised model on inputs the original runs on".

Bound inputs
------------
An input bound with ``--constant-input`` (:mod:`opfuse.prepare.constant_inputs`) is gone from the
rewritten model. Inputs are drawn for the rewritten model's inputs; the original is fed
the same ones plus each bound input's value, the rewritten one only its own.

Coverage
--------
Rewrites in the main graph run on every input. A rewrite in a branch of a main-graph
``If`` counts as exercised when some input set took that branch (its condition is
exposed too). Deeper branches, loop bodies and unnamed, ambiguous Ifs cannot be observed;
those rewrites are listed as not exercised, never silently "passed".
"""

from __future__ import annotations

__all__ = ["TOLERANCES", "VARIATION_LEVEL", "VARIATION_FACTOR", "make_inputs", "run_model", "verify_models",
           "compare_outputs", "compare_tensor", "runtime_variation"]

import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from opfuse.core.analysis import infer_shapes
from opfuse.prepare.constant_inputs import bound_view, show_value
from opfuse.errors import BadInputError
from opfuse.core.dims import free_dims
from opfuse.verify.inputs import branch_conditions, defined_positions, make_feeds
from opfuse.verify.random_ops import describe_random, random_nodes, seed_random_nodes
from opfuse.verify.reference import (GIVEN_PADDED_LABEL, PADDED_LABEL, CHUNK as COMPARE_CHUNK, NoReference, Runner as _Runner, ScaledOnce
                                     as _ScaledOnce, finite_max_abs as _finite_max_abs, input_free as _input_free,
                                     input_sets, permuted_scales, require_finite, rerun)
from opfuse.verify.variation import VARIATION_LEVEL, runtime_rounding, runtime_variation
from opfuse.report import FusionRecord, OutputCheck, Verification
from opfuse.runtime import create_session, drop_resident_pages, serialized
from opfuse.core.algebra import products_per_output
from opfuse.targets.kernels import read_kernel
from opfuse.core.ops import OPS, OpKind, first_line, is_onnx, op_info, op_kind

# dtype -> (rtol, atol relative to the tensor's scale)
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-6, 1e-7),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 2e-3),
    "bfloat16": (5e-2, 1e-2),
}
VARIATION_FACTOR = 4.0  # k: a check may differ from the original by k * d0 (module docstring)
EPSILON = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
def make_inputs(
    model: ir.Model, *, dims: Mapping[str, int] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Seeded random inputs; free dims from ``dims`` (by name or ``INPUT:AXIS``), else 1.

    Names the model does not have are ignored here (the benchmarks pass a batch size for
    every model); ``opfuse optimize`` rejects them (:func:`opfuse.core.dims.resolve_dims`).
    """
    known = free_dims(model)
    by_place = {f"{i}:{a}": d.key for d in known.values() for i, a in d.places}
    sizes = {}
    for key, size in (dims or {}).items():
        target = key if key in known else by_place.get(key)
        if target is not None:
            sizes[target] = int(size)
    return make_feeds(model, sizes, seed=seed)


def run_model(model: ir.Model, feeds: Mapping[str, np.ndarray], threads: int | None = None):
    """Run on ONNX Runtime CPU with graph optimisations disabled; returns {name: array}."""
    session = create_session(model, "disabled", threads)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds))))


# -- comparing ---------------------------------------------------------------------------

def compare_outputs(
    expected: Mapping[str, np.ndarray],
    actual: Mapping[str, np.ndarray],
    floors: Mapping[str, float] | None = None,
    variation: Mapping[str, float] | None = None,
) -> list[OutputCheck]:
    """One check per expected tensor (``floors``: absolute floor per name, see above;
    ``variation``: the original's own d0 per name, from :func:`runtime_variation`, which
    admits :data:`VARIATION_FACTOR` times it)."""
    variation = variation or {}
    floors = {name: max((floors or {}).get(name, 0.0), VARIATION_FACTOR * variation.get(name, 0.0))
              for name in expected}
    checks = []
    for name, ref in expected.items():
        ref = np.asarray(ref)
        if name not in actual:
            checks.append(OutputCheck(name, str(ref.dtype), ref.shape, np.inf, np.inf, 0.0, False,
                                      "missing from the optimised model's outputs"))
            continue
        checks.append(compare_tensor(name, ref, np.asarray(actual[name]), floor=floors.get(name, 0.0),
                                     variation=variation.get(name)))
    return checks


def compare_tensor(name: str, ref: np.ndarray, got: np.ndarray, *, floor: float = 0.0,
                   rewrite: str = "", inputs: str = "", where: np.ndarray | None = None,
                   positions: str = "", variation: float | None = None) -> OutputCheck:
    """Compare one tensor under :data:`TOLERANCES` (module docstring); ``where``: compare only
    these elements (a padded batch's defined positions, described by ``positions``);
    ``variation``: the original's own d0 here, recorded (the floor already holds k * d0)."""
    dtype, shape = str(ref.dtype), tuple(ref.shape)
    tags = {"rewrite": rewrite, "inputs": inputs, "variation": variation}
    if ref.shape != got.shape or str(got.dtype) != dtype:
        return OutputCheck(name, dtype, shape, np.inf, np.inf, 0.0, False,
                           f"shape/dtype changed: {ref.shape} {dtype} -> {got.shape} {got.dtype}", **tags)
    if where is not None:
        ref, got = ref[where], got[where]
        tags["positions"] = f"{positions}: {ref.size} of {where.size} elements"
    if dtype not in TOLERANCES:
        same = bool(np.array_equal(ref, got))
        return OutputCheck(name, dtype, shape, 0.0 if same else np.inf,
                           0.0 if same else np.inf, 0.0, same, "" if same else "values differ", **tags)
    rtol, atol = TOLERANCES[dtype]
    ref, got = ref.reshape(-1), got.reshape(-1)
    nan_a = np.isnan(ref)
    if not np.array_equal(nan_a, np.isnan(got)):
        return OutputCheck(name, dtype, shape, np.inf, np.inf, 0.0, False,
                           "NaNs appear in different places", **tags)
    if nan_a.any():
        ref, got = ref[~nan_a], got[~nan_a]
    if ref.size == 0:
        return OutputCheck(name, dtype, shape, 0.0, 0.0, 0.0, True, **tags)
    scale = float(np.max(np.abs(ref))) or 1.0  # (exact in the tensor's own dtype)
    errs, scaleds = [], []
    for start in range(0, ref.size, COMPARE_CHUNK):  # in float64, a chunk at a time: no float64 copy of the whole
        a = ref[start:start + COMPARE_CHUNK].astype(np.float64)
        err = np.abs(a - got[start:start + COMPARE_CHUNK].astype(np.float64))
        limit = np.maximum(atol * scale + rtol * np.abs(a), floor)
        errs.append(np.max(err))
        scaleds.append(np.max(err / limit))
    err_max, scaled = float(np.max(errs)), float(np.max(scaleds))
    ok = bool(scaled <= 1.0)
    source = "rounding: its sum of products, the runtime's own fusion" if rewrite else "the last operator's inputs"
    if variation is not None and VARIATION_FACTOR * variation >= floor:
        source = f"{VARIATION_FACTOR:g} x the original's own float32 variation {variation:.3g}"
    floor_text = f", floor {floor:.3g} from {source}" if floor > atol * scale else ""
    problem = "" if ok else (
        f"max |diff| {err_max:.3g} exceeds the {dtype} tolerance "
        f"(rtol {rtol:g}, atol {atol:g} x scale {scale:.3g}{floor_text}) by {scaled:.1f}x"
    )
    return OutputCheck(name, dtype, shape, err_max, scaled,
                       scale, ok, problem, floor=float(floor), **tags)


# -- the models, with their probes exposed ---------------------------------------------------

def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    values = {v.name: v for v in graph.inputs}
    values.update(graph.initializers)
    for node in graph:
        for v in node.outputs:
            values[v.name] = v
    return values


def _with_outputs(model: ir.Model, names: Iterable[str], dtypes: Mapping[str, ir.DataType]) -> tuple[ir.Model, list[str]]:
    """A copy of ``model`` with the named main-graph tensors as extra outputs; the names added."""
    work = model.clone()
    values = _values_by_name(work.graph)
    if any(values[n].dtype is None and n not in dtypes for n in names if n in values):
        infer_shapes(work)  # a private copy: the types of the tensors to expose
        values = _values_by_name(work.graph)
    present = {v.name for v in work.graph.outputs}
    added = []
    for name in names:
        value = values.get(name)
        if name in present or value is None:
            continue
        if value.dtype is None and name in dtypes:
            value.dtype = dtypes[name]
        if value.dtype is None:
            continue  # ONNX Runtime needs an output's type
        work.graph.outputs.append(value)
        present.add(name)
        added.append(name)
    return work, added


def _is_constant(value: ir.Value) -> bool:
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant")


def _floor_sources(model: ir.Model, dtypes: Mapping[str, ir.DataType]) -> dict[str, list[str]]:
    """graph output -> the non-constant float tensors entering the operator that produces it."""
    out = {}
    for value in model.graph.outputs:
        producer = value.producer()
        if producer is None:
            continue
        out[value.name] = [v.name for v in producer.inputs
                           if v is not None and not _is_constant(v) and v.name in dtypes
                           and dtypes[v.name].is_floating_point()]
    return out


def _rewrite_label(record: FusionRecord) -> str:
    return f"{record.pattern} at '{record.node}'"


def _probes(records: Sequence[FusionRecord], optimised: ir.Model) -> list[tuple[str, str]]:
    """(tensor, rewrite label) of the main-graph rewrites, in graph order."""
    order = {v.name: i for i, node in enumerate(optimised.graph) for v in node.outputs}
    outputs = {v.name for v in optimised.graph.outputs}
    found = {}
    for r in records:
        if r.graph == "main" and r.output and r.output in order and r.output not in outputs:
            found.setdefault(r.output, _rewrite_label(r))
    return sorted(found.items(), key=lambda item: order[item[0]])


def verify_models(
    original: ir.Model,
    optimised: ir.Model,
    *,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    records: Sequence[FusionRecord] = (),
    constant_inputs: Mapping[str, np.ndarray] | None = None,
    approximated: ir.Model | None = None,
) -> Verification:
    """Run both models on the same inputs; compare every rewrite and every output.

    ``constant_inputs``: inputs of ``original`` that ``optimised`` has bound (see above).
    ``approximated``: the model an inexact step (``dequantize-dynamic``) started from, when
    ``original`` is that step's result; its output SQNR against ``original`` on the same
    inputs (the original's feeds, bound inputs included) is measured and noted
    (:func:`_approximation`), never checked."""
    bound = dict(constant_inputs or {})
    probes = _probes(records, optimised)
    conditions = branch_conditions(original)
    typed = original.clone()
    infer_shapes(typed)  # a private copy: the types of the tensors exposed below
    dtypes = {v.name: v.dtype for v in _values_by_name(typed.graph).values() if v.dtype is not None}
    floors_from = _floor_sources(typed, dtypes)
    extra = [t for t, _ in probes] + [n for names in floors_from.values() for n in names] + list(conditions.values())
    original_x, _ = _with_outputs(original, extra, dtypes)
    optimised_x, _ = _with_outputs(optimised, [t for t, _ in probes], dtypes)
    seeded = seed_random_nodes(original_x)  # private copies: the same node, the same seed
    seed_random_nodes(optimised_x)
    original_x = serialized(original_x)  # once, for all of its sessions (serialising is most of their cost)
    graph_outputs = [v.name for v in original.graph.outputs]
    scaled_once = _input_free(original, {n for names in floors_from.values() for n in names}
                              - {t for t, _ in probes} - set(conditions.values()) - set(graph_outputs))
    try:
        run_original = _ScaledOnce(_Runner(original_x), scaled_once, permuted_scales(original, scaled_once))
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise BadInputError(f"cannot verify: ONNX Runtime cannot load the input model ({first_line(e)}); "
                            "pass --no-verify to skip verification") from None

    result = Verification(runtime=_runtime_name(), inputs="")
    run_reference = (lambda feeds: run_original({**feeds, **bound})) if bound else run_original
    try:
        sets = input_sets(bound_view(original, bound), run_reference, inputs, dims, seed, result, graph_outputs,
                          bound)
        sets = [(label, {**feeds, **bound}, expected) for label, feeds, expected in sets]  # the original's feeds
        if seeded:  # the draws advanced while the inputs were chosen: run again from a fresh session
            result.notes.append(describe_random(seeded, Counter(n.op_type for n in random_nodes(original))))
            sets = [(lab, f, {**e, **run_original.proxies}) for lab, f, e in rerun(original_x, sets)]
            require_finite(sets[0][2], graph_outputs, "on generated inputs" if inputs is None else "on the given inputs")
    except NoReference as e:
        result.unverified = str(e)
        return result
    proxied = set(run_original.proxies)  # (their magnitude stands in the sets' outputs, not their values)
    run_original = run_reference = None  # (its outputs are in ``sets``: one model's session at a time)
    drop_resident_pages(original)  # (and the pages of its weights that it read go with it)
    try:
        run_optimised = _Runner(optimised_x)
    except Exception as e:  # noqa: BLE001
        result.outputs.append(OutputCheck("<model>", "", (), np.inf, np.inf, 0.0, False,
                                          f"ONNX Runtime cannot load the optimised model: {first_line(e)}"))
        return result

    fan_in = _fan_in(optimised)
    pending = []  # checks over their modelled floor, for the measured one: (checks, index, floor, args)
    taken: dict[str, set[bool]] = {}
    masks = _padding_masks(sets, result)
    for label, feeds, expected in sets:
        mask = masks.get(label)

        def defined(shape, mask=mask):  # where a tensor of this set is defined (None: everywhere)
            return defined_positions(shape, mask) if mask is not None else None

        shown = f"where '{result.padded_input}' is 1"
        for if_label, cond in conditions.items():
            if cond in expected:
                taken.setdefault(if_label, set()).add(bool(np.asarray(expected[cond]).reshape(-1)[0]))
        try:
            actual = run_optimised({k: v for k, v in feeds.items() if k not in bound})
        except Exception as e:  # noqa: BLE001
            where = f" [{label}]" if label else ""
            result.outputs.append(OutputCheck("<model>", "", (), np.inf, np.inf, 0.0, False,
                                              "ONNX Runtime cannot run the optimised model on inputs the original "
                                              f"runs on ({result.inputs}{where}): {first_line(e)}", inputs=label))
            continue
        for tensor, rewrite in probes:
            if tensor in expected and tensor in actual:
                ref, got = np.asarray(expected[tensor]), np.asarray(actual[tensor])
                where = defined(ref.shape)
                floor = _sum_floor(ref if where is None else ref[where], fan_in.get(tensor))
                check = compare_tensor(tensor, ref, got, rewrite=rewrite, inputs=label, floor=floor, where=where,
                                       positions=shown)
                if not check.ok:
                    pending.append((result.rewrites, len(result.rewrites), floor,
                                    (tensor, ref, got, rewrite, label, where, shown)))
                result.rewrites.append(check)
        for name in graph_outputs:
            ref = np.asarray(expected[name])
            if name not in actual:
                result.outputs.append(OutputCheck(name, str(ref.dtype), ref.shape, np.inf, np.inf, 0.0, False,
                                                  "missing from the optimised model's outputs", inputs=label))
                continue
            got, floor = np.asarray(actual[name]), _floor(ref, floors_from.get(name, ()), expected, defined)
            where = defined(ref.shape)
            check = compare_tensor(name, ref, got, floor=floor, inputs=label, where=where, positions=shown)
            if not check.ok:
                pending.append((result.outputs, len(result.outputs), floor, (name, ref, got, None, label, where, shown)))
            result.outputs.append(check)
    run_optimised = None
    drop_resident_pages(optimised)
    if pending:  # the original's own variation (float64, else ALL), run only when needed
        level, noise = runtime_rounding(original_x, sets, sorted({args[0] for *_, args in pending}), masks)
        result.variation_level, result.variation_factor = level, VARIATION_FACTOR
        for checks, index, floor, (name, ref, got, rewrite, label, where, shown) in pending:
            d0 = noise.get((label, name))
            measured = VARIATION_FACTOR * (d0 or 0.0)
            checks[index] = compare_tensor(name, ref, got, rewrite=rewrite, inputs=label, floor=max(floor, measured),
                                           where=where, positions=shown, variation=d0)
    if bound:
        result.notes.append("the original was fed " + ", ".join(f"{n}={show_value(v)}" for n, v in bound.items())
                            + " (--constant-input); the rewritten model has no such input")
    if not result.ok:
        result.unverified = _unstable_original(original_x, sets, result, proxied)
    _coverage(result, records, original, taken)
    if approximated is not None:
        _approximation(result, approximated, sets, graph_outputs)
    return result


def _approximation(result: Verification, approximated: ir.Model, sets, names: list[str]) -> None:
    """The output SQNR of the reference (an inexact step's result) against the model the step
    started from, on the verification's inputs: a measured figure, not a check."""
    from opfuse.quantization.qdq.sqnr import Accumulator  # (the SQNR definition: only for an inexact step)

    acc = Accumulator()
    try:
        run = _Runner(approximated)
        for _, feeds, expected in sets:
            given = run(feeds)
            for name in names:
                acc.add(name, given[name], expected[name])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        result.notes.append(f"the input model could not be run to measure the inexact step ({first_line(e)})")
        return
    result.approximation_sqnr_db = acc.total_db(names)
    result.notes.append(f"reference: the model after the inexact step; the input model's outputs differ from it by "
                        f"{result.approximation_sqnr_db:.1f} dB output SQNR on these {len(sets)} input set(s) "
                        "(measured, not a pass/fail check)")


def _unstable_original(original_x, sets, result: Verification, proxied: set[str] = frozenset()) -> str:
    """Why no rewrite can be blamed, when the original run again on the same inputs differs
    from itself at a failing check's tensor ("" when it does not). It runs twice more, from
    a fresh session and then on that session again: an unseeded random kernel draws anew on
    each run of a session (and from a seed that follows its position in the graph, so a
    fresh session of the same graph repeats the first draw, while the rewritten graph draws
    other numbers). ``proxied``: held as their magnitude in the first run (ScaledOnce): the reruns alone."""
    failing = {(c.inputs, c.name) for c in (*result.rewrites, *result.outputs) if not c.ok}
    try:
        runner = _Runner(original_x)
        again = [[(label, runner(feeds)) for label, feeds, _ in sets] for _ in range(2)]
    except Exception:  # noqa: BLE001 - it ran before: a failure now is itself instability
        return "the original model failed on a second run of the same inputs; it is not a stable reference"
    for index, (label, _, first) in enumerate(sets):  # the failing tensors first, then any the reruns give
        runs = [first, again[0][index][1], again[1][index][1]]
        for name in [*sorted(n for lab, n in failing if lab == label), *sorted(set(runs[1]) & set(runs[2]))]:
            held = [r[name] for r in runs[1 if name in proxied else 0:] if name in r]
            for a, b in zip(held, held[1:]):
                check = compare_tensor(name, np.asarray(a), np.asarray(b), inputs=label)
                if not check.ok:
                    return (f"the original's tensor '{name}' differs between two runs on the same inputs "
                            f"({check.problem}): the model is nondeterministic, so no rewrite is blamed; "
                            "pass --inputs FILE.npz on which it is deterministic (or --no-verify)")
    return ""


def _padding_masks(sets, result: Verification) -> dict[str, np.ndarray]:
    """input-set label -> the padded batch's mask ([rows, T], 0/1), for the sets that have one."""
    if not result.padded_input:
        return {}
    return {label: np.asarray(feeds[result.padded_input]) for label, feeds, _ in sets
            if label in (PADDED_LABEL, GIVEN_PADDED_LABEL) and result.padded_input in feeds}


def _fan_in(model: ir.Model) -> dict[str, int]:
    """Main-graph tensor -> the products its node sums per output element (the module
    docstring's K), for every weighted layer of the op table with a constant weight, fused
    or not (a fused kernel is read as the op it extends)."""
    out = {}
    for node in model.graph:
        view = None if is_onnx(node) else read_kernel(node.domain, node.op_type, node.inputs, node.attributes)
        info = OPS.get(view.anchor) if view is not None else op_info(node)
        spec = info.weights if info is not None else None
        if spec is None or len(node.inputs) <= spec.weight or node.inputs[spec.weight] is None:
            continue
        weight = node.inputs[spec.weight].const_value
        if weight is None or len(weight.shape) < 2:
            continue
        k = products_per_output(tuple(weight.shape), spec.layout_of(node), spec.group_of(node))
        out[node.outputs[0].name] = k
    for node in model.graph:  # a layout op after it (a fold through a Transpose) moves the same sums
        if node.inputs and node.inputs[0] is not None and node.inputs[0].name in out and op_kind(node) is OpKind.INJECTIVE:
            out.setdefault(node.outputs[0].name, out[node.inputs[0].name])
    return out


def _sum_floor(ref: np.ndarray, k: int | None) -> float:
    dtype = str(ref.dtype)
    if not k or dtype not in TOLERANCES or ref.size == 0:
        return 0.0
    scale = _finite_max_abs(ref) or 0.0
    return 8 * EPSILON[dtype] * float(np.sqrt(k)) * scale


def _floor(ref: np.ndarray, sources: Iterable[str], expected: Mapping[str, np.ndarray], defined=None) -> float:
    dtype = str(ref.dtype)
    if dtype not in TOLERANCES:
        return 0.0
    scales = []
    for s in sources:
        values = np.asarray(expected.get(s, ()))
        where = defined(values.shape) if defined is not None and values.ndim else None
        scale = _finite_max_abs(values[where] if where is not None else values)
        if scale is not None:
            scales.append(scale)
    return TOLERANCES[dtype][1] * max(scales, default=0.0)


def _coverage(result: Verification, records: Sequence[FusionRecord], original: ir.Model,
              taken: Mapping[str, set[bool]]) -> None:
    called = {f"function:{n.domain}.{n.op_type}" for n in original.graph}
    for r in records:
        parts = r.graph.split("/")
        if r.graph == "main" or r.graph in called:
            result.exercised += 1
        elif (len(parts) == 3 and parts[0] == "main" and parts[2] in ("then_branch", "else_branch")
              and (parts[2] == "then_branch") in taken.get("/".join(parts[:2]), set())):
            result.exercised += 1
        else:
            result.not_exercised.append(f"{_rewrite_label(r)} in {r.graph}")


def _runtime_name() -> str:
    return f"onnxruntime {ort.__version__} CPU (graph optimisations disabled)"
