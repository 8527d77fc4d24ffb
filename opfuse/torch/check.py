"""The torch wing's check against the eager model, with opfuse.verify's tolerance policy.

Both modules run on the example inputs (fresh copies: a model may write into them);
every floating-point output is compared by :func:`opfuse.verify.compare_outputs`, the
same rule as the ONNX side's: one tolerance policy in the product.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from opfuse.report import Verification
from opfuse.torch.capture import _clone_inputs
from opfuse.verify import compare_outputs


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as numpy, bfloat16 included (as ml_dtypes' bfloat16, exactly)."""
    t = t.detach().cpu()
    return t.float().numpy().astype(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def _verify(reference: nn.Module, fused: nn.Module, example_inputs: tuple) -> Verification:
    verification = Verification(runtime=f"torch {torch.__version__} eager", inputs="example_inputs")
    with torch.no_grad():
        expected = pytree.tree_leaves(reference(*_clone_inputs(example_inputs)))
        actual = pytree.tree_leaves(fused(*_clone_inputs(example_inputs)))
    if len(expected) != len(actual):
        verification.skipped = "the two models return different numbers of outputs"
        return verification
    pairs = {f"output[{i}]": (e, a) for i, (e, a) in enumerate(zip(expected, actual))
             if isinstance(e, torch.Tensor) and e.is_floating_point()}
    verification.outputs.extend(compare_outputs(
        {k: _numpy(e) for k, (e, _) in pairs.items()},
        {k: _numpy(a) if isinstance(a, torch.Tensor) else np.asarray(a) for k, (_, a) in pairs.items()},
    ))
    return verification
