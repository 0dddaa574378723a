"""Read-only host facts. `collect(root)` returns one immutable snapshot; nothing is changed."""
from __future__ import annotations

# Nothing is imported here at module level: driverd.host.cudaprobe and driverd.host.nvml, the children of the
# workload check and of NVML's report, are modules of this package and pay for every import of it (the facts'
# classes alone are ~50 ms; typing itself ~18 ms on a GPU host, hence not typing.TYPE_CHECKING).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from driverd.host.facts import Facts
    from driverd.host.nvml import Asked
    from driverd.root import Root


def collect(root: Root, *, nvml: bool = True, handler: str = "nvidia",
            binary: str | None = None, driver_root: str | None = None) -> Facts:
    """`handler` and `binary`: runtime.handler and runtime.binary (default the toolkit's
    /usr/bin/nvidia-container-runtime), whose needs each runtime reports; `driver_root`:
    validation.driver_root, where the driver's user-space is looked for first."""
    early = _nvml_early(root) if nvml else None       # first: NVML's start overlaps every read below
    from driverd.host import runtimes
    versions = runtimes.start(root)                   # so do the runtime binaries' --version runs
    from driverd.host.facts import Facts
    from driverd.runtime.model import DEFAULT_BINARY
    binary = binary or DEFAULT_BINARY
    from driverd.host import kernel, keyrings, modules, nouveau, osrelease, ownership, pci, processes, rdma
    from driverd.host import fabric, workload
    from driverd.host.facts import NvmlFacts
    from driverd.host.nvml import read_nvml

    warnings: list[str] = []
    k = kernel.read_kernel(root, warnings)
    o = osrelease.read_os(root, warnings)
    gpus, switches, nics = pci.classify(root, pci.scan(root, warnings), warnings)
    drv = modules.read_driver(root, k.release, warnings)
    nv = nouveau.read_nouveau(root, [g.pci_address for g in gpus])
    users, daemons = processes.scan(root, users=drv.loaded, skip=(early.pid,) if early is not None else ())
    hostname = root.read_first_line("/proc/sys/kernel/hostname") or None
    if hostname is not None and (len(hostname) > 64 or not hostname.isprintable()):
        warnings.append("/proc/sys/kernel/hostname is garbled; ignored")
        hostname = None
    if not nvml:
        nvml_facts = NvmlFacts(False, "NVML disabled (--no-nvml)")
    else:
        asked = early() if early is not None else None      # collected even when unused: no child left behind
        nvml_facts = asked if asked is not None and drv.loaded else read_nvml(root, drv.loaded)
    return Facts(
        root=root.base, hostname=hostname,
        kernel=k, os=o, gpus=tuple(gpus), nvswitches=tuple(switches), mellanox_nics=tuple(nics), nouveau=nv,
        driver=drv, gpu_users=tuple(users), daemons=tuple(daemons),
        runtimes=tuple(runtimes.read_runtimes(root, handler, binary, versions)),
        nvml=nvml_facts,
        warnings=tuple(warnings), keyrings=keyrings.read_keyrings(root),
        rdma=rdma.read_rdma(root, k.release, modules.loaded_modules(root)) if nics else None,
        driver_owner=ownership.read_ownership(root, k.release, (drv.version, drv.flavor) if drv.loaded else None),
        userspace=_userspace(workload, root, drv.version if drv.loaded else None, driver_root),
        fabric=fabric.read_fabric(root, gpus, switches, nics, k.arch))


def _nvml_early(root: Root):
    """NVML's report, asked of a child started before anything else is read, where it will be asked for (a
    live root with a loaded driver): pynvml's import, nvmlInit and the queries then run on another core
    while this process imports and reads, and `detect` costs what the slower of the two does, not their
    sum. The child ask_nvml_early() started for this command when there is one. None elsewhere
    (read_nvml says why)."""
    global _asked
    if not root.is_live():
        return None
    if _asked is not None:
        asked, _asked = _asked, None
        return asked
    if not _driver_loaded():
        return None
    from driverd.host.nvml import start_child
    return start_child()


def _driver_loaded() -> bool:
    """Whether NVML may be asked on this live host: only while the driver is loaded (its version file is
    there), as NVML would otherwise try to load it."""
    import os
    from driverd.driver.ident import VERSION_FILE
    return os.path.exists(VERSION_FILE)


# The child ask_nvml_early() started, until collect() takes it or the command's release dismisses it.
_asked: Asked | None = None


def ask_nvml_early(base: str):
    """NVML's child, started now for a command that will collect the live host's facts with NVML
    (`detect`), before that command has read its configuration or imported the facts' modules: on a GPU
    host the child's pynvml import and nvmlInit take as long as everything this process does before its
    reads, and were on its path once the reads began (issue 47). Only for the live root itself (--root /,
    the default) with the driver loaded; elsewhere nothing starts and collect() decides as before.

    Returns the release to call once the command is over (None when nothing started): a child whose
    report went unused (the command failed first) is killed and reaped there, so that none is left behind
    and a hung NVML call does not hold the failed command's exit."""
    import os
    global _asked
    if _asked is not None or os.path.abspath(base) != "/" or not _driver_loaded():
        return None
    from driverd.host.nvml import start_child
    _asked = start_child()
    return _release_early


def _release_early() -> None:
    global _asked
    asked, _asked = _asked, None
    if asked is not None:
        asked.dismiss()


def _userspace(workload, root: Root, loaded: str | None, driver_root: str | None) -> dict:
    us, problems = workload.quick(root, loaded, driver_root)
    return {**us.to_json(), "problems": problems}
