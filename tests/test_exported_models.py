"""Real models written in torch, exported to ONNX by torch's own exporter, then optimised.

The networks are small ResNet- and MobileNetV2-style nets (no torchvision), with random
BatchNorm statistics and affine parameters (a fresh BatchNorm is the identity in eval mode,
which would make folding trivially "right") and a few BatchNorms with eps=1e-3.

They are exported with the TorchScript exporter (``dynamo=False``) in
``TrainingMode.PRESERVE``: for a model in eval mode that keeps BatchNormalization nodes in
the graph (in ``EVAL`` mode the exporter folds them itself, leaving opfuse nothing to do).
Each test checks the exported graph really has them, then runs ``opfuse.optimize`` with
verification on, and compares the optimised model on ONNX Runtime with torch's own output.
"""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import onnx
import pytest

import torch  # the test extra pins torch==2.13.0 (CPU); torchvision is not used
from torch import nn

import opfuse

from graphs import ort_run, to_proto  # tests/ is on sys.path under pytest's default import mode

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

RTOL_SCALE = 1e-4  # max |onnx - torch| <= 1e-4 * max |torch|


# -- networks ----------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, inp: int, out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out, eps=1e-3)
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class TinyResNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8, eps=1e-3)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)  # with a downsample branch
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def conv_bn_relu6(inp: int, out: int, kernel: int = 3, stride: int = 1, groups: int = 1,
                  eps: float = 1e-5) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(inp, out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out, eps=eps),
        nn.ReLU6(inplace=True),
    )


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, out: int, stride: int, expand: int):
        super().__init__()
        hidden = inp * expand
        self.residual = stride == 1 and inp == out
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(conv_bn_relu6(inp, hidden, kernel=1))
        layers += [
            conv_bn_relu6(hidden, hidden, stride=stride, groups=hidden, eps=1e-3),  # depthwise
            nn.Conv2d(hidden, out, 1, bias=False),
            nn.BatchNorm2d(out),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.residual else self.conv(x)


class TinyMobileNetV2(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            conv_bn_relu6(3, 8, stride=2),
            InvertedResidual(8, 8, 1, 1),  # no expansion, residual
            InvertedResidual(8, 12, 2, 4),
            InvertedResidual(12, 12, 1, 4),  # residual
            conv_bn_relu6(12, 32, kernel=1),
        )
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(32, classes))

    def forward(self, x):
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, 1)
        return self.classifier(torch.flatten(x, 1))


