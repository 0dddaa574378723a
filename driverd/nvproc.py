"""The NVIDIA driver's per-GPU procfs file, /proc/driver/nvidia/gpus/<pci address>/information
(nv-procfs.c: "Key: \\t value" lines — Model, IRQ, GPU UUID, Device Minor, Bus Location, ...),
present while nvidia is bound to the GPU; and the driver's IMEX channel devices with the major of their
region. One reader for the facts (host/pci.py, host/fabric.py), the device nodes (kmod/devnodes.py) and
the CDI spec (runtime/cdi/); the root object is passed in, so this sits at the bottom of the layers."""
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


# -- IMEX channels ----------------------------------------------------------------------------------
# nv-caps-imex.c (open-gpu-kernel-modules): with NVreg_ImexChannelCount > 0 the driver registers a
# character region named "nvidia-caps-imex-channels" (its major in /proc/devices) and, with
# NVreg_CreateImexChannel0=1, udev makes /dev/nvidia-caps-imex-channels/channel0 (mode 0666: the
# one world-visible channel). Without udev (a container, a minimal host) nobody makes the node:
# mknod c <major> <N>. Read by the fabric facts (host/fabric.py) and the CDI writer (runtime/cdi/).
IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"
IMEX_REGION = "nvidia-caps-imex-channels"


def imex_channels(root) -> list[tuple[int, str]]:
    """(channel number, host path) of each /dev/nvidia-caps-imex-channels/channel<N> there, by number."""
    out = []
    for name in root.listdir(IMEX_CHANNELS):
        num = name.removeprefix("channel")
        # nvidia-container-toolkit bounds channel ids by a dev_t minor (20 bits): pkg/nvcdi/lib-imex.go
        if name.startswith("channel") and num.isascii() and num.isdigit() and int(num) < 1 << 20:
            path = f"{IMEX_CHANNELS}/{name}"
            if root.exists(path) and not root.is_dir(path):
                out.append((int(num), path))
    return sorted(out)


def char_major(root, name: str) -> int | None:
    """The major /proc/devices gives the character region `name` ("%3d %s" lines under
    "Character devices:"), None when the driver has not registered it."""
    section = ""
    for line in (root.read_text("/proc/devices", 64 << 10) or "").splitlines():
        if line.endswith("devices:"):
            section = line.split(" ", 1)[0]
            continue
        num, _, dev = line.strip().partition(" ")
        if section == "Character" and dev.strip() == name and num.isdigit():
            return int(num)
    return None
