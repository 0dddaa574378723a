"""`driverd reboot-ready` (issue 43): exit 0 only when every installed kernel newer than the running one has the
node's driver package installed and verified; otherwise exit 1 naming each kernel, what it lacks and the fix.
Kernels are installed into simulated host trees as Debian's linux-image package leaves them
(driverd.sim.hosttree.install_kernel), and bad input — a kernel without modules.dep, a half-installed kernel
package, a /boot image without modules — closes the gate, named, without a crash."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from driverd.sim.fakepkg import make_fake_package
from driverd.sim.hosttree import install_kernel
from driverd.sim.scenario import RELEASE
from tests.apply.conftest import drv
from tests.conftest import run_cli
from tests.kmod.conftest import host, packages  # noqa: F401  (fixtures)

OLD, NEW = "535.261.03", "550.127.05"
NEXT = "6.1.0-50-cloud-amd64"          # newer than the simulated host's RELEASE (6.1.0-47-cloud-amd64)


def _config(root, repo=None, version: str = OLD, extra: str = "") -> None:
    p = root / "etc/driverd/config.toml"
    p.parent.mkdir(parents=True, exist_ok=True)
    repos = f'["file://{repo}"]' if repo else "[]"
    p.write_text(f'[driver]\nversion = "{version}"\nflavor = "open"\n[packages]\nrepositories = {repos}\n'
                 f'build_fallback = false\n[runtime]\nrestart = "none"\n{extra}')


def gate(root, *args) -> tuple[int, dict]:
    r = drv(root, "reboot-ready", "--json", *args)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, json.loads(r.stdout)


@pytest.fixture
def krepo(tmp_path):
    """A file:// repository holding the OLD package for NEXT (and the running kernel's)."""
    d = tmp_path / "repo"
    make_fake_package(d, OLD, NEXT)
    make_fake_package(d, OLD, RELEASE)
    run_cli("repo", "index", str(d), check=True)
    return d


def test_no_newer_kernel_is_an_open_gate(host):
    _config(host)
    install_kernel(host, "6.1.0-40-cloud-amd64")          # older: the boot loader prefers the running one
    rc, doc = gate(host)
    assert rc == 0 and doc["ready"] and doc["kernels"] == [], doc
    assert "no kernel newer than the running 6.1.0-47-cloud-amd64" in doc["reason"]


def test_a_newer_kernel_without_its_package_closes_the_gate_until_prepare_kernel(host, krepo):
    _config(host, krepo)
    install_kernel(host, NEXT)
    r = drv(host, "reboot-ready")
    assert r.returncode == 1, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith(f"kernel {NEXT}"))
    assert f"kernel {NEXT}: no package, no headers to build" in line, r.stdout
    assert f"fix: driverd prepare-kernel {NEXT}" in line and f"linux-headers-{NEXT}" in line, line
    rc, doc = gate(host)
    k = doc["kernels"][0]
    assert rc == 1 and not doc["ready"] and k["release"] == NEXT and not k["ready"] and not k["headers"], doc
    assert doc["driver"] == {"version": OLD, "flavor": "open", "source": "driver.version"}

    r = drv(host, "prepare-kernel", NEXT)
    assert r.returncode == 0, r.stdout + r.stderr
    rc, doc = gate(host)
    assert rc == 0 and doc["ready"], doc
    assert doc["kernels"][0]["package"]["version"] == OLD
    assert drv(host, "reboot-ready", "--quiet").stdout == ""


def test_headers_installed_are_said_and_the_fix_is_the_build(host):
    _config(host)
    install_kernel(host, NEXT, headers=True)
    rc, doc = gate(host)
    k = doc["kernels"][0]
    assert rc == 1 and k["short"] == "no package" and k["headers"], k


