"""Restart a runtime after its configuration changed, then wait (bounded) until its socket answers.

systemd: `systemctl restart UNIT` (through `chroot ROOT` when driverd runs in a container with the
host at ROOT). signal: SIGHUP, which dockerd and CRI-O take as "reload the configuration";
containerd has no reload, so signal is refused for it. none: report that a restart is needed.
Running containers survive all three: containerd/CRI-O shims and Docker with live-restore keep them.
"""
from __future__ import annotations

import os
import signal
import socket
import time

from driverd.root import Root
from driverd.runner import Runner

UNITS = {"crio": "crio", "docker": "docker"}
COMMS = {"containerd": ("containerd", "k3s-server", "k3s-agent", "rke2"), "crio": ("crio",),
         "docker": ("dockerd",)}


def socket_answers(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def wait_socket(path: str, timeout_s: float) -> float | None:
    """Seconds until a unix socket accepts a connection, None after `timeout_s`."""
    start = time.monotonic()
    while True:
        if socket_answers(path):
            return round(time.monotonic() - start, 3)
        if time.monotonic() - start >= timeout_s:
            return None
        time.sleep(0.1)


def _pids(root: Root, comms: tuple[str, ...]) -> list[int]:
    out = []
    for name in root.listdir("/proc"):
        if name.isdigit() and (root.read_first_line(f"/proc/{name}/comm") or "") in comms:
            out.append(int(name))
    return out


def restart(root: Root, runtime: str, unit: str, socket_path: str | None, mode: str, runner: Runner,
            timeout_s: float = 30.0) -> tuple[bool, str, float | None]:
    """(restarted, what happened, seconds until the socket answered)."""
    if mode == "none":
        return False, f"restart {runtime} to apply the change (restart mode 'none')", None
    if mode == "systemd":
        argv = ["systemctl", "restart", unit]
        if not root.is_slash:
            argv = ["chroot", root.base] + argv
        res = runner.run(argv, timeout=max(timeout_s, 30), check=False)
        if res.dry_run:
            return False, f"would run: {' '.join(argv)}", None
        if not res.ok:
            return False, f"{' '.join(argv)} failed: {res.first_error_line()}", None
        what = f"ran {' '.join(argv)}"
    elif mode == "signal":
        if runtime == "containerd":
            return False, ("containerd does not reload its configuration on a signal; "
                           "restart it (--restart systemd) to apply the change"), None
        if runner.dry_run:
            return False, f"would send SIGHUP to {runtime}", None
        if not root.is_live():
            return False, f"cannot signal {runtime}: {root.base} is not this machine's live root", None
        pids = _pids(root, COMMS[runtime])
        if not pids:
            return False, f"no running {runtime} process to signal", None
        for pid in pids:
            os.kill(pid, signal.SIGHUP)
        what = f"sent SIGHUP to {runtime} (pid {', '.join(map(str, pids))})"
    else:
        raise ValueError(mode)
    if not socket_path:
        return True, what, None
    waited = wait_socket(str(root.real(socket_path)), timeout_s)
    if waited is None:
        return True, f"{what}; its socket {socket_path} did not answer within {timeout_s:g}s", None
    return True, f"{what}; {socket_path} answered after {waited:g}s", waited
