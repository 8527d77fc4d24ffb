"""Cross-layer equalisation (CLE): balance the per-channel weight ranges of two convolutions.

Nagel et al., "Data-Free Quantization Through Weight Equalization and Bias Correction"
(ICCV 2019). Per-tensor int8 weights lose the small channels of a layer whose channel
ranges differ widely; CLE moves range from one layer into the next, computing the same
function, so both quantise well. It runs after the folds, before quantisation.

Algebra. For a pair conv1 -> [between] -> conv2, where output channel i of conv1 is input
channel i of conv2, and any s_i > 0:

    W1'[i] = W1[i] / s_i      b1'[i] = b1[i] / s_i      W2'[:, i] = W2[:, i] * s_i

(conv2's bias unchanged) is exact when every op between commutes with the scale,
f(x / s) = f(x) / s. With r1_i = max |W1[i]| (over all but the output axis) and
r2_i = max |W2[.., i, ..]| (input channel i of conv2, over its output channels and
kernel), s_i = sqrt(r1_i / r2_i) makes both ranges sqrt(r1_i * r2_i); s_i = 1 when r1_i or
r2_i is 0. For grouped conv2 (group g, W2 [Cout, Cin/g, k...]), input channel i is index
i % (Cin/g) on axis 1 of the output channels of group i // (Cin/g); depthwise (g = C) is
the common case (MobileNetV2: pointwise -> ReLU6 -> depthwise -> ReLU6 -> pointwise).

Pairs that share a conv form chains (a -> b -> c: b's input channels belong to one pair,
its output channels to the next). A chain is balanced by sweeping over its pairs, each
sweep rebalancing every pair given the others' scales and multiplying into that pair's
total, until no pair moves by more than a quarter of the dtype's tolerance (below), at
most ``MAX_SWEEPS`` sweeps. The sweeps work on max |W| per (output, input) channel, in
float64; each weight is rewritten once, cast back to its dtype once.

Ops between the convs (the table ``BETWEEN``):

    Relu, LeakyRelu, PRelu, Identity,  unchanged: positive-homogeneous (PRelu's slope needs
    Abs, Neg                           no constant: it is not downstream of conv1)
    Clip(x, lo, hi)                    not homogeneous: becomes Max(Min(x, hi / s), lo / s),
                                       or Relu(x) then Min(x, hi / s) when lo = 0 (a Relu
                                       after a conv folds into ONNX Runtime's quantised
                                       conv); a missing bound is left out
    Min / Max with a constant c        Min(x / s, c / s) = Min(x, c) / s: c is divided

The bounds become constants of shape [C, 1, ..., 1] (the conv output's rank minus one).
The Min/Max form is what the pass writes, so a second run reads it back.

Legality, each failure a refusal with its reason (never a silent skip). A candidate is a
``Conv`` whose output reaches the data input of another ``Conv`` through at most
``MAX_BETWEEN`` element-wise ops of the default domain, in the same graph:

1. conv1's output and each op's output between have exactly one consumer and are not
   graph outputs (every reader would see rescaled channels).
2. Each op between is in ``BETWEEN``; others are refused ("Sigmoid(x/s) != Sigmoid(x)/s").
   Clip bounds and Min/Max operands are constants, one value per channel at most, with
   lo <= hi; Clip becomes Min/Max only from opset 8 (before it they do not broadcast).
3. Both weights, and conv1's bias, are constants (initializers that are not graph inputs,
   or Constant nodes); the weights are float32 or float16 and agree on the channel count.
4. The rescaled weights, biases and bounds stay finite and are not flushed to zero in their
   dtype (float16), else the whole chain is refused.
5. A weight or bias another node also uses is copied privately (the report counts the
   bytes); the other user keeps the original.

A chain whose pairs all need scales within max(1e-6, the dtype's epsilon) of 1 is left
untouched, with no record and no refusal: a second run on the pass's own output is a
no-op. Every tensor whose values are rescaled (conv1's output, the outputs between) gets a
new name (``..._equalized``), so a name means the same values before and after; the
record's ``output`` is the chain's last output, which keeps its values.
"""

