"""The graph onnxruntime-genai runs fastest on a CPU: each layer's attention as ``com.microsoft.GroupQueryAttention``.

What it does (:func:`group_query_attention`), on the optimised export (:mod:`opfuse.llm.export`, then
``opfuse.pipeline.optimize`` at ``--target onnxruntime``), layer by layer, before int4 quantisation:

- finds the attention of layer ``i`` from its cache: ``present.i.key = Concat(past_key_values.i.key,
  RotaryEmbedding(Transpose(Reshape(k))))``, ``present.i.value = Concat(past_key_values.i.value,
  Transpose(Reshape(v)))``, with ``q, k, v`` the three outputs of one ``Split`` of the packed QKV projection
  (``opfuse``'s MatMul-siblings packing; with a bias each, Qwen2's, added to each output, written as one
  Add of the three biases on the packed output), the query through a ``RotaryEmbedding`` on the same cos/sin, and
  the attention's output ``Reshape(Transpose(MatMul(probabilities, values)))`` found from the values;
- replaces all of it (head split, rotary of Q and K, the cache Concats, the repeated KV heads, the scaled
  scores, the causal and padding mask, Softmax, the weighted sum, the head merge) by one
  ``GroupQueryAttention(packed qkv, past key, past value, seqlens_k, total_sequence_length, cos_cache,
  sin_cache)`` with ``do_rotary`` 1 (the builder's form); ``seqlens_k`` and ``total_sequence_length``
  come from ``attention_mask`` (its row sums minus one, its length) as the builder computes them;
- the cos/sin tables (``[context, head_size / 2]``) are the graph's own rotary subgraph evaluated on
  ONNX Runtime at positions ``0 .. context - 1`` (so a scaled rotary, Llama 3's, is what the model
  computes, not a formula re-derived here);
- what is left unread (the mask arithmetic, the position ids' cos/sin) is removed, and the
  ``position_ids`` input with it when nothing reads it (the caller writes ``genai_config.json`` from the
  graph's inputs).

GroupQueryAttention's present key and value can share one buffer with the past (genai's
``past_present_share_buffer``): the cache is not copied into a new tensor at every step, the graph
as exported concatenates it (and its shape analysis and the repeated heads cost one Expand each).

Legality: GroupQueryAttention computes the export's attention when the mask is all ones (no padding:
one sequence, genai's batch of one) and the positions are ``past .. past + seq - 1`` (what genai
feeds): ``seqlens_k`` then is ``past + seq - 1`` and its rotary positions and causal mask are the
export's. A left-padded batch is not the same computation (GroupQueryAttention takes the valid tokens
as a prefix), as with the builder's graph. :func:`verify` runs the graph before and after on ONNX
Runtime on those inputs (a prompt with no past, one decode step after a past, a chunk after a past) and
the caller keeps the graph as it was when they differ. A graph that is not this form (no packed QKV,
another rotary, partial rotary, a site without its cache Concat) is left as it is, with the reason.
"""

from __future__ import annotations

__all__ = ["Rewritten", "group_query_attention", "verify"]

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from opfuse.core.ops import MS_DOMAIN as MS
from opfuse.core.ops import ONNX_DOMAINS


@dataclasses.dataclass
class Rewritten:
    layers: int  # GroupQueryAttention nodes written
    refused: list[str]  # layer: why it was left as it was
    removed_inputs: list[str]  # graph inputs nothing reads after the rewrite


class _Graph:
    def __init__(self, model: onnx.ModelProto):
        self.graph = model.graph
        self.refresh()

    def refresh(self):
        self.producer = {o: n for n in self.graph.node for o in n.output if o}
        self.consumers: dict[str, list] = {}
        for n in self.graph.node:
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)
        self.inits = {t.name: t for t in self.graph.initializer}
        self.inputs = {i.name for i in self.graph.input}
        self.outputs = {o.name for o in self.graph.output}

    def attrs(self, node) -> dict:
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def made_by(self, name: str, op: str, domain: str = ""):
        node = self.producer.get(name)
        domains = ONNX_DOMAINS if not domain else (domain,)
        return node if node is not None and node.op_type == op and node.domain in domains else None

    def scalar(self, name: str):
        if name in self.inits:
            value = numpy_helper.to_array(self.inits[name])
        else:
            node = self.made_by(name, "Constant")
            if node is None:
                return None
            value = numpy_helper.to_array(self.attrs(node)["value"])
        return float(value.reshape(-1)[0]) if value.size == 1 else None


