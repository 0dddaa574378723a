"""The coordinator: whichever node daemon holds the rollout Lease admits nodes and writes the
rollouts' status; the others only watch the Lease, ready to take over when its holder stops
renewing it. The holder watches every Node and every DriverRollout, and after each change runs
`admission.decide` and carries the decision out: a merge patch per admitted node, the rollout's
status (at most once per `status_interval_s`, less often in a large fleet: STATUS_EVENTS_PER_S; at
once when the phase changes), an Event on the rollout when its phase or reason changes.

A rollout carries the finalizer `driverd.io/rollout`: deleting it is aborting it (nodes not yet
unloading are given back by their daemons, under the rollout's own policies since its spec is still
there), and the finalizer goes once none of its nodes is active.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Collection

from driverd.cluster import events
from driverd.cluster import model as m
from driverd.cluster.admission import A_CANARY_APPROVED, REFUSED_RETRY_S, Targets, decide_on, reopened
from driverd.cluster.fleet_status import FleetStatus
from driverd.cluster.informer import Informer
from driverd.cluster.states import PHASES
from driverd.cluster.kube import (
    Kube,
    KubeError,
    lease_path,
    node_path,
    now_rfc3339,
    parse_time,
    rollout_path,
)
from driverd.cluster.lease import LEASE_DURATION_S, LEASE_NAME, Lease
from driverd.cluster.nodeindex import NodeIndex
from driverd.cluster.poolkeeper import PoolKeeper
from driverd.cluster.pools import SUPERSEDED, owner
from driverd.datatypes import dataclass

COALESCE_S = 0.02
# Every node's daemon watches every DriverRollout, so each status write is one watch event per node of
# the fleet: progress (counts, lists) is written at most once per status_interval_s, and no more often
# than keeps this many such events per second (a phase change is written at once).
STATUS_EVENTS_PER_S = 100
ADMIT_AT_ONCE = 8           # admissions of one pass written concurrently (_admit_all)
CLOSE_WAIT_S = 5.0          # close() waits this long for the pass in flight before giving the Lease up


@dataclass
class _Refusal:
    """The API's refusal to admit one node to a rollout, kept until the node changes or the retry is due."""
    rv: str            # the node's resourceVersion when the API refused its admission
    at: float          # when (monotonic), for REFUSED_RETRY_S
    message: str       # the API's words
    since: str         # when this refusal (these words) was first seen (RFC 3339)


