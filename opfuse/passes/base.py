"""The one base every opfuse pass stands on (an onnx-ir ``InPlacePass`` with a small surface).

A pass declares, as class attributes:

- ``name`` - how ``--passes`` and the registry (:mod:`opfuse.passes`) call it;
- ``emits_contrib_ops`` - whether it writes a target's own kernels (``com.microsoft``),
  which portable ONNX cannot run;
- ``fuses_residual`` - whether it can give a kernel a residual input (a target's layout
  policy asks: ONNX Runtime's NCHWc check is needed only then);
- ``options`` - the keyword options it accepts beyond the report (the fusion passes take
  ``exclude`` and ``veto``), so the pipeline hands each pass only what it declares;
- ``after_rewrites`` - whether it runs with the fusion into the target's kernels, after the
  other rewrites have settled: it changes what they match (``pack-projections``: a packed
  MatMul is no projection the attention patterns know), so running among them would hide
  their refusals of the graph written;
- ``requires_ops`` - the op types of which a model must hold one for the pass to change
  anything (empty: any model might); the measured choice builds no variant without a family's
  pass where the model has none (:mod:`opfuse.passes.pattern_gate`);
- ``exact`` - whether its rewrites compute the same numbers (every pass but
  ``dequantize-dynamic``). An inexact pass runs before the others, and verification takes
  its result as the reference, its distance from the input measured and reported
  (:func:`opfuse.pipeline.optimize`).

and gets from the base:

- :meth:`refuse` - the one way to record a refusal (pattern, node, reason, anchor, scope);
- :attr:`refusals` - those of its latest run: the pipeline runs the passes to a fixpoint
  and reports the refusals of the final round, which describe the final graph;
- :attr:`emitted` - the fused nodes it wrote over all its rounds, by name, with their
  epilogue (empty for folds);
- :meth:`release` - drop transient state (values annotated during the run) when the
  passes are done. The pipeline calls it once, after the last round.

Records (what a pass did) go to the shared :class:`~opfuse.report.FusionReport` as they
happen, because every round's rewrites are real.
"""

from __future__ import annotations

__all__ = ["OpfusePass"]

from typing import Any, ClassVar

import onnx_ir as ir

from opfuse.core.analysis import Scope, node_label
from opfuse.report import FusionReport, Refusal


class OpfusePass(ir.passes.InPlacePass):
    """Base class of opfuse's passes: a name, a report, refusals, transient state."""

    name: ClassVar[str] = ""
    emits_contrib_ops: ClassVar[bool] = False
    fuses_residual: ClassVar[bool] = False
    options: ClassVar[frozenset[str]] = frozenset()
    exact: ClassVar[bool] = True
    after_rewrites: ClassVar[bool] = False
    requires_ops: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, report: FusionReport | None = None, **options: Any):
        super().__init__()
        unknown = sorted(set(options) - self.options)
        if unknown:
            raise TypeError(f"pass {self.name} takes no option {unknown[0]!r}")
        self.report = report if report is not None else FusionReport()
        self.refusals: list[Refusal] = []
        self.emitted: dict[str, str] = {}

    def __call__(self, model: ir.Model) -> ir.passes.PassResult:
        self.refusals = []  # a new round describes the graph anew
        return super().__call__(model)

    def refuse(self, pattern: str, node: ir.Node, reason: str, *, anchor: ir.Node | None = None,
               scope: Scope | None = None, also: tuple[ir.Node, ...] = ()) -> None:
        """Record that ``node`` was not rewritten (into ``anchor``), and why; ``also``: the
        other nodes the same decision leaves (one fusion declined is one entry)."""
        self.refusals.append(Refusal(
            pattern, node_label(node), reason, node_label(anchor) if anchor is not None else "",
            scope.label if scope is not None else "main", tuple(node_label(n) for n in also),
        ))

    def release(self) -> None:
        """Drop transient state; the default pass keeps none."""
