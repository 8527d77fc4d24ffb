"""Shared machinery of every fold: absorb a per-channel affine consumer into its producer.

A fold pass names which consumers it matches (BatchNormalization; constant Add, Sub, Mul,
Div) and how to read each one as ``z = s * y + t`` per output channel; this module does
the rest, identically for all of them. The algebra is :mod:`opfuse.core.algebra`.

Producers (:data:`PRODUCERS`, read from the op table's weighted ops): Conv, ConvTranspose,
Gemm, and MatMul with a 2-D constant weight (BatchNormalization only; it becomes a Gemm,
the only way to carry a bias).

Between producer and consumer there may be Identity nodes and layout ops (Transpose,
Squeeze, Unsqueeze, Slice, Reshape, Flatten: :mod:`opfuse.passes.layout_chain`), which only
move elements. The consumer's rule then reads the channel axis where the layout ops put it
(``Conv -> Transpose(0,2,3,1) -> Add``: a [C] constant on the last axis is per channel).

Legality, checked in this order; every failure is a :class:`~opfuse.report.Refusal`:

1. The producer is in the same graph as the consumer.
2. The producer's output, and every Identity or layout output between it and the consumer,
   has exactly one consumer and is not a graph output (otherwise the unfolded value must stay).
3. Its weight, and its bias if it has one, are constants: initializers that are not also
   graph inputs, or Constant nodes, possibly behind Identity nodes.
4. The layout ops keep the channel axis as one whole axis (:mod:`opfuse.passes.layout_chain`),
   and the consumer is an affine map along that axis only (the pass's rule).
5. The folded weight and bias are representable in the weight's dtype: no value overflows
   to inf and the weights are not flushed to zero (float16, bfloat16).

Rewrite: the producer gets new, private weight and bias tensors (an original still used
elsewhere is kept, and the report counts the extra bytes); the consumer and the Identity
nodes between are removed; the producer's output takes over the consumer's output, and
its name (so a tensor name means the same values before and after). Through layout ops, only
the consumer goes: the last layout output takes over the consumer's output and its name, and
the values before it, which now hold folded numbers, get fresh names. Inputs, outputs and
unrelated nodes are untouched.
"""

from __future__ import annotations

__all__ = ["ChannelAffine", "Producer", "PRODUCERS", "FoldPass"]

import dataclasses
import re
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from opfuse.core import algebra
from opfuse.core.analysis import (
    Constant,
    NameTable,
    Scope,
    describe,
    find_constant,
    infer_shapes,
    node_label,
    iter_scopes,
    sole_use_problem,
)
from opfuse.core.edit import add_constant, drop_if_unused
from opfuse.passes.base import OpfusePass
from opfuse.passes.layout_chain import describe_chain, follow_channel, has_layout_op, trace_through_layout
from opfuse.report import FusionRecord, Reason
from opfuse.core.ops import FLOAT_DTYPES, ONNX_DOMAINS, OPS, WEIGHTED_OPS, WeightSpec, float_attr

# Transient metadata on values (never serialised; dropped by ``release``): on the values a
# fold creates, the float64 bias and the weight's source array with the product of the
# scales applied to it so far; on an original kept because another node still uses it, the
# indices of the records that counted a private copy of it (settled when the last user folds).
FOLDED_WEIGHT = "opfuse.folded_weight"
FOLDED_BIAS = "opfuse.folded_bias"
SHARED_BY = "opfuse.shared_by_records"
_FOLDED_SUFFIX = re.compile(r"_folded(_\d+)?$")
_AFFINE_SUFFIX = re.compile(r"_affine(_\d+)?$")  # a value renamed by an earlier fold through layout ops


@dataclasses.dataclass(frozen=True)
class ChannelAffine:
    """z = scale * y + shift along the output-channel axis (float64; None = 1 or 0)."""

    scale: np.ndarray | None
    shift: np.ndarray | None
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class ProducerShape:
    """What a fold needs to know about a producer's output."""

    channels: int
    rank: int | None  # None when unknown (MatMul without shape information)
    channel_axis: int  # counted from the front; -1 when only "the last axis" is known


