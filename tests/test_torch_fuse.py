"""opfuse.torch: folding algebra, graph fusion, oneDNN kernels, refusals, export.

Equality is always against the unfused eval model, in float32, within
max|fused - ref| <= 1e-5 * max|ref| + 1e-5 * |ref| (elementwise).
"""

from __future__ import annotations

import copy
import operator
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import opfuse.torch as oft
from opfuse.torch import fold_conv_bn_weights, fold_linear_bn_weights, fuse
from opfuse.torch.kernels import ConvAddPointwise, ConvPointwise, kernels_available

import torch_nets

KERNELS = kernels_available() is None


@pytest.fixture(autouse=True, scope="module")
def _two_torch_threads():
    """This file's tests run torch on at most two threads, and give the count back after: set at
    import, the count reached every test of the process, the tests of other files collected with
    this one (a pytest-xdist worker imports every file), where the run asked for one thread a worker
    (``OMP_NUM_THREADS=1``, tests/conftest.py) and two threads a worker oversubscribe the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, before))
    yield
    torch.set_num_threads(before)


def assert_close(ref: torch.Tensor, out: torch.Tensor, tol: float = 1e-5) -> None:
    ref, out = ref.double(), out.double()
    assert ref.shape == out.shape
    scale = float(ref.abs().max())
    excess = (ref - out).abs() - (tol * scale + tol * ref.abs())
    assert float(excess.max()) <= 0, (
        f"max |diff| {float((ref - out).abs().max()):.3g} at scale {scale:.3g}")


def check(model: nn.Module, *inputs: torch.Tensor, **kw):
    """Fuse ``model`` (eval) with example inputs; assert equality; return (fused, report)."""
    model = model.eval()
    with torch.no_grad():
        ref = model(*inputs)
    fused, report = fuse(model, inputs, **kw)
    with torch.no_grad():
        out = fused(*inputs)
    assert_close(ref, out)
    if report.verification is not None and not report.verification.skipped:
        assert report.verification.ok
    return fused, report


@torch.no_grad()
def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    return torch_nets.randomize_batchnorm(model, seed=seed, eps_1e3_every=2)


def count(module: nn.Module, cls) -> int:
    return sum(isinstance(m, cls) for m in module.modules())


# -- the algebra, as pure functions ----------------------------------------------------------


def test_fold_conv_bn_weights_matches_hand_computation_with_the_modules_eps():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, 3, 3, generator=g)
    mean, var = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.1
    gamma, beta = torch.randn(4, generator=g), torch.randn(4, generator=g)
    eps = 1e-3
    fw, fb = fold_conv_bn_weights(w, None, mean, var, eps, gamma, beta)
    # by hand, in float64: s = gamma / sqrt(var + eps); W' = s W; b' = beta - mean * s
    s = gamma.double() / torch.sqrt(var.double() + eps)
    assert fw.dtype == torch.float32 and fb.dtype == torch.float32
    assert torch.equal(fw, (w.double() * s.view(-1, 1, 1, 1)).float())
    assert torch.equal(fb, (beta.double() - mean.double() * s).float())
    # the chapter's bug: 1e-5 instead of the layer's 1e-3 gives other weights
    wrong_w, _ = fold_conv_bn_weights(w, None, mean, var, 1e-5, gamma, beta)
    assert not torch.allclose(wrong_w, fw, rtol=1e-4, atol=0)


def test_fold_conv_bn_weights_with_bias_and_affine_false():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(5, 2, 1, 1, generator=g), torch.randn(5, generator=g)
    mean, var = torch.randn(5, generator=g), torch.rand(5, generator=g) + 0.5
    fw, fb = fold_conv_bn_weights(w, b, mean, var, 1e-5, None, None)
    s = 1 / torch.sqrt(var.double() + 1e-5)
    assert torch.allclose(fw.double(), w.double() * s.view(-1, 1, 1, 1), rtol=1e-7)
    assert torch.allclose(fb.double(), (b.double() - mean.double()) * s, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_fold_conv_transpose_bn_weights_is_group_aware(groups):
    torch.manual_seed(groups)
    ct = nn.ConvTranspose2d(8, 12, 3, stride=2, groups=groups, bias=False)
    bn = randomize(nn.BatchNorm2d(12)).eval()
    w, b = fold_conv_bn_weights(ct.weight, None, bn.running_mean, bn.running_var, bn.eps,
                                bn.weight, bn.bias, transpose=True, groups=groups)
    x = torch.randn(2, 8, 5, 5)
    with torch.no_grad():
        ref = bn(ct(x))
        out = F.conv_transpose2d(x, w, b, stride=2, groups=groups)
    assert_close(ref, out)


def test_fold_linear_bn_weights():
    torch.manual_seed(0)
    lin, bn = nn.Linear(6, 4), randomize(nn.BatchNorm1d(4)).eval()
    w, b = fold_linear_bn_weights(lin.weight, lin.bias, bn.running_mean, bn.running_var,
                                  bn.eps, bn.weight, bn.bias)
    x = torch.randn(3, 6)
    with torch.no_grad():
        assert_close(bn(lin(x)), F.linear(x, w, b))


def test_fold_raises_when_the_result_overflows_the_dtype():
    w = torch.full((2, 1, 1, 1), 60000.0, dtype=torch.float16)
    ones = torch.ones(2, dtype=torch.float16)
    with pytest.raises(oft.FoldingError, match="overflow"):
        fold_conv_bn_weights(w, None, ones * 0, ones * 0, 1e-5, ones * 100, ones * 0)


# -- whole networks ----------------------------------------------------------------------------


@pytest.mark.parametrize("name,size", [("resnet18", 96), ("resnet50", 64), ("mobilenetv2", 96)])
def test_networks_equal_the_unfused_model(name, size):
    model = torch_nets.build(name)
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0))
    fused, report = check(model, x)
    assert count(fused, nn.modules.batchnorm._BatchNorm) == 0  # every BN folded
    assert report.ops_after.get("BatchNorm2d", 0) == 0
    assert not report.refusals, report.refusals
    counts = report.pattern_counts()
    assert counts["Conv+BatchNormalization"] == count(model, nn.BatchNorm2d)
    if KERNELS:
        assert count(fused, nn.Conv2d) == 0  # every conv is a oneDNN kernel module
        if name.startswith("resnet"):
            assert counts["Conv+Relu"] > 0 and counts["Conv+Add+Relu"] > 0
        else:
            assert counts["Conv+Clip"] > 0 and counts["Conv+Add"] == 10
    # a different input shape than the one the weights were packed for still works
    y = torch.randn(1, 3, size + 32, size + 32)
    with torch.no_grad():
        assert_close(model(y), fused(y))


def test_fuse_without_example_inputs_and_unfused_model_untouched():
    model = torch_nets.build("resnet18")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fused, report = fuse(model)  # no example inputs: no shapes, no verification
    assert report.verification is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # bit-identical
    assert count(model, nn.BatchNorm2d) == 20  # the caller's model still has its BNs
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert_close(model(x), fused(x))


def test_inplace_true_also_keeps_the_callers_model_working():
    model = torch_nets.build("resnet18")
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
    fused, _ = fuse(model, (x,), inplace=True)
    with torch.no_grad():
        assert_close(ref, fused(x))
        assert torch.equal(ref, model(x))


# -- conv / BN variants ----------------------------------------------------------------------------


class ConvBN(nn.Module):
    def __init__(self, conv: nn.Module, bn: nn.Module, act: nn.Module | None = None):
        super().__init__()
        self.conv, self.bn, self.act = conv, bn, act or nn.Identity()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


CASES = {
    "conv2d bias": (lambda: nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), (2, 4, 9, 9)),
    "conv2d no bias": (lambda: nn.Conv2d(4, 6, 3, bias=False), nn.BatchNorm2d(6), (2, 4, 9, 9)),
    "grouped": (lambda: nn.Conv2d(8, 12, 3, stride=2, groups=4, bias=False),
                nn.BatchNorm2d(12), (2, 8, 9, 9)),
    "depthwise": (lambda: nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8, bias=False),
                  nn.BatchNorm2d(8), (2, 8, 9, 9)),
    "same padding": (lambda: nn.Conv2d(4, 6, 3, padding="same"), nn.BatchNorm2d(6), (1, 4, 7, 7)),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, padding=1), nn.BatchNorm1d(6), (2, 4, 11)),
    "conv3d": (lambda: nn.Conv3d(4, 6, 3, padding=1, bias=False), nn.BatchNorm3d(6),
               (2, 4, 5, 5, 5)),
    "convtranspose2d groups": (
        lambda: nn.ConvTranspose2d(8, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
        nn.BatchNorm2d(6), (2, 8, 5, 5)),
    "convtranspose1d": (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, bias=False),
                        nn.BatchNorm1d(6), (2, 4, 7)),
    "convtranspose3d groups": (lambda: nn.ConvTranspose3d(4, 6, 2, stride=2, groups=2),
                               nn.BatchNorm3d(6), (1, 4, 3, 3, 3)),
    "bn affine=False": (lambda: nn.Conv2d(4, 6, 3), nn.BatchNorm2d(6, affine=False),
                        (2, 4, 9, 9)),
    "bn eps=0.1": (lambda: nn.Conv2d(4, 6, 1), nn.BatchNorm2d(6, eps=0.1), (2, 4, 5, 5)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("act", [None, nn.ReLU])
def test_conv_bn_variants(case, act):
    make_conv, bn, shape = CASES[case]
    torch.manual_seed(0)
    model = randomize(ConvBN(make_conv(), copy.deepcopy(bn), act and act()))
    fused, report = check(model, torch.randn(shape))
    kind = "ConvTranspose" if "transpose" in case else "Conv"
    assert len(report.applied(f"{kind}+BatchNormalization")) == 1
    assert count(fused, nn.modules.batchnorm._BatchNorm) == 0
    if act is not None and KERNELS:
        assert len(report.applied(f"{kind}+Relu")) == 1
        assert count(fused, ConvPointwise) == 1 and count(fused, nn.ReLU) == 0


def test_eps_is_read_from_each_batchnorm():
    torch.manual_seed(0)
    model = randomize(ConvBN(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3)))
    model.bn.running_var.fill_(1e-3)  # eps now matters: 1e-5 instead would be ~40% off
    fused, report = check(model, torch.randn(1, 3, 6, 6))
    assert "eps=0.001" in report.applied("Conv+BatchNormalization")[0].detail


def test_linear_bn1d():
    torch.manual_seed(0)
    model = randomize(nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.ReLU()))
    fused, report = check(model, torch.randn(5, 8))
    assert len(report.applied("Linear+BatchNormalization")) == 1
    assert count(fused, nn.BatchNorm1d) == 0


def test_linear_bn1d_needs_shapes_and_refuses_3d_outputs():
    torch.manual_seed(0)
    model = randomize(nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))).eval()
    _, report = fuse(model)  # rank unknown without example inputs
    assert "pass example_inputs" in report.reason_for("1")
    _, report = check(model, torch.randn(2, 6, 6))  # [N, L, C]: BN1d normalises L, not C
    assert "not the Linear's feature dim" in report.reason_for("1")


# -- epilogues ------------------------------------------------------------------------------------


class ConvAct(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), act

    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.act(y) if isinstance(self.act, nn.Module) else self.act(y)


EPILOGUES = [
    (nn.ReLU(), "Conv+Relu"),
    (nn.ReLU6(), "Conv+Clip"),
    (nn.Hardtanh(-0.5, 0.7), "Conv+Clip"),
    (nn.LeakyReLU(0.2), "Conv+LeakyRelu"),
    (nn.SiLU(), "Conv+SiLU"),
    (nn.Sigmoid(), "Conv+Sigmoid"),
    (nn.Tanh(), "Conv+Tanh"),
    (nn.GELU(approximate="tanh"), "Conv+Gelu"),
    (nn.Hardswish(), "Conv+HardSwish"),
    (F.relu, "Conv+Relu"),
    (torch.relu, "Conv+Relu"),
    (lambda y: y.relu(), "Conv+Relu"),
    (F.relu6, "Conv+Clip"),
    (lambda y: F.hardtanh(y, 0.0, 4.0), "Conv+Clip"),
    (lambda y: torch.clamp(y, -1.0, 1.0), "Conv+Clip"),
    (lambda y: F.leaky_relu(y, 0.3), "Conv+LeakyRelu"),
    (F.silu, "Conv+SiLU"),
    (torch.sigmoid, "Conv+Sigmoid"),
    (torch.tanh, "Conv+Tanh"),
    (F.gelu, "Conv+Gelu"),
]


@pytest.mark.parametrize("act,pattern", EPILOGUES,
                         ids=[f"{p}-{i}" for i, (_, p) in enumerate(EPILOGUES)])
def test_activation_epilogues(act, pattern):
    torch.manual_seed(0)
    model = randomize(ConvAct(act))
    fused, report = check(model, torch.randn(2, 4, 8, 8) * 3)
    assert len(report.applied("Conv+BatchNormalization")) == 1
    if KERNELS:
        assert [r.pattern for r in report.records] == ["Conv+BatchNormalization", pattern]
        (kernel,) = [m for m in fused.modules() if isinstance(m, ConvPointwise)]
        assert kernel.prepack
        assert not report.refusals


class Residual(nn.Module):
    def __init__(self, add, relu):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6)
        self.conv2, self.bn2 = nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6)
        self.add, self.relu = add, relu

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return self.relu(self.add(y, x))


@pytest.mark.parametrize("add", [operator.add, torch.add, lambda a, b: b + a,
                                 lambda a, b: a.add(b)], ids=["op", "torch.add", "radd", "method"])
@pytest.mark.parametrize("relu", [nn.ReLU(), F.relu, nn.Identity()], ids=["ReLU", "F.relu", "none"])
def test_conv_add_relu_residual(add, relu):
    torch.manual_seed(0)
    model = randomize(Residual(add, relu))
    fused, report = check(model, torch.randn(2, 6, 8, 8))
    if KERNELS:
        pattern = "Conv+Add" if isinstance(relu, nn.Identity) else "Conv+Add+Relu"
        assert len(report.applied(pattern)) == 1
        assert count(fused, ConvAddPointwise) == 1
        assert not report.refusals


def test_conv_add_with_a_broadcast_addend_falls_back_at_run_time(monkeypatch):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x, bias):
            return F.relu(self.conv(x) + bias)

    model = M().eval()
    x, bias = torch.randn(1, 3, 5, 5), torch.randn(1, 4, 1, 1)
    fused, report = check(model, x, bias)  # the shape guard routes around the kernel
    if not KERNELS:
        pytest.skip(f"oneDNN's fused kernels are not available ({kernels_available()}): nothing to fall back from")
    assert len(report.applied("Conv+Add+Relu")) == 1, report.refusals
    assert count(fused, ConvAddPointwise) == 1
    routes = []  # which way each call of the fused conv goes: the plain conv, or oneDNN's kernel
    for route, name in (("plain", "_plain"), ("kernel", "_kernel_weight")):
        original = getattr(ConvAddPointwise, name)
        monkeypatch.setattr(ConvAddPointwise, name,
                            lambda self, t, _o=original, _r=route: routes.append(_r) or _o(self, t))
    with torch.no_grad():
        assert_close(model(x, bias), fused(x, bias))
    assert routes == ["plain"]  # a [1, 4, 1, 1] addend is not the kernel's [1, 4, 5, 5]: it falls back
    full = torch.randn(1, 4, 5, 5)
    with torch.no_grad():
        assert_close(model(x, full), fused(x, full))
    assert routes == ["plain", "kernel"]  # the same module runs the kernel when the addend's shape fits


def test_conv1d_add_is_refused_with_the_kernels_reason():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(4, 4, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.conv(x) + x)

    if not KERNELS:
        pytest.skip(f"oneDNN kernels unavailable: {kernels_available()}")
    _, report = check(M(), torch.randn(2, 4, 9))
    reason = report.reason_for("add")
    assert reason is not None and "1-D" in reason and "2d and 3d" in reason


def test_float64_model_folds_but_keeps_plain_convs_with_a_reason():
    torch.manual_seed(0)
    model = randomize(ConvBN(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())).double()
    fused, report = check(model, torch.randn(1, 3, 6, 6, dtype=torch.float64))
    assert len(report.applied("Conv+BatchNormalization")) == 1
    assert "float64" in report.reason_for("act")
    assert count(fused, nn.Conv2d) == 1 and count(fused, nn.ReLU) == 1


def test_bfloat16_uses_what_the_probe_accepts():
    torch.manual_seed(0)
    model = randomize(Residual(operator.add, nn.ReLU())).to(torch.bfloat16).eval()
    x = torch.randn(2, 6, 8, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
    fused, report = fuse(model, (x,))
    with torch.no_grad():
        assert_close(ref, fused(x), tol=2e-2)
    assert report.verification.ok
    assert len(report.applied("Conv+BatchNormalization")) == 2
    if KERNELS:  # whatever oneDNN rejects in bfloat16 is refused with its own message
        for refusal in report.refusals:
            assert "bfloat16" in refusal.reason


# -- module reuse --------------------------------------------------------------------------------


class SharedConv(nn.Module):
    """One conv called at two sites, each followed by its own BN (or by none)."""

    def __init__(self, second_bn: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn_a = nn.BatchNorm2d(4)
        self.bn_b = nn.BatchNorm2d(4) if second_bn else nn.Identity()

    def forward(self, x):
        return torch.relu(self.bn_a(self.conv(x))) + self.bn_b(self.conv(x * 2))


@pytest.mark.parametrize("second_bn", [True, False], ids=["two BNs", "one BN"])
def test_module_reuse_trap(second_bn):
    torch.manual_seed(0)
    model = randomize(SharedConv(second_bn))
    weight = model.conv.weight.detach().clone()
    x = torch.randn(2, 3, 6, 6)
    fused, report = check(model, x)
    assert torch.equal(model.conv.weight, weight)  # the shared original is untouched
    folds = report.applied("Conv+BatchNormalization")
    assert len(folds) == (2 if second_bn else 1)
    assert all("called at 2 sites" in r.detail for r in folds[:1])
    assert report.extra_bytes > 0  # one conv became two
    # each site is computed from its own module: neither fold leaked into the other site
    a = fused.get_submodule(folds[0].produced)
    assert not torch.equal(a.weight, weight)


def test_module_reuse_with_the_same_bn_shares_one_folded_copy():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.conv(x)) * self.bn(self.conv(-x))

    torch.manual_seed(0)
    fused, report = check(randomize(M()), torch.randn(1, 3, 4, 4), kernels=False)
    assert len(report.applied("Conv+BatchNormalization")) == 2
    assert report.extra_bytes == 0 and count(fused, nn.Conv2d) == 1


# -- refusals -----------------------------------------------------------------------------------


def test_refuses_batchnorm_in_training_mode():
    torch.manual_seed(0)
    model = randomize(ConvBN(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))).eval()
    model.bn.train()
    stats = model.bn.running_mean.clone()
    fused, report = fuse(model, (torch.randn(2, 3, 5, 5),))
    assert "training mode" in report.reason_for("bn")
    assert report.verification.skipped  # running it would update the BN's statistics
    assert torch.equal(model.bn.running_mean, stats)
    assert count(fused, nn.BatchNorm2d) == 1


def test_refuses_batchnorm_without_running_stats():
    torch.manual_seed(0)
    model = ConvBN(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False))
    fused, report = check(model, torch.randn(2, 3, 5, 5))
    assert "no running statistics" in report.reason_for("bn")
    assert count(fused, nn.BatchNorm2d) == 1


def test_refuses_when_the_conv_output_has_two_consumers():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + self.relu(y)

    torch.manual_seed(0)
    fused, report = check(randomize(M()), torch.randn(1, 3, 6, 6))
    assert "also read by relu" in report.reason_for("bn")
    assert "read by 2 nodes" in report.reason_for("relu")
    assert not report.applied("Conv+BatchNormalization")


def test_refusal_for_a_batchnorm_after_a_pool():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.MaxPool2d(2), nn.BatchNorm2d(4))
    _, report = check(randomize(model), torch.randn(1, 3, 6, 6))
    assert "follows MaxPool2d" in report.reason_for("2")


def test_untraceable_model_is_captured_with_torch_export():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4, eps=1e-3)

        def forward(self, x):
            if x.shape[-1] > 4:  # control flow on a shape: torch.fx cannot trace this,
                x = x * 2  # torch.export specialises it to the example input's shape
            return F.relu(self.bn(self.conv(x)))

    torch.manual_seed(0)
    model = randomize(M()).eval()
    x = torch.randn(1, 3, 6, 6)
    _, report = fuse(model)  # no example inputs: refused, with what to do
    assert "pass example_inputs" in report.reason_for("M")
    fused, report = check(model, x)
    assert report.passes[0] == "torch.export"
    assert len(report.applied("Conv+BatchNormalization")) == 1
    if KERNELS:
        assert len(report.applied("Conv+Relu")) == 1


# -- the kernel modules ------------------------------------------------------------------------


def test_fused_module_deepcopies_pickles_and_differentiates():
    torch.manual_seed(0)
    model = randomize(ConvBN(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU6()))
    x = torch.randn(1, 3, 6, 6)
    fused, _ = check(model, x)
    with torch.no_grad():
        ref = fused(x)
        assert torch.equal(copy.deepcopy(fused)(x), ref)
        assert torch.equal(pickle.loads(pickle.dumps(fused))(x), ref)
    xg = x.clone().requires_grad_()
    fused(xg).sum().backward()  # autograd takes the plain path
    assert xg.grad is not None


# -- random chains (property test) -------------------------------------------------------------

ACTS = [None, nn.ReLU, nn.ReLU6, lambda: nn.LeakyReLU(0.1), lambda: nn.Hardtanh(-2.0, 1.5),
        nn.SiLU, nn.Sigmoid, nn.Tanh, lambda: F.relu, lambda: F.relu6]


class Chain(nn.Module):
    def __init__(self, conv, bn, act, residual):
        super().__init__()
        self.conv, self.bn, self.act, self.residual = conv, bn, act, residual

    def forward(self, x, other):
        y = self.conv(x)
        if self.bn is not None:
            y = self.bn(y)
        if self.residual:
            y = y + other
        return self.act(y) if self.act is not None else y


@st.composite
def chains(draw):
    rank = draw(st.sampled_from([1, 2, 2, 3]))
    transposed = draw(st.booleans())
    groups = draw(st.sampled_from([1, 2, 3]))
    c_in, c_out = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    k = draw(st.integers(1, 3))
    stride, dilation = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    padding = draw(st.integers(0, 2))
    bias = draw(st.booleans())
    size = draw(st.integers(5, 8)) if rank < 3 else draw(st.integers(3, 5))
    if transposed:
        output_padding = draw(st.integers(0, max(stride, dilation) - 1))
        padding = min(padding, (dilation * (k - 1)) // 2)
        cls = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[rank - 1]
        conv = cls(c_in, c_out, k, stride, padding, output_padding, groups, bias, dilation)
    else:
        if size + 2 * padding < dilation * (k - 1) + 1:
            padding = (dilation * (k - 1) + 1 - size + 1) // 2
        cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[rank - 1]
        conv = cls(c_in, c_out, k, stride, padding, dilation, groups, bias)
    bn_kind = draw(st.sampled_from(["affine", "plain", None]))
    bn = None
    if bn_kind is not None:
        bn_cls = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[rank - 1]
        bn = bn_cls(c_out, eps=draw(st.sampled_from([1e-5, 1e-3, 0.1])),
                    affine=bn_kind == "affine")
    act = draw(st.sampled_from(ACTS))
    residual = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return conv, bn, act() if act is not None else None, residual, (2, c_in) + (size,) * rank, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_random_conv_bn_activation_chains(case):
    conv, bn, act, residual, shape, seed = case
    torch.manual_seed(seed)
    model = randomize(Chain(conv, bn, act, residual), seed=seed).eval()
    x = torch.randn(shape)
    with torch.no_grad():
        other = torch.randn(conv(x).shape)
    fused, report = check(model, x, other)
    if bn is not None:
        assert count(fused, nn.modules.batchnorm._BatchNorm) == 0, report.refusals


# -- export ------------------------------------------------------------------------------------


def test_export_folds_exports_and_runs_the_onnx_pipeline(tmp_path):
    torch.manual_seed(0)
    model = randomize(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, eps=1e-3), nn.ReLU(),
        nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )).eval()
    x = torch.randn(2, 3, 8, 8)
    path = tmp_path / "model.onnx"
    onnx_model, report = oft.export(model, (x,), path)
    assert path.is_file()
    assert len(report.applied("Conv+BatchNormalization")) >= 2  # folded on the torch side
    assert report.passes[0].startswith("torch:")
    assert "BatchNormalization" not in {n.op_type for n in onnx_model.graph}
    assert report.verification is not None and report.verification.ok
    assert any("vs torch" in o.name for o in report.verification.outputs)

    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        assert_close(model(x), torch.from_numpy(out))


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_fuse_works_under_inference_mode_and_no_grad_and_tracks_no_gradients(mode):
    model = randomize(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                    nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))).eval()
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad():
        ref = model(x)
    context = torch.inference_mode() if mode == "inference_mode" else torch.no_grad()
    with context:
        fused, report = fuse(model, (x,))
        out = fused(x)
    assert_close(ref, out)
    assert report.verification.ok and len(report.records) >= 2
    assert not any(p.requires_grad for p in fused.parameters())
    assert all(p.requires_grad for p in model.parameters())  # the caller's model is untouched
    trainable, _ = fuse(model, (x,), kernels=False, requires_grad=True)  # asked for: plain modules keep it
    assert any(p.requires_grad for p in trainable.parameters())


def test_activation_names_are_onnx_ops_or_declared_torch_only_and_checked_at_import(monkeypatch):
    """The torch rules name activations in the shared vocabulary; a name outside
    ACTIVATION_OPS and TORCH_ONLY_ACTIVATIONS stops the rules module from importing."""
    import importlib.util

    import opfuse.core.ops as vocabulary
    from opfuse.torch import rules

    names = {name for name, _ in rules.ACTIVATIONS.values()}
    assert {"Relu", "Clip", "Sigmoid", "Tanh", "LeakyRelu", "Gelu", "HardSwish",
            "HardSigmoid", "SiLU"} <= names
    assert names - rules.TORCH_ONLY_ACTIVATIONS <= vocabulary.ACTIVATION_OPS
    assert not rules.TORCH_ONLY_ACTIVATIONS & vocabulary.ACTIVATION_OPS  # truly not ONNX ops
    # the import-time check: a fresh copy of rules.py (not the one in sys.modules) against
    # a vocabulary without HardSwish refuses to load
    monkeypatch.setattr(vocabulary, "ACTIVATION_OPS", vocabulary.ACTIVATION_OPS - {"HardSwish"})
    spec = importlib.util.spec_from_file_location("opfuse_rules_probe", rules.__file__)
    with pytest.raises(AssertionError, match="HardSwish"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
