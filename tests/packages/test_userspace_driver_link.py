"""The driver root where the ecosystem looks for it: driverd's user-space install makes /run/nvidia/driver
(userspace.driver_link, the GPU Operator's convention; nvidia-ctk --driver-root / NVIDIA_CTK_DRIVER_ROOT)
a relative link to <userspace.root>/current, only where the name is free, and removes only its own. The
finder (the workload check's and the CDI spec's) follows it inside the root. Host trees with the real
ldconfig, as tests/packages/test_userspace_install.py."""
from __future__ import annotations

import os

import pytest

from driverd.driver import files as driverfiles
from driverd.host import workload
from driverd.install import userspace as ui
from driverd.driver import userspace as dus
from driverd.root import Root
from tests import cudastandin
from tests.packages.test_userspace_install import GPUS, NEW, OLD, UROOT, _ldconfig, host, package, pk  # noqa: F401

LINK = "run/nvidia/driver"
REL = "../../var/lib/driverd/driver/current"


def test_the_install_links_the_toolkits_driver_root_and_both_finders_agree_through_it(tmp_path, pk):
    from tests.runtime.driver_trees import add_gpus
    h = tmp_path / "h"
    root = host(h)
    add_gpus(h, 2, char_devices=False)
    rep = ui.install(root, pk[OLD].path)
    assert os.readlink(h / LINK) == REL                    # relative: the same tree on the host and under /host
    assert any(n == f"linked /run/nvidia/driver to {UROOT}/current (the toolkit's driver root)" for n in rep.notes)
    assert dus.foreign_userspace(root, ui.Places()) is None  # driverd's own link is not a foreign user-space
    assert ui.is_installed(root, pk[OLD].sha256)
    tree = f"{UROOT}/{OLD}"
    # found through the link (it is searched first), reported at the real tree, as through the loader configuration
    us = driverfiles.find(root, "/run/nvidia/driver")
    assert (us.driver_root, us.lib_dir, us.version) == (tree, f"{tree}/lib64", OLD)
    assert driverfiles.find(root) == driverfiles.find(root, "/run/nvidia/driver", driverd=False)
    via_link = driverfiles.inventory(root, driver_root="/run/nvidia/driver")
    assert via_link.to_json() == driverfiles.inventory(root).to_json()
    from driverd.runtime import cdi
    mounts = {m["hostPath"]: m["containerPath"] for m in cdi.build(root)["containerEdits"]["mounts"]}
    assert mounts[f"{tree}/lib64/libcuda.so.{OLD}"] == f"/lib64/libcuda.so.{OLD}"
    # upgrade and roll back: the link stays, what it names switches with `current`
    ui.install(root, pk[NEW].path)
    assert os.readlink(h / LINK) == REL and driverfiles.find(root, "/run/nvidia/driver").version == NEW
    ui.rollback(root)
    assert driverfiles.find(root, "/run/nvidia/driver").version == OLD
    # restored to "no user-space": driverd's link goes with `current`
    rep = ui.restore(root, None)
    assert not os.path.lexists(h / LINK) and "removed /run/nvidia/driver" in rep.notes
    assert ui.is_installed(root, None) and not driverfiles.find(root).found


@pytest.mark.parametrize("other", ["empty-dir", "foreign-link"])
def test_a_driver_root_driverd_did_not_make_is_left_alone_with_a_note(tmp_path, pk, other):
    h = tmp_path / "h"
    root = host(h)
    (h / "run/nvidia").mkdir(parents=True)
    if other == "empty-dir":
        (h / LINK).mkdir()
    else:
        os.symlink("/opt/vendor/driver", h / LINK)
    rep = ui.install(root, pk[NEW].path)
    assert rep.activated and any(n.startswith("/run/nvidia/driver is not driverd's: left alone") and
                                 "NVIDIA_CTK_DRIVER_ROOT" in n for n in rep.notes), rep.notes
    assert ui.is_installed(root, pk[NEW].sha256)           # nothing to redo: it stays left alone
    assert driverfiles.find(root).driver_root == f"{UROOT}/{NEW}"
    ui.restore(root, None)
    assert (h / LINK).is_dir() if other == "empty-dir" else os.readlink(h / LINK) == "/opt/vendor/driver"


