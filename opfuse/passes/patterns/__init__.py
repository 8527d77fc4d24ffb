"""The multi-op patterns opfuse knows, as onnxscript rewrite rules: the catalogue.

=================  ============================================  =========================
pattern            what it matches                               becomes (standard / ORT)
=================  ============================================  =========================
``layer-norm``     ReduceMean, Sub, Pow|Mul, ReduceMean, Add,    LayerNormalization (17+)
                   Sqrt, Div|Reciprocal-Mul [, Mul] [, Add]      / LayerNormalization
``rms-norm``       x * Reciprocal|Div(1, Sqrt(ReduceMean(x^2)    RMSNormalization (23+) /
                   + eps)) * scale [, Casts]                     SimplifiedLayerNormalization
``skip-layer-norm`` Add then LayerNormalization                  - / SkipLayerNormalization
``skip-rms-norm``  Add then SimplifiedLayerNormalization        - / SkipSimplifiedLayerNormalization
``gelu``           0.5 x (1 + erf(x / sqrt 2)); its tanh form    Gelu (20+) / Gelu, FastGelu
``bias-gelu``      Add(bias) then Gelu                           - / BiasGelu
``silu``           x * Sigmoid(x)                                Swish (24+) / QuickGelu(1)
``hardswish``      x * HardSigmoid(x; 1/6, 1/2); Clip forms      HardSwish (14+)
``rotary``         x * cos + Concat(-x2, x1) * sin, or GPT-J's     RotaryEmbedding (23+) /
                   interleaved pairs [, partial: Concat(., x[R:])] RotaryEmbedding (contrib)
``self-attention`` x Wq|Wk|Wv + b, head split, q k / c [+ mask],   - / Attention (packed QKV)
                   Softmax, v, head merge (TorchScript's encoders)
``attention``      MatMul, scale, mask, Softmax, MatMul          Attention (23+) /
                   [, past Concat, repeat_kv: kv_cache.py]       MultiHeadAttention, Attention
                   [, present window Slices: present_window.py]  [under If (23+)]
``matmul-add``     MatMul (2-D) then Add(bias)                   Gemm / Gemm
=================  ============================================  =========================

One module per pattern (``layer_norm.py``...): its algebra, its legality rules, a ``TITLE``
for the log (``RECORD_TITLES`` names rules the log shows apart; a record's label is the
title's source before "->" and the op type the rewrite wrote, "SiLU->QuickGelu") and a
``stages(form, approximate)`` function returning the onnxscript rules
that produce the pattern in ``form`` ("standard": ONNX ops, where the model's opset has
them, else a refusal naming the opset; "onnxruntime": ONNX Runtime's contrib ops; "qnn":
standard ops, except where a module's ``FORMS`` lists it: gelu's com.microsoft Gelu below
opset 20, the form QNN runs), as
stages run one after the other over the whole graph. A module whose first stages emit
intermediate ops that later ones consume (attention) names their domains in
``INTERMEDIATE_DOMAINS``: its stages run on a copy, kept only when none is left; its ``ENTRY_STAGE``
is the stage that finds the pattern in the graph's own ops (attention's SDPA stage), which the gate
of :mod:`opfuse.passes.pattern_gate` reads. A target says per pattern
whether to fuse it (:attr:`opfuse.targets.kernels.Target.patterns`); the pass that runs
them is :mod:`opfuse.passes.fuse_patterns`; ``PATTERN_ORDER`` is the order it runs them
(a LayerNorm or an RMSNorm must exist before an Add can join it, and a bias Add must not become a Gemm
before BiasGelu takes it).
"""

from __future__ import annotations

__all__ = ["PATTERN_ORDER", "PATTERN_MODULES", "PatternRules", "forget_matches", "pattern_rules", "rules_in_form", "model_opset",
           "constant_array", "constant_int",
           "opset_problem", "reduce_axes", "trailing_axis"]

import dataclasses
import functools
import importlib

PATTERN_MODULES: dict[str, str] = {
    "layer-norm": "opfuse.passes.patterns.layer_norm",
    "rms-norm": "opfuse.passes.patterns.rms_norm",
    "skip-layer-norm": "opfuse.passes.patterns.skip_layer_norm",
    "skip-rms-norm": "opfuse.passes.patterns.skip_rms_norm",
    "gelu": "opfuse.passes.patterns.gelu",
    "bias-gelu": "opfuse.passes.patterns.bias_gelu",
    "silu": "opfuse.passes.patterns.silu",
    "hardswish": "opfuse.passes.patterns.hardswish",
    "rotary": "opfuse.passes.patterns.rotary",
    "self-attention": "opfuse.passes.patterns.self_attention",
    "attention": "opfuse.passes.patterns.attention",
    "matmul-add": "opfuse.passes.patterns.matmul_add",
}
PATTERN_ORDER = tuple(PATTERN_MODULES)
# the op forms every pattern module writes; a module that writes another (gelu: "qnn") lists
# its forms in FORMS, and for any other module a form it does not know is "standard"
_FORMS = ("standard", "onnxruntime")


