"""The pipeline, end to end: load -> analyse -> rewrite -> verify -> save and report.

:func:`optimize` is the Python API behind ``opfuse optimize``; :func:`inspect_model` is
the dry run behind ``opfuse inspect``. Neither mutates the caller's model.
"""

from __future__ import annotations

__all__ = ["optimize", "OptimizeOptions", "inspect_model", "run_passes", "run_fusion", "Inspection", "epsilon_notes"]

import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import os
import pathlib
from collections import defaultdict
from collections.abc import Iterable, Mapping

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import NameLedger, epsilon_census, label_unnamed, op_counts
from opfuse.prepare.constant_inputs import BINDING, bind_inputs, resolve_constant_inputs
from opfuse.errors import BadInputError, OpfuseError, VerificationError
from opfuse.core.dims import resolve_dims
from opfuse.passes.leftovers import leftover_notes
from opfuse.load import LOAD_NOTES, ModelSource, load_model
from opfuse.prepare.opset import kernels_lost, raise_for_rms_norm, upgrade_opset
from opfuse.passes import make_passes, parse_pass_names, pass_class
from opfuse.passes.cleanup import CleanupPass
from opfuse.passes.constant_branches import RESOLVED
from opfuse.report import FusionReport
from opfuse.runtime import drop_resident_pages
from opfuse.targets import RUNTIME_LEVELS, TARGET_DEFAULT_PASSES, TARGETS
from opfuse.cost.accelerator import fusion_veto, load_profile
from opfuse.targets.kernels import Target, load_target
from opfuse.prepare.static_shapes import make_static
from opfuse.save import (
    StagedModel,
    check_destinations,
    declared_types,
    fingerprint,
    needs_external_data,
    restore_declared_types,
    write_text_atomic,
)
from opfuse.tune import ENVIRONMENT, tune_by_default, untimed
from opfuse.tune.families import configure
from opfuse.tune.run import tuned_run
from opfuse.verify import verify_models

MAX_ROUNDS = 8  # folding repeats until nothing changes; chains settle in two rounds


class _Settled(ir.passes.InPlacePass):
    """A pass, then no new value keeps a removed value's name (:class:`NameLedger`) where it
    changed the graph. A pass that changed nothing leaves the names as the last settlement
    left them, so settling again would rename nothing: on a 48k-node chain the walk of every
    name after each of the 14 pass runs of two rounds was a quarter of the run.

    A pass is not run again on a graph it changed nothing in: ``changes`` (shared by the passes of
    one :func:`run_passes`) counts the runs that changed the graph, and a pass whose last run changed
    nothing, with no change by any pass since, is skipped (its refusals, of that same graph, stand).
    The last round of the fixpoint, which confirms that nothing changes, then runs only the passes
    that have not yet seen the graph as it is (a decoder's pattern matcher, its dearest pass, once
    less)."""

    def __init__(self, inner: ir.passes.InPlacePass, ledger: NameLedger | None, report: FusionReport,
                 changes: list[int]):
        super().__init__()
        self.inner, self.ledger, self.report, self.changes = inner, ledger, report, changes
        self.unchanged_at: int | None = None  # the count of changes when this pass last changed nothing

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if self.unchanged_at == self.changes[0]:
            return ir.passes.PassResult(model, modified=False)
        result = self.inner(model)
        if result.modified:
            self.changes[0] += 1
            self.unchanged_at = None
            if self.ledger is not None:
                settle_names(self.ledger, result.model, self.report)
        else:
            self.unchanged_at = self.changes[0]
        return result


def settle_names(ledger: NameLedger | None, model: ir.Model, report: FusionReport) -> None:
    """:meth:`NameLedger.settle`, and the records that named a renamed value follow it."""
    renamed = ledger.settle(model) if ledger is not None else {}
    if renamed:
        report.records[:] = [dataclasses.replace(r, output=renamed[r.output]) if r.output in renamed else r
                             for r in report.records]


