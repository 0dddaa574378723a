"""Reading something of every process (its open files, its name), split over forked workers on a host
with many processes.

Naming the GPU users reads every /proc/PID/fd link, one readlink each, nearly all of it kernel time
(~2-3 us): a busy GPU node (a training job's ranks and their data-loader workers, each holding tens of
/dev/nvidia* files, beside the kubelet, the runtime and the pods' shims) has tens of thousands. On a
16-core H200 host one process read 50,000 links of 1,185 processes in ~146 ms, more than `nvidia-smi -q`
takes in all; 9 forked workers in ~26 ms (bench/proc_scan.py). Threads do not help: each readlink gives
up and takes back the interpreter's lock, and 4 threads took 3.5x one thread's time there. Workers are
used only where the process may fork (one thread: not the daemon) and the host has enough processes to
pay for them; a worker that fails or hangs has its share read here.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable

    from driverd.host.forked import Forked
    from driverd.root import Root

# At least this many processes a worker: below it, the forks cost more than they save (a share of ~130
# processes took ~2 ms to read on that host, a fork of a process the size of detect's ~0.5 ms).
PER_WORKER = 128
MAX_WORKERS = 16
WORKER_TIMEOUT_S = 60.0


def each_process(root: Root, pids: list[int], read: Callable[[Root, int], Any]) -> dict[int, Any]:
    """`read(root, pid)` for each of `pids` (a JSON-serialisable answer, None for nothing to say), in the
    order of `pids`, processes answering None left out. The answer is the same however it was read."""
    workers = _workers(root, len(pids))
    if workers < 2:
        return _read(root, pids, read)
    from driverd.host import forked
    started: list[tuple[list[int], forked.Forked | None]] = []
    for i in range(workers):
        share = pids[i::workers]
        try:
            started.append((share, forked.fork(lambda share=share: _read(root, share, read))))
        except OSError:                       # no more processes or pipes: this process reads the share
            started.append((share, None))
    found: dict[int, Any] = {}
    for share, child in started:
        got = answer_of(child) if child is not None else None
        found.update(_read(root, share, read) if got is None else got)
    return {pid: found[pid] for pid in pids if pid in found}


def answer_of(child: Forked, each: Callable[[Any], Any] | None = None) -> dict[int, Any] | None:
    """A pass's answer from the child that made it (pid -> what it kept, through `each`), waited for up to
    WORKER_TIMEOUT_S; None where the child failed or its answer is not of that shape: the caller then reads
    those processes itself, and nothing is lost."""
    from driverd.host.forked import ChildFailed
    try:
        return {int(pid): (each(kept) if each else kept) for pid, kept in child.answer(WORKER_TIMEOUT_S).items()}
    except (ChildFailed, AttributeError, TypeError, ValueError):
        return None


def _workers(root: Root, processes: int) -> int:
    if root.recorded is not None:             # a capture records each file in the order it is read
        return 1
    n = min(processes // PER_WORKER, MAX_WORKERS, _cpus())
    if n < 2:
        return 1
    from driverd.host import forked
    return n if forked.can_fork() else 1


def _cpus() -> int:
    """The CPUs this process may run on (a container's cpuset, not the host's count)."""
    return len(os.sched_getaffinity(0))


def _read(root: Root, pids: list[int], read: Callable[[Root, int], Any]) -> dict[int, Any]:
    found: dict[int, Any] = {}
    for pid in pids:
        answer = read(root, pid)
        if answer is not None:
            found[pid] = answer
    return found
