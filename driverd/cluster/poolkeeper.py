"""The coordinator's part for DriverPools (cluster/pools.py decides, this carries it out): in every
pass of the Lease holder, for each pool, mark a revision the pool no longer wants `Superseded`, create
the next revision's DriverRollout (owned by the pool, its spec the pool's), and write the pool's
status — desired driver, nodes on it, nodes behind and why, the Converged and Overlap conditions —
when it changed (at most once per `status_interval_s` unless a condition changed). It also tells
the coordinator which nodes each rollout may take (`taker`, given the pools this pass read): a pool's
rollout its pool's members only, any other rollout only nodes in no pool.

A pass looks again only at the pools something changed for (issue 47): the members are kept node by
node (nodeindex.Membership), and a pool's plan is made again only when its members, its object or its
rollouts changed — or when the last one carried the pass's time (a condition that changed) or asked
for a write other than the status.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable

from driverd.cluster import events
from driverd.cluster import model as m
from driverd.cluster import pools as pl
from driverd.cluster.informer import Informer
from driverd.cluster.kube import Kube, KubeError, now_rfc3339, pool_path, rollout_path
from driverd.cluster.nodeindex import Membership, NodeIndex


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
        self._plans: dict[str, tuple[tuple, pl.PoolPlan]] = {}    # pool -> (what its plan was made from, the plan)
        self.again = False                        # a status write was held back: look again soon

    def act(self, index: NodeIndex) -> bool:
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
        kept = index.membership(good)
        if not good:
            self._plans = {}
            return True             # no pool to assign the nodes to: every rollout takes nodes in no pool
        plans: dict[str, tuple[tuple, pl.PoolPlan]] = {}
        for pool in good:
            plan = self._plan(pool, kept, self.rollouts.snapshot(), now, plans)
            for old in plan.supersede:
                self.write_rollout_status(old, {
                    "phase": pl.SUPERSEDED, "reason": "PoolChanged", "observedGeneration": old["metadata"].get("generation"),
                    "message": f"pool {pool.name} now wants driver {pool.target}: the next revision replaces this "
                               "rollout (nodes not yet unloading are given back; those unloading finish first)"})
            if plan.create is not None:
                self._create(pool, plan.create)
            self._status(pool.obj, plan.status)
        self._plans = plans
        return True

    def _plan(self, pool: pl.Pool, kept: Membership, rollouts: list[dict], now: str,
              plans: dict[str, tuple[tuple, pl.PoolPlan]]) -> pl.PoolPlan:
        """pools.plan for `pool`, the last pass's when nothing it reads changed since (kept in `plans`)."""
        key = _made_from(pool, kept, rollouts)
        last = self._plans.get(pool.name)
        if key is not None and last is not None and last[0] == key:
            plans[pool.name] = last
            return last[1]
        plan = pl.plan(pool, kept.of(pool.name), rollouts, now=now, previous=pool.obj.get("status"))
        # kept only where making it again later would give this very plan: not when a condition took
        # `now` (it changed: the pass that writes it gives the time), nor when it writes more than the
        # status (a create or a supersede is made afresh each pass, as before, until the rollouts show it)
        if key is not None and plan.create is None and not plan.supersede and \
                pl.timeless(plan.status, pool.obj.get("status")):
            plans[pool.name] = (key, plan)
        return plan

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


def _made_from(pool: pl.Pool, kept: Membership, rollouts: list[dict]) -> tuple | None:
    """What pools.plan reads for `pool`, as versions: the pool (its object's resourceVersion: spec and the
    status written last), its members' version, and the rollouts it owns or that are named for it (the
    next revision's number); None when something has no resourceVersion to tell a change by."""
    rv = (pool.obj.get("metadata") or {}).get("resourceVersion")
    mine = []
    for o in rollouts:
        md = o.get("metadata") or {}
        if (pool.uid and (pl.owner(o) or ("", ""))[1] == pool.uid) or (md.get("labels") or {}).get(pl.L_POOL) == pool.name:
            mine.append((md.get("name") or "", md.get("uid") or "", md.get("resourceVersion")))
    if rv is None or any(r[2] is None for r in mine):
        return None
    return pool, rv, kept.version[pool.name], tuple(sorted(mine))


def _same(a: dict, b: dict) -> bool:
    strip = ("updated",)
    return json.dumps({k: v for k, v in a.items() if k not in strip}, sort_keys=True, default=str) == \
        json.dumps({k: v for k, v in b.items() if k not in strip}, sort_keys=True, default=str)
