"""Measured latency on ONNX Runtime's CPU provider, done so that small differences show.

The timing core (sessions, warm-up, interleaved rounds, the A/A control, paired ratios) is
the optimiser's own, :mod:`opfuse.tune.timing`, re-exported here for the benchmarks: the
benchmark's configurations run with the runtime's graph optimisations **disabled** (so only
opfuse's rewrites differ), the runtime's own levels (basic / extended / all) on the
original model, and an A/A control of the unfused model. Any two variants compare the same
way (:meth:`Measurement.ratio`): the int8 rows, which run at ORT all, against the float
model at ORT all.

This module adds the optional per-op-type profile (``enable_profiling``): kernel time summed
per op type, per run, e.g. how much BatchNormalization, Relu and Add cost before fusion and
after.
"""

from __future__ import annotations

__all__ = [
    "RUNTIME_LEVELS",
    "Variant",
    "Timing",
    "Measurement",
    "measure",
    "profile_op_types",
    "summarise_profile",
]

import bisect
import json
import os
import statistics
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnxruntime as ort

from opfuse.runtime import RUNTIME_LEVELS, session_options
from opfuse.runtime import model_source as serialize
from opfuse.tune.timing import Measurement, Timing, Variant, measure


def profile_op_types(
    models: Mapping[str, Any],
    feeds: Mapping[str, np.ndarray],
    *,
    level: str = "disabled",
    threads: int = 2,
    runs: int = 5,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, dict[str, float]]:
    """Kernel time per op type (ms per run) for each model, from ONNX Runtime's profiler.

    One profiling session per model; one unprofiled-in-effect first run each (dropped),
    then ``runs`` rounds over the sessions in turn, like :func:`measure`. For every run the
    profiler's node events (``cat`` "Node", name ending in ``_kernel_time``) are summed
    by ``args.op_name``; the result is the median over runs, so one disturbed run does not
    move it. Returns {model name: {op type: ms per run}}, op types by decreasing time.
    """
    feeds = dict(feeds)
    with tempfile.TemporaryDirectory(prefix="opfuse-profile-") as tmp:
        sessions = {}
        for i, (name, model) in enumerate(models.items()):
            source = serialize(model, tmp)
            options = session_options(level, threads, profile_prefix=os.path.join(tmp, f"profile{i}"))
            sessions[name] = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
            sessions[name].run(None, feeds)  # first run: arena growth, dropped below
        names = list(sessions)
        for r in range(runs):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                sessions[name].run(None, feeds)
            if progress is not None:
                progress("profiling op types", r + 1, runs)
        result = {}
        for name, session in sessions.items():
            path = session.end_profiling()
            with open(path, encoding="utf-8") as f:
                result[name] = summarise_profile(json.load(f), skip_runs=1)
    return result


def summarise_profile(events: list[dict], *, skip_runs: int = 0) -> dict[str, float]:
    """Median over runs of the kernel ms per op type, from a profiler event list.

    A run is a ``model_run`` session event; node events are assigned to the run whose time
    span holds them. The first ``skip_runs`` runs are dropped.
    """
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("cat") == "Session" and e.get("name") == "model_run"
    )[skip_runs:]
    if not spans:
        return {}
    starts = [s for s, _ in spans]
    per_run: list[dict[str, float]] = [{} for _ in spans]
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        ts = e.get("ts", 0)
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0 or ts > spans[i][1]:
            continue
        op = (e.get("args") or {}).get("op_name", "?")
        per_run[i][op] = per_run[i].get(op, 0.0) + float(e.get("dur", 0)) / 1e3
    ops = {op for run in per_run for op in run}
    medians = {op: statistics.median(run.get(op, 0.0) for run in per_run) for op in ops}
    return dict(sorted(medians.items(), key=lambda kv: -kv[1]))

