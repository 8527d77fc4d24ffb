"""The PyTorch front end: capture an eval-mode module's graph, fold, fuse, verify, report.

``fuse(model, example_inputs=None, inplace=False)`` returns a new ``torch.fx.GraphModule``
and the :class:`opfuse.report.FusionReport` that says what was rewritten and what was
refused, with the same pattern vocabulary as the ONNX side. The pipeline is

    capture  torch.fx.symbolic_trace; where fx cannot trace (control flow on shapes or
             Python values) and example inputs are given, torch.export (specialised to
             their shapes), whose aten conv, linear and batch_norm calls on constant weights
             are lifted back to modules, so that one matcher serves both
    shapes   with example inputs, torch.fx's ShapeProp records every tensor's shape
    fold     BatchNorm into the Conv/ConvTranspose/Linear before it   (FOLD_PATTERNS)
    fuse     a conv's epilogue (activation, or residual add + ReLU) into one oneDNN kernel
             with pre-packed weights                              (ACTIVATIONS, ADDS)
    verify   with example inputs, both models run and every output is compared

Every rule is pattern (which nodes), check (a sentence when it is illegal here), rewrite.
The patterns are data in ``rules.py``, the capture is ``capture.py``, the algebra
``fold.py``, the fused kernels ``kernels.py``; this module is the fuser and its checks.
Verification (``check.py``) uses :mod:`opfuse.verify`'s tolerance policy, as the ONNX side does.
A failed check is a :class:`~opfuse.report.Refusal` in the report, never a silent skip.

Algebra (``fold.py``): BN is z = s * y + t per channel with s = gamma / sqrt(var + eps)
(eps from the BN module) and t = beta - mean * s; the producer becomes W' = s[o] * W[o],
b' = s * b + t (b = 0 without a bias; gamma = 1, beta = 0 when affine=False).

Legality of folding a BatchNorm into its producer P:
  1. P is a Conv{1,2,3}d, ConvTranspose{1,2,3}d or Linear module (exact type: a subclass
     may compute something else) and the BN a BatchNorm{1,2,3}d module; neither has hooks.
  2. The BN is in eval mode and tracks running statistics; otherwise it normalises each
     batch with that batch's own statistics, which no fixed weight can reproduce.
  3. P's output has no consumer but the BN: folding changes P's output for every reader.
  4. BN.num_features equals P's output channels; for Linear, P's output is 2-D (BN1d
     normalises dim 1, which is the Linear's feature dim only then), which needs shapes,
     so Linear+BN without example inputs is refused. (Unbatched Conv1d input followed by
     BatchNorm1d is the one case the rank check catches only with example inputs.)
  5. The folded weights fit the weight's dtype (no overflow, no channel flushed to zero).
Module reuse: a module called at several sites is never changed in place. Each folded or
fused site gets its own module (sites with identical folds share one); the original stays
for the sites that still call it, and the copies' bytes are reported as ``extra_bytes``.
The caller's model is deep-copied first unless ``inplace=True``, in which case the result
shares the modules it did not rewrite with the caller's model (which is still not changed).

Legality of fusing an epilogue E into a convolution C (oneDNN: kernels.py):
  1. C is a Conv or ConvTranspose module called with a single input, zero padding mode,
     numeric (or symmetric "same") padding and output_padding < stride; E is an activation in ACTIVATIONS whose
     parameters are constants, or an add of C's output and another tensor (alpha = 1; an
     in-place add must write into C's output, not into the other tensor), optionally
     followed by a ReLU.
  2. C's output has exactly one consumer, E (for Conv+Add+Relu, the add's only consumer is
     the ReLU): otherwise the others would read the activated values.
  3. This build's oneDNN runs E for C's rank and dtype, checked by a probe call (the
     binary add form exists for 2-D and 3-D convolutions only, not transposed).
When (3) fails the conv stays a plain (folded) conv followed by E, with the reason.
Convolutions without an epilogue also move to the oneDNN kernel when their weights can be
pre-packed (2-D/3-D): the packing, not the epilogue, is most of the measured speed-up.
"""

from __future__ import annotations

__all__ = ["fuse", "ACTIVATIONS", "FOLD_PATTERNS"]

