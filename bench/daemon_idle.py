#!/usr/bin/env python3
"""An idle `driverd daemon`: RSS and CPU over 60 s on a converged simulated host (8x H100, 4
NVSwitch, the simulated kernel), and the driver container's fast path: `driverd
container-entrypoint` restarted on that converged host, from exec to READY=1 on the notify socket,
against a bare `python3 -c pass` start-up in the same run.

Targets (issue 13): idle RSS <= 50 MB in host mode, idle CPU <= 0.1 %; the fast path is reported as a
ratio to the bare interpreter start-up.
Usage: python3 bench/daemon_idle.py [--seconds 60] [-n 5]
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build_host(work: Path) -> Path:
    from driverd.repo.index import write_index
    from driverd.sim.scenario import dgx_spec, make_companion_packages, make_host, make_packages
    pk = make_packages(work / "repo")
    make_companion_packages(work / "repo")          # the NVSwitches' fabric manager, of the driver's version
    write_index(work / "repo", verify=False)
    root = make_host(work / "root", dgx_spec(gpus=8, nvswitches=4, nouveau=False))
    cfg = root / "etc/driverd/config.toml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(f'[driver]\nversion = "535.261.03"\nflavor = "open"\n[packages]\nrepositories = '
                   f'["file://{pk["old"].parent}"]\n[runtime]\nrestart = "none"\n'
                   '[modules]\nkernel = "sim"\n[companions]\nfetch = true\n')          # a simulated tree: the simulated kernel changes it
    return root


class Notify:
    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)

    def wait(self, needle: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while True:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                msg = self.sock.recv(65536).decode()
            except socket.timeout:
                raise SystemExit(f"no {needle} within {timeout}s") from None
            if needle in msg:
                return time.monotonic()


def start(root: Path, command: str, notify: Notify) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIVERD_")}
    env["NOTIFY_SOCKET"] = notify.path
    exe = Path(sys.executable).parent / "driverd"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "driverd"]
    return subprocess.Popen(base + [command, "--root", str(root), "--listen", "127.0.0.1:0"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(REPO))


def stop(p: subprocess.Popen) -> float:
    t = time.monotonic()
    p.send_signal(signal.SIGTERM)
    rc = p.wait(15)
    took = time.monotonic() - t
    if rc != 0:
        raise SystemExit(f"exit {rc} after SIGTERM: {p.stderr.read()}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="idle measurement window")
    ap.add_argument("-n", type=int, default=5, help="fast-path and baseline runs (medians)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="drvd-bench-") as t:
        work = Path(t)
        root = build_host(work)
        notify = Notify(str(work / "notify"))

        # -- host mode: converge, then sit idle --------------------------------------------------
        t0 = time.monotonic()
        p = start(root, "daemon", notify)
        ready = notify.wait("READY=1", 120)
        print(f"daemon: converged the bare simulated host and sent READY=1 after {ready - t0:.2f} s")
        time.sleep(2.0)                                    # let start-up garbage settle
        proc = psutil.Process(p.pid)
        c0, w0 = proc.cpu_times(), time.monotonic()
        peak = 0
        while time.monotonic() - w0 < args.seconds:
            peak = max(peak, proc.memory_info().rss)
            time.sleep(min(5.0, max(0.0, args.seconds - (time.monotonic() - w0))))
        c1, w1 = proc.cpu_times(), time.monotonic()
        rss = proc.memory_info().rss
        uss = proc.memory_full_info().uss
        threads = proc.num_threads()
        cpu = (c1.user + c1.system - c0.user - c0.system) / (w1 - w0) * 100
        took = stop(p)
        rss_mb, peak_mb = rss / 2**20, max(peak, rss) / 2**20
        print(f"idle {w1 - w0:.0f} s: RSS {rss_mb:.1f} MB (peak {peak_mb:.1f} MB, USS {uss / 2**20:.1f} MB, "
              f"{threads} threads), CPU {cpu:.4f} % "
              f"({(c1.user + c1.system - c0.user - c0.system) * 1000:.1f} ms in {w1 - w0:.0f} s)")
        print(f"  target RSS <= 50 MB: {'met' if peak_mb <= 50 else 'MISSED'}; "
              f"target CPU <= 0.1 %: {'met' if cpu <= 0.1 else 'MISSED'}")
        print(f"SIGTERM -> exit 0 in {took * 1000:.0f} ms (limit 10 s)")

        # -- the driver container restarted on the converged host ------------------------------
        fast = []
        for _ in range(args.n):
            t0 = time.monotonic()
            p = start(root, "container-entrypoint", notify)
            at = notify.wait("READY=1", 30)
            fast.append(at - t0)
            stop(p)
            if not re.search(r"fast path: ", p.stderr.read()):
                raise SystemExit("the container entrypoint did not take the fast path")
        bare = []
        for _ in range(args.n):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            bare.append(time.perf_counter() - t0)
        f, b = statistics.median(fast), statistics.median(bare)
        print(f"container-entrypoint fast path, exec -> READY=1: median {f * 1000:.0f} ms over {args.n} "
              f"(min {min(fast) * 1000:.0f}, max {max(fast) * 1000:.0f})")
        print(f"python3 -c pass:                               median {b * 1000:.0f} ms")
        print(f"  ratio fast path / bare interpreter start-up: {f / b:.1f}x")
    return 0 if peak_mb <= 50 and cpu <= 0.1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