@dataclasses.dataclass(frozen=True)
class Producer:
    """A linear operator whose output channels can absorb an affine map: a weighted op of
    the op table (:data:`opfuse.core.ops.OPS`, its :class:`~opfuse.core.ops.WeightSpec`)."""

    op_type: str
    spec: WeightSpec

    @property
    def weight_index(self) -> int:
        return self.spec.weight

    @property
    def bias_index(self) -> int | None:  # None: the op has no bias input (MatMul)
        return self.spec.bias

    def layout(self, node: ir.Node) -> algebra.WeightLayout:
        return self.spec.layout_of(node)

    def group(self, node: ir.Node) -> int:
        return self.spec.group_of(node)

    def output(self, node: ir.Node, weight: np.ndarray) -> ProducerShape | Reason:
        layout, group = self.layout(node), self.group(node)
        if layout in ("oihw", "iohw"):
            if weight.ndim < 3:
                return Reason(f"the weight of {describe(node)} has rank {weight.ndim}, not 3 or more")
            if layout == "iohw" and weight.shape[0] % group:
                return Reason(f"the weight of {describe(node)} does not split into {group} groups")
            return ProducerShape(algebra.output_channels(weight.shape, layout, group), weight.ndim, 1)
        if weight.ndim != 2:
            return Reason(f"the weight of {describe(node)} has rank {weight.ndim}, not 2")
        if not self.spec.batched:  # Gemm: [M, N]
            return ProducerShape(algebra.output_channels(weight.shape, layout), 2, 1)
        # MatMul: y[..., n] = sum_k a[..., k] * w[k, n]; channels are the last axis.
        a = node.inputs[0]
        rank = len(a.shape) if a is not None and a.shape is not None else None
        return ProducerShape(int(weight.shape[1]), rank, -1 if rank is None else rank - 1)


PRODUCERS: dict[str, Producer] = {op: Producer(op, OPS[op].weights) for op in sorted(WEIGHTED_OPS)}


@dataclasses.dataclass
class _Candidate:
    scope: Scope
    consumer: ir.Node
    side: int  # which consumer input carries the producer's output
    producer: ir.Node
    through: list[ir.Node]  # Identity nodes, nearest the consumer first (no layout op between)
    info: Producer  # the producer's row of PRODUCERS
    layout: list[ir.Node] = dataclasses.field(default_factory=list)  # Identity and layout ops, producer first
    producer_out: ProducerShape | None = None  # the producer's own output (``affine`` gets the consumer's view)


