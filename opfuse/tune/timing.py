"""Measured latency on ONNX Runtime's CPU provider, done so that small differences show.

The timing core both the optimiser's measured fusion choice (:mod:`opfuse.tune`) and the
benchmarks (:mod:`opfuse.bench.measure`, which re-exports it) run:

- Every variant gets its own session, at its own runtime level; an **A/A control** is a
  second, separate session of the same model, whose ratio to the first is the noise floor.
  ``copies`` gives each variant several sessions, its round time their mean: two sessions of one
  model can differ for as long as they live (by how much: docs/results/measurements.md), which
  one session per variant reads as the variants'.
- ``intra_op_num_threads`` is configurable, one inter-op thread, sequential execution, and
  thread spinning off (``session.intra_op.allow_spinning = 0``) so idle sessions do not
  steal the cores the measured one needs.
- Warm-up runs first; then rounds: each round runs every session once, in an order that
  rotates from round to round, so slow drifts of a shared machine hit every variant alike;
  within a round a session may run ``repeat`` times, its fastest run taken. ``rounds`` may
  be left to a time budget: as many rounds as the last warm-up pass says fit in
  ``budget_s``, between ``min_rounds`` and ``max_rounds``.
- Statistics per variant: median, min and max in ms, and the **paired ratio**: the median
  over rounds of (this variant / the baseline in the same round), which cancels what the
  machine was doing during that round (:meth:`Measurement.paired` pairs any two).
- The warm-up outputs are compared with the baseline's (``opfuse.verify`` tolerances, and the
  baseline's own float32 variation where the caller measured it), so a row that computes something
  else is flagged rather than celebrated; an int8 variant (``exact=False``) computes something else
  by design.
- A variant may bring its own inputs (``Variant.feeds``: a graph with other input names, such as a
  model builder's); the others run on the shared ``feeds``.
- Each session is fed the feeds its model takes (a model whose inputs were bound to
  constants takes fewer).
- Node counts: the graph's own for disabled optimisations; for the runtime's levels, the
  nodes left after its optimiser (``optimized_model_filepath``), by ``domain.op_type``.
- ``same_as``: a variant whose graph, as the runtime runs it, is node for node the named variant's
  (the same ops, each fed by the same ops) runs the same kernels; it is not timed (any ratio of the two
  would be the noise), and :attr:`Measurement.same` names it.
"""

from __future__ import annotations

__all__ = ["Variant", "Timing", "Measurement", "measure", "rounds_for_budget"]

import dataclasses
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from opfuse.core.ops import count_ops, first_line, is_op
from opfuse.runtime import model_source as serialize
from opfuse.runtime import session_options
from opfuse.verify import compare_outputs
from opfuse.verify.random_ops import drop_given_seeds, seed_random_nodes


@dataclasses.dataclass
class Variant:
    """One session to measure: a model and the runtime level it runs at."""

    name: str  # row key: "none", "conv-bn", "ort-all", "none (A/A)"...
    label: str  # what the table shows
    model: ir.Model | bytes | str  # an onnx-ir model, serialized bytes, or a path
    level: str = "disabled"
    kind: str = "config"  # "config" | "control" | "runtime" | "reference" | "int8" | "peer"
    note: str = ""
    exact: bool = True  # False: outputs are not compared with the baseline's (an int8 model)
    feeds: Mapping[str, np.ndarray] | None = None  # its own inputs (other names); None: measure()'s feeds


