"""Layer-wise weight rounding (AdaRound): each weight rounded up or down to reconstruct its
layer's float output on the calibration data, not to the nearest integer.

Nagel et al., "Up or Down? Adaptive Rounding for Post-Training Quantization" (ICML 2020).
For a layer with float weight W (rows: output channels, columns: the K inputs one output
reads, per group), weight scale s and zero point z from ONNX Runtime's quantiser, float
input patches x (the float model's own tensor) and their 8-bit round trip xq = DQ(Q(x))
with the layer's input scale, the rounding is chosen to minimise

    E(Wq) = sum over patches p of || Wq xq_p - W x_p ||^2,      Wq = s * (floor(W / s) + h),  h in {0, 1}

the layer's pre-activation output error against the float layer on the float input (the
bias cancels; bias correction, run after, removes the mean of what is left). E is
quadratic, so the data enters only through three Gram matrices per group, summed over
the calibration samples once:

    Gqq = sum xq xq^T,   Gfq = sum x xq^T,   Gff = sum x x^T
    E(Wq) = tr(Wq Gqq Wq^T) - 2 tr(Wq Gfq^T W^T) + tr(W Gff W^T),   dE/dWq = 2 (Wq Gqq - W Gfq)

and each iteration costs O(out * K^2), whatever the number of samples. h is relaxed to the
rectified sigmoid h(V) = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1) (zeta 1.1, gamma
-0.1), V initialised so that Wq = W, and optimised with Adam on E / E(round to nearest) +
lambda * mean(1 - |2h - 1|^beta), beta annealed from 20 to 2 after a warm-up without
the regulariser (the paper's schedule); then h is set to 0 or 1 (h >= 0.5 rounds up).

Exact acceptance: the rounding found is kept for a layer only if its exact error E is
below round-to-nearest's (both computed from the Gram matrices), so no layer ends worse
than ONNX Runtime left it; the report gives every layer's two errors.

Layers: Conv (any spatial rank, groups, strides, dilations, explicit pads), Gemm and
MatMul with a 2-D constant weight (WeightSpec layouts ``oihw``, ``kn``, ``nk``), whose
weight is an 8-bit DequantizeLinear initializer. ConvTranspose, auto_pad other than
NOTSET/VALID, Gemm with transA, and a layer whose input differs in shape across samples
are left as ONNX Runtime rounded them, with the reason.

AdaQuant (Hubara et al. 2021: also adjusting the float weights and scales) is not done:
with weights stored as ONNX Runtime's int8 and scales fixed by its symmetric rule, the
rounding is the one free choice that keeps the QDQ graph as ONNX Runtime writes it.
"""

from __future__ import annotations

__all__ = ["RoundingResult", "Rounding", "adaround_layers", "apply_rounding", "reconstruction_error"]

import dataclasses

import numpy as np
import onnx
from numpy.lib.stride_tricks import sliding_window_view
import onnx.helper
from onnx import numpy_helper

from opfuse.quantization.sqnr import QdqIndex, _exposed
from opfuse.runtime import create_session
from opfuse.vocabulary import ONNX_DOMAINS, weight_spec

ITERATIONS = 600
WARMUP = 0.2  # share of the iterations without the rounding regulariser
LEARNING_RATE = 0.05
REGULARISER = 0.01
BETA = (20.0, 2.0)
ZETA, GAMMA = 1.1, -0.1
SAMPLES = 16  # calibration samples whose patches enter the Gram matrices
POSITIONS = 2048  # output positions per sample at most (a fixed random subset)


@dataclasses.dataclass
class RoundingResult:
    """One layer: its exact reconstruction error with round-to-nearest and with AdaRound."""

    layer: str
    nearest_error: float
    adaround_error: float
    kept: bool
    reason: str = ""


@dataclasses.dataclass
class Rounding:
    """The integer weights chosen per layer (QDQ initializer name -> values), and why."""

    weights: dict[str, np.ndarray]
    results: list[RoundingResult]
    skipped: dict[str, str]


@dataclasses.dataclass
class _Site:
    name: str
    x: str  # the float model's input tensor
    x_scale: float | None  # None: the input is not quantised
    x_zero: int
    x_levels: tuple[int, int]
    conv: dict | None  # kernel, strides, pads, dilations, group for a Conv; None for Gemm/MatMul
    trans_a: bool
    float_weight: np.ndarray  # [groups, out/group, K]
    scale: np.ndarray  # broadcast like float_weight
    zero: np.ndarray
    levels: tuple[int, int]
    initializer: str  # the QDQ model's integer weight
    shape: tuple[int, ...]  # the integer weight's own shape
    dtype: np.dtype
    to_groups: object  # the weight's own layout -> [groups, out/group, K]
    to_own: object  # [groups, out/group, K] -> the weight's own layout


