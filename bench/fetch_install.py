#!/usr/bin/env python3
"""Fetch + verify + install + depmod of a real package vs the plain-tools baseline on the same bytes.

    python bench/fetch_install.py PACKAGE.tar.zst [--runs N]

Both sides download from the same loopback HTTP server into a fresh root each run:
  driverd, three ways:
    in-process  the daemon's path: fetch(verify sha256 against the index) + install(expected_sha256) which
                checks every file against the manifest while unpacking, stages, switches, runs the real
                depmod and modprobe --show-depends. No interpreter start-up.
    cli-1       `driverd fetch ... --install` (one process: start-up + imports + the above)
    cli-2       `driverd fetch ...` (full verification) then `driverd install PKG` (verifies again)
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
        from driverd.packages.fetch import Want, fetch
        from driverd.packages.install import install
        from driverd.root import Root
        from driverd.runner import Runner
        times: dict[str, list[float]] = {"in-process": [], "cli-1": [], "cli-2": []}
        b_times: list[float] = []
        fetch_args = ["--driver", m.driver_version, "--flavor", m.flavor, "--no-build"]
        with RepoServer(repo) as srv:
            url = f"{srv.url}/{pkg.name}"
            want = Want(m.driver_version, m.flavor, rel, m.arch)
            for i in range(a.runs):
                root = write_host(t / f"p{i}", HostSpec(release=rel))
                t0 = time.perf_counter()
                res = fetch(Root(root), want, [srv.url], verify_files=False)
                install(Root(root), res.package, Runner(), expected_sha256=res.sha256)
                times["in-process"].append(time.perf_counter() - t0)

                root = write_host(t / f"o{i}", HostSpec(release=rel))
                t0 = time.perf_counter()
                run(driverd_cmd() + ["fetch", "--root", str(root), "--repo", srv.url, "--install"] + fetch_args, env=env)
                times["cli-1"].append(time.perf_counter() - t0)

                root = write_host(t / f"d{i}", HostSpec(release=rel))
                t0 = time.perf_counter()
                out = run(driverd_cmd() + ["fetch", "--root", str(root), "--repo", srv.url] + fetch_args,
                          env=env).stdout.strip()
                run(driverd_cmd() + ["install", "--root", str(root), out], env=env)
                times["cli-2"].append(time.perf_counter() - t0)
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
        b = statistics.median(b_times)
        print(f"package: {pkg.name} ({pkg.stat().st_size / 1e6:.1f} MB, {len(m.files)} files), {a.runs} runs")
        print(f"baseline curl+sha256sum+tar+depmod: median {b:.3f}s")
        for k, v in times.items():
            d = statistics.median(v)
            print(f"driverd {k:<11} median {d:.3f}s  ratio {d / b:.2f}  (target <= 1.5)")


if __name__ == "__main__":
    main()
