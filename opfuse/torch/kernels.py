"""oneDNN fused-convolution modules, and what this PyTorch build's oneDNN can run.

PyTorch CPU builds ship oneDNN's fused convolutions as operators (inductor lowers to
them when freezing):

    torch.ops.mkldnn._convolution_pointwise(x, W, b, padding, stride, dilation, groups,
                                            unary, scalars, algorithm)
        y = unary(conv(x, W) + b)
    torch.ops.mkldnn._convolution_pointwise.binary(x, other, W, b, padding, stride,
                                                   dilation, groups, "add", None,
                                                   unary, scalars, algorithm)
        y = unary(conv(x, W) + b + other)
    torch.ops.mkldnn._convolution_transpose_pointwise(x, W, b, padding, output_padding,
                                                      stride, dilation, groups,
                                                      unary, scalars, algorithm)

The epilogue runs on each output tile before it is written, so the activation (and the
residual add) costs no extra trip through memory. What helps most on CPU, measured on
ResNet-50 and MobileNetV2 (benchmarks/torch_fusion.py), is that ``W`` may be a weight
pre-packed into oneDNN's blocked layout by ``torch.ops.mkldnn._reorder_convolution_weight``
(``_reorder_convolution_transpose_weight``): eager ``F.conv2d`` reorders the weight on
every call. The packed layout depends on the input size, so a module packs once per input
shape and keeps the packed copy (packing without the input size was slower than not
packing at all). Channels-last activations gave nothing on top, so inputs stay NCHW.

Algorithm names this build accepts (checked by :func:`unary_problem` with a probe call,
never assumed): "none", "relu", "hardtanh" [min, max] (ReLU6, Hardtanh, clamp),
"leaky_relu" [slope], "sigmoid", "tanh", "swish" (SiLU; "silu" is rejected), "gelu" with
algorithm "none" or "tanh", "hardswish", "hardsigmoid". The binary form accepts "add"
(not "sum"), followed only by "relu" or nothing, for 2-D and 3-D convolutions only;
weight packing exists for 2-D and 3-D only. float32 and bfloat16 run; float64 does not.

Every module here is always correct: when a call falls outside what the kernel was
checked for (an input of another rank or dtype, autograd on, a residual whose shape is
not the conv output's), it computes the same result with plain ``F.conv*`` + add +
activation instead.
"""

from __future__ import annotations

__all__ = [
    "Unary",
    "kernels_available",
    "unary_problem",
    "binary_problem",
    "pack_problem",
    "ConvPointwise",
    "ConvAddPointwise",
]

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from opfuse.core.ops import first_line

# Input shapes a module keeps a packed weight for; more distinct shapes start afresh.
MAX_PACKED_SHAPES = 8


@dataclasses.dataclass(frozen=True)
class Unary:
    """An epilogue activation, in oneDNN's vocabulary."""

    attr: str = "none"  # oneDNN algorithm name
    scalars: tuple[float, ...] = ()  # hardtanh: (min, max); leaky_relu: (slope,)
    algorithm: str = ""  # gelu: "none" (erf) or "tanh"

    def op_scalars(self) -> list:
        return list(self.scalars) if self.scalars else [None]

    def reference(self, y: torch.Tensor) -> torch.Tensor:
        """The same activation in plain torch (used by fallbacks and probes)."""
        a, s = self.attr, self.scalars
        if a == "none":
            return y
        if a == "relu":
            return F.relu(y)
        if a == "hardtanh":
            return F.hardtanh(y, s[0], s[1])
        if a == "leaky_relu":
            return F.leaky_relu(y, s[0])
        if a == "sigmoid":
            return torch.sigmoid(y)
        if a == "tanh":
            return torch.tanh(y)
        if a == "swish":
            return F.silu(y)
        if a == "gelu":
            return F.gelu(y, approximate=self.algorithm or "none")
        if a == "hardswish":
            return F.hardswish(y)
        if a == "hardsigmoid":
            return F.hardsigmoid(y)
        raise ValueError(f"unknown oneDNN unary attribute {a!r}")

    def describe(self) -> str:
        args = ", ".join(f"{v:g}" for v in self.scalars)
        alg = f", {self.algorithm}" if self.algorithm else ""
        return f"{self.attr}({args}{alg})" if args or alg else self.attr


# -- what this build can run ---------------------------------------------------------------


def _ops():
    m = torch.ops.mkldnn
    return (
        m._convolution_pointwise.default,
        m._convolution_pointwise.binary,
        m._convolution_transpose_pointwise.default,
        m._reorder_convolution_weight.default,
        m._reorder_convolution_transpose_weight.default,
    )


@functools.cache
def _build_problem() -> str | None:
    """Why this build cannot run oneDNN's fused convolutions at all, or None."""
    if not torch.backends.mkldnn.is_available():
        return "oneDNN (mkldnn) is not available in this PyTorch build"
    try:
        _ops()
    except (AttributeError, RuntimeError) as exc:
        return f"this PyTorch build lacks oneDNN's fused convolution operators ({exc})"
    return None


