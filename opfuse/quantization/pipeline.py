"""``opfuse quantize``: fold first, then int8 that keeps the model's accuracy.

The stages, in order: steps 1-3 and 8-9 are this module's; 4-7 are the preset's list of
steps (:mod:`.presets`, with the caller's choices: :meth:`.options.QuantizeOptions.steps`),
each with one interface (:mod:`.steps`):

1. load (:mod:`opfuse.load`), read the ``constant_inputs`` (:mod:`opfuse.prepare.constant_inputs`:
   the bound inputs are no inputs of the model quantised) and the calibration data
   (:mod:`.calibration`); the last
   quarter of the samples is held out for step 7; with a target (``min_sqnr`` or a
   ``metric``) the last quarter of the rest is the search's **check** set, and what is
   left the **tuning** set (everything else is tuned on it alone);
2. fold and clean up with :func:`opfuse.optimize` (portable ONNX, verified on a held-out
   sample as any rewrite), with ``equalize`` also cross-layer equalisation
   (:mod:`opfuse.passes.equalize`; the per-tensor preset's ``Equalize`` step): after folding,
   each weight is quantised once. A model
   that ships dynamic int8 (ONNX Runtime's ``quantize_dynamic``: ConvInteger, MatMulInteger,
   DynamicQuantizeLSTM...) is first dequantised to float ops with its int8 weights
   (:mod:`opfuse.passes.dequantize_dynamic`, not exact), before anything else: that model
   is the reference of the folds' verification and of every SQNR below, and its own output
   SQNR against the shipped model on the held-out samples is measured and reported;
3. prepare (:mod:`.qdq`): nodes named, a zero bias where a Conv or Gemm has none, the
   opset raised where the preset's QDQ needs it;
4. calibrate and insert QDQ with ONNX Runtime's quantiser (:mod:`.presets`); ``calibrate``
   "auto" (the default) gives each tensor the range whose 8-bit round trip is closest to
   its own values (:mod:`.ranges`: MinMax, the 99.99th percentile, or a range clipped
   inside MinMax, per tensor; docs/quantization.md gives what it gains). Where step 7 will
   search the activation scales (the ``qnn`` presets), auto starts from MinMax instead and
   leaves the clipping to that search, which judges a scale by its block's output
   (docs/results/qnn.md: above auto's own start on BERT and ViT over ten draws);
5. with ``adaround`` (the per-tensor preset's default, opt-in for the others: it costs
   minutes), AdaRound (:mod:`.adaround`), then empirical bias correction
   (:mod:`.bias_correction`), each kept only where it lowers a layer's error and raises
   the output SQNR on the tuning samples (:mod:`.trials`; for ``qnn`` measured on the
   device);
6. mixed precision (:mod:`.search`), with a target only: an exact sensitivity ranking
   (each candidate re-quantised alone) and a walk that never accepts a step lowering the
   tuning SQNR, stopped by the check samples; kept layers run in float (16-bit
   activations for ``qnn``); a ``runner`` replaces what evaluates candidates (ONNX
   Runtime's CPU provider by default);
7. block reconstruction (:mod:`.reconstruction`; ``reconstruct``, "auto" by default: when
   torch is installed, AdaRound is off, and it is estimated under
   ``reconstruction_budget_s``, :mod:`.options`): the rounding of every int8 weight and the scale of
   every activation learned block by block, so that each block reproduces the float
   model's block outputs weighted by how much they reach the outputs (for ``qnn`` the
   scales searched rather than learned, the ``Reconstruction`` step's ``scale_fit``, and the
   estimate multiplied by its ``budget_factor``); kept only if it
   raises the output SQNR on the tuning samples. It comes after the search (it is not
   repeated for each candidate) and starts from the model the search chose;
8. verify: output SQNR on the held-out samples, the quantised model running as deployed
   (ONNX Runtime CPU, all optimisations: its int8 kernels); below ``min_sqnr`` (or, with
   no target, below :data:`FLOOR_SQNR_DB`: no model of the float one): exit 1, nothing
   written but the report. The floor is not applied, and a note says why, where the float
   outputs on the held-out samples are below one int8 step of the output (the SQNR then measures
   errors finer than an int8 output resolves: :func:`.qdq.sqnr.below_output_step`);
9. save and report (:mod:`.report`).

One route to any device: a preset names its target (``Preset.target``), and where that target
has a device module (:attr:`opfuse.targets.kernels.Target.device`, the interface in
:mod:`opfuse.targets.qnn.device`), quantize reaches the device through it alone, as
:func:`opfuse.optimize` does: ``require_backend()``, ``Options.parse()``, the quantiser's
conventions (``quantizer_config``), a ``Runner`` for the steps' guards, ``compile`` and
``accuracy`` for the verification. Adding an NPU is a target module and a device module.
"""

