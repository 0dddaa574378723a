"""MIG across a reload. Unloading the driver destroys every GPU and compute instance (MIG *mode*
persists on the GPU). Before unloading, each GPU's mode and instance layout is recorded; after
loading it is re-created, or the report says exactly which GPUs must be re-partitioned and with what,
so GPUs are never left silently un-partitioned.

Backends: NVML (pynvml) on a live host; the simulated GPUs of a sim tree.
"""
from __future__ import annotations

from dataclasses import asdict, field

from driverd.datatypes import dataclass


MIG_PARTED_CONFIG = "/etc/nvidia-mig-manager/config.yaml"


@dataclass(frozen=True)
class ComputeInstance:
    """One MIG compute instance of a GPU instance, by its profile."""
    profile_id: int


@dataclass(frozen=True)
class GpuInstance:
    """One MIG GPU instance as recorded before an unload, with its compute instances."""
    profile_id: int
    placement_start: int
    placement_size: int
    compute_instances: tuple[ComputeInstance, ...] = ()


@dataclass(frozen=True)
class GpuMig:
    """One GPU's MIG layout as read before an unload, to be restored after the reload."""
    pci_address: str
    mode: bool
    gpu_instances: tuple[GpuInstance, ...] = ()

    @classmethod
    def from_json(cls, d: dict) -> "GpuMig":
        return cls(d["pci_address"], bool(d["mode"]), tuple(
            GpuInstance(g["profile_id"], g["placement_start"], g["placement_size"],
                        tuple(ComputeInstance(c["profile_id"]) for c in g.get("compute_instances", ())))
            for g in d.get("gpu_instances", ())))


@dataclass
class MigRestore:
    """What re-creating the recorded MIG layouts after a load did, and what is left to the operator."""
    restored: list[str] = field(default_factory=list)          # GPUs whose layout was re-created
    must_reapply: list[str] = field(default_factory=list)      # what the operator must do, per GPU

    def to_json(self) -> dict:
        return asdict(self)


class NvmlMig:
    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def read(self) -> list[GpuMig] | None:
        if not self.kernel.root.is_live():     # NVML answers for this machine, not a captured tree
            return None
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception:
            return None
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                bus = pynvml.nvmlDeviceGetPciInfo(h).busId
                bus = (bus.decode() if isinstance(bus, bytes) else bus).lower()[-12:]
                try:
                    cur, _pending = pynvml.nvmlDeviceGetMigMode(h)
                except pynvml.NVMLError:
                    out.append(GpuMig(bus, False))
                    continue
                gis = []
                if cur:
                    for pid in range(getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 8)):
                        try:
                            prof = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, pid)
                            insts = pynvml.nvmlDeviceGetGpuInstances(h, prof.id)
                        except pynvml.NVMLError:
                            continue
                        for gi in insts:
                            info = pynvml.nvmlGpuInstanceGetInfo(gi)
                            cis = []
                            for cpid in range(getattr(pynvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 8)):
                                try:
                                    cprof = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, cpid, 0)
                                    cis += [ComputeInstance(cprof.id)] * len(
                                        pynvml.nvmlGpuInstanceGetComputeInstances(gi, cprof.id))
                                except pynvml.NVMLError:
                                    continue
                            gis.append(GpuInstance(prof.id, info.placement.start, info.placement.size, tuple(cis)))
                out.append(GpuMig(bus, bool(cur), tuple(gis)))
            return out
        except pynvml.NVMLError:
            return None
        finally:
            pynvml.nvmlShutdown()

    def create(self, gpu: GpuMig) -> None:
        import pynvml
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByPciBusId(gpu.pci_address.encode())
            for g in gpu.gpu_instances:
                placement = pynvml.c_nvmlGpuInstancePlacement_t()
                placement.start, placement.size = g.placement_start, g.placement_size
                gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(h, g.profile_id, placement)
                for c in g.compute_instances:
                    pynvml.nvmlGpuInstanceCreateComputeInstance(gi, c.profile_id)
        finally:
            pynvml.nvmlShutdown()


def backend(kernel):
    from driverd import backends
    return backends.MIG.get(kernel.name, NvmlMig)(kernel)


def record(kernel) -> list[dict] | None:
    """Each GPU's MIG mode and layout now, or None when it cannot be read (no NVML / no driver)."""
    layout = backend(kernel).read()
    return None if layout is None else [asdict(g) for g in layout]


def restore(kernel, recorded: list[dict] | None) -> MigRestore:
    out = MigRestore()
    if not recorded:
        return out
    be = backend(kernel)
    now = {g.pci_address: g for g in (be.read() or [])}
    for d in recorded:
        want = GpuMig.from_json(d)
        if not want.mode or not want.gpu_instances:
            continue
        have = now.get(want.pci_address)
        if have is not None and have.gpu_instances == want.gpu_instances:
            out.restored.append(want.pci_address)         # already there (idempotent)
            continue
        if have is None or not have.mode:
            out.must_reapply.append(f"{want.pci_address}: MIG mode is off after the reload; enable it "
                                    f"(nvidia-smi -i {want.pci_address} -mig 1) and re-apply the layout "
                                    f"(nvidia-mig-parted apply -f {MIG_PARTED_CONFIG}, or the GPU operator's MIG manager)")
            continue
        try:
            be.create(want)
            out.restored.append(want.pci_address)
        except Exception as e:   # NVML errors are many; each becomes an instruction, never silence
            out.must_reapply.append(f"{want.pci_address}: re-creating {len(want.gpu_instances)} GPU instance(s) "
                                    f"failed ({e}); re-apply with nvidia-mig-parted apply -f {MIG_PARTED_CONFIG}")
    return out
