"""Who holds the NVIDIA modules: other modules (holders/refcounts from /sys/module), processes with
/dev/nvidia* (or a GPU's /dev/vfio/<group>) open or the CUDA/NVML libraries mapped, each mapped back
to its container and pod where the cgroup path and the runtime's bundle say so. References that no
visible holder explains are reported too (e.g. a console on nvidia_drm, another PID namespace)."""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, field

from driverd.datatypes import dataclass
from driverd.host.processes import container_of
from driverd.root import Root

NVIDIA_FAMILY = ("nvidia_peermem", "nvidia_drm", "nvidia_modeset", "nvidia_uvm", "nvidia")
# Modules from outside the driver package that attach to it; they are holders to report.
KNOWN_FOREIGN = {"gdrdrv": "GPUDirect RDMA copy (gdrcopy)", "nvidia_fs": "GPUDirect Storage",
                 "nv_peer_mem": "legacy Mellanox peer memory", "nvidia_vgpu_vfio": "vGPU mediated devices"}
GPU_LIBS = re.compile(r"/(libcuda\.so|libnvidia-ml\.so|libnvidia-[\w-]+\.so|libnvcuvid\.so)[\w.]*$")
_BUNDLES = (  # runtime bundle configs whose OCI annotations name the pod
    "/run/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
    "/run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io/{id}/config.json",
    "/run/containers/storage/overlay-containers/{id}/userdata/config.json",
)
_POD_KEYS = (("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.container-name"),
             ("io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.container.name"))


@dataclass(frozen=True)
class ProcessHolder:
    """A process that holds the NVIDIA modules, mapped back to its container and pod where known."""
    pid: int
    comm: str
    cmdline: str
    uses: tuple[str, ...]                 # /dev/nvidia0, libcuda.so.1, /dev/vfio/12
    container_id: str | None = None
    pod_uid: str | None = None
    pod: str | None = None                # namespace/name when known
    container: str | None = None

    def describe(self) -> str:
        where = ""
        if self.pod or self.pod_uid:
            where = f", pod {self.pod or self.pod_uid}" + (f" container {self.container}" if self.container else "")
        elif self.container_id:
            where = f", container {self.container_id[:12]}"
        cmd = self.cmdline or self.comm
        return f"pid {self.pid} ({cmd[:60]}{where}) using {', '.join(self.uses[:3])}"


@dataclass(frozen=True)
class ModuleHolder:
    """A loaded module that holds one of the NVIDIA modules."""
    module: str                            # the holder
    holds: str                             # the NVIDIA module it holds
    foreign: bool                          # not part of the driver package
    what: str = ""


@dataclass
class Holders:
    """Everything that holds the NVIDIA modules: modules, processes and references nothing visible explains."""
    modules: list[ModuleHolder] = field(default_factory=list)
    processes: list[ProcessHolder] = field(default_factory=list)
    unexplained: dict[str, int] = field(default_factory=dict)   # module -> references nobody visible explains

    @property
    def blocking(self) -> bool:
        return bool(self.processes or any(m.foreign for m in self.modules) or self.unexplained)

    def describe(self) -> str:
        parts = [p.describe() for p in self.processes]
        parts += [f"module {m.module} holds {m.holds}" + (f" ({m.what})" if m.what else "")
                  for m in self.modules if m.foreign]
        parts += [f"{n} reference(s) on {m} held by nothing driverd can see (a console/framebuffer on "
                  f"nvidia_drm, or a process in another PID namespace)" for m, n in self.unexplained.items()]
        return "; ".join(parts)

    def to_json(self) -> dict:
        return {"modules": [asdict(m) for m in self.modules], "processes": [asdict(p) for p in self.processes],
                "unexplained": self.unexplained}


def _pod_of(root: Root, pid: int, container_id: str | None) -> tuple[str | None, str | None]:
    if container_id:
        for tmpl in _BUNDLES:
            text = root.read_text(tmpl.format(id=container_id))
            if not text:
                continue
            try:
                ann = json.loads(text).get("annotations", {}) or {}
            except ValueError:
                continue
            for ns_k, name_k, ctr_k in _POD_KEYS:
                if name_k in ann:
                    return f"{ann.get(ns_k, 'default')}/{ann[name_k]}", ann.get(ctr_k)
    env = root.read_bytes(f"/proc/{pid}/environ") or b""
    for item in env.split(b"\0"):
        if item.startswith(b"HOSTNAME="):     # a pod's hostname is its name unless spec.hostname says otherwise
            return item[9:].decode(errors="replace") or None, None
    return None, None


