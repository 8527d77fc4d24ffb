"""A VGG-11-style network without BatchNorm, written with the shared GraphBuilder.

    features      VGG-11 conv stages 64 | 128 | 256 256 | 512 512 | 512 512, each conv
                  3x3 with bias followed directly by Relu, MaxPool 2x2/2 after each stage
                  (torchvision numbering: features.0 conv, features.1 relu, features.2 pool, ...)
    head          avgpool (GlobalAveragePool) -> flatten -> classifier.0 (Gemm 512->512)
                  -> classifier.1 (Relu) -> classifier.2 (Gemm 512->num_classes)

The head is smaller than torchvision's (global pooling instead of 7x7x512 -> 4096 -> 4096)
to keep the model modest. Conv weights are He-normal on fan_in, which keeps the activation
scale steady through the ReLUs without any normalisation. This is the network where
Conv + Relu fuses with no BatchNorm to fold: 8 Conv, 9 Relu, 5 MaxPool, 2 Gemm.
"""

from __future__ import annotations

__all__ = ["vgg", "VGG11_LAYOUT"]

from opfuse.models._builder import GraphBuilder, Value

# Conv output widths, "M" for a MaxPool: torchvision's configuration "A" (VGG-11).
VGG11_LAYOUT = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
HIDDEN_FEATURES = 512


def vgg(graph: GraphBuilder, num_classes: int) -> Value:
    """VGG-11 features with a small global-pooling classifier."""
    x = graph.input
    index = 0
    for layer in VGG11_LAYOUT:
        if layer == "M":
            x = graph.maxpool(x, f"features.{index}", 2, stride=2)
            index += 1
        else:
            x = graph.conv(x, f"features.{index}", layer, 3, bias=True, fan="fan_in")
            x = graph.relu(x, f"features.{index + 1}")
            index += 2
    x = graph.global_average_pool(x, "avgpool")
    x = graph.flatten(x, "flatten")
    x = graph.gemm(x, "classifier.0", HIDDEN_FEATURES)
    x = graph.relu(x, "classifier.1")
    return graph.gemm(x, "classifier.2", num_classes, output="logits")
