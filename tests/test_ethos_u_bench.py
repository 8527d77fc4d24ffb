"""``opfuse bench --hardware ethos-u55-128``: the ablation compiled by Arm's Vela, beside the cost model.

A tiny residual conv net built here (Conv -> BN -> Relu -> Conv -> BN -> Add -> Relu -> pool -> Gemm)
goes through the whole Ethos-U ablation (quantise, lower, Vela); the BatchNormalization
decomposition is checked against ONNX Runtime; the roofline fit against times generated from
known rates; the shipped Ethos-U profiles are parsed.
"""

from __future__ import annotations

import io

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper
from rich.console import Console

import extras
from graphs import bn_node, bn_params, model, ort_run, rng, tensor, vinfo
from opfuse.bench.ethos_u import ETHOS_CONFIGS, decompose_batchnorm, merge_activations, predicted_kernels
from opfuse.bench.options import BenchOptions
from opfuse.cost.fit import OpSample, fit_roofline
from opfuse.cost.profiles import list_profiles, load_profile

ETHOS_PROFILES = ("ethos-u55-128", "ethos-u65-256", "ethos-u85-256")


def residual_net(size: int = 16, c: int = 8):
    r = rng(3)
    inits = [
        tensor("w1", r.normal(0, 0.3, (c, 3, 3, 3)).astype(np.float32)),
        tensor("w2", r.normal(0, 0.3, (c, c, 3, 3)).astype(np.float32)),
        tensor("w0", r.normal(0, 0.3, (c, 3, 1, 1)).astype(np.float32)),
        tensor("fc", r.normal(0, 0.3, (10, c)).astype(np.float32)),
        tensor("fcb", r.normal(0, 0.1, (10,)).astype(np.float32)),
        *bn_params("bn1", c, 1), *bn_params("bn2", c, 2),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        bn_node("bn1", "c1", "b1"),
        helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        bn_node("bn2", "c2", "b2"),
        helper.make_node("Conv", ["x", "w0"], ["skip"], name="conv0"),
        helper.make_node("Add", ["b2", "skip"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="pool"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["y"], name="fc", transB=1),
    ]
    return model(nodes, [vinfo("x", [1, 3, size, size])], [vinfo("y", [1, 10])], inits, opset=13)


def test_batchnorm_decomposed_into_mul_add_computes_the_same():
    m = residual_net()
    d = decompose_batchnorm(m)
    assert [n.op_type for n in d.graph.node].count("BatchNormalization") == 0
    assert [n.op_type for n in d.graph.node].count("Mul") == 2
    x = rng(5).normal(0, 1, (1, 3, 16, 16)).astype(np.float32)
    np.testing.assert_allclose(ort_run(d, {"x": x})["y"], ort_run(m, {"x": x})["y"], rtol=1e-4, atol=1e-5)


def test_activation_merges_into_the_op_before_it_only_when_fusing():
    from opfuse.bench.ethos_u import config_float_model, quantize_for_ethos_u
    from opfuse.load import load_model
    from opfuse.verify import make_inputs

    ir_model, _ = load_model(residual_net())
    calib = [make_inputs(ir_model, seed=i) for i in range(2)]
    qdq = quantize_for_ethos_u(config_float_model(ir_model, "conv-bn-act"), calib)
    unfused = predicted_kernels(qdq, None)
    fused = predicted_kernels(qdq, [])  # the lowering refused none
    assert [k.op for k in unfused].count("Relu") == 2
    assert [k.op for k in fused].count("Relu") == 0
    assert sorted(k.label for k in fused if k.epilogue) == ["Add+Relu", "Conv+Relu"]
    relus = [k.name for k in unfused if k.op == "Relu"]
    one_kept = predicted_kernels(qdq, relus[:1])  # the lowering kept the first Relu as its own op
    assert [k.op for k in one_kept].count("Relu") == 1
    assert len(merge_activations(unfused, ())) == len(unfused)


def test_roofline_fit_recovers_the_rates_the_times_were_made_with():
    peak, bandwidth, launch = 2e11, 4e9, 3e-6
    r = rng(7)
    samples = []
    for i in range(60):
        ops, nbytes = float(r.uniform(1e4, 1e8)), float(r.uniform(1e3, 2e6))
        samples.append(OpSample(f"op{i}", "Conv2D", max(ops / peak, nbytes / bandwidth) + launch, ops, nbytes))
    fit = fit_roofline(samples)
    assert fit.peak_ops_per_s == pytest.approx(peak, rel=0.05)
    assert fit.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=0.05)
    assert fit.launch_s == pytest.approx(launch, rel=0.2, abs=5e-7)
    assert abs(fit.total_error) < 0.02


