"""``quantize --preset qnn-a16-per-channel`` (w8a16) on a decoder at opset 23, as ``benchmarks/qnn_llm.py`` runs
it on SmolLM2: a one-layer random Llama's prefill and KV-cache decode step (``decoder_nets.export_llama_step``,
the corpus' dynamo export) raised to opset 23 (RMSNormalization, RotaryEmbedding, Attention), the deployment's
static shapes (a prefill chunk of :data:`SEQ`, a past of :data:`PAST`), calibrated on prompts left-padded into
the chunk and on the decode steps the float export takes after them.

- the attention mask's fill: float32's minimum becomes -32768 once Attention-23 reads the mask
  (:mod:`opfuse.passes.mask_fill`), in both graphs;
- the prefill: the fold stage is verified on a left-padded calibration sample, where Attention-23 gives other
  values than the export at the padded queries (undefined there, :mod:`opfuse.verify`); it passes, compiles
  whole on the HTP, and the HTP's logits match the float export at the real tokens of padded and unpadded
  prompts (the QNN quantize tests' bar, 20 dB), as the report's SQNR, counted there, says; its MatMul weights
  have one scale per output channel, as the preset says;
- the decode step: the Attention's presents are written in float (QNN's HTP builds them as graph outputs,
  :func:`opfuse.targets.qnn.conventions.float_attention_presents`); it compiles and runs whole on the HTP and
  matches the float export; without that form its first run fails, and the command says so in one line.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import extras
from decoder_nets import STEP, export_llama_step
from qnn_graphs import needs_htp

pytestmark = needs_htp
SEQ, PAST = 16, 255
MIN_DB = 20.0  # the bar of the QNN quantize tests (test_qnn_target)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{"prefill"|"decode": the opset-23 export}, and the calibration samples of each."""
    extras.require("torch")
    import onnx_ir as ir

    from opfuse.prepare.opset import upgrade_opset

    folder = tmp_path_factory.mktemp("qnn_llm")
    paths = {}
    for graph in ("prefill", "decode"):
        raw = export_llama_step(folder / f"raw-{graph}.onnx", graph)
        model, _ = upgrade_opset(ir.load(str(raw)), 23)
        paths[graph] = folder / f"{graph}.onnx"
        ir.save(model, str(paths[graph]))
    import qnn_llm  # (benchmarks/, on the path once export_llama_step has run: the benchmark's own loop)

    class Shapes(qnn_llm.Shapes):
        def __init__(self):
            self.layers, self.kv_heads = STEP["num_hidden_layers"], STEP["num_key_value_heads"]
            self.head_dim, self.past, self.seq = STEP["hidden_size"] // STEP["num_attention_heads"], PAST, SEQ

    cpu = {g: qnn_llm._runner(_cpu(p)) for g, p in paths.items()}
    r = np.random.default_rng(0)
    samples = {"prefill": [], "decode": []}
    for length in (14, 5, 11, 8, 12, 3):
        run = qnn_llm.generate(cpu["prefill"], cpu["decode"], r.integers(3, 100, length).tolist(), Shapes(), 4)
        samples["prefill"].append(run["steps"][0][0])
        samples["decode"] += [run["steps"][s][0] for s in (1, 3)]
    return paths, samples, qnn_llm


def _cpu(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _sqnr(reference, actual) -> float:
    reference = reference.astype(np.float64)
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - actual) ** 2)))


def _quantize(path, samples, dims, tmp_path, name):
    from opfuse.quantization.pipeline import quantize

    out = tmp_path / f"{name}.onnx"
    _, report = quantize(str(path), samples, preset="qnn-a16-per-channel", holdout=2, require_npu=True, dims=dims,
                         output=out, context=tmp_path / f"{name}_ctx.onnx", reconstruct=False,
                         bias_correction=False)
    return out, report


def test_the_prefill_quantised_w8a16_with_padded_calibration_matches_float_on_the_htp(exports, tmp_path):
    from opfuse.targets.qnn.backend import open_session

    paths, samples, qnn_llm = exports
    out, report = _quantize(paths["prefill"], samples["prefill"], {"batch": 1, "seq": SEQ}, tmp_path, "prefill")
    fold = report.fusion.verification
    assert fold.ok and "left-padded" in fold.padded, (fold.padded, fold.padded_skipped)
    assert report.fusion.applied("attention->Attention")
    assert report.fusion.applied("attention mask fill->-32768")  # the mask's fill in the HTP's range (mask-fill)
    assert report.device.placement.all_on_npu and report.device.strict and (tmp_path / "prefill_ctx.onnx").exists()
    # the report's own figure counts the padded held-out samples at their real tokens (qdq.sqnr)
    assert report.verification.sqnr_db > MIN_DB and any("pad their attention mask" in n for n in report.notes)
    written = onnx.load(str(out))
    inits = {i.name: i for i in written.graph.initializer}
    matmul_weights = {n.input[1] for n in written.graph.node if n.op_type == "MatMul"}
    scales = [list(inits[n.input[1]].dims) for n in written.graph.node
              if n.op_type == "DequantizeLinear" and n.output[0] in matmul_weights and n.input[0] in inits]
    assert len(scales) >= 7 and all(len(s) == 1 and s[0] > 1 for s in scales), scales  # one scale per channel
    htp, cpu = open_session(str(out), strict=True), _cpu(paths["prefill"])
    names = [o.name for o in cpu.get_outputs()]
    for length in (SEQ, 9, 3):  # unpadded, and left-padded by 7 and 13
        feeds = qnn_llm.prefill_feeds(np.random.default_rng(length).integers(3, 100, length).tolist(), SEQ)
        real = feeds["attention_mask"][0].astype(bool)
        want = cpu.run(["logits"], feeds)[0][0, real]
        got = dict(zip(names, htp.run(feeds, names)))["logits"][0, real]
        assert _sqnr(want, got) > MIN_DB, (length, _sqnr(want, got))