def test_a_package_of_another_driver_does_not_open_the_gate(host, tmp_path):
    _config(host, version=NEW)
    install_kernel(host, NEXT)
    pkg = make_fake_package(tmp_path / "p", OLD, NEXT).path
    assert drv(host, "install", "--kernel", NEXT, str(pkg)).returncode == 0
    rc, doc = gate(host)
    k = doc["kernels"][0]
    assert rc == 1 and k["short"] == "another driver", k
    assert f"its driverd package is {OLD} (open), the node runs {NEW} (open)" in k["lacks"][0]
    rc, doc = gate(host, "--driver", OLD)                  # the node's driver named on the command line
    assert rc == 0, doc


def test_a_damaged_package_and_a_module_of_another_kernel_configuration_close_the_gate(host, krepo):
    _config(host, krepo)
    install_kernel(host, NEXT)
    assert drv(host, "prepare-kernel", NEXT).returncode == 0
    ko = host / f"lib/modules/{NEXT}/updates/driverd/nvidia.ko"
    data = ko.read_bytes()
    # the same release name, another configuration: vermagic's words differ, the file's size does not
    ko.write_bytes(data.replace(b" SMP preempt mod_unload", b" SMP PREEMPT mod_unload"))
    rc, doc = gate(host)
    k = doc["kernels"][0]
    assert rc == 1 and k["short"] == "wrong vermagic", k
    assert any("nvidia.ko has vermagic" in x and "another kernel configuration" in x for x in k["lacks"]), k
    ko.write_bytes(data[:-100])                          # truncated
    rc, doc = gate(host)
    k = doc["kernels"][0]
    assert rc == 1 and k["short"] == "incomplete package", k


def test_a_kernel_that_enforces_signatures_refuses_an_unsigned_package(host, krepo):
    _config(host, krepo)
    install_kernel(host, NEXT, config={"CONFIG_MODULE_SIG_FORCE": "y"})
    assert drv(host, "prepare-kernel", NEXT).returncode == 0      # the running kernel does not enforce
    rc, doc = gate(host)
    k = doc["kernels"][0]
    assert rc == 1 and k["short"] == "signature not trusted", k
    assert f"CONFIG_MODULE_SIG_FORCE=y (/boot/config-{NEXT})" in k["lacks"][0], k


@pytest.mark.parametrize("bad, words", [
    (dict(depmod=False), f"/lib/modules/{NEXT}/modules.dep is missing"),
    (dict(dpkg_state="half-installed"), f"its package linux-image-{NEXT} is half-installed in the dpkg database"),
    (dict(dpkg_state="unpacked"), f"its package linux-image-{NEXT} is unpacked"),
    (dict(modules=False), f"no modules: /lib/modules/{NEXT}/kernel is missing"),
])
def test_a_kernel_whose_installation_did_not_finish_closes_the_gate_named(host, krepo, bad, words):
    _config(host, krepo)
    install_kernel(host, NEXT, **bad)
    if "dpkg_state" in bad:
        assert drv(host, "prepare-kernel", NEXT).returncode == 0    # even with its driver prepared
    r = drv(host, "reboot-ready")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert words in r.stdout and f"kernel {NEXT}: kernel not completely installed" in r.stdout, r.stdout
    assert "fix: " in r.stdout


def test_a_half_installed_kernel_package_without_an_image_yet_is_still_named(host):
    """dpkg records the package before its files are all there: the release is known from the database."""
    _config(host)
    install_kernel(host, NEXT, image=False, modules=False, dpkg_state="half-installed")
    rc, doc = gate(host)
    assert rc == 1 and doc["kernels"][0]["release"] == NEXT, doc
    assert any("half-installed" in x for x in doc["kernels"][0]["lacks"])


def test_a_removed_kernels_leftover_module_directory_is_not_a_kernel(host):
    _config(host)
    (host / f"lib/modules/{NEXT}/updates/driverd").mkdir(parents=True)   # what apt's removal leaves
    rc, doc = gate(host)
    assert rc == 0 and doc["kernels"] == [], doc


