"""Attention with its KV cache written out -> ONNX Attention (opset 23) with past_key/past_value.

A decode step (or a prefill with a cache input) writes, per layer, the cache update and
grouped-query attention's head repeat (``repeat_kv``) around the attention op that
:mod:`opfuse.passes.patterns.attention` wrote:

    present_k = Concat(past_k, k, axis=2)                     [B, Hkv, P + S, Dh]   (a graph output)
    K         = Reshape(Expand(Unsqueeze(present_k, 2),        [B, Hkv, n, P + S, Dh])
                        [B, Hkv * n, P + S, Dh])               (repeat_kv; absent when n = 1)
    (likewise V)
    y         = Attention(q, K, V, mask)                       q: [B, Hq, S, Dh], Hq = Hkv * n

Rewrite (ONNX ``Attention``, opset 23, 4-D form; one node):

    y, present_k, present_v = Attention(q, k, v, mask, past_k, past_v)

Algebra: the standard op concatenates the past and the new keys along the sequence axis
and writes that as ``present_key`` (the Concat's value, bit for bit); with Hq = n * Hkv it
uses key head ``h // n`` for query head ``h`` (the spec's grouped-query attention), which is
what ``repeat_kv`` builds: ``Expand`` of a new axis 2 then merged into axis 1 repeats each
key head n times in a row. The mask, scale and every other attribute are the attention
node's own. The present outputs keep their names, so they stay the graph's outputs with
their shapes.

Legality (each failure is a refusal with its reason):

- the Concats join a rank-4 cache along axis 2 (the sequence axis of [B, H, S, Dh]);
- the repeat is ``Unsqueeze`` at axis 2, an ``Expand`` that changes axis 2 only, and a
  ``Reshape`` merging axes 1 and 2, as the shapes (symbolic ones included) show; the query's
  head count is the key's times n. A ``Tile`` along the heads axis (head ``h % Hkv``) is
  another grouping, which the standard op does not run: no rule matches it;
- the matched nodes are replaced by their outputs only (``remove_nodes=False``): the exporter's
  shape arithmetic, dead by then, may still read the repeated keys; what nothing reads goes;
- the mask's last axis is the keys' length (past + new), as the shapes show: the op with a
  cache does not broadcast a shorter one (ONNX Runtime 1.32 fails to run it). Where the shapes
  do not show it (Mistral's sliding-window cache: keys ``past - Max(0, past - 4095) + 1`` long,
  the mask ``past + 1``), the mask is expanded to the keys' length first,
  ``Expand(mask, [1, .., 1, P + S])`` with P and S the past's and the new keys' lengths: exact
  wherever the graph ran (its Add broadcast the mask to the scores' [.., P + S], so the mask's
  last axis was P + S or 1, which the Expand gives the same values), and a mask of unknown rank
  is refused;
- a sliding-window cache's Slice of the past, ``Slice(past, -W, E, axis 2)`` with E >= W >= 1
  (Mistral's exports: W = 4095), is dropped (the op takes the past itself) where the mask's last
  axis is the past's length plus the new keys', as the shapes show (``past_seq + 1``): wherever the
  graph ran, its Add broadcast that mask against keys ``min(past, W) + S`` long (S >= 1, static),
  so the two were equal (past <= W) or one of them was 1 (past 0), and the Slice kept the whole past. The key's and
  the value's Slices must be alike (the same W, past length and new length); the Slice of the present
  that the export writes after the Concat stays. Elsewhere the Slice stays the op's past, with the
  mask expanded as above;
- neither the query nor the mask is computed from the presents (a mask reshaped to Shape(keys)
  would read the new op's own output: a cycle);
- the keys and the values are two caches (one Concat read as both would be written twice);
- the attention node takes no cache yet, has no ``is_causal`` (its diagonal would move with
  a past) and no ``qk_matmul_output_mode`` output.
"""

from __future__ import annotations

__all__ = ["TITLE", "rules"]

import ast

from onnxscript.rewriter import pattern

from opfuse.core.dims import same_dim
from opfuse.core.ops import ONNX_DOMAINS
from opfuse.passes.patterns import constant_array, opset_problem

