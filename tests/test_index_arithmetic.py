"""index-arithmetic: the index and mask arithmetic exporters write, in fewer nodes, computing the same.

The first tests export transformers' own mask functions (``masking_utils.sdpa_mask``: causal, sliding
window and padding, as Mistral's and Llama's exports build their masks) with torch's dynamo exporter,
at symbolic batch and lengths, and compare the rewritten graph with the export on ONNX Runtime at
several batches, lengths and paddings. The others build each rule's graph in code, with the cases
each rule must leave alone (indices that are not a grid, a Range that is not the whole axis, a
constant that broadcasts, a graph output).
"""

from __future__ import annotations

import contextlib
import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import extras
import opfuse
from graphs import assert_outputs_close, model, ops, ort_run, rng, tensor, vinfo

n = helper.make_node
PASSES = ["index-arithmetic"]


def _same(expected: dict, actual: dict) -> None:
    assert_outputs_close(expected, actual, exact=list(expected))


def _optimize(m, **keywords):
    out, report = opfuse.optimize(m, passes=PASSES, runtime_level="disabled", tune=False, **keywords)
    assert report.verification.ok, report.verification
    return out, report


# -- transformers' masks, exported ---------------------------------------------------------------

def _export_mask(tmp_path, window: int | None) -> str:
    """x [B, S, 4] (S new tokens) and attention_mask [B, T] (the past's P = T - S, and the new) -> the
    additive 4-D mask [B, 1, S, T] of ``sdpa_mask`` (causal, or sliding-window causal), plus x's sums."""
    torch = extras.require("torch")
    masking = extras.require("transformers.masking_utils")

    class Mask(torch.nn.Module):
        def forward(self, x, attention_mask):
            s, t = x.shape[1], attention_mask.shape[1]
            p = t - s
            function = (masking.causal_mask_function if window is None
                        else masking.sliding_window_causal_mask_function(window))
            kv_offset = max(0, p + s - window) if window is not None else 0
            mask = masking.sdpa_mask(batch_size=x.shape[0], q_length=s, kv_length=t - kv_offset, q_offset=p,
                                     kv_offset=kv_offset, mask_function=function,
                                     attention_mask=attention_mask.bool(), allow_is_causal_skip=False)
            return torch.where(mask, 0.0, torch.finfo(torch.float32).min) + x.sum(-1)[:, None, :, None]

    batch, new, total = torch.export.Dim("batch"), torch.export.Dim("new"), torch.export.Dim("total")
    args = (torch.randn(2, 3, 4), torch.ones(2, 8, dtype=torch.int64))
    path = tmp_path / "mask.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(Mask().eval(), args, str(path), dynamo=True, opset_version=18, external_data=False,
                          input_names=["x", "attention_mask"], output_names=["mask"],
                          dynamic_shapes=({0: batch, 1: new}, {0: batch, 1: total}))
    return str(path)


def _mask_inputs(batch: int, new: int, past: int, padded: int, seed: int) -> dict:
    r = rng(seed)
    attention_mask = np.ones((batch, past + new), np.int64)
    attention_mask[-1, :padded] = 0  # the last sequence left-padded
    return {"x": r.standard_normal((batch, new, 4)).astype(np.float32), "attention_mask": attention_mask}


@pytest.mark.parametrize("window", [None, 6], ids=["causal", "sliding-window"])
def test_transformers_masks_lose_their_gathernd_and_compute_the_same(tmp_path, window):
    path = _export_mask(tmp_path, window)
    original = onnx.load(path)
    if "GatherND" not in ops(original):
        pytest.skip(f"this torch exports the padding term without GatherND: {sorted(set(ops(original)))}")
    out, report = _optimize(path)
    assert "GatherND" not in ops(out), ops(out)
    assert len(ops(out)) <= len(ops(original)) - 6, (len(ops(original)), ops(out))
    patterns = {r.pattern for r in report.records}
    assert "GatherND(index grid)->Gather" in patterns, patterns
    for batch, new, past, padded in ((1, 1, 4, 0), (3, 1, 9, 4), (2, 3, 2, 1), (2, 4, 0, 2)):
        if window is not None and past + new > window:
            continue  # (the export's kv_offset is traced at the example's lengths)
        inputs = _mask_inputs(batch, new, past, padded, seed=past)
        _same(ort_run(original, inputs), ort_run(out, inputs))