def test_rpm_family_reads_lib_modules_vmlinuz_and_names_a_missing_boot_copy(host, krepo):
    _config(host, krepo)
    (host / "etc/os-release").write_text('ID="rhel"\nID_LIKE="fedora"\nVERSION_ID="9.4"\n')
    rel = "6.1.0-51-cloud-amd64"
    install_kernel(host, rel, dpkg_state=None)
    os.replace(host / f"boot/vmlinuz-{rel}", host / f"lib/modules/{rel}/vmlinuz")   # kernel-core's file only
    r = drv(host, "reboot-ready")
    assert r.returncode == 1 and f"kernel {rel}:" in r.stdout, r.stdout + r.stderr
    assert f"/lib/modules/{rel}/vmlinuz has no copy in /boot" in r.stdout and f"kernel-install add {rel}" in r.stdout


def test_if_required_opens_only_with_the_reboot_sentinel(host):
    _config(host)
    r = drv(host, "reboot-ready", "--if-required")
    assert r.returncode == 1 and "no reboot is required" in r.stdout, r.stdout
    (host / "var/run").mkdir(parents=True, exist_ok=True)
    sentinel = host / "var/run/reboot-required"
    if sentinel.parent.is_symlink():
        sentinel = host / "run/reboot-required"
    sentinel.parent.mkdir(parents=True, exist_ok=True)
    sentinel.write_text("*** System restart required ***\n")
    rc, doc = gate(host, "--if-required")
    assert rc == 0 and doc["reboot_required"] is True, doc


def test_driver_manage_never_and_no_gpu_open_the_gate(host, tmp_path):
    _config(host)
    install_kernel(host, NEXT)
    p = host / "etc/driverd/config.toml"
    p.write_text(p.read_text().replace('flavor = "open"\n', 'flavor = "open"\nmanage = "never"\n'))
    rc, doc = gate(host)
    assert rc == 0 and "driver.manage = never" in doc["reason"], doc
    bare = tmp_path / "bare"
    from driverd.sim.hosttree import HostSpec, write_host
    write_host(bare, HostSpec())
    _config(bare)
    install_kernel(bare, NEXT)
    rc, doc = gate(bare)
    assert rc == 0 and "no NVIDIA GPU" in doc["reason"], doc


def test_cluster_mode_judges_the_driver_the_node_last_converged_to(host, krepo):
    """A rollout pins the node's driver: node-driver.json names it, whatever driver.version says."""
    _config(host, krepo, version=NEW)
    (host / "var/lib/driverd").mkdir(parents=True, exist_ok=True)
    (host / "var/lib/driverd/node-driver.json").write_text(json.dumps({"version": OLD, "flavor": "open"}))
    install_kernel(host, NEXT)
    shutil.copy(next(krepo.glob(f"driverd-{OLD}-open-{NEXT}-*")), host / "pkg.tar.zst")
    assert drv(host, "install", "--kernel", NEXT, str(host / "pkg.tar.zst")).returncode == 0
    rc, doc = gate(host)
    assert rc == 0 and doc["driver"]["version"] == OLD and "last converged" in doc["driver"]["source"], doc


def test_a_driver_driverd_did_not_install_is_not_driverds_to_gate(host):
    """driver.manage = auto with a driver loaded that no driverd package provides (a distribution's, DKMS):
    its package manager keeps it; reboot-ready does not ask for a driverd package."""
    _config(host)
    install_kernel(host, NEXT)
    shutil.rmtree(host / f"lib/modules/{RELEASE}/updates/driverd")
    (host / "proc/driver/nvidia").mkdir(parents=True, exist_ok=True)
    (host / "proc/driver/nvidia/version").write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  "
                                                     "550.127.05  Release Build\n")
    rc, doc = gate(host)
    assert rc == 0 and "not driverd's" in doc["reason"], doc
    p = host / "etc/driverd/config.toml"
    p.write_text(p.read_text().replace('flavor = "open"\n', 'flavor = "open"\nmanage = "always"\n'))
    rc, doc = gate(host)
    assert rc == 1 and doc["kernels"][0]["release"] == NEXT, doc