def _heads_split(g: _Graph, name: str):
    """``name`` = Transpose([0, 2, 1, 3])(Reshape(x)): x, or None."""
    t = g.made_by(name, "Transpose")
    if t is None or list(g.attrs(t).get("perm", [])) != [0, 2, 1, 3]:
        return None
    r = g.made_by(t.input[0], "Reshape")
    return r.input[0] if r is not None else None


def _rotary(g: _Graph, name: str, head_size: int):
    """``name`` = RotaryEmbedding-23(x, cos, sin), full and not interleaved: (x, cos, sin), or None."""
    node = g.made_by(name, "RotaryEmbedding")
    if node is None or len(node.input) != 3:
        return None
    attrs = g.attrs(node)
    if attrs.get("interleaved", 0) or attrs.get("rotary_embedding_dim", 0) not in (0, head_size):
        return None
    return tuple(node.input)


def _forward_to(g: _Graph, start: str, op: str, through: frozenset) -> list:
    """The ``op`` nodes reached from ``start`` through nodes of the types ``through``."""
    found, seen, todo = [], set(), [start]
    while todo:
        name = todo.pop()
        for node in g.consumers.get(name, []):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == op:
                found.append((node, name))
            elif node.op_type in through:
                todo.extend(node.output)
    return found


_REPEAT = frozenset({"Unsqueeze", "Expand", "Reshape", "Transpose", "Mul", "Identity"})


def _site(g: _Graph, layer: int, heads: int, kv_heads: int, head_size: int):
    """(Split node, q rotary, attention output name, scale) of ``layer``, or a str: why not."""
    key, value = f"present.{layer}.key", f"present.{layer}.value"
    ck, cv = g.made_by(key, "Concat"), g.made_by(value, "Concat")
    if ck is None or cv is None:
        return "present key/value not a Concat of the past"
    if list(ck.input[:1]) != [f"past_key_values.{layer}.key"] or list(cv.input[:1]) != [f"past_key_values.{layer}.value"] \
            or len(ck.input) != 2 or len(cv.input) != 2:
        return "present key/value not Concat(past, new)"
    rotary_k = _rotary(g, ck.input[1], head_size)
    if rotary_k is None:
        return "the new keys not a full RotaryEmbedding-23"
    k_lin, v_lin = _heads_split(g, rotary_k[0]), _heads_split(g, cv.input[1])
    if k_lin is None or v_lin is None:
        return "keys or values not Transpose(Reshape(.)) of a projection"
    (k_src, k_bias), (v_src, v_bias) = _unbiased(g, k_lin), _unbiased(g, v_lin)
    split = g.producer.get(k_src)
    if split is None or split.op_type != "Split" or len(split.output) != 3 or list(split.output[1:]) != [k_src, v_src]:
        return "q, k, v not the three outputs of one Split (packed QKV)"
    sizes = split.input[1] if len(split.input) > 1 else ""
    if sizes not in g.inits or list(numpy_helper.to_array(g.inits[sizes])) != \
            [heads * head_size, kv_heads * head_size, kv_heads * head_size]:
        return "the packed QKV's split sizes are not the heads'"
    q_lin, q_bias = split.output[0], None
    q_adds = [n for n in g.consumers.get(q_lin, []) if n.op_type == "Add"]
    if len(q_adds) == 1 and _unbiased(g, q_adds[0].output[0])[1] is not None:
        q_lin, q_bias = q_adds[0].output[0], _unbiased(g, q_adds[0].output[0])[1]
    biases = (q_bias, k_bias, v_bias)
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return "a bias on some of q, k, v but not all"
    q_rot = None
    for node in g.consumers.get(q_lin, []):
        if node.op_type == "Reshape":
            for t in g.consumers.get(node.output[0], []):
                for r in g.consumers.get(t.output[0], []):
                    rot = _rotary(g, r.output[0], head_size)
                    if rot is not None and rot[1:] == rotary_k[1:] and _heads_split(g, rot[0]) == q_lin:
                        q_rot = r
    if q_rot is None:
        return "no RotaryEmbedding of the queries on the keys' cos/sin"
    weighted = [n for n, via in _forward_to(g, value, "MatMul", _REPEAT) if n.input[1] == via]
    if len(weighted) != 1:
        return f"the values reach {len(weighted)} MatMuls, not one"
    (pv,) = weighted
    merge_t = [n for n in g.consumers.get(pv.output[0], []) if n.op_type == "Transpose"]
    if len(merge_t) != 1 or list(g.attrs(merge_t[0]).get("perm", [])) != [0, 2, 1, 3]:
        return "the weighted values not Transpose([0, 2, 1, 3])"
    merge_r = [n for n in g.consumers.get(merge_t[0].output[0], []) if n.op_type == "Reshape"]
    if len(merge_r) != 1:
        return "the heads not merged by one Reshape"
    q_mul = [n for n in g.consumers.get(q_rot.output[0], []) if n.op_type == "Mul"]
    k_mul = [n for n, _ in _forward_to(g, key, "Mul", _REPEAT - {"Mul"})]
    factors = [g.scalar(n.input[1]) for n in q_mul + k_mul]
    # (not found: GroupQueryAttention's default, 1 / sqrt(head_size); verification decides)
    scale = factors[0] * factors[1] if len(q_mul) == 1 and len(k_mul) == 1 and None not in factors else None
    return split, q_rot, merge_r[0].output[0], scale, biases if q_bias is not None else None


