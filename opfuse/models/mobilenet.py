"""MobileNetV2 (width 1.0) in torchvision's layout, written with the shared GraphBuilder.

    features.0       conv 3x3/2 3->32 -> BN -> ReLU6         (features.0.0 / .1 / .2)
    features.1..17   inverted residual blocks, per row (t, c, n, s) of INVERTED_RESIDUALS:
                       expand   1x1 conv to t*C_in -> BN -> ReLU6   (conv.0.0/.1/.2; not if t = 1)
                       depthwise 3x3 conv, group = channels, stride s on the first block
                                -> BN -> ReLU6                        (conv.<k>.0/.1/.2)
                       project  1x1 conv to c -> BN, no activation    (conv.<k+1>, conv.<k+2>)
                       add      features.<i>.add when stride 1 and C_in == c
    features.18      conv 1x1 320->1280 -> BN -> ReLU6
    head             avgpool (GlobalAveragePool) -> flatten -> classifier.1 (Gemm)

Convs have no bias. ReLU6 is ``Clip(0, 6)`` (bounds as constant inputs from opset 11 on,
attributes before). 52 Conv, 52 BatchNormalization, 35 Clip, 10 Add.

BatchNorm epsilon is 1e-3 on the stem BN and on the first BN of the first block of every
row (eight BNs in all) and 1e-5 elsewhere. The projection BN of a block with a residual
Add starts with a small gamma so the residual stream grows slowly.
"""

from __future__ import annotations

__all__ = ["mobilenetv2", "INVERTED_RESIDUALS"]

from opfuse.models._builder import DEFAULT_GAMMA, GraphBuilder, Value

# (expand ratio t, output channels c, repeats n, stride of the first block s)
INVERTED_RESIDUALS = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
STEM_CHANNELS = 32
LAST_CHANNELS = 1280
RESIDUAL_GAMMA = (0.2, 0.6)
WIDE_EPSILON = 1e-3
EPSILON = 1e-5


def mobilenetv2(graph: GraphBuilder, num_classes: int) -> Value:
    """MobileNetV2 1.0: 52 Conv, 52 BN, 35 Clip, 10 Add."""
    x = _conv_bn_relu6(
        graph, graph.input, "features.0", STEM_CHANNELS, 3, stride=2, epsilon=WIDE_EPSILON
    )
    index = 1
    for expand_ratio, channels, repeats, stride in INVERTED_RESIDUALS:
        for repeat in range(repeats):
            x = _inverted_residual(
                graph, x, f"features.{index}", channels,
                stride=stride if repeat == 0 else 1,
                expand_ratio=expand_ratio,
                first_epsilon=WIDE_EPSILON if repeat == 0 else EPSILON,
            )
            index += 1
    x = _conv_bn_relu6(graph, x, f"features.{index}", LAST_CHANNELS, 1)
    x = graph.global_average_pool(x, "avgpool")
    x = graph.flatten(x, "flatten")
    return graph.gemm(x, "classifier.1", num_classes, output="logits")


def _inverted_residual(
    graph: GraphBuilder, x: Value, name: str, out_channels: int,
    *, stride: int, expand_ratio: int, first_epsilon: float,
) -> Value:
    hidden = x.channels * expand_ratio
    residual = stride == 1 and x.channels == out_channels
    layers = []  # (out_channels, kernel, stride, group) of the conv-BN-ReLU6 layers
    if expand_ratio != 1:
        layers.append((hidden, 1, 1, 1))
    layers.append((hidden, 3, stride, hidden))  # depthwise

    y = x
    for k, (channels, kernel, layer_stride, group) in enumerate(layers):
        y = _conv_bn_relu6(
            graph, y, f"{name}.conv.{k}", channels, kernel,
            stride=layer_stride, group=group, epsilon=first_epsilon if k == 0 else EPSILON,
        )
    k = len(layers)
    y = graph.conv(y, f"{name}.conv.{k}", out_channels, 1)
    gamma = RESIDUAL_GAMMA if residual else DEFAULT_GAMMA
    y = graph.batchnorm(y, f"{name}.conv.{k + 1}", epsilon=EPSILON, gamma=gamma)
    return graph.add(x, y, f"{name}.add") if residual else y


def _conv_bn_relu6(
    graph: GraphBuilder, x: Value, name: str, out_channels: int, kernel: int,
    *, stride: int = 1, group: int = 1, epsilon: float = EPSILON,
) -> Value:
    """torchvision's Conv2dNormActivation: ``<name>.0`` conv, ``.1`` BN, ``.2`` ReLU6."""
    y = graph.conv(x, f"{name}.0", out_channels, kernel, stride=stride, group=group)
    y = graph.batchnorm(y, f"{name}.1", epsilon=epsilon)
    return graph.relu6(y, f"{name}.2")
