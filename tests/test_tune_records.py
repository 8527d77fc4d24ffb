"""The measured choice at scale and as data: blocks, records, replay, and failures that never fail the run.

- What is timed (opfuse.tune.block): a repeated block is found from dynamo's name scopes and from
  TorchScript-style node names; a large model is timed on the prefix through its first block (every
  variant timed is that prefix, not the whole model); a large model without a block is not timed.
- Records (opfuse.tune.record): a timed run's record replays (``--tuning``) to the same bytes without
  timing; a second run replays the cache; ``--retune`` times again; a record of another graph is a
  usage error (exit 2, one line).
- Failures: a variant whose rewrites raise is dropped with its reason and the others go on; a timing
  that raises leaves the target's policy, and the run succeeds.
- The default path (no flag) with a deterministic clock, through the CLI.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from decoder_nets import decode_step
from graphs import bn_params, model, rng, tensor, vinfo
from opfuse import pipeline
from opfuse.cli import main
from opfuse.core.analysis import op_counts
from opfuse.pipeline import optimize
from opfuse.tune import block, timing
from opfuse.tune.block import cut_lookups, find_block, prefix_model


def _clock(cost=None):
    """A deterministic timer (each variant's time is ``cost(variant)``, by default its node count,
    times a drift shared by the round) that records every variant's node count."""
    seen: list[tuple[str, int]] = []

    def nodes(v):
        m = v.model if isinstance(v.model, ir.Model) else ir.from_proto(onnx.load_from_string(v.model))
        return sum(op_counts(m).values())

    def measure(variants, feeds, *, threads=1, rounds=None, baseline=None, **_):
        drift = [1.0, 1.3, 0.9, 1.1, 1.0, 1.2, 0.95, 1.05, 1.0, 1.15, 0.9]
        seen.extend((v.name, nodes(v)) for v in variants)
        timings = {v.name: timing.Timing([(cost or nodes)(v) * d for d in drift]) for v in variants}
        return timing.Measurement(timings, baseline, threads, 0, len(drift), {}, {}, {})

    measure.seen = seen
    return measure


def _blocks(n: int = 4, c: int = 4, named: bool = True) -> onnx.ModelProto:
    """A chain of ``n`` Conv-BatchNormalization-Relu blocks named ``blocks.i.conv`` (as torch names a
    ModuleList's children), after a stem ``stem.conv``."""
    nodes, inits, x = [], [], "x"
    for i, prefix in enumerate(["stem"] + [f"blocks.{j}" for j in range(n)]):
        w = rng(i).normal(0, 0.3, (c, c, 3, 3)).astype(np.float32)
        inits += [tensor(f"w{i}", w)] + bn_params(f"bn{i}", c, i)
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1],
                                   name=f"{prefix}.conv" if named else ""),
                  helper.make_node("BatchNormalization", [f"c{i}", f"bn{i}.scale", f"bn{i}.B", f"bn{i}.mean",
                                                          f"bn{i}.var"], [f"b{i}"], name=f"{prefix}.bn" if named else ""),
                  helper.make_node("Relu", [f"b{i}"], [f"r{i}"], name=f"{prefix}.relu" if named else "")]
        x = f"r{i}"
    return model(nodes, [vinfo("x", [1, c, 8, 8])], [vinfo(x, [1, c, 8, 8])], inits)


def test_a_block_is_found_from_names_and_from_dynamos_scopes():
    found = find_block(ir.from_proto(_blocks()))
    assert (found.container, found.index, found.copies) == ("blocks", "0", 4)
    scoped = ir.from_proto(_blocks(named=False))
    for i, node in enumerate(scoped.graph):
        layer = max(i // 3 - 1, -1)
        scopes = ["", "model", "model.layers." + str(layer) if layer >= 0 else "model.stem", node.op_type.lower()]
        node.metadata_props["pkg.torch.onnx.name_scopes"] = repr(scopes)
    found = find_block(scoped)
    assert (found.container, found.index, found.copies) == ("model.layers", "0", 4)
    assert find_block(ir.from_proto(_blocks(named=False))) is None


def test_the_prefix_is_what_computes_the_first_block():
    whole = ir.from_proto(_blocks())
    prefix = prefix_model(whole, find_block(whole))
    assert [n.name for n in prefix.graph] == ["stem.conv", "stem.bn", "stem.relu",
                                              "blocks.0.conv", "blocks.0.bn", "blocks.0.relu"]
    assert [v.name for v in prefix.graph.outputs] == ["r1"] and [v.name for v in prefix.graph.inputs] == ["x"]


def test_a_large_lookup_table_is_fed_as_an_input():
    table = rng(1).standard_normal((1000, 300)).astype(np.float32)  # 1.2 MB
    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
             helper.make_node("Relu", ["emb"], ["y"], name="relu")]
    m = ir.from_proto(model(nodes, [vinfo("ids", [1, 5], TensorProto.INT64)], [vinfo("y", [1, 5, 300])],
                            [tensor("table", table)]))
    m.graph.node(0).outputs[0].shape = ir.Shape([1, 5, 300])
    m.graph.node(0).outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    lookups = cut_lookups(m)
    assert [n.op_type for n in m.graph] == ["Relu"] and not m.graph.initializers
    ids = np.array([[3, 1, 4, 1, 5]])
    np.testing.assert_array_equal(lookups[0].feed({"ids": ids}), table[ids])


