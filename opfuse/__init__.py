"""opfuse: an operator-fusion optimiser for neural-network inference.

    model, report = opfuse.optimize("model.onnx", output="model.opt.onnx")
    print(report.summary())

The pipeline: :mod:`opfuse.load` -> :mod:`opfuse.analyse` -> :mod:`opfuse.passes` ->
:mod:`opfuse.verify` -> :mod:`opfuse.save` and :mod:`opfuse.report`.
"""

from opfuse.errors import BadInputError, OpfuseError, VerificationError
from opfuse.passes import DEFAULT_PASSES, PASSES, TARGETS
from opfuse.pipeline import Inspection, inspect_model, optimize
from opfuse.report import FusionRecord, FusionReport, Refusal, Verification

__all__ = [
    "optimize",
    "inspect_model",
    "Inspection",
    "FusionReport",
    "FusionRecord",
    "Refusal",
    "Verification",
    "PASSES",
    "DEFAULT_PASSES",
    "TARGETS",
    "OpfuseError",
    "BadInputError",
    "VerificationError",
]
__version__ = "0.1.0"
