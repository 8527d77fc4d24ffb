"""Arm's Vela compiler: an int8 TFLite compiled for an Ethos-U, and what Vela says about it.

:func:`compile_with_vela` runs ``ethos-u-vela`` 5.2.0 (the ``opfuse[ethos-u]`` extra) in a
subprocess (``sys.executable -m ethosu.vela``: Vela's own command line, its C++ core and its
prints stay out of this process) with

- ``--accelerator-config`` the NPU and its MAC count (:data:`NPUS`: every size Vela accepts);
- ``--config Arm/vela.ini``: the configuration file shipped inside the package
  (``ethosu/config_files/Arm/vela.ini``), Arm's system configurations and memory modes;
- ``--system-config`` and ``--memory-mode``: by default the ones Vela itself falls back to for
  the NPU's family when none is given (:data:`DEFAULTS`; Vela warns "No system configuration
  specified. Using a default of ..."), passed explicitly so the report names them;
- ``--verbose-performance`` and ``--output-dir``.

and reads what it writes (:class:`VelaResult`):

- ``<name>_summary_<system>.csv``: the totals (NPU cycles, inference time at the system's
  clock, SRAM bytes, off-chip bytes: DRAM plus on- and off-chip flash, read and written);
- ``<name>_per-layer.csv``: one row per op Vela scheduled (the TFLite op, the op Vela made of
  it, NPU or CPU, cycles, share of the network's cycles, and per memory the *access cycles*:
  Vela 5.2's per-layer file gives bytes only in total);
- which ops Vela left on the CPU: the per-layer file's rows whose target is not the NPU
  (``Passthrough``), the placement Vela itself reports; and why, from its log
  (:func:`cpu_reasons`): for an op it names, "Warning (supported operators) operator: OP, ofm:
  'NAME'" and the lines of "Reason: ..." that follow. Some of its checks print a line that
  names no op ("Quantization scale of any tensor must be positive.", for a scale its
  fixed-point requantisation cannot express): those lines (:func:`unattributed_messages`) are
  the reason given for each CPU op Vela named no reason for.

Vela failing (a malformed TFLite, an internal error) is :class:`VelaError`, with the last line
of its log. :class:`EthosOptions` are the NPU and Vela's options as ``--npu`` and ``--vela``
give them; :func:`require_vela` is the install check: one line with the command (exit 2).
"""

from __future__ import annotations

__all__ = ["NPUS", "DEFAULTS", "INSTALL_COMMAND", "VelaError", "VelaOp", "VelaResult", "available",
           "require_vela", "compile_with_vela", "cpu_reasons", "unattributed_messages", "cpu_placement",
           "default_configs", "EthosOptions"]

import csv
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from opfuse.errors import BadInputError, EXTRAS, OpfuseError, missing_extra, require_extra

INSTALL_COMMAND = EXTRAS["ethos-u"].command
CONFIG = "Arm/vela.ini"  # inside ethos-u-vela (ethosu/config_files/Arm/vela.ini)
NPUS = ("ethos-u55-32", "ethos-u55-64", "ethos-u55-128", "ethos-u55-256", "ethos-u65-256", "ethos-u65-512",
        "ethos-u85-128", "ethos-u85-256", "ethos-u85-512", "ethos-u85-1024", "ethos-u85-2048")
# family -> (system config, memory mode): what Vela 5.2.0 chooses itself when given neither
DEFAULTS: dict[str, tuple[str, str]] = {
    "ethos-u55": ("Ethos_U55_High_End_Embedded", "Shared_Sram"),
    "ethos-u65": ("Ethos_U65_Client_Server", "Dedicated_Sram_384KB"),
    "ethos-u85": ("Ethos_U85_SYS_DRAM_Mid", "Dedicated_Sram_384KB"),
}
_OFF_CHIP = ("dram", "on_chip_flash", "off_chip_flash")  # the summary's memories besides SRAM
_CPU_OP = re.compile(r"^Warning \(supported operators\) operator: (?P<op>\S+), ofm: '(?P<name>.*)'$")
_NO_CONFIG = re.compile(r"^Warning: No (configuration file|system configuration|memory mode) specified")
_REPORT_START = ("####", "Network summary for", "Performance for NPU")  # where Vela's figures begin


