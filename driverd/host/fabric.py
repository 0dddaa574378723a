"""Which kind of GPU fabric a host has, the evidence, and the companions the driver then needs.

- **nvswitch** — NVSwitch chips on the host's PCI bus: HGX/DGX A100 (2nd-gen LR10, NVLink3) and H100/H200
  (3rd-gen LS10, NVLink4) baseboards. NVIDIA functions of class 0x0680 ("bridge/other"): the class
  nvidia.ko's nvswitch driver binds (kernel-open/nvidia/linux_nvswitch.c, nvswitch_pci_table) and the
  one os_is_nvswitch_present() counts (kernel-open/nvidia/os-interface.c); its device ids are the tables
  of src/common/nvswitch/kernel/nvswitch.c (open-gpu-kernel-modules 595.45.04). nv-fabricmanager routes
  the switches; until it has, CUDA sees the GPUs but cannot use them. libnvidia-nscq is how nvidia-smi
  and DCGM read the switches.
- **nvlink5-switch-tray** — HGX B200/B300-class: the NVLink5 switches are not PCI devices. NVIDIA's Fabric
  Manager User Guide (HGX B200 baseboard): a ConnectX-7 bridge on the baseboard exposes per port a
  full-capability PF and a limited PF (LPF); "the LPF VPD information includes a vendor-specific field
  called SMDL, with a non-zero value defined as SW_MNG", and the fabric manager's prelaunch script
  finds the LPFs by it. NVIDIA's driver container decides the same way (gpu-driver-container,
  rhel9/nvidia-driver `_assert_nvlink5_system`: SW_MNG in /sys/class/infiniband/*/device/vpd) and
  then waits for mlx5_core and ib_umad before it starts NVLSM and the fabric manager
  (`_ensure_nvlink5_prerequisites`, nvidia-fabricmanager-start.sh). The VPD is parsed here
  (driverd/host/vpd.py), not searched as text.
- **nvlink5-imex** — GB200/GB300 NVL72-class compute trays: an NVIDIA Grace CPU with Blackwell GPUs and
  neither of the above; the NVLink switch trays are managed off the node (NMX-C in the switch trays),
  and GPU memory crosses nodes through the IMEX daemon and its channel devices
  (/dev/nvidia-caps-imex-channels/channel<N>, driverd/nvproc.py).
  IMEX is a host service (nvidia-imex) unless NVIDIA's DRA driver runs it: its ComputeDomains start an IMEX
  daemon per domain themselves, and a host IMEX service beside them must never run (`compute_domains`
  below: the evidence; driverd.plan.companions decides who owns IMEX).
- **unknown** — the evidence that decides could not be read (a ConnectX VPD is root's only: an
  unprivileged `detect` cannot tell an HGX B200 from a host without a fabric).
- **none** — everything else (PCIe GPUs, NVLink bridges between pairs, no GPU).

Light on purpose: `driverd detect` runs it on every call. VPD (a slow config-space walk on real hardware)
is read only for the physical functions of ConnectX (Mellanox vendor) network devices, and only when the host has a
GPU of Blackwell's generation or one the table does not know and no NVSwitch: the only hosts that can
have switch trays. A host without GPUs (a shared-NVSwitch service VM) reports its PCI NVSwitches but no
switch trays.
"""
from __future__ import annotations

import re
from dataclasses import replace

from driverd.host import gputable
# the shapes live with the other facts (facts.py never imports this module: collect() does)
from driverd.host.facts import Companion, Fabric, FabricDevice, GpuFacts, NicFacts, NvSwitchFacts
from driverd.nvproc import IMEX_CHANNELS, IMEX_REGION, char_major, imex_channels

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Sequence

    from driverd.root import Root

KINDS = ("none", "nvswitch", "nvlink5-switch-tray", "nvlink5-imex", "unknown")
# src/common/nvswitch/kernel/nvswitch.c: nvswitch_lr10_device_ids, nvswitch_ls10_device_ids (0x22A0-0x22A7
# the management endpoint, 0x22A8-0x22AF the Laguna switch's bridge functions).
LR10_IDS = frozenset({0x1AE8, *range(0x1AF0, 0x1B00)})
LS10_IDS = frozenset(range(0x22A0, 0x22B0))
# SMCCC SOC_ID as the kernel shows it (drivers/firmware/smccc/soc_id.c: "jep106:%02x%02x:%04x"): JEP106
# NVIDIA (0x6b after three continuation codes), SoC 0x0241 = Grace; NVIDIA's DCGM and hwloc match this string.
SOC_ID = "/sys/devices/soc0/soc_id"
GRACE_SOC_ID = "jep106:036b:0241"
SW_MNG = ("SMDL", "SW_MNG")            # the LPF's vendor-specific VPD field and value (Fabric Manager User Guide)
NVLSM_AFTER = ("mlx5_core", "ib_core", "ib_umad")   # the LPF's driver and the MAD interface NVLSM opens
PCI = "/sys/bus/pci/devices"
# NVIDIA's DRA driver (github.com/NVIDIA/k8s-dra-driver-gpu) runs IMEX itself for ComputeDomains. Its
# compute-domain kubelet plugin is the DRA driver "compute-domain.nvidia.com" (cmd/compute-domain-kubelet-plugin/
# main.go: DriverName; its data directory DriverPluginPath = <kubelet plugins directory>/<DriverName>), and it
# registers through k8s.io/dynamic-resource-allocation/kubeletplugin (cmd/compute-domain-kubelet-plugin/driver.go:
# kubeletplugin.Start), whose defaults (kubeletplugin/draplugin.go: KubeletPluginsDir, KubeletRegistryDir) put the
# plugin's socket dra.sock in /var/lib/kubelet/plugins/<DriverName>/ and its registration socket
# <DriverName>-reg.sock (<DriverName>-<uid>-reg.sock with the helper's rolling update) in
# /var/lib/kubelet/plugins_registry, where the kubelet's plugin watcher finds it. A kubelet run with another
# --root-dir is not looked for.
CD_DRIVER = "compute-domain.nvidia.com"
KUBELET_REGISTRY = "/var/lib/kubelet/plugins_registry"
KUBELET_PLUGINS = "/var/lib/kubelet/plugins"
_CD_REG = re.compile(r"^" + re.escape(CD_DRIVER) + r"(-[0-9A-Za-z-]+)?-reg\.sock$")
_NEW_ARCH = gputable.ARCH_ORDER.index("Blackwell")


