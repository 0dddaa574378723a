"""Write a host tree (procfs, sysfs, /etc, /boot, /lib/modules) from a small spec.

The formats are the kernel's: /proc/modules rows, sysfs attribute files with trailing newlines,
PCI device directories reached through /sys/bus/pci/devices symlinks, efivarfs attribute bytes.
"""
from __future__ import annotations

import gzip
import os
from dataclasses import field
from pathlib import Path

from driverd.datatypes import dataclass

EFI_GUID = "8be4df61-93ca-11d2-aa0d-e0a9e8d14b8c"


@dataclass
class Pci:
    """One PCI device to write into a host tree's sysfs."""
    address: str
    vendor: str
    device: str
    class_code: str                 # 24-bit, e.g. "0x030200"
    driver: str | None = None
    numa_node: int = -1
    subsystem_vendor: str = "0x10de"
    subsystem_device: str = "0x0000"
    vpd: bytes | None = None        # the device's Vital Product Data (vpd_image), as sysfs gives it
    ib_device: str | None = None    # its RDMA device (mlx5_N): <dev>/infiniband/<name> and /sys/class/infiniband


@dataclass
class Module:
    """One loaded module to write into a host tree's /proc/modules and /sys/module."""
    name: str
    size: int = 100000
    refcount: int = 0
    used_by: tuple[str, ...] = ()
    taints: str = "POE"
    version: str | None = None


@dataclass
class Proc:
    """One process to write into a host tree's /proc, with the files it holds open."""
    pid: int
    comm: str
    fds: tuple[str, ...] = ()
    cgroup: str = "0::/system.slice/example.service"
    cmdline: str = ""


@dataclass
class HostSpec:
    """The small spec a host tree is written from: kernel, OS, devices, modules, processes and files."""
    release: str = "6.1.0-47-cloud-amd64"
    arch: str = "x86_64"
    os_release: str = ('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nNAME="Debian GNU/Linux"\n'
                       'VERSION_ID="12"\nVERSION="12 (bookworm)"\nVERSION_CODENAME=bookworm\nID=debian\n')
    hostname: str = "gpu-node-1"
    cmdline: str = "BOOT_IMAGE=/boot/vmlinuz root=/dev/sda1 ro quiet"
    sig_enforce: bool = False
    config: dict[str, str] = field(default_factory=lambda: {"CONFIG_MODULES": "y", "CONFIG_MODULE_UNLOAD": "y",
                                                              "CONFIG_MODULE_SIG": "y"})
    lockdown: str | None = "[none] integrity confidentiality"
    secure_boot: bool | None = None           # None: not an EFI system
    module_unload: bool = True
    headers: bool = True
    pci: list[Pci] = field(default_factory=list)
    modules: list[Module] = field(default_factory=lambda: [Module("ext4", 1000000, 1, (), "")])
    nvidia_version_text: str | None = None
    modprobe_d: dict[str, str] = field(default_factory=dict)    # host path -> content
    files: dict[str, str] = field(default_factory=dict)         # extra host files
    procs: list[Proc] = field(default_factory=list)
    # Simulated trusted keyrings (driverd.sim.keys): keyring -> certificate files to enrol. None: the
    # tree has no keyrings, and its kernel accepts any signature.
    keyrings: dict[str, list[str]] | None = None
    # Character devices (host path -> (major, minor)): real nodes when this process may mknod, else empty
    # files of that name (what a tree test can look for without root).
    char_devices: dict[str, tuple[int, int]] = field(default_factory=dict)


def vpd_image(identifier: str, readonly: list[tuple[str, str | bytes]]) -> bytes:
    """PCI VPD bytes (PCI Local Bus Specification 3.0, 6.4 and appendix I): the identifier string (large
    item 0x82), VPD-R (0x90) with `readonly` keywords and an RV keyword whose checksum byte makes every byte
    through it sum to zero, and the end tag (0x78). driverd.host.vpd parses it."""
    def large(tag: int, data: bytes) -> bytes:
        return bytes((tag, len(data) & 0xFF, len(data) >> 8)) + data

    head = large(0x82, identifier.encode("latin-1"))
    words = b"".join(k.encode() + bytes((len(v),)) + (v.encode("latin-1") if isinstance(v, str) else v)
                     for k, v in readonly)
    body = words + b"RV\x01"                       # RV: one checksum byte, no reserved space
    vpd_r = bytes((0x90, (len(body) + 1) & 0xFF, (len(body) + 1) >> 8)) + body
    return head + vpd_r + bytes(((-sum(head + vpd_r)) & 0xFF, 0x78))


def h100(addr: str, driver: str | None = None, numa: int = 0) -> Pci:
    return Pci(addr, "0x10de", "0x2330", "0x030200", driver, numa, "0x10de", "0x16c1")