from __future__ import annotations

__all__ = ["quantize", "QuantizeOptions"]

import dataclasses
import tempfile
from collections import Counter

import onnx
import onnx_ir as ir

from opfuse.core.analysis import iter_scopes, label_unnamed, op_counts, opset_of
from opfuse.prepare.constant_inputs import bound_view, resolve_constant_inputs
from opfuse.errors import BadInputError, VerificationError
from opfuse.load import ModelSource, load_model
from opfuse.passes.constant_branches import RESOLVED
from opfuse.pipeline import optimize, run_passes
from opfuse.quantization.calibration import CalibrationSource, check_runs, constant_across, load_calibration, split
from opfuse.quantization.qdq.layers import qdq_layers
from opfuse.quantization.options import QuantizeOptions
from opfuse.quantization.presets import PRESETS, Equalize
from opfuse.quantization.qdq.quantizer import prepare, weight_storage
from opfuse.quantization.report import LayerRow, QuantReport, QuantVerification
from opfuse.quantization.qdq.sqnr import (INFINITE, below_output_step, layer_costs, layer_pairs, measure, output_sqnr,
                                         padding_of)
from opfuse.quantization.steps import QuantState, build_steps
from opfuse.verify.random_ops import drop_given_seeds, seed_random_nodes
from opfuse.report import FusionReport
from opfuse.runtime import create_session
from opfuse.save import check_destinations, save_model, write_text_atomic
from opfuse.targets import TARGET_DEFAULT_PASSES
from opfuse.targets.kernels import load_target
from opfuse.core.ops import integer_op

LOW_SQNR_DB = 10  # below it, with no target given, the report suggests --min-sqnr
FLOOR_SQNR_DB = 3  # below it, with no target given, the result is no model of the float one: exit 1
LAYER_SAMPLES = 16  # samples of the per-layer SQNR table (every intermediate tensor exposed)


