"""Layer-wise weight rounding (AdaRound): each weight rounded up or down to reconstruct its
layer's float output on the calibration data, not to the nearest integer.

Nagel et al., "Up or Down? Adaptive Rounding for Post-Training Quantization" (ICML 2020).
For a layer with float weight W (rows: output channels, columns: the K inputs one output
reads, per group), weight scale s and zero point z from ONNX Runtime's quantiser, bias b,
the layer's input xq **as the QDQ model computes it** (every earlier layer quantised, with
the roundings already chosen: layers are done in graph order, so each one corrects what
the ones before it left) and the float model's own input x, the rounding minimises

    E(Wq) = mean over output positions p of ( act(Wq xq_p + b) - act(W x_p + b) )^2
    Wq = s * (floor(W / s) + h),   h in {0, 1}

where ``act`` is the Relu or Clip that follows the layer in the float model (identity
otherwise: an error a Relu cuts off costs nothing). h is relaxed to the rectified sigmoid
h(V) = clip(sigmoid(V) (zeta - gamma) + gamma, 0, 1) (zeta 1.1, gamma -0.1), V initialised
so that Wq = W, and V is optimised with torch's Adam (:func:`.rounding.optimiser`: the gradient is
computed here in numpy, two products a step) on mini-batches of :data:`BATCH` positions for
:data:`ITERATIONS` steps, on E / E(round to nearest) + lambda * mean(1 - |2h - 1|^beta): no
regulariser for the first :data:`.rounding.WARMUP` of the steps, then beta annealed from 20 to 2 (the
paper's schedule); then h is set to 0 or 1 (h >= 0.5 rounds up). The learning rate bounds
how far a weight can travel from its float value; with a few thousand positions per layer
and K up to thousands of inputs, the problem is underdetermined, and a rate that lets V
roam flips many weights the data cannot decide (docs/results/measurements.md).

Before the rounding, each layer's weight scale is chosen by the same error, the rounding
to nearest in place (:mod:`.weight_ranges`): a range clipped inside the weight's extremes
when that reconstructs the output better. A new weight scale writes a new int32 bias scale
(``x_scale * w_scale``, as ONNX Runtime's QLinearConv fusion reads it) and the float bias
requantised to it.

Data: :data:`SAMPLES` calibration samples, :data:`POSITIONS` output positions per layer
(a fixed random subset, the same count from each sample); the positions of the last
quarter of the samples are the **check** set, never optimised on.

Exact acceptance: a layer's rounding (and scale) is kept only if its error E on the check
positions is below round-to-nearest's at ONNX Runtime's scale, so no layer ends worse on
data it was not fitted to than ONNX Runtime left it; the report gives every layer's two
errors. (:mod:`.trials` then keeps AdaRound for the whole model only if the output SQNR on
the tuning samples rises.)

Layers: Conv (any spatial rank, groups, strides, dilations, explicit pads), Gemm and
MatMul with a 2-D constant weight (WeightSpec layouts ``oihw``, ``kn``, ``nk``), whose
weight is an 8-bit DequantizeLinear initializer read by that layer alone. ConvTranspose,
auto_pad other than NOTSET/VALID and an input not quantised per tensor are left as ONNX
Runtime rounded them, with the reason.

Cost: per step two products of [out, K] by [K, BATCH]: minutes per model on one thread
(``benchmarks/quantize.py --flows adaround``; times and gains in docs/results/quantize.md).

AdaQuant (Hubara et al. 2021: also adjusting the float weights) is not done: with weights
stored as ONNX Runtime's int8 and scales chosen by the error above, the rounding is the
one free choice left that keeps the QDQ graph as ONNX Runtime writes it.
"""

from __future__ import annotations

__all__ = ["RoundingResult", "Rounding", "adaround_layers", "apply_rounding"]

import dataclasses

import numpy as np
import onnx
import onnx.helper
import onnx_ir as ir
from numpy.lib.stride_tricks import sliding_window_view
from onnx import numpy_helper

from opfuse.core.activations import clamp_of, read_activation
from opfuse.core.analysis import opset_of
from opfuse.quantization.qdq.layers import QdqLayers, exposed
from opfuse.quantization.algorithms.rounding import (
    FRACTION_CLIP,
    GAMMA,
    REGULARISER,
    ZETA,
    beta_at,
    initial_v,
    optimiser,
    warmup_steps,
)
from opfuse.quantization.algorithms.weight_ranges import choose_factors, layer_error
from opfuse.runtime import create_session
from opfuse.core.ops import ONNX_DOMAINS, proto_attr, weight_spec