import copy
import dataclasses
import logging
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from opfuse.report import FusionRecord, FusionReport, Refusal, Verification
from opfuse.torch.capture import _capture, _propagate_shapes
from opfuse.torch.check import _verify
from opfuse.torch.fold import FoldingError, fold_conv_bn_weights, fold_linear_bn_weights
from opfuse.torch.kernels import (
    ConvAddPointwise,
    ConvPointwise,
    Unary,
    binary_problem,
    kernels_available,
    pack_problem,
    unary_problem,
)
from opfuse.torch.rules import (
    ACTIVATIONS,
    BATCHNORM_TYPES,
    CONV_TRANSPOSE_TYPES,
    CONV_TYPES,
    FOLD_PATTERNS,
    INPLACE_ADDS,
    _arg,
    _exists,
    _has_hooks,
    _is_add,
    _key,
    _match_activation,
    _module,
    _name,
    _nbytes,
    _op_counts,
    _producer_kind,
    _set_submodule,
    _shape,
    aten,
)

log = logging.getLogger(__name__)

# -- the pass ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Rewrite:
    """A record whose extra bytes are known only at the end."""

    record: FusionRecord | None  # None: a conv only moved to the packed kernel
    source: nn.Module  # the module that was copied (it may stay in use elsewhere)
    copy: nn.Module  # the module this site now calls


_TRAINING_BN = ("the BatchNorm is in training mode, so it normalises with each batch's "
                "statistics; call model.eval() before fusing")


