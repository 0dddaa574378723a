"""A list-then-watch cache of one kind of object (the informer pattern): one LIST, then one long
WATCH from its resourceVersion, resumed from the last seen resourceVersion (bookmarks keep it
fresh) when the server closes it; a 410 Gone (history compacted, or the API server restarted)
starts over with a LIST. Every change calls `on_change`. No polling: idle costs one open connection.
"""
from __future__ import annotations

import random
import threading
from collections.abc import Callable

from driverd.cluster.kube import ClusterError, Kube, KubeError

# The server ends a watch after a time we choose, and we resume from the last resourceVersion: between
# 5 and 10 minutes, drawn for each watch as client-go's reflector does, so that a fleet's daemons, all
# started together, do not come back to the apiserver all at once (a fixed 290 s brought every
# daemon's three watches back in the same second, and cost a long rollout a request per 290 s each).
WATCH_TIMEOUT_S = (300, 600)
MISSING_RETRY_S = 30        # a resource not served (missing_ok): list again after this
# tries while the server does not answer back off from 0.2 s to this: a fleet's daemons do not all
# hammer an API server that is restarting
RETRY_MAX_S = 10.0


class Informer:
    def __init__(self, kube: Kube, path: str, *, labels: str | None = None, fields: str | None = None,
                 on_change: Callable[[str, dict], None] | None = None, name: str = "informer",
                 log: Callable[[str], None] | None = None, missing_ok: bool = False,
                 watch_timeout_s: tuple[int, int] = WATCH_TIMEOUT_S, retry_max_s: float = RETRY_MAX_S) -> None:
        """missing_ok: a resource the server does not serve (404: a CRD not installed) is an empty,
        synced cache, listed again every MISSING_RETRY_S until it is served. watch_timeout_s: the
        range each watch's timeout is drawn from (a short-lived informer ends with its watch).
        retry_max_s: the longest wait between two tries while the server does not answer."""
        self.kube, self.path, self.labels, self.fields = kube, path, labels, fields
        self.on_change = on_change or (lambda kind, obj: None)
        self.name, self.log = name, log or (lambda m: None)
        self.missing_ok = missing_ok
        self.watch_timeout_s, self.retry_max_s = watch_timeout_s, retry_max_s
        self.items: dict[str, dict] = {}
        self.synced = threading.Event()
        self.tried = threading.Event()          # the first list was tried, whatever came of it
        # the last failure of the list or the watch, None once events (or a new list) flow again: while
        # set, the cache may be behind the server (a watch refused, the API server gone)
        self.error: str | None = None
        self.stop = threading.Event()
        self._rv: str | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> Informer:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.stop.set()

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.items.values())

    def get(self, name: str) -> dict | None:
        with self._lock:
            return self.items.get(name)

    def put(self, obj: dict) -> None:
        """Our own write's answer, so that we act on it before its watch event arrives."""
        with self._lock:
            k = self._key(obj)
            if _newer(obj, self.items.get(k)):
                self.items[k] = obj

    def _key(self, obj: dict) -> str:
        md = obj.get("metadata") or {}
        return f"{md['namespace']}/{md['name']}" if md.get("namespace") else md.get("name", "")

    def _relist(self) -> None:
        lst = self.kube.list(self.path, labels=self.labels, fields=self.fields)
        fresh = {self._key(o): o for o in lst.get("items") or []}
        with self._lock:
            gone = [self.items[k] for k in self.items if k not in fresh]
            self.items = fresh
        self._rv = (lst.get("metadata") or {}).get("resourceVersion")
        self.error = None
        self.synced.set()
        self.tried.set()
        for o in gone:
            self.on_change("DELETED", o)
        self.on_change("SYNC", {})

    def _run(self) -> None:
        delay = 0.2
        while not self.stop.is_set():
            try:
                if self._rv is None:
                    self._relist()
                for ev in self.kube.watch(self.path, resource_version=self._rv, labels=self.labels,
                                          fields=self.fields, timeout_s=random.randrange(*self.watch_timeout_s),
                                          stop=self.stop):
                    if self.stop.is_set():
                        return        # closed: its stream may still bring events, nobody asked for them
                    self.error = None
                    obj = ev.get("object") or {}
                    rv = (obj.get("metadata") or {}).get("resourceVersion")
                    if rv:
                        self._rv = rv
                    if ev["type"] == "BOOKMARK":
                        continue
                    with self._lock:
                        if ev["type"] == "DELETED":
                            self.items.pop(self._key(obj), None)
                        elif _newer(obj, self.items.get(self._key(obj))):
                            self.items[self._key(obj)] = obj
                    self.on_change(ev["type"], obj)
                    delay = 0.2
            except KubeError as e:
                if e.status == 410:
                    self._rv = None           # too old: list again
                    continue
                if e.status == 404 and self.missing_ok:
                    self._missing()
                    continue
                self._failed(e)
                self._sleep(delay)
                delay = min(delay * 2, self.retry_max_s)
            except ClusterError as e:           # connection refused / broken: the API server restarts
                self._failed(e)
                self._sleep(delay)
                delay = min(delay * 2, self.retry_max_s)

    def _failed(self, e: ClusterError) -> None:
        self.error = e.one_line()
        self.tried.set()
        self.log(f"{self.name}: {self.error}")

    def _missing(self) -> None:
        with self._lock:
            gone, self.items = list(self.items.values()), {}
        self._rv = None
        first = not self.synced.is_set()
        self.synced.set()
        self.tried.set()
        for o in gone:
            self.on_change("DELETED", o)
        if first or gone:
            self.on_change("SYNC", {})
        self.stop.wait(MISSING_RETRY_S)

    def _sleep(self, s: float) -> None:
        self.stop.wait(s * (0.5 + random.random()))


def _newer(obj: dict, than: dict | None) -> bool:
    """Whether `obj` is a later version than `than`. resourceVersions are opaque to clients, but
    both this cache's sources (a watch and our own writes' answers) come from one server whose
    versions of one object only grow; a non-numeric one is taken as newer."""
    if than is None:
        return True
    a, b = (obj.get("metadata") or {}).get("resourceVersion"), (than.get("metadata") or {}).get("resourceVersion")
    if a and b and a.isdigit() and b.isdigit():
        return int(a) >= int(b)
    return True