@dataclasses.dataclass
class Timing:
    """Latency samples of one variant, in milliseconds, and its paired ratio to the baseline."""

    samples_ms: list[float]
    ratios: list[float] = dataclasses.field(default_factory=list)  # per round, / baseline

    @property
    def median(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min(self) -> float:
        return min(self.samples_ms)

    @property
    def max(self) -> float:
        return max(self.samples_ms)

    @property
    def ratio(self) -> float:
        """Median over rounds of this variant's time / the baseline's in the same round."""
        return statistics.median(self.ratios) if self.ratios else float("nan")

    @property
    def ratio_spread(self) -> tuple[float, float]:
        """The 25th and 75th percentiles of the per-round ratios."""
        if len(self.ratios) < 2:
            return (self.ratio, self.ratio)
        q = np.percentile(self.ratios, [25, 75])
        return float(q[0]), float(q[1])

    def to_dict(self) -> dict[str, Any]:
        lo, hi = self.ratio_spread
        return {
            "median_ms": self.median,
            "min_ms": self.min,
            "max_ms": self.max,
            "ratio_to_baseline": self.ratio,
            "ratio_iqr": [lo, hi],
            "samples_ms": list(self.samples_ms),
        }


@dataclasses.dataclass
class Measurement:
    """Everything :func:`measure` found."""

    timings: dict[str, Timing]
    baseline: str
    threads: int
    warmup: int
    rounds: int
    op_counts: dict[str, Counter]  # variant -> node counts by domain.op_type as the runtime runs it
    mismatches: dict[str, str]  # variant -> why its outputs differ from the baseline's
    errors: dict[str, str]  # variant -> why it could not run
    same: set[str] = dataclasses.field(default_factory=set)  # not timed: the same runtime graph as ``same_as``

    def nodes(self, name: str) -> int | None:
        counts = self.op_counts.get(name)
        return None if counts is None else sum(counts.values())

    def paired(self, name: str, reference: str) -> list[float]:
        """Per-round ratios of ``name``'s time to ``reference``'s (every round runs both)."""
        a, b = self.timings.get(name), self.timings.get(reference)
        if a is None or b is None or len(a.samples_ms) != len(b.samples_ms):
            return []
        return [x / y for x, y in zip(a.samples_ms, b.samples_ms) if y > 0]

    def ratio(self, name: str, reference: str) -> float:
        """Median over rounds of ``name``'s time / ``reference``'s in the same round."""
        ratios = self.paired(name, reference)
        return statistics.median(ratios) if ratios else float("nan")


def _graph_op_counts(proto: onnx.ModelProto) -> Counter:
    return count_ops(proto.graph.node)


def _runtime_graph(proto: onnx.ModelProto) -> tuple:
    """The graph as the runtime runs it, node by node, in any order: each node's (domain, op, the
    (domain, op) making each of its inputs, or "" for an input or a weight). Attributes are left out:
    two rewrites of one graph may write an attribute at its default or leave it out."""
    made = {out: f"{n.domain}.{n.op_type}" for n in proto.graph.node for out in n.output}
    return tuple(sorted(repr((n.domain, n.op_type, [made.get(i, "") for i in n.input], len(n.output)))
                        for n in proto.graph.node))


def _model_op_counts(model) -> Counter:
    if isinstance(model, ir.Model):
        return count_ops(n for n in model.graph if not is_op(n, "Constant"))
    if isinstance(model, bytes):
        proto = onnx.ModelProto()
        proto.ParseFromString(model)
    elif isinstance(model, onnx.ModelProto):
        proto = model
    else:
        proto = onnx.load(model, load_external_data=False)
    return count_ops(n for n in proto.graph.node if not is_op(n, "Constant"))


def measure(
    variants: Sequence[Variant],
    feeds: Mapping[str, np.ndarray],
    *,
    threads: int = 2,
    warmup: int = 3,
    rounds: int | None = 20,
    baseline: str | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    budget_s: float = 5.0,
    min_rounds: int = 7,
    max_rounds: int = 41,
    repeat: int = 1,
    copies: int = 1,
    same_as: str | None = None,
    variation: Mapping[str, float] | None = None,
) -> Measurement:
    """Interleaved latency measurement of ``variants`` on the same ``feeds``.

    ``progress(stage, done, total)`` is called as sessions are created and rounds complete.
    ``baseline`` (default: the first variant) is what paired ratios and output checks use.
    ``rounds`` None: as many as fit in ``budget_s`` (:func:`rounds_for_budget`). ``repeat``:
    runs per session per round, the fastest taken (a burst of another process's work on a
    shared machine lengthens one run, rarely all of them). ``copies``: sessions per variant,
    created in turn with the other variants' (copy 0 of each, then copy 1...); a round's time of
    a variant is the mean of its copies' (two sessions of one model can differ by several percent
    for as long as they live: where each got its memory, not what it computes). ``same_as``: a variant
    of kind "config" whose runtime graph is that variant's is not timed (module docstring).
    ``variation``: the baseline's own float32 variation d0 per output on ``feeds``
    (:func:`opfuse.verify.runtime_variation`), which the output check admits
    :data:`opfuse.verify.VARIATION_FACTOR` times (``compare_outputs(..., variation=)``).
    """
    baseline = baseline or variants[0].name
    op_counts: dict[str, Counter] = {}
    errors: dict[str, str] = {}
    total_steps = len(variants) + warmup + (rounds or min_rounds)
    step = 0

    def tick(stage: str) -> None:
        nonlocal step
        step += 1
        if progress is not None:
            progress(stage, step, total_steps)

    copies_of: dict[str, list[Any]] = {}
    sources: dict[str, bytes | str] = {}  # (serialised once, whatever the copies)
    graphs: dict[str, tuple] = {}  # variant -> its runtime graph (at a runtime level)
    same: set[str] = set()

    def drop_same() -> None:
        if same_as in graphs:
            same.update(v.name for v in variants if v.kind == "config" and v.name != same_as
                        and graphs.get(v.name) == graphs[same_as])
        for name in same:
            copies_of.pop(name, None)

    with tempfile.TemporaryDirectory(prefix="opfuse-bench-") as tmp:
        for copy in range(max(1, copies)):
            if copy == 1:
                drop_same()  # (before their second sessions)
            for i, v in enumerate(variants):
                if v.name in errors or v.name in same:
                    continue
                optimized = os.path.join(tmp, f"opt{i}.onnx") if v.level != "disabled" and copy == 0 else None
                try:
                    if v.name not in sources:
                        sources[v.name] = _seeded_source(v.model, tmp)
                    copies_of.setdefault(v.name, []).append(ort.InferenceSession(
                        sources[v.name], session_options(v.level, threads, optimized_path=optimized),
                        providers=["CPUExecutionProvider"],
                    ))
                    if copy == 0 and optimized is not None:
                        proto = onnx.load(optimized, load_external_data=False)
                        op_counts[v.name] = _graph_op_counts(proto)
                        graphs[v.name] = _runtime_graph(proto)
                        del proto
                    elif copy == 0:
                        op_counts[v.name] = _model_op_counts(v.model)
                except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types
                    errors[v.name] = first_line(e)
                    copies_of.pop(v.name, None)
                if copy == 0:
                    tick(f"session {v.label}")
        drop_same()
    sessions = {name: found[0] for name, found in copies_of.items()}

    names = [v.name for v in variants if v.name in sessions]
    taken = {name: {i.name for i in sessions[name].get_inputs()} for name in names}
    own = {v.name: v.feeds for v in variants}
    fed = {name: {k: v for k, v in (feeds if own[name] is None else own[name]).items() if k in taken[name]}
           for name in names}
    outputs: dict[str, dict[str, np.ndarray]] = {}
    pass_s = 0.0
    for w in range(warmup):
        start_pass = time.perf_counter()
        for name in names:
            try:
                result = sessions[name].run(None, fed[name])
                for other in copies_of[name][1:]:
                    other.run(None, fed[name])
            except Exception as e:  # noqa: BLE001
                errors[name] = first_line(e)
                continue
            if w == 0:
                out_names = [o.name for o in sessions[name].get_outputs()]
                outputs[name] = dict(zip(out_names, result))
        names = [n for n in names if n not in errors]
        pass_s = time.perf_counter() - start_pass
        tick("warm-up")
    if rounds is None:
        rounds = rounds_for_budget(pass_s * repeat, budget_s, min_rounds, max_rounds)  # (a pass runs every copy)

    mismatches: dict[str, str] = {}
    inexact = {v.name for v in variants if not v.exact}
    if baseline in outputs:
        for name in names:
            if name == baseline or name not in outputs or name in inexact:
                continue
            bad = [c for c in compare_outputs(outputs[baseline], outputs[name], variation=variation) if not c.ok]
            if bad:
                mismatches[name] = f"output '{bad[0].name}': {bad[0].problem}"

    samples: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names) if names else 0
        order = names[shift:] + names[:shift]
        this_round: dict[str, float] = {}
        for name in order:
            own_copies = copies_of[name]
            turn = r % len(own_copies)
            times = []
            for session in own_copies[turn:] + own_copies[:turn]:
                best = float("inf")
                for _ in range(repeat):
                    start = time.perf_counter()
                    session.run(None, fed[name])
                    best = min(best, time.perf_counter() - start)
                times.append(best)
            this_round[name] = sum(times) / len(times) * 1e3
        for name, ms in this_round.items():
            samples[name].append(ms)
            if baseline in this_round:
                ratios[name].append(ms / this_round[baseline])
        tick("measuring")

    return Measurement(
        timings={n: Timing(samples[n], ratios[n]) for n in names if samples[n]},
        baseline=baseline,
        threads=threads,
        warmup=warmup,
        rounds=rounds,
        op_counts=op_counts,
        mismatches=mismatches,
        errors=errors,
        same=same,
    )




def _seeded_source(model: ir.Model | bytes | str, tmp: str) -> bytes | str:
    """What a session loads for ``model``: an onnx-ir model's random nodes draw from seeds of their
    names (:mod:`opfuse.verify.random_ops`, as verification does), so that each variant's first run
    draws the same numbers and their outputs compare (a VITS voice adds noise from RandomNormalLike);
    the model itself keeps its attributes."""
    if not isinstance(model, ir.Model):
        return serialize(model, tmp)

    given = seed_random_nodes(model)
    try:
        return serialize(model, tmp)
    finally:
        drop_given_seeds(model, given)


def rounds_for_budget(pass_s: float, budget_s: float, least: int, most: int) -> int:
    """How many rounds of ``pass_s`` seconds each fit in ``budget_s``, between ``least`` and ``most``."""
    if pass_s <= 0:
        return most
    return max(least, min(most, int(budget_s / pass_s)))