def nvidia_version_line(version: str, flavor: str) -> str:
    if flavor == "open":
        return (f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  "
                "(dvs-builder@U16-I3-B03-4-3)  Thu Oct 19 18:56:32 UTC 2023\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    return (f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Thu Oct 19 18:56:32 UTC 2023\n"
            "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")


def _w(root: Path, hostpath: str, content: str | bytes, mode: int = 0o644) -> None:
    p = root / hostpath.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(content.encode() if isinstance(content, str) else content)
    os.chmod(p, mode)


def proc_modules_text(mods: list[Module], unload: bool) -> str:
    rows = []
    addr = 0xffffffffc0400000
    for m in mods:
        if unload:
            used = "".join(f"{u}," for u in m.used_by) or "-"
            ref = str(m.refcount)
        else:
            used = ref = "-"
        taint = f" ({m.taints})" if m.taints else ""
        rows.append(f"{m.name} {m.size} {ref} {used} Live 0x{addr:016x}{taint}")
        addr += 0x100000
    return "\n".join(rows) + ("\n" if rows else "")


def write_modules(root: Path, mods: list[Module], unload: bool = True) -> None:
    """(Re)write /proc/modules and /sys/module/<name>/ for the given loaded modules."""
    _w(root, "/proc/modules", proc_modules_text(mods, unload))
    for m in mods:
        base = f"/sys/module/{m.name}"
        _w(root, f"{base}/initstate", "live\n")
        _w(root, f"{base}/taint", f"{m.taints}\n")
        if unload:
            _w(root, f"{base}/refcnt", f"{m.refcount}\n")
        (root / base.lstrip("/") / "holders").mkdir(parents=True, exist_ok=True)
        for u in m.used_by:
            link = root / base.lstrip("/") / "holders" / u
            if not link.is_symlink():
                os.symlink(f"../../{u}", link)
        if m.version:
            _w(root, f"{base}/version", f"{m.version}\n")


def write_host(root: str | os.PathLike, spec: HostSpec) -> Path:
    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    _w(r, "/proc/sys/kernel/osrelease", spec.release + "\n")
    _w(r, "/proc/sys/kernel/arch", spec.arch + "\n")
    _w(r, "/proc/sys/kernel/hostname", spec.hostname + "\n")
    _w(r, "/proc/version", f"Linux version {spec.release} (debian-kernel@lists.debian.org) (gcc-12 (Debian "
                           f"12.2.0-14) 12.2.0, GNU ld (GNU Binutils for Debian) 2.40) #1 SMP PREEMPT_DYNAMIC "
                           f"Debian 6.1.0-0 (2025-01-01)\n")
    _w(r, "/proc/cmdline", spec.cmdline + "\n")
    _w(r, "/etc/os-release", spec.os_release)
    cfg = dict(spec.config)
    cfg["CONFIG_MODULE_UNLOAD"] = "y" if spec.module_unload else "n"
    _w(r, f"/boot/config-{spec.release}", "".join(
        f"# {k} is not set\n" if v == "n" else f"{k}={v}\n" for k, v in sorted(cfg.items())))
    _w(r, "/sys/module/module/parameters/sig_enforce", "Y\n" if spec.sig_enforce else "N\n")
    if not (r / "proc/sys/kernel/random/boot_id").exists():
        import uuid
        _w(r, "/proc/sys/kernel/random/boot_id", f"{uuid.uuid4()}\n")
    if spec.lockdown is not None:
        _w(r, "/sys/kernel/security/lockdown", spec.lockdown + "\n")
    if spec.secure_boot is not None:
        _w(r, f"/sys/firmware/efi/efivars/SecureBoot-{EFI_GUID}", bytes([6, 0, 0, 0, 1 if spec.secure_boot else 0]))
    (r / "lib/modules" / spec.release).mkdir(parents=True, exist_ok=True)
    if spec.headers:
        hdr = f"/usr/src/linux-headers-{spec.release}"
        _w(r, f"{hdr}/Makefile", "# kbuild\n")
        link = r / "lib/modules" / spec.release / "build"
        if not link.is_symlink():
            os.symlink(hdr, link)
    for dev in spec.pci:
        d = f"/sys/devices/pci0000:00/{dev.address}"
        _w(r, f"{d}/vendor", dev.vendor + "\n")
        _w(r, f"{d}/device", dev.device + "\n")
        _w(r, f"{d}/class", dev.class_code + "\n")
        _w(r, f"{d}/subsystem_vendor", dev.subsystem_vendor + "\n")
        _w(r, f"{d}/subsystem_device", dev.subsystem_device + "\n")
        _w(r, f"{d}/numa_node", f"{dev.numa_node}\n")
        (r / "sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../../devices/pci0000:00/{dev.address}", r / "sys/bus/pci/devices" / dev.address)
        if dev.vpd is not None:
            _w(r, f"{d}/vpd", dev.vpd, 0o600)              # drivers/pci/vpd.c: S_IRUSR | S_IWUSR
        if dev.ib_device:
            (r / d.lstrip("/") / "infiniband" / dev.ib_device).mkdir(parents=True, exist_ok=True)
            (r / "sys/class/infiniband").mkdir(parents=True, exist_ok=True)
            os.symlink(f"../../devices/pci0000:00/{dev.address}/infiniband/{dev.ib_device}",
                       r / "sys/class/infiniband" / dev.ib_device)
        if dev.driver:
            drv = r / "sys/bus/pci/drivers" / dev.driver
            drv.mkdir(parents=True, exist_ok=True)
            os.symlink(f"../../../bus/pci/drivers/{dev.driver}", r / d.lstrip("/") / "driver")
            os.symlink(f"../../../../devices/pci0000:00/{dev.address}", drv / dev.address)
    write_modules(r, spec.modules, spec.module_unload)
    if spec.nvidia_version_text:
        _w(r, "/proc/driver/nvidia/version", spec.nvidia_version_text)
    for path, text in {**spec.modprobe_d, **spec.files}.items():
        _w(r, path, text)
    for p in spec.procs:
        base = r / "proc" / str(p.pid)
        (base / "fd").mkdir(parents=True, exist_ok=True)
        _w(r, f"/proc/{p.pid}/comm", p.comm[:15] + "\n")   # TASK_COMM_LEN: 15 chars + NUL
        _w(r, f"/proc/{p.pid}/cmdline", (p.cmdline or p.comm).replace(" ", "\0") + "\0")
        _w(r, f"/proc/{p.pid}/cgroup", p.cgroup + "\n")
        for i, target in enumerate(p.fds, 3):
            os.symlink(target, base / "fd" / str(i))
    for path, (major, minor) in spec.char_devices.items():
        _char_device(r, path, major, minor)
    if spec.keyrings is not None:
        from driverd.sim import keys
        keys.setup(r, spec.keyrings)
    return r


