"""Calibration data: what ``--calibration`` reads, checked against the model's inputs.

Three forms, each giving a list of samples (one feed dict per sample, keyed by input name):

- ``DATA.npz``: one array per graph input, named after it, with a leading sample axis:
  ``[samples, *input_shape]`` (input ``x`` of shape ``[1, 3, 48, 320]`` is stored as
  ``[64, 1, 3, 48, 320]`` for 64 samples);
- a directory of ``.npz`` files in ``--inputs`` format, one sample each (read in name
  order), for inputs whose free dimensions differ between samples;
- ``random:N``: N seeded random samples built from the model like verification's inputs
  (:mod:`opfuse.verify.inputs`), for smoke tests only: a scale computed on noise is not the
  scale of real data, and the report says so.

In Python, any iterable of mappings ``{input name: array}`` (one per sample) too.

Inputs bound with ``--constant-input`` (:mod:`opfuse.prepare.constant_inputs`) are not inputs of
the model quantised: ``random:N`` does not draw them, and a sample that carries one must
hold exactly its bound value (else one line naming the sample); it is dropped.

Every sample is checked before any work: the names are exactly the model's inputs, each
array has the input's rank, its fixed dimensions and its dtype, and there are enough
samples to hold some out (:func:`split`). A failure is one line
(:class:`~opfuse.errors.BadInputError`, exit 2) and nothing is written.

Samples are split in order: the last quarter (at least one) is **held out**, never
seen by calibration, bias correction or the mixed-precision search, and the output SQNR
reported and checked against ``--min-sqnr`` is measured on it alone. With a target, the
search splits the rest the same way again: tuning samples, and check samples for its
stopping test (:mod:`.search`).
"""

from __future__ import annotations

__all__ = ["Sample", "load_calibration", "split", "check_runs", "run_sample", "constant_across", "MIN_SAMPLES"]

import os
import pathlib
import re
from collections.abc import Iterable, Mapping

import numpy as np
import onnx_ir as ir

from opfuse.prepare.constant_inputs import drop_bound, show_value
from opfuse.errors import BadInputError
from opfuse.core.dims import dim_name, resolve_dims, runtime_inputs
from opfuse.verify.inputs import find_sizes, make_feeds
from opfuse.runtime import create_session
from opfuse.core.ops import first_line

Sample = dict[str, np.ndarray]
MIN_SAMPLES = 2  # one to calibrate on, one held out
HOLDOUT_FRACTION = 0.25
CalibrationSource = str | os.PathLike | Iterable[Mapping[str, np.ndarray]]


def load_calibration(
    source: CalibrationSource, model: ir.Model, *, seed: int = 0, bound: Mapping[str, np.ndarray] | None = None,
    dims: Mapping[str, int] | None = None,
) -> tuple[list[Sample], list[str]]:
    """(samples, notes) from ``source``, checked against ``model``'s inputs (``model``: with
    the ``bound`` inputs already bound; see the module docstring). ``random:N`` draws its
    samples at the sizes ``dims`` (``--dim``) gives."""
    notes: list[str] = []
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        match = re.fullmatch(r"random:(\d+)", text)
        if match:
            samples = _random_samples(model, int(match.group(1)), seed, dims)
            notes.append(
                f"calibration on {len(samples)} random samples (--calibration {text}): fit for a "
                "smoke test only; scales computed on noise are not those of real data"
            )
            where = text
        else:
            samples, where = _read_path(pathlib.Path(text)), text
    elif isinstance(source, Mapping):
        raise BadInputError(
            "calibration: got one mapping; give an iterable of samples (one {input: array} each), "
            "or an .npz path whose arrays have a leading sample axis"
        )
    else:
        try:
            samples = [{k: np.asarray(v) for k, v in dict(s).items()} for s in source]
        except (TypeError, ValueError) as e:
            raise BadInputError(f"calibration: not an iterable of {{input: array}} mappings ({e})") from None
        where = "the calibration samples"
    if bound:
        carried = [n for n in bound if any(n in s for s in samples)]
        samples = drop_bound(samples, bound, where)
        if carried:
            notes.append("calibration samples: " + ", ".join(f"{n} ({show_value(bound[n])} wherever given)"
                                                               for n in carried)
                         + " dropped from the feeds: bound with --constant-input")
    _check(samples, model, where)
    return samples, notes


def constant_across(samples: list[Sample], model: ir.Model) -> dict[str, np.ndarray]:
    """The integer and boolean inputs that hold one value in every sample (an If they
    decide would take one branch in this deployment: the compile log's fix gives it)."""
    out = {}
    for value in runtime_inputs(model):
        if value.dtype is None or np.dtype(value.dtype.numpy()).kind not in "iub":
            continue
        arrays = [np.asarray(s[value.name]) for s in samples if value.name in s]
        if len(arrays) == len(samples) and arrays and all(np.array_equal(a, arrays[0]) for a in arrays[1:]):
            out[value.name] = arrays[0]
    return out


def split(samples: list[Sample], holdout: int | None = None) -> tuple[list[Sample], list[Sample]]:
    """(calibration, held out): the last ``holdout`` samples (default a quarter, >= 1)."""
    n = len(samples)
    k = max(1, round(n * HOLDOUT_FRACTION)) if holdout is None else holdout
    if not 1 <= k < n:
        raise BadInputError(f"calibration: cannot hold out {k} of {n} samples (need 1 <= holdout < samples)")
    return samples[: n - k], samples[n - k:]


