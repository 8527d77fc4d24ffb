"""A sliding-window cache's present Slice after Attention-23 -> If (the copy only where it cuts).

A sliding-window decoder (Mistral's exports; the window W = 4095) writes each present as the
last W positions of the cache the op wrote, after :mod:`opfuse.passes.patterns.kv_cache`:

    y, k_all, v_all = Attention(q, k, v, mask, past_k, past_v)         k_all: [B, Hkv, P + S, Dh]
    present_k = Slice(k_all, -W, E, axis 2)                             E >= W (likewise v)

Rewrite (one ``If`` per attention node; ONNX's own op):

    fits = LessOrEqual(Shape(past_k)[2:3], W - S)           (S static; else Shape(past_k) + Shape(k) <= W)
    y, present_k, present_v = If(fits,
        then: Attention(q, k, v, mask, past_k, past_v)                       (its outputs as they are)
        else: Attention(...) then the two Slices, as the graph wrote them)

Algebra: ``Slice(x, -W, E)`` along an axis of length L keeps positions max(0, L - W) to
min(E, L): all of x when L <= W (E >= W >= L). The op's present is P + S long, so where
P + S <= W the Slice is the identity and the then-branch writes the same tensors; elsewhere
the else-branch is the graph's own nodes. Exact at every length; what changes is that a cache
which fits the window is no longer copied once more after the op wrote it (its times on the
Mistral decode steps: docs/results/measurements.md).

Legality (each failure a refusal with its reason):

- the attention node has its cache (past_key and past_value inputs, three outputs), and each
  present is read by one Slice only, not by anything else nor as a graph output;
- both Slices are a window: one constant start -W, end E >= W >= 1, axis 2 (or -2), step 1
  (as :func:`opfuse.passes.patterns.kv_cache._window_slice` reads them), with the same W;
- the past's key and value lengths are one dim (the shapes show it), so one test covers both;
- the new keys' length S is known (static), or read with a Shape off the keys' sequence axis
  (axis 2 of the 4-D form, 1 of the 3-D form); S > W (every step cuts) is left alone.

A target whose runtime does not run control flow on its accelerator (QNN's HTP) does not get
this stage (:func:`opfuse.passes.patterns.attention.stages`).
"""

from __future__ import annotations

__all__ = ["rules"]

import itertools

import onnx_ir as ir
from onnxscript.rewriter import _matcher, pattern

from opfuse.core.dims import same_dim
from opfuse.core.ops import ONNX_DOMAINS
from opfuse.passes.patterns.heads_3d import _live
from opfuse.passes.patterns.kv_cache import _window_slice


_THEN, _ELSE = "fits_window", "cut_to_window"  # the branches' names; this rule leaves the else-branch alone


def _new_keys(node: ir.Node) -> tuple[ir.Value, int] | None:
    """(the new keys or values, their sequence axis) of Attention ``node``: axis 2 of the 4-D form
    [B, H, S, Dh], 1 of the 3-D form [B, S, H * Dh] (the spec: K and V are one length); the one whose
    length is static first; None if neither's rank is known."""
    known = [v for v in node.inputs[1:3] if v is not None and v.shape is not None and len(v.shape) in (3, 4)]
    known.sort(key=lambda v: not isinstance(v.shape[2 if len(v.shape) == 4 else 1], int))
    return (known[0], 2 if len(known[0].shape) == 4 else 1) if known else None


