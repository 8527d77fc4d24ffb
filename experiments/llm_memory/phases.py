"""Peak RSS of ``opfuse llm`` per phase: the conversion in this process, RSS sampled every 50 ms by a thread.

    python experiments/llm_memory/phases.py SOURCE OUT [--precision int4] [other opfuse llm flags]

Each step of :func:`opfuse.llm.convert` (load, export, optimize, quantize_int4, the genai files) is
wrapped to mark where it starts; printed: the peak RSS (``/proc/self/status`` VmRSS, and VmHWM at the
end) inside each phase and the RSS when it ends. Measurements only.
"""

from __future__ import annotations

import sys
import threading
import time


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


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
    import opfuse.llm.export as export
    import opfuse.llm.genai as genai
    import opfuse.llm.quantize_int4 as q
    import opfuse.pipeline as pipeline

    mark("imports done")
    wrap(export, "load", "load")
    wrap(export, "export", "export")
    wrap(pipeline, "optimize", "optimize")
    wrap(q, "quantize_int4", "quantize_int4")
    wrap(genai, "write_config", "genai files")
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
