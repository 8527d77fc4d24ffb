"""A replayed decision explains its refusals per site as the timed run did (issue 49).

The timed run turns each fusion the measured choice declined into one refusal per site: the rewrites
of the configuration with it that the one without it does not make. A replay (``--tuning FILE``, or
the cache) did not time, so it had no rewrites to compare and said nothing per site. The record now
keeps the declined decisions; a replay makes the two configurations' rewrites (untimed) on what the
timed run ran them on, the whole model or its first block, and reports the same refusals."""

from __future__ import annotations

import json

import onnx
import pytest

from decoder_nets import decode_step
from opfuse.core.analysis import op_counts
from opfuse.pipeline import optimize
from opfuse.tune import block, timing
from test_tune_records import _blocks, _clock


def _measured(report) -> list[tuple[str, str, str]]:
    return sorted((r.pattern, r.node, r.reason) for r in report.refusals if r.reason.startswith("measured choice"))


def _no_clock(*a, **k):
    pytest.fail("timed")


@pytest.mark.parametrize("case", ["whole model", "first block"])
def test_replayed_and_cached_runs_name_the_same_sites(tmp_path, monkeypatch, case):
    if case == "whole model":
        src_model, slower = decode_step(), "Split"  # the packed projections measured slower
    else:
        monkeypatch.setattr(block, "SMALL_BYTES", 0)
        src_model, slower = _blocks(), "FusedConv"  # the epilogues measured slower, on blocks.0
    src, report = tmp_path / "in.onnx", tmp_path / "r.json"
    onnx.save(src_model, src)
    monkeypatch.setattr(timing, "measure", _clock(lambda v: 1.2 if slower in str(op_counts(v.model)) else 1.0))
    _, timed = optimize(str(src), target="onnxruntime", tune=True, retune=True, report_path=report)
    assert timed.tuning.timed and (case == "whole model" or timed.tuning.scope.startswith("on blocks.0"))
    sites = _measured(timed)
    assert sites, timed.refusals
    assert json.loads(report.read_text())["tuning"]["record"]["declined"]

    monkeypatch.setattr(timing, "measure", _no_clock)
    _, replayed = optimize(str(src), target="onnxruntime", tune=True, tuning=report)
    assert replayed.tuning.source.startswith("replayed from") and _measured(replayed) == sites
    _, cached = optimize(str(src), target="onnxruntime", tune=True)
    assert cached.tuning.source.startswith("replayed from the cache") and _measured(cached) == sites


def test_a_record_without_declined_decisions_replays_as_before(tmp_path, monkeypatch):
    """A record written before the field (no "declined") still replays: the decision, no sites."""
    src, report, record = tmp_path / "in.onnx", tmp_path / "r.json", tmp_path / "record.json"
    onnx.save(decode_step(), src)
    monkeypatch.setattr(timing, "measure", _clock(lambda v: 1.2 if "Split" in str(op_counts(v.model)) else 1.0))
    optimize(str(src), target="onnxruntime", tune=True, retune=True, report_path=report)
    old = json.loads(report.read_text())["tuning"]["record"]
    del old["declined"]
    record.write_text(json.dumps(old))
    monkeypatch.setattr(timing, "measure", _no_clock)
    written, replayed = optimize(str(src), target="onnxruntime", tune=True, tuning=record)
    assert replayed.verification.ok and _measured(replayed) == []
    assert "Split" not in op_counts(written)
