"""``opfuse quantize``: fold first, then int8 that keeps the model's accuracy.

The steps, in order (each its own module):

1. load (:mod:`opfuse.load`), read the ``constant_inputs`` (:mod:`opfuse.constant_inputs`:
   the bound inputs are no inputs of the model quantised) and the calibration data
   (:mod:`.calibration`); the last
   quarter of the samples is held out for step 7; with a target (``min_sqnr`` or a
   ``metric``) the last quarter of the rest is the search's **check** set, and what is
   left the **tuning** set (everything else is tuned on it alone);
2. fold and clean up with :func:`opfuse.optimize` (portable ONNX, verified on a held-out
   sample as any rewrite), with ``equalize`` also cross-layer equalisation
   (:mod:`opfuse.passes.equalize`; by default for the per-tensor preset:
   :class:`.presets.Preset`): after folding, each weight is quantised once. A model
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
   HTP);
6. mixed precision (:mod:`.search`), with a target only: an exact sensitivity ranking
   (each candidate re-quantised alone) and a walk that never accepts a step lowering the
   tuning SQNR, stopped by the check samples; kept layers run in float (16-bit
   activations for ``qnn``); a ``runner`` replaces what evaluates candidates (ONNX
   Runtime's CPU provider by default);
7. block reconstruction (:mod:`.reconstruction`; ``reconstruct``, "auto" by default: when
   torch is installed, AdaRound is off, and it is estimated under
   :data:`RECONSTRUCTION_BUDGET_S`): the rounding of every int8 weight and the scale of
   every activation learned block by block, so that each block reproduces the float
   model's block outputs weighted by how much they reach the outputs (for ``qnn`` the
   scales searched rather than learned, :attr:`.presets.Preset.scale_fit`, and the estimate
   multiplied by :data:`QNN_FIT_FACTOR`); kept only if it
   raises the output SQNR on the tuning samples. It comes after the search (it is not
   repeated for each candidate) and starts from the model the search chose;
8. verify: output SQNR on the held-out samples, the quantised model running as deployed
   (ONNX Runtime CPU, all optimisations: its int8 kernels); below ``min_sqnr`` (or, with
   no target, below :data:`FLOOR_SQNR_DB`: no model of the float one): exit 1, nothing
   written but the report;
9. save and report (:mod:`.report`).
"""

from __future__ import annotations

__all__ = ["quantize"]

import dataclasses
import importlib.util
import os
import pathlib
import tempfile
from collections import Counter
from collections.abc import Callable

import onnx
import onnx_ir as ir
import onnxruntime as ort

from opfuse.analyse import iter_scopes, label_unnamed, op_counts
from opfuse.constant_inputs import bound_view, resolve_constant_inputs
from opfuse.errors import BadInputError, VerificationError
from opfuse.load import ModelSource, load_model
from opfuse.passes import DEFAULT_PASSES
from opfuse.passes.constant_branches import RESOLVED
from opfuse.targets import TARGET_DEFAULT_PASSES
from opfuse.pipeline import optimize, run_passes
from opfuse.quantization.bias_correction import compute_corrections, select_corrections
from opfuse.quantization.calibration import CalibrationSource, check_runs, constant_across, load_calibration, split
from opfuse.quantization.presets import DEFAULT_PRESET, PRESETS
from opfuse.quantization.layers import qdq_layers
from opfuse.quantization.qdq import CALIBRATION_METHODS, Quantizer, prepare, weight_storage
from opfuse.quantization.report import LayerRow, QuantReport, QuantVerification, ReconstructionFacts
from opfuse.quantization.search import KEEP_ACTIONS, Judge, Runner, monotone_search
from opfuse.quantization.sqnr import INFINITE, layer_costs, layer_pairs, measure, output_sqnr
from opfuse.quantization.trials import CHOICE_SAMPLES, TrialMaker
from opfuse.random_ops import drop_given_seeds, seed_random_nodes
from opfuse.report import FusionReport
from opfuse.runtime import create_session
from opfuse.save import check_destinations, save_model, write_text_atomic
from opfuse.vocabulary import integer_op

