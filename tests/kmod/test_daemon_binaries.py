"""The GPU daemons run from the driver's own version: when driverd installed the user-space with the
modules, nvidia-persistenced is started from that tree (`<userspace.root>/current/bin`), never the host's
binary of another version; without driverd's tree the host's is used. Under systemd, driverd's binary runs as
a transient unit (`systemd-run --unit driverd-<unit>`), the distribution's unit keeps naming the host's."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from driverd.kmod import daemons as dmn
from driverd.root import Root
from driverd.runner import Result

TREE_BIN = "/var/lib/driverd/driver/current/bin"


@dataclass
class _Kernel:
    root: Root
    runner: object


class _Systemctl:
    """A runner that answers systemctl like a host where the named units are active."""
    dry_run = False

    def __init__(self, active: set[str]) -> None:
        self.active = set(active)
        self.calls: list[tuple[str, ...]] = []

    def run(self, argv, *, timeout=120, check=True, mutates=True, **kw):
        argv = tuple(os.fspath(a) for a in argv)
        self.calls.append(argv)
        rc = 0
        if argv[1:3] == ("is-active", "--quiet"):
            rc = 0 if argv[3] in self.active else 3
        elif argv[1] == "stop":
            self.active.discard(argv[2])
        elif os.path.basename(argv[0]) == "systemd-run":
            self.active.add(next(a.split("=", 1)[1] for a in argv if a.startswith("--unit=")))
        return Result(argv, rc, "", "", 0.0)


def _exe(root, path: str) -> None:
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("#!/bin/sh\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def test_the_command_is_driverds_trees_binary_when_it_has_one(tmp_path):
    _exe(tmp_path, "/usr/bin/nvidia-persistenced")
    svc = dmn.SystemdServices(_Kernel(Root(str(tmp_path)), _Systemctl(set())), bin_dirs=(TREE_BIN,))
    assert svc.command(dmn.PERSISTENCED)[0] == "/usr/bin/nvidia-persistenced"
    _exe(tmp_path, TREE_BIN + "/nvidia-persistenced")
    argv = svc.command(dmn.PERSISTENCED)
    assert argv == [TREE_BIN + "/nvidia-persistenced", *dmn.COMMANDS[dmn.PERSISTENCED][1:]]
    # fabric manager is not in the user-space package (NVIDIA ships it separately): the host's
    assert svc.command(dmn.FABRICMANAGER) == dmn.COMMANDS[dmn.FABRICMANAGER]


def test_under_systemd_driverds_binary_runs_as_a_transient_unit_and_is_stopped_by_it(tmp_path):
    _exe(tmp_path, TREE_BIN + "/nvidia-persistenced")
    run = _Systemctl(set())
    svc = dmn.SystemdServices(_Kernel(Root(str(tmp_path)), run), bin_dirs=(TREE_BIN,))
    svc.start(dmn.PERSISTENCED)
    started = [c for c in run.calls if os.path.basename(c[0]) == "systemd-run"]
    assert len(started) == 1 and "--unit=driverd-nvidia-persistenced.service" in started[0]
    assert started[0][started[0].index("--") + 1] == TREE_BIN + "/nvidia-persistenced"
    assert not any(c[1:] == ("start", "nvidia-persistenced.service") for c in run.calls)
    assert svc.running(dmn.PERSISTENCED)
    svc.start(dmn.PERSISTENCED)                     # already active: not started twice
    assert len([c for c in run.calls if os.path.basename(c[0]) == "systemd-run"]) == 1
    svc.stop(dmn.PERSISTENCED)
    assert ("systemctl", "stop", "driverd-nvidia-persistenced.service") in [(os.path.basename(c[0]), *c[1:])
                                                                             for c in run.calls]
    assert not svc.running(dmn.PERSISTENCED)


def test_under_systemd_without_driverds_tree_the_distributions_unit_is_used(tmp_path):
    run = _Systemctl(set())
    svc = dmn.SystemdServices(_Kernel(Root(str(tmp_path)), run), bin_dirs=(TREE_BIN,))
    svc.start(dmn.PERSISTENCED)
    assert [(os.path.basename(c[0]), *c[1:]) for c in run.calls if c[1:2] == ("start",)] == \
        [("systemctl", "start", "nvidia-persistenced.service")]
    assert not any(os.path.basename(c[0]) == "systemd-run" for c in run.calls)


def test_switching_to_driverds_tree_stops_the_host_units_daemon(tmp_path):
    """The host's persistenced (distribution unit) was running before driverd installed its user-space: stop
    reaches it, so the next start is the tree's."""
    _exe(tmp_path, TREE_BIN + "/nvidia-persistenced")
    run = _Systemctl({"nvidia-persistenced.service"})
    svc = dmn.SystemdServices(_Kernel(Root(str(tmp_path)), run), bin_dirs=(TREE_BIN,))
    svc.stop(dmn.PERSISTENCED)
    assert "nvidia-persistenced.service" not in run.active