class _Fuser:
    def __init__(self, gm: fx.GraphModule, report: FusionReport, use_kernels: bool,
                 prepack: bool):
        self.gm = gm
        self.graph = gm.graph
        self.report = report
        self.use_kernels = use_kernels
        self.prepack = prepack
        self.rewrites: list[_Rewrite] = []
        self.copies: dict[tuple, nn.Module] = {}  # (source module, what) -> shared new module
        self.packed_convs = 0

    # naming and installation ---------------------------------------------------------------
    def _call_sites(self, node: fx.Node) -> list[fx.Node]:
        """The calls of ``node``'s module (fx names a module by one canonical path)."""
        return [n for n in self.graph.nodes if n.op == "call_module" and n.target == node.target]

    def _install(self, node: fx.Node, new: nn.Module, suffix: str) -> str:
        """Give ``new`` a module path for the site ``node``: the old module's own path when
        this is its only call site, else a fresh path next to it."""
        for m_name, m in self.gm.named_modules():
            if m is new:  # an identical rewrite already installed for another site
                return m_name
        if len(self._call_sites(node)) == 1 and not any(
            n.op == "get_attr" and n.target.startswith(node.target + ".")
            for n in self.graph.nodes
        ):
            target = node.target
        else:
            base, i = f"{node.target}_{suffix}", 1
            target = base
            while _exists(self.gm, target):
                i += 1
                target = f"{base}{i}"
        _set_submodule(self.gm, target, new)
        return target

    def _refuse(self, pattern: str, node: fx.Node, reason: str, anchor: fx.Node | None = None):
        self.report.refusals.append(
            Refusal(pattern, _name(node), reason, "" if anchor is None else _name(anchor))
        )
        log.debug("refused %s at %s: %s", pattern, _name(node), reason)

    # phase 1: fold BatchNorm ---------------------------------------------------------------
    def fold_batchnorms(self) -> None:
        for bn_node in list(self.graph.nodes):
            if bn_node.op == "call_function" and bn_node.target is aten.batch_norm.default:
                self._refuse("BatchNormalization", bn_node, _TRAINING_BN
                             if _arg(bn_node, 5, "training", False) else
                             "this batch_norm call follows no Conv, ConvTranspose or Linear "
                             "module with constant weights, so there is nothing to fold it into")
                continue
            bn = _module(self.gm, bn_node)
            if type(bn) not in BATCHNORM_TYPES:
                continue
            producer = bn_node.args[0] if bn_node.args else None
            pm = _module(self.gm, producer)
            kind = _producer_kind(pm)
            if kind is None:
                what = (type(pm).__name__ if pm is not None else
                        getattr(producer, "name", "an input") if isinstance(producer, fx.Node)
                        else "a constant")
                self._refuse("BatchNormalization", bn_node,
                             f"it follows {what}, not a Conv, ConvTranspose or Linear, so "
                             "there is no weight to fold it into")
                continue
            pattern = FOLD_PATTERNS[kind]
            reason = self._check_fold(kind, producer, pm, bn_node, bn)
            if reason is None:
                try:
                    folded = self._folded_copy(kind, pm, bn)
                except FoldingError as exc:
                    reason = f"the folded weights do not fit: {exc}"
            if reason is not None:
                self._refuse(pattern, bn_node, reason, producer)
                continue
            self._apply_fold(pattern, producer, pm, bn_node, bn, folded)

    def _check_fold(self, kind, producer, pm, bn_node, bn) -> str | None:
        if bn.training:
            return _TRAINING_BN
        if bn.running_mean is None or bn.running_var is None:
            return ("the BatchNorm has no running statistics (track_running_stats=False), so "
                    "it normalises with each batch's statistics even in eval mode")
        if _has_hooks(bn) or _has_hooks(pm):
            which = "BatchNorm" if _has_hooks(bn) else kind
            return f"the {which} module has forward hooks, which a fold would bypass"
        users = list(producer.users)
        if len(users) != 1:
            others = ", ".join(_name(u) for u in users if u is not bn_node)
            return (f"the {kind} output is also read by {others}, which needs the values "
                    "before BatchNorm")
        channels = pm.out_features if kind == "Linear" else pm.out_channels
        if bn.num_features != channels:
            return (f"the BatchNorm has {bn.num_features} features but the {kind} has "
                    f"{channels} output channels")
        out_shape = _shape(producer)
        if kind == "Linear":
            if out_shape is None:
                return ("the Linear output's rank is unknown: BatchNorm1d normalises dim 1, "
                        "which is the Linear's feature dim only for 2-D outputs; pass "
                        "example_inputs so opfuse can check")
            if len(out_shape) != 2:
                return (f"the Linear output is {len(out_shape)}-D, so BatchNorm1d normalises "
                        "dim 1, which is not the Linear's feature dim")
        elif out_shape is not None:
            rank = (CONV_TYPES.get(type(pm)) or CONV_TRANSPOSE_TYPES.get(type(pm))) + 2
            if len(out_shape) != rank:
                return (f"the {kind} runs on an unbatched input, so the BatchNorm normalises "
                        "another dim than its channels")
        return None

    def _folded_copy(self, kind: str, pm: nn.Module, bn: nn.Module) -> nn.Module:
        key = (pm, bn, "fold")
        if key in self.copies:
            return self.copies[key]
        if kind == "Linear":
            w, b = fold_linear_bn_weights(pm.weight, pm.bias, bn.running_mean, bn.running_var,
                                          bn.eps, bn.weight, bn.bias)
        else:
            w, b = fold_conv_bn_weights(pm.weight, pm.bias, bn.running_mean, bn.running_var,
                                        bn.eps, bn.weight, bn.bias,
                                        transpose=kind == "ConvTranspose", groups=pm.groups)
        folded = copy.deepcopy(pm)
        folded.weight = nn.Parameter(w, requires_grad=pm.weight.requires_grad)
        folded.bias = nn.Parameter(b, requires_grad=pm.weight.requires_grad)
        self.copies[key] = folded
        return folded

    def _apply_fold(self, pattern, producer, pm, bn_node, bn, folded) -> None:
        sites = len(self._call_sites(producer))
        target = self._install(producer, folded, "bn_folded")
        bn_name, anchor = _name(bn_node), _name(producer)
        producer.target = target
        bn_node.replace_all_uses_with(producer)
        self.graph.erase_node(bn_node)
        detail = f"eps={bn.eps:g}" + ("" if bn.affine else ", affine=False") + (
            ", bias created" if pm.bias is None else "")
        if sites > 1:
            detail += (f"; the module is called at {sites} sites, so the fold went into a copy "
                       "(sites with the same BatchNorm share one)")
        record = FusionRecord(pattern, anchor, (bn_name,), target,
                              weight_bytes=_nbytes(folded.weight, folded.bias), detail=detail)
        self.rewrites.append(_Rewrite(record, pm, folded))

    # phase 2: epilogues --------------------------------------------------------------------
    def fuse_epilogues(self) -> None:
        """Activations first, then residual adds (each add picks the conv operand that can
        absorb it), then the convs left without an epilogue move to packed kernels."""
        if not self.use_kernels:
            return
        for node in list(self.graph.nodes):
            if self._conv_kind(node) is not None:
                self._fuse_activation(node)
        for node in list(self.graph.nodes):
            if _is_add(node):
                self._fuse_add(node)
        for node in list(self.graph.nodes):
            if self._conv_kind(node) == "Conv":
                self._pack_only(node)

    def _conv_kind(self, node: fx.Node) -> str | None:
        """"Conv"/"ConvTranspose" for a call of a (still plain) conv module, else None."""
        if node.op != "call_module":
            return None
        kind = _producer_kind(self.gm.get_submodule(node.target))
        return kind if kind in ("Conv", "ConvTranspose") else None

    def _kernel_problem(self, node: fx.Node, conv: nn.Module) -> str | None:
        """Why this conv cannot become a oneDNN kernel module at all, or None."""
        if len(node.args) != 1 or node.kwargs:
            return "the conv is called with more than its input (output_size?)"
        if _has_hooks(conv):
            return "the conv module has forward hooks, which a fused kernel would bypass"
        if conv.padding_mode != "zeros":
            return (f"padding_mode '{conv.padding_mode}' pads outside the convolution; the "
                    "fused kernel only zero-pads")
        if _numeric_padding(conv) is None:
            return f"padding={conv.padding!r} is asymmetric, which the fused kernel cannot express"
        if conv.weight.dtype not in (torch.float32, torch.bfloat16):
            return f"oneDNN's fused convolution does not take {conv.weight.dtype} weights"
        output_padding = getattr(conv, "output_padding", ())
        if any(p >= s for p, s in zip(output_padding, conv.stride)):
            return (f"output_padding {tuple(output_padding)} is not smaller than the stride "
                    f"{tuple(conv.stride)}, which oneDNN's deconvolution cannot express")
        return None

    def _fuse_activation(self, node: fx.Node) -> None:
        conv, kind = self.gm.get_submodule(node.target), self._conv_kind(node)
        users = list(node.users)
        matches = [(u, act) for u in users if (act := _match_activation(self.gm, u))]
        if not matches:
            return
        if len(users) > 1:
            for u, (suffix, _) in matches:
                self._refuse(f"{kind}+{suffix}", u, _multiple_readers(kind, users), node)
            return
        epi, (suffix, unary) = matches[0]
        pattern = f"{kind}+{suffix}"
        rank, transposed = conv.weight.dim() - 2, kind == "ConvTranspose"
        module = _module(self.gm, epi)
        problem = (
            self._kernel_problem(node, conv)
            or ("the activation module has forward hooks, which a fused kernel would bypass"
                if module is not None and _has_hooks(module) else None)
            or unary_problem(unary, rank, transposed, conv.weight.dtype)
        )
        if problem:
            self._refuse(pattern, epi, problem, node)
            return
        new = self._kernel(ConvPointwise, conv, unary, rank, transposed)
        self._replace_chain(pattern, node, conv, [epi], new, (node.args[0],))

    def _fuse_add(self, add: fx.Node) -> None:
        """Fuse ``add`` into the first of its operands that is a conv able to absorb it."""
        operands = [a for a in add.args[:2] if isinstance(a, fx.Node)]
        convs = [a for a in operands if self._conv_kind(a) is not None]
        if not convs or len(operands) < 2:
            return  # no conv operand, or a constant addend: not this pattern
        relu = None
        if len(add.users) == 1:
            (user,) = add.users
            act = _match_activation(self.gm, user)
            if act is not None and act[1] == Unary("relu"):
                relu = user
        problems = []
        for conv_node in convs:
            kind = self._conv_kind(conv_node)
            problem = self._add_problem(add, conv_node, kind)
            if problem is None:
                return self._apply_add(add, conv_node, kind, relu)
            problems.append((conv_node, kind, problem))
        conv_node, kind, problem = problems[0]
        pattern = f"{kind}+Add" + ("+Relu" if relu is not None else "")
        self._refuse(pattern, add, problem, conv_node)

    def _add_problem(self, add: fx.Node, conv_node: fx.Node, kind: str) -> str | None:
        conv = self.gm.get_submodule(conv_node.target)
        users = list(conv_node.users)
        if len(users) > 1:
            return _multiple_readers(kind, users)
        if add.kwargs.get("out") is not None:
            return "the add writes into an out= tensor"
        alpha = _arg(add, 2, "alpha", 1)
        if alpha != 1:
            return f"the add scales its second operand (alpha={alpha}), which the kernel cannot"
        a, b = add.args[0], add.args[1]
        if a is b:
            return "the conv output is added to itself"
        if _key(add) in INPLACE_ADDS and a is not conv_node:
            return ("the in-place add writes into the other operand, which later readers "
                    "would no longer see updated")
        if kind == "ConvTranspose":
            return "oneDNN has no fused transposed convolution + add"
        return self._kernel_problem(conv_node, conv) or binary_problem(
            Unary(), conv.weight.dim() - 2, conv.weight.dtype)

    def _apply_add(self, add: fx.Node, conv_node: fx.Node, kind: str, relu) -> None:
        conv = self.gm.get_submodule(conv_node.target)
        rank = conv.weight.dim() - 2
        other = add.args[1] if add.args[0] is conv_node else add.args[0]
        pattern, unary, chain = f"{kind}+Add", Unary(), [add]
        if relu is not None:
            relu_module = _module(self.gm, relu)
            problem = ("the ReLU module has forward hooks, which a fused kernel would bypass"
                       if relu_module is not None and _has_hooks(relu_module)
                       else binary_problem(Unary("relu"), rank, conv.weight.dtype))
            if problem:
                self._refuse(f"{kind}+Add+Relu", relu, problem, conv_node)
            else:
                pattern, unary, chain = f"{kind}+Add+Relu", Unary("relu"), [add, relu]
        new = self._kernel(ConvAddPointwise, conv, unary, rank, False)
        self._replace_chain(pattern, conv_node, conv, chain, new, (conv_node.args[0], other))

    def _kernel(self, cls, conv, unary, rank, transposed) -> nn.Module:
        key = (conv, cls, unary)
        if key in self.copies:
            return self.copies[key]
        prepack = self.prepack and pack_problem(rank, transposed, conv.weight.dtype) is None
        new = cls(
            conv.weight, conv.bias, stride=conv.stride, padding=_numeric_padding(conv),
            dilation=conv.dilation, groups=conv.groups, transposed=transposed,
            output_padding=getattr(conv, "output_padding", None), unary=unary, prepack=prepack,
        )
        self.copies[key] = new
        return new

    def _replace_chain(self, pattern, conv_node, conv, chain, new, args) -> None:
        sites = len(self._call_sites(conv_node))
        anchor = _name(conv_node)
        removed = tuple(_name(n) for n in chain)
        last = chain[-1]
        target = self._install(conv_node, new, "fused")
        with self.graph.inserting_before(last):
            fused = self.graph.call_module(target, args)
        fused.meta.update(last.meta)
        input_shape = _shape(conv_node.args[0])
        last.replace_all_uses_with(fused)
        for n in reversed([conv_node, *chain]):
            self.graph.erase_node(n)
        if input_shape is not None and new.prepack:
            new.pack(input_shape)
        detail = f"oneDNN {new.epilogue()}" + (", pre-packed weights" if new.prepack else "")
        if sites > 1:
            detail += (f"; the conv is called at {sites} sites, so the kernel is a copy "
                       "(sites with the same epilogue share one)")
        record = FusionRecord(pattern, anchor, removed, target,
                              weight_bytes=_nbytes(new.weight, new.bias), detail=detail)
        self.rewrites.append(_Rewrite(record, conv, new))

    def _pack_only(self, node: fx.Node) -> None:
        """No epilogue: still move a 2-D/3-D conv to the kernel when its weights can be packed."""
        conv = self.gm.get_submodule(node.target)
        rank, dtype, transposed = conv.weight.dim() - 2, conv.weight.dtype, False
        if (not self.prepack or self._kernel_problem(node, conv)
                or pack_problem(rank, transposed, dtype)
                or unary_problem(Unary(), rank, transposed, dtype)):
            return
        new = self._kernel(ConvPointwise, conv, Unary(), rank, transposed)
        target = self._install(node, new, "packed")
        input_shape = _shape(node.args[0])
        node.target = target
        if input_shape is not None:
            new.pack(input_shape)
        self.packed_convs += 1
        self.rewrites.append(_Rewrite(None, conv, new))

    # bookkeeping -----------------------------------------------------------------------------
    def records(self) -> list[FusionRecord]:
        """The records, with ``extra_bytes``: per source module, the bytes of the distinct
        copies made from it, less one copy when the source itself is gone (it was replaced,
        not duplicated). The total goes on the first record made from that source."""
        alive = {id(m) for m in self.gm.modules()}
        by_source: dict[int, list[_Rewrite]] = {}
        for rw in self.rewrites:
            by_source.setdefault(id(rw.source), []).append(rw)
        extra: dict[int, int] = {}
        for source_id, rws in by_source.items():
            distinct = list({id(rw.copy): rw.copy for rw in rws}.values())
            total = sum(_module_bytes(c) for c in distinct)
            if source_id not in alive:
                total -= _module_bytes(distinct[0])
            first = next((rw for rw in rws if rw.record is not None), None)
            if first is not None and total > 0:
                extra[id(first)] = total
        return [dataclasses.replace(rw.record, extra_bytes=extra.get(id(rw), 0))
                for rw in self.rewrites if rw.record is not None]


