"""The fusion log: what was rewritten, what was refused and why, and what it all proved.

A :class:`FusionReport` is plain data. Passes append a :class:`FusionRecord` for every
rewrite they apply and a :class:`Refusal` for every candidate they decline, always with a
one-sentence reason. A question that has an answer or a reason why not (is this value a
constant? where do the channels land?) returns ``Value | Reason``: the :class:`Reason` is
that sentence, as a type of its own. The report renders as JSON (``to_json``) and as rich tables
(``print_report``); the ONNX and PyTorch front ends share this vocabulary.
"""

from __future__ import annotations

__all__ = [
    "FusionRecord",
    "Refusal",
    "Reason",
    "OutputCheck",
    "Verification",
    "FusionReport",
    "print_report",
]

import dataclasses
import json
import math
import re
from collections import Counter
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclasses.dataclass(frozen=True)
class FusionRecord:
    """One applied rewrite."""

    pattern: str  # e.g. "Conv+BatchNormalization"
    node: str  # the node that absorbed the others (it keeps its place in the graph)
    removed: tuple[str, ...]  # names of the nodes that are gone
    produced: str  # the node that now computes the result ("" when none is emitted)
    graph: str = "main"  # "main", a subgraph path such as "If_0/then_branch", or "function:f"
    weight_bytes: int = 0  # bytes of weights and biases rewritten
    extra_bytes: int = 0  # bytes of private copies kept because the originals are shared
    detail: str = ""
    # the tensor the rewritten node now computes; a rewrite's output keeps the name of the
    # tensor it replaces, so the name means the same values in the original model
    output: str = ""


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why a question about the graph has no answer: one sentence a :class:`Refusal` can carry.

    A function that answers with a value, or says why it cannot, returns ``Value | Reason``
    (onnxscript's ``MatchResult`` plays this part in its rewriter), so a failure is never
    mistaken for a value that happens to be text: the caller asks ``isinstance(x, Reason)``
    and passes ``x.sentence`` on, or builds a longer sentence around it."""

    sentence: str

    def __str__(self) -> str:
        return self.sentence


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A candidate that was not rewritten, and why."""

    pattern: str
    node: str  # the node that would have been absorbed (a BatchNormalization, an Add...)
    reason: str  # one sentence a user can act on
    anchor: str = ""  # the producer it would have been folded into, when there is one
    graph: str = "main"
    also: tuple[str, ...] = ()  # the other nodes of the same declined fusion (one decision, one entry)


@dataclasses.dataclass(frozen=True)
class OutputCheck:
    """Comparison of one tensor between the original and the optimised model: a graph
    output, or (``rewrite`` set) the tensor one rewrite computes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    max_abs_error: float
    max_scaled_error: float  # max |a - b| / max(atol * scale + rtol * |a|, floor); <= 1 passes
    scale: float  # max |reference|, the tensor's scale
    ok: bool
    problem: str = ""
    rewrite: str = ""  # "Conv+BatchNormalization at 'conv1'" for a rewrite's own check
    floor: float = 0.0  # the absolute floor applied (graph outputs; see opfuse.verify)
    inputs: str = ""  # the input set it was checked on, when there are several
    variation: float | None = None  # d0: max |original - original at variation_level| here (measured when needed)
    positions: str = ""  # which elements were compared, when not all (a padded batch's defined positions)

    @property
    def label(self) -> str:
        what = f"rewrite {self.rewrite} (tensor '{self.name}')" if self.rewrite else f"output '{self.name}'"
        what = "the optimised model" if self.name == "<model>" else what  # it does not load or run at all
        return f"{what} [{self.inputs}]" if self.inputs else what


@dataclasses.dataclass
class Verification:
    """The result of running both models on the same inputs."""

    runtime: str
    inputs: str  # "random (seed 0)" or the path of the user's inputs
    outputs: list[OutputCheck] = dataclasses.field(default_factory=list)
    skipped: str = ""  # why verification did not run, when it did not
    unverified: str = ""  # why the comparison cannot conclude (the original is no reference), when so
    notes: list[str] = dataclasses.field(default_factory=list)  # how inputs and random ops were handled
    rewrites: list[OutputCheck] = dataclasses.field(default_factory=list)  # one per rewrite and input set
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # free dimension -> size used
    input_sets: list[str] = dataclasses.field(default_factory=list)  # e.g. "sr=16000"
    exercised: int = 0  # rewrites the inputs executed
    not_exercised: list[str] = dataclasses.field(default_factory=list)  # rewrites they did not reach
    approximation_sqnr_db: float | None = None  # an inexact step's reference against the input model (opfuse.verify)
    padded: str = ""  # the padded batch verified: its mask input, rows and position ids (opfuse.verify.inputs.Padding)
    padded_input: str = ""  # the attention-mask input whose zeros mark the undefined positions
    padded_skipped: str = ""  # why a model with an attention mask had no padded batch verified
    variation_level: str = ""  # the ONNX Runtime level the original ran at for its own float variation (d0)
    variation_factor: float = 0.0  # k: a check may differ by k * d0 (opfuse.verify, "The original's own variation")

    @property
    def ok(self) -> bool:
        return not self.skipped and not self.unverified and all(o.ok for o in (*self.rewrites, *self.outputs))

    def first_failure(self) -> OutputCheck | None:
        """The failing rewrite that comes first in the graph, else the first failing output."""
        return next((o for o in (*self.rewrites, *self.outputs) if not o.ok), None)


@dataclasses.dataclass
class FusionReport:
    """Everything opfuse did to one model."""

    model: str = ""
    target: str = "onnx"
    passes: list[str] = dataclasses.field(default_factory=list)
    records: list[FusionRecord] = dataclasses.field(default_factory=list)
    refusals: list[Refusal] = dataclasses.field(default_factory=list)
    ops_before: Counter = dataclasses.field(default_factory=Counter)
    ops_after: Counter = dataclasses.field(default_factory=Counter)
    notes: list[str] = dataclasses.field(default_factory=list)
    verification: Verification | None = None
    # a device compiler's own log of the result (opfuse.targets.qnn.compile.HtpCompileLog: to_dict, render)
    device: Any = None
    # the measured fusion choice (opfuse.tune.Tuning: to_dict, lines): what was timed and decided
    tuning: Any = None

    # -- queries ---------------------------------------------------------------------
    def applied(self, pattern: str | None = None) -> list[FusionRecord]:
        return [r for r in self.records if pattern is None or r.pattern == pattern]

    def refused(self, node: str | None = None) -> list[Refusal]:
        return [r for r in self.refusals if node is None or r.node == node or node in r.also]

    def reason_for(self, node: str) -> str | None:
        """Why the candidate ``node`` was refused (every pass's reason), or None if it was not."""
        found = self.refused(node)
        return "; ".join(dict.fromkeys(r.reason for r in found)) if found else None

    @property
    def extra_bytes(self) -> int:
        return sum(r.extra_bytes for r in self.records)

    def pattern_counts(self) -> Counter:
        return Counter(r.pattern for r in self.records)

    # -- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "target": self.target,
            "passes": list(self.passes),
            "summary": {
                "applied": dict(self.pattern_counts()),
                "refused": len(self.refusals),
                "nodes_before": sum(self.ops_before.values()),
                "nodes_after": sum(self.ops_after.values()),
                "extra_bytes": self.extra_bytes,
                "verified": None if self.verification is None else self.verification.ok,
            },
            "applied": [dataclasses.asdict(r) for r in self.records],
            "refused": [dataclasses.asdict(r) for r in self.refusals],
            "ops_before": dict(sorted(self.ops_before.items())),
            "ops_after": dict(sorted(self.ops_after.items())),
            "notes": list(self.notes),
            "verification": None
            if self.verification is None
            else {
                **dataclasses.asdict(self.verification),
                "ok": self.verification.ok,
            },
            **({"device": self.device.to_dict()} if self.device is not None else {}),
            **({"tuning": self.tuning.to_dict()} if self.tuning is not None else {}),
        }

    def to_json(self, indent: int = 2) -> str:
        return json_text(self.to_dict(), indent)

    def summary(self) -> str:
        """One line: what was applied and refused."""
        counts = self.pattern_counts()
        applied = ", ".join(f"{n} {p}" for p, n in sorted(counts.items())) or "nothing applied"
        before, after = sum(self.ops_before.values()), sum(self.ops_after.values())
        return f"{applied}; {len(self.refusals)} refused; nodes {before} -> {after}"


def json_text(data: Any, indent: int = 2) -> str:
    """``data`` as strict JSON: a NaN or infinite float (an SQNR of an exact or a failed
    match, a row that was not measured) is ``null``, numpy scalars are numbers, sets and
    tuples are lists (Python's ``json`` would write ``NaN``, which JSON readers reject)."""
    return json.dumps(_plain(data), indent=indent, allow_nan=False)


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):  # numpy scalars
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)):
        return obj
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def print_report(report: FusionReport, console=None, *, verbose: bool = False) -> None:
    """Render the report as rich tables: applied, refused, op counts, verification."""
    console = console or Console(stderr=False)
    title = f"opfuse: {report.model}" if report.model else "opfuse"
    console.print(f"[bold]{title}[/bold]  target={report.target}  passes={','.join(report.passes)}")

    counts = report.pattern_counts()
    if counts:
        table = Table(title="Applied", title_justify="left")
        table.add_column("pattern")
        table.add_column("count", justify="right")
        table.add_column("weights rewritten", justify="right")
        table.add_column("extra bytes", justify="right")
        for pattern, n in sorted(counts.items()):
            rows = report.applied(pattern)
            table.add_row(
                pattern,
                str(n),
                _bytes(sum(r.weight_bytes for r in rows)),
                _bytes(sum(r.extra_bytes for r in rows)),
            )
        console.print(table)
        if verbose:
            detail = Table(title="Applied, node by node", title_justify="left")
            for col in ("pattern", "node", "removed", "graph", "detail"):
                detail.add_column(col)
            for r in report.records:
                detail.add_row(r.pattern, r.node, ", ".join(r.removed), r.graph, r.detail)
            console.print(detail)
    else:
        console.print("Applied: nothing")

    if report.refusals and verbose:
        table = Table(title="Refused", title_justify="left")
        for col in ("pattern", "node", "into", "reason"):
            table.add_column(col)
        for r in report.refusals:
            node = r.node + (f" (+ {', '.join(r.also)})" if r.also else "")
            node = node if r.graph == "main" else f"{node} ({r.graph})"
            table.add_row(r.pattern, node, r.anchor, r.reason)
        console.print(table)
    elif report.refusals:
        # Group refusals that say the same thing about different nodes.
        groups: dict[tuple[str, str], list[Refusal]] = {}
        for r in report.refusals:
            groups.setdefault((r.pattern, _QUOTED.sub("'…'", r.reason)), []).append(r)
        table = Table(title="Refused (grouped; -v or --report lists every node)", title_justify="left")
        for col, justify in (("pattern", "left"), ("count", "right"), ("example", "left"), ("reason", "left")):
            table.add_column(col, justify=justify)
        for (pattern, _), rows in groups.items():
            table.add_row(pattern, str(len(rows)), rows[0].node, rows[0].reason)
        console.print(table)

    ops = sorted(set(report.ops_before) | set(report.ops_after))
    if ops:
        table = Table(title="Operators", title_justify="left")
        table.add_column("op")
        table.add_column("before", justify="right")
        table.add_column("after", justify="right")
        for op in ops:
            b, a = report.ops_before.get(op, 0), report.ops_after.get(op, 0)
            style = "green" if a < b else ("yellow" if a > b else "")
            table.add_row(op, str(b), str(a), style=style)
        table.add_row("total", str(sum(report.ops_before.values())),
                      str(sum(report.ops_after.values())), style="bold")
        console.print(table)

    for note in report.notes:
        console.print(f"[yellow]note:[/yellow] {note}")

    if report.device is not None:
        report.device.render(console)

    if report.tuning is not None:
        for line in report.tuning.lines():
            console.print(f"[cyan]tuning:[/cyan] {line}")

    v = report.verification
    if v is not None:
        if v.skipped:
            console.print(f"verification: [yellow]skipped[/yellow] ({v.skipped})")
        elif v.unverified:
            console.print(f"verification: [red]not verified[/red] on {v.runtime}: {v.unverified}")
        else:
            status = "[green]passed[/green]" if v.ok else "[red]FAILED[/red]"
            worst = max(v.outputs, key=lambda o: o.max_scaled_error, default=None)
            extra = (
                f"; worst output '{worst.name}': max |diff| {worst.max_abs_error:.3g} "
                f"(scale {worst.scale:.3g}, {worst.max_scaled_error:.2f} of tolerance)"
                if worst
                else ""
            )
            checked = f", {len({c.name for c in v.rewrites})} rewrite(s) at their own tensors" if v.rewrites else ""
            sets = f" x {1 + len(v.input_sets)} input sets" if v.input_sets else ""
            console.print(
                f"verification: {status} on {v.runtime}, {len({o.name for o in v.outputs})} output(s)"
                f"{checked}{sets}, inputs {v.inputs}{extra}"
            )
            if v.padded:
                console.print(f"  padded batch: {v.padded}; compared where '{v.padded_input}' is 1")
            measured = [c for c in (*v.rewrites, *v.outputs) if c.variation is not None]
            if measured:
                top = max(measured, key=lambda c: c.variation)
                console.print(f"  the original's own variation (at ONNX Runtime {v.variation_level}): d0 up to "
                              f"{top.variation:.3g} at {top.label}; bound max(tolerance, {v.variation_factor:g} x d0)")
            for note in v.notes:
                console.print(f"  [yellow]note:[/yellow] {note}")
            bad = v.first_failure()
            if bad is not None:
                console.print(f"  [red]first failure:[/red] {bad.label}: {bad.problem}")
            if v.not_exercised:
                shown = "; ".join(v.not_exercised[:5]) + ("; ..." if len(v.not_exercised) > 5 else "")
                console.print(
                    f"  [yellow]not exercised:[/yellow] {len(v.not_exercised)} of "
                    f"{v.exercised + len(v.not_exercised)} rewrite(s) lie in branches the inputs did "
                    f"not take, so they are unverified: {shown}"
                )


_QUOTED = re.compile(r"'[^']*'")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