def test_the_decode_step_quantised_w8a16_compiles_and_runs_whole_on_the_htp(exports, tmp_path):
    from opfuse.targets.qnn.backend import open_session

    paths, samples, _ = exports
    out, report = _quantize(paths["decode"], samples["decode"], {"batch": 1, "past_seq": PAST}, tmp_path, "decode")
    assert report.device.placement.all_on_npu and report.device.strict and report.verification.sqnr_db > MIN_DB
    assert report.fusion.applied("attention mask fill->-32768")
    assert any("KV cache outputs (present.0.key, present.0.value; 2 in all) are written in float" in n
               for n in report.notes), report.notes
    written = onnx.load(str(out))
    (attention,) = [n for n in written.graph.node if n.op_type == "Attention"]
    assert list(attention.output[1:]) == ["present.0.key", "present.0.value"]  # the graph's outputs, no Q/DQ
    htp, cpu = open_session(str(out), strict=True), _cpu(paths["decode"])
    names = [o.name for o in cpu.get_outputs()]
    for feeds in samples["decode"][-2:]:
        want = dict(zip(names, cpu.run(names, feeds)))
        got = dict(zip(names, htp.run(feeds, names)))
        assert _sqnr(want["logits"], got["logits"]) > MIN_DB
        real = feeds["attention_mask"][0].astype(bool)  # the present's real slots (the masked ones: the cache's 0)
        assert _sqnr(want["present.0.key"][:, :, real], got["present.0.key"][:, :, real]) > MIN_DB


def test_without_the_float_presents_the_htp_fails_at_the_first_run_and_says_so_in_one_line(exports, tmp_path,
                                                                                        monkeypatch):
    """The form onnxruntime-qnn's Attention cannot run (a Q/DQ pair after its presents): one line, exit 1. When
    this no longer fails, the provider binds such presents and the float form is no longer needed."""
    from opfuse.errors import OpfuseError
    from opfuse.targets.qnn import device
    from opfuse.targets.qnn.backend import HtpRunError

    paths, samples, _ = exports
    monkeypatch.setattr(device, "FINISH_QDQ", None)
    with pytest.raises(HtpRunError, match="QNN_GRAPH_ERROR_INVALID_TENSOR") as caught:
        _quantize(paths["decode"], samples["decode"], {"batch": 1, "past_seq": PAST}, tmp_path, "decode")
    assert isinstance(caught.value, OpfuseError) and caught.value.exit_code == 1
    assert "\n" not in str(caught.value) and str(caught.value).startswith("QNN compiled the model but its HTP")


def test_the_search_keeps_the_costliest_layers_with_16_bit_weights_and_stays_whole_on_the_htp(exports, tmp_path):
    """``--min-sqnr`` with ``qnn-a16-per-channel``: the search keeps layers with int16 weights (its activations
    are 16-bit already; float would leave the HTP), its exact ranking bounded to the 3 costliest by the per-layer
    table (``search_candidates``); the result compiles whole on the HTP. The target is out of reach on purpose
    (the search walks until no candidate helps), so the command fails its verification, with the report."""
    from opfuse.errors import VerificationError
    from opfuse.quantization.pipeline import quantize

    paths, samples, _ = exports
    with pytest.raises(VerificationError) as caught:
        quantize(str(paths["prefill"]), samples["prefill"], preset="qnn-a16-per-channel", holdout=2,
                 require_npu=True, dims={"batch": 1, "seq": SEQ}, output=tmp_path / "o.onnx", reconstruct=False,
                 bias_correction=False, min_sqnr=99.0, search_candidates=3, max_steps=4)
    report = caught.value.report
    assert report.device.placement.all_on_npu and report.device.strict
    kept = [r for r in report.layers if r.precision != "int8"]
    assert kept and {r.precision for r in kept} == {"int16 weights"} and {r.op_type for r in kept} == {"MatMul"}
    assert all("kept with 16-bit weights" in r.reason for r in kept), kept
    first_pass = [s for s in report.search if s.phase == "sensitivity" and s.kept == s.added]
    assert 0 < len(first_pass) <= 3, [s.kept for s in report.search]
    assert any("re-quantised the 3 costliest of" in n for n in report.notes), report.notes
    accepted = [s.sqnr_db for s in report.search if s.accepted]
    assert accepted == sorted(accepted) and accepted[-1] > accepted[0]  # never a step down
