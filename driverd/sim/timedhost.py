"""A simulated node's host whose work costs what it costs on a node: wall-clock time, not this
machine's CPU.

On a real fleet a node's transaction takes seconds of that node's kernel and GPUs (the driver's load
initialises every GPU; the workload check runs CUDA on each) and none of the coordinator's. A fleet
of hundreds of simulated hosts in one process on a small machine, each doing the simulated kernel's
file work, measures that machine's CPU instead (issue 34). `TimedHost` is the host under a node's
real cluster agent (driverd.cluster.nodehost's methods): which driver runs and which processes hold
a GPU are a record in memory, and the node transaction is a sleep of the measured durations —
so the agent's decisions and its API traffic are the daemon's own, and what is left to measure is
the coordination.

The durations (NodeCosts) default to what was measured on real GPU machines (docs/testing.md, "The
fleet rollout on the real apiserver"): the driver's load on 4×H200 and the workload check there.
"""
from __future__ import annotations

import itertools
import json
import os
import threading
import time
import uuid

from driverd.datatypes import dataclass

# nvidia.ko loaded -> the GPUs initialised (the kernel log's "Persistence mode is deprecated" line,
# written once persistence mode is set on the initialised GPUs): 4.54 s on 4×H200, 3.20 s on 1×H200
# (580.159.04, the device machines' boot logs, docs/testing.md). The unload and the package's install
# before it are not in it: the node's work here is the lower bound of a reload.
RELOAD_S = 4.5
# driverd.host.workload.check on 4×H200 (median of 5; 0.91 s on 1×H100): docs/testing.md, "On the GPU machines".
VALIDATE_S = 2.46


@dataclass(frozen=True)
class NodeCosts:
    """How long a simulated node's work takes in wall-clock seconds, by default as measured on real GPU machines."""
    reload_s: float = RELOAD_S          # unload -> install -> load of the target driver
    validate_s: float = VALIDATE_S      # the workload check the transaction ends with
    preflight_s: float = 0.0            # plan and package pre-pull before the rollout admits anyone

    @property
    def work_s(self) -> float:
        """A node transaction that succeeds."""
        return self.reload_s + self.validate_s


