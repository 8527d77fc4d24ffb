"""Peak RSS of ``opfuse llm`` per phase: the conversion in this process, RSS sampled every 50 ms by a thread.

    python experiments/llm_memory/phases.py SOURCE OUT [--precision int4] [other opfuse llm flags]

Each step of :func:`opfuse.llm.convert` (the export's process, optimize, quantize_int4) is wrapped to mark
where it starts; printed: the peak RSS of this process and its children (``/proc/PID/status`` VmRSS,
summed; the export runs in a spawned child) inside each phase and the RSS when it ends, and this
process's own VmHWM. Measurements only.
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


def rss_mb() -> float:
    """RSS of this process plus its children's (the export runs in a spawned process)."""
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
    return (_rss_kb("self") + sum(_rss_kb(c) for c in children)) / 1024


def hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    phases: list[list] = [["start", 0.0, rss_mb()]]  # name, peak, rss at the end
    stop = False

    def sample():
        while not stop:
            r = rss_mb()
            if r > phases[-1][1]:
                phases[-1][1] = r
            time.sleep(0.05)

    def mark(name):
        phases[-1][2] = rss_mb()
        phases.append([name, rss_mb(), 0.0])

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
    wrap(llm, "_export_in_a_process", "load + export (child process)")
    wrap(pipeline, "optimize", "optimize")
    wrap(q, "quantize_int4", "quantize_int4")
    from opfuse.cli import main as cli

    start = time.perf_counter()
    rc = cli(["llm", *sys.argv[1:]])
    mark("end")
    stop = True
    print(f"exit {rc} in {time.perf_counter() - start:.0f} s; VmHWM {hwm_mb():.0f} MB")
    print("| phase | peak RSS MB | RSS at its end MB |")
    print("|---|---|---|")
    for name, peak, end in phases[:-1]:
        print(f"| {name} | {peak:.0f} | {end:.0f} |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