def test_an_operator_driver_root_with_libraries_is_host_managed_and_gets_no_link(tmp_path, pk):
    h = tmp_path / "h"
    root = host(h)
    lib = h / LINK / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    for soname in driverfiles.KEY_LIBS:
        (lib / soname.replace(".so.1", f".so.{OLD}")).write_bytes(b"\0")
        os.symlink(soname.replace(".so.1", f".so.{OLD}"), lib / soname)
    rep = ui.install(root, pk[NEW].path)
    assert rep.activated is False and (h / LINK).is_dir() and not (h / LINK).is_symlink()
    assert driverfiles.find(root).version == OLD


def test_the_hosts_own_libraries_behind_driverds_link_are_still_foreign(tmp_path, pk):
    """driverd's link, searched first, must not hide a user-space the host gained since: the next switch
    sees it, and takes driverd's link and loader configuration away from in front of it."""
    h = tmp_path / "h"
    root = host(h)
    ui.install(root, pk[NEW].path)
    cudastandin.install(h, OLD, GPUS)                      # the host's own libcuda1, installed afterwards
    foreign = dus.foreign_userspace(root, ui.Places())
    assert foreign is not None and foreign.version == OLD
    assert not ui.is_installed(root, pk[NEW].sha256)
    rep = ui.install(root, pk[NEW].path)
    assert rep.activated is False and not os.path.lexists(h / LINK) and "removed /run/nvidia/driver" in rep.notes
    assert driverfiles.find(root).version == OLD


def test_in_the_driver_container_the_link_is_made_under_host_and_resolves_inside_it(tmp_path, pk):
    host(tmp_path / "host")
    root = Root(tmp_path / "host")                         # the driver container's --root /host
    ui.install(root, pk[NEW].path)
    link = tmp_path / "host" / LINK
    assert os.readlink(link) == REL
    assert os.path.realpath(link) == str(tmp_path / f"host{UROOT}/{NEW}")   # the kernel's own resolution, too


def test_the_workload_checks_loader_path_stays_inside_the_root(tmp_path, pk, monkeypatch):
    """Even an absolute link at /run/nvidia/driver (a hand-made one, or one from an older driverd) leads the
    finder and the child's LD_LIBRARY_PATH to the tree under the root, never to this machine's own path."""
    h = tmp_path / "h"
    root = host(h, loaded=NEW)
    ui.install(root, pk[NEW].path, places=ui.Places(driver_link=None))
    assert not os.path.lexists(h / LINK)                   # userspace.driver_link = none: no link
    (h / "run/nvidia").mkdir(parents=True)
    os.symlink(f"{UROOT}/current", h / LINK)               # absolute: counted as driverd's, resolved under the root
    assert dus.link_state(root, ui.Places()) == "ours"
    seen = {}

    def popen(argv, **kw):
        seen.update(kw["env"])
        raise OSError("not run")
    monkeypatch.setattr(workload.subprocess, "Popen", popen)
    workload.check(root, NEW, GPUS, driver_root="/run/nvidia/driver")
    assert seen["LD_LIBRARY_PATH"] == str(h / f"{UROOT.lstrip('/')}/{NEW}/lib64")


def test_after_a_reboot_recovery_makes_the_link_again(tmp_path, pk):
    h = tmp_path / "h"
    root = host(h)
    ui.install(root, pk[NEW].path)
    os.unlink(h / LINK)                                    # /run is a tmpfs
    assert not ui.is_installed(root, pk[NEW].sha256)
    assert ui.recover(root) == [f"linked /run/nvidia/driver to {UROOT}/current (the toolkit's driver root)"]
    assert os.readlink(h / LINK) == REL and ui.is_installed(root, pk[NEW].sha256)
    assert ui.recover(root) == []


def test_the_link_is_configurable(tmp_path):
    from driverd.config import load
    from driverd.errors import DriverdError
    root = Root(tmp_path)
    assert ui.Places.from_config(load(root, None, {"DRIVERD_USERSPACE_DRIVER_LINK": "none"})).driver_link is None
    assert ui.Places.from_config(load(root, None, {})).driver_link == "/run/nvidia/driver"
    with pytest.raises(DriverdError) as e:
        load(root, None, {"DRIVERD_USERSPACE_DRIVER_LINK": "run/nvidia/driver"})
    assert "userspace.driver_link" in str(e.value) and "/run/nvidia/driver, or none" in (e.value.fix or "")
