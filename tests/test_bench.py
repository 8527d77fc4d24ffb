"""opfuse bench: traffic counted by hand, the cost model's laws, the command end to end."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from graphs import bn_node, bn_params, model, rng, tensor, vinfo
from opfuse.bench.chapter import fuse_activation_into_batchnorm
from opfuse.bench.measure import summarise_profile
from opfuse.cost import accelerator as costmodel
from opfuse.cost import traffic
from opfuse.cost.int8 import float_ops, int8_traffic
from opfuse.cost.accelerator import HardwareProfile, fusion_veto, load_profile, predict
from opfuse.cost.traffic import Kernel, TensorInfo, analyse_traffic
from opfuse.cli import main
from opfuse.errors import BadInputError

F32 = 4
MS = "com.microsoft"


def by_name(t: traffic.Traffic) -> dict[str, traffic.Kernel]:
    return {n.name: n for n in t.nodes}


# -- traffic, by hand ------------------------------------------------------------------

def conv_model(batch=1):
    w = tensor("W", rng(0).normal(size=(4, 3, 3, 3)).astype(np.float32))
    node = helper.make_node("Conv", ["x", "W"], ["y"], name="conv", pads=[1, 1, 1, 1])
    return model([node], [vinfo("x", [batch, 3, 8, 8])], [vinfo("y", [batch, 4, 8, 8])], [w])


def test_conv_reads_input_and_weight_writes_output():
    node = by_name(analyse_traffic(conv_model()))["conv"]
    assert node.activation_read == 1 * 3 * 8 * 8 * F32 == 768
    assert node.weight_read == 4 * 3 * 3 * 3 * F32 == 432
    assert node.written == 4 * 8 * 8 * F32 == 1024
    assert node.total == 2224 and node.unknown == []


def test_symbolic_batch_is_bound_to_the_benchmark_batch():
    t = analyse_traffic(conv_model(batch="N"), batch=3)
    node = by_name(t)["conv"]
    assert node.activation_read == 3 * 768 and node.written == 3 * 1024 and node.weight_read == 432
    unbound = analyse_traffic(conv_model(batch="N"))
    assert unbound.unknown == {"conv": ["x", "y"]}  # said, not guessed
    assert by_name(unbound)["conv"].total == 432


def conv_bn_relu():
    r = rng(1)
    inits = [tensor("W", r.normal(size=(4, 3, 3, 3)).astype(np.float32)),
             tensor("B", r.normal(size=4).astype(np.float32))] + bn_params("bn", 4)
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             bn_node("bn", "c", "n"),
             helper.make_node("Relu", ["n"], ["y"], name="relu")]
    return model(nodes, [vinfo("x", [1, 3, 8, 8])], [vinfo("y", [1, 4, 8, 8])], inits)


def fused_conv(with_z=False):
    """FusedConv(x, W, B[, Z]) + Relu, built by hand; its output shape left to inference."""
    r = rng(2)
    inits = [tensor("W", r.normal(size=(4, 3, 3, 3)).astype(np.float32)),
             tensor("B", r.normal(size=4).astype(np.float32))]
    inputs = ["x", "W", "B"] + (["z"] if with_z else [])
    nodes = [helper.make_node("FusedConv", inputs, ["f"], name="fused", domain=MS,
                              pads=[1, 1, 1, 1], activation="Relu"),
             helper.make_node("Sigmoid", ["f"], ["y"], name="after")]
    graph_inputs = [vinfo("x", [1, 3, 8, 8])] + ([vinfo("z", [1, 4, 8, 8])] if with_z else [])
    graph = helper.make_graph(nodes, "fused", graph_inputs, [vinfo("y", None)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    m.ir_version = 8
    return m


def test_conv_bn_relu_unfused_versus_a_hand_built_fused_conv():
    unfused = analyse_traffic(conv_bn_relu())
    n = by_name(unfused)
    fmap = 4 * 8 * 8 * F32  # 1024: each intermediate feature map
    assert n["conv"].total == 768 + 432 + 16 + fmap
    assert n["bn"].total == fmap + 4 * 16 + fmap  # reads the map and 4 vectors, writes the map
    assert n["relu"].total == fmap + fmap
    assert unfused.total == 768 + 432 + 16 + 5 * fmap + 64

    fused = analyse_traffic(fused_conv())
    f = by_name(fused)
    assert f["fused"].total == 768 + 432 + 16 + fmap
    assert f["after"].activation_read == fmap  # the shape went through the FusedConv
    assert fused.unknown == {}
    # element-wise ops belong to the layer whose activation they work on
    assert {x.layer for x in unfused.nodes} == {"conv"}
    assert unfused.per_layer() == {"conv": unfused.total}


def test_fused_conv_reads_its_residual_input():
    f = by_name(analyse_traffic(fused_conv(with_z=True)))["fused"]
    assert f.activation_read == 768 + 1024 and f.weight_read == 432 + 16 and f.written == 1024


def test_add_with_broadcasting_counts_each_operand_at_its_own_size():
    add = helper.make_node("Add", ["a", "b"], ["y"], name="add")
    m = model([add], [vinfo("a", [2, 3, 4, 5]), vinfo("b", [3, 1, 1])], [vinfo("y", [2, 3, 4, 5])])
    node = by_name(analyse_traffic(m))["add"]
    assert node.activation_read == 120 * F32 + 3 * F32 and node.written == 120 * F32
    const = model([add], [vinfo("a", [2, 3, 4, 5])], [vinfo("y", [2, 3, 4, 5])],
                  [tensor("b", np.ones((3, 1, 1), np.float32))])
    node = by_name(analyse_traffic(const))["add"]
    assert node.activation_read == 480 and node.weight_read == 12 and node.written == 480


def test_gemm_and_float16():
    gemm = helper.make_node("Gemm", ["a", "W", "C"], ["y"], name="fc")
    inits = [tensor("W", np.ones((8, 4), np.float32)), tensor("C", np.ones(4, np.float32))]
    node = by_name(analyse_traffic(model([gemm], [vinfo("a", [2, 8])], [vinfo("y", [2, 4])], inits)))["fc"]
    assert (node.activation_read, node.weight_read, node.written) == (64, 128 + 16, 32)
    inits16 = [tensor("W", np.ones((8, 4), np.float16)), tensor("C", np.ones(4, np.float16))]
    m16 = model([gemm], [vinfo("a", [2, 8], TensorProto.FLOAT16)], [vinfo("y", [2, 4], TensorProto.FLOAT16)], inits16)
    node = by_name(analyse_traffic(m16))["fc"]
    assert (node.activation_read, node.weight_read, node.written) == (32, 72, 16)


def test_shape_reads_no_data_and_constants_move_nothing():
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Constant", [], ["k"], name="k", value=tensor("kv", np.ones(4, np.int64))),
             helper.make_node("Reshape", ["x", "k"], ["y"], name="reshape")]
    m = model(nodes, [vinfo("x", [1, 2, 2, 1])], [vinfo("y", [1, 2, 2, 1]), vinfo("s", [4], TensorProto.INT64)])
    n = by_name(analyse_traffic(m))
    assert n["shape"].activation_read == 0 and n["shape"].written == 4 * 8
    assert n["k"].total == 0
    assert n["reshape"].weight_read == 32 and n["reshape"].activation_read == 16


def test_ideal_bound_each_activation_written_and_read_once():
    # x -> conv -> add(x) -> relu -> y: x is read twice (conv and the residual), ideally once
    r = rng(3)
    inits = [tensor("W", r.normal(size=(3, 3, 1, 1)).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
             helper.make_node("Add", ["c", "x"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["y"], name="relu")]
    m = model(nodes, [vinfo("x", [1, 3, 4, 4])], [vinfo("y", [1, 3, 4, 4])], inits)
    t = analyse_traffic(m)
    fmap = 3 * 4 * 4 * F32  # 192
    assert t.total == (fmap + 36 + fmap) + (3 * fmap) + (2 * fmap)
    # activations: x (read once, never written) and the conv's map (written once; y is an output)
    assert t.activations == 2
    assert t.ideal_activation_bytes == fmap + fmap
    assert t.ideal_weight_bytes == 36
    assert t.ideal == 2 * fmap + 36 < t.total
    assert {n.layer for n in t.nodes} == {"conv"}


def test_ideal_activation_part_is_the_same_fused_or_not():
    unfused, fused = analyse_traffic(conv_bn_relu()), analyse_traffic(fused_conv())
    # x read once + the conv's map written once (element-wise ops run in its epilogue)
    assert unfused.ideal_activation_bytes == fused.ideal_activation_bytes == 768 + 1024
    assert unfused.ideal_weight_bytes == 432 + 16 + 64 and fused.ideal_weight_bytes == 432 + 16
    assert fused.total == fused.ideal + 2 * 1024  # the Sigmoid after the FusedConv is not fused


# -- int8: a QDQ graph read as an int8 accelerator runs it ----------------------------------

def qdq_conv(folded: bool):
    """x -> Q -> DQ -> Conv (int8 W, int32 B, both through DQ) -> Q -> DQ [-> BN -> Q -> DQ] -> y,
    by hand: what ONNX Runtime's quantiser writes with BN folded, and with BN left in float."""
    r = rng(7)
    u8 = lambda name, v: tensor(name, np.array(v, np.uint8))  # noqa: E731
    inits = [
        tensor("xs", np.float32(0.02)), u8("xz", 128), tensor("cs", np.float32(0.05)), u8("cz", 128),
        tensor("Wq", r.integers(-127, 128, size=(4, 3, 3, 3)).astype(np.int8)),
        tensor("Ws", np.full(4, 0.01, np.float32)), tensor("Wz", np.zeros(4, np.int8)),
        tensor("Bq", r.integers(-1000, 1000, size=4).astype(np.int32)),
        tensor("Bs", np.full(4, 0.0002, np.float32)), tensor("Bz", np.zeros(4, np.int32)),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="q_x"),
        helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"], name="dq_x"),
        helper.make_node("DequantizeLinear", ["Wq", "Ws", "Wz"], ["Wd"], name="dq_w", axis=0),
        helper.make_node("DequantizeLinear", ["Bq", "Bs", "Bz"], ["Bd"], name="dq_b", axis=0),
        helper.make_node("Conv", ["xd", "Wd", "Bd"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c", "cs", "cz"], ["cq"], name="q_c"),
        helper.make_node("DequantizeLinear", ["cq", "cs", "cz"], ["y" if folded else "cd"], name="dq_c"),
    ]
    if not folded:
        inits += bn_params("bn", 4) + [tensor("ns", np.float32(0.05)), u8("nz", 128)]
        nodes += [bn_node("bn", "cd", "n"),
                  helper.make_node("QuantizeLinear", ["n", "ns", "nz"], ["nq"], name="q_n"),
                  helper.make_node("DequantizeLinear", ["nq", "ns", "nz"], ["y"], name="dq_n")]
    return model(nodes, [vinfo("x", [1, 3, 8, 8])], [vinfo("y", [1, 4, 8, 8])], inits, opset=13)


def test_a_conv_between_dq_and_q_is_one_int8_kernel():
    raw = analyse_traffic(qdq_conv(folded=True))
    view = int8_traffic(raw)
    assert [(n.op_type, n.precision) for n in view.nodes] == [
        ("QuantizeLinear", ""), ("Conv", "int8"), ("DequantizeLinear", "")]  # float in, float out
    conv = by_name(view)["conv"]
    assert conv.activation_read == 3 * 8 * 8  # uint8: 1 byte an element
    assert conv.weight_read == 4 * 3 * 3 * 3 + 4 * 4  # int8 weights, int32 bias
    assert conv.written == 4 * 8 * 8  # the Q's output: requantised in the epilogue
    assert [t.name for t in conv.outputs] == ["cq"]
    assert view.total < raw.total and float_ops(view) == {}
    assert view.ideal <= view.total
    graph_ops = [n.op_type for n in raw.nodes]
    assert graph_ops.count("DequantizeLinear") == 4  # the graph itself is untouched
    assert int8_traffic(analyse_traffic(conv_bn_relu())).nodes[0].precision == ""  # float: unchanged


def test_an_unfolded_batchnorm_runs_in_float_between_conversions():
    view = int8_traffic(analyse_traffic(qdq_conv(folded=False)))
    assert [(n.op_type, n.precision) for n in view.nodes] == [
        ("QuantizeLinear", ""), ("Conv", "int8"), ("DequantizeLinear", ""), ("BatchNormalization", ""),
        ("QuantizeLinear", ""), ("DequantizeLinear", "")]
    n = by_name(view)
    fmap = 4 * 8 * 8
    assert n["dq_c"].activation_read == fmap and n["dq_c"].written == fmap * F32  # int8 -> float
    assert n["bn"].activation_read == fmap * F32 and n["bn"].weight_read == 4 * 4 * F32
    assert n["q_n"].activation_read == fmap * F32 and n["q_n"].written == fmap  # float -> int8
    assert float_ops(view) == {"BatchNormalization": 1}


def test_int8_conv_is_predicted_faster_and_an_unfolded_bn_slower():
    folded = predict(analyse_traffic(qdq_conv(folded=True)), "npu-chapter")  # read as int8 on its own
    unfolded = predict(analyse_traffic(qdq_conv(folded=False)), "npu-chapter")
    float_conv = predict(analyse_traffic(conv_model()), "npu-chapter").kernels[0]  # the same conv in float
    conv = next(k for k in folded.kernels if k.label == "Conv")
    assert conv.bytes == 192 + 108 + 16 + 256 < float_conv.bytes  # float16 on npu-chapter: 2 bytes
    assert conv.time_s < float_conv.time_s
    assert conv.compute_s == pytest.approx(conv.flops / 3000e9)  # npu-chapter's int8 peak
    # the graph input's Q and the output's DQ are kernels here (float in, float out); the
    # unfolded BN adds three more: DQ, BN, Q
    assert len(unfolded.kernels) == len(folded.kernels) + 3 and unfolded.latency_s > folded.latency_s


def test_the_int8_peak_is_the_profiles_own():
    prof = profile(peak_gflops={"float32": 100.0, "int8": 400.0})
    assert prof.peak("uint8") == prof.peak("int8") == 400e9 and prof.peak("float32") == 100e9
    npu = profile(execution_dtype="float16", peak_gflops={"float32": 100.0, "float16": 200.0})
    assert npu.peak("uint8") == 200e9  # no int8 rate stated: not assumed faster than float16
    for name in costmodel.list_profiles():
        prof = load_profile(name)
        assert prof.peak("int8") >= prof.peak("float32")


# -- the cost model ----------------------------------------------------------------------

def t(name, shape, weight=False, dtype="float32", bits=32):
    return TensorInfo(name, tuple(shape), dtype, bits, weight)


def conv_kernel(cin=64, cout=64, size=56, k=3, epilogue=(), residual=False, name="conv", int8=False):
    """A Conv kernel; ``int8``: as read from a QDQ graph (uint8 activations, int8 weights, int32 bias)."""
    act = {"dtype": "uint8", "bits": 8} if int8 else {}
    weight = {"dtype": "int8", "bits": 8} if int8 else {}
    bias = {"dtype": "int32"} if int8 else {}
    inputs = [t("x", (1, cin, size, size), **act), t("w", (cout, cin, k, k), True, **weight),
              t("b", (cout,), True, **bias)]
    if residual:
        inputs.append(t("z", (1, cout, size, size), **act))
    return Kernel(name, "Conv", tuple(inputs), (t("y", (1, cout, size, size), **act),),
                  {"pads": [k // 2] * 4, "strides": [1, 1]}, tuple(epilogue), name, "int8" if int8 else "",
                  residual_input=3 if residual else None)


def eltwise_kernel(op, c=64, size=56, name="e"):
    return Kernel(name, op, (t("y", (1, c, size, size)),), (t(name, (1, c, size, size)),), {}, (), name)


def profile(**changes) -> HardwareProfile:
    base = HardwareProfile("test", dram_bandwidth_gbps=20.0, onchip_buffer_kib=1024, launch_overhead_us=5.0,
                           peak_gflops={"float32": 500.0}, tile_rows=4)
    return base.replace(**changes)


def test_roofline_plus_launch_by_hand():
    k = conv_kernel(cin=8, cout=8, size=16)
    p = predict([k], profile())
    cost = p.kernels[0]
    moved = (8 * 16 * 16 + 8 * 8 * 9 + 8 + 8 * 16 * 16) * F32
    flops = 2 * 8 * 16 * 16 * 8 * 9 + 8 * 16 * 16  # MACs x 2, plus the bias
    assert cost.bytes == moved and cost.flops == flops and cost.spill_bytes == 0
    assert cost.time_s == pytest.approx(max(flops / 500e9, moved / 20e9) + 5e-6)
    assert p.latency_s == pytest.approx(cost.time_s)


def test_spill_is_charged_when_the_buffer_is_too_small():
    fused = conv_kernel(cin=256, cout=256, size=56, epilogue=("Add", "Relu"), residual=True)
    fast = {"float32": 5000.0}  # memory-bound, so the spill shows in the time
    roomy = predict([fused], profile(onchip_buffer_kib=8192, peak_gflops=fast)).kernels[0]
    tight = predict([fused], profile(onchip_buffer_kib=256, peak_gflops=fast)).kernels[0]
    assert roomy.spill_bytes == 0 and tight.spill_bytes > 0
    ws, tiles, parts = costmodel.working_set(fused, profile())
    assert parts["weights"] == (256 * 256 * 9 + 256) * F32
    assert parts["output tile"] == parts["residual tile"] == 4 * 56 * 256 * F32
    assert parts["input tile"] == 6 * 56 * 256 * F32  # 4 output rows of a 3x3 window need 6
    # overflow refetched for every further tile, plus the two intermediates there and back
    expected = (ws - 256 * 1024) * (tiles - 1) + 2 * 2 * (256 * 56 * 56 * F32)
    assert tight.spill_bytes == pytest.approx(expected, rel=1e-9)
    assert tight.time_s > roomy.time_s


def test_a_fused_kernel_that_spills_can_be_slower_than_unfused():
    # the chapter's warning: with a small buffer, forced fusion gets slower. The residual
    # tile pushes the fused kernel over a 380 KiB buffer the conv alone fits in.
    fused = [conv_kernel(cin=256, cout=64, size=56, k=1, epilogue=("Add", "Relu"), residual=True)]
    add = Kernel("add", "Add", (t("y", (1, 64, 56, 56)), t("z", (1, 64, 56, 56))), (t("s", (1, 64, 56, 56)),), {})
    unfused = [conv_kernel(cin=256, cout=64, size=56, k=1), add, eltwise_kernel("Relu", 64, 56)]
    small = profile(onchip_buffer_kib=380, spill_efficiency=0.5)
    assert len(predict(fused, small).spilling) == 1 and not predict(unfused, small).spilling
    assert predict(fused, small).latency_s > predict(unfused, small).latency_s
    roomy = profile(onchip_buffer_kib=1024)  # where it fits, fusion wins
    assert predict(fused, roomy).latency_s < predict(unfused, roomy).latency_s


kernel_sets = st.lists(
    st.tuples(st.sampled_from([8, 32, 64, 256]), st.sampled_from([8, 64, 128, 512]),
              st.sampled_from([7, 14, 28, 56]), st.sampled_from([1, 3]),
              st.sampled_from([(), ("Relu",), ("Add", "Relu")])),
    min_size=1, max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(kernel_sets,
       st.floats(1, 200), st.floats(1, 4),
       st.floats(16, 16384), st.floats(1, 8),
       st.floats(10, 5000), st.floats(0, 50), st.sampled_from([1, 2, 4, 16]), st.floats(0.1, 1.0),
       st.booleans(), st.floats(1, 4), st.sampled_from([None, "float16"]))
def test_more_bandwidth_or_buffer_is_never_slower(specs, bw, bw_gain, buf, buf_gain, peak, launch, rows, eff,
                                                  int8, int8_gain, exec_dtype):
    def kernels_in(int8):
        made = [conv_kernel(cin, cout, size, k, epi, residual="Add" in epi, name=f"k{i}", int8=int8)
                for i, (cin, cout, size, k, epi) in enumerate(specs)]
        return made + [eltwise_kernel("Relu", 64, 28, name="relu")]

    kernels = kernels_in(int8)
    peaks = {"float32": peak, "float16": peak * 2, "int8": peak * 2 * int8_gain}
    base = profile(dram_bandwidth_gbps=bw, onchip_buffer_kib=buf, peak_gflops=peaks,
                   launch_overhead_us=launch, tile_rows=rows, spill_efficiency=eff, execution_dtype=exec_dtype)
    slow = predict(kernels, base).latency_s
    faster = {k: v * 2 for k, v in peaks.items()}
    assert predict(kernels, base.replace(dram_bandwidth_gbps=bw * bw_gain)).latency_s <= slow * (1 + 1e-12)
    assert predict(kernels, base.replace(onchip_buffer_kib=buf * buf_gain)).latency_s <= slow * (1 + 1e-12)
    assert predict(kernels, base.replace(peak_gflops=faster)).latency_s <= slow * (1 + 1e-12)
    assert predict(kernels, base.replace(peak_gflops={**peaks, "int8": peaks["int8"] * 2})).latency_s <= slow * (1 + 1e-12)
    assert predict(kernels, base.replace(launch_overhead_us=launch / 2)).latency_s <= slow * (1 + 1e-12)
    assert predict(kernels, base.replace(spill_efficiency=1.0)).latency_s <= slow * (1 + 1e-12)
    # the same kernels in int8 (1-byte activations and weights, int32 bias, int8 peak >= float's)
    # are never predicted slower than in float
    assert predict(kernels_in(True), base).latency_s <= predict(kernels_in(False), base).latency_s * (1 + 1e-12)


def test_execution_dtype_halves_float_bytes():
    k = conv_kernel(cin=8, cout=8, size=16)
    full = predict([k], profile()).kernels[0].bytes
    half = predict([k], profile(execution_dtype="float16", peak_gflops={"float32": 1.0, "float16": 1.0})).kernels[0].bytes
    assert half * 2 == full


def test_profiles_load_and_bad_ones_are_refused(tmp_path):
    chapter = load_profile("npu-chapter")
    assert chapter.name == "npu-chapter" and chapter.execution_dtype == "float16"
    assert load_profile("npu-small").onchip_buffer_kib < chapter.onchip_buffer_kib
    assert set(costmodel.list_profiles()) >= {"npu-chapter", "npu-small"}
    with pytest.raises(BadInputError, match="unknown hardware profile 'npu-nope'"):
        load_profile("npu-nope")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\ndram_bandwidth_gbps = -1\nonchip_buffer_kib = 1\nlaunch_overhead_us = 0\n'
                   '[peak_gflops]\nfloat32 = 1.0\n')
    with pytest.raises(BadInputError, match="dram_bandwidth_gbps"):
        load_profile(bad)
    bad.write_text("not toml [")
    with pytest.raises(BadInputError, match="TOML"):
        load_profile(bad)
    good = tmp_path / "mine.toml"
    good.write_text('dram_bandwidth_gbps = 10\nonchip_buffer_kib = 64\nlaunch_overhead_us = 1\n'
                    '[peak_gflops]\nfloat32 = 100\n')
    assert load_profile(good).name == "mine"


def test_fusing_activation_into_batchnorm_models_the_chapters_conv_relu():
    t_ = analyse_traffic(conv_bn_relu())
    kernels = costmodel.kernels_of(t_)
    merged = fuse_activation_into_batchnorm(kernels, t_.graph_outputs)
    assert [k.label for k in merged] == ["Conv", "BatchNormalization+Relu"]
    assert merged[1].outputs[0].name == "y"
    # a BN output that something else also reads stays unfused
    m = conv_bn_relu()
    m.graph.output.append(vinfo("n", [1, 4, 8, 8]))
    t2 = analyse_traffic(m)
    assert len(fuse_activation_into_batchnorm(costmodel.kernels_of(t2), t2.graph_outputs)) == 3


# -- the --hardware hook -----------------------------------------------------------------

def big_conv_relu():
    r = rng(4)
    inits = [tensor("W", (r.normal(size=(256, 256, 3, 3)) * 0.01).astype(np.float32)),
             tensor("B", np.zeros(256, np.float32))]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["y"], name="relu")]
    m = model(nodes, [vinfo("x", [1, 256, 56, 56])], [vinfo("y", [1, 256, 56, 56])], inits)
    irm = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(m))
    conv, relu = list(irm.graph)
    return conv, relu


