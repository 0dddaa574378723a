"""`.ci/install-components` the way a fresh machine meets it: an empty prefix, the install, a check that
judges each component by what it contains and does, a repair of a component found incomplete, and the
real kernel booted from what the install left (issue 28: `dpkg -x` of linux-image writes no modules.dep,
and a reused machine's old index hid it)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, missing_component
from tests.vm import harness as h

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(1200)]

INSTALL = REPO / ".ci" / "install-components"


def _install(prefix: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRIVERD_CI_PREFIX": str(prefix)}
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def fresh_prefix(tmp_path_factory):
    if os.geteuid() != 0:
        missing_component("the fresh-machine install test runs .ci/install-components, which needs root")
    prefix = tmp_path_factory.mktemp("driverd-ci-fresh")
    assert not any(prefix.iterdir())
    r = _install(prefix, "--only", "vm")
    assert r.returncode == 0, f"install into an empty prefix failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "every component complete" in r.stdout
    return prefix


def _index(prefix: Path) -> Path:
    return prefix / f"kernel-{h.RELEASE}" / "lib" / "modules" / h.RELEASE


def test_the_kernel_tree_gets_its_module_index(fresh_prefix):
    idx = _index(fresh_prefix)
    assert (idx / "modules.dep").stat().st_size > 0 and (idx / "modules.dep.bin").is_file()
    r = subprocess.run(["modprobe", "-d", str(fresh_prefix / f"kernel-{h.RELEASE}"), "-S", h.RELEASE,
                        "--show-depends", "nouveau"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "drm" in r.stdout, r.stderr


def test_an_incomplete_component_is_named_then_repaired_not_trusted(fresh_prefix):
    idx = _index(fresh_prefix)
    # What a bare `dpkg -x` leaves: the directory and the modules, no index.
    for f in idx.glob("modules.dep*"):
        f.unlink()
    r = _install(fresh_prefix, "--check")
    assert r.returncode == 1
    assert "kernel-module-index" in r.stderr and "fix: run bash .ci/install-components" in r.stderr
    r = _install(fresh_prefix, "--only", "vm")
    assert r.returncode == 0, r.stderr
    assert "writing the module index" in r.stdout
    assert (idx / "modules.dep.bin").is_file()
    # A second run installs nothing new.
    r = _install(fresh_prefix, "--only", "vm")
    assert r.returncode == 0 and "writing the module index" not in r.stdout


def test_the_real_kernel_boots_from_the_fresh_prefix_and_loads_a_module(fresh_prefix):
    """One VM boot from nothing but what the install left: the guest's modprobe reads the tree's index."""
    vng = next(iter(sorted(fresh_prefix.glob("vng-*/bin/vng"))), None)
    assert vng, "the install left no vng"
    vmlinuz = fresh_prefix / f"kernel-{h.RELEASE}" / "boot" / f"vmlinuz-{h.RELEASE}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIVERD_")}
    env["PATH"] = f"{vng.parent}:{env.get('PATH', '')}"
    # --verbose: this QEMU has no virtio-serial script ports, so the script's output comes on the console
    # (vng's "console fallback"), which vng shows only when verbose; vng then cannot pass the script's exit
    # code on (it exits 255), and the guest's init prints it instead
    r = subprocess.run([str(vng), "--run", str(vmlinuz), "--user", "root", "--disable-kvm", "--force-9p",
                        "--verbose", "--memory", "512M", "--exec", "modprobe -v dummy && grep -c '^dummy ' /proc/modules && uname -r"],
                       capture_output=True, text=True, timeout=600, env=env, stdin=subprocess.DEVNULL, cwd="/")
    out = r.stdout + r.stderr
    assert "script exited with code 0" in out, out[-3000:]
    assert f"insmod /lib/modules/{h.RELEASE}/kernel/drivers/net/dummy.ko" in out and f"\n{h.RELEASE}" in out
