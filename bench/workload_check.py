#!/usr/bin/env python3
"""What the workload check costs (driverd.host.workload.check: a child that loads the driver's own
libnvidia-ml and libcuda, NVML, cuInit, a context and a 1 MiB round trip on every GPU) against the least a
CUDA check can cost in the same run: a bare child `python3 -I -S -c` (no site: no .pth file runs in it, as in the check's) that dlopens libcuda.so.1 and calls cuInit
and cuDeviceGetCount. Run on a GPU host (the live root); prints medians, per-GPU cost and the ratio.

Each measurement starts on a GPU that no CUDA process has used for --idle-s seconds (3 by default), as
at a daemon's start or its hourly check. It matters: on the H200 hosts cuInit took ~100 ms when another
CUDA process had ended less than ~1 s before, and ~185 ms after 2 s or more without one (2026-11-29,
docs/testing.md). `--idle-s 0.5` measures checks made back to back.

Usage: python3 bench/workload_check.py [-n RUNS] [--idle-s S] [--root /] [--driver-root DIR]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

BARE = ("import ctypes,sys; l=ctypes.CDLL(sys.argv[1]); n=ctypes.c_int(); "
        "assert l.cuInit(0)==0; l.cuDeviceGetCount(ctypes.byref(n)); print(n.value)")


def main() -> int:
    from driverd.host import pci
    from driverd.driver.ident import parse_version_file as parse_nvidia_version
    from driverd.host.workload import check, quick
    from driverd.root import Root
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--idle-s", type=float, default=3.0,
                    help="seconds without a CUDA process before each measurement (default 3: an idle GPU)")
    ap.add_argument("--root", default="/")
    ap.add_argument("--driver-root", default=None)
    a = ap.parse_args()
    root = Root(a.root)
    version, _, _ = parse_nvidia_version(root.read_text("/proc/driver/nvidia/version"))
    gpus, _, _ = pci.classify(root, pci.scan(root, []), [])
    expected = [g.pci_address for g in gpus]
    us, _ = quick(root, version, a.driver_root)
    if not us.found or version is None:
        print(f"no loaded driver or user-space here (driver {version}, user-space {us.to_json()})")
        return 2
    cuda = str(root.path(us.libs["libcuda.so.1"]))
    bare, full, finding, last = [], [], [], None
    for _ in range(a.n):
        # each measurement starts with the GPU idle: the check's child ends (its contexts torn down) after
        # the check has its answer, and that teardown must not land in the next measurement; and cuInit
        # on a GPU left alone for a while takes longer than right after another process (see above)
        time.sleep(a.idle_s)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-c", BARE, cuda], check=True, capture_output=True)
        bare.append(time.perf_counter() - t)
        t = time.perf_counter()
        quick(root, version, a.driver_root)
        finding.append(time.perf_counter() - t)
        time.sleep(a.idle_s)
        t = time.perf_counter()
        last = check(root, version, expected, driver_root=a.driver_root)
        full.append(time.perf_counter() - t)
    b, f = statistics.median(bare), statistics.median(full)
    ok = last.ok if last else False
    print(f"driver {version}, user-space {us.version} in {us.lib_dir}, {len(expected)} GPU(s), "
          f"{a.idle_s:g} s without a CUDA process before each measurement")
    print(f"bare cuInit child          median {b:6.3f} s")
    print(f"workload check (ok={ok})   median {f:6.3f} s   {f / max(1, len(expected)):6.3f} s per GPU")
    print(f"  of which finding the user-space (in driverd's process): median {statistics.median(finding):6.3f} s")
    print(f"ratio workload check / bare cuInit: {f / b:.2f}")
    if last and not ok:
        print("problems: " + "; ".join(last.problems))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
