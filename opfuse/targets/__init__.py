"""What each deployment target can execute, and the passes it runs by default.

- ``onnx`` (the default): portable ONNX only; folding, no fused kernels.
- ``onnxruntime``: folding plus epilogue fusion into ``com.microsoft.FusedConv`` and
  ``FusedGemm`` (:mod:`opfuse.targets.onnxruntime`, which emits those kernels and reads
  them back).
- an accelerator profile (``--hardware``, :mod:`opfuse.targets.accelerator`): the cost
  model that declines fusions which would spill its on-chip buffer.

This package's ``__init__`` is data only (the command line reads it at start-up); the
target modules themselves load onnx and ONNX Runtime.
"""

from __future__ import annotations

__all__ = ["TARGET_DEFAULT_PASSES", "TARGETS", "RUNTIME_LEVELS"]

_FOLDS = ("fold-batchnorm", "fold-arithmetic")
# target -> the passes ``opfuse optimize --target T`` runs when --passes is not given
TARGET_DEFAULT_PASSES: dict[str, tuple[str, ...]] = {
    "onnx": _FOLDS,
    "onnxruntime": _FOLDS + ("fuse-epilogue",),
}
TARGETS = tuple(TARGET_DEFAULT_PASSES)

# ONNX Runtime graph-optimisation levels, by the names the command line uses
RUNTIME_LEVELS: dict[str, str] = {
    "disabled": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}