# -- rule 1: GatherND over an index grid -----------------------------------------------------------

def _grid_model(*, axes=((1, 2, 3), (0, 1, 2)), broadcast="Max", batch_dims=0, data_shape=("B", "T"),
                offset=True, opset=18) -> onnx.ModelProto:
    """x[b_idx (axis 0 of 4), kv_idx + offset (axis 3 of 4)] as the dynamo exporter writes it."""
    nodes = [
        n("Shape", ["x"], ["b1"], start=0, end=1), n("Squeeze", ["b1"], ["b"]),
        n("Shape", ["x"], ["t1"], start=1, end=2), n("Squeeze", ["t1"], ["t"]),
        n("Range", ["zero", "b", "one"], ["b_idx"]), n("Range", ["zero", "t", "one"], ["t_idx"]),
    ]
    kv = "t_idx"
    if offset:
        nodes.append(n("Add", ["t_idx", "offset"], ["kv"]))
        kv = "kv"
    nodes += [
        n("Unsqueeze", ["b_idx", "axes_b"], ["g0"]), n("Unsqueeze", [kv, "axes_kv"], ["g1"]),
        n(broadcast, ["g0", "g1"], ["joined"]), n("Shape", ["joined"], ["grid"]),
        n("Expand", ["g0", "grid"], ["e0"]), n("Expand", ["g1", "grid"], ["e1"]),
        n("Unsqueeze", ["e0", "last"], ["u0"]), n("Unsqueeze", ["e1", "last"], ["u1"]),
        n("Concat", ["u0", "u1"], ["indices"], axis=-1),
        n("GatherND", ["x", "indices"], ["picked"], batch_dims=batch_dims),
        n("Cast", ["picked"], ["y"], to=TensorProto.FLOAT),
    ]
    inits = [tensor("zero", np.int64(0)), tensor("one", np.int64(1)), tensor("offset", np.int64(0)),
             tensor("axes_b", np.array(axes[0], np.int64)), tensor("axes_kv", np.array(axes[1], np.int64)),
             tensor("last", np.array([-1], np.int64))]
    return model(nodes, [vinfo("x", list(data_shape), TensorProto.BOOL)], [vinfo("y", None)], inits, opset=opset)


def _bool_inputs(shape, seed=0) -> dict:
    return {"x": rng(seed).random(shape) > 0.4}


@pytest.mark.parametrize("broadcast", ["Max", "Add", "Mul"])
def test_gathernd_over_an_index_grid_becomes_two_gathers(broadcast):
    original = _grid_model(broadcast=broadcast)
    out, report = _optimize(original)
    assert "GatherND" not in ops(out) and "Concat" not in ops(out) and "Expand" not in ops(out), ops(out)
    for shape in ((1, 1), (3, 7), (2, 12)):
        inputs = _bool_inputs(shape, seed=shape[1])
        expected = ort_run(original, inputs)
        assert expected["y"].shape == (shape[0], 1, 1, shape[1])
        _same(expected, ort_run(out, inputs))


def test_a_grid_of_three_dims_and_trailing_data_dims_keep_their_places():
    """x [B, T, 5] indexed along axes 0 and 2 of a rank-3 grid: y [B, 1, T, 5]."""
    original = _grid_model(axes=((1, 2), (0, 1)), data_shape=("B", "T", 5))
    out, _ = _optimize(original)
    assert "GatherND" not in ops(out), ops(out)
    inputs = _bool_inputs((3, 4, 5))
    expected = ort_run(original, inputs)
    assert expected["y"].shape == (3, 1, 4, 5)
    _same(expected, ort_run(out, inputs))


@pytest.mark.parametrize("case", ["axes out of order", "Sub is no broadcast"])
def test_gathernd_that_is_no_ordered_grid_stays(case):
    """The index vectors in the reverse of x's axis order would need a Transpose; the grid's shape from
    an op that is not taken as their broadcast (Sub: any op of both would do, but only those an export
    of broadcast_tensors writes are read)."""
    keywords = {"axes out of order": {"axes": ((0, 1, 2), (1, 2, 3))}, "Sub is no broadcast": {"broadcast": "Sub"}}
    original = _grid_model(**keywords[case])
    out, _ = _optimize(original)
    assert "GatherND" in ops(out), ops(out)
    inputs = _bool_inputs((3, 3))
    _same(ort_run(original, inputs), ort_run(out, inputs))


