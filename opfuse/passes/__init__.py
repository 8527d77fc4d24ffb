"""Step 3 of the pipeline: the rewrites, one onnx-ir pass per file, selected by name.

=====================  ==========================================================
``fold-batchnorm``     BatchNormalization -> Conv/ConvTranspose/Gemm/MatMul weights
``fold-arithmetic``    constant Add/Sub/Mul/Div -> Conv/ConvTranspose/Gemm weights
``fuse-activation``    Conv/Gemm + activation -> FusedConv/FusedGemm (onnxruntime)
``fuse-epilogue``      Conv + residual Add + activation -> FusedConv (onnxruntime)
=====================  ==========================================================

The ``fold-*`` passes emit standard ONNX; the ``fuse-*`` passes emit the target's fused
kernels (:mod:`opfuse.targets`) and so need ``--target onnxruntime``.

Each pass appends what it did, and every candidate it refused with the reason, to the
:class:`~opfuse.report.FusionReport` it is given.
"""

from __future__ import annotations

__all__ = ["PASSES", "DEFAULT_PASSES", "TARGET_DEFAULT_PASSES", "TARGETS", "FUSION_PASSES", "make_passes"]

from opfuse.errors import BadInputError
from opfuse.passes.fold_arithmetic import FoldArithmeticPass
from opfuse.passes.fold_batchnorm import FoldBatchNormPass
from opfuse.passes.fuse_epilogue import ActivationFusionPass, EpilogueFusionPass
from opfuse.report import FusionReport

PASSES = {
    cls.name: cls
    for cls in (FoldBatchNormPass, FoldArithmeticPass, ActivationFusionPass, EpilogueFusionPass)
}
FUSION_PASSES = frozenset({"fuse-activation", "fuse-epilogue"})

DEFAULT_PASSES = ("fold-batchnorm", "fold-arithmetic")
TARGET_DEFAULT_PASSES = {
    "onnx": DEFAULT_PASSES,
    "onnxruntime": DEFAULT_PASSES + ("fuse-epilogue",),
}
TARGETS = tuple(TARGET_DEFAULT_PASSES)


def make_passes(names, report: FusionReport, **fusion_options) -> list:
    """Instantiate the named passes, in order, all writing to ``report``.

    ``fusion_options`` (exclude, veto) go to the fuse-* passes.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise BadInputError(
            f"unknown pass {unknown[0]!r}; known passes: {', '.join(sorted(PASSES))}"
        )
    return [PASSES[n](report, **fusion_options) if n in FUSION_PASSES else PASSES[n](report) for n in names]
