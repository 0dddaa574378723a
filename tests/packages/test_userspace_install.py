"""Installing user-space packages into a versioned driver root on a node (driverd.install.userspace),
on host trees with the real ldconfig (`ldconfig -X -r ROOT`) and user-space packages built from miniature .run
directories of real ELF objects (tests/packages/usfake.py; libcuda and libnvidia-ml are the stand-ins of
tests/cudastandin, which answer the workload check like NVIDIA's for the tree's loaded-driver version)."""
from __future__ import annotations

import json
import os
import platform

import pytest

from driverd.driver import files as driverfiles
from driverd.errors import PackageError
from driverd.host import workload
from driverd.install import userspace as ui
from driverd.driver import userspace as dus
from driverd.build.userspace import build_from_run_dir
from driverd.root import Root
from driverd.runner import Runner
from driverd.sim.hosttree import HostSpec, h100, nvidia_version_line, write_host
from tests import cudastandin
from tests.packages import usfake

NEW, OLD, OLDER = "550.163.01", "535.261.03", "570.195.03"
GPUS = ["0000:1b:00.0", "0000:3b:00.0"]
UROOT = "/var/lib/driverd/driver"


@pytest.fixture(autouse=True)
def _ldconfig():
    usfake.require_ldconfig()


def host(path, loaded: str | None = NEW) -> Root:
    write_host(path, HostSpec(pci=[h100(a, "nvidia") for a in GPUS],
                              nvidia_version_text=nvidia_version_line(loaded, "open") if loaded else None))
    (path / "etc/ld.so.conf.d").mkdir(parents=True, exist_ok=True)
    (path / "etc/ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    return Root(path)


def package(tmp, version: str, rm_file=None, tweak=None):
    d = usfake.run_dir(tmp / f"src-{version}-{os.urandom(3).hex()}", version, rm_file=rm_file, gpus=tuple(GPUS))
    if tweak:
        tweak(d)
    return build_from_run_dir(d, tmp / "out").ref


@pytest.fixture(scope="module")
def pk(tmp_path_factory):
    t = tmp_path_factory.mktemp("uspk")
    return {v: package(t, v) for v in (NEW, OLD, OLDER)}


def snapshot(path) -> dict:
    out = {}
    for dp, dns, fns in os.walk(path):
        for n in dns + fns:
            p = os.path.join(dp, n)
            st = os.lstat(p)
            out[p] = (st.st_ino, st.st_mtime_ns, st.st_size, st.st_mode)
    return out


def test_the_installed_root_is_what_find_the_cdi_spec_and_the_workload_check_use(tmp_path):
    from tests.runtime.driver_trees import add_gpus
    root = host(tmp_path / "h")
    add_gpus(tmp_path / "h", 2, char_devices=False)
    ref = package(tmp_path, NEW, rm_file=tmp_path / "h/proc/driver/nvidia/version")
    rep = ui.install(root, ref.path)
    tree = f"{UROOT}/{NEW}"
    assert (rep.changed, rep.driver_version, rep.tree, rep.replaced, rep.activated) == (True, NEW, tree, None, True)
    t = tmp_path / "h" / tree.lstrip("/")
    assert os.readlink(tmp_path / f"h{UROOT}/current") == NEW
    assert os.readlink(t / "lib64/libcuda.so.1") == f"libcuda.so.{NEW}" and os.readlink(t / "lib64/libcuda.so") == "libcuda.so.1"
    assert (t / f"firmware/nvidia/{NEW}/gsp_ga10x.bin").is_file() and os.access(t / "bin/nvidia-smi", os.X_OK)
    assert json.loads((t / "install.json").read_text())["package_sha256"] == ref.sha256
    assert (tmp_path / "h/etc/ld.so.conf.d/00-driverd-nvidia.conf").read_text().splitlines()[-1] == f"{UROOT}/current/lib64"
    # the loader's cache (the real ldconfig's) gives driverd's libraries, through `current`
    cache = driverfiles.parse_ld_cache((tmp_path / "h/etc/ld.so.cache").read_bytes())
    assert ("libcuda.so.1", f"{UROOT}/current/lib64/libcuda.so.1") in cache
    assert ("libnvidia-nvvm.so.4", f"{UROOT}/current/lib64/libnvidia-nvvm.so.4") in cache
    assert os.readlink(tmp_path / "h/usr/local/bin/nvidia-smi") == f"{UROOT}/current/bin/nvidia-smi"
    assert sorted(os.path.basename(p) for p in rep.bin_links) == ["nvidia-cuda-mps-control", "nvidia-cuda-mps-server",
                                                                  "nvidia-debugdump", "nvidia-modprobe",
                                                                  "nvidia-persistenced", "nvidia-smi"]
    # one finder: the workload validation and the CDI spec see exactly this tree
    us = driverfiles.find(root)
    assert (us.driver_root, us.lib_dir, us.version) == (tree, f"{tree}/lib64", NEW)
    inv = driverfiles.inventory(root)
    assert {lib.name: lib.soname for lib in inv.libraries}[f"libcuda.so.{NEW}"] == "libcuda.so.1"
    assert inv.binaries["nvidia-smi"] == f"{tree}/bin/nvidia-smi"
    assert inv.firmware == (f"{tree}/firmware/nvidia/{NEW}/gsp_ga10x.bin", f"{tree}/firmware/nvidia/{NEW}/gsp_tu10x.bin")
    from driverd.runtime import cdi
    spec = cdi.build(root)
    mounts = {m["hostPath"]: m["containerPath"] for m in spec["containerEdits"]["mounts"]}
    assert mounts[f"{tree}/lib64/libcuda.so.{NEW}"] == f"/lib64/libcuda.so.{NEW}"
    assert mounts[f"{tree}/bin/nvidia-smi"] == "/bin/nvidia-smi"
    r = workload.check(root, NEW, GPUS)
    assert r.ok, r.problems
    assert r.userspace["lib_dir"] == f"{tree}/lib64" and r.nvml["driver_version"] == NEW


def test_a_stale_library_set_is_caught_by_the_workload_check(tmp_path):
    """The 535 user-space switched in while the 550 modules are loaded: the file-only half and the child both say so."""
    root = host(tmp_path / "h", loaded=NEW)
    rm = tmp_path / "h/proc/driver/nvidia/version"
    ui.install(root, package(tmp_path, NEW, rm_file=rm).path)
    ui.install(root, package(tmp_path, OLD, rm_file=rm).path)
    us, quick = workload.quick(root, NEW)
    assert us.version == OLD and quick == [f"user-space {OLD} does not match the loaded kernel driver {NEW}"]
    r = workload.check(root, NEW, GPUS)
    assert not r.ok and r.problems[0].startswith(f"user-space {OLD} does not match the loaded kernel driver {NEW}")
    ui.rollback(root)
    assert workload.check(root, NEW, GPUS).ok


def test_installing_what_is_installed_writes_nothing(tmp_path, pk):
    root = host(tmp_path / "h")
    ui.install(root, pk[NEW].path)
    before = snapshot(tmp_path / "h")
    rep = ui.install(root, pk[NEW].path)
    assert rep.changed is False and rep.sha256 == pk[NEW].sha256 and rep.replaced is None
    assert snapshot(tmp_path / "h") == before
    assert ui.is_installed(root, pk[NEW].sha256) and not ui.is_installed(root, pk[OLD].sha256)
    # the dry run verifies the package and writes nothing either
    rep = ui.install(root, pk[OLD].path, Runner(dry_run=True))
    assert rep.dry_run and rep.changed and rep.replaced == pk[NEW].sha256
    assert snapshot(tmp_path / "h") == before


def test_upgrade_rollback_and_back_keep_both_trees_and_say_what_they_replaced(tmp_path, pk):
    root = host(tmp_path / "h")
    assert ui.install(root, pk[OLD].path).replaced is None
    assert dus.previous_sha(root) == (True, None)
    rep = ui.install(root, pk[NEW].path)
    assert (rep.replaced, rep.replaced_version) == (pk[OLD].sha256, OLD)
    assert dus.previous_sha(root) == (True, pk[OLD].sha256)
    assert dus.installed_sha256(root) == pk[NEW].sha256
    rep = ui.rollback(root)
    assert (rep.driver_version, rep.replaced) == (OLD, pk[NEW].sha256) and driverfiles.find(root).version == OLD
    rep = ui.rollback(root)
    assert rep.driver_version == NEW and driverfiles.find(root).version == NEW
    assert sorted(t.name for t in dus.trees(root, ui.Places())) == [OLD, NEW]
    # no user-space at all: `current`, the loader configuration and driverd's links go; the trees stay
    rep = ui.restore(root, None)
    assert rep.changed and rep.replaced == pk[NEW].sha256
    assert not os.path.lexists(tmp_path / f"h{UROOT}/current")
    assert not (tmp_path / "h/etc/ld.so.conf.d/00-driverd-nvidia.conf").exists()
    assert not os.path.lexists(tmp_path / "h/usr/local/bin/nvidia-smi")
    assert not driverfiles.find(root).found and ui.is_installed(root, None)
    assert ui.restore(root, pk[OLD].sha256).driver_version == OLD and ui.is_installed(root, pk[OLD].sha256)
    assert not (tmp_path / "h/var/lib/driverd/userspace/pending.json").exists()


def test_a_host_managed_user_space_is_never_touched(tmp_path, pk):
    root = host(tmp_path / "h")
    libdir = cudastandin.install(tmp_path / "h", OLD, GPUS)           # the host's own, e.g. Debian's libcuda1
    (tmp_path / "h/usr/local/bin").mkdir(parents=True, exist_ok=True)
    (tmp_path / "h/usr/local/bin/nvidia-smi").write_text("#!/bin/sh\necho the host's\n")
    host_files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in
                  [*libdir.iterdir(), tmp_path / "h/usr/local/bin/nvidia-smi"] if p.is_file()}
    rep = ui.install(root, pk[NEW].path)
    assert rep.changed and rep.activated is False and rep.bin_links == []
    assert any("the host has its own NVIDIA user-space" in n and str(libdir.relative_to(tmp_path / "h")) in n
               for n in rep.notes), rep.notes
    assert not (tmp_path / "h/etc/ld.so.conf.d/00-driverd-nvidia.conf").exists()
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in host_files} == host_files
    assert driverfiles.find(root).version == OLD                       # the host's stays the one found
    assert driverfiles.find(root, f"{UROOT}/current").version == NEW   # validation.driver_root can name driverd's
    assert ui.is_installed(root, pk[NEW].sha256)


