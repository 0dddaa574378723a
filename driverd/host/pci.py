"""PCI devices from sysfs (/sys/bus/pci/devices/<domain:bus:dev.fn>/): NVIDIA GPUs, NVSwitches,
Mellanox NICs. The `class` file holds 24 bits: base class, subclass, programming interface."""
from __future__ import annotations

import re

from driverd.datatypes import dataclass
from driverd.host import gputable
from driverd.host.facts import GpuFacts, NicFacts, NvSwitchFacts
from driverd.host.textfmt import kernel_int
from driverd.nvproc import gpu_information
from driverd.root import Root

PCI_DEVICES = "/sys/bus/pci/devices"
NVIDIA = "0x10de"
MELLANOX = "0x15b3"
# nvidia.ko binds NVIDIA functions of class VGA (0x0300) and 3D (0x0302) only (nv-pci-table.c,
# nv_pci_table); other display functions (0x0380) are not GPUs it will drive.
GPU_CLASSES = {0x0300, 0x0302}      # VGA-compatible, 3D controller
DISPLAY_BASE = 0x03
# bridge: other. nvidia.ko's nvswitch driver binds every NVIDIA function of this class (linux_nvswitch.c,
# nvswitch_pci_table) and os_is_nvswitch_present() counts them (os-interface.c); host/fabric.py names them.
NVSWITCH_CLASS = 0x0680
PASSTHROUGH_DRIVERS = ("vfio-pci", "pci-stub", "nvgrace_gpu_vfio_pci", "nvgrace-gpu-vfio-pci")
# pci_name(): "%04x:%02x:%02x.%d"; the domain is wider than 4 digits behind Intel VMD (10000:e1:00.0).
_ADDR = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
# drivers/pci/pci-sysfs.c: vendor/device/subsystem_* are "0x%04x\n", class is "0x%06x\n".
_HEX4 = re.compile(r"^0x[0-9a-f]{4}$")
_HEX6 = re.compile(r"^0x[0-9a-f]{6}$")


@dataclass(frozen=True)
class PciDevice:
    """One PCI function as sysfs shows it."""
    address: str
    vendor: str
    device: str
    class_code: int
    subsystem_vendor: str | None
    subsystem_device: str | None
    numa_node: int | None
    driver: str | None


def _hex(root: Root, path: str, pattern: re.Pattern = _HEX4) -> str | None:
    v = root.read_first_line(path)
    if v is None:
        return None
    v = v.lower()
    return v if pattern.match(v) else None


def read_device(root: Root, addr: str, warnings: list[str]) -> PciDevice | None:
    base = f"{PCI_DEVICES}/{addr}"
    vendor, device = _hex(root, f"{base}/vendor"), _hex(root, f"{base}/device")
    cls = _hex(root, f"{base}/class", _HEX6)
    if vendor is None or device is None or cls is None:
        if root.is_dir(base):
            warnings.append(f"PCI device {addr}: unreadable or garbled vendor/device/class in sysfs; skipped")
        else:
            warnings.append(f"PCI device {addr}: {base} is not a device directory; skipped")
        return None
    # numa_node is "%d\n"; -1 means the platform gives no NUMA affinity.
    numa = root.read_first_line(f"{base}/numa_node")
    numa_node = kernel_int(numa)
    if numa is not None and numa_node is None:
        warnings.append(f"PCI device {addr}: garbled numa_node {numa[:20]!r}")
    link = root.readlink(f"{base}/driver")
    return PciDevice(addr, gputable.norm_id(vendor), gputable.norm_id(device), int(cls, 16) >> 8,
                     _hex(root, f"{base}/subsystem_vendor"), _hex(root, f"{base}/subsystem_device"),
                     numa_node if numa_node is None or numa_node >= 0 else None,
                     _driver_name(link))


def _driver_name(link: str | None) -> str | None:
    """The bound driver from the device's `driver` symlink, which the driver core always points
    at .../bus/<bus>/drivers/<name>; any other target (a loop, junk) names no driver."""
    parts = link.rstrip("/").split("/") if link else []
    if len(parts) < 2 or parts[-2] != "drivers":
        return None
    name = parts[-1]
    return name if name and name.isprintable() else None


def scan(root: Root, warnings: list[str]) -> list[PciDevice]:
    out = []
    for addr in root.listdir(PCI_DEVICES):
        if not _ADDR.match(addr):
            continue
        dev = read_device(root, addr, warnings)
        if dev is not None:
            out.append(dev)
    return out


# nv-procfs.c prints "GPU UUID: \t %s" only when RM returns one: GPU-<8>-<4>-<4>-<4>-<12> hex.
_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


def gpu_from(dev: PciDevice, warnings: list[str], info: dict[str, str] | None = None) -> GpuFacts:
    model = gputable.lookup(dev.device, dev.subsystem_vendor, dev.subsystem_device)
    if model is None:
        warnings.append(f"GPU {dev.address}: device id {dev.device} is not in driverd's GPU table; "
                        f"architecture and open-module support unknown (`driverd gpus {dev.device}`)")
    return GpuFacts(
        pci_address=dev.address, vendor_id=dev.vendor, device_id=dev.device,
        subsystem_vendor_id=dev.subsystem_vendor, subsystem_device_id=dev.subsystem_device,
        class_code=f"0x{dev.class_code:04x}", numa_node=dev.numa_node, bound_driver=dev.driver,
        name=model.name if model else "unknown", architecture=model.architecture if model else "unknown",
        chip=model.chip if model else None,
        open_module_support=model.open_module_support if model else "unknown",
        min_branch=model.min_branch if model else None, last_branch=model.last_branch if model else None,
        known=model is not None,
        uuid=(info or {}).get("GPU UUID") if _UUID.match((info or {}).get("GPU UUID", "")) else None,
        minor=kernel_int((info or {}).get("Device Minor"), signed=False))   # "Device Minor: \t %u"


def classify(root: Root, devices: list[PciDevice], warnings: list[str]
             ) -> tuple[list[GpuFacts], list[NvSwitchFacts], list[NicFacts]]:
    gpus, switches, nics = [], [], []
    for d in devices:
        if d.vendor == NVIDIA and d.class_code in GPU_CLASSES:
            gpus.append(gpu_from(d, warnings, gpu_information(root, d.address)))
            if d.driver in PASSTHROUGH_DRIVERS:
                warnings.append(f"GPU {d.address} is bound to {d.driver} (passed through to a VM); the host "
                                "driver will not use it until it is unbound")
        elif d.vendor == NVIDIA and d.class_code >> 8 == DISPLAY_BASE:
            warnings.append(f"NVIDIA display function {d.address} (device {d.device}, class 0x{d.class_code:04x}) "
                            "is not a VGA or 3D controller; nvidia.ko does not drive it, not counted as a GPU")
        elif d.vendor == NVIDIA and d.class_code == NVSWITCH_CLASS:
            switches.append(NvSwitchFacts(d.address, d.device, gputable.nvswitch_name(d.device) or "NVSwitch",
                                          d.driver))
        elif d.vendor == MELLANOX and d.class_code >> 8 == 0x02:   # network controllers
            nics.append(NicFacts(d.address, d.vendor, d.device, f"0x{d.class_code:04x}", d.driver,
                                 tuple(root.listdir(f"{PCI_DEVICES}/{d.address}/net"))))
    return gpus, switches, nics
