"""The host lock: one driverd transaction at a time on a node.

An exclusive `flock` on <root>/<state.dir>/lock. The kernel releases it when the holder exits or
dies (kill -9 included), so there is no stale pid file to clean up; a systemd instance and a driver
container that mount the same /var/lib/driverd exclude each other. The holder writes who it is
(pid, command, since) into the file so that the loser can name it. Readers (detect, plan, status)
take no lock.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time

from driverd.datatypes import dataclass
from driverd.errors import DriverdError, EXIT_BLOCKED

LOCK_NAME = "lock"


class LockHeld(DriverdError):
    subject = "lock"
    exit_code = EXIT_BLOCKED


@dataclass
class HostLock:
    """The host lock file under the state directory, as one driverd command takes or probes it."""
    root: object
    state_dir: str
    command: str
    fd: int | None = None

    @property
    def hostpath(self) -> str:
        return f"{self.state_dir.rstrip('/')}/{LOCK_NAME}"

    def holder(self) -> dict | None:
        """Who holds (or last held) the lock, from the file's contents; None when unknown."""
        text = self.root.read_text(self.hostpath)
        try:
            info = json.loads(text) if text else None
        except ValueError:
            return None
        return info if isinstance(info, dict) else None

    def held_by(self) -> dict | None:
        """The live holder, for readers (status): probed with a shared, non-blocking flock that is
        dropped at once; the file's contents alone may name a holder that died."""
        real = self.root.safe_real(self.hostpath)
        if real is None:
            return None
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        except OSError:
            return self.holder() or {"pid": None, "command": "unknown"}
        finally:
            os.close(fd)

    def acquire(self, wait_s: float | None = None) -> "HostLock":
        """Take the lock; with `wait_s` wait up to that long for the holder, else fail at once."""
        try:
            with self.root.at(self.hostpath, create=True) as (dfd, leaf):       # confined to the root
                fd = os.open(leaf, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        except OSError as e:
            ro = " (the file system is read-only)" if e.errno == errno.EROFS else ""
            raise LockHeld(f"cannot take the host lock {self.hostpath}: {e.strerror}{ro}; nothing was changed",
                           cause=str(e), fix=f"driverd needs {self.state_dir} writable under the root (in the driver "
                           "container, mount the host's /var/lib/driverd read-write)") from None
        deadline = time.monotonic() + (wait_s or 0)
        grace = time.monotonic() + 3.0
        delay = 0.05
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise
            # A lock with no holder named in it is a reader's momentary probe (status) or a holder
            # that is just starting: give it a few seconds before calling it held.
            # The holder is read once: one read names it in the error, as a second could find it
            # releasing (its name already truncated away) and name nobody.
            now, held_by = time.monotonic(), self.holder()
            if now >= deadline and (now >= grace or (held_by or {}).get("pid")):
                os.close(fd)
                raise self._held_error(wait_s, held_by)
            # flock has no timed wait; a short, growing sleep keeps a waiting daemon near idle.
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
        info = {"pid": os.getpid(), "command": self.command, "since": time.time(), "host": socket.gethostname()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)       # nobody holds it now; the next holder writes itself in
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "HostLock":
        if self.fd is None:
            self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _held_error(self, wait_s: float | None, h: dict | None) -> LockHeld:
        if h:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0)))
            who = f"pid {h.get('pid')} ({h.get('command')}) since {since}"
        else:
            who = "another driverd process (it has not written its name yet)"
        waited = f" after waiting {wait_s:g}s" if wait_s else ""
        return LockHeld(f"another driverd transaction holds the host lock{waited}: {who}",
                        cause=f"{self.hostpath} is locked; one change to a node at a time",
                        fix="wait for it to finish (driverd status shows it), or pass --wait SECONDS",
                        details={"holder": h, "lock": self.hostpath})