def kernels_available() -> str | None:
    """None when the fused kernels run here (a conv+relu probe passes), else why not."""
    return _build_problem() or unary_problem(Unary("relu"), 2, False, torch.float32)


def _probe_case(rank: int, transposed: bool, dtype: torch.dtype):
    """Tiny grouped tensors and hyper-parameters for a probe call."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((2, 4) + (5,) * rank, generator=gen).to(dtype)
    w = torch.randn((4, 2) + (3,) * rank, generator=gen).to(dtype)  # groups = 2
    b = torch.randn(4, generator=gen).to(dtype)
    if transposed:
        hp = dict(stride=[2] * rank, padding=[1] * rank, output_padding=[1] * rank)
    else:
        hp = dict(stride=[1] * rank, padding=[1] * rank, output_padding=[0] * rank)
    return x, w, b, dict(hp, dilation=[1] * rank, groups=2)


def _plain_conv(x, w, b, transposed, stride, padding, dilation, groups, output_padding):
    rank = w.dim() - 2
    if transposed:
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[rank - 1]
        return fn(x, w, b, stride, padding, output_padding, groups, dilation)
    fn = (F.conv1d, F.conv2d, F.conv3d)[rank - 1]
    return fn(x, w, b, stride, padding, dilation, groups)


def _mismatch(y: torch.Tensor, ref: torch.Tensor) -> str | None:
    tol = 1e-4 if y.dtype == torch.float32 else 3e-2
    err = float((y.float() - ref.float()).abs().max())
    scale = max(1.0, float(ref.float().abs().max()))
    return None if err <= tol * scale else f"the probe differs from the plain result by {err:.3g}"


@functools.lru_cache(maxsize=None)
def unary_problem(unary: Unary, rank: int, transposed: bool, dtype: torch.dtype) -> str | None:
    """None if conv(+transposed) with this epilogue runs correctly here, else why not."""
    if (problem := _build_problem()) is not None:
        return problem
    kind = "transposed convolution" if transposed else "convolution"
    x, w, b, hp = _probe_case(rank, transposed, dtype)
    try:
        conv, _, conv_t, _, _ = _ops()
        if transposed:
            y = conv_t(x, w, b, hp["padding"], hp["output_padding"], hp["stride"],
                       hp["dilation"], hp["groups"], unary.attr, unary.op_scalars(),
                       unary.algorithm)
        else:
            y = conv(x, w, b, hp["padding"], hp["stride"], hp["dilation"], hp["groups"],
                     unary.attr, unary.op_scalars(), unary.algorithm)
    except Exception as exc:  # noqa: BLE001 - any failure means "not here"
        return (f"oneDNN's fused {rank}-D {kind} rejects a {unary.describe()} epilogue "
                f"in {str(dtype).removeprefix('torch.')} ({first_line(exc, limit=160)})")
    ref = unary.reference(_plain_conv(x.float(), w.float(), b.float(), transposed, **hp))
    return _mismatch(y, ref)


@functools.lru_cache(maxsize=None)
def binary_problem(unary: Unary, rank: int, dtype: torch.dtype) -> str | None:
    """None if conv + add (+ unary) runs correctly here, else why not."""
    if (problem := _build_problem()) is not None:
        return problem
    x, w, b, hp = _probe_case(rank, False, dtype)
    ref = _plain_conv(x.float(), w.float(), b.float(), False, **hp)
    other = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    try:
        _, binary, _, _, _ = _ops()
        y = binary(x, other, w, b, hp["padding"], hp["stride"], hp["dilation"], hp["groups"],
                   "add", None, None if unary.attr == "none" else unary.attr,
                   unary.op_scalars(), unary.algorithm)
    except Exception as exc:  # noqa: BLE001
        what = "add" if unary.attr == "none" else f"add + {unary.describe()}"
        return (f"oneDNN's fused {rank}-D convolution rejects an {what} epilogue in "
                f"{str(dtype).removeprefix('torch.')} ({first_line(exc, limit=160)})")
    return _mismatch(y, unary.reference(ref + other.float()))


@functools.lru_cache(maxsize=None)
def pack_problem(rank: int, transposed: bool, dtype: torch.dtype) -> str | None:
    """None if weights of this kind can be pre-packed here, else why not."""
    if (problem := _build_problem()) is not None:
        return problem
    x, w, b, hp = _probe_case(rank, transposed, dtype)
    try:
        conv, _, conv_t, reorder, reorder_t = _ops()
        if transposed:
            packed = reorder_t(w, hp["padding"], hp["output_padding"], hp["stride"],
                               hp["dilation"], hp["groups"], list(x.shape))
            y = conv_t(x, packed, b, hp["padding"], hp["output_padding"], hp["stride"],
                       hp["dilation"], hp["groups"], "none", [None], "")
        else:
            packed = reorder(w, hp["padding"], hp["stride"], hp["dilation"], hp["groups"],
                             list(x.shape))
            y = conv(x, packed, b, hp["padding"], hp["stride"], hp["dilation"], hp["groups"],
                     "none", [None], "")
    except Exception as exc:  # noqa: BLE001
        return f"oneDNN cannot pre-pack {rank}-D weights ({first_line(exc, limit=160)})"
    return _mismatch(y, _plain_conv(x.float(), w.float(), b.float(), transposed, **hp))


# -- the modules ---------------------------------------------------------------------------


class _ConvKernel(nn.Module):
    """Folded weights plus the conv hyper-parameters; packs weights per input shape."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        stride,
        padding,
        dilation,
        groups: int,
        transposed: bool = False,
        output_padding=None,
        unary: Unary = Unary(),
        prepack: bool = True,
    ):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = (None if bias is None
                     else nn.Parameter(bias.detach().clone(), requires_grad=False))
        self.rank = weight.dim() - 2
        self.stride = list(stride)
        self.padding = list(padding)
        self.dilation = list(dilation)
        self.groups = int(groups)
        self.transposed = bool(transposed)
        self.output_padding = list(output_padding or [0] * self.rank)
        self.unary = unary
        self.prepack = bool(prepack)
        self.kernel_dtype = weight.dtype  # the dtype the kernel was checked for
        self._packed: dict[torch.Size, torch.Tensor] = {}
        self._packed_version = -1

    # packing ---------------------------------------------------------------------------
    def pack(self, input_shape) -> torch.Tensor:
        """The weight packed for inputs of ``input_shape`` (cached)."""
        key = torch.Size(int(d) for d in input_shape)
        if self.weight._version != self._packed_version:  # weights changed in place
            self._packed.clear()
            self._packed_version = self.weight._version
        packed = self._packed.get(key)
        if packed is None:
            if len(self._packed) >= MAX_PACKED_SHAPES:
                self._packed.clear()
            _, _, _, reorder, reorder_t = _ops()
            with torch.no_grad():
                if self.transposed:
                    packed = reorder_t(self.weight, self.padding, self.output_padding,
                                       self.stride, self.dilation, self.groups, list(key))
                else:
                    packed = reorder(self.weight, self.padding, self.stride, self.dilation,
                                     self.groups, list(key))
            self._packed[key] = packed
        return packed

    def _kernel_weight(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prepack:
            return self.weight
        packed = self._packed.get(x.shape)
        if packed is None or self.weight._version != self._packed_version:
            packed = self.pack(x.shape)
        return packed

    def _kernel_applies(self, x: torch.Tensor) -> bool:
        return (
            x.dim() == self.rank + 2
            and x.dtype == self.weight.dtype == self.kernel_dtype
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and x.requires_grad)
        )

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        return _plain_conv(x, self.weight, self.bias, self.transposed, self.stride,
                           self.padding, self.dilation, self.groups, self.output_padding)

    # housekeeping: the packed cache is derived state --------------------------------------
    def _apply(self, fn, recurse=True):
        self._packed = {}
        return super()._apply(fn, recurse)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_packed"] = {}  # oneDNN's opaque tensors neither pickle nor deepcopy
        return state

    def extra_repr(self) -> str:
        kind = "transposed " if self.transposed else ""
        return (
            f"{kind}{tuple(self.weight.shape)}, stride={self.stride}, padding={self.padding}, "
            f"dilation={self.dilation}, groups={self.groups}, epilogue={self.epilogue()}, "
            f"prepack={self.prepack}"
        )

    def epilogue(self) -> str:
        return self.unary.describe()


