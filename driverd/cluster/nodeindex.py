"""The coordinator's picture of the fleet's nodes, kept from its informer's events: each node's view
(`model.NodeView`), the Node object a decision saw (an admission is written against its
resourceVersion), the nodes being upgraded and those an operator asked to retry, and for each rollout
its targets sorted for admission (`admission.Targets`).

A pass reads again only the nodes that changed since the last one (the informer names them as their
events arrive; a re-list, which reports only the nodes that are gone, makes the next pass read them
all), so its cost follows what changed. Reading every node of the fleet in every pass, and deciding
every rollout over all of them, made the coordinator's CPU per node grow with the fleet (issue 47).
With DriverPools, the pools' members (`Membership`, what `pools.assign` says of every node) are kept
the same way, so a pool whose members did not change need not be looked at again.
"""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from driverd.cluster import model as m
from driverd.cluster import pools as pl
from driverd.cluster.admission import Targets

Member = Callable[[m.NodeView], bool]       # whether a node is one of a rollout's targets


class Source(Protocol):
    """What the index reads: the nodes' informer (Informer.get, Informer.snapshot)."""

    def get(self, name: str) -> dict | None: ...

    def snapshot(self) -> list[dict]: ...


class NodeIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self._everything = True               # read every node on the next sync: a fresh index, a re-list
        self.objs: dict[str, dict] = {}
        self.views: dict[str, m.NodeView] = {}
        self.active: dict[str, m.NodeView] = {}   # in an active state (holds a rollout's slot)
        self.retry: set[str] = set()               # driverd.io/retry set: what may reopen a Failed rollout
        self._targets: dict[str, tuple[object, Member, Targets]] = {}     # rollout ident -> its targets
        self._used: set[str] = set()          # the rollouts whose targets this pass asked for
        self._members: Membership | None = None   # the pools' members, while there are pools

    def __len__(self) -> int:
        return len(self.views)

    # -- the informer's side (its thread) --------------------------------------------------------------
    def changed(self, kind: str, obj: dict) -> None:
        """An informer event: that node is read again on the next sync (every node after a re-list)."""
        name = (obj.get("metadata") or {}).get("name")
        with self._lock:
            if kind == "SYNC" or not name:
                self._everything = True
            else:
                self._dirty.add(name)

    # -- the pass's side ---------------------------------------------------------------------------
    def sync(self, source: Source) -> list[str]:
        """Bring the index to what `source` holds now, reading the nodes that changed; their names."""
        with self._lock:
            dirty, everything = self._dirty, self._everything
            self._dirty, self._everything = set(), False
        if everything:
            now = {(o.get("metadata") or {}).get("name", ""): o for o in source.snapshot()}
            names: Iterable[str] = now.keys() | self.objs.keys()
            get: Callable[[str], dict | None] = now.get
        else:
            names, get = dirty, source.get
        changed = []
        for name in names:
            obj = get(name)
            before = self.objs.get(name)
            if obj is None:
                if before is not None:
                    self._drop(name)
                    changed.append(name)
            elif before is None or not _same_version(before, obj):
                self._set(name, obj)
                changed.append(name)
        for _, member, t in self._targets.values():
            for name in changed:
                v = self.views.get(name)
                if v is not None and member(v):
                    t.put(v)
                else:
                    t.discard(name)
        if self._members is not None:
            for name in changed:
                self._members.put(name, self.views.get(name))
        return changed

    def _set(self, name: str, obj: dict) -> None:
        v = m.NodeView.from_node(obj)
        self.objs[name], self.views[name] = obj, v
        if v.active:
            self.active[name] = v
        else:
            self.active.pop(name, None)
        if v.retry:
            self.retry.add(name)
        else:
            self.retry.discard(name)

    def _drop(self, name: str) -> None:
        del self.objs[name], self.views[name]
        self.active.pop(name, None)
        self.retry.discard(name)

    def obj(self, name: str) -> dict | None:
        return self.objs.get(name)

    def targets(self, r: m.Rollout, key: object, member: Member) -> Targets:
        """Rollout `r`'s targets (the nodes `member` says it may take), kept up to date by sync() from
        now on; sorted from every node again when `key` — what decides membership: the rollout's spec,
        the pools — differs from the last pass's."""
        self._used.add(r.ident)
        kept = self._targets.get(r.ident)
        if kept is not None and kept[0] == key:
            return kept[2]
        t = Targets(r)
        for v in self.views.values():
            if member(v):
                t.put(v)
        self._targets[r.ident] = (key, member, t)
        return t

    def membership(self, pools: Sequence[pl.Pool]) -> Membership:
        """The pools' members, kept up to date by sync() from now on; assigned from every node again when
        the pools (what decides membership: their names, uids, generations and specs) differ from the
        last pass's. No pools: nothing is kept (no node's change pays for an assignment nobody reads)."""
        if not pools:
            self._members = None
            return Membership((), ())
        kept = self._members
        if kept is None or kept.pools != tuple(pools):
            kept = self._members = Membership(tuple(pools), self.views.values())
        return kept

    def forget_unused(self) -> None:
        """At the end of a pass: stop keeping the targets of the rollouts it did not decide on (ended,
        deleted, invalid), which every node's change would otherwise update."""
        for ident in [k for k in self._targets if k not in self._used]:
            del self._targets[ident]
        self._used = set()

    def named(self, names: Iterable[str]) -> Iterator[m.NodeView]:
        """The views of the nodes of these names that exist."""
        return (self.views[n] for n in names if n in self.views)