def run_passes(model: ir.Model, names: Iterable[str], report: FusionReport, *,
               ledger: NameLedger | None = None, **options) -> list:
    """Run the named passes in order, repeatedly, until a round changes nothing.

    onnx-ir's PassManager drives the rounds. Records accumulate in ``report``; the
    refusals are those of the last round, so they describe the final graph. Returns the
    pass objects (a fusion pass's ``emitted`` says what it wrote). With a ``ledger``, the
    names are settled after every pass (no new value takes a removed one's name).
    """
    passes = make_passes(list(names), report, **options)
    if passes:
        changes = [0]
        steps = [_Settled(p, ledger, report, changes) for p in passes]
        try:
            ir.passes.PassManager(steps, steps=MAX_ROUNDS, early_stop=True)(model)
        except ir.passes.PassError as e:  # the manager wraps what a pass raised
            cause = e.__cause__
            while isinstance(cause, ir.passes.PassError) and cause.__cause__ is not None:
                cause = cause.__cause__
            raise cause if isinstance(cause, OpfuseError) else e
        finally:
            for p in passes:
                p.release()
    for p in passes:
        report.refusals.extend(p.refusals)
    return passes


def run_fusion(model: ir.Model, names: list[str], report: FusionReport, target: Target, *,
               runtime_level: str = "all", veto=None, ledger: NameLedger | None = None) -> ir.Model:
    """Run the fusion passes for ``target``: through the target's own driver when it has
    one (ONNX Runtime keeps its NCHWc layout), else once. Returns the fused model."""
    if target.run_fusion is None:
        run_passes(model, names, report, veto=veto, target=target, ledger=ledger)
        return model
    return target.run_fusion(
        model, names, report,
        run_passes=lambda m, n, r, **options: run_passes(m, n, r, target=target, ledger=ledger, **options),
        runtime_level=runtime_level, veto=veto,
        fuses_residual=any(pass_class(n).fuses_residual for n in names),
    )