ITERATIONS = 1000
BATCH = 1024  # output positions per step
SAMPLES = 48  # calibration samples whose positions are used
POSITIONS = 16384  # output positions per layer at most
CHECK_SHARE = 0.25  # the last quarter of the samples: the acceptance test's positions


@dataclasses.dataclass
class RoundingResult:
    """One layer: its output error (on the check positions) with ONNX Runtime's rounding to
    nearest and with the scale and rounding chosen here."""

    layer: str
    nearest_error: float
    adaround_error: float
    kept: bool
    reason: str = ""
    scale_factor: float = 1.0  # the mean factor on the weight scale (1: ONNX Runtime's)


@dataclasses.dataclass
class Rounding:
    """The initializers chosen per layer (QDQ initializer name -> values: the integer
    weights, and where the scale changed, the weight scale, the bias scale and the int32
    bias), and why."""

    weights: dict[str, np.ndarray]
    results: list[RoundingResult]
    skipped: dict[str, str]


@dataclasses.dataclass
class _Site:
    name: str
    x: str  # the QDQ model's input to the layer (after its DequantizeLinear)
    y: str  # the float model's output of the layer (before its activation)
    clamp: tuple[float, float] | None  # the Relu / Clip after it in the float model
    bias: np.ndarray  # the float bias, [groups, out/group, 1]
    x_scale: float | None  # None: the input is not quantised
    conv: dict | None  # kernel, strides, pads, dilations, group for a Conv; None for Gemm/MatMul
    trans_a: bool
    float_weight: np.ndarray  # [groups, out/group, K]
    scale: np.ndarray  # broadcast like float_weight
    zero: np.ndarray
    levels: tuple[int, int]
    per_channel: bool
    initializer: str  # the QDQ model's integer weight
    scale_initializer: str
    bias_initializers: tuple[str, str] | None  # the int32 bias and its scale
    dtype: np.dtype
    to_groups: object  # the weight's own layout -> [groups, out/group, K]
    to_own: object  # [groups, out/group, K] -> the weight's own layout


def weight_sites(layers: QdqLayers, skipped: dict[str, str]) -> list[_Site]:
    """The layers whose int8 weight AdaRound (and the block reconstruction) can learn, read from
    the index; each layer it cannot handle named in ``skipped`` with the reason."""
    clamps = _clamps(layers.float_model)
    sites = []
    for node in layers.qdq.graph.node:
        spec = weight_spec(node) if node.domain in ONNX_DOMAINS else None
        original = layers.float_nodes.get(node.name)
        if spec is None or original is None or len(node.input) <= spec.weight:
            continue
        dq = layers.producer.get(node.input[spec.weight])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in layers.inits:
            continue  # not an int8 weight (kept in float, or an activation)
        why = _unhandled(layers, node, original, spec, dq)
        if why:
            skipped[node.name] = why
            continue
        site = _weight_site(layers, node, original, spec, dq, clamps.get(original.name))
        if isinstance(site, str):
            skipped[node.name] = site
            continue
        sites.append(site)
    return sites


def _layout(node: onnx.NodeProto, spec) -> str:
    return spec.layout[::-1] if spec.transposed_by and proto_attr(node, spec.transposed_by, 0) else spec.layout


def _unhandled(layers: QdqLayers, node, original, spec, dq) -> str:
    """Why AdaRound cannot take this layer ("": it can)."""
    float_w = layers.float_inits.get(original.input[spec.weight])
    layout = _layout(node, spec)
    if layout not in ("oihw", "kn", "nk") or float_w is None:
        return f"{node.op_type} weight layout {layout} is not handled" if float_w is not None \
            else "its float weight is not an initializer"
    if spec.weight != 1 or not original.input[0] or original.input[0] in layers.float_inits:
        return "its activation input is not the first input"
    if layers.readers(node.input[spec.weight]) != 1 or dq.input[1] not in layers.inits:
        return "its quantised weight is shared with another layer"
    if node.op_type == "Conv" and proto_attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
        return "auto_pad SAME is not handled"
    return ""