TITLE = "KV cache->Attention"


def _axes(node) -> list[int] | None:
    attr = node.attributes.get("axes")
    if attr is not None:
        return [int(a) for a in attr.value]
    array = constant_array(node.inputs[1]) if len(node.inputs) > 1 else None
    return None if array is None else [int(a) for a in array.reshape(-1)]


def _concat_problem(present, what: str) -> str | None:
    node = present.producer()
    axis = node.attributes.get_int("axis", 0)
    past = node.inputs[0]
    if past.shape is None or len(past.shape) != 4:
        return f"the {what} cache is not known to be rank 4 [batch, heads, past, head_dim]"
    if axis not in (2, -2):
        return f"the {what} cache is joined along axis {axis}, not the sequence axis 2"
    return None


def _repeat_problem(present, unsqueezed, expanded, repeated, what: str) -> tuple[int | None, str | None]:
    """(n, None) when ``repeated`` is repeat_kv(present) with each head repeated n times, else (None, why)."""
    axes = _axes(unsqueezed.producer())
    if axes not in ([2], [-3]):
        return None, f"the {what} heads are not repeated along a new axis 2 (Unsqueeze axes {axes})"
    src, mid, out = present.shape, expanded.shape, repeated.shape
    if src is None or mid is None or out is None or len(mid) != 5 or len(out) != 4:
        return None, (f"the {what} repeat's shapes are not known "
                      "([B, H, 1, S, Dh] -> [B, H, n, S, Dh] -> [B, H*n, S, Dh])")
    n = mid[2]
    if not isinstance(n, int) or not isinstance(src[1], int) or out[1] != src[1] * n:
        return None, f"the {what} repeat's head counts ({src[1]}, x {n} -> {out[1]}) are not static and consistent"
    for i, j in ((0, 0), (1, 1), (3, 2), (4, 3)):
        if not same_dim(mid[i], src[j]):
            return None, f"the {what} repeat's Expand changes axis {i} ({src[j]} -> {mid[i]}), not only the new axis 2"
    for i, j in ((0, 0), (2, 3), (3, 4)):
        if not same_dim(out[i], mid[j]):
            return None, f"the {what} repeat's Reshape does not merge axes 1 and 2 only ({list(mid)} -> {list(out)})"
    return n, None


def _reads(value, nodes: set) -> bool:
    """Whether ``value`` is computed from an output of one of ``nodes`` (its ancestors, walked once)."""
    frontier, seen = [value], set()
    while frontier:
        producer = frontier.pop().producer()
        if producer is None or producer in seen:
            continue
        if producer in nodes:
            return True
        seen.add(producer)
        frontier.extend(v for v in producer.inputs if v is not None)
    return False


def _mask_shape(mask):
    """The mask's shape, or before inference its Expand's input's (the standard form's Expand over the
    query axis), else None."""
    if mask is None:
        return None
    if mask.shape is None and mask.producer() is not None and mask.producer().op_type == "Expand":
        return mask.producer().inputs[0].shape
    return mask.shape


def _mask_rank(mask) -> int | None:
    """The mask's rank where its shape (:func:`_mask_shape`) is known."""
    shape = _mask_shape(mask)
    return len(shape) if shape is not None and len(shape) >= 2 else None


def _mask_problem(mask, present) -> str | None:
    """Why ``mask``'s last axis is not known to be the keys' length (the op with a cache wants
    it so; the graph may broadcast a shorter one), or None."""
    shape = _mask_shape(mask)
    length = present.shape[2] if present.shape is not None and len(present.shape) == 4 else None
    if shape is None or len(shape) == 0 or length is None or not same_dim(shape[-1], length):
        return (f"the mask's last axis ({shape[-1] if shape else 'unknown'}) is not known to be the keys' length "
                f"({length}, past + new): with a cache ONNX Runtime's Attention wants it so, and a broadcast "
                "mask would not run")
    return None


