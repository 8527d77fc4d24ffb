"""Properties of the quantiser on small random graphs (hypothesis), each judged independently.

Every value here is drawn from numpy arrays (weights, samples, ranges); the graphs are written
from ONNX's own operators; the oracle is the ONNX definition of QuantizeLinear and
DequantizeLinear as ONNX Runtime runs it, or plain numpy, never opfuse's own reading of a QDQ
graph (:mod:`opfuse.quantization.qdq.layers`) or its own figures:

1. the round trip of every quantised weight and activation is within half a step of the value;
2. the ranges' ``quantisation_error`` is the brute-force round trip's error (a uniform step's
   ``s^2/12`` a value inside the range, the squared distance to the range outside);
3. the mixed-precision search never steps down: each step it accepts has an output SQNR on
   the tuning samples, recomputed here, at least that of the step before, from the all-int8 model;
4. every int32 bias the pipeline writes has the scale ``x_scale * w_scale`` (per channel).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import helper, numpy_helper
from onnx_ir import serde

import opfuse
from opfuse.errors import VerificationError
from graphs import model, tensor, vinfo
from opfuse.quantization.presets import PRESETS
from opfuse.quantization.qdq.quantizer import Quantizer, prepare
from opfuse.quantization.algorithms.ranges import quantisation_error
from opfuse.quantization.report import QuantReport
from opfuse.quantization.algorithms.search import KEEP_ACTIONS, monotone_search
from opfuse.quantization.algorithms.trials import TrialMaker
from opfuse.quantization.qdq.sqnr import OutputReference
from opfuse.runtime import create_session

SLOW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOATS = st.floats(-4, 4, allow_nan=False, width=32)


@st.composite
def conv_nets(draw):
    """x [1, 3, 8, 8] -> Conv (bias) -> Relu -> Conv (bias) -> Flatten -> Gemm (bias): weights drawn."""
    c = draw(st.integers(2, 6))
    spread = draw(st.sampled_from([0.1, 0.5, 2.0]))
    w1 = draw(hnp.arrays(np.float32, (c, 3, 3, 3), elements=FLOATS)) * spread
    w2 = draw(hnp.arrays(np.float32, (c, c, 1, 1), elements=FLOATS)) * spread
    b1, b2 = (draw(hnp.arrays(np.float32, (c,), elements=FLOATS)) for _ in range(2))
    wg = draw(hnp.arrays(np.float32, (4, c * 64), elements=FLOATS)) * 0.1
    bg = draw(hnp.arrays(np.float32, (4,), elements=FLOATS))
    nodes = [helper.make_node("Conv", ["x", "W1", "B1"], ["y1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["y1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "W2", "B2"], ["y2"], name="conv2"),
             helper.make_node("Flatten", ["y2"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "WG", "BG"], ["out"], name="fc", transB=1)]
    inits = [tensor("W1", w1), tensor("B1", b1), tensor("W2", w2), tensor("B2", b2), tensor("WG", wg), tensor("BG", bg)]
    return model(nodes, [vinfo("x", [1, 3, 8, 8])], [vinfo("out", [1, 4])], inits)


def quantised(net, calib, **options):
    """``opfuse.quantize``'s model, or the draw rejected where verification refuses it (a draw whose
    int8 outputs are no approximation of the float ones, under 3 dB: nothing is written to check)."""
    try:
        q, _ = opfuse.quantize(net, calib, reconstruct=False, holdout=2, **options)
    except VerificationError:
        assume(False)
    return serde.serialize_model(q)


def samples_of(seed: int, count: int = 12) -> list[dict]:
    r = np.random.default_rng(seed)
    return [{"x": r.normal(0, 1, (1, 3, 8, 8)).astype(np.float32)} for _ in range(count)]


def dequantize(inits: dict, dq: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray]:
    """(DequantizeLinear's output, its scale broadcast), by the ONNX definition (q - zero) * scale."""
    q = numpy_helper.to_array(inits[dq.input[0]]).astype(np.float64)
    scale = numpy_helper.to_array(inits[dq.input[1]]).astype(np.float64)
    zero = numpy_helper.to_array(inits[dq.input[2]]).astype(np.float64) if len(dq.input) > 2 else 0 * scale
    if scale.size > 1:
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        shape = [1] * q.ndim
        shape[axis] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return (q - zero) * scale, np.broadcast_to(scale, q.shape)


def output_db(reference: list[np.ndarray], got: list[np.ndarray]) -> float:
    signal = sum(float((a.astype(np.float64) ** 2).sum()) for a in reference)
    noise = sum(float(((a.astype(np.float64) - b) ** 2).sum()) for a, b in zip(reference, got))
    return np.inf if noise == 0 else 10 * np.log10(signal / noise)


# -- 1. the round trip ---------------------------------------------------------------------------

@SLOW
@given(net=conv_nets(), seed=st.integers(0, 2**16), preset=st.sampled_from(["cpu", "per-tensor"]))
def test_every_quantised_value_is_within_half_a_step_of_its_float_value(net, seed, preset):
    """Rounded to nearest (no AdaRound, no reconstruction), with MinMax ranges: every weight
    element, and every activation value inside the range its 8 bits represent, is within half
    its step of the value the quantised model computed there."""
    calib = samples_of(seed)
    proto = quantised(net, calib, preset=preset, calibrate="minmax", adaround=False, equalize=False,
                      bias_correction=False)
    inits = {i.name: i for i in proto.graph.initializer}
    float_inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in net.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    checked = 0
    for node in proto.graph.node:
        if node.op_type in ("Conv", "Gemm") and node.input[1] in producer:
            values, scale = dequantize(inits, producer[node.input[1]])
            w = float_inits[{"conv1": "W1", "conv2": "W2", "fc": "WG"}[node.name]]
            assert np.all(np.abs(values - w) <= scale / 2 * (1 + 1e-6) + 1e-12), node.name
            checked += 1
    assert checked == 3
    pairs = [(n.input[0], c.output[0]) for n in proto.graph.node if n.op_type == "QuantizeLinear"
             and n.input[0] not in inits for c in proto.graph.node if c.op_type == "DequantizeLinear"
             and c.input[0] == n.output[0]]
    assert pairs
    names = sorted({t for pair in pairs for t in pair})
    exposed = onnx.ModelProto()
    exposed.CopyFrom(proto)
    exposed.graph.output.extend(helper.make_empty_tensor_value_info(t) for t in names
                                if t not in {o.name for o in proto.graph.output})
    session = create_session(exposed, "disabled")
    grids = {}  # DQ output -> (step, lowest and highest value its 8 bits represent)
    for c in proto.graph.node:
        if c.op_type == "DequantizeLinear" and c.input[1] in inits and c.input[0] not in inits:
            step = float(numpy_helper.to_array(inits[c.input[1]]))
            zero = numpy_helper.to_array(inits[c.input[2]])
            info = np.iinfo(zero.dtype)
            grids[c.output[0]] = (step, (info.min - float(zero)) * step, (info.max - float(zero)) * step)
    inside = 0
    for sample in calib[:-2]:  # the calibration samples (the last two are held out)
        values = dict(zip(names, session.run(names, sample)))
        for before, after in pairs:
            step, lowest, highest = grids[after]
            x = values[before].astype(np.float64)
            within = (x >= lowest) & (x <= highest)  # outside, the round trip clips: a range's matter
            err = np.abs(x - values[after])[within]
            inside += err.size
            assert err.size == 0 or err.max() <= step / 2 * (1 + 1e-5) + 1e-7, (before, err.max(), step)
    assert inside > 0


# -- 2. the ranges' error ------------------------------------------------------------------------

def round_trip(values: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """uint8 QuantizeLinear then DequantizeLinear over (lo, hi) widened to contain 0, run by ONNX Runtime."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = np.float32((hi - lo) / 255)
    zero = np.uint8(np.clip(np.rint(-lo / scale), 0, 255))
    nodes = [helper.make_node("QuantizeLinear", ["v", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["out"])]
    m = model(nodes, [vinfo("v", [values.size])], [vinfo("out", [values.size])],
              [tensor("s", scale), tensor("z", zero)])
    return create_session(m, "disabled").run(None, {"v": values.astype(np.float32)})[0].astype(np.float64)


@settings(max_examples=30, deadline=None)
@given(lo=st.floats(-8, -0.01), hi=st.floats(0.01, 8), shift=st.floats(0, 1))
def test_inside_the_range_the_error_is_a_uniform_steps_as_the_brute_force_round_trip_gives(lo, hi, shift):
    """Values spread evenly over the range (many per step, none exactly 0): the estimate
    ``count * s^2 / 12`` is the brute-force sum of squared round-trip errors within 3%."""
    step = (hi - lo) / 20000
    values = lo + (np.arange(20000) + 0.5 * shift + 0.25) * step
    values = values[values != 0]
    counts, edges = np.histogram(values, bins=4096, range=(lo, hi))
    centres = (edges[:-1] + edges[1:]) / 2
    estimate = float(quantisation_error(centres, counts.astype(np.float64), np.array([lo]), np.array([hi]))[0])
    brute = float(((values - round_trip(values, lo, hi)) ** 2).sum())
    assert estimate == pytest.approx(brute, rel=0.03)


@settings(max_examples=30, deadline=None)
@given(hi=st.floats(0.5, 8), beyond=st.floats(0.1, 10), count=st.integers(1, 50))
def test_outside_the_range_the_error_is_the_squared_distance_the_round_trip_clips(hi, beyond, count):
    """Values above the range: the estimate is the squared distance to ``hi``; the brute-force
    round trip clips to the top of the grid, which is within one step of ``hi``."""
    lo = -hi / 3
    v = hi + beyond
    centres, counts = np.array([v]), np.array([float(count)])
    estimate = float(quantisation_error(centres, counts, np.array([lo]), np.array([hi]))[0])
    assert estimate == pytest.approx(count * beyond ** 2, rel=1e-9)
    brute = float(((np.full(count, v) - round_trip(np.full(count, v), lo, hi)) ** 2).sum())
    s = (hi - lo) / 255
    assert count * max(beyond - s, 0) ** 2 <= brute * (1 + 1e-5) and brute <= count * (beyond + s) ** 2 * (1 + 1e-5)


# -- 3. the search never steps down --------------------------------------------------------------

@SLOW
@given(net=conv_nets(), seed=st.integers(0, 2**16), keep_as=st.sampled_from(["float", "int16"]))
def test_the_search_never_accepts_a_step_that_lowers_the_tuning_sqnr(net, seed, keep_as, tmp_path_factory):
    """An unreachable target, a few steps: each accepted step's tuning SQNR, recomputed here
    from the candidate's own outputs, is at least the one before it, starting from the
    all-int8 model."""
    preset = PRESETS["cpu"]
    float_model, _ = prepare(net, preset)
    tune = samples_of(seed, 8)
    check = samples_of(seed + 1, 4)
    quantizer = Quantizer(float_model, preset, tune, tmp_path_factory.mktemp("search"), method="minmax")
    maker = TrialMaker(quantizer, float_model, tune, adaround=False, bias_correction=True)
    report = QuantReport()
    action = KEEP_ACTIONS[keep_as]
    outcome = monotone_search(lambda keep: maker.make(keep, keep_as=action.name), float_model,
                              OutputReference(float_model, tune), OutputReference(float_model, check), report, keep_as=action,
                              min_sqnr=300.0, max_steps=3)
    reference = create_session(float_model, "disabled")
    wanted = [reference.run(None, s)[0] for s in tune]

    def tuning_db(qdq):
        session = create_session(qdq, "disabled")
        return output_db(wanted, [session.run(None, s)[0] for s in tune])

    figures = [tuning_db(maker.make([], keep_as=action.name))]
    for step in report.search:
        if step.phase == "step" and step.accepted:
            figures.append(tuning_db(maker.make(step.kept, keep_as=action.name)))
    assert all(b >= a - 1e-6 for a, b in zip(figures, figures[1:])), figures
    assert tuning_db(outcome.model) >= figures[0] - 1e-6


# -- 4. the bias scale ---------------------------------------------------------------------------

@SLOW
@given(net=conv_nets(), seed=st.integers(0, 2**16), preset=st.sampled_from(["cpu", "per-tensor"]))
def test_every_written_bias_scale_is_the_input_scale_times_the_weight_scale(net, seed, preset):
    """Through the whole pipeline, AdaRound's weight scales (per-tensor) and bias correction
    included: each int32 bias's DequantizeLinear scale is x_scale * w_scale, channel by channel."""
    proto = quantised(net, samples_of(seed), preset=preset)
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    producer = {o: n for n in proto.graph.node for o in n.output}
    checked = 0
    for node in proto.graph.node:
        if node.op_type not in ("Conv", "Gemm") or len(node.input) < 3:
            continue
        x_dq, w_dq, b_dq = (producer.get(name) for name in node.input[:3])
        if b_dq is None or inits[b_dq.input[0]].dtype != np.int32:
            continue
        x_scale = inits[x_dq.input[1]].astype(np.float64)
        w_scale = inits[w_dq.input[1]].astype(np.float64)
        expected = np.broadcast_to(x_scale * w_scale, inits[b_dq.input[1]].shape)
        np.testing.assert_allclose(inits[b_dq.input[1]].astype(np.float64), expected, rtol=1e-6)
        checked += 1
    assert checked >= 2
