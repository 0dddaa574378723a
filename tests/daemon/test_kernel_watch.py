"""Issue 43: the daemon notices a kernel installed behind its back (the post-install hook not run, or run while
the repository was away) and prepares it in its next pass; until then driverd_kernel_unprepared{kernel} is 1,
`driverd status` and `driverd reboot-ready` say why, and a kernel that cannot be prepared is tried again with a
backoff. After a reboot into a newer kernel, what driverd kept for a kernel no longer installed is removed."""
from __future__ import annotations

import shutil
import time

from driverd.sim.fakepkg import make_fake_package
from driverd.sim.hosttree import install_kernel
from driverd.sim.scenario import RELEASE
from tests.apply.conftest import drv
from tests.conftest import run_cli
from tests.daemon.conftest import OLD, journal_runs, kernel_of, write_config

NEXT = "6.1.0-50-cloud-amd64"
BEFORE = "6.1.0-40-cloud-amd64"


def _repo(tmp_path, packages):
    """A copy of the session's repository (the running kernel's packages), indexed: the test adds to it."""
    repo = tmp_path / "repo"
    shutil.copytree(packages["old"].parent, repo, ignore=shutil.ignore_patterns("broken"))
    run_cli("repo", "index", str(repo), check=True)
    return repo


def _until(what, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what.__doc__ or what}")
        time.sleep(0.2)


def test_a_kernel_installed_behind_the_daemons_back_is_named_then_prepared_once_its_package_exists(
        host, packages, daemons, tmp_path):
    repo = _repo(tmp_path, packages)
    write_config(host, OLD, repo)
    d = daemons(host)
    d.wait_notify("READY=1", 60)
    assert d.metric("driverd_kernel_unprepared", kernel=NEXT) is None

    install_kernel(host, NEXT)                      # apt installed a kernel; no repository has its package
    d.wait_log(rf"kernel {NEXT} is installed without the {OLD} \(open\) driver \(no package, no headers to build\): "
               "preparing it", 30)
    d.wait_log(rf"kernel {NEXT} could not be prepared \(attempt 1\): .*no package driverd-{OLD}-open-{NEXT}", 60)

    def unprepared():
        """driverd_kernel_unprepared{kernel=NEXT} == 1"""
        return d.metric("driverd_kernel_unprepared", kernel=NEXT) == 1
    _until(unprepared)
    assert d.get("/readyz")[0] == 200                  # the node itself is fine: only the next boot is not
    r = drv(host, "reboot-ready")
    assert r.returncode == 1 and f"kernel {NEXT}: no package, no headers to build" in r.stdout, r.stdout
    assert "the daemon's last attempt:" in r.stdout, r.stdout
    r = drv(host, "status")
    assert f"kernel     {NEXT}: NOT PREPARED (no package, no headers to build)" in r.stdout, r.stdout
    assert "REBOOT NOT SAFE" in r.stdout
    d.wait_log(rf"kernel {NEXT} could not be prepared \(attempt 2\)", 60)     # retried, with a backoff

    # the package appears in the repository: the next retry prepares it, in that one pass
    make_fake_package(repo, OLD, NEXT)
    run_cli("repo", "index", str(repo), check=True)
    d.wait_log(rf"kernel {NEXT}: the {OLD} \(open\) driver is prepared", 60)

    def prepared():
        """driverd_kernel_unprepared{kernel=NEXT} == 0"""
        return d.metric("driverd_kernel_unprepared", kernel=NEXT) == 0
    _until(prepared)
    runs = [r for r in journal_runs(host) if r["command"] == "prepare-kernel"]
    assert runs[-1]["state"] == "done" and all(r["state"] != "done" for r in runs[:-1]), \
        [(r["command"], r["state"]) for r in runs]
    assert drv(host, "reboot-ready").returncode == 0
    r = drv(host, "status")
    assert f"kernel     {NEXT}: prepared" in r.stdout and "REBOOT NOT SAFE" not in r.stdout, r.stdout
    assert (host / f"lib/modules/{NEXT}/updates/driverd/nvidia.ko").is_file()
    assert kernel_of(host).modules()["nvidia"].version == OLD          # the running driver was not touched
    assert d.stop()[0] == 0


def test_after_a_reboot_into_a_newer_kernel_the_packages_of_a_removed_kernel_are_removed(host, packages, daemons,
                                                                                       tmp_path):
    repo = _repo(tmp_path, packages)
    for rel in (NEXT, BEFORE):
        make_fake_package(repo, OLD, rel)
    run_cli("repo", "index", str(repo), check=True)
    write_config(host, OLD, repo)
    install_kernel(host, RELEASE)                       # the running kernel, as its package installed it
    for rel in (BEFORE, NEXT):
        install_kernel(host, rel)
        assert drv(host, "prepare-kernel", rel).returncode == 0
    kept = host / "var/lib/driverd/packages/kept"

    def kept_for(rel: str) -> list[str]:
        from driverd.install.kept import tree_manifest
        return [e.name for e in kept.iterdir() if tree_manifest(e / "modules").kernel_release == rel]
    assert kept_for(BEFORE) and kept_for(NEXT) and kept_for(RELEASE)

    # apt removed the oldest kernel (its package's files; driverd's tree stays), then the node rebooted into NEXT
    shutil.rmtree(host / f"lib/modules/{BEFORE}/kernel")
    (host / f"lib/modules/{BEFORE}/modules.dep").unlink()
    (host / f"boot/vmlinuz-{BEFORE}").unlink()
    status = host / "var/lib/dpkg/status"
    status.write_text(status.read_text().replace(f"Package: linux-image-{BEFORE}\nStatus: install ok installed",
                                                 f"Package: linux-image-{BEFORE}\nStatus: deinstall ok config-files"))
    (host / "proc/sys/kernel/osrelease").write_text(NEXT + "\n")
    kernel_of(host).reboot()

    d = daemons(host)
    d.wait_notify("READY=1", 60)
    assert kernel_of(host).modules()["nvidia"].version == OLD          # loaded from NEXT's prepared package
    d.wait_log(rf"removed driverd's packages of kernel\(s\) no longer installed: {BEFORE}", 30)
    assert kept_for(BEFORE) == [] and not (host / f"lib/modules/{BEFORE}").exists()
    assert not (host / f"var/lib/driverd/packages/previous/{BEFORE}.json").exists()
    assert kept_for(NEXT) and kept_for(RELEASE)                        # still installed kernels keep theirs
    assert (host / f"lib/modules/{RELEASE}/updates/driverd/manifest.json").is_file()
    runs = [r for r in journal_runs(host) if r["command"] == "forget-kernels"]
    assert len(runs) == 1 and runs[0]["state"] == "done", runs
    assert d.stop()[0] == 0
