"""Peak RSS of ``opfuse llm`` per phase: the conversion in this process, RSS sampled every 50 ms by a thread.

    python experiments/llm_memory/phases.py SOURCE OUT [--precision int4] [other opfuse llm flags]

Each step of :func:`opfuse.llm.convert` (each step run in a spawned process, named by its function;
and, when they run in this process, optimize, the calibration run and quantize_int4) is wrapped to
mark where it starts; printed:
the peak RSS of this process and its children (``/proc/PID/status`` VmRSS, summed) inside each phase,
the largest single process's RSS in it, and the RSS when it ends, and this process's own VmHWM; and
each spawned step's own peak (its ``getrusage`` maximum resident set size, which a spike between
two samples does not escape). Measurements only.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def _rss_kb(pid) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_mb() -> tuple[float, float]:
    """(RSS of this process plus its children's, the largest of them) in MB: the steps run in spawned
    processes."""
    me = os.getpid()
    children = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        children.append(d)
            except (OSError, ValueError, IndexError):
                pass
    each = [_rss_kb("self"), *(_rss_kb(c) for c in children)]
    return sum(each) / 1024, max(each) / 1024


def hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _measured(fn, *args):
    """``fn(*args)`` and the peak resident set of the process it ran in (KB): run in each step's process."""
    import resource

    return fn(*args), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> int:
    phases: list[list] = [["start", *rss_mb(), 0.0]]  # name, peak, largest process's peak, rss at the end
    stop = False

    def sample():
        while not stop:
            total, largest = rss_mb()
            phases[-1][1] = max(phases[-1][1], total)
            phases[-1][2] = max(phases[-1][2], largest)
            time.sleep(0.05)

    def mark(name):
        phases[-1][3] = rss_mb()[0]
        phases.append([name, *rss_mb(), 0.0])

    def wrap(module, attr, name):
        original = getattr(module, attr)

        def wrapped(*a, **k):
            mark(name)
            try:
                return original(*a, **k)
            finally:
                mark(f"after {name}")

        setattr(module, attr, wrapped)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    import opfuse.llm as llm
    import opfuse.llm.quantize_int4 as q
    import opfuse.pipeline as pipeline

    mark("imports done")
    original = llm._in_a_process

    maxrss = {}  # step -> its process's own peak (MB)

    def in_a_process(fn, *a, **k):
        mark(f"{fn.__name__} (its process)")
        try:
            result, kb = original(_measured, fn, *a, **k)
            maxrss[f"{fn.__name__} (its process)"] = kb / 1024
            return result
        finally:
            mark(f"after {fn.__name__}")

    llm._in_a_process = in_a_process
    wrap(pipeline, "optimize", "optimize (in this process)")
    wrap(q, "hessians", "calibration run")
    wrap(q, "quantize_int4", "quantize_int4")
    from opfuse.cli import main as cli

    start = time.perf_counter()
    rc = cli(["llm", *sys.argv[1:]])
    mark("end")
    stop = True
    print(f"exit {rc} in {time.perf_counter() - start:.0f} s; VmHWM {hwm_mb():.0f} MB")
    print("| phase | peak RSS MB (all) | largest process MB | its process's maxrss MB | RSS at its end MB |")
    print("|---|---|---|---|---|")
    for name, peak, largest, end in phases[:-1]:
        own = f"{maxrss[name]:.0f}" if name in maxrss else ""
        print(f"| {name} | {peak:.0f} | {largest:.0f} | {own} | {end:.0f} |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
