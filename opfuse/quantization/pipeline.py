"""``opfuse quantize``: fold first, then int8 that keeps the model's accuracy.

The steps, in order (each its own module):

1. load (:mod:`opfuse.load`) and read the calibration data (:mod:`.calibration`); the last
   quarter of the samples is held out for step 7;
2. fold and clean up with :func:`opfuse.optimize` (portable ONNX, verified on a held-out
   sample as any rewrite), with ``equalize`` also cross-layer equalisation
   (:mod:`opfuse.passes.equalize`): after folding, each weight is quantised once;
3. prepare (:mod:`.qdq`): nodes named, a zero bias where a Conv or Gemm has none, the
   opset raised where the preset's QDQ needs it;
4. calibrate and insert QDQ with ONNX Runtime's quantiser (:mod:`.presets`); ``calibrate``
   "auto" (the default) calibrates with MinMax and with the 99.99th percentile and keeps
   the one whose model has the better output SQNR on the calibration samples (or metric):
   MinMax lets one outlier widen every step of a tensor's range (PP-OCRv4 rec: 71% exact
   match with MinMax, 97.5% with the percentile; float 98%);
5. empirical bias correction (:mod:`.bias_correction`), kept only if it raises the output
   SQNR on the calibration samples;
6. mixed precision (:mod:`.mixed`): while the output SQNR on the calibration samples is
   below ``min_sqnr`` (or the caller's ``metric`` below ``min_metric``), the layers whose
   keeping raises it most, each measured alone, are kept out of int8 (in float, or with
   16-bit activations for ``qnn``) and the model is quantised again; the per-layer SQNR
   table (:mod:`.sqnr`) goes into the report;
7. verify: output SQNR on the held-out samples, the quantised model running as deployed
   (ONNX Runtime CPU, all optimisations: its int8 kernels); below ``min_sqnr``: exit 1,
   nothing written, the report names the costliest layers;
8. save and report (:mod:`.report`).
"""

from __future__ import annotations

__all__ = ["quantize"]

import os
import pathlib
import tempfile
from collections.abc import Callable

import onnx
import onnx_ir as ir
import onnxruntime as ort

from opfuse.errors import BadInputError, VerificationError
from opfuse.load import ModelSource, load_model
from opfuse.passes import DEFAULT_PASSES
from opfuse.targets import TARGET_DEFAULT_PASSES
from opfuse.pipeline import optimize
from opfuse.quantization.calibration import CalibrationSource, check_runs, load_calibration, split
from opfuse.quantization.presets import DEFAULT_PRESET, PRESETS
from opfuse.quantization.mixed import search
from opfuse.quantization.qdq import CALIBRATION_METHODS, Quantizer, prepare, weight_storage
from opfuse.quantization.report import QuantReport, QuantVerification
from opfuse.quantization.sqnr import output_sqnr
from opfuse.random_ops import drop_given_seeds, seed_random_nodes
from opfuse.runtime import create_session
from opfuse.save import check_destinations, save_model, write_text_atomic

Metric = Callable[[ort.InferenceSession], float]
LOW_SQNR_DB = 10  # below it, with no target given, the report suggests --min-sqnr


