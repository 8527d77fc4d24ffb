"""Step 3 of the pipeline: the rewrites, one onnx-ir pass per file, selected by name.

========================  ==========================================================
``fold-batchnorm``        BatchNormalization -> Conv/ConvTranspose/Gemm/MatMul weights
``fold-arithmetic``       constant Add/Sub/Mul/Div -> Conv/ConvTranspose/Gemm weights
``remove-casts``          Casts to a value's own dtype and exact round trips, removed
``cancel-transposes``     Transposes moved past element-wise ops, inverse pairs removed
``fuse-activation``       Conv/Gemm + activation -> FusedConv/FusedGemm (onnxruntime)
``fuse-epilogue``         Conv + residual Add + activation -> FusedConv (onnxruntime)
``reshape-dims``          Reshape targets computed from shapes -> constants (0 = the input's dim)
``index-arithmetic``      index and mask arithmetic (GatherND over an index grid, Gather of a
                          whole axis, Unsqueeze chains, And/Or/Expand returning their input)
                          in fewer nodes
``fuse-patterns``         LayerNorm, GELU, SiLU, HardSwish, attention... -> the op the target
                          runs (:mod:`opfuse.passes.patterns`)
``pack-projections``      MatMuls reading one input with constant weights -> one MatMul
                          and a Split (packed QKV; onnxruntime, timed by the tuner)
``equalize``              cross-layer equalisation of Conv -> [act] -> Conv weight ranges
                          (before int8 quantisation; no target runs it by default)
``equalize-homogeneous``  the same, refusing a pair whose Clip would become Min/Max
                          (what ``quantize --preset per-tensor`` runs by default)
``dequantize-dynamic``    dynamic int8 (ConvInteger, MatMulInteger, DynamicQuantizeLSTM...)
                          back to float ops with the int8 weights dequantised; not exact
                          (it removes the activations' run-time rounding): ``quantize``
                          runs it on such a model, no target by default
``fuse-dynamic-int8``     DynamicQuantizeLinear + MatMulInteger + Cast + Mul [+ Add] (what
                          ``quantize_dynamic`` writes) -> DynamicQuantizeMatMul or
                          MatMulIntegerToFloat (onnxruntime)
``slices-to-split``       Slices that tile an axis of one tensor -> one Split (an LSTM
                          stack's h0[l:l+1]; after the patterns: onnx, onnxruntime)
``mask-fill``             an additive mask filled with float32's minimum (or -inf) before
                          a Softmax -> Where(allowed, scores, -65504): a value float16 and
                          a 16-bit range hold, the same Softmax; Attention-23's attn_mask
                          from Where(allowed, 0, float32's minimum) -> its fill -32768
                          (``--target qnn``)
``rotary-table``          a rotary embedding's Cos/Sin of angles computed from integer
                          positions -> Gather(table, positions) from a table computed on
                          the CPU, bounded by the graph's attention context (``--target qnn``)
``reciprocal-div``        Reciprocal(x) -> Div(1, x), exact: QNN's HTP computes a quantised
                          Reciprocal of a small-scaled input wrongly (``--target qnn``)
``gathernd-gather``       GatherND(x, indices[..., 1]) -> Gather(x, indices[..., 0], axis=0),
                          exact: QNN's HTP compiler crashes on a GatherND of a constant
                          (a mixture of experts' weights at its router's indices; ``--target qnn``)
``attention-presents``    Attention-23's present -> Slice of the whole axis -> graph output: the
                          Slice goes, exact; QNN's HTP binds a present only as a graph output
                          (a sliding-window cache's Slice; ``--target qnn``)
``rms-norm-rows``         RMSNormalization over the last axis of [.., S, H, D] -> the same on
                          [1, N, D] between two Reshapes, exact: QNN's HTP computes a per-head
                          q/k norm's RmsNorm wrongly (Qwen3, Gemma3; ``--target qnn``)
========================  ==========================================================

Every pass stands on :class:`opfuse.passes.base.OpfusePass`: it declares its name,
whether it emits contrib ops (the ``fuse-*`` passes write the target's fused kernels,
:mod:`opfuse.targets`, and so need ``--target onnxruntime``) and the options it takes,
and records each refusal one way.

This module is the registry, and it is data: the command line lists the passes without
loading onnx. :func:`pass_class` imports a pass's module when a pipeline runs it.
"""

