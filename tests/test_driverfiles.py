"""driverd.driver.files: where the driver's user-space is and which of its files a container needs, on
the layouts driverd meets — the device's /usr/local/nvidia, the GPU Operator's /run/nvidia/driver,
Debian's nvidia/current behind alternatives links, a directory only the ld cache names, two versions
side by side — built from real ELF shared objects (tests/runtime/driver_trees.py)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from driverd.driver import files as driverfiles
from driverd.driver.files import find, inventory
from driverd.root import Root
from tests.conftest import require_binary
from tests.runtime.driver_trees import DEBIAN, DEVICE, NEW, OLD, OPERATOR, Layout, _build, add_socket, add_userspace


@pytest.fixture(scope="module")
def so_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("so")


def _names(inv) -> set[str]:
    return {os.path.basename(lib.path) for lib in inv.libraries}


def test_device_layout(tmp_path, so_cache):
    host = tmp_path / "h"
    add_userspace(host, DEVICE, NEW, so_cache)
    (host / "proc/sys/kernel").mkdir(parents=True)
    (host / "proc/sys/kernel/osrelease").write_text("6.8.0-1024-gcp\n")
    add_socket(host, "/run/nvidia-persistenced/socket")          # the host's own persistenced
    (host / "tmp/nvidia-mps").mkdir(parents=True)
    us = find(Root(host))
    assert (us.driver_root, us.lib_dir, us.version) == ("/usr/local/nvidia", "/usr/local/nvidia/lib64", NEW)
    assert us.libs == {"libcuda.so.1": f"/usr/local/nvidia/lib64/libcuda.so.{NEW}",
                       "libnvidia-ml.so.1": f"/usr/local/nvidia/lib64/libnvidia-ml.so.{NEW}"}
    assert us.found and us.relative(f"/usr/local/nvidia/lib64/libcuda.so.{NEW}") == f"/lib64/libcuda.so.{NEW}"
    inv = inventory(Root(host), us)
    assert inv.problem is None and inv.lib_dirs == ("/usr/local/nvidia/lib64",)
    assert _names(inv) == {f"{b}.so.{NEW}" for b in (
        "libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm", "libcudadebugger", "libnvidia-opencl",
        "libnvidia-cfg", "libnvidia-allocator", "libnvidia-gpucomp", "libnvidia-pkcs11-openssl3", "libnvidia-pkcs11")}
    cuda = next(lib for lib in inv.libraries if lib.name.startswith("libcuda."))
    # the soname comes from the ELF file, the links from the directory
    assert cuda.soname == "libcuda.so.1" and cuda.links == (("libcuda.so.1", f"libcuda.so.{NEW}"), ("libcuda.so", "libcuda.so.1"))
    gpucomp = next(lib for lib in inv.libraries if lib.name.startswith("libnvidia-gpucomp."))
    assert gpucomp.soname == f"libnvidia-gpucomp.so.{NEW}" and gpucomp.links == ()
    assert inv.binaries == {n: f"/usr/local/nvidia/bin/{n}" for n in (
        "nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server")}
    assert inv.firmware == tuple(f"/usr/local/nvidia/firmware/nvidia/{NEW}/{n}" for n in ("gsp_ga10x.bin", "gsp_tu10x.bin"))
    assert inv.ipc == {"/run/nvidia-persistenced/socket": "/run/nvidia-persistenced/socket",
                       "/tmp/nvidia-mps": "/tmp/nvidia-mps"}


def test_operator_driver_root_paths_without_prefix(tmp_path, so_cache):
    host = tmp_path / "h"
    add_userspace(host, OPERATOR, NEW, so_cache)
    add_userspace(host, DEBIAN, OLD, so_cache)            # the host's own leftovers are never mixed in
    add_socket(host, "/run/nvidia/driver/run/nvidia-persistenced/socket")
    us = find(Root(host))
    assert us.driver_root == "/run/nvidia/driver" and us.version == NEW
    inv = inventory(Root(host), us)
    assert all(lib.path.startswith("/run/nvidia/driver/usr/lib/x86_64-linux-gnu/") for lib in inv.libraries)
    assert us.relative(inv.libraries[0].path).startswith("/usr/lib/x86_64-linux-gnu/lib")
    assert inv.binaries["nvidia-smi"] == "/run/nvidia/driver/usr/bin/nvidia-smi"
    assert inv.firmware[0].startswith(f"/run/nvidia/driver/lib/firmware/nvidia/{NEW}/")
    # under the driver root first, where the driver container's persistenced puts it
    assert inv.ipc == {"/run/nvidia-persistenced/socket": "/run/nvidia/driver/run/nvidia-persistenced/socket"}
    # an explicit driver root wins over the defaults
    assert find(Root(host), driver_root="/").version == OLD


def test_debian_alternatives(tmp_path, so_cache):
    """Debian: real files in nvidia/current, libcuda.so.1 in the multiarch dir through an absolute
    alternatives link (resolved inside the root, never on this machine), nvidia-smi likewise."""
    host = tmp_path / "h"
    add_userspace(host, DEBIAN, OLD, so_cache, absolute_links=True)
    assert os.readlink(host / "usr/lib/x86_64-linux-gnu/libcuda.so.1").startswith("/etc/alternatives/")
    us = find(Root(host))
    assert (us.driver_root, us.lib_dir, us.version) == ("/", "/usr/lib/x86_64-linux-gnu", OLD)
    assert us.libs["libcuda.so.1"] == f"/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.{OLD}"
    inv = inventory(Root(host), us)
    assert inv.lib_dirs == ("/usr/lib/x86_64-linux-gnu/nvidia/current",)
    assert f"libnvidia-ptxjitcompiler.so.{OLD}" in _names(inv)
    assert inv.binaries["nvidia-smi"] == "/usr/bin/nvidia-smi"          # the PATH name; the mount follows the link
    assert inv.firmware == tuple(f"/lib/firmware/nvidia/{OLD}/{n}" for n in ("gsp_ga10x.bin", "gsp_tu10x.bin"))
    assert us.relative("/usr/bin/nvidia-smi") == "/usr/bin/nvidia-smi"


def test_two_versions_side_by_side_never_mixed(tmp_path, so_cache):
    host = tmp_path / "h"
    add_userspace(host, DEVICE, OLD, so_cache)
    add_userspace(host, DEVICE, NEW, so_cache)           # the links now point at 580
    inv = inventory(Root(host))
    assert inv.version == NEW
    assert _names(inv) and all(n.endswith(NEW) for n in _names(inv))
    assert all(NEW in p for p in inv.firmware) and len(inv.firmware) == 2


def test_mixed_key_libraries_list_nothing(tmp_path, so_cache):
    host = tmp_path / "h"
    add_userspace(host, DEVICE, OLD, so_cache)
    add_userspace(host, DEVICE, NEW, so_cache)
    os.unlink(host / "usr/local/nvidia/lib64/libnvidia-ml.so.1")
    os.symlink(f"libnvidia-ml.so.{OLD}", host / "usr/local/nvidia/lib64/libnvidia-ml.so.1")
    us = find(Root(host))
    assert us.version is None and us.versions == {"libcuda.so.1": NEW, "libnvidia-ml.so.1": OLD}
    inv = inventory(Root(host), us)
    assert inv.libraries == () and inv.binaries == {} and "not of one driver version" in inv.problem
    assert "libcuda.so.1 580.159.04" in inv.problem and "libnvidia-ml.so.1 535.261.03" in inv.problem


def test_nothing_found(tmp_path):
    inv = inventory(Root(tmp_path))
    assert not inv.userspace.found and inv.libraries == () and "no driver user-space found" in inv.problem
    assert "/usr/local/nvidia/lib64" in inv.userspace.searched and "/etc/ld.so.cache" in inv.userspace.searched


def test_ld_cache_finds_a_directory_only_ld_so_conf_names(tmp_path, so_cache):
    """/opt/nvidia/lib is in no list of driverd's: the host's ld cache (written by the real ldconfig
    into the tree) says where libcuda.so.1 is."""
    if os.geteuid() != 0:
        pytest.skip("ldconfig -r chroots into the tree: needs root")
    ldconfig = require_binary("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig")
    host = tmp_path / "h"
    layout = Layout("opt", "/", "/opt/nvidia/lib", "/opt/nvidia/lib", "/opt/nvidia/bin", "/lib/firmware")
    add_userspace(host, layout, NEW, so_cache, binaries=False, firmware=False)
    (host / "etc").mkdir(exist_ok=True)
    (host / "etc/ld.so.conf").write_text("/opt/nvidia/lib\n")
    subprocess.run([ldconfig, "-r", str(host)], check=True, capture_output=True)
    entries = driverfiles.parse_ld_cache((host / "etc/ld.so.cache").read_bytes())
    assert ("libcuda.so.1", "/opt/nvidia/lib/libcuda.so.1") in entries
    us = find(Root(host))
    assert (us.driver_root, us.lib_dir, us.version, us.via_ld_cache) == ("/", layout.lib_dir, NEW, True)
    assert f"libnvidia-cfg.so.{NEW}" in _names(inventory(Root(host), us))


def test_the_ld_cache_is_read_once_for_every_library_asked_of_it(tmp_path):
    """A host with no user-space anywhere: each driver root's cache is read once, not once a library."""
    reads = []

    class Counting(Root):
        def read_bytes(self, path, limit=4 << 20):
            reads.append(path)
            return super().read_bytes(path, limit)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/ld.so.cache").write_bytes(b"glibc-ld.so.cache1.1" + b"\0" * 28)
    us = find(Counting(tmp_path))
    caches = [r for r in reads if r.endswith("ld.so.cache")]
    assert not us.found and caches and len(caches) == len(set(caches)), reads


