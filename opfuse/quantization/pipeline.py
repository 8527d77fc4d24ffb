"""``opfuse quantize``: fold first, then int8 that keeps the model's accuracy.

The steps, in order (each its own module):

1. load (:mod:`opfuse.load`) and read the calibration data (:mod:`.calibration`); the last
   quarter of the samples is held out for step 7;
2. fold and clean up with :func:`opfuse.optimize` (portable ONNX, verified on a held-out
   sample as any rewrite), with ``equalize`` also cross-layer equalisation
   (:mod:`opfuse.passes.equalize`): after folding, each weight is quantised once;
3. prepare (:mod:`.qdq`): nodes named, a zero bias where a Conv or Gemm has none, the
   opset raised where the preset's QDQ needs it;
4. calibrate once and insert QDQ with ONNX Runtime's quantiser (:mod:`.presets`);
5. empirical bias correction (:mod:`.bias_correction`), kept only if it raises the output
   SQNR on the calibration samples;
6. mixed precision: per-layer SQNR against the float model (:mod:`.sqnr`); while the output
   SQNR on the calibration samples is below ``min_sqnr`` (or the caller's ``metric`` is
   below ``min_metric``), the layers that cost most are kept out of int8 (in float, or
   with 16-bit activations for ``qnn``) and the model is quantised again: 1, 1, 2, 2, 4,
   4, ... layers a step, at most ``max_steps`` steps;
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
from opfuse.pipeline import optimize
from opfuse.quantization.bias_correction import BiasCorrection, apply_corrections, compute_corrections
from opfuse.quantization.calibration import CalibrationSource, load_calibration, split
from opfuse.quantization.presets import DEFAULT_PRESET, PRESETS
from opfuse.quantization.qdq import Quantizer, prepare, qdq_layers, weight_storage
from opfuse.quantization.report import LayerRow, QuantReport, QuantVerification, SearchStep
from opfuse.quantization.sqnr import INFINITE, layer_costs, layer_pairs, measure, output_sqnr
from opfuse.runtime import create_session
from opfuse.save import save_model, write_text_atomic

Metric = Callable[[ort.InferenceSession], float]


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
    holdout: int | None = None,
    max_steps: int = 12,
    output: str | os.PathLike | None = None,
    report_path: str | os.PathLike | None = None,
    overwrite: bool = False,
    seed: int = 0,
) -> tuple[ir.Model, QuantReport]:
    """Fold, quantise to int8 QDQ, verify; returns (the quantised model, its report).

    ``calibration``: an ``.npz`` path (arrays named after the inputs, leading sample
    axis), a directory of one-sample ``.npz`` files, ``"random:N"`` (smoke tests), or an
    iterable of ``{input: array}``. ``metric(session) -> float`` (higher is better) is the
    caller's own accuracy measure on an ``InferenceSession`` of a candidate model; with
    ``min_metric`` the search continues until it is met too. Raises
    :class:`~opfuse.errors.VerificationError` (exit 1) when the held-out SQNR is below
    ``min_sqnr`` or the metric below ``min_metric``: nothing is written but the report.
    """
    if preset not in PRESETS:
        raise BadInputError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if (min_metric is None) != (metric is None):
        raise BadInputError("metric and min_metric go together")
    if output is not None and isinstance(model, (str, os.PathLike)) and not overwrite:
        if pathlib.Path(output).resolve() == pathlib.Path(model).resolve():
            raise BadInputError(f"{output}: refusing to overwrite the input model; choose another output")
    chosen = PRESETS[preset]
    work, display = load_model(model)
    samples, notes = load_calibration(calibration, work, seed=seed)
    calib, held = split(samples, holdout)

    passes = [*DEFAULT_PASSES, *(["equalize"] if equalize else [])]
    folded, fusion = optimize(work, passes=passes, target="onnx", inputs=held[0])
    fusion.model = display
    float_model, prep_notes = prepare(ir.serde.serialize_model(folded), chosen)
    report = QuantReport(model=display, preset=preset, fusion=fusion, calibration_samples=len(calib),
                         notes=[*notes, *prep_notes])

    with tempfile.TemporaryDirectory(prefix="opfuse-quantize-") as tmp:
        quantizer = Quantizer(float_model, chosen, calib, tmp)
        qdq = _search(quantizer, float_model, calib, report, min_sqnr=min_sqnr, metric=metric,
                      min_metric=min_metric, bias_correction=bias_correction, max_steps=max_steps)

    outputs, total = output_sqnr(float_model, qdq, held, qdq_level="all")
    report.verification = QuantVerification(
        samples=len(held), outputs=outputs, sqnr_db=total, min_sqnr_db=min_sqnr,
        runtime="ONNX Runtime CPU, all optimisations (int8 kernels)",
        metric=metric(create_session(qdq, "all")) if metric else None, min_metric=min_metric,
    )
    report.weights_8bit, report.weights_total = weight_storage(float_model, qdq)
    report.bytes_float, report.bytes_quantized = float_model.ByteSize(), qdq.ByteSize()
    report.quantize_linear = sum(n.op_type == "QuantizeLinear" for n in qdq.graph.node)

    if not report.verification.ok:
        if report_path is not None:
            write_text_atomic(report_path, report.to_json())
        v = report.verification
        why = (f"output SQNR {v.sqnr_db:.1f} dB on {v.samples} held-out sample(s) is below --min-sqnr "
               f"{min_sqnr:g}" if min_sqnr is not None and v.sqnr_db < min_sqnr
               else f"metric {v.metric} is below {min_metric}")
        costly = ", ".join(f"{r.name} (own SQNR {r.own_sqnr_db:.1f} dB)" for r in report.costliest(3))
        written = f"only the report was written ({report_path})" if report_path else "nothing was written"
        raise VerificationError(f"quantisation failed: {why}; costliest layers {costly}; {written}", report)
    result = ir.serde.deserialize_model(qdq)
    if output is not None:
        save_model(result, output)
    if report_path is not None:
        write_text_atomic(report_path, report.to_json())
    return result, report


def _search(quantizer: Quantizer, float_model: onnx.ModelProto, calib, report: QuantReport, *,
            min_sqnr, metric, min_metric, bias_correction: bool, max_steps: int) -> onnx.ModelProto:
    """Steps 4-6 of the module docstring; fills the report's layers, search and bias fields."""
    outputs = [o.name for o in float_model.graph.output]
    keep: list[str] = []
    why: dict[str, str] = {}
    correction: BiasCorrection | None = None
    for step in range(max_steps + 1):
        qdq = quantizer.quantize(keep)
        layers = qdq_layers(float_model, qdq, also=keep)
        pairs = {**layer_pairs(layers), **{f"output:{n}": (n, n) for n in outputs}}
        if bias_correction and correction is None:
            correction = compute_corrections(float_model, qdq, calib)
            before = measure(float_model, qdq, calib, pairs)
            report.bias_corrected = apply_corrections(qdq, correction)
            report.bias_skipped = dict(correction.skipped)
            acc = measure(float_model, qdq, calib, pairs)
            with_db, without_db = (a.total_db(f"output:{n}" for n in outputs) for a in (acc, before))
            report.bias_sqnr_db = (without_db, with_db)
            if with_db < without_db:  # it did not help on this model: undo it
                report.notes.append(f"bias correction lowered the calibration output SQNR "
                                    f"({without_db:.1f} -> {with_db:.1f} dB), so it was not applied")
                correction, bias_correction, acc = None, False, before
                qdq = quantizer.quantize(keep)
                report.bias_corrected = 0
        else:
            if correction is not None:
                apply_corrections(qdq, correction)
            acc = measure(float_model, qdq, calib, pairs)
        sqnr = acc.total_db(f"output:{n}" for n in outputs)
        value = metric(create_session(qdq, "all")) if metric else None
        report.search.append(SearchStep(kept=list(keep), sqnr_db=sqnr, metric=value))
        costs = layer_costs(layers, acc)
        met = (min_sqnr is None or sqnr >= min_sqnr) and (min_metric is None or value >= min_metric)
        candidates = sorted((own, name) for name, (_, own) in costs.items() if name not in keep and own < INFINITE)
        if met or not candidates or step == max_steps:
            break
        count = 1 << (step // 2)
        for own, name in candidates[:count]:
            keep.append(name)
            why[name] = (f"kept {'with 16-bit activations' if quantizer.preset.keep_as == 'int16' else 'in float'}: "
                         f"at step {step + 1} it added the most noise of the int8 layers (its own SQNR "
                         f"{own:.1f} dB; output SQNR {sqnr:.1f} dB"
                         + (f", below --min-sqnr {min_sqnr:g}" if min_sqnr is not None and sqnr < min_sqnr else "")
                         + ")")
    costs_by_name = {name: costs[name] for name in costs}
    kept_as = "int16 activations" if quantizer.preset.keep_as == "int16" else "float"
    ops = {n.name: n.op_type for n in float_model.graph.node}
    rows = []
    for layer in layers:
        out_db, own = costs_by_name.get(layer.name, (float("nan"), INFINITE))
        precision = kept_as if layer.name in why else "int8"
        rows.append(LayerRow(layer.name, layer.op_type, out_db, own, precision, why.get(layer.name, "")))
    seen = {r.name for r in rows}
    rows += [LayerRow(name, ops.get(name, "?"), float("nan"), INFINITE, kept_as, why[name])
             for name in keep if name not in seen]
    report.layers = rows
    return qdq