def _char_device(root: Path, hostpath: str, major: int, minor: int) -> None:
    import stat
    p = root / hostpath.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists():
        return
    try:
        os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(major, minor))
    except PermissionError:
        p.touch()


def gzip_config(text: str) -> bytes:
    return gzip.compress(text.encode())


def install_kernel(root: str | os.PathLike, release: str, *, image: bool = True, modules: bool = True,
                   depmod: bool = True, dpkg_state: str | None = "installed", headers: bool = False,
                   config: dict[str, str] | None = None) -> None:
    """What Debian's linux-image-<release> leaves in a host tree (the demo, tests, benchmarks): the boot image
    and configuration, an in-tree module of the release's vermagic under /lib/modules/<release>/kernel,
    modules.dep (its postinst's depmod), the package's dpkg status (`dpkg_state`: "installed", or an
    unfinished one — "half-installed", "unpacked", "half-configured"; None: no record) and, with `headers`,
    the headers' Makefile behind /lib/modules/<release>/build. Each part can be left out: the bad input a
    kernel installation leaves when it fails."""
    from driverd.sim.fakemod import FakeModule, default_vermagic, write_module
    r = Path(root)
    if image:
        _w(r, f"/boot/vmlinuz-{release}", "simulated kernel image\n")
        _w(r, f"/boot/config-{release}", "".join(f"{k}={v}\n" for k, v in sorted(
            {"CONFIG_MODULES": "y", "CONFIG_MODULE_UNLOAD": "y", **(config or {})}.items())))
    base = r / "lib/modules" / release
    if modules:
        write_module(FakeModule("dummy", version="", vermagic=default_vermagic(release)), base / "kernel/drivers/net")
        if depmod:              # the whole tree, as depmod indexes it (a driverd package already there too)
            from driverd.sim.depmod import dependency_lines
            _w(r, f"/lib/modules/{release}/modules.dep", "".join(ln + "\n" for ln in dependency_lines(base)))
    if headers:
        hdr = f"/usr/src/linux-headers-{release}"
        _w(r, f"{hdr}/Makefile", "# kbuild\n")
        _w(r, f"{hdr}/.config", "CONFIG_MODULES=y\n")
        base.mkdir(parents=True, exist_ok=True)
        if not (base / "build").is_symlink():
            os.symlink(hdr, base / "build")
    if dpkg_state is not None:
        status = r / "var/lib/dpkg/status"
        status.parent.mkdir(parents=True, exist_ok=True)
        old = status.read_text() if status.exists() else ""
        want = "install" if dpkg_state != "config-files" else "deinstall"
        status.write_text(old + ("\n" if old and not old.endswith("\n\n") else "") +
                          f"Package: linux-image-{release}\nStatus: {want} ok {dpkg_state}\nPriority: optional\n"
                          f"Section: kernel\nArchitecture: amd64\nVersion: {release.split('-')[0]}-1\n"
                          f"Description: Linux {release}\n\n")