def switch_generation(device_id: str) -> str:
    did = int(device_id, 16)
    if did in LS10_IDS:
        return "3rd-gen NVSwitch (LS10, NVLink4)"
    if did in LR10_IDS:
        return "2nd-gen NVSwitch (LR10, NVLink3)"
    return "NVSwitch of an id nvswitch.c does not list"


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else many or word + 's'}"


def _fabricmanager(detail: str) -> Companion:
    return Companion("fabricmanager", "daemon", detail)


def _switches(switches: Sequence[NvSwitchFacts]) -> Fabric:
    devs = tuple(FabricDevice(s.pci_address, "nvswitch", s.device_id, switch_generation(s.device_id),
                              "NVIDIA vendor, PCI class 0x0680") for s in switches)
    gens = sorted({d.name.split(" (")[0] for d in devs})
    return Fabric(
        "nvswitch",
        f"{_plural(len(devs), 'NVSwitch', 'NVSwitches')} on the PCI bus ({', '.join(gens)}: NVIDIA functions of "
        f"class 0x0680 at {', '.join(d.pci_address for d in devs)}), which nv-fabricmanager must route before CUDA "
        "can use the GPUs",
        devs,
        (_fabricmanager("nvidia-fabricmanager of the driver's version: trains the NVLinks and routes the NVSwitches"),
         Companion("nscq", "library", "libnvidia-nscq of the driver's version: how nvidia-smi and DCGM query the "
                                      "NVSwitches")))


def _lpf(root: Root, nic: NicFacts) -> tuple[FabricDevice | None, str | None]:
    """(the device when its VPD names it a switch-tray manager, the VPD path when it exists but is unreadable)."""
    base = f"{PCI}/{nic.pci_address}"
    path = f"{base}/vpd"
    if root.exists(f"{base}/physfn") or not root.exists(path):     # a VF, or no VPD capability
        return None, None
    raw = root.read_bytes(path, 1 << 15)
    if raw is None:
        return None, path
    from driverd.host import vpd
    parsed = vpd.parse(raw)
    if vpd.vendor_fields(parsed).get(SW_MNG[0]) != SW_MNG[1]:
        return None, None
    ib = root.listdir(f"{base}/infiniband")
    name = parsed.identifier or "ConnectX"
    return FabricDevice(nic.pci_address, "switch-tray-manager", nic.device_id, name,
                        f"VPD {SW_MNG[0]}={SW_MNG[1]}", ib[0] if ib else None), None


def _switch_tray(root: Root, lpfs: list[FabricDevice]) -> Fabric:
    from driverd.host.modules import is_loaded, loaded_modules
    proc = loaded_modules(root)
    waiting = tuple(m for m in NVLSM_AFTER if not is_loaded(root, m, proc))
    ibs = [d.ib_device for d in lpfs if d.ib_device]
    return Fabric(
        "nvlink5-switch-tray",
        f"{_plural(len(lpfs), 'ConnectX function')} ({', '.join(d.pci_address for d in lpfs)}"
        f"{'; ' + ', '.join(ibs) if ibs else ''}) {'carries' if len(lpfs) == 1 else 'carry'} "
        f"{SW_MNG[0]}={SW_MNG[1]} in {'its' if len(lpfs) == 1 else 'their'} VPD and no NVSwitch is on "
        "PCI: the NVLink5 switches of this baseboard are managed from the host through them, by NVLSM and the "
        "fabric manager",
        tuple(lpfs),
        (_fabricmanager("nvidia-fabricmanager of the driver's version (nvidia-fabricmanager-start.sh starts NVLSM, "
                        "then nv-fabricmanager, on the LPFs)"),
         Companion("nvlsm", "daemon", "NVLink Subnet Manager (package nvlsm): configures the NVLink5 switches "
                                      "through the LPFs", after_modules=NVLSM_AFTER, waiting_for=waiting)))


