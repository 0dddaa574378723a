#!/usr/bin/env python3
"""Cold `driverd build` against builds through a warm compiler cache (ccache), in one run.

    python bench/build_cache.py [--source TAR] [--kernels A,B] [--older-source TAR] [--cases LIST]

Real NVIDIA sources and Debian headers (installed: .ci/install-components, plus
linux-headers-6.1.0-50-cloud-amd64 for the second ABI). Run by hand, not in CI: every case is a full
kbuild build of NVIDIA's five modules (about 2 minutes on 2 idle cores). Cases, in this order (one
work directory, so the tarballs are extracted once before timing and the cache is shared):

  cold-A     --ccache off, kernel A                         the baseline
  fill-A     --ccache on, kernel A, empty cache             what the cache costs a cold build
  rebuild-A  --ccache on, kernel A again, another out dir   same inputs (a retried pod, --rebuild)
  abi-B      --ccache on, kernel B (the same series)        the second cell of the same driver
  cold-B     --ccache off, kernel B                         its baseline
  older-P    --ccache on, --older-source on kernel A        (with --older-source) an earlier point release
  point-P    --ccache on, --newer-source on kernel A        the next point release, cache warm from older-P
  cold-P     --ccache off, --newer-source on kernel A       its baseline
  flavor-A   --ccache on, --newer-source (the proprietary flavour of the same driver) on kernel A,
             warm from the open flavour's builds: the other flavour's cell of the same driver and
             kernel (its baseline is cold-P)

Prints each build's CPU time (the build and every process it ran), wall time and the cache's
hits/misses/uncacheable compiles, and the ratios cold/warm (issue 34's target for the second cell:
>= 2). On a machine shared with other work the CPU ratio is the one to read: wall time also measures
the neighbours. The older point release's source is
Debian's bookworm-backports nvidia-kernel-source (535.216.03, proprietary flavour only): fetch it
with a private apt state as docs/testing.md describes and pass the tarball inside it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def driverd() -> list[str]:
    exe = Path(sys.executable).parent / "driverd"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "driverd"]


def build(work: Path, out: Path, source: str, kernel: str, flavor: str, ccache: str, jobs: int) -> dict:
    argv = driverd() + ["build", "--source", source, "--kernel", kernel, "--flavor", flavor, "--out", str(out),
                        "--work-dir", str(work), "--jobs", str(jobs), "--ccache", ccache, "--json"]
    t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the build and everything it ran (make, gcc, ccache: waited-for descendants count
    # into RUSAGE_CHILDREN): on a machine shared with other work, wall time measures the neighbours too.
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    d = json.loads(r.stdout)
    return {"wall": wall, "cpu": cpu, "make": d["phases"].get("make", 0.0), "ccache": d.get("ccache")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default="/usr/src/nvidia-open-kernel.tar.xz")
    ap.add_argument("--flavor", default="open")
    ap.add_argument("--kernels", default="6.1.0-47-cloud-amd64,6.1.0-50-cloud-amd64")
    ap.add_argument("--older-source", help="an earlier point release's kernel-source tarball (535.216.03)")
    ap.add_argument("--newer-source", default="/usr/src/nvidia-kernel.tar.xz")
    ap.add_argument("--point-flavor", default="proprietary")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cases", default="cold-A,fill-A,rebuild-A,abi-B,cold-B,older-P,point-P,cold-P")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary directory)")
    a = ap.parse_args()
    ka, kb = a.kernels.split(",")
    for k in (ka, kb):
        if not Path(f"/usr/src/linux-headers-{k}/Makefile").is_file():
            sys.exit(f"headers of {k} are missing; fix: apt-get install linux-headers-{k}")
    cases = [c for c in a.cases.split(",") if c]
    if not a.older_source:
        cases = [c for c in cases if c not in ("older-P", "point-P")]
    from driverd.build.modules import prepare_source
    from driverd.runner import which
    if which("ccache") is None:
        sys.exit("ccache is not installed; fix: apt-get install ccache")
    plan = {
        "cold-A": (a.source, ka, a.flavor, "off"), "fill-A": (a.source, ka, a.flavor, "on"),
        "rebuild-A": (a.source, ka, a.flavor, "on"), "abi-B": (a.source, kb, a.flavor, "on"),
        "cold-B": (a.source, kb, a.flavor, "off"), "older-P": (a.older_source, ka, a.point_flavor, "on"),
        "point-P": (a.newer_source, ka, a.point_flavor, "on"), "cold-P": (a.newer_source, ka, a.point_flavor, "off"),
        "flavor-A": (a.newer_source, ka, a.point_flavor, "on"),
    }
    tmp = None if a.keep else tempfile.TemporaryDirectory(prefix="driverd-bench-ccache.")
    base = Path(a.keep or tmp.name)
    work = base / "work"
    for src in {plan[c][0] for c in cases}:
        prepare_source(src, work)              # extracted once, outside the timings
    res: dict[str, dict] = {}
    for c in cases:
        src, kernel, flavor, mode = plan[c]
        res[c] = build(work, base / f"out-{c}", src, kernel, flavor, mode, a.jobs)
        cs = res[c]["ccache"]
        print(f"{c:<10} {kernel:<22} {flavor:<12} ccache {mode:<3} cpu {res[c]['cpu']:7.1f} s  wall "
              f"{res[c]['wall']:7.1f} s  load {os.getloadavg()[0]:5.1f}" + (f"  hits {cs['hits']:4} misses {cs['misses']:4} uncacheable "
                                           f"{cs['uncacheable']:4}" if cs else ""), flush=True)
    print(f"\nmake -j{a.jobs}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")

    def ratio(cold: str, warm: str, what: str, target: str = "") -> None:
        if cold in res and warm in res:
            print(f"{what:<60} {res[cold]['cpu'] / res[warm]['cpu']:5.2f}x CPU, "
                  f"{res[cold]['wall'] / res[warm]['wall']:5.2f}x wall {target}")
    ratio("cold-A", "fill-A", "cold / cold through an empty cache (the cache's cost)")
    ratio("cold-A", "rebuild-A", "cold / the same cell again (same inputs)")
    ratio("cold-B", "abi-B", f"cold / second cell, new ABI {kb} (warm from {ka})", "(target >= 2)")
    ratio("cold-P", "point-P", "cold / next point release, same kernel (warm from older)", "(target >= 2)")
    ratio("cold-P", "flavor-A", f"cold / the other flavour ({a.point_flavor}), same driver and kernel", "(target >= 2)")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
