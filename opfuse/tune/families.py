"""The fusion families the measured choice times, as data, and a configuration of them.

A **family** is a group of rewrites that stand or fall together (a SkipSimplifiedLayerNorm
needs the SimplifiedLayerNorm it joins; BiasGelu the Gelu): its patterns
(:mod:`opfuse.passes.patterns`) and the passes that are its own (``fuse-epilogue``).

===============  ==========================================  ============================
family           rewrites                                    options
===============  ==========================================  ============================
attention        the ``attention`` pattern                   written out; ONNX Runtime's
                                                             MultiHeadAttention; the
                                                             standard Attention (opset 23;
                                                             a KV cache as past/present,
                                                             then its 3-D form)
self-attention   the ``self-attention`` pattern (encoders'   on / off
                 Attention with packed QKV)
rotary           the ``rotary`` pattern (RotaryEmbedding)    on / off
norms            layer-norm, rms-norm, skip-layer-norm,      on / off
                 skip-rms-norm
activations      gelu, bias-gelu, silu, hardswish            on / off
epilogues        matmul-add (Gemm), fuse-epilogue            on / off
                 (FusedConv / FusedGemm)
packed-          pack-projections (q, k, v or gate, up as    on / off
projections      one MatMul and a Split)
dynamic-int8     fuse-dynamic-int8 (quantize_dynamic's       on / off
                 MatMulInteger chains as DynamicQuantizeMatMul,
                 MatMulIntegerToFloat)
opset            the ``--opset N`` the user asked for        on / off (only when asked)
===============  ==========================================  ============================

A **configuration** maps each family to its option; :func:`configure` turns one into what
the optimiser runs: the target with those patterns set to ``keep`` (a policy override as
data, :attr:`opfuse.targets.kernels.Target.patterns`), the attention pattern's op form
(:attr:`~opfuse.targets.kernels.Target.pattern_forms`), the passes without the ones turned
off, and the opset to raise to. :func:`policy_configuration` is what the target writes untimed,
as a configuration (a policy exception's ``untimed`` options included: a decode step's
Attention-23 at ONNX Runtime): the measured choice's reference, which stands wherever the
clock cannot tell.

ONNX Runtime's contrib GroupQueryAttention is not a form here: its kernel ran the Llama decode
step's four attentions slower than the standard op with its cache (ONNX Runtime's profile:
docs/results/measurements.md), and its implicit causal mask equals the graph's only for masks of
ones then zeros per row (no left padding), a condition on the input data; the rest of the
builder's gain (rotary inside, packed QKV read directly) the standard forms get from
``heads_3d`` and ``pack-projections``.

The standard Attention needs opset 23: at ``--target onnxruntime`` the candidate raises the
model's opset to 23 (ONNX Runtime runs it); at ``--target onnx`` it is a candidate only at
the opset the user gave (portable ONNX keeps the model's opset unless asked).
"""

from __future__ import annotations

__all__ = ["Family", "AttentionForm", "FAMILIES", "ATTENTION_FORMS", "WRITTEN_OUT", "ON", "OFF", "Configuration",
           "configure", "policy_configuration", "forms_for"]

import dataclasses
from collections.abc import Mapping

from opfuse.targets.kernels import Target

ON, OFF = "on", "off"
WRITTEN_OUT = "written out"
ATTENTION_OPSET = 23  # the standard Attention's first opset


@dataclasses.dataclass(frozen=True)
class Family:
    """A group of rewrites timed on and off together."""

    name: str
    title: str  # for the log: "the norm fusions (LayerNorm, SimplifiedLayerNorm, Skip...)"
    patterns: tuple[str, ...] = ()
    passes: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()  # the op types its rewrites write: what the log counts in the file written


@dataclasses.dataclass(frozen=True)
class AttentionForm:
    """One candidate form of attention: the pattern's policy, its op form, the opset it needs."""

    name: str
    policy: str  # "keep" or "fuse"
    form: str | None = None  # the op form (None: the target's own)
    opset: int | None = None  # the opset to raise to (None: the model's)
    targets: tuple[str, ...] = ("onnx", "onnxruntime")  # where it is a candidate