def residual_conv(c=32, h=64, w=800):
    """A memory-bound 1x1 Conv -> Add(z) -> Relu: the conv alone fits npu-small's buffer
    (input + output tiles, 400 KiB) but the fused kernel, with a tile of Z, does not."""
    r = rng(5)
    inits = [tensor("W", (r.normal(size=(c, c, 1, 1)) * 0.01).astype(np.float32)),
             tensor("B", np.zeros(c, np.float32))]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
             helper.make_node("Add", ["c", "z"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    m = model(nodes, [vinfo("x", [1, c, h, w]), vinfo("z", [1, c, h, w])], [vinfo("y", [1, c, h, w])], inits)
    irm = ir.serde.deserialize_model(onnx.shape_inference.infer_shapes(m))
    return list(irm.graph)


def test_fusion_veto_declines_a_fusion_that_causes_a_spill_and_loses():
    conv, add, relu = residual_conv()
    reason = fusion_veto("npu-small")(conv, [add, relu])
    assert reason is not None and "\n" not in reason
    assert "exceeds npu-small's 512 KiB on-chip buffer; it would spill" in reason
    assert "predicted slower fused" in reason
    assert fusion_veto("npu-chapter")(conv, [add, relu]) is None


def test_fusion_veto_keeps_a_spilling_fusion_that_still_wins():
    # The weights alone (1.1 MiB at float16) exceed npu-small's buffer: the unfused conv
    # spills anyway, and fusing still saves the Relu's round trip.
    conv, relu = big_conv_relu()
    assert fusion_veto("npu-small")(conv, [relu]) is None
    assert fusion_veto("npu-chapter")(conv, [relu]) is None


def test_fusion_veto_works_without_inferred_shapes():
    conv, add, relu = residual_conv()
    for n in (conv, add, relu):
        n.outputs[0].shape = None
    assert "would spill" in fusion_veto("npu-small")(conv, [add, relu])
    conv.inputs[0].shape = None
    assert fusion_veto("npu-small")(conv, [add, relu]) is None  # cannot tell: no objection


def test_fusion_veto_unknown_profile_is_bad_input():
    with pytest.raises(BadInputError):
        fusion_veto("no-such-chip")


@pytest.mark.slow
def test_npu_chapter_reproduces_the_chapters_resnet50_table_within_15_percent():
    from opfuse.bench.ablation import apply_config
    from opfuse.models import build

    proto = build("resnet50", batch=1)
    prof = load_profile("npu-chapter")
    none = analyse_traffic(apply_config(proto, "none")[0], batch=1)
    rows = {
        "none": predict(none, prof),
        "conv-bn": predict(analyse_traffic(apply_config(proto, "conv-bn")[0], batch=1), prof),
        "conv-relu": predict(fuse_activation_into_batchnorm(costmodel.kernels_of(none),
                                                                      none.graph_outputs), prof),
        "conv-bn-act": predict(analyse_traffic(apply_config(proto, "conv-bn-act")[0], batch=1), prof),
    }
    chapter = {"none": 12.5, "conv-bn": 10.1, "conv-relu": 11.3, "conv-bn-act": 9.2}
    for key, ms in chapter.items():
        assert rows[key].latency_s * 1e3 == pytest.approx(ms, rel=0.15), key
    assert not any(p.spilling for p in rows.values())
    # and the colleague's traffic figures: 426 MB unfused, 175 nodes
    assert round(none.total / 1e6) == 426 and len(none.nodes) == 175


# -- measurement helpers -------------------------------------------------------------------

def test_profile_summary_is_the_median_per_op_type_over_runs():
    def run(ts, dur):
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    def node(ts, op, dur):
        return {"cat": "Node", "name": f"n{ts}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}

    events = [run(0, 100), node(1, "Conv", 5000), run(200, 100), node(201, "Conv", 1000), node(202, "Relu", 300),
              run(400, 100), node(401, "Conv", 2000), node(402, "Relu", 100), run(600, 100), node(601, "Conv", 3000)]
    summary = summarise_profile(events, skip_runs=1)
    assert summary == {"Conv": 2.0, "Relu": 0.1}  # medians over the three kept runs, in ms


# -- the command -------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def int8_rows_without_reconstruction(monkeypatch):
    """The bench's int8 rows quantise with opfuse.quantize's defaults, block reconstruction
    included (minutes on a built-in model); these tests of the rows ask for it off."""
    import functools

    import opfuse.bench.int8
    from opfuse.quantization.pipeline import quantize

    monkeypatch.setattr(opfuse.bench.int8, "quantize", functools.partial(quantize, reconstruct=False))


def test_bench_end_to_end_on_a_tiny_builtin(tmp_path, capsys, int8_rows_without_reconstruction):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = main(["bench", "--model", "resnet18", "--image-size", "64", "--reps", "2", "--quick",
               "--runtime-levels", "all", "--hardware", "npu-chapter,npu-small",
               "--json", str(out_json), "--plot", str(out_png)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "NOT measurements" in captured.out and "Measured on this machine" in captured.out
    data = json.loads(out_json.read_text())
    rows = {r["key"]: r for r in data["rows"]}
    assert {"none", "conv-bn", "conv-act", "conv-bn-act", "all", "none-aa", "ort-all", "npu-conv-relu"} <= set(rows)
    assert rows["conv-act"]["same_as"] == "none" and rows["conv-act"]["measured"] is None
    for key in ("none", "conv-bn", "conv-bn-act", "all", "none-aa", "ort-all"):
        assert rows[key]["measured"]["median_ms"] > 0 and len(rows[key]["measured"]["samples_ms"]) == 2
        assert rows[key]["outputs_match_baseline"] is True, rows[key]["mismatch"]
    assert rows["none"]["nodes"] == 69 and rows["all"]["nodes"] < rows["conv-bn"]["nodes"] < 69
    assert rows["all"]["traffic"]["total"] < rows["none"]["traffic"]["total"]
    assert data["ideal_traffic_bytes"] <= rows["all"]["traffic"]["total"]
    assert rows["npu-conv-relu"]["measured"] is None and rows["npu-conv-relu"]["predicted"]["npu-chapter"]["latency_ms"] > 0
    assert rows["none"]["predicted"]["npu-small"]["note"].startswith("a cost model's prediction")
    assert "chapter" not in rows["none"]  # the chapter's table is ResNet-50 at 224 only
    assert len(data["traffic_per_layer"]["layers"]) == len(data["traffic_per_layer"]["bytes"]["none"])
    # int8 rows (on by default for a built-in): measured at ORT all beside the float model at all
    assert "int8 rows: QDQ graphs" in captured.out and "vs ORT all" in captured.out
    for key in ("int8", "int8-unfolded", "all-ort-all", "ort-all"):
        assert rows[key]["level"] == "all", key
        assert rows[key]["measured"]["median_ms"] > 0 and rows[key]["error"] is None, rows[key]["error"]
    assert rows["none"]["level"] == "disabled" and "ratio_to_ort_all" not in rows["none"]["measured"]
    folded, unfolded = rows["int8"]["int8"], rows["int8-unfolded"]["int8"]
    for facts in (folded, unfolded):
        assert facts["quantize_linear"] > 0 and facts["qdq_nodes"] > rows["none"]["nodes"]
        assert 5 < facts["sqnr_db"] < 200  # finite: close to the float model, not equal to it
        assert facts["held_out_samples"] == 4 and facts["weights_8bit_fraction"] == 1.0
        assert facts["runtime_int8_kernels"] > 0  # ONNX Runtime ran int8 kernels at all
    assert unfolded["quantize_linear"] > folded["quantize_linear"]  # BN got its own Q/DQ
    assert unfolded["float_ops"]["BatchNormalization"] == 20
    assert set(unfolded["float_ops"]) - {"BatchNormalization"} <= {"Add", "Relu"}
    # folded: only the residual path stays float (opfuse's cpu preset keeps element-wise Adds, and
    # the Relu after them, out of int8: opfuse.quantization.presets)
    assert set(folded["float_ops"]) <= {"Add", "Relu"}
    assert unfolded["runtime_ops"]["BatchNormalization"] == 20 and "BatchNormalization" not in folded["runtime_ops"]
    for key in ("int8", "int8-unfolded"):
        assert rows[key]["outputs_match_baseline"] is None  # int8 differs by design: its SQNR says how much
        assert rows[key]["measured"]["ratio_to_ort_all"] > 0
    predicted = {k: rows[k]["predicted"]["npu-chapter"]["latency_ms"] for k in ("none", "conv-bn", "int8", "int8-unfolded")}
    assert predicted["int8"] < predicted["conv-bn"] and predicted["int8-unfolded"] < predicted["none"]
    assert predicted["int8"] < predicted["int8-unfolded"]
    png = out_png.read_bytes()
    assert png[:8] == PNG_SIGNATURE
    import matplotlib.image

    image = matplotlib.image.imread(out_png)
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_bench_a_model_file_with_a_symbolic_batch(tmp_model, capsys):
    path = tmp_model(conv_bn_relu_symbolic())
    rc = main(["bench", str(path), "--batch", "2", "--reps", "2", "--quick", "--runtime-levels", "none",
               "--configs", "conv-bn,all", "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(captured.out)  # only JSON on stdout with --json -
    rows = {r["key"]: r for r in data["rows"]}
    assert set(rows) >= {"none", "conv-bn", "all", "none-aa"}
    assert rows["none"]["traffic"]["unknown"] == {}
    assert rows["none"]["traffic"]["per_node"][0]["activation_read"] == 2 * 768  # batch bound to 2


def test_bench_int8_rows_for_a_model_file(tmp_model, capsys, int8_rows_without_reconstruction):
    path = tmp_model(conv_bn_relu_symbolic())
    rc = main(["bench", str(path), "--int8", "--reps", "2", "--quick", "--runtime-levels", "none",
               "--configs", "conv-bn", "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = {r["key"]: r for r in json.loads(captured.out)["rows"]}
    assert {"int8", "int8-unfolded", "all-ort-all", "ort-all"} <= set(rows)  # ORT all added as the reference
    folded, unfolded = rows["int8"]["int8"], rows["int8-unfolded"]["int8"]
    assert 0 < folded["quantize_linear"] < unfolded["quantize_linear"]
    assert unfolded["float_ops"] == {"BatchNormalization": 1}
    assert rows["int8"]["traffic"]["total"] < rows["conv-bn"]["traffic"]["total"]  # 1-byte tensors
    file_default = main(["bench", str(path), "--no-measure", "--json", "-"])
    assert file_default == 0
    assert not {"int8", "int8-unfolded"} & {r["key"] for r in json.loads(capsys.readouterr().out)["rows"]}


def test_a_failing_int8_flow_is_a_row_with_its_error(tmp_model, capsys, monkeypatch):
    import opfuse.bench.int8

    def broken(*args, **kwargs):
        raise BadInputError("the quantiser failed on this model: boom")

    monkeypatch.setattr(opfuse.bench.int8, "quantize", broken)
    rc = main(["bench", str(tmp_model(conv_bn_relu())), "--int8", "--no-measure", "--configs", "conv-bn",
               "--json", "-"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = {r["key"]: r for r in json.loads(captured.out)["rows"]}
    assert "boom" in rows["int8"]["error"] and rows["int8"]["predicted"] == {}
    assert rows["int8"]["int8"]["sqnr_db"] is None
    assert rows["int8-unfolded"]["error"] is None and rows["int8-unfolded"]["predicted"]["npu-chapter"]


def conv_bn_relu_symbolic():
    m = conv_bn_relu()
    for v in (m.graph.input[0], m.graph.output[0]):
        v.type.tensor_type.shape.dim[0].dim_param = "N"
    return m


@pytest.mark.parametrize("args, message", [
    (["bench", "/no/such/model.onnx"], "no such file"),
    (["bench", "--hardware", "npu-nope", "--no-measure"], "unknown hardware profile 'npu-nope'"),
    (["bench", "--configs", "none,conv-relu"], "unknown configuration 'conv-relu'"),
    (["bench", "--model", "alexnet"], "unknown built-in model 'alexnet'"),
    (["bench", "--runtime-levels", "max"], "unknown runtime level 'max'"),
    (["bench", "--threads", "0"], "--threads must be at least 1"),
])
def test_bench_bad_input_exits_2_with_one_line(args, message, capsys):
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_optimize_with_hardware_declines_the_spilling_fusion_end_to_end():
    import opfuse

    r = rng(6)
    c, h, w = 32, 64, 800
    inits = [tensor("W", (r.normal(size=(c, c, 1, 1)) * 0.1).astype(np.float32)),
             tensor("B", r.normal(size=c).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
             helper.make_node("Add", ["c", "z"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    m = model(nodes, [vinfo("x", [1, c, h, w]), vinfo("z", [1, c, h, w])], [vinfo("y", [1, c, h, w])], inits)
    small, report = opfuse.optimize(m, target="onnxruntime", runtime_level="disabled", hardware="npu-small")
    assert [n.op_type for n in small.graph] == ["Conv", "Add", "Relu"]
    assert "npu-small's 512 KiB on-chip buffer; it would spill" in report.reason_for("add")
    assert report.verification.ok
    big, report = opfuse.optimize(m, target="onnxruntime", runtime_level="disabled", hardware="npu-chapter")
    assert [n.op_type for n in big.graph] == ["FusedConv"]


def test_plot_without_matplotlib_fails_before_measuring(tmp_path, monkeypatch, capsys):
    import importlib.util

    import opfuse.bench.run
    from opfuse.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(opfuse.bench.run, "run_bench", lambda *a, **k: pytest.fail("measured anyway"))
    assert main(["bench", "--model", "resnet18", "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "opfuse[plot]" in err[0] and not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_unwritable_destination_fails_before_measuring(flag, tmp_path, monkeypatch, capsys):
    import opfuse.bench.run
    from opfuse.cli import main

    monkeypatch.setattr(opfuse.bench.run, "run_bench", lambda *a, **k: pytest.fail("measured anyway"))
    target = tmp_path / "missing" / ("r.json" if flag == "--json" else "p.png")
    assert main(["bench", "--model", "resnet18", flag, str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0], err


# -- measure: a variant with its own inputs ------------------------------------------------

def _doubler(input_name: str) -> bytes:
    node = helper.make_node("Mul", [input_name, "two"], ["out"])
    return model([node], [vinfo(input_name, [2, 3])], [vinfo("out", [2, 3])],
                 [tensor("two", np.array(2.0, np.float32))]).SerializeToString()


def test_a_variant_runs_on_its_own_feeds_and_is_compared_with_the_baseline():
    from opfuse.bench.measure import Variant, measure

    x = rng(0).normal(size=(2, 3)).astype(np.float32)
    variants = [Variant("a", "a", _doubler("x")),
                Variant("b", "b", _doubler("y"), feeds={"y": x}),  # same values under another name: equal
                Variant("c", "c", _doubler("y"), feeds={"y": x + 1})]  # other values: flagged
    result = measure(variants, {"x": x}, threads=1, warmup=1, rounds=2)
    assert result.errors == {}
    assert set(result.timings) == {"a", "b", "c"} and len(result.timings["b"].samples_ms) == 2
    assert "b" not in result.mismatches
    assert "out" in result.mismatches["c"]


def test_copies_give_each_variant_several_sessions_and_one_time_per_round():
    from opfuse.bench.measure import Variant, measure

    x = rng(0).normal(size=(2, 3)).astype(np.float32)
    variants = [Variant("a", "a", _doubler("x")), Variant("b", "b", _doubler("x")),
                Variant("broken", "broken", b"not a model")]
    result = measure(variants, {"x": x}, threads=1, warmup=1, rounds=3, copies=3)
    assert set(result.timings) == {"a", "b"} and "broken" in result.errors
    assert all(len(result.timings[k].samples_ms) == 3 for k in ("a", "b"))
    assert len(result.paired("b", "a")) == 3 and not result.mismatches
