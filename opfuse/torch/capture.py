"""Graph capture for the torch wing: torch.fx, or torch.export lifted back to modules.

:func:`_capture` tries ``torch.fx.symbolic_trace`` first; where fx cannot trace (control
flow on shapes or Python values) and example inputs are given, ``torch.export`` instead
(specialised to their shapes), after which :func:`_lift_aten` turns its aten conv, linear
and batch_norm calls on constant weights back into modules, so that one matcher serves
both captures. :func:`_propagate_shapes` records every tensor's shape with ShapeProp.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils import _pytree as pytree

from opfuse.torch.rules import _arg, _exists, _set_submodule, aten
from opfuse.core.ops import first_line


def _capture(model: nn.Module, example_inputs) -> tuple[fx.GraphModule | None, str, str]:
    """(graph module, how it was captured, why capture failed)."""
    try:
        return fx.symbolic_trace(model), "torch.fx", ""
    except Exception as exc:  # noqa: BLE001 - any trace failure
        fx_error = first_line(exc, limit=160)
    if example_inputs is None:
        return None, "", (f"torch.fx cannot trace it ({fx_error}); pass example_inputs so "
                          "opfuse can capture it with torch.export instead")
    try:
        ep = torch.export.export(model, tuple(example_inputs), strict=False)
        gm = ep.module()
        _lift_aten(gm)
        return gm, "torch.export", ""
    except Exception as exc:  # noqa: BLE001
        return None, "", (f"neither torch.fx ({fx_error}) nor torch.export "
                          f"({first_line(exc, limit=160)}) can capture it")


_ATEN_CONV = {aten.conv1d.default: nn.Conv1d, aten.conv2d.default: nn.Conv2d,
              aten.conv3d.default: nn.Conv3d}
_ATEN_CONV_T = {aten.conv_transpose1d.default: nn.ConvTranspose1d,
                aten.conv_transpose2d.input: nn.ConvTranspose2d,
                aten.conv_transpose3d.input: nn.ConvTranspose3d}


def _lift_aten(gm: fx.GraphModule) -> None:
    """Turn torch.export's aten conv/linear/batch_norm calls on constant weights back into
    modules, so that one matcher serves both captures. Calls sharing a weight share a module,
    so module reuse stays visible."""
    graph = gm.graph
    lifted: dict[tuple, str] = {}
    ranks: dict[fx.Node, int] = {}
    producers: dict[fx.Node, str] = {}

    def attr(node):
        if node is None:
            return None
        if isinstance(node, fx.Node) and node.op == "get_attr":
            return node.target
        return False  # computed: cannot lift

    def tensor(target):
        t = gm.get_parameter(target) if _is_param(gm, target) else gm.get_buffer(target)
        return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)

    def install(key, make, names):
        if key not in lifted:
            module = make()
            parent = names[0].rpartition(".")[0]
            target = (parent or "lifted") + "_" + type(module).__name__.lower()
            i = 1
            while _exists(gm, target):
                i += 1
                target = f"{parent or 'lifted'}_{type(module).__name__.lower()}{i}"
            _set_submodule(gm, target, module)
            lifted[key] = target
        return lifted[key]

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        t = node.target
        if t in _ATEN_CONV or t in _ATEN_CONV_T or t is aten.linear.default:
            w, b = attr(_arg(node, 1, "weight")), attr(_arg(node, 2, "bias"))
            if not w or b is False:
                continue
            weight = tensor(w)
            rank = weight.dim() - 2
            if t is aten.linear.default:
                hp: tuple = ()

                def make(weight=weight, b=b):
                    m = nn.Linear(weight.shape[1], weight.shape[0], bias=b is not None,
                                  device="meta")
                    m.weight, m.bias = weight, None if b is None else tensor(b)
                    return m
            else:
                transposed = t in _ATEN_CONV_T
                if transposed:
                    names = ("stride", "padding", "output_padding", "groups", "dilation")
                    defaults = (1, 0, 0, 1, 1)
                else:
                    names = ("stride", "padding", "dilation", "groups")
                    defaults = (1, 0, 1, 1)
                values = {n: _arg(node, 3 + i, n, d)
                          for i, (n, d) in enumerate(zip(names, defaults))}
                hp = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                  for k, v in values.items()))
                if any(isinstance(v, fx.Node) for v in values.values()):
                    continue

                def make(weight=weight, b=b, values=values, transposed=transposed, t=t):
                    cls = _ATEN_CONV_T[t] if transposed else _ATEN_CONV[t]
                    groups = values["groups"]
                    c_in, c_out = ((weight.shape[0], weight.shape[1] * groups) if transposed
                                   else (weight.shape[1] * groups, weight.shape[0]))
                    kw = {k: v for k, v in values.items() if k != "groups"}
                    m = cls(c_in, c_out, tuple(weight.shape[2:]), groups=groups,
                            bias=b is not None, device="meta", **kw)
                    m.weight, m.bias = weight, None if b is None else tensor(b)
                    return m
            target = install((t, w, b, hp), make, (w,))
            with graph.inserting_before(node):
                new = graph.call_module(target, (node.args[0],))
            new.meta.update(node.meta)
            ranks[new] = rank
            producers[new] = target
            node.replace_all_uses_with(new)
            graph.erase_node(node)
        elif t is aten.batch_norm.default:
            producer = node.args[0]
            if producer not in ranks:
                continue
            parts = [attr(_arg(node, i, n)) for i, n in
                     enumerate(("input", "weight", "bias", "running_mean", "running_var"))][1:]
            if any(p is False for p in parts):
                continue
            wt, bt, mt, vt = parts
            training = bool(_arg(node, 5, "training", False))
            if training:  # left as a call; reported with the training-mode reason
                continue
            momentum, eps = _arg(node, 6, "momentum", 0.1), _arg(node, 7, "eps", 1e-5)
            rank = ranks[producer]

            def make(wt=wt, bt=bt, mt=mt, vt=vt, rank=rank, training=training,
                     momentum=momentum, eps=eps, producer=producer):
                cls = (nn.BatchNorm1d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[max(rank, 0)]
                pm = gm.get_submodule(producers[producer])
                features = pm.out_features if isinstance(pm, nn.Linear) else pm.out_channels
                m = cls(features, eps=eps, momentum=momentum, affine=wt is not None,
                        track_running_stats=mt is not None, device="meta")
                if wt is not None:
                    m.weight, m.bias = tensor(wt), tensor(bt)
                if mt is not None:
                    m.running_mean, m.running_var = gm.get_buffer(mt), gm.get_buffer(vt)
                    m.num_batches_tracked = torch.tensor(0)
                return m.train(training)

            target = install(("bn", wt, bt, mt, vt, training, eps), make,
                             (mt or wt or "batchnorm",))
            with graph.inserting_before(node):
                new = graph.call_module(target, (producer,))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    gm.recompile()


def _is_param(gm: nn.Module, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def _clone_inputs(example_inputs: tuple) -> tuple:
    """Fresh copies: a model may write into its inputs."""
    return pytree.tree_map(lambda a: a.clone() if isinstance(a, torch.Tensor) else a,
                           example_inputs)


def _propagate_shapes(gm: fx.GraphModule, example_inputs: tuple) -> str | None:
    """Record every node's shape (ShapeProp), in eval mode so that no BatchNorm updates its
    statistics; returns why it failed, or None."""
    modes = {m: m.training for m in gm.modules()}
    for m in modes:  # not gm.eval(): torch.export's modules refuse it
        m.training = False
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*_clone_inputs(example_inputs))
    except Exception as exc:  # noqa: BLE001
        return first_line(exc, limit=160)
    finally:
        for m, training in modes.items():
            m.training = training
    return None
