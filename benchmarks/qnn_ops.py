"""What QNN's HTP compiler takes whole, and what falls back: the evidence for targets/qnn.py.

    python benchmarks/qnn_ops.py                 # every case, float and QDQ, a table
    python benchmarks/qnn_ops.py --json out.json --cases gelu-20,erf-gelu
    python benchmarks/qnn_ops.py --numerics --cases decoder   # the decoder forms, and the HTP's numbers

Each case is a one-op or one-pattern graph with static shapes and tiny tensors, built here
(onnx.helper); the decoder forms (rotary, attention with a KV cache, skip + RMSNorm, each
fused and written out) in ``benchmarks/qnn_decoder_ops.py``.
:func:`opfuse.targets.qnn.probe.probe` compiles it on the HTP backend as float and
as ONNX Runtime's QNN flow quantises it (``get_qnn_qdq_config``), and the table gives, per
form, "QNN" when every node went to QNN, else each CPU node with QNN's reason. About a
second a case. Needs ``opfuse[qnn]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from opfuse.targets.qnn.backend import HtpCompileError, open_session
from opfuse.targets.qnn.probe import _random_feeds, probe
from qnn_decoder_ops import CASES as DECODER_CASES  # (the decoder forms: rotary, KV cache, skip + RMSNorm)

MS = "com.microsoft"
F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def _w(name, *shape, scale=0.3):
    return numpy_helper.from_array(RNG.normal(0, scale, shape).astype(np.float32), name)


def _model(nodes, inputs, outputs, inits=(), opset=17, ms=False):
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(MS, 1)] if ms else [])
    g = helper.make_graph(nodes, "probe", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 10
    return m


def _v(name, shape, t=F):
    return helper.make_tensor_value_info(name, t, shape)


def conv_act(op, opset=17, domain="", extra_inits=(), extra_inputs=(), **attrs):
    """Conv 3x3 -> op."""
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1], name="conv")]
    if op:
        nodes.append(helper.make_node(op, ["c", *extra_inputs], ["y"], name="act", domain=domain, **attrs))
    return _model(nodes, [_v("x", [1, 3, 6, 6])], [_v("y" if op else "c", [1, 4, 6, 6])],
                  [_w("W", 4, 3, 3, 3), _w("B", 4), *extra_inits], opset=opset, ms=bool(domain))


def unary(op, opset=17, domain="", shape=(1, 4, 8), inits=(), inputs=(), **attrs):
    nodes = [helper.make_node(op, ["x", *inputs], ["y"], name=op.lower(), domain=domain, **attrs)]
    return _model(nodes, [_v("x", list(shape))], [_v("y", None)], inits, opset=opset, ms=bool(domain))


def erf_gelu():
    """x * 0.5 * (1 + erf(x / sqrt(2))): the form torch exports."""
    c = lambda n, v: numpy_helper.from_array(np.array(v, np.float32), n)  # noqa: E731
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"], name="div"),
             helper.make_node("Erf", ["d"], ["e"], name="erf"),
             helper.make_node("Add", ["e", "one"], ["a"], name="add"),
             helper.make_node("Mul", ["x", "a"], ["m"], name="mul"),
             helper.make_node("Mul", ["m", "half"], ["y"], name="mul_half")]
    return _model(nodes, [_v("x", [1, 4, 8])], [_v("y", [1, 4, 8])],
                  [c("sqrt2", np.sqrt(2)), c("one", 1.0), c("half", 0.5)])


def swish_decomposed():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"], name="sigmoid"), helper.make_node("Mul", ["x", "s"], ["y"], name="mul")]
    return _model(nodes, [_v("x", [1, 4, 8])], [_v("y", [1, 4, 8])])


def attention_decomposed():
    """softmax(q k^T * s) v on [1, 2, 4, 8] heads."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["qk"], name="qk"),
             helper.make_node("Mul", ["qk", "scale"], ["qks"], name="scale"),
             helper.make_node("Softmax", ["qks"], ["p"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["p", "v"], ["y"], name="pv")]
    shape = [1, 2, 4, 8]
    return _model(nodes, [_v("q", shape), _v("k", shape), _v("v", shape)], [_v("y", shape)],
                  [numpy_helper.from_array(np.array(0.35, np.float32), "scale")])