def _module_bytes(m: nn.Module) -> int:
    return _nbytes(getattr(m, "weight", None), getattr(m, "bias", None))


def _multiple_readers(kind: str, users: list[fx.Node]) -> str:
    return (f"the {kind} output is read by {len(users)} nodes "
            f"({', '.join(_name(u) for u in users)}); fusing would hide the values before the "
            "epilogue from the others")


def _numeric_padding(conv: nn.Module) -> list[int] | None:
    rank = conv.weight.dim() - 2
    if not isinstance(conv.padding, str):
        return list(conv.padding)
    if conv.padding == "valid":
        return [0] * rank
    total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
    return None if any(t % 2 for t in total) else [t // 2 for t in total]


# -- entry point ---------------------------------------------------------------------------------


def fuse(
    model: nn.Module,
    example_inputs: Any = None,
    inplace: bool = False,
    *,
    kernels: bool = True,
    prepack: bool = True,
    verify: bool = True,
    requires_grad: bool = False,
) -> tuple[nn.Module, FusionReport]:
    """Fold BatchNorms and fuse conv epilogues of an eval-mode ``model``.

    Works the same inside ``torch.inference_mode()`` and ``torch.no_grad()``. The fused
    module's parameters do not require grad (it is for inference) unless
    ``requires_grad``; with ``inplace`` the modules it shares with ``model`` keep theirs.
    """
    with torch.inference_mode(False), torch.no_grad():
        fused, report = _fuse(model, example_inputs, inplace, kernels=kernels, prepack=prepack,
                              verify=verify)
    if not requires_grad:
        shared = {id(p) for p in model.parameters()} if inplace else set()
        for p in fused.parameters():
            if id(p) not in shared:
                p.requires_grad_(False)
    return fused, report


def _fuse(
    model: nn.Module,
    example_inputs: Any,
    inplace: bool,
    *,
    kernels: bool,
    prepack: bool,
    verify: bool,
) -> tuple[nn.Module, FusionReport]:
    """The body of :func:`fuse`.

    ``example_inputs`` (a tensor or a tuple of positional inputs) is optional; with it
    opfuse knows every tensor's shape (checks that need ranks, weights pre-packed for that
    shape), can capture with torch.export where torch.fx cannot trace, and verifies the
    result against ``model``. ``kernels=False`` folds only and keeps plain torch modules
    (exportable); ``prepack=False`` uses the fused kernels without packed weights.
    Returns ``(fused_module, report)``; ``model`` itself is never modified.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    elif example_inputs is not None:
        example_inputs = tuple(example_inputs)
    report = FusionReport(model=type(model).__name__, target="torch")
    work = model if inplace else copy.deepcopy(model)
    gm, how, failure = _capture(work, example_inputs)
    if gm is None:
        report.refusals.append(Refusal("Capture", type(model).__name__, failure))
        return work, report
    report.passes = [how, "fold_batchnorm"] + (["fuse_epilogues"] if kernels else [])
    if how == "torch.export":
        report.notes.append("captured with torch.export because torch.fx could not trace it; "
                            "the result is specialised to the example inputs' shapes")
    report.ops_before = _op_counts(gm)
    if example_inputs is not None and (problem := _propagate_shapes(gm, example_inputs)):
        report.notes.append(f"shapes unknown (ShapeProp failed: {problem})")

    use_kernels = kernels
    if use_kernels and (problem := kernels_available()):
        report.notes.append(f"fused oneDNN kernels not used: {problem}")
        use_kernels = False
    fuser = _Fuser(gm, report, use_kernels, prepack)
    fuser.fold_batchnorms()
    fuser.fuse_epilogues()
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    report.records = fuser.records()
    report.ops_after = _op_counts(gm)
    if fuser.packed_convs:
        report.notes.append(
            f"{fuser.packed_convs} convolution(s) without an epilogue run on oneDNN's kernel "
            "with pre-packed weights")
    training = sorted({type(m).__name__ for m in model.modules() if m.training})
    if verify and example_inputs is not None and training:
        report.verification = Verification(
            runtime=f"torch {torch.__version__} eager", inputs="example_inputs",
            skipped=f"modules in training mode ({', '.join(training)}) depend on batch "
                    "statistics or randomness, and running them would update their state")
    elif verify and example_inputs is not None:
        report.verification = _verify(model, gm, example_inputs)
        if not report.verification.ok:
            log.warning("opfuse.torch.fuse: the fused model differs from the original")
    return gm, report
