"""`driverd reboot-gate` (issue 43): holds a logind shutdown inhibitor lock while `driverd reboot-ready` is closed
and releases it once the newer kernel is prepared. No logind runs on these machines (systemd is not PID 1), so
`systemd-inhibit` is a stand-in on PATH that records its arguments and holds "the lock" while its command runs,
as the real one does; the options given are checked against the real systemd-inhibit's --help."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from driverd.sim.fakepkg import make_fake_package
from driverd.sim.hosttree import install_kernel
from tests.apply.conftest import drv
from tests.conftest import driverd_env, require_binary, run_cli
from tests.kmod.conftest import host, packages  # noqa: F401  (fixtures)

NEXT = "6.1.0-50-cloud-amd64"
OLD = "535.261.03"

STANDIN = """#!/bin/sh
# systemd-inhibit stand-in: "holds the lock" while its command (the last argument) runs
printf '%s\\n' "$@" > "$GATE_DIR/held"
for a; do cmd=$a; done
"$cmd"
mv "$GATE_DIR/held" "$GATE_DIR/released.$$"
"""


@pytest.fixture
def standin(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "systemd-inhibit").write_text(STANDIN)
    (d / "systemd-inhibit").chmod(0o755)
    return d


def _until(pred, timeout=60):
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s")
        time.sleep(0.2)


def test_the_lock_is_held_while_the_gate_is_closed_and_released_when_it_opens(host, tmp_path, standin):
    repo = tmp_path / "repo"
    make_fake_package(repo, OLD, NEXT)
    run_cli("repo", "index", str(repo), check=True)
    (host / "etc/driverd").mkdir(parents=True, exist_ok=True)
    (host / "etc/driverd/config.toml").write_text(
        f'[driver]\nversion = "{OLD}"\nflavor = "open"\n[packages]\nrepositories = ["file://{repo}"]\n')
    install_kernel(host, NEXT)
    env = driverd_env(drop=("DRIVERD_",))
    env.update(PATH=f"{standin}:{env['PATH']}", GATE_DIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "driverd", "reboot-gate", "--root", str(host), "--interval", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        held = tmp_path / "held"
        _until(held.exists)
        args = held.read_text().splitlines()
        assert args[:3] == ["--what=shutdown", "--who=driverd", args[2]] and args[3:] == ["--mode=block", "cat"], args
        assert args[2].startswith(f"--why=kernel {NEXT}: no package, no headers to build"), args

        assert drv(host, "prepare-kernel", NEXT).returncode == 0        # the gate opens
        _until(lambda: not held.exists() and list(tmp_path.glob("released.*")))
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=20)
        assert p.returncode == 0, err
        assert "closed: holding a shutdown inhibitor lock" in err and "open: the shutdown inhibitor lock is " \
            "released" in err, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_the_lock_goes_with_the_gate_process(host, tmp_path, standin):
    """Killed (SIGKILL), the gate's pipe to the lock holder closes: the lock is released with it."""
    (host / "etc/driverd").mkdir(parents=True, exist_ok=True)
    (host / "etc/driverd/config.toml").write_text(f'[driver]\nversion = "{OLD}"\nflavor = "open"\n')
    install_kernel(host, NEXT)
    env = driverd_env(drop=("DRIVERD_",))
    env.update(PATH=f"{standin}:{env['PATH']}", GATE_DIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "driverd", "reboot-gate", "--root", str(host), "--interval", "1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        _until((tmp_path / "held").exists)
    finally:
        p.kill()
        p.wait()
    _until(lambda: not (tmp_path / "held").exists())


def test_the_options_given_are_systemd_inhibits_own():
    real = require_binary("systemd-inhibit")
    help_text = subprocess.run([real, "--help"], capture_output=True, text=True).stdout
    from driverd.daemon.inhibit import Inhibitor
    for a in Inhibitor(lambda *a, **k: None).argv("why"):
        if a.startswith("--"):
            assert a.split("=")[0] in help_text, a
    assert "shutdown" in help_text and "block" in help_text
    assert os.path.basename(real) == "systemd-inhibit"