def test_ld_cache_parser_rejects_garbage_and_reads_the_old_prefix(tmp_path):
    import struct
    assert driverfiles.parse_ld_cache(b"") == [] and driverfiles.parse_ld_cache(b"\0" * 100) == []
    strings = b"libcuda.so.1\0/x/libcuda.so.1\0"
    new = bytearray(b"glibc-ld.so.cache1.1" + struct.pack("<II", 2, len(strings)) + b"\0" * 20)
    base = 48 + 2 * 24
    new += struct.pack("<iIIIQ", 0x0303, base, base + 13, 0, 0)          # x86-64 ELF: kept
    new += struct.pack("<iIIIQ", 0x0003, base, base + 13, 0, 0)          # i386: not ours
    new += strings
    assert driverfiles.parse_ld_cache(bytes(new)) == [("libcuda.so.1", "/x/libcuda.so.1")]
    old = b"ld.so-1.7.0\0" + struct.pack("<I", 1) + b"\0" * 12          # one old entry, then 8-byte aligned
    old += b"\0" * ((-len(old)) % 8)
    assert driverfiles.parse_ld_cache(old + bytes(new)) == [("libcuda.so.1", "/x/libcuda.so.1")]
    assert driverfiles.parse_ld_cache(bytes(new[:60])) == []              # truncated: nothing, no exception


