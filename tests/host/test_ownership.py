"""Who owns the installed driver, and driver.manage: a driver that Debian/Ubuntu packages, an RPM, DKMS
or NVIDIA's installer owns is left alone under `auto` (the plan names the owner), replaced under
`always`; `never` leaves any driver."""
import os
import sqlite3
import struct

import pytest

from driverd.host import collect
from driverd.distro.rpm import parse_rpm_header
from driverd.host.ownership import read_ownership
from driverd.plan import Desired, plan
from driverd.root import Root
from driverd.sim.hosttree import HostSpec, Module, h100, nvidia_version_line, write_host

REL = "6.1.0-47-cloud-amd64"
CONTAINERD = {"/etc/containerd/config.toml": 'version = 2\n', "/usr/bin/containerd": ""}


def tree(tmp_path, files: dict, links: dict = (), running: tuple | None = None):
    kw = {}
    if running:
        version, flavor = running
        kw = {"modules": [Module("nvidia", 5000000, 0, ("nvidia_modeset", "nvidia_uvm"), version=version),
                          Module("nvidia_uvm", 100000, 0), Module("nvidia_modeset", 100000, 0)],
              "nvidia_version_text": nvidia_version_line(version, flavor)}
    write_host(tmp_path, HostSpec(pci=[h100("0000:1b:00.0", "nvidia" if running else None)],
                                  files={**CONTAINERD, **files}, **kw))
    for link, target in dict(links).items():
        p = tmp_path / link.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, p)
    return tmp_path


def debian_dkms(tmp_path, running=("535.261.03", "proprietary")):
    """Debian 12's nvidia-kernel-dkms: DKMS builds nvidia-current.ko into updates/dkms/."""
    mods = ["nvidia-current", "nvidia-current-modeset", "nvidia-current-uvm", "nvidia-current-drm",
            "nvidia-current-peermem"]
    files = {f"/lib/modules/{REL}/updates/dkms/{m}.ko": "\x7fELF" for m in mods}
    files.update({f"/var/lib/dkms/nvidia-current/535.261.03/{REL}/x86_64/module/{m}.ko": "\x7fELF" for m in mods})
    files[f"/lib/modules/{REL}/modules.dep"] = "".join(f"updates/dkms/{m}.ko:\n" for m in mods)
    files["/var/lib/dpkg/info/nvidia-kernel-dkms.list"] = "/.\n/usr\n/usr/src\n/usr/src/nvidia-current-535.261.03\n" \
        "/usr/src/nvidia-current-535.261.03/dkms.conf\n"
    files["/var/lib/dpkg/status"] = "Package: nvidia-kernel-dkms\nStatus: install ok installed\nVersion: 535.261.03-1\n\n"
    links = {f"/var/lib/dkms/nvidia-current/kernel-{REL}-x86_64": f"535.261.03/{REL}/x86_64"}
    return tree(tmp_path, files, links, running)


def ubuntu_lrm(tmp_path, merged_usr=True, running=("535.216.01", "proprietary")):
    """Ubuntu's precompiled, signed linux-modules-nvidia-535-server-<release> (what DGX OS and cloud
    images install): its .list names /lib/modules/... (or /usr/lib/modules/... with merged /usr)."""
    pkg = f"linux-modules-nvidia-535-server-{REL}"
    mods = ["nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-drm", "nvidia-peermem"]
    files = {f"/lib/modules/{REL}/kernel/nvidia-535srv/{m}.ko": "\x7fELF" for m in mods}
    prefix = "/usr/lib/modules" if merged_usr else "/lib/modules"
    files[f"/var/lib/dpkg/info/{pkg}.list"] = "".join(f"{prefix}/{REL}/kernel/nvidia-535srv/{m}.ko\n" for m in mods)
    files["/var/lib/dpkg/status"] = (f"Package: {pkg}\nStatus: install ok installed\nArchitecture: amd64\n"
                                     "Version: 6.1.0-47.1+1\n\n")
    return tree(tmp_path, files, running=running)


def rpm_header(name: str, version: str, release: str, files: list[str]) -> bytes:
    dirs = sorted({f.rsplit("/", 1)[0] + "/" for f in files})
    entries, store = [], b""

    def add(tag, typ, data: bytes, count: int, align: int = 1):
        nonlocal store
        store += b"\0" * (-len(store) % align)
        entries.append(struct.pack(">iiii", tag, typ, len(store), count))
        store += data
    add(1000, 6, name.encode() + b"\0", 1)
    add(1001, 6, version.encode() + b"\0", 1)
    add(1002, 6, release.encode() + b"\0", 1)
    add(1116, 4, b"".join(struct.pack(">i", dirs.index(f.rsplit("/", 1)[0] + "/")) for f in files), len(files), 4)
    add(1117, 8, b"".join(f.rsplit("/", 1)[1].encode() + b"\0" for f in files), len(files))
    add(1118, 8, b"".join(d.encode() + b"\0" for d in dirs), len(dirs))
    return struct.pack(">ii", len(entries), len(store)) + b"".join(entries) + store


def rhel_kmod(tmp_path):
    mods = [f"/lib/modules/{REL}/extra/nvidia-open/{m}.ko.xz" for m in ("nvidia", "nvidia-uvm", "nvidia-modeset")]
    tree(tmp_path, {m: "x" for m in mods})
    db = tmp_path / "var/lib/rpm/rpmdb.sqlite"
    db.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE Packages (hnum INTEGER PRIMARY KEY AUTOINCREMENT, blob BLOB NOT NULL)")
    con.execute("INSERT INTO Packages (blob) VALUES (?)", (rpm_header("bash", "5.1.8", "9.el9", ["/usr/bin/bash"]),))
    con.execute("INSERT INTO Packages (blob) VALUES (?)",
                (rpm_header("kmod-nvidia-open", "570.172.08", "1.el9", mods),))
    con.commit()
    con.close()
    return tmp_path