class FoldPass(OpfusePass):
    """Base class of the fold passes; subclasses give the consumer rule."""

    #: consumer op types this pass matches
    consumer_ops: frozenset[str] = frozenset()
    #: producer op types it folds into
    producer_ops: frozenset[str] = frozenset(PRODUCERS)

    def __init__(self, report=None, **options):
        super().__init__(report, **options)
        self._names: NameTable | None = None
        self._annotated: list[ir.Value] = []  # values carrying transient metadata

    def release(self) -> None:
        """Drop the chain metadata (it holds the source weights, possibly memory-mapped)."""
        for value in self._annotated:
            for key in (FOLDED_WEIGHT, FOLDED_BIAS, SHARED_BY):
                value.meta.pop(key, None)
        self._annotated.clear()

    # -- hooks for subclasses -----------------------------------------------------------
    def producer_sides(self, node: ir.Node) -> Sequence[int]:
        """Consumer inputs that may carry the producer's output."""
        return (0,)

    def is_candidate(self, cand: "_Candidate") -> bool:
        """Whether a producer/consumer pair is worth a refusal when it cannot fold."""
        return True

    def without_producer(self, node: ir.Node, scope: Scope) -> str | None:
        """Reason to report when no input comes from a producer (None: not a candidate)."""
        return None

    def affine(self, cand: _Candidate, out: ProducerShape) -> ChannelAffine | Reason:
        """Read the consumer as a per-channel affine map, or the :class:`Reason` it is not one."""
        raise NotImplementedError

    # -- the pass ------------------------------------------------------------------------
    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self._names = NameTable(model)
        self._model, self._shapes_inferred, self._symbolic_inferred = model, False, False
        modified = False
        for scope in list(iter_scopes(model)):
            for node in list(scope.graph):
                if node.graph is None or node.domain not in ONNX_DOMAINS:
                    continue
                if node.op_type in self.consumer_ops and self._fold_one(node, scope):
                    modified = True
        return ir.passes.PassResult(model, modified=modified)

    def _refuse(self, node: ir.Node, scope: Scope, reason: str, anchor: ir.Node | None) -> None:
        pattern = f"{anchor.op_type}+{node.op_type}" if anchor is not None else node.op_type
        self.refuse(pattern, node, reason, anchor=anchor, scope=scope)

    def _fold_one(self, node: ir.Node, scope: Scope) -> bool:
        candidates = []
        for side in self.producer_sides(node):
            if side >= len(node.inputs) or node.inputs[side] is None:
                continue
            producer, chain = trace_through_layout(node.inputs[side])
            if (
                producer is not None
                and producer.domain in ONNX_DOMAINS
                and producer.op_type in self.producer_ops
            ):
                through, layout = (chain[::-1], []) if not has_layout_op(chain) else ([], chain)
                candidates.append(
                    _Candidate(scope, node, side, producer, through, PRODUCERS[producer.op_type], layout)
                )
        candidates = [c for c in candidates if self.is_candidate(c)]
        if not candidates:
            reason = self.without_producer(node, scope)
            if reason:
                self._refuse(node, scope, reason, None)
            return False
        first_reason = None
        for cand in candidates:
            reason = self._check_and_rewrite(cand)
            if reason is None:
                return True
            first_reason = first_reason or (reason, cand.producer)
        self._refuse(node, scope, first_reason[0], first_reason[1])
        return False

    def _check_and_rewrite(self, cand: _Candidate) -> str | None:
        node, producer, info = cand.consumer, cand.producer, cand.info
        if producer.graph is not node.graph:
            return f"{describe(producer)} is in another graph than {describe(node)}"
        if len(producer.outputs) != 1:
            return f"{describe(producer)} has {len(producer.outputs)} outputs"
        chain = [producer, *reversed(cand.through), *cand.layout, node]
        for owner, nxt in zip(chain, chain[1:]):
            problem = sole_use_problem(owner.outputs[0], owner, nxt)
            if problem:
                return problem
        weight = find_constant(_input(producer, info.weight_index), f"weight of {describe(producer)}")
        if isinstance(weight, Reason):
            return weight.sentence
        bias: Constant | None = None
        if info.bias_index is not None and _input(producer, info.bias_index) is not None:
            found = find_constant(_input(producer, info.bias_index), f"bias of {describe(producer)}")
            if isinstance(found, Reason):
                return found.sentence
            bias = found
        if str(weight.array.dtype) not in FLOAT_DTYPES:
            return f"the weight of {describe(producer)} is {weight.array.dtype}, not floating point"
        out = info.output(producer, weight.array)
        if isinstance(out, ProducerShape) and out.rank is None and not self._shapes_inferred:
            self._infer_shapes()  # only when a rank is needed and unknown
            out = info.output(producer, weight.array)
        if isinstance(out, Reason):
            return out.sentence
        cand.producer_out = out
        affine = self._read_consumer(cand, out) if cand.layout else self.affine(cand, out)
        if isinstance(affine, Reason):
            return affine.sentence
        if info.spec.bias is None and affine.shift is not None and cand.producer_out.rank != 2:
            return (
                f"folding {describe(node)} gives {describe(producer)} a bias, which needs a Gemm, and its "
                "input is not known to be 2-D"
            )
        for what, arr in (("scale", affine.scale), ("shift", affine.shift)):
            if arr is not None and arr.size not in (1, out.channels):
                return (
                    f"the {what} has {arr.size} values but {describe(producer)} has "
                    f"{out.channels} output channels"
                )
        return self._rewrite(cand, weight, bias, affine, out)

    def _read_consumer(self, cand: _Candidate, out: ProducerShape) -> ChannelAffine | Reason:
        """The consumer's map through layout ops: along the axis they put the channels on, or,
        when they do not keep that axis whole, a map with one value (it commutes with any op
        that only moves elements)."""
        producer, node = cand.producer, cand.consumer
        if out.rank is None:
            return Reason(f"the rank of {describe(producer)}'s output is unknown, so its channel axis cannot be "
                          "followed")
        view = follow_channel(cand.layout, out.rank, out.channel_axis % out.rank, out.channels,
                              cand.scope.opset, self._infer_shapes)
        if isinstance(view, Reason):
            reason = Reason(f"{view.sentence}, between {describe(producer)} and {describe(node)}")
            fed = node.inputs[cand.side]
            if fed.shape is None:
                return reason
            scalar = self.affine(cand, ProducerShape(1, len(fed.shape), 0))
            return reason if isinstance(scalar, Reason) else scalar
        affine = self.affine(cand, ProducerShape(out.channels, view[0], view[1]))
        if isinstance(affine, Reason):
            return Reason(f"{affine.sentence} ({describe_chain(cand.layout)} puts {describe(producer)}'s output "
                          f"channels on axis {view[1]})")
        return affine

    def _infer_shapes(self, symbolic: bool = False) -> None:
        """onnx's shape inference, once per pass, when a rank or a dim is needed and unknown;
        with ``symbolic``, ONNX Runtime's too (once), for dims onnx's leaves unknown (a Reshape
        whose target is computed from shapes)."""
        if not self._shapes_inferred:
            infer_shapes(self._model)
            self._shapes_inferred = True
        if symbolic and not self._symbolic_inferred:
            from opfuse.core.symbolic_shapes import infer_symbolic_shapes  # (only when a computed reshape needs it)

            infer_symbolic_shapes(self._model)
            self._symbolic_inferred = True

    # -- rewrite -------------------------------------------------------------------------
    def _rewrite(
        self,
        cand: _Candidate,
        weight: Constant,
        bias: Constant | None,
        affine: ChannelAffine,
        out: ProducerShape,
    ) -> str | None:
        """Fold ``affine`` into the producer: new tensors (:func:`_fold_tensors`), the producer
        wired to them (:meth:`_install`), the consumer's output rerouted (:meth:`_reroute`),
        the originals dropped when unused and the rewrite recorded (:meth:`_account`)."""
        folded, problem = _fold_tensors(cand, weight, bias, affine, out)
        if problem:
            return problem
        edit = self._install(cand, folded)
        result = self._reroute(cand, edit)
        self._account(cand, folded, edit, affine, result)
        return None

    def _install(self, cand: _Candidate, folded: _FoldedTensors) -> _Edit:
        """The folded tensors as private constants, read by the producer (or, for a MatMul
        that gains a bias, by a new Gemm in its place)."""
        producer, info, scope = cand.producer, cand.info, cand.scope
        old_w = _input(producer, info.weight_index)
        old_b = _input(producer, info.bias_index) if info.bias_index is not None else None
        new_w = old_w
        if folded.weight is not None:
            new_w = self._new_constant(scope, producer, folded.weight, f"{_base(old_w, producer)}_folded")
            new_w.meta[FOLDED_WEIGHT] = (folded.source, folded.total)
            self._annotated.append(new_w)
        new_b = None
        if folded.bias is not None:
            base = _base(old_b, producer) if old_b is not None else f"{producer.name or 'producer'}.bias"
            new_b = self._new_constant(scope, producer, folded.bias, f"{base}_folded")
            new_b.meta[FOLDED_BIAS] = folded.exact_bias
            self._annotated.append(new_b)

        anchor = producer
        removed = [cand.consumer, *cand.through]
        if info.op_type == "MatMul" and new_b is not None:  # a bias: the MatMul becomes a Gemm
            anchor = ir.Node(
                "",
                "Gemm",
                [producer.inputs[0], new_w, new_b],
                name=self._names.fresh(producer.name or "Gemm"),
                outputs=[ir.Value(name=self._names.fresh(f"{producer.outputs[0].name}_gemm"))],
            )
            scope.container.insert_before(producer, anchor)
            removed.append(producer)
        else:
            if new_w is not old_w:
                producer.replace_input_with(info.weight_index, new_w)
            if new_b is not None and info.bias_index is not None:
                if len(producer.inputs) <= info.bias_index:
                    producer.resize_inputs(info.bias_index + 1)
                producer.replace_input_with(info.bias_index, new_b)
            if info.op_type == "Gemm":
                for attr in ("alpha", "beta"):
                    if attr in producer.attributes:
                        producer.attributes[attr] = ir.AttrFloat32(attr, 1.0)
        return _Edit(anchor, removed, old_w, new_w, old_b, new_b)

    def _reroute(self, cand: _Candidate, edit: _Edit) -> ir.Value:
        """The consumer's output is now computed by the anchor (or by the last layout op),
        under the consumer's name; the removed nodes leave the graph. Returns that value."""
        producer, node, anchor = cand.producer, cand.consumer, edit.anchor
        result = anchor.outputs[0]
        if cand.layout:  # the layout ops stay; what they read and write now holds folded values
            if anchor is not producer:
                producer.outputs[0].replace_all_uses_with(result)
            for value in [result, *(n.outputs[0] for n in cand.layout[:-1])]:
                value.name = self._names.fresh(f"{_AFFINE_SUFFIX.sub('', value.name or 'folded')}_affine")
            result = node.inputs[cand.side]
        tail = node.outputs[0]
        tail_name = tail.name
        result.type = tail.type if tail.type is not None else result.type
        if tail.shape is not None:
            result.shape = tail.shape
        tail.replace_all_uses_with(result, replace_graph_outputs=True)
        edit.former_inputs = [v for n in edit.removed for v in n.inputs if v is not None]
        cand.scope.container.remove(edit.removed, safe=True)
        if tail_name:  # the result is the consumer's tensor, under its name
            result.name = tail_name
        return result

    def _account(self, cand: _Candidate, folded: _FoldedTensors, edit: _Edit, affine: ChannelAffine,
                 result: ir.Value) -> None:
        """Originals no longer read are dropped; a shared one stays and its copy's bytes are
        counted (until its last user folds too); the rewrite is recorded."""
        producer, node = cand.producer, cand.consumer
        extra, still_shared, dropped = 0, [], []
        for old, new, array in ((edit.old_w, edit.new_w, folded.weight), (edit.old_b, edit.new_b, folded.bias)):
            if old is None or new is None or old is new:
                continue
            if drop_if_unused(old, dropped) is False:
                extra += int(array.nbytes)  # the original is shared: both copies stay
                still_shared.append(old)
        for value in edit.former_inputs:
            drop_if_unused(value, dropped)
        for value in dropped:  # an original that is gone costs the earlier copies nothing
            self._settle_shared(value)

        for old in still_shared:
            if SHARED_BY not in old.meta:
                old.meta[SHARED_BY] = []
                self._annotated.append(old)
            old.meta[SHARED_BY].append(len(self.report.records))
        self.report.records.append(
            FusionRecord(
                pattern=f"{producer.op_type}+{node.op_type}",
                node=node_label(producer),
                removed=tuple(node_label(n) for n in edit.removed),
                produced=edit.anchor.name or "",
                graph=cand.scope.label,
                weight_bytes=int(sum(a.nbytes for a in (folded.weight, folded.bias) if a is not None)),
                extra_bytes=extra,
                detail=affine.detail + (f" through {describe_chain(cand.layout)}" if cand.layout else ""),
                output=result.name or "",
            )
        )

    def _settle_shared(self, original: ir.Value) -> None:
        """The last user of a shared original folded too: earlier copies cost nothing now."""
        for index in original.meta.pop(SHARED_BY, ()):
            self.report.records[index] = dataclasses.replace(self.report.records[index], extra_bytes=0)

    def _new_constant(self, scope: Scope, before: ir.Node, array: np.ndarray, base: str) -> ir.Value:
        return add_constant(scope, self._names, before, array, base)


