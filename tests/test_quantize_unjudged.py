"""When the held-out SQNR cannot judge a quantisation: the float outputs below one int8 step of
the output (a probability map in its Sigmoid's saturated tail; an output under its own
``DequantizeLinear``'s step). The quantisation is then written with a note saying so, where
the 3 dB floor would have refused it as "no approximation of the float model"; ``--min-sqnr``
still refuses it, with the same reason. The oracles are numpy's sigmoid and the models' own
scales, not opfuse's code."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import opfuse
from graphs import model, rng, tensor, vinfo
from opfuse.cli import main
from opfuse.quantization.qdq.sqnr import below_output_step


def tail_net() -> onnx.ModelProto:
    """y = sigmoid(20 * sum_c x_c - 100): on N(0, 1) inputs the logits sit near -100, y near 1e-9."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["z"], name="conv"),
             helper.make_node("Sigmoid", ["z"], ["y"], name="sigmoid")]
    return model(nodes, [vinfo("x", [1, 3, 8, 8])], [vinfo("y", [1, 1, 8, 8])],
                 [tensor("w", np.full((1, 3, 1, 1), 20, np.float32)), tensor("b", np.array([-100], np.float32))])


def samples(count=8):
    return [{"x": rng(i).normal(0, 1, (1, 3, 8, 8)).astype(np.float32)} for i in range(count)]


def test_outputs_in_a_sigmoid_tail_are_written_with_a_note_not_refused():
    data = samples()
    held = data[-2:]  # the last quarter is held out
    logits = [20 * s["x"].sum(axis=1) - 100 for s in held]
    rms = np.sqrt(np.mean(np.concatenate([1 / (1 + np.exp(-z.ravel().astype(np.float64))) for z in logits]) ** 2))
    assert rms < 1 / 256  # the premise, from numpy
    _, report = opfuse.quantize(tail_net(), data, reconstruct=False)
    v = report.verification
    assert v.sqnr_db < 3 and v.ok and v.floor_sqnr_db is None and "below one int8 step" in v.unjudged
    assert report.to_dict()["verification"]["unjudged"] == v.unjudged
    note = next(n for n in report.notes if "is not judged" in n)
    assert "below one int8 step of the output" in note and "y: RMS" in note and "real samples" in note


def test_min_sqnr_still_refuses_and_says_the_sqnr_cannot_judge(tmp_path, capsys):
    src, calib = tmp_path / "m.onnx", tmp_path / "c.npz"
    onnx.save(tail_net(), src)
    np.savez(calib, x=np.stack([s["x"] for s in samples()]))
    rc = main(["quantize", "--reconstruct", "off", str(src), "-o", str(tmp_path / "q.onnx"), "--calibration",
               str(calib), "--min-sqnr", "10"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 1 and not (tmp_path / "q.onnx").exists()
    assert "below --min-sqnr 10" in last and "cannot judge the quantisation" in last


def _scaled(scale_of_output: float):
    """float: y = 1e-4 * x; QDQ: the same with y quantised at ``scale_of_output``."""
    k = tensor("k", np.array(1e-4, np.float32))
    f = model([helper.make_node("Mul", ["x", "k"], ["y"])], [vinfo("x", [1, 4])], [vinfo("y", [1, 4])], [k])
    q = model([helper.make_node("Mul", ["x", "k"], ["t"]),
               helper.make_node("QuantizeLinear", ["t", "s", "zp"], ["t_q"]),
               helper.make_node("DequantizeLinear", ["t_q", "s", "zp"], ["y"])],
              [vinfo("x", [1, 4])], [vinfo("y", [1, 4])],
              [k, tensor("s", np.array(scale_of_output, np.float32)),
               helper.make_tensor("zp", TensorProto.INT8, [], [0])])
    return f, q


@pytest.mark.parametrize("scale, judged", [(1e-2, False), (1e-7, True)])
def test_an_output_under_its_own_step_is_not_judged(scale, judged):
    f, q = _scaled(scale)
    held = [{"x": rng(3).normal(0, 1, (1, 4)).astype(np.float32)}]  # y about 1e-4: under 1e-2, over 1e-7
    said = below_output_step(f, q, held)
    assert (said is None) == judged
    if not judged:
        assert "y: RMS" in said and "step of 0.01" in said


def test_the_cli_writes_it_and_says_not_judged_in_its_verdict(tmp_path, capsys):
    src, calib, out = tmp_path / "m.onnx", tmp_path / "c.npz", tmp_path / "q.onnx"
    onnx.save(tail_net(), src)
    np.savez(calib, x=np.stack([s["x"] for s in samples()]))
    rc = main(["quantize", "--reconstruct", "off", str(src), "-o", str(out), "--calibration", str(calib)])
    printed = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and out.exists()
    assert "verification: not judged" in printed and "is not judged: the float model's outputs" in printed
