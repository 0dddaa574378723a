"""GPU daemons: nvidia-persistenced (keeps GPUs initialised), and the fabric's companions — fabric manager
(NVSwitch hosts and NVLink5 switch trays; CUDA cannot use NVLink until it has configured the fabric), NVLSM (the
NVLink5 switch trays' subnet manager, before the fabric manager) and nvidia-imex (GB200-class trays: GPU memory
across nodes). Which of them run on a host is driverd.plan.companions' decision. Three ways to run them, one
interface:

- systemd (host mode): `systemctl start|stop|is-active <unit>` through the Runner;
- child processes (driver container, root=/host): started from the host's binaries, pid files under
  <root>/run/driverd/, stopped with SIGTERM;
- simulated (driverd.sim.services, through driverd.backends): processes in the tree's /proc.

A daemon must be of the driver's version (persistenced talks to the kernel module through
libnvidia-cfg; fabric manager, NVLSM and IMEX refuse another driver's): when driverd installed the user-space
or the companion with the modules, its tree's binary is the one started (`bin_dirs`, searched first); the
host's otherwise. Under systemd that binary runs as a transient unit `driverd-<unit>` (the distribution's unit,
where one exists, names the host's binary).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from abc import ABC, abstractmethod

from driverd.datatypes import dataclass
from driverd.errors import ModuleError
from driverd.host.processes import DAEMONS
from driverd.runner import CHILD_CWD

PERSISTENCED = "nvidia-persistenced"
FABRICMANAGER = "nv-fabricmanager"
NVLSM = "nvlsm"
IMEX = "nvidia-imex"
# The distribution's units (NVIDIA's packages: nvidia-fabricmanager-<branch>, nvidia-imex-<branch>; nvlsm's own
# unit where the fabric manager's start script does not start it).
UNITS = {PERSISTENCED: "nvidia-persistenced.service", FABRICMANAGER: "nvidia-fabricmanager.service",
         NVLSM: "nvlsm.service", IMEX: "nvidia-imex.service"}
# Where NVIDIA's packages put them and how their units start them: nvidia-fabricmanager.service, the nvlsm line
# of nvidia-fabricmanager-start.sh (-B: in the background, once configured), nvidia-imex.service.
COMMANDS = {PERSISTENCED: ["/usr/bin/nvidia-persistenced", "--persistence-mode", "--verbose"],
            FABRICMANAGER: ["/usr/bin/nv-fabricmanager", "-c", "/usr/share/nvidia/nvswitch/fabricmanager.cfg"],
            NVLSM: ["/opt/nvidia/nvlsm/sbin/nvlsm", "-F", "/usr/share/nvidia/nvlsm/nvlsm.conf", "-B"],
            IMEX: ["/usr/bin/nvidia-imex", "-c", "/etc/nvidia-imex/config.cfg"]}
# the setting that turns each off (NVLSM goes with the fabric manager)
SETTING = {PERSISTENCED: "daemons.persistenced", FABRICMANAGER: "daemons.fabricmanager", NVLSM: "daemons.fabricmanager",
           IMEX: "daemons.imex"}
# the option that names a daemon's configuration file in COMMANDS (replaced by driverd's where it has one)
CONFIG_OPTION = {FABRICMANAGER: "-c", NVLSM: "-F", IMEX: "-c"}
FM_READY_TIMEOUT = 120.0
LOGS = {FABRICMANAGER: "journalctl -u nvidia-fabricmanager or /var/log/fabricmanager.log",
        NVLSM: "/var/log/nvlsm.log", IMEX: "journalctl -u nvidia-imex or /var/log/nvidia-imex.log"}


@dataclass(frozen=True)
class DaemonStatus:
    """Whether one GPU daemon is running, and as which processes."""
    name: str
    running: bool
    pids: tuple[int, ...] = ()


class Services(ABC):
    mode = "abstract"

    def __init__(self, kernel, bin_dirs: tuple[str, ...] = (), configs: dict[str, tuple[str, ...]] | None = None
                 ) -> None:
        self.kernel = kernel
        self.root = kernel.root
        self.runner = kernel.runner
        self.bin_dirs = bin_dirs
        self.configs = configs or {}

    def command(self, name: str) -> list[str]:
        """The daemon's argv: its binary from the first of `bin_dirs` that has it, else the host's. A binary
        of driverd's runs with the first configuration file of `configs[name]` that exists (the fabric
        manager's, written with its companion tree; IMEX's: the operator's /etc/nvidia-imex/config.cfg, else
        its tree's own), when there is one."""
        argv = list(COMMANDS[name])
        exe = os.path.basename(argv[0])
        for d in self.bin_dirs:
            p = f"{d.rstrip('/')}/{exe}"
            if self.root.is_executable(p):
                argv = [p, *argv[1:]]
                opt = CONFIG_OPTION.get(name)
                cfgs = self.configs.get(name) or ()
                cfg = next((c for c in ((cfgs,) if isinstance(cfgs, str) else cfgs) if self.root.is_file(c)), None)
                if cfg and opt in argv:
                    argv[argv.index(opt) + 1] = cfg
                return argv
        return argv

    def from_userspace(self, name: str) -> bool:
        return self.command(name)[0] != COMMANDS[name][0]

    def pids(self, name: str) -> list[int]:
        comms = DAEMONS[name]
        return [int(p) for p in self.root.listdir("/proc") if p.isdigit()
                and self.root.read_first_line(f"/proc/{p}/comm") in comms]

    def running(self, name: str) -> bool:
        return bool(self.pids(name))

    @abstractmethod
    def start(self, name: str) -> None: ...

    @abstractmethod
    def stop(self, name: str) -> None: ...

    def wait_ready(self, name: str, timeout: float = FM_READY_TIMEOUT) -> None:
        """Fabric manager is ready when every GPU reports fabric state Completed (NVML), or, where
        NVML cannot tell, when the daemon is still alive after it configured the switches. NVLSM and IMEX
        fork once they are up (their units say Type=forking): alive after their start is ready."""
        if name != FABRICMANAGER:
            if not self.running(name):
                raise ModuleError(f"{name} exited right after it started", cause=f"see its log ({LOGS.get(name)})",
                                  fix=f"{name} must be of the loaded driver's version")
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.fabric_state()
            if state == "completed":
                return
            if not self.running(name):
                raise ModuleError(f"{name} exited while configuring the fabric",
                                  cause="see its log (journalctl -u nvidia-fabricmanager or /var/log/fabricmanager.log)",
                                  fix="the fabric manager version must equal the driver version")
            time.sleep(0.5)
        raise ModuleError(f"{name} did not finish configuring the NVSwitch fabric in {timeout:.0f}s",
                          cause="GPU fabric state never reached Completed", fix="check the fabric manager log")

    def fabric_state(self) -> str | None:
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception:   # no NVML here: readiness by survival
            time.sleep(1.0)
            return "completed" if self.running(FABRICMANAGER) else None
        try:
            states = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                info = pynvml.nvmlDeviceGetGpuFabricInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
                states.append(info.state)
            done = getattr(pynvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)
            return "completed" if states and all(s == done for s in states) else "in-progress"
        except Exception:
            return "completed" if self.running(FABRICMANAGER) else None
        finally:
            try:
                pynvml.nvmlShutdown()
            except Exception:
                pass


