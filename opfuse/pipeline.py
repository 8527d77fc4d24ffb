"""The pipeline, end to end: load -> analyse -> rewrite -> verify -> save and report.

:func:`optimize` is the Python API behind ``opfuse optimize``; :func:`inspect_model` is
the dry run behind ``opfuse inspect``. Neither mutates the caller's model.
"""

from __future__ import annotations

__all__ = ["optimize", "inspect_model", "run_passes", "Inspection", "epsilon_notes"]

import dataclasses
import os
import pathlib
from collections import defaultdict
from collections.abc import Iterable, Mapping

import numpy as np
import onnx_ir as ir

from opfuse.analyse import epsilon_census, op_counts
from opfuse.errors import BadInputError, VerificationError
from opfuse.load import ModelSource, load_model
from opfuse.passes import DEFAULT_PASSES, make_passes
from opfuse.report import FusionReport
from opfuse.save import needs_external_data, save_model, write_text_atomic
from opfuse.verify import verify_models

MAX_ROUNDS = 8  # folding repeats until nothing changes; chains settle in two rounds


def run_passes(model: ir.Model, names: Iterable[str], report: FusionReport) -> None:
    """Run the named passes in order, repeatedly, until a round changes nothing.

    Refusals are those of the last round, so they describe the final graph.
    """
    passes = make_passes(list(names), report)
    for _ in range(MAX_ROUNDS):
        report.refusals.clear()
        modified = False
        for p in passes:
            modified = p(model).modified or modified
        if not modified:
            break


def epsilon_notes(model: ir.Model) -> list[str]:
    """A warning when BatchNormalization epsilons differ across layers."""
    by_eps: dict[float, list[str]] = defaultdict(list)
    for name, eps, _ in epsilon_census(model):
        by_eps[eps].append(name)
    if len(by_eps) < 2:
        return []
    parts = []
    for eps, names in sorted(by_eps.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        parts.append(f"{eps:g} ({len(names)}: {shown})")
    return [
        "BatchNormalization epsilons differ across layers: " + "; ".join(parts)
        + ". Each layer is folded with its own epsilon; check these match what the model "
        "was trained with (a wrong epsilon costs accuracy silently)."
    ]


def optimize(
    model: ModelSource,
    *,
    passes: Iterable[str] | str | None = None,
    target: str = "onnx",
    verify: bool = True,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
    output: str | os.PathLike | None = None,
    report_path: str | os.PathLike | None = None,
    external_data: bool | None = None,
    overwrite: bool = False,
) -> tuple[ir.Model, FusionReport]:
    """Optimise ``model`` (a path, bytes, ModelProto or onnx_ir.Model).

    Returns the new model and its report; the caller's model is never mutated. With
    ``verify`` (the default) both models run on ONNX Runtime and a mismatch raises
    :class:`VerificationError` before anything is written. ``output`` writes the model
    (atomically); ``report_path`` writes the report as JSON.
    """
    if isinstance(passes, str):
        passes = [p.strip() for p in passes.split(",") if p.strip()]
    names = list(passes) if passes is not None else list(DEFAULT_PASSES)
    if output is not None and isinstance(model, (str, os.PathLike)) and not overwrite:
        if pathlib.Path(output).resolve() == pathlib.Path(model).resolve():
            raise BadInputError(
                f"{output}: refusing to overwrite the input model; choose another output "
                "or pass --overwrite"
            )
    make_passes(names, FusionReport())  # reject unknown names before any work

    work, display = load_model(model)
    original = work.clone() if verify else None
    report = FusionReport(model=display, target=target, passes=names)
    report.ops_before = op_counts(work)
    report.notes.extend(epsilon_notes(work))
    input_was_external = needs_external_data(work)  # before the folds replace its tensors

    run_passes(work, names, report)
    report.ops_after = op_counts(work)

    if verify:
        report.verification = verify_models(original, work, inputs=inputs, dims=dims, seed=seed)
        if not report.verification.ok:
            bad = report.verification.first_failure()
            raise VerificationError(
                f"verification failed: output '{bad.name}': {bad.problem}; nothing was written",
                report,
            )
    if output is not None:
        if external_data is None:
            external_data = input_was_external or needs_external_data(work)
        save_model(work, output, external_data=external_data)
    if report_path is not None:
        write_text_atomic(report_path, report.to_json())
    return work, report


@dataclasses.dataclass
class Inspection:
    """What ``opfuse inspect`` shows: the dry-run report and the epsilons in use."""

    report: FusionReport
    epsilons: list[tuple[str, float, str]]

    @property
    def warnings(self) -> list[str]:
        return [n for n in self.report.notes if "epsilon" in n]


def inspect_model(
    model: ModelSource, *, passes: Iterable[str] | str | None = None
) -> Inspection:
    """Dry run: which candidates would fold, what blocks the others, and the BN epsilons."""
    work, display = load_model(model)
    epsilons = epsilon_census(work)
    _, report = optimize(work, passes=passes, verify=False)
    report.model = display
    return Inspection(report=report, epsilons=epsilons)
