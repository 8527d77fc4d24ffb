"""Measured fusion choice: every fusion family the target fuses, timed off against its policy.

A fusion that does not fit the runtime can make a model slower (docs/results/decoders.md), so for a
target whose runtime is on this machine (ONNX Runtime's CPU provider: ``--target onnxruntime``, ``onnx``)
:func:`tune` decides each family (:mod:`opfuse.tune.families`) by timing it, after the rewrites
and before anything is written. The steps, each a function:

1. **What is timed** (:mod:`opfuse.tune.block`): the whole model when it is small; else the
   prefix through its first repeated block (a decoder's first layer with the embedding, mask and
   rotary tables before it), whose decision every copy of the block follows; a large model with no
   repeated block is not timed.
2. **Shapes** (:func:`tuning_feeds`): the sizes a deployment uses. ``--dim`` values where given;
   else, for a KV-cache decode step (:func:`opfuse.verify.inputs.past_cache`), a past of 256 and
   one new token; for any other graph, 128 for every free dimension but the batch, and batch 1.
   Where the input does not run there, those sizes are halved until it does, and the log says so.
3. **One interleaved run** (:mod:`opfuse.tune.timing`) at the runtime level the user targets,
   one intra-op thread unless asked otherwise, each session's fastest of :data:`REPEAT` runs per
   round, :data:`COPIES` sessions per variant (a round's time their mean): the input, its A/A
   control, the target's **policy** (:func:`opfuse.tune.families.policy_configuration`: what it
   writes untimed), the policy with each family it fuses off in turn, and each other form of
   attention. The number of rounds comes from the graph's work units
   (:func:`rounds_for`), not the clock. A variant whose rewrites raise, or that fails to run or
   computes something else, is dropped with its reason; the others go on. A variant that writes
   the same graph as the policy is not timed ("not in this graph"), nor one that the runtime, at the
   level timed, runs as the policy's kernels node for node (the same graph once it has optimised
   both: any ratio would be the noise; the policy stands); with nothing to time, nothing is.
4. **Decisions** (:func:`decide`). The noise (:func:`noise_of`) is the A/A's distance from 1, or
   the half-width of a 95% interval for its median where that is wider, plus a floor
   (:data:`NOISE_FLOOR`). A family the policy fuses is turned off only where the policy measured
   slower with it than without it beyond the noise; another form of attention replaces the
   policy's only where it measured faster beyond the noise. Where the clock cannot tell, the
   target's stated policy stands, and the reason says so (and where the runtime, at the level
   timed, makes the same kernels from the graph without the family).
5. **Never slower than the input** (:func:`fall_back`). The configuration chosen is timed against
   the input (in the same run when it was one of its variants, else in a second one with its own
   A/A). If it is slower beyond the noise, the folds alone (every family off: built and timed against
   the input only then) are written when they are not slower, else the input itself (``None``), and
   the log says which.

Decisions are data (:mod:`opfuse.tune.record`): a timed run's record is cached by the graph's signature
and the machine, and replayed (``--tuning FILE``, or the cache) without timing.

Nothing is timed with ``--no-tune`` (or ``OPFUSE_TUNE=off``), nor for a target whose runtime is not
here (qnn's HTP): the target's default policy applies and the report says so (:func:`untimed`).
"""

from __future__ import annotations

__all__ = ["tune", "decide", "fall_back", "judge", "noise_of", "median_uncertainty", "tuning_feeds", "untimed",
           "replayed", "rounds_for", "work_units", "Tuning", "FamilyResult", "Spread", "NOISE_FLOOR", "ROUND_BYTES",
           "tune_by_default"]

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
from opfuse.tune.budget import COPIES, REPEAT, ROUND_BYTES, rounds_for, work_units
from opfuse.tune.families import FAMILIES, OFF, ON, WRITTEN_OUT, Configuration, forms_for
from opfuse.tune.record import FORMAT
from opfuse.verify.inputs import describe_sizes, find_sizes, make_feeds, past_cache

