"""Where `opfuse optimize`'s peak memory and wall time go, phase by phase (issue 49's memory bars).

    python experiments/memory_profile/rss_phases.py MODEL.onnx --target onnxruntime [--cprofile out.prof]

Runs :func:`opfuse.optimize` in this process as ``opfuse optimize MODEL -o OUT --target T`` does
(tuning and verification on, the cached tuning record not replayed unless ``--replay``), with a
thread sampling the process's resident set (/proc/self/statm) every 10 ms, and each phase below
wrapped: one line per call with the RSS at entry, the peak inside it, the RSS at exit and its
seconds. Linux only. Not part of the package.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import sys
import tempfile
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def mappings() -> dict[str, int]:
    """Resident bytes by mapping (/proc/self/smaps): a file's path, else [heap], [anon] and the like."""
    out: dict[str, int] = {}
    name = "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if not head:
                continue
            if "-" in head[0] and not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else "[anon]"
            elif head[0] == "Rss:":
                out[name] = out.get(name, 0) + int(head[1]) * 1024
    return out


def show_mappings(where: dict[str, int], top: int = 8) -> str:
    items = sorted(where.items(), key=lambda kv: -kv[1])
    return "; ".join(f"{'/'.join(k.split('/')[-2:]) or k} {v / 1e9:.2f}" for k, v in items[:top] if v > 5e6)


class Sampler(threading.Thread):
    def __init__(self, every: float = 0.01, smaps: bool = False):
        super().__init__(daemon=True)
        self.every, self.peak, self.stop = every, rss(), False
        self.windows: list[list[int]] = []  # open phases' peaks
        self.smaps, self.at_peak, self.phase_at_peak = smaps, {}, ""
        self.smaps_peak = 0

    def run(self):
        while not self.stop:
            now = rss()
            self.peak = max(self.peak, now)
            for w in self.windows:
                w[0] = max(w[0], now)
            if self.smaps and now > self.smaps_peak + 20e6:  # a new peak: what it is made of
                self.smaps_peak = now
                self.at_peak = mappings()
                self.phase_at_peak = " > ".join(OPEN)
            time.sleep(self.every)


SAMPLER = Sampler()
LINES: list[str] = []
OPEN: list[str] = []  # the phases open now, outermost first
DEPTH = [0]

PHASES = [  # (module, attribute): wrapped where the caller looks it up
    ("opfuse.pipeline", "load_model"),
    ("opfuse.tune.run", "load_model"),
    ("opfuse.pipeline", "_prepare"),
    ("opfuse.pipeline", "_rewrite"),
    ("opfuse.pipeline", "upgrade_opset"),
    ("opfuse.pipeline", "make_static"),
    ("opfuse.pipeline", "_verify_and_write"),
    ("opfuse.pipeline", "verify_models"),
    ("opfuse.pipeline", "StagedModel"),
    ("opfuse.tune.run", "_timed"),
    ("opfuse.tune.run", "tune"),
    ("opfuse.tune.run", "find_block"),
    ("opfuse.tune.run", "signature"),
    ("opfuse.verify", "input_sets"),
    ("opfuse.verify", "runtime_rounding"),
    ("opfuse.verify", "_Runner"),
    ("opfuse.verify", "serialized"),
    ("opfuse.verify", "_with_outputs"),
    ("opfuse.verify", "infer_shapes"),
    ("opfuse.verify", "_unstable_original"),
    ("opfuse.verify.variation", "_in_float64"),
    ("opfuse.verify.variation", "create_session"),
    ("opfuse.verify.variation", "_measured"),
    ("opfuse.verify.variation", "_float64_session"),
    ("opfuse.verify.variation", "_float64_from_bytes"),
    ("opfuse.save", "fingerprint"),
]


def wrap(module: str, name: str) -> None:
    mod = importlib.import_module(module)
    inner = getattr(mod, name)
    label = f"{module.rsplit('.', 1)[-1]}.{name}"

    if isinstance(inner, type):  # a class: time its construction
        class Wrapped(inner):  # type: ignore[misc, valid-type]
            def __init__(self, *a, **k):
                with phase(label + "()"):
                    super().__init__(*a, **k)
        Wrapped.__name__ = inner.__name__
        setattr(mod, name, Wrapped)
        return

    @functools.wraps(inner)
    def wrapper(*a, **k):
        with phase(label):
            return inner(*a, **k)
    setattr(mod, name, wrapper)


@contextlib.contextmanager
def phase(label: str):
    window = [rss()]
    start_rss, start = window[0], time.perf_counter()
    SAMPLER.windows.append(window)
    DEPTH[0] += 1
    OPEN.append(label)
    if SAMPLER.smaps:
        print(f"{'  ' * DEPTH[0]}> {label} entered: {show_mappings(mappings())}", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        OPEN.pop()
        DEPTH[0] -= 1
        SAMPLER.windows[:] = [w for w in SAMPLER.windows if w is not window]
        end = rss()
        window[0] = max(window[0], end)
        LINES.append(f"{'  ' * DEPTH[0]}{label:<40} in {start_rss / 1e9:6.2f} GB  peak {window[0] / 1e9:6.2f} GB  "
                     f"out {end / 1e9:6.2f} GB  {time.perf_counter() - start:7.1f} s")
        print(LINES[-1], file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--target", default="onnxruntime")
    parser.add_argument("--replay", action="store_true", help="replay a cached tuning record (default: --retune)")
    parser.add_argument("--no-tune", action="store_true")
    parser.add_argument("--cprofile", help="write a cProfile of the run here")
    parser.add_argument("--extra", action="append", default=[], help="MODULE:ATTR to wrap as well")
    parser.add_argument("--smaps", action="store_true",
                        help="say what the resident set is made of (by mapping) at each phase's entry and at the peak")
    parser.add_argument("--output", help="keep the written model here (default: a temporary folder)")
    args = parser.parse_args()
    SAMPLER.smaps = args.smaps
    for module, name in PHASES + [tuple(e.split(":")) for e in args.extra]:
        wrap(module, name)
    import opfuse.pipeline as pipeline

    SAMPLER.start()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rss-phases-") as tmp:
        out = args.output or os.path.join(tmp, "out.onnx")
        options = dict(target=args.target, output=out, retune=not args.replay)
        if args.no_tune:
            options["tune"] = False
        if args.cprofile:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        try:
            _, report = pipeline.optimize(args.model, **options)
        finally:
            if args.cprofile:
                profiler.disable()
                profiler.dump_stats(args.cprofile)
        print(f"written: {report.ops_after and sum(report.ops_after.values())} nodes; "
              f"verification ok={report.verification.ok if report.verification else None}; "
              f"level={getattr(report.verification, 'variation_level', None)}", file=sys.stderr)
    SAMPLER.stop = True
    if SAMPLER.smaps:
        print(f"at the peak ({SAMPLER.smaps_peak / 1e9:.2f} GB, in {SAMPLER.phase_at_peak}): "
              f"{show_mappings(SAMPLER.at_peak, 12)}", file=sys.stderr)
    print(f"total {time.perf_counter() - start:.1f} s, peak RSS {SAMPLER.peak / 1e9:.2f} GB (sampled), "
          f"maxrss {__import__('resource').getrusage(0).ru_maxrss / 1e6:.2f} GB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
