"""Mixed precision: an exact sensitivity ranking and a search that never steps down.

The pieces, each replaceable:

- a **scorer** (:class:`~opfuse.quantization.qdq.sqnr.OutputReference`, the one every step
  judges by): the output SQNR of a candidate model against the float model's outputs on one
  sample set, the candidate run by its runner (ONNX Runtime's CPU by default; a backend whose
  numerics differ, an NPU's, plugs its own in, and every measurement of the search, ranking,
  acceptance and stopping, goes through it);
- a **keep action** (:class:`KeepAction`): what keeping a layer out of int8 means: in
  float (``nodes_to_exclude``), with 16-bit activations (tensor overrides), or with 16-bit
  weights (weight overrides: the 16-bit-activation presets of an NPU, whose activations are 16-bit
  already and which runs no float), applied by re-quantising: ``make(keep) -> model``
  (:class:`~opfuse.quantization.algorithms.trials.TrialMaker`); with 16-bit weights, the candidates
  are the layers with weights alone;
- two sample sets: the **tuning** samples (calibration, AdaRound, bias correction, the
  ranking, the acceptance of each step) and the **check** samples, which nothing was
  tuned on, used only for the stopping test.

The search (:func:`monotone_search`):

1. the base model keeps nothing; if its check SQNR meets the target, stop;
2. **sensitivity, exactly**: each candidate (each layer with weights; the other quantised
   nodes by op type, "every MaxPool") is kept alone, the model re-quantised with it
   excluded (``make([candidate])``), and its tuning SQNR measured; the gain over the base
   ranks the candidates (those that gain nothing are not tried). A large model has more candidates
   than re-quantising each is worth (a decoder's hundreds of MatMuls, each trial a whole model):
   with ``ranked=N`` only the N costliest by the per-layer table's measure (each layer's own noise,
   :func:`~opfuse.quantization.qdq.sqnr.layer_costs`, one run of the current model with every layer's
   tensors exposed) are measured exactly; a later pass takes the next N;
3. **the walk**: down the ranking, one candidate a step: ``make(kept + [candidate])``; the
   step is accepted only if the tuning SQNR (the caller's metric first, when there is one)
   rises above the current one, so the accepted sequence rises strictly: the search never
   accepts a step that lowers the measured SQNR. After each accepted step the check
   samples decide whether the target is met;
4. when a pass ends short of the target with steps left, the remaining candidates are
   ranked again against the current model (keeping one layer changes what the others
   cost) and the walk goes on; it ends when the target is met, no candidate is left, or
   after ``max_steps`` walk trials.

The report gets the ranking (every candidate's measured gain), every step (what it added,
the tuning and check SQNR, accepted or not) and, for each kept layer, why.
"""

from __future__ import annotations

__all__ = ["KeepAction", "KEEP_ACTIONS", "Candidate", "candidates",
           "monotone_search", "SearchOutcome"]

import dataclasses
from collections.abc import Callable

import onnx

from opfuse.quantization.qdq.layers import qdq_layers
from opfuse.quantization.qdq.quantizer import WEIGHTED_OPS
from opfuse.quantization.report import QuantReport, RankedCandidate, SearchStep
from opfuse.quantization.qdq.sqnr import OutputReference, layer_costs, layer_pairs
from opfuse.quantization.qdq.sqnr import measure as measure_tensors

@dataclasses.dataclass(frozen=True)
class KeepAction:
    """What keeping a layer out of int8 means (``Quantizer.quantize(keep, keep_as=name)``)."""

    name: str  # "float", "int16" or "int16-weights"
    label: str  # as the report says it: "float", "int16 activations", "int16 weights"
    verb: str  # "kept in float", "kept with 16-bit activations", "kept with 16-bit weights"
    weights_only: bool = False  # its candidates are the layers with weights alone (nothing else has any)


KEEP_ACTIONS = {
    "float": KeepAction("float", "float", "kept in float"),
    "int16": KeepAction("int16", "int16 activations", "kept with 16-bit activations"),
    "int16-weights": KeepAction("int16-weights", "int16 weights", "kept with 16-bit weights", weights_only=True),
}
_BOUNDED = "the exact sensitivity ranking re-quantised the"
RANK_SAMPLES = 16  # samples of the per-layer cost that preselects the ranked candidates (pipeline.LAYER_SAMPLES)