NOISE_FLOOR = 0.02  # added to the A/A's distance from 1: what a family must beat
DECODE_PAST, PREFILL_SEQ = 256, 128  # the default shapes: a decode step's past, any other graph's free dims
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
    scope: str = ""  # what was timed: "the whole model", or the prefix through a block
    source: str = ""  # where the decision came from, when not timed here: "replayed from F", "cached in F"
    configuration: dict | None = None  # the configuration written ({family: option}; None: the input)
    signature: str = ""  # of the graph and the options that decide it (opfuse.tune.record.signature)
    machine: dict = dataclasses.field(default_factory=dict)
    target: str = ""
    in_file: dict = dataclasses.field(default_factory=dict)  # family -> {op: count} in the model written
    # each refused decision as (with it, without it, the reason): the pipeline turns the rewrites only the
    # first has into refusals, one per site (recorded: a replay explains them too, opfuse.tune.run)
    declined: list[tuple[Configuration, Configuration, str]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "declined"}
        out.update(families=[f.to_dict() for f in self.families],
                   aa=None if self.aa is None else dataclasses.asdict(self.aa),
                   final=None if self.final is None else dataclasses.asdict(self.final))
        out["record"] = self.record()
        return out

    def record(self) -> dict:
        """What ``--tuning FILE`` replays (:mod:`opfuse.tune.record`): the decision and what it rests on."""
        return {"format": FORMAT, "signature": self.signature, "machine": self.machine, "target": self.target,
                "level": self.level, "shapes": self.shapes, "scope": self.scope, "rounds": self.rounds,
                "aa": None if self.aa is None else dataclasses.asdict(self.aa), "noise": self.noise,
                "families": [f.to_dict() for f in self.families], "configuration": self.configuration,
                "chosen": self.chosen, "written": self.written,
                "final": None if self.final is None else dataclasses.asdict(self.final),
                "declined": [{"with": with_it.to_dict(), "without": without.to_dict(), "reason": reason}
                             for with_it, without, reason in self.declined]}

    def describe_written(self, model: ir.Model) -> None:
        """Count each family's ops in the model written (:attr:`in_file`): the log states the file."""
        counts = op_counts(model)
        by_op: dict[str, int] = {}
        for key, n in counts.items():
            op = key.split(".")[-1]
            by_op[op] = by_op.get(op, 0) + n
        self.in_file = {f.name: {op: by_op[op] for op in f.ops if by_op.get(op)} for f in FAMILIES if f.ops}

    def lines(self) -> list[str]:
        """The human log: one line for the run, one per family (what was decided, and what of it
        the file written has), one for what was written."""
        if self.source:
            out = [f"{self.source}; not timed in this run (--retune times again)"]
        elif not self.timed:
            return [self.reason, *self._file_lines()]
        else:
            aa = f"A/A {self.aa}" if self.aa else "no A/A"
            out = [f"timed {self.scope} at ORT {self.level}, {self.threads} thread(s), {self.shapes}: {self.rounds} "
                   f"rounds in {self.seconds:.1f} s; {aa}, noise {self.noise:.2f}"]
        titles = {f.name: f.title for f in FAMILIES}
        grouped: dict[str, list[FamilyResult]] = {}
        for result in self.families:
            grouped.setdefault(result.family, []).append(result)
        for family, results in grouped.items():
            reasons = list(dict.fromkeys(r.reason for r in results))
            absent = all(r.decision == "not in this graph" for r in results) and not self.in_file.get(family)
            out.append(f"{titles.get(family, family)}: {'; '.join(reasons)}{'' if absent else self._in_file(family)}")
        final = f" ({self.final} of the input's time)" if self.final else ""
        out.append(f"written: {self.written}{final}")
        return out

    def _in_file(self, family: str) -> str:
        if family not in self.in_file:
            return ""
        found = self.in_file[family]
        return f"; in the file: {', '.join(f'{op} {n}' for op, n in found.items())}" if found else "; in the file: none"

    def _file_lines(self) -> list[str]:
        titles = {f.name: f.title for f in FAMILIES}
        return [f"{titles[f]}: in the file: {', '.join(f'{op} {n}' for op, n in found.items())}"
                for f, found in self.in_file.items() if found]


