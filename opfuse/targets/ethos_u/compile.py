"""The compile step of ``--target ethos-u``: lowered to TFLite, compiled by Vela, its log in the report.

:func:`compile_for_ethos_u` lowers the model (:func:`opfuse.targets.ethos_u.lower.lower_to_tflite`:
an op it cannot write is refused in one line, nothing written), compiles the TFLite with Vela
(:func:`.vela.compile_with_vela`) and returns an :class:`EthosCompileLog`, the report's
``device`` section: the NPU and Vela's system configuration and memory mode, the ops on the NPU
and on the CPU (each with Vela's reason and the fix opfuse knows, :data:`FIXES`), and Vela's
estimate: cycles, time, SRAM and off-chip bytes in total, cycles and memory access cycles per op.

``require_npu`` makes any op on the CPU an error (exit 1, nothing written). ``context``
(``M_vela.tflite``): Vela's compiled model is written there, and the lowered TFLite beside it
(``M.tflite``: the context's name without ``_vela``; ``M_int8.tflite`` when it has none), both
moved into place only when everything else is written (:meth:`EthosCompileLog.commit_context`).
"""

from __future__ import annotations

__all__ = ["EthosCompileLog", "compile_for_ethos_u", "FIXES", "U85_ONLY", "lowered_path"]

import dataclasses
import os
import pathlib
import shutil
import tempfile
import time
import weakref

import onnx

from opfuse.errors import VerificationError
from opfuse.save import commit_staged_files
from opfuse.targets.ethos_u.vela import EthosOptions, VelaResult, compile_with_vela

# the TFLite ops Vela 5.2.0 runs on the U85 and not on the U55 or U65 (its SUPPORTED_OPS.md)
U85_ONLY = frozenset({"ASSIGN_VARIABLE", "CAST", "DIV", "EQUAL", "GATHER", "GREATER", "GREATER_EQUAL", "LESS",
                      "LESS_EQUAL", "LOGICAL_AND", "LOGICAL_NOT", "LOGICAL_OR", "NOT_EQUAL", "READ_VARIABLE",
                      "REDUCE_ALL", "REDUCE_ANY", "SCATTER_ND", "SELECT", "SELECT_V2"})
# a word of Vela's reason -> what to do about it
FIXES: dict[str, str] = {
    "Unsupported opType": "write it as ops Vela runs (vela --supported-ops-report lists them per NPU)",
    "Stride": "a smaller stride (a strided conv as a stride-1 conv and a pool, or space-to-depth)",
    "kernel": "a smaller kernel (split it into convs Vela takes)",
    "Per-axis quantization": "per-tensor quantisation for this op (only the layers with weights take per-channel)",
    "dimension": "fewer dimensions or a smaller size (a Reshape to what Vela takes)",
    "scale": "a quantisation scale Vela takes (positive, and within its ratio limits)",
}


def fix_for(op: str, reason: str, npu: str) -> str:
    """The fix opfuse knows for an op Vela leaves on the CPU ("" when it knows none)."""
    if op in U85_ONLY and not npu.startswith("ethos-u85"):
        return f"{op} runs on the Ethos-U85's NPU (--npu ethos-u85-256), not on the U55 or U65"
    return next((fix for word, fix in FIXES.items() if word.lower() in reason.lower()), "")


def lowered_path(context: str | os.PathLike) -> pathlib.Path:
    """Where the lowered TFLite goes beside Vela's compiled model ``context``."""
    context = pathlib.Path(context)
    stem = context.name.removesuffix(".tflite")
    base = stem.removesuffix("_vela") if stem.endswith("_vela") else f"{stem}_int8"
    return context.with_name(f"{base}.tflite")


