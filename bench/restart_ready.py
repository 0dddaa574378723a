#!/usr/bin/env python3
"""How fast a restarted driver container is ready on a converged host (issue 47), against the workload
check's own time in the same run — ready means CUDA works, so the check is the floor; what the fast path
adds on top of it is the figure. Run on a GPU host as root (the live root; the driver is left as it runs:
driver.manage = auto, runtimes none, a temporary state directory, so nothing of the host's is changed).

Prints per restart: ready time (process start to /readyz 200) and whether it took the fast path; then the
median restart, the median workload check, their difference and ratio.

Usage: python3 bench/restart_ready.py [-n RESTARTS]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cfg: str, log: str) -> float:
    port = _port()
    env = {**os.environ, "DRIVERD_CONFIG": cfg, "DRIVERD_ROOT": "/"}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "driverd", "container-entrypoint", "--listen", f"127.0.0.1:{port}"],
                             env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/")
    try:
        while time.perf_counter() - t0 < 120:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status == 200:
                    return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.01)
        raise SystemExit(f"not ready in 120 s: see {log}")
    finally:
        p.terminate()
        p.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=5)
    a = ap.parse_args()
    from driverd.driver.ident import loaded
    from driverd.host import pci
    from driverd.host.workload import check
    from driverd.root import Root
    root = Root("/")
    drv = loaded(root)
    if drv is None:
        print("no NVIDIA driver is loaded here")
        return 2
    work = tempfile.mkdtemp(prefix="driverd-bench-restart.")
    cfg = os.path.join(work, "config.toml")
    with open(cfg, "w") as f:
        f.write(f'[driver]\nversion = "{drv.version}"\nmanage = "auto"\n[runtime]\nruntimes = ["none"]\n'
                f'[state]\ndir = "{work}/state"\n[validation]\nworkload = "on"\n')
    first = start(cfg, f"{work}/start-0.log")
    print(f"first start (records the converge): {first:.3f} s")
    ready, fast = [], 0
    for i in range(1, a.n + 1):
        time.sleep(0.5)
        t = start(cfg, f"{work}/start-{i}.log")
        text = open(f"{work}/start-{i}.log").read()
        took = "fast path:" in text and "no fast path:" not in text
        fast += took
        ready.append(t)
        print(f"restart {i}: ready in {t:.3f} s ({'fast path' if took else 'reconciled'})")
    gpus = [g.pci_address for g in pci.classify(root, pci.scan(root, []), [])[0]]
    checks = []
    for _ in range(a.n):
        time.sleep(0.5)
        t = time.perf_counter()
        check(root, drv.version, gpus)
        checks.append(time.perf_counter() - t)
    r, c = statistics.median(ready), statistics.median(checks)
    print(f"restart ready median {r:.3f} s ({fast}/{a.n} through the fast path); workload check median {c:.3f} s")
    print(f"restart - check: {r - c:+.3f} s; ratio {r / c:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