def _grace(root: Root, arch: str | None) -> str | None:
    if arch not in (None, "aarch64", "arm64"):
        return None
    soc = root.read_first_line(SOC_ID)
    return f"NVIDIA Grace (soc_id {soc})" if soc == GRACE_SOC_ID else None


def _imex(root: Root, cpu: str, blackwell: list[GpuFacts], channels: tuple[str, ...]) -> Fabric:
    major = char_major(root, IMEX_REGION)
    ch0 = f"{IMEX_CHANNELS}/channel0"
    names = sorted({g.name for g in blackwell})
    have = "" if major is None else f" ({major} now)"
    return Fabric(
        "nvlink5-imex",
        f"{cpu} with {_plural(len(blackwell), 'Blackwell GPU')} ({', '.join(names)}) and no NVSwitch or "
        "switch-tray manager on PCI: an NVL72-class compute tray whose NVLink switch trays are managed off the "
        "node, sharing GPU memory across nodes through IMEX",
        tuple(FabricDevice(g.pci_address, "gpu", g.device_id, g.name, "Blackwell GPU on a Grace CPU")
              for g in blackwell),
        (Companion("imex", "daemon", "nvidia-imex of the driver's version: exports and imports GPU memory between "
                                     "the nodes of the NVLink domain"),
         Companion("imex-channel0", "device", "the IMEX channel workloads open to share memory across nodes",
                   path=ch0, present=ch0 in channels,
                   how="the nvidia module parameter NVreg_CreateImexChannel0=1 (udev makes the node), or mknod -m "
                       f"0666 {ch0} c <major> 0 with the major of {IMEX_REGION} in /proc/devices{have}")),
        cpu=cpu, imex_channels=channels, imex_major=major)


def compute_domains(root: Root) -> str | None:
    """Evidence that NVIDIA's DRA driver's compute-domain kubelet plugin is on this node (None: it is not). Its
    registration socket is the live sign — the kubelet's plugin watcher reads it and the helper removes it when
    the plugin stops —; the plugin's own socket counts too (a plugin that has not registered yet). Its
    directory alone does not: the checkpoint.json in it outlives an uninstall."""
    for name in sorted(root.listdir(KUBELET_REGISTRY)):
        if _CD_REG.match(name):
            return f"the {CD_DRIVER} kubelet plugin is registered: {KUBELET_REGISTRY}/{name}"
    sock = f"{KUBELET_PLUGINS}/{CD_DRIVER}/dra.sock"
    if root.lexists(sock):
        return f"the {CD_DRIVER} kubelet plugin's socket is there: {sock}"
    return None


def read_fabric(root: Root, gpus: Sequence[GpuFacts], switches: Sequence[NvSwitchFacts],
                nics: Sequence[NicFacts], arch: str | None) -> Fabric:
    """The host's fabric from the facts' PCI classification (`pci.classify`) and the kernel's arch. Never
    raises: what cannot be read is named in `unreadable` and the kind says unknown only when it decides."""
    fab = _read_fabric(root, gpus, switches, nics, arch)
    return replace(fab, compute_domains=compute_domains(root)) if gpus else fab


def _read_fabric(root: Root, gpus: Sequence[GpuFacts], switches: Sequence[NvSwitchFacts],
                 nics: Sequence[NicFacts], arch: str | None) -> Fabric:
    if switches:
        return _switches(switches)
    if not gpus:
        return Fabric("none", "no NVIDIA GPU on this host: no GPU fabric to set up")
    channels = tuple(p for _, p in imex_channels(root))
    newer = [g for g in gpus if g.architecture not in gputable.ARCH_ORDER
             or gputable.ARCH_ORDER.index(g.architecture) >= _NEW_ARCH]
    lpfs: list[FabricDevice] = []
    unreadable: list[str] = []
    if newer:
        for nic in nics:
            dev, locked = _lpf(root, nic)
            lpfs += [dev] if dev else []
            unreadable += [locked] if locked else []
    if lpfs:
        return _switch_tray(root, lpfs)
    cpu = _grace(root, arch)
    blackwell = [g for g in gpus if g.architecture == "Blackwell"]
    if cpu and blackwell:
        return _imex(root, cpu, blackwell, channels)
    if unreadable:
        why = (f"the VPD of {_plural(len(unreadable), 'ConnectX function')} could not be read "
               f"({', '.join(unreadable)}: root's only, or the device did not answer): cannot tell whether this "
               "host manages NVLink5 switch trays")
        return Fabric("unknown", why, cpu=cpu, imex_channels=channels, unreadable=tuple(unreadable))
    checked = f", no ConnectX function with {SW_MNG[0]}={SW_MNG[1]} in its VPD" if newer and nics else ""
    grace = f" ({cpu}: NVLink-C2C to its own GPU only)" if cpu else ""
    return Fabric("none", f"{_plural(len(gpus), 'GPU')}{grace}, no NVSwitch on PCI{checked}: the GPUs talk over "
                          "PCIe or NVLink bridges, no fabric daemon is needed", cpu=cpu, imex_channels=channels)
