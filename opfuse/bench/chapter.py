"""The chapter's ResNet-50 table (section 4 of the source notes), and its modelled row.

The chapter reports, for ResNet-50 on one NPU, latency, bandwidth and speed-up for no
fusion, Conv+BN, Conv+ReLU and Conv+BN+ReLU (:data:`CHAPTER`). ``opfuse bench`` prints
those numbers beside its own when it runs the same case (built-in ResNet-50, batch 1,
224x224).

The "Conv+ReLU" row
-------------------
On ResNet-50 a BatchNormalization sits between every conv and its Relu, so opfuse's
``conv-act`` (activation into the conv, BN left in place) fuses nothing there. The
chapter's NPU compiler evidently still fused the activations: the row is modelled by
:func:`fuse_activation_into_batchnorm` (each activation runs in the epilogue of the
BatchNormalization kernel that produces its input; BN stays its own kernel, Relus after a
residual Add stay separate). It is a model of what that compiler did, stated as such in
the output and predicted only, never a graph opfuse produces.
"""

from __future__ import annotations

__all__ = ["CHAPTER", "MODELLED_CONV_RELU", "fuse_activation_into_batchnorm", "modelled_conv_relu"]

import dataclasses
from collections.abc import Iterable, Sequence

from opfuse.cost.accelerator import kernels_of
from opfuse.cost.traffic import Kernel, Traffic
from opfuse.core.ops import ACTIVATION_OPS

MODELLED_CONV_RELU = "npu-conv-relu"

# The chapter's section 4 (ResNet-50 on one NPU): row key -> (chapter row, ms, GB/s, speed-up)
CHAPTER: dict[str, tuple[str, float, float, float]] = {
    "none": ("none", 12.5, 18.2, 1.0),
    "conv-bn": ("Conv+BN", 10.1, 22.5, 1.24),
    MODELLED_CONV_RELU: ("Conv+ReLU", 11.3, 20.1, 1.11),
    "conv-bn-act": ("Conv+BN+ReLU", 9.2, 24.8, 1.36),
}


def fuse_activation_into_batchnorm(kernels: Sequence[Kernel], graph_outputs: Iterable[str] = ()) -> list[Kernel]:
    """The chapter's "Conv+ReLU" as its NPU compiler would run it (a modelled configuration).

    Each activation kernel whose input comes from a BatchNormalization kernel, and is that
    kernel's only use (not a graph output), runs in the BN kernel's epilogue. Everything
    else is unchanged. See the module docstring for why this models the chapter's row.
    """
    uses: dict[str, int] = {}
    for k in kernels:
        for t in k.inputs:
            if t is not None:
                uses[t.name] = uses.get(t.name, 0) + 1
    outputs = set(graph_outputs)
    producer = {k.outputs[0].name: i for i, k in enumerate(kernels) if k.outputs}
    merged: list[Kernel | None] = list(kernels)
    for i, k in enumerate(kernels):
        if k.op not in ACTIVATION_OPS or k.epilogue or not k.inputs or k.inputs[0] is None:
            continue
        src = k.inputs[0].name
        j = producer.get(src)
        if j is None or merged[j] is None or merged[j].op != "BatchNormalization":
            continue
        if uses.get(src, 0) != 1 or src in outputs:
            continue
        bn = merged[j]
        merged[j] = dataclasses.replace(
            bn,
            outputs=(k.outputs[0], *bn.outputs[1:]),
            epilogue=(*bn.epilogue, k.op, *k.epilogue),
        )
        merged[i] = None
    return [k for k in merged if k is not None]




def modelled_conv_relu(unfused: Traffic) -> tuple[list[Kernel], str | None]:
    """The modelled Conv+ReLU kernels of the unfused configuration, and the row's note.

    The note is None when no activation would move into a BatchNormalization kernel (the
    row would equal the unfused one, so it is left out).
    """
    kernels = kernels_of(unfused)
    modelled = fuse_activation_into_batchnorm(kernels, unfused.graph_outputs)
    fused_count = len(kernels) - len(modelled)
    if fused_count <= 0:
        return modelled, None
    return modelled, (
        f"the chapter's Conv+ReLU as its NPU compiler must have run it (modelled, predicted "
        f"only): BN kept, each of {fused_count} activations runs in the epilogue of the "
        "BatchNormalization kernel before it"
    )