def quantize(model: ModelSource, calibration: CalibrationSource, options: QuantizeOptions | None = None,
             **keywords) -> tuple[ir.Model, QuantReport]:
    """Fold, quantise to int8 QDQ, verify; returns (the quantised model, its report).

    ``options`` (:class:`~.options.QuantizeOptions`) or its fields as keywords (a keyword
    replaces the field of ``options``): ``preset``, ``equalize``, ``min_sqnr``, ``metric``,
    ``min_metric``, ``bias_correction``, ``adaround``, ``reconstruct``, ``calibrate``,
    ``holdout``, ``max_steps``, ``search_candidates``, ``runner``, ``keep_as``, ``output``, ``report_path``,
    ``overwrite``, ``seed``, ``dims``, ``constant_inputs``, ``require_npu``,
    ``htp_options``, ``context``, ``reconstruction_budget_s``, ``reconstruction_iterations``.

    ``calibration``: an ``.npz`` path (arrays named after the inputs, leading sample
    axis), a directory of one-sample ``.npz`` files, ``"random:N"`` (smoke tests), or an
    iterable of ``{input: array}``. ``metric(session) -> float`` (higher is better) is the
    caller's own accuracy measure on an ``InferenceSession`` of a candidate model; with
    ``min_metric`` the search continues until it is met too. ``runner(model, samples) ->
    outputs per sample`` evaluates the search's candidates (default: ONNX Runtime's CPU
    provider); ``keep_as`` ("float", "int16": 16-bit activations, or "int16-weights") is how the search
    keeps a layer out of int8 (default: the preset's); ``search_candidates`` (None: all) bounds the
    candidates its exact ranking re-quantises at a time, the costliest by the per-layer table. Raises
    :class:`~opfuse.errors.VerificationError` (exit 1) when the held-out SQNR is below
    ``min_sqnr`` or the metric below ``min_metric``: nothing is written but the report.

    A preset whose target has a device (``qnn``: Qualcomm's HTP, :mod:`opfuse.targets.qnn`): every
    symbolic dimension is bound first (``dims``, else the calibration samples' shapes), the
    patterns fused as the target runs them, and the quantised model compiled on the device:
    its placement is the report's ``device`` section (``require_npu``: any CPU fallback
    fails, nothing written; ``context``: the EPContext model), and the held-out SQNR (and
    ``metric``) is measured on the device's outputs, the CPU-QDQ figure beside it.

    ``equalize`` and ``adaround``: None (the default) takes the preset's steps (both on for
    ``per-tensor``, which equalises only the pairs with no ReLU6 between; off for the others:
    :mod:`.presets`); ``equalize=True`` equalises every pair.

    ``constant_inputs`` (``{"sr": 16000}``) binds inputs a deployment fixes, as
    :func:`opfuse.optimize` does: the result no longer takes them, a calibration sample that
    carries one must hold exactly that value, and ``random:N`` does not draw them.
    """
    options = QuantizeOptions.of(options, keywords)
    options.check(model)
    check_destinations(options.output, options.report_path, options.context)
    device, device_options = _device(options)
    loaded = _load(model, calibration, options)
    settings = options.steps()
    float_model, report, seeded = _fold(loaded, options, settings)
    tune, check = _tuning_split(loaded.calib, options, report)
    with tempfile.TemporaryDirectory(prefix="opfuse-quantize-") as tmp:
        state = QuantState(options, report, float_model, tune, check, tmp, device=device,
                           device_options=device_options, reconstruct=options.reconstruct)
        for step in build_steps(settings):  # the preset's steps, in order
            report.steps.append(step.apply(state).to_dict())
        qdq = state.qdq
        report.layers = _layer_rows(float_model, qdq, tune, state.keep, state.why, state.gain_of,
                                    state.keep_action.label)
    compiled = _verify(report, float_model, qdq, loaded, options, device, device_options)
    unjudged = _describe(report, float_model, qdq, loaded.held, options)
    if not report.verification.ok:
        if compiled is not None:
            compiled.discard()  # (no EPContext model either)
        _fail(report, options, unjudged)
    result = ir.serde.deserialize_model(qdq)
    drop_given_seeds(result, seeded)
    if options.output is not None:
        save_model(result, options.output)
    if compiled is not None:
        compiled.commit_context()
    if options.report_path is not None:
        write_text_atomic(options.report_path, report.to_json())
    return result, report


def _device(options: QuantizeOptions):
    """(the preset's target's device module, its parsed options), or (None, None) for a target
    without one; the backend missing is one line with the install command, before any work."""
    device = options.chosen.device()
    if device is None:
        if options.context is not None or options.require_npu:
            npu = "|".join(name for name, preset in PRESETS.items() if load_target(preset.target).device)
            raise BadInputError(f"--context and --require-npu compile for an NPU: use them with a preset whose "
                                f"target has one (--preset {npu})")
        return None, None
    device.require_backend()
    return device, device.Options.parse(options.htp_options)


@dataclasses.dataclass
class _Loaded:
    """The model and its calibration data, as step 1 reads them."""

    work: ir.Model
    display: str
    bound: dict
    view: ir.Model  # the inputs the result takes
    samples: list
    notes: list[str]
    calib: list
    held: list
    deciding: dict  # inputs that hold one value in every sample (for the compile log's fix of an If)


def _load(model, calibration, options: QuantizeOptions) -> _Loaded:
    work, display = load_model(model)
    bound = resolve_constant_inputs(work, options.constant_inputs)  # a value that does not fit: one line
    view = bound_view(work, bound)
    samples, notes = load_calibration(calibration, view, seed=options.seed, bound=bound, dims=options.dims)
    calib, held = split(samples, options.holdout)
    check_runs(view, samples)  # before any work: a sample the model cannot run on is named
    deciding = {} if bound else constant_across(samples, work)
    return _Loaded(work, display, bound, view, samples, notes, calib, held, deciding)


