"""Driver pools: one declarative desired driver per set of nodes (a `DriverPool`, cluster-scoped, group
driverd.io — what NVIDIA's NVIDIADriver resource is to the GPU Operator). Pure: which pool a node
belongs to, which pools overlap, which rollout may take which node, when a pool needs a new rollout,
and what its status says. The coordinator (cluster/poolkeeper.py) acts on it; the node agent and
cluster mode read it to answer preflights and to pick a joining node's driver.

A pool's spec *is* a DriverRollout's spec (driver, flavor, nodeSelector and the rollout policy:
limits, preflight, canary, failure budget, drain, validation, paused); it is read with
`model.Rollout.from_object`, so a pool is valid exactly when a rollout with its spec would be. A
pool's driver reaches its nodes three ways:

- a **joining** node (no driver yet, see cluster/desired.py) installs it directly, before it is ready;
- a node that runs another driver is upgraded by a DriverRollout the coordinator creates for the pool
  (named `<pool>-<revision>`, owned by the pool through a controller ownerReference, its spec a copy
  of the pool's): changing the pool's driver starts the next revision under the pool's own policy;
- a node that comes into the pool later (a label changed) on another driver: a new revision once
  the current one has ended without it.

Overlap is judged on the nodes, as the GPU Operator judges NVIDIADrivers: a node two pools select
belongs to neither — both pools say so in a condition naming the other and the nodes, no rollout of
either takes it, a joining one waits, and neither pool starts a new rollout while they overlap.

Every other DriverRollout (one an operator created, `kubectl driverd rollout start` without
`--pool`) takes only nodes in no pool; the nodes in no pool fall back to `driver.version` of their
configuration, which — like every desired driver — only a joining node applies without admission.
"""
from __future__ import annotations

from collections.abc import Callable

from dataclasses import field

from driverd.cluster import model as m
from driverd.cluster.desired import Desired
from driverd.cluster.states import ACTIVE, DONE, FAILED
from driverd.datatypes import dataclass

KIND = "DriverPool"
API_VERSION = "driverd.io/v1alpha1"
L_POOL = m.PREFIX + "pool"                        # on a pool's DriverRollout: the pool's name
A_REVISION = m.PREFIX + "pool-revision"           # on a pool's DriverRollout: its revision, 1, 2, ...
A_SETTINGS = m.PREFIX + "pool-settings"           # on a pool's DriverRollout: the settings changes it was made for
SUPERSEDED = "Superseded"                         # the phase of a pool's rollout a newer revision replaced
MAX_LISTED = 50


class PoolSpecError(m.SpecError):
    """A pool field that cannot be carried out (the rollout model's SpecError, with the pool's fix)."""


@dataclass(frozen=True)
class Pool:
    """A DriverPool: the driver one set of nodes should run, its spec read as a rollout's."""
    name: str
    uid: str
    generation: int
    spec: m.Rollout                  # the pool's spec read as a rollout: driver, flavor, selector, policy
    obj: dict = field(compare=False, hash=False, repr=False)

    @classmethod
    def from_object(cls, obj: dict) -> Pool:
        md = (obj or {}).get("metadata") or {}
        try:
            spec = m.Rollout.from_object(obj)
        except m.SpecError as e:
            err = PoolSpecError(e.field, str(e).partition(": ")[2] or str(e))
            err.fix = f"correct the DriverPool's spec (kubectl edit driverpool {md.get('name', 'NAME')})"
            raise err from None
        return cls(md.get("name", ""), str(md.get("uid") or ""), int(md.get("generation") or 1), spec, obj)

    @property
    def version(self) -> str:
        return self.spec.driver

    @property
    def flavor(self) -> str:
        return self.spec.flavor

    @property
    def target(self) -> str:
        return self.spec.target

    def selects(self, labels: dict) -> bool:
        return self.spec.selects(labels)

    def runs_desired(self, v: m.NodeView) -> bool:
        """The node runs this pool's driver (the flavour counts only when the pool names one)."""
        return v.driver == self.version and (self.flavor == "auto" or v.flavor == self.flavor)


def read(objs: list[dict]) -> tuple[list[Pool], dict[str, str]]:
    """The pools that can be carried out (by name) and why the others cannot ({name: reason})."""
    good, bad = [], {}
    for o in sorted(objs, key=lambda o: (o.get("metadata") or {}).get("name", "")):
        if (o.get("metadata") or {}).get("deletionTimestamp"):
            continue                 # a pool being deleted declares nothing any more
        try:
            good.append(Pool.from_object(o))
        except m.SpecError as e:
            bad[(o.get("metadata") or {}).get("name", "")] = e.one_line()
    return good, bad