class PresentWindow(pattern.RewriteRuleClassBase):
    """Attention-23 with its cache, each present cut by a window Slice -> If(cache fits) (docstring)."""

    def __init__(self):
        super().__init__(name="PresentWindow->If")
        self._window: int | None = None
        # the exporter's shape arithmetic, dead by now, may still read the op's presents: replace the
        # outputs only, and clean-up drops what nothing reads
        self.remove_nodes = False

    def pattern(self, op, query, key, value):
        y, key_all, value_all = op.Attention(query, key, value, _allow_other_inputs=True,
                                             _allow_other_attributes=True,
                                             _outputs=["attention", "key_all", "value_all"])
        present_key = op.Slice(key_all, _allow_other_inputs=True, _outputs=["present_key"])
        present_value = op.Slice(value_all, _allow_other_inputs=True, _outputs=["present_value"])
        return y, present_key, present_value

    def check(self, context, attention, key_all, value_all, present_key, present_value,
              **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        problem = self._problem(attention, key_all, value_all, present_key, present_value)
        return result.fail(problem) if problem else result

    def _problem(self, attention, key_all, value_all, present_key, present_value) -> str | None:
        node = attention.producer()
        if node.domain not in ONNX_DOMAINS or len(node.inputs) < 6 or node.inputs[4] is None or node.inputs[5] is None:
            return "the attention node has no cache (past_key, past_value)"
        if len(node.outputs) != 3:
            return "the attention node writes a fourth output (qk_matmul_output)"
        for whole, cut, what in ((key_all, present_key, "key"), (value_all, present_value, "value")):
            # (dead shape arithmetic the earlier stages left, cleaned up later, does not count)
            if whole.is_graph_output() or any(_live(out, set()) for user, _ in whole.uses()
                                              if user is not cut.producer() for out in user.outputs):
                return f"the op's present {what} is read besides its window Slice"
        windows = [_window_slice(p) for p in (present_key, present_value)]
        if any(w is None for w in windows):
            return "a present's Slice is not a window (one constant start -W, end >= W, axis 2, step 1)"
        if windows[0][1] != windows[1][1]:
            return f"the key's window ({windows[0][1]}) is not the value's ({windows[1][1]})"
        past_key, past_value = node.inputs[4], node.inputs[5]
        if (past_key.shape is None or past_value.shape is None or len(past_key.shape) != 4
                or len(past_value.shape) != 4 or not same_dim(past_key.shape[2], past_value.shape[2])):
            return "the past keys and values are not shown to be one length"
        found = _new_keys(node)
        if found is None:
            return "the new keys' and values' ranks are not known (3 or 4)"
        new = found[0].shape[found[1]]
        if isinstance(new, int) and new > windows[0][1]:
            return f"the new keys ({new}) are longer than the window ({windows[0][1]}): every step cuts"
        self._window = windows[0][1]
        return None

    def rewrite(self, op, attention, present_key, present_value, **_):
        node = attention.producer()
        window, past_key = self._window, node.inputs[4]
        new, axis = _new_keys(node)
        length = op.Shape(past_key, start=2, end=3)
        if isinstance(new.shape[axis], int):  # (a constant bound: one comparison per layer)
            fits = op.LessOrEqual(length, op.Constant(value_ints=[window - new.shape[axis]]))
        else:
            fits = op.LessOrEqual(op.Add(length, op.Shape(new, start=axis, end=axis + 1)),
                                  op.Constant(value_ints=[window]))
        slices = [p.producer() for p in (present_key, present_value)]
        then_branch = _branch(_THEN, node, [])
        else_branch = _branch(_ELSE, node, slices)
        outputs = op.If(fits, then_branch=then_branch, else_branch=else_branch, _outputs=3)
        for out, old in zip(outputs, (attention, present_key, present_value)):
            out.shape, out.type = old.shape, old.type
        return outputs


def _branch(name: str, node: ir.Node, slices: list[ir.Node]) -> ir.Graph:
    """A branch with a copy of the attention ``node`` (outer-scope inputs) and, if given, the window
    ``slices`` after its presents; its outputs (y, present_key, present_value) typed as the graph's,
    named after them with the branch's name (unique in the model: a subgraph's names are its own)."""
    attributes = [ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()]
    attention = ir.Node("", "Attention", list(node.inputs), attributes, num_outputs=3,
                        name=f"{node.name}_{name}" if node.name else None)
    nodes, outputs = [attention], list(attention.outputs)
    for i, cut in enumerate(slices, start=1):
        copied = ir.Node("", "Slice", [attention.outputs[i], *cut.inputs[1:]], num_outputs=1,
                         name=f"{cut.name}_{name}" if cut.name else None)
        nodes.append(copied)
        outputs[i] = copied.outputs[0]
    for whole, out in zip(node.outputs, attention.outputs):
        whole_name = whole.name or f"attention_{id(node)}"
        out.name, out.shape, out.type = f"{whole_name}_{name}", whole.shape, whole.type
    for cut, out in zip(slices, outputs[1:]):
        out.name = f"{cut.outputs[0].name}_{name}"
        out.shape, out.type = cut.outputs[0].shape, cut.outputs[0].type
    return ir.Graph([], outputs, nodes=nodes, name=name)


class _SlicesOfTheNode(_matcher.SimplePatternMatcher):
    """onnxscript's matcher for a pattern of several output nodes tries every node of the graph with
    the output nodes' op types (here: every pair of Slices, for each Attention); this one tries only
    the Slices that read the given Attention's presents."""

    def match(self, model, graph_or_function, node, *, verbose=0, remove_nodes=True, tracer=None):
        self._tracer = tracer
        self._graph = graph_or_function if isinstance(graph_or_function, ir.Graph) else graph_or_function.graph
        result = pattern.MatchResult()
        if node.op_type != "Attention" or node.domain not in ONNX_DOMAINS or len(node.outputs) != 3:
            return result.fail("not an Attention node with its presents")
        if self._graph.name == _ELSE:  # (not a refusal: the If's else-branch is the graph's own nodes)
            return result.fail("the If's own else-branch")
        cuts = [[user for user, _ in out.uses() if user.op_type == "Slice"] for out in node.outputs[1:]]
        for combination in itertools.product([node], *cuts):
            self._init_match(verbose)
            result = self._multi_match(combination, check_removable=remove_nodes)
            if result:
                return result
        return result if cuts[0] and cuts[1] else pattern.MatchResult().fail("a present is not read by a Slice")


def rules() -> list:
    rule = PresentWindow()
    return [pattern.RewriteRule(rule.pattern, rule.rewrite, rule.check, _SlicesOfTheNode, name=rule.name,
                                remove_nodes=rule.remove_nodes)]
