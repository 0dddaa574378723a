#!/usr/bin/env python3
"""Cold `driverd build` of one kernel x flavour vs `dkms build` of the same source and kernel.

    python bench/build_vs_dkms.py [--kernel 6.1.0-47-cloud-amd64] [--dkms-source DIR] [--tarball TAR]

Needs dkms and the DKMS source (apt-get install dkms; the source tree of nvidia-open-kernel-dkms,
/usr/src/nvidia-current-open-535.261.03, registered with `dkms add`). Run by hand, not in CI.
Both build all five modules with make -j$(nproc), strip debug info and sign (DKMS with its MOK key,
driverd with the same key/certificate). Measured, in this order, on the same machine:
  dkms        dkms build --force nvidia-current-open/535.261.03 -k KERNEL
  driverd     driverd build --source <the same DKMS source tree> (fresh work dir, no cache)
  driverd-tar driverd build --source <the Debian tarball> (fresh work dir: includes extracting it)
  again       the same driverd build requested again (served from the output directory)
Prints wall times and the ratios driverd/dkms (target <= 1.05) and the repeat time (target < 1 s).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def driverd() -> list[str]:
    exe = Path(sys.executable).parent / "driverd"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "driverd"]


def timed(argv: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, **kw)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return dt, r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="6.1.0-47-cloud-amd64")
    ap.add_argument("--dkms-source", default="/usr/src/nvidia-current-open-535.261.03")
    ap.add_argument("--tarball", default="/usr/src/nvidia-open-kernel.tar.xz")
    ap.add_argument("--module", default="nvidia-current-open/535.261.03")
    a = ap.parse_args()
    if not shutil.which("dkms"):
        sys.exit("dkms is not installed: apt-get install dkms (and the nvidia-open-kernel-dkms source)")
    name, version = a.module.split("/")
    if not Path(f"/var/lib/dkms/{name}/{version}").exists():
        subprocess.run(["dkms", "add", a.dkms_source], check=True)
    mok_key, mok_cert = Path("/var/lib/dkms/mok.key"), Path("/var/lib/dkms/mok.pub")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    jobs = str(os.cpu_count() or 1)
    times: dict[str, float] = {}
    times["dkms"], _ = timed(["dkms", "build", "--force", a.module, "-k", a.kernel])
    sign = ["--sign-key", str(mok_key), "--sign-cert", str(mok_cert)] if mok_key.exists() else []
    with tempfile.TemporaryDirectory(prefix="driverd-bench-build.") as t:
        t = Path(t)
        common = ["--kernel", a.kernel, "--flavor", "open", "--jobs", jobs, "--json"] + sign
        times["driverd"], r1 = timed(driverd() + ["build", "--source", a.dkms_source, "--out", str(t / "o1"),
                                                 "--work-dir", str(t / "w1")] + common, env=env)
        times["driverd-tar"], _ = timed(driverd() + ["build", "--source", a.tarball, "--out", str(t / "o2"),
                                                     "--work-dir", str(t / "w2")] + common, env=env)
        times["again"], r = timed(driverd() + ["build", "--source", a.tarball, "--out", str(t / "o2"),
                                               "--work-dir", str(t / "w2")] + common, env=env)
        assert '"cached": true' in r.stdout, r.stdout
    import json
    print(f"kernel {a.kernel}, make -j{jobs}, signed: {bool(sign)}")
    print(f"driverd phases (s): {json.dumps(json.loads(r1.stdout).get('phases'))}")
    for k, v in times.items():
        print(f"  {k:<12} {v:8.2f} s")
    print(f"ratio driverd/dkms (same source tree): {times['driverd'] / times['dkms']:.3f} (target <= 1.05)")
    print(f"ratio driverd/dkms (from the tarball, extraction included): {times['driverd-tar'] / times['dkms']:.3f}")
    print(f"same build again: {times['again']:.3f} s including interpreter start-up (target < 1 s)")


if __name__ == "__main__":
    main()