class SystemdServices(Services):
    mode = "systemd"

    def _ctl(self, *args: str, check: bool = True):
        from driverd.runner import which
        return self.runner.run([which("systemctl") or "systemctl", *args], timeout=180, check=check)

    def start(self, name: str) -> None:
        if not self.from_userspace(name):
            self._ctl("start", UNITS[name])
            return
        if self._active(transient_unit(name)):
            return
        from driverd.runner import which
        # the daemons fork once they are up (NVIDIA's own units say Type=forking): systemd waits for that
        self.runner.run([which("systemd-run") or "systemd-run", f"--unit={transient_unit(name)}", "--collect",
                         "--property=Type=forking", f"--description=NVIDIA {name} (driverd's tree of the driver)",
                         "--", *self.command(name)], timeout=180)

    def stop(self, name: str) -> None:
        if self._active(transient_unit(name)):
            self._ctl("stop", transient_unit(name))
        if self._active(UNITS[name]) or not self.from_userspace(name):
            self._ctl("stop", UNITS[name])

    def _active(self, unit: str) -> bool:
        res = self.runner.run(["systemctl", "is-active", "--quiet", unit], timeout=30, check=False, mutates=False)
        return res.returncode == 0

    def running(self, name: str) -> bool:
        return self._active(UNITS[name]) or self._active(transient_unit(name)) or super().running(name)


class ChildServices(Services):
    """The driver container runs the daemons itself (the host has no unit for them)."""
    mode = "child"

    @staticmethod
    def _pidfile(name: str) -> str:
        return f"/run/driverd/{name}.pid"          # a host path: written through the root

    def start(self, name: str) -> None:
        if self.running(name):
            return
        argv = self.command(name)
        exe = self.root.real(argv[0])
        if not exe.is_file():
            raise ModuleError(f"{name} is not installed on the host", cause=f"{argv[0]} is missing under {self.root.base}",
                              fix=f"install it: driverd's user-space or companion package of the driver's version, or "
                                  f"the distribution's (or set {SETTING[name]} = false)")
        if self.runner.dry_run:
            return
        proc = subprocess.Popen([str(exe), *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True, cwd=CHILD_CWD)
        self.root.atomic_write(self._pidfile(name), f"{proc.pid}\n")

    def stop(self, name: str) -> None:
        for pid in self.pids(name):
            self.kernel.signal(pid, signal.SIGTERM)
        left = self.kernel.wait_gone(self.pids(name), 10)
        for pid in left:
            self.kernel.signal(pid, signal.SIGKILL)
        self.root.unlink(self._pidfile(name))


def transient_unit(name: str) -> str:
    return "driverd-" + UNITS[name]


def select_services(kernel, mode: str = "auto", bin_dirs: tuple[str, ...] = (),
                    configs: dict[str, tuple[str, ...]] | None = None) -> Services:
    """systemd on a host that runs it, child processes in the driver container; a kernel backend
    with its own services (the simulated one) brings them through driverd.backends. `bin_dirs`: where
    the driver's own binaries are looked for first (driverd's companion and user-space trees)."""
    from driverd import backends
    if mode == "auto":
        if kernel.name in backends.SERVICES:
            mode = kernel.name
        elif kernel.root.is_slash and os.path.isdir("/run/systemd/system"):
            mode = "systemd"
        else:
            mode = "child"
    factory = {"systemd": SystemdServices, "child": ChildServices, **backends.SERVICES}.get(mode)
    if factory is None:
        from driverd.errors import ConfigError
        raise ConfigError(f"daemons.mode {mode} is not available in this process",
                          fix="use daemons.mode auto, systemd or child")
    return factory(kernel, bin_dirs, configs)