@dataclasses.dataclass
class EthosCompileLog:
    """What Vela did with the lowered model (a section of the report)."""

    vela: VelaResult
    options: EthosOptions
    tflite_bytes: int
    compile_seconds: float
    context: str | None = None  # where Vela's compiled model goes
    session: object = dataclasses.field(default=None, repr=False)  # the TFLite in LiteRT (runs the samples)
    _pending: pathlib.Path | None = None  # the directory Vela wrote into

    def __post_init__(self):
        if self._pending is not None:  # dropped unused (an error before commit_context or discard): removed
            weakref.finalize(self, shutil.rmtree, self._pending, True)

    @property
    def placement(self):
        return self  # (the device interface reads placement.cpu)

    @property
    def cpu(self) -> list[str]:
        """The ops Vela left on the CPU, by output tensor name."""
        return [op.name for op in self.vela.ops if not op.on_npu] or list(self.vela.cpu_ops)

    @property
    def fallbacks(self) -> list[dict]:
        out = []
        for op in self.vela.ops:
            if not op.on_npu:
                reason = self.vela.cpu_ops.get(op.name, "")
                out.append({"name": op.name, "op": op.tflite_op, "reason": reason,
                            "fix": fix_for(reason.split(":")[0], reason, self.vela.npu)})
        return out

    @property
    def warnings(self) -> list[str]:
        return [f"{f['name']} ({f['op']}) runs on the CPU; Vela: {f['reason'] or 'no reason given'}"
                + (f"; fix: {f['fix']}" if f["fix"] else "") for f in self.fallbacks]

    def summary(self) -> str:
        v = self.vela
        on_npu, on_cpu = len(v.npu_ops), len(v.ops) - len(v.npu_ops)
        return (f"{on_npu} op(s) on the NPU, {on_cpu} on the CPU; {v.cycles:,} cycles, {v.seconds * 1e3:.3f} ms at "
                f"{v.clock_hz / 1e6:.0f} MHz; SRAM {v.sram_bytes:,} B, off-chip {v.off_chip_bytes:,} B per inference")

    def commit_context(self) -> None:
        """Vela's compiled model and the lowered TFLite moved into place (after the other outputs)."""
        if self._pending is None or self.context is None:
            self.discard()  # (no context asked for: Vela's files go)
            return
        pending, self._pending = self._pending, None
        commit_staged_files(pending, [("model.tflite", lowered_path(self.context)), (self.vela.compiled, self.context)])

    def discard(self) -> None:
        if self._pending is not None:
            shutil.rmtree(self._pending, ignore_errors=True)
            self._pending = None

    def to_dict(self) -> dict:
        return {"backend": "Arm Vela (ethos-u-vela) estimate; TFLite run in LiteRT",
                "options": self.options.to_dict(), "tflite_bytes": self.tflite_bytes,
                "compile_seconds": round(self.compile_seconds, 3), "context": self.context,
                "lowered": os.fspath(lowered_path(self.context)) if self.context else None,
                **self.vela.to_dict(), "fallbacks": self.fallbacks}

    def render(self, console) -> None:
        from rich.table import Table  # (only the CLI renders)

        v = self.vela
        style = "green" if not self.fallbacks else "yellow"
        console.print(f"[bold]Vela compile log[/bold] ({self.options.describe()}; {self.tflite_bytes:,} B TFLite, "
                      f"compiled in {self.compile_seconds:.1f} s): [{style}]{self.summary()}[/{style}]")
        table = Table(title="Vela's estimate per op", title_justify="left")
        for col in ("op (output)", "TFLite op", "Vela op", "on", "cycles", "share", "SRAM AC", "off-chip AC"):
            table.add_column(col, justify="right" if col in ("cycles", "share", "SRAM AC", "off-chip AC") else "left")
        for op in v.ops:
            table.add_row(op.name, op.tflite_op, op.vela_op, "NPU" if op.on_npu else "CPU", f"{op.cycles:,}",
                          f"{op.cycle_share:.1%}", f"{op.sram_access_cycles:,}", f"{op.off_chip_access_cycles:,}")
        console.print(table)
        console.print("(AC: memory access cycles, as Vela's per-layer file gives them; bytes are Vela's totals)")
        for w in self.warnings:
            console.print(f"[yellow]warning:[/yellow] {w}")
        if self.context:
            console.print(f"Vela's compiled model: {self.context}; the lowered TFLite: {lowered_path(self.context)}")


def compile_for_ethos_u(model, report=None, *, options=None, require_npu: bool = False, context=None,
                        input_values=None) -> EthosCompileLog:
    """Lower ``model``, compile it with Vela; see the module docstring. With ``report`` (a
    FusionReport or a QuantReport) the log becomes its ``device`` section. ``input_values``
    is the interface's (an If's deciding inputs): a TFLite has no If, so it is not read."""
    from opfuse.targets.ethos_u.lower import lower_to_tflite  # (the lowering loads the TFLite schema)
    from opfuse.targets.ethos_u.runner import TfliteSession  # (LiteRT: loaded with the lowering)

    options = options or EthosOptions()
    proto = model if isinstance(model, onnx.ModelProto) else _serialize(model)
    tflite = lower_to_tflite(proto, float_islands=options.float_islands)  # an op it cannot write: one line
    # Vela's files are kept (beside the context, renamed into place by commit_context) only when
    # a context is asked for; otherwise its figures are read and its files removed at once
    pending = (pathlib.Path(tempfile.mkdtemp(prefix=".opfuse-vela-", dir=pathlib.Path(context).resolve().parent))
               if context is not None else None)
    start = time.perf_counter()
    try:
        vela = compile_with_vela(tflite, npu=options.npu, system_config=options.system_config,
                                 memory_mode=options.memory_mode, output_dir=pending)
        seconds = time.perf_counter() - start
        session = TfliteSession(tflite, proto)
    except BaseException:
        if pending is not None:
            shutil.rmtree(pending, ignore_errors=True)
        raise
    log = EthosCompileLog(vela, options, len(tflite), seconds,
                          context=os.fspath(context) if context is not None else None,
                          session=session, _pending=pending)
    if report is not None:
        report.device = log
    if require_npu and log.fallbacks:
        log.discard()
        more = f" (and {len(log.fallbacks) - 1} more)" if len(log.fallbacks) > 1 else ""
        raise VerificationError(f"--require-npu: {log.warnings[0]}{more}", report)
    return log


def _serialize(model) -> onnx.ModelProto:
    import onnx_ir as ir  # (optimize hands an onnx-ir model)

    return ir.serde.serialize_model(model)
