"""Verification on models shaped like the ones people have (the wheel models of
benchmarks/wild.py): `-1`/'?'/empty dimensions, inputs that do not run at size 1, integer
inputs that pick an If branch, Sigmoid heads, outputs without a shape. And the other
side: deliberately wrong folds (a bias shifted by one channel, a wrong epsilon, a
transposed weight) are still caught, and named at their own tensor.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import opfuse.core.algebra
from graphs import bn_node, bn_params, model, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.errors import BadInputError, VerificationError
from opfuse.core.dims import free_dims, resolve_dims
from opfuse.verify.inputs import find_sizes, integer_cases
from opfuse.load import load_model
from opfuse.pipeline import optimize
from opfuse.verify import _Runner, compare_tensor, verify_models


def _conv(name, x, y, cin, cout, seed, k=3, bias=True):
    r = rng(seed)
    inputs = [x, f"{name}.w"] + ([f"{name}.b"] if bias else [])
    node = helper.make_node("Conv", inputs, [y], name=name, pads=[k // 2] * 4, kernel_shape=[k, k])
    inits = [tensor(f"{name}.w", r.normal(0, 0.3, (cout, cin, k, k)).astype(np.float32))]
    if bias:
        inits.append(tensor(f"{name}.b", r.normal(0, 0.1, cout).astype(np.float32)))
    return node, inits


def conv_bn_chain(x_shape, c=8, sigmoid_bias=None):
    """x -> Conv -> BN -> Relu -> Conv -> BN [-> 1x1 Conv -> Sigmoid]: the PP-OCR shape."""
    n1, i1 = _conv("conv1", "x", "c1", 3, c, 1)
    n2, i2 = _conv("conv2", "r1", "c2", c, c, 2, bias=False)
    nodes = [n1, bn_node("bn1", "c1", "b1"), helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
             n2, bn_node("bn2", "c2", "b2")]
    inits = [*i1, *bn_params("bn1", c, 1), *i2, *bn_params("bn2", c, 2)]
    out = "b2"
    if sigmoid_bias is not None:
        r = rng(3)
        nodes += [helper.make_node("Conv", ["b2", "head.w", "head.b"], ["logits"], name="head"),
                  helper.make_node("Sigmoid", ["logits"], ["y"], name="sigmoid")]
        inits += [tensor("head.w", r.normal(0, 0.02, (1, c, 1, 1)).astype(np.float32)),
                  tensor("head.b", np.array([sigmoid_bias], np.float32))]
        out = "y"
    return model(nodes, [vinfo("x", x_shape)], [vinfo(out, None)], inits)


# -- inputs that run ---------------------------------------------------------------------

def test_minus_one_and_question_mark_dims_are_free_dims_by_position(tmp_model, capsys):
    m = conv_bn_chain([-1, 3, "?", "?"])
    dims = free_dims(ir.serde.deserialize_model(m))
    assert list(dims) == ["x:0", "x:2", "x:3"] and dims["x:0"].batch and not dims["x:2"].batch
    path = tmp_model(m)
    assert main(["optimize", str(path), "-o", str(path.with_name("o.onnx")), "--dim", "x:2=16"]) == 0
    out = capsys.readouterr().out
    assert "verification: passed" in out and "x:2=16" in out


def _reflect_pad_model():
    """Pad(reflect, 4 each side) needs 5 samples: the silero-vad STFT front end."""
    pads = tensor("pads", np.array([0, 0, 0, 4, 0, 0, 0, 4], np.int64))
    n1, i1 = _conv("conv", "p", "c", 1, 4, 0)
    nodes = [helper.make_node("Pad", ["x", "pads"], ["p"], mode="reflect", name="pad"), n1,
             bn_node("bn", "c", "y")]
    return model(nodes, [vinfo("x", [1, 1, "", "samples"])], [vinfo("y", None)], [pads, *i1, *bn_params("bn", 4)])


def test_sizes_grow_until_the_model_runs_and_are_reported():
    m = _reflect_pad_model()
    _, report = optimize(m)
    v = report.verification
    assert v.ok and v.sizes == {"x:2": 8, "samples": 8}
    assert "samples=8" in v.inputs


def test_each_dimension_also_grows_alone():
    """A second input whose free axis must match the batch (an RNN state) stays at 1."""
    irm = ir.serde.deserialize_model(_reflect_pad_model())
    calls = []

    def run(feeds):
        calls.append(feeds["x"].shape)
        if feeds["x"].shape[2] != 1 or feeds["x"].shape[3] < 30:  # axis 2 must stay 1
            raise RuntimeError("does not run")
        return {}

    _, sizes, _ = find_sizes(irm, run)
    assert sizes == {"x:2": 1, "samples": 32}


def test_unknown_dim_is_a_usage_error_that_lists_the_models_dims(tmp_model, capsys):
    path = tmp_model(_reflect_pad_model())
    out = path.with_name("o.onnx")
    assert main(["optimize", str(path), "-o", str(out), "--dim", "heigth=320"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "heigth" in err and "samples" in err and "x:2" in err
    assert not out.exists()
    with pytest.raises(BadInputError):
        resolve_dims(ir.serde.deserialize_model(_reflect_pad_model()), {"x:1": 3})  # a fixed axis


def test_nothing_runs_is_one_line_naming_the_dims_and_onnx_runtime_stays_quiet(tmp_path):
    shape = tensor("shape", np.array([3, 5], np.int64))
    m = model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshape")],
              [vinfo("x", ["n"])], [vinfo("y", [3, 5])], [shape])
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    proc = subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(path), "-o", str(tmp_path / "o.onnx")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # ONNX Runtime's own log lines never get through
    assert "free dimensions: n" in lines[0] and "--dim" in lines[0] and "--inputs" in lines[0]
    assert not (tmp_path / "o.onnx").exists()
    proc = subprocess.run([sys.executable, "-m", "opfuse", "optimize", str(path), "-o", str(tmp_path / "o.onnx"),
                           "--dim", "n=15", "-q"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""


# -- integer inputs and If branches ------------------------------------------------------

def _branchy(wrong_in_branch=False, nested=False):
    """sr == 16000 ? conv+BN (then) : conv (else), like silero-vad's sample-rate If."""
    c = 4
    then_conv, then_inits = _conv("then_conv", "x", "tc", 1, c, 5)
    then_nodes = [then_conv, bn_node("then_bn", "tc", "t_out")]
    if nested:
        inner_conv, inner_inits = _conv("inner_conv", "x", "ic", 1, c, 6)
        inner = helper.make_graph([inner_conv, bn_node("inner_bn", "ic", "i_out")], "inner", [],
                                  [vinfo("i_out", None)], [*inner_inits, *bn_params("inner_bn", c, 6)])
        other = helper.make_graph([helper.make_node("Identity", ["tc"], ["o_out"])], "other", [],
                                  [vinfo("o_out", None)])
        then_nodes = [then_conv, helper.make_node("If", ["flag"], ["t_out"], name="inner_if",
                                                  then_branch=inner, else_branch=other)]
    then_g = helper.make_graph(then_nodes, "then", [], [vinfo("t_out", None)],
                               [*then_inits, *bn_params("then_bn", c, 5)])
    else_conv, else_inits = _conv("else_conv", "x", "e_out", 1, c, 7)
    else_g = helper.make_graph([else_conv], "else", [], [vinfo("e_out", None)], else_inits)
    nodes = [helper.make_node("Reshape", ["sr", "one"], ["sr1"], name="reshape"),
             helper.make_node("Equal", ["sr1", "rate"], ["is16k"], name="eq"),
             helper.make_node("Cast", ["is16k"], ["flag"], to=TensorProto.BOOL, name="flag"),
             helper.make_node("If", ["is16k"], ["y"], name="rate_if", then_branch=then_g, else_branch=else_g)]
    inits = [tensor("one", np.array([1], np.int64)), tensor("rate", np.array([16000], np.int64))]
    return model(nodes, [vinfo("x", ["batch", 1, 8, 8]), vinfo("sr", [], TensorProto.INT64)],
                 [vinfo("y", ["batch", c, 8, 8])], inits)