def _folded_grid(b: int, t: int) -> np.ndarray:
    """indices [b, 1, 1, t, 2] of x[batch_arange[:, None, None, None], kv_arange[None, None, None, :]], as
    the clean-up folds them once every dim is bound (``--target qnn``)."""
    i, j = np.meshgrid(np.arange(b), np.arange(t), indexing="ij")
    return np.stack([i, j], -1)[:, None, None].astype(np.int64)


def _gathernd_of(grid: np.ndarray, data_shape) -> onnx.ModelProto:
    return model([n("GatherND", ["x", "indices"], ["picked"]), n("Cast", ["picked"], ["y"], to=TensorProto.FLOAT)],
                 [vinfo("x", list(data_shape), TensorProto.BOOL)], [vinfo("y", None)], [tensor("indices", grid)],
                 opset=18)


def _run_pass(m: onnx.ModelProto, target: str):
    """The pass alone, as the qnn pipeline hands it its target (opfuse.optimize would compile on the HTP)."""
    import onnx_ir as ir

    from opfuse.passes.index_arithmetic import IndexArithmeticPass
    from opfuse.report import FusionReport

    report = FusionReport()
    work = ir.from_proto(m)
    IndexArithmeticPass(report, target=target)(work)
    return ir.to_proto(work), report


@pytest.mark.parametrize("shape", [(3, 7), (1, 7)], ids=["batch 3", "batch 1"])
def test_a_grid_folded_into_a_constant_becomes_gathers_for_a_static_target(shape):
    """With every dim bound the clean-up folds the grid's Shape, Range and Expand into one constant
    ``indices``; for qnn rule 1 reads the vectors off it. At batch 1 the batch index is one value (a
    scalar Gather, its axis put back by the Unsqueeze). For onnx the GatherND stays (one node, not three)."""
    original = _gathernd_of(_folded_grid(*shape), shape)
    out, report = _run_pass(original, "qnn")
    assert ops(out) == ["Gather", "Gather", "Unsqueeze", "Cast"], ops(out)
    assert any(r.pattern == "GatherND(index grid)->Gather" and "a constant grid" in r.detail for r in report.records)
    inputs = _bool_inputs(shape, seed=shape[0])
    _same(ort_run(original, inputs), ort_run(out, inputs))
    kept, _ = _run_pass(original, "onnx")
    assert ops(kept) == ["GatherND", "Cast"], ops(kept)


def test_the_qnn_pipeline_folds_the_grid_first():
    """What makes the rule needed: the grid of :func:`_grid_model` with its dims static is one constant
    after the clean-up (the pass alone, for onnx, leaves that GatherND)."""
    out, _ = _optimize(_grid_model(data_shape=(3, 7)))
    assert ops(out) == ["GatherND", "Cast"], ops(out)


@pytest.mark.parametrize("case", ["diagonal", "axes out of order", "broadcast axis"])
def test_a_constant_index_tensor_that_is_no_ordered_grid_stays(case):
    """indices[i, j] = (i, i) varies along one axis in both components but reads a diagonal only when
    the two are the same axis (kept: a vector per component needs an axis of its own); (j, i) would need a
    Transpose; (i, 0) over a [3, 4] grid repeats along axis 1, which Gathers and Unsqueezes do not write."""
    i, j = np.meshgrid(np.arange(3), np.arange(4), indexing="ij")
    grid = {"diagonal": np.stack([i, i], -1), "axes out of order": np.stack([j, i], -1),
            "broadcast axis": np.stack([i, np.zeros_like(i)], -1)}[case].astype(np.int64)
    original = _gathernd_of(grid, (4, 4))
    out, report = _run_pass(original, "qnn")
    assert ops(out) == ["GatherND", "Cast"] and not report.records, ops(out)


# -- rule 2: a Gather of a whole axis ----------------------------------------------------------------

