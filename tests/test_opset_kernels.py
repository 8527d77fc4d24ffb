"""A configuration's opset raise that ONNX Runtime could not run is not made (issue 49: a Piper VITS
voice, ``en_US-joe-medium``, at ``--target onnxruntime``).

The voice draws its noise with RandomNormalLike at opset 15; ONNX Runtime's CPU kernel of it is
registered for version 1 only, and it matches a kernel registered "from V on" to version V alone, so
at opset 22 and later the op has no kernel ("Could not find an implementation for
RandomNormalLike(22)"). The onnxruntime target's policy for a decode step, and the timing's
Attention-23 variant, raise the opset to 23. Built here: an attention decode step with a noise
output (RandomNormalLike), at opset 15. Also: the timing compares variants whose random nodes draw
from seeds of their names, as verification does, so that no variant "computes something else"
because of its draw."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper

from decoder_nets import decode_step
from graphs import model, ops, tensor, vinfo
from opfuse.pipeline import optimize
from opfuse.prepare.opset import kernels_lost
from opfuse.tune import timing
from test_tune_records import _clock


def noisy_step(opset: int = 15) -> onnx.ModelProto:
    """:func:`decode_step` whose output gets noise: y + RandomNormalLike(y) * 0.1."""
    m = decode_step()
    g = m.graph
    g.node.extend([helper.make_node("RandomNormalLike", ["y"], ["noise"], name="noise"),
                   helper.make_node("Mul", ["noise", "tenth"], ["scaled"], name="noise_scale"),
                   helper.make_node("Add", ["y", "scaled"], ["y_noisy"], name="add_noise")])
    g.initializer.append(tensor("tenth", np.array(0.1, np.float32)))
    present = g.output[1]
    del g.output[:]
    g.output.extend([vinfo("y_noisy", ["batch", 1, 8]), present])
    m.opset_import[0].version = opset
    onnx.checker.check_model(m)
    return m


def test_the_ops_that_would_lose_their_kernel():
    m = ir.from_proto(noisy_step())
    assert kernels_lost(m, 23) == ["RandomNormalLike (version 22)"]
    assert kernels_lost(m, 21) == []  # (RandomNormalLike's version at 21 is still 1)
    relu = ir.from_proto(model([helper.make_node("Relu", ["x"], ["y"])], [vinfo("x", [2])], [vinfo("y", [2])]))
    assert kernels_lost(relu, 23) == []


def test_untimed_the_policy_leaves_the_opset_and_the_run_succeeds(tmp_path):
    out = tmp_path / "out.onnx"
    written, report = optimize(noisy_step(), target="onnxruntime", tune=False, output=out)
    assert report.verification.ok and out.exists()
    assert onnx.load(out).opset_import[0].version == 15
    assert any("opset not raised to 23" in n and "RandomNormalLike (version 22)" in n for n in report.notes)
    assert not any("opset raised to 23" in n for n in report.notes), report.notes
    assert "RandomNormalLike" in ops(written)


def test_timed_no_variant_differs_by_its_draw(tmp_path, monkeypatch):
    real = timing.measure
    clock = _clock()
    compared = {}

    def measure(variants, feeds, **kw):  # the real comparison of outputs, the test's clock for the times
        found = real(variants, feeds, **{**kw, "rounds": 1, "warmup": 1})
        compared.update(found.mismatches)
        timed = clock(variants, feeds, **kw)
        timed.mismatches.update(found.mismatches)
        return timed

    monkeypatch.setattr(timing, "measure", measure)
    out = tmp_path / "out.onnx"
    written, report = optimize(noisy_step(), target="onnxruntime", tune=True, output=out)
    assert report.tuning.timed and report.verification.ok and out.exists()
    assert compared == {}, compared
    assert onnx.load(out).opset_import[0].version == 15
