"""The deployment targets, and the passes each runs by default (data: read at start-up).

========================  ===========================================================
``onnx`` (the default)    portable ONNX at the model's opset; folding, standard-op
                          patterns, no fused kernels (:mod:`opfuse.targets.onnx`)
``onnxruntime``           ONNX Runtime's CPU provider: folding, its contrib ops for the
                          patterns, epilogues fused into ``com.microsoft.FusedConv`` /
                          ``FusedGemm``, its NCHWc layout kept
                          (:mod:`opfuse.targets.onnxruntime`)
``qnn``                   Qualcomm's HTP NPU (ONNX Runtime's QNN provider): static
                          shapes, folding, standard-op patterns (Gelu as QNN takes it),
                          ops QNN cannot run unfused (:mod:`opfuse.targets.qnn`)
``ethos-u``               Arm's Ethos-U NPUs: static shapes, folding, standard-op
                          patterns, the norms TFLite has no op for unfused; lowered
                          to int8 TFLite, compiled by Vela (:mod:`opfuse.targets.ethos_u`)
========================  ===========================================================

A target module holds one :class:`~opfuse.targets.kernels.Target` named ``TARGET``: the
kernels it executes and its fuse / keep / unfuse policy per pattern. Adding a target is
adding a module and a row here.

What a graph costs on a target, modelled (memory traffic, an accelerator's latency), is
:mod:`opfuse.cost`; a target's device code sits beside it (``targets/qnn/``,
``targets/ethos_u/``).
"""

from __future__ import annotations

__all__ = ["TARGET_MODULES", "TARGET_DEFAULT_PASSES", "TARGETS", "RUNTIME_LEVELS"]

# a no-op Cast can sit between a layer and its map; Transposes left between the folded layers cancel
_FOLDS = ("remove-casts", "fold-batchnorm", "fold-arithmetic", "cancel-transposes")
# target -> the module that declares it
TARGET_MODULES: dict[str, str] = {
    "onnx": "opfuse.targets.onnx",
    "onnxruntime": "opfuse.targets.onnxruntime",
    "qnn": "opfuse.targets.qnn",
    "ethos-u": "opfuse.targets.ethos_u",
}
# target -> the passes ``opfuse optimize --target T`` runs when --passes is not given
TARGET_DEFAULT_PASSES: dict[str, tuple[str, ...]] = {
    "onnx": _FOLDS + ("reshape-dims", "index-arithmetic", "fuse-patterns", "slices-to-split"),
    "onnxruntime": _FOLDS + ("reshape-dims", "index-arithmetic", "fuse-patterns", "pack-projections", "fuse-epilogue",
                             "fuse-dynamic-int8", "slices-to-split"),
    # mask-fill after fuse-patterns: an Add(scores, mask) it rewrites is no longer attention's spelling;
    # rotary-table last: its bound is the attention context the bound dims give
    # gathernd-gather after index-arithmetic: a GatherND over an index grid becomes Gathers there first
    # attention-presents and rms-norm-rows after fuse-patterns: they read the Attention and RMSNormalization it writes
    "qnn": _FOLDS + ("reshape-dims", "index-arithmetic", "gathernd-gather", "fuse-patterns", "mask-fill",
                   "attention-presents", "rms-norm-rows", "rotary-table", "reciprocal-div"),
    "ethos-u": _FOLDS + ("reshape-dims", "index-arithmetic", "fuse-patterns"),
}
TARGETS = tuple(TARGET_MODULES)

# ONNX Runtime graph-optimisation levels, by the names the command line uses
RUNTIME_LEVELS: dict[str, str] = {
    "disabled": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}