def untimed(target_name: str, why: str, *, measured_policy: bool) -> Tuning:
    """The record of a run that timed nothing: the target's default policy applies."""
    which = ", which benchmarks/decoders.py measured" if measured_policy else ""
    return Tuning(False, f"not timed ({why}): followed the {target_name} target's default policy{which}")


def replayed(record: dict, source: str) -> tuple[Configuration | None, Tuning]:
    """The configuration a record (:mod:`opfuse.tune.record`) says to write, and its :class:`Tuning`
    (not timed here; its measurements carried over for the log). A record whose configuration this
    version cannot read raises ValueError."""
    configuration = record.get("configuration")
    config = None if configuration is None else Configuration.from_dict(configuration)
    families = [FamilyResult(f["family"], f["candidate"], f["decision"], f["reason"],
                             Spread(**f["ratio"]) if f.get("ratio") else None) for f in record.get("families", [])]
    tuning = Tuning(False, shapes=record.get("shapes", ""), level=record.get("level", "all"),
                    threads=record.get("machine", {}).get("threads", 1), rounds=record.get("rounds", 0),
                    aa=Spread(**record["aa"]) if record.get("aa") else None, noise=record.get("noise", 0.0),
                    families=families, chosen=record.get("chosen", ""),
                    final=Spread(**record["final"]) if record.get("final") else None,
                    written=record.get("written", ""), scope=record.get("scope", ""), source=source,
                    configuration=configuration, signature=record.get("signature", ""),
                    machine=record.get("machine", {}), target=record.get("target", ""),
                    declined=[(Configuration.from_dict(d["with"]), Configuration.from_dict(d["without"]), d["reason"])
                              for d in record.get("declined", [])])
    return config, tuning


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
    """Feeds at the deployment's sizes (module docstring, step 2) and their description;
    raises :class:`opfuse.errors.BadInputError` when the model runs at none."""
    free = free_dims(model)
    given = dict(dims or {})
    past = past_cache(model)
    past_key = None
    if past is not None and past.shape is not None:
        axis = len(past.shape) - 2
        past_key = next((k for k, d in free.items() if (past.name, axis) in d.places), None)
    def defaults_at(halved: int) -> dict[str, int]:
        """The default sizes, the past and the free sequences halved ``halved`` times; a decode step's
        mask dimension of its own name (a TorchScript export's total length) covers the past and the
        new token."""
        out = {}
        for key, dim in free.items():
            if dim.derived is not None or key in given:
                continue
            if dim.batch:
                out[key] = 1
            elif past is not None and key == past_key:
                out[key] = DECODE_PAST >> halved
            elif past is not None:
                masked = any("mask" in (name or "").lower() for name, _ in dim.places)
                out[key] = (DECODE_PAST >> halved) + 1 if masked and past_key is not None else 1
            else:
                out[key] = PREFILL_SEQ >> halved
        return out

    halved = 0
    defaults = defaults_at(halved)
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
            if max(defaults.values(), default=0) <= 16:
                feeds, sizes, _ = find_sizes(model, lambda f: session.run(None, f), fixed=given, seed=seed,
                                             purpose="cannot time")
                notes.append(f"the defaults did not run ({first_line(e, limit=100)}): the smallest sizes that do")
                break
            notes.append(f"{describe_sizes(free, sizes)} did not run ({first_line(e, limit=100)})")
            halved += 1
            defaults = defaults_at(halved)
    from opfuse.core.dims import derive_sizes  # (the sizes shown with the derived ones)

    shown = describe_sizes(free, derive_sizes(free, sizes)) or "the declared shape"
    source = "--dim" if given else "defaults"
    text = f"{_graph_kind(model)} at {shown} ({source})" + (f"; {'; '.join(notes)}" if notes else "")
    return feeds, text