def test_a_path_entry_that_is_not_driverds_is_left_alone(tmp_path, pk):
    root = host(tmp_path / "h")
    (tmp_path / "h/usr/local/bin").mkdir(parents=True, exist_ok=True)
    os.symlink("/opt/other/nvidia-smi", tmp_path / "h/usr/local/bin/nvidia-smi")
    rep = ui.install(root, pk[NEW].path)
    assert os.readlink(tmp_path / "h/usr/local/bin/nvidia-smi") == "/opt/other/nvidia-smi"
    assert os.readlink(tmp_path / "h/usr/local/bin/nvidia-persistenced") == f"{UROOT}/current/bin/nvidia-persistenced"
    assert any("/usr/local/bin/nvidia-smi is not driverd's: left alone" in n for n in rep.notes)
    ui.restore(root, None)
    assert os.readlink(tmp_path / "h/usr/local/bin/nvidia-smi") == "/opt/other/nvidia-smi"
    assert not os.path.lexists(tmp_path / "h/usr/local/bin/nvidia-persistenced")


def test_the_install_root_is_configurable_for_immutable_hosts(tmp_path, pk):
    root = host(tmp_path / "h")
    from driverd.config import load
    cfg = load(root, None, {"DRIVERD_USERSPACE_ROOT": "/opt/nvidia-driver", "DRIVERD_USERSPACE_BIN_DIR": "none"})
    places = ui.Places.from_config(cfg)
    assert (places.root, places.bin_dir) == ("/opt/nvidia-driver", None)
    rep = ui.install(root, pk[NEW].path, places=places)
    assert rep.tree == f"/opt/nvidia-driver/{NEW}" and rep.bin_links == []
    assert not (tmp_path / "h/var/lib/driverd/driver").exists() and not (tmp_path / "h/usr/local/bin/nvidia-smi").exists()
    assert driverfiles.find(root).driver_root == f"/opt/nvidia-driver/{NEW}"
    assert (tmp_path / "h/etc/ld.so.conf.d/00-driverd-nvidia.conf").read_text().endswith("/opt/nvidia-driver/current/lib64\n")