def test_a_lookup_whose_output_declares_no_type_is_cut_too():
    """TorchScript's exports declare no type for intermediate values: the input gets the table's dtype
    and the shape the Gather gives (else every variant's session held a copy of the table)."""
    table = rng(1).standard_normal((1000, 300)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
             helper.make_node("Relu", ["emb"], ["y"], name="relu")]
    m = ir.from_proto(model(nodes, [vinfo("ids", ["batch", 5], TensorProto.INT64)], [vinfo("y", ["batch", 5, 300])],
                            [tensor("table", table)], fill_output_shapes=False))
    assert m.graph.node(0).outputs[0].type is None
    lookups = cut_lookups(m)
    assert [n.op_type for n in m.graph] == ["Relu"] and not m.graph.initializers
    fed = m.graph.inputs[-1]
    assert fed.name == lookups[0].name and fed.dtype == ir.DataType.FLOAT
    assert [str(d) for d in fed.shape] == ["batch", "5", "300"]


def test_a_large_model_is_timed_on_its_first_block(monkeypatch):
    monkeypatch.setattr(block, "SMALL_BYTES", 0)
    clock = _clock()
    monkeypatch.setattr(timing, "measure", clock)
    written, report = optimize(_blocks(), target="onnxruntime", tune=True)
    assert report.tuning.timed and report.tuning.scope.startswith("on blocks.0 (1 of 4 blocks)")
    assert clock.seen and max(n for _, n in clock.seen) <= 6  # the prefix: stem and block 0, never 15 nodes
    assert report.verification.ok and "BatchNormalization" not in op_counts(written)


def test_a_large_model_without_a_block_is_not_timed(monkeypatch):
    monkeypatch.setattr(block, "SMALL_NODES", 0)
    monkeypatch.setattr(timing, "measure", lambda *a, **k: pytest.fail("timed"))
    written, report = optimize(_blocks(named=False), target="onnxruntime", tune=True)
    assert report.tuning.reason.startswith("not timed (a large model with no repeated block")
    assert report.verification.ok and "BatchNormalization" not in op_counts(written)


def test_a_record_replays_to_the_same_bytes_without_timing(tmp_path, monkeypatch):
    src = tmp_path / "in.onnx"
    onnx.save(decode_step(), src)
    first, second, third, report = (tmp_path / n for n in ("a.onnx", "b.onnx", "c.onnx", "r.json"))
    monkeypatch.setattr(timing, "measure", _clock(lambda v: 1.2 if "Split" in str(op_counts(v.model)) else 1.0))
    optimize(str(src), target="onnxruntime", tune=True, output=first, report_path=report)
    record = json.loads(report.read_text())["tuning"]["record"]
    assert record["configuration"]["packed-projections"] == "off" and record["machine"]["onnxruntime"]
    monkeypatch.setattr(timing, "measure", lambda *a, **k: pytest.fail("timed"))
    _, replay = optimize(str(src), target="onnxruntime", tune=True, output=second, tuning=report)
    assert replay.tuning.source.startswith("replayed from") and second.read_bytes() == first.read_bytes()
    _, cached = optimize(str(src), target="onnxruntime", tune=True, output=third)  # the cache, no flag
    assert cached.tuning.source.startswith("replayed from the cache") and third.read_bytes() == first.read_bytes()
    assert any("replayed from the cache" in line for line in cached.tuning.lines())


def test_retune_times_again(monkeypatch):
    clock = _clock()
    monkeypatch.setattr(timing, "measure", clock)
    optimize(decode_step(), target="onnxruntime", tune=True)
    timed = len(clock.seen)
    optimize(decode_step(), target="onnxruntime", tune=True)
    assert len(clock.seen) == timed  # replayed
    _, report = optimize(decode_step(), target="onnxruntime", tune=True, retune=True)
    assert len(clock.seen) == 2 * timed and report.tuning.timed


