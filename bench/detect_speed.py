#!/usr/bin/env python3
"""`driverd detect --json` wall time on captured host trees vs a bare `python3 -c pass`, same run; with
--live, on this GPU host against `nvidia-smi -q` (issue 47's baseline: what people run to read a GPU host),
the two interleaved run by run so that a busy moment hits both.

Targets: issue 2, median <= 0.25 s on a 2-core machine for the trees; issue 47, detect <= nvidia-smi -q live.
Usage: python3 bench/detect_speed.py [-n RUNS] [--live]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from driverd import safetar

HOSTS = Path(__file__).resolve().parent.parent / "tests/fixtures/hosts"


def median_wall(cmd: list[str], n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=21)
    ap.add_argument("--live", action="store_true", help="this host against nvidia-smi -q (needs a loaded driver)")
    args = ap.parse_args()
    exe = Path(sys.executable).parent / "driverd"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "driverd"]
    if args.live:
        return live(base, args.n)
    bare = median_wall([sys.executable, "-c", "pass"], args.n)
    print(f"python3 -c pass                 median {bare * 1000:7.1f} ms")
    worst = 0.0
    for tarball in sorted(HOSTS.glob("*.tar.gz")):
        with tempfile.TemporaryDirectory() as d:
            safetar.extract_file(tarball, d, links="rooted")
            m = median_wall(base + ["detect", "--root", d, "--json"], args.n)
            worst = max(worst, m)
            print(f"detect --json {tarball.name:<32} median {m * 1000:7.1f} ms  ratio to bare start-up {m / bare:5.1f}x")
    ok = worst <= 0.25
    print(f"target median <= 250 ms: {'met' if ok else 'MISSED'} (worst {worst * 1000:.1f} ms)")
    return 0 if ok else 1


def live(base: list[str], n: int) -> int:
    import shutil
    smi = shutil.which("nvidia-smi") or "/usr/local/nvidia/bin/nvidia-smi"
    cmds = {"detect --json": base + ["detect", "--json"], "nvidia-smi -q": [smi, "-q"],
            "python3 -c pass": [sys.executable, "-c", "pass"]}
    times: dict[str, list[float]] = {k: [] for k in cmds}
    for c in cmds.values():                     # warm: bytecode written, pages cached
        subprocess.run(c, check=True, stdout=subprocess.DEVNULL)
    for _ in range(n):
        for k, c in cmds.items():
            t = time.perf_counter()
            subprocess.run(c, check=True, stdout=subprocess.DEVNULL)
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, m in med.items():
        print(f"{k:<16} median {m * 1000:7.1f} ms  (min {min(times[k]) * 1000:.1f}, max {max(times[k]) * 1000:.1f})")
    ratio = med["detect --json"] / med["nvidia-smi -q"]
    print(f"detect / nvidia-smi -q: {ratio:.2f}x (target <= 1.00x: {'met' if ratio <= 1 else 'MISSED'})")
    return 0 if ratio <= 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
