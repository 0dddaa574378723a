"""`driverd reboot-gate`: for hosts without kured, hold a systemd shutdown inhibitor lock while the reboot gate
(driverd.install.rebootgate, `driverd reboot-ready`) is closed, and release it once it opens.

The lock is logind's (`systemd-inhibit --what=shutdown --mode=block`): while it is held, logind refuses a
shutdown or reboot that checks inhibitors — a user's or session's request, `systemctl reboot` from a terminal
(`--check-inhibitors=auto`), any tool run with `--check-inhibitors=yes` — and `systemd-inhibit --list` names
driverd and why. Its holder is a child `systemd-inhibit ... cat` whose standard input is a pipe from this
process: closing the pipe releases the lock, and so does this process dying in any way (the pipe closes with
it), so a crashed gate never keeps a host from rebooting. docs/reboots.md says why this and not a masked
reboot.target, and what a block lock does not stop (root's non-interactive `systemctl reboot`).

The gate is judged every `interval_s` seconds and when /boot or /lib/modules change (a kernel installed or
removed: daemon.kernelwatch)."""
from __future__ import annotations

import signal
import subprocess
import threading
import time
from typing import Callable

INHIBIT = "systemd-inhibit"
WHO = "driverd"


def why_of(gate) -> str:
    """The lock's --why: the kernels that would boot without the driver, short enough for `--list`."""
    bad = [k for k in gate.kernels if not k.ready]
    text = ("kernel " + "; ".join(f"{k.release}: {k.short}" for k in bad) if bad else gate.reason)
    return (text[:180] + "…" if len(text) > 180 else text) + " (driverd reboot-ready)"


class Inhibitor:
    def __init__(self, log: Callable[..., None]) -> None:
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.why: str | None = None

    @property
    def held(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def argv(self, why: str) -> list[str]:
        return [INHIBIT, "--what=shutdown", f"--who={WHO}", f"--why={why}", "--mode=block", "cat"]

    def hold(self, why: str) -> None:
        if self.held and self.why == why:
            return
        self.release(quiet=self.held)
        try:
            self.proc = subprocess.Popen(self.argv(why), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE)
        except OSError as e:
            self.proc = None
            self.log(f"driverd reboot-gate: cannot take the shutdown inhibitor lock: {INHIBIT}: {e.strerror}; "
                     "fix: run on a systemd host (logind), or gate reboots with `driverd reboot-ready`", "error")
            return
        self.why = why
        time.sleep(0.2)
        if self.proc.poll() is not None:        # logind refused it (no logind, no permission)
            err = (self.proc.stderr.read() or b"").decode(errors="replace").strip()
            self.log(f"driverd reboot-gate: the shutdown inhibitor lock was refused: {err or 'exit ' + str(self.proc.returncode)}",
                     "error")
            self.proc = None
            return
        self.log(f"driverd reboot-gate: closed: holding a shutdown inhibitor lock: {why}", "warning")

    def release(self, quiet: bool = False) -> None:
        p, self.proc, self.why = self.proc, None, None
        if p is None:
            return
        try:
            if p.stdin is not None:
                p.stdin.close()                 # cat ends, systemd-inhibit ends, logind drops the lock
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.terminate()
            p.wait(5)
        if not quiet:
            self.log("driverd reboot-gate: open: the shutdown inhibitor lock is released", "info")


def run(root, load_config: Callable, *, interval_s: float, log: Callable[..., None]) -> int:
    """The gate's loop until SIGTERM/SIGINT; exit 0 (the lock released)."""
    from driverd.daemon.kernelwatch import KernelDirs
    from driverd.errors import DriverdError
    from driverd.install.rebootgate import judge
    stop = threading.Event()

    def on_stop(signum, frame) -> None:
        stop.set()
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    lock = Inhibitor(log)
    dirs = KernelDirs(root)
    last: tuple | None = None
    try:
        while not stop.is_set():
            try:
                g = judge(root, load_config())
            except DriverdError as e:
                log(f"driverd reboot-gate: cannot judge the gate: {e.one_line()}; the lock is left as it is", "error")
            else:
                now = (g.ready, g.reason)
                if now != last:
                    log(f"driverd reboot-gate: {'open' if g.ready else 'closed'}: {g.reason}",
                        "info" if g.ready else "warning")
                    last = now
                if g.ready:
                    lock.release(quiet=not lock.held)
                else:
                    lock.hold(why_of(g))
            waited = 0.0
            while waited < interval_s and not stop.is_set():
                stop.wait(min(5.0, interval_s - waited))
                waited += min(5.0, interval_s - waited)
                if dirs.changed():
                    break
    finally:
        lock.release(quiet=not lock.held)
    return 0
