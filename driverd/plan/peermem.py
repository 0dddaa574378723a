"""GPUDirect RDMA: load nvidia-peermem only where the kernel can load it and the host needs it.

NVIDIA's GPUDirect RDMA documentation: nvidia-peermem registers with the peer-memory API
(`ib_register_peer_memory_client`) of MLNX_OFED's ib_core; the inbox ib_core of kernel.org and
distribution kernels has no such API, so there `modprobe nvidia-peermem` fails with "Unknown
symbol". With the open kernel modules on Linux >= 5.12, GPUDirect RDMA goes through DMA-BUF
(ib_umem_dmabuf), the recommended path, and needs no extra module.

`modules.load_peermem`:
- auto: no Mellanox NIC -> no; loaded with the running driver -> keep it (an upgrade loads the same
  set); open flavour on kernel >= 5.12 -> no (DMA-BUF); MLNX_OFED's peer-memory API present -> yes;
  absent or unknown -> no, with a warning naming what GPUDirect RDMA would need.
- true: yes, unless the API is known to be absent: then the plan is blocked (the load would fail).
- false: no.
A pure function of the facts: every answer carries its reason.
"""
from __future__ import annotations

import re

from driverd.datatypes import dataclass

DMABUF_KERNEL = (5, 12)


@dataclass(frozen=True)
class PeermemDecision:
    """Whether to load nvidia-peermem on this host, and why (or what blocks it)."""
    load: bool
    reason: str
    blocked: str | None = None
    warning: str | None = None


def kernel_version(release: str | None) -> tuple[int, int] | None:
    m = re.match(r"^(\d+)\.(\d+)", release or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def decide_peermem(setting: str, nics: int, rdma, flavor: str | None, release: str | None,
                   was_loaded: bool = False) -> PeermemDecision:
    """`rdma`: driverd.host.rdma.RdmaFacts or None (no Mellanox NIC, so not read)."""
    api = rdma.peer_memory_api if rdma is not None else None
    why_api = rdma.evidence if rdma is not None else "RDMA facts not read"
    ofed = f"MLNX_OFED {rdma.ofed_version}" if rdma is not None and rdma.ofed_version else "MLNX_OFED"
    kv = kernel_version(release)
    dmabuf = flavor == "open" and kv is not None and kv >= DMABUF_KERNEL
    if setting == "false":
        return PeermemDecision(False, "modules.load_peermem = false")
    if setting == "true":
        if api is False:
            return PeermemDecision(False, "modules.load_peermem = true",
                                   blocked=f"modules.load_peermem = true, but {why_api}: nvidia-peermem would fail to "
                                           "load with 'Unknown symbol ib_register_peer_memory_client'; install "
                                           "MLNX_OFED/DOCA-OFED for this kernel or set modules.load_peermem = auto"
                                           + (" (the open modules on this kernel use DMA-BUF instead)" if dmabuf else ""))
        return PeermemDecision(True, "modules.load_peermem = true" + ("" if api else f" ({why_api}; not confirmed)"))
    if not nics:
        return PeermemDecision(False, "no Mellanox NIC: GPUDirect RDMA has nothing to pair with")
    if was_loaded and api is not False:
        return PeermemDecision(True, "nvidia-peermem was loaded with the running driver; the new one loads the same set")
    if dmabuf:
        return PeermemDecision(False, f"the open modules on kernel {release} (>= {DMABUF_KERNEL[0]}.{DMABUF_KERNEL[1]}) do "
                                      "GPUDirect RDMA through DMA-BUF, which needs no extra module")
    if api is True:
        return PeermemDecision(True, f"{ofed} provides the peer-memory API ({why_api}); GPUDirect RDMA with the "
                                     f"{flavor or 'chosen'} modules needs nvidia-peermem")
    need = ("install MLNX_OFED/DOCA-OFED for this kernel"
            + (", or use the open modules (kernel >= 5.12: DMA-BUF)" if flavor != "open" and kv and kv >= DMABUF_KERNEL
               else ""))
    if api is False:
        return PeermemDecision(False, f"not loaded: {why_api}; nvidia-peermem would fail with 'Unknown symbol'",
                               warning=f"GPUDirect RDMA is unavailable with the {flavor or 'chosen'} modules on this "
                                       f"host: {why_api}; {need}")
    return PeermemDecision(False, f"not loaded: no evidence of MLNX_OFED's peer-memory API ({why_api})",
                           warning=f"GPUDirect RDMA: cannot tell whether nvidia-peermem could load ({why_api}); "
                                   f"not loaded; {need}, or set modules.load_peermem = true")
