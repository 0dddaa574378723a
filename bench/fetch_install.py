#!/usr/bin/env python3
"""Fetch + verify + install + depmod of a real package vs the plain-tools baseline on the same bytes.

    python bench/fetch_install.py PACKAGE.tar.zst [--runs N]

Both sides download from the same loopback HTTP server into a fresh root each run:
  driverd:   `driverd fetch --root R --driver V --flavor F --repo URL` then `driverd install --root R PKG`
             (two CLI processes, as an operator or the daemon's step runner would invoke them; fetch verifies
             sha256 and every file against the manifest, install re-checks, stages, switches, runs the real
             depmod and modprobe --show-depends)
  baseline:  curl -o, sha256sum, tar -I zstd -x into lib/modules/<rel>/updates/driverd, depmod -b R <rel>
Prints the median of N runs for each and the ratio driverd / baseline (target <= 1.5).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from driverd.packages.archive import read_manifest  # noqa: E402
from driverd.packages.repo import write_index  # noqa: E402
from driverd.sim.hosttree import HostSpec, write_host  # noqa: E402
from driverd.sim.httprepo import RepoServer  # noqa: E402


def driverd_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "driverd"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "driverd"]


def run(argv, **kw):
    return subprocess.run(argv, check=True, capture_output=True, text=True, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("package")
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    pkg = Path(a.package).resolve()
    m = read_manifest(pkg)
    rel = m.kernel_release
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory(prefix="driverd-bench.") as t:
        t = Path(t)
        repo = t / "repo"
        repo.mkdir()
        shutil.copy(pkg, repo / pkg.name)
        write_index(repo)
        d_times, b_times = [], []
        with RepoServer(repo) as srv:
            url = f"{srv.url}/{pkg.name}"
            for i in range(a.runs):
                # driverd
                root = write_host(t / f"d{i}", HostSpec(release=rel))
                t0 = time.perf_counter()
                out = run(driverd_cmd() + ["fetch", "--root", str(root), "--driver", m.driver_version, "--flavor",
                                           m.flavor, "--repo", srv.url, "--no-build"], env=env).stdout.strip()
                run(driverd_cmd() + ["install", "--root", str(root), out], env=env)
                d_times.append(time.perf_counter() - t0)
                # baseline
                root = write_host(t / f"b{i}", HostSpec(release=rel))
                dest = root / "lib/modules" / rel / "updates/driverd"
                t0 = time.perf_counter()
                f = t / f"b{i}.tar.zst"
                run(["curl", "-sSf", "-o", str(f), url])
                run(["sha256sum", str(f)])
                dest.mkdir(parents=True)
                run(["tar", "-I", "zstd", "-xf", str(f), "-C", str(dest)])
                run(["depmod", "-b", str(root), rel])
                b_times.append(time.perf_counter() - t0)
        d, b = statistics.median(d_times), statistics.median(b_times)
        print(f"package: {pkg.name} ({pkg.stat().st_size / 1e6:.1f} MB, {len(m.files)} files)")
        print(f"driverd fetch+verify+install+depmod: median {d:.3f}s  (runs: {' '.join(f'{x:.3f}' for x in d_times)})")
        print(f"curl+sha256sum+tar+depmod baseline:  median {b:.3f}s  (runs: {' '.join(f'{x:.3f}' for x in b_times)})")
        print(f"ratio driverd/baseline: {d / b:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
