"""Property tests of the fold passes on random Conv/ConvTranspose/Gemm chains.

Each example builds a producer followed by 1-3 consumers (BatchNormalization; constant
Add, Mul, Sub, Div) as an ONNX graph, runs ``opfuse.optimize(..., verify=False)`` and then
checks, on its own:

- the numbers: the original and the optimised model agree on ONNX Runtime for every graph
  output (float32: |a - b| <= 1e-5 * scale + 1e-4 * |a|; float16: 2e-3 * scale + 1e-2 * |a|);
  an unrelated convolution that shares the producer's weight computes bit for bit as before;
- the decisions: which consumers must fold and which must be refused is decided here from
  the legality rules alone (a constant operand that broadcasts along the channel axis only;
  a producer whose weight and bias are constants; every value between producer and
  consumer used once and not a graph output; a folded float16 weight that stays finite),
  never from opfuse's code. Folding repeats, so a chain of legal consumers folds entirely;
  the first refused consumer blocks everything after it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, Phase, assume, given, note, settings
from hypothesis import strategies as st
from onnx import helper

import opfuse

from graphs import (  # tests/ is on sys.path under pytest's default import mode
    assert_outputs_close,
    constant_node,
    dead_nodes,
    model,
    node_names,
    ort_run,
    tensor,
    to_proto,
    unused_initializers,
    vinfo,
)
from profiles import examples

TOLERANCE = {np.float32: (1e-4, 1e-5), np.float16: (1e-2, 2e-3)}  # rtol, atol x scale
FLOAT16_MAX = float(np.finfo(np.float16).max)

SETTINGS = dict(
    deadline=None,
    derandomize=True,  # deterministic in CI
    print_blob=True,  # a failure prints @reproduce_failure(...) to replay it alone
    # the profile's phases (tests/profiles.py: shrinking only where asked), never the "explain"
    # phase: on a failure it re-runs hundreds of variants, and the minimal example plus the
    # notes (graph, expectations, report) already say what went wrong
    phases=[phase for phase in settings.default.phases if phase is not Phase.explain],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# why a consumer, once reached, must be refused -> words its reason must contain
REASON_WORDS = {
    "use": ("consumer", "graph output"),  # an intermediate value is used elsewhere
    "weight": ("graph input",),  # the producer's weight or bias can change at run time
    "nonconst": ("graph input",),  # the consumer's operand / statistics can change
    "shape": ("axis", "rank", "shape", "channel"),  # not per-channel
    "rank": ("rank",),  # the constant would raise the output's rank
    "divisor": ("divisor", "not affine"),  # c / y
    "overflow": ("overflow", "float16"),  # folded float16 weight would be inf
}


# -- building graphs --------------------------------------------------------------------


class Builder:
    """Accumulates one graph; constants can come from several kinds of source."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.pre_nodes: list[onnx.NodeProto] = []  # Constant/Identity sources, first
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.feeds: dict[str, np.ndarray] = {}

    def const(self, name: str, array: np.ndarray, src: str = "init") -> str:
        """Add a constant (or, for src "input"/"init_input", a run-time value)."""
        array = np.asarray(array)
        if src == "init":
            self.inits.append(tensor(name, array))
        elif src == "node":
            self.pre_nodes.append(constant_node(f"csrc_{name}", name, array))
        elif src == "identity":
            self.inits.append(tensor(f"{name}_raw", array))
            self.pre_nodes.append(
                helper.make_node("Identity", [f"{name}_raw"], [name], name=f"csrc_id_{name}")
            )
        elif src == "init_input":  # an initializer that is also a graph input
            self.inits.append(tensor(name, array))
            self.inputs.append(vinfo(name, array.shape, array.dtype))
        elif src == "input":  # a plain graph input, fed at run time
            self.inputs.append(vinfo(name, array.shape, array.dtype))
            self.feeds[name] = array
        else:
            raise AssertionError(src)
        return name

    def node(self, op: str, inputs, output: str, name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=name, **attrs))
        return output

    def output(self, name: str, shape) -> None:
        self.outputs.append(vinfo(name, list(shape), self.dtype))

    def model(self, opset: int) -> onnx.ModelProto:
        return model(self.pre_nodes + self.nodes, self.inputs, self.outputs, self.inits, opset,
                     name="g", fill_output_shapes=False, check=True)


