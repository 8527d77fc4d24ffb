"""The onnxscript surface opfuse relies on beyond its public API, checked symbol by symbol.

pyproject.toml pins onnxscript to the tested minor range (``>=0.7.2,<0.8``). Inside it,
opfuse still reads some private names and compares some of onnxscript's English messages
(listed below, with the opfuse module that reads each). When a new onnxscript moves one,
the test names the symbol that moved, rather than a pattern silently refusing or a
refusal silently changing its words. Each check is of existence and of the behaviour
opfuse assumes, on a small graph built here.
"""

from __future__ import annotations

import importlib
import inspect
import logging

import onnx_ir as ir
import pytest
from onnxscript.rewriter import pattern

from opfuse.passes import cleanup, fuse_patterns

# (module, attribute path, the opfuse module that reads it)
PRIVATE = [
    ("onnxscript.rewriter._ir_utils", "display_nodes", "passes/fuse_patterns.py (a verbose rule's display)"),
    ("onnxscript.rewriter._pattern_ir", "StringConstantPattern", "passes/fuse_patterns.py _root_op (by type name)"),
    ("onnxscript.rewriter._matcher", "SimplePatternMatcher._multi_match", "passes/patterns/present_window.py"),
    ("onnxscript.rewriter._matcher", "SimplePatternMatcher._init_match", "passes/patterns/present_window.py"),
    ("onnxscript.optimizer._constant_folding", "registry.op_evaluators", "passes/cleanup.py _evaluated_ops"),
    ("onnxscript.rewriter.rules.common._matmul_add_to_gemm", "MatMulAddToGemm", "passes/patterns/matmul_add.py"),
    ("onnxscript.rewriter.rules.fusion._rms_normalization", "RmsNormFusion", "passes/patterns/rms_norm.py"),
    ("onnxscript.rewriter.ort_fusions.mha", "MultiHeadAttention", "passes/patterns/attention.py"),
    ("onnxscript.rewriter.ort_fusions.mha_scale", "_mha_scale_rules.rules", "passes/patterns/attention.py"),
    ("onnxscript.rewriter.ort_fusions.sdpa_via_mha", "_rules.rules", "passes/patterns/attention.py"),
    ("onnxscript.rewriter.ort_fusions.sdpa", "sdpa_rules.rules", "passes/patterns/attention.py"),
    ("onnxscript.rewriter.ort_fusions.shape_optimization", "rules.rules", "passes/patterns/attention.py"),
    ("onnxscript.rewriter.ort_fusions.attention", "attention_rules.rules", "passes/patterns/attention.py"),
    ("onnxscript.rewriter.ort_fusions.mha_bias", "mha_bias_rules.rules", "passes/patterns/attention.py"),
]


@pytest.mark.parametrize("module, path, reader", PRIVATE, ids=[f"{m}.{p}" for m, p, _ in PRIVATE])
def test_each_private_symbol_opfuse_reads_still_exists(module, path, reader):
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        pytest.fail(f"onnxscript moved {module} (read by opfuse's {reader}): {e}")
    for part in path.split("."):
        assert hasattr(obj, part), f"onnxscript moved {module}.{path} (read by opfuse's {reader}): no {part!r}"
        obj = getattr(obj, part)


def test_the_constant_folders_registry_is_read_so_the_folder_is_skipped_where_it_cannot_act():
    # unreadable, opfuse falls back to "always fold and infer" (slower, not wrong): say so here
    assert cleanup.EVALUATED_OPS is not None, "onnxscript.optimizer._constant_folding.registry moved"
    assert ("", "Shape") in cleanup.EVALUATED_OPS or ("", "Size") in cleanup.EVALUATED_OPS


def test_the_constant_folders_logger_and_size_limit_are_where_cleanup_reads_them():
    module = importlib.import_module("onnxscript.optimizer._constant_folding")
    assert module.logger.name == "onnxscript.optimizer._constant_folding", (
        "passes/cleanup.py silences onnxscript's folder by this logger name")
    assert isinstance(logging.getLogger("onnxscript.optimizer._constant_folding"), logging.Logger)
    import onnxscript.optimizer

    assert "input_size_limit" in inspect.signature(onnxscript.optimizer.fold_constants_ir).parameters, (
        "onnxscript.optimizer.fold_constants_ir has no input_size_limit (passes/cleanup.py reads its default)")


def test_the_tracer_is_public_and_its_hook_has_the_signature_opfuse_overrides():
    assert pattern.MatchingTracer is fuse_patterns.MatchingTracer
    assert pattern.MatchStatus is fuse_patterns.MatchStatus
    assert {"NO_MATCH", "CONDITION_FAILED"} <= set(pattern.MatchStatus.__members__)
    params = list(inspect.signature(pattern.MatchingTracer.log).parameters)
    assert params == ["self", "rule", "container", "node", "match_result", "status"], (
        f"onnxscript's MatchingTracer.log takes {params}; passes/fuse_patterns.py _Refusals.log overrides it")


# -- a small graph: y = Relu(Neg(x)), with Neg's output also read by an Identity (the other use)

