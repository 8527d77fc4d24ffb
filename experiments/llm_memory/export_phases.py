"""Peak RSS of ``opfuse llm``'s export step, phase by phase, in this process (sampled every 20 ms).

    python experiments/llm_memory/export_phases.py SOURCE OUT_DIR [WINDOWS]

Runs :func:`opfuse.llm._export_step` (the load, the tokenizer, the genai files, the dynamo export,
its save) here, with transformers' GGUF reader, the tokenizer's load, torch.export, the exporter's
translation, its optimiser and the save marked; prints each phase's peak and its RSS at the end, and
this process's VmHWM. ``WINDOWS``: calibration windows (the default command's 8). Measurements only.
"""

from __future__ import annotations

import pathlib
import sys
import threading
import time


def _status_mb(key: str) -> float:
    """A /proc/self/status line (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def _hwm_mb() -> float:
    return _status_mb("VmHWM")


phases: list[list] = []  # name, peak, rss at its end


def mark(name: str) -> None:
    if phases:
        phases[-1][2] = _rss_mb()
    phases.append([name, _rss_mb(), 0.0])


def wrap(owner, attr: str, name: str, method: bool = False) -> None:
    original = getattr(owner, attr)
    if method:  # (a classmethod: wrap the function, keep it a classmethod)
        function = original.__func__

        def wrapped(cls, *a, **k):
            mark(name)
            try:
                return function(cls, *a, **k)
            finally:
                mark(f"after {name}")

        setattr(owner, attr, classmethod(wrapped))
        return

    def wrapped(*a, **k):
        mark(name)
        try:
            return original(*a, **k)
        finally:
            mark(f"after {name}")

    setattr(owner, attr, wrapped)


def main() -> int:
    mark("start")

    def sample():
        while True:
            phases[-1][1] = max(phases[-1][1], _rss_mb())
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from torch.onnx._internal.exporter import _core, _onnx_program
    from transformers import AutoTokenizer

    import opfuse.llm.export as export
    from opfuse.llm import _export_step

    mark("imports done")
    wrap(gguf_utils, "load_gguf_checkpoint", "transformers' GGUF reader")
    wrap(AutoTokenizer, "from_pretrained", "tokenizer", method=True)
    wrap(export, "load", "load")
    wrap(torch.export, "export", "torch.export.export")
    wrap(_core, "_exported_program_to_onnx_program", "translation")
    wrap(_onnx_program.ONNXProgram, "optimize", "the exporter's optimiser")
    out = pathlib.Path(sys.argv[2])
    _export_step(sys.argv[1], out / "export" / "model.onnx", out / "genai", int(sys.argv[3]) if len(sys.argv) > 3 else 8)
    mark("end")
    print("| phase | peak RSS MB | RSS at its end MB |")
    print("|---|---|---|")
    for name, peak, end in phases[:-1]:
        print(f"| {name} | {peak:.0f} | {end:.0f} |")
    print(f"VmHWM {_hwm_mb():.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