def selecting(pools: list[Pool], labels: dict) -> list[Pool]:
    return [p for p in pools if p.selects(labels)]


def desired_for(labels: dict, pools: list[Pool], config_version: str | None, config_flavor: str) -> Desired:
    """The driver the cluster declares for a node with `labels`: its pool's; in no pool, `driver.version`
    of its configuration; none while two pools select it."""
    sel = selecting(pools, labels)
    if len(sel) > 1:
        return Desired(None, "", "pools " + ", ".join(p.name for p in sel),
                       why=f"pools {' and '.join(p.name for p in sel)} both select this node (overlapping pools "
                           "are refused: change one pool's nodeSelector)")
    if sel:
        return Desired(sel[0].version, sel[0].flavor, f"pool {sel[0].name}")
    return Desired(config_version or None, config_flavor or "auto", "configuration",
                   why="" if config_version else "the node is in no pool and its configuration names no driver.version")


# -- a pool's rollouts ---------------------------------------------------------------------------------
def owner(obj: dict) -> tuple[str, str] | None:
    """(name, uid) of the DriverPool that owns a DriverRollout (its controller ownerReference), or None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith("driverd.io/") and ref.get("controller"):
            return ref.get("name", ""), ref.get("uid", "")
    return None


def revision(obj: dict) -> int:
    try:
        return int(((obj.get("metadata") or {}).get("annotations") or {}).get(A_REVISION) or 0)
    except ValueError:
        return 0


def owned(pool: Pool, rollouts: list[dict]) -> list[dict]:
    """The pool's DriverRollouts, oldest revision first."""
    mine = [o for o in rollouts if (owner(o) or ("", ""))[1] == pool.uid and pool.uid]
    return sorted(mine, key=lambda o: (revision(o), (o.get("metadata") or {}).get("creationTimestamp", "")))


def takes(rollout: dict, labels: dict, pools: list[Pool]) -> bool:
    """Whether DriverRollout `rollout` may take a node with `labels`: it selects the node, and the node
    is a member of the rollout's pool alone — or, for a rollout no pool owns, the node is in no pool."""
    return taker(rollout, pools)(labels)


def taker(rollout: dict, pools: list[Pool]) -> Callable[[dict], bool]:
    """takes() for one rollout over many nodes: the rollout is parsed once (a coordinator's pass asks
    it of every node of the fleet, for every rollout)."""
    try:
        r = m.Rollout.from_object(rollout)
    except m.SpecError:
        return lambda labels: False
    own = owner(rollout)

    def check(labels: dict) -> bool:
        if not r.selects(labels):
            return False
        sel = selecting(pools, labels)
        if own is None:
            return not sel
        return len(sel) == 1 and sel[0].uid == own[1]
    return check


def rollout_object(pool: Pool, rev: int, settings: str = "") -> dict:
    """The DriverRollout of the pool's revision `rev`: its spec a copy of the pool's (the admission policy
    driverd-pool-rollouts holds a node's creation of one to exactly that), owned by the pool. `settings`:
    the digest of the members' waiting settings changes it is made to apply (settings_digest)."""
    name = f"{pool.name[:253 - len(str(rev)) - 1]}-{rev}"
    ann = {A_REVISION: str(rev)} | ({A_SETTINGS: settings} if settings else {})
    return {"apiVersion": API_VERSION, "kind": "DriverRollout",
            "metadata": {"name": name, "labels": {L_POOL: pool.name}, "annotations": ann,
                         "ownerReferences": [{"apiVersion": API_VERSION, "kind": KIND, "name": pool.name,
                                              "uid": pool.uid, "controller": True}]},
            "spec": dict(pool.obj.get("spec") or {})}


@dataclass(frozen=True)
class Assignment:
    """Nodes by pool: `members` (selected by that pool alone), `overlapped` (node -> the pools that
    select it, two or more), `free` (in no pool), and for each pool the other pools it overlaps with
    and on which nodes."""
    members: dict[str, list[m.NodeView]]
    overlapped: dict[str, list[str]]
    free: list[m.NodeView]
    conflicts: dict[str, dict[str, list[str]]]


