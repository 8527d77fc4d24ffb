"""The ``onnxruntime`` target: ONNX Runtime's CPU provider and its contrib kernels, as data.

Epilogue kernels (domain ``com.microsoft``; :data:`KERNELS`):

    FusedConv(X, W, B?, Z?)   Y = act(Conv(X, W, B) + Z)        float32, float16
    FusedGemm(A, B, C?)       Y = act(alpha * A'B' + beta * C)   float32

The activations each runs, with how it writes their parameters (one row each: adding an
activation is adding its name to ``activations``, when the runtime's kernel parses it):

    op           FusedConv: activation_params     FusedGemm: activation_alpha/beta
    Relu         -                                -
    LeakyRelu    [alpha]                          alpha
    Sigmoid      -                                -
    Tanh         -                                -
    HardSigmoid  [alpha, beta]                    alpha, beta
    Clip         [min, max]                       (FusedGemm does not run Clip)
    HardSwish    -                                (nor HardSwish)

HardSwish: onnxruntime 1.32's FusedConv runs it, in the NCHWc layout too, float32 and
float16 (measured on this machine: identical to Conv then HardSwish), while the runtime's
own optimiser leaves Conv + HardSwish unfused. FusedGemm rejects both Clip and HardSwish
("unknown kernel type"). Neither runs Elu, Selu, Softplus, Gelu, Swish or PRelu: after a
layer these stay, each with that reason. ``FusedMatMul`` is the runtime's own (its transposes and
alpha folded into a MatMul); opfuse reads it in the runtime's graphs and never emits it.

Multi-op patterns (:data:`PATTERNS`, :mod:`opfuse.passes.patterns`) become the contrib
ops the CPU provider runs: LayerNormalization, SkipLayerNormalization, Gelu, FastGelu,
BiasGelu, SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, QuickGelu (SiLU is
QuickGelu with alpha 1), MultiHeadAttention and Attention, and RotaryEmbedding (the contrib op,
its caches the graph's own cos/sin tables with position ids over them; the standard op where
the model's opset is 23: :mod:`opfuse.passes.patterns.rotary`).

Dynamic int8 (what ``onnxruntime.quantization.quantize_dynamic`` writes) runs in the contrib
kernels :data:`INTEGER_MATMUL` names (:mod:`opfuse.passes.fuse_dynamic_int8`):

    DynamicQuantizeMatMul(A, B, b_scale, b_zp?, bias?)                   A float32
    MatMulIntegerToFloat(A, B, a_scale, b_scale, a_zp?, b_zp?, bias?)    A uint8

B int8 or uint8, 2-D; b_scale and b_zp one value or one per column ([N]); a_scale and a_zp one
value (onnxruntime 1.32's CPU kernels: MatMulIntegerToFloat is registered for a uint8 A only,
and a per-column B parameter must be [N] for the kernel's own per-column path).

Those are the fusions the measured choice (:mod:`opfuse.tune`, on by default: this target's
runtime is here) times family by family, attention's form included (written out,
MultiHeadAttention, or the standard Attention-23 with the opset raised to 23); what follows
is the default policy it replaces, which applies untimed (``--no-tune``).

Except in a KV-cache decode step (:data:`EXCEPTIONS`, :func:`decode_step_sites`): there
MultiHeadAttention ran slower than the graph as written, where the standard Attention-23 of
``--target onnx --opset 23`` ran faster (``benchmarks/decoders.py``; the ratios:
docs/results/measurements.md), so it is never written there. Untimed (``--no-tune``), such a graph gets the
standard Attention with the opset raised to 23, its KV cache taken in as past_key/past_value
(:mod:`opfuse.passes.patterns.kv_cache`, then its 3-D form, :mod:`~opfuse.passes.patterns.heads_3d`),
faster than the export on the Llama decode step, and the log says so; the exception's own
policy (kept written out, one refusal per site) is what a configuration without that form
follows. A decode step is recognised from the graph: a float rank-4 graph input (the
past keys or values, [batch, heads, past, head_dim]; or a sliding window of it, a Slice,
seen through TorchScript's one-input Concat copy of it) joined by a Concat along the
sequence axis (2) with a computed tensor (this step's keys or values), whose result is a
graph output (the present) or reaches a MatMul; the input's name (``past``, ``cache``) is
taken as the second signal in place of those two. Prefill graphs and encoders have no such
input and are fused as before.

The NCHWc layout (:func:`run_fusion`): at ENABLE_ALL, ONNX Runtime on x86 rewrites convs
into its blocked NCHWc layout and absorbs Add and activations itself. A FusedConv whose Z
comes from outside that layout (a graph input, a Relu...) stays outside it, and so does
its conv: :func:`layout_losses` runs the runtime on both graphs and names the fusions that
would cost a conv its layout; :func:`run_fusion` leaves those to the runtime and fuses
again (a fusion left out can change where the next block's Z comes from), at most
:data:`LAYOUT_ATTEMPTS` times; when the attempts run out it fuses once more with every
loss found excluded and says so.

Only a residual input can cost the layout: the runtime's NCHWc pass
(``nchwc_transformer.cc``, ``TransformConv``) takes ``Conv`` and ``com.microsoft.FusedConv``
alike, on the same conditions (a constant float 4-D weight, the channel and group counts,
a constant bias) and keeps the activation attribute, so a FusedConv without Z gets the
layout exactly when its Conv does (checked on this machine for every activation opfuse
fuses). :func:`takes_residual` says whether a model can get a fusion with Z at all; when
it cannot, no runtime session is built. That matters beyond the seconds: the runtime
names every node its layout pass creates by scanning all nodes
(``Graph::GenerateNodeName``), so a session at ENABLE_ALL costs O(convs x nodes): tens of
seconds on a long chain (docs/results/measurements.md).
"""

