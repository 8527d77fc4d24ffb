"""The folding algebra as pure functions: layouts, the one-pass cast, the dtype checks."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from opfuse.core import algebra

LAYOUTS = st.sampled_from([("oihw", 1), ("oihw", 2), ("iohw", 1), ("iohw", 2), ("iohw", 3), ("kn", 1), ("nk", 1)])


def weight_shape(layout, group, draw_dims):
    a, b, k = draw_dims
    if layout == "oihw":
        return (a * group, b, k, k)
    if layout == "iohw":
        return (a * group, b, k, k)
    return (a * 7, b * 5)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(LAYOUTS, st.tuples(st.integers(1, 40), st.integers(1, 6), st.integers(1, 3)), st.integers(0, 2**16))
def test_one_pass_cast_equals_float64_then_cast(layout_group, dims, seed):
    layout, group = layout_group
    shape = weight_shape(layout, group, dims)
    r = np.random.default_rng(seed)
    w = r.standard_normal(shape).astype(np.float32)
    s = r.uniform(-3, 3, algebra.output_channels(shape, layout, group))
    reference = algebra.scale_output_channels(w, s, layout, group)
    assert reference.dtype == np.float64
    fast, problem = algebra.fold_weight(w, s, layout, group)
    assert problem is None and fast.dtype == np.float32
    np.testing.assert_array_equal(fast, reference.astype(np.float32))


def test_each_layout_scales_the_right_slice():
    w = np.ones((4, 3, 2, 2))  # Conv: output channels on axis 0
    out = algebra.scale_output_channels(w, np.arange(4.0), "oihw")
    assert (out[2] == 2).all()
    w = np.ones((4, 3, 2, 2))  # ConvTranspose, 2 groups: output channel g*3 + j
    out = algebra.scale_output_channels(w, np.arange(6.0), "iohw", group=2)
    assert (out[0:2, 1] == 1).all() and (out[2:4, 1] == 4).all()
    w = np.ones((5, 3))  # Gemm B[K, N]
    assert (algebra.scale_output_channels(w, np.arange(3.0), "kn")[:, 2] == 2).all()
    w = np.ones((3, 5))  # Gemm B[N, K] (transB=1)
    assert (algebra.scale_output_channels(w, np.arange(3.0), "nk")[2] == 2).all()


def test_batchnorm_affine_and_bias():
    s, t = algebra.batchnorm_affine([2.0], [1.0], [3.0], [4.0 - 1e-3], 1e-3)
    assert s[0] == 1.0 and t[0] == -2.0
    assert algebra.fold_bias(None, s, t, 1)[0] == -2.0  # a conv without bias takes BN's
    assert algebra.fold_bias(np.array([5.0]), s, t, 1)[0] == 3.0
    assert algebra.fold_bias(None, s, None, 1) is None
    assert (algebra.fold_bias(np.float64(2.0), None, None, 3) == 2.0).all()  # scalar broadcast


def test_cast_back_reports_overflow_and_underflow():
    _, problem = algebra.cast_back(np.array([1e6, 1.0]), np.float16)
    assert "overflow" in problem and "65504" in problem
    _, problem = algebra.cast_back(np.array([1e6, 1.0]), ml_dtypes.bfloat16)
    assert problem is None  # bfloat16 reaches 3e38
    w = np.full((4, 2, 3, 3), 1e-9)
    w[0] = 1.0
    _, problem = algebra.cast_back(w, np.float16, layout="oihw")
    assert "underflow" in problem and "output channel 1 becomes all zeros" in problem
    _, problem = algebra.cast_back(np.array([np.inf]), np.float32)
    assert "not finite" in problem


def test_fold_weight_falls_back_to_the_checked_path():
    w = np.full((2, 1, 1, 1), 3e38, np.float32)
    _, problem = algebra.fold_weight(w, np.array([10.0, 1.0]), "oihw")
    assert "overflow" in problem
    w16 = np.ones((2, 1, 1, 1), np.float16)
    _, problem = algebra.fold_weight(w16, np.array([1e-9, 1.0]), "oihw")
    assert "underflow" in problem
