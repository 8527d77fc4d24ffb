"""Computed Pad, Slice and Reshape arguments, built the way exporters build them, fold to their own values.

Exporters compute an op's integer arguments at run time from a tensor's shape, and move
them between orders on the way:

- torch's ``F.pad`` takes (begin, end) pairs, last dim first; its exporter turns them
  into ONNX ``pads`` (all begins, then all ends, first dim first) with
  ``Concat(pairs, ConstantOfShape(zeros)) -> Reshape[-1, 2] -> Slice(step -1, axis 0) ->
  Transpose -> Reshape[-1]`` (open_nsfw's ``/Pad_1``, whose pads onnxslim and opfuse
  once folded to the other side);
- pairs written interleaved (b0, e0, b1, e1, ...) go through ``Reshape[-1, 2] -> Transpose ->
  Reshape[-1]``;
- tf2onnx writes TensorFlow's ``paddings`` ([rank, 2], rows built one by one) as
  ``Transpose -> Reshape[-1]``, with the NHWC Pad between two Transposes;
- a vector may also be read back a row at a time (``Gather`` of a [2, n] tensor) or
  reversed (``Slice`` step -1 of a 1-D tensor).

The arguments' values, the input shapes and the route each argument takes are drawn by
hypothesis; each element is a constant or computed from a static dim of an input whose
batch dim is symbolic (so only the shape arithmetic step can fold it). Each graph is
optimised by opfuse (which verifies it) and then checked here on its own: the original
and the optimised model run on ONNX Runtime at batch 1 and at batch 3 and must agree
exactly (a pad, slice or reshape moves values; it computes none).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from graphs import constant_node, model, ort_run, rng, vinfo
from opfuse.pipeline import optimize

INT64_MIN_PLUS_1 = -(2 ** 63) + 1  # the "end" torch writes for a reversed slice
EXAMPLES = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Graph:
    """The nodes of a graph under construction; each op's output gets a fresh name."""

    def __init__(self, dims: list[int | str]):
        self.dims = dims  # the input's dims: "batch" first, then static ones
        self.nodes: list = []
        self.count = 0
        self.shape = self.op("Shape", ["x"])

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        self.count += 1
        out = f"/{op_type}_{self.count}_output_0"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"/{op_type}_{self.count}", **attrs))
        return out

    def const(self, value) -> str:
        self.count += 1
        out = f"/Constant_{self.count}_output_0"
        self.nodes.append(constant_node(f"/Constant_{self.count}", out, np.asarray(value, np.int64)))
        return out

    def scalar(self, value: int, kind: str) -> str:
        """A scalar int64 whose value is ``value``: a constant, or computed from a dim."""
        if kind == "constant":
            return self.const(value)
        if kind == "read batch":  # the batch dim itself (symbolic: ``value`` is not used)
            return self.op("Gather", [self.shape, self.const(0)], axis=0)
        if kind == "batch":  # (batch + value) - batch: the symbol cancels
            b = self.op("Gather", [self.shape, self.const(0)], axis=0)
            return self.op("Sub", [self.op("Add", [b, self.const(value)]), b])
        axis = 1 + (self.count + value) % (len(self.dims) - 1)  # a static dim (which one: any)
        dim = self.op("Gather", [self.shape, self.const(axis)], axis=0)
        diff = self.op("Sub", [dim, self.const(self.dims[axis] - value)])
        if kind == "dim":
            return diff
        # kind "muldiv": the open_nsfw way, ((d - k) * 2) / 2 through Casts
        twice = self.op("Mul", [diff, self.const(2)])
        return self.op("Cast", [self.op("Div", [twice, self.const(2)])], to=TensorProto.INT64)

    def vector(self, values: list[int], kinds: list[str]) -> str:
        """Concat of Unsqueezed scalars (torch's list of ints), then a Cast."""
        axes = self.const([0])
        parts = [self.op("Unsqueeze", [self.scalar(v, k), axes]) for v, k in zip(values, kinds)]
        return self.op("Cast", [self.op("Concat", parts, axis=0)], to=TensorProto.INT64)

    def routed(self, values: list[int], kinds: list[str], route: str, lead_zeros: int = 0) -> str:
        """An int64 vector equal to ``values``, computed along ``route`` (module docstring)."""
        n = len(values)
        if route == "concat" or (n % 2 and route != "flip"):
            return self.vector(values, kinds)
        if route == "flip":
            rev = self.vector(values[::-1], kinds[::-1])
            return self.op("Slice", [rev, self.const([-1]), self.const([INT64_MIN_PLUS_1]), self.const([0]),
                                     self.const([-1])])
        m = n // 2
        begins, ends = values[:m], values[m:]
        if route == "torch_pad":  # pairs of the last dims first; the first lead_zeros dims' pairs from ConstantOfShape
            order = [i for d in reversed(range(lead_zeros, m)) for i in (d, m + d)]
            listed = self.vector([values[i] for i in order], [kinds[i] for i in order])
            if lead_zeros:
                zeros = self.op("ConstantOfShape", [self.const([2 * lead_zeros])],
                                value=helper.make_tensor("v", TensorProto.INT64, [1], [0]))
                listed = self.op("Concat", [listed, zeros], axis=0)
            pairs = self.op("Reshape", [listed, self.const([-1, 2])])
            flipped = self.op("Slice", [pairs, self.const([-1]), self.const([INT64_MIN_PLUS_1]), self.const([0]),
                                        self.const([-1])])
            return self.op("Reshape", [self.op("Transpose", [flipped], perm=[1, 0]), self.const([-1])])
        if route == "interleaved":
            order = [i for d in range(m) for i in (d, m + d)]
            listed = self.vector([values[i] for i in order], [kinds[i] for i in order])
            pairs = self.op("Reshape", [listed, self.const([-1, 2])])
            return self.op("Reshape", [self.op("Transpose", [pairs], perm=[1, 0]), self.const([-1])])
        if route == "tf_paddings":  # rows [b_d, e_d] built one by one, stacked to [m, 2]
            rows = [self.op("Unsqueeze", [self.vector([begins[d], ends[d]], [kinds[d], kinds[m + d]]),
                                          self.const([0])]) for d in range(m)]
            paddings = self.op("Concat", rows, axis=0)
            return self.op("Reshape", [self.op("Transpose", [paddings], perm=[1, 0]), self.const([-1])])
        if route == "rows":  # [2, m] read back a row at a time
            table = self.op("Reshape", [self.vector(values, kinds), self.const([2, m])])
            first, second = (self.op("Gather", [table, self.const(i)], axis=0) for i in (0, 1))
            return self.op("Concat", [first, second], axis=0)
        raise ValueError(route)


