"""opfuse for PyTorch: fold BatchNorms and fuse conv epilogues of an eval-mode nn.Module.

    fused, report = opfuse.torch.fuse(model.eval(), example_inputs=(x,))
    opfuse.report.print_report(report)

``fuse`` captures the graph (torch.fx, or torch.export where fx cannot trace), folds every
BatchNorm it legally can into the Conv/ConvTranspose/Linear before it (eps from the BN
module), fuses activations and residual adds into oneDNN's fused convolution kernels with
pre-packed weights, and reports every rewrite and every refusal with its reason, in the
vocabulary the ONNX side uses. ``export`` folds on the torch side, exports to ONNX and runs
the ONNX pipeline. The algebra is available as pure tensor functions (``fold_*``).

Files: ``fold.py`` the algebra, ``rules.py`` the rule tables (what folds, which
activations fuse), ``capture.py`` graph capture (torch.fx, or torch.export lifted back to
modules), ``fuse.py`` the rewriting (legality rules in its docstring), ``check.py`` the
check against the eager model, ``kernels.py`` the oneDNN kernel modules and what this
build supports, ``export.py`` the ONNX route.
"""

from opfuse.torch.export import export
from opfuse.torch.fold import (
    FoldingError,
    batchnorm_scale_shift,
    fold_affine_weights,
    fold_conv_bn_weights,
    fold_linear_bn_weights,
)
from opfuse.torch.fuse import fuse
from opfuse.torch.kernels import ConvAddPointwise, ConvPointwise, kernels_available

__all__ = [
    "fuse",
    "export",
    "fold_conv_bn_weights",
    "fold_linear_bn_weights",
    "fold_affine_weights",
    "batchnorm_scale_shift",
    "FoldingError",
    "ConvPointwise",
    "ConvAddPointwise",
    "kernels_available",
]