def test_integer_inputs_take_the_branch_a_comparison_tests_for():
    irm = ir.serde.deserialize_model(_branchy())
    assert integer_cases(irm) == {"sr": [16000]}
    _, report = optimize(_branchy())
    v = report.verification
    assert v.ok and v.input_sets == ["sr=16000"]
    assert [r.graph for r in report.records] == ["main/rate_if/then_branch"]
    assert v.exercised == 1 and v.not_exercised == []


def test_a_rewrite_no_input_reaches_is_reported_not_exercised(capsys):
    _, report = optimize(_branchy(nested=True))
    v = report.verification
    inner = [r for r in report.records if "inner_if" in r.graph]
    assert inner and v.ok
    assert len(v.not_exercised) == len(inner) and "inner_conv" in v.not_exercised[0]
    from opfuse.report import print_report

    print_report(report)
    assert "not exercised" in capsys.readouterr().out


# -- the floor for graph outputs ----------------------------------------------------------

def test_a_sigmoid_head_does_not_fail_on_rounding_but_the_old_rule_would():
    """PP-OCRv4 det's false failure: Sigmoid outputs of scale 1e-4 round in steps of 6e-8."""
    m = conv_bn_chain(["n", 3, "h", "w"], sigmoid_bias=-10.0)
    work, report = optimize(m, dims={"h": 64, "w": 64})
    v = report.verification
    assert v.ok and v.rewrites and all(r.ok for r in v.rewrites)
    out = v.outputs[0]
    assert out.floor > 0 and out.scale < 1e-3
    # the same arrays under a tolerance scaled to the output alone
    original, _ = load_model(m)
    feeds = {"x": rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)}
    ref, got = _Runner(original)(feeds)["y"], _Runner(work)(feeds)["y"]
    if np.abs(ref - got).max() > 0:  # the runtime's rounding shows at this scale
        assert not compare_tensor("y", ref, got).ok
        assert compare_tensor("y", ref, got, floor=out.floor).ok


