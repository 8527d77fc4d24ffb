"""The compile step of ``--target qnn``: the result opened on the HTP, its log in the report.

:func:`compile_on_htp` opens the rewritten model on QNN's HTP backend
(:func:`opfuse.targets.qnn.backend.open_session`) and returns a :class:`HtpCompileLog`, which the
fusion log shows as a section of its own (:meth:`HtpCompileLog.render`; JSON under
``"device"``): the HTP options, the compile time, the nodes on QNN, its partitions, and
each node left on the CPU as a warning with QNN's reason and the fix opfuse knows (for an
``If`` and its branches, the inputs whose binding removes it: :mod:`.branches`).

``require_npu`` makes any CPU fallback an error (exit 1, nothing written). Then the model
is also opened in strict mode (``session.disable_cpu_ep_fallback``), the way a deployment
that must not fall back opens it.

``context``: the compiled model as an EPContext ONNX (``ep.context_enable``, the QNN
context binary embedded), written beside the destination under a temporary name during
the compile and moved into place only when everything else is written
(:meth:`HtpCompileLog.commit_context`), so a device loads it without recompiling.
"""

from __future__ import annotations

__all__ = ["HtpCompileLog", "compile_on_htp", "context_config"]

import dataclasses
import os
import pathlib
import shutil
import tempfile
import weakref
from collections.abc import Mapping

import numpy as np

from opfuse.errors import VerificationError
from opfuse.save import commit_staged_files
from opfuse.targets.qnn.backend import HtpCompileError, HtpOptions, open_session
from opfuse.targets.qnn.branches import branch_fixes
from opfuse.targets.qnn.placement import Fallback, Placement


def context_config(path: str | os.PathLike) -> dict[str, str]:
    """The session entries that make ONNX Runtime write an EPContext model to ``path``."""
    return {"ep.context_enable": "1", "ep.context_file_path": os.fspath(path), "ep.context_embed_mode": "1"}


@dataclasses.dataclass
class HtpCompileLog:
    """What QNN's compiler did with the model (a section of the fusion log)."""

    placement: Placement
    options: HtpOptions
    compile_seconds: float
    strict: bool = False  # opened with CPU fallback disabled too
    context: str | None = None  # where the EPContext model goes
    _pending: pathlib.Path | None = None  # the EPContext file written during the compile
    session: object = dataclasses.field(default=None, repr=False)  # the HtpSession (runs the held-out samples)

    def __post_init__(self):
        if self._pending is not None:  # dropped unused (an error before commit_context or discard): removed
            weakref.finalize(self, shutil.rmtree, self._pending, True)

    @property
    def warnings(self) -> list[str]:
        """One sentence per QNN reason and fix: the nodes of an If's branches share theirs."""
        out = []
        for group in _grouped(self.placement.fallbacks):
            if len(group) == 1:
                out.append(group[0].sentence())
                continue
            first = group[0]
            why = f"QNN: {first.reason}" if first.reason else "QNN gave no reason in its log"
            out.append(f"{len(group)} nodes ({_names(group)}) run on the CPU; {why}"
                       + (f"; fix: {first.fix}" if first.fix else ""))
        return out

    def commit_context(self) -> None:
        """Move the EPContext model into place (after the other outputs are written)."""
        if self._pending is None or self.context is None:
            return
        pending, self._pending = self._pending, None
        commit_staged_files(pending, [("context.onnx", self.context)])

    def discard(self) -> None:
        if self._pending is not None:
            shutil.rmtree(self._pending, ignore_errors=True)
            self._pending = None

    def to_dict(self) -> dict:
        return {"backend": "QNN HTP (onnxruntime-qnn)", "options": self.options.to_dict(),
                "compile_seconds": round(self.compile_seconds, 3), "strict_open": self.strict,
                "context": self.context, **self.placement.to_dict()}

    def render(self, console) -> None:
        from rich.table import Table  # (rich is light, but only the CLI renders)

        p = self.placement
        style = "green" if p.all_on_npu else "yellow"
        console.print(f"[bold]QNN HTP compile log[/bold] ({self.options.describe()}; compiled in "
                      f"{self.compile_seconds:.1f} s): [{style}]{p.summary()}[/{style}]"
                      + ("; opened with CPU fallback disabled" if self.strict else ""))
        if p.fallbacks:
            table = Table(title="On the CPU, with QNN's reason", title_justify="left")
            for col in ("node", "op", "QNN's reason", "fix"):
                table.add_column(col)
            for group in _grouped(p.fallbacks):
                ops = ", ".join(dict.fromkeys(f.op_type for f in group))
                table.add_row(_names(group), ops, group[0].reason or "(none logged)", group[0].fix)
            console.print(table)
            for w in self.warnings:
                console.print(f"[yellow]warning:[/yellow] {w}")
        if self.context:
            console.print(f"EPContext model: {self.context} (loads on the device without recompiling)")


def _grouped(fallbacks: list[Fallback]) -> list[list[Fallback]]:
    """The fallbacks by (QNN's reason, fix), in order of first appearance (the JSON keeps each)."""
    groups: dict[tuple[str, str], list[Fallback]] = {}
    for f in fallbacks:
        groups.setdefault((f.reason, f.fix), []).append(f)
    return list(groups.values())


def _names(group: list[Fallback], shown: int = 3) -> str:
    names = ", ".join(f.name for f in group[:shown])
    return names + (f" and {len(group) - shown} more" if len(group) > shown else "")


def compile_on_htp(model, report=None, *, options: HtpOptions | None = None, require_npu: bool = False,
                   context: str | os.PathLike | None = None,
                   input_values: Mapping[str, np.ndarray] | None = None) -> HtpCompileLog:
    """Open ``model`` on the HTP; see the module docstring. With ``report`` (a FusionReport
    or a QuantReport) the log becomes its ``device`` section. ``input_values``: inputs that
    hold one value in every calibration sample (an If they decide: the fix gives it)."""
    options = options or HtpOptions()
    pending = None
    config = None
    if context is not None:
        pending = pathlib.Path(tempfile.mkdtemp(prefix=".opfuse-ctx-", dir=pathlib.Path(context).resolve().parent))
        config = context_config(pending / "context.onnx")
    try:
        session = open_session(model, options, session_config=config)
    except BaseException:
        if pending is not None:
            shutil.rmtree(pending, ignore_errors=True)
        raise
    session.placement.fixes.update(branch_fixes(model, session.placement.cpu, input_values))
    log = HtpCompileLog(session.placement, options, session.compile_seconds,
                        context=os.fspath(context) if context is not None else None, _pending=pending,
                        session=session)
    if report is not None:
        report.device = log
    if require_npu:
        if log.placement.fallbacks:
            log.discard()
            first = log.placement.fallbacks[0]
            more = f" (and {len(log.placement.fallbacks) - 1} more)" if len(log.placement.fallbacks) > 1 else ""
            raise VerificationError(f"--require-npu: {first.sentence()}{more}", report)
        try:
            open_session(model, options, strict=True)
        except HtpCompileError as e:
            log.discard()
            raise VerificationError(f"--require-npu: {e}", report) from e
        log.strict = True
    return log
