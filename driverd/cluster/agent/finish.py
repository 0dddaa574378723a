"""The node agent (driverd.cluster.agent.NodeAgent) from the node transaction to the node given back:
the transaction and the reboot it may need, validation (the node Ready, its GPUs schedulable again, and
the rollout's validation workload pod when it asks for one: cluster/workloadpod.py), the endings (done,
failed, given back), and what the node says of its driver all along: its labels and the GPUDriverReady
condition."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from driverd.apply.preflight import driver_config
from driverd.cluster import model as m
from driverd.cluster import operator_components as oc
from driverd.cluster import schedulable as sched
from driverd.cluster import workloadpod as wlp
from driverd.cluster.informer import Informer
from driverd.cluster.kube import Kube, KubeError, node_path, now_rfc3339, parse_time, pods_path
from driverd.cluster.nodehost import NodeHost

A_BOOT = m.PREFIX + "boot-id"
CONDITION = "GPUDriverReady"
# `validating` looks again at least this often; most of what it waits for wakes it sooner, as it is
# watched: the Node (Ready, its GPUs' count) and the node's pods (the DaemonSets' pods that left with the
# driver). A DRA plugin's ResourceSlices are not: their return is seen at the next look.
VALIDATE_POLL_S = 5.0
# How long `validating` waits for the node's GPUs before it says so (WaitingForGPUs: a Node patch and an
# Event at each change of what it waits for): the device plugin's pod is usually back within a second, and
# a wait that short is not news (issue 47: ~1.7 requests a node in a 500-node rollout on 16 cores).
SAY_GPUS_WAIT_S = 2.0


class NodeFinish:
    """NodeAgent's side from the transaction to the end of its upgrade (a mixin: NodeAgent holds these)."""
    kube: Kube
    node: str
    namespace: str
    cfg: Any
    host: NodeHost
    nodes: Informer
    events: bool
    log: Callable[[str], None]
    clock: Callable[[], float]
    workload: tuple[bool, str] | None
    waiting: str | None
    # when this daemon first saw the node's GPUs short in its present `validating` (its since, the clock):
    # the since annotation is whole seconds, too coarse to time a 2-s wait
    _short_since: tuple[str, float] | None = None
    _wl_watch: Informer | None
    _node_pods: Callable[[], list[dict]]
    _reboot_checked: bool
    _to: Callable[..., dict]
    _elapsed: Callable[[m.NodeView], float]
    _say: Callable[[dict, m.NodeView, str, str], None]
    event: Callable[..., None]
    view: Callable[[], tuple[dict | None, m.NodeView | None]]
    _changed: Callable[[str, dict], None]

    # -- labels and GPUDriverReady -------------------------------------------------------------------
    def condition(self, ready: bool, reason: str, message: str) -> None:
        """The Node condition GPUDriverReady (status subresource, merged by type as the kubelet's own
        conditions are): True while a validated driver runs, False while it is being replaced."""
        now = now_rfc3339(self.clock())
        cond = {"type": CONDITION, "status": "True" if ready else "False", "reason": reason,
                "message": message[:1000], "lastTransitionTime": now, "lastHeartbeatTime": now}
        try:
            self.kube.patch(node_path(self.node) + "/status", {"status": {"conditions": [cond]}}, kind="strategic")
        except KubeError as e:
            self.log(f"driverd cluster: cannot set the {CONDITION} condition: {e.one_line()}")

    def _sync_labels(self, node: dict, v: m.NodeView) -> None:
        """Node labels say what is loaded (and whether it is validated), from the host's facts."""
        loaded = self.host.loaded(self.cfg)
        wl = self.workload
        usable = bool(loaded) and (wl is None or wl[0])
        want = {m.L_VERSION: loaded["version"] if loaded else None, m.L_FLAVOR: loaded["flavor"] if loaded else None}
        if v.state not in m.ACTIVE:
            want[m.L_READY] = "true" if usable else None
        patch: dict = {}
        if any(v.labels.get(k) != val for k, val in want.items()):
            patch["labels"] = want
        if self.waiting is not None and v.waiting != self.waiting[:1000]:
            patch["annotations"] = {m.A_WAITING: self.waiting[:1000] or None}
        if patch:
            self.nodes.put(self.kube.patch(node_path(self.node), {"metadata": patch}))
        conds = {c.get("type"): c for c in (node.get("status") or {}).get("conditions") or []}
        have = conds.get(CONDITION) or {}
        if not loaded:
            reason, message = "NoDriver", "no NVIDIA driver is loaded"
        elif not usable:
            reason, message = "NotWorkloadReady", f"driver {loaded['version']} ({loaded['flavor']}) loaded, not " \
                f"workload-ready: {wl[1]}"
        else:
            reason, message = "DriverLoaded", f"driver {loaded['version']} ({loaded['flavor']}) loaded" + \
                (", workload-ready" if wl else "")
        status = "True" if usable else "False"
        if v.state not in m.ACTIVE and (have.get("status"), have.get("reason"), have.get("message")) != \
                (status, reason, message[:1000]):
            self.condition(usable, reason, message)

    # -- the GPU Operator's components (operator_components.py) ------------------------------------------
    def _restore_components(self, node: dict) -> float:
        """A free node that still records paused components (its upgrade ended without restoring them:
        the record was edited by hand, or left by another version): they come back now."""
        labels, ann, keys = oc.restore(node["metadata"].get("labels") or {}, node["metadata"].get("annotations"))
        patch = {"metadata": {"annotations": ann, "labels": labels}}
        new = self.kube.patch(node_path(self.node), patch)
        self.nodes.put(new)
        message = (f"GPU Operator components back: {oc.names(keys)}" if keys else
                   "no paused GPU Operator component left to restore") + " (their pause outlived the upgrade)"
        self.log(f"driverd cluster: node {self.node}: {message}")
        if self.events and keys:
            self.event(new, "RestoredOperatorComponents", message)
        return 0

    # -- the node transaction ---------------------------------------------------------------------------
    def _transact(self, node: dict, v: m.NodeView, r: m.Rollout) -> float:
        cfg = driver_config(self.cfg, r.driver, r.flavor, source=f"rollout {r.key}")
        res = self.host.transact(cfg)
        node, v = self.view()
        if res.converged:
            self._to(node, m.VALIDATING, "Validating", f"driver {res.loaded['version']} ({res.loaded['flavor']}) "
                     "loaded and validated on the host; waiting for the node to be Ready")
            return 0
        if res.state == "reboot-required":
            self._to(node, m.REBOOT, "RebootRequired", res.reason + " (the reboot sentinel /var/run/reboot-required "
                     "is set for the cluster's reboot coordinator, e.g. kured)", ann={A_BOOT: self.host.boot_id(cfg)},
                     warning=True)
            return None
        reason = {"rolled-back": "RolledBack", "rollback-failed": "RollbackFailed", "blocked": "TransactionBlocked",
                  "lock": "HostLocked", "validation": "ValidationFailed"}.get(res.failure or "", "TransactionFailed")
        return self._fail(node, v, reason, res.reason)

    def _after_reboot(self, node: dict, v: m.NodeView, r: m.Rollout) -> float | None:
        before = (node["metadata"].get("annotations") or {}).get(A_BOOT) or ""
        now = self.host.boot_id(self.cfg)
        if before == now and (now or self._reboot_checked):
            return None          # not rebooted yet: the reboot coordinator's turn
        # a new boot, or no boot id to tell (then the transaction says whether a reboot is still due,
        # once per daemon start: a daemon starts again after a reboot)
        self._reboot_checked = True
        self._to(node, m.UNLOADING, "Rebooted", f"the node rebooted; finishing the upgrade to {r.driver}")
        return 0

    # -- validating → done ---------------------------------------------------------------------------------
    def _not_back(self, node: dict) -> list[str]:
        """The DaemonSets whose pods left with the driver (recorded at the cordon and the drain) that have
        no Ready pod on the node again, in words. The kubelet publishes a plugin's leaving and return in
        its next status (up to 10 s): its count alone read the old plugin's devices as back (seen on the
        real kubelet). One whose label is no longer `true` (an operator turned the component off during
        the upgrade) does not come back and is not waited for."""
        md = node.get("metadata") or {}
        labels = md.get("labels") or {}
        left = [ref for ref, label in sorted(m.left_with(md.get("annotations")).items())
                if label == m.L_READY or labels.get(label) == oc.TRUE]
        if not left:
            return []
        pods = self._node_pods()
        out = []
        for ref in left:
            ns, _, name = str(ref).partition("/")
            mine = [p for p in pods if (p.get("metadata") or {}).get("namespace") == ns and any(
                o.get("kind") == "DaemonSet" and o.get("name") == name for o in p["metadata"].get("ownerReferences") or [])]
            if not any(_ready_pod(p) for p in mine):
                out.append(f"DaemonSet {ref}: " + (f"its pod {mine[0]['metadata'].get('name')} is not Ready yet" if mine
                                                  else "no pod on the node yet"))
        return out

    def _validate(self, node: dict, v: m.NodeView, r: m.Rollout) -> float:
        if not v.ready:
            if self._elapsed(v) < r.validation_timeout_s:
                return min(VALIDATE_POLL_S, r.validation_timeout_s - self._elapsed(v) + 0.1)
            return self._fail(node, v, "NodeNotReady", f"the driver is loaded but the node was not Ready within "
                              f"{r.validation_timeout_s}s (kubelet not posting Ready)")
        loaded = self.host.loaded(self.cfg)
        if loaded is None or loaded["version"] != r.driver:
            return self._fail(node, v, "ValidationFailed", f"the node runs {loaded['version'] if loaded else 'no driver'}"
                              f", not {r.driver}")
        before = sched.decode((node["metadata"].get("annotations") or {}).get(m.A_GPUS_BEFORE))
        if before:
            # done means its GPUs can be scheduled again. The device plugin (or DRA plugin) comes back with
            # the driver-ready label and the GPU Operator's component labels (their DaemonSets select
            # them; DaemonSet pods ignore the cordon): those first, the cordon stays until the count is back
            back, back_ann, said = _restored(node)
            if v.labels.get(m.L_READY) != "true" or back:
                new = self.kube.patch(node_path(self.node), {"metadata": {
                    "labels": {m.L_READY: "true", **back}, "annotations": back_ann}})
                self.nodes.put(new)
                self.log(f"driverd cluster: node {self.node}: validating: driver validated; its GPU DaemonSets may "
                         f"come back (driverd.io/driver-ready=true{said})")
                if said and self.events:
                    self.event(new, "RestoredOperatorComponents", f"driver validated{said}; the node stays cordoned "
                               "until its GPUs are schedulable again")
                return 0
            short = self._not_back(node) + sched.shortfall(
                before, sched.counts(node, sched.node_slices(self.kube, self.node) if sched.DRA_KEY in before else []))
            if short:
                waited = self._elapsed(v)
                if waited < r.validation_timeout_s:
                    if self._short_since is None or self._short_since[0] != v.since:
                        self._short_since = (v.since, self.clock())
                    short_for = self.clock() - self._short_since[1]
                    if short_for < SAY_GPUS_WAIT_S:     # not news yet: look again when it would be (a watch may wake
                        # it sooner)
                        return min(VALIDATE_POLL_S, SAY_GPUS_WAIT_S - short_for + 0.05)
                    self._say(node, v, "WaitingForGPUs", "driver validated; waiting for the node's GPUs to be "
                              "schedulable again: " + "; ".join(short))
                    return min(VALIDATE_POLL_S, r.validation_timeout_s - waited + 0.1)
                return self._fail(node, v, "GPUsNotSchedulable", "; ".join(short) + f" after "
                                  f"{r.validation_timeout_s}s (spec.validation.timeoutSeconds): the device plugin or "
                                  "the DRA kubelet plugin did not come back with the driver")
        ran = ""
        if r.workload_pod is not None:
            step, ran = self._workload_pod(node, v, r)
            if step != "ok":
                return ran
        spec = {"unschedulable": None} if v.cordoned_by_us else None
        back, back_ann, said = _restored(node)
        self._to(node, m.DONE, "Upgraded", f"driver {loaded['version']} ({loaded['flavor']}) validated" + ran
                 + ("; uncordoned" if v.cordoned_by_us else "; left cordoned: it was cordoned before driverd") + said,
                 ann={m.A_CORDONED: None, m.A_GPUS_BEFORE: None, m.A_LEFT_WITH: None, **back_ann}, spec=spec,
                 labels={m.L_VERSION: loaded["version"], m.L_FLAVOR: loaded["flavor"], m.L_READY: "true", **back})
        self.condition(True, "DriverValidated", f"driver {loaded['version']} ({loaded['flavor']}) loaded and validated")
        return None

    # -- the validation workload pod (spec.validation.workloadPod, cluster/workloadpod.py) ----------------
    def _workload_pod(self, node: dict, v: m.NodeView, r: m.Rollout) -> tuple[str, Any]:
        """The rollout's workload pod on this node, once its GPUs are schedulable again: ("ok", words for
        the done message) once it Succeeded; ("wait", seconds) while it runs; ("failed", None) when it
        Failed, did not succeed within its timeout or could not be created — the node is failed
        (WorkloadPodFailed), through the ending every failure takes (uncordoned, counted against the
        failure budget). The pod is deleted before the node moves on, either way: nothing is left on the
        node, and a daemon restarted before the move runs it once more rather than leaving it behind."""
        wp = r.workload_pod
        assert wp is not None
        timeout = r.workload_timeout_s
        name = wlp.pod_name(self.node, v.rollout or r.key, v.attempt, v.since)
        ref = f"{self.namespace}/{name}"
        pod = self._workload_view(name)
        if pod is None:
            gpu = wlp.publishes_gpus(node)
            try:
                pod = self.kube.create(pods_path(self.namespace), wlp.manifest(
                    name, self.namespace, self.node, r.name, wp, gpu=gpu))
            except KubeError as e:
                if e.conflict:          # created by this daemon before a restart, not in the view yet
                    return "wait", 1.0
                if e.status in (400, 403, 404, 422):
                    # refused for good (the admission policy, RBAC, a namespace that does not exist, an
                    # image reference the API rejects): waiting out the timeout would change nothing
                    return "failed", self._fail(node, v, "WorkloadPodFailed", f"the validation workload pod {ref} "
                                                f"could not be created: {e.status} {e.reason}: {e.api_message}")
                raise
            if self._wl_watch is not None:
                self._wl_watch.put(pod)
            self._say(node, v, "ValidatingWorkload", f"GPUs schedulable again; running the validation workload pod "
                      f"{ref} (image {wp.image}, runtime class {wlp.RUNTIME_CLASS}, " +
                      (f"one {wlp.GPU}" if gpu else f"no {wlp.GPU} limit: the node publishes none") +
                      f") for up to {timeout}s (spec.validation.workloadPod)")
            return "wait", min(float(timeout), 10.0)
        took = max(0.0, self.clock() - (parse_time(pod["metadata"].get("creationTimestamp")) or self.clock()))
        ok = wlp.finished(pod)
        if ok is True:
            self._delete_workload(name)
            return "ok", f"; validation workload pod {ref} succeeded after {took:.0f}s"
        if ok is False:
            self._delete_workload(name)
            return "failed", self._fail(node, v, "WorkloadPodFailed", f"validation workload pod {ref} (image "
                                        f"{wp.image}) failed: {wlp.failure(pod)}")
        left = timeout - took
        if left > 0:
            # its watch wakes the agent at every change; the bound only re-reads a watch that broke
            return "wait", min(left + 0.1, 10.0)
        self._delete_workload(name)
        return "failed", self._fail(node, v, "WorkloadPodFailed", f"validation workload pod {ref} (image {wp.image}) "
                                    f"did not succeed within {timeout}s (spec.validation.workloadPod.timeoutSeconds, "
                                    f"else spec.validation.timeoutSeconds): {wlp.pending(pod)}")

    def _workload_view(self, name: str) -> dict | None:
        """The workload pod as its watch shows it (one list, then a watch of that one name, which wakes the
        agent when the pod changes); listed from the API while the watch is not synced or has failed."""
        w = self._wl_watch
        fields = f"metadata.name={name}"
        if w is None or w.fields != fields:
            if w is not None:
                w.close()
            w = self._wl_watch = Informer(self.kube, pods_path(self.namespace), fields=fields,
                                          name=f"validation/{self.node}", on_change=self._changed, log=self.log).start()
        if w.tried.wait(10) and w.synced.is_set() and w.error is None:
            return w.get(f"{self.namespace}/{name}")
        items = self.kube.list(pods_path(self.namespace), fields=fields).get("items") or []
        return items[0] if items else None

    def _delete_workload(self, name: str) -> None:
        try:
            self.kube.delete(pods_path(self.namespace, name))
        except KubeError as e:
            if not e.not_found:
                raise
        self._end_workload_watch()

    def _end_workload_watch(self) -> None:
        if self._wl_watch is not None:
            self._wl_watch.close()
            self._wl_watch = None

    # -- endings that give the node back --------------------------------------------------------------------
    def _fail(self, node: dict, v: m.NodeView, reason: str, message: str) -> float | None:
        """The node leaves the rollout failed. The daemon's own reconciles are pinned to the driver
        that runs *now* (driverd.io/pinned-driver): after a rollback that is the previous one, after
        a driver that loaded but left the node NotReady it is the new one — changing it again is a
        decision for an admitted retry or a new rollout, never for the periodic reconcile."""
        loaded = self.host.loaded(self.cfg)
        labels = {m.L_VERSION: loaded["version"] if loaded else None,
                  m.L_FLAVOR: loaded["flavor"] if loaded else None, m.L_READY: "true" if loaded else None}
        spec = {"unschedulable": None} if v.cordoned_by_us else None
        pinned = f"{loaded['version']}/{loaded['flavor']}" if loaded else None
        back, back_ann, said = _restored(node)
        self._to(node, m.FAILED, reason, message + ("; uncordoned" if v.cordoned_by_us else "") + said,
                 ann={m.A_CORDONED: None, m.A_GPUS_BEFORE: None, m.A_LEFT_WITH: None, m.A_PINNED: pinned, **back_ann},
                 spec=spec,
                 labels={**labels, **back},
                 warning=True)
        self.condition(bool(loaded), reason, (f"the upgrade failed; driver {loaded['version']} runs: " if loaded
                                              else "the upgrade failed and no driver is loaded: ") + message)
        return None

    def _give_back(self, node: dict, v: m.NodeView, reason: str, message: str, *,
                   warning: bool = False) -> float | None:
        spec = {"unschedulable": None} if v.cordoned_by_us else None
        back, back_ann, said = _restored(node)
        self._to(node, m.IDLE, reason, message + ("; uncordoned" if v.cordoned_by_us else "") + said,
                 ann={m.A_CORDONED: None, m.A_GPUS_BEFORE: None, m.A_LEFT_WITH: None, **back_ann}, spec=spec,
                 labels={m.L_READY: "true", **back}, warning=warning)
        self.condition(True, reason, message)
        return None


def _ready_pod(p: dict) -> bool:
    st = p.get("status") or {}
    return st.get("phase") == "Running" and not (p.get("metadata") or {}).get("deletionTimestamp") and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])


def _restored(node: dict) -> tuple[dict, dict, str]:
    """What ends the pause of the GPU Operator's components, for the patch that ends the node's
    upgrade (done, failed, given back): labels, annotations, and words for the message."""
    md = node.get("metadata") or {}
    back, back_ann, keys = oc.restore(md.get("labels") or {}, md.get("annotations"))
    return back, back_ann, (f"; GPU Operator components back: {oc.names(keys)}" if keys else "")