# -- deliberately wrong folds are caught ---------------------------------------------------

def _tamper(work: ir.Model, name: str, change) -> ir.Model:
    bad = work.clone()
    value = bad.graph.initializers[name]
    value.const_value = ir.tensor(change(value.const_value.numpy().copy()), name=name)
    return bad


WRONG_FOLDS = {
    "bias shifted by one channel": lambda a: np.roll(a, 1) if a.ndim == 1 else a,
    "transposed weight": lambda a: a.transpose(0, 1, 3, 2) if a.ndim == 4 else a,
}


def _folded_bias(report, conv):
    return next(r for r in report.records if r.node == conv)


@pytest.mark.parametrize("how", sorted(WRONG_FOLDS))
@pytest.mark.parametrize("shape", ["minus-one", "sigmoid-head"])
def test_wrong_folds_are_caught_and_named_at_their_own_tensor(how, shape):
    m = conv_bn_chain([-1, 3, "?", "?"]) if shape == "minus-one" else conv_bn_chain(
        ["n", 3, "h", "w"], sigmoid_bias=-10.0)
    dims = {} if shape == "minus-one" else {"h": 16, "w": 16}
    work, report = optimize(m, verify=False)
    conv = next(n for n in work.graph if n.name == "conv1")
    name = conv.inputs[2 if how.startswith("bias") else 1].name
    bad = _tamper(work, name, WRONG_FOLDS[how])
    original, _ = load_model(m)
    v = verify_models(original, bad, dims=dims, records=report.records)
    assert not v.ok
    first = v.first_failure()
    assert first.rewrite == "Conv+BatchNormalization at 'conv1'", first
    assert first.name == _folded_bias(report, "conv1").output


def test_a_wrong_epsilon_is_caught(monkeypatch):
    real = opfuse.core.algebra.batchnorm_affine

    def wrong_eps(gamma, beta, mean, var, eps):
        return real(gamma, beta, mean, var, eps + 1e-2)

    monkeypatch.setattr(opfuse.core.algebra, "batchnorm_affine", wrong_eps)
    m = conv_bn_chain(["n", 3, "h", "w"], sigmoid_bias=-10.0)
    for init in m.graph.initializer:  # small variances, where epsilon matters
        if init.name.endswith(".var"):
            init.CopyFrom(tensor(init.name, np.full(init.dims, 0.05, np.float32)))
    with pytest.raises(VerificationError, match="rewrite Conv\\+BatchNormalization at 'conv1'"):
        optimize(m, dims={"h": 16, "w": 16})


def test_a_wrong_fold_inside_the_branch_an_integer_selects_is_caught(monkeypatch):
    real = opfuse.core.algebra.batchnorm_affine
    monkeypatch.setattr(opfuse.core.algebra, "batchnorm_affine",
                        lambda g, b, m, v, eps: (lambda s, t: (s, t + 1.0))(*real(g, b, m, v, eps)))
    with pytest.raises(VerificationError, match=r"output 'y' \[sr=16000\]"):
        optimize(_branchy())


# -- outputs without a shape or a type ---------------------------------------------------------

