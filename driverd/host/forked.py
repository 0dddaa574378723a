"""A function's answer made in a forked child: its JSON comes back down a pipe.

For a process with one thread only (`can_fork()`): the child already holds every module its parent
imported, so it starts at once and runs on another core while the parent goes on (NVML's report in
`detect`, host/nvml.py; a share of every process's open files on a host with many, host/procscan.py).
The child closes everything of the parent's but its pipe (a host lock, sockets: a child left waiting must
not hold them after the parent has gone), takes the default action on a signal (the parent's handlers,
Ctrl-C's clean-up, are not the child's) and leaves by `_exit` (never the parent's atexit handlers or
stdio buffers).
"""
from __future__ import annotations

import json
import os

TYPE_CHECKING = False           # not typing's: detect forks before it would otherwise import it
if TYPE_CHECKING:
    from typing import Any, Callable


class ChildFailed(Exception):
    """The child gave no answer: the reason in words (no answer in time, its exit status, a signal)."""


def can_fork() -> bool:
    """Whether this process may fork: it has one thread (a fork copies only the calling thread, and a lock
    another one holds would stay held in the child for ever)."""
    import threading
    return hasattr(os, "fork") and threading.active_count() == 1


class Forked:
    """A child making `fn()`'s answer: `answer()` waits for it, `dismiss()` kills it unheard."""
    __slots__ = ("pid", "_r")

    def __init__(self, pid: int, r: int) -> None:
        self.pid, self._r = pid, r

    def answer(self, timeout: float) -> Any:
        """The child's answer (what `fn` returned, through JSON); ChildFailed when there is none within
        `timeout` s (the child is killed), or the child failed. The child is reaped either way."""
        import selectors
        import signal
        import time
        chunks: list[bytes] = []
        deadline = time.monotonic() + timeout
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self._r, selectors.EVENT_READ)
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not sel.select(left):
                        os.kill(self.pid, signal.SIGKILL)
                        os.waitpid(self.pid, 0)
                        raise ChildFailed(f"no answer in {timeout:g} s")
                    chunk = os.read(self._r, 65536)
                    if not chunk:
                        break
                    chunks.append(chunk)
        finally:
            os.close(self._r)
        _, status = os.waitpid(self.pid, 0)
        if status:
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            raise ChildFailed(f"killed by signal {sig}" if sig else f"exit status {os.waitstatus_to_exitcode(status)}")
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise ChildFailed(f"{e.__class__.__name__}: {e}") from None

    def dismiss(self) -> None:
        """The answer is not wanted after all: the child is killed and reaped, so that a call of its that
        hangs does not hold this process."""
        import signal
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.answer(0)
        except ChildFailed:
            pass


def fork(fn: Callable[[], Any]) -> Forked:
    """Start a child that sends `fn()`'s answer (JSON-serialisable) back; OSError where no pipe or child
    could be made. Only where can_fork() says so."""
    import signal
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:                                    # the child: one answer down the pipe, then gone
        code = 0
        try:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            _close_all_but(w)
            data = json.dumps(fn()).encode()
            while data:
                data = data[os.write(w, data):]
        except BaseException:                       # noqa: BLE001 -- whatever it was, the parent says so
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return Forked(pid, r)


def _close_all_but(keep: int) -> None:
    """Close every file descriptor above stderr but `keep`: those /proc/self/fd lists (a container's limit
    of 1,048,576 would be as many close() calls where the kernel has no close_range)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except (OSError, ValueError):
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        return
    for fd in fds:
        if fd > 2 and fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass                    # the directory's own descriptor, closed by now