def tune(original: ir.Model, build: Callable[[Configuration], ir.Model], *, target: str,
         policy: Configuration, dims: Mapping[str, int] | None = None, bound: Mapping[str, np.ndarray] | None = None,
         level: str = "all", threads: int = 1, rounds: int | None = None, seed: int = 0, exact: bool = True,
         measure: Callable[..., timing.Measurement] | None = None, feeds: tuple[dict, str] | None = None,
         possible: Callable[[tuple[str, ...], tuple[str, ...]], bool] | None = None,
         scope: str = "the whole model") -> tuple[Configuration | None, Tuning]:
    """Time the families of ``build``'s configurations against ``policy`` (module docstring) and
    return the configuration to write (None: the input unchanged) with the record of what was measured.

    ``build(config)`` returns the optimised model for a configuration (the pipeline caches
    them); a configuration whose build raises is dropped with its reason. ``measure`` is
    :func:`opfuse.tune.timing.measure` (None: looked up when called, so a test may stand a
    deterministic clock in for it); ``feeds`` (feeds, description) skips the search for sizes;
    ``rounds`` None: from the graph's work units (:func:`rounds_for`). ``possible(patterns,
    passes)`` says whether one of a family's passes runs or one of its patterns could match the
    graph at all (:func:`opfuse.passes.pattern_gate.patterns_that_could_match`): a family for which
    it says no is "not in this graph" without a build. ``scope`` says what ``original`` is (the whole
    model, or the prefix through its first block: :mod:`opfuse.tune.block`).
    """
    measure = measure or timing.measure
    start = time.perf_counter()
    fed, shapes = feeds if feeds is not None else tuning_feeds(original, dims, level=level, seed=seed, bound=bound)
    record = Tuning(True, shapes=shapes, level=level, threads=threads, scope=scope)
    candidates, folds = _candidates(policy, target)
    results: dict[Configuration, FamilyResult] = {}
    absent = "not in this graph: no rule of its patterns finds all its ops here"
    for config, (family, candidate) in candidates.items():
        if possible is not None and not _could_be_here(family, possible):
            own = next(f for f in FAMILIES if f.name == family)  # (a family of passes alone: what they need)
            why = absent if own.patterns else f"not in this graph: {', '.join(own.passes)} does not run at this target or finds none of the ops it needs here"
            results[config] = FamilyResult(family, candidate, "not in this graph", why)
    models: dict[Configuration, ir.Model] = {}
    try:
        models[policy] = build(policy)
    except Exception as e:  # noqa: BLE001 - whatever a rewrite raised: the policy is no reference
        record.written = f"the input unchanged: the target's policy could not be built ({first_line(e, limit=160)})"
        record.seconds = time.perf_counter() - start
        return None, record
    for config in [c for c in candidates if c not in results]:
        try:
            models[config] = build(config)
        except Exception as e:  # noqa: BLE001 - one variant's failure drops it, the others go on
            family, candidate = candidates[config]
            results[config] = FamilyResult(family, candidate, "not timed", f"could not be built: {first_line(e, limit=160)}")
    same = "not in this graph: it writes the same graph as the target's policy (nothing it changes here)"
    for config in [c for c in candidates if c not in results]:
        if _signature(models[config], candidates[config][0]) == _signature(models[policy], candidates[config][0]):
            results[config] = FamilyResult(*candidates[config], "not in this graph", same)
    timed = [c for c in candidates if c not in results]
    if not timed:  # nothing to decide: the policy is written, untimed
        record.timed = False
        record.reason = "nothing to time: no family's rewrites change this graph; the target's policy applies"
        record.families = [results[c] for c in candidates]
        record.chosen = _describe(policy, policy)
        record.written = "the target's policy"
        record.seconds = time.perf_counter() - start
        return policy, record
    names = {policy: "policy", folds: "folds alone", **{c: c.label(policy) for c in candidates}}
    rounds = rounds if rounds is not None else rounds_for(original, fed, 3 + len(timed))

    def timed_run(configs: list[Configuration]) -> timing.Measurement:
        variants = [timing.Variant("original", "the input", original, level=level, kind="reference"),
                    timing.Variant("original (A/A)", "the input (A/A)", original, level=level, kind="control")]
        variants += [timing.Variant(names.get(c, "chosen"), names.get(c, "chosen"), models[c], level=level,
                                    exact=exact) for c in configs if c in models]
        found = measure(variants, fed, threads=threads, rounds=rounds, baseline="original",
                        repeat=REPEAT, copies=COPIES, same_as=names[policy])
        record.rounds += found.rounds
        return found

    run = timed_run([policy, *timed])  # (the folds alone only if the fall-back needs them: fall_back)
    record.aa = Spread.of(run.paired("original (A/A)", "original"))
    record.noise = noise_of(run.paired("original (A/A)", "original"))
    final = decide(run, record, policy, candidates, timed, names, results)
    record.families = [results[c] for c in candidates]
    record.chosen = _describe(final, policy)
    written = fall_back(run, record, final, policy, folds, names, models, build, timed_run)
    record.seconds = time.perf_counter() - start
    return written, record