def test_rpm_header_parser_reads_what_it_needs():
    h = parse_rpm_header(rpm_header("kmod-nvidia", "1", "2", ["/lib/modules/x/extra/nvidia.ko"]))
    assert h[1000] == "kmod-nvidia" and h[1117] == ["nvidia.ko"] and h[1118] == ["/lib/modules/x/extra/"]
    with pytest.raises(ValueError):
        parse_rpm_header(b"\x7f\xff\xff\xff\0\0\0\0")


@pytest.mark.parametrize("make,manager,package,words", [
    (debian_dkms, "dkms", "nvidia-current/535.261.03", "source from package nvidia-kernel-dkms"),
    (ubuntu_lrm, "dpkg", f"linux-modules-nvidia-535-server-{REL}", "linux-modules-nvidia-535-server"),
    (rhel_kmod, "rpm", "kmod-nvidia-open", "rpmdb.sqlite"),
])
def test_package_managed_drivers_are_recognised(tmp_path, make, manager, package, words):
    root = make(tmp_path)
    o = read_ownership(Root(root), REL)
    assert o.foreign is not None and o.foreign.manager == manager and o.foreign.package == package
    assert words in o.foreign.evidence
    assert o.module_files and all(p.startswith(f"/lib/modules/{REL}/") for p in o.module_files)


def test_ubuntu_list_without_merged_usr_and_dpkg_version(tmp_path):
    o = read_ownership(Root(ubuntu_lrm(tmp_path, merged_usr=False)), REL)
    assert o.foreign.manager == "dpkg" and o.foreign.version == "6.1.0-47.1+1" and len(o.foreign.files) == 5


def test_run_installer_driver(tmp_path):
    root = tree(tmp_path, {f"/lib/modules/{REL}/kernel/drivers/video/nvidia.ko": "x",
                           f"/lib/modules/{REL}/kernel/drivers/video/nvidia-uvm.ko": "x",
                           "/usr/bin/nvidia-uninstall": "#!/bin/sh\n"})
    o = read_ownership(Root(root), REL)
    assert o.foreign.manager == "nvidia-installer" and "nvidia-uninstall" in o.foreign.evidence


def test_driverd_own_package_and_unknown_files_are_not_foreign(tmp_path):
    root = tree(tmp_path, {f"/lib/modules/{REL}/updates/driverd/nvidia.ko": "x",
                           f"/lib/modules/{REL}/extra/nvidia.ko": "x"})
    o = read_ownership(Root(root), REL)
    assert [x.manager for x in o.owners] == ["driverd", "unknown"] and o.foreign is None
    none = read_ownership(Root(tree(tmp_path / "bare", {})), REL)
    assert none.module_files == () and none.foreign is None and "no NVIDIA kernel module" in none.summary


def test_auto_leaves_a_debian_dkms_driver_and_still_configures_the_runtimes(tmp_path):
    f = collect(Root(debian_dkms(tmp_path)), nvml=False)
    p = plan(f, Desired("570.195.03"))
    assert p.driver_managed_by == "DKMS module nvidia-current/535.261.03"
    assert [s.action for s in p.steps] == ["configure-runtime"]
    assert "nvidia-kernel-dkms" in p.flavor_reason and "driver.manage = always" in p.flavor_reason
    assert any("570.195.03 is not applied" in w and "535.261.03" in w for w in p.warnings)
    assert not p.blocked_by


def test_auto_leaves_ubuntu_precompiled_modules_without_a_driver_version(tmp_path):
    f = collect(Root(ubuntu_lrm(tmp_path)), nvml=False)
    p = plan(f, Desired(None))                       # no driver.version needed to leave it alone
    assert p.driver_managed_by.startswith("Debian/Ubuntu package linux-modules-nvidia-535-server")
    assert p.driver_version == "535.216.01" and p.flavor == "proprietary"


def test_always_replaces_and_warns(tmp_path):
    f = collect(Root(debian_dkms(tmp_path)), nvml=False)
    p = plan(f, Desired("570.195.03", manage="always"))
    acts = [s.action for s in p.steps]
    assert p.driver_managed_by is None
    assert {"fetch-package", "install-package", "unload-modules", "load-modules"} <= set(acts)
    assert any("driver.manage = always" in w and "nvidia-current/535.261.03" in w for w in p.warnings)


def test_never_leaves_even_an_unmanaged_host(tmp_path):
    f = collect(Root(tree(tmp_path, {})), nvml=False)
    p = plan(f, Desired("570.195.03", manage="never"))
    assert p.driver_managed_by and [s.action for s in p.steps] == ["configure-runtime"]
    assert plan(f, Desired("570.195.03")).driver_managed_by is None     # auto: nobody else owns it


def test_plan_command_says_who_owns_the_driver(tmp_path):
    from tests.conftest import run_cli
    root = debian_dkms(tmp_path)
    out = run_cli("plan", "--root", str(root), "--driver", "570.195.03", check=True).stdout
    assert out.startswith("driver left to DKMS module nvidia-current/535.261.03") and "configure-runtime" in out
    out = run_cli("plan", "--root", str(root), "--driver", "570.195.03", env={"DRIVERD_DRIVER_MANAGE": "always"}).stdout
    assert "fetch-package" in out
