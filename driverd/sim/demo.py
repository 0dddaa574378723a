"""`driverd demo`: the whole product on a simulated DGX-class host in well under a minute, no GPU.

detect -> plan -> apply (fetch, verify, install, load, validate) -> status, then an upgrade to a
package whose GSP firmware is missing: the load fails with the kernel's NVRM lines and the host
rolls back to the last-known-good driver, validated.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

CONFIG = """[driver]
version = "535.261.03"
flavor = "open"
[packages]
repositories = ["file://{repo}"]
[runtime]
runtimes = ["containerd"]
restart = "none"
cdi = true
"""


def _say(msg: str) -> None:
    print(msg, flush=True)


def run_demo(workdir: str | None, as_json: bool = False) -> int:
    from driverd.cli import main
    from driverd.sim.scenario import dgx_spec, make_host, make_packages
    t0 = time.monotonic()
    wd = Path(workdir or tempfile.mkdtemp(prefix="driverd-demo.")).resolve()
    root, repo = wd / "host", wd / "repo"
    if root.exists():
        import shutil
        shutil.rmtree(root)
    _say(f"== driverd demo in {wd}\n   sandbox host: 8x H100 SXM, 4 NVSwitch, ConnectX-7 NIC, nouveau loaded, "
         "simulated kernel (its /proc and /sys live in the sandbox)")
    make_host(root, dgx_spec())
    marker = repo / ".built"
    if not marker.exists():
        _say("   building the package repository (fake but real ELF modules, real depmod) ...")
        pk = make_packages(repo)
        marker.write_text("\n".join(f"{k} {v}" for k, v in pk.items()) + "\n")
    pk = dict(ln.split(" ", 1) for ln in marker.read_text().splitlines())
    (root / "etc/driverd").mkdir(parents=True, exist_ok=True)
    (root / "etc/driverd/config.toml").write_text(CONFIG.format(repo=repo))
    for k in [k for k in os.environ if k.startswith("DRIVERD_")]:
        del os.environ[k]
    r = str(root)
    stages = [("detect: what is on this host", ["detect", "--root", r, "--no-nvml"]),
              ("plan: what driverd will do, and why", ["plan", "--root", r]),
              ("apply: fetch -> verify -> install -> load -> validate (journaled step by step)", ["apply", "--root", r]),
              ("status", ["status", "--root", r]),
              ("upgrade to 550.127.08, whose package lacks its GSP firmware: the load fails, driverd rolls back",
               ["reload", "--root", r, "--package", pk["broken"]]),
              ("status after the rollback", ["status", "--root", r])]
    for i, (title, argv) in enumerate(stages, 1):
        _say(f"\n== {i}. {title}\n$ driverd {' '.join(a if len(a) < 60 else '...' + a[-40:] for a in argv)}")
        rc = main(argv + (["--json"] if as_json else []))
        expect_fail = argv[0] == "reload"
        if (rc != 0) != expect_fail:
            _say(f"demo: stage {i} exited {rc} unexpectedly")
            return 1
        if expect_fail:
            _say(f"   (exit {rc} as expected: the failed upgrade is reported with the kernel's words, "
                 "and the host is back on the last-known-good driver)")
    _say(f"\n== done in {time.monotonic() - t0:.1f}s: the sandbox stays in {wd} (driverd status --root {root})")
    return 0
