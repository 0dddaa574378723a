"""Observations: the places that fetch and build packages say what happened (how long, from where,
how it failed); whoever cares subscribes. The daemon subscribes its Prometheus metrics
(driverd.daemon.metrics); a one-shot command has no subscriber and pays for one empty-list check.

Events and their fields:
    package.fetch   source (cache | repository | build | none), result (ok | error), cache (hit | miss),
                    reason (on error: not-found, index, download, verify, build, io, unexpected),
                    seconds, package (the file name, on success)
    package.build   result (built | cached | failed), reason (on failure: headers, source, compile,
                    check, toolchain, sign, pack, usage, unexpected), seconds, cell

Standard library only; a subscriber that raises is dropped from that event, never the caller's
failure.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

Subscriber = Callable[[str, dict], None]

_subscribers: list[Subscriber] = []
_lock = threading.Lock()


def subscribe(fn: Subscriber) -> Callable[[], None]:
    """Add `fn(event, fields)`; returns the function that removes it again."""
    with _lock:
        _subscribers.append(fn)

    def unsubscribe() -> None:
        with _lock:
            if fn in _subscribers:
                _subscribers.remove(fn)
    return unsubscribe


def emit(event: str, **fields: Any) -> None:
    if not _subscribers:
        return
    with _lock:
        subs = list(_subscribers)
    for fn in subs:
        try:
            fn(event, fields)
        except Exception:         # metrics must never turn a fetch into a failure
            pass