def assign(pools: list[Pool], views: list[m.NodeView]) -> Assignment:
    members: dict[str, list[m.NodeView]] = {p.name: [] for p in pools}
    overlapped: dict[str, list[str]] = {}
    free: list[m.NodeView] = []
    conflicts: dict[str, dict[str, list[str]]] = {p.name: {} for p in pools}
    for v in sorted(views, key=lambda v: v.name):
        sel = selecting(pools, v.labels)
        if not sel:
            free.append(v)
        elif len(sel) == 1:
            members[sel[0].name].append(v)
        else:
            overlapped[v.name] = [p.name for p in sel]
            for p in sel:
                for q in sel:
                    if q is not p:
                        conflicts[p.name].setdefault(q.name, []).append(v.name)
    return Assignment(members, overlapped, free, conflicts)


@dataclass
class PoolPlan:
    """What the coordinator does for one pool in one pass."""
    create: dict | None = None                      # a DriverRollout to create (the next revision)
    supersede: list[dict] = field(default_factory=list)   # older revisions to mark Superseded
    status: dict = field(default_factory=dict)


def current_rollout(pool: Pool, rollouts: list[dict]) -> dict | None:
    """The pool's latest revision, when it installs the pool's driver (else the next one is due)."""
    mine = owned(pool, rollouts)
    return mine[-1] if mine and _current(pool, mine[-1]) else None


def _ended(obj: dict | None) -> bool:
    return obj is not None and m.ended(obj)


def _current(pool: Pool, obj: dict | None) -> bool:
    """The rollout installs the pool's driver (version and flavour as the pool names them)."""
    spec = (obj or {}).get("spec") or {}
    return obj is not None and spec.get("driver") == pool.version and (spec.get("flavor") or "auto") == pool.flavor


def _seen_by(v: m.NodeView, obj: dict) -> bool:
    """The rollout object (any generation) dealt with the node: its record or its preflight answer names
    the rollout (done, failed, excluded, given back there), or the rollout's status lists it (a node
    whose daemon never answered, one NotReady past the bound). A new revision would only repeat that."""
    md, st = obj.get("metadata") or {}, obj.get("status") or {}
    ident = f"{md.get('name')}/{md.get('uid')}" if md.get("uid") else md.get("name")
    if (v.rollout or "").rpartition("/")[0] == ident:
        return True
    pre = v.preflight or {}
    if (pre.get("rollout") or "").rpartition("/")[0] == ident:
        # A yes (driver needed) from a node the rollout never recorded, under a status that says the
        # rollout completed or failed: the coordinator's own never ends so with a node pending, so the
        # status is not to be believed (issue 44: a node that took the Lease wrote Completed once every
        # node had answered); the next revision takes the node
        return not (pre.get("ok") and pre.get("needed", True) and st.get("phase") in ("Completed", "Failed"))
    return any(e.get("node") == v.name for k in ("preflightFailures", "failedNodes", "notReadyNodes")
               for e in st.get(k) or [] if isinstance(e, dict))


def _behind(pool: Pool, v: m.NodeView) -> bool:
    """A node a rollout must bring to the pool's driver: it has a driver (a joining one installs the
    pool's itself), another one, and nobody asked to leave it out."""
    return v.driver is not None and not pool.runs_desired(v) and not v.skip


def waiting_settings(v: m.NodeView) -> str:
    """The driver settings changes (module parameters, module set, unload policy, ...) the node's daemon
    keeps out until a rollout applies them: the `configuration: ...` part of its driverd.io/waiting."""
    return v.waiting.partition(m.WAITING_SETTINGS)[2]


def settings_digest(pool: Pool, members: list[m.NodeView]) -> str:
    """One digest of what waits on the pool's members that run its driver: a new revision carries a
    ConfigMap edit of the settings to them under the pool's policy (drain, canary, limits), once per edit —
    the same digest after a revision made for it ended means that revision dealt with it (a node that failed
    there, or whose preflight found nothing to change), and another would only repeat it."""
    import hashlib
    import json
    waiting = sorted((v.name, w) for v in members
                     if not v.skip and v.driver is not None and pool.runs_desired(v) and (w := waiting_settings(v)))
    return hashlib.sha256(json.dumps(waiting).encode()).hexdigest()[:16] if waiting else ""


def _next_revision(pool: Pool, rollouts: list[dict]) -> int:
    """The next revision's number: past every rollout named for this pool, its own and those of an earlier
    pool of the same name (deleted and re-created: the garbage collector may not have removed them yet,
    and their names are taken until it has)."""
    named = [revision(o) for o in rollouts if ((o.get("metadata") or {}).get("labels") or {}).get(L_POOL) == pool.name]
    return max(named, default=0) + 1


