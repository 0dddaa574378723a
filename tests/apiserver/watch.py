"""Watchers: one queue per open watch, fed by the store under its lock, drained by the connection's thread."""
from __future__ import annotations

import threading
from collections import deque

ADDED, MODIFIED, DELETED, BOOKMARK, ERROR = "ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"


class Event:
    __slots__ = ("key", "namespace", "obj", "old", "rv", "type")

    def __init__(self, rv: int, type_: str, key, namespace: str, obj: dict, old: dict | None):
        self.rv, self.type, self.key, self.namespace, self.obj, self.old = rv, type_, key, namespace, obj, old


class Watcher:
    """Events of one resource (optionally one namespace), filtered by selectors when read.

    ``next(timeout)`` returns ``(type, obj)`` or None on timeout; after ``stop()`` it returns ``("CLOSED", None)``.
    Objects are the store's own (shared, never mutated): copy before changing them."""

    def __init__(self, store, res, namespace, label_selector=None, field_selector=None):
        self.store, self.res, self.namespace = store, res, namespace
        self.label_selector, self.field_selector = label_selector, field_selector
        self._q: deque = deque()
        self._cv = threading.Condition(threading.Lock())
        self.closed = False
        self.last_rv = 0

    # called by the store, under its lock
    def push(self, ev) -> None:
        # Filter here, in the writer's thread: a fleet holds one watch per node on its own Node, and
        # waking every one of them for every change (to discard it) costs O(watchers) thread switches.
        relevant = ev.type in (BOOKMARK, ERROR) or self._match(ev.obj) or (ev.old is not None and self._match(ev.old))
        with self._cv:
            if not relevant:
                if ev.rv:
                    self.last_rv = max(self.last_rv, ev.rv)
                return
            self._q.append(ev)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()
        self.store._unwatch(self)

    def pending(self) -> int:
        return len(self._q)

    def _match(self, obj) -> bool:
        if obj is None:
            return False
        if self.label_selector is not None and not self.label_selector.matches((obj.get("metadata") or {}).get("labels")):
            return False
        return self.field_selector is None or self.field_selector.matches(obj)

    def _filter(self, ev):
        if ev.type in (BOOKMARK, ERROR):
            return ev.type, ev.obj
        new_ok = self._match(ev.obj)
        if ev.type == ADDED:
            return (ADDED, ev.obj) if new_ok else None
        if ev.type == DELETED:
            return (DELETED, ev.obj) if new_ok else None
        old_ok = self._match(ev.old) if ev.old is not None else new_ok
        if new_ok and old_ok:
            return MODIFIED, ev.obj
        if new_ok:
            return ADDED, ev.obj
        if old_ok:
            return DELETED, ev.obj
        return None

    def next(self, timeout: float | None = None):
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cv:
                while not self._q and not self.closed:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return None
                    self._cv.wait(left)
                if self.closed and not self._q:
                    return ("CLOSED", None)
                ev = self._q.popleft()
            if ev.rv:
                self.last_rv = max(self.last_rv, ev.rv)
            out = self._filter(ev)
            if out is not None:
                return out[0], self.store._encode(self.res, out[1]) if out[1] is not None else None

    def __iter__(self):
        while True:
            item = self.next()
            if item is None or item[0] == "CLOSED":
                return
            yield item
