"""Property test: random conv epilogue chains, fused vs unfused on ONNX Runtime.

Each example is Conv -> [Add(residual)] -> [activation] -> [activation], with random
residual sources (graph input, a Relu, a second conv, a broadcasting shape, a strongly
negative branch), random activations including every Clip form, and sometimes an extra
consumer or a graph output in the middle. The test decides independently which ops must
be absorbed and checks the fused graph has exactly those fused, and the same outputs.

The activations are not opfuse's table: they are the ONNX specification's activation
functions (each read from onnx.defs, its float attributes drawn at random), kept when ONNX
Runtime's FusedConv runs them, a set written down here from ONNX Runtime's own sources
(``fused_conv.cc`` maps the ``activation`` attribute to MLAS's activation kinds: Relu,
LeakyRelu, Tanh, Sigmoid, Clip, HardSigmoid; HardSwish measured on onnxruntime 1.32).
"""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

import opfuse
from graphs import assert_same, model, tensor, vinfo

F32MAX = float(np.finfo(np.float32).max)
OPSET = 18
# the ONNX specification's activation functions of one float input
ONNX_ACTIVATIONS = ("Relu", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu", "Celu",
                    "Softplus", "Softsign", "Mish", "ThresholdedRelu")
# what ONNX Runtime's FusedConv runs (the module docstring says where this comes from)
FUSED_CONV_RUNS = {"Relu", "LeakyRelu", "Tanh", "Sigmoid", "Clip", "HardSigmoid", "HardSwish"}


def _float_attributes(op: str) -> list[str]:
    """The float attributes onnx's schema declares for ``op`` (alpha, beta...)."""
    schema = onnx.defs.get_schema(op, OPSET)
    return sorted(name for name, a in schema.attributes.items() if a.type == onnx.defs.OpSchema.AttrType.FLOAT)


# name -> (node factory(input, output, name, rng) -> (nodes, inits), kind, bounds constant?)
def _act(op):
    def make(i, o, n, rng):
        attrs = {a: float(rng.uniform(0.05, 0.6)) for a in _float_attributes(op)}
        return [helper.make_node(op, [i], [o], name=n, **attrs)], []
    return make


def _clip(lo=None, hi=None, graph_input_lo=False):
    def make(i, o, n, rng):
        inits, inputs = [], [i]
        if lo is not None or graph_input_lo:
            inputs.append(f"{n}.lo")
            if not graph_input_lo:
                inits.append(tensor(f"{n}.lo", np.float32(lo)))
        elif hi is not None:
            inputs.append("")
        if hi is not None:
            inputs.append(f"{n}.hi")
            inits.append(tensor(f"{n}.hi", np.float32(hi)))
        return [helper.make_node("Clip", inputs, [o], name=n)], inits
    return make


ACTS = {
    **{op.lower(): (_act(op), op, True) for op in ONNX_ACTIVATIONS if op in FUSED_CONV_RUNS},
    "clip06": (_clip(0.0, 6.0), "Clip", True),
    "clip-lo": (_clip(lo=-0.5), "Clip", True),
    "clip-hi": (_clip(hi=1.5), "Clip", True),
    "clip-none": (_clip(), "Clip", True),
    "clip-runtime-bound": (_clip(graph_input_lo=True), "Clip", False),
}


def test_the_alphabet_is_onnx_and_holds_every_activation_fused_conv_runs():
    for op in ONNX_ACTIVATIONS:
        schema = onnx.defs.get_schema(op, OPSET)
        assert schema.since_version <= OPSET and len(schema.inputs) == 1, op
    assert {kind for _, kind, _ in ACTS.values()} == FUSED_CONV_RUNS
    assert "hardswish" in ACTS


def merges(first: str, then: str) -> bool:
    a, b = ACTS[first][1], ACTS[then][1]
    # consecutive clamps are one clamp (Relu is Clip(0, inf)); nothing else merges
    return (a, b) in {("Relu", "Relu"), ("Relu", "Clip"), ("Clip", "Relu"), ("Clip", "Clip")}


chains = st.fixed_dictionaries({
    "c": st.sampled_from([4, 8, 16]),
    "k": st.sampled_from([1, 3]),
    "bias": st.booleans(),
    "residual": st.sampled_from([None, "input", "relu", "conv", "broadcast", "negative"]),
    "acts": st.lists(st.sampled_from(sorted(ACTS)), max_size=2),
    "extra_consumer_at": st.sampled_from([None, None, 0, 1, 2]),  # index of the value in the chain
    "output_at": st.sampled_from([None, None, None, 0, 1]),
    "seed": st.integers(0, 2**16),
})