class VelaError(OpfuseError):
    """Vela could not compile the TFLite (exit 1): the message carries the last line of its log."""

    exit_code = 1


def available() -> bool:
    """Whether ``ethos-u-vela`` and ``ai-edge-litert`` are installed (nothing is loaded)."""
    return not missing_extra("ethos-u")


def require_vela() -> None:
    """Nothing, or one line with the install command (exit 2) when a package is missing."""
    require_extra("ethos-u", "--target ethos-u (Arm's Vela compiler and LiteRT)")


def default_configs(npu: str) -> tuple[str, str]:
    """(system config, memory mode) Vela uses for ``npu`` when given neither."""
    if npu not in NPUS:
        raise BadInputError(f"unknown Ethos-U configuration {npu!r}; choose from {', '.join(NPUS)}")
    return DEFAULTS[npu.rsplit("-", 1)[0]]


@dataclasses.dataclass(frozen=True)
class EthosOptions:
    """The NPU and Vela's system configuration and memory mode (None: Vela's default for the NPU);
    ``float_ops``: what the lowering does with an op the quantiser left float, ``refuse`` (the
    default) or ``cpu`` (float32 between DEQUANTIZE and QUANTIZE, which Vela leaves to the CPU:
    :mod:`.tflite_islands`)."""

    npu: str = "ethos-u55-128"
    system_config: str | None = None
    memory_mode: str | None = None
    float_ops: str | None = None

    KEYS = ("npu", "system_config", "memory_mode", "float_ops")
    FLOAT_OPS = ("refuse", "cpu")

    @classmethod
    def parse(cls, items: Mapping[str, str] | None) -> EthosOptions:
        """From KEY=VALUE pairs (``--npu X`` is ``npu=X``); an empty value or ``default`` unsets a key."""
        fields = {}
        for key, value in (items or {}).items():
            if key not in cls.KEYS:
                raise BadInputError(f"--vela {key}={value}: unknown option; choose from {', '.join(cls.KEYS)}")
            fields[key] = None if value in ("", "default") else value
        if fields.get("npu") is None:
            fields.pop("npu", None)
        options = cls(**fields)
        if options.float_ops not in (None, *cls.FLOAT_OPS):
            raise BadInputError(f"--vela float_ops={options.float_ops}: choose from {', '.join(cls.FLOAT_OPS)}")
        if options.npu not in NPUS:
            raise BadInputError(f"--npu {options.npu}: unknown Ethos-U configuration; choose from {', '.join(NPUS)}")
        return options

    @property
    def resolved(self) -> tuple[str, str]:
        system, memory = default_configs(self.npu)
        return self.system_config or system, self.memory_mode or memory

    @property
    def float_islands(self) -> bool:
        return self.float_ops == "cpu"

    def describe(self) -> str:
        system, memory = self.resolved
        return f"{self.npu}, {system}, {memory}" + (", float ops on the CPU" if self.float_islands else "")

    def to_dict(self) -> dict:
        system, memory = self.resolved
        return {"npu": self.npu, "system_config": system, "memory_mode": memory,
                **({"float_ops": "cpu"} if self.float_islands else {})}


