"""Processes that matter to a driver change: GPU users (open /dev/nvidia* files) and GPU daemons.

Read from <root>/proc so that the driver container (root=/host with the host's /proc) sees the
host's processes. The container / pod a process belongs to comes from its cgroup path.

The pass over every process (`read_all`) runs in a child forked before the facts' modules are imported
(driverd.host.start_early), which imports this module: the facts' classes are imported where the facts
are made (scan), not here.
"""
from __future__ import annotations

import re

from driverd.host.procscan import each_process

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Collection

    from driverd.host.facts import DaemonFacts, GpuUser
    from driverd.root import Root
    # what the pass keeps of a process: its name where it is a GPU daemon's, the NVIDIA device nodes it holds
    Seen = tuple[str | None, list[str]]

DAEMONS = {"nvidia-persistenced": ("nvidia-persiste", "nvidia-persistenced"),   # comm is cut at 15 chars
           "nv-fabricmanager": ("nv-fabricmanage", "nv-fabricmanager"),
           "nvlsm": ("nvlsm",), "nvidia-imex": ("nvidia-imex",)}
_POD_RE = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CTR_RE = re.compile(r"(?:cri-containerd-|crio-|docker-|/)([0-9a-f]{64})(?:\.scope)?$")


def pids(root: Root) -> list[int]:
    # ASCII digits only: str.isdigit() also accepts '²', which int() rejects.
    return sorted(int(p) for p in root.listdir("/proc") if p.isascii() and p.isdigit() and len(p) < 12)


def container_of(cgroup_text: str) -> tuple[str | None, str | None]:
    """(container id, pod uid) from /proc/<pid>/cgroup (v1 or v2, systemd or cgroupfs drivers)."""
    ctr = pod = None
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        m = _POD_RE.search(path)
        if m and pod is None:
            pod = m.group(1).replace("_", "-")
        for seg in reversed(path.split("/")):
            m2 = _CTR_RE.search("/" + seg)
            if m2:
                ctr = ctr or m2.group(1)
                break
    return ctr, pod


TASK_COMM_LEN = 16         # the kernel keeps a process's name in 16 bytes, NUL included: 15 characters


def process_name(root: Root, pid: int) -> str | None:
    """A process's name: /proc/PID/comm, and when the kernel cut that at 15 characters the full one,
    from argv[0] (its base name) or else /proc/PID/exe, if that starts with the cut name (a process
    that rewrote its argv, "postgres: writer", keeps its comm)."""
    comm = root.read_first_line(f"/proc/{pid}/comm")
    if comm is None or len(comm) < TASK_COMM_LEN - 1:
        return comm
    argv0 = (root.read_text(f"/proc/{pid}/cmdline") or "").split("\0", 1)[0]
    exe = root.readlink(f"/proc/{pid}/exe") or ""
    for cand in (argv0.split(" ", 1)[0].rsplit("/", 1)[-1], exe.removesuffix(" (deleted)").rsplit("/", 1)[-1]):
        if len(cand) > len(comm) and cand.startswith(comm):
            return cand
    return comm


def gpu_users(root: Root, skip: Collection[int | None] = ()) -> list[GpuUser]:
    """Processes holding an NVIDIA device node open, but those in `skip` (driverd's own NVML query)."""
    return scan(root, skip=skip)[0]


def daemons(root: Root) -> list[DaemonFacts]:
    return scan(root, users=False)[1]


def scan(root: Root, users: bool = True, skip: Collection[int | None] = (),
         seen: dict[int, Seen] | None = None) -> tuple[list[GpuUser], list[DaemonFacts]]:
    """The GPU users (where `users`: processes holding an NVIDIA device node open, but those in `skip`)
    and the GPU daemons, from one pass over every process (host/procscan.py: split over workers on a
    host with many), or from `seen`, that pass made earlier (`read_all()`, in a child of collect())."""
    from driverd.host.facts import DaemonFacts, GpuUser
    if seen is None:
        seen = each_process(root, pids(root), _matters if users else _daemon)
    found: dict[str, list[int]] = {name: [] for name in DAEMONS}
    held = []
    for pid, (comm, devices) in seen.items():
        for name, comms in DAEMONS.items():
            if comm in comms:
                found[name].append(pid)
        if users and devices and pid not in skip:
            cmd = (root.read_text(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()
            ctr, pod = container_of(root.read_text(f"/proc/{pid}/cgroup") or "")
            held.append(GpuUser(pid, process_name(root, pid) or "?", cmd, tuple(sorted(set(devices))), ctr, pod))
    return held, [DaemonFacts(name, bool(p), tuple(p)) for name, p in found.items()]


_DAEMON_COMMS = frozenset(c for comms in DAEMONS.values() for c in comms)


def read_all(root: Root, but: int | None = None) -> dict[int, Seen]:
    """scan()'s pass over every process but `but` (the reader itself), users and daemons alike."""
    return each_process(root, [p for p in pids(root) if p != but], _matters)


def _daemon(root: Root, pid: int) -> Seen | None:
    comm = root.read_first_line(f"/proc/{pid}/comm")
    return (comm, []) if comm in _DAEMON_COMMS else None


def _matters(root: Root, pid: int) -> Seen | None:
    """What scan() keeps of a process (None where nothing)."""
    devices = [t for t in root.link_targets(f"/proc/{pid}/fd").values() if t.startswith("/dev/nvidia")]
    comm = root.read_first_line(f"/proc/{pid}/comm")
    if comm not in _DAEMON_COMMS:
        comm = None
    return (comm, devices) if devices or comm else None
