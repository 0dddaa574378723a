"""One admitting writer at a time: a coordination.k8s.io/v1 Lease among the node daemons.

The holder renews every `duration/3`; a holder that stops renewing (killed, partitioned) is dead
once `leaseDurationSeconds` have passed on *this* daemon's clock since it last saw the Lease change
(as client-go's leader election judges it): the holder's `renewTime` is written by another
machine's clock, and comparing it with ours would let a skewed clock make two holders. Any daemon
may then take the Lease - the write carries the resourceVersion it read, so of two daemons taking
it at once exactly one wins (the other gets 409 and stays a follower). Followers learn of a change
through a watch on the Lease, not by polling it.
"""
from __future__ import annotations

import threading
import time

from driverd.cluster.kube import Kube, KubeError, lease_path, micro_time

LEASE_NAME = "driverd-rollout"
LEASE_DURATION_S = 15           # the product's: a dead holder is replaced after this (deploy/'s policy allows 1..60)


class Lease:
    def __init__(self, kube: Kube, namespace: str, identity: str, *, name: str = LEASE_NAME,
                 duration_s: int = LEASE_DURATION_S) -> None:
        self.kube, self.ns, self.identity, self.name, self.duration_s = kube, namespace, identity, name, duration_s
        self.held_until = 0.0           # local clock: until when we may act as the holder
        self.acquired_at = 0.0          # local clock: when the last successful take or renewal began
        self.last: dict | None = None    # the Lease as last seen
        self._seen: tuple | None = None  # the holder's record as last observed …
        self._seen_at = 0.0              # … and when we observed it change (local monotonic clock)
        self._lock = threading.Lock()     # one take-or-renew at a time (the coordinator renews in a thread)

    @property
    def path(self) -> str:
        return lease_path(self.ns, self.name)

    def holding(self, now: float | None = None) -> bool:
        return (now or time.monotonic()) < self.held_until

    def expires_in(self, lease: dict | None = None, now: float | None = None) -> float:
        """Seconds until the current holder's claim lapses (<= 0: it has, or there is none), judged
        by when this daemon last saw the holder's record change, never by the times in it."""
        spec = ((lease or self.last) or {}).get("spec") or {}
        if not spec.get("holderIdentity"):
            return 0.0
        now = time.monotonic() if now is None else now
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("acquireTime"),
                  spec.get("leaseTransitions"), spec.get("leaseDurationSeconds"))
        if record != self._seen:
            self._seen, self._seen_at = record, now
        return self._seen_at + int(spec.get("leaseDurationSeconds") or self.duration_s) - now

    def try_acquire(self) -> bool:
        """Take or renew the Lease; True while we hold it. One GET + at most one write."""
        with self._lock:
            return self._try_acquire()

    def _try_acquire(self) -> bool:
        t0 = time.monotonic()
        now = micro_time()
        cur = self.kube.find(self.path)
        if cur is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.ns},
                    "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration_s,
                             "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
            try:
                self.last = self.kube.create(lease_path(self.ns), body)
            except KubeError as e:
                if e.status == 409:          # someone created it first
                    return False
                raise
            self.acquired_at, self.held_until = t0, t0 + self.duration_s * 2 / 3
            return True
        self.last = cur
        spec = cur.setdefault("spec", {})
        mine = spec.get("holderIdentity") == self.identity
        if not mine and self.expires_in(cur) > 0:
            self.held_until = 0.0
            return False
        if not mine:
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            spec["acquireTime"] = now
        spec.update(holderIdentity=self.identity, leaseDurationSeconds=self.duration_s, renewTime=now)
        try:
            self.last = self.kube.replace(self.path, cur)
        except KubeError as e:
            if e.status == 409:              # another daemon wrote it between our read and write
                self.held_until = 0.0
                return False
            raise
        self.acquired_at, self.held_until = t0, t0 + self.duration_s * 2 / 3
        return True

    def release(self) -> None:
        """Give the Lease up on a clean exit so that another daemon takes over at once."""
        if not self.holding():
            return
        self.held_until = 0.0

        def mutate(cur):
            spec = cur.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return None
            spec["holderIdentity"] = None
            spec["renewTime"] = None
            return cur
        try:
            self.kube.update(self.path, mutate, attempts=3)
        except Exception:       # best effort: the Lease lapses on its own
            pass