class Coordinator:
    def __init__(self, kube: Kube, identity: str, namespace: str, *, rollouts: Informer,
                 log: Callable[[str], None], clock: Callable[[], float] = time.time,
                 status_interval_s: float = 1.0, lease_s: int = LEASE_DURATION_S, pools: Informer | None = None) -> None:
        self.kube, self.identity, self.ns, self.log, self.clock = kube, identity, namespace, log, clock
        self.rollouts = rollouts
        # DriverPools (cluster/poolkeeper.py): each pool's rollouts, its status, which nodes a rollout takes
        self.pool_keeper = PoolKeeper(kube, identity, pools=pools, rollouts=rollouts, write_rollout_status=self._status,
                                      log=log, clock=clock, status_interval_s=status_interval_s) \
            if pools is not None else None
        self.status_interval_s = status_interval_s
        self.lease = Lease(kube, namespace, identity, duration_s=lease_s)
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.lease_watch = Informer(kube, lease_path(namespace), fields=f"metadata.name={LEASE_NAME}",
                                    name="lease", on_change=lambda k, o: self.wake.set(), log=log)
        self.nodes: Informer | None = None
        self._renewer: threading.Thread | None = None
        # keyed by the rollout's ident (name/uid): a rollout deleted and re-created under its name is new
        self._written: dict[str, tuple[dict, float]] = {}     # rollout -> (status written, when)
        self._seen_gen: dict[str, tuple[int, float]] = {}      # rollout -> (generation, first seen)
        self.admitted = 0
        self.index = NodeIndex()          # the nodes as this pass decides on them (one per nodes informer)
        self._refused: dict[tuple[str, str], _Refusal] = {}   # (rollout ident, node) -> the API's refusal
        self._status_due: float | None = None                 # when a held-back status write is due (monotonic)
        self.fleet = FleetStatus()        # the last pass's numbers, for the daemon's /metrics
        self._idle = threading.Event()    # run() is not running (its pass loop has returned)
        self._idle.set()
        self._held = False                # it has held the Lease: its identity may, whatever a 403 says later

    @property
    def coordinating(self) -> bool:
        """It holds the Lease (its nodes informer is open) and its pass loop runs."""
        return self.nodes is not None and not self._idle.is_set()

    def close(self) -> None:
        """Stop, and give the Lease up once the pass in flight has ended: its last writes (a status,
        the Event of a phase change) are the holder's, and would be refused by deploy/'s
        driverd-coordinator-scope policy once the Lease says nobody holds it (seen in CI: a daemon
        stopped while its pool's rollout completed). A pass that outlasts CLOSE_WAIT_S gives it up
        anyway; the writes left are refused, as any former holder's are."""
        self.stop.set()
        self.wake.set()
        self._idle.wait(CLOSE_WAIT_S)
        self.lease_watch.close()
        if self.nodes:
            self.nodes.close()
        self.lease.release()

    def run(self) -> None:
        self._idle.clear()
        try:
            self._run()
        finally:
            if not self.stop.is_set():
                # the pass loop gave up on its own: a coordinator that no longer coordinates must not keep the
                # Lease (its renewer would hold it, and no other coordinator could take over)
                self.stop.set()
                self.lease.release()
            self._idle.set()

    def _run(self) -> None:
        self.lease_watch.start()
        # the first list, whatever came of it: a refused one (an identity without the Lease) is told below
        self.lease_watch.tried.wait(30)
        while not self.stop.is_set():
            self.wake.clear()
            try:
                if not self.lease.holding():
                    if self.nodes is not None:
                        self.log(f"driverd cluster: {self.identity} lost the Lease")
                        self.nodes.close()
                        self.nodes = None
                        self.index = NodeIndex()
                        self.fleet.clear()
                    if self.lease.expires_in(self.lease_watch.get(f"{self.ns}/{LEASE_NAME}")) <= 0 and \
                            self.lease.try_acquire():
                        self._keep_renewing()
                if self.lease.holding() and self.nodes is None:
                    self._held = True
                    self.log(f"driverd cluster: {self.identity} coordinates rollouts (holds the Lease)")
                    self.nodes = Informer(self.kube, node_path(), name="nodes",
                                          on_change=self._node_changed, log=self.log).start()
                    self.nodes.synced.wait(30)
                    self._seen_holding()
                if self.lease.holding() and self.nodes is not None:
                    wait = self.act()
                    self.wake.wait(wait)
                    self.stop.wait(COALESCE_S)     # one pass for a burst of node changes
                else:
                    exp = self.lease.expires_in(self.lease_watch.get(f"{self.ns}/{LEASE_NAME}"))
                    self.wake.wait(max(0.2, exp + 0.05) if exp > 0 else 1.0)
            except KubeError as e:
                if e.status == 403 and not _not_holder(e) and self.nodes is None and not self._held:
                    # RBAC or deploy/'s policy gives this identity no Lease (a GPU node's, issue 44): the
                    # coordinator is another identity; this daemon stops trying, said once. Not an identity
                    # that has held it: after a 27-s kube-apiserver outage a coordinator took a 403 for its last
                    # word and stopped coordinating while its renewer took the Lease back and kept it (a node
                    # done, its rollout Progressing for good, no other coordinator able to take over)
                    self.log(f"driverd cluster: {self.identity} may not hold the rollout Lease ({e.one_line()}): it "
                             "runs its own node's side of rollouts only; deploy/'s driverd-coordinator coordinates "
                             "(set cluster.coordinate = false to say so)")
                    self.lease_watch.close()
                    return
                self.log(f"driverd cluster coordinator: {e.one_line()}")
                # refused as no holder (the API server's cache of the Lease behind ours, or the Lease
                # taken by another daemon): look again soon; the next renewal tells which
                self.wake.wait(0.5 if _not_holder(e) else 2.0)
            except Exception as e:  # never die: say it and retry
                self.log(f"driverd cluster coordinator: {e.__class__.__name__}: {e}")
                self.wake.wait(2.0)

    def _node_changed(self, kind: str, obj: dict) -> None:
        self.index.changed(kind, obj)
        self.wake.set()

    def _keep_renewing(self) -> None:
        """Renew the Lease every third of its duration for as long as we hold it, in a thread of its
        own (as client-go's leader election does): a pass that takes long — fifty admissions against
        a busy API server — must not hold the renewal back past the Lease's duration, after which
        another daemon takes it over in the middle of the rollout (seen with 500 nodes)."""
        if self._renewer is not None and self._renewer.is_alive():
            return
        self._renewer = threading.Thread(target=self._renew, name="lease-renewer", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        """A third of the duration after the last renewal began — at once after one that took longer
        than that (a busy apiserver): the next renewal. It goes on while the Lease on the server is
        ours, even past our own hold (the write carries the resourceVersion read: it cannot take back
        a Lease another daemon took meanwhile); it ends when another daemon holds it."""
        delay = max(0.0, self.lease.acquired_at + self.lease.duration_s / 3 - time.monotonic())
        while not self.stop.wait(delay):
            try:
                if not self.lease.try_acquire():        # another daemon holds it now
                    break
                delay = max(0.0, self.lease.acquired_at + self.lease.duration_s / 3 - time.monotonic())
            except Exception as e:      # the API server restarting: again soon
                self.log(f"driverd cluster coordinator: renewing the Lease: {e.__class__.__name__}: {e}")
                delay = min(1.0, self.lease.duration_s / 3)
        self.wake.set()                 # the pass loop sees the Lease lost (or the daemon stopping)

    def _seen_holding(self, timeout: float = 2.0) -> None:
        """Wait (briefly) until our watch of the Lease shows us as its holder. The API server judges
        the coordinator's writes against its own cache of the Lease (deploy/'s admission policy
        driverd-coordinator-scope: only the holder writes other nodes and rollouts); that cache and
        our watch are fed by the same watch of the API server, so once ours shows it, so does that."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and not self.stop.is_set():
            cur = self.lease_watch.get(f"{self.ns}/{LEASE_NAME}") or {}
            if (cur.get("spec") or {}).get("holderIdentity") == self.identity:
                return
            self.stop.wait(0.02)

    # -- one pass as the holder -----------------------------------------------------------------
    def act(self) -> float:
        """Admit what may be admitted for every rollout; the seconds until we must look again. A
        write the API refuses or fails for one rollout is that rollout's (recorded on it, tried again
        later), never the end of the pass for the rollouts after it — unless the refusal says this
        daemon no longer holds the Lease, which ends every write."""
        assert self.nodes is not None
        wait = 30.0
        self._status_due = None
        self.index.sync(self.nodes)
        if self.pool_keeper is not None:
            if not self.pool_keeper.act(self.index):
                return 1.0            # the DriverPools are not read yet: which rollout takes which node is unknown
            if self.pool_keeper.again:
                wait = self.status_interval_s
        decided: dict[str, dict] = {}      # rollout -> the status this pass decided (fleet metrics)
        # node -> the rollout that holds it: the nodes being upgraded, then (one layer per rollout, in
        # order) the nodes each rollout that has not ended selects, for the rollouts after it
        held = _Held({v.name: f"rollout {v.rollout.split('/')[0]}: {v.state}"
                      for v in self.index.active.values() if v.rollout}, [])
        for obj in sorted(self.rollouts.snapshot(), key=m.oldest_first):
            try:
                wait = min(wait, self._act_on(obj, held, decided))
            except KubeError as e:
                if _not_holder(e):
                    raise
                self.log(f"driverd cluster: rollout {obj['metadata'].get('name')}: {e.one_line()}")
                wait = min(wait, 2.0)
        self.index.forget_unused()
        self.fleet.publish(self.rollouts.snapshot(), decided)
        if self._status_due is not None:          # a progress write held back: the pass that writes it
            wait = min(wait, max(COALESCE_S, self._status_due - time.monotonic()))
        return wait

    def _act_on(self, obj: dict, held: _Held, decided: dict[str, dict]) -> float:
        name = obj["metadata"]["name"]
        md = obj["metadata"]
        if md.get("deletionTimestamp"):
            self._deleted(obj)
            return 30.0
        if m.FINALIZER not in (md.get("finalizers") or []):
            self._add_finalizer(obj)
        try:
            r = m.Rollout.from_object(obj)
        except m.SpecError as e:
            self._status(obj, {"phase": "Invalid", "reason": "InvalidSpec", "message": str(e),
                               "observedGeneration": obj["metadata"].get("generation")})
            return 30.0
        why = None
        if m.ended(obj) and (obj.get("status") or {}).get("phase") == SUPERSEDED:
            return 30.0                     # its pool's next revision replaced it: no verb reopens it
        if m.ended(obj):
            # terminal for this spec, holding no node, until an operator's verb reopens it: a retry of
            # a node it failed, a skip of a node its preflight refused — the only nodes to look at
            st = obj.get("status") or {}
            named = {e.get("node") for e in st.get("preflightFailures") or [] if isinstance(e, dict)}
            why = reopened(r, st, list(self.index.named(self.index.retry | named)))
            if why is None:
                return 30.0
            self.log(f"driverd cluster: rollout {name} ({(obj.get('status') or {}).get('phase')}) reopened by {why}")
            self._seen_gen[r.ident] = (r.generation, self.clock())     # its preflight deadline starts again
        ann = obj["metadata"].get("annotations") or {}
        if ann.get(m.A_ABORT) == "true":
            self._status(obj, {"phase": "Aborted", "reason": "Aborted", "message": "aborted by an operator; "
                               "nodes not yet unloading were given back", "observedGeneration": r.generation})
            return 30.0
        gen, since = self._seen_gen.get(r.ident, (None, 0.0))
        if gen != r.generation:
            prev = parse_time((obj.get("status") or {}).get("generationSince")) \
                if (obj.get("status") or {}).get("observedGeneration") == r.generation else None
            since = prev or self.clock()
            self._seen_gen[r.ident] = (r.generation, since)
        targets = self._targets(r, obj)
        mine_active = {v.name for v in self.index.active.values() if v.in_rollout(r)}
        d = decide_on(targets, now=self.clock(), started=since,
                      canary_approved=ann.get(A_CANARY_APPROVED) == "true",
                      held=held.for_rollout(mine_active), refused=self._refusals(r))
        if not m.ended(dict(obj, status=d.status(r))):
            # a rollout that has not ended holds the nodes it selects for the rollouts after it
            # (their daemons answer the oldest one's preflight first)
            held.layers.append((targets.views.keys(), f"rollout {r.name}: {d.phase}"))
        if mine_refused := [k for k in self._refused if k[0] == r.ident]:
            pending = set(d.pending)
            for key in mine_refused:
                if key[1] not in pending:
                    del self._refused[key]          # admitted, skipped, no longer selected: nothing refused
        st = decided[name] = d.status(r)
        st["generationSince"] = now_rfc3339(since)
        st["conditions"] = self._conditions(r)
        if why and d.admit:
            # not ended any more before its nodes see the admission (their daemons refuse an
            # admission into a rollout that has ended)
            self._status(obj, st)
        said: list[tuple[dict, str]] = []
        try:
            results = self._admit_all(r, d.admit, obj, said)
            refused_now = "refused" in results
            self.admitted += results.count("admitted")
        finally:
            # the admissions' Events after all of them: a wave of fifty nodes does not wait for fifty
            # Event writes to start (an Event is a courtesy, never part of the decision)
            for involved, message in said:
                events.record(self.kube, involved, "Admitted", message, warning=False, instance=self.identity,
                              log=self.log, now=self.clock())
        if refused_now:
            self.wake.set()                 # the status says so on the next pass, decided without that node
        else:
            self._status(obj, st)
        return 5.0 if d.phase in ("Preflight", "Progressing") else 30.0

    def _targets(self, r: m.Rollout, obj: dict) -> Targets:
        """The nodes rollout `r` may take, kept by the index from one pass to the next: a pool's rollout
        its pool's members only, any other rollout nodes in no pool (pools.takes), and those it is
        upgrading now (a pool created over them mid-upgrade: they still hold the rollout's slots)."""
        if self.pool_keeper is None:
            return self.index.targets(r, r, lambda v: r.selects(v.labels))
        takes = self.pool_keeper.taker(obj)
        return self.index.targets(r, (r, owner(obj), tuple(self.pool_keeper.current)), lambda v: r.selects(
            v.labels) and (takes(v.labels) or (v.active and v.in_rollout_name(r.name))))

    def _admit_all(self, r: m.Rollout, names: list[str], obj: dict, said: list[tuple[dict, str]]) -> list[str]:
        """Write a pass's admissions, up to ADMIT_AT_ONCE at a time: each is one patch of its own node
        (decided together, within the limit, whatever the order they land in), and a wave of fifty
        written one after the other kept the last node waiting for forty-nine round trips, each judged
        by the admission policies. The first error is raised once all were tried."""
        if len(names) <= 1:
            return [self._admit(r, n, obj, said) for n in names]
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=min(ADMIT_AT_ONCE, len(names)), thread_name_prefix="admit") as pool:
            return list(pool.map(lambda n: self._admit(r, n, obj, said), names))

    def _admit(self, r: m.Rollout, name: str, obj: dict, said: list[tuple[dict, str]]) -> str:
        """Write the admission: "admitted", "conflict" (the node changed: decided again) or
        "refused" (the API said no for this node: recorded on the rollout, tried again later). The
        Event an admission deserves goes to `said` (involved object, message)."""
        assert self.nodes is not None
        # the Node as the decision saw it: its resourceVersion makes the write fail (409) if the node
        # changed since, so an admission is never written over a state the decision did not see
        node = self.index.obj(name) or {}
        v = m.NodeView.from_node(node)
        prev = f"{v.driver}/{v.flavor}" if v.driver else ""
        message = f"admitted by {self.identity} to upgrade to {r.driver} (rollout {r.name})"
        patch = m.state_patch(m.ADMITTED, "Admitted", message,
                              since=now_rfc3339(self.clock()), rollout=r.key,
                              extra={m.A_TARGET: r.target, m.A_ATTEMPT: str(v.attempt + 1),
                                     m.A_PREVIOUS: prev, m.A_RETRY: None, m.A_PINNED: None,
                                     m.A_ADMITTED_BY: self.identity})
        patch["metadata"]["resourceVersion"] = node["metadata"]["resourceVersion"]
        try:
            new = self.kube.patch(node_path(name), patch)
            self.nodes.put(new)
            self.index.changed("MODIFIED", new)     # our own write: no watch event has said it yet
        except KubeError as e:
            if e.conflict:        # the node changed since we looked: decide again with the new view
                self.wake.set()
                return "conflict"
            if e.status in (400, 403, 422) and not _not_holder(e):
                self._record_refusal(r, name, node, e, obj)
                return "refused"
            raise
        self._refused.pop((r.ident, name), None)
        said.append(({"apiVersion": "v1", "kind": "Node", "name": name, "uid": new["metadata"].get("uid")}, message))
        self.log(f"driverd cluster: rollout {r.name}: admitted {name}")
        return "admitted"

    # -- admissions the API refused ---------------------------------------------------------------
    def _record_refusal(self, r: m.Rollout, name: str, node: dict, e: KubeError, obj: dict) -> None:
        """Remember the refusal (the node is not tried again until it changes or REFUSED_RETRY_S
        pass) and say it once on the rollout: a Warning Event with the API's words; the rollout's
        status carries it as the condition AdmissionRefused while it lasts."""
        words = f"{e.status} {e.reason}: {e.api_message}".strip()[:600]
        before = self._refused.get((r.ident, name))
        self._refused[(r.ident, name)] = _Refusal(
            rv=(node.get("metadata") or {}).get("resourceVersion", ""), at=time.monotonic(), message=words,
            since=before.since if before and before.message == words else now_rfc3339(self.clock()))
        self.log(f"driverd cluster: rollout {r.name}: the API refused the admission of {name}: {words}")
        if before is None or before.message != words:
            md = obj["metadata"]
            events.record(self.kube, {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                      "name": md["name"], "uid": md.get("uid")}, "AdmissionRefused",
                          f"the API server refused the admission of node {name}: {words}", warning=True,
                          instance=self.identity, log=self.log, now=self.clock())

    def _refusals(self, r: m.Rollout) -> dict[str, str]:
        """The refused admissions of this rollout not to try again yet: the node has not changed
        since, and REFUSED_RETRY_S have not passed."""
        out = {}
        for (ident, name), rf in self._refused.items():
            v = self.nodes.get(name) if self.nodes else None
            rv = ((v or {}).get("metadata") or {}).get("resourceVersion")
            if ident == r.ident and rv == rf.rv and time.monotonic() - rf.at < REFUSED_RETRY_S:
                out[name] = rf.message
        return out

    def _conditions(self, r: m.Rollout) -> list[dict]:
        mine = sorted((name, rf) for (ident, name), rf in self._refused.items() if ident == r.ident)
        if not mine:
            return []
        return [{"type": "AdmissionRefused", "status": "True", "reason": "AdmissionRefused",
                 "lastTransitionTime": min(rf.since for _, rf in mine),
                 "message": "the API server refused the admission of " + "; ".join(
                     f"{name}: {rf.message}" for name, rf in mine[:5])[:1000]}]

    def _add_finalizer(self, obj: dict) -> None:
        md = obj["metadata"]
        body = {"metadata": {"finalizers": list(md.get("finalizers") or []) + [m.FINALIZER],
                             "resourceVersion": md.get("resourceVersion")}}
        try:
            self.rollouts.put(self.kube.patch(rollout_path(md["name"]), body))
        except KubeError as e:
            if not (e.conflict or e.not_found):       # changed meanwhile: the next pass adds it
                raise

    def _deleted(self, obj: dict) -> None:
        """A deleted rollout is an aborted one: its daemons give back the nodes not yet unloading;
        the finalizer goes when none of its nodes is active any more."""
        md = obj["metadata"]
        if m.FINALIZER not in (md.get("finalizers") or []):
            return
        try:
            r = m.Rollout.from_object(obj)
            busy = sorted(v.name for v in self.index.active.values() if v.in_rollout(r))
        except m.SpecError:
            busy = []
        if busy:
            self._status(obj, {"phase": "Aborted", "reason": "Deleting", "message": "deleted: waiting for "
                               f"{len(busy)} node(s) to finish or be given back: {', '.join(busy[:5])}",
                               "observedGeneration": md.get("generation")})
            return
        body = {"metadata": {"finalizers": [f for f in md.get("finalizers") or [] if f != m.FINALIZER],
                             "resourceVersion": md.get("resourceVersion")}}
        try:
            self.kube.patch(rollout_path(md["name"]), body)
            self.log(f"driverd cluster: rollout {md['name']} deleted; its nodes are given back")
        except KubeError as e:
            if not (e.conflict or e.not_found):
                raise

    def _status(self, obj: dict, status: dict) -> None:
        name, key = obj["metadata"]["name"], m.ident(obj)
        last, when = self._written.get(key, (obj.get("status") or {}, 0.0))
        if _same(last, status):
            return
        phase_changed = (last.get("phase"), last.get("reason")) != (status.get("phase"), status.get("reason"))
        interval = max(self.status_interval_s, len(self.index) / STATUS_EVENTS_PER_S)
        if not phase_changed and time.monotonic() - when < interval:
            due = when + interval     # written by the first pass after that
            self._status_due = due if self._status_due is None else min(self._status_due, due)
            return
        body = {"status": dict(status, updated=now_rfc3339(self.clock()))}
        try:
            new = self.kube.patch(rollout_path(name, status=True), body)
            self.rollouts.put(new)
        except KubeError as e:
            if e.not_found:
                return
            raise
        self._written[key] = (status, time.monotonic())
        if phase_changed:
            self._event(obj, status)

    def _event(self, obj: dict, status: dict) -> None:
        md = obj["metadata"]
        involved = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "name": md["name"],
                    "uid": md.get("uid")}
        events.record(self.kube, involved, status.get("reason") or "Progressing", status.get("message") or "",
                      warning=getattr(PHASES.get(status.get("phase") or ""), "warning", False),
                      instance=self.identity, log=self.log, now=self.clock())


@dataclass
class _Held:
    """The nodes other rollouts hold, as a pass goes through the rollouts oldest first: those being
    upgraded (`active`: node -> by which), then one layer per rollout that has not ended (the nodes it
    selects) for the rollouts after it. A node is held by the first that names it."""
    active: dict[str, str]
    layers: list[tuple[Collection[str], str]]

    def for_rollout(self, mine: set[str]) -> dict[str, str]:
        """What holds each node for a rollout that is upgrading `mine` (its own nodes are not held)."""
        held: dict[str, str] = {}
        for names, by in reversed(self.layers):
            held.update(dict.fromkeys(names, by))
        held.update(self.active)
        for name in mine:
            held.pop(name, None)
        return held


def _not_holder(e: KubeError) -> bool:
    """deploy/'s driverd-coordinator-scope refused: the API server does not see us holding the Lease."""
    return e.status == 403 and "driverd-coordinator-scope" in e.api_message


def _same(a: dict, b: dict) -> bool:
    strip = ("updated", "generationSince")
    return json.dumps({k: v for k, v in a.items() if k not in strip}, sort_keys=True, default=str) == \
        json.dumps({k: v for k, v in b.items() if k not in strip}, sort_keys=True, default=str)
