"""cancel-transposes: Transposes moved past element-wise ops until they meet their inverse.

Each graph runs on ONNX Runtime against the unrewritten model (:func:`graphs.assert_same`).
How many Transposes must be left is decided here from the composition of the perms alone
(two perms cancel when applying one after the other is the identity), never from opfuse.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from onnx import helper

import opfuse

from graphs import assert_same, model, ops, rng, tensor, vinfo
from test_fold_layouts import NCHW, NHWC, caffe_nhwc_block

n = helper.make_node
SHAPE = [2, 3, 4, 5]  # distinct sizes: a wrongly permuted constant cannot broadcast by accident


def _composed(p, q):
    """The perm of Transpose(q) after Transpose(p): output axis i reads input axis p[q[i]]."""
    return [p[i] for i in q]


def test_an_nhwc_block_keeps_only_the_transposes_at_its_edges_and_its_convs_fuse_on_onnxruntime():
    m = caffe_nhwc_block()
    out, report = opfuse.optimize(m, dims={"N": 2})
    # in: the graph input's NHWC -> NCHW for conv0 stays; out: the residual Add reads the NHWC
    # input, so conv1's way back to NHWC stays; conv0 -> NHWC -> Relu -> NCHW -> conv1 cancels
    assert ops(out).count("Transpose") == 2, ops(out)
    assert_same(m, out, dims={"N": 3})
    fused, report = opfuse.optimize(m, dims={"N": 2}, target="onnxruntime")
    assert "FusedConv" in ops(fused) and "Relu" in ops(fused)  # conv0 + Relu fused; the block's last Relu stays
    assert_same(m, fused, dims={"N": 3})


@pytest.mark.parametrize("p, q", [(NHWC, NCHW), ([0, 2, 1, 3], [0, 2, 1, 3]), ([1, 0, 2, 3], NHWC)])
def test_two_transposes_in_a_row_become_one_or_none(p, q):
    nodes = [n("Relu", ["x"], ["r"], name="r"), n("Transpose", ["r"], ["t1"], name="t1", perm=p),
             n("Transpose", ["t1"], ["t2"], name="t2", perm=q), n("Sigmoid", ["t2"], ["y"], name="s")]
    m = model(nodes, [vinfo("x", SHAPE)], [vinfo("y", None)])
    out, _ = opfuse.optimize(m, passes=["cancel-transposes"])
    identity = _composed(p, q) == [0, 1, 2, 3]
    assert ops(out).count("Transpose") == (0 if identity else 1)
    assert_same(m, out)


def test_a_transpose_with_no_inverse_ahead_is_not_moved():
    nodes = [n("Transpose", ["x"], ["t"], name="t", perm=NHWC), n("Relu", ["t"], ["y"], name="relu")]
    m = model(nodes, [vinfo("x", SHAPE)], [vinfo("y", None)])
    out, report = opfuse.optimize(m, passes=["cancel-transposes"])
    assert ops(out) == ["Transpose", "Relu"] and not report.records


def test_batchnormalization_between_is_not_moved_past():
    r = rng(0)
    c = SHAPE[3]
    inits = [tensor(k, r.uniform(0.5, 1.5, c).astype(np.float32)) for k in ("g", "b", "mu", "var")]
    nodes = [n("Transpose", ["x"], ["t"], name="t", perm=NHWC),
             n("BatchNormalization", ["t", "g", "b", "mu", "var"], ["bn"], name="bn"),
             n("Transpose", ["bn"], ["y"], name="back", perm=NCHW)]
    m = model(nodes, [vinfo("x", [2, 4, c, 3])], [vinfo("y", None)], inits)
    out, _ = opfuse.optimize(m, passes=["cancel-transposes"])
    assert ops(out).count("Transpose") == 2
    assert_same(m, out)


ELEMENTWISE = ["Relu", "Sigmoid", "Neg", "Abs"]
BINARY = ["Add", "Mul", "Sub", "Max"]


@st.composite
def chains(draw):
    p = draw(st.permutations(range(4)))
    inverse = list(np.argsort(p))
    q = inverse if draw(st.booleans()) else draw(st.permutations(range(4)))
    steps = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            steps.append((draw(st.sampled_from(ELEMENTWISE)), None, False))
        else:
            shape = [SHAPE[a] for a in p]  # the transposed tensor's shape
            rank = draw(st.integers(0, 4))
            const = [d if draw(st.booleans()) else 1 for d in shape[4 - rank:]]
            steps.append((draw(st.sampled_from(BINARY)), const, draw(st.booleans())))
    return list(p), list(q), steps


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.integers(0, 2**16))
def test_a_transpose_moves_through_any_element_wise_chain_to_its_partner(drawn, seed):
    p, q, steps = drawn
    r = np.random.default_rng(seed)
    nodes, inits, h = [n("Transpose", ["x"], ["t0"], name="t0", perm=p)], [], "t0"
    for i, (op, const, first) in enumerate(steps):
        if const is None:
            nodes.append(n(op, [h], [f"h{i}"], name=f"op{i}"))
        else:
            inits.append(tensor(f"c{i}", r.uniform(0.5, 1.5, const).astype(np.float32)))
            nodes.append(n(op, [f"c{i}", h] if first else [h, f"c{i}"], [f"h{i}"], name=f"op{i}"))
        h = f"h{i}"
    nodes.append(n("Transpose", [h], ["y"], name="t1", perm=q))
    m = model(nodes, [vinfo("x", SHAPE)], [vinfo("y", None)], inits)
    out, report = opfuse.optimize(m, passes=["cancel-transposes"])
    expected = 0 if _composed(p, q) == [0, 1, 2, 3] else 1
    note(f"{p} then {steps} then {q}: {ops(out)}; {report.records}")
    assert ops(out).count("Transpose") == expected
    assert_same(m, out)