class ConvPointwise(_ConvKernel):
    """y = unary(conv(x, W') + b') in one oneDNN call (``unary`` may be "none")."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._kernel_applies(x):
            return self.unary.reference(self._plain(x))
        u = self.unary
        if self.transposed:
            return torch.ops.mkldnn._convolution_transpose_pointwise(
                x, self._kernel_weight(x), self.bias, self.padding, self.output_padding,
                self.stride, self.dilation, self.groups, u.attr, u.op_scalars(), u.algorithm,
            )
        return torch.ops.mkldnn._convolution_pointwise(
            x, self._kernel_weight(x), self.bias, self.padding, self.stride, self.dilation,
            self.groups, u.attr, u.op_scalars(), u.algorithm,
        )


class ConvAddPointwise(_ConvKernel):
    """y = unary(conv(x, W') + b' + other) in one oneDNN call (unary: "relu" or "none")."""

    def _output_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        spatial = tuple(
            (size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, p, d, k, s in zip(x.shape[2:], self.padding, self.dilation,
                                        self.weight.shape[2:], self.stride)
        )
        return (x.shape[0], self.weight.shape[0]) + spatial

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        if not (
            self._kernel_applies(x)
            and other.dtype == x.dtype
            and tuple(other.shape) == self._output_shape(x)
            and not (torch.is_grad_enabled() and other.requires_grad)
        ):
            return self.unary.reference(self._plain(x) + other)
        u = self.unary
        return torch.ops.mkldnn._convolution_pointwise.binary(
            x, other, self._kernel_weight(x), self.bias, self.padding, self.stride,
            self.dilation, self.groups, "add", None, None if u.attr == "none" else u.attr,
            u.op_scalars(), u.algorithm,
        )

    def epilogue(self) -> str:
        return "add" if self.unary.attr == "none" else f"add+{self.unary.describe()}"