def _window_slice(past) -> tuple[object, int] | None:
    """(the cache, W) when ``past`` is ``Slice(cache, -W, E)`` along axis 2 with E >= W >= 1 and step 1
    (a sliding window keeping the last W positions, all of them when the cache is at most W long), else None."""
    node = past.producer()
    if node is None or node.op_type != "Slice" or node.domain not in ONNX_DOMAINS or len(node.inputs) < 4:
        return None
    starts, ends, axes = (constant_array(node.inputs[i]) for i in (1, 2, 3))
    steps = constant_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    if starts is None or ends is None or axes is None or (len(node.inputs) > 4 and node.inputs[4] is not None
                                                           and steps is None):
        return None
    if starts.size != 1 or ends.size != 1 or axes.size != 1 or int(axes.reshape(-1)[0]) not in (2, -2):
        return None
    if steps is not None and (steps.size != 1 or int(steps.reshape(-1)[0]) != 1):
        return None
    window, end = -int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
    return (node.inputs[0], window) if 1 <= window <= end else None


def _spells_sum(dim, name: str, new: int) -> bool:
    """Whether the symbolic ``dim`` is spelled ``name + new`` (or ``new + name``), parsed, never evaluated."""
    text = getattr(dim, "value", None)
    if not isinstance(text, str):
        return False
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    if not isinstance(tree, ast.BinOp) or not isinstance(tree.op, ast.Add):
        return False
    sides = [tree.left, tree.right]
    return any(isinstance(a, ast.Name) and a.id == name and isinstance(b, ast.Constant) and b.value == new
               and type(b.value) is int for a, b in (sides, sides[::-1]))


def _whole_window(mask, present_key, present_value) -> tuple[object, object] | None:
    """(key cache, value cache) when both caches are sliding windows (:func:`_window_slice`) that keep
    the whole cache wherever the graph ran: the mask's last axis is shown to be the cache's length
    plus the new keys' (module docstring), else None."""
    found = [(_window_slice(p.producer().inputs[0]), p.producer().inputs[1]) for p in (present_key, present_value)]
    if any(w is None or new.shape is None or len(new.shape) != 4 for w, new in found):
        return None
    (cache_k, window_k), new_k = found[0]
    (cache_v, window_v), new_v = found[1]
    if any(c.shape is None or len(c.shape) != 4 for c in (cache_k, cache_v)):
        return None
    length, count = cache_k.shape[2], new_k.shape[2]
    # (count >= 1: keys of length 1 then mean an empty past, whatever the window)
    if (not isinstance(getattr(length, "value", None), str) or not isinstance(count, int) or count < 1
            or window_k != window_v
            or not same_dim(cache_v.shape[2], length) or new_v.shape[2] != count):
        return None
    shape = _mask_shape(mask)
    if shape is None or len(shape) == 0 or not _spells_sum(shape[-1], length.value, count):
        return None
    return cache_k, cache_v


