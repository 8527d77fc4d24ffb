"""What a rewrite pass keeps after it ran: nothing of the model it was given.

The onnxscript rules are built once per process and reused (their matchers keep their last match
until the next one, and a rule written as a class keeps what its check found); a graph the pipeline discarded (a trial, a tuning variant, a clone) must not stay
alive through them, with the weights it holds in memory (a decoder's packed projection weights, a
second copy beside the file's at verification's peak)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from opfuse.passes.fuse_patterns import PatternFusionPass


def _silu_matmul() -> ir.Model:
    """x @ W, then SiLU written out (Sigmoid, Mul): a pattern both targets fuse."""
    w = numpy_helper.from_array(np.ones((8, 8), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Sigmoid", ["y"], ["s"]),
         helper.make_node("Mul", ["y", "s"], ["z"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 8])], [w])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_a_model_the_pattern_pass_saw_is_freed_with_its_last_reference():
    model = _silu_matmul()
    graph, weight = weakref.ref(model.graph), weakref.ref(model.graph.initializers["w"].const_value)
    PatternFusionPass(target="onnxruntime")(model)
    assert any(n.op_type == "QuickGelu" for n in model.graph), [n.op_type for n in model.graph]
    del model
    gc.collect()
    assert graph() is None and weight() is None, gc.get_referrers(graph()) if graph() else "the weight is held"


def test_a_class_rule_s_check_state_does_not_outlive_the_pass():
    """A rule written as a class (onnxscript's RewriteRuleClassBase) keeps what its check found in its own
    attributes: after the pass its attributes are those it was built with."""
    from opfuse.passes.patterns import _BUILT

    model = _silu_matmul()
    PatternFusionPass(target="onnxruntime")(model)
    held = [name for instance, built in _BUILT.values() for name, value in vars(instance).items()
            if isinstance(value, (ir.Value, ir.Node, ir.Graph)) or value is not built.get(name, value)]
    assert not held, held