def _weight_site(layers: QdqLayers, node, original, spec, dq, clamp) -> _Site | str:
    """The site of a layer :func:`_unhandled` passed, or why its weight or input does not fit."""
    const = layers.const
    trans_a = bool(proto_attr(original, "transA", 0)) if node.op_type == "Gemm" else False
    q = const(dq.input[0])
    scale = const(dq.input[1]).astype(np.float64)
    zero = const(dq.input[2]).astype(np.float64) if len(dq.input) > 2 and dq.input[2] else np.zeros_like(scale)
    axis = proto_attr(dq, "axis", 1)
    w = numpy_helper.to_array(layers.float_inits[original.input[spec.weight]]).astype(np.float64)
    if w.shape != q.shape or (node.op_type != "Conv" and w.ndim != 2):
        return "its weight is not a 2-D matrix" if w.ndim != 2 else "weight shapes differ"
    per_channel = scale.size > 1
    if per_channel:
        shape = [1] * w.ndim
        shape[axis % w.ndim] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    scale, zero = np.broadcast_to(scale, w.shape), np.broadcast_to(zero, w.shape)
    info = np.iinfo(q.dtype)
    conv, to_groups, to_own = _group_maps(node, original, w, _layout(node, spec))
    x_scale = None
    q_x = layers.input_quantizer(node)
    if q_x is not None:
        xs = const(q_x.input[1])
        if xs is None or xs.size != 1:
            return "its input is not quantised per tensor"
        x_scale = float(xs.reshape(()))
    groups = to_groups(w)
    bias, bias_initializers = _bias(layers, node, original, spec, groups.shape[:2] + (1,))
    return _Site(node.name, node.input[0], original.output[0], clamp, bias, x_scale, conv, trans_a, groups,
                 to_groups(scale), to_groups(zero), (int(info.min), int(info.max)), per_channel, dq.input[0],
                 dq.input[1], bias_initializers, q.dtype, to_groups, to_own)