@dataclasses.dataclass
class Consumer:
    name: str
    op: str  # the ONNX op type
    segment: list[str]  # values from the previous result through Identity nodes to its input
    identities: list[str]  # Identity node names between the previous result and it
    problem: str | None  # a REASON_WORDS key when it is illegal on its own
    scale: np.ndarray  # |s| per channel, float64, of z = s * y + t (for float16 bounds)
    shift: np.ndarray  # |t| per channel
    huge: bool = False
    divides_by_y: bool = False  # c / y
    expect: str = ""  # "fold", "refuse" or "blocked"
    why: str | None = None


@dataclasses.dataclass
class Producer:
    name: str
    op: str
    out_shape: list[int]
    weight_src: str
    bias_src: str | None
    max_weight: float  # max |W| after the cast to the model's dtype (alpha included)
    max_bias: float


@dataclasses.dataclass
class Case:
    model: onnx.ModelProto
    feeds: dict
    producer: Producer
    consumers: list[Consumer]
    exact_outputs: list[str]
    shared_weight: tuple[str, np.ndarray] | None  # (name, original values)
    dtype: np.dtype
    opset: int


def draw_float(data, lo, hi):
    return data.draw(st.floats(lo, hi, allow_nan=False, allow_infinity=False))


def draw_source(data, allow_runtime: bool = True) -> str:
    choices = ["init"] * 12 + ["node"] * 2 + ["identity"] * 2 + (["init_input"] if allow_runtime else [])
    return data.draw(st.sampled_from(choices))


def draw_const_shape(data, out_shape: list[int], last: bool) -> tuple[list[int], str | None]:
    """A shape that broadcasts into ``out_shape`` without changing it (or, when ``last``,
    one that raises its rank); returns (shape, problem)."""
    rank = len(out_shape)
    channels = out_shape[1]
    modes = ["per_channel"] * 4 + ["scalar"] * 2 + ["general"] * 3 + ["rank1"] * 2 + ["batch"] * 2
    if last:
        modes.append("rankup")
    mode = data.draw(st.sampled_from(modes))
    if mode == "scalar":
        shape = [1] * data.draw(st.integers(0, rank))
    elif mode == "per_channel":
        shape = [channels] + [1] * (rank - 2)
        if data.draw(st.booleans()):
            shape = [1] + shape
    elif mode == "rank1":  # a rank-1 constant aligns with the LAST axis
        shape = [out_shape[-1]]
    elif mode == "batch":  # [N, 1, ...] or [N, C, ...] ([M, 1] or [M, N] after Gemm)
        shape = [out_shape[0], channels if data.draw(st.booleans()) else 1] + [1] * (rank - 2)
    elif mode == "rankup":
        return [1] * (rank + 1), "rank"
    else:
        r = data.draw(st.integers(1, rank))
        shape = [
            out_shape[axis] if data.draw(st.sampled_from([True, True, False])) else 1
            for axis in range(rank - r, rank)
        ]
    aligned = [1] * (rank - len(shape)) + shape
    legal = all(n == 1 for axis, n in enumerate(aligned) if axis != 1)
    return shape, None if legal else "shape"


def per_channel_abs(c: np.ndarray, out_shape: list[int]) -> np.ndarray:
    """|c| as seen by each output channel (max over the other axes), float64."""
    a = np.abs(np.asarray(c, np.float64))
    if a.ndim > len(out_shape):
        a = a.reshape(a.shape[a.ndim - len(out_shape):])
    a = np.broadcast_to(a.reshape((1,) * (len(out_shape) - a.ndim) + a.shape), out_shape)
    return a.max(axis=tuple(i for i in range(len(out_shape)) if i != 1)) if a.size else a