def test_a_record_of_another_graph_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(timing, "measure", _clock())
    src, other, report = tmp_path / "in.onnx", tmp_path / "other.onnx", tmp_path / "r.json"
    onnx.save(decode_step(), src)
    onnx.save(_blocks(), other)
    optimize(str(src), target="onnxruntime", tune=True, report_path=report)
    code = main(["optimize", str(other), "-o", str(tmp_path / "o.onnx"), "--target", "onnxruntime",
                 "--tuning", str(report)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "tuning record is of another graph" in err[0]
    assert not (tmp_path / "o.onnx").exists()


def test_a_variant_that_fails_to_build_is_dropped_and_the_others_go_on(monkeypatch):
    real = pipeline._configured

    def fragile(model_, options, plan, config, **kw):
        if config is not None and config.get("attention") == "MultiHeadAttention":
            raise RuntimeError("NotImplemented: Could not find an implementation for RandomNormalLike(22)")
        return real(model_, options, plan, config, **kw)

    monkeypatch.setattr(pipeline, "_configured", fragile)
    monkeypatch.setattr(timing, "measure", _clock())
    written, report = optimize(decode_step(), target="onnxruntime", tune=True)
    mha = next(f for f in report.tuning.families if f.candidate == "MultiHeadAttention")
    assert mha.decision == "not timed" and "could not be built: NotImplemented" in mha.reason
    assert report.tuning.timed and report.verification.ok


def test_timing_that_raises_leaves_the_policy_and_the_run_succeeds(monkeypatch, tmp_path):
    def broken(*a, **k):
        raise RuntimeError("the clock broke")

    monkeypatch.setattr(timing, "measure", broken)
    out = tmp_path / "out.onnx"
    written, report = optimize(decode_step(), target="onnxruntime", tune=True, output=out)
    assert report.tuning.reason.startswith("not timed (tuning failed: the clock broke)")
    assert out.exists() and report.verification.ok and op_counts(written).get("Attention", 0) == 1


def test_the_default_command_with_a_deterministic_clock(tmp_path, monkeypatch, capsys):
    """No flag but the target: the measured choice runs (as a user gets it), on the clock of the test."""
    monkeypatch.setenv("OPFUSE_TUNE", "on")
    monkeypatch.setattr(timing, "measure", _clock())
    src, out, report = tmp_path / "in.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    onnx.save(decode_step(), src)
    assert main(["optimize", str(src), "-o", str(out), "--target", "onnxruntime", "--report", str(report)]) == 0
    tuning = json.loads(report.read_text())["tuning"]
    assert tuning["timed"] and tuning["record"]["signature"] and tuning["in_file"]["attention"]
    printed = " ".join(capsys.readouterr().out.split())  # (the console wraps long lines)
    assert "tuning: timed the whole model" in printed
    assert printed.count("tuning: attention:") == 1  # one line per family...
    attention = printed.split("tuning: attention:")[1].split("tuning:")[0]
    written = {k.split(".")[-1]: n for k, n in op_counts(ir.load(out)).items()}
    kind = "MultiHeadAttention" if "MultiHeadAttention" in written else "Attention"
    assert f"in the file: {kind} {written[kind]}" in attention  # ...with what the file written has of it


def test_a_decode_steps_mask_dimension_of_its_own_is_timed_at_the_past_and_one():
    """A TorchScript decode step names its mask's length apart from the past ('total_seq'): timed at a
    past of 256, the mask covers the past and the new token (not a past of one, where nothing larger ran)."""
    from opfuse.tune import tuning_feeds

    feeds, shapes = tuning_feeds(ir.from_proto(decode_step(mask_dim="mask_len")), None)
    assert feeds["past_key"].shape[2] == 256 and feeds["attention_mask"].shape == (1, 257)
    assert "past_seq=256" in shapes and "did not run" not in shapes


def test_an_opset_raise_keeps_the_weights_it_had(tmp_path):
    """The version converter sees the weights as references only: the raised model holds the very
    tensors the input had (no copy of a large model), and it computes the same numbers."""
    import onnx_ir as ir

    from graphs import assert_same
    from opfuse.prepare.opset import upgrade_opset

    w = rng(2).standard_normal((64, 64)).astype(np.float32)  # 16 KB: a stand-in through the converter
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
             helper.make_node("ReduceMean", ["y"], ["z"], axes=[1], keepdims=1, name="mean")]
    m = ir.from_proto(model(nodes, [vinfo("x", [2, 64])], [vinfo("z", [2, 1])], [tensor("w", w)], opset=17))
    before = m.graph.initializers["w"].const_value
    raised, note = upgrade_opset(m, 23)
    assert raised.graph.initializers["w"].const_value is before and "17 -> 23" in note
    assert raised.opset_imports[""] == 23 and "ReduceMean" in [n.op_type for n in raised.graph]  # (axes an input)
    assert_same(ir.serde.serialize_model(m), ir.serde.serialize_model(raised))


def test_a_mismatch_at_the_timings_fixed_tolerance_does_not_write_the_input_unchanged(monkeypatch):
    """The timing compares outputs at a fixed float32 tolerance (a deep model's policy can exceed it by
    rounding alone): that is no verdict on what is written, which verification checks with the
    tolerance that scales with the model; the input unchanged is for a configuration that did not run."""
    clock = _clock()

    def measure(variants, feeds, **kw):
        found = clock(variants, feeds, **kw)
        found.mismatches.update({v.name: "output 'y': max |diff| 1.79e-07 exceeds the float32 tolerance"
                                 for v in variants if not v.name.startswith("original")})
        return found

    monkeypatch.setattr(timing, "measure", measure)
    written, report = optimize(_blocks(), target="onnxruntime", tune=True)
    assert report.tuning.written.startswith("the configuration chosen"), report.tuning.written
    assert "BatchNormalization" not in op_counts(written) and report.verification.ok