def _unbiased(g: _Graph, name: str) -> tuple[str, str | None]:
    """``name`` = Add(x, b) of a 1-D initializer b (a projection's bias): (x, b); else (name, None)."""
    node = g.made_by(name, "Add")
    if node is not None and node.input[1] in g.inits and len(g.inits[node.input[1]].dims) == 1:
        return node.input[0], node.input[1]
    return name, None


def _rotary_tables(model: onnx.ModelProto, g: _Graph, cos: str, sin: str, context: int) -> tuple[np.ndarray, np.ndarray]:
    """The graph's cos and sin at positions 0 .. context - 1 ([context, head_size / 2] each)."""
    # (ONNX Runtime evaluates the graph's own rotary subgraph)
    import onnxruntime as ort

    nodes, todo, seen = [], [cos, sin], set()
    while todo:
        name = todo.pop()
        node = g.producer.get(name)
        if node is None or id(node) in seen:
            if node is None and name not in g.inits and name and name != "position_ids":
                raise ValueError(f"the rotary tables read {name}, not only position_ids")
            continue
        seen.add(id(node))
        nodes.append(node)
        todo.extend(i for i in node.input if i)
    order = {id(n): k for k, n in enumerate(model.graph.node)}
    nodes.sort(key=lambda n: order[id(n)])
    read = {i for n in nodes for i in n.input}
    graph = helper.make_graph(
        nodes, "rotary", [helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, context])],
        [helper.make_tensor_value_info(cos, TensorProto.FLOAT, None),
         helper.make_tensor_value_info(sin, TensorProto.FLOAT, None)],
        [g.inits[name] for name in read if name in g.inits])
    sub = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
    session = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    c, s = session.run(None, {"position_ids": np.arange(context, dtype=np.int64)[None]})
    return c.reshape(context, -1).astype(np.float32), s.reshape(context, -1).astype(np.float32)


