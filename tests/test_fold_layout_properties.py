"""Property test: a constant Add/Sub/Mul after Conv -> Transpose(perm) [-> Reshape] [-> Unsqueeze] folds
exactly when the algebra says it may.

Each example draws a permutation of the conv output's axes, optionally a Reshape that merges
two neighbouring axes, optionally an Unsqueeze, and a constant whose dims are each 1 or the size of the axis it lines
up with. The axes have distinct sizes (N=2, C=3, H=4, W=5; merged ones 6 or more), so the
oracle finds where the channels went by their size alone, without reading a permutation
rule or opfuse's code:

- the fold is legal iff the constant has one value, or some axis of the consumer's input
  has size C (the channels stayed whole on it) and the constant varies along that axis only;
- legal: exactly one record and no refusal; illegal: no record and one refusal at the consumer;
- either way the optimised model computes the original's numbers on ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from onnx import helper

import opfuse

from graphs import assert_same, model, tensor, vinfo

N, C, H, W = 2, 3, 4, 5


@st.composite
def layouts(draw):
    perm = draw(st.permutations(range(4)))
    shape = [[N, C, H, W][p] for p in perm]
    merge = draw(st.one_of(st.none(), st.integers(0, 2)))
    if merge is not None:
        shape = shape[:merge] + [shape[merge] * shape[merge + 1]] + shape[merge + 2:]
    merged = list(shape)
    insert = draw(st.one_of(st.none(), st.integers(0, len(shape))))
    if insert is not None:
        shape = shape[:insert] + [1] + shape[insert:]
    rank = draw(st.integers(0, len(shape)))
    aligned = shape[len(shape) - rank:]
    # varying along one axis (the one of size C half the time, when it is there) or any subset
    if aligned and draw(st.booleans()):
        one = aligned.index(C) if C in aligned and draw(st.booleans()) else draw(st.integers(0, rank - 1))
        const_shape = [d if i == one else 1 for i, d in enumerate(aligned)]
    else:
        const_shape = [d if draw(st.booleans()) else 1 for d in aligned]
    op = draw(st.sampled_from(["Add", "Mul", "Sub"]))
    const_first = draw(st.booleans())
    return list(perm), (merge, merged), insert, shape, const_shape, op, const_first


def _legal(shape, const_shape) -> bool:
    varying = [len(shape) - len(const_shape) + i for i, d in enumerate(const_shape) if d != 1]
    if not varying:
        return True
    return C in shape and varying == [shape.index(C)]


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(), st.integers(0, 2**16))
def test_a_constant_after_layout_ops_folds_iff_it_varies_along_where_the_channels_went(drawn, seed):
    perm, (merge, merged), insert, shape, const_shape, op, const_first = drawn
    r = np.random.default_rng(seed)
    inits = [tensor("w", r.normal(0, 0.5, (C, 2, 3, 3)).astype(np.float32)),
             tensor("k", (r.uniform(0.5, 1.5, const_shape) * r.choice([-1, 1], const_shape)).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["conv"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Transpose", ["conv"], ["t"], name="t", perm=perm)]
    fed = "t"
    if merge is not None:
        inits.append(tensor("target", np.array(merged, np.int64)))
        nodes.append(helper.make_node("Reshape", ["t", "target"], ["merged"], name="merge"))
        fed = "merged"
    if insert is not None:
        inits.append(tensor("axis", np.array([insert], np.int64)))
        nodes.append(helper.make_node("Unsqueeze", [fed, "axis"], ["unsqueezed"], name="unsqueeze"))
        fed = "unsqueezed"
    operands = ["k", fed] if const_first else [fed, "k"]
    nodes.append(helper.make_node(op, operands, ["y"], name="consumer"))
    m = model(nodes, [vinfo("x", [N, 2, H, W])], [vinfo("y", shape)], inits)
    legal = _legal(shape, const_shape)
    note(f"perm {perm} merge {merge} insert {insert} -> {shape}; constant {const_shape}; {op} (const first: {const_first}); "
         f"legal: {legal}")
    out, report = opfuse.optimize(m, verify=False, passes=["fold-arithmetic"])
    note(f"records {report.records}; refusals {report.refusals}")
    if legal:
        assert [rec.pattern for rec in report.records] == [f"Conv+{op}"] and not report.refusals
    else:
        assert not report.records and [ref.node for ref in report.refusals] == ["consumer"]
    assert_same(m, out)