from __future__ import annotations

__all__ = [
    "TARGET",
    "KERNELS",
    "PATTERNS",
    "LAYOUT_ATTEMPTS",
    "run_fusion",
    "layout_losses",
    "takes_residual",
    "EXCEPTIONS",
    "decode_step_sites",
    "residual_add",
    "runtime_graph",
    "has_layout_pass",
    "INTEGER_MATMUL",
]

import onnx_ir as ir

from opfuse.core.analysis import NameTable, iter_scopes, trace_producer
from opfuse.report import FusionReport
from opfuse.runtime import optimized_graph
from opfuse.targets.kernels import ActivationEncoding, EpilogueKernel, IntegerMatMulKernels, PolicyException, Target
from opfuse.core.ops import MS_DOMAIN, WEIGHTED_OPS, is_op

_MLAS = frozenset({"Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid"})  # what both kernels run

KERNELS: dict[str, EpilogueKernel] = {
    "Conv": EpilogueKernel(
        "Conv", MS_DOMAIN, "FusedConv", dtypes=frozenset({"float32", "float16"}),
        steps=("residual", "activation"), activations=_MLAS | {"Clip", "HardSwish"}, residual_input=3,
        encoding=ActivationEncoding(params_attribute="activation_params"),
    ),
    "Gemm": EpilogueKernel(
        "Gemm", MS_DOMAIN, "FusedGemm", dtypes=frozenset({"float32"}),
        steps=("activation",), activations=_MLAS,
        encoding=ActivationEncoding(param_attributes=("activation_alpha", "activation_beta",
                                                      "activation_gamma")),
    ),
}
# the runtime's own kernels, which opfuse reads in its graphs and never emits
_RUNTIME_KERNELS = (
    EpilogueKernel("MatMul", MS_DOMAIN, "FusedMatMul", dtypes=frozenset({"float32", "float16"}),
                   steps=(), anchor_inputs=2, keeps_anchor_attributes=False, emitted=False),
)

INTEGER_MATMUL = IntegerMatMulKernels(
    MS_DOMAIN, "DynamicQuantizeMatMul", "MatMulIntegerToFloat", a_dtypes=frozenset({"uint8"}),
    b_dtypes=frozenset({"int8", "uint8"}), b_per_column=True,
)