def decide(run: timing.Measurement, record: Tuning, policy: Configuration, candidates: dict,
           timed: list[Configuration], names: dict, results: dict) -> Configuration:
    """Each timed family judged against the target's policy, into ``results``; the configuration
    they make. A family the policy fuses is turned off only where it measured slower beyond the noise;
    another form of attention replaces the policy's only where it measured faster beyond the noise;
    where the clock cannot tell, the policy stands, and the reason says so."""
    broken = {**{k: f"did not run: {v}" for k, v in run.errors.items()},
              **{k: f"computes something else: {v}" for k, v in run.mismatches.items()}}
    changes: dict[str, str] = {}
    best: tuple[float, str] | None = None
    aa = record.aa.median if record.aa else None
    own_form = policy.get("attention")
    same_kernels = _same_runtime_graphs(run, names[policy])
    same = getattr(run, "same", set())
    for config in timed:
        family, candidate = candidates[config]
        problem = broken.get(names[config])
        if names[config] in same:  # the runtime runs it as the policy's kernels: no ratio but the noise
            itself = f"ONNX Runtime at level {record.level} runs the same kernels"
            if family == "attention":
                results[config] = FamilyResult(family, candidate, "refused", (
                    f"{own_form} kept (the target's policy): {candidate} against {own_form}: {itself} (not timed)"))
            else:
                results[config] = FamilyResult(family, candidate, "kept", (
                    f"kept (the target's policy): {itself} from the graph without it (not timed)"))
            continue
        if family == "attention":  # another form over the policy's
            ratios = run.paired(names[config], names[policy])
            kept, why = (False, problem) if problem else judge(ratios, record.noise, aa)
            what = f"{candidate} against {own_form}"
            if kept:
                text = f"{candidate} written: {why}"
                if best is None or Spread.of(ratios).median < best[0]:
                    best = (Spread.of(ratios).median, candidate)
            else:
                text = f"{own_form} kept (the target's policy): {what} {why}"
            results[config] = FamilyResult(family, candidate, "kept" if kept else "refused", text, Spread.of(ratios))
            continue
        ratios = run.paired(names[policy], names[config])  # with it / without it
        if problem:
            results[config] = FamilyResult(family, candidate, "kept", f"kept (the target's policy): without it {problem}")
            continue
        faster, why = judge(ratios, record.noise, aa)
        spread = Spread.of(ratios)
        slower = spread is not None and spread.median > 1 + max(record.noise, median_uncertainty(ratios) + NOISE_FLOOR)
        itself = (f"; ONNX Runtime at level {record.level} makes the same kernels from the graph without it"
                  if names[config] in same_kernels else "")
        if slower:
            changes[family] = OFF
            text = f"turned off: {why}"
            record.declined.append((policy, config, f"measured choice: {text}"))
            decision = "refused"
        else:
            text = f"kept: {why}" if faster else f"kept (the target's policy): {why}"
            decision = "kept"
        results[config] = FamilyResult(family, candidate, decision, text + itself, spread)
    if best is not None:
        changes["attention"] = best[1]
        if best[1] == WRITTEN_OUT:  # the policy's form declined at every site
            chosen = policy.replaced({"attention": WRITTEN_OUT})
            record.declined.append((policy, chosen, f"measured choice: {WRITTEN_OUT} was faster than {own_form}"))
        for result in results.values():
            if result.family == "attention" and result.decision == "kept" and result.candidate != best[1]:
                result.decision = "refused"
                result.reason = f"not written: {best[1]} was faster; {result.reason}"
        if best[1].startswith("Attention-") and policy.get("opset") == OFF:
            changes.pop("opset", None)
    return policy.replaced(changes)