class TimedHost:
    """One node's host: the loaded driver, the processes holding a GPU (pod UID -> (pid, comm,
    device)), the boot id; `fail_reload` makes the next loads fail (the transaction rolls back)."""

    _pids = itertools.count(50000)

    def __init__(self, name: str, costs: NodeCosts, *, loaded: tuple[str, str] | None, kernel: str,
                 sleep=time.sleep, processes_file: str | None = None) -> None:
        """processes_file: the processes live in this file, written by the host that plays the kubelet
        and read by the host the daemon uses, when the two are in different processes (a fleet's
        daemons spawned apart from its harness: driverd.sim.fleet.Fleet.spawn_group)."""
        self.name, self.costs, self.kernel, self.sleep = name, costs, kernel, sleep
        self.driver = loaded
        self.processes: dict[str, tuple[int, str, str]] = {}
        self.processes_file = processes_file
        self._writes_file = False       # only the host that plays the kubelet (share) writes the file
        self.boot = str(uuid.uuid4())
        self.fail_reload = False
        self.transactions = 0
        self._lock = threading.Lock()

    # -- what the kubelet does on the node ------------------------------------------------------------
    def start_process(self, pod_uid: str, comm: str, device: str) -> None:
        with self._lock:
            if pod_uid not in self.processes:
                self.processes[pod_uid] = (next(self._pids), comm, device)
                self._save()

    def end_process(self, pod_uid: str) -> None:
        with self._lock:
            if self.processes.pop(pod_uid, None) is not None:
                self._save()

    def pod_uids(self) -> set[str]:
        with self._lock:
            return set(self._current())

    def reboot(self) -> None:
        """A new boot: no driver loaded yet, no process left."""
        with self._lock:
            self.processes.clear()
            self._save()
        self.driver, self.boot = None, str(uuid.uuid4())

    def share(self, path: str) -> None:
        """From now on, keep the processes in `path` as well (see processes_file)."""
        with self._lock:
            self.processes_file, self._writes_file = path, True
            self._save()

    def _save(self) -> None:
        if self.processes_file and self._writes_file:
            tmp = f"{self.processes_file}.{os.getpid()}.tmp"
            with open(tmp, "w") as fh:
                json.dump(self.processes, fh)
            os.replace(tmp, self.processes_file)

    def _current(self) -> dict[str, tuple[int, str, str]]:
        """The processes as the kubelet's host keeps them: its own record where it writes the file
        (or there is none), the file where another process writes it."""
        if not self.processes_file or self._writes_file:
            return self.processes
        try:
            with open(self.processes_file) as fh:
                return {k: tuple(v) for k, v in json.load(fh).items()}
        except FileNotFoundError:
            return {}

    # -- driverd.cluster.nodehost.NodeHost --------------------------------------------------------------
    def loaded(self, cfg) -> dict | None:
        d = self.driver
        return None if d is None else {"version": d[0], "flavor": d[1]}

    def gpu_users(self, cfg) -> dict[str, str]:
        with self._lock:
            return {uid: f"its process {pid} ({comm}) has {dev} open" for uid, (pid, comm, dev) in self._current().items()}

    def preflight(self, cfg, key: str, driver: str, flavor: str, *, leaving: set[str],
                  staying: dict[str, str]) -> dict:
        """The answer driverd.apply.preflight gives on a host that can take the target from its
        repository: not needed when it runs it already; refused while a process that stays holds a GPU."""
        from driverd.apply.preflight import driver_config
        self.sleep(self.costs.preflight_s)
        want = _flavor(driver_config(cfg, driver, flavor, source=f"rollout {key}"))
        out = {"rollout": key, "driver": driver, "ok": True, "needed": True, "reasons": [], "reboot": False,
               "kernel": self.kernel, "current": f"{self.driver[0]}/{self.driver[1]}" if self.driver else None}
        if self.driver == (driver, want):
            out["needed"], out["reasons"] = False, [f"already runs {driver} ({want})"]
            return out
        held = {uid: why for uid, why in self.gpu_users(cfg).items() if uid not in leaving}
        if held:
            out["ok"] = False
            out["reasons"] = [f"the GPU stays in use after the drain: {staying.get(uid) or f'pod {uid}: {why}'}"
                              for uid, why in sorted(held.items())]
            return out
        out["flavor"] = want
        out["reasons"] = [f"package {driver} ({want}) for {self.kernel} from the node's repository"]
        return out

    def transact(self, cfg):
        """Unload -> install -> load -> validate, as long as it takes on a node; a load that fails
        loads the previous driver again (the transaction's rollback). Refused while a GPU is in use."""
        from driverd.apply.reconcile import Result
        started = time.time()
        version, flavor = cfg["driver.version"], _flavor(cfg)
        if self.driver == (version, flavor):
            return Result("converged", f"driver {version} ({flavor}) loaded and validated",
                          loaded=self.loaded(cfg), started=started, finished=time.time())
        users = self.gpu_users(cfg)
        if users:
            return Result("blocked", "cannot unload the driver: " + "; ".join(sorted(users.values())),
                          failure="blocked", started=started, finished=time.time())
        self.transactions += 1
        before = self.driver
        self.driver = None
        self.sleep(self.costs.reload_s)
        if self.fail_reload:
            self.sleep(self.costs.reload_s)                 # the previous driver, loaded again
            self.driver = before
            self.sleep(self.costs.validate_s)
            return Result("failed", f"loading {version} ({flavor}) failed: the GPUs did not initialise (simulated "
                          f"fault); rolled back to {before[0] if before else 'no driver'}", failure="rolled-back",
                          started=started, finished=time.time())
        self.driver = (version, flavor)
        self.sleep(self.costs.validate_s)
        return Result("converged", f"driver {version} ({flavor}) loaded and validated", loaded=self.loaded(cfg),
                      started=started, finished=time.time())

    def boot_id(self, cfg) -> str:
        return self.boot


def _flavor(cfg) -> str:
    """The flavour a simulated host's GPUs (H100) take when the configuration leaves it to the host."""
    f = cfg["driver.flavor"]
    return "open" if f in (None, "", "auto") else f
