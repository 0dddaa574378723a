"""Read-only host facts. `collect(root)` returns one immutable snapshot; nothing is changed."""
from __future__ import annotations

# Nothing is imported here at module level: driverd.host.cudaprobe and driverd.host.nvml, the children of the
# workload check and of NVML's report, are modules of this package and pay for every import of it (the facts'
# classes alone are ~50 ms; typing itself ~18 ms on a GPU host, hence not typing.TYPE_CHECKING).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from driverd.host.facts import Facts
    from driverd.host.forked import Forked
    from driverd.host.nvml import Asked
    from driverd.root import Root


def collect(root: Root, *, nvml: bool = True, handler: str = "nvidia",
            binary: str | None = None, driver_root: str | None = None) -> Facts:
    """`handler` and `binary`: runtime.handler and runtime.binary (default the toolkit's
    /usr/bin/nvidia-container-runtime), whose needs each runtime reports; `driver_root`:
    validation.driver_root, where the driver's user-space is looked for first."""
    early = _nvml_early(root) if nvml else None       # first: NVML's start overlaps every read below
    reading = _procs_early(root)                      # so does the pass over every process
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
    users, daemons = processes.scan(root, users=drv.loaded, skip=(early.pid,) if early is not None else (),
                                    seen=_seen(reading))
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
    sum. The child start_early() started for this command when there is one. None elsewhere
    (read_nvml says why)."""
    if not root.is_live():
        return None
    asked = _started.take("nvml")
    if asked is not None or not _driver_loaded():
        return asked
    from driverd.host.nvml import start_child
    return start_child()


def _driver_loaded() -> bool:
    """Whether NVML may be asked on this live host: only while the driver is loaded (its version file is
    there), as NVML would otherwise try to load it."""
    import os
    from driverd.driver.ident import VERSION_FILE
    return os.path.exists(VERSION_FILE)


class _Started:
    """The children start_early() started, until collect() takes them or the command's release dismisses
    them: NVML's report, and the pass over every process (host/processes.py)."""
    nvml: Asked | None = None
    reading: Forked | None = None

    def take(self, which: str):
        child = getattr(self, which)
        setattr(self, which, None)
        return child

    def dismiss(self) -> None:
        for which in ("nvml", "reading"):
            child = self.take(which)
            if child is not None:
                child.dismiss()


_started = _Started()


def start_early(base: str, nvml: bool = True):
    """The children of a command that will collect the live host's facts (`detect`), started now, before
    it has read its configuration or imported the facts' modules: NVML's report (with `nvml`, where the
    driver is loaded) and the pass over every process. On a GPU host the child's pynvml import and
    nvmlInit take as long as everything this process does before its reads, and were on its path once the
    reads began; the pass reads every process's open files, tens of thousands on a busy node (issue 47).
    Only for the live root itself (--root /, the default); elsewhere nothing starts and collect() decides
    as before.

    Called again once children run (the console script starts them before the command line is read,
    driverd/__main__.py), it keeps those that are what this call asks for and dismisses the others.

    Returns the release to call once the command is over (None when nothing runs): a child whose
    answer went unused (the command failed first) is killed and reaped there, so that none is left behind
    and a hung call does not hold the failed command's exit."""
    import os
    live = os.path.abspath(base) == "/"
    if _started.nvml is not None or _started.reading is not None:
        if not live:
            _started.dismiss()
        elif not nvml and _started.nvml is not None:
            _started.take("nvml").dismiss()
        return _started.dismiss if _started.nvml is not None or _started.reading is not None else None
    if not live:
        return None
    if nvml and _driver_loaded():
        from driverd.host.nvml import start_child
        _started.nvml = start_child()
    _started.reading = _start_reading("/")
    return _started.dismiss if _started.nvml is not None or _started.reading is not None else None


def _procs_early(root: Root) -> Forked | None:
    """The pass over every process, in a child started before anything else is read (a live root, a
    process that may fork): the child start_early() started for this command when there is one. None
    elsewhere: collect() reads in this process (processes.scan)."""
    if not root.is_live():
        return None
    reading = _started.take("reading")
    return reading if reading is not None else _start_reading(root.base)


def _start_reading(base: str) -> Forked | None:
    from driverd.host import forked
    if not forked.can_fork():
        return None
    try:
        return forked.fork(lambda: _read_all(base))
    except OSError:
        return None                             # read in this process instead


def _read_all(base: str) -> dict:
    """In the child: the pass over every process but the child itself."""
    import os

    from driverd.host import processes
    from driverd.root import Root
    return processes.read_all(Root(base), but=os.getpid())


def _seen(reading: Forked | None) -> dict | None:
    """The child's pass (pid -> what it kept), None where there is none or it failed: collect() then
    reads in this process, and nothing is lost."""
    if reading is None:
        return None
    from driverd.host.procscan import answer_of
    return answer_of(reading, _comm_and_devices)


def _comm_and_devices(kept) -> tuple:
    comm, devices = kept            # what processes.read_all keeps of a process; else not the pass's answer
    return comm, devices


def _userspace(workload, root: Root, loaded: str | None, driver_root: str | None) -> dict:
    us, problems = workload.quick(root, loaded, driver_root)
    return {**us.to_json(), "problems": problems}
