"""Create missing /dev/nvidia* character devices from /proc/devices, as nvidia-modprobe does.

The driver registers majors but no udev rule creates these nodes; containers and CUDA need them.
Fixed numbers: /dev/nvidia<N> is 195:N, /dev/nvidiactl 195:255, /dev/nvidia-modeset 195:254.
Dynamic majors (nvidia-uvm, nvidia-caps, nvidia-nvswitch) are read from /proc/devices.
"""
from __future__ import annotations

import re

NVIDIA_MAJOR = 195


def parse_proc_devices(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    section = None
    for line in (text or "").splitlines():
        if line.endswith("devices:"):
            section = line.split()[0]
            continue
        m = re.match(r"^\s*(\d+)\s+(\S+)$", line)
        if m and section == "Character":
            out.setdefault(m.group(2), int(m.group(1)))
    return out


def gpu_minors(root) -> list[int]:
    from driverd.nvproc import gpu_addresses, gpu_information
    minors = (gpu_information(root, addr).get("Device Minor", "") for addr in gpu_addresses(root))
    return sorted(int(m) for m in minors if m.isdigit())


def wanted_nodes(root, loaded: set[str]) -> list[tuple[str, int, int]]:
    devs = parse_proc_devices(root.read_text("/proc/devices"))
    nodes: list[tuple[str, int, int]] = []
    if "nvidia" in loaded:
        nodes.append(("/dev/nvidiactl", NVIDIA_MAJOR, 255))
        nodes += [(f"/dev/nvidia{n}", NVIDIA_MAJOR, n) for n in gpu_minors(root)]
        if "nvidia-caps" in devs:
            nodes += [("/dev/nvidia-caps/nvidia-cap1", devs["nvidia-caps"], 1),
                      ("/dev/nvidia-caps/nvidia-cap2", devs["nvidia-caps"], 2)]
        if "nvidia-nvswitch" in devs:
            nodes.append(("/dev/nvidia-nvswitchctl", devs["nvidia-nvswitch"], 255))
            nodes += [(f"/dev/nvidia-nvswitch{i}", devs["nvidia-nvswitch"], i)
                      for i in range(len([a for a in root.listdir("/sys/bus/pci/drivers/nvidia-nvswitch") if ":" in a]))]
    if "nvidia_modeset" in loaded:
        nodes.append(("/dev/nvidia-modeset", NVIDIA_MAJOR, 254))
    if "nvidia_uvm" in loaded and "nvidia-uvm" in devs:
        nodes += [("/dev/nvidia-uvm", devs["nvidia-uvm"], 0), ("/dev/nvidia-uvm-tools", devs["nvidia-uvm"], 1)]
    return nodes


def create_missing(kernel) -> list[str]:
    """Create the nodes that do not exist yet; returns the paths created."""
    loaded = kernel.loaded_names()
    made = []
    for path, major, minor in wanted_nodes(kernel.root, loaded):
        if kernel.root.exists(path) or kernel.root.readlink(path) is not None:   # inside the root, as written
            continue
        kernel.mknod(path, major, minor)
        made.append(path)
    return made