def lstm():
    hidden, inp = 4, 3
    return _model([helper.make_node("LSTM", ["x", "W", "R", "B"], ["y"], hidden_size=hidden, name="lstm")],
                  [_v("x", [5, 1, inp])], [_v("y", None)],
                  [_w("W", 1, 4 * hidden, inp), _w("R", 1, 4 * hidden, hidden), _w("B", 1, 8 * hidden)])


def mha(op="MultiHeadAttention"):
    shape = [1, 4, 16]
    return _model([helper.make_node(op, ["q", "k", "v"], ["y"], num_heads=2, name="mha", domain=MS)],
                  [_v("q", shape), _v("k", shape), _v("v", shape)], [_v("y", shape)], ms=True)


def attention_23():
    shape = [1, 2, 4, 8]
    return _model([helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attention")],
                  [_v("q", shape), _v("k", shape), _v("v", shape)], [_v("y", shape)], opset=23)


def ln_inits(c=8):
    return [numpy_helper.from_array(np.ones(c, np.float32), "g"), numpy_helper.from_array(np.zeros(c, np.float32), "b")]


CASES = {
    **{f"conv+{op.lower()}": (lambda op=op: conv_act(op)) for op in
       ("Relu", "Sigmoid", "Tanh", "HardSigmoid", "HardSwish", "Elu", "Selu", "Softplus", "LeakyRelu")},
    "conv": lambda: conv_act(None),
    "conv+clip": lambda: conv_act("Clip", extra_inits=[numpy_helper.from_array(np.array(0, np.float32), "lo"),
                                                       numpy_helper.from_array(np.array(6, np.float32), "hi")],
                                  extra_inputs=("lo", "hi")),
    "conv+prelu": lambda: conv_act("PRelu", extra_inits=[_w("slope", 4, 1, 1)], extra_inputs=("slope",)),
    "conv+gelu-20": lambda: conv_act("Gelu", opset=20),
    "gemm": lambda: _model([helper.make_node("Gemm", ["x", "W", "B"], ["y"], transB=1, name="gemm")],
                           [_v("x", [2, 8])], [_v("y", [2, 4])], [_w("W", 4, 8), _w("B", 4)]),
    "matmul": lambda: _model([helper.make_node("MatMul", ["x", "W"], ["y"], name="matmul")],
                             [_v("x", [1, 4, 8])], [_v("y", [1, 4, 6])], [_w("W", 8, 6)]),
    "batchnorm": lambda: unary("BatchNormalization", shape=(1, 4, 6, 6),
                               inits=[_w("s", 4), _w("bb", 4), _w("mean", 4),
                                      numpy_helper.from_array(np.ones(4, np.float32), "var")],
                               inputs=("s", "bb", "mean", "var")),
    "layer-norm-17": lambda: unary("LayerNormalization", inits=ln_inits(), inputs=("g", "b"), axis=-1),
    "rms-norm-23": lambda: unary("RMSNormalization", opset=23, inits=ln_inits()[:1], inputs=("g",), axis=-1),
    "simplified-layer-norm": lambda: unary("SimplifiedLayerNormalization", domain=MS, inits=ln_inits()[:1],
                                           inputs=("g",), axis=-1),
    "skip-layer-norm": lambda: _model(
        [helper.make_node("SkipLayerNormalization", ["x", "s", "g", "b"], ["y"], name="sln", domain=MS)],
        [_v("x", [1, 4, 8]), _v("s", [1, 4, 8])], [_v("y", [1, 4, 8])], ln_inits(), ms=True),
    "gelu-20": lambda: unary("Gelu", opset=20),
    "gelu-20-tanh": lambda: unary("Gelu", opset=20, approximate="tanh"),
    "ms-gelu": lambda: unary("Gelu", domain=MS),
    "ms-fast-gelu": lambda: unary("FastGelu", domain=MS),
    "ms-bias-gelu": lambda: unary("BiasGelu", domain=MS, inits=[_w("bias", 8)], inputs=("bias",)),
    "ms-quick-gelu": lambda: unary("QuickGelu", domain=MS, alpha=1.702),
    "erf-gelu": erf_gelu,
    "erf": lambda: unary("Erf"),
    "hardswish": lambda: unary("HardSwish", opset=14),
    "hardsigmoid": lambda: unary("HardSigmoid"),
    "swish-24": lambda: unary("Swish", opset=24),
    "x*sigmoid(x)": swish_decomposed,
    "softmax": lambda: unary("Softmax", axis=-1),
    "instance-norm": lambda: unary("InstanceNormalization", shape=(1, 4, 6, 6), inits=ln_inits(4),
                                   inputs=("g", "b")),
    "group-norm-21": lambda: unary("GroupNormalization", opset=21, shape=(1, 4, 6, 6), inits=ln_inits(4),
                                   inputs=("g", "b"), num_groups=2),
    "resize": lambda: unary("Resize", shape=(1, 4, 4, 4), inits=[numpy_helper.from_array(
        np.array([1, 1, 2, 2], np.float32), "scales")], inputs=("", "scales"), mode="nearest"),
    "lstm": lstm,
    "attention-decomposed": attention_decomposed,
    "ms-multi-head-attention": mha,
    "attention-23": attention_23,
    "ms-fused-conv": lambda: conv_act(None) if False else _model(
        [helper.make_node("FusedConv", ["x", "W", "B"], ["y"], pads=[1, 1, 1, 1], activation="Relu",
                          name="fused", domain=MS)],
        [_v("x", [1, 3, 6, 6])], [_v("y", [1, 4, 6, 6])], [_w("W", 4, 3, 3, 3), _w("B", 4)], ms=True),
    "ms-fused-gemm": lambda: _model(
        [helper.make_node("FusedGemm", ["x", "W", "B"], ["y"], transB=1, activation="Relu", name="fused", domain=MS)],
        [_v("x", [2, 8])], [_v("y", [2, 4])], [_w("W", 4, 8), _w("B", 4)], ms=True),
    **DECODER_CASES,
}


def htp_error(model) -> float | None:
    """The float graph's outputs on the HTP against ONNX Runtime's CPU provider (optimisations off),
    one random sample: max |HTP - CPU| / max |CPU| over the outputs (the HTP computes float graphs in
    float16, so about 1e-3 is exact); None when a node falls back or the graph does not run."""
    import onnxruntime as ort

    feeds = _random_feeds(model, 1, seed=1)[0]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = open_session(model, strict=True)
        got = session.run(feeds)
    except (HtpCompileError, RuntimeError, ValueError):
        return None
    want = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)
    return max(float(np.abs(g.astype(np.float64) - w).max() / max(np.abs(w).max(), 1e-12)) for g, w in zip(got, want))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names, or 'decoder' for the decoder forms (default: all)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--numerics", action="store_true",
                        help="also run each float graph QNN takes whole on the HTP against ONNX Runtime's CPU")
    args = parser.parse_args(argv)
    groups = {"decoder": list(DECODER_CASES)}  # a group name stands for its cases
    names = [n for c in args.cases.split(",") for n in groups.get(c, [c])] if args.cases else list(CASES)
    results = {}
    err = f" {'HTP/CPU':9}" if args.numerics else ""
    print(f"{'case':34} {'float':40}{err} qdq (get_qnn_qdq_config)")
    for name in names:
        start = time.perf_counter()
        model = CASES[name]()
        r = probe(model)
        results[name] = {form: {"verdict": p.verdict(), "whole": p.whole, "on_cpu": p.on_cpu, "error": p.error}
                         for form, p in r.items()}
        if args.numerics:
            e = htp_error(model) if r["float"].whole else None
            results[name]["float"]["htp_vs_cpu"] = e
            err = f" {e:9.1e}" if e is not None else f" {'-':9}"
        print(f"{name:34} {r['float'].verdict()[:40]:40}{err} {r['qdq'].verdict()}  "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
