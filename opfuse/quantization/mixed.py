"""Mixed precision: which layers to keep out of int8, chosen by what keeping each one buys.

1. Quantise everything; measure the output SQNR on the calibration samples
   (:class:`~opfuse.quantization.sqnr.OutputReference`, float outputs computed once).
2. If it is below the target (``min_sqnr``, or the caller's metric below ``min_metric``),
   measure each candidate's **sensitivity**: the output SQNR of the same QDQ model with
   only that layer kept in float (its float weight and bias back, its inputs read before
   their int8 round trip: :func:`keep_variant`, graph surgery, no re-quantisation), on the
   first :data:`SENSITIVITY_SAMPLES` calibration samples. Candidates are each layer with
   weights (Conv, ConvTranspose, Gemm, MatMul), and the other quantised layers by op type
   ("every Add", "every Softmax": element-wise arithmetic in 8 bits is a common culprit,
   and one candidate per op type keeps the count near the number of weighted layers).
   A per-layer noise figure alone ranks badly: in PP-OCRv4 rec with only its weighted
   layers in int8, keeping one 144-weight depthwise conv raises the output SQNR from 12.1
   to 17.6 dB though it adds little noise at its own output; the gain downstream is what
   matters.
3. Greedy forward selection: keep the candidates with the largest gain, 1, 1, 2, 2, 4,
   ... a step, quantised anew by ONNX Runtime's quantiser with the kept layers excluded
   (in float; 16-bit activations for ``qnn``); a step that does not raise the output
   SQNR (or the metric) measured on every calibration sample is undone and its candidates
   set aside; the gains are measured again from the new model before the next step
   (layers interact: keeping every Mul changes what each conv costs). Until the target is
   met, no candidate helps any more, or ``max_steps`` steps.

Every kept layer's reason in the report says what keeping it alone was measured to buy.
"""

from __future__ import annotations

__all__ = ["search", "keep_variant", "SENSITIVITY_SAMPLES"]

import onnx

from opfuse.errors import BadInputError
from opfuse.quantization.bias_correction import (
    BiasCorrection,
    apply_corrections,
    compute_corrections,
    select_corrections,
)
from opfuse.quantization.qdq import WEIGHTED_OPS, Quantizer, _read_float_inputs, qdq_layers
from opfuse.quantization.report import LayerRow, QuantReport, SearchStep
from opfuse.quantization.sqnr import INFINITE, OutputReference, layer_costs, layer_pairs, measure
from opfuse.runtime import create_session

AUTO_METHODS = ("minmax", "percentile")  # --calibrate auto tries these
SENSITIVITY_SAMPLES = 8  # calibration samples each candidate's sensitivity is measured on
LAYER_SAMPLES = 16  # samples of the per-layer SQNR table (every intermediate tensor exposed)


def keep_variant(qdq: onnx.ModelProto, float_model: onnx.ModelProto, names) -> onnx.ModelProto:
    """``qdq`` with the nodes ``names`` running in float: float weights and biases, float inputs."""
    variant = onnx.ModelProto()
    variant.CopyFrom(qdq)
    names = set(names)
    originals = {n.name: n for n in float_model.graph.node if n.name in names}
    float_inits = {i.name: i for i in float_model.graph.initializer}
    have = {i.name for i in variant.graph.initializer}
    for node in variant.graph.node:
        original = originals.get(node.name)
        if original is None:
            continue
        for index, source in enumerate(original.input):
            if index < len(node.input) and source in float_inits and node.input[index] != source:
                if source not in have:
                    variant.graph.initializer.append(float_inits[source])
                    have.add(source)
                node.input[index] = source
    _read_float_inputs(variant, names, float_model)
    return variant