def plan(pool: Pool, a: Assignment, rollouts: list[dict], *, now: str, previous: dict | None = None) -> PoolPlan:
    """One pass for `pool`: supersede a revision whose driver the pool no longer wants, create the next
    revision when a member on another driver is not covered by the current one — or when members on its
    driver wait for settings no revision was made for — and the pool's status.
    `now`: the time for a condition that changes; `previous`: the status written last."""
    out = PoolPlan()
    mine = owned(pool, rollouts)
    latest = mine[-1] if mine else None
    members = a.members.get(pool.name, [])
    conflicts = a.conflicts.get(pool.name, {})
    if latest is not None and not _current(pool, latest) and not _ended(latest):
        out.supersede.append(latest)
    if latest is not None and _current(pool, latest) and not _ended(latest):
        uncovered: list[m.NodeView] = []                 # it takes newcomers itself
    else:
        cur = latest if latest is not None and _current(pool, latest) else None
        uncovered = [v for v in members if _behind(pool, v) and (cur is None or not _seen_by(v, cur))]
    settings = settings_digest(pool, members)
    made_for = ((latest or {}).get("metadata") or {}).get("annotations", {}).get(A_SETTINGS, "")
    settings_due = bool(settings) and settings != made_for and (latest is None or _ended(latest)
                                                                 or not _current(pool, latest))
    if (uncovered or settings_due) and not conflicts:
        out.create = rollout_object(pool, _next_revision(pool, rollouts), settings)
    current = out.create or (latest if latest is not None and _current(pool, latest) else None)
    out.status = status(pool, a, current, now=now, previous=previous)
    return out


# -- status -------------------------------------------------------------------------------------------
def why_behind(pool: Pool, v: m.NodeView, current: dict | None, overlapped_with: list[str]) -> str:
    """Why a node the pool selects does not run the pool's driver (yet), in words."""
    others = [n for n in overlapped_with if n != pool.name]
    if others:
        return (f"also selected by pool {', '.join(others)}: left as it is while the pools overlap "
                "(change one pool's nodeSelector)")
    name = ((current or {}).get("metadata") or {}).get("name")
    st = (current or {}).get("status") or {}
    if v.driver is None and not v.active:
        return f"no driver yet: joining (its daemon installs {pool.version} before the node is ready)"
    if v.skip:
        return "skipped (driverd.io/skip): no rollout takes it"
    if name and v.in_rollout_name(name):
        if v.state in ACTIVE:
            return f"upgrading in rollout {name}: {v.state}" + (f" ({v.reason})" if v.reason else "")
        if v.state == FAILED:
            return f"failed in rollout {name}: {v.reason}: {v.message}"[:300]
        if v.state == DONE:
            return f"done in rollout {name} but runs {v.driver}"
    pre = v.preflight or {}
    if name and (pre.get("rollout") or "").split("/")[0] == name and pre.get("ok") is False:
        return f"the preflight of rollout {name} says it cannot take {pool.version}: " + \
            "; ".join(pre.get("reasons") or ["preflight failed"])[:250]
    if v.active and v.rollout:
        return f"held by rollout {v.rollout.split('/')[0]} ({v.state})"
    if not v.ready:
        return "NotReady: not admitted until Ready again"
    if name is None:
        return "no rollout yet"
    if m.ended(current):
        return f"rollout {name} ended ({st.get('phase')}) without it; the next revision takes it"
    return f"waiting in rollout {name} ({st.get('phase') or 'Pending'}" + \
        (f": {st.get('reason')}" if st.get("reason") else "") + ")"


def why_settings(v: m.NodeView, current: dict | None) -> str:
    """Why a node on the pool's driver is still listed: settings of its configuration wait for a rollout."""
    name = ((current or {}).get("metadata") or {}).get("name")
    what = f"its settings wait for a rollout ({waiting_settings(v)[:200]})"
    if name and v.in_rollout_name(name) and v.state in ACTIVE:
        return f"{what}: upgrading in rollout {name}: {v.state}"
    if name and not m.ended(current):
        return f"{what}: in rollout {name}"
    if name:
        return f"{what}: rollout {name} ended ({((current or {}).get('status') or {}).get('phase')}) without " \
               "applying them (its status says why); the next edit of the settings starts another revision"
    return what