def build(spec):
    r = np.random.default_rng(spec["seed"])
    c, k = spec["c"], spec["k"]
    inits = [tensor("W", r.normal(0, 0.4, (c, c, k, k)).astype(np.float32))]
    inputs = [vinfo("x", [2, c, 5, 5])]
    conv_in = ["x", "W"]
    if spec["bias"]:
        inits.append(tensor("B", r.normal(0, 0.3, c).astype(np.float32)))
        conv_in.append("B")
    nodes = [helper.make_node("Conv", conv_in, ["v0"], name="conv", pads=[k // 2] * 4)]
    chain = ["v0"]  # values along the chain
    absorbed_by = "conv"
    residual = spec["residual"]
    if residual:
        if residual in ("input", "negative"):
            inputs.append(vinfo("z", [2, c, 5, 5]))
            other = "z"
            if residual == "negative":
                inits.append(tensor("minus", np.float32(-50)))
                nodes.append(helper.make_node("Mul", ["z", "minus"], ["zneg"], name="neg"))
                other = "zneg"
        elif residual == "relu":
            nodes.insert(0, helper.make_node("Relu", ["x"], ["zr"], name="zrelu"))
            other = "zr"
        elif residual == "conv":
            inits.append(tensor("W2", r.normal(0, 0.4, (c, c, 1, 1)).astype(np.float32)))
            nodes.append(helper.make_node("Conv", ["x", "W2"], ["y2"], name="conv2"))
            other = "y2"
            absorbed_by = "conv2"  # the later conv takes the Add
        else:  # broadcast
            inputs.append(vinfo("zb", [1, c, 1, 1]))
            other = "zb"
        nodes.append(helper.make_node("Add", ["v0", other], ["v1"], name="add"))
        chain.append("v1")
    for i, act in enumerate(spec["acts"]):
        out = f"v{len(chain)}"
        made, act_inits = ACTS[act][0](chain[-1], out, f"act{i}", np.random.default_rng(spec["seed"] + i))
        nodes += made
        inits += act_inits
        if act == "clip-runtime-bound":
            inputs.append(vinfo(f"act{i}.lo", []))
        chain.append(out)
    outputs = [chain[-1]]
    extra = spec["extra_consumer_at"]
    if extra is not None and extra < len(chain) - 1:
        nodes.append(helper.make_node("Neg", [chain[extra]], ["side"], name="side"))
        outputs.append("side")
    at = spec["output_at"]
    if at is not None and at < len(chain) - 1:
        outputs.append(chain[at])
    return (model(nodes, inputs, [vinfo(o, None) for o in outputs], inits, opset=OPSET),
            chain, absorbed_by)


def expected_absorbed(spec, chain) -> list[str]:
    """Names of chain ops that must end up inside the fused kernel, derived from the rules."""
    blocked = set()
    if spec["extra_consumer_at"] is not None:
        blocked.add(spec["extra_consumer_at"])
    if spec["output_at"] is not None:
        blocked.add(spec["output_at"])
    if spec["residual"] == "conv":
        blocked.discard(0)  # value 0 is the other conv's output: it becomes Z, which may be shared
    absorbed, position = [], 0
    ops = []
    if spec["residual"]:
        ops.append(("add", spec["residual"] != "broadcast", None))
    for i, act in enumerate(spec["acts"]):
        ops.append((f"act{i}", ACTS[act][2], act))
    last_act = None
    for name, legal, act in ops:
        if position in blocked or not legal:
            break
        if act is not None:
            if last_act is not None and not merges(last_act, act):
                break
            last_act = act
        elif absorbed:  # an Add after an absorbed op is not in the kernel's order
            break
        absorbed.append(name)
        position += 1
    return absorbed


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(chains)
def test_random_epilogue_chains(spec):
    m, chain, absorbed_by = build(spec)
    out, report = opfuse.optimize(m, target="onnxruntime", runtime_level="disabled", verify=False)
    expected = expected_absorbed(spec, chain)
    fused = [r for r in report.records if r.produced.startswith("com.microsoft")]
    got = sorted(n for r in fused for n in r.removed if n.startswith(("add", "act")))
    assert got == sorted(expected), (spec, report.records, report.refusals)
    if expected:
        assert fused[0].node == absorbed_by
    remaining = {n.name for n in out.graph}
    for name in ["add"] * bool(spec["residual"]) + [f"act{i}" for i in range(len(spec["acts"]))]:
        if name not in expected:
            assert name in remaining
            assert report.reason_for(name), (name, report.refusals)
    assert_same(m, out, seed=spec["seed"])