def test_a_second_package_of_one_version_gets_its_own_tree(tmp_path, pk):
    root = host(tmp_path / "h")
    ui.install(root, pk[NEW].path)
    other = package(tmp_path, NEW, tweak=lambda d: (d / "firmware/gsp_ga10x.bin").write_bytes(b"rebuilt"))
    assert other.sha256 != pk[NEW].sha256
    rep = ui.install(root, other.path)
    assert rep.tree == f"{UROOT}/{NEW}-{other.sha256[:12]}" and rep.replaced == pk[NEW].sha256
    assert ui.rollback(root).tree == f"{UROOT}/{NEW}"


def test_old_trees_are_pruned_but_never_the_current_or_previous_one(tmp_path, pk):
    root = host(tmp_path / "h")
    places = ui.Places(max_kept=2)
    ui.install(root, pk[OLDER].path, places=places)
    ui.install(root, pk[OLD].path, places=places)
    rep = ui.install(root, pk[NEW].path, places=places)
    assert any(f"pruned the {OLDER} user-space tree" in n for n in rep.notes), rep.notes
    assert sorted(t.name for t in dus.trees(root, places)) == [OLD, NEW]
    assert not any(n.startswith(".driverd-") for n in os.listdir(tmp_path / f"h{UROOT}"))
    assert ui.rollback(root, places=places).driver_version == OLD