ROUTES = ("concat", "flip", "torch_pad", "interleaved", "tf_paddings", "rows")
KINDS = ("constant", "dim", "muldiv", "batch")


@st.composite
def input_dims(draw) -> list[int | str]:
    rank = draw(st.integers(3, 4))
    return ["batch", *draw(st.lists(st.integers(1, 5), min_size=rank - 1, max_size=rank - 1))]


def _check(m, dims, target) -> None:
    """opfuse optimises (and verifies) ``m``; both run the same on ONNX Runtime at two batches."""
    out, report = optimize(m, target=target)
    assert report.verification.ok
    for batch in (1, 3):
        x = rng(batch).normal(0, 1, (batch, *dims[1:])).astype(np.float32)
        want, got = ort_run(m, {"x": x})["y"], ort_run(out, {"x": x})["y"]
        assert want.shape == got.shape and np.array_equal(want, got), (batch, want.shape, got.shape)


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
@EXAMPLES
@given(data=st.data())
def test_a_computed_pad_keeps_each_pad_on_its_side(target, data):
    dims = data.draw(input_dims(), "dims")
    rank = len(dims)
    nhwc = data.draw(st.booleans(), "nhwc")  # tf2onnx: Transpose -> Pad (NHWC pads) -> Transpose back
    pads = data.draw(st.lists(st.integers(0, 3), min_size=2 * rank, max_size=2 * rank), "pads")
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=2 * rank, max_size=2 * rank), "kinds")
    route = data.draw(st.sampled_from(ROUTES), "route")
    lead_zeros = data.draw(st.integers(0, rank - 1), "lead_zeros") if route == "torch_pad" else 0
    for d in range(lead_zeros):  # F.pad leaves the first dims out: their pads are 0
        pads[d] = pads[rank + d] = 0
    mode = data.draw(st.sampled_from(["constant", "edge"]), "mode")
    g = Graph(dims)
    to_nhwc, to_nchw = [0, *range(2, rank), 1], [0, rank - 1, *range(1, rank - 1)]
    x = g.op("Transpose", ["x"], perm=to_nhwc) if nhwc else "x"
    padded = g.op("Pad", [x, g.routed(pads, kinds, route, lead_zeros)], mode=mode)
    g.nodes.append(helper.make_node("Transpose" if nhwc else "Identity", [padded], ["y"], name="/out",
                                    **({"perm": to_nchw} if nhwc else {})))
    note(f"pads {pads} by {route}")
    _check(model(g.nodes, [vinfo("x", dims)], [vinfo("y", None)], fill_output_shapes=False), dims, target)


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
@EXAMPLES
@given(data=st.data())
def test_a_computed_slice_takes_its_own_elements(target, data):
    dims = data.draw(input_dims(), "dims")
    rank = len(dims)
    axes = data.draw(st.lists(st.integers(1, rank - 1), min_size=1, max_size=rank - 1, unique=True), "axes")
    k = len(axes)
    steps = data.draw(st.lists(st.sampled_from([-2, -1, 1, 2]), min_size=k, max_size=k), "steps")
    bound = st.integers(-6, 6)
    starts = data.draw(st.lists(bound, min_size=k, max_size=k), "starts")
    ends = data.draw(st.lists(bound, min_size=k, max_size=k), "ends")
    negative = data.draw(st.booleans(), "negative axes")
    axes = [a - rank if negative else a for a in axes]
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=4 * k, max_size=4 * k), "kinds")
    routes = data.draw(st.lists(st.sampled_from(ROUTES), min_size=3, max_size=3), "routes")
    g = Graph(dims)
    both = g.routed(starts + ends, kinds[:2 * k], routes[0])  # starts and ends computed together, then split
    first = g.op("Slice", [both, g.const([0]), g.const([k]), g.const([0])])
    second = g.op("Slice", [both, g.const([k]), g.const([2 * k]), g.const([0])])
    args = [first, second, g.routed(axes, kinds[2 * k:3 * k], routes[1]), g.routed(steps, kinds[3 * k:], routes[2])]
    g.nodes.append(helper.make_node("Slice", ["x", *args], ["y"], name="/out"))
    note(f"starts {starts} ends {ends} axes {axes} steps {steps} by {routes}")
    _check(model(g.nodes, [vinfo("x", dims)], [vinfo("y", None)], fill_output_shapes=False), dims, target)


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
@EXAMPLES
@given(data=st.data())
def test_a_computed_reshape_target_keeps_its_order(target, data):
    dims = data.draw(input_dims(), "dims")
    size = int(np.prod(dims[1:]))
    factors, left = [], size
    for p in (2, 3, 5):  # the static size split into drawn factors, in a drawn order
        while left % p == 0:
            factors.append(p)
            left //= p
    groups = data.draw(st.lists(st.integers(0, 2), min_size=len(factors), max_size=len(factors)), "groups")
    rest = [int(np.prod([f for f, g in zip(factors, groups) if g == i])) for i in range(3)]
    rest = data.draw(st.permutations(rest), "order")
    lead = data.draw(st.sampled_from(["copy", "batch", "open"]), "lead")
    shape = [-1 if lead == "open" else 0, *rest]
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=len(shape), max_size=len(shape)), "kinds")
    if lead == "batch":  # the batch read off the shape: symbolic, so the target stays open there
        kinds[0] = "read batch"
    route = data.draw(st.sampled_from(ROUTES), "route")
    g = Graph(dims)
    shaped = g.op("Reshape", ["x", g.routed(shape, kinds, route)])
    g.nodes.append(helper.make_node("Identity", [shaped], ["y"], name="/out"))
    note(f"target {shape} ({lead}) by {route}")
    _check(model(g.nodes, [vinfo("x", dims)], [vinfo("y", None)], fill_output_shapes=False), dims, target)