@contextlib.contextmanager
def young_collections_only():
    """No full garbage collection inside: Python's collector walks every live object on
    each one, and an onnx-ir graph is millions of small objects (what that costs on a long
    chain: docs/results/measurements.md). Young objects are still collected; cycles that
    outlive the run are freed by the first full collection after it.

    The thresholds are process-wide state: while this runs, every thread's full collections
    wait too. They are restored on every exit, unless someone changed them meanwhile. It is
    not reentrant across threads: nested calls on one thread restore correctly, but when two
    threads overlap, the first to finish restores the caller's thresholds and the other runs
    on with full collections (slower, never wrong)."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], max(thresholds[2], 1_000_000))
    try:
        yield
    finally:
        if gc.get_threshold()[2] == max(thresholds[2], 1_000_000):  # (unless changed meanwhile)
            gc.set_threshold(*thresholds)


def epsilon_notes(model: ir.Model) -> list[str]:
    """A warning when BatchNormalization epsilons differ across layers."""
    by_eps: dict[float, list[str]] = defaultdict(list)
    for name, eps, _ in epsilon_census(model):
        by_eps[eps].append(name)
    if len(by_eps) < 2:
        return []
    parts = []
    for eps, names in sorted(by_eps.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        parts.append(f"{eps:g} ({len(names)}: {shown})")
    return [
        "BatchNormalization epsilons differ across layers: " + "; ".join(parts)
        + ". Each layer is folded with its own epsilon; check these match what the model "
        "was trained with (a wrong epsilon costs accuracy silently)."
    ]


@dataclasses.dataclass(frozen=True)
class OptimizeOptions:
    """Everything :func:`optimize` is asked to do, as one value (the CLI builds it from its flags).

    ``target`` "onnxruntime" adds epilogue fusion (FusedConv/FusedGemm); ``runtime_level`` is
    the graph-optimisation level the result will run at ("all" keeps the runtime's NCHWc
    layout, lower levels fuse everything legal); ``hardware`` names an accelerator profile whose
    on-chip buffer vetoes fusions that would spill. With ``verify`` (the default) both models run
    on ONNX Runtime and a mismatch raises :class:`VerificationError` before anything is written.
    ``output`` writes the model (atomically); ``report_path`` writes the report as JSON (also when
    verification fails). ``cleanup`` (the default) folds constant subexpressions and removes
    Identity and unused nodes before and after the rewrites (:mod:`opfuse.passes.cleanup`). The
    result carries the shape information the input declared; ``keep_shapes`` keeps the inferred
    shapes. ``opset`` raises the model's opset first (onnx's version converter), so patterns can
    become standard ops that need it; ``approximate`` lets a pattern become an op that
    approximates it (a tanh GELU for an erf one), recorded as such. ``constant_inputs``
    (``{"sr": 16000}``; text as ``--constant-input`` gives it, numbers or arrays) binds inputs to
    values a deployment fixes: each becomes an initializer and leaves the graph's inputs, and the
    clean-up folds what it decides (an ``If`` on it becomes its taken branch;
    :mod:`opfuse.prepare.constant_inputs`); verification feeds the original those values. An inexact pass
    among ``passes`` (``dequantize-dynamic``) runs first; verification then holds every other
    rewrite to its result and reports its output SQNR against the input model. ``require_npu``,
    ``htp_options``, ``context`` and ``compile_for_device`` are for a target with a device
    (``qnn``): compile for it, with these backend options, writing this context binary.
    ``tune`` (None: on, unless ``OPFUSE_TUNE=off`` is in the environment) times each fusion
    family the target fuses on and off where the target's runtime is on this machine, and turns
    off those that make the model slower (:mod:`opfuse.tune`), at ``tune_threads`` intra-op
    threads, in ``tune_rounds`` rounds (None: from the graph's work units); the shapes are
    ``dims`` or the defaults the log states. Off, the target's default policy applies.
    ``tuning`` replays a record (:mod:`opfuse.tune.record`: a file, or a report holding one)
    instead of timing; without it a record cached for this graph and machine is replayed unless
    ``retune``.
    """

    passes: Iterable[str] | str | None = None  # None: the target's default passes
    target: str = "onnx"
    runtime_level: str = "all"
    hardware: str | None = None
    verify: bool = True
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None  # verification's inputs
    dims: Mapping[str, int] | None = None  # sizes of the free dimensions
    constant_inputs: Mapping[str, object] | None = None
    seed: int = 0  # of verification's random inputs
    output: str | os.PathLike | None = None
    report_path: str | os.PathLike | None = None
    external_data: bool | None = None  # None: when the input had it or the model needs it
    overwrite: bool = False  # may ``output`` be the input model's path
    cleanup: bool = True
    keep_shapes: bool = False
    opset: int | None = None
    approximate: bool = False
    require_npu: bool = False
    htp_options: Mapping[str, str] | None = None
    context: str | os.PathLike | None = None
    compile_for_device: bool = True
    tune: bool | None = None  # None: tune_by_default() (on unless OPFUSE_TUNE=off)
    tune_threads: int = 1
    tune_rounds: int | None = None
    tuning: str | os.PathLike | None = None  # a record to replay (no timing)
    retune: bool = False  # time again even where a record is cached


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the options resolve to before any work: the passes by role and the target."""

    names: list[str]
    chosen: Target
    fusion: list[str]  # passes that fuse into the target's kernels
    inexact: list[str]  # passes whose result is the reference (run first)
    veto: object = None  # the hardware profile's fusion veto
    backend: object = None  # the device's module, when compiling for it
    device: object = None  # its parsed options
    asked_opset: int | None = None  # --opset (a configuration may raise the opset where it is None)


@dataclasses.dataclass
class _Run:
    """The model being optimised and what the steps learn about it on the way."""

    work: ir.Model
    report: FusionReport
    ledger: NameLedger
    bound: Mapping[str, np.ndarray]  # constant inputs, resolved
    shipped: ir.Model | None = None  # the inexact passes' result: verification's reference
    original: ir.Model | None = None  # what verification compares against (unbound)
    static: object = None  # make_static's account of the shapes it fixed
    static_note: int = -1  # its note's index in report.notes
    declared: object = None  # the shape information the input declared
    input_was_external: bool = False
    opset_kept: bool = False  # a configuration's opset raise not made (ONNX Runtime would lose a kernel)


@young_collections_only()  # (a context manager from contextlib is a decorator too; see its docstring)
def optimize(model: ModelSource, *, options: OptimizeOptions | None = None,
             **keywords) -> tuple[ir.Model, FusionReport]:
    """Optimise ``model`` (a path, bytes, ModelProto or onnx_ir.Model) as ``options`` say.

    The keywords are :class:`OptimizeOptions`' fields (``optimize(m, target="onnxruntime",
    output="m.opt.onnx")``); given with ``options``, they replace its fields. Returns the new
    model and its report; the caller's model is never mutated. The steps: the options checked
    before any work (:func:`_plan`), the model loaded and prepared (:func:`_prepare`), the passes
    (:func:`_rewrite`), then verification of the bytes to be written, the device compilation and
    the writing (:func:`_verify_and_write`).
    """
    options = dataclasses.replace(options or OptimizeOptions(), **keywords)
    plan = _plan(model, options)
    untimed_because = _untimed_because(options, plan)
    if untimed_because is None:
        run = tuned_run(model, options, plan, _configured)
    else:
        measured = bool(plan.chosen.exceptions)
        options, plan, note = _untimed_policy(model, options, plan)
        run = _prepare(model, options, plan)
        _rewrite(run, options, plan)
        if note and not run.opset_kept:  # (the exception's note says the opset was raised)
            run.report.notes.append(note)
        run.report.tuning = untimed(options.target, untimed_because, measured_policy=measured)
    _verify_and_write(run, options, plan)
    return run.work, run.report


def _untimed_because(options: OptimizeOptions, plan: _Plan) -> str | None:
    """Why the fusion families are not timed (None: they are, or a record is replayed)."""
    if options.tuning is not None:
        if not plan.chosen.runs_here or plan.device is not None:
            raise BadInputError(f"--tuning replays a measured choice of the onnx and onnxruntime targets, "
                                f"not of {options.target}")
        return None
    if not (tune_by_default() if options.tune is None else options.tune):
        return "--no-tune" if options.tune is False else f"{ENVIRONMENT}=off"
    if not plan.chosen.runs_here or plan.device is not None:
        return f"the {options.target} target's runtime is not on this machine"
    return None


def _untimed_policy(model: ModelSource, options: OptimizeOptions, plan: _Plan):
    """Untimed, a target exception that names the families' options for its graphs
    (:attr:`~opfuse.targets.kernels.PolicyException.untimed`: a decode step at onnxruntime gets
    Attention-23 with its cache, where it has an attention) replaces the policy where ``model`` is such a graph:
    (options, plan, the note saying so), or the three unchanged (None) elsewhere."""
    exceptions = [e for e in plan.chosen.exceptions if e.untimed]
    if not exceptions:
        return options, plan, None
    loaded, _ = load_model(model)
    for exception in exceptions:
        if (exception.untimed_where or exception.sites)(loaded):
            chosen, names, opset = configure(plan.chosen, plan.names, options.opset, dict(exception.untimed))
            plan = dataclasses.replace(plan, chosen=chosen, names=names, fusion=[n for n in plan.fusion if n in names])
            return dataclasses.replace(options, opset=opset), plan, exception.untimed_note
    return options, plan, None


def _configured(model: ModelSource, options: OptimizeOptions, plan: _Plan, config, *, verify: bool,
                loaded: tuple[ir.Model, str] | None = None) -> _Run:
    """The rewrites of ``config`` on ``model`` (None: the input as given, no pass)."""
    if config is None:  # the input as given: no pass, no clean-up, no opset raise
        o = dataclasses.replace(options, opset=None, cleanup=False, verify=verify)
        p = dataclasses.replace(plan, names=[], fusion=[], inexact=[])
    else:
        chosen, names, opset = configure(plan.chosen, plan.names, options.opset, config)
        o = dataclasses.replace(options, opset=opset, verify=verify)
        p = dataclasses.replace(plan, chosen=chosen, names=names, fusion=[n for n in plan.fusion if n in names])
    run = _prepare(model, o, p, loaded)
    _rewrite(run, o, p)
    return run


def hardware_veto(hardware: str):
    """``--hardware``'s check of each fusion: for an Ethos-U profile with Vela installed, Vela's own
    cycles (:func:`opfuse.targets.ethos_u.vela_veto.vela_fusion_veto`); otherwise the cost model's
    (:func:`opfuse.cost.accelerator.fusion_veto`)."""
    profile = load_profile(hardware)
    if profile.compiler == "vela" and importlib.util.find_spec("ethosu") is not None:
        # the lowering and Vela: only for an Ethos-U profile
        from opfuse.targets.ethos_u.vela_veto import vela_fusion_veto

        return vela_fusion_veto(profile)
    return fusion_veto(profile)


def _plan(model: ModelSource, options: OptimizeOptions) -> _Plan:
    """The options checked, and the passes sorted by role: every usage error before any work."""
    o = options
    if o.target not in TARGETS:
        raise BadInputError(f"unknown target {o.target!r}; choose from {', '.join(TARGETS)}")
    if o.runtime_level not in RUNTIME_LEVELS:
        raise BadInputError(
            f"unknown runtime level {o.runtime_level!r}; choose from {', '.join(RUNTIME_LEVELS)}"
        )
    names = parse_pass_names(o.passes if o.passes is not None else TARGET_DEFAULT_PASSES[o.target])
    chosen = load_target(o.target)
    fusion = [n for n in names if pass_class(n).emits_contrib_ops or pass_class(n).after_rewrites]
    contrib = [n for n in fusion if pass_class(n).emits_contrib_ops]
    if contrib and not chosen.kernels:
        raise BadInputError(
            f"pass {contrib[0]} fuses epilogues into a target's kernels, and {chosen.title} "
            f"(--target {o.target}) has none; use --target onnxruntime"
        )
    veto = None
    if o.hardware is not None:
        veto = hardware_veto(o.hardware)
    if o.output is not None and isinstance(model, (str, os.PathLike)) and not o.overwrite:
        if pathlib.Path(o.output).resolve() == pathlib.Path(model).resolve():
            raise BadInputError(
                f"{o.output}: refusing to overwrite the input model; choose another output "
                "or pass --overwrite"
            )
    check_destinations(o.output, o.report_path, o.context)
    backend = device = None
    if chosen.device and o.compile_for_device or o.context is not None or o.require_npu:
        if not chosen.device:
            raise BadInputError("--context and --require-npu compile for the NPU: use them with --target "
                                + ", ".join(n for n in TARGETS if load_target(n).device))
        backend = importlib.import_module(chosen.device)  # (a device's backend: only for its target)
        backend.require_backend()  # not installed: one line with the install command, before any work
        device = backend.Options.parse(o.htp_options)
    inexact = [n for n in names if not pass_class(n).exact]
    return _Plan(names, chosen, fusion, inexact, veto, backend, device, o.opset)


def _prepare(model: ModelSource, options: OptimizeOptions, plan: _Plan,
             loaded: tuple[ir.Model, str] | None = None) -> _Run:
    """Load (or take ``loaded``, a private model from :func:`load_model` and its display name);
    the inexact passes first; the reference kept; inputs bound, shapes made static and the opset
    raised as the target and options ask; the notes about the input."""
    o = options
    work, display = loaded if loaded is not None else load_model(model)
    label_unnamed(work)  # the log names an unnamed node by op type and position
    ledger = NameLedger(work)  # no new value takes a removed one's name, over the whole run
    bound = resolve_constant_inputs(work, o.constant_inputs)  # a value that does not fit: one line, before any work
    if o.verify and o.inputs is None:
        resolve_dims(work, o.dims)  # a --dim the model does not have is a usage error, before any work
    report = FusionReport(model=display, target=o.target, passes=plan.names)
    run = _Run(work, report, ledger, bound)
    ops_shipped = op_counts(work) if plan.inexact else None
    if plan.inexact:  # first, and the reference verification holds the other rewrites to (passes/base.py)
        run.shipped = work.clone() if o.verify else None
        run_passes(work, plan.inexact, report, ledger=ledger)
        report.notes.append(f"{', '.join(plan.inexact)} is not exact: the model it wrote is the reference the "
                            "other rewrites are verified against; its own distance from the input model is "
                            "measured, not verified")
    run.original = work.clone() if o.verify else None  # (unbound: verification feeds it the bound values)
    if bound:
        report.records.extend(bind_inputs(work, bound))
    if plan.chosen.static_shapes:
        run.work, run.static = make_static(run.work, o.dims)  # an unbound dimension: one line naming it
        report.notes.append(run.static.note())
        run.static_note = len(report.notes) - 1
    lost = kernels_lost(run.work, o.opset) if o.opset is not None and o.opset != plan.asked_opset else []
    if lost:  # a configuration's raise (not --opset) that ONNX Runtime could not run: the rewrites that need it refuse
        run.opset_kept = True
        report.notes.append(f"opset not raised to {o.opset}: ONNX Runtime's CPU kernels do not run "
                            f"{', '.join(lost)}; the rewrites that need opset {o.opset} are not made")
    elif o.opset is not None:
        run.work, note = upgrade_opset(run.work, o.opset)
        report.notes.extend([note] if note else [])
        label_unnamed(run.work)
    elif (raised := raise_for_rms_norm(run.work, plan.chosen)) is not None:
        run.work, note = raised
        report.notes.append(note)
        label_unnamed(run.work)
    report.ops_before = ops_shipped if plan.inexact else op_counts(run.work)
    report.notes.extend(run.work.meta.pop(LOAD_NOTES, None) or [])
    report.notes.extend(epsilon_notes(run.work))
    run.input_was_external = needs_external_data(run.work)  # before the folds replace its tensors
    run.declared = declared_types(run.work)
    return run


def _rewrite(run: _Run, options: OptimizeOptions, plan: _Plan) -> None:
    """The clean-up, the exact rewrites, the fusion into the target's kernels, the clean-up
    again; the notes about the result; the declared shape information put back."""
    o, report, ledger = options, run.report, run.ledger
    tidy = CleanupPass(report, infer_shapes=o.keep_shapes) if o.cleanup else None
    if tidy is not None:
        tidy(run.work)  # constant subexpressions become initializers the folds can absorb
        settle_names(ledger, run.work, report)
    static = run.static
    if static is not None and static.unknown and any(r.pattern == RESOLVED for r in report.records):
        run.work, again = make_static(run.work, None)  # an If's outputs had no static shape; its branch's do
        static.unknown = again.unknown
        report.notes[run.static_note] = static.note()
    rewrites = [n for n in plan.names if n not in plan.fusion and n not in plan.inexact]
    targeted = {"target": plan.chosen} if any("target" in pass_class(n).options for n in rewrites) else {}
    if o.approximate and any("approximate" in pass_class(n).options for n in rewrites):
        targeted["approximate"] = True
    run_passes(run.work, rewrites, report, ledger=ledger, **targeted)
    if plan.fusion:
        run.work = run_fusion(run.work, plan.fusion, report, plan.chosen, runtime_level=o.runtime_level,
                              veto=plan.veto, ledger=ledger)
    if tidy is not None:
        tidy.eliminate_common = True  # (not before the folds: a shared conv output blocks a fold)
        tidy(run.work)  # what the rewrites left unused, and repeated nodes
        if tidy.summary():
            report.notes.append(tidy.summary())
    settle_names(ledger, run.work, report)
    report.notes.extend(binding_notes(report, o.cleanup))
    report.ops_after = op_counts(run.work)
    report.notes.extend(leftover_notes(run.work, report, plan.chosen))
    if not o.keep_shapes and not plan.chosen.static_shapes:
        restore_declared_types(run.work, run.declared)  # only the shape information the input had


def _verify_and_write(run: _Run, options: OptimizeOptions, plan: _Plan) -> None:
    """The bytes to be written, loaded back and verified against the original; the device
    compilation; then the model, the context binary and the report, each only when asked for."""
    o, work, report = options, run.work, run.report
    external_data = o.external_data
    if external_data is None:
        external_data = run.input_was_external or needs_external_data(work)

    def verified(staged: StagedModel) -> None:  # the staged bytes, loaded back, against the original
        if o.verify:
            report.verification = verify_models(run.original, staged.load(), inputs=o.inputs, dims=o.dims,
                                                seed=o.seed, records=report.records,
                                                constant_inputs=run.bound, approximated=run.shipped)
            _raise_if_failed(report, o.report_path)

    # (only verification and the device's compilation run between staging and writing: without
    # them nothing can change the model, and its fingerprint, a walk of every node, is not taken)
    checked = o.verify or plan.device is not None
    drop_resident_pages(work)  # (what the rewrites read of the input's weights: not while the new ones are written)
    drop_resident_pages(run.original)
    release = o.output is not None and plan.device is None  # (the model returned reads its weights from the file written)
    staged = (StagedModel(work, o.output, external_data=external_data, release=release, fingerprinted=checked)
              if o.output is not None or o.verify else None)
    drop_resident_pages(work)  # (what the rewrites and the writing read of the input's weights: verification reads
    drop_resident_pages(run.original)  # them again, one model at a time)
    try:
        if staged is not None:
            verified(staged)
        compiled = _compile(run, options, plan)
        if checked and staged is not None and fingerprint(work) != staged.fingerprint:  # changed after it was verified
            stale, staged = staged, StagedModel(work, o.output, external_data=external_data, release=release)
            stale.discard()  # (after: the model may read weights from its files)
            verified(staged)
            report.notes.append("the model changed after verification; it was verified again as written")
        if o.output is not None:
            staged.commit()
    finally:
        if staged is not None:
            staged.discard()
    if compiled is not None:
        compiled.commit_context()
    if o.report_path is not None:
        write_text_atomic(o.report_path, report.to_json())


def _compile(run: _Run, options: OptimizeOptions, plan: _Plan):
    """The device's compilation of the verified model (None without a device). Its error says
    what was written: the report alone when it is a verification on the device that failed."""
    if plan.device is None:
        return None
    report, report_path = run.report, options.report_path
    try:
        return plan.backend.compile(run.work, report, options=plan.device, require_npu=options.require_npu,
                                    context=options.context)
    except OpfuseError as e:
        if report_path is not None and isinstance(e, VerificationError):
            write_text_atomic(report_path, report.to_json())
        written = (f"only the report was written ({report_path})"
                   if report_path is not None and isinstance(e, VerificationError) else "nothing was written")
        raise type(e)(f"{e}; {written}", *([report] if isinstance(e, VerificationError) else [])) from None


def _raise_if_failed(report: FusionReport, report_path) -> None:
    """A failed or impossible verification: the report alone is written (when asked for), and
    :class:`VerificationError` says which check failed and that the model was not written."""
    if report.verification.ok:
        return
    bad = report.verification.first_failure()
    if report_path is not None:  # what was attempted, and the failing check
        write_text_atomic(report_path, report.to_json())
    written = f"only the report was written ({report_path})" if report_path else "nothing was written"
    if report.verification.unverified:  # the original is no reference: no rewrite is blamed
        raise VerificationError(f"not verified: {report.verification.unverified}; {written}", report)
    raise VerificationError(f"verification failed: {bad.label}: {bad.problem}; {written}", report)


def binding_notes(report: FusionReport, cleanup: bool = True) -> list[str]:
    """One note for the bound inputs and the Ifs the clean-up resolved (the records have each)."""
    bound = [r.detail for r in report.records if r.pattern == BINDING]
    resolved = [r for r in report.records if r.pattern == RESOLVED]
    if not bound and not resolved:
        return []
    parts = list(bound)
    if resolved:
        shown = ", ".join(f"'{r.node}' to its {r.produced}" for r in resolved[:4])
        parts.append(f"{len(resolved)} If(s) resolved: {shown}{', ...' if len(resolved) > 4 else ''}")
    elif bound and not cleanup:
        parts.append("--no-cleanup: nothing the bound values decide was folded")
    return ["; ".join(parts)]


@dataclasses.dataclass
class Inspection:
    """What ``opfuse inspect`` shows: the dry-run report and the epsilons in use."""

    report: FusionReport
    epsilons: list[tuple[str, float, str]]

    @property
    def warnings(self) -> list[str]:
        return [n for n in self.report.notes if "epsilon" in n]


def inspect_model(model: ModelSource, **options) -> Inspection:
    """Dry run: which candidates would fold, what blocks the others, and the BN epsilons."""
    work, display = load_model(model)
    epsilons = epsilon_census(work)
    _, report = optimize(work, verify=False, **{"tune": False, **options})
    report.model = display
    return Inspection(report=report, epsilons=epsilons)