@pytest.mark.parametrize("name", ETHOS_PROFILES)
def test_ethos_u_profiles_parse_and_name_their_npu(name):
    assert name in list_profiles()
    prof = load_profile(name)
    assert prof.compiler == "vela"
    assert prof.vela["npu"] == name
    assert prof.execution_dtype == "int8"
    assert prof.peak("int8") > 0 and prof.bandwidth > 0
    assert prof.calibration.get("fit_command")


@extras.needs("ethosu.vela")
def test_ablation_on_ethos_u55_has_five_rows_with_vela_figures_and_the_model_error(tmp_path):
    import onnx

    from opfuse.bench.run import run_bench
    from opfuse.bench.table import vela_table

    path = tmp_path / "net.onnx"
    onnx.save(residual_net(), path)
    options = BenchOptions(model_path=str(path), builtin=None, runtime_levels=(), hardware=("ethos-u55-128",),
                           measure=False, int8=False, profile_ops=False)
    result = run_bench(options)
    rows = [r for r in result.vela_rows if r.profile == "ethos-u55-128"]
    assert [r.config for r in rows] == list(ETHOS_CONFIGS)
    for r in rows:
        assert r.error is None, r.error
        assert r.cycles > 0 and r.time_s > 0 and r.offchip_bytes > 0
        assert r.predicted_s > 0
        assert r.model_error == pytest.approx((r.predicted_s - r.time_s) / r.time_s)
    by = {r.config: r for r in rows}
    # folding BN removes two MULs and two ADDs (Vela runs a RELU after an op in that op's epilogue
    # itself where it can, so fusing it first may change nothing: not asserted)
    assert by["conv-bn"].npu_ops == by["none"].npu_ops - 4
    assert by["conv-bn"].cycles < by["none"].cycles
    assert by["conv-bn-act"].cycles <= by["conv-bn"].cycles
    out = io.StringIO()
    Console(file=out, width=200).print(vela_table(result, "ethos-u55-128"))
    text = out.getvalue()
    for label in ("none", "Conv+BN", "Conv+ReLU", "Conv+BN+ReLU", "everything"):
        assert label in text
    assert "%" in text  # the model's error column


@extras.needs("ethosu.vela")
def test_the_hardware_veto_of_an_ethos_u_profile_asks_vela():
    from opfuse.load import load_model
    from opfuse.pipeline import hardware_veto, optimize

    m = residual_net()
    folded, _ = optimize(m, passes=("fold-batchnorm",), target="onnx", verify=False)
    ir.passes.common.ShapeInferencePass()(folded)
    nodes = {n.name: n for n in folded.graph}
    conv = next(n for n in folded.graph if n.op_type == "Conv" and n.outputs[0].uses()
                and next(iter(n.outputs[0].uses())).node.op_type == "Relu")
    relu = next(iter(conv.outputs[0].uses())).node
    veto = hardware_veto("ethos-u55-128")
    assert veto(conv, [relu]) is None  # Vela runs the RELU in the conv's epilogue either way
    (verdict,) = veto.verdicts.values()
    assert verdict.fused_cycles > 0 and verdict.unfused_cycles > 0, verdict.note
    assert verdict.fused_cycles <= verdict.unfused_cycles
    # and through the optimiser: every fusion Vela does not object to is made
    fused, report = optimize(load_model(m)[0], target="onnxruntime", hardware="ethos-u55-128", verify=False)
    assert not [r for r in report.refusals if "Vela" in r.reason]
    assert any(n.op_type == "FusedConv" for n in fused.graph)
    assert nodes  # the folded graph had its nodes named
