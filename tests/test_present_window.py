"""A sliding-window cache's present Slices after Attention-23 go under an If
(:mod:`opfuse.passes.patterns.present_window`): the copy is skipped while the cache fits the window,
and the graph's own Slices run where it does not. Decode blocks exported by torch (both exporters) with
a small window (8: the past's last 7 positions, the presents' last 7), so both branches run: past 3
and 6 fit (the present is at most 7 long), past 7 is cut by one. The numbers are ONNX Runtime's for the
export and for the rewrite, presents included; QNN's form writes no If (its HTP runs no control
flow); a window the key and the value do not share is refused with the reason."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

import opfuse
from graphs import assert_outputs_close, ops, ort_run
from test_gqa import _attention, _export_block, _inputs

WINDOW = 8  # the export keeps the last WINDOW - 1 positions of the past and of the present


def _ifs(out) -> list:
    return [n for n in out.graph if n.op_type == "If"]


def _assert_equal_on_both_branches(original, out):
    for past, masked_out in ((3, 0), (6, 1), (WINDOW - 1, 0), (WINDOW - 1, 2)):
        inputs = _inputs(2, past, masked_out, seed=past, rotary=True)
        expected, got = ort_run(original, inputs), ort_run(out, inputs)
        assert expected["present_key"].shape[2] == min(past + 1, WINDOW - 1)
        assert_outputs_close(expected, got, 1e-5, 1e-5)


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_the_present_windows_go_under_an_if_that_skips_them_while_the_cache_fits(tmp_path, dynamo, target):
    path = _export_block(tmp_path, 2, rotary=True, window=WINDOW, dynamo=dynamo,
                         present_windows=(WINDOW - 1, WINDOW - 1))
    original = onnx.load(path)
    assert sum(n.op_type == "Slice" for n in original.graph.node) >= 4  # (the past's two, the presents' two)
    out, report = opfuse.optimize(path, target=target, opset=23, runtime_level="disabled", tune=False)
    assert report.verification.ok
    (branching,) = _ifs(out)
    assert [v.name for v in branching.outputs[1:]] == ["present_key", "present_value"]
    then_branch, else_branch = (branching.attributes[k].value for k in ("then_branch", "else_branch"))
    assert [n.op_type for n in then_branch] == ["Attention"], ops(out)
    assert [n.op_type for n in else_branch] == ["Attention", "Slice", "Slice"]
    assert not _attention(out), "the attention node lives in the branches only"
    readers = [n.op_type for n in out.graph for v in n.inputs if v is not None and v.name in ("past_key", "past_value")]
    assert "Concat" not in readers and "Slice" not in readers, ops(out)  # (kv_cache's rule: the past whole)
    assert [o.name for o in out.graph.outputs] == [o.name for o in original.graph.output]
    assert any(r.pattern == "attention->If(Attention)" for r in report.records), [r.pattern for r in report.records]
    _assert_equal_on_both_branches(original, out)


@pytest.mark.parametrize("target, ifs", [("qnn", 0), ("onnx", 1)])
def test_qnn_s_form_of_the_rules_writes_no_if(tmp_path, target, ifs):
    """QNN's HTP runs no control flow: its form of the attention rules has no If stage. The pattern pass
    alone, on the export at opset 23 with its dims still symbolic (the QNN pipeline binds them first,
    and a static cache length leaves no Slice to put under an If), against the standard form's."""
    from onnx import version_converter

    from opfuse.passes.fuse_patterns import PatternFusionPass

    path = _export_block(tmp_path, 2, rotary=True, window=WINDOW, present_windows=(WINDOW - 1, WINDOW - 1))
    model = ir.from_proto(version_converter.convert_version(onnx.load(path), 23))
    PatternFusionPass(target=target)(model)
    assert sum(n.op_type == "If" for n in model.graph) == ifs, ops(model)
    assert _attention(model), "the KV cache went into Attention-23 on both forms"


@pytest.mark.parametrize("past", [3, WINDOW - 1])
def test_qnn_writes_the_presents_the_export_does(tmp_path, past):
    """QNN's graphs are static (``--dim``): at a length that fits and one that is cut, no If, equal."""
    path = _export_block(tmp_path, 2, rotary=True, window=WINDOW, present_windows=(WINDOW - 1, WINDOW - 1))
    out, report = opfuse.optimize(path, target="qnn", opset=23, runtime_level="disabled", tune=False,
                                  dims={"batch": 2, "past": past})
    assert report.verification.ok
    assert not _ifs(out), ops(out)
    inputs = _inputs(2, past, 1, seed=past, rotary=True)
    assert_outputs_close(ort_run(onnx.load(path), inputs), ort_run(out, inputs), 1e-5, 1e-5)


def test_windows_the_key_and_the_value_do_not_share_are_refused_with_the_reason(tmp_path):
    path = _export_block(tmp_path, 2, rotary=True, window=WINDOW, present_windows=(WINDOW - 1, WINDOW - 2))
    out, report = opfuse.optimize(path, target="onnx", opset=23, runtime_level="disabled", tune=False)
    assert report.verification.ok
    assert not _ifs(out), ops(out)
    assert len(_attention(out)) == 1
    reasons = [r.reason for r in report.refusals]
    assert any(f"the key's window ({WINDOW - 1}) is not the value's ({WINDOW - 2})" in r for r in reasons), reasons
    inputs = _inputs(2, 5, 0, seed=5, rotary=True)
    assert_outputs_close(ort_run(onnx.load(path), inputs), ort_run(out, inputs), 1e-5, 1e-5)



def test_the_written_model_optimised_again_keeps_its_one_if(tmp_path):
    """Run on its own output: the then-branch's presents are no Slice's, the else-branch is the graph's
    own nodes (no rule matches there, and no refusal is logged for it): one If, no If inside it."""
    path = _export_block(tmp_path, 2, rotary=True, window=WINDOW, present_windows=(WINDOW - 1, WINDOW - 1))
    once, _ = opfuse.optimize(path, target="onnx", opset=23, runtime_level="disabled", tune=False)
    twice, report = opfuse.optimize(once, target="onnx", opset=23, runtime_level="disabled", tune=False)
    assert report.verification.ok
    (branching,) = _ifs(twice)
    branches = [branching.attributes[k].value for k in ("then_branch", "else_branch")]
    assert [[n.op_type for n in b] for b in branches] == [["Attention"], ["Attention", "Slice", "Slice"]]
    assert not [r for r in report.refusals if "If" in r.reason or "branch" in r.reason], report.refusals
    _assert_equal_on_both_branches(onnx.load(path), twice)
