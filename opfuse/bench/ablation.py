"""The chapter's ablation (the table ``opfuse bench`` reproduces) as named configurations.

=============  ================  ========================================================
name           chapter's row     what runs
=============  ================  ========================================================
none           none              nothing: the model as given
conv-bn        Conv+BN           fold-batchnorm (portable ONNX)
conv-act       Conv+ReLU         fuse-activation only: BatchNormalization stays, so only
                                 convs directly followed by an activation fuse
conv-bn-act    Conv+BN+ReLU      fold-batchnorm, then fuse-activation
all            (beyond)          fold-batchnorm, fold-arithmetic, fuse-epilogue
                                 (activation and residual Add)
=============  ================  ========================================================

The fusing configurations target ONNX Runtime (``com.microsoft.FusedConv``/``FusedGemm``).
``runtime_level`` says at which graph-optimisation level the result will run: at "all"
(the default) a fusion that would keep a conv out of ONNX Runtime's NCHWc layout pass is
not emitted; below "all" everything legal fuses.
"""

from __future__ import annotations

__all__ = ["AblationConfig", "CONFIGS", "apply_config"]

import dataclasses
from typing import TYPE_CHECKING

from opfuse.passes import pass_class

if TYPE_CHECKING:  # the type only: loading opfuse.load would load onnx at start-up
    from opfuse.load import ModelSource


@dataclasses.dataclass(frozen=True)
class AblationConfig:
    name: str
    label: str  # the chapter's row name
    passes: tuple[str, ...]

    @property
    def target(self) -> str:
        """onnxruntime when a pass emits its contrib ops, else portable onnx."""
        return "onnxruntime" if any(pass_class(p).emits_contrib_ops for p in self.passes) else "onnx"


CONFIGS: dict[str, AblationConfig] = {
    c.name: c
    for c in (
        AblationConfig("none", "none", ()),
        AblationConfig("conv-bn", "Conv+BN", ("fold-batchnorm",)),
        AblationConfig("conv-act", "Conv+ReLU", ("fuse-activation",)),
        AblationConfig("conv-bn-act", "Conv+BN+ReLU", ("fold-batchnorm", "fuse-activation")),
        AblationConfig("all", "everything", ("fold-batchnorm", "fold-arithmetic", "fuse-epilogue")),
    )
}


def apply_config(
    model: "ModelSource",
    name: str,
    *,
    runtime_level: str = "disabled",
    verify: bool = False,
    hardware: str | None = None,
):
    """Return (model, report) for the named configuration. The caller's model is untouched.

    ``runtime_level`` defaults to "disabled" here because the ablation measures opfuse's
    own fusions with the runtime's optimisations off.
    """
    from opfuse.pipeline import optimize  # loads onnx; this module is read at CLI start-up

    config = CONFIGS[name]
    return optimize(
        model,
        passes=config.passes,
        target=config.target,
        runtime_level=runtime_level,
        verify=verify,
        hardware=hardware,
        cleanup=bool(config.passes),  # "none" is the model as given
        tune=False,  # a row is its configuration: the bench times it, nothing chooses for it
    )

