"""Measured fusion choice: every fusion family timed on and off, kept only where it is faster.

A fusion that does not fit the runtime makes a model slower (ONNX Runtime's contrib
MultiHeadAttention runs a KV-cache decode step 20-30% slower than the graph as exported,
``benchmarks/decoders.py``), so for a target whose runtime is on this machine (ONNX
Runtime's CPU provider: ``--target onnxruntime`` and ``onnx``) :func:`tune` decides each
family (:mod:`opfuse.tune.families`) by timing it, after the rewrites and before anything is
written:

1. **Shapes** (:func:`tuning_feeds`): the sizes a deployment uses. ``--dim`` values where
   given; otherwise, for a KV-cache decode step (a past cache input, :func:`opfuse.verify.
   inputs.past_cache`), a past of 256 and one new token; for any other graph, 128 for every
   free dimension but the batch (a prefill's sequence, a CNN's free height and width), and
   batch 1. The feeds are verification's (:func:`opfuse.verify.inputs.make_feeds`: masks,
   position ids after the past). Where the input model does not run there (GPT-2's learned
   positions end at 255), those sizes are halved until it does, and the log says so.
2. **One interleaved run** (:mod:`opfuse.tune.timing`) at the runtime level the user
   targets (``--runtime-level``, default all), one intra-op thread unless asked otherwise,
   each session's fastest of :data:`REPEAT` runs per round, :data:`COPIES` sessions per
   variant (a round's time their mean: two sessions of one model can differ by 5-15% for as long
   as they live, which one session each would read as the variants'): the input, its A/A control (a
   second session of it), the **reference** (every family on, attention written out), the
   reference with each family off in turn, each candidate form of attention, and every
   family off (the folds alone). A variant that writes the same
   graph as the reference is not timed ("not in this graph").
3. **Decisions** (:func:`judge`). The noise (:func:`noise_of`) is the A/A's distance from
   1, or the half-width of a 95% interval for its median where that is wider, plus a floor
   (:data:`NOISE_FLOOR`); a ratio whose own median is less certain than that must beat its
   own. A family's ratio is the median over rounds of the reference's time
   over the reference-without-it's in the same round; it is kept only below 1 - noise, else
   turned off with the ratio and its spread in the reason ("slower", or "no gain beyond
   noise"). Attention takes the fastest candidate below 1 - noise, else stays written out.
4. **Never slower than the input.** The configuration chosen is timed against the input (in
   the same run when it was one of its variants, else in a second one with its own A/A). If
   it is slower beyond the noise, the folds alone are written when they are not, else the
   input itself (``None``), and the log says which. Where the choice turned families off, every
   family on with attention in the chosen form is timed beside it, and taken where it is at
   least as fast: each family was judged against attention written out, and some pay only with
   the form (a kept rotation lets Attention-23 take its 3-D form, :mod:`opfuse.passes.patterns.
   heads_3d`). Where attention stays written out (no form faster beyond the noise alone), every
   family on with the form measured fastest (or written out, the reference) is compared with the
   choice from the same rounds, and taken where it is faster beyond the noise, or at least as fast
   (median paired ratio at most 1) in fewer nodes (the tie-break: where the clock cannot tell two
   configurations apart, the smaller graph; without it, runs of one model flipped between 118 and
   274 nodes at 0.74x and 0.76x of the input's time, a Qwen2 TorchScript decode step): families that
   each gain less than the noise can gain more together (a Phi3 TorchScript decode step: each
   family alone 0.97-1.02x, attention 0.94x; all with Attention-23 0.70x of the input's time).

Nothing is timed with ``--no-tune`` (or ``OPFUSE_TUNE=off`` in the environment, which test
suites set: timing is noise there), nor for a target whose runtime is not here (qnn's HTP):
the target's default policy applies and the report says so (:func:`untimed`).
"""

from __future__ import annotations

__all__ = ["tune", "judge", "noise_of", "median_uncertainty", "tuning_feeds", "untimed", "Tuning", "FamilyResult",
           "Spread", "NOISE_FLOOR", "DEFAULT_BUDGET_S", "tune_by_default"]

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Mapping

import numpy as np
import onnx_ir as ir