from __future__ import annotations

__all__ = ["EqualizePass", "ChainBalance", "chain_scales"]

import dataclasses
import logging
import re
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from opfuse.core.algebra import cast_back
from opfuse.core.analysis import Constant, NameTable, Scope, describe, find_constant, iter_scopes, node_label
from opfuse.core.activations import clip_bounds
from opfuse.core.edit import add_constant, drop_if_unused
from opfuse.passes.base import OpfusePass
from opfuse.report import FusionRecord, Reason
from opfuse.core.ops import ELEMENTWISE_KINDS, OpKind, int_attr, is_op, op_info, op_kind

logger = logging.getLogger(__name__)

NOOP_TOLERANCE = 1e-6  # |log s| below this (or the dtype's epsilon, if larger) counts as 1
MAX_SWEEPS = 100  # a chain of p pairs converges like cos(pi / (p + 1))**(2 * sweeps)
MAX_BETWEEN = 3  # element-wise ops searched between two convs (Relu + Min + Identity)
DTYPES = ("float32", "float16")
_SUFFIX = re.compile(r"_equalized(_\d+)?$")

# op between the convs -> what equalisation does to it
BETWEEN: dict[str, str] = {
    "Relu": "keep",  # max(x/s, 0) = max(x, 0)/s
    "LeakyRelu": "keep",  # x/s < 0 exactly when x < 0
    "PRelu": "keep",  # slope * x/s = (slope * x)/s; the slope is not rescaled
    "Identity": "keep",
    "Abs": "keep",  # |x/s| = |x|/s
    "Neg": "keep",
    "Clip": "clip",  # -> Max(Min(x, hi/s), lo/s), or Relu then Min(x, hi/s) when lo = 0
    "Min": "bound",  # Min(x/s, c/s) = Min(x, c)/s
    "Max": "bound",  # Max(x/s, c/s) = Max(x, c)/s
}
# ops that commute with the scale (or would, once folded) but that the pass does not rewrite
_NOT_HANDLED = {
    "BatchNormalization": "is not folded yet (run fold-batchnorm before equalize)",
    "Mul": "is not one of the ops equalisation looks through",
    "Div": "is not one of the ops equalisation looks through",
    "Dropout": "is not one of the ops equalisation looks through (remove it for inference)",
}


@dataclasses.dataclass(frozen=True)
class ChainBalance:
    """The scales that balance a chain of convolutions, and how they were found."""

    scales: list[np.ndarray]  # per pair, float64: divide conv p's output channels, multiply conv p+1's inputs
    sweeps: int
    converged: bool
    imbalance: float  # max |log s| any pair needed before rescaling (0: already balanced)


def chain_scales(
    weights: Sequence[np.ndarray], groups: Sequence[int], *, tolerance: float = NOOP_TOLERANCE / 4,
    max_sweeps: int = MAX_SWEEPS,
) -> ChainBalance:
    """Balance the chain weights[0] -> weights[1] -> ... (Conv layout [Cout, Cin/g, k...])."""
    absmax = [np.abs(np.asarray(w, np.float64)).reshape(w.shape[0], w.shape[1], -1).max(axis=2) for w in weights]
    scales = [np.ones(w.shape[0]) for w in weights[:-1]]

    def step(p: int) -> np.ndarray:
        s_in = scales[p - 1] if p > 0 else None
        s_out = scales[p + 1] if p + 1 < len(scales) else None
        r1 = _output_ranges(absmax[p], groups[p], s_in) / scales[p]
        r2 = _input_ranges(absmax[p + 1], groups[p + 1], s_out) * scales[p]
        return _balancing(r1, r2)

    imbalance = max((_log_spread(step(p)) for p in range(len(scales))), default=0.0)
    for sweep in range(1, max_sweeps + 1):
        worst = 0.0
        for p in range(len(scales)):
            factor = step(p)
            scales[p] = scales[p] * factor
            worst = max(worst, _log_spread(factor))
        if worst < tolerance:
            return ChainBalance(scales, sweep, True, imbalance)
    return ChainBalance(scales, max_sweeps, False, imbalance)