@pytest.mark.parametrize("missing", ["shape", "type"])
def test_an_output_without_shape_or_type_is_completed_with_a_note(missing, tmp_path, capsys):
    n1, i1 = _conv("conv", "x", "c", 3, 4, 0)
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    if missing == "type":
        out = onnx.ValueInfoProto(name="y")
    graph = helper.make_graph([n1, bn_node("bn", "c", "y")], "g", [vinfo("x", [1, 3, 8, 8])], [out],
                              [*i1, *bn_params("bn", 4)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(m)
    path, written = tmp_path / "m.onnx", tmp_path / "o.onnx"
    onnx.save(m, path)
    assert main(["optimize", str(path), "-o", str(written), "--report", str(tmp_path / "r.json")]) == 0
    assert "were inferred" in capsys.readouterr().out
    onnx.checker.check_model(onnx.load(written))  # what opfuse writes, any tool opens
    notes = json.loads((tmp_path / "r.json").read_text())["notes"]
    assert sum("were inferred" in n for n in notes) == 1


def test_a_rewrite_summing_many_products_gets_a_rounding_floor_that_still_catches_wrong_folds():
    """ResNet-50's last 3x3 convs sum K = 4608 products: folded and original round apart by
    about eps * sqrt(K) of the scale, over atol; the floor grows with sqrt(K) only, so a
    bias off by 1% of the scale still fails."""
    from opfuse.verify import _sum_floor

    r = rng(11)
    ref = r.normal(0, 2, (1, 512, 7, 7)).astype(np.float32)
    scale = float(np.abs(ref).max())
    rounding = ref + (1.04e-5 * scale * np.sign(r.normal(size=ref.shape))).astype(np.float32)
    wrong = ref + np.float32(0.01 * scale)
    floor = _sum_floor(ref, 4608)
    assert 6e-5 * scale < floor < 7e-5 * scale
    assert not compare_tensor("y", ref, rounding).ok  # atol alone: the false failure of ResNet-50
    assert compare_tensor("y", ref, rounding, floor=floor).ok
    assert not compare_tensor("y", ref, wrong, floor=floor).ok
    assert _sum_floor(ref, None) == 0.0 == _sum_floor(ref, 0)


def cancelling_conv_bn() -> onnx.ModelProto:
    """Conv with a bias of 1000 per channel, then BatchNormalization whose mean is that
    1000 (statistics from data) and whose variance is 1e-4: the original rounds at 1000 and
    scales the rounding by 100, so it and the fold differ by ~1e-4 of the output's scale,
    over the modelled floor; ONNX Runtime's own Conv+BN fusion differs as much."""
    r = rng(3)
    c = 8
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             bn_node("bn", "c", "t"), helper.make_node("Relu", ["t"], ["y"], name="relu")]
    inits = [tensor("w", r.normal(0, 0.3, (c, 3, 3, 3)).astype(np.float32)),
             tensor("b", np.full(c, 1000.0, np.float32)),
             tensor("bn.scale", np.ones(c, np.float32)), tensor("bn.B", np.zeros(c, np.float32)),
             tensor("bn.mean", (1000.0 + r.normal(0, 0.01, c)).astype(np.float32)),
             tensor("bn.var", np.full(c, 1e-4, np.float32))]
    return model(nodes, [vinfo("x", [1, 3, 16, 16])], [vinfo("y", [1, c, 16, 16])], inits)


def test_the_runtime_s_own_rounding_is_measured_only_when_the_modelled_floor_fails(monkeypatch):
    import opfuse.verify

    calls = []
    real = opfuse.verify.runtime_rounding
    monkeypatch.setattr(opfuse.verify, "runtime_rounding", lambda *a: calls.append(a[2]) or real(*a))
    optimize(conv_bn_chain([1, 3, 16, 16]))  # ordinary statistics: no EXTENDED session
    assert calls == []

    m = cancelling_conv_bn()
    work, report = optimize(m)  # passes, on the measured floor
    assert calls and report.verification.ok
    check = next(c for c in report.verification.rewrites if c.rewrite)
    assert check.floor > opfuse.verify._sum_floor(np.ones(1) * check.scale, 27)

    conv = next(n for n in work.graph if n.op_type == "Conv")
    bad = _tamper(work, conv.inputs[2].name, lambda a: np.roll(a, 1))  # still caught
    original, _ = load_model(m)
    assert not verify_models(original, bad, records=report.records).ok


def test_a_wrong_model_beside_a_weight_held_as_its_magnitude_is_blamed_not_called_nondeterministic():
    """A tied head's Transpose of a weight is a floor source no input reaches: the reference keeps only its
    magnitude (a 0-d array, ScaledOnce). When a check fails, the original's rerun is compared with the first
    run; that tensor is compared between the reruns alone, so the failure stays the rewrite's."""
    def tied(scale: float):
        w = rng(2).standard_normal((50, 16)).astype(np.float32) * np.float32(scale)
        nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Wt"], ["y"])]
        return load_model(model(nodes, [vinfo("x", ["batch", 16])], [vinfo("y", ["batch", 50])], [tensor("W", w)]))[0]

    result = verify_models(tied(1.0), tied(1.01))
    assert not result.ok and not result.unverified, result.unverified
    assert result.first_failure().name == "y"