class AttentionWithPast(pattern.RewriteRuleClassBase):
    """Attention over Concat(past, new) [repeated per head group] -> Attention with past/present (docstring)."""

    def __init__(self, repeated: bool, masked: bool):
        super().__init__(name=f"KVCache{'+repeat_kv' if repeated else ''}->Attention{'(mask)' if masked else ''}")
        self.repeated, self.masked = repeated, masked
        self._widen: int | None = None  # the mask's rank, when it is expanded to the keys' length
        self._caches: tuple | None = None  # (key, value) caches whose window Slice keeps them whole
        # the exporter's own shape arithmetic still reads the repeated keys (Shape nodes the attention
        # stage left dead until clean-up): replace the outputs only, and drop what nothing reads
        self.remove_nodes = False

    def _kv(self, op, present, prefix: str):
        if not self.repeated:
            return present
        unsqueezed = op.Unsqueeze(present, pattern.ANY_VALUE, _outputs=[f"{prefix}_unsqueezed"])
        expanded = op.Expand(unsqueezed, pattern.ANY_VALUE, _outputs=[f"{prefix}_expanded"])
        return op.Reshape(expanded, pattern.ANY_VALUE, _allow_other_attributes=True, _outputs=[f"{prefix}_repeated"])

    def pattern(self, op, query, past_key, key, past_value, value, mask):
        present_key = op.Concat(past_key, key, _outputs=["present_key"])
        present_value = op.Concat(past_value, value, _outputs=["present_value"])
        inputs = [query, self._kv(op, present_key, "k"), self._kv(op, present_value, "v")]
        if self.masked:
            inputs.append(mask)
        y = op.Attention(*inputs, _allow_other_attributes=True, _outputs=["attention"])
        return y, present_key, present_value

    def check(self, context, query, present_key, present_value, attention, **bindings) -> pattern.MatchResult:
        result = pattern.MatchResult()
        problem = opset_problem(context, "Attention", 23) or self._problem(query, present_key, present_value,
                                                                            attention, bindings)
        return result.fail(problem) if problem else result

    def _problem(self, query, present_key, present_value, attention, bindings) -> str | None:
        node = attention.producer()
        if len(node.outputs) > 1 and any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return "the attention node's other outputs are read"
        if node.attributes.get_int("is_causal", 0):
            return "the attention is causal by its attribute, whose diagonal would move by the past's length"
        for present, what in ((present_key, "key"), (present_value, "value")):
            problem = _concat_problem(present, what)
            if problem:
                return problem
        if query.shape is None or len(query.shape) != 4 or not isinstance(query.shape[1], int):
            return "the query is not known to be rank 4 with a static head count"
        self._caches = None
        if self.masked:
            self._caches = _whole_window(bindings.get("mask"), present_key, present_value)
            problem = None if self._caches else _mask_problem(bindings.get("mask"), present_key)
            self._widen = _mask_rank(bindings.get("mask")) if problem else None
            if problem and not self._widen:
                return problem + "; its rank is not known either, so it cannot be expanded to it"
        for value, what in ((query, "query"), (bindings.get("mask"), "mask")):
            if value is not None and _reads(value, {present_key.producer(), present_value.producer()}):
                return (f"the {what} is computed from the present keys or values (a Shape of them, say), which "
                        "the op with a cache writes: it would read its own output")
        if present_key.producer() is present_value.producer():
            return "the keys and the values are one cache (one Concat), which the op writes as two presents"
        heads = present_key.producer().inputs[0].shape[1]
        if self.repeated:
            for present, what, prefix in ((present_key, "key", "k"), (present_value, "value", "v")):
                n, problem = _repeat_problem(present, bindings[f"{prefix}_unsqueezed"], bindings[f"{prefix}_expanded"],
                                             bindings[f"{prefix}_repeated"], what)
                if problem:
                    return problem
                if query.shape[1] != heads * n:
                    return f"the query has {query.shape[1]} heads, not the {what}'s {heads} x {n}"
        elif query.shape[1] != heads:
            return f"the query has {query.shape[1]} heads and the cache {heads}"
        return None

    def rewrite(self, op, query, past_key, key, past_value, value, attention, mask=None, **_):
        node = attention.producer()
        attributes = {k: a.value for k, a in node.attributes.items()}
        if self.masked and self._widen:  # (module docstring: the mask to the keys' length, P + S)
            static = key.shape is not None and len(key.shape) == 4 and isinstance(key.shape[2], int)
            # (a static new length as a constant: a Shape of the 4-D keys would keep them for the 3-D form)
            new = op.Constant(value_ints=[key.shape[2]]) if static else op.Shape(key, start=2, end=3)
            length = op.Add(op.Shape(past_key, start=2, end=3), new)
            keys = op.Concat(op.Constant(value_ints=[1] * (self._widen - 1)), length, axis=0)
            rows = mask.producer() if mask.producer() is not None and mask.producer().op_type == "Expand" else None
            # under the attention stage's Expand over the query's rows, which the 3-D form reads
            mask = op.Expand(op.Expand(rows.inputs[0], keys), rows.inputs[1]) if rows else op.Expand(mask, keys)
        if self.masked and self._caches:  # (module docstring: the window keeps the whole cache)
            past_key, past_value = self._caches
        return op.Attention(query, key, value, mask if self.masked else None, past_key, past_value,
                            _outputs=3, **attributes)


def rules() -> list:
    return [AttentionWithPast.rule(repeated=r, masked=m) for r in (True, False) for m in (True, False)]