def build_chain(
    data, rng, b: Builder, y: str, out_shape: list[int], opset: int, huge: bool
) -> tuple[list[Consumer], str, list[int]]:
    """Append 1-3 consumers (with Identity nodes between) after value ``y``."""
    dtype = b.dtype
    channels = out_shape[1]
    n = data.draw(st.integers(1, 3))
    huge_at = data.draw(st.integers(0, n - 1)) if huge else None
    consumers: list[Consumer] = []
    current, shape = y, list(out_shape)
    for i in range(n):
        segment, identities = [current], []
        for k in range(data.draw(st.sampled_from([0, 0, 0, 1, 2]))):
            name = f"id{i}_{k}"
            current = b.node("Identity", [current], f"v_{name}", name)
            segment.append(current)
            identities.append(name)
        last = i == n - 1
        if huge_at is not None and i == huge_at:
            op = "BatchNormalization"
        elif huge_at is not None and i < huge_at:
            op = data.draw(st.sampled_from(["Mul", "Div"]))  # keep y near BN's mean (0)
        else:
            ops = ["BatchNormalization"] * 2 + ["Add", "Mul", "Sub", "Div"]
            if i == 0:
                ops.append("DivR")  # c / y: only where nothing before it can change y
            op = data.draw(st.sampled_from(ops))
        out = f"v{i}"
        name = f"c{i}_{op}"
        problem = None
        if op == "BatchNormalization":
            is_huge = huge_at == i
            if is_huge:  # gamma 1e4, var 1e-6: s ~ 3e6..7e6, the weight overflows float16
                eps = 10 ** draw_float(data, -6, -5)
                gamma = np.full(channels, 1e4)
                beta = rng.uniform(-1, 1, channels)
                mean = np.zeros(channels)
                var = np.full(channels, 1e-6)
            else:
                eps = 10 ** draw_float(data, -6, -2)
                gamma = rng.uniform(0.5, 1.5, channels) * rng.choice([-1, 1], channels)
                beta = rng.uniform(-1, 1, channels)
                mean = rng.uniform(-1, 1, channels)
                var = rng.uniform(0.1, 2.0, channels)
            pdtype = dtype
            if dtype == np.float16 and opset >= 15 and data.draw(st.booleans()):
                pdtype = np.dtype(np.float32)  # BatchNormalization-15: float32 statistics
            params = [a.astype(pdtype) for a in (gamma, beta, mean, var)]
            srcs = ["init"] * 4
            special = data.draw(st.sampled_from(["init"] * 8 + ["node", "identity", "input"]))
            srcs[data.draw(st.integers(0, 3))] = special
            if special == "input":
                problem = "nonconst"
            inputs = [current] + [
                b.const(f"{name}_{role}", p, src)
                for role, p, src in zip(("scale", "B", "mean", "var"), params, srcs)
            ]
            attrs = {"epsilon": float(eps)}
            if opset >= 14 and data.draw(st.booleans()):
                attrs["training_mode"] = 0
            b.node("BatchNormalization", inputs, out, name, **attrs)
            g, bt, m, v = (p.astype(np.float64) for p in params)
            s = g / np.sqrt(v + np.float64(np.float32(eps)))
            consumers.append(Consumer(name, op, segment, identities, problem,
                                      np.abs(s), np.abs(bt - m * s), huge=is_huge))
        else:
            cshape, problem = draw_const_shape(data, shape, last and op != "DivR")
            if op in ("Add", "Sub"):
                c = rng.uniform(-1, 1, cshape)
            else:
                hi = 1.0 if huge else 2.0
                c = rng.uniform(0.5, hi, cshape) * rng.choice([-1, 1], cshape)
            c = np.asarray(c).astype(dtype)
            src = data.draw(st.sampled_from(["init"] * 12 + ["node"] * 2 + ["identity", "input"]))
            if src == "input":
                problem = "nonconst"
            if op == "DivR" and problem is None:
                problem = "divisor"
            cname = b.const(f"{name}_c", c, src)
            if op in ("Add", "Mul") and data.draw(st.booleans()):
                operands = [cname, current]
            elif op == "Sub" and data.draw(st.booleans()):
                operands = [cname, current]  # c - y: s = -1, t = c
            elif op == "DivR":
                operands = [cname, current]
            else:
                operands = [current, cname]
            b.node("Div" if op == "DivR" else op, operands, out, name)
            ca = per_channel_abs(c, shape) if problem is None else np.ones(channels)
            one, zero = np.ones(channels), np.zeros(channels)
            if op == "Mul":
                consumers.append(Consumer(name, op, segment, identities, problem, ca, zero))
            elif op == "Div":
                consumers.append(Consumer(name, op, segment, identities, problem, 1 / ca, zero))
            elif op == "DivR":
                consumers.append(Consumer(name, "Div", segment, identities, problem, one, zero,
                                          divides_by_y=True))
            else:
                consumers.append(Consumer(name, op, segment, identities, problem, one, ca))
            if len(cshape) > len(shape):
                shape = [1] * (len(cshape) - len(shape)) + shape
        current = out
    return consumers, current, shape