def _read_path(path: pathlib.Path) -> list[Sample]:
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
        if not files:
            raise BadInputError(f"{path}: no .npz files in the calibration directory")
        return [_read_npz(f) for f in files]
    if not path.exists():
        raise BadInputError(f"{path}: no such calibration file or directory")
    stacked = _read_npz(path)
    lengths = {name: (a.shape[0] if a.ndim else None) for name, a in stacked.items()}
    if not stacked:
        raise BadInputError(f"{path}: the .npz holds no arrays")
    if None in lengths.values() or len(set(lengths.values())) != 1:
        raise BadInputError(
            f"{path}: every array needs the same leading sample axis; got "
            + ", ".join(f"{k} {tuple(v.shape)}" for k, v in stacked.items())
        )
    count = next(iter(lengths.values()))
    return [{name: np.asarray(a[i]) for name, a in stacked.items()} for i in range(count)]  # (a 0-d sample too)


def _read_npz(path: pathlib.Path) -> Sample:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: np.asarray(data[k]) for k in data.files}
    except Exception as e:  # noqa: BLE001 - numpy raises many kinds for a bad file
        raise BadInputError(f"{path}: not a readable .npz file ({type(e).__name__}: {first_line(e, 120)})") from None


def _check(samples: list[Sample], model: ir.Model, where: str) -> None:
    if len(samples) < MIN_SAMPLES:
        raise BadInputError(
            f"{where}: {len(samples)} sample(s); quantisation needs at least {MIN_SAMPLES} "
            "(some to calibrate on, one held out to verify)"
        )
    inputs = {v.name: v for v in runtime_inputs(model)}
    for index, sample in enumerate(samples):
        missing, unknown = sorted(set(inputs) - set(sample)), sorted(set(sample) - set(inputs))
        if missing or unknown:
            raise BadInputError(
                f"{where}: sample {index} does not match the model's inputs ({', '.join(inputs)})"
                + (f"; missing {', '.join(missing)}" if missing else "")
                + (f"; not inputs of the model: {', '.join(unknown)}" if unknown else "")
            )
        sizes: dict[str, tuple[str, int]] = {}  # named dimension -> (where first seen, its size)
        for name, value in inputs.items():
            array = np.asarray(sample[name])
            problem = _mismatch(array, value)
            if problem:
                raise BadInputError(f"{where}: sample {index}, input '{name}': {problem}")
            for axis, dim in enumerate(value.shape or ()):
                if dim_name(dim) is not None:  # one size per sample, like --dim
                    seen = sizes.setdefault(dim_name(dim), (f"'{name}' axis {axis}", array.shape[axis]))
                    if seen[1] != array.shape[axis]:
                        raise BadInputError(
                            f"{where}: sample {index}: dimension '{dim_name(dim)}' is {seen[1]} in {seen[0]} "
                            f"but {array.shape[axis]} in '{name}' axis {axis}; a named dimension has one "
                            "size per sample")


def _mismatch(array: np.ndarray, value: ir.Value) -> str | None:
    if value.dtype is not None:
        want = np.dtype(value.dtype.numpy())
        if array.dtype != want:
            return f"dtype {array.dtype}, the model expects {want}"
    if value.shape is not None:
        shape = list(value.shape)
        if array.ndim != len(shape):
            return f"shape {list(array.shape)} has rank {array.ndim}, the model's input has rank {len(shape)} ({_show(shape)})"
        for axis, (dim, got) in enumerate(zip(shape, array.shape)):
            if isinstance(dim, int) and dim >= 0 and dim != got:
                return f"shape {list(array.shape)} differs from the model's {_show(shape)} at axis {axis}"
    if array.size == 0:
        return "empty array"
    return None


def _show(shape) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else (d.value or "?") for d in shape) + "]"


def _random_samples(model: ir.Model, count: int, seed: int, dims: Mapping[str, int] | None) -> list[Sample]:
    if count < MIN_SAMPLES:
        raise BadInputError(f"random:{count}: quantisation needs at least {MIN_SAMPLES} samples")
    session = create_session(model, "disabled")
    _, sizes, _ = find_sizes(  # sizes at which the model runs, as verification finds them
        model, lambda feeds: session.run(None, feeds), fixed=resolve_dims(model, dims), seed=seed,
        purpose=f"random:{count}", advice="give calibration data: --calibration DATA.npz")
    return [make_feeds(model, sizes, seed=seed + i) for i in range(count)]


def check_runs(model: ir.Model, samples: list[Sample]) -> None:
    """Every sample runs on the model (ONNX Runtime, no graph optimisation), before any work:
    a sample it cannot run on is bad input (exit 2), named by its index."""
    session = create_session(model, "disabled")
    for index, sample in enumerate(samples):
        run_sample(session, None, sample, index)


def run_sample(session, names: list[str] | None, sample: Mapping[str, np.ndarray], index: int) -> list:
    """``session.run`` on one calibration sample; a sample the model cannot run on is bad
    input (exit 2), named by its index."""
    try:
        return session.run(names, sample)
    except Exception as e:  # noqa: BLE001 - ONNX Runtime raises its own kinds
        raise BadInputError(f"calibration sample {index}: ONNX Runtime cannot run the model on it "
                            f"({first_line(e, 200)})") from None