def test_a_switch_the_loader_would_not_follow_is_undone(tmp_path, pk):
    """A directory ld.so.conf names before driverd's holds another libcuda.so.1: after the switch the loader
    would load that one, so the install fails with the reason and the previous user-space is current again."""
    root = host(tmp_path / "h")
    ui.install(root, pk[OLD].path)
    cudastandin.install(tmp_path / "h", OLDER, GPUS, libdir="/opt/stale/lib")
    (tmp_path / "h/etc/ld.so.conf.d/00-aaa-stale.conf").write_text("/opt/stale/lib\n")
    with pytest.raises(PackageError) as e:
        ui.install(root, pk[NEW].path)
    line = e.value.one_line()
    assert "the loader resolves libcuda.so.1 to /opt/stale/lib/libcuda.so.1, not driverd's" in line, line
    assert f"the {OLD} user-space is current again" in line and "fix:" in line and len(line.splitlines()) == 1
    assert dus.current(root).version == OLD and dus.previous_sha(root) == (True, None)
    assert not (tmp_path / "h/var/lib/driverd/userspace/pending.json").exists()


def test_refusals_are_one_line_with_the_fix(tmp_path, pk, monkeypatch):
    root = host(tmp_path / "h")
    with pytest.raises(PackageError) as e:
        ui.rollback(root)
    assert e.value.one_line().startswith("nothing to roll back to") and "fix:" in e.value.one_line()
    with pytest.raises(PackageError) as e:
        ui.restore(root, "a" * 64)
    assert f"user-space package {'a' * 12} is not installed under {UROOT}" in e.value.one_line()
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(PackageError) as e:
        ui.install(root, pk[NEW].path)
    assert e.value.one_line().startswith("user-space package for x86_64, this node is aarch64")
    assert not (tmp_path / f"h{UROOT}").exists()


def test_recover_removes_what_a_killed_install_left(tmp_path, pk):
    root = host(tmp_path / "h")
    ui.install(root, pk[NEW].path)
    u = tmp_path / f"h{UROOT}"
    (u / ".driverd-staging-0123").mkdir()
    (u / ".driverd-staging-0123/lib64").mkdir()
    os.symlink(OLD, u / ".current.abcd.tmp")
    notes = ui.recover(root)
    assert any(".driverd-staging-0123" in n for n in notes)
    assert sorted(os.listdir(u)) == [NEW, "current"]
    assert ui.recover(root) == []


def test_a_removed_loader_configuration_is_repaired_by_installing_again(tmp_path, pk):
    root = host(tmp_path / "h")
    ui.install(root, pk[NEW].path)
    (tmp_path / "h/etc/ld.so.conf.d/00-driverd-nvidia.conf").unlink()
    os.unlink(tmp_path / "h/usr/local/bin/nvidia-smi")
    assert not ui.is_installed(root, pk[NEW].sha256)
    rep = ui.install(root, pk[NEW].path)
    assert rep.changed and rep.replaced is None and ui.is_installed(root, pk[NEW].sha256)
    assert driverfiles.find(root).version == NEW and dus.previous_sha(root) == (True, None)