def _whole_axis_model(read_from: str, axis: int = 0, start: int = 0) -> onnx.ModelProto:
    nodes = [n("Shape", [read_from], ["d1"], start=axis, end=axis + 1), n("Squeeze", ["d1"], ["d"]),
             n("Range", ["start", "d", "one"], ["r"]), n("Gather", ["x", "r"], ["g"], axis=axis),
             n("Mul", ["g", "two"], ["y"])]
    inits = [tensor("start", np.int64(start)), tensor("one", np.int64(1)), tensor("two", np.float32(2))]
    return model(nodes, [vinfo("x", ["B", "T"]), vinfo("other", ["B", "T"]), vinfo("unrelated", ["N", "M"])],
                 [vinfo("y", None)], inits)


@pytest.mark.parametrize("read_from, axis", [("x", 0), ("x", 1), ("other", 0)])
def test_a_gather_of_a_whole_axis_in_order_goes(read_from, axis):
    original = _whole_axis_model(read_from, axis)
    out, report = _optimize(original)
    assert "Gather" not in ops(out) and "Range" not in ops(out), ops(out)
    assert any(r.pattern == "Gather(Range)" for r in report.records)
    r = rng(1)
    inputs = {"x": r.standard_normal((3, 4)).astype(np.float32), "other": np.zeros((3, 4), np.float32),
              "unrelated": np.zeros((2, 2), np.float32)}
    _same(ort_run(original, inputs), ort_run(out, inputs))


@pytest.mark.parametrize("read_from, start", [("unrelated", 0), ("x", 1)])
def test_a_gather_of_part_of_an_axis_stays(read_from, start):
    """A length read off a dim declared under another name, or a Range that does not start at 0."""
    original = _whole_axis_model(read_from, 0, start)
    out, _ = _optimize(original)
    assert "Gather" in ops(out), ops(out)
    r = rng(2)
    inputs = {"x": r.standard_normal((3, 4)).astype(np.float32), "other": np.zeros((3, 4), np.float32),
              "unrelated": np.zeros((2, 2), np.float32)}
    _same(ort_run(original, inputs), ort_run(out, inputs))


# -- rule 3: Unsqueeze chains ------------------------------------------------------------------------

@pytest.mark.parametrize("first, second", [([1, 2], [3]), ([0], [0]), ([-1], [0, -1]), ([0, 2], [1]),
                                           ([2], [0, 4])])
