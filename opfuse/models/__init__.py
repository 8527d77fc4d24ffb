"""The built-in benchmark networks, generated as ONNX graphs in code: no downloads, no torch.

``build(name, ...)`` returns a fresh ``onnx.ModelProto`` for one of ``BUILTIN_MODELS``,
deterministically from ``seed``. Every network reads ``input`` [batch, 3, H, W] and writes
``logits`` [batch, num_classes]; node and initializer names follow torchvision's module
paths (``layer1.0.conv1``, ``layer1.0.bn1.running_mean``, ``features.3.conv.1.0``, ``fc``).

    resnet18      BasicBlocks [2, 2, 2, 2]             Conv+BN(+Relu), Add    resnet.py
    resnet50      Bottlenecks [3, 4, 6, 3], v1.5       Conv+BN(+Relu), Add    resnet.py
    mobilenetv2   inverted residuals, depthwise convs  Conv+BN(+ReLU6 Clip)   mobilenet.py
    vgg           VGG-11 convs with bias, no BN        Conv+Relu              vgg.py

BatchNorm statistics are calibrated so each BN roughly normalises its input on a
standard-normal image (see ``_builder.py``); a few BNs per network use epsilon 1e-3, the
rest 1e-5. The weights depend on ``name``, ``seed``, ``num_classes`` and ``dtype`` only,
not on ``batch`` or ``image_size``.
"""

from __future__ import annotations

__all__ = ["BUILTIN_MODELS", "build"]

from typing import Callable

import onnx

from opfuse import __version__
from opfuse.models._builder import DTYPES, GraphBuilder, Value
from opfuse.models.mobilenet import mobilenetv2
from opfuse.models.resnet import resnet18, resnet50
from opfuse.models.vgg import vgg

# Five stride-2 reductions (or MaxPools) in every network need at least this many pixels.
MIN_IMAGE_SIZE = 32

# name -> (layers, model doc_string)
_NETWORKS: dict[str, tuple[Callable[[GraphBuilder, int], Value], str]] = {
    "resnet18": (
        resnet18,
        "ResNet-18 (torchvision layout, BasicBlocks [2, 2, 2, 2]): Conv+BatchNorm+Relu "
        "with residual Adds; random weights, BatchNorm statistics calibrated on a "
        "standard-normal input.",
    ),
    "resnet50": (
        resnet50,
        "ResNet-50 v1.5 (torchvision layout, Bottlenecks [3, 4, 6, 3], stride on the 3x3 "
        "conv): Conv+BatchNorm+Relu with residual Adds; random weights, BatchNorm "
        "statistics calibrated on a standard-normal input.",
    ),
    "mobilenetv2": (
        mobilenetv2,
        "MobileNetV2 1.0 (torchvision layout): inverted residual blocks with depthwise "
        "convs, Conv+BatchNorm+ReLU6 (Clip 0..6); random weights, BatchNorm statistics "
        "calibrated on a standard-normal input.",
    ),
    "vgg": (
        vgg,
        "VGG-11-style net without BatchNorm: Conv (with bias) + Relu, MaxPool between "
        "stages, global-pooling classifier 512 -> 512 -> classes; random He-normal weights.",
    ),
}

BUILTIN_MODELS: tuple[str, ...] = tuple(_NETWORKS)


def build(
    name: str,
    *,
    batch: int | str = "batch",
    image_size: int = 224,
    opset: int = 17,
    seed: int = 0,
    dtype: str = "float32",
    num_classes: int = 1000,
) -> onnx.ModelProto:
    """Builds the built-in network ``name`` as a new ModelProto.

    ``batch`` is a static batch size (int) or the name of a symbolic batch dimension (str).
    ``dtype`` is "float32" or "float16" (every initializer, the input and the output).
    Raises ValueError for an unknown name or an unusable argument.
    """
    if name not in _NETWORKS:
        valid = ", ".join(BUILTIN_MODELS)
        raise ValueError(f"unknown model {name!r}; the built-in models are: {valid}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if isinstance(batch, bool) or not (
        (isinstance(batch, int) and batch >= 1) or (isinstance(batch, str) and batch)
    ):
        raise ValueError(f"batch must be a positive int or a dimension name, not {batch!r}")
    if image_size < MIN_IMAGE_SIZE:
        raise ValueError(f"image_size must be at least {MIN_IMAGE_SIZE}, not {image_size}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, not {num_classes}")

    layers, description = _NETWORKS[name]
    graph = GraphBuilder(seed=seed, opset=opset)
    logits = layers(graph, num_classes)
    return graph.to_model(
        logits,
        graph_name=name,
        doc_string=description,
        batch=batch,
        image_size=image_size,
        dtype=dtype,
        producer_version=__version__,
    )
