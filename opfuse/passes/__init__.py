"""Step 3 of the pipeline: the rewrites, one onnx-ir pass per file, selected by name.

=====================  ==========================================================
``fold-batchnorm``     BatchNormalization -> Conv/ConvTranspose/Gemm/MatMul weights
``fold-arithmetic``    constant Add/Sub/Mul/Div -> Conv/ConvTranspose/Gemm weights
=====================  ==========================================================

Each pass appends what it did, and every candidate it refused with the reason, to the
:class:`~opfuse.report.FusionReport` it is given.
"""

from __future__ import annotations

__all__ = ["PASSES", "DEFAULT_PASSES", "make_passes"]

from opfuse.errors import BadInputError
from opfuse.passes.fold_arithmetic import FoldArithmeticPass
from opfuse.passes.fold_batchnorm import FoldBatchNormPass
from opfuse.report import FusionReport

PASSES = {cls.name: cls for cls in (FoldBatchNormPass, FoldArithmeticPass)}

DEFAULT_PASSES = ("fold-batchnorm", "fold-arithmetic")


def make_passes(names, report: FusionReport) -> list:
    """Instantiate the named passes, in order, all writing to ``report``."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise BadInputError(
            f"unknown pass {unknown[0]!r}; known passes: {', '.join(sorted(PASSES))}"
        )
    return [PASSES[n](report) for n in names]