def _group_maps(node, original, w: np.ndarray, layout: str):
    """(the Conv's attributes or None, own layout -> [groups, out/group, K], and back)."""
    if node.op_type == "Conv":
        group = proto_attr(original, "group", 1)
        out = w.shape[0]
        spatial = w.ndim - 2
        conv = {"kernel": w.shape[2:], "group": group,
                "strides": list(proto_attr(original, "strides", [1] * spatial)),
                "dilations": list(proto_attr(original, "dilations", [1] * spatial)),
                "pads": list(proto_attr(original, "pads", [0] * (2 * spatial)))}
        return conv, (lambda a: a.reshape(group, out // group, -1)), (lambda a, shape=w.shape: a.reshape(shape))
    if layout == "kn":
        return None, (lambda a: a.T[None]), (lambda a: a[0].T)
    return None, (lambda a: a[None]), (lambda a: a[0])  # nk


def _bias(layers: QdqLayers, node, original, spec, shape) -> tuple[np.ndarray, tuple[str, str] | None]:
    """(the float bias as ``shape``, zeros without one; its int32 initializer and scale, when
    this layer alone reads them)."""
    b_name = original.input[spec.bias] if spec.bias is not None and len(original.input) > spec.bias else ""
    if b_name not in layers.float_inits:
        return np.zeros(shape), None
    bias = numpy_helper.to_array(layers.float_inits[b_name]).astype(np.float64).reshape(shape)
    dq_b = layers.producer.get(node.input[spec.bias]) if len(node.input) > spec.bias else None
    if dq_b is not None and dq_b.op_type == "DequantizeLinear" and dq_b.input[0] in layers.inits \
            and dq_b.input[1] in layers.inits and layers.readers(node.input[spec.bias]) == 1:
        return bias, (dq_b.input[0], dq_b.input[1])
    return bias, None


def _clamps(float_model: onnx.ModelProto) -> dict[str, tuple[float, float]]:
    """Layer name -> the clamp of the Relu or Clip that alone reads its output (float model)."""
    model = ir.serde.deserialize_model(float_model)
    opset = opset_of(model.opset_imports)
    out = {}
    for node in model.graph:
        users = node.outputs[0].consumers() if node.outputs else ()
        if not node.name or len(users) != 1 or len(node.outputs[0].uses()) != 1 or node.outputs[0].is_graph_output():
            continue
        act = read_activation(users[0], opset)
        if act is not None and not isinstance(act, str) and clamp_of(act) is not None:
            out[node.name] = clamp_of(act)
    return out


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


def _outputs(y: np.ndarray, site: _Site) -> np.ndarray:
    """The layer's output as [groups, out/group, positions], in :func:`_patches`' order."""
    if site.conv is None:
        return y.reshape(-1, y.shape[-1]).T[None]
    n, channels = y.shape[:2]
    g = site.conv["group"]
    return y.reshape(n, g, channels // g, -1).transpose(1, 2, 0, 3).reshape(g, channels // g, -1)


@dataclasses.dataclass
class _Data:
    train: tuple  # (patches [g, K, P] float32, targets [g, o, P] float32, bias [g, o, 1] float32)
    check: tuple


def _layer_data(site: _Site, work: onnx.ModelProto, float_session, samples, rng) -> _Data:
    """The layer's input in the QDQ model ``work`` and its float target, at a fixed random
    subset of positions per sample; the last :data:`CHECK_SHARE` of the samples are the check."""
    session = create_session(exposed(work, [site.x]), "disabled")
    per_sample = -(-POSITIONS // len(samples))
    xs, ts = [], []
    for sample in samples:
        x = np.asarray(session.run([site.x], sample)[0], np.float32)
        y = np.asarray(float_session.run([site.y], sample)[0], np.float32)
        cols, out = _patches(x, site), _outputs(y, site)
        if cols.shape[-1] > per_sample:
            pick = np.sort(rng.choice(cols.shape[-1], per_sample, replace=False))
            cols, out = cols[..., pick], out[..., pick]
        xs.append(np.ascontiguousarray(cols))
        ts.append(out if site.clamp is None else np.clip(out, *site.clamp))
    cut = len(samples) - max(1, int(round(len(samples) * CHECK_SHARE))) if len(samples) > 1 else 1
    b = site.bias.astype(np.float32)

    def part(items):
        return np.concatenate(items, -1)

    train = (part(xs[:cut]), part(ts[:cut]), b)
    check = (part(xs[cut:]), part(ts[cut:]), b) if cut < len(samples) else train
    return _Data(train, check)


def _integers(w, scale, zero, levels) -> np.ndarray:
    """Round to nearest, without the zero point: [g, o, K]."""
    return np.clip(np.rint(w / scale) + zero, *levels) - zero


def _optimise(site: _Site, scale: np.ndarray, data: _Data, nearest: np.ndarray, rng) -> np.ndarray:
    """The integer weights (as [groups, out/group, K], without the zero point) AdaRound finds."""
    w = site.float_weight
    x, t, b = data.train
    lo_int, hi_int = site.levels[0] - site.zero, site.levels[1] - site.zero
    base = np.floor(w / scale)
    free = (base >= lo_int) & (base + 1 <= hi_int)  # both roundings representable
    rest = np.clip(w / scale - base, *FRACTION_CLIP)
    norm = max(float(layer_error(scale * nearest, x, t, b, site.clamp).mean()), 1e-30)
    s32, base32, near32 = scale.astype(np.float32), base.astype(np.float32), nearest.astype(np.float32)
    import torch  # (torch: the optimiser; AdaRoundStep refuses the step without it)

    weights = torch.from_numpy(initial_v(rest, np.log).astype(np.float32))  # h(V) = rest: Wq = W
    v = weights.numpy()  # (the same memory: Adam's steps are seen here)
    adam = optimiser([weights])
    positions = x.shape[-1]
    warm = warmup_steps(ITERATIONS)
    for step in range(1, ITERATIONS + 1):
        pick = rng.integers(0, positions, min(BATCH, positions))
        xb, tb = x[..., pick], t[..., pick]
        sig = 1 / (1 + np.exp(-v))
        h = np.clip(sig * (ZETA - GAMMA) + GAMMA, 0, 1)
        y = (s32 * np.where(free, base32 + h, near32)) @ xb + b
        d = y - tb
        if site.clamp is not None:  # no gradient where the activation cuts the output off
            d = np.where((y > site.clamp[0]) & (y < site.clamp[1]), d, 0.0)
        grad_h = (2 / (norm * d.size)) * (d @ xb.transpose(0, 2, 1)) * s32
        if step > warm:
            beta = beta_at(step - warm, ITERATIONS - warm)
            tt = 2 * h - 1
            grad_h = grad_h + REGULARISER / h.size * (-beta * np.abs(tt) ** (beta - 1) * np.sign(tt) * 2)
        inside = (h > 0) & (h < 1) & free
        weights.grad = torch.from_numpy(np.where(inside, grad_h * sig * (1 - sig) * (ZETA - GAMMA), 0.0)
                                        .astype(np.float32))
        adam.step()
    h = np.clip(1 / (1 + np.exp(-v)) * (ZETA - GAMMA) + GAMMA, 0, 1)
    return np.where(free, base + (h >= 0.5), nearest)


def _values(site: _Site, index: QdqLayers, integers: np.ndarray, factors: np.ndarray) -> dict[str, np.ndarray]:
    """The initializers that write ``integers`` at the weight scale times ``factors``."""
    out = {site.initializer: site.to_own(np.clip(integers + site.zero, *site.levels)).astype(site.dtype)}
    if np.all(factors == 1.0):
        return out
    old = index.const(site.scale_initializer)
    factor = factors.reshape(-1) if old.size > 1 else np.float64(factors.reshape(-1)[0])
    new = (old.astype(np.float64) * factor).astype(old.dtype).reshape(old.shape)
    out[site.scale_initializer] = new
    if site.bias_initializers is not None and site.x_scale is not None:
        ints, scale_name = site.bias_initializers
        bias_scale = (np.float32(site.x_scale) * new.astype(np.float32)).reshape(index.const(scale_name).shape)
        values = site.bias.reshape(-1) / np.maximum(bias_scale.astype(np.float64).reshape(-1), 1e-30)
        out[scale_name] = bias_scale.astype(index.const(scale_name).dtype)
        out[ints] = np.clip(np.rint(values), -(2 ** 31), 2 ** 31 - 1).astype(np.int32).reshape(index.const(ints).shape)
    return out


def adaround_layers(float_model: onnx.ModelProto, qdq: onnx.ModelProto, samples,
                    cache: dict | None = None) -> Rounding:
    """The weight scale and AdaRound's integer weights for every handled layer of ``qdq``,
    layer by layer in graph order, each on the inputs the layers before it (as rounded
    here) give it. ``qdq`` is not changed (:func:`apply_rounding` writes the result).
    ``cache`` (reused across the search's trials) maps a layer's quantisation parameters to
    its result, so a layer quantised alike in a later trial is not optimised again (its
    earlier result is applied as it was found)."""
    cache = {} if cache is None else cache
    skipped: dict[str, str] = {}
    sites = weight_sites(QdqLayers(float_model, qdq), skipped)
    samples = [dict(s) for s in list(samples)[:SAMPLES]]
    work = onnx.ModelProto()
    work.CopyFrom(qdq)
    index = QdqLayers(float_model, work)
    keys = {s.name: (s.name, s.x_scale, s.scale.tobytes(), s.zero.tobytes()) for s in sites}
    float_session = None
    rng = np.random.default_rng(0)
    weights, results = {}, []
    for site in sites:
        if keys[site.name] not in cache:
            if float_session is None:
                float_session = create_session(exposed(float_model, [s.y for s in sites]), "disabled")
            cache[keys[site.name]] = _one_layer(site, work, index, float_session, samples, rng)
        values, result = cache[keys[site.name]]
        results.append(result)
        if values:
            weights.update(values)
            _write(work, values)
    return Rounding(weights, results, skipped)


def _one_layer(site: _Site, work: onnx.ModelProto, index: QdqLayers, float_session, samples, rng):
    data = _layer_data(site, work, float_session, samples, rng)
    x, t, b = data.check
    nearest = _integers(site.float_weight, site.scale, site.zero, site.levels)
    e_near = float(layer_error(site.scale * nearest, x, t, b, site.clamp).sum())
    factors = choose_factors(site.float_weight, site.scale, site.zero, site.levels, site.per_channel,
                             data.train, data.check, site.clamp)
    scale = site.scale * factors[..., None]
    chosen = _optimise(site, scale, data, _integers(site.float_weight, scale, site.zero, site.levels), rng)
    e_ada = float(layer_error(scale * chosen, x, t, b, site.clamp).sum())
    kept = e_ada < e_near
    result = RoundingResult(site.name, e_near, e_ada, kept,
                            "" if kept else "the rounding found did not lower the layer's error on the check "
                            "positions; ONNX Runtime's rounding kept", float(factors.mean()))
    return (_values(site, index, chosen, factors) if kept else {}), result


def _write(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> int:
    changed = 0
    for tensor in model.graph.initializer:
        if tensor.name in values:
            tensor.CopyFrom(numpy_helper.from_array(values[tensor.name], tensor.name))
            changed += 1
    return changed


def apply_rounding(qdq: onnx.ModelProto, rounding: Rounding) -> int:
    """Writes the chosen initializers into ``qdq`` (in place); returns how many layers changed."""
    _write(qdq, rounding.weights)
    return sum(r.kept for r in rounding.results)
