"""Facts: one immutable, JSON-serialisable snapshot of a host. Reading facts never changes anything."""
from __future__ import annotations

from dataclasses import asdict, field

from driverd.datatypes import dataclass
from driverd.host.keyrings import KeyringFacts
from driverd.host.ownership import OwnershipFacts
from driverd.host.rdma import RdmaFacts
# Facts.runtimes' element type; each runtime of driverd.runtime's registry detects its own.
from driverd.runtime.model import RuntimeFacts  # noqa: F401

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class KernelFacts:
    """The running kernel: its release, module support, signature and unload rules, headers."""
    release: str | None
    version: str | None                     # the full /proc/version line
    arch: str | None
    cmdline: str
    modules_supported: bool                 # False when the kernel has no loadable-module support
    module_signature_enforced: bool
    signature_enforcement_sources: tuple[str, ...]   # which evidence says so
    lockdown: str | None                    # none | integrity | confidentiality | None (no LSM file)
    secure_boot: str                        # enabled | disabled | setup-mode | not-efi | unknown
    module_unload_supported: bool
    module_unload_evidence: str
    headers_present: bool
    headers_path: str | None                # where /lib/modules/<release>/build resolves on the host
    config_source: str | None               # /boot/config-<release> or /proc/config.gz


@dataclass(frozen=True)
class OsFacts:
    """The distribution, as /etc/os-release names it."""
    id: str
    version_id: str | None
    id_like: tuple[str, ...] = ()
    pretty_name: str | None = None
    version_codename: str | None = None
    source: str | None = None


@dataclass(frozen=True)
class GpuFacts:
    """One NVIDIA GPU on the PCI bus, with what NVIDIA's lists say of its model."""
    pci_address: str
    vendor_id: str
    device_id: str
    subsystem_vendor_id: str | None
    subsystem_device_id: str | None
    class_code: str
    numa_node: int | None
    bound_driver: str | None
    name: str
    architecture: str                       # "unknown" for device ids missing from the table
    chip: str | None
    open_module_support: str                # required | supported | unsupported | unknown (driverd/host/gputable.py)
    min_branch: int | None                  # first branch that NVIDIA's lists (as shipped in the table) name it in
    last_branch: int | None                 # NVIDIA's legacy branch for it (e.g. 470): later branches refuse it
    known: bool
    uuid: str | None = None                 # from /proc/driver/nvidia/gpus/<addr>/information
    minor: int | None = None                # /dev/nvidia<minor>


@dataclass(frozen=True)
class NvSwitchFacts:
    """One NVSwitch on the PCI bus."""
    pci_address: str
    device_id: str
    name: str
    bound_driver: str | None


@dataclass(frozen=True)
class NicFacts:
    """One Mellanox (NVIDIA networking) NIC on the PCI bus, with its network interfaces."""
    pci_address: str
    vendor_id: str
    device_id: str
    class_code: str
    bound_driver: str | None
    netdevs: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModuleFacts:
    """One loaded kernel module of the driver, as /sys/module shows it."""
    name: str
    size: int | None
    refcount: int | None                    # None when the kernel cannot unload modules
    holders: tuple[str, ...]                # modules using this one (/sys/module/<m>/holders)
    state: str | None                       # Live | Loading | Unloading
    taints: str
    version: str | None
    srcversion: str | None
    permanent: bool = False


@dataclass(frozen=True)
class NouveauFacts:
    """Whether nouveau is loaded, holds GPUs, and what blacklists it."""
    loaded: bool
    refcount: int | None
    holders: tuple[str, ...]
    bound_devices: tuple[str, ...]
    blacklisted: bool
    blacklist_sources: tuple[str, ...]      # files / cmdline entries that blacklist it
    modeset_disabled: bool                  # options nouveau modeset=0 or nouveau.modeset=0


@dataclass(frozen=True)
class InstalledPackage:
    """A driver package driverd installed for a kernel, as its records say."""
    kernel_release: str
    driver_version: str
    flavor: str
    sha256: str | None
    path: str


@dataclass(frozen=True)
class DriverFacts:
    """The NVIDIA kernel driver: whether and which is loaded, its modules, driverd's installed packages."""
    loaded: bool
    version: str | None
    flavor: str | None                      # open | proprietary
    version_line: str | None
    modules: tuple[ModuleFacts, ...]
    installed: tuple[InstalledPackage, ...] = ()


@dataclass(frozen=True)
class GpuUser:
    """A process that holds a GPU device node open."""
    pid: int
    comm: str                       # its name: /proc/PID/comm, completed when the kernel cut it (processes.process_name)
    cmdline: str
    devices: tuple[str, ...]
    container_id: str | None = None
    pod_uid: str | None = None