def _fold(loaded: _Loaded, options: QuantizeOptions, settings) -> tuple[onnx.ModelProto, QuantReport, dict]:
    """Steps 2 and 3: (the float model every step starts from, the report, the seeded random ops)."""
    preset, notes, work, held = options.chosen, loaded.notes, loaded.work, loaded.held
    dynamic = _dynamic_kernels(work)  # (the shipped model's SQNR is read on the samples' inputs)
    if dynamic:  # float ops again, with the shipped int8 weights: the model every later step starts from
        work, dequantised = _dequantise(work)
    passes = [*TARGET_DEFAULT_PASSES[preset.target], *(s.pass_name for s in settings if isinstance(s, Equalize))]
    static = None
    if load_target(preset.target).static_shapes:
        work, static = _static_from_samples(work, [{**s, **loaded.bound} for s in loaded.samples], options.dims)
        static_note = len(notes)
        notes.append(static.note())
    # the folds int8 starts from, at the model's opset (quantisation measures its own way; the qnn target's raise
    # for an RMSNorm, Target.rms_norm_opset, is float's: the attention and mask it writes at 23 are not yet
    # calibrated and verified on padded samples)
    folded, fusion = optimize(work, passes=passes, target=preset.target, inputs=held[0],
                              constant_inputs=loaded.bound, compile_for_device=False, tune=False,
                              opset=opset_of(work.opset_imports))
    fusion.model = loaded.display
    if static is not None and static.unknown and fusion.applied(RESOLVED):
        from opfuse.prepare.static_shapes import not_static  # (static shapes: only a target that needs them)

        static.unknown = not_static(ir.serde.serialize_model(folded))  # an If's outputs: now its branch's
        notes[static_note] = static.note()
    if dynamic:  # one fusion log: the dequantisation first
        fusion.passes = [*dequantised.passes, *fusion.passes]
        fusion.records[:0], fusion.refusals[:0] = dequantised.records, dequantised.refusals
        fusion.ops_before = dequantised.ops_before
    seeded = seed_random_nodes(folded)  # calibration and SQNR draw the same numbers (the output drops the seeds)
    # weights still in the input's external data file go into memory: the proto below is run from bytes
    # (a relative data path would be read against the working directory) and saved again by the quantiser
    ir.external_data.load_to_model(folded)
    float_model, prep_notes = prepare(ir.serde.serialize_model(folded), preset)
    report = QuantReport(model=loaded.display, preset=options.preset, fusion=fusion,
                         calibration_samples=len(loaded.calib), notes=[*notes, *prep_notes])
    if dynamic:
        _dequantised_note(report, loaded.view, float_model, held, dynamic, rewritten=len(dequantised.records),
                          first_index=len(loaded.calib))
    if seeded:
        report.notes.append(f"random ops ({', '.join(seeded)}) drew from a fixed seed for calibration and the "
                            "SQNR measurement; the written model keeps its own attributes")
    return float_model, report, seeded