def test_elf_soname_of_non_elf_and_truncated(tmp_path, so_cache):
    so = _build(so_cache, "libx.so.7", "int x(void){return 1;}\n")
    assert driverfiles.elf_soname(str(so)) == "libx.so.7"
    (tmp_path / "t").write_bytes(so.read_bytes()[:200])
    (tmp_path / "n").write_text("not elf")
    assert driverfiles.elf_soname(str(tmp_path / "t")) is None
    assert driverfiles.elf_soname(str(tmp_path / "n")) is None
    assert driverfiles.elf_soname(str(tmp_path / "missing")) is None
    assert driverfiles.elf_soname(shutil.which("true") or "/bin/true") is None      # an executable declares none


def test_firmware_follows_the_kernels_custom_path_and_release(tmp_path, so_cache):
    host = tmp_path / "h"
    add_userspace(host, DEVICE, NEW, so_cache, firmware=False)
    (host / "proc/sys/kernel").mkdir(parents=True)
    (host / "proc/sys/kernel/osrelease").write_text("6.1.0-47-cloud-amd64\n")
    rel = host / f"lib/firmware/6.1.0-47-cloud-amd64/nvidia/{NEW}"
    rel.mkdir(parents=True)
    (rel / "gsp_ga10x.bin").write_bytes(b"x")
    assert inventory(Root(host)).firmware == (f"/lib/firmware/6.1.0-47-cloud-amd64/nvidia/{NEW}/gsp_ga10x.bin",)
    custom = host / f"srv/fw/nvidia/{NEW}"
    custom.mkdir(parents=True)
    (custom / "gsp_ga10x.bin").write_bytes(b"y")
    (host / "sys/module/firmware_class/parameters").mkdir(parents=True)
    (host / "sys/module/firmware_class/parameters/path").write_text("/srv/fw\n")
    assert inventory(Root(host)).firmware == (f"/srv/fw/nvidia/{NEW}/gsp_ga10x.bin",)


def test_json_keeps_the_finder_fields(tmp_path, so_cache):
    add_userspace(tmp_path / "h", DEVICE, NEW, so_cache)
    us = find(Root(tmp_path / "h"))
    assert set(us.to_json()) == {"driver_root", "lib_dir", "libs", "version", "versions", "searched"}
    assert inventory(Root(tmp_path / "h"), us).to_json()["libraries"][0]["soname"]
