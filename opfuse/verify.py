"""Step 4 of the pipeline: prove the rewritten model computes the same numbers.

Both models run on ONNX Runtime's CPU provider with the runtime's own graph optimisations
disabled (so only opfuse's rewrites differ), on the same inputs: the user's (an ``.npz``
keyed by input name) or seeded random ones, with symbolic dimensions set to a small
default (overridable per name). Every output is compared with a tolerance chosen per
dtype, relative to the output's scale (its largest magnitude):

    |optimised - original| <= atol * scale + rtol * |original|

Integer and boolean outputs must match exactly; NaNs must sit in the same places.
"""

from __future__ import annotations

__all__ = ["TOLERANCES", "make_inputs", "run_model", "verify_models", "compare_outputs"]

import os
import pathlib
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from opfuse.errors import BadInputError
from opfuse.report import OutputCheck, Verification
from opfuse.runtime import create_session
from opfuse.vocabulary import first_line

# dtype -> (rtol, atol relative to the output's scale)
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-6, 1e-7),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 2e-3),
    "bfloat16": (5e-2, 1e-2),
}
DEFAULT_DIM = 1


def _runtime_inputs(model: ir.Model) -> list[ir.Value]:
    return [v for v in model.graph.inputs if not v.is_initializer()]


def make_inputs(
    model: ir.Model, *, dims: Mapping[str, int] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Seeded random inputs; symbolic dims from ``dims`` (by name) or DEFAULT_DIM."""
    dims = dict(dims or {})
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in _runtime_inputs(model):
        if value.type is None or value.shape is None:
            raise BadInputError(
                f"graph input '{value.name}' has no declared type or shape; "
                "give inputs with --inputs FILE.npz"
            )
        shape = []
        for dim in value.shape:
            if isinstance(dim, int):
                shape.append(dim)
            else:
                name = str(dim.value) if dim.value is not None else ""
                shape.append(int(dims.get(name, DEFAULT_DIM)))
        dtype = value.dtype.numpy()
        kind = np.dtype(dtype).kind
        if kind == "f" or str(dtype) == "bfloat16":
            data = rng.standard_normal(shape).astype(dtype)
        elif kind in "iu":
            data = rng.integers(0, 8, size=shape).astype(dtype)
        elif kind == "b":
            data = rng.random(shape) < 0.5
        else:
            raise BadInputError(
                f"cannot make random data for input '{value.name}' of type {dtype}; "
                "give inputs with --inputs FILE.npz"
            )
        feeds[value.name] = np.asarray(data)
    return feeds


def load_inputs(model: ir.Model, path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Inputs from an .npz file keyed by graph input name."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise BadInputError(f"{path}: no such inputs file")
    try:
        with np.load(path, allow_pickle=False) as data:
            feeds = {k: data[k] for k in data.files}
    except Exception as e:  # noqa: BLE001 - numpy raises many kinds for a bad file
        raise BadInputError(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") from None
    expected = {v.name for v in _runtime_inputs(model)}
    missing = sorted(expected - set(feeds))
    unknown = sorted(set(feeds) - expected)
    if missing or unknown:
        raise BadInputError(
            f"{path}: inputs do not match the model"
            + (f"; missing {missing}" if missing else "")
            + (f"; not inputs of the model {unknown}" if unknown else "")
        )
    return feeds


def run_model(model: ir.Model, feeds: Mapping[str, np.ndarray], threads: int | None = None):
    """Run on ONNX Runtime CPU with graph optimisations disabled; returns {name: array}."""
    session = create_session(model, "disabled", threads)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds))))


def compare_outputs(
    expected: Mapping[str, np.ndarray], actual: Mapping[str, np.ndarray]
) -> list[OutputCheck]:
    checks = []
    for name, ref in expected.items():
        ref = np.asarray(ref)
        if name not in actual:
            checks.append(OutputCheck(name, str(ref.dtype), ref.shape, np.inf, np.inf, 0.0, False,
                                      "missing from the optimised model's outputs"))
            continue
        got = np.asarray(actual[name])
        checks.append(_compare(name, ref, got))
    return checks


def _compare(name: str, ref: np.ndarray, got: np.ndarray) -> OutputCheck:
    dtype = str(ref.dtype)
    if ref.shape != got.shape or str(got.dtype) != dtype:
        return OutputCheck(name, dtype, tuple(ref.shape), np.inf, np.inf, 0.0, False,
                           f"shape/dtype changed: {ref.shape} {dtype} -> {got.shape} {got.dtype}")
    if dtype not in TOLERANCES:
        same = bool(np.array_equal(ref, got))
        return OutputCheck(name, dtype, tuple(ref.shape), 0.0 if same else np.inf,
                           0.0 if same else np.inf, 0.0, same, "" if same else "values differ")
    rtol, atol = TOLERANCES[dtype]
    a, b = ref.astype(np.float64), got.astype(np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if not np.array_equal(nan_a, nan_b):
        return OutputCheck(name, dtype, tuple(ref.shape), np.inf, np.inf, 0.0, False,
                           "NaNs appear in different places")
    finite = ~nan_a
    a, b = a[finite], b[finite]
    if a.size == 0:
        return OutputCheck(name, dtype, tuple(ref.shape), 0.0, 0.0, 0.0, True)
    scale = float(np.max(np.abs(a))) or 1.0
    err = np.abs(a - b)
    limit = atol * scale + rtol * np.abs(a)
    scaled = float(np.max(err / limit))
    ok = bool(scaled <= 1.0)
    problem = "" if ok else (
        f"max |diff| {float(err.max()):.3g} exceeds the {dtype} tolerance "
        f"(rtol {rtol:g}, atol {atol:g} x scale {scale:.3g}) by {scaled:.1f}x"
    )
    return OutputCheck(name, dtype, tuple(ref.shape), float(err.max()), scaled, scale, ok, problem)


def verify_models(
    original: ir.Model,
    optimised: ir.Model,
    *,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
    seed: int = 0,
) -> Verification:
    """Run both models on the same inputs and compare every output."""
    if inputs is None:
        feeds, described = make_inputs(original, dims=dims, seed=seed), f"random (seed {seed})"
    elif isinstance(inputs, Mapping):
        feeds, described = dict(inputs), "given"
    else:
        feeds, described = load_inputs(original, inputs), str(inputs)
    try:
        expected = run_model(original, feeds)
    except BadInputError:
        raise
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise BadInputError(
            "cannot verify: ONNX Runtime cannot run the input model "
            f"({first_line(e)}); pass --no-verify to skip verification"
        ) from None
    result = Verification(runtime=_runtime_name(), inputs=described)
    try:
        actual = run_model(optimised, feeds)
    except Exception as e:  # noqa: BLE001
        result.outputs.append(OutputCheck("<model>", "", (), np.inf, np.inf, 0.0, False,
                                          f"ONNX Runtime cannot run the optimised model: {first_line(e)}"))
        return result
    result.outputs.extend(compare_outputs(expected, actual))
    return result


def _runtime_name() -> str:
    return f"onnxruntime {ort.__version__} CPU (graph optimisations disabled)"

