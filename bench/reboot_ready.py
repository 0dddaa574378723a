#!/usr/bin/env python3
"""`driverd reboot-ready` wall time on a converged simulated host (issue 43: kured runs it every period as its
sentinel command), against `python -c pass` and `driverd --help` start-up in the same run.

The host: the 2-GPU simulated host with the driver's package installed for the running kernel, and two newer
kernels installed as Debian's linux-image leaves them, each prepared (its driverd package installed): the gate
is open, so every check runs (package record, module sizes, every module's vermagic, the kernels' own vermagic).
With --enforce the newer kernels also enforce module signatures (the keyrings and every signature are read).

Target: median well under a second (<= 0.5 s) on this 2-core machine. Prints medians and ratios.
Usage: python3 bench/reboot_ready.py [-n RUNS] [--enforce]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def median_wall(cmd: list[str], n: int, env: dict, ok=(0,)) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        times.append(time.perf_counter() - t)
        if r.returncode not in ok:
            raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.decode()[-2000:]}")
    return statistics.median(times)


def converged_host(base: Path, enforce: bool) -> Path:
    from driverd.install.modules import install
    from driverd.root import Root
    from driverd.runner import Runner
    from driverd.sim.fakepkg import make_fake_package
    from driverd.sim.hosttree import install_kernel
    from driverd.sim.scenario import RELEASE, dgx_spec, make_host
    from driverd.sim.kernel import SimKernel
    root = base / "root"
    make_host(root, dgx_spec(gpus=2, nvswitches=0, nouveau=False))
    version = "535.261.03"
    install(Root(root), make_fake_package(base / "pkgs", version, RELEASE).path, Runner(),
            kernel_tools=SimKernel(Root(root), Runner()))
    cfg = {"CONFIG_MODULE_SIG_FORCE": "y"} if enforce else {}
    for rel in ("6.1.0-50-cloud-amd64", "6.1.0-53-cloud-amd64"):
        install_kernel(root, rel, config=cfg)
        pkg = make_fake_package(base / f"pkgs-{rel}", version, rel).path
        install(Root(root), pkg, Runner(), kernel=rel, enforce=False, kernel_tools=SimKernel(Root(root), Runner()))
    (root / "etc/driverd").mkdir(parents=True, exist_ok=True)
    (root / "etc/driverd/config.toml").write_text(f'[driver]\nversion = "{version}"\nflavor = "open"\n'
                                                   '[modules]\nkernel = "sim"\n')
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=21)
    ap.add_argument("--enforce", action="store_true", help="the newer kernels enforce module signatures")
    args = ap.parse_args()
    exe = Path(sys.executable).parent / "driverd"
    base_cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "driverd"]
    with tempfile.TemporaryDirectory(prefix="driverd-bench-rr-") as d:
        root = converged_host(Path(d), args.enforce)
        # as an installed driverd runs: from bytecode (pip compiles it at install), kept apart from the tree
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DRIVERD_", "PYTHONDONTWRITEBYTECODE"))}
        env["PYTHONPYCACHEPREFIX"] = str(Path(d) / "pycache")
        gate = base_cmd + ["reboot-ready", "--root", str(root), "--quiet"]
        ok = (0,) if not args.enforce else (0, 1)       # unsigned fake modules: the gate closes, every check ran
        for warm in (gate, base_cmd + ["--help"]):      # the page cache and the bytecode
            subprocess.run(warm, check=False, env=env, stdout=subprocess.DEVNULL)
        bare = median_wall([sys.executable, "-c", "pass"], args.n, env)
        helps = median_wall(base_cmd + ["--help"], args.n, env)
        rr = median_wall(gate, args.n, env, ok)
    print(f"python -c pass                 median {bare * 1000:7.1f} ms")
    print(f"driverd --help                 median {helps * 1000:7.1f} ms  ratio to bare start-up {helps / bare:5.2f}x")
    print(f"driverd reboot-ready{' (enforcing)' if args.enforce else ''}   median {rr * 1000:7.1f} ms  "
          f"ratio to bare start-up {rr / bare:5.2f}x, to driverd --help {rr / helps:5.2f}x")
    met = rr <= 0.5
    print(f"target median <= 500 ms: {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