def add_taps(data, b: Builder, consumers: list[Consumer], final: str, final_shape, out_shape):
    """Give some values an extra consumer (a Relu that is a graph output) or make them
    graph outputs themselves; returns the set of intermediate values so tapped."""
    tapped = set()
    values = [v for c in consumers for v in c.segment]
    for k, v in enumerate(values):
        odds = ["none"] * (8 if k == 0 else 18) + ["relu", "output"]
        kind = data.draw(st.sampled_from(odds))
        if kind == "relu":
            b.node("Relu", [v], f"tap{k}", f"tap{k}_Relu")
            b.output(f"tap{k}", out_shape)
            tapped.add(v)
        elif kind == "output":
            b.output(v, out_shape)
            tapped.add(v)
    if data.draw(st.sampled_from([False] * 4 + [True])):  # a consumer of the final result
        b.node("Relu", [final], "tap_final", "tap_final_Relu")
        b.output("tap_final", final_shape)
    return tapped


# -- producers --------------------------------------------------------------------------


def draw_conv(data, rng, b: Builder, huge: bool) -> tuple[Producer, dict, list[str]]:
    """A Conv or ConvTranspose reading graph input 'x'; returns its attributes too."""
    dtype = b.dtype
    op = data.draw(st.sampled_from(["Conv", "ConvTranspose"]))
    nd = data.draw(st.integers(1, 3))
    batch = data.draw(st.integers(1, 2))
    gkind = data.draw(st.sampled_from(["1", "2", "depthwise"]))
    if gkind == "2":
        cin, group = data.draw(st.sampled_from([2, 4, 6, 8])), 2
    else:
        cin = data.draw(st.integers(1, 8))
        group = cin if gkind == "depthwise" else 1
    spatial = [data.draw(st.integers(3, 7 if nd < 3 else 5)) for _ in range(nd)]
    kernel = [data.draw(st.integers(1, 3)) for _ in range(nd)]
    strides = [data.draw(st.integers(1, 2)) for _ in range(nd)]
    dilations = [data.draw(st.integers(1, 2)) for _ in range(nd)]
    attrs: dict = {"kernel_shape": kernel, "strides": strides, "dilations": dilations}
    if group != 1 or data.draw(st.booleans()):
        attrs["group"] = group
    out_spatial = []
    if op == "Conv":
        pad_mode = data.draw(st.sampled_from(["pads", "pads", "SAME_UPPER", "SAME_LOWER", "VALID"]))
        pads = [data.draw(st.integers(0, 2)) for _ in range(2 * nd)] if pad_mode == "pads" else [0] * (2 * nd)
        for i in range(nd):
            if pad_mode.startswith("SAME"):
                dilations[i] = 1  # onnxruntime: "Dilation not supported for AutoPadType::SAME_*"
            if dilations[i] * (kernel[i] - 1) + 1 > spatial[i] + pads[i] + pads[i + nd]:
                dilations[i] = 1  # kernel <= 3 <= spatial size
            eff = dilations[i] * (kernel[i] - 1) + 1
            if pad_mode.startswith("SAME"):
                out_spatial.append(-(-spatial[i] // strides[i]))
            else:
                out_spatial.append((spatial[i] + pads[i] + pads[i + nd] - eff) // strides[i] + 1)
        if pad_mode == "pads":
            attrs["pads"] = pads
        else:
            attrs["auto_pad"] = pad_mode
    else:
        pads = [data.draw(st.integers(0, 1)) for _ in range(2 * nd)]
        attrs["pads"] = pads
        out_pad = [0] * nd
        if data.draw(st.booleans()):
            out_pad = [data.draw(st.integers(0, strides[i] - 1)) for i in range(nd)]
            attrs["output_padding"] = out_pad
        for i in range(nd):
            eff = dilations[i] * (kernel[i] - 1) + 1
            out_spatial.append(strides[i] * (spatial[i] - 1) + out_pad[i] + eff - pads[i] - pads[i + nd])
    # output channels: a multiple of group (depthwise: multiplier 1 or 2); sometimes equal
    # to the last output axis, so that a rank-1 [C] constant is valid ONNX (and illegal)
    if gkind == "depthwise":
        candidates = [m * cin for m in (1, 2) if m * cin <= 8]
    else:
        candidates = [c for c in range(1, 9) if c % group == 0]
    if data.draw(st.booleans()) and out_spatial[-1] in candidates:
        cout = out_spatial[-1]
    else:
        cout = data.draw(st.sampled_from(candidates))
    if op == "Conv":
        wshape = [cout, cin // group, *kernel]
    else:
        wshape = [cin, cout // group, *kernel]
    fan_in = (cin // group) * math.prod(kernel)
    w = rng.uniform(-1, 1, wshape) / math.sqrt(fan_in)
    bias = rng.uniform(-1, 1, cout) if data.draw(st.booleans()) else None
    if huge:  # small weights and bias but one weight of 0.5: y stays small, W' overflows
        w *= 0.05
        w.flat[0] = 0.5
        bias = None if bias is None else bias * 1e-4
    w = w.astype(dtype)
    weight_src = draw_source(data)
    inputs = ["x", b.const("W", w, weight_src)]
    bias_src = None
    if bias is not None:
        bias = bias.astype(dtype)
        bias_src = draw_source(data)
        inputs.append(b.const("B", bias, bias_src))
    in_shape = [batch, cin, *spatial]
    b.inputs.insert(0, vinfo("x", in_shape, dtype))
    x = rng.standard_normal(in_shape) * (1e-4 if huge else 1.0)
    b.feeds["x"] = x.astype(dtype)
    b.node(op, inputs, "y", "producer", **attrs)
    out_shape = [batch, cout, *out_spatial]
    assert all(n >= 1 for n in out_shape)
    prod = Producer(
        "producer", op, out_shape, weight_src, bias_src,
        float(np.max(np.abs(w.astype(np.float64)))),
        0.0 if bias is None else float(np.max(np.abs(bias.astype(np.float64)))),
    )
    return prod, attrs, inputs


def draw_gemm(data, rng, b: Builder, huge: bool) -> tuple[Producer, dict, list[str]]:
    dtype = b.dtype
    m = data.draw(st.sampled_from([2, 3, 4, 1]))  # M > 1 mostly: [M, 1] must then be refused
    k, n = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    trans_a, trans_b = data.draw(st.booleans()), data.draw(st.booleans())
    alpha = draw_float(data, 0.5, 2.0) * data.draw(st.sampled_from([-1, 1]))
    beta = draw_float(data, 0.5, 2.0) * data.draw(st.sampled_from([-1, 1]))
    attrs: dict = {}
    if trans_a or data.draw(st.booleans()):
        attrs["transA"] = int(trans_a)
    if trans_b or data.draw(st.booleans()):
        attrs["transB"] = int(trans_b)
    if data.draw(st.booleans()):
        attrs["alpha"] = alpha
    else:
        alpha = 1.0
    c_kind = data.draw(st.sampled_from(["none", "[N]", "[1,N]", "[]", "[1]"]))
    if c_kind != "none" and data.draw(st.booleans()):
        attrs["beta"] = beta
    else:
        beta = 1.0
    w = rng.uniform(-1, 1, [n, k] if trans_b else [k, n]) / math.sqrt(k)
    if huge:
        w *= 0.05
        w.flat[0] = 0.5
    w = w.astype(dtype)
    weight_src = draw_source(data)
    inputs = ["x", b.const("W", w, weight_src)]
    bias_src, max_bias = None, 0.0
    if c_kind != "none":
        cshape = {"[N]": [n], "[1,N]": [1, n], "[]": [], "[1]": [1]}[c_kind]
        c = (rng.uniform(-1, 1, cshape) * (1e-4 if huge else 1.0)).astype(dtype)
        bias_src = draw_source(data)
        inputs.append(b.const("B", c, bias_src))
        max_bias = float(np.max(np.abs(c.astype(np.float64)))) * abs(beta)
    a_shape = [k, m] if trans_a else [m, k]
    b.inputs.insert(0, vinfo("x", a_shape, dtype))
    x = rng.standard_normal(a_shape) * (1e-4 if huge else 1.0)
    b.feeds["x"] = x.astype(dtype)
    b.node("Gemm", inputs, "y", "producer", **attrs)
    prod = Producer("producer", "Gemm", [m, n], weight_src, bias_src,
                    float(np.max(np.abs(w.astype(np.float64)))) * abs(alpha), max_bias)
    return prod, {**attrs, "_c_kind": c_kind}, inputs


def draw_case(data, dtype, producer_kind: str, huge: bool = False) -> Case:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    b = Builder(dtype)
    if producer_kind == "conv":
        opset = data.draw(st.sampled_from([9, 13, 15, 17]))
        prod, attrs, inputs = draw_conv(data, rng, b, huge)
    else:
        prod, attrs, inputs = draw_gemm(data, rng, b, huge)
        # Gemm-9 requires C; C became optional in Gemm-11
        opset = data.draw(st.sampled_from([9, 13, 15, 17] if len(inputs) == 3 else [13, 15, 17]))
        attrs.pop("_c_kind")
    if dtype == np.float16:
        # float16 rounds each intermediate of the ORIGINAL chain to 11 bits; on a tensor of
        # a few elements that cancel (y - c ~ 0) the scale is no measure of that error
        assume(math.prod(prod.out_shape) >= 12)
    consumers, final, final_shape = build_chain(data, rng, b, "y", prod.out_shape, opset, huge)
    b.output(final, final_shape)

    exact, shared = [], None
    if data.draw(st.sampled_from([False, False, True]), label="share weight"):
        # a second producer with the same weight (and bias): it must compute as before
        b.node(prod.op, inputs, "shared_out", "shared", **attrs)
        b.output("shared_out", prod.out_shape)
        exact.append("shared_out")
        w_init = next((t for t in b.inits if t.name in ("W", "W_raw")), None)
        if w_init is not None:
            shared = (w_init.name, onnx.numpy_helper.to_array(w_init).copy())
    tapped = add_taps(data, b, consumers, final, final_shape, prod.out_shape)
    model = b.model(opset)
    case = Case(model, b.feeds, prod, consumers, exact, shared, np.dtype(dtype), opset)
    decide(case, tapped)
    return case


# -- the expected outcome, from the rules alone ------------------------------------------


def decide(case: Case, tapped: set[str]) -> None:
    """Mark every consumer "fold", "refuse" (with why) or "blocked"."""
    prod = case.producer
    weight_problem = prod.weight_src == "init_input" or prod.bias_src == "init_input"
    reached = True
    # bounds on |W| and |b| of the producer as it is after the folds so far (float16 check)
    s_lo = s_hi = 1.0
    b_hi = prod.max_bias
    for c in case.consumers:
        if not reached:
            c.expect = "blocked"
            continue
        c.expect = "refuse"
        if any(v in tapped for v in c.segment):
            c.why = "use"
        elif weight_problem:
            c.why = "weight"
        elif c.problem:
            c.why = c.problem
        else:
            new_lo, new_hi = s_lo * c.scale.min(), s_hi * c.scale.max()
            new_b_hi = b_hi * c.scale.max() + c.shift.max()
            if case.dtype == np.float16:
                lo_w, hi_w = prod.max_weight * new_lo, prod.max_weight * new_hi
                if lo_w > 1.01 * FLOAT16_MAX:
                    c.why = "overflow"
                else:  # the generator keeps ordinary chains far from float16's limit
                    assert hi_w < FLOAT16_MAX / 4 and new_b_hi < FLOAT16_MAX / 4, (
                        "test generator made an ambiguous float16 case"
                    )
                assert c.why == "overflow" if c.huge else c.why is None
            if c.why is None:
                c.expect = "fold"
                s_lo, s_hi, b_hi = new_lo, new_hi, new_b_hi
        reached = c.expect == "fold"


# -- the check ---------------------------------------------------------------------------


def subnormal_floor(case: Case) -> float:
    """The absolute error float16 allows at the outputs whichever way a fold rounds.

    Below 6.1e-5 float16 values are subnormal: they carry an absolute rounding error of
    up to 2**-24 (6e-8), not a relative one. A fold upstream changes where that rounding
    happens (W * c rounded, then the conv; instead of the conv rounded, then * c), and a
    consumer left in the graph after it multiplies the difference by its |s|: the huge
    BatchNormalization (s ~ 3e6) turns 6e-8 into 0.2 on outputs of scale 50. Allowed:
    a few subnormal steps times the product of the scales of the consumers not folded.
    """
    if case.dtype != np.float16:
        return 0.0
    gain = math.prod(float(np.max(c.scale)) for c in case.consumers if c.expect != "fold")
    return 4 * 2.0**-24 * gain


def check_case(case: Case) -> None:
    rtol, atol = TOLERANCE[case.dtype.type]
    floor = subnormal_floor(case)
    note(f"opset {case.opset}, producer {case.producer}")
    for c in case.consumers:
        note(f"  {c.name}: expect {c.expect} ({c.why}); problem {c.problem}; via {c.segment}")
    note(onnx.printer.to_text(case.model.graph))

    expected = ort_run(case.model, case.feeds)
    for name, value in expected.items():
        if not case.consumers[0].divides_by_y:
            assert np.all(np.isfinite(value)), f"generator made a non-finite output {name}"

    before = case.model.SerializeToString()
    # the folds' own rules, exactly (the clean-up stage, which removes Identity nodes
    # before the folds see them, is checked on the same graphs at the end)
    result, report = opfuse.optimize(case.model, verify=False, cleanup=False)
    note(report.to_json())
    onnx.checker.check_model(to_proto(result))

    prod = case.producer
    names = node_names(result)
    assert prod.name in names
    pattern_of = {c.name: f"{prod.op}+{c.op}" for c in case.consumers}
    removed_by = {}
    for record in report.records:
        for r in record.removed:
            removed_by[r] = record

    folded = [c for c in case.consumers if c.expect == "fold"]
    expect_removed = {c.name for c in folded} | {i for c in folded for i in c.identities}
    assert set(removed_by) == expect_removed, (
        f"removed {sorted(removed_by)}, expected {sorted(expect_removed)}"
    )
    original_nodes = [n for n in node_names(case.model) if not n.startswith("csrc_")]
    kept_nodes = [n for n in names if not n.startswith("csrc_")]
    assert sorted(kept_nodes) == sorted(n for n in original_nodes if n not in expect_removed)

    for c in case.consumers:
        reason = report.reason_for(c.name)
        if c.expect == "fold":
            record = removed_by[c.name]
            assert record.pattern == pattern_of[c.name]
            assert record.node == prod.name
            assert reason is None, f"{c.name} folded but also refused: {reason}"
        elif c.expect == "refuse":
            assert reason, f"{c.name} should be refused ({c.why}) with a reason"
            words = REASON_WORDS[c.why]
            if c.why == "use" and (c.problem or prod.weight_src == "init_input"):
                words = ()  # several rules fail at once; any reason will do
            assert not words or any(w in reason.lower() for w in words), (
                f"{c.name} refused ({c.why}) with reason {reason!r}"
            )
            refusal = report.refused(c.name)[0]
            assert refusal.anchor == prod.name
        else:  # blocked: its input is no longer the producer's
            assert c.name in names
            if c.op == "BatchNormalization":
                assert reason, f"{c.name} stays in the graph with no reason given"

    assert not dead_nodes(result), f"dead nodes left: {dead_nodes(result)}"
    assert not unused_initializers(result), f"unused initializers: {unused_initializers(result)}"
    if case.shared_weight is not None:
        name, values = case.shared_weight
        assert name in result.graph.initializers, "the shared weight disappeared"
        kept = result.graph.initializers[name].const_value.numpy()
        assert np.array_equal(kept, values), "the shared weight was modified in place"
        if any(c.op in ("BatchNormalization", "Mul", "Div") for c in folded):
            # a fold that scales the weight makes a private copy, which costs bytes
            assert report.extra_bytes > 0, "a private copy of a shared weight costs bytes"
        if folded and all(c.op == "Add" for c in folded):
            # pure shifts change only the bias: the weight stays shared, no copy
            def source(v):  # through the Identity nodes an exporter puts on weights
                while v.producer() is not None and v.producer().op_type == "Identity":
                    v = v.producer().inputs[0]
                return v.name

            assert all(source(n.inputs[1]) == name for n in result.graph if n.op_type in ("Conv", "ConvTranspose"))

    actual = ort_run(result, case.feeds)
    assert_outputs_close(expected, actual, rtol, atol, exact=case.exact_outputs, floor=floor)
    assert case.model.SerializeToString() == before, "optimize mutated the caller's ModelProto"

    # with the clean-up stage (the default): the same outputs, at least the same folds,
    # no Identity between computed values, nothing dead, inputs and outputs by their names
    cleaned, cleaned_report = opfuse.optimize(case.model, verify=False)
    assert [v.name for v in cleaned.graph.outputs] == [v.name for v in result.graph.outputs]
    assert [v.name for v in cleaned.graph.inputs] == [v.name for v in result.graph.inputs]
    assert not dead_nodes(cleaned) and not unused_initializers(cleaned)
    assert not [n.name for n in cleaned.graph if n.op_type in ("Identity", "Constant")
                and not (n.op_type == "Identity" and n.outputs[0].is_graph_output()  # two names kept
                         and (n.inputs[0].is_graph_input() or n.inputs[0].is_graph_output()))]
    assert sum(n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization", "Add", "Sub",
                             "Mul", "Div") for n in cleaned.graph) <= sum(
        n.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization", "Add", "Sub", "Mul",
                      "Div") for n in result.graph)
    assert_outputs_close(expected, ort_run(cleaned, case.feeds), rtol, atol, exact=case.exact_outputs,
                         floor=floor)


# -- the properties ----------------------------------------------------------------------


@settings(max_examples=examples(600), **SETTINGS)
@given(data=st.data())
def test_conv_chains_fold_exactly_the_legal_consumers(data):
    check_case(draw_case(data, np.float32, "conv"))


@settings(max_examples=examples(300), **SETTINGS)
@given(data=st.data())
def test_gemm_chains_fold_exactly_the_legal_consumers(data):
    check_case(draw_case(data, np.float32, "gemm"))


@settings(max_examples=examples(400), **SETTINGS)
@given(data=st.data())
def test_float16_chains_refuse_folds_that_overflow(data):
    kind = data.draw(st.sampled_from(["conv", "conv", "gemm"]))
    huge = data.draw(st.sampled_from([False, False, True]), label="huge BN scale")
    check_case(draw_case(data, np.float16, kind, huge=huge))


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_rank1_constant_of_length_c_is_refused(op, nd):
    """[C] after an N-D conv whose last axis also has C entries: valid ONNX, and it
    broadcasts along width, so it must not fold even though its length equals C."""
    c = 4
    b = Builder(np.float32)
    rng = np.random.default_rng(nd)
    spatial = [c] * nd  # Conv (k=1) and ConvTranspose (k=1) keep the spatial size
    wshape = [c, 3, *[1] * nd] if op == "Conv" else [3, c, *[1] * nd]
    b.inputs.append(vinfo("x", [1, 3, *spatial], np.float32))
    b.feeds["x"] = rng.standard_normal([1, 3, *spatial]).astype(np.float32)
    w = b.const("W", rng.standard_normal(wshape).astype(np.float32))
    b.node(op, ["x", w], "y", "producer")
    k = b.const("k", rng.uniform(0.5, 2, [c]).astype(np.float32))
    b.node("Mul", ["y", k], "z", "mul")
    b.output("z", [1, c, *spatial])
    model = b.model(17)
    expected = ort_run(model, b.feeds)
    result, report = opfuse.optimize(model, verify=False)
    assert "mul" in node_names(result)
    assert report.reason_for("mul")
    assert not report.records
    assert_outputs_close(expected, ort_run(result, b.feeds), 1e-4, 1e-5)
