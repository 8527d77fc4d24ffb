"""``slices-to-split`` (opfuse/passes/slices_to_split.py): Slices that tile an axis become one Split.

Each case is built in code: the LSTM stack's ``h0[l:l+1]`` (in order, in any order with negative and
clamped bounds, uneven parts, at opsets 11 and 17), the tilings it must leave (a gap, an overlap, one
Slice, a graph output, a symbolic dim), and rotate-half's halves, which the rotary pattern takes first.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

import opfuse
from graphs import assert_outputs_close, model, ops, ort_run, rng, tensor, vinfo

n = helper.make_node


def _same(expected: dict, actual: dict) -> None:
    assert_outputs_close(expected, actual, exact=list(expected))


def _optimize(m, passes=("slices-to-split",), **keywords):
    out, report = opfuse.optimize(m, passes=list(passes), runtime_level="disabled", tune=False, **keywords)
    assert report.verification.ok, report.verification
    return out, report


def _slices_model(bounds, *, opset=17, axis=0, output_slice=False, dim=3):
    """h[dim, B, 4] -> one Slice per (start, end) along ``axis`` -> Relu each (the LSTM stack's h0[l:l+1])."""
    nodes, inits, outputs = [], [tensor("axis", np.array([axis], np.int64))], []
    for i, (start, end) in enumerate(bounds):
        inits += [tensor(f"s{i}", np.array([start], np.int64)), tensor(f"e{i}", np.array([end], np.int64))]
        nodes += [n("Slice", ["h", f"s{i}", f"e{i}", "axis"], [f"p{i}"], name=f"slice{i}"),
                  n("Relu", [f"p{i}"], [f"y{i}"], name=f"relu{i}")]
        outputs.append(vinfo(f"y{i}", None))
    if output_slice:
        outputs.append(vinfo("p0", None))
    return model(nodes, [vinfo("h", [dim, "B", 4])], outputs, inits, opset=opset)


@pytest.mark.parametrize("opset", [11, 17])
@pytest.mark.parametrize("bounds", [[(0, 1), (1, 2), (2, 3)], [(2, 99), (0, 1), (-2, -1)], [(0, 2), (2, 3)]],
                         ids=["in-order", "any-order-negative-clamped", "uneven"])
def test_slices_that_tile_an_axis_become_one_split(bounds, opset):
    m = _slices_model(bounds, opset=opset)
    out, report = _optimize(m)
    assert ops(out).count("Split") == 1 and "Slice" not in ops(out)
    split = next(node for node in out.graph if node.op_type == "Split")
    in_order = sorted(range(len(bounds)), key=lambda i: bounds[i][0] % 3)  # (a negative start counts from the end)
    assert [v.name for v in split.outputs] == [f"p{i}" for i in in_order]
    assert {c.rewrite.split(" at ")[0] for c in report.verification.rewrites} == {"Slices->Split"}
    feeds = {"h": rng(1).normal(0, 1, (3, 2, 4)).astype(np.float32)}
    _same(ort_run(m, feeds), ort_run(out, feeds))


def test_a_computed_tensors_halves_become_a_split_once_the_patterns_have_run():
    """Rotate-half's two halves tile the last axis of a computed tensor. The pass runs after the
    patterns (``after_rewrites``), so a rotary it belongs to is RotaryEmbedding by then
    (tests/test_rotary*.py); left alone by them, they are a Split."""
    from opfuse.passes import pass_class

    assert pass_class("slices-to-split").after_rewrites
    inits = [tensor("axis", np.array([-1], np.int64)), tensor("zero", np.array([0], np.int64)),
             tensor("half", np.array([2], np.int64)), tensor("end", np.array([4], np.int64))]
    nodes = [n("Relu", ["h"], ["q"], name="relu"),
             n("Slice", ["q", "zero", "half", "axis"], ["x1"], name="first_half"),
             n("Slice", ["q", "half", "end", "axis"], ["x2"], name="second_half"),
             n("Neg", ["x2"], ["nx2"], name="neg"),
             n("Concat", ["nx2", "x1"], ["y"], axis=-1, name="rotate_half")]
    m = model(nodes, [vinfo("h", [3, "B", 4])], [vinfo("y", None)], inits)
    out, _ = _optimize(m)
    assert ops(out).count("Split") == 1 and "Slice" not in ops(out)
    feeds = {"h": rng(2).normal(0, 1, (3, 2, 4)).astype(np.float32)}
    _same(ort_run(m, feeds), ort_run(out, feeds))


@pytest.mark.parametrize("case", ["gap", "overlap", "one-slice", "graph-output", "symbolic-dim"])
def test_slices_that_do_not_tile_an_axis_stay(case):
    bounds = {"gap": [(0, 1), (2, 3)], "overlap": [(0, 2), (1, 3)], "one-slice": [(0, 3)]}.get(case, [(0, 1), (1, 3)])
    m = _slices_model(bounds, output_slice=case == "graph-output", axis=1 if case == "symbolic-dim" else 0)
    out, _ = _optimize(m)
    assert "Split" not in ops(out) and ops(out).count("Slice") == len(bounds)