def _sites(float_model: onnx.ModelProto, qdq: onnx.ModelProto, skipped: dict[str, str]) -> list[_Site]:
    index = QdqIndex(float_model, qdq)
    inits, float_inits, producer, float_nodes = index.inits, index.float_inits, index.producer, index.float_nodes
    const = index.const

    sites = []
    for node in qdq.graph.node:
        spec = weight_spec(node) if node.domain in ONNX_DOMAINS else None
        original = float_nodes.get(node.name)
        if spec is None or original is None or len(node.input) <= spec.weight:
            continue
        dq = producer.get(node.input[spec.weight])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits:
            continue  # not an int8 weight (kept in float, or an activation)
        layout = spec.layout[::-1] if spec.transposed_by and _attr(node, spec.transposed_by, 0) else spec.layout
        float_w = float_inits.get(original.input[spec.weight])
        if layout not in ("oihw", "kn", "nk") or float_w is None:
            skipped[node.name] = f"{node.op_type} weight layout {layout} is not handled" if float_w is not None \
                else "its float weight is not an initializer"
            continue
        if spec.weight != 1 or not original.input[0] or original.input[0] in float_inits:
            skipped[node.name] = "its activation input is not the first input"
            continue
        if node.op_type == "Conv" and node.attribute and any(
                a.name == "auto_pad" and a.s not in (b"NOTSET", b"VALID") for a in node.attribute):
            skipped[node.name] = "auto_pad SAME is not handled"
            continue
        trans_a = bool(_attr(original, "transA", 0)) if node.op_type == "Gemm" else False
        q = const(dq.input[0])
        scale = const(dq.input[1]).astype(np.float64)
        zero = const(dq.input[2]).astype(np.float64) if len(dq.input) > 2 and dq.input[2] else np.zeros_like(scale)
        axis = _attr(dq, "axis", 1)
        w = numpy_helper.to_array(float_w).astype(np.float64)
        if w.shape != q.shape or (node.op_type != "Conv" and w.ndim != 2):
            skipped[node.name] = "its weight is not a 2-D matrix" if w.ndim != 2 else "weight shapes differ"
            continue
        if scale.size > 1:
            shape = [1] * w.ndim
            shape[axis % w.ndim] = -1
            scale, zero = scale.reshape(shape), zero.reshape(shape)
        scale, zero = np.broadcast_to(scale, w.shape), np.broadcast_to(zero, w.shape)
        info = np.iinfo(q.dtype)
        conv = None
        if node.op_type == "Conv":
            group = _attr(original, "group", 1)
            out = w.shape[0]
            spatial = w.ndim - 2
            conv = {"kernel": w.shape[2:], "group": group,
                    "strides": _ints(original, "strides", [1] * spatial),
                    "dilations": _ints(original, "dilations", [1] * spatial),
                    "pads": _ints(original, "pads", [0] * (2 * spatial))}

            def to_groups(a, group=group, out=out):
                return a.reshape(group, out // group, -1)

            def to_own(a, shape=w.shape):
                return a.reshape(shape)
        elif layout == "kn":
            def to_groups(a):
                return a.T[None]

            def to_own(a):
                return a[0].T
        else:  # nk
            def to_groups(a):
                return a[None]

            def to_own(a):
                return a[0]
        x_scale, x_zero, x_levels = None, 0, (0, 255)
        dq_x = producer.get(node.input[0])
        q_x = producer.get(dq_x.input[0]) if dq_x is not None and dq_x.op_type == "DequantizeLinear" else None
        if q_x is not None and q_x.op_type == "QuantizeLinear":
            xs = const(q_x.input[1])
            xz = const(q_x.input[2]) if len(q_x.input) > 2 and q_x.input[2] else np.zeros((), np.uint8)
            if xs is None or xs.size != 1:
                skipped[node.name] = "its input is not quantised per tensor"
                continue
            x_scale, x_zero = float(xs.reshape(())), int(xz.reshape(()))
            xinfo = np.iinfo(xz.dtype)
            x_levels = (int(xinfo.min), int(xinfo.max))
        sites.append(_Site(node.name, original.input[0], x_scale, x_zero, x_levels, conv, trans_a,
                           to_groups(w), to_groups(scale), to_groups(zero), (int(info.min), int(info.max)),
                           dq.input[0], q.shape, q.dtype, to_groups, to_own))
    return sites


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _ints(node, name, default):
    for a in node.attribute:
        if a.name == name:
            return list(a.ints)
    return list(default)


def _patches(x: np.ndarray, site: _Site) -> np.ndarray:
    """The layer's input as [groups, K, positions]."""
    if site.conv is None:
        if site.trans_a:
            x = x.T
        cols = x.reshape(-1, x.shape[-1]).T[None]
    else:
        c = site.conv
        spatial = len(c["kernel"])
        pads = c["pads"]
        width = [(0, 0), (0, 0)] + [(pads[i], pads[i + spatial]) for i in range(spatial)]
        xp = np.pad(x, width)
        span = [(k - 1) * d + 1 for k, d in zip(c["kernel"], c["dilations"])]
        win = sliding_window_view(xp, span, axis=tuple(range(2, 2 + spatial)))
        index = (slice(None), slice(None)) + tuple(slice(None, None, s) for s in c["strides"]) \
            + tuple(slice(None, None, d) for d in c["dilations"])
        win = win[index]  # [N, C, out..., k...]
        n, channels = win.shape[:2]
        g = c["group"]
        win = win.reshape(n, g, channels // g, *win.shape[2:])
        out_axes = tuple(range(3, 3 + spatial))
        k_axes = tuple(range(3 + spatial, 3 + 2 * spatial))
        cols = win.transpose(1, 2, *k_axes, 0, *out_axes).reshape(g, -1, n * int(np.prod(win.shape[3:3 + spatial])))
    return cols


def _fake_quant(x: np.ndarray, site: _Site) -> np.ndarray:
    if site.x_scale is None:
        return x
    lo, hi = site.x_levels
    q = np.clip(np.rint(x / site.x_scale) + site.x_zero, lo, hi)
    return (q - site.x_zero) * site.x_scale


def _grams(float_model: onnx.ModelProto, sites: list[_Site], samples, skipped: dict[str, str]) -> dict:
    names = sorted({s.x for s in sites})
    session = create_session(_exposed(float_model, names), "disabled")
    grams: dict[str, list[np.ndarray]] = {}
    shapes: dict[str, tuple] = {}
    rng = np.random.default_rng(0)
    for sample in list(samples)[:SAMPLES]:
        values = dict(zip(names, session.run(names, dict(sample))))
        for site in sites:
            if site.name in skipped:
                continue
            x = np.asarray(values[site.x], np.float64)
            if shapes.setdefault(site.name, x.shape[1:]) != x.shape[1:]:
                skipped[site.name] = "its input's shape differs between calibration samples"
                continue
            f, q = _patches(x, site), _patches(_fake_quant(x, site), site)
            if f.shape[-1] > POSITIONS:  # the same random subset of positions for both
                pick = np.sort(rng.choice(f.shape[-1], POSITIONS, replace=False))
                f, q = f[..., pick], q[..., pick]
            acc = grams.setdefault(site.name, [0.0, 0.0, 0.0])
            acc[0] = acc[0] + q @ q.transpose(0, 2, 1)
            acc[1] = acc[1] + f @ q.transpose(0, 2, 1)
            acc[2] = acc[2] + f @ f.transpose(0, 2, 1)
    return grams


def reconstruction_error(wq: np.ndarray, w: np.ndarray, grams) -> float:
    """E(Wq) of the module docstring, from the Gram matrices (Gqq, Gfq, Gff)."""
    gqq, gfq, gff = grams  # (as matrix products: einsum over three operands does not use BLAS)
    return float(np.sum((wq @ gqq) * wq) - 2 * np.sum((w @ gfq) * wq) + np.sum((w @ gff) * w))


def _optimise(site: _Site, grams, nearest: np.ndarray) -> np.ndarray:
    """The integer weights (as [groups, out/group, K], without the zero point) AdaRound finds."""
    w, s = site.float_weight, site.scale
    gqq, gfq, _ = grams
    lo_int, hi_int = site.levels[0] - site.zero, site.levels[1] - site.zero
    base = np.floor(w / s)
    free = (base >= lo_int) & (base + 1 <= hi_int)  # both roundings representable
    rest = np.clip(w / s - base, 1e-4, 1 - 1e-4)
    norm = max(reconstruction_error(s * nearest, w, grams), 1e-30)
    # the gradient 2 (Wq Gqq - W Gfq) written as 2 ((Wq - W) Gqq + W (Gqq - Gfq)): the second
    # term is fixed (float64, once per layer), the first multiplies the small rounding error
    # Wq - W, so the iterations run in float32 (twice the BLAS rate of float64) without the
    # cancellation of two large, nearly equal products; the rounding they find is judged by
    # its exact float64 error in adaround_layers
    fixed = (w @ (gqq - gfq) / norm).astype(np.float32)
    gqq = (gqq / norm).astype(np.float32)
    exact = w / s
    rest32 = (exact - base).astype(np.float32)  # Wq - W = s (h - rest) where free
    off = (nearest - exact).astype(np.float32)  # and s (nearest - W / s) where not
    s = s.astype(np.float32)
    v = (-np.log((ZETA - GAMMA) / (rest - GAMMA) - 1)).astype(np.float32)  # h(V) = rest: Wq = W
    m, u = np.zeros_like(v), np.zeros_like(v)
    warm = int(ITERATIONS * WARMUP)
    for step in range(1, ITERATIONS + 1):
        sig = 1 / (1 + np.exp(-v))
        h = np.clip(sig * (ZETA - GAMMA) + GAMMA, 0, 1)
        grad_wq = 2 * ((s * np.where(free, h - rest32, off)) @ gqq + fixed)
        grad_h = grad_wq * s
        if step > warm:
            beta = BETA[1] + (BETA[0] - BETA[1]) * (1 - (step - warm) / (ITERATIONS - warm))
            t = 2 * h - 1
            grad_h = grad_h + REGULARISER / h.size * (-beta * np.abs(t) ** (beta - 1) * np.sign(t) * 2)
        inside = (h > 0) & (h < 1) & free
        grad_v = np.where(inside, grad_h * sig * (1 - sig) * (ZETA - GAMMA), 0.0)
        m = 0.9 * m + 0.1 * grad_v
        u = 0.999 * u + 0.001 * grad_v * grad_v
        v -= LEARNING_RATE * (m / (1 - 0.9 ** step)) / (np.sqrt(u / (1 - 0.999 ** step)) + 1e-8)
    h = np.clip(1 / (1 + np.exp(-v)) * (ZETA - GAMMA) + GAMMA, 0, 1)
    return np.where(free, base + (h >= 0.5), nearest)


def adaround_layers(float_model: onnx.ModelProto, qdq: onnx.ModelProto, samples,
                    cache: dict | None = None) -> Rounding:
    """AdaRound's integer weights for every handled layer of ``qdq`` (nothing is changed:
    :func:`apply_rounding` writes them). ``cache`` (reused across the search's trials)
    maps a layer's quantisation parameters to its result, so a layer quantised alike in
    a later trial is not optimised again."""
    cache = {} if cache is None else cache
    skipped: dict[str, str] = {}
    sites = _sites(float_model, qdq, skipped)
    inits = {i.name: i for i in qdq.graph.initializer}
    keys = {s.name: (s.name, s.x_scale, s.x_zero, s.scale.tobytes(), s.zero.tobytes()) for s in sites}
    todo = [s for s in sites if keys[s.name] not in cache]
    grams = _grams(float_model, todo, samples, skipped) if todo else {}
    for site in todo:
        if site.name in skipped or site.name not in grams:
            continue
        own = numpy_helper.to_array(inits[site.initializer]).astype(np.float64)
        nearest = site.to_groups(own) - site.zero
        chosen = _optimise(site, grams[site.name], nearest)
        e_near = reconstruction_error(site.scale * nearest, site.float_weight, grams[site.name])
        e_ada = reconstruction_error(site.scale * chosen, site.float_weight, grams[site.name])
        kept = e_ada < e_near
        values = site.to_own(np.clip(chosen + site.zero, *site.levels)).astype(site.dtype) if kept else None
        cache[keys[site.name]] = (values, RoundingResult(
            site.name, e_near, e_ada, kept,
            "" if kept else "AdaRound's rounding did not lower the layer's reconstruction error; nearest kept"))
    weights, results = {}, []
    for site in sites:
        if keys[site.name] not in cache:
            continue
        values, result = cache[keys[site.name]]
        results.append(result)
        if values is not None:
            weights[site.initializer] = values
    return Rounding(weights, results, skipped)


def apply_rounding(qdq: onnx.ModelProto, rounding: Rounding) -> int:
    """Writes the chosen integer weights into ``qdq`` (in place); returns how many."""
    changed = 0
    for tensor in qdq.graph.initializer:
        values = rounding.weights.get(tensor.name)
        if values is not None:
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
            changed += 1
    return changed