def search(quantizer: Quantizer, float_model: onnx.ModelProto, calib, report: QuantReport, *,
           min_sqnr, metric, min_metric, bias_correction: bool, max_steps: int,
           calibrate: str = "auto") -> onnx.ModelProto:
    """The module docstring's steps; fills the report's layers, search and bias fields.

    Returns the best trial: the first that meets the target, else the one that came
    closest (by the metric when there is one, then by SQNR).
    """
    reference = OutputReference(float_model, calib)
    kept_as = "int16 activations" if quantizer.preset.keep_as == "int16" else "float"
    subset = reference.head(LAYER_SAMPLES)  # for choosing which corrections to keep
    sensitivity = reference.head(SENSITIVITY_SAMPLES)
    corrections: dict[str, BiasCorrection | None] = {}  # per calibration method, decided by its first trial
    bias_facts: dict[str, tuple] = {}  # method -> (layers corrected, skipped, (SQNR without, with))

    def trial(keep: list[str]):
        method = quantizer.method
        qdq = quantizer.quantize(keep)
        if bias_correction and method not in corrections:  # a method's first trial decides
            without_db = reference.sqnr(qdq)
            corrected, correction = select_corrections(qdq, compute_corrections(float_model, qdq, calib),
                                                       subset.sqnr)
            with_db = reference.sqnr(corrected)
            if with_db > without_db:
                qdq, sqnr = corrected, with_db
            else:  # it did not help on every calibration sample
                correction, sqnr = None, without_db
            corrections[method] = correction
            bias_facts[method] = (len(correction.layers) if correction else 0,
                                  dict(correction.skipped) if correction else {}, (without_db, with_db))
        else:
            if corrections.get(method) is not None:
                apply_corrections(qdq, corrections[method])
            sqnr = reference.sqnr(qdq)
        value = metric(create_session(qdq, "all")) if metric else None
        report.search.append(SearchStep(kept=list(keep), sqnr_db=sqnr, metric=value, calibration=method))
        return qdq, sqnr, value

    def score(sqnr, value):
        return (value if value is not None else 0.0, sqnr)

    keep: list[str] = []
    why: dict[str, str] = {}
    gain_of: dict[str, float] = {}
    rejected: set[str] = set()
    if calibrate == "auto":  # the first trial with each method; the better one stays
        tried, failed = {}, {}
        for method in AUTO_METHODS:
            quantizer.method = method
            try:
                tried[method] = trial(keep)
            except BadInputError as e:  # one method's failure (an empty histogram) leaves the other
                failed[method] = str(e)
        if not tried:
            raise BadInputError(next(iter(failed.values())))
        for method, error in failed.items():
            report.notes.append(f"calibration: {method} failed, not used ({error})")
        best = max(tried, key=lambda m: score(*tried[m][1:]))
        quantizer.method = best
        qdq, sqnr, value = tried[best]
        report.notes.append("calibration: " + ", ".join(
            f"{m} {tried[m][1]:.1f} dB" + (f" (metric {tried[m][2]:.4g})" if tried[m][2] is not None else "")
            for m in tried) + f" output SQNR on the calibration samples; {best} kept")
    else:
        quantizer.method = calibrate
        qdq, sqnr, value = trial(keep)
    report.calibration = quantizer.method
    if quantizer.method in bias_facts:
        report.bias_corrected, report.bias_skipped, report.bias_sqnr_db = bias_facts[quantizer.method]
        if corrections.get(quantizer.method) is None:
            without_db, with_db = report.bias_sqnr_db
            report.notes.append(f"bias correction did not raise the calibration output SQNR "
                                f"({without_db:.1f} -> {with_db:.1f} dB), so it was not applied")
    steps = 0
    while steps < max_steps:
        met = (min_sqnr is None or sqnr >= min_sqnr) and (min_metric is None or value >= min_metric)
        if met:
            break
        gains: dict[str, float] = {}
        order = [(label, names) for label, names in _rank(qdq, float_model, sensitivity, gains, skip=set(keep))
                 if label not in rejected]
        if not order:
            break
        fresh = order[: 1 << (steps // 2)]  # 1, 1, 2, 2, 4, ... candidates a step
        steps += 1
        candidate = keep + [name for _, names in fresh for name in names]
        new_qdq, new_sqnr, new_value = trial(candidate)
        if score(new_sqnr, new_value) <= score(sqnr, value):  # measured together they do not help
            rejected.update(label for label, _ in fresh)
            continue
        for label, names in fresh:
            what = "it" if names == (label,) else f"{label} ({len(names)} nodes)"
            for name in names:
                gain_of[name] = gains[label]
                why[name] = (f"kept {'in float' if kept_as == 'float' else 'with 16-bit activations'} at step "
                             f"{steps}: keeping {what} alone raised the calibration output SQNR by "
                             f"{gains[label]:+.2f} dB on {SENSITIVITY_SAMPLES} samples, the most of the "
                             f"candidates; the step took it from {sqnr:.1f} to {new_sqnr:.1f} dB"
                             + (f" (target {min_sqnr:g} dB)" if min_sqnr is not None else ""))
        keep, qdq, sqnr, value = candidate, new_qdq, new_sqnr, new_value
    if rejected:
        report.notes.append(f"mixed precision: {len(rejected)} candidate(s) that helped alone but not "
                            f"together with the layers already kept were left in int8")
    layers = qdq_layers(float_model, qdq, also=keep)
    costs = layer_costs(layers, measure(float_model, qdq, calib[:LAYER_SAMPLES], layer_pairs(layers)))
    ops = {n.name: n.op_type for n in float_model.graph.node}
    rows = []
    for layer in layers:
        out_db, own = costs.get(layer.name, (float("nan"), INFINITE))
        rows.append(LayerRow(layer.name, layer.op_type, out_db, own, kept_as if layer.name in why else "int8",
                             why.get(layer.name, ""), gain_of.get(layer.name)))
    seen = {r.name for r in rows}
    rows += [LayerRow(name, ops.get(name, "?"), float("nan"), INFINITE, kept_as, why[name], gain_of.get(name))
             for name in keep if name not in seen]
    report.layers = rows
    return qdq


def _rank(qdq: onnx.ModelProto, float_model: onnx.ModelProto, subset: OutputReference,
          gains: dict[str, float], *, skip: set[str]) -> list[tuple]:
    """Candidates that raise the output SQNR on ``subset`` when kept alone, largest gain
    first: a list of (label, node names); ``gains`` gets each label's gain in dB. Nodes in
    ``skip`` (kept already) are no candidates."""
    layers = qdq_layers(float_model, qdq)
    units: dict[str, tuple[str, ...]] = {}
    for layer in layers:
        if layer.name in skip:
            continue
        if layer.op_type in WEIGHTED_OPS:
            units[layer.name] = (layer.name,)
        else:
            units.setdefault(f"every {layer.op_type}", ())
            units[f"every {layer.op_type}"] += (layer.name,)
    base = subset.sqnr(qdq)
    for label, names in units.items():
        gains[label] = subset.sqnr(keep_variant(qdq, float_model, names)) - base
    return [(label, units[label]) for label in sorted(units, key=lambda u: -gains[u]) if gains[label] > 0]
