#!/usr/bin/env python3
"""Reading every process on a busy host (driverd.host.processes.scan: which NVIDIA device files each
holds open and whether it is a GPU daemon, what `detect` and a reconcile read; host/procscan.py): the
default (forked workers where the host has many processes) against one process reading them all, in the
same run, on the live /proc.

The bench starts --processes sleeping processes of its own holding --fds descriptors each (a training
node's ranks and data-loader workers hold tens to hundreds), then alternates the two ways, --runs times
each, and prints their medians, the ratio and how many workers the default used. Where `nvidia-smi` is on
the PATH its `-q` is timed too, as the yardstick detect is held to (issue 47).

Usage: python3 bench/proc_scan.py [--processes N] [--fds F] [--runs R]
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time


def main() -> int:
    from driverd.host import forked, procscan
    from driverd.host.processes import pids, scan
    from driverd.root import Root
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=1000)
    ap.add_argument("--fds", type=int, default=50)
    ap.add_argument("--runs", type=int, default=9)
    a = ap.parse_args()
    kids = []
    for _ in range(a.processes):
        pid = os.fork()
        if pid == 0:
            for _ in range(a.fds):
                os.open(os.devnull, os.O_RDONLY)            # held until the bench kills it
            signal.pause()
            os._exit(0)
        kids.append(pid)
    try:
        time.sleep(1.0 + a.processes / 1000)
        root = Root("/")
        processes = len(pids(root))
        workers: list[int] = []
        real_fork = forked.fork

        def counting(fn):
            child = real_fork(fn)
            workers.append(child.pid)
            return child
        forked.fork = counting
        default_per_worker = procscan.PER_WORKER
        times: dict[str, list[float]] = {"one process": [], "default": []}
        answers = {}
        for _ in range(a.runs):
            for way in times:
                procscan.PER_WORKER = 10**9 if way == "one process" else default_per_worker
                workers.clear()
                t = time.perf_counter()
                answers[way] = scan(root)
                times[way].append(time.perf_counter() - t)
        smi = shutil.which("nvidia-smi")
        if smi:
            times["nvidia-smi -q"] = []
            for _ in range(a.runs):
                t = time.perf_counter()
                subprocess.run([smi, "-q"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                times["nvidia-smi -q"].append(time.perf_counter() - t)
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
        for pid in kids:
            os.waitpid(pid, 0)
    fds = a.processes * a.fds
    print(f"{processes} processes, {fds} descriptors of the bench's own, {len(os.sched_getaffinity(0))} CPUs; the "
          f"default used {len(workers)} workers")
    for way, ts in times.items():
        print(f"{way:<14} median {statistics.median(ts) * 1000:7.1f} ms  (min {min(ts) * 1000:.1f}, max "
              f"{max(ts) * 1000:.1f})")
    same = answers["default"] == answers["one process"]
    ratio = statistics.median(times["default"]) / statistics.median(times["one process"])
    print(f"default / one process: {ratio:.2f}x; the same answer: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