class ConvLinearBN1d(nn.Module):
    """Conv1d + BatchNorm1d, then Linear + BatchNorm1d (with or without the Linear's bias)."""

    def __init__(self, linear_bias: bool):
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, padding=1)
        self.bn = nn.BatchNorm1d(6, eps=1e-3)
        self.fc = nn.Linear(6, 5, bias=linear_bias)
        self.bn_fc = nn.BatchNorm1d(5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.bn_fc(self.fc(x.mean(dim=2)))


class TiedWeights(nn.Module):
    """Two convs with equal weights (the exporter de-duplicates them into an Identity),
    BatchNorms whose statistics equal their affine parameters (Identity again), and one
    conv applied twice (one initializer shared by two Conv nodes)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.b = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn_a = nn.BatchNorm2d(4)
        self.bn_b = nn.BatchNorm2d(4, eps=1e-3)
        self.shared = nn.Conv2d(4, 4, 1)
        self.bn_s1 = nn.BatchNorm2d(4)
        self.bn_s2 = nn.BatchNorm2d(4)

    def tie(self):
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)
            # running_var == weight and running_mean == bias: exported as Identity nodes
            self.bn_s2.running_var.copy_(self.bn_s2.weight.abs() + 0.5)
            self.bn_s2.weight.copy_(self.bn_s2.running_var)
            self.bn_s2.running_mean.copy_(self.bn_s2.bias)
        return self

    def forward(self, x):
        y = self.bn_a(self.a(x)) + self.bn_b(self.b(x))
        y = self.bn_s1(self.shared(torch.relu(y)))
        return self.bn_s2(self.shared(y))


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random BN statistics and affine parameters (so BN is not the identity); eval mode."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.5)
            m.running_var.copy_(torch.rand(n, generator=g) * 1.5 + 0.5)
            m.weight.copy_((torch.rand(n, generator=g) + 0.5) * torch.sign(torch.randn(n, generator=g)))
            m.bias.copy_(torch.randn(n, generator=g) * 0.5)
    return model.eval()


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "resnet":
        return randomize(TinyResNet())
    if name == "mobilenetv2":
        return randomize(TinyMobileNetV2())
    if name == "conv_linear_bias":
        return randomize(ConvLinearBN1d(linear_bias=True))
    if name == "conv_linear_nobias":
        return randomize(ConvLinearBN1d(linear_bias=False))
    if name == "tied":
        return randomize(TiedWeights()).tie()
    raise AssertionError(name)


INPUT_SHAPE = {
    "resnet": (3, 16, 16),
    "mobilenetv2": (3, 16, 16),
    "conv_linear_bias": (4, 10),
    "conv_linear_nobias": (4, 10),
    "tied": (3, 8, 8),
}


def bn_modules(model: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


# -- export and compare ------------------------------------------------------------------


def export(model: nn.Module, name: str, path, opset: int, dynamic: bool, batch: int = 2):
    x = torch.randn(batch, *INPUT_SHAPE[name], generator=torch.Generator().manual_seed(1))
    kwargs = {}
    if dynamic:
        kwargs["dynamic_axes"] = {"input": {0: "batch"}, "output": {0: "batch"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            str(path),
            training=torch.onnx.TrainingMode.PRESERVE,
            dynamo=False,
            opset_version=opset,
            input_names=["input"],
            output_names=["output"],
            **kwargs,
        )
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto)
    return proto


def op_counts(model) -> Counter:
    if isinstance(model, onnx.ModelProto):
        return Counter(n.op_type for n in model.graph.node)
    return Counter(n.op_type for n in model.graph)


def torch_output(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def assert_matches_torch(onnx_model, model: nn.Module, x: np.ndarray) -> None:
    expected = torch_output(model, x)
    (got,) = ort_run(onnx_model, {"input": x}).values()
    assert got.shape == expected.shape, f"{got.shape} != {expected.shape}"
    scale = float(np.max(np.abs(expected)))
    err = float(np.max(np.abs(got.astype(np.float64) - expected)))
    assert err <= RTOL_SCALE * scale, f"max |onnx - torch| {err:.3g} > 1e-4 x scale {scale:.3g}"


def check_optimised(path, proto, model: nn.Module, name: str, batches, **optimize_kwargs):
    """optimize(path) with verification: no BatchNormalization left, every BN module
    folded, and the optimised model equal to torch for every batch size in ``batches``."""
    n_bn = bn_modules(model)
    before = op_counts(proto)
    assert before["BatchNormalization"] == n_bn, (
        f"the exporter should keep {n_bn} BatchNormalization nodes, found {dict(before)}"
    )
    result, report = opfuse.optimize(path, **optimize_kwargs)  # verify=True by default
    assert report.verification is not None and report.verification.ok
    after = op_counts(result)
    assert after["BatchNormalization"] == 0, report.summary()
    folded = [r for r in report.records if r.pattern.endswith("+BatchNormalization")]
    assert len(folded) == n_bn
    assert not [r for r in report.refusals if "BatchNormalization" in r.pattern]
    # nothing else changes but what the clean-up removes: Identity, and Constant nodes
    # (now initializers, as ONNX Runtime makes them when it loads a model)
    assert after["Identity"] == after["Constant"] == 0
    def kept(counts):  # MatMul + BatchNormalization folds into a Gemm
        out = Counter()
        for op, n in counts.items():
            if op not in ("BatchNormalization", "Identity", "Constant"):
                out["Gemm" if op == "MatMul" else op] += n
        return out

    assert kept(after) == kept(before)
    onnx.checker.check_model(to_proto(result))
    rng = np.random.default_rng(7)
    for batch in batches:
        x = rng.standard_normal((batch, *INPUT_SHAPE[name])).astype(np.float32)
        assert_matches_torch(proto, model, x)  # the export itself is right
        assert_matches_torch(result, model, x)
    return result, report


# -- tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("name", ["resnet", "mobilenetv2"])
def test_static_batch(tmp_path, name, opset):
    model = build(name)
    path = tmp_path / f"{name}.onnx"
    proto = export(model, name, path, opset, dynamic=False, batch=2)
    result, report = check_optimised(path, proto, model, name, batches=[2])
    assert report.pattern_counts()["Conv+BatchNormalization"] == bn_modules(model)
    assert all(d.dim_value == 2 for d in to_proto(result).graph.input[0].type.tensor_type.shape.dim[:1])


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("name", ["resnet", "mobilenetv2"])
def test_dynamic_batch(tmp_path, name, opset):
    model = build(name)
    path = tmp_path / f"{name}_dyn.onnx"
    proto = export(model, name, path, opset, dynamic=True)
    result, _ = check_optimised(path, proto, model, name, batches=[1, 3])
    batch_dim = to_proto(result).graph.input[0].type.tensor_type.shape.dim[0]
    assert batch_dim.dim_param == "batch", "the dynamic batch axis must stay symbolic"
    # verification on a batch of 3 as well (symbolic dims set by name)
    _, report = opfuse.optimize(path, dims={"batch": 3})
    assert report.verification.ok
    assert report.verification.outputs[0].shape[0] == 3


def test_depthwise_and_eps_1e3_are_folded_with_their_own_epsilon(tmp_path):
    model = build("mobilenetv2")
    path = tmp_path / "mnv2.onnx"
    proto = export(model, "mobilenetv2", path, 17, dynamic=False)
    eps = sorted(
        round(onnx.helper.get_attribute_value(a), 7)
        for n in proto.graph.node if n.op_type == "BatchNormalization"
        for a in n.attribute if a.name == "epsilon"
    )
    assert 0.001 in eps and 1e-5 in eps
    groups = [
        onnx.helper.get_attribute_value(a)
        for n in proto.graph.node if n.op_type == "Conv" for a in n.attribute if a.name == "group"
    ]
    assert max(groups) > 1, "the export should contain depthwise convolutions"
    _, report = opfuse.optimize(path)
    details = Counter(r.detail for r in report.records)
    assert details["epsilon=0.001"] == sum(
        isinstance(m, nn.BatchNorm2d) and m.eps == 1e-3 for m in model.modules()
    )
    assert any("epsilon" in note for note in report.notes), "mixed epsilons deserve a note"


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("linear_bias", [True, False])
def test_conv1d_and_linear_with_batchnorm1d(tmp_path, linear_bias, opset):
    name = "conv_linear_bias" if linear_bias else "conv_linear_nobias"
    model = build(name)
    path = tmp_path / f"{name}.onnx"
    proto = export(model, name, path, opset, dynamic=True)
    ops = op_counts(proto)
    # what the exporter emits for Linear on a 2-D input: Gemm with a bias, MatMul without
    if linear_bias:
        assert ops["Gemm"] == 1 and ops["MatMul"] == 0, dict(ops)
    else:
        assert ops["MatMul"] == 1 and ops["Gemm"] == 0, dict(ops)
    conv1d = next(n for n in proto.graph.node if n.op_type == "Conv")
    assert [list(a.ints) for a in conv1d.attribute if a.name == "kernel_shape"] == [[3]]
    result, report = check_optimised(path, proto, model, name, batches=[1, 3])
    patterns = report.pattern_counts()
    assert patterns["Conv+BatchNormalization"] == 1
    assert patterns["Gemm+BatchNormalization" if linear_bias else "MatMul+BatchNormalization"] == 1
    after = op_counts(result)
    assert after["Gemm"] == 1 and after["MatMul"] == 0, dict(after)


def test_legacy_exporter_identity_on_weights(tmp_path):
    model = build("tied")
    path = tmp_path / "tied.onnx"
    proto = export(model, "tied", path, 17, dynamic=True)
    inits = {t.name for t in proto.graph.initializer}
    identities = [n for n in proto.graph.node if n.op_type == "Identity" and n.input[0] in inits]
    consumers = {i for n in proto.graph.node for i in n.input}
    # the exporter de-duplicated equal tensors: b.weight (a Conv weight) and some
    # BatchNormalization inputs are Identity nodes on another parameter's initializer
    conv_weights = {n.input[1] for n in proto.graph.node if n.op_type == "Conv"}
    bn_inputs = {i for n in proto.graph.node if n.op_type == "BatchNormalization" for i in n.input[1:]}
    assert any(n.output[0] in conv_weights for n in identities), "no Identity on a Conv weight"
    assert any(n.output[0] in bn_inputs for n in identities), "no Identity on BN parameters"
    shared = [w for w in conv_weights if sum(
        n.op_type == "Conv" and n.input[1] == w for n in proto.graph.node) > 1]
    assert shared, "the conv applied twice should share one weight initializer"
    assert all(n.output[0] in consumers for n in identities)

    result, report = check_optimised(path, proto, model, "tied", batches=[1, 3])
    # nothing dead left behind: no Identity nodes, every initializer still used, and no
    # extra bytes once every user of a shared original has folded
    assert op_counts(result)["Identity"] == 0, dict(op_counts(result))
    unused = [n for n, v in result.graph.initializers.items() if not v.uses()]
    assert not unused, f"unused initializers left: {unused}"
    assert report.extra_bytes == 0
    convs = [n for n in result.graph if n.op_type == "Conv"]
    assert len({id(n.inputs[1]) for n in convs}) == len(convs), "each conv has its own weight"
