"""systemd's notification protocol (sd_notify(3)), written out: newline-separated KEY=VALUE
datagrams on the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or '@name' in the abstract
namespace). READY=1 once converged or degraded, STATUS=<one line> as the daemon works, WATCHDOG=1 every
$WATCHDOG_USEC/2, STOPPING=1 on the way out. Without $NOTIFY_SOCKET every call does nothing."""
from __future__ import annotations

import os
import socket
from typing import Callable, Mapping

ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None, log: Callable[[str], None] | None = None,
                 unset: bool = True) -> None:
        env = os.environ if environ is None else environ
        self.log = log or (lambda m: None)
        name = env.get("NOTIFY_SOCKET") or ""
        self.address = ("\0" + name[1:]) if name.startswith("@") else name
        self.watchdog_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if usec and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1e6 / 2        # ping twice per period, as sd_watchdog_enabled advises
        self.sock: socket.socket | None = None
        if self.address:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        if unset and environ is None:
            # Children (modprobe, the GPU daemons in child mode) must not talk to our service manager.
            for k in ENV:
                os.environ.pop(k, None)
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.sock is not None

    def send(self, *fields: str) -> bool:
        if self.sock is None:
            return False
        text = "\n".join(f.replace("\n", " ") for f in fields)
        try:
            self.sock.sendto(text.encode("utf-8", "replace"), self.address)
            return True
        except OSError as e:                 # the manager went away: say so once, keep running
            if not self._failed:
                self.log(f"driverd: warning: cannot notify the service manager at {self.address!r}: {e.strerror}")
                self._failed = True
            return False

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