def _neg_relu(x_op, x):
    return x_op.Relu(x_op.Neg(x))


def _abs_min(op, x):  # (any replacement: the rules here never get to apply it)
    return op.Neg(op.Relu(x))


def _model(other_use: bool) -> ir.Model:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([4]))
    neg = ir.node("Neg", [x], name="neg")
    relu = ir.node("Relu", [neg.outputs[0]], name="relu")
    nodes, outputs = [neg, relu], [relu.outputs[0]]
    if other_use:
        side = ir.node("Identity", [neg.outputs[0]], name="side")
        nodes.append(side)
        outputs.append(side.outputs[0])
    for i, v in enumerate(outputs):
        v.name = f"y{i}"
    graph = ir.Graph([x], outputs, nodes=nodes, opset_imports={"": 18})
    return ir.Model(graph, ir_version=10)


class _Log(pattern.MatchingTracer):
    def __init__(self):
        super().__init__()
        self.seen = []

    def log(self, rule, container, node, match_result, status):
        self.seen.append((status, getattr(match_result, "reason", ""), len(getattr(match_result, "nodes", ()))))


def _trace(rule, model: ir.Model):
    tracer = _Log()
    relu = next(n for n in model.graph if n.op_type == "Relu")
    assert rule.try_rewrite(model, model.graph, relu, tracer=tracer) is None
    return tracer.seen


def test_a_match_with_other_uses_fails_with_the_message_opfuse_recognises():
    seen = _trace(pattern.RewriteRule(_neg_relu, _abs_min), _model(other_use=True))
    assert any(status == pattern.MatchStatus.NO_MATCH and reason.startswith(fuse_patterns._OTHER_USES)
               and count == 2 for status, reason, count in seen), (
        f"onnxscript's reason for an unremovable match is no longer {fuse_patterns._OTHER_USES!r}...: {seen}")


def test_a_check_returning_false_fails_with_the_message_opfuse_treats_as_no_reason():
    rule = pattern.RewriteRule(_neg_relu, _abs_min, lambda context, x: False)
    seen = _trace(rule, _model(other_use=False))
    assert (pattern.MatchStatus.CONDITION_FAILED, fuse_patterns._NO_REASON, 2) in seen, (
        f"onnxscript's message for a bare False check is no longer {fuse_patterns._NO_REASON!r}: {seen}")
    rule = pattern.RewriteRule(_neg_relu, _abs_min,
                               lambda context, x: pattern.MatchResult().fail("x is not what the rule needs"))
    seen = _trace(rule, _model(other_use=False))
    assert (pattern.MatchStatus.CONDITION_FAILED, "x is not what the rule needs", 2) in seen, seen


def test_a_rules_private_target_pattern_names_its_root_op_and_its_verbose_level():
    rule = pattern.RewriteRule(_neg_relu, _abs_min, verbose=2)
    assert fuse_patterns._root_op(rule) == ("", "Relu"), (
        "passes/fuse_patterns.py _root_op reads rule._target_pattern.output_nodes[0].op (a StringConstantPattern)")
    assert getattr(rule, "_verbose", None) == 2, "passes/fuse_patterns.py reads a rule's verbose level as rule._verbose"


# (class, the arguments opfuse's subclass passes to its check, the subclass)
SUBCLASSED = [
    ("onnxscript.rewriter.ort_fusions.mha", "MultiHeadAttention", ["query_BSD"], "attention.py"),
    ("onnxscript.rewriter.ort_fusions.rms_normalization", "RmsNormFusion",
     ["x", "scale", "epsilon", "compute_dtype", "target_dtype"], "rms_norm.py OrtRmsNorm"),
    ("onnxscript.rewriter.rules.fusion._rms_normalization", "RmsNormFusion",
     ["x", "scale", "epsilon", "compute_dtype", "target_dtype"], "rms_norm.py StandardRmsNorm"),
    ("onnxscript.rewriter.rules.common._matmul_add_to_gemm", "MatMulAddToGemm", ["input_a", "input_b"],
     "matmul_add.py"),
]


@pytest.mark.parametrize("module, name, bindings, subclass", SUBCLASSED, ids=[f"{m}.{n}" for m, n, _, _ in SUBCLASSED])
def test_the_rules_opfuse_subclasses_still_check_the_bindings_it_reads(module, name, bindings, subclass):
    cls = getattr(importlib.import_module(module), name)
    params = inspect.signature(cls.check).parameters
    missing = [b for b in bindings if b not in params]
    assert not missing and any(p.kind is p.VAR_KEYWORD for p in params.values()), (
        f"{module}.{name}.check takes {list(params)}; opfuse's passes/patterns/{subclass} passes {bindings}")


def test_multi_head_attention_is_still_built_with_the_flags_opfuse_sets():
    from onnxscript.rewriter.ort_fusions import mha

    params = inspect.signature(mha.MultiHeadAttention.__init__).parameters
    assert {"is_rotary", "has_past_present", "is_cross_attention"} <= set(params), (
        f"onnxscript's MultiHeadAttention takes {list(params)} (passes/patterns/attention.py _mha_rules)")
