"""What the rewrites and the measured choice do not spend, with the same result.

- The pattern pass tries a rule only while the model holds the nodes its pattern needs
  (``pattern_gate.usable_rules``): the tanh GELU's rules wait for a Tanh, and come in as soon as
  the model has one.
- The fixpoint of the passes does not run a pass again on a graph it changed nothing in: the
  confirming round runs only the passes that have not seen the graph as it is.
- The timing leaves out a variant the runtime runs as the policy's kernels (``same_as``), and
  the folds alone are built and timed only when the configuration chosen measured slower than the
  input.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir

from decoder_nets import decode_step
from graphs import conv_bn_model
from opfuse.passes.pattern_gate import required_ops, usable_rules
from opfuse.passes.patterns import pattern_rules
from opfuse.pipeline import _Settled, optimize
from opfuse.report import FusionReport
from opfuse.targets.kernels import load_target
from opfuse.tune import timing


def test_a_rule_waits_for_the_ops_its_pattern_needs():
    rules = tuple(r for stage in pattern_rules("gelu", load_target("onnxruntime")).stages for r in stage)
    tanh = {r for r in rules if required_ops(r).get(("", "Tanh"))}
    assert tanh and tanh != set(rules)
    present = collections.Counter({("", op): 9 for op in ("Mul", "Add", "Div", "Erf", "Pow")})
    usable, waiting = usable_rules(rules, present)
    assert not tanh & set(usable) and ("", "Tanh") in waiting and usable
    present[("", "Tanh")] += 1
    usable, _ = usable_rules(rules, present)
    assert tanh <= set(usable)


class _Counting(ir.passes.InPlacePass):
    """Changes the graph on its first ``changes`` runs, then nothing."""

    def __init__(self, changes: int):
        super().__init__()
        self.left, self.runs = changes, 0

    def call(self, model):
        self.runs += 1
        self.left -= 1
        return ir.passes.PassResult(model, modified=self.left >= 0)


def test_a_pass_is_not_run_again_on_a_graph_it_changed_nothing_in():
    first, second = _Counting(1), _Counting(0)
    changes = [0]
    steps = [_Settled(p, None, FusionReport(), changes) for p in (first, second)]
    ir.passes.PassManager(steps, steps=8, early_stop=True)(ir.from_proto(conv_bn_model()))
    # round 1: first changes, second sees that graph and changes nothing; round 2: first changes
    # nothing; second is not run again (nothing changed since it last saw the graph)
    assert first.runs == 2 and second.runs == 1 and changes == [1]


def test_a_variant_the_runtime_runs_as_the_reference_is_not_timed():
    model = ir.from_proto(conv_bn_model())
    variants = [timing.Variant("a", "a", model, level="all", kind="reference"),
                timing.Variant("b", "b", model, level="all"),
                timing.Variant("c", "c", model, level="all")]
    feeds = {"x": np.zeros((1, 4, 7, 7), np.float32)}
    found = timing.measure(variants, feeds, threads=1, rounds=2, warmup=1, same_as="b", copies=2)
    assert found.same == {"c"} and set(found.timings) == {"a", "b"}


def test_the_folds_alone_are_timed_only_when_the_fall_back_needs_them(monkeypatch):
    timed = []

    def fake(cost):
        def measure(variants, feeds, *, threads=1, rounds=None, baseline=None, **_):
            timed.append([v.name for v in variants])
            return timing.Measurement({v.name: timing.Timing([cost(v)] * 9) for v in variants},
                                      baseline, threads, 0, 9, {}, {}, {})
        return measure

    monkeypatch.setattr(timing, "measure", fake(lambda v: 1.0 if v.name.startswith("original") else 0.8))
    optimize(decode_step(), target="onnxruntime", tune=True, verify=False, retune=True)
    assert timed and not any("folds alone" in run for run in timed)
    timed.clear()
    monkeypatch.setattr(timing, "measure", fake(lambda v: 1.0 if v.name.startswith("original") else 1.5))
    _, report = optimize(decode_step(), target="onnxruntime", tune=True, verify=False, retune=True)
    assert "folds alone" in timed[-1] and report.tuning.written.startswith("the input unchanged")
