"""Hardware profiles: what the accelerator model knows of a chip, read from TOML.

A profile (``opfuse/cost/hardware/*.toml``, shipped as package data; or any TOML file
by path) gives DRAM bandwidth, on-chip buffer size, peak compute per dtype (``int8`` for
the int8 kernels of a quantised graph, :mod:`opfuse.cost.int8`), per-kernel
launch overhead, the tile height the chip works in, an optional execution dtype (an NPU
running a float32 model in float16) and the efficiency of spilled traffic. An Ethos-U
profile also has a ``[vela]`` table (the NPU, system config and memory mode Arm's Vela
compiler measures it with; ``opfuse bench`` then prints Vela's figures beside the model's). Every field is
validated on load: a bad profile is one :class:`~opfuse.errors.BadInputError` naming the
field. :mod:`opfuse.cost.accelerator` turns a profile and a graph into predictions.
"""

from __future__ import annotations

__all__ = ["HardwareProfile", "load_profile", "list_profiles", "PROFILE_DIR", "EXECUTION_DTYPES"]

import dataclasses
import math
import os
import pathlib
from typing import TYPE_CHECKING, Any

from opfuse.errors import BadInputError
from opfuse.core.ops import FLOAT_DTYPES

if TYPE_CHECKING:  # annotations only: this module stays light (the CLI lists profiles at start-up)
    from opfuse.cost.traffic import TensorInfo

try:  # Python 3.11+
    import tomllib as _toml
except ModuleNotFoundError:  # pragma: no cover - Python 3.10 needs the tomli backport
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ModuleNotFoundError:
        _toml = None