# pattern (opfuse.passes.patterns) -> policy
PATTERNS: dict[str, str] = {
    "layer-norm": "fuse",
    "rms-norm": "fuse",
    "skip-layer-norm": "fuse",
    "skip-rms-norm": "fuse",
    "gelu": "fuse",
    "bias-gelu": "fuse",
    "silu": "fuse",
    "hardswish": "fuse",
    "rotary": "fuse",
    "self-attention": "fuse",
    "attention": "fuse",
    "matmul-add": "fuse",
}


# --- where the policy does not hold: a KV-cache decode step ---------------------------------

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})
_CACHE_NAMES = ("past", "cache")
# what lies between a cache and its MatMul, and between that MatMul and the Softmax (layout,
# GQA's repeat_kv, a scale split over q and k, the mask)
_BETWEEN = frozenset({"Transpose", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Tile", "Identity", "Cast",
                      "Mul", "Div", "Add", "Sub", "Where", "Slice"})
_HOPS = 10  # how far through them a site is looked for


def _reached(value: ir.Value, op_type: str, forward: bool = True) -> list[ir.Node]:
    """The ``op_type`` nodes ``value`` reaches (``forward``) or comes from, through :data:`_BETWEEN` ops."""
    found: list[ir.Node] = []
    frontier, seen = [value], set()
    for _ in range(_HOPS):
        step = []
        for v in frontier:
            if forward:
                nodes = [use.node for use in v.uses()]
            else:
                nodes = [v.producer()] if v.producer() is not None else []
            for node in nodes:
                if node in seen:
                    continue
                seen.add(node)
                if is_op(node, op_type):
                    found.append(node)
                elif is_op(node, *_BETWEEN):
                    step.extend(node.outputs if forward else [i for i in node.inputs if i is not None])
        frontier = step
    return found


def _cache_input(v: ir.Value) -> bool:
    """A float rank-4 graph input, or a Slice of one (a sliding-window cache keeps its last
    positions: Mistral's exports), seen through the copies an export leaves before clean-up
    (TorchScript's one-input Concat of the past, an Identity)."""
    producer = v.producer()
    if producer is not None and is_op(producer, "Slice"):
        v = producer.inputs[0]
    while v.producer() is not None and _copies(v.producer()):
        v = v.producer().inputs[0]
    return v.is_graph_input() and v.dtype in _FLOATS and v.shape is not None and len(v.shape) == 4


def _copies(node: ir.Node) -> bool:
    """An Identity, or a Concat of one input: its output is its input."""
    return (is_op(node, "Identity") or is_op(node, "Concat")) and len(node.inputs) == 1 and node.inputs[0] is not None


def _past_concat(node: ir.Node) -> bool:
    """A Concat along the sequence axis of the cache (:func:`_cache_input`) with a computed tensor."""
    if not is_op(node, "Concat") or len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return False
    axis = node.attributes.get_int("axis", 0)
    past = [v for v in node.inputs if _cache_input(v)]
    new = [v for v in node.inputs if v not in past and v.producer() is not None]
    return len(past) == 1 and len(new) == 1 and axis in (2, -2)


def decode_step_sites(model: ir.Model) -> list[tuple[ir.Node, tuple[ir.Node, ...]]]:
    """The attention sites of a KV-cache decode step (module docstring), one per Softmax the
    caches reach (its key and value Concats and MatMuls taken in); empty when ``model`` is
    not a decode step."""
    sites: dict[ir.Node, list[ir.Node]] = {}
    for node in model.graph:
        if not _past_concat(node):
            continue
        present = node.outputs[0]
        matmuls = _reached(present, "MatMul")
        named = any(word in (v.name or "").lower() for v in node.inputs if v.is_graph_input() for word in _CACHE_NAMES)
        if not (present.is_graph_output() or matmuls or named):
            continue
        softmaxes = [s for m in matmuls for s in _reached(m.outputs[0], "Softmax")]  # the keys' scores
        softmaxes += [s for m in matmuls for v in m.inputs if v is not None
                      for s in _reached(v, "Softmax", forward=False)]  # the values' weights
        site = softmaxes[0] if softmaxes else node
        sites.setdefault(site, []).extend((node, *matmuls))
    return [(site, tuple(n for n in dict.fromkeys(others) if n is not site)) for site, others in sites.items()]