@dataclasses.dataclass
class _FoldedTensors:
    """The arrays a fold writes: None where that tensor stays as it is."""

    weight: np.ndarray | None = None  # in the weight's dtype
    source: np.ndarray | None = None  # what ``weight`` was computed from (an earlier fold's source)
    total: np.ndarray | None = None  # the product of the scales applied to ``source``
    bias: np.ndarray | None = None  # in the weight's dtype
    exact_bias: np.ndarray | None = None  # float64, before the cast


@dataclasses.dataclass
class _Edit:
    """The graph edit of one fold: the node that computes the result, what goes, and the
    weight and bias before and after."""

    anchor: ir.Node
    removed: list[ir.Node]
    old_w: ir.Value | None
    new_w: ir.Value | None
    old_b: ir.Value | None
    new_b: ir.Value | None
    former_inputs: list[ir.Value] = dataclasses.field(default_factory=list)


def _fold_tensors(
    cand: _Candidate, weight: Constant, bias: Constant | None, affine: ChannelAffine, out: ProducerShape
) -> tuple[_FoldedTensors, str | None]:
    """The folded weight and bias (float64 algebra, one rounding per chain of folds), or the
    sentence saying why they cannot be written (legality rule 5, and Gemm's alpha and C)."""
    producer, info, node = cand.producer, cand.info, cand.consumer
    layout, group = info.layout(producer), info.group(producer)
    folded = _FoldedTensors()
    scale = affine.scale
    b = None if bias is None else bias.value.meta.get(FOLDED_BIAS, bias.array.astype(np.float64))
    if info.op_type == "Gemm":
        # y = alpha * (A.B + (beta / alpha) * C): alpha joins the scale (one pass over B)
        alpha = float_attr(producer, "alpha", 1.0)
        if alpha == 0.0:
            return folded, f"{describe(producer)} has alpha=0, so its weight does not matter"
        if alpha != 1.0:
            scale = np.full(out.channels, alpha) if scale is None else scale * alpha
        if b is not None:
            b = b * (float_attr(producer, "beta", 1.0) / alpha)
            if b.ndim == 2 and b.shape[0] != 1:
                pass  # C per row ([M, 1] or [M, N]): the folded C stays [M, N]
            elif b.size not in (1, out.channels):
                return folded, f"the C input of {describe(producer)} has shape {list(b.shape)}"
            else:
                b = b.reshape(-1)
    if scale is not None:  # (a pure shift leaves the weight as it is)
        # A weight an earlier fold produced is recomputed from its source with the
        # product of the scales, so a chain of folds rounds once, not once per fold.
        folded.source, prior = weight.value.meta.get(FOLDED_WEIGHT, (weight.array, None))
        folded.total = np.broadcast_to(np.asarray(scale, np.float64).reshape(-1), (out.channels,))
        if prior is not None:
            folded.total = prior * folded.total
        folded.weight, problem = algebra.fold_weight(folded.source, folded.total, layout, group)
        if problem:
            return folded, f"{problem}, so folding {describe(node)} into {describe(producer)} would break it"
    folded.exact_bias = algebra.fold_bias(b, scale, affine.shift, out.channels)
    if folded.exact_bias is not None:
        folded.bias, problem = algebra.cast_back(folded.exact_bias, weight.array.dtype, "bias")
        if problem:
            return folded, f"{problem}, so folding {describe(node)} into {describe(producer)} would break it"
    return folded, None


def _input(node: ir.Node, index: int | None) -> ir.Value | None:
    if index is None or index >= len(node.inputs):
        return None
    return node.inputs[index]


def _base(value: ir.Value | None, producer: ir.Node) -> str:
    name = (value.name if value is not None and value.name else None) or producer.name or "weight"
    return _FOLDED_SUFFIX.sub("", name)  # a second fold into the same weight reuses the stem