from __future__ import annotations

__all__ = ["REGISTRY", "PASS_NAMES", "DEFAULT_PASSES", "parse_pass_names", "pass_class", "make_passes"]

import importlib

from opfuse.errors import BadInputError
from opfuse.targets import TARGET_DEFAULT_PASSES

# pass name -> "module:class"; adding a pass is adding a row (its class declares the name too)
REGISTRY: dict[str, str] = {
    "fold-batchnorm": "opfuse.passes.fold_batchnorm:FoldBatchNormPass",
    "fold-arithmetic": "opfuse.passes.fold_arithmetic:FoldArithmeticPass",
    "remove-casts": "opfuse.passes.remove_casts:NoOpCastPass",
    "cancel-transposes": "opfuse.passes.cancel_transposes:CancelTransposesPass",
    "fuse-activation": "opfuse.passes.fuse_epilogue:ActivationFusionPass",
    "fuse-epilogue": "opfuse.passes.fuse_epilogue:EpilogueFusionPass",
    "fuse-patterns": "opfuse.passes.fuse_patterns:PatternFusionPass",
    "reshape-dims": "opfuse.passes.reshape_dims:ReshapeDimsPass",
    "index-arithmetic": "opfuse.passes.index_arithmetic:IndexArithmeticPass",
    "pack-projections": "opfuse.passes.pack_projections:PackProjectionsPass",
    "equalize": "opfuse.passes.equalize:EqualizePass",
    "equalize-homogeneous": "opfuse.passes.equalize:HomogeneousEqualizePass",
    "dequantize-dynamic": "opfuse.passes.dequantize_dynamic:DequantizeDynamicPass",
    "mask-fill": "opfuse.passes.mask_fill:MaskFillPass",
    "rotary-table": "opfuse.passes.rotary_table:RotaryTablePass",
    "reciprocal-div": "opfuse.passes.reciprocal_div:ReciprocalDivPass",
    "gathernd-gather": "opfuse.passes.gathernd_gather:GatherNdGatherPass",
    "attention-presents": "opfuse.passes.attention_presents:AttentionPresentsPass",
    "rms-norm-rows": "opfuse.passes.rms_norm_rows:RmsNormRowsPass",
    "fuse-dynamic-int8": "opfuse.passes.fuse_dynamic_int8:FuseDynamicInt8Pass",
    "slices-to-split": "opfuse.passes.slices_to_split:SlicesToSplitPass",
}
PASS_NAMES = tuple(REGISTRY)
DEFAULT_PASSES = TARGET_DEFAULT_PASSES["onnx"]


def parse_pass_names(names) -> list[str]:
    """A list of known pass names from a list or a comma-separated string."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = list(names)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise BadInputError(f"unknown pass {unknown[0]!r}; known passes: {', '.join(sorted(REGISTRY))}")
    return names


def pass_class(name: str):
    """The pass class registered as ``name`` (its module is imported on first use)."""
    module, _, cls = REGISTRY[parse_pass_names([name])[0]].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_passes(names, report, **options) -> list:
    """Instantiate the named passes, in order, all writing to ``report``.

    Each pass receives the ``options`` it declares (``exclude`` and ``veto`` go to the
    fusion passes); options no pass declares are an error.
    """
    classes = [pass_class(n) for n in parse_pass_names(names)]
    declared = set().union(*(c.options for c in classes)) if classes else set()
    stray = sorted(k for k, v in options.items() if v is not None and k not in declared)
    if stray:
        raise TypeError(f"no pass among {names} takes the option {stray[0]!r}")
    return [c(report, **{k: v for k, v in options.items() if k in c.options}) for c in classes]