EXCEPTIONS = (
    PolicyException(
        "attention", decode_step_sites, "keep",
        "a KV-cache decode step: ONNX Runtime's MultiHeadAttention runs one slower than the graph as written "
        "(measured: python benchmarks/decoders.py --graphs decode), so attention is kept written out here; "
        "--target onnx --opset 23 writes the standard Attention, which runs it faster",
        untimed=(("attention", "Attention-23"),), untimed_where=lambda m: [s for s in decode_step_sites(m)
                                                                           if is_op(s[0], "Softmax")],
        untimed_note=(
            "untimed policy for a KV-cache decode step: attention written as the standard Attention (opset raised "
            "to 23) with its cache as past_key/past_value where the graph allows it, the form benchmarks/decoders.py "
            "measured fastest (Llama decode at past 256, with every family on: 0.54x (IQR 0.47-0.63) of the "
            "export's time in the tuner's run, 0.74x in benchmarks/decoders.py's; MultiHeadAttention 1.27-1.50x)")),
)

LAYOUT_ATTEMPTS = 3  # fusion redone at most this often to keep the runtime's layout


# --- the runtime's own layout pass --------------------------------------------------------

def runtime_graph(model: ir.Model) -> list[tuple[str, str, str]]:
    """(domain, op_type, name) of the graph ONNX Runtime runs at ENABLE_ALL."""
    return [(n.domain, n.op_type, n.name) for n in optimized_graph(model, "all").graph.node]


def has_layout_pass(baseline_graph: list[tuple[str, str, str]]) -> bool:
    return any(domain.endswith("nchwc") for domain, _, _ in baseline_graph)


_RESIDUAL_ANCHORS = frozenset(op for op, kernel in KERNELS.items() if kernel.residual_input is not None)


def residual_add(node: ir.Node) -> bool:
    """Whether ``node`` is an Add that reads, past Identity nodes, the output of an op whose
    kernel takes a residual input Z (Conv): a candidate for a fused Z."""
    if not is_op(node, "Add"):
        return False
    for value in node.inputs:
        producer = trace_producer(value)[0] if value is not None else None
        if is_op(producer, *_RESIDUAL_ANCHORS):
            return True
    return False


def takes_residual(model: ir.Model) -> bool:
    """Whether an epilogue fusion could give a kernel a residual input Z (the one way a
    FusedConv can lose the NCHWc layout): the model has a :func:`residual_add`."""
    return any(residual_add(node) for scope in iter_scopes(model) for node in scope.graph)


def layout_losses(
    baseline_graph: list[tuple[str, str, str]], fused: ir.Model, emitted: dict[str, str]
) -> dict[str, str]:
    """Fusions that keep a conv out of ONNX Runtime's NCHWc layout at ENABLE_ALL.

    ``baseline_graph`` is :func:`runtime_graph` of the unfused model; ``emitted`` maps each
    fused node's name to a description of its epilogue. Returns {fused node name: reason}
    for those the runtime leaves outside the layout although it converts the unfused conv.
    Empty when the runtime has no NCHWc layout on this machine.
    """
    if not emitted or not has_layout_pass(baseline_graph):
        return {}
    outside = {name for domain, op, name in baseline_graph if "Conv" in op and not domain.endswith("nchwc")}
    losses = {}
    for domain, op, name in runtime_graph(fused):
        if name in emitted and op in ("FusedConv", "Conv") and not domain.endswith("nchwc") and name not in outside:
            losses[name] = (
                f"ONNX Runtime at ENABLE_ALL keeps a FusedConv with {emitted[name]} out of its "
                "NCHWc layout, which it gives the unfused conv (and then fuses the epilogue "
                "itself); left to the runtime (--runtime-level below all fuses it anyway)"
            )
    return losses