@dataclass(frozen=True)
class DaemonFacts:
    """A GPU daemon (persistenced, fabric manager, ...) and whether it runs."""
    name: str
    running: bool
    pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as NVML reports it."""
    index: int
    name: str
    uuid: str
    pci_bus_id: str
    memory_total_mib: int | None
    persistence_mode: bool | None
    mig_mode_current: bool | None
    mig_mode_pending: bool | None


@dataclass(frozen=True)
class NvmlFacts:
    """NVML's report of the live host, or why there is none."""
    available: bool
    reason: str | None                      # why not, when unavailable
    source: str | None = None               # live | capture
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    devices: tuple[NvmlDevice, ...] = ()


@dataclass(frozen=True)
class FabricDevice:
    """A device that makes up the GPU fabric (an NVSwitch, a switch tray's manager, a GPU)."""
    pci_address: str
    role: str                        # nvswitch | switch-tray-manager (a ConnectX LPF) | gpu
    device_id: str
    name: str
    evidence: str                    # what makes it one
    ib_device: str | None = None     # the RDMA device of an LPF (mlx5_N): what FM and NVLSM are pointed at


@dataclass(frozen=True)
class Companion:
    """Something beside the driver that the fabric needs, of the driver's exact version where it is NVIDIA's."""
    name: str                        # fabricmanager | nscq | nvlsm | imex | imex-channel0
    kind: str                        # daemon | library | device
    detail: str                      # what it is and does, one phrase
    after_modules: tuple[str, ...] = ()   # kernel modules that must be live before it starts
    waiting_for: tuple[str, ...] = ()     # those of after_modules not loaded now
    path: str | None = None          # a device node's path
    present: bool | None = None      # a device node: there now (None for daemons and libraries)
    how: str | None = None           # how a missing device node is made


@dataclass(frozen=True)
class Fabric:
    """Which GPU fabric the host has (driverd.host.fabric reads it; its docstring has the kinds and sources)."""
    kind: str                        # none | nvswitch | nvlink5-switch-tray | nvlink5-imex | unknown
    why: str                         # one sentence naming the evidence
    devices: tuple[FabricDevice, ...] = ()
    wants: tuple[Companion, ...] = ()
    cpu: str | None = None           # "NVIDIA Grace (soc_id jep106:036b:0241)" when seen
    imex_channels: tuple[str, ...] = ()   # /dev/nvidia-caps-imex-channels/channel<N> present
    imex_major: int | None = None    # /proc/devices' nvidia-caps-imex-channels, while the driver has it
    unreadable: tuple[str, ...] = ()      # evidence that exists but could not be read (root only)
    # NVIDIA's DRA driver's compute-domain kubelet plugin on this node, which runs IMEX itself for
    # ComputeDomains (driverd.host.fabric.compute_domains): the evidence, None when it is not here
    compute_domains: str | None = None

    def want(self, name: str) -> Companion | None:
        return next((c for c in self.wants if c.name == name), None)


@dataclass(frozen=True)
class Facts:
    """Everything driverd reads of one host at one moment; what plan decides from and detect prints."""
    root: str
    hostname: str | None
    kernel: KernelFacts
    os: OsFacts
    gpus: tuple[GpuFacts, ...]
    nvswitches: tuple[NvSwitchFacts, ...]
    mellanox_nics: tuple[NicFacts, ...]
    nouveau: NouveauFacts
    driver: DriverFacts
    gpu_users: tuple[GpuUser, ...]
    daemons: tuple[DaemonFacts, ...]
    runtimes: tuple[RuntimeFacts, ...]
    nvml: NvmlFacts
    warnings: tuple[str, ...] = field(default=())
    schema_version: int = SCHEMA_VERSION
    keyrings: KeyringFacts | None = None    # the kernel's trusted keyrings (driverd.host.keyrings)
    rdma: RdmaFacts | None = None           # GPUDirect RDMA: MLNX_OFED peer-memory API (driverd.host.rdma); None without a Mellanox NIC
    driver_owner: OwnershipFacts | None = None   # who owns the installed driver (driverd.host.ownership)
    # the driver's user-space (driverd.driver.files) and, with a loaded driver, what the file-only half of the
    # workload check says of it ("problems": e.g. its version is not the loaded module's)
    userspace: dict | None = None
    # which GPU fabric the host has and why, and the companions it needs (driverd.host.fabric); None only in
    # facts made by hand. `nvswitches` stays the PCI list the planner reads.
    fabric: Fabric | None = None

    def to_json(self) -> dict:
        return asdict(self)

    def daemon(self, name: str) -> DaemonFacts | None:
        return next((d for d in self.daemons if d.name == name), None)
