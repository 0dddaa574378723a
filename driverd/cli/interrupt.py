"""SIGTERM handled as Ctrl-C for the commands that do long work outside a transaction (build,
build-matrix, demo): their clean-up (a cell's build tree, make and its compilers, the demo's
cluster processes) runs on `kill`, `systemctl stop` and `docker stop` as it does on Ctrl-C.

Transactions are left alone: a signal there kills the process and the journal makes the run
resumable (docs/architecture.md, "Crash safety inside steps")."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_INTERRUPTED = 130          # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_TERMINATED = 143           # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so that every clean-up written for Ctrl-C runs."""


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, frame) -> None:
        if fired:       # the clean-up is running: a second SIGTERM must not cut it short
            return
        fired.append(signum)
        raise Terminated()
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