def quantize(
    model: ModelSource,
    calibration: CalibrationSource,
    *,
    preset: str = DEFAULT_PRESET,
    equalize: bool = False,
    min_sqnr: float | None = None,
    metric: Metric | None = None,
    min_metric: float | None = None,
    bias_correction: bool = True,
    calibrate: str = "auto",
    holdout: int | None = None,
    max_steps: int = 12,
    output: str | os.PathLike | None = None,
    report_path: str | os.PathLike | None = None,
    overwrite: bool = False,
    seed: int = 0,
    dims: dict[str, int] | None = None,
    require_npu: bool = False,
    htp_options: dict[str, str] | None = None,
    context: str | os.PathLike | None = None,
) -> tuple[ir.Model, QuantReport]:
    """Fold, quantise to int8 QDQ, verify; returns (the quantised model, its report).

    ``calibration``: an ``.npz`` path (arrays named after the inputs, leading sample
    axis), a directory of one-sample ``.npz`` files, ``"random:N"`` (smoke tests), or an
    iterable of ``{input: array}``. ``metric(session) -> float`` (higher is better) is the
    caller's own accuracy measure on an ``InferenceSession`` of a candidate model; with
    ``min_metric`` the search continues until it is met too. Raises
    :class:`~opfuse.errors.VerificationError` (exit 1) when the held-out SQNR is below
    ``min_sqnr`` or the metric below ``min_metric``: nothing is written but the report.

    ``qnn`` (Qualcomm's HTP, :mod:`opfuse.qnn`): every symbolic dimension is bound first
    (``dims``, else the calibration samples' shapes), the patterns fused as QNN runs them
    (``--target qnn``), and the quantised model compiled on the HTP backend: its placement
    is the report's ``device`` section (``require_npu``: any CPU fallback fails, nothing
    written; ``context``: the EPContext model), and the held-out SQNR (and ``metric``) is
    measured on the HTP's outputs, the CPU-QDQ figure beside it.
    """
    if calibrate != "auto" and calibrate not in CALIBRATION_METHODS:
        raise BadInputError(f"unknown calibration method {calibrate!r}; choose from auto, "
                            + ", ".join(CALIBRATION_METHODS))
    if preset not in PRESETS:
        raise BadInputError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if (min_metric is None) != (metric is None):
        raise BadInputError("metric and min_metric go together")
    if output is not None and isinstance(model, (str, os.PathLike)) and not overwrite:
        if pathlib.Path(output).resolve() == pathlib.Path(model).resolve():
            raise BadInputError(f"{output}: refusing to overwrite the input model; choose another output")
    check_destinations(output, report_path, context)
    chosen = PRESETS[preset]
    if (context is not None or require_npu) and not chosen.qnn:
        raise BadInputError("--context and --require-npu compile for the NPU: use them with --preset qnn")
    htp = None
    if chosen.qnn:
        from opfuse.qnn.backend import HtpOptions, require_backend  # (the NPU's backend: only for its preset)

        require_backend()  # not installed: one line with the install command, before any work
        htp = HtpOptions.parse(htp_options)
    work, display = load_model(model)
    samples, notes = load_calibration(calibration, work, seed=seed)
    calib, held = split(samples, holdout)
    check_runs(work, samples)  # before any work: a sample the model cannot run on is named

    passes = [*DEFAULT_PASSES, *(["equalize"] if equalize else [])]
    target = "onnx"
    if chosen.qnn:
        work, static_note = _static_from_samples(work, samples, dims)
        notes.append(static_note)
        passes, target = [*TARGET_DEFAULT_PASSES["qnn"], *(["equalize"] if equalize else [])], "qnn"
    folded, fusion = optimize(work, passes=passes, target=target, inputs=held[0], compile_for_device=False)
    fusion.model = display
    seeded = seed_random_nodes(folded)  # calibration and SQNR draw the same numbers (the output drops the seeds)
    float_model, prep_notes = prepare(ir.serde.serialize_model(folded), chosen)
    report = QuantReport(model=display, preset=preset, fusion=fusion, calibration_samples=len(calib),
                         notes=[*notes, *prep_notes])
    if seeded:
        report.notes.append(f"random ops ({', '.join(seeded)}) drew from a fixed seed for calibration and the "
                            "SQNR measurement; the written model keeps its own attributes")

    with tempfile.TemporaryDirectory(prefix="opfuse-quantize-") as tmp:
        quantizer = Quantizer(float_model, chosen, calib, tmp)
        qdq = search(quantizer, float_model, calib, report, min_sqnr=min_sqnr, metric=metric,
                     min_metric=min_metric, bias_correction=bias_correction, max_steps=max_steps,
                     calibrate=calibrate)

    if htp is None:
        outputs, total = output_sqnr(float_model, qdq, held, qdq_level="all", first_index=len(calib))
        report.verification = QuantVerification(
            samples=len(held), outputs=outputs, sqnr_db=total, min_sqnr_db=min_sqnr,
            runtime="ONNX Runtime CPU, all optimisations (int8 kernels)",
            metric=metric(create_session(qdq, "all")) if metric else None, min_metric=min_metric,
        )
    else:
        compiled = _verify_on_htp(report, float_model, qdq, held, htp, require_npu=require_npu, context=context,
                                  min_sqnr=min_sqnr, metric=metric, min_metric=min_metric, report_path=report_path)
        total = report.verification.sqnr_db
    if min_sqnr is None and metric is None and total < LOW_SQNR_DB:
        report.notes.append(f"output SQNR {total:.1f} dB on the held-out samples is low (under {LOW_SQNR_DB} dB "
                            "the outputs are far from the float model's); --min-sqnr DB keeps the layers that "
                            "cost most out of int8 until it is met")
    report.weights_8bit, report.weights_total = weight_storage(float_model, qdq)
    report.bytes_float, report.bytes_quantized = float_model.ByteSize(), qdq.ByteSize()
    report.quantize_linear = sum(n.op_type == "QuantizeLinear" for n in qdq.graph.node)
    if not report.quantize_linear:
        subgraphs = any(a.type == onnx.AttributeProto.GRAPH for n in float_model.graph.node for a in n.attribute)
        report.notes.append("nothing was quantised: ONNX Runtime's quantiser found no layer it quantises in the "
                            "main graph" + (" (it does not enter If and Loop bodies, where this model computes)"
                                            if subgraphs else ""))

    if not report.verification.ok:
        if htp is not None:
            compiled.discard()  # (no EPContext model either)
        if report_path is not None:
            write_text_atomic(report_path, report.to_json())
        v = report.verification
        why = (f"output SQNR {v.sqnr_db:.1f} dB on {v.samples} held-out sample(s) is below --min-sqnr "
               f"{min_sqnr:g}" if min_sqnr is not None and v.sqnr_db < min_sqnr
               else f"metric {v.metric} is below {min_metric}")
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


