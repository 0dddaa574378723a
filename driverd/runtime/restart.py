"""Restart a runtime after its configuration changed, then wait (bounded) until it answers again.

systemd: ask `systemctl is-active UNIT` first (through `chroot ROOT` when driverd runs in a container
with the host at ROOT). Only an active unit is restarted, with `systemctl try-restart --no-block`; one
that is not running reads the new configuration when it starts. Never a synchronous `systemctl
restart`: at boot driverd.service runs Before=containerd.service, so a blocking restart job would wait
for driverd itself until its timeout (and the failed step would roll back the driver it just loaded).
After the non-blocking restart driverd waits, bounded by the timeout, for a new invocation of the
unit and then for its socket; running out of time is a note in the report, never a hang.
signal: SIGHUP to the runtime's processes, for the runtimes that take it as "reload the configuration"
(dockerd, CRI-O: `reloads_on_signal` in the registry); containerd has no reload, so signal is refused
for it. none: report that a restart is needed.
Running containers survive all three: containerd/CRI-O shims and Docker with live-restore keep them.
"""
from __future__ import annotations

import os
import signal
import socket
import time

from driverd.errors import DriverdError
from driverd.root import Root
from driverd.runner import Result, Runner

class DidNotStart(Exception):
    """The runtime's unit was restarted and failed to start: the new configuration is the suspect."""


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


# What `systemctl is-active` prints; anything else (empty, an error) means systemd could not be asked.
UNIT_STATES = ("active", "reloading", "refreshing", "inactive", "activating", "deactivating", "failed",
               "maintenance", "unknown")


def systemd_decision(runtime: str, unit: str, state: str) -> tuple[bool, str]:
    """(restart it?, why) from the unit state `systemctl is-active` printed. Pure.

    Only a running unit is restarted (try-restart --no-block). A unit that is not running, or is
    starting right now (at boot: waiting for driverd.service, which is ordered before it), is left
    alone: it reads the new configuration when it starts, and a restart job could only wait for us.
    """
    state = (state or "").strip() or "unknown"
    if state in ("active", "reloading", "refreshing"):
        return True, f"{unit} is {state}"
    if state == "activating":
        return False, (f"{unit} is starting (activating): not restarted, it reads the new configuration as it "
                       f"starts; if it had already read it before driverd's change, restart {unit} once it is up")
    if state == "deactivating":
        return False, f"{unit} is stopping: not restarted; {runtime} reads the new configuration when it starts again"
    return False, f"{unit} is {state}: not restarted; {runtime} reads the new configuration when it starts"


def _systemctl(root: Root, *args: str) -> list[str]:
    argv = ["systemctl", *args]
    return argv if root.is_slash else ["chroot", root.base] + argv


def _show(root: Root, unit: str, runner: Runner) -> dict[str, str]:
    """ActiveState and InvocationID of `unit` ({} when systemd cannot be asked)."""
    try:
        res = runner.run(_systemctl(root, "show", "-p", "ActiveState", "-p", "InvocationID", unit), timeout=15,
                         check=False, mutates=False)
    except DriverdError:
        return {}
    if not res.ok:
        return {}
    return dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)


def _is_active(root: Root, unit: str, runner: Runner) -> tuple[str | None, Result | None, str]:
    argv = _systemctl(root, "is-active", unit)
    try:
        res = runner.run(argv, timeout=15, check=False, mutates=False)
    except DriverdError as e:
        return None, None, f"{' '.join(argv)} failed: {e.one_line()}"
    first = (res.stdout.strip().splitlines() or [""])[0].strip()
    if first in UNIT_STATES:
        return first, res, ""
    return None, res, f"{' '.join(argv)} failed: {res.first_error_line()}"


def _systemd_restart(root: Root, runtime: str, unit: str, socket_path: str | None, runner: Runner,
                     timeout_s: float) -> tuple[bool, str, float | None]:
    argv = _systemctl(root, "try-restart", "--no-block", unit)
    if runner.dry_run:
        runner.run(argv)                               # recorded, not run
        return False, f"would run: {' '.join(argv)} (only if {unit} is active)", None
    state, _, err = _is_active(root, unit, runner)
    if state is None:
        return False, err, None
    restart_it, why = systemd_decision(runtime, unit, state)
    if not restart_it:
        return False, why, None
    start = time.monotonic()
    before = _show(root, unit, runner).get("InvocationID") or None
    try:
        res = runner.run(argv, timeout=30, check=False)
    except DriverdError as e:
        return False, f"{' '.join(argv)} failed: {e.one_line()}", None
    if not res.ok:
        return False, f"{' '.join(argv)} failed: {res.first_error_line()}", None
    return _wait_up(root, runtime, unit, socket_path, runner, f"{why}: ran {' '.join(argv)}", before,
                    start + timeout_s, timeout_s)


