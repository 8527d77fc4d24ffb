"""opfuse: an operator-fusion optimiser for neural-network inference.

    model, report = opfuse.optimize("model.onnx", output="model.opt.onnx")
    print(report.summary())

The pipeline: :mod:`opfuse.load` -> :mod:`opfuse.core.analysis` -> :mod:`opfuse.passes` ->
:mod:`opfuse.verify` -> :mod:`opfuse.save` and :mod:`opfuse.report`.

The public names below are loaded on first use (PEP 562): ``import opfuse`` and
``opfuse --version`` cost nothing, and the pipeline (onnx, onnx-ir, ONNX Runtime) loads
when something asks for it.
"""

from __future__ import annotations

import importlib

from opfuse.passes import PASS_NAMES, pass_class

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "optimize": "opfuse.pipeline",
    "OptimizeOptions": "opfuse.pipeline",
    "inspect_model": "opfuse.pipeline",
    "quantize": "opfuse.quantization.pipeline",
    "QuantReport": "opfuse.quantization.report",
    "Inspection": "opfuse.pipeline",
    "FusionReport": "opfuse.report",
    "FusionRecord": "opfuse.report",
    "Refusal": "opfuse.report",
    "Verification": "opfuse.report",
    "PASS_NAMES": "opfuse.passes",
    "DEFAULT_PASSES": "opfuse.passes",
    "TARGETS": "opfuse.targets",
    "OpfuseError": "opfuse.errors",
    "BadInputError": "opfuse.errors",
    "VerificationError": "opfuse.errors",
}
__all__ = [*_EXPORTS, "PASSES", "__version__"]


def __getattr__(name: str):
    if name == "PASSES":  # name -> pass class; importing every pass
        return {n: pass_class(n) for n in PASS_NAMES}
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'opfuse' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
