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

from driverd.package.archive import read_manifest  # noqa: E402
from driverd.repo.index import write_index  # noqa: E402
from driverd.sim.hosttree import HostSpec, write_host  # noqa: E402


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
        from driverd.repo.fetch import Want, fetch
        from driverd.install.modules import install
        from driverd.root import Root
        from driverd.runner import Runner
        times: dict[str, list[float]] = {"in-process": [], "cli-1": [], "cli-2": []}
        base: dict[str, list[float]] = {k: [] for k in times}
        fetch_args = ["--driver", m.driver_version, "--flavor", m.flavor, "--no-build"]
        n = [0]

        def fresh() -> Path:
            # Remove the previous run's tree first: hundreds of MB of leftovers slow later runs down.
            for old in t.glob("run-*"):
                shutil.rmtree(old)
            for old in t.glob("b*.tar.zst"):
                old.unlink()
            n[0] += 1
            r = write_host(t / f"run-{n[0]}", HostSpec(release=rel))
            os.sync()          # start every timed run with no dirty pages left by the previous one
            return r

        # The server runs in its own process: in this one it would compete with driverd for the GIL
        # while curl (a separate process) would not, which skews the comparison against driverd.
        server = subprocess.Popen([sys.executable, "-m", "driverd.sim.httprepo", str(repo)], env=env,
                                  stdout=subprocess.PIPE, text=True)
        srv = type("Srv", (), {"url": server.stdout.readline().strip()})()
        try:
            url = f"{srv.url}/{pkg.name}"
            want = Want(m.driver_version, m.flavor, rel, m.arch)

            def baseline() -> float:
                root = fresh()
                dest = root / "lib/modules" / rel / "updates/driverd"
                f = t / f"b{n[0]}.tar.zst"
                t0 = time.perf_counter()
                run(["curl", "-sSf", "-o", str(f), url])
                run(["sha256sum", str(f)])
                dest.mkdir(parents=True)
                run(["tar", "-I", "zstd", "-xf", str(f), "-C", str(dest)])
                run(["depmod", "-b", str(root), rel])
                return time.perf_counter() - t0

            def in_process() -> float:
                root = fresh()
                t0 = time.perf_counter()
                res = fetch(Root(root), want, [srv.url], verify_files=False)
                install(Root(root), res.package, Runner(), expected_sha256=res.sha256)
                return time.perf_counter() - t0

            def cli_1() -> float:
                root = fresh()
                t0 = time.perf_counter()
                run(driverd_cmd() + ["fetch", "--root", str(root), "--repo", srv.url, "--install"] + fetch_args,
                    env=env)
                return time.perf_counter() - t0

            def cli_2() -> float:
                root = fresh()
                t0 = time.perf_counter()
                out = run(driverd_cmd() + ["fetch", "--root", str(root), "--repo", srv.url] + fetch_args,
                          env=env).stdout.strip()
                run(driverd_cmd() + ["install", "--root", str(root), out], env=env)
                return time.perf_counter() - t0

            in_process(), baseline()          # warm-up (imports, page cache), not counted
            for _ in range(a.runs):
                # each variant is timed right after its own baseline run, so load drift hits both
                for name, fn in (("in-process", in_process), ("cli-1", cli_1), ("cli-2", cli_2)):
                    base[name].append(baseline())
                    times[name].append(fn())
        finally:
            server.terminate()
            server.wait()
        print(f"package: {pkg.name} ({pkg.stat().st_size / 1e6:.1f} MB, {len(m.files)} files), {a.runs} runs")
        for k, v in times.items():
            d, b = statistics.median(v), statistics.median(base[k])
            print(f"driverd {k:<11} median {d * 1000:6.1f} ms vs baseline {b * 1000:5.1f} ms  ratio {d / b:.2f}"
                  f"  (target <= 1.5)")


if __name__ == "__main__":
    main()