@dataclasses.dataclass(frozen=True)
class Candidate:
    label: str  # a node name, or "every OP"
    nodes: tuple[str, ...]


def candidates(float_model: onnx.ModelProto, qdq: onnx.ModelProto, skip=(), weights_only: bool = False
               ) -> list[Candidate]:
    """Each quantised layer with weights alone; the other quantised nodes by op type (not with
    ``weights_only``, which takes the layers whose weight is a constant alone: a MatMul of two
    activations has none to keep)."""
    skip = set(skip)
    units: dict[str, list[str]] = {}
    inits = {i.name for i in float_model.graph.initializer}
    weighted = {n.name for n in float_model.graph.node
                if n.op_type in WEIGHTED_OPS and len(n.input) > 1 and n.input[1] in inits}
    for layer in qdq_layers(float_model, qdq):
        if layer.name in skip or (weights_only and layer.name not in weighted):
            continue
        label = layer.name if layer.op_type in WEIGHTED_OPS else f"every {layer.op_type}"
        units.setdefault(label, []).append(layer.name)
    return [Candidate(label, tuple(nodes)) for label, nodes in units.items()]


@dataclasses.dataclass
class SearchOutcome:
    model: onnx.ModelProto
    kept: list[str]
    tune_db: float
    check_db: float
    metric: float | None
    met: bool
    why: dict[str, str]  # node -> why it was kept
    gain_of: dict[str, float]  # node -> its candidate's measured gain alone
    stopped: str = ""  # why the search ended, in words


def monotone_search(make: Callable[[list[str]], onnx.ModelProto], float_model: onnx.ModelProto,
                    tune: OutputReference, check: OutputReference, report: QuantReport, *, keep_as: KeepAction,
                    min_sqnr: float | None, metric: Callable[[onnx.ModelProto], float] | None = None,
                    min_metric: float | None = None, max_steps: int = 64, ranked: int | None = None
                    ) -> SearchOutcome:
    """The module docstring's search; ``make(keep)`` builds a candidate, ``metric(model)``
    (higher is better) is the caller's measure; ``ranked``: at most that many candidates measured
    exactly per ranking, the costliest by the per-layer table (None: all). Fills ``report.ranking``
    and ``report.search``."""

    def measure(keep: list[str], added: list[str], phase: str):
        model = make(keep)
        tune_db = tune.sqnr(model)
        value = metric(model) if metric else None
        report.search.append(SearchStep(kept=list(keep), sqnr_db=tune_db, metric=value,
                                        calibration=report.calibration, added=list(added), phase=phase))
        return model, tune_db, value

    def met(check_db: float, value) -> bool:
        return (min_sqnr is None or check_db >= min_sqnr) and (min_metric is None or value >= min_metric)

    def score(tune_db, value):
        return (value if value is not None else 0.0, tune_db)

    keep: list[str] = []
    model, tune_db, value = measure(keep, [], "base")
    check_db = check.sqnr(model)
    report.search[-1].check_sqnr_db, report.search[-1].accepted = check_db, True
    why: dict[str, str] = {}
    gain_of: dict[str, float] = {}
    steps, tried = 0, set()
    base_tune, base_check = tune_db, check_db
    stopped = ""
    while not met(check_db, value) and steps < max_steps:
        ranking = _rank(model, float_model, keep, tried, measure, score(tune_db, value), report,
                        keep_as=keep_as, ranked=ranked, samples=tune.samples)
        if not ranking:
            stopped = "no candidate left raises the tuning SQNR"
            break
        accepted_any = False
        for candidate, gain in ranking:
            if steps >= max_steps or met(check_db, value):
                break
            steps += 1
            tried.add(candidate.label)
            trial_keep = keep + list(candidate.nodes)
            new_model, new_db, new_value = measure(trial_keep, list(candidate.nodes), "step")
            step = report.search[-1]
            if score(new_db, new_value) <= score(tune_db, value):
                step.accepted = False  # it lowers (or does not raise) the measured SQNR: not taken
                continue
            new_check = check.sqnr(new_model)
            step.accepted, step.check_sqnr_db = True, new_check
            what = "it" if candidate.nodes == (candidate.label,) else f"{candidate.label} ({len(candidate.nodes)} nodes)"
            for name in candidate.nodes:
                gain_of[name] = gain
                why[name] = (f"{keep_as.verb} at step {steps}: keeping {what} alone raised the tuning output "
                             f"SQNR by {gain:+.2f} dB (re-quantised); the step took it from {tune_db:.1f} to "
                             f"{new_db:.1f} dB, {new_check:.1f} dB on the check samples"
                             + (f" (target {min_sqnr:g} dB)" if min_sqnr is not None else ""))
            keep, model, tune_db, value, check_db = trial_keep, new_model, new_db, new_value, new_check
            accepted_any = True
        if not accepted_any:
            stopped = "no candidate left raises the tuning SQNR when taken"
            break
    if met(check_db, value):
        stopped = "the target was met"
    elif not stopped:
        stopped = f"it took its {max_steps} steps (max_steps)"
    stopped += (f"; with {len(keep)} node(s) kept, the tuning samples went from {base_tune:.1f} to {tune_db:.1f} dB "
                f"and the check samples from {base_check:.1f} to {check_db:.1f} dB")
    if tune_db - base_tune > 1.0 and check_db - base_check < 0.5 * (tune_db - base_tune):
        stopped += ": what the steps gained on the samples they were chosen on did not carry to others"
    return SearchOutcome(model, keep, tune_db, check_db, value, met(check_db, value), why, gain_of, stopped)