def _condition(kind: str, ok: bool, reason: str, message: str, now: str, previous: dict | None) -> dict:
    status = "True" if ok else "False"
    before = next((c for c in (previous or {}).get("conditions") or [] if c.get("type") == kind), {})
    since = before.get("lastTransitionTime") if before.get("status") == status and before.get("lastTransitionTime") \
        else now
    return {"type": kind, "status": status, "reason": reason, "message": message[:1000], "lastTransitionTime": since}


def timeless(status: dict, previous: dict | None) -> bool:
    """Every condition of `status` took its lastTransitionTime from `previous` (_condition's rule), none
    the pass's `now`: the same inputs give the same status at any later time."""
    for c in status.get("conditions") or []:
        before = next((b for b in (previous or {}).get("conditions") or [] if b.get("type") == c.get("type")), {})
        if not (before.get("status") == c.get("status") and before.get("lastTransitionTime")):
            return False
    return True


def status(pool: Pool, a: Assignment, current: dict | None, *, now: str, previous: dict | None = None) -> dict:
    """The pool's status: its desired driver, its nodes (total, on it, behind), each node behind with
    why, its current rollout, and the conditions Converged and Overlap."""
    members = a.members.get(pool.name, [])
    over = sorted(n for n, ps in a.overlapped.items() if pool.name in ps)
    # the nodes behind, in order: (the node's view, or an overlapped node's name; whether its settings wait);
    # only the listed ones are put in words (every member's, for the MAX_LISTED a status lists, were most
    # of a pool's pass in a large pool)
    lagging: list[tuple[m.NodeView | str, bool]] = []
    joining = 0
    for v in members:
        if pool.runs_desired(v):
            if waiting_settings(v) and not v.skip:
                lagging.append((v, True))
            continue
        joining += v.driver is None and not v.active
        lagging.append((v, False))
    lagging += [(n, False) for n in over]
    behind = [{"node": v.name, "driver": f"{v.driver}/{v.flavor}" if v.driver else "",
               "reason": why_settings(v, current) if settings else why_behind(pool, v, current, [])}
              if isinstance(v, m.NodeView) else
              {"node": v, "driver": "", "reason": why_behind(pool, _stub(v), current, a.overlapped[v])}
              for v, settings in lagging[:MAX_LISTED]]
    on = len(members) - (len(lagging) - len(over))      # a node whose settings wait runs the driver, not as kept
    conflicts = a.conflicts.get(pool.name, {})
    if conflicts:
        words = "; ".join(f"pool {q} also selects {', '.join(ns[:5])}" + (f" and {len(ns) - 5} more" if len(ns) > 5
                                                                          else "") for q, ns in sorted(conflicts.items()))
        overlap = _condition("Overlap", True, "ConflictingNodeSelector", f"{words}: those nodes are left as they are, "
                             "and no new rollout starts while the pools overlap", now, previous)
    else:
        overlap = _condition("Overlap", False, "NoOverlap", "no other pool selects its nodes", now, previous)
    name = ((current or {}).get("metadata") or {}).get("name")
    if not lagging:
        conv = _condition("Converged", True, "AllCurrent" if members else "NoNodes",
                          f"{on} node(s) run {pool.version}" if members else "no node matches the nodeSelector",
                          now, previous)
    elif name and not m.ended(current):
        conv = _condition("Converged", False, "RollingOut", f"rollout {name}: {len(lagging)} node(s) behind", now,
                          previous)
    else:
        conv = _condition("Converged", False, "NodesBehind", f"{len(lagging)} node(s) behind: " + "; ".join(
            f"{b['node']}: {b['reason']}" for b in behind[:3]), now, previous)
    return {"observedGeneration": pool.generation, "driver": pool.version, "flavor": pool.flavor,
            "rollout": name or "",
            "nodes": {"total": len(members) + len(over), "current": on, "behind": len(lagging), "joining": joining,
                      "overlapped": len(over)},
            "behindNodes": behind, "conditions": [conv, overlap]}


def invalid_status(obj: dict, why: str, *, now: str) -> dict:
    md = obj.get("metadata") or {}
    prev = obj.get("status") or {}
    return {"observedGeneration": md.get("generation"), "driver": (obj.get("spec") or {}).get("driver"),
            "rollout": prev.get("rollout", ""), "nodes": {}, "behindNodes": [],
            "conditions": [_condition("Converged", False, "InvalidSpec", why, now, prev)]}


def _stub(name: str) -> m.NodeView:
    return m.NodeView.from_node({"metadata": {"name": name}})
