"""The per-node state machine, run by the daemon on that node, recorded on its Node object:

  idle → admitted → (cordon) → [waiting-for-jobs] → evicting → unloading → validating → done
                                                                    ↘ reboot-required ↗
  any of them → failed  (the node transaction rolled back to the previous driver; uncordoned if we cordoned)

`admitted` is written by the coordinator (admission); every other state by the node's own daemon,
one merge patch per transition with an Event on the Node. The record (state, reason, message,
since, attempt, previous driver, target, whether *we* cordoned) is in annotations, so a restarted
daemon resumes from where it stood; the node transaction itself resumes from the local journal.
`unloading` covers the whole node transaction (unload → install → load → validate, all-or-nothing
under the host lock); a kernel that cannot unload modules makes it `reboot-required`, which the
cluster's reboot coordinator (kured watches /var/run/reboot-required, which the transaction writes)
acts on, and after the reboot the daemon finishes the upgrade.

Every wait has a deadline from the rollout, and the reason names what blocked it: the pods, the
PodDisruptionBudget, the processes holding the GPU.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

from driverd.cluster import events
from driverd.cluster import model as m
from driverd.cluster import operator_components as oc
from driverd.cluster import pools as pl
from driverd.cluster import states
from driverd.cluster.agent.admission import NodeAdmission
from driverd.cluster.agent.finish import A_BOOT, CONDITION, NodeFinish
from driverd.cluster.drain import DrainPlan, plan_drain
from driverd.cluster.gpuusers import PodUse
from driverd.cluster.informer import Informer
from driverd.cluster.nodehost import LocalHost, NodeHost
from driverd.cluster.kube import (
    ClusterError,
    Kube,
    KubeError,
    node_path,
    now_rfc3339,
    outage,
    parse_time,
    pods_path,
    pool_path,
    rollout_path,
)

EVICT_RETRY_S = 5.0          # the longest wait between two eviction rounds (the backoff's cap)
EVICT_FIRST_S = 0.25         # the first wait; doubled after every round that left pods behind
# While a node is evicting, its pods are watched (a list, then a watch): the drain goes on as soon as
# the last pod is gone instead of at the next poll, and the rounds read the watched pods, not the API.
# The watch is re-opened within this range of seconds for as long as the node stays evicting. It is
# open from the cordon (which reads which DaemonSets' pods will leave with the driver, while they are
# all still there) until the node is validated: `validating` waits for those pods to be Ready again, and
# a pod's change must wake it as a Node's does (issue 47: a node that looked once too early waited 5 s
# for its next look, one straggler in a 500-node rollout's makespan).
DRAIN_WATCH_S = (30, 60)
# `admitted` too: the cordon opens the watch while the node is still admitted, and a cordon that meets a
# concurrent change of the Node (409) is tried again from `admitted` on the same watch, not a new list.
POD_WATCH_STATES = (m.ADMITTED, m.CORDONED, m.WAITING, m.EVICTING, m.UNLOADING, m.VALIDATING)


def _leaving(plan: DrainPlan) -> dict[str, str]:
    """The plan's DaemonSets whose pods leave with the driver -> the label that takes them (a GPU Operator
    component's, or driver-ready's, which the cordon removes)."""
    return {plan.daemonset_of[u.uid]: plan.leaves_by.get(u.uid) or m.L_READY
            for u in plan.with_label if u.uid in plan.daemonset_of}


# The admission side (agent/admission.py) and the finish (agent/finish.py) are mixins of their own; the
# drain stays here, as tests tune its pace through this module's EVICT_* settings.
class NodeAgent(NodeAdmission, NodeFinish):
    _pod_watch = None           # the node's pods from its cordon to its validation (see _pod_watch_view)
    _wl_watch = None            # the validation workload pod while validating (finish.py)

    def __init__(self, kube: Kube, node: str, *, cfg, log: Callable[[str], None], make_context: Callable | None = None,
                 reconciler=None, host: NodeHost | None = None, events: bool = True,
                 clock: Callable[[], float] = time.time, namespace: str = "driverd") -> None:
        """`host`: the machine under the agent (default: this one, through `make_context` and the
        reconcile pass). `namespace`: where driverd runs (the daemon's pod's own, $POD_NAMESPACE): a
        rollout's validation workload pod runs there."""
        self.kube, self.node, self.cfg, self.log = kube, node, cfg, log
        self.namespace = namespace
        if host is None:
            from driverd.apply.reconcile import Reconciler
            assert make_context is not None, "NodeAgent needs a host or a make_context"
            host = LocalHost(make_context, reconciler or Reconciler(make_context, log))
        self.host = host
        self.events, self.clock = events, clock
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.nodes = Informer(kube, node_path(), fields=f"metadata.name={node}", name=f"node/{node}",
                              on_change=self._changed, log=log)
        self.rollouts = Informer(kube, rollout_path(), name="rollouts", on_change=self._rollout_changed, log=log)
        # DriverPools: which rollouts may take this node, and a joining node's driver (cluster/pools.py);
        # a cluster without the DriverPool CRD has no pools
        self.pools = Informer(kube, pool_path(), name="pools", on_change=self._rollout_changed, log=log,
                              missing_ok=True)
        self._rollout_seen: dict[str, tuple] = {}
        self._drain_round: tuple[str, int] = ("", 0)     # (the evicting state's since, rounds so far)
        # while evicting: the node's pods (list + watch), the pods evicted so far, the DaemonSets read and
        # each pod's last refusal in the API's words (what the node fails with, should the API server be
        # unreachable on the last try)
        self._pod_watch: Informer | None = None
        self._wl_watch: Informer | None = None      # while validating: the rollout's workload pod (finish.py)
        # when this daemon's view of the node's pods began: its first read of them, or its first read
        # after one the API server did not answer. The drain's timeout counts from it, so an API server
        # away (or this daemon restarted) mid-drain does not fail the node for pods nobody could see
        # leave: their kubelets could not confirm the deletions either
        self._drain_view: float | None = None
        self._evicted: set[str] = set()
        self._left_with: dict[str, str] = {}        # DaemonSets (ns/name) whose pods left -> the label that took them
        self._daemonsets: dict[tuple, dict | None] = {}
        self._refusals: dict[str, str] = {}
        self._labels_checked = False
        self._reboot_checked = False
        # what the daemon's last workload check said of this host: (ready, why). A loaded driver that cannot
        # run CUDA (another version's user-space, a GPU CUDA cannot open) is not GPUDriverReady.
        self.workload: tuple[bool, str] | None = None
        self.waiting: str | None = None          # None: the daemon has not said (leave the annotation)
        # the kernel watch's news for the node's Events (set_kernels), sent by tick
        self._kernels_said: dict[str, tuple] = {}
        self._kernel_news: list[tuple[str, str, bool]] = []

    def set_workload(self, ready: bool, why: str) -> None:
        """The daemon's workload verdict for this host; a change re-syncs GPUDriverReady and the labels."""
        if self.workload != (ready, why):
            self.workload = (ready, why)
            self._labels_checked = False
            self.wake.set()

    def set_waiting(self, text: str) -> None:
        """What the node's desired driver or settings want that its daemon keeps out until a rollout
        (daemon/cluster_mode.py); published as driverd.io/waiting when it changes."""
        if self.waiting != text:
            self.waiting = text
            self._labels_checked = False
            self.wake.set()

    def set_kernels(self, report: dict | None) -> None:
        """The daemon's kernel watch (driverd.apply.kernelprep): a newer kernel without the node's driver gets a
        Warning Event KernelUnprepared (again when the reason changes), one prepared since a Normal Event
        KernelPrepared; the agent's own thread sends them."""
        if report is None:
            return
        for rel, k in sorted(report.items()):
            said = self._kernels_said.get(rel)
            if not k.get("prepared"):
                msg = (f"kernel {rel} is installed without this node's driver package ({k.get('short')}): "
                       f"{k.get('reason')}" + (f"; fix: {k['fix']}" if k.get("fix") else "")
                       + ("; driverd tries again" if k.get("next_try_in_s") is not None else ""))
                if said != ("unprepared", k.get("reason")):
                    self._kernels_said[rel] = ("unprepared", k.get("reason"))
                    self._kernel_news.append(("KernelUnprepared", msg, True))
            elif said is not None and said[0] != "prepared":
                self._kernels_said[rel] = ("prepared", None)
                self._kernel_news.append(("KernelPrepared", f"kernel {rel}: this node's driver package is installed "
                                          "and verified: a reboot into it comes back with the driver", False))
        for rel in [r for r in self._kernels_said if r not in report]:
            del self._kernels_said[rel]
        if self._kernel_news:
            self.wake.set()

    def relabel(self) -> None:
        """The daemon's own reconcile changed what is loaded (a joining node's first driver, a driver
        loaded back after a reboot): the labels and GPUDriverReady follow at once."""
        self._labels_checked = False
        self.wake.set()

    # -- loop ---------------------------------------------------------------------------------------
    def _changed(self, kind: str, obj: dict) -> None:
        self.wake.set()

    def _rollout_changed(self, kind: str, obj: dict) -> None:
        """Only spec, annotation and phase changes concern a node; the coordinator's progress
        counts (written every second) do not wake every node of the fleet."""
        md = obj.get("metadata") or {}
        seen = (kind == "DELETED", md.get("generation"), json.dumps(md.get("annotations") or {}, sort_keys=True),
                (obj.get("status") or {}).get("phase"), md.get("deletionTimestamp"))
        if kind not in ("SYNC",) and self._rollout_seen.get(md.get("name", "")) == seen:
            return
        self._rollout_seen[md.get("name", "")] = seen
        self.wake.set()

    def start(self) -> NodeAgent:
        self.nodes.start()
        self.rollouts.start()
        self.pools.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.wake.set()
        if self._pod_watch is not None:
            self._end_pod_watch()
        self._end_workload_watch()
        self.nodes.close()
        self.rollouts.close()
        self.pools.close()

    def pool_list(self) -> list[pl.Pool]:
        return pl.read(self.pools.snapshot())[0]

    def run(self) -> None:
        self.start()
        self.nodes.synced.wait(30)
        self.rollouts.synced.wait(30)
        self.pools.synced.wait(30)
        while not self.stop.is_set():
            self.wake.clear()
            try:
                delay = self.tick()
            except ClusterError as e:     # an API answer, or none (the API server away): said, retried
                self.log(f"driverd cluster agent: {e.one_line()}")
                delay = 5.0
            except Exception as e:    # a bug must not kill the agent: say it, retry later
                self.log(f"driverd cluster agent: unexpected {e.__class__.__name__}: {e}")
                delay = 10.0
            if delay is None or delay > 0:
                self.wake.wait(delay if delay is not None else 300.0)

    # -- the state machine ---------------------------------------------------------------------------
    def view(self) -> tuple[dict | None, m.NodeView | None]:
        node = self.nodes.get(self.node)
        return node, (m.NodeView.from_node(node) if node else None)

    def rollout(self, name: str | None) -> tuple[m.Rollout | None, dict | None]:
        obj = self.rollouts.get(name) if name else None
        if obj is None:
            return None, None
        try:
            return m.Rollout.from_object(obj), obj
        except m.SpecError:
            return None, obj

    def tick(self) -> float | None:
        """Act on the node's current state once; the seconds until we must look again (None: only
        when something changes). Each handler makes at most one transition."""
        node, v = self.view()
        if v is None:
            return 5.0
        if self._kernel_news and self.events:
            news, self._kernel_news = self._kernel_news, []
            for reason, message, warning in news:
                self.event(node, reason, message, warning=warning)
        if not self._labels_checked:
            self._labels_checked = True
            self._sync_labels(node, v)
            return 0
        if v.state not in POD_WATCH_STATES and self._pod_watch is not None:
            self._end_pod_watch()       # and the drain's own records: no state after these evicts again
        if v.state != m.VALIDATING and self._wl_watch is not None:
            self._end_workload_watch()
        state = states.node_state(v.state)
        if state is None:
            return self._unknown_state(node, v)
        if state.free:
            if oc.A_PAUSED in (node["metadata"].get("annotations") or {}):
                return self._restore_components(node)
            return self._preflight(v)
        name = (v.rollout or "").split("/")[0]
        r, obj = self.rollout(name)
        if r is None:
            r = self._fallback_rollout(node, v)
        # an aborted or deleted rollout gets its nodes back (an admission it did not make is the
        # handler's to refuse: it never becomes a give-back that would free the node's driver)
        if obj is not None and v.state in (m.ADMITTED, m.CORDONED, m.WAITING, m.EVICTING) and \
                not (v.state == m.ADMITTED and self._admission_problem(v)):
            if (obj["metadata"].get("annotations") or {}).get(m.A_ABORT) == "true":
                return self._give_back(node, v, "Aborted", f"rollout {name} was aborted before the driver was touched")
            if obj["metadata"].get("deletionTimestamp"):
                return self._give_back(node, v, "Aborted", f"rollout {name} was deleted before the driver was "
                                       "touched (deleting a rollout aborts it)")
            if m.ended(obj) and (obj.get("status") or {}).get("phase") == pl.SUPERSEDED:
                return self._give_back(node, v, pl.SUPERSEDED, f"rollout {name} was superseded by its pool's next "
                                       "revision before the driver was touched")
        return getattr(self, state.handler)(node, v, r)

    def _unknown_state(self, node: dict, v: m.NodeView) -> float | None:
        """A state this driverd has no handler for (written by hand, or by another version): the node
        is given back as failed, with its driver pinned as it runs, never left half-way and silent."""
        return self._fail(node, v, "UnknownState", f"driverd.io/state={v.state!r} is not a state this driverd "
                          f"knows ({', '.join(states.NODE_STATES)}); fix: retry the node "
                          "(kubectl driverd node retry NODE) once every daemon runs the same version")

    def _fallback_rollout(self, node: dict, v: m.NodeView) -> m.Rollout:
        """The rollout was deleted mid-way: finish what was started with default policies."""
        tv, tf = m.split_driver((node["metadata"].get("annotations") or {}).get(m.A_TARGET))
        return m.Rollout(name=(v.rollout or "deleted").split("/")[0], generation=0, driver=tv or "0.0",
                         flavor=tf or "auto")

    def _to(self, node: dict, state: str, reason: str, message: str, *, rollout: str | None = None,
            ann: dict | None = None, spec: dict | None = None, labels: dict | None = None, warning: bool = False,
            precondition: bool = False) -> dict:
        """One transition: a merge patch of the Node (state annotations, and the cordon/labels that go
        with it) and an Event. With `precondition` the patch carries the resourceVersion read, so a
        concurrent change (an admin's cordon) makes it fail with 409 instead of being overwritten."""
        patch = m.state_patch(state, reason, message, since=now_rfc3339(self.clock()), rollout=rollout, extra=ann)
        if spec:
            patch["spec"] = spec
        if labels:
            patch["metadata"]["labels"] = labels
        if precondition:
            patch["metadata"]["resourceVersion"] = node["metadata"]["resourceVersion"]
        new = self.kube.patch(node_path(self.node), patch)
        self.nodes.put(new)
        self.log(f"driverd cluster: node {self.node}: {state}: {reason}: {message}")
        if self.events:
            self.event(new, reason, message, warning=warning)
        return new

    def event(self, node: dict, reason: str, message: str, *, warning: bool = False) -> None:
        involved = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": (node.get("metadata") or {}).get("uid")}
        events.record(self.kube, involved, reason, message, warning=warning, instance=self.node, log=self.log,
                      now=self.clock())

    def _elapsed(self, v: m.NodeView) -> float:
        t = parse_time(v.since)
        return 0.0 if t is None else max(0.0, self.clock() - t)

    # -- evicting ---------------------------------------------------------------------------------------
    def _pods(self, labels: str | None = None, *, retry: bool = True) -> list[dict]:
        return self.kube.list(pods_path(), labels=labels or None, fields=f"spec.nodeName={self.node}",
                              retry=retry).get("items") or []

    def _leaving_with_driver(self, r: m.Rollout) -> dict[str, str]:
        """The DaemonSets (namespace/name) whose pods on the node leave with the driver, as the drain
        decides it, read before the cordon: the cordon takes the driver-ready label away and a fast
        DaemonSet controller removes their pods before the drain's first look (the kubelet's count of
        their GPUs lags them by its status loop, so a DaemonSet missed here let `validating` end early)."""
        return _leaving(self._drain_plan(r, watched=True, pods=self._node_pods()))

    def _pod_watch_view(self) -> list[dict] | None:
        """The node's pods as its watch shows them (started at the first call: one list, then a watch
        whose every event wakes the agent); None while the watch is not synced or has failed since its
        last event (RBAC without `watch` on pods, the API server restarting): then ask the API."""
        if self._pod_watch is None:
            self._pod_watch = Informer(self.kube, pods_path(), fields=f"spec.nodeName={self.node}",
                                       name=f"pods/{self.node}", on_change=self._changed, log=self.log,
                                       watch_timeout_s=DRAIN_WATCH_S).start()
        w = self._pod_watch
        return w.snapshot() if w.tried.wait(10) and w.synced.is_set() and w.error is None else None

    def _node_pods(self) -> list[dict]:
        """The node's pods, from its watch where it answers, else listed (retried)."""
        pods = self._pod_watch_view()
        return self._pods() if pods is None else pods

    def _watched_pods(self) -> list[dict]:
        """The drain's view of the node's pods (_pod_watch_view), and the start of the drain's clock."""
        pods = self._pod_watch_view()
        if pods is None:
            # the watch refused or broken: its cache may be behind, the API is not. Asked once: an API
            # server that does not answer stops the drain's clock (below) instead of a retry hiding it
            try:
                pods = self._pods(retry=False)
            except ClusterError as e:
                if outage(e):
                    self._drain_view = None
                raise
        if self._drain_view is None:
            self._drain_view = self.clock()
        return pods

    def _drain_elapsed(self, v: m.NodeView) -> float:
        """The drain's time so far: since the node began evicting, or since this daemon's view of its
        pods last began (its first round, the API server back after an outage), whichever is later."""
        since = parse_time(v.since) or 0.0
        start = max(since, self._drain_view) if self._drain_view else since
        return max(0.0, self.clock() - start)

    def _end_pod_watch(self) -> None:
        if self._pod_watch is not None:
            self._pod_watch.close()
            self._pod_watch = None
        self._evicted.clear()
        self._drain_view = None
        self._daemonsets, self._refusals = {}, {}

    def _drain_plan(self, r: m.Rollout, *, watched: bool = False, pods: list[dict] | None = None) -> DrainPlan:
        if pods is None:
            pods = self._watched_pods() if watched else self._pods()
        extra = {p["metadata"]["uid"] for p in self._pods(r.drain_selector)} if r.drain_selector else set()
        self._empty_dir = {p["metadata"]["uid"] for p in pods
                           if any("emptyDir" in vol for vol in (p.get("spec") or {}).get("volumes") or [])}
        self._deleting_since = {p["metadata"]["uid"]: p["metadata"].get("deletionTimestamp") for p in pods}
        md = (self.nodes.get(self.node) or {}).get("metadata") or {}
        return plan_drain(self.kube, pods, self.host.gpu_users(self.cfg), drain_selector_uids=extra,
                          force=r.drain_force, selector=r.drain_selector,
                          operator_labels=oc.leaving(md.get("labels") or {}, md.get("annotations")),
                          daemonsets=self._daemonsets if watched else None)

    def _backoff(self, v: m.NodeView) -> float:
        """The wait before the next eviction round: doubles from EVICT_FIRST_S up to EVICT_RETRY_S
        within one stay in `evicting` (a pod stuck Terminating or a PDB refusing is not hammered)."""
        since, rounds = self._drain_round
        rounds = rounds + 1 if since == v.since else 1
        self._drain_round = (v.since, rounds)
        return min(EVICT_RETRY_S, EVICT_FIRST_S * 2 ** (rounds - 1))

    def _evict(self, node: dict, v: m.NodeView, r: m.Rollout) -> float:
        """One eviction round. Every way a pod can stay counts against spec.drain.timeoutSeconds: a
        PodDisruptionBudget (429), any other refusal of the API (e.g. 500 for a pod under two
        budgets), a pod stuck Terminating, a DaemonSet pod its controller has not removed yet.
        Rounds back off; at the timeout the node fails naming each pod and the API's words."""
        paused = self._pause_components(node, oc.EARLY)
        if paused is not None:
            return paused
        try:
            plan = self._drain_plan(r, watched=True)
        except ClusterError as e:
            if not outage(e):
                raise
            self.log(f"driverd cluster: node {self.node}: evicting: cannot read its pods ({e.one_line()}); "
                     "the drain's timeout counts again once the API server answers")
            return 1.0
        if plan.no_controller and not r.drain_force:
            return self._fail(node, v, "EvictionRefused", f"{len(plan.no_controller)} GPU pod(s) have no controller, "
                              f"so nothing would recreate them ({', '.join(u.ref for u in plan.no_controller[:5])}); "
                              "kubectl drain refuses them too: set spec.drain.force=true to delete them anyway")
        users = plan.evict + (plan.no_controller if r.drain_force else [])
        # the pods of a component paused last (the DRA kubelet plugin) are not waited for before its pause
        late = set(oc.to_pause(node["metadata"].get("labels") or {}, oc.LATE))
        leaving = [u for u in plan.with_label if plan.leaves_by.get(u.uid) not in late]
        # the DaemonSets whose pods leave with the driver (the device plugin among them): `done` waits for
        # them to be back (validating), not only for the kubelet's count, which lags them by its status loop
        self._left_with.update(_leaving(plan))
        if not users and not leaving and not plan.held:
            # the DRA kubelet plugin goes last: the pods that left needed it to release their claims
            paused = self._pause_components(node, oc.LATE)
            if paused is not None:
                return paused
            # what the cordon recorded, and what the drain saw leave since
            left = {**m.left_with(node["metadata"].get("annotations")), **self._left_with}
            self._left_with = {}
            self._to(node, m.UNLOADING, "Unloading", f"no GPU pods left; node transaction to driver {r.driver}: "
                     "unload → install → load → validate",
                     ann={m.A_LEFT_WITH: m.left_with_value(left)})
            return 0
        if not r.drain_empty_dir:
            local = [u for u in users if u.uid in self._empty_dir]
            if local:
                return self._fail(node, v, "EvictionRefused", f"{len(local)} GPU pod(s) use emptyDir volumes whose data "
                                  f"would be lost ({', '.join(u.ref for u in local[:5])}); set "
                                  "spec.drain.deleteEmptyDirData=true to evict them anyway")
        stuck: list[tuple[PodUse, str]] = []
        unreachable = False         # a pod's eviction reached no API server, and no earlier try got an answer
        for u in users:
            if u.terminating:      # already being deleted: another eviction would change nothing
                stuck.append((u, f"stuck Terminating since {self._deleting_since.get(u.uid) or '?'}"))
                continue
            if u.uid in self._evicted:      # evicted; the watch has not shown its deletion yet
                stuck.append((u, "evicted, its deletion not seen yet"))
                continue
            try:
                self.kube.create(pods_path(u.namespace, u.name) + "/eviction",
                                 {"apiVersion": "policy/v1", "kind": "Eviction",
                                  "metadata": {"name": u.name, "namespace": u.namespace}}, retry=False)
                self._evicted.add(u.uid)
            except KubeError as e:
                if e.status == 404:
                    continue
                if outage(e):       # the API server shutting down or overloaded: not its verdict on the pod
                    unreachable |= u.uid not in self._refusals
                    stuck.append((u, self._refusals.get(u.uid) or e.one_line()))
                    continue
                self._refusals[u.uid] = _pdb_words(e) if e.status == 429 else \
                    f"eviction answered {e.status} {e.reason}: {e.api_message}"
                stuck.append((u, self._refusals[u.uid]))
            except ClusterError as e:
                unreachable |= u.uid not in self._refusals
                stuck.append((u, self._refusals.get(u.uid) or e.one_line()))
        stuck += [(u, f"its DaemonSet has not removed it yet ({plan.leaves_by[u.uid]}={oc.PAUSED})"
                   if u.uid in plan.leaves_by else
                   "its DaemonSet has not removed it yet (the node lost the driver-ready label at the cordon)")
                  for u in leaving]
        stuck += [(u, f"opts out of the drain ({oc.SKIP_DRAIN}=true) and {u.why}: waiting for it to end")
                  for u in plan.held]
        if plan.held and not users and not leaving:
            self._say(node, v, "WaitingForPods", f"drained but for {len(plan.held)} GPU pod(s) that opt out of the "
                      f"drain ({oc.SKIP_DRAIN}=true): {', '.join(f'{u.ref} ({u.why})' for u in plan.held[:5])}; the "
                      f"driver is not unloaded while they run: waiting up to spec.drain.timeoutSeconds="
                      f"{r.drain_timeout_s} for them to end")
        if not stuck:
            return EVICT_FIRST_S     # evicted: look again shortly for pods still terminating
        left = r.drain_timeout_s - self._drain_elapsed(v)
        if left > 0:
            return min(self._backoff(v), left + 0.1)
        if unreachable and left > -r.drain_timeout_s:
            # the timeout is about pods that stay; whether this one would has not been asked yet (the API
            # server restarting): ask again, for at most one more timeout, before failing the node
            return 1.0
        words = "; ".join(f"{u.ref} ({why})" for u, why in stuck[:5]) + \
            (f" and {len(stuck) - 5} more" if len(stuck) > 5 else "")
        forced = [u for u, _ in stuck if u not in plan.with_label and u not in plan.held and not u.terminating]
        if r.drain_force and forced:
            for u in forced:
                try:
                    self.kube.delete(pods_path(u.namespace, u.name))
                except KubeError as e:
                    if e.status != 404:
                        raise
            self._to(node, m.EVICTING, "ForcedDeletion", f"eviction still refused after {r.drain_timeout_s}s: "
                     f"deleted {len(forced)} pod(s) per spec.drain.force: {words}", warning=True)
            return 1.0
        return self._fail(node, v, "EvictionBlocked", f"pods still on the node after spec.drain.timeoutSeconds="
                          f"{r.drain_timeout_s}: {words}; fix: relax the PodDisruptionBudget, move the workload, "
                          "remove what keeps the pod Terminating, or set spec.drain.force" +
                          (f" (a pod labelled {oc.SKIP_DRAIN}=true is never evicted: let it end or remove the label)"
                           if plan.held else ""))

    def _say(self, node: dict, v: m.NodeView, reason: str, message: str) -> None:
        """What a wait is waiting for, on the Node (reason and message; the state and since stay, so
        the wait's deadline does not move), once per change, with an Event."""
        if (v.reason, v.message) == (reason, message[:1000]):
            return
        new = self.kube.patch(node_path(self.node), {"metadata": {"annotations": {
            m.A_REASON: reason, m.A_MESSAGE: message[:1000]}}})
        self.nodes.put(new)
        self.log(f"driverd cluster: node {self.node}: {v.state}: {reason}: {message}")
        if self.events:
            self.event(new, reason, message)

    # -- the GPU Operator's components (operator_components.py) ------------------------------------------
    def _pause_components(self, node: dict, stage: str) -> float | None:
        """Pause the node's `true` components of `stage` (their DaemonSets' pods leave) and record them,
        in one patch that keeps the node evicting (the drain's clock starts again: their pods are
        waited for like the GPU pods); None when there is nothing to pause."""
        md = node["metadata"]
        labels, ann = oc.pause(md.get("labels") or {}, md.get("annotations"), stage)
        if not labels:
            return None
        try:
            # with the resourceVersion read: an operator's `false` written meanwhile is never overwritten
            self._to(node, m.EVICTING, "PausedOperatorComponents", f"GPU Operator components paused for the upgrade "
                     f"({oc.names(labels)}: {oc.DEPLOY_PREFIX}<component>={oc.PAUSED}); waiting for their pods "
                     "to leave the node" + ("" if stage == oc.EARLY else " (the DRA kubelet plugin goes last)"),
                     ann=ann, labels=labels, precondition=True)
        except KubeError as e:
            if e.conflict:        # our view of the node is behind: its watch event wakes us
                return EVICT_FIRST_S
            raise
        return EVICT_FIRST_S


def _pdb_words(e: KubeError) -> str:
    """Kubernetes' own words for a refused eviction: the DisruptionBudget cause names the PDB."""
    causes = ((e.body.get("details") or {}).get("causes") or [])
    named = [c.get("message") for c in causes if c.get("reason") == "DisruptionBudget" and c.get("message")]
    return "; ".join(named) or e.api_message


__all__ = ["A_BOOT", "CONDITION", "DRAIN_WATCH_S", "EVICT_FIRST_S", "EVICT_RETRY_S", "NodeAgent"]