def run_fusion(model: ir.Model, names: list[str], report: FusionReport, *, run_passes,
               runtime_level: str = "all", fuses_residual: bool = True, veto=None) -> ir.Model:
    """Run the fusion passes ``names``; at runtime level "all", keep the NCHWc layout.

    ``run_passes(model, names, report, **options)`` runs passes (the pipeline's); the
    fusions the layout check rejects are excluded and the fusion is redone. Returns the
    fused model, a new object when the check ran. ``fuses_residual``: whether any of the
    passes can give a kernel Z (without one no fusion can cost the layout).
    """
    if runtime_level != "all":
        run_passes(model, names, report, veto=veto)
        report.notes.append(
            f"runtime level {runtime_level}: ONNX Runtime applies no layout pass below "
            "ENABLE_ALL, so every legal epilogue fusion is emitted"
        )
        return model
    if not (fuses_residual and takes_residual(model)):
        run_passes(model, names, report, veto=veto)
        report.notes.append(
            "runtime level all: no conv output here reaches an Add, so no fused kernel takes a "
            "residual input (Z); ONNX Runtime's NCHWc layout pass converts a FusedConv without Z "
            "exactly as it converts the Conv, so no fusion can cost a conv that layout and every "
            "legal epilogue fusion is emitted"
        )
        return model
    _name_anchors(model)  # fusions are excluded by their conv's name
    baseline_graph = runtime_graph(model)
    exclude: dict[str, str] = {}
    still_losing: dict[str, str] = {}
    for attempt_number in range(LAYOUT_ATTEMPTS + 1):
        trial, attempt = model.clone(), FusionReport()
        passes = run_passes(trial, names, attempt, exclude=exclude, veto=veto)
        emitted = {k: v for p in passes for k, v in p.emitted.items()}
        losses = layout_losses(baseline_graph, trial, emitted)
        if not losses:
            break
        if attempt_number == LAYOUT_ATTEMPTS:  # out of attempts: these stay, and are said to
            still_losing = losses
            break
        exclude.update(losses)
    report.records.extend(attempt.records)
    report.refusals.extend(attempt.refusals)
    if not has_layout_pass(baseline_graph):
        report.notes.append(
            "runtime level all: ONNX Runtime at ENABLE_ALL puts none of this model's "
            "convolutions in its NCHWc layout, so no fusion can cost one its layout; every "
            "legal epilogue fusion is emitted"
        )
        return trial
    note = (f"runtime level all: {len(emitted) - len(still_losing)} fused kernel(s) keep ONNX Runtime's "
            f"NCHWc layout; {len(exclude)} fusion(s) left to the runtime because they would lose it"
            + (f" ({', '.join(sorted(exclude)[:5])}{', ...' if len(exclude) > 5 else ''})" if exclude else ""))
    if still_losing:
        note += (f"; after {LAYOUT_ATTEMPTS + 1} attempts {len(still_losing)} emitted fusion(s) still lose it "
                 f"({', '.join(sorted(still_losing)[:5])}): each exclusion moved a residual to the next conv")
    report.notes.append(note + ". For runtimes below ENABLE_ALL use --runtime-level extended (or lower) "
                        "to fuse everything.")
    return trial


def _name_anchors(model: ir.Model) -> None:
    """Give unnamed weighted layers a name (many exporters write none): the layout check
    excludes a fusion by its conv's name, and an empty one would name none or all."""
    table = None
    for node in model.graph:
        if not node.name and is_op(node, *WEIGHTED_OPS):
            table = table or NameTable(model)
            node.name = table.fresh(node.op_type)


TARGET = Target(
    name="onnxruntime",
    title="ONNX Runtime",
    kernels=KERNELS,
    patterns=PATTERNS,
    pattern_ops="onnxruntime",
    run_fusion=run_fusion,
    reads=_RUNTIME_KERNELS,
    exceptions=EXCEPTIONS,
    runs_here=True,
    integer_matmul=INTEGER_MATMUL,
)