def _rank(model, float_model, keep, tried, measure, base_score, report, *, keep_as: KeepAction,
          ranked: int | None = None, samples=()) -> list[tuple[Candidate, float]]:
    """Candidates not kept or tried yet, each kept alone on top of ``keep`` and measured
    (re-quantised), those that raise the tuning score first, largest gain first; with ``ranked``,
    only that many of them, the costliest by :func:`costliest` on ``samples``."""
    pending = [c for c in candidates(float_model, model, skip=keep, weights_only=keep_as.weights_only)
               if c.label not in tried]
    if ranked is not None and len(pending) > ranked:
        total = len(pending)
        pending = costliest(float_model, model, pending, samples, ranked)
        if not any(n.startswith(_BOUNDED) for n in report.notes):
            report.notes.append(f"{_BOUNDED} {len(pending)} costliest of {total} candidates by each layer's own noise "
                                f"(the layer table's; first {', '.join(c.label for c in pending[:3])}): "
                                f"--search-candidates {ranked}; each later pass measures the costliest "
                                f"{ranked} of those left")
    ranked_out = []
    for candidate in pending:
        _, tune_db, value = measure(keep + list(candidate.nodes), list(candidate.nodes), "sensitivity")
        gain = tune_db - base_score[1]
        better = (value if value is not None else 0.0, tune_db) > base_score
        report.ranking.append(RankedCandidate(candidate.label, list(candidate.nodes), gain, len(keep),
                                              metric=value))
        if better:
            ranked_out.append((candidate, gain))
    ranked_out.sort(key=lambda item: -item[1])
    return ranked_out


def costliest(float_model: onnx.ModelProto, qdq: onnx.ModelProto, pending: list[Candidate], samples,
              count: int) -> list[Candidate]:
    """The ``count`` candidates of ``pending`` whose layers add the most noise in ``qdq`` (the per-layer
    table's own-noise SQNR, :func:`~opfuse.quantization.qdq.sqnr.layer_costs`, lowest first; a
    candidate of several nodes by its costliest), measured once on the first :data:`RANK_SAMPLES`."""
    layers = qdq_layers(float_model, qdq)
    costs = layer_costs(layers, measure_tensors(float_model, qdq, list(samples)[:RANK_SAMPLES], layer_pairs(layers)))
    own = {name: cost for name, (_, cost) in costs.items()}
    return sorted(pending, key=lambda c: min((own.get(n, float("inf")) for n in c.nodes)))[:count]