def _static_from_samples(work: ir.Model, samples, dims) -> tuple[ir.Model, str]:
    """Every symbolic dimension bound: ``dims`` (--dim) first, the others from the samples."""
    from opfuse.inputs import resolve_dims  # (static shapes: only the qnn preset needs them)
    from opfuse.static_shapes import dims_from_samples, make_static  # (likewise)

    given = resolve_dims(work, dims)
    read = {k: v for k, v in dims_from_samples(work, samples).items() if k not in given}
    sources = [f"--dim ({', '.join(given)})"] * bool(given) + [f"the calibration samples' shapes ({', '.join(read)})"] * bool(read)
    work, static = make_static(work, {**read, **given}, source="; ".join(sources) or "nothing")
    return work, static.note()


def _verify_on_htp(report, float_model, qdq, held, htp, *, require_npu, context, min_sqnr, metric, min_metric,
                   report_path):
    """The quantised model compiled on the HTP; the held-out SQNR measured on its outputs."""
    from opfuse.qnn.compile import compile_on_htp  # (the NPU's backend: only for its preset)
    from opfuse.qnn.runner import htp_accuracy  # (likewise)

    try:
        compiled = compile_on_htp(qdq, report, options=htp, require_npu=require_npu, context=context)
    except VerificationError as e:
        if report_path is not None:
            write_text_atomic(report_path, report.to_json())
        written = f"only the report was written ({report_path})" if report_path else "nothing was written"
        raise VerificationError(f"{e}; {written}", report) from None
    accuracy = htp_accuracy(float_model, qdq, held, session=compiled.session)
    report.verification = QuantVerification(
        samples=len(held), outputs=accuracy.outputs, sqnr_db=accuracy.htp_vs_float, min_sqnr_db=min_sqnr,
        runtime=f"QNN HTP backend ({htp.describe()})",
        metric=metric(compiled.session.quiet) if metric else None, min_metric=min_metric,
        cpu_qdq_sqnr_db=accuracy.cpu_vs_float, htp_vs_cpu_sqnr_db=accuracy.htp_vs_cpu,
    )
    return compiled