from opfuse.core.analysis import op_counts, opset_of
from opfuse.core.dims import free_dims
from opfuse.core.ops import first_line
from opfuse.runtime import create_session
from opfuse.tune import timing
from opfuse.tune.families import (FAMILIES, OFF, ON, WRITTEN_OUT, Configuration, base_configuration, forms_for,
                                  label)
from opfuse.verify.inputs import describe_sizes, find_sizes, make_feeds, past_cache

NOISE_FLOOR = 0.02  # added to the A/A's distance from 1: what a family must beat
DECODE_PAST, PREFILL_SEQ = 256, 128  # the default shapes: a decode step's past, any other graph's free dims
DEFAULT_BUDGET_S = 5.0  # of timing rounds, per interleaved run
REPEAT = 3  # runs per session per round, the fastest taken (timing.measure)
COPIES = 2  # sessions per variant, a round's time their mean (timing.measure; experiments/decode_timing)
MIN_ROUNDS, MAX_ROUNDS = 7, 151  # the budget decides between them (a small model gets many: a tight A/A)
ENVIRONMENT = "OPFUSE_TUNE"  # "off": the default is not to time (test suites)


def tune_by_default() -> bool:
    """Whether ``optimize`` times the fusion families when not told (``OPFUSE_TUNE=off``: no)."""
    return os.environ.get(ENVIRONMENT, "on").strip().lower() not in ("off", "0", "no", "false")


@dataclasses.dataclass(frozen=True)
class Spread:
    """Per-round paired ratios, summarised: median, interquartile range, rounds."""

    median: float
    q1: float
    q3: float
    rounds: int

    @classmethod
    def of(cls, ratios: list[float]) -> Spread | None:
        if not ratios:
            return None
        q1, q3 = (float(q) for q in np.percentile(ratios, [25, 75]))
        return cls(float(statistics.median(ratios)), q1, q3, len(ratios))

    def __str__(self) -> str:
        return f"{self.median:.2f}x (IQR {self.q1:.2f}-{self.q3:.2f}, {self.rounds} rounds)"


@dataclasses.dataclass
class FamilyResult:
    """One family's (or attention form's) measurement and the decision taken."""

    family: str
    candidate: str  # "on" for a family, the form's name for attention
    decision: str  # "kept", "refused", "not in this graph"
    reason: str
    ratio: Spread | None = None  # with it / without it (attention: the form / written out)

    def to_dict(self) -> dict:
        return {"family": self.family, "candidate": self.candidate, "decision": self.decision,
                "reason": self.reason, "ratio": None if self.ratio is None else dataclasses.asdict(self.ratio)}


@dataclasses.dataclass
class Tuning:
    """What the measured choice timed and decided (the report's ``tuning`` section)."""

    timed: bool
    reason: str = ""  # why nothing was timed, when so
    shapes: str = ""
    level: str = "all"
    threads: int = 1
    rounds: int = 0
    seconds: float = 0.0
    aa: Spread | None = None
    noise: float = 0.0
    families: list[FamilyResult] = dataclasses.field(default_factory=list)
    chosen: str = ""  # the configuration written, as a label
    final: Spread | None = None  # the written model / the input
    written: str = ""  # "the configuration chosen", "the folds alone", "the input unchanged"
    # each refused decision as (configuration with it, configuration without it, the reason): the
    # pipeline turns the rewrites only the first has into refusals, one per site (not serialised)
    declined: list[tuple[Configuration, Configuration, str]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "declined"}
        out.update(families=[f.to_dict() for f in self.families],
                   aa=None if self.aa is None else dataclasses.asdict(self.aa),
                   final=None if self.final is None else dataclasses.asdict(self.final))
        return out

    def lines(self) -> list[str]:
        """The human log: one line for the run, one per family, one for what was written."""
        if not self.timed:
            return [self.reason]
        aa = f"A/A {self.aa}" if self.aa else "no A/A"
        out = [f"timed at ORT {self.level}, {self.threads} thread(s), {self.shapes}: {self.rounds} rounds in "
               f"{self.seconds:.1f} s; {aa}, noise {self.noise:.2f}"]
        titles = {f.name: f.title for f in FAMILIES}
        out += [f"{titles.get(f.family, f.family)}: {f.reason}" for f in self.families]
        final = f" ({self.final} of the input's time)" if self.final else ""
        out.append(f"written: {self.written}{final}")
        return out