def _tuning_split(calib: list, options: QuantizeOptions, report: QuantReport) -> tuple[list, list]:
    """(tuning samples, the search's check samples): a quarter of them with a target."""
    searching = options.searching
    if searching and len(calib) < 2:
        report.notes.append("one calibration sample: the search's stopping test runs on the sample it tuned on")
    return split(calib, max(1, len(calib) // 4)) if searching and len(calib) >= 2 else (calib, calib)


def _verify(report, float_model, qdq, loaded: _Loaded, options: QuantizeOptions, device, device_options):
    """Step 8: the held-out SQNR, on ONNX Runtime's CPU or on the device (its compiled model returned)."""
    metric = options.metric
    padded = sum(padding_of(s) is not None for s in [*loaded.calib, *loaded.held])
    if padded:  # (every SQNR, the search's too, counts a padded sample where defined: qdq.sqnr)
        report.notes.append(f"{padded} of {len(loaded.calib) + len(loaded.held)} calibration sample(s) pad their "
                            "attention mask: every SQNR counts them at their real positions only (a padded "
                            "position's value is undefined, and the runtimes give their own there)")
    if device is None:
        outputs, total = output_sqnr(float_model, qdq, loaded.held, qdq_level="all", first_index=len(loaded.calib))
        report.verification = QuantVerification(
            samples=len(loaded.held), outputs=outputs, sqnr_db=total, min_sqnr_db=options.min_sqnr,
            runtime="ONNX Runtime CPU, all optimisations (int8 kernels)",
            metric=metric(create_session(qdq, "all")) if metric else None, min_metric=options.min_metric,
        )
        return None
    try:
        compiled = device.compile(qdq, report, options=device_options, require_npu=options.require_npu,
                                  context=options.context, input_values=loaded.deciding)
    except VerificationError as e:
        if options.report_path is not None:
            write_text_atomic(options.report_path, report.to_json())
        written = f"only the report was written ({options.report_path})" if options.report_path else \
            "nothing was written"
        raise VerificationError(f"{e}; {written}", report) from None
    accuracy = device.accuracy(float_model, qdq, loaded.held, session=compiled.session)
    runtime = f"{device.TITLE} ({device_options.describe()})"
    on_cpu = len(compiled.placement.cpu)
    if on_cpu:  # not the device's figure alone: the fallbacks computed in ONNX Runtime's CPU kernels
        runtime += (f", with {on_cpu} node(s) on ONNX Runtime's CPU (the fallbacks of the compile log, "
                    "including an If's branches)")
    report.verification = QuantVerification(
        samples=len(loaded.held), outputs=accuracy.outputs, sqnr_db=accuracy.htp_vs_float,
        min_sqnr_db=options.min_sqnr, runtime=runtime,
        metric=metric(compiled.session.quiet) if metric else None, min_metric=options.min_metric,
        cpu_qdq_sqnr_db=accuracy.cpu_vs_float, htp_vs_cpu_sqnr_db=accuracy.htp_vs_cpu,
    )
    return compiled


def _describe(report: QuantReport, float_model, qdq, held, options: QuantizeOptions) -> str | None:
    """The verdict without a target, and what the quantised model stores; returns why the
    held-out SQNR cannot judge the quantisation, when it cannot (:func:`.qdq.sqnr.below_output_step`)."""
    total = report.verification.sqnr_db
    failing = total < FLOOR_SQNR_DB or (options.min_sqnr is not None and total < options.min_sqnr)
    unjudged = below_output_step(float_model, qdq, held) if failing else None
    if not options.searching and unjudged:
        report.notes.append(f"output SQNR {total:.1f} dB is not judged: {unjudged}")
        report.verification.unjudged = unjudged
    elif not options.searching:
        report.verification.floor_sqnr_db = FLOOR_SQNR_DB
    if not options.searching and FLOOR_SQNR_DB <= total < LOW_SQNR_DB:
        report.notes.append(f"output SQNR {total:.1f} dB on the held-out samples is low (under {LOW_SQNR_DB} dB "
                            "the outputs are far from the float model's); --min-sqnr DB keeps the layers that "
                            "cost most out of int8 until it is met")
    report.weights_8bit, report.weights_total = weight_storage(float_model, qdq)
    report.bytes_float, report.bytes_quantized = float_model.ByteSize(), qdq.ByteSize()
    report.quantize_linear = sum(n.op_type == "QuantizeLinear" for n in qdq.graph.node)
    if not report.quantize_linear:
        subgraphs = any(a.type == onnx.AttributeProto.GRAPH for n in float_model.graph.node for a in n.attribute)
        integer = sum(integer_op(n) is not None for n in float_model.graph.node)
        report.notes.append("nothing was quantised: ONNX Runtime's quantiser found no layer it quantises in the "
                            "main graph" + (" (it does not enter If and Loop bodies, where this model computes; an If "
                                            "decided by an input the deployment fixes, such as a sample rate, goes "
                                            "with --constant-input NAME=VALUE)"
                                            if subgraphs else "")
                            + (f"; the model already computes in integers ({integer} node(s) such as "
                               "DynamicQuantizeLinear, MatMulInteger, DynamicQuantizeLSTM): it was quantised before"
                               if integer else ""))
    return unjudged


def _fail(report: QuantReport, options: QuantizeOptions, unjudged: str | None = None):
    """Verification failed: the report written where asked, and exit 1 with why."""
    if options.report_path is not None:
        write_text_atomic(options.report_path, report.to_json())
    v, min_sqnr = report.verification, options.min_sqnr
    if min_sqnr is not None and v.sqnr_db < min_sqnr:
        why = f"output SQNR {v.sqnr_db:.1f} dB on {v.samples} held-out sample(s) is below --min-sqnr {min_sqnr:g}"
        if report.search_stopped:
            why += f"; the search stopped: {report.search_stopped}"
        if unjudged:
            why += f" ({unjudged})"
    elif v.floor_sqnr_db is not None and v.sqnr_db < v.floor_sqnr_db:
        why = (f"output SQNR {v.sqnr_db:.1f} dB on {v.samples} held-out sample(s) is below {v.floor_sqnr_db:g} dB: "
               "the int8 model's outputs are no approximation of the float model's (give --min-sqnr DB to "
               "keep the costliest layers out of int8)")
    else:
        why = f"metric {v.metric} is below {options.min_metric}"
    costly = ", ".join(f"{r.name} ({r.cost})" for r in report.costliest(3))
    written = f"only the report was written ({options.report_path})" if options.report_path else "nothing was written"
    raise VerificationError(f"quantisation failed: {why}; costliest layers {costly}; {written}", report)


def _static_from_samples(work: ir.Model, samples, dims):
    """Every symbolic dimension bound: ``dims`` (--dim) first, the others from the samples."""
    from opfuse.core.dims import resolve_dims  # (static shapes: only a target that needs them)
    from opfuse.prepare.static_shapes import dims_from_samples, make_static  # (likewise)

    given = resolve_dims(work, dims)
    read = {k: v for k, v in dims_from_samples(work, samples).items() if k not in given}
    sources = ([f"--dim ({', '.join(given)})"] * bool(given)
               + [f"the calibration samples' shapes ({', '.join(read)})"] * bool(read))
    work, static = make_static(work, {**read, **given}, source="; ".join(sources) or "nothing")
    return work, static


def _dynamic_kernels(model: ir.Model) -> Counter:
    """Op type -> count of the integer kernels ONNX Runtime's quantize_dynamic writes."""
    return Counter(n.op_type for scope in iter_scopes(model) for n in scope.graph
                   if (row := integer_op(n)) is not None and row.dynamic and row.computes)


def _dequantise(shipped: ir.Model) -> tuple[ir.Model, FusionReport]:
    """A copy of the shipped model with its dynamic int8 as float ops (not exact: the copy is
    the reference from here on), and the log of that step."""
    work = shipped.clone()
    label_unnamed(work)
    log = FusionReport(passes=["dequantize-dynamic"], ops_before=op_counts(work))
    run_passes(work, log.passes, log)
    return work, log


def _dequantised_note(report: QuantReport, shipped: ir.Model, float_model, held, dynamic: Counter, *,
                      rewritten: int, first_index: int) -> None:
    """What the dequantisation did, and how far the dequantised model (the reference of every
    SQNR after it) is from the shipped one, measured with the shipped model as reference."""
    kinds = ", ".join(f"{n} {op}" for op, n in dynamic.most_common())
    if not rewritten:
        report.notes.append(f"the model shipped dynamic int8 ({kinds}), and none of it is in a form opfuse "
                            "dequantises (the fusion log's refusals say why): it is quantised as it is")
        return
    _, report.shipped_sqnr_db = output_sqnr(ir.serde.serialize_model(shipped), float_model, held,
                                            first_index=first_index)
    left = sum(1 for n in float_model.graph.node if (row := integer_op(n)) is not None and row.dynamic)
    report.notes.append(
        f"the model shipped dynamic int8 ({kinds}): dequantised to float ops with its int8 weights (the reference "
        f"below is that model; it differs from the shipped model by {report.shipped_sqnr_db:.1f} dB output SQNR on "
        "the held-out samples)"
        + (f"; {left} dynamic int8 node(s) stayed as they were (the fusion log's refusals say why)" if left else ""))


def _layer_rows(float_model, qdq, samples, keep, why, gain_of, kept_as: str) -> list[LayerRow]:
    """The per-layer table: each quantised (or kept) layer's SQNR, its own noise, its
    precision and why."""
    layers = qdq_layers(float_model, qdq, also=keep)
    costs = layer_costs(layers, measure(float_model, qdq, samples[:LAYER_SAMPLES], layer_pairs(layers)))
    ops = {n.name: n.op_type for n in float_model.graph.node}
    rows = []
    for layer in layers:
        out_db, own = costs.get(layer.name, (float("nan"), INFINITE))
        rows.append(LayerRow(layer.name, layer.op_type, out_db, own, kept_as if layer.name in why else "int8",
                             why.get(layer.name, ""), gain_of.get(layer.name)))
    seen = {r.name for r in rows}
    rows += [LayerRow(name, ops.get(name, "?"), float("nan"), INFINITE, kept_as, why.get(name, ""), gain_of.get(name))
             for name in keep if name not in seen]
    return rows