@dataclasses.dataclass(frozen=True)
class VelaOp:
    """One row of Vela's per-layer file."""

    name: str  # the op's output tensor (Vela names an op by it)
    tflite_op: str  # the original TFLite op ("Conv2D")
    vela_op: str  # what Vela made of it ("Conv2D", "Relu", "Passthrough" on the CPU)
    on_npu: bool
    cycles: int  # Vela's "Op Cycles"
    cycle_share: float  # of the network's cycles, 0..1
    sram_access_cycles: int
    off_chip_access_cycles: int  # DRAM plus on- and off-chip flash
    macs: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class VelaResult:
    """What Vela compiled and estimated (the figures are Arm's own estimate, not a measurement)."""

    npu: str
    system_config: str
    memory_mode: str
    cycles: int  # NPU cycles per inference
    seconds: float  # Vela's inference time at the system's clock
    clock_hz: float
    sram_bytes: int  # read and written per inference
    off_chip_bytes: int  # DRAM and flash, read and written per inference
    sram_used_kib: float  # the SRAM the schedule occupies
    off_chip_used_kib: float
    ops: list[VelaOp]
    cpu_ops: dict[str, str]  # output tensor name -> Vela's reason it stays on the CPU (:func:`cpu_placement`)
    compiled: pathlib.Path | None  # <name>_vela.tflite in output_dir (None: no output_dir, the files are gone)
    log: str
    summary: dict[str, str] = dataclasses.field(repr=False, default_factory=dict)  # the summary CSV's row

    @property
    def npu_ops(self) -> list[VelaOp]:
        return [op for op in self.ops if op.on_npu]

    def to_dict(self) -> dict:
        return {"npu": self.npu, "system_config": self.system_config, "memory_mode": self.memory_mode,
                "cycles": self.cycles, "seconds": self.seconds, "clock_hz": self.clock_hz,
                "sram_bytes": self.sram_bytes, "off_chip_bytes": self.off_chip_bytes,
                "sram_used_kib": self.sram_used_kib, "off_chip_used_kib": self.off_chip_used_kib,
                "ops": [op.to_dict() for op in self.ops], "cpu_ops": dict(self.cpu_ops)}


def compile_with_vela(tflite: bytes | str | os.PathLike, *, npu: str = "ethos-u55-128",
                      system_config: str | None = None, memory_mode: str | None = None,
                      output_dir: str | os.PathLike | None = None) -> VelaResult:
    """Compile ``tflite`` (its bytes or a path) for ``npu``; see the module docstring. The files
    go to ``output_dir``; when None, to a temporary directory removed before this returns or
    raises (:attr:`VelaResult.compiled` is then None: the figures are read, the files gone)."""
    require_vela()
    default_system, default_memory = default_configs(npu)
    system_config, memory_mode = system_config or default_system, memory_mode or default_memory
    if output_dir is None:
        with tempfile.TemporaryDirectory(prefix="opfuse-vela-") as tmp:
            return dataclasses.replace(_compile(tflite, npu, system_config, memory_mode, pathlib.Path(tmp)),
                                       compiled=None)
    return _compile(tflite, npu, system_config, memory_mode, pathlib.Path(output_dir))


def _compile(tflite: bytes | str | os.PathLike, npu: str, system_config: str, memory_mode: str,
             out: pathlib.Path) -> VelaResult:
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(tflite, (bytes, bytearray)):
        source = out / "model.tflite"
        source.write_bytes(tflite)
    else:
        source = pathlib.Path(tflite)
    command = [sys.executable, "-m", "ethosu.vela", str(source.resolve()), "--accelerator-config", npu,
               "--config", CONFIG, "--system-config", system_config, "--memory-mode", memory_mode,
               "--verbose-performance", "--output-dir", str(out.resolve())]
    done = subprocess.run(command, capture_output=True, text=True, cwd=out, check=False)
    log = done.stdout + done.stderr
    name = source.stem
    compiled, per_layer = out / f"{name}_vela.tflite", out / f"{name}_per-layer.csv"
    summary_path = out / f"{name}_summary_{system_config}.csv"
    if done.returncode != 0 or not compiled.exists() or not summary_path.exists():
        last = next((line.strip() for line in reversed(log.splitlines()) if line.strip()), "no output")
        raise VelaError(f"Vela could not compile the TFLite for {npu} (exit {done.returncode}): {last[:300]}")
    summary = _read_csv(summary_path)[0]
    ops = [_op(row) for row in _read_csv(per_layer)] if per_layer.exists() else []
    return VelaResult(
        npu=npu, system_config=system_config, memory_mode=memory_mode,
        cycles=int(float(summary["cycles_total"])), seconds=float(summary["inference_time"]),
        clock_hz=float(summary["core_clock"]), sram_bytes=int(float(summary["sram_total_bytes"])),
        off_chip_bytes=sum(int(float(summary[f"{m}_total_bytes"])) for m in _OFF_CHIP),
        sram_used_kib=float(summary["sram_memory_used"]),
        off_chip_used_kib=sum(float(summary[f"{m}_memory_used"]) for m in _OFF_CHIP),
        ops=ops, cpu_ops=cpu_placement(ops, log), compiled=compiled, log=log, summary=summary)


