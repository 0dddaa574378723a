"""Simulated GPU daemons and MIG for the simulated kernel: processes in the tree's /proc that hold
/dev/nvidia* like the real daemons do, and MIG layouts kept beside the simulated kernel's state.
Registered as backends by driverd.sim.install_backends."""
from __future__ import annotations

import json
import signal
from dataclasses import asdict

from driverd.errors import ModuleError
from driverd.fsutil import atomic_write_json
from driverd.kmod.daemons import DAEMONS, FABRICMANAGER, IMEX, NVLSM, Services
from driverd.kmod.mig import GpuMig
from driverd.sim import companiond
from driverd.sim.fabricmanager import LOG
from driverd.sim.kernel import FABRIC, MIG_DIR


# the daemons whose binary the simulated services run before they play the process: the companions, whose
# stand-ins refuse another driver as NVIDIA's do (sim/fabricmanager.py, sim/companiond.py)
COMPANIONS = {FABRICMANAGER: (LOG, "fabricmanager", "daemons.fabricmanager"),
              NVLSM: (companiond.LOGS["nvlsm"], "nvlsm", "daemons.fabricmanager"),
              IMEX: (companiond.LOGS["imex"], "imex", "daemons.imex")}


class SimServices(Services):
    """Daemons as simulated processes that hold the driver open, like the real ones do."""
    mode = "sim"

    def start(self, name: str) -> None:
        if self.running(name):
            return
        if not self.kernel.is_loaded("nvidia") or not self.root.exists("/dev/nvidiactl"):
            raise ModuleError(f"{name} could not start", cause="Failed to open /dev/nvidiactl: the driver is not loaded",
                              fix="load the driver first (driverd load)")
        devs = ["/dev/nvidiactl"] + sorted(p for p in (f"/dev/{n}" for n in self.root.listdir("/dev"))
                                          if p[11:].isdigit() and p.startswith("/dev/nvidia"))
        if name == FABRICMANAGER:
            devs.append("/dev/nvidia-nvswitchctl")
        if name == NVLSM:
            devs = []                   # NVLSM holds the InfiniBand MAD device, not the GPUs
        if name in COMPANIONS:
            self._run_companion(name)
        comm = DAEMONS[name][0]
        self.kernel.spawn(comm, devs, cmdline=" ".join(self.command(name)))

    def _run_companion(self, name: str) -> None:
        """Run the tree's binary (driverd's companion tree's, else the host's): a stand-in refuses a driver of
        another version as NVIDIA's does; with none at all the daemon cannot start, as systemd's unit cannot."""
        log, component, key = COMPANIONS[name]
        argv = self.command(name)
        exe = self.root.real(argv[0])
        if not exe.is_file():
            raise ModuleError(f"{name} could not start: {argv[0]} is missing",
                              cause=f"no {name} is installed on this host or in driverd's companion tree",
                              fix=f"provide the driver version's {component} companion package (driverd "
                                  f"build-companion) or set {key} = \"false\"")
        import subprocess
        res = subprocess.run([str(exe), *argv[1:]], env={"PATH": "/usr/bin:/bin", "DRIVERD_SIM_ROOT": str(self.root.base)},
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        if res.returncode != 0:
            err = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]
            raise ModuleError(f"{name} ({argv[0]}) exited with status {res.returncode}: {err}",
                              cause=f"its log: {log}",
                              fix=f"the {component} must be of the loaded driver's version: provide the driver "
                                  f"version's {component} companion package (driverd build-companion)")

    def stop(self, name: str) -> None:
        for pid in self.pids(name):
            self.kernel.signal(pid, signal.SIGTERM)

    def fabric_state(self) -> str | None:
        return (self.root.read_first_line(FABRIC) or None)


class SimMig:
    """MIG state of simulated GPUs: /run/driverd-sim/mig/<pci>.json."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def read(self) -> list[GpuMig] | None:
        if not self.kernel.is_loaded("nvidia"):
            return None
        r = self.kernel.root
        return [GpuMig.from_json(json.loads(r.read_text(f"{MIG_DIR}/{f}") or "{}")) for f in r.listdir(MIG_DIR)]

    def create(self, gpu: GpuMig) -> None:
        atomic_write_json(self.kernel.root.path(f"{MIG_DIR}/{gpu.pci_address}.json"), asdict(gpu))
