#!/usr/bin/env python3
"""`driverd detect --json` wall time on captured host trees vs a bare `python3 -c pass`, same run.

Target (issue 2): median <= 0.25 s on a 2-core machine. Prints medians and the ratio.
Usage: python3 bench/detect_speed.py [-n RUNS]
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
    args = ap.parse_args()
    exe = Path(sys.executable).parent / "driverd"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "driverd"]
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


if __name__ == "__main__":
    raise SystemExit(main())