def cpu_placement(ops: list[VelaOp], log: str) -> dict[str, str]:
    """Every op Vela left on the CPU, output tensor name -> reason: the per-layer rows whose
    target is not the NPU, each with the reason Vela printed for it by name, else the lines
    Vela printed naming no op (:func:`unattributed_messages`), else a sentence saying Vela gave
    none; and any op Vela warned about by name that has no per-layer row."""
    named = cpu_reasons(log)
    loose = unattributed_messages(log)
    placement = {}
    for op in ops:
        if op.on_npu:
            continue
        if op.name in named:
            placement[op.name] = named[op.name]
        elif loose:
            placement[op.name] = f"{op.tflite_op}: " + "; ".join(loose) + " (Vela's message names no op)"
        else:
            placement[op.name] = (f"{op.tflite_op}: left to the CPU by Vela (per-layer target "
                                  f"{op.vela_op or 'CPU'}); Vela printed no reason")
    placement.update({name: why for name, why in named.items() if name not in placement})
    return placement


def unattributed_messages(log: str) -> list[str]:
    """The distinct lines of Vela's log before its figures that are neither a warning about a
    named op (and its reason lines) nor its note that no configuration was given."""
    found: list[str] = []
    in_warning = False
    for line in log.splitlines():
        line = line.strip()
        if line.startswith(_REPORT_START):
            break
        if not line:
            in_warning = False
        elif _CPU_OP.match(line):
            in_warning = True
        elif not in_warning and not _NO_CONFIG.match(line) and line not in found:
            found.append(line)
    return found


def cpu_reasons(log: str) -> dict[str, str]:
    """Output tensor name -> Vela's reason, from the warnings it prints for each op it leaves on
    the CPU ("Warning (supported operators) operator: COS, ofm: 'z'" then "Reason: ..." lines)."""
    reasons: dict[str, str] = {}
    lines = log.splitlines()
    for i, line in enumerate(lines):
        match = _CPU_OP.match(line.strip())
        if not match:
            continue
        why = []
        for following in lines[i + 1:]:
            following = following.strip()
            if not following or _CPU_OP.match(following):
                break
            why.append(following.removeprefix("Reason:").strip())
        reasons[match["name"]] = f"{match['op']}: " + ("; ".join(why) or "no reason given")
    return reasons


def _read_csv(path: pathlib.Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _op(row: dict[str, str]) -> VelaOp:
    def number(key: str) -> float:
        return float(row.get(key) or 0)

    return VelaOp(name=row["Name"], tflite_op=row["Original Operator"], vela_op=row["NNG Operator"],
                  on_npu=row["Target"] == "NPU", cycles=int(number("Op Cycles")),
                  cycle_share=number("Network% (cycles)") / 100, sram_access_cycles=int(number("SRAM AC")),
                  off_chip_access_cycles=int(number("DRAM AC") + number("OnFlash AC") + number("OffFlash AC")),
                  macs=int(number("MAC Count")))
