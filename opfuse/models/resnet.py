"""ResNet-18 and ResNet-50 in torchvision's layout, written with the shared GraphBuilder.

    stem   conv1 (7x7/2, pad 3) -> bn1 -> relu -> maxpool (3x3/2, pad 1)
    body   layer1..layer4 of BasicBlocks [2, 2, 2, 2] (ResNet-18) or
           Bottlenecks [3, 4, 6, 3] (ResNet-50, v1.5: the stride sits on the 3x3 conv)
    head   avgpool (GlobalAveragePool) -> flatten -> fc (Gemm, transB=1)

Every conv has no bias and is followed by a BatchNormalization. Inside a block each BN is
followed by a Relu except the last one, which feeds ``layer<i>.<j>.add`` together with the
identity or the ``downsample`` branch (``downsample.0`` conv 1x1, ``downsample.1`` BN);
the Add is followed by the block's last Relu. The last BN of a block starts with a small
gamma (``RESIDUAL_GAMMA``) so the residual stream grows slowly with depth.

BatchNorm epsilon is 1e-3 on the stem BN and on ``layer<i>.0.bn1`` (five BNs in all) and
1e-5 everywhere else, so a fold that ignores epsilon shows up.
"""

from __future__ import annotations

__all__ = ["resnet18", "resnet50"]

from opfuse.models._builder import GraphBuilder, Value

STAGE_WIDTHS = (64, 128, 256, 512)
RESIDUAL_GAMMA = (0.2, 0.6)
WIDE_EPSILON = 1e-3
EPSILON = 1e-5


def resnet18(graph: GraphBuilder, num_classes: int) -> Value:
    """ResNet-18: BasicBlocks [2, 2, 2, 2]; 20 Conv, 20 BN, 17 Relu, 8 Add."""
    return _resnet(graph, _basic_block, expansion=1, depths=(2, 2, 2, 2), num_classes=num_classes)


def resnet50(graph: GraphBuilder, num_classes: int) -> Value:
    """ResNet-50 v1.5: Bottlenecks [3, 4, 6, 3]; 53 Conv, 53 BN, 49 Relu, 16 Add."""
    return _resnet(graph, _bottleneck, expansion=4, depths=(3, 4, 6, 3), num_classes=num_classes)


def _resnet(
    graph: GraphBuilder, block, *, expansion: int, depths: tuple[int, ...], num_classes: int
) -> Value:
    x = graph.conv(graph.input, "conv1", 64, 7, stride=2)
    x = graph.batchnorm(x, "bn1", epsilon=WIDE_EPSILON)
    x = graph.relu(x, "relu")
    x = graph.maxpool(x, "maxpool", 3, stride=2, pad=1)
    for stage, (width, depth) in enumerate(zip(STAGE_WIDTHS, depths), start=1):
        for index in range(depth):
            stride = 2 if stage > 1 and index == 0 else 1
            x = block(graph, x, f"layer{stage}.{index}", width, stride, expansion)
    x = graph.global_average_pool(x, "avgpool")
    x = graph.flatten(x, "flatten")
    return graph.gemm(x, "fc", num_classes, output="logits")


def _basic_block(
    graph: GraphBuilder, x: Value, name: str, width: int, stride: int, expansion: int
) -> Value:
    """conv3x3 -> bn -> relu -> conv3x3 -> bn -> (+ shortcut) -> relu."""
    y = graph.conv(x, f"{name}.conv1", width, 3, stride=stride)
    y = graph.batchnorm(y, f"{name}.bn1", epsilon=_first_bn_epsilon(name))
    y = graph.relu(y, f"{name}.relu1")
    y = graph.conv(y, f"{name}.conv2", width, 3)
    y = graph.batchnorm(y, f"{name}.bn2", epsilon=EPSILON, gamma=RESIDUAL_GAMMA)
    y = graph.add(y, _shortcut(graph, x, name, width * expansion, stride), f"{name}.add")
    return graph.relu(y, f"{name}.relu2")


def _bottleneck(
    graph: GraphBuilder, x: Value, name: str, width: int, stride: int, expansion: int
) -> Value:
    """1x1 -> bn -> relu -> 3x3 (stride) -> bn -> relu -> 1x1 -> bn -> (+ shortcut) -> relu."""
    y = graph.conv(x, f"{name}.conv1", width, 1)
    y = graph.batchnorm(y, f"{name}.bn1", epsilon=_first_bn_epsilon(name))
    y = graph.relu(y, f"{name}.relu1")
    y = graph.conv(y, f"{name}.conv2", width, 3, stride=stride)
    y = graph.batchnorm(y, f"{name}.bn2", epsilon=EPSILON)
    y = graph.relu(y, f"{name}.relu2")
    y = graph.conv(y, f"{name}.conv3", width * expansion, 1)
    y = graph.batchnorm(y, f"{name}.bn3", epsilon=EPSILON, gamma=RESIDUAL_GAMMA)
    y = graph.add(y, _shortcut(graph, x, name, width * expansion, stride), f"{name}.add")
    return graph.relu(y, f"{name}.relu3")


def _shortcut(graph: GraphBuilder, x: Value, name: str, out_channels: int, stride: int) -> Value:
    """The identity, or ``downsample`` (strided conv1x1 -> bn) when the shape changes."""
    if stride == 1 and x.channels == out_channels:
        return x
    y = graph.conv(x, f"{name}.downsample.0", out_channels, 1, stride=stride)
    return graph.batchnorm(y, f"{name}.downsample.1", epsilon=EPSILON)


def _first_bn_epsilon(block_name: str) -> float:
    """1e-3 for the first BN of each stage's first block, 1e-5 elsewhere."""
    return WIDE_EPSILON if block_name.endswith(".0") else EPSILON
