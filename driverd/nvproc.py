"""The NVIDIA driver's per-GPU procfs file, /proc/driver/nvidia/gpus/<pci address>/information
(nv-procfs.c: "Key: \\t value" lines — Model, IRQ, GPU UUID, Device Minor, Bus Location, ...),
present while nvidia is bound to the GPU. One reader for the facts (host/pci.py), the device nodes
(kmod/devnodes.py) and the CDI spec (runtime/cdi.py); the root object is passed in, so this sits at
the bottom of the layers."""
from __future__ import annotations

GPUS = "/proc/driver/nvidia/gpus"


def gpu_addresses(root) -> list[str]:
    """The PCI addresses the driver lists (none while it is not loaded)."""
    return root.listdir(GPUS)


def gpu_information(root, addr: str) -> dict[str, str]:
    """'Key: value' lines of one GPU's information file; {} when it is absent or unreadable."""
    out = {}
    for line in (root.read_text(f"{GPUS}/{addr}/information", 64 << 10) or "").splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out