def group_query_attention(model: onnx.ModelProto, *, layers: int, heads: int, kv_heads: int, head_size: int,
                          context: int) -> Rewritten:
    """Rewrite ``model`` (in place) as in the module docstring; what was done."""
    g = _Graph(model)
    sites, refused = {}, []
    for layer in range(layers):
        site = _site(g, layer, heads, kv_heads, head_size)
        if isinstance(site, str):
            refused.append(f"layer {layer}: {site}")
        else:
            sites[layer] = site
    if not sites:
        return Rewritten(0, refused, [])
    some = next(iter(sites.values()))
    cos, sin = some[1].input[1], some[1].input[2]
    cos_table, sin_table = _rotary_tables(model, g, cos, sin, context)
    graph = model.graph
    graph.initializer.extend([numpy_helper.from_array(cos_table, "cos_cache"),
                              numpy_helper.from_array(sin_table, "sin_cache"),
                              numpy_helper.from_array(np.array([1], np.int64), "gqa_axes_1"),
                              numpy_helper.from_array(np.array(1, np.int64), "gqa_one")])
    mask_nodes = [
        helper.make_node("ReduceSum", ["attention_mask", "gqa_axes_1"], ["gqa_mask_sum"], keepdims=0,
                         name="gqa_mask_sum"),
        helper.make_node("Sub", ["gqa_mask_sum", "gqa_one"], ["gqa_seqlens"], name="gqa_seqlens"),
        helper.make_node("Cast", ["gqa_seqlens"], ["seqlens_k"], to=TensorProto.INT32, name="gqa_seqlens_k"),
        helper.make_node("Shape", ["attention_mask"], ["gqa_mask_shape"], start=1, end=2, name="gqa_mask_shape"),
        helper.make_node("Squeeze", ["gqa_mask_shape"], ["gqa_total"], name="gqa_total"),
        helper.make_node("Cast", ["gqa_total"], ["total_sequence_length"], to=TensorProto.INT32,
                         name="gqa_total_sequence_length"),
    ]
    present = {f"present.{i}.{kv}" for i in sites for kv in ("key", "value")}
    out_of = {}  # attention output name -> its GroupQueryAttention
    for layer, (split, _, out, scale, biases) in sites.items():
        attrs = dict(num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0)
        if scale is not None:
            attrs["scale"] = scale
        qkv, before = split.input[0], []
        if biases is not None:  # the three biases as one, added to the packed projection
            packed = np.concatenate([numpy_helper.to_array(g.inits[b]) for b in biases])
            graph.initializer.append(numpy_helper.from_array(packed, f"gqa_qkv_bias_{layer}"))
            before = [helper.make_node("Add", [qkv, f"gqa_qkv_bias_{layer}"], [f"gqa_qkv_{layer}"],
                                       name=f"gqa_qkv_bias_add_{layer}")]
            qkv = f"gqa_qkv_{layer}"
        out_of[out] = [*before, helper.make_node(
            "GroupQueryAttention",
            [qkv, "", "", f"past_key_values.{layer}.key", f"past_key_values.{layer}.value", "seqlens_k",
             "total_sequence_length", "cos_cache", "sin_cache"],
            [out, f"present.{layer}.key", f"present.{layer}.value"], domain=MS,
            name=f"GroupQueryAttention_{layer}", **attrs)]
    kept = list(mask_nodes)
    for node in graph.node:
        if any(o in out_of for o in node.output):
            kept.extend(out_of[node.output[0]])
        elif not any(o in present for o in node.output):
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    _remove_unread(model)
    read = {i for n in graph.node for i in n.input}
    removed = [i.name for i in graph.input if i.name not in read and i.name not in {o.name for o in graph.output}]
    for name in removed:
        graph.input.remove(next(i for i in graph.input if i.name == name))
    if not any(d.domain == MS for d in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    return Rewritten(len(sites), refused, removed)


def _remove_unread(model: onnx.ModelProto) -> None:
    graph = model.graph
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in graph.node for i in n.input} | outputs
        dead = [n for n in graph.node if not any(o in read for o in n.output if o)]
        if not dead:
            break
        for n in dead:
            graph.node.remove(n)
    read = {i for n in graph.node for i in n.input}
    unread = [t for t in graph.initializer if t.name not in read]
    for t in unread:
        graph.initializer.remove(t)
    keep = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    infos = [v for v in graph.value_info if v.name not in keep]
    for v in infos:
        graph.value_info.remove(v)


def _feeds(inputs: set[str], layers: int, kv_heads: int, head_size: int, past: int, seq: int, seed: int,
           vocab: int) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {"input_ids": rng.integers(0, vocab, (1, seq), dtype=np.int64),
             "attention_mask": np.ones((1, past + seq), np.int64),
             "position_ids": np.arange(past, past + seq, dtype=np.int64)[None]}
    for i in range(layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((1, kv_heads, past, head_size)).astype(np.float32)
    return {k: v for k, v in feeds.items() if k in inputs}


def verify(before: str, after: str, *, layers: int, kv_heads: int, head_size: int, vocab: int,
           cases=((0, 7), (9, 1), (5, 3))) -> str:
    """"" when the graphs at ``before`` and ``after`` (files) agree on genai's inputs (module docstring)
    for each (past, seq) of ``cases``, else what differed."""
    # (ONNX Runtime: only when a rewrite is verified)
    import onnxruntime as ort

    from opfuse.runtime import give_back_memory  # (ONNX Runtime: as above)

    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.add_session_config_entry("session.disable_prepacking", "1")
    outputs = []  # per graph, per case: {output name: array}
    for path in (before, after):  # one session at a time: one copy of the weights in memory, not two
        s = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        names = {i.name for i in s.get_inputs()}
        outputs.append([dict(zip([o.name for o in s.get_outputs()],
                                 s.run(None, _feeds(names, layers, kv_heads, head_size, past, seq, past * 31 + seq,
                                                    vocab))))
                        for past, seq in cases])
        del s
        give_back_memory()  # (the session's weights: freed, and the heap's pages returned)
    for (past, seq), want_all, got_all in zip(cases, *outputs):
        for name, want in want_all.items():
            got = got_all[name]
            if got.shape != want.shape:
                return f"past {past}, {seq} new tokens: {name} shape {got.shape}, expected {want.shape}"
            scale = float(np.abs(want).max()) or 1.0
            diff = float(np.abs(got - want).max())
            if diff > 1e-4 * scale + 1e-5:
                return f"past {past}, {seq} new tokens: {name} max |diff| {diff:.3g} (scale {scale:.3g})"
    return ""
