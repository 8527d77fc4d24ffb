"""What each deployment target can execute.

- ``onnx`` (the default): portable ONNX only; folding, no fused kernels.
- ``onnxruntime``: folding plus epilogue fusion into ``com.microsoft.FusedConv`` and
  ``FusedGemm`` (:mod:`opfuse.targets.onnxruntime`).
"""