FAMILIES: tuple[Family, ...] = (
    Family("attention", "attention", ("attention",), ops=("Attention", "MultiHeadAttention")),
    Family("self-attention", "the encoders' self-attention (Attention with packed QKV)", ("self-attention",),
           ops=("Attention",)),
    Family("rotary", "the rotary embeddings (RotaryEmbedding)", ("rotary",), ops=("RotaryEmbedding",)),
    Family("norms", "the norm fusions (LayerNorm, SimplifiedLayerNorm, SkipLayerNorm, SkipSimplifiedLayerNorm)",
           ("layer-norm", "rms-norm", "skip-layer-norm", "skip-rms-norm"),
           ops=("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                "SkipSimplifiedLayerNormalization", "RMSNormalization")),
    Family("activations", "the activations (Gelu, BiasGelu, SiLU, HardSwish)",
           ("gelu", "bias-gelu", "silu", "hardswish"), ops=("Gelu", "FastGelu", "BiasGelu", "QuickGelu", "HardSwish")),
    Family("epilogues", "the epilogues (MatMul+Add as Gemm, FusedConv, FusedGemm)", ("matmul-add",),
           ("fuse-epilogue",), ops=("Gemm", "FusedConv", "FusedGemm")),
    Family("packed-projections", "the packed projections (MatMuls reading one input as one MatMul and a Split)",
           passes=("pack-projections",), ops=("Split",)),
    Family("dynamic-int8", "the dynamic int8 MatMuls (DynamicQuantizeMatMul, MatMulIntegerToFloat)",
           passes=("fuse-dynamic-int8",), ops=("DynamicQuantizeMatMul", "MatMulIntegerToFloat")),
    Family("opset", "the opset raise (--opset)"),
)
ATTENTION_FORMS: tuple[AttentionForm, ...] = (
    AttentionForm(WRITTEN_OUT, "keep"),
    AttentionForm("MultiHeadAttention", "fuse", "onnxruntime", targets=("onnxruntime",)),
    AttentionForm("Attention-23", "fuse", "standard", ATTENTION_OPSET, targets=("onnxruntime",)),
    AttentionForm("Attention-23", "fuse", "standard", targets=("onnx",)),
)

@dataclasses.dataclass(frozen=True)
class Configuration:
    """Each family's option, in :data:`FAMILIES`' order: hashable, and iterable as (family, option)
    pairs (``dict(config)``)."""

    options: tuple[tuple[str, str], ...]

    def __iter__(self):
        return iter(self.options)

    def get(self, family: str, default: str | None = None) -> str | None:
        return dict(self.options).get(family, default)

    def replaced(self, changes: Mapping[str, str]) -> Configuration:
        """This configuration with ``changes`` ({family: option}) applied to the families it has."""
        return Configuration(tuple((f, changes.get(f, o)) for f, o in self.options))

    def label(self, base: Configuration | None = None) -> str:
        """What sets it apart from ``base`` ("attention MultiHeadAttention, norms off"), or all of it."""
        parts = [f"{family} {option}" for family, option in self.options
                 if base is None or base.get(family) != option]
        return ", ".join(parts) or ("as the target's policy" if base is not None else "every family off")

    def to_dict(self) -> dict[str, str]:
        return dict(self.options)

    @classmethod
    def from_dict(cls, options: Mapping[str, str]) -> Configuration:
        """From a record's {family: option}; a family no longer known, or an option that is not
        one of it, raises ValueError."""
        known = {f.name for f in FAMILIES}
        forms = {f.name for f in ATTENTION_FORMS}
        for family, option in options.items():
            if family not in known or option not in ((forms if family == "attention" else {ON, OFF})):
                raise ValueError(f"unknown family option {family}={option!r}")
        return cls(tuple((f.name, options[f.name]) for f in FAMILIES if f.name in options))


def policy_configuration(target: Target, opset_given: bool,
                         exception: Mapping[str, str] | None = None) -> Configuration:
    """What ``target`` writes untimed, as a configuration: each family on where one of its patterns'
    policy is "fuse" (or it is a pass of its own), attention in the target's own op form (written out
    where its policy is not to fuse), then ``exception``'s options (a policy exception's ``untimed``:
    a KV-cache decode step at ONNX Runtime gets Attention-23). It is what the measured choice keeps
    wherever the clock cannot tell (:func:`opfuse.tune.decide`)."""
    options = {}
    for family in FAMILIES:
        if family.name == "opset":
            if opset_given:
                options["opset"] = ON
        elif family.name == "attention":
            own = next((f.name for f in forms_for(target.name) if f.form == target.form("attention")
                        and f.opset is None), WRITTEN_OUT)
            options["attention"] = own if target.policy("attention") == "fuse" else WRITTEN_OUT
        else:
            fused = family.passes or any(target.policy(p) == "fuse" for p in family.patterns)
            options[family.name] = ON if fused else OFF
    options.update(exception or {})
    return Configuration(tuple(options.items()))


def forms_for(target: str) -> list[AttentionForm]:
    return [f for f in ATTENTION_FORMS if target in f.targets]


def configure(target: Target, passes: list[str], opset: int | None,
              config: Configuration | Mapping[str, str]) -> tuple[Target, list[str], int | None]:
    """What the optimiser runs for ``config``: the target with the families turned off set to
    ``keep`` and attention in the chosen form (no policy exception: the choice is measured),
    the passes without the families' own, and the opset to raise to."""
    chosen = dict(config)
    patterns, forms, dropped = dict(target.patterns), dict(target.pattern_forms), set()
    if chosen.get("opset") == OFF:
        opset = None
    for family in FAMILIES:
        option = chosen.get(family.name)
        if family.name == "attention" and option is not None:
            form = next(f for f in forms_for(target.name) if f.name == option)
            patterns["attention"] = form.policy if target.policy("attention") == "fuse" else "keep"
            if form.form is not None:
                forms["attention"] = form.form
            if form.opset is not None:
                opset = max(opset or 0, form.opset)
        elif option == OFF:
            patterns.update({p: "keep" for p in family.patterns if p in patterns})
            dropped.update(family.passes)
    configured = dataclasses.replace(target, patterns=patterns, pattern_forms=forms, exceptions=())
    return configured, [n for n in passes if n not in dropped], opset