def untimed(target_name: str, why: str, *, measured_policy: bool) -> Tuning:
    """The record of a run that timed nothing: the target's default policy applies."""
    which = ", which benchmarks/decoders.py measured" if measured_policy else ""
    return Tuning(False, f"not timed ({why}): followed the {target_name} target's default policy{which}")


def median_uncertainty(ratios: list[float]) -> float:
    """The half-width of a 95% interval for the median of ``ratios``, from their spread
    (1.96 x 1.2533 x IQR / 1.349 / sqrt(rounds): the normal approximation, read off the
    interquartile range so a few disturbed rounds do not widen it)."""
    if len(ratios) < 2:
        return 0.0
    q1, q3 = np.percentile(ratios, [25, 75])
    return float(1.82 * (q3 - q1) / np.sqrt(len(ratios)))


def noise_of(aa: list[float]) -> float:
    """What a ratio must beat: the A/A control's distance from 1, or the uncertainty of its
    median (:func:`median_uncertainty`) where that is wider (a busy machine, few rounds), plus
    :data:`NOISE_FLOOR`."""
    if not aa:
        return NOISE_FLOOR
    return max(abs(statistics.median(aa) - 1), median_uncertainty(aa)) + NOISE_FLOOR


def judge(ratios: list[float], noise: float, aa: float | None = None) -> tuple[bool, str]:
    """Keep a rewrite only where its paired ratio (with / without) is below 1 - noise, the
    noise being the A/A's (``noise``) or this ratio's own median uncertainty plus the floor,
    whichever is wider: (kept, why) with the ratio, its spread and the A/A's median in the reason."""
    spread = Spread.of(ratios)
    if spread is None:
        return False, "not measured"
    noise = max(noise, median_uncertainty(ratios) + NOISE_FLOOR)
    measured = f"measured {str(spread)[:-1]}{f', A/A {aa:.2f}' if aa is not None else ''})"
    if spread.median < 1 - noise:
        return True, f"{measured}: faster beyond the noise ({noise:.2f})"
    if spread.median > 1 + noise:
        return False, f"{measured}: slower"
    return False, f"{measured}: no gain beyond noise ({noise:.2f})"


def _graph_kind(model: ir.Model) -> str:
    return "decode step" if past_cache(model) is not None else "graph"