def _wait_up(root: Root, runtime: str, unit: str, socket_path: str | None, runner: Runner, what: str,
             before: str | None, deadline: float, timeout_s: float) -> tuple[bool, str, float | None]:
    """After a --no-block job on `unit`: wait (bounded) for its new invocation to be up, then for its
    socket. Raises DidNotStart when the new invocation failed."""
    if before:      # --no-block returned at once: wait (bounded) for the new invocation to be up
        while True:
            now = _show(root, unit, runner)
            new = now.get("InvocationID") not in (None, "", before)
            if new and now.get("ActiveState") == "active":
                break
            if new and now.get("ActiveState") == "failed":
                raise DidNotStart(f"{what}; {unit} failed to start again: see journalctl -u {unit}")
            if time.monotonic() >= deadline:
                return True, (f"{what}; {unit} was not running again within {timeout_s:g}s (the restart is queued "
                              f"in systemd, which may be waiting for other units first): check systemctl status {unit}"), None
            time.sleep(0.2)
    if not socket_path:
        return True, what, None
    waited = wait_socket(str(root.real(socket_path)), max(0.0, deadline - time.monotonic()))
    if waited is None:
        return True, (f"{what}; its socket {socket_path} did not answer within {timeout_s:g}s: {runtime} may "
                      f"still be starting, check systemctl status {unit}"), None
    return True, f"{what}; {socket_path} answered after {waited:g}s", waited


def start_again(root: Root, runtime: str, unit: str, socket_path: str | None, runner: Runner,
                timeout_s: float = 30.0) -> tuple[bool, str, float | None]:
    """Start a unit that failed to start after driverd's change, once that change is undone: it was
    running before driverd touched its configuration, so starting it puts back what was. Non-blocking
    (`start --no-block`, after `reset-failed` so systemd's start limit does not refuse it), then the
    same bounded wait as a restart. Raises DidNotStart when it fails again."""
    start = time.monotonic()
    before = _show(root, unit, runner).get("InvocationID") or None
    runner.run(_systemctl(root, "reset-failed", unit), timeout=15, check=False)
    argv = _systemctl(root, "start", "--no-block", unit)
    res = runner.run(argv, timeout=30, check=False)
    if not res.ok:
        raise DidNotStart(f"{' '.join(argv)} failed: {res.first_error_line()}")
    return _wait_up(root, runtime, unit, socket_path, runner, f"ran {' '.join(argv)}", before,
                    start + timeout_s, timeout_s)


def restart(root: Root, runtime: str, unit: str, socket_path: str | None, mode: str, runner: Runner,
            timeout_s: float = 30.0) -> tuple[bool, str, float | None]:
    """(restarted, what happened, seconds until the socket answered). A unit that failed to start
    again is (True, what happened, None); `restart_or_raise` tells it apart."""
    try:
        return restart_or_raise(root, runtime, unit, socket_path, mode, runner, timeout_s)
    except DidNotStart as e:
        return True, str(e), None


def restart_or_raise(root: Root, runtime: str, unit: str, socket_path: str | None, mode: str, runner: Runner,
                     timeout_s: float = 30.0) -> tuple[bool, str, float | None]:
    """restart(), raising DidNotStart when the restarted unit failed to start again."""
    if mode == "none":
        return False, f"restart {runtime} to apply the change (restart mode 'none')", None
    if mode == "systemd":
        return _systemd_restart(root, runtime, unit, socket_path, runner, timeout_s)
    if mode == "signal":
        from driverd.runtime.registry import get
        rt = get(runtime)
        if not rt.reloads_on_signal:
            return False, (f"{runtime} does not reload its configuration on a signal; "
                           "restart it (--restart systemd) to apply the change"), None
        if runner.dry_run:
            return False, f"would send SIGHUP to {runtime}", None
        if not root.is_live():
            return False, f"cannot signal {runtime}: {root.base} is not this machine's live root", None
        pids = _pids(root, rt.process_names)
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
