"""Run a command with a memory cap: its peak resident memory and wall time, killed if it goes over the cap.

    python benchmarks/memcap.py --limit-gb 16 -- python -m opfuse optimize big.onnx -o out.onnx

For the memory cases of issue 49 (a model whose optimize the kernel's OOM killer ended at 19.5 GB on a
24 GB machine shared with others): the command's process tree is polled every ``--every`` seconds (its
resident set, from /proc: Linux only), and killed (SIGKILL, the whole process group) as soon as it
exceeds ``--limit-gb``, before the machine's OOM killer picks some other process. One line at the end:
``memcap: exit N, peak RSS X GB (process tree, polled), maxrss Y GB (getrusage of the largest child),
wall Z s``, and ``killed at the cap`` when it was. Polling can miss a spike shorter than ``--every``;
getrusage's maxrss (what ``/usr/bin/time -v`` prints as "Maximum resident set size") does not, but is
one process's. Exit: the command's, or 137 when killed at the cap.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import time


def tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and every descendant (from /proc/*/stat's ppid and statm)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    page, total, stack = os.sysconf("SC_PAGE_SIZE"), 0, [root]
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
        stack.extend(children.get(pid, []))
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gb", type=float, default=16.0, help="kill the command above this RSS (GB, 1e9)")
    parser.add_argument("--every", type=float, default=0.2, help="seconds between polls")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (memcap.py [--limit-gb G] -- COMMAND ...)")
    start = time.perf_counter()
    proc = subprocess.Popen(command, start_new_session=True)
    peak, killed = 0, False
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        if peak > args.limit_gb * 1e9:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            proc.wait()
            break
        time.sleep(args.every)
    wall = time.perf_counter() - start
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    rc = 137 if killed else proc.returncode
    print(f"memcap: exit {proc.returncode}, peak RSS {peak / 1e9:.2f} GB (process tree, polled), maxrss "
          f"{maxrss / 1e9:.2f} GB (getrusage of the largest child), wall {wall:.1f} s"
          + (f"; killed at the cap of {args.limit_gb:g} GB" if killed else ""), file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
