"""The node agent (driverd.cluster.agent.NodeAgent) from a free node to its drain: the answer to a
rollout's preflight, the node's own check of an admission before it touches anything (who wrote it,
for which live rollout, within that rollout's limits), the cordon, and the wait for the jobs a
rollout lets finish."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from driverd.cluster import model as m
from driverd.cluster import pools as pl
from driverd.cluster import schedulable as sched
from driverd.cluster.admission import A_CANARY_APPROVED
from driverd.cluster.drain import DrainPlan
from driverd.cluster.informer import Informer
from driverd.cluster.kube import ClusterError, Kube, KubeError, node_path, rollout_path
from driverd.cluster.nodehost import NodeHost


EVICTING_WORDS = "evicting the GPU pods through the Eviction API"

class NodeAdmission:
    """NodeAgent's side from preflight to drain (a mixin: NodeAgent holds these)."""
    kube: Kube
    node: str
    cfg: Any
    host: NodeHost
    nodes: Informer
    events: bool
    log: Callable[[str], None]
    rollouts: Informer
    _to: Callable[..., dict]
    _elapsed: Callable[[m.NodeView], float]
    _pods: Callable[..., list[dict]]
    _drain_plan: Callable[..., DrainPlan]
    _leaving_with_driver: Callable[[m.Rollout], dict[str, str]]
    _give_back: Callable[..., float | None]
    condition: Callable[[bool, str, str], None]
    event: Callable[..., None]
    pool_list: Callable[[], list[pl.Pool]]

    # -- preflight (idle/done/failed) ------------------------------------------------------------------
    def _preflight(self, v: m.NodeView) -> float | None:
        """Answer the preflight of the oldest unfinished rollout that selects this node, once per
        rollout generation: can this node take the target, and does it need to?"""
        for obj in sorted(self.rollouts.snapshot(), key=m.oldest_first):
            try:
                r = m.Rollout.from_object(obj)
            except m.SpecError:
                continue
            # an ended rollout (for its current spec) or one being deleted holds no node; a pool's rollout
            # takes its pool's members only, any other rollout nodes in no pool
            if m.ended(obj) or r.deleting or not pl.takes(obj, v.labels, self.pool_list()):
                continue
            if (v.preflight or {}).get("rollout") == r.key:
                return None
            node = self.nodes.get(self.node)
            try:
                plan = self._drain_plan(r)
            except ClusterError as e:
                self.log(f"driverd cluster: preflight of {r.name}: cannot list the node's pods: {e.one_line()}")
                return 5.0
            answer = self.host.preflight(self.cfg, r.key, r.driver, r.flavor,
                                         leaving=plan.leaving, staying=plan.staying)
            if not answer["ok"]:
                # The pods were listed before the host's GPU users were read: a pod that started in
                # between (a DaemonSet pod coming back, say) holds the GPU but is in no list, so it
                # looks like a process outside any pod. Judge once more against a fresh list.
                try:
                    again = self._drain_plan(r)
                except ClusterError:
                    again = plan
                if (again.leaving, again.staying) != (plan.leaving, plan.staying):
                    answer = self.host.preflight(self.cfg, r.key, r.driver, r.flavor,
                                                 leaving=again.leaving, staying=again.staying)
            patch = {"metadata": {"annotations": {m.A_PREFLIGHT: json.dumps(answer, sort_keys=True)}}}
            self.nodes.put(self.kube.patch(node_path(self.node), patch))
            if not answer["ok"] and self.events:
                self.event(node, "PreflightFailed", "; ".join(answer["reasons"]), warning=True)
            return None
        return None

    # -- admitted → cordoned and draining -----------------------------------------------------------
    def _admission_problem(self, v: m.NodeView) -> str | None:
        """Why this node's admission is not one to act on; None when it is. An admission must name a
        live DriverRollout (this object: name and uid) that has not ended, selects this node, installs
        exactly the admission's target, and whose preflight this node answered yes to. The admission
        policy lets only the Lease holder write another node's admission; this is the node's own check
        of what was written (by hand, by a node that took the Lease, or for a rollout edited since)."""
        name, _, rest = (v.rollout or "").partition("/")
        uid = rest.partition("/")[0]
        if not name:
            return "it names no rollout"
        obj = self.rollouts.get(name)
        if obj is None:
            return f"no DriverRollout {name} exists"
        md = obj.get("metadata") or {}
        if uid and md.get("uid") != uid:
            return f"DriverRollout {name} is another object (uid {md.get('uid')}, the admission names {uid})"
        try:
            r = m.Rollout.from_object(obj)
        except m.SpecError as e:
            return f"DriverRollout {name} cannot be carried out: {e.one_line()}"
        # whom the rollout takes first: it names a forged admission's fault whatever phase the rollout has
        # reached meanwhile (one that takes no node may have ended at once)
        if not r.selects(v.labels):
            return f"rollout {name} does not select this node"
        if not pl.takes(obj, v.labels, self.pool_list()):
            own = pl.owner(obj)
            return (f"the node is not a member of pool {own[0]} alone, whose rollout {name} is" if own else
                    f"the node belongs to a DriverPool: only its pool's rollouts take it, not {name}")
        # (an aborted or deleted one is given back by tick(), like every node it holds)
        if m.ended(obj) and (md.get("annotations") or {}).get(m.A_ABORT) != "true" and not md.get("deletionTimestamp") \
                and (obj.get("status") or {}).get("phase") != pl.SUPERSEDED:
            # an operator's retry reopens an ended rollout: the coordinator writes its status before
            # the admission, but our watch of the rollouts may show it after our watch of the Node
            fresh = self._fresh_rollout(name)
            if fresh is None or m.ended(fresh):
                return f"rollout {name} has ended ({((fresh or obj).get('status') or {}).get('phase')})"
        if v.target != r.target:
            return f"rollout {name} installs {r.target}, not {v.target or '(no target)'}"
        pre = v.preflight or {}
        if pre.get("rollout") != v.rollout or not pre.get("ok"):
            return (f"this node's preflight answer for {v.rollout} is " +
                    ("a refusal" if pre.get("rollout") == v.rollout else "missing"))
        return None

    def _fresh_rollout(self, name: str) -> dict | None:
        """The rollout as the API server has it now (a list by name: the daemons' RBAC lists and
        watches rollouts, it does not get them), put into the watch's cache."""
        items = self.kube.list(rollout_path(), fields=f"metadata.name={name}").get("items") or []
        if items:
            self.rollouts.put(items[0])
        return items[0] if items else None

    def _beyond_limits(self, v: m.NodeView, r: m.Rollout) -> str | None:
        """Why acting on this admission would break the rollout's own rules, as this node can see them
        (issue 44): the admission policy lets the Lease holder admit nodes, and a node that took the Lease
        could admit a whole pool at once. Read fresh from the API server (the coordinator admits from a
        view newer than this agent's cache), and counted so that a coordinator's own admission always
        passes: the nodes of this rollout other than this one that are being upgraded stay below
        maxParallel and maxUnavailable, a canary that waits for `rollout resume` takes no more nodes, and
        a rollout the coordinator wrote paused (a canary done, spec.paused) admits none."""
        obj = self._fresh_rollout(r.name)
        if obj is None:
            return None                   # deleted meanwhile: tick() gives the node back as aborted
        st, ann = obj.get("status") or {}, (obj.get("metadata") or {}).get("annotations") or {}
        approved = ann.get(A_CANARY_APPROVED) == "true"
        if st.get("phase") == "Paused" and (st.get("reason") == "PausedBySpec" and (obj.get("spec") or {}).get("paused")
                                            or st.get("reason") == "CanaryDone" and not approved):
            return f"rollout {r.name} is paused ({st.get('reason')})"
        # every Node at each admission: their metadata alone (state, rollout and target are annotations,
        # the selector's labels), not their status - what a fleet's API server serves per admitted node
        views = [m.NodeView.from_node(n) for n in self.kube.list(node_path(), metadata_only=True).get("items") or []]
        mine = [w for w in views if w.name != v.name and w.in_rollout(r)]
        busy = sorted(w.name for w in mine if w.active)
        shown = ", ".join(busy[:5]) + (f" and {len(busy) - 5} more" if len(busy) > 5 else "")
        if len(busy) >= r.max_parallel:
            return f"{len(busy)} other node(s) of rollout {r.name} are being upgraded ({shown}); its maxParallel is " \
                   f"{r.max_parallel}"
        limit = r.unavailable_limit(sum(1 for w in views if r.selects(w.labels)))
        if len(busy) >= limit:
            return f"{len(busy)} other node(s) of rollout {r.name} are being upgraded ({shown}); its maxUnavailable " \
                   f"allows {limit}"
        if r.canary and not approved and r.canary_soak_s is None:
            taken = sorted(w.name for w in mine if w.active or (w.state in (m.DONE, m.FAILED) and w.target == r.target))
            if len(taken) >= r.canary:
                return (f"rollout {r.name}'s {r.canary} canary node(s) are taken ({', '.join(taken[:5])}); the rest "
                        f"waits for `kubectl driverd rollout resume {r.name}`")
        return None

    def _reject_admission(self, node: dict, v: m.NodeView, why: str) -> float | None:
        """Hand an admission back without touching the host: the node is recorded failed
        (AdmissionRejected), out of any rollout, its daemon's reconciles pinned to the driver it runs
        now (not to the config's, not to what the admission wrote), with a Warning naming the writer."""
        ann = node["metadata"].get("annotations") or {}
        by = ann.get(m.A_ADMITTED_BY)
        writer = (f"admitted by {by} (driverd.io/admitted-by, which the admission policy holds to the writer's "
                  "own token)" if by else "not written by a live rollout's coordinator (no driverd.io/admitted-by)")
        last = _writer(node, m.A_STATE)
        loaded = self.host.loaded(self.cfg)
        pinned = f"{loaded['version']}/{loaded['flavor']}" if loaded else None
        message = (f"admission to {v.target or '(no target)'} for rollout {v.rollout or '(none)'} not acted on: {why}; "
                   f"{writer}" + (f"; managedFields: {last}" if last else "") +
                   f"; nothing was cordoned, drained or installed, the node keeps "
                   f"{'driver ' + pinned if pinned else 'its configured driver'}")
        try:
            self._to(node, m.FAILED, "AdmissionRejected", message, warning=True, precondition=True,
                     ann={m.A_ROLLOUT: None, m.A_TARGET: None, m.A_PREVIOUS: None, m.A_ADMITTED_BY: None,
                          m.A_CORDONED: None, m.A_PINNED: pinned})
        except KubeError as e:
            if e.conflict:        # written again meanwhile: judge the new record
                return 0
            raise
        return None

    def _cordon(self, node: dict, v: m.NodeView, r: m.Rollout) -> float | None:
        why = self._admission_problem(v)
        if why:
            return self._reject_admission(node, v, why)
        beyond = self._beyond_limits(v, r)
        if beyond:
            # nothing touched, nothing failed: a coordinator that admitted in good faith admits the node
            # again once the rollout allows it; a forged one has moved nothing
            by = (node["metadata"].get("annotations") or {}).get(m.A_ADMITTED_BY) or "an unnamed writer"
            return self._give_back(node, v, "AdmissionBeyondLimits", f"admission by {by} not acted on: {beyond}; "
                                   "nothing was cordoned, drained or installed", warning=True)
        drop_ready = {m.L_READY: None}
        # what the scheduler can place on the node now, and the DaemonSets whose pods leave with the
        # driver: `validating` waits for both to be back
        before = sched.encode(sched.counts(node, sched.node_slices(self.kube, self.node)))
        left = self._leaving_with_driver(r)
        ann = {m.A_GPUS_BEFORE: before, m.A_LEFT_WITH: m.left_with_value(left)}
        # The cordon and the drain's start are one transition (one patch, one Event): `cordoned` was a
        # state of no duration whose own patch and Event were two of a node's ~25 requests (issue 47).
        try:
            if v.unschedulable and not v.cordoned_by_us:
                self._start_drain(node, r, "AlreadyCordoned", "the node was already cordoned (not by driverd): it "
                                  "stays cordoned after the upgrade", ann={m.A_CORDONED: "false", **ann},
                                  labels=drop_ready, precondition=True)
            else:
                self._start_drain(node, r, "Cordoned", f"cordoned for the upgrade to {r.driver}",
                                  ann={m.A_CORDONED: "true", **ann}, spec={"unschedulable": True},
                                  labels=drop_ready, precondition=True)
        except KubeError as e:
            if e.conflict:        # the node changed under us (an admin's cordon?): look again
                return 0
            raise
        self.condition(False, "Upgrading", f"being upgraded to {r.driver} by rollout {r.name}")
        return 0

    def _after_cordon(self, node: dict, v: m.NodeView, r: m.Rollout) -> float:
        """A node recorded as `cordoned` (by a driverd before the cordon and the drain's start were one
        transition) goes on to the drain."""
        self._start_drain(node, r, "WaitingForJobs" if r.jobs_selector else "Evicting", None)
        return 0

    def _start_drain(self, node: dict, r: m.Rollout, reason: str, done: str | None, **kw) -> dict:
        """The transition into the drain: waiting-for-jobs where the rollout names job pods, else evicting;
        `done`: what the transition did besides (the cordon), said first; `kw`: _to's."""
        then = (f"waiting up to {r.jobs_timeout_s}s for pods {r.jobs_selector!r} on the node to finish"
                if r.jobs_selector else EVICTING_WORDS)
        return self._to(node, m.WAITING if r.jobs_selector else m.EVICTING, reason,
                        f"{done}; {then}" if done else then, **kw)

    # -- waiting-for-jobs -----------------------------------------------------------------------------
    def _wait_jobs(self, node: dict, v: m.NodeView, r: m.Rollout) -> float:
        pods = self._pods(r.jobs_selector)
        running = [p for p in pods if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
        if running and self._elapsed(v) < r.jobs_timeout_s:
            return min(10.0, r.jobs_timeout_s - self._elapsed(v) + 0.1)
        msg = "no job pods left" if not running else (
            f"{len(running)} job pod(s) still running after {r.jobs_timeout_s}s ({_refs(running)}): evicting them")
        self._to(node, m.EVICTING, "Evicting", f"{msg}; {EVICTING_WORDS}")
        return 0


def _refs(pods: list[dict]) -> str:
    return ", ".join(f"{p['metadata'].get('namespace')}/{p['metadata']['name']}" for p in pods[:5]) + \
        (f" and {len(pods) - 5} more" if len(pods) > 5 else "")


def _writer(node: dict, annotation: str) -> str:
    """Who last wrote `annotation` of the Node, as far as the API tells: the managedFields entry that
    owns it (the manager's name is what the writing client called itself; the time is the server's)."""
    key = "f:" + annotation
    for e in (node.get("metadata") or {}).get("managedFields") or []:
        if key in (((e.get("fieldsV1") or {}).get("f:metadata") or {}).get("f:annotations") or {}):
            return f"{annotation} last written by manager {e.get('manager')!r} ({e.get('operation')}" + \
                (f" of {e['subresource']}" if e.get("subresource") else "") + f", {e.get('time')})"
    return ""