def tuning_feeds(model: ir.Model, dims: Mapping[str, int] | None, *, level: str = "all", seed: int = 0,
                 bound: Mapping[str, np.ndarray] | None = None) -> tuple[dict[str, np.ndarray], str]:
    """Feeds at the deployment's sizes (module docstring, step 1) and their description;
    raises :class:`opfuse.errors.BadInputError` when the model runs at none."""
    free = free_dims(model)
    given = dict(dims or {})
    past = past_cache(model)
    past_key = None
    if past is not None and past.shape is not None:
        axis = len(past.shape) - 2
        past_key = next((k for k, d in free.items() if (past.name, axis) in d.places), None)
    defaults = {}
    for key, dim in free.items():
        if dim.derived is not None or key in given:
            continue
        if dim.batch:
            defaults[key] = 1
        elif past is not None:
            defaults[key] = DECODE_PAST if key == past_key else 1
        else:
            defaults[key] = PREFILL_SEQ
    session = create_session(model, level, 1)
    notes = []
    while True:
        sizes = {**defaults, **given}
        feeds = make_feeds(model, sizes, seed=seed)
        feeds.update({k: np.asarray(v) for k, v in (bound or {}).items() if k in feeds})
        try:
            session.run(None, feeds)
            break
        except Exception as e:  # noqa: BLE001 - ONNX Runtime raises its own types
            grown = {k: v // 2 for k, v in defaults.items() if v > 16}
            if not grown:
                feeds, sizes, _ = find_sizes(model, lambda f: session.run(None, f), fixed=given, seed=seed,
                                             purpose="cannot time")
                notes.append(f"the defaults did not run ({first_line(e, limit=100)}): the smallest sizes that do")
                break
            notes.append(f"{describe_sizes(free, sizes)} did not run ({first_line(e, limit=100)})")
            defaults.update(grown)
    from opfuse.core.dims import derive_sizes  # (the sizes shown with the derived ones)

    shown = describe_sizes(free, derive_sizes(free, sizes)) or "the declared shape"
    source = "--dim" if given else "defaults"
    text = f"{_graph_kind(model)} at {shown} ({source})" + (f"; {'; '.join(notes)}" if notes else "")
    return feeds, text


def tune(original: ir.Model, build: Callable[[Configuration], ir.Model], *, target: str, opset_given: bool,
         dims: Mapping[str, int] | None = None, bound: Mapping[str, np.ndarray] | None = None,
         level: str = "all", threads: int = 1, budget_s: float = DEFAULT_BUDGET_S, seed: int = 0,
         exact: bool = True, measure: Callable[..., timing.Measurement] | None = None,
         feeds: tuple[dict, str] | None = None,
         possible: Callable[[tuple[str, ...], tuple[str, ...]], bool] | None = None) -> tuple[Configuration | None, Tuning]:
    """Time the families of ``build``'s configurations (module docstring) and return the
    configuration to write (None: the input unchanged) with the record of what was measured.

    ``build(config)`` returns the optimised model for a configuration (the pipeline caches
    them); ``measure`` is :func:`opfuse.tune.timing.measure` (None: looked up when called, so a
    test may stand a deterministic clock in for it); ``feeds`` (feeds, description) skips the
    search for sizes. ``possible(patterns, passes)`` says whether one of a family's passes runs or
    one of its patterns could match the graph at all
    (:func:`opfuse.passes.pattern_gate.patterns_that_could_match`): a family for which it says
    no is "not in this graph" without a build.
    """
    measure = measure or timing.measure
    start = time.perf_counter()
    fed, shapes = feeds if feeds is not None else tuning_feeds(original, dims, level=level, seed=seed, bound=bound)
    record = Tuning(True, shapes=shapes, level=level, threads=threads)
    base = base_configuration(opset_given)
    candidates, folds = _candidates(base, target)
    absent = "not in this graph: no rule of its patterns finds all its ops here"
    results = {c: FamilyResult(*candidates[c], "not in this graph", absent) for c in candidates
               if possible is not None and not _could_be_here(candidates[c][0], possible)}
    models = {config: build(config) for config in (base, *candidates) if config not in results}
    same = "not in this graph: it writes the same graph as the reference (nothing it fuses here, or not at this opset)"
    # an attention form that writes no attention is no candidate, whatever opset it raised to
    results.update({c: FamilyResult(*candidates[c], "not in this graph", same) for c in candidates
                    if c not in results
                    and _signature(models[c], candidates[c][0]) == _signature(models[base], candidates[c][0])})
    timed = [c for c in candidates if c not in results]
    if timed and folds not in models:
        models[folds] = build(folds)
    names = {base: "reference", folds: "folds alone", **{c: label(c, base) for c in candidates}}

    def timed_run(configs: list[Configuration]) -> timing.Measurement:
        variants = [timing.Variant("original", "the input", original, level=level, kind="reference"),
                    timing.Variant("original (A/A)", "the input (A/A)", original, level=level, kind="control")]
        variants += [timing.Variant(names.get(c, "chosen"), names.get(c, "chosen"), models[c], level=level,
                                    exact=exact) for c in configs]
        found = measure(variants, fed, threads=threads, rounds=None, baseline="original", budget_s=budget_s,
                        repeat=REPEAT, copies=COPIES, min_rounds=MIN_ROUNDS, max_rounds=MAX_ROUNDS)
        record.rounds += found.rounds
        return found

    run = timed_run([base, *timed] + ([folds] if timed and folds not in timed else []))
    record.aa = Spread.of(run.paired("original (A/A)", "original"))
    record.noise = noise_of(run.paired("original (A/A)", "original"))
    final_noise = record.noise
    final, fastest = _decide(run, record, base, candidates, timed, names, results)
    record.families = [results[c] for c in candidates]
    record.chosen = label(final, base) if final != base else label(base)
    whole = _with_every_family(final, base, models, fastest)
    if names.get(final) in run.timings:
        source, final_name = run, names[final]
    else:  # a configuration no variant was: timed against the input on its own
        models[final] = build(final)
        source, final_name = timed_run([final] + ([whole] if whole is not None else [])), "chosen"
        final_noise = max(final_noise, noise_of(source.paired("original (A/A)", "original")))
    final_ratios = source.paired(final_name, "original")
    if whole is not None and names[whole] in source.timings:
        whole_ratios = source.paired(names[whole], "original")
        if dict(final)["attention"] != WRITTEN_OUT:  # families judged against attention written out
            better = bool(whole_ratios) and statistics.median(whole_ratios) <= statistics.median(final_ratios)
        else:  # attention, judged alone, gained nothing beyond the noise: all together must, or tie and be smaller
            paired = source.paired(names[whole], final_name)
            smaller = _nodes(models[whole]) < _nodes(models[final]) if final in models else False
            better = judge(paired, final_noise)[0] or (
                smaller and bool(paired) and statistics.median(paired) <= 1)
        if better:
            _take_every_family(record, results, final, whole, whole_ratios, final_ratios,
                               (_nodes(models[whole]), _nodes(models[final])) if final in models else None)
            final, final_ratios = whole, whole_ratios
            record.chosen = label(final, base) if final != base else label(base)
    record.final = Spread.of(final_ratios)
    written: Configuration | None = final
    record.written = f"the configuration chosen ({record.chosen})"
    if record.final is not None and record.final.median > 1 + final_noise:  # never slower than the input
        folded = Spread.of(run.paired(names[folds], "original")) if names[folds] in run.timings else None
        if folded is not None and folded.median <= 1 + record.noise and final != folds:
            written, record.final = folds, folded
            record.written = (f"the folds alone: the configuration chosen measured {Spread.of(final_ratios)} of the "
                              "input's time, slower beyond the noise")
        else:
            written = None
            record.written = (f"the input unchanged: the configuration chosen measured {record.final} of its time, "
                              "slower beyond the noise")
    record.seconds = time.perf_counter() - start
    return written, record


def _with_every_family(final: Configuration, base: Configuration, built: dict,
                       fastest: str | None) -> Configuration | None:
    """Every family on, when that differs from ``final``: with attention in ``final``'s form (that
    form's candidate) where ``final`` writes one, else in the form measured fastest (None: written
    out, the reference itself). Judged one by one, each family against the reference without it,
    a family can pay only with the form (a rotation kept is what lets the form drop its head
    transposes), and families that each gain less than the noise can gain more together."""
    form = dict(final).get("attention")
    form = fastest if form == WRITTEN_OUT else form
    whole = tuple((f, form if f == "attention" and form is not None else o) for f, o in base)
    return whole if whole != final and whole in built else None


def _take_every_family(record: Tuning, results: dict, final: Configuration, whole: Configuration,
                       whole_ratios: list[float], final_ratios: list[float],
                       nodes: tuple[int, int] | None = None) -> None:
    """``whole`` (every family on, attention in the chosen form) measured at least as fast as the
    families chosen one by one: the families turned off are kept, and the log says why (``nodes``:
    both graphs' node counts, the tie-break)."""
    form = dict(whole)["attention"]
    off = {f for f, o in final if o == OFF and dict(whole).get(f) == ON}
    count = f" in {nodes[0]} nodes against {nodes[1]}" if nodes else ""
    why = (f"kept with attention {form}: every family on measured {Spread.of(whole_ratios)} of "
           f"the input's time{count}, the families chosen one by one {Spread.of(final_ratios)}; alone: ")
    for result in results.values():
        if ((result.family in off or (result.family == "attention" and result.candidate == form))
                and result.decision == "refused"):
            result.decision, result.reason = "kept", why + result.reason
    record.declined = [d for d in record.declined if not any(dict(d[1]).get(f) == OFF for f in off)
                       and dict(d[1]).get("attention") == dict(d[0]).get("attention")]


def _candidates(base: Configuration, target: str) -> tuple[dict[Configuration, tuple[str, str]], Configuration]:
    """Each configuration timed against ``base`` -> (family, candidate): every family off in turn,
    every form of attention; and the folds alone (every family off)."""

    def variant(**change) -> Configuration:
        return tuple((f, change.get(f, o)) for f, o in base)

    candidates: dict[Configuration, tuple[str, str]] = {}
    for family, option in base:
        if family == "attention":
            candidates.update({variant(attention=form.name): ("attention", form.name)
                               for form in forms_for(target) if form.name != WRITTEN_OUT})
        else:
            candidates[variant(**{family: OFF})] = (family, option)
    return candidates, variant(**{f: OFF for f, _ in base if f != "attention"})


def _decide(run: timing.Measurement, record: Tuning, base: Configuration, candidates: dict,
            timed: list[Configuration], names: dict, results: dict) -> tuple[Configuration, str | None]:
    """Each timed family judged (:func:`judge`) into ``results``; the configuration they make (the
    families kept on, attention in its fastest form that is faster beyond the noise) and the form
    of attention measured fastest, beyond the noise or not (None: no form ran faster than written out)."""
    broken = {**{k: f"did not run: {v}" for k, v in run.errors.items()},
              **{k: f"computes something else: {v}" for k, v in run.mismatches.items()}}
    chosen = dict(base)
    best: tuple[float, str] | None = None
    fastest: tuple[float, str] | None = None
    aa = record.aa.median if record.aa else None
    for config in timed:
        family, candidate = candidates[config]
        problem = broken.get(names[config]) or broken.get(names[base])
        # a family: the reference (with it) over the reference without it; a form: it over written out
        ratios = (run.paired(names[config], names[base]) if family == "attention"
                  else run.paired(names[base], names[config]))
        kept, why = (False, problem) if problem else judge(ratios, record.noise, aa)
        if family == "attention":
            median = Spread.of(ratios).median if ratios and not problem else None
            if median is not None and median < 1 and (fastest is None or median < fastest[0]):
                fastest = (median, candidate)
            text = f"{candidate} written: {why}" if kept else f"kept written out: {candidate} {why}"
            if kept and (best is None or Spread.of(ratios).median < best[0]):
                best = (Spread.of(ratios).median, candidate)
            elif not kept:
                record.declined.append((config, base, f"measured choice: {text}"))
        else:
            text = f"kept: {why}" if kept else f"turned off: {why}"
            chosen[family] = chosen[family] if kept else OFF
            if not kept:
                record.declined.append((base, config, f"measured choice: {text}"))
        results[config] = FamilyResult(family, candidate, "kept" if kept else "refused", text, Spread.of(ratios))
    if best is not None:  # attention is written: its refused forms are no site's refusal
        chosen["attention"] = best[1]
        record.declined = [d for d in record.declined if dict(d[1]).get("attention") == dict(d[0]).get("attention")]
        if chosen.get("opset") == OFF and best[1].startswith("Attention-"):  # the form needs the opset asked for
            chosen["opset"] = ON
            record.declined = [d for d in record.declined if dict(d[1]).get("opset") != OFF]
            for result in results.values():
                if result.family == "opset":
                    result.decision, result.reason = "kept", f"kept: {best[1]} needs it; {result.reason}"
        for result in results.values():
            if result.family == "attention" and result.decision == "kept" and result.candidate != best[1]:
                result.decision = "refused"
                result.reason = f"not written: {best[1]} was faster; {result.reason}"
    return tuple(chosen.items()), (fastest[1] if fastest else None)


def _could_be_here(family: str, possible: Callable[[tuple[str, ...], tuple[str, ...]], bool]) -> bool:
    """Whether a variant of ``family`` could differ from the reference: the opset raise always;
    else ``possible(patterns, passes)``: one of its passes runs, or one of its patterns could match."""
    found = next(f for f in FAMILIES if f.name == family)
    return (not found.patterns and not found.passes) or possible(found.patterns, found.passes)


def _nodes(model: ir.Model) -> int:
    """The nodes a model runs, its subgraphs' included."""
    return sum(op_counts(model).values())


def _signature(model: ir.Model, family: str) -> tuple:
    """What tells two built variants of ``family`` apart: their op counts, and but for attention's
    forms their opset (a form that writes no attention is no candidate, whatever opset it raised to)."""
    return tuple(sorted(op_counts(model).items())), None if family == "attention" else opset_of(model.opset_imports)