PROFILE_DIR = pathlib.Path(__file__).resolve().parent / "hardware"
EXECUTION_DTYPES = {"float32": 32, "float16": 16, "bfloat16": 16, "int8": 8}
INT8_DTYPES = frozenset({"int8", "uint8"})  # an int8 kernel's dtypes: [peak_gflops] int8


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator, as the cost model sees it (see ``opfuse/cost/hardware/*.toml``)."""

    name: str
    dram_bandwidth_gbps: float  # GB/s, 1e9 bytes per second
    onchip_buffer_kib: float
    launch_overhead_us: float
    peak_gflops: dict[str, float]  # dtype -> sustained GFLOP/s (int8: GOP/s)
    tile_rows: int = 4
    execution_dtype: str | None = None  # float tensors are costed at this width
    spill_efficiency: float = 0.5  # spilled bytes move at this fraction of the bandwidth
    description: str = ""
    calibration: dict[str, Any] = dataclasses.field(default_factory=dict)
    vela: dict[str, str] = dataclasses.field(default_factory=dict)  # an Ethos-U NPU: Vela's npu, system config...
    source: str = ""

    @property
    def compiler(self) -> str | None:
        """"vela" for an Ethos-U profile (its ``[vela]`` table names the NPU Vela compiles for)."""
        return "vela" if self.vela else None

    @property
    def buffer_bytes(self) -> float:
        return self.onchip_buffer_kib * 1024

    @property
    def bandwidth(self) -> float:
        return self.dram_bandwidth_gbps * 1e9

    @property
    def launch_s(self) -> float:
        return self.launch_overhead_us * 1e-6

    def peak(self, dtype: str | None) -> float:
        """Operations per second for ``dtype``: an int8 kernel's (``int8``/``uint8``) at the
        ``int8`` entry; otherwise, and for int8 on a profile without that entry, the
        execution dtype's when set (a float16 NPU runs float32 in float16), else the
        dtype's own; float32's when the entry is not listed."""
        if dtype in INT8_DTYPES and "int8" in self.peak_gflops:
            key = "int8"
        else:
            key = self.execution_dtype or dtype or "float32"
        value = self.peak_gflops.get(key, self.peak_gflops.get("float32"))
        return float(value) * 1e9

    def bits(self, t: TensorInfo) -> int | None:
        if self.execution_dtype and t.dtype in FLOAT_DTYPES:
            return EXECUTION_DTYPES[self.execution_dtype]
        return t.bits

    def nbytes(self, t: TensorInfo | None) -> int:
        if t is None or t.shape is None:
            return 0
        bits = self.bits(t)
        return 0 if bits is None else (math.prod(t.shape) * bits + 7) // 8

    def replace(self, **changes) -> HardwareProfile:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "dram_bandwidth_gbps": self.dram_bandwidth_gbps,
            "onchip_buffer_kib": self.onchip_buffer_kib,
            "launch_overhead_us": self.launch_overhead_us,
            "peak_gflops": dict(self.peak_gflops),
            "tile_rows": self.tile_rows,
            "execution_dtype": self.execution_dtype,
            "spill_efficiency": self.spill_efficiency,
            "vela": dict(self.vela),
            "source": self.source,
        }


def list_profiles() -> list[str]:
    """Names of the shipped profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str | os.PathLike | HardwareProfile) -> HardwareProfile:
    """A shipped profile by name (``npu-chapter``) or a TOML file by path.

    Raises :class:`BadInputError` for an unknown name, an unreadable file or a bad field.
    """
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    text = str(name_or_path)
    path = pathlib.Path(text)
    if not (text.endswith(".toml") or os.sep in text or "/" in text):
        path = PROFILE_DIR / f"{text}.toml"
        if not path.is_file():
            raise BadInputError(
                f"unknown hardware profile {text!r}; shipped profiles: {', '.join(list_profiles())} "
                "(or give the path of a .toml file)"
            )
    if not path.is_file():
        raise BadInputError(f"{path}: no such hardware profile file")
    if _toml is None:  # pragma: no cover
        raise BadInputError("reading hardware profiles on Python 3.10 needs the 'tomli' package")
    try:
        data = _toml.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, _toml.TOMLDecodeError) as e:
        raise BadInputError(f"{path}: not a readable TOML profile ({e})") from None
    return _profile_from(data, path)


def _profile_from(data: dict[str, Any], path: pathlib.Path) -> HardwareProfile:
    def number(key: str, minimum: float = 0.0, strict: bool = True) -> float:
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadInputError(f"{path}: '{key}' must be a number")
        if value < minimum or (strict and value == minimum):
            raise BadInputError(f"{path}: '{key}' must be {'>' if strict else '>='} {minimum:g}")
        return float(value)

    peaks = data.get("peak_gflops")
    if not isinstance(peaks, dict) or not peaks or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in peaks.values()
    ):
        raise BadInputError(f"{path}: [peak_gflops] must map dtypes to positive numbers")
    if "float32" not in peaks:
        raise BadInputError(f"{path}: [peak_gflops] needs a float32 entry (the fallback)")
    exec_dtype = data.get("execution_dtype")
    if exec_dtype is not None and exec_dtype not in EXECUTION_DTYPES:
        raise BadInputError(
            f"{path}: execution_dtype must be one of {', '.join(EXECUTION_DTYPES)}, not {exec_dtype!r}"
        )
    if exec_dtype is not None and exec_dtype not in peaks:
        raise BadInputError(f"{path}: [peak_gflops] has no entry for the execution dtype {exec_dtype}")
    tile_rows = data.get("tile_rows", 4)
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
        raise BadInputError(f"{path}: 'tile_rows' must be a positive integer")
    calibration = data.get("calibration", {})
    spill_efficiency = number("spill_efficiency") if "spill_efficiency" in data else 0.5
    if spill_efficiency > 1:
        raise BadInputError(f"{path}: 'spill_efficiency' must be in (0, 1]")
    vela = data.get("vela", {})
    if not isinstance(vela, dict) or not isinstance(vela.get("npu", ""), str) or (vela and not vela.get("npu")):
        raise BadInputError(f"{path}: [vela] must give the npu Vela compiles for (npu = \"ethos-u55-128\")")
    unknown_vela = sorted(set(vela) - {"npu", "system_config", "memory_mode"})
    if unknown_vela:
        raise BadInputError(f"{path}: unknown [vela] field {unknown_vela[0]!r}; known: memory_mode, npu, system_config")
    known = {"name", "description", "dram_bandwidth_gbps", "onchip_buffer_kib", "launch_overhead_us",
             "peak_gflops", "tile_rows", "execution_dtype", "spill_efficiency", "calibration", "vela"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise BadInputError(f"{path}: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}")
    return HardwareProfile(
        name=str(data.get("name") or path.stem),
        description=str(data.get("description", "")),
        dram_bandwidth_gbps=number("dram_bandwidth_gbps"),
        onchip_buffer_kib=number("onchip_buffer_kib"),
        launch_overhead_us=number("launch_overhead_us", strict=False),
        peak_gflops={str(k): float(v) for k, v in peaks.items()},
        tile_rows=tile_rows,
        execution_dtype=exec_dtype,
        spill_efficiency=spill_efficiency,
        calibration=calibration if isinstance(calibration, dict) else {},
        vela={str(k): str(v) for k, v in vela.items()},
        source=str(path),
    )