def _output_ranges(absmax: np.ndarray, group: int, s_in: np.ndarray | None) -> np.ndarray:
    """max |W[o]| per output channel o, the input channels multiplied by s_in."""
    cout, cin_g = absmax.shape
    if s_in is not None:
        absmax = (absmax.reshape(group, cout // group, cin_g) * s_in.reshape(group, 1, cin_g)).reshape(cout, cin_g)
    return absmax.max(axis=1)


def _input_ranges(absmax: np.ndarray, group: int, s_out: np.ndarray | None) -> np.ndarray:
    """max |W[.., i, ..]| per input channel i (over its group's outputs), outputs divided by s_out."""
    cout, cin_g = absmax.shape
    if s_out is not None:
        absmax = absmax / s_out[:, None]
    return absmax.reshape(group, cout // group, cin_g).max(axis=1).reshape(-1)


def _balancing(r1: np.ndarray, r2: np.ndarray) -> np.ndarray:
    out = np.ones_like(r1)
    ok = (r1 > 0) & (r2 > 0) & np.isfinite(r1) & np.isfinite(r2)
    out[ok] = np.sqrt(r1[ok] / r2[ok])
    return out


def _log_spread(scale: np.ndarray) -> float:
    return float(np.max(np.abs(np.log(scale)))) if scale.size else 0.0


def _spread(ranges: np.ndarray) -> float:
    live = ranges[ranges > 0]
    return float(live.max() / live.min()) if live.size else 1.0


# -- what the pass reads -------------------------------------------------------------------------

@dataclasses.dataclass
class _Layer:
    node: ir.Node
    weight: Constant
    bias: Constant | None | Reason  # why, when the bias is not a constant
    group: int
    incoming: _Pair | None = None  # the pair this conv is the second of
    outgoing: _Pair | None = None  # the pair this conv is the first of
    arrays: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # input slot -> new array


@dataclasses.dataclass
class _Step:
    node: ir.Node
    action: str  # "keep", "clip", "bound"
    bounds: tuple[float | None, float | None] = (None, None)  # clip: (lo, hi); None = unbounded
    constant: Constant | None = None  # bound: the constant operand
    constant_index: int = 1
    parts: list[tuple[str, np.ndarray | None]] = dataclasses.field(default_factory=list)  # what it becomes


@dataclasses.dataclass
class _Pair:
    first: _Layer
    second: _Layer
    steps: list[_Step]
    pattern: str
    scale: np.ndarray | None = None


class EqualizePass(OpfusePass):
    """Balance the per-channel weight ranges of consecutive convolutions, exactly."""

    name = "equalize"
    bounds = True  # a Clip between may become per-channel Min/Max bounds


    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self._model, self._names = model, None
        modified = False
        for scope in list(iter_scopes(model)):
            layers: dict[ir.Node, _Layer | Reason] = {}
            pairs = []
            for node in list(scope.graph):
                if not is_op(node, "Conv"):
                    continue
                for path, second in list(_candidates(node, scope.graph)):
                    pair = _check(scope, layers, node, path, second, self.bounds)
                    if isinstance(pair, Reason):
                        self.refuse(_pattern(path), node, pair.sentence, anchor=second, scope=scope)
                    else:
                        pairs.append(pair)
            for chain in _chains(pairs):
                modified |= self._equalize(scope, chain)
        return ir.passes.PassResult(model, modified=modified)

    def _equalize(self, scope: Scope, chain: list[_Layer]) -> bool:
        pairs = [layer.outgoing for layer in chain[:-1]]
        dtype = chain[0].weight.array.dtype
        tolerance = max(NOOP_TOLERANCE, float(np.finfo(dtype).eps))
        weights = [layer.weight.array for layer in chain]
        balance = chain_scales(weights, [layer.group for layer in chain], tolerance=tolerance / 4)
        if balance.imbalance <= tolerance or all(_log_spread(s) <= tolerance for s in balance.scales):
            return False  # already balanced: nothing to write, nothing to report
        if not balance.converged:
            logger.info("equalisation from %s did not converge in %d sweeps",
                        describe(chain[0].node), balance.sweeps)
        for pair, scale in zip(pairs, balance.scales):
            pair.scale = scale
        problem = _prepare(chain, pairs, dtype)
        if problem:
            for pair in pairs:
                self.refuse(pair.pattern, pair.first.node, problem, anchor=pair.second.node, scope=scope)
            return False
        spreads = [_spreads(pair, lambda layer: layer.weight.array) for pair in pairs]

        if self._names is None:
            self._names = NameTable(self._model)
        written: list[list[tuple[ir.Value | None, int]]] = [[] for _ in pairs]  # (original, new bytes)
        for index, layer in enumerate(chain):
            for slot, array in layer.arrays.items():
                old = layer.node.inputs[slot]
                new = add_constant(scope, self._names, layer.node, array, _stem(old, layer.node, slot))
                layer.node.replace_input_with(slot, new)
                written[min(index, len(pairs) - 1)].append((old, int(array.nbytes)))
        removed: list[list[str]] = []
        for index, pair in enumerate(pairs):
            self._rename(pair.first.node.outputs[0])
            removed.append([])
            for step in pair.steps:
                if step.action == "clip":
                    removed[-1].append(step.node.name or step.node.op_type)
                written[index] += self._rewrite_step(scope, step)
        for old, _ in (w for ws in written for w in ws):
            drop_if_unused(old)

        end = chain[-1].node.outputs[0].name or ""
        for index, pair in enumerate(pairs):
            extra = sum(n for old, n in written[index] if old is not None and (old.uses() or old.is_graph_input()))
            after = _spreads(pair, lambda layer: layer.arrays[1])
            self.report.records.append(FusionRecord(
                pattern=pair.pattern, node=node_label(pair.first.node), removed=tuple(removed[index]),
                produced="", graph=scope.label, weight_bytes=sum(n for _, n in written[index]),
                extra_bytes=extra, detail=_detail(pair, spreads[index], after, balance), output=end,
            ))
        return True

    def _rewrite_step(self, scope: Scope, step: _Step) -> list[tuple[ir.Value | None, int]]:
        """Apply a step's new bounds; returns (original constant or None, new bytes)."""
        node = step.node
        if step.action == "keep":
            self._rename(node.outputs[0])
            return []
        if step.action == "bound":
            (_, array), = step.parts
            old = node.inputs[step.constant_index]
            new = add_constant(scope, self._names, node, array, _stem(old, node, step.constant_index))
            node.replace_input_with(step.constant_index, new)
            self._rename(node.outputs[0])
            return [(old, int(array.nbytes))]
        # Clip -> [Relu], [Min(x, hi/s)], [Max(x, lo/s)]
        out, value, nodes, written = node.outputs[0], node.inputs[0], [], []
        base = node.name or "clip"
        for op, array in step.parts:
            inputs = [value]
            if array is not None:
                inputs.append(add_constant(scope, self._names, node, array, f"{base}.{op.lower()}_bound"))
                written.append((None, int(array.nbytes)))
            value = ir.Value(name=self._names.fresh(f"{_SUFFIX.sub('', out.name or base)}_equalized"),
                             type=out.type, shape=out.shape)
            nodes.append(ir.Node("", op, inputs, name=self._names.fresh(f"{base}_{op.lower()}"), outputs=[value]))
        scope.container.insert_before(node, nodes)
        out.replace_all_uses_with(value)
        bounds = [v for v in node.inputs[1:] if v is not None]
        scope.container.remove(node, safe=True)
        return written + [(v, 0) for v in bounds]  # the old bounds go if nothing else uses them

    def _rename(self, value: ir.Value) -> None:
        """A rescaled tensor gets a new name: the old one meant other values."""
        value.name = self._names.fresh(f"{_SUFFIX.sub('', value.name or 'equalized')}_equalized")


class HomogeneousEqualizePass(EqualizePass):
    """:class:`EqualizePass` on the pairs whose ops between need no new bound: a Clip between
    (ReLU6) is refused rather than turned into a Relu and a per-channel Min, an op that ONNX
    Runtime's int8 conv does not absorb as it absorbs the Clip (the per-tensor quantisation
    preset: on MobileNetV2, whose pairs all have a ReLU6 between, equalising every pair cost
    speed for no SQNR: docs/results/measurements.md)."""

    name = "equalize-homogeneous"
    bounds = False


def _pattern(path: Sequence[ir.Node]) -> str:
    return "+".join(["Conv", *(n.op_type for n in path), "Conv"]) + " equalisation"


def _stem(old: ir.Value | None, node: ir.Node, slot: int) -> str:
    base = (old.name if old is not None and old.name else None) or f"{node.name or node.op_type}.{slot}"
    return f"{_SUFFIX.sub('', base)}_equalized"


# -- finding and checking candidates ---------------------------------------------------------------

def _candidates(conv: ir.Node, graph: ir.Graph):
    """(ops between, second conv) for every Conv the output reaches through element-wise ops."""
    stack: list[tuple[ir.Value, list[ir.Node]]] = [(conv.outputs[0], [])]
    seen: set[tuple[int, ...]] = set()
    while stack:
        value, path = stack.pop()
        for use in value.uses():
            node, index = use.node, use.idx
            if node.graph is not graph:
                continue
            key = tuple(map(id, [*path, node]))
            if key in seen:
                continue
            seen.add(key)
            if is_op(node, "Conv") and index == 0:
                yield path, node
            elif (len(path) < MAX_BETWEEN and op_kind(node) in ELEMENTWISE_KINDS and node.outputs
                  and (index == 0 or op_info(node).commutative)):
                stack.append((node.outputs[0], [*path, node]))


def _check(scope: Scope, layers: dict, first: ir.Node, path: list[ir.Node], second: ir.Node,
           bounds: bool = True) -> _Pair | Reason:
    """The pair, or why it cannot be equalised (rules 1-3 of the module docstring; without
    ``bounds``, a Clip that would become Min/Max too)."""
    for node in path:  # the op between first: the most basic reason
        if node.op_type not in BETWEEN:
            return _not_commuting(node)
    chain = [first, *path, second]
    for owner, nxt in zip(chain, chain[1:]):
        problem = _sole_use_problem(owner, nxt)
        if problem:
            return Reason(problem)
    a, b = (layers[n] if n in layers else layers.setdefault(n, _read_layer(n)) for n in (first, second))
    for layer in (a, b):
        if isinstance(layer, Reason):
            return layer
    if isinstance(a.bias, Reason):
        return a.bias
    channels, rank, dtype = a.weight.array.shape[0], a.weight.array.ndim, a.weight.array.dtype
    if b.weight.array.shape[1] * b.group != channels:
        return Reason(f"{describe(first)} has {channels} output channels but {describe(second)} "
                f"reads {b.weight.array.shape[1] * b.group}")
    if b.weight.array.dtype != dtype:
        return Reason(f"the weights of {describe(first)} and {describe(second)} differ in dtype")
    steps = []
    for node, value in zip(path, [first.outputs[0], *(n.outputs[0] for n in path)]):
        step = _read_step(node, value, scope.opset, channels, rank, dtype)
        if isinstance(step, Reason):
            return step
        if not bounds and step.action == "clip":
            return Reason(f"{describe(node)} would become per-channel Min/Max bounds, which ONNX Runtime's int8 "
                    "conv does not absorb as it absorbs the Clip (equalize-homogeneous; equalize takes the pair)")
        steps.append(step)
    return _Pair(a, b, steps, _pattern(path))


def _sole_use_problem(owner: ir.Node, nxt: ir.Node) -> str | None:
    value = owner.outputs[0]
    if value.is_graph_output():
        return f"the output of {describe(owner)} is a graph output, whose values equalisation would rescale"
    if any(v.uses() or v.is_graph_output() for v in owner.outputs[1:]):
        return f"{describe(owner)} has more outputs in use than the one equalisation would rescale"
    uses = value.uses()
    if len(uses) == 1 and uses[0].node is nxt:
        return None
    others = [u.node for u in uses if u.node is not nxt]
    names = ", ".join(describe(n) for n in others[:3]) + (" ..." if len(others) > 3 else "")
    return (f"the output of {describe(owner)} feeds {len(uses)} consumers (also {names}), which "
            f"would all see its rescaled channels; equalisation needs it to reach {describe(nxt)} alone")


def _read_layer(node: ir.Node) -> _Layer | Reason:
    weight = find_constant(node.inputs[1] if len(node.inputs) > 1 else None, f"weight of {describe(node)}")
    if isinstance(weight, Reason):
        return weight
    dtype = weight.array.dtype
    if dtype.name not in DTYPES:
        return Reason(f"the weight of {describe(node)} is {dtype.name}; equalisation handles {' and '.join(DTYPES)}")
    group = int_attr(node, "group", 1)
    if weight.array.ndim < 3 or group < 1 or weight.array.shape[0] % group:
        return Reason(f"the weight of {describe(node)} has shape {list(weight.array.shape)}, which is not a Conv "
                      "weight")
    bias: Constant | None | Reason = None
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        bias = find_constant(node.inputs[2], f"bias of {describe(node)}")
        if isinstance(bias, Constant) and bias.array.size != weight.array.shape[0]:
            bias = Reason(f"the bias of {describe(node)} has {bias.array.size} values, not one per output channel")
    return _Layer(node, weight, bias, group)


def _read_step(node: ir.Node, x: ir.Value, opset: int, channels: int, rank: int, dtype) -> _Step | Reason:
    op = node.op_type
    action = BETWEEN.get(op)
    if action is None:
        return _not_commuting(node)
    if action == "clip":
        bounds = _clip_bounds(node, opset, dtype)
        if isinstance(bounds, Reason):
            return bounds
        lo, hi = bounds
        if lo is None and hi is None:
            return _Step(node, "keep")  # no bound: the identity
        if opset < 8 and (hi is not None or lo != 0.0):
            return Reason(f"{describe(node)} must become Min/Max with per-channel bounds, which do not "
                    "broadcast before opset 8; convert the model to opset 8 or later")
        return _Step(node, "clip", bounds=bounds)
    if action == "bound":
        if len(node.inputs) != 2:
            return Reason(f"{describe(node)} has {len(node.inputs)} inputs; equalisation rescales a {op} of two")
        index = 1 if node.inputs[0] is x else 0
        found = find_constant(node.inputs[index], f"other operand of {describe(node)}")
        if isinstance(found, Reason):
            return Reason(f"{found.sentence}, and {op}(x/s, y) != {op}(x, y)/s unless y is a constant to rescale")
        shape = found.array.shape
        try:
            per_channel = (1, channels) + (1,) * (rank - 2)  # one value per channel at most
            fits = len(shape) <= rank and np.broadcast_shapes(shape, per_channel) == per_channel
        except ValueError:
            fits = False
        if not fits or found.array.dtype != dtype:
            return Reason(f"the constant of {describe(node)} ({found.array.dtype.name} {list(shape)}) does not "
                    f"broadcast as {dtype.name} along the {channels} channels")
        return _Step(node, "bound", constant=found, constant_index=index)
    return _Step(node, "keep")


def _not_commuting(node: ir.Node) -> Reason:
    op = node.op_type
    form = "x/s, y" if op_kind(node) is OpKind.BROADCAST else "x/s"
    why = _NOT_HANDLED.get(op, f"{op}({form}) != {op}({form.replace('/s', '')})/s")
    return Reason(f"{describe(node)} sits between the convs and {why}; equalisation handles Relu, "
            "LeakyRelu, PRelu, Clip, Abs, Neg and Min/Max with a constant there")


def _clip_bounds(node: ir.Node, opset: int, dtype) -> tuple[float | None, float | None] | Reason:
    """(lo, hi) of a Clip, None for a bound that is absent (or the dtype's own limit)."""
    bounds = clip_bounds(node, opset)
    if isinstance(bounds, Reason):
        return Reason(f"{bounds.sentence}; equalisation must divide each Clip bound by the channel's scale")
    limit = float(np.finfo(dtype).max)
    lo, hi = (None if abs(b) >= limit else b for b in bounds)
    return lo, hi


def _chains(pairs: list[_Pair]) -> list[list[_Layer]]:
    """The legal pairs joined into chains of layers, first conv first (one consumer each: no forks)."""
    for pair in pairs:
        pair.first.outgoing = pair
        pair.second.incoming = pair
    chains = []
    for pair in pairs:
        if pair.first.incoming is None:
            chain = [pair.first]
            while chain[-1].outgoing is not None:
                chain.append(chain[-1].outgoing.second)
            chains.append(chain)
    return chains


# -- the new arrays ----------------------------------------------------------------------------

def _prepare(chain: list[_Layer], pairs: list[_Pair], dtype) -> str | None:
    """Compute every rescaled array in ``dtype`` (rule 4); a problem stops the whole chain."""
    for index, layer in enumerate(chain):
        s_in = pairs[index - 1].scale if index > 0 else None
        s_out = pairs[index].scale if index < len(pairs) else None
        w = layer.weight.array
        cout, cin_g = w.shape[:2]
        factor = np.ones((cout, cin_g))
        if s_out is not None:
            factor /= s_out[:, None]
        if s_in is not None:
            factor = factor * np.broadcast_to(s_in.reshape(layer.group, 1, cin_g),
                                              (layer.group, cout // layer.group, cin_g)).reshape(cout, cin_g)
        scaled = w.astype(np.float64) * factor.reshape((cout, cin_g) + (1,) * (w.ndim - 2))
        layer.arrays[1], problem = cast_back(scaled, dtype, "weight", "oihw", layer.group, float(factor.min()))
        if problem:
            return f"{problem} in {describe(layer.node)}, so equalising its chain would break it"
        if s_out is not None and isinstance(layer.bias, Constant):
            bias = layer.bias.array.astype(np.float64) / s_out.reshape(layer.bias.array.shape)
            layer.arrays[2], problem = cast_back(bias, dtype, "bias")
            if problem:
                return f"{problem} in {describe(layer.node)}, so equalising its chain would break it"
    for pair in pairs:
        per_channel = pair.scale.reshape((-1,) + (1,) * (pair.first.weight.array.ndim - 2))
        for step in pair.steps:
            if step.action == "bound":
                wanted = [(step.node.op_type, step.constant.array.astype(np.float64))]
            elif step.action == "clip":
                lo, hi = step.bounds
                wanted = [("Relu", None)] if lo == 0.0 else []
                wanted += [("Min", np.float64(hi))] if hi is not None else []
                wanted += [("Max", np.float64(lo))] if lo not in (None, 0.0) else []
            else:
                continue
            for op, bound in wanted:
                array, problem = (None, None) if bound is None else cast_back(bound / per_channel, dtype, "bound")
                if problem:
                    return f"{problem} in {describe(step.node)}, so equalising its chain would break it"
                step.parts.append((op, array))
    return None


def _spreads(pair: _Pair, weight_of) -> tuple[float, float]:
    """max/min of conv1's per-output-channel ranges and of conv2's per-input-channel ranges."""
    def absmax(w):
        return np.abs(w.astype(np.float64)).reshape(w.shape[0], w.shape[1], -1).max(axis=2)
    return (_spread(_output_ranges(absmax(weight_of(pair.first)), pair.first.group, None)),
            _spread(_input_ranges(absmax(weight_of(pair.second)), pair.second.group, None)))


def _detail(pair: _Pair, before: tuple[float, float], after: tuple[float, float], balance: ChainBalance) -> str:
    first, second = describe(pair.first.node), describe(pair.second.node)
    sweeps = f"{balance.sweeps} sweep(s)" + ("" if balance.converged else " (not converged)")
    return (f"per-channel range spread (max/min): {first} outputs {before[0]:.3g} -> {after[0]:.3g}, "
            f"{second} inputs {before[1]:.3g} -> {after[1]:.3g}; scales {pair.scale.min():.3g}.."
            f"{pair.scale.max():.3g}, {sweeps}")