Metric = Callable[[ort.InferenceSession], float]
LOW_SQNR_DB = 10  # below it, with no target given, the report suggests --min-sqnr
FLOOR_SQNR_DB = 3  # below it, with no target given, the result is no model of the float one: exit 1
RECONSTRUCTION_BUDGET_S = 900  # reconstruct="auto" runs when estimated to take at most this
# The qnn presets' reconstruction searches each activation scale before the rounding fit, and
# estimated_seconds does not count that search; measured, it took 7-10x the estimate
# (docs/quantization.md). So auto runs it for qnn when the estimate is at most a budget's eighth.
QNN_FIT_FACTOR = 8
LAYER_SAMPLES = 16  # samples of the per-layer SQNR table (every intermediate tensor exposed)


def quantize(
    model: ModelSource,
    calibration: CalibrationSource,
    *,
    preset: str = DEFAULT_PRESET,
    equalize: bool | None = None,
    min_sqnr: float | None = None,
    metric: Metric | None = None,
    min_metric: float | None = None,
    bias_correction: bool = True,
    adaround: bool | None = None,
    reconstruct: bool | str = "auto",
    calibrate: str = "auto",
    holdout: int | None = None,
    max_steps: int = 64,
    runner: Runner | None = None,
    keep_as: str | None = None,
    output: str | os.PathLike | None = None,
    report_path: str | os.PathLike | None = None,
    overwrite: bool = False,
    seed: int = 0,
    dims: dict[str, int] | None = None,
    constant_inputs: dict[str, object] | None = None,
    require_npu: bool = False,
    htp_options: dict[str, str] | None = None,
    context: str | os.PathLike | None = None,
) -> tuple[ir.Model, QuantReport]:
    """Fold, quantise to int8 QDQ, verify; returns (the quantised model, its report).

    ``calibration``: an ``.npz`` path (arrays named after the inputs, leading sample
    axis), a directory of one-sample ``.npz`` files, ``"random:N"`` (smoke tests), or an
    iterable of ``{input: array}``. ``metric(session) -> float`` (higher is better) is the
    caller's own accuracy measure on an ``InferenceSession`` of a candidate model; with
    ``min_metric`` the search continues until it is met too. ``runner(model, samples) ->
    outputs per sample`` evaluates the search's candidates (default: ONNX Runtime's CPU
    provider); ``keep_as`` ("float" or "int16") is how the search keeps a layer out of
    int8 (default: the preset's). Raises
    :class:`~opfuse.errors.VerificationError` (exit 1) when the held-out SQNR is below
    ``min_sqnr`` or the metric below ``min_metric``: nothing is written but the report.

    ``qnn`` (Qualcomm's HTP, :mod:`opfuse.qnn`): every symbolic dimension is bound first
    (``dims``, else the calibration samples' shapes), the patterns fused as QNN runs them
    (``--target qnn``), and the quantised model compiled on the HTP backend: its placement
    is the report's ``device`` section (``require_npu``: any CPU fallback fails, nothing
    written; ``context``: the EPContext model), and the held-out SQNR (and ``metric``) is
    measured on the HTP's outputs, the CPU-QDQ figure beside it.

    ``equalize`` and ``adaround``: None (the default) takes the preset's choice (both on for
    ``per-tensor``, which equalises only the pairs with no ReLU6 between; off for the others:
    :class:`.presets.Preset`); ``equalize=True`` equalises every pair.

    ``constant_inputs`` (``{"sr": 16000}``) binds inputs a deployment fixes, as
    :func:`opfuse.optimize` does: the result no longer takes them, a calibration sample that
    carries one must hold exactly that value, and ``random:N`` does not draw them.
    """
    if calibrate != "auto" and calibrate not in CALIBRATION_METHODS:
        raise BadInputError(f"unknown calibration method {calibrate!r}; choose from auto, "
                            + ", ".join(CALIBRATION_METHODS))
    if preset not in PRESETS:
        raise BadInputError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if (min_metric is None) != (metric is None):
        raise BadInputError("metric and min_metric go together")
    if keep_as is not None and keep_as not in KEEP_ACTIONS:
        raise BadInputError(f"unknown keep action {keep_as!r}; choose from {', '.join(KEEP_ACTIONS)}")
    if output is not None and isinstance(model, (str, os.PathLike)) and not overwrite:
        if pathlib.Path(output).resolve() == pathlib.Path(model).resolve():
            raise BadInputError(f"{output}: refusing to overwrite the input model; choose another output")
    check_destinations(output, report_path, context)
    if reconstruct not in (True, False, "auto"):
        raise BadInputError(f"reconstruct is True, False or 'auto', not {reconstruct!r}")
    if reconstruct is True and importlib.util.find_spec("torch") is None:
        raise BadInputError("--reconstruct needs torch: pip install 'opfuse[torch]' (it pins torch==2.13.0)")
    chosen = PRESETS[preset]
    equalizing = chosen.equalize if equalize is None else ("equalize" if equalize else "")  # None: the preset's
    adaround = chosen.adaround if adaround is None else adaround
    if (context is not None or require_npu) and not chosen.qnn:
        raise BadInputError("--context and --require-npu compile for the NPU: use them with --preset qnn")
    htp = None
    if chosen.qnn:
        from opfuse.qnn.backend import HtpOptions, require_backend  # (the NPU's backend: only for its preset)

        require_backend()  # not installed: one line with the install command, before any work
        htp = HtpOptions.parse(htp_options)
    work, display = load_model(model)
    bound = resolve_constant_inputs(work, constant_inputs)  # a value that does not fit: one line, before any work
    view = bound_view(work, bound)  # the inputs the result takes
    samples, notes = load_calibration(calibration, view, seed=seed, bound=bound, dims=dims)
    calib, held = split(samples, holdout)
    check_runs(view, samples)  # before any work: a sample the model cannot run on is named
    deciding = {} if bound else constant_across(samples, work)  # (for the compile log's fix of an If)

    shipped, dynamic = view, _dynamic_kernels(work)  # (the shipped model's SQNR is read on the samples' inputs)
    if dynamic:  # float ops again, with the shipped int8 weights: the model every later step starts from
        work, dequantised = _dequantise(work)
    passes = [*DEFAULT_PASSES, *([equalizing] if equalizing else [])]
    target = "onnx"
    static = None
    if chosen.qnn:
        work, static = _static_from_samples(work, [{**s, **bound} for s in samples], dims)
        static_note = len(notes)
        notes.append(static.note())
        passes, target = [*TARGET_DEFAULT_PASSES["qnn"], *([equalizing] if equalizing else [])], "qnn"
    folded, fusion = optimize(work, passes=passes, target=target, inputs=held[0], constant_inputs=bound,
                              compile_for_device=False)
    fusion.model = display
    if static is not None and static.unknown and fusion.applied(RESOLVED):
        from opfuse.static_shapes import not_static  # (static shapes: only the qnn preset needs them)

        static.unknown = not_static(ir.serde.serialize_model(folded))  # an If's outputs: now its branch's
        notes[static_note] = static.note()
    if dynamic:  # one fusion log: the dequantisation first
        fusion.passes = [*dequantised.passes, *fusion.passes]
        fusion.records[:0], fusion.refusals[:0] = dequantised.records, dequantised.refusals
        fusion.ops_before = dequantised.ops_before
    seeded = seed_random_nodes(folded)  # calibration and SQNR draw the same numbers (the output drops the seeds)
    float_model, prep_notes = prepare(ir.serde.serialize_model(folded), chosen)
    report = QuantReport(model=display, preset=preset, fusion=fusion, calibration_samples=len(calib),
                         notes=[*notes, *prep_notes])
    if dynamic:
        _dequantised_note(report, shipped, float_model, held, dynamic, rewritten=len(dequantised.records),
                          first_index=len(calib))
    if seeded:
        report.notes.append(f"random ops ({', '.join(seeded)}) drew from a fixed seed for calibration and the "
                            "SQNR measurement; the written model keeps its own attributes")

    searching = min_sqnr is not None or metric is not None
    tune, check = split(calib, max(1, len(calib) // 4)) if searching and len(calib) >= 2 else (calib, calib)
    if searching and len(calib) < 2:
        report.notes.append("one calibration sample: the search's stopping test runs on the sample it tuned on")
    action = KEEP_ACTIONS[keep_as or chosen.keep_as]
    if calibrate == "auto" and chosen.activation != "uint8":  # auto judges ranges by their 8-bit round trip
        calibrate = "minmax"
        report.notes.append(f"--calibrate auto reads MinMax ranges for {chosen.activation} activations: its "
                            "per-tensor search judges a range by the 8-bit round trip")
    if reconstruct == "auto" and chosen.scale_fit == "search":  # decided before calibrating: it picks the ranges
        reconstruct = _reconstruct_by_default(report, chosen, float_model, tune, adaround)
    if calibrate == "auto" and chosen.scale_fit == "search" and reconstruct is True:
        calibrate = "minmax"  # the scale search (x0.7..x1.5) then clips where the block's output says so
        report.notes.append("--calibrate auto starts from MinMax ranges where block reconstruction searches the "
                            "activation scales (the qnn presets): each scale is then judged by its block's output, "
                            "not by its own round trip")
    with tempfile.TemporaryDirectory(prefix="opfuse-quantize-") as tmp:
        quantizer = Quantizer(float_model, chosen, tune, tmp, method=calibrate)
        guards = None
        if htp is not None and (adaround or bias_correction):  # the NPU judges what is fitted for it
            from opfuse.qnn.runner import HtpRunner  # (the NPU's backend: only for its preset)

            guards = _htp_runner(HtpRunner(htp), [o.name for o in float_model.graph.output])
        maker = TrialMaker(quantizer, float_model, tune, adaround=adaround, bias_correction=bias_correction,
                           runner=guards)
        report.calibration = calibrate
        if searching:
            def measured(model):
                return metric(create_session(model, "all"))

            outcome = monotone_search(
                lambda keep: maker.make(keep, keep_as=action.name), float_model, Judge(float_model, tune, runner),
                Judge(float_model, check, runner), report, keep_as=action, min_sqnr=min_sqnr,
                metric=measured if metric else None, min_metric=min_metric, max_steps=max_steps)
            qdq, keep, why, gain_of = outcome.model, outcome.kept, outcome.why, outcome.gain_of
            report.search_stopped = outcome.stopped
            report.tuning_samples, report.check_samples = len(tune), len(check)
        else:
            qdq, keep, why, gain_of = maker.make([], keep_as=action.name), [], {}, {}
        _record_trial_facts(report, quantizer, maker)
        quantised = any(n.op_type == "QuantizeLinear" for n in qdq.graph.node)
        if reconstruct == "auto" and quantised:
            reconstruct = _reconstruct_by_default(report, chosen, float_model, tune, adaround)
        if reconstruct and quantised:
            qdq = _reconstructed(report, maker, qdq, keep, action.name, seed)
        report.layers = _layer_rows(float_model, qdq, tune, keep, why, gain_of, action.label)

    if htp is None:
        outputs, total = output_sqnr(float_model, qdq, held, qdq_level="all", first_index=len(calib))
        report.verification = QuantVerification(
            samples=len(held), outputs=outputs, sqnr_db=total, min_sqnr_db=min_sqnr,
            runtime="ONNX Runtime CPU, all optimisations (int8 kernels)",
            metric=metric(create_session(qdq, "all")) if metric else None, min_metric=min_metric,
        )
    else:
        compiled = _verify_on_htp(report, float_model, qdq, held, htp, require_npu=require_npu, context=context,
                                  min_sqnr=min_sqnr, metric=metric, min_metric=min_metric, report_path=report_path,
                                  input_values=deciding)
        total = report.verification.sqnr_db
    if min_sqnr is None and metric is None:
        report.verification.floor_sqnr_db = FLOOR_SQNR_DB
    if min_sqnr is None and metric is None and FLOOR_SQNR_DB <= total < LOW_SQNR_DB:
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
                            "main graph" + (" (it does not enter If and Loop bodies, where this model computes; an If decided "
                                            "by an input the deployment fixes, such as a sample rate, goes with "
                                            "--constant-input NAME=VALUE)"
                                            if subgraphs else "")
                            + (f"; the model already computes in integers ({integer} node(s) such as "
                               "DynamicQuantizeLinear, MatMulInteger, DynamicQuantizeLSTM): it was quantised before"
                               if integer else ""))

    if not report.verification.ok:
        if htp is not None:
            compiled.discard()  # (no EPContext model either)
        if report_path is not None:
            write_text_atomic(report_path, report.to_json())
        v = report.verification
        if min_sqnr is not None and v.sqnr_db < min_sqnr:
            why = f"output SQNR {v.sqnr_db:.1f} dB on {v.samples} held-out sample(s) is below --min-sqnr {min_sqnr:g}"
            if report.search_stopped:
                why += f"; the search stopped: {report.search_stopped}"
        elif v.floor_sqnr_db is not None and v.sqnr_db < v.floor_sqnr_db:
            why = (f"output SQNR {v.sqnr_db:.1f} dB on {v.samples} held-out sample(s) is below {v.floor_sqnr_db:g} dB: "
                   "the int8 model's outputs are no approximation of the float model's (give --min-sqnr DB to "
                   "keep the costliest layers out of int8)")
        else:
            why = f"metric {v.metric} is below {min_metric}"
        costly = ", ".join(f"{r.name} ({r.cost})" for r in report.costliest(3))
        written = f"only the report was written ({report_path})" if report_path else "nothing was written"
        raise VerificationError(f"quantisation failed: {why}; costliest layers {costly}; {written}", report)
    result = ir.serde.deserialize_model(qdq)
    drop_given_seeds(result, seeded)
    if output is not None:
        save_model(result, output)
    if htp is not None:
        compiled.commit_context()
    if report_path is not None:
        write_text_atomic(report_path, report.to_json())
    return result, report


def _reconstruct_by_default(report: QuantReport, preset, float_model, samples, adaround: bool) -> bool:
    """``reconstruct="auto"``: block reconstruction runs when torch is installed, AdaRound
    does not round the weights already, and it is estimated to take at most
    :data:`RECONSTRUCTION_BUDGET_S` (for the ``qnn`` presets, the estimate times
    :data:`QNN_FIT_FACTOR`); otherwise the report says why it did not."""
    if adaround:
        report.notes.append("block reconstruction did not run: AdaRound rounds the weights layer by layer "
                            "(--reconstruct on runs it too, from ONNX Runtime's rounding, kept only where it "
                            "raises the tuning output SQNR further)")
        return False
    if importlib.util.find_spec("torch") is None:
        report.notes.append("block reconstruction did not run: torch is not installed (pip install "
                            "'opfuse[torch]')")
        return False
    from opfuse.quantization.reconstruction import estimated_seconds  # (torch: only block reconstruction needs it)

    try:
        seconds, why = estimated_seconds(float_model, samples[0])
    except Exception as e:  # noqa: BLE001 - the interpreter failed on this model: quantised without the refinement
        seconds, why = None, f"the float model failed in torch ({type(e).__name__}: {_first_line(e)})"
    factor = QNN_FIT_FACTOR if preset.qnn else 1
    if seconds is None or seconds * factor > RECONSTRUCTION_BUDGET_S:
        how = ""  # for qnn, the estimate times the factor
        if seconds is not None and factor > 1:
            how = f"estimated {seconds / 60:.0f} min, times {factor} for the qnn presets' scale search; "
        report.notes.append("block reconstruction did not run: " + (why if seconds is None else
                            f"it would take about {seconds * factor / 60:.0f} min here ({how}more than "
                            f"{RECONSTRUCTION_BUDGET_S / 60:.0f})") + "; --reconstruct on runs it")
        return False
    return True


def _reconstructed(report: QuantReport, maker: TrialMaker, qdq, keep, keep_as: str, seed: int):
    """The model ``qdq`` was made as (``keep`` out of int8), with its rounding and activation
    scales learned block by block (:mod:`.reconstruction`) from ONNX Runtime's quantisation
    (AdaRound and bias correction are fitted to the rounding it replaces), then bias
    correction again where it helps; kept only if that raises the output SQNR on the tuning
    samples over ``qdq`` (on the HTP for ``qnn``)."""
    from opfuse.quantization.reconstruction import SAMPLES, apply_reconstruction, reconstruct  # (torch, likewise)

    start = maker.quantizer.quantize(list(keep), keep_as=keep_as)
    try:
        result = reconstruct(maker.float_model, start, maker.samples, seed=seed,
                             scale_fit=maker.quantizer.preset.scale_fit)
    except Exception as e:  # noqa: BLE001 - an optional refinement: the model is quantised without it, and says why
        report.notes.append(f"block reconstruction failed ({type(e).__name__}: {_first_line(e)}); the model is "
                            "quantised without it")
        return qdq
    candidate = onnx.ModelProto()
    candidate.CopyFrom(start)
    apply_reconstruction(candidate, result)
    if maker.use_bias_correction and result.values:
        candidate, _ = select_corrections(candidate, compute_corrections(maker.float_model, candidate, maker.samples),
                                          maker.reference.head(CHOICE_SAMPLES).sqnr)
    before = maker.judge(qdq)
    after = maker.judge(candidate) if result.values else before
    report.reconstruction = ReconstructionFacts(
        blocks=[dataclasses.asdict(b) for b in result.blocks], layers=result.layers, sqnr_db=(before, after),
        kept=after > before, stopped=result.stopped, weighted=result.weighted,
        unweighted_reason=result.unweighted_reason, seconds=result.seconds, samples=min(len(maker.samples), SAMPLES))
    return candidate if after > before else qdq


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _static_from_samples(work: ir.Model, samples, dims):
    """Every symbolic dimension bound: ``dims`` (--dim) first, the others from the samples."""
    from opfuse.dims import resolve_dims  # (static shapes: only the qnn preset needs them)
    from opfuse.static_shapes import dims_from_samples, make_static  # (likewise)

    given = resolve_dims(work, dims)
    read = {k: v for k, v in dims_from_samples(work, samples).items() if k not in given}
    sources = [f"--dim ({', '.join(given)})"] * bool(given) + [f"the calibration samples' shapes ({', '.join(read)})"] * bool(read)
    work, static = make_static(work, {**read, **given}, source="; ".join(sources) or "nothing")
    return work, static


def _htp_runner(htp_runner, names):
    """A search :data:`Runner` on the HTP (every graph output, in the float model's order)."""

    def run(model, samples):
        return htp_runner.outputs(model, [dict(s) for s in samples], names)

    return run


def _verify_on_htp(report, float_model, qdq, held, htp, *, require_npu, context, min_sqnr, metric, min_metric,
                   report_path, input_values=None):
    """The quantised model compiled on the HTP; the held-out SQNR measured on its outputs."""
    from opfuse.qnn.compile import compile_on_htp  # (the NPU's backend: only for its preset)
    from opfuse.qnn.runner import htp_accuracy  # (likewise)

    try:
        compiled = compile_on_htp(qdq, report, options=htp, require_npu=require_npu, context=context,
                                  input_values=input_values)
    except VerificationError as e:
        if report_path is not None:
            write_text_atomic(report_path, report.to_json())
        written = f"only the report was written ({report_path})" if report_path else "nothing was written"
        raise VerificationError(f"{e}; {written}", report) from None
    accuracy = htp_accuracy(float_model, qdq, held, session=compiled.session)
    runtime = f"QNN HTP backend ({htp.describe()})"
    on_cpu = len(compiled.placement.cpu)
    if on_cpu:  # not the NPU's figure alone: the fallbacks computed in ONNX Runtime's CPU kernels
        runtime += (f", with {on_cpu} node(s) on ONNX Runtime's CPU (the fallbacks of the compile log, "
                    "including an If's branches)")
    report.verification = QuantVerification(
        samples=len(held), outputs=accuracy.outputs, sqnr_db=accuracy.htp_vs_float, min_sqnr_db=min_sqnr,
        runtime=runtime,
        metric=metric(compiled.session.quiet) if metric else None, min_metric=min_metric,
        cpu_qdq_sqnr_db=accuracy.cpu_vs_float, htp_vs_cpu_sqnr_db=accuracy.htp_vs_cpu,
    )
    return compiled


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


def _record_trial_facts(report: QuantReport, quantizer: Quantizer, maker: TrialMaker) -> None:
    """The calibration method's first-trial decisions (AdaRound, bias correction, ranges)."""
    facts = maker.facts.get(quantizer.method)
    if quantizer.range_choices:
        kinds: dict[str, int] = {}
        for choice in quantizer.range_choices:
            kinds[choice.kind] = kinds.get(choice.kind, 0) + 1
        report.range_kinds = kinds
    if facts is None:
        return
    where = " on the HTP" if maker.runner is not None else ""
    if facts.adaround_sqnr_db is not None:
        report.adaround_sqnr_db = facts.adaround_sqnr_db
        results = facts.rounding.results if facts.rounding else []
        report.adaround_layers = sum(r.kept for r in results) if facts.adaround else 0
        report.adaround_errors = [{"layer": r.layer, "nearest": r.nearest_error, "adaround": r.adaround_error,
                                   "kept": r.kept and facts.adaround} for r in results]
        if not facts.adaround:
            before, after = facts.adaround_sqnr_db
            report.notes.append(f"AdaRound did not raise the tuning output SQNR{where} ({before:.1f} -> {after:.1f} dB), "
                                "so the weights stay rounded to nearest")
    if facts.bias_sqnr_db is not None:
        report.bias_sqnr_db, report.bias_skipped = facts.bias_sqnr_db, facts.bias_skipped
        report.bias_corrected = facts.bias_layers
        if facts.correction is None:
            without_db, with_db = facts.bias_sqnr_db
            report.notes.append(f"bias correction did not raise the tuning output SQNR{where} "
                                f"({without_db:.1f} -> {with_db:.1f} dB), so it was not applied")


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