@dataclasses.dataclass(frozen=True)
class PatternRules:
    """One pattern's rules for one op form: stages of onnxscript rules (commuted variants
    included), and the domains of the intermediate ops its stages hand on."""

    title: str
    stages: tuple[tuple, ...]
    intermediate_domains: frozenset[str] = frozenset()
    record_titles: dict = dataclasses.field(default_factory=dict)  # rule name -> its title (source before "->")
    entry_stage: int | None = None  # the stage that finds the pattern in the graph's own ops (None: any)

    @property
    def transactional(self) -> bool:
        return bool(self.intermediate_domains)


@functools.cache
def _rules(pattern: str, form: str, approximate: bool) -> PatternRules:
    from onnxscript.rewriter import pattern as rewriter  # (heavy; the catalogue itself is data)

    module = importlib.import_module(PATTERN_MODULES[pattern])
    form = form if form in getattr(module, "FORMS", _FORMS) else "standard"  # ("qnn": standard unless it says)
    stages = tuple(tuple(r for rule in stage for r in _commuted(rewriter, rule))
                   for stage in module.stages(form, approximate))
    for stage in stages:
        for rule in stage:
            instance = _rule_instance(rule)
            if instance is not None and id(instance) not in _BUILT:
                _BUILT[id(instance)] = (instance, dict(instance.__dict__))
    return PatternRules(module.TITLE, stages, frozenset(getattr(module, "INTERMEDIATE_DOMAINS", ())),
                        dict(getattr(module, "RECORD_TITLES", {})), getattr(module, "ENTRY_STAGE", None))


_BUILT: dict[int, tuple[object, dict]] = {}  # a class-based rule's instance -> its attributes as built


def _rule_instance(rule):
    """The object whose methods a rule written as a class (onnxscript's ``RewriteRuleClassBase``) calls,
    else None."""
    return getattr(getattr(rule, "_condition_function", None), "__self__", None)


def forget_matches(rules) -> None:
    """Drop what each rule keeps of the last graph it looked at. The rules are built once per process
    (:func:`pattern_rules`); onnxscript's matcher holds its last node, graph and match
    (``_current_node``, ``_graph``, ``_match``, ``_tracer``) until its next match, and a rule written as
    a class keeps what its ``check`` found (values, nodes) in its own attributes. Either would keep a
    graph the caller has discarded (a trial, a tuning variant) alive, with the weights it holds in
    memory, to the end of the run. A class rule's attributes go back to those it was built with (the
    next ``setup`` and ``check`` set them again)."""
    for rule in rules:
        matcher = getattr(rule, "_matcher", None)
        for name in ("_current_node", "_graph", "_match", "_tracer"):
            if getattr(matcher, name, None) is not None:
                setattr(matcher, name, None)
        instance = _rule_instance(rule)
        built = _BUILT.get(id(instance))
        if built is not None and built[0] is instance:
            instance.__dict__.clear()
            instance.__dict__.update(built[1])


def _commuted(rewriter, rule) -> list:
    """The rule and its variants with commutative operands swapped; a rule using onnxscript's
    OrValue cannot be commuted (its clone fails), and is taken as written."""
    try:
        return list(rewriter.RewriteRuleSet([rule], commute=True).rules)
    except ValueError:
        return [rule]


def pattern_rules(pattern: str, target, *, approximate: bool = False) -> PatternRules:
    """The onnxscript rules producing ``pattern`` for ``target``."""
    return _rules(pattern, target.form(pattern), approximate)


def rules_in_form(pattern: str, form: str, *, approximate: bool = False) -> PatternRules:
    """The onnxscript rules producing ``pattern`` in op ``form``, whatever a target's policy."""
    return _rules(pattern, form, approximate)


# -- helpers the rules share ----------------------------------------------------------------

def model_opset(context) -> int:
    """The default-domain opset of the model an onnxscript match context belongs to."""
    from opfuse.core.analysis import opset_of  # (heavy; see above)

    return opset_of(context.model.opset_imports)


def opset_problem(context, op: str, since: int) -> str | None:
    """Why ``op`` cannot be emitted in this model (its opset is below ``since``), or None."""
    opset = model_opset(context)
    if opset >= since:
        return None
    return (f"{op} exists from opset {since} and the model has opset {opset}; "
            f"--opset {since} upgrades the model first")


def constant_array(value):
    """The numpy array of a constant (initializer not also a graph input, Constant node),
    else None."""
    from opfuse.core.analysis import Constant, find_constant  # (heavy; see above)

    if value is None:
        return None
    found = find_constant(value)
    return found.array if isinstance(found, Constant) else None


def constant_int(value) -> int | None:
    """The integer of a one-element constant (a Slice's start, an axis), else None."""
    array = constant_array(value)
    return int(array.reshape(-1)[0]) if array is not None and array.size == 1 else None


def reduce_axes(node) -> list[int] | None:
    """A reduction's axes, from its attribute (opset < 18) or its constant input (18+); None when
    they are computed at run time or absent."""
    attr = node.attributes.get("axes")
    if attr is not None:
        return [int(a) for a in attr.value]
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant_array(node.inputs[1])
        return None if array is None else [int(a) for a in array.reshape(-1)]
    return None


def trailing_axis(axes: list[int], rank: int | None) -> int | None:
    """The first normalised axis (negative) when ``axes`` are the trailing ones, else None."""
    if rank is not None:
        axes = [a + rank if a < 0 else a for a in axes]
        axes = sorted(a - rank for a in axes)
    elif any(a >= 0 for a in axes):
        return None
    axes = sorted(axes)
    return axes[0] if axes == list(range(axes[0], 0)) else None
