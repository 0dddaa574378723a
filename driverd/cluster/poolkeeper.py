"""The coordinator's part for DriverPools (cluster/pools.py decides, this carries it out): in every
pass of the Lease holder, for each pool, mark a revision the pool no longer wants `Superseded`, create
the next revision's DriverRollout (owned by the pool, its spec the pool's), and write the pool's
status — desired driver, nodes on it, nodes behind and why, the Converged and Overlap conditions —
when it changed (at most once per `status_interval_s` unless a condition changed). It also tells
the coordinator which nodes each rollout may take (`taker`, given the pools this pass read): a pool's
rollout its pool's members only, any other rollout only nodes in no pool.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection

from driverd.cluster import events
from driverd.cluster import model as m
from driverd.cluster import pools as pl
from driverd.cluster.informer import Informer
from driverd.cluster.kube import Kube, KubeError, now_rfc3339, pool_path, rollout_path


class PoolKeeper:
    def __init__(self, kube: Kube, identity: str, *, pools: Informer, rollouts: Informer,
                 write_rollout_status: Callable[[dict, dict], None], log: Callable[[str], None],
                 clock: Callable[[], float] = time.time, status_interval_s: float = 1.0) -> None:
        self.kube, self.identity, self.pools, self.rollouts = kube, identity, pools, rollouts
        self.write_rollout_status, self.log, self.clock = write_rollout_status, log, clock
        self.status_interval_s = status_interval_s
        self.current: list[pl.Pool] = []
        self._written: dict[str, tuple[dict, float]] = {}
        self._refused: set[str] = set()          # rollout names whose creation the API refused (said once)
        self.again = False                        # a status write was held back: look again soon

    def act(self, views: Collection[m.NodeView]) -> bool:
        """One pass over the pools; False while the DriverPools are not read yet (then which rollout
        may take which node is not known, and the coordinator admits nothing)."""
        self.again = False
        if not self.pools.synced.is_set():
            return False
        now = now_rfc3339(self.clock())
        objs = self.pools.snapshot()
        good, bad = pl.read(objs)
        self.current = good
        for o in objs:
            name = (o.get("metadata") or {}).get("name", "")
            if name in bad:
                self._status(o, pl.invalid_status(o, bad[name], now=now))
        if not good:
            return True             # no pool to assign the nodes to: every rollout takes nodes in no pool
        a = pl.assign(good, views)
        for pool in good:
            plan = pl.plan(pool, a, self.rollouts.snapshot(), now=now, previous=pool.obj.get("status"))
            for old in plan.supersede:
                self.write_rollout_status(old, {
                    "phase": pl.SUPERSEDED, "reason": "PoolChanged", "observedGeneration": old["metadata"].get("generation"),
                    "message": f"pool {pool.name} now wants driver {pool.target}: the next revision replaces this "
                               "rollout (nodes not yet unloading are given back; those unloading finish first)"})
            if plan.create is not None:
                self._create(pool, plan.create)
            self._status(pool.obj, plan.status)
        return True

    def taker(self, rollout: dict) -> Callable[[dict], bool]:
        """Whether `rollout` may take a node with these labels, given the pools (pools.takes)."""
        return pl.taker(rollout, self.current)

    def _create(self, pool: pl.Pool, body: dict) -> None:
        name = body["metadata"]["name"]
        try:
            new = self.kube.create(rollout_path(), body)
        except KubeError as e:
            if e.status == 409:          # made meanwhile (by us a moment ago, or another object of that name)
                if name not in self._refused and (pl.owner(self.kube.get(rollout_path(name))) or ("", ""))[1] != pool.uid:
                    self._refused.add(name)
                    self.log(f"driverd cluster: pool {pool.name}: a DriverRollout named {name} exists and is not the "
                             "pool's: delete or rename it")
                return
            if name not in self._refused:
                self._refused.add(name)
                self.log(f"driverd cluster: pool {pool.name}: cannot create rollout {name}: {e.one_line()}")
            return
        self.rollouts.put(new)
        message = f"created for pool {pool.name}: driver {pool.target} (revision {pl.revision(new)}, the pool's policy)"
        self.log(f"driverd cluster: rollout {name} {message}")
        events.record(self.kube, {"apiVersion": pl.API_VERSION, "kind": "DriverRollout", "name": name,
                                  "uid": new["metadata"].get("uid")}, "PoolRollout", message, warning=False,
                      instance=self.identity, log=self.log, now=self.clock())

    def _status(self, obj: dict, status: dict) -> None:
        name, key = obj["metadata"]["name"], m.ident(obj)
        last, when = self._written.get(key, (obj.get("status") or {}, 0.0))
        if _same(last, status):
            return
        conds = lambda st: [(c.get("type"), c.get("status"), c.get("reason")) for c in st.get("conditions") or []]
        if conds(last) == conds(status) and time.monotonic() - when < self.status_interval_s:
            self.again = True
            return
        try:
            new = self.kube.patch(pool_path(name, status=True), {"status": dict(status, updated=now_rfc3339(self.clock()))})
            self.pools.put(new)
        except KubeError as e:
            if e.not_found:
                return
            raise
        self._written[key] = (status, time.monotonic())


def _same(a: dict, b: dict) -> bool:
    strip = ("updated",)
    return json.dumps({k: v for k, v in a.items() if k not in strip}, sort_keys=True, default=str) == \
        json.dumps({k: v for k, v in b.items() if k not in strip}, sort_keys=True, default=str)