def gpu_vfio_groups(root: Root) -> set[str]:
    from driverd.host.pci import NVIDIA, PCI_DEVICES
    out = set()
    for addr in root.listdir(PCI_DEVICES):
        if (root.read_first_line(f"{PCI_DEVICES}/{addr}/vendor") or "").lower() == NVIDIA:
            link = root.readlink(f"{PCI_DEVICES}/{addr}/iommu_group")
            if link:
                out.add(os.path.basename(link))
    return out


def _maps(root: Root, pid: int) -> list[str]:
    if root.is_live():
        try:
            import psutil
            return [m.path for m in psutil.Process(pid).memory_maps(grouped=True)]
        except Exception:   # psutil raises several types for vanished / foreign processes
            pass
    return [ln.split(None, 5)[5] for ln in (root.read_text(f"/proc/{pid}/maps", 16 << 20) or "").splitlines()
            if len(ln.split(None, 5)) == 6]


def _pids(root: Root) -> list[int]:
    if root.is_live():
        try:
            import psutil
            return sorted(psutil.pids())
        except ImportError:
            pass
    return sorted(int(p) for p in root.listdir("/proc") if p.isdigit())


def process_holders(root: Root, exclude: set[int] = frozenset()) -> list[ProcessHolder]:
    vfio = gpu_vfio_groups(root)
    me = os.getpid() if root.is_live() else -1
    out = []
    for pid in _pids(root):
        if pid in exclude or pid == me:
            continue
        uses = {t for t in root.link_targets(f"/proc/{pid}/fd").values()
                if t.startswith("/dev/nvidia") or (t.startswith("/dev/vfio/") and os.path.basename(t) in vfio)}
        for path in _maps(root, pid):
            m = GPU_LIBS.search(path)
            if m:
                uses.add(os.path.basename(path))
        if not uses:
            continue
        comm = root.read_first_line(f"/proc/{pid}/comm") or "?"
        cmd = (root.read_text(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()
        ctr, pod_uid = container_of(root.read_text(f"/proc/{pid}/cgroup") or "")
        pod, cname = _pod_of(root, pid, ctr) if (ctr or pod_uid) else (None, None)
        out.append(ProcessHolder(pid, comm, cmd, tuple(sorted(uses)), ctr, pod_uid, pod, cname))
    return out


def find_holders(kernel, exclude_pids: set[int] = frozenset()) -> Holders:
    """Everything that keeps the NVIDIA modules from being removed right now."""
    mods = kernel.modules(NVIDIA_FAMILY)
    h = Holders()
    family = [m for m in NVIDIA_FAMILY if m in mods]
    for name in family:
        for holder in mods[name].holders:
            h.modules.append(ModuleHolder(holder, name, holder not in NVIDIA_FAMILY, KNOWN_FOREIGN.get(holder, "")))
    h.processes = process_holders(kernel.root, exclude_pids) if family else []
    opens: dict[str, int] = {}
    for p in h.processes:
        for u in p.uses:
            owner = _owner(u)
            if owner:
                opens[owner] = opens.get(owner, 0) + 1
    for name in family:
        m = mods[name]
        if m.refcount is None:
            continue
        extra = m.refcount - len(m.holders) - opens.get(name, 0)
        if extra > 0 and not any(p for p in h.processes if any(_owner(u) == name for u in p.uses)):
            h.unexplained[name] = extra
    return h


def device_owner(dev: str) -> str | None:
    """Which module a character device belongs to (its open files pin that module)."""
    if dev.startswith("/dev/nvidia-uvm"):
        return "nvidia_uvm"
    if dev == "/dev/nvidia-modeset":
        return "nvidia_modeset"
    if re.match(r"^/dev/nvidia(ctl|\d+|-caps/.*|-nvswitch.*)$", dev):
        return "nvidia"
    return None


_owner = device_owner