def fall_back(run: timing.Measurement, record: Tuning, final: Configuration, policy: Configuration,
              folds: Configuration, names: dict, models: dict, build: Callable, timed_run: Callable) -> Configuration | None:
    """Never slower than the input: ``final`` timed against it (in ``run`` when it was one of its
    variants, else in a second run with its own A/A); slower beyond the noise, the folds alone (built and
    timed, with their own A/A, only then) are written when they are not, else the input itself (None). Sets the record's ``final`` and ``written``."""
    noise = record.noise
    if names.get(final) in run.timings:
        source, name = run, names[final]
    else:  # a configuration no variant was: timed against the input on its own
        try:
            models[final] = build(final)
        except Exception as e:  # noqa: BLE001 - the combination failed: the policy instead
            record.written = f"the target's policy: the configuration chosen could not be built ({first_line(e)})"
            record.chosen = _describe(policy, policy)
            final = policy
            source, name = run, names[policy]
        else:
            source, name = timed_run([final]), "chosen"
            noise = max(noise, noise_of(source.paired("original (A/A)", "original")))
    ratios = source.paired(name, "original")
    record.final = Spread.of(ratios)
    if name in source.errors or not ratios:  # (a mismatch at the timing's fixed tolerance is no verdict:
        # verification, with the tolerance that scales with the model, checks what is written)
        problem = f"did not run: {source.errors[name]}" if name in source.errors else "was not measured"
        record.written = f"the input unchanged: the configuration chosen {problem}"
        return None
    record.written = record.written or f"the configuration chosen ({record.chosen})"
    if record.final.median <= 1 + noise:
        return final
    folded, folds_noise = None, record.noise
    if final != folds:  # the folds alone, timed against the input (in ``run`` when a variant was them)
        if names[folds] not in run.timings and folds not in models:
            try:
                models[folds] = build(folds)
            except Exception:  # noqa: BLE001 - the folds alone are only the fall-back
                pass
        if names[folds] in run.timings:
            folded = Spread.of(run.paired(names[folds], "original"))
        elif folds in models:
            second = timed_run([folds])
            folded = Spread.of(second.paired(names[folds], "original"))
            folds_noise = max(folds_noise, noise_of(second.paired("original (A/A)", "original")))
    if folded is not None and folded.median <= 1 + folds_noise:
        record.written = (f"the folds alone: the configuration chosen measured {record.final} of the "
                          "input's time, slower beyond the noise")
        record.final = folded
        return folds
    record.written = (f"the input unchanged: the configuration chosen measured {record.final} of its time, "
                      "slower beyond the noise")
    return None


def _describe(config: Configuration, policy: Configuration) -> str:
    """``config`` as the log names it: the target's policy, or what sets it apart from it."""
    return "the target's policy" if config == policy else f"the target's policy with {config.label(policy)}"


def _same_runtime_graphs(run: timing.Measurement, reference: str) -> set[str]:
    """The variants whose graph, as the runtime optimised it at the timed level, has the same op
    counts as ``reference``'s: the runtime makes those fusions itself."""
    ref = run.op_counts.get(reference)
    return {name for name, counts in run.op_counts.items() if ref is not None and name != reference
            and counts == ref}


def _candidates(policy: Configuration, target: str) -> tuple[dict[Configuration, tuple[str, str]], Configuration]:
    """Each configuration timed against ``policy`` -> (family, candidate): every family it fuses off
    in turn, every other form of attention; and the folds alone (every family off)."""
    candidates: dict[Configuration, tuple[str, str]] = {}
    for family, option in policy:
        if family == "attention":
            candidates.update({policy.replaced({"attention": form.name}): ("attention", form.name)
                               for form in forms_for(target) if form.name != option})
        elif option == ON:
            candidates[policy.replaced({family: OFF})] = (family, option)
    folds = policy.replaced({f: OFF for f, _ in policy if f not in ("attention", "opset")})
    return candidates, folds.replaced({"attention": WRITTEN_OUT})


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
