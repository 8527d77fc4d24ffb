"""The pattern adapter (fuse-patterns) as onnxscript's rule API declares it: a rule declared
``remove_nodes=False`` keeps the matched nodes still used elsewhere (GPT-2's ``ExtractDim``
match, whose shape Concat feeds other Reshapes), a rule that raises is a refusal with its
reason while the other rewrites go on, and each record's label names the op written and
counts written nodes (a tiny Hugging Face Llama, both targets). Graphs are built here."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import helper
from onnxscript.rewriter import pattern

import extras
import opfuse
from decoder_nets import export_tiny_llama
from graphs import assert_same, model, ops, tensor, vinfo
from opfuse.passes import fuse_patterns
from opfuse.passes.patterns import PatternRules


def optimize(m, target="onnx", **kw):
    kw.setdefault("runtime_level", "disabled")
    return opfuse.optimize(m, target=target, **kw)


# -- remove_nodes=False: GPT-2's ExtractDim ------------------------------------------------------

def extract_dim_model():
    """x [B, S, 64] -> Reshape(x, Concat(B, S, 4, 16), allowzero=1) -> Transpose(0, 2, 1, 3), whose
    Shape sliced at [2:3] is S (what onnxscript's ExtractDim rewrites to S itself), and whose
    shape Concat also feeds another Reshape and whose Transpose also feeds an output: the
    matched nodes are used outside the match (the dynamo exporter's GPT-2 attention)."""
    n = helper.make_node
    ints = {name: np.array([v], np.int64) for name, v in (("i0", 0), ("i1", 1), ("i2", 2), ("i3", 3),
                                                          ("heads", 4), ("size", 16))}
    inits = [tensor(k, v) for k, v in ints.items()] + [tensor("two", np.float32(2))]
    nodes = [n("Shape", ["x"], ["sx"]), n("Slice", ["sx", "i0", "i1"], ["d0"]), n("Slice", ["sx", "i1", "i2"], ["d1"]),
             n("Concat", ["d0", "d1", "heads", "size"], ["shape4"], axis=0, name="shape_concat"),
             n("Reshape", ["x", "shape4"], ["r"], allowzero=1, name="heads_reshape"),
             n("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3], name="heads_transpose"),
             n("Shape", ["t"], ["st"], name="shape_of_t"), n("Slice", ["st", "i2", "i3"], ["seq"], name="seq_slice"),
             n("Concat", ["d0", "heads", "seq", "size"], ["back"], axis=0),
             n("Reshape", ["t", "back"], ["y1"]),
             n("Mul", ["x", "two"], ["x2"]), n("Reshape", ["x2", "shape4"], ["y2"], allowzero=1, name="other_reshape")]
    return model(nodes, [vinfo("x", ["B", "S", 64])], [vinfo("y1", None), vinfo("y2", None)], inits, opset=18)


@pytest.mark.parametrize("target", ["onnx", "onnxruntime"])
def test_extract_dim_keeps_the_matched_nodes_that_other_nodes_still_use(target):
    m = extract_dim_model()
    out, report = optimize(m, target, dims={"B": 2, "S": 5})
    (record,) = [r for r in report.records if "rule ExtractDim" in r.detail]
    assert set(record.removed) == {"seq_slice", "shape_of_t"}, record  # the Shape and Slice, nothing else
    assert "3 matched node(s) kept" in record.detail
    names = {node.name for node in out.graph}
    assert {"shape_concat", "heads_reshape", "heads_transpose", "other_reshape"} <= names
    assert "shape_of_t" not in names and "seq_slice" not in names
    assert report.verification.ok
    assert_same(m, out, dims={"B": 3, "S": 7})


# -- a rule that raises --------------------------------------------------------------------------

class _Fake(pattern.RewriteRuleClassBase):
    """A rule rooted at ``op``: raises in its check or in its rewrite (after building a node,
    as a rewrite that fails halfway does), or declares ``as_function``; counts its set-ups."""

    calls = Counter()

    def __init__(self, op: str, fault: str):
        super().__init__(name=f"fake-{fault}-{op}", as_function=fault == "as-function")
        self.op, self.fault = op, fault

    def pattern(self, op, x):
        return getattr(op, self.op)(x, _outputs=["y"])

    def check(self, context, x, **_):
        if self.fault == "check":
            raise ValueError(f"boom in the check of {self.op}\nsecond line")
        return pattern.MatchResult()

    def rewrite(self, op, x, y, **_):
        if self.fault == "rewrite":
            op.Neg(y)  # a node built before the failure: a user of y until dropped
            raise RuntimeError(f"boom in the rewrite of {self.op}")
        return op.Neg(x, _domain="fake.domain")

    def setup(self):
        self.calls["setup"] += 1

    def cleanup(self):
        self.calls["cleanup"] += 1


def test_a_rule_that_raises_is_a_refusal_and_the_other_rewrites_go_on(monkeypatch):
    """layer-norm's catalogue replaced by faulty rules: one raising in its check (Relu), one in
    its rewrite after building a node on the Sigmoid's output (which the SiLU rule must still
    find removable), one declaring as_function (Abs). SiLU -> Swish still happens."""
    n = helper.make_node
    m = model([n("Relu", ["x"], ["r"], name="relu"), n("Abs", ["r"], ["a"], name="abs"),
               n("Sigmoid", ["a"], ["s"], name="sigmoid"), n("Mul", ["a", "s"], ["y"], name="mul")],
              [vinfo("x", [2, 16])], [vinfo("y", None)], opset=24)
    faulty = PatternRules("fake", ((_Fake.rule("Relu", "check"), _Fake.rule("Sigmoid", "rewrite"),
                                    _Fake.rule("Abs", "as-function")),))
    real = fuse_patterns.pattern_rules
    monkeypatch.setattr(fuse_patterns, "pattern_rules",
                        lambda name, *a, **k: faulty if name == "layer-norm" else real(name, *a, **k))
    _Fake.calls.clear()
    out, report = optimize(m, "onnx")
    assert ops(out) == ["Relu", "Abs", "Swish"], (ops(out), report.refusals)
    reasons = {r.node: r.reason for r in report.refusals if r.pattern == "fake"}
    assert reasons["relu"] == "rule fake-check-Relu failed: ValueError: boom in the check of Relu"
    assert "as_function" in reasons["abs"]
    assert report.applied("SiLU->Swish") and report.verification.ok
    assert _Fake.calls["setup"] >= 1 and _Fake.calls["setup"] == _Fake.calls["cleanup"]
    assert_same(m, out)


def test_a_rewrite_that_raises_leaves_a_refusal_when_its_node_stays(monkeypatch):
    n = helper.make_node
    m = model([n("Relu", ["x"], ["y"], name="relu")], [vinfo("x", [2, 16])], [vinfo("y", None)], opset=18)
    faulty = PatternRules("fake", ((_Fake.rule("Relu", "rewrite"),),))
    real = fuse_patterns.pattern_rules
    monkeypatch.setattr(fuse_patterns, "pattern_rules",
                        lambda name, *a, **k: faulty if name == "layer-norm" else real(name, *a, **k))
    out, report = optimize(m, "onnx")
    assert ops(out) == ["Relu"]
    (refusal,) = [r for r in report.refusals if r.pattern == "fake"]
    assert refusal.node == "relu" and refusal.reason.endswith("RuntimeError: boom in the rewrite of Relu")
    assert_same(m, out)


# -- labels: the op written, one per written node ------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama, a prefill graph exported by torch's dynamo exporter at opset 18."""
    return export_tiny_llama(tmp_path_factory.mktemp("llama") / "llama.onnx")


@pytest.mark.parametrize("target, opset, expected", [
    ("onnxruntime", None,
     {"RMSNorm->SimplifiedLayerNormalization", "SiLU->QuickGelu", "attention->MultiHeadAttention"}),
    ("onnx", 23, {"RMSNorm->RMSNormalization", "attention->Attention"}),
])
def test_each_label_names_the_op_written_and_counts_its_nodes(llama, target, opset, expected):
    out, report = opfuse.optimize(str(llama), target=target, opset=opset)
    assert report.verification.ok
    written = Counter(node.op_type for node in out.graph)
    counts = report.pattern_counts()
    fused = {label: n for label, n in counts.items() if label.partition("->")[0] in ("RMSNorm", "SiLU", "attention")}
    assert set(fused) == expected, counts
    assert not any("KV-cache decode step" in r.reason for r in report.refusals)  # a prefill: no exception
    for label, n in fused.items():
        op = label.partition("->")[2]
        assert written[op] == n, (label, n, written[op])
        assert f"{n} {label}" in report.summary()


# -- attention whose heads are merged straight to [B*S, D] (GPT-2's Conv1D projection) -----------

def test_attention_merged_to_two_dims_is_not_taken_as_multiheadattention_s_output(tmp_path):
    """GPT-2 as the dynamo exporter writes it: the heads merged by a Reshape to [B*S, D] for the
    projection's Gemm. onnxscript's MHA rule reads that Reshape as the merge to [B, S, D] and
    wrote a MultiHeadAttention the Gemm could not run; the rule that takes it must see the shape."""
    torch = extras.require("torch")

    class Attention(torch.nn.Module):
        def __init__(self, d=64, heads=4):
            super().__init__()
            self.heads, self.qkv, self.proj = heads, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).split(d, dim=2))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b * s, d)).view(b, s, d)

    torch.manual_seed(0)
    path = tmp_path / "attention.onnx"
    dims = {"x": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}}
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(Attention().eval(), (torch.randn(2, 8, 64),), str(path), dynamo=True, opset_version=18,
                          input_names=["x"], dynamic_shapes=dims)
    out, report = opfuse.optimize(str(path), target="onnxruntime")
    assert report.verification.ok
    assert report.applied("attention->MultiHeadAttention")
    assert Counter(n.op_type for n in out.graph)["MultiHeadAttention"] == 1
    assert_same(onnx.load(path), out, dims={"batch": 3, "seq": 5})