# Members' versions are never reused, not even by another Membership (pools changed, Lease lost and
# taken again): a version a plan was cached under means those members exactly.
_ticks = itertools.count(1)


class Membership:
    """pools.assign's answer kept node by node: each node's selecting pools, each pool's members and
    the overlapped nodes it selects, and for each pool a version that moves whenever anything of it a
    plan reads (its members' views, its overlapped nodes) may have changed."""

    def __init__(self, pools: tuple[pl.Pool, ...], views: Iterable[m.NodeView]) -> None:
        self.pools, self._list = pools, list(pools)
        self.selected: dict[str, tuple[str, ...]] = {}       # node -> the pools that select it, in pool order
        self.members: dict[str, dict[str, m.NodeView]] = {p.name: {} for p in pools}
        self.overlapped: dict[str, set[str]] = {p.name: set() for p in pools}
        self.free: dict[str, m.NodeView] = {}
        self.version: dict[str, int] = {p.name: next(_ticks) for p in pools}
        self._sorted: dict[str, list[str]] = {}            # pool -> its members' names sorted, until one comes or goes
        for v in views:
            self.put(v.name, v)

    def put(self, name: str, v: m.NodeView | None) -> None:
        """Node `name` is now `v` (None: gone)."""
        before = self.selected.pop(name, None)
        after = tuple(p.name for p in pl.selecting(self._list, v.labels)) if v is not None else None
        if before is not None:
            self._leave(name, before, moved=before != after)
        if v is None or after is None:
            return
        self.selected[name] = after
        if not after:
            self.free[name] = v
        elif len(after) == 1:
            if before != after:
                self._sorted.pop(after[0], None)
            self.members[after[0]][name] = v
        else:
            for p in after:
                self.overlapped[p].add(name)
        for p in after:
            self.version[p] = next(_ticks)

    def _leave(self, name: str, before: tuple[str, ...], *, moved: bool) -> None:
        if not before:
            del self.free[name]
        elif len(before) == 1:
            del self.members[before[0]][name]
            if moved:
                self._sorted.pop(before[0], None)
        else:
            for p in before:
                self.overlapped[p].discard(name)
        for p in before:
            self.version[p] = next(_ticks)

    def of(self, pool: str) -> pl.Assignment:
        """What pools.assign says of `pool` (its members, its overlapped nodes and conflicts) and nothing of
        the other pools: all pools.plan and pools.status read for it."""
        names = self._sorted.get(pool)
        if names is None:
            names = self._sorted[pool] = sorted(self.members[pool])
        mine = self.members[pool]
        over = {n: list(self.selected[n]) for n in sorted(self.overlapped[pool])}
        conflicts: dict[str, list[str]] = {}
        for n, ps in over.items():
            for q in ps:
                if q != pool:
                    conflicts.setdefault(q, []).append(n)
        return pl.Assignment({pool: [mine[n] for n in names]}, over, [], {pool: conflicts})

    def assignment(self) -> pl.Assignment:
        """pools.assign over every node, from what is kept (the whole fleet: not for a pass)."""
        over = {n: list(ps) for n, ps in sorted(self.selected.items()) if len(ps) > 1}
        conflicts: dict[str, dict[str, list[str]]] = {p.name: {} for p in self.pools}
        for n, ps in over.items():
            for p in ps:
                for q in ps:
                    if q != p:
                        conflicts[p].setdefault(q, []).append(n)
        return pl.Assignment({p.name: [self.members[p.name][n] for n in sorted(self.members[p.name])]
                              for p in self.pools}, over, [self.free[n] for n in sorted(self.free)], conflicts)


def _same_version(a: dict, b: dict) -> bool:
    rv = (a.get("metadata") or {}).get("resourceVersion")
    return a is b or (rv is not None and rv == (b.get("metadata") or {}).get("resourceVersion"))