@pytest.mark.parametrize("opset", [11, 18])
def test_two_unsqueezes_become_one_with_the_same_shape(first, second, opset):
    def axes(name, values):
        return ([n("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)], values))],
                {}) if opset >= 13 else ([], {"axes": values})
    c1, a1 = axes("a1", first)
    c2, a2 = axes("a2", second)
    nodes = [*c1, *c2, n("Unsqueeze", ["x", "a1"] if opset >= 13 else ["x"], ["u1"], **a1),
             n("Unsqueeze", ["u1", "a2"] if opset >= 13 else ["u1"], ["u2"], **a2), n("Neg", ["u2"], ["y"])]
    original = model(nodes, [vinfo("x", ["N", 3])], [vinfo("y", None)], opset=opset)
    out, report = _optimize(original)
    assert ops(out).count("Unsqueeze") == 1, ops(out)
    inputs = {"x": rng(0).standard_normal((2, 3)).astype(np.float32)}
    expected = ort_run(original, inputs)
    _same(expected, ort_run(out, inputs))


def test_an_unsqueeze_read_elsewhere_is_not_merged():
    nodes = [n("Unsqueeze", ["x", "a1"], ["u1"]), n("Unsqueeze", ["u1", "a2"], ["u2"]),
             n("Neg", ["u2"], ["y"]), n("Neg", ["u1"], ["z"])]
    inits = [tensor("a1", np.array([0], np.int64)), tensor("a2", np.array([0], np.int64))]
    out, _ = _optimize(model(nodes, [vinfo("x", [3])], [vinfo("y", None), vinfo("z", None)], inits))
    assert ops(out).count("Unsqueeze") == 2, ops(out)


# -- rule 4: ops that return their input -------------------------------------------------------------

@pytest.mark.parametrize("op, constant, removed", [
    ("And", np.array(True), True), ("And", np.ones((1, 1), bool), True), ("Or", np.array(False), True),
    ("And", np.array([True, False, True]), False),  # not all True
    ("And", np.ones((2, 1, 1), bool), False),  # of higher rank than x: the output would be 3-D
    ("Or", np.array(True), False),
])
def test_and_or_with_a_constant_that_returns_the_input(op, constant, removed):
    nodes = [n("Greater", ["x", "zero"], ["b"]), n(op, ["c", "b"], ["m"]), n("Not", ["m"], ["y"])]
    original = model(nodes, [vinfo("x", ["N", 3])], [vinfo("y", None, TensorProto.BOOL)],
                     [tensor("zero", np.float32(0)), tensor("c", constant)])
    out, _ = _optimize(original)
    assert (op not in ops(out)) == removed, ops(out)
    inputs = {"x": rng(3).standard_normal((4, 3)).astype(np.float32)}
    _same(ort_run(original, inputs), ort_run(out, inputs))


@pytest.mark.parametrize("shape, removed", [([1, 1], True), ([1], True), ([1, 1, 1], False), ([2, 1], False)])
def test_expand_by_ones_goes_where_it_broadcasts_nothing(shape, removed):
    nodes = [n("Expand", ["x", "s"], ["e"]), n("Neg", ["e"], ["y"])]
    original = model(nodes, [vinfo("x", ["N", 3])], [vinfo("y", None)], [tensor("s", np.array(shape, np.int64))])
    out, _ = _optimize(original)
    assert ("Expand" not in ops(out)) == removed, ops(out)
    inputs = {"x": rng(4).standard_normal((2 if shape != [2, 1] else 1, 3)).astype(np.float32)}
    _same(ort_run(original, inputs), ort_run(out, inputs))


def test_a_graph_output_keeps_its_node():
    nodes = [n("And", ["b", "c"], ["y"])]
    original = model(nodes, [vinfo("b", [3], TensorProto.BOOL)], [vinfo("y", [3], TensorProto.BOOL)],
                     [tensor("c", np.array(True))])
    out, _ = _optimize(original)
    assert ops(out) == ["And"]


# -- rule 5: one read per declared dim ----------------------------------------------------------------

def test_shape_reads_of_one_declared_dim_become_one():
    """Three inputs declare axis 1 'P', one 'Q': the reads of 'P' share one Shape, 'Q' keeps its own."""
    nodes, outs = [], []
    for i, name in enumerate(["a", "b", "c", "d"]):
        nodes += [n("Shape", [name], [f"s{i}"], start=1, end=2), n("LessOrEqual", [f"s{i}", "limit"], [f"y{i}"])]
        outs.append(vinfo(f"y{i}", [1], TensorProto.BOOL))
    inputs = [vinfo("a", [2, "P"]), vinfo("b", [2, "P"]), vinfo("c", [2, "P"]), vinfo("d", [2, "Q"])]
    original = model(nodes, inputs, outs, [tensor("limit", np.array([4], np.int64))])
    out, report = _optimize(original)
    assert ops(out).count("Shape") == 2, ops(out)
    assert sum(r.pattern == "Shape(same dim)" for r in report.records) == 2
    feeds = {k: np.zeros((2, 3), np.float32) for k in "abc"} | {"d": np.zeros((2, 6), np.float32)}
    _same(ort_run(original, feeds), ort_run(out, feeds))


@pytest.mark.parametrize("anonymous", ["?", "unk__0"])
def test_shape_reads_of_anonymous_dims_stay_apart(anonymous):
    """Paddle2ONNX writes "?" on every free axis, onnx's inference ``unk__N``: two inputs that both
    say so are not one dimension (core.dims.same_dim), so each keeps its own Shape."""
    nodes = [n("Shape", ["a"], ["sa"], start=1, end=2), n("Shape", ["b"], ["sb"], start=1, end=2),
             n("Concat", ["sa", "sb"], ["y"], axis=0)]
    original = model(nodes, [vinfo("a", [2, anonymous]), vinfo("b", [2, anonymous])], [vinfo("y", [2], TensorProto.INT64)])
    out, report = _optimize(original)
    assert ops(out).count("Shape") == 2 and not any(r.pattern == "Shape(same dim)" for r in report.records)
    feeds = {"a": np.zeros((2, 3), np.float32), "b": np.zeros((2, 6), np.float32)}
    _same(ort_run(original, feeds), ort_run(out, feeds))
