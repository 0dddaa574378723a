"""Living beside NVIDIA's GPU Operator (driverd/cluster/operator_components.py): the Operator's
components are paused during a node's upgrade through their `nvidia.com/gpu.deploy.<component>`
labels, as k8s-driver-manager does, and exactly what driverd paused comes back — also after its daemon
was killed mid-way; a pod labelled `nvidia.com/gpu-driver-upgrade-drain.skip=true` is never evicted.

The label bookkeeping is tested as functions. What Kubernetes does is Kubernetes' own: the Operator's
DaemonSets run on the real control plane with the real DaemonSet controller (a second
kube-controller-manager running only `daemonset`; tests/controlplane.py's does not run it), which
creates a pod for every node that matches a DaemonSet's nodeSelector and deletes it from a node that
no longer does. No scheduler runs here: `Binder` plays kube-scheduler for those pods (a Binding to the
node the controller's node affinity names) and starts each pod's process on the simulated host
holding /dev/nvidiactl, as the device plugin's does; the fleet's kubelet stand-in ends it when the pod
is deleted. Nor does the node lifecycle controller: the test lifts the `node.kubernetes.io/not-ready`
taint the apiserver puts on a new Node (the Operator's pods do not tolerate it), as that controller
does once the node is Ready."""
from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from driverd.cluster import model as m
from driverd.cluster import operator_components as oc
from driverd.cluster.kube import Kube, KubeError, Target, node_path, pods_path, rollout_path
from driverd.sim.fleet import GPU_NS, NEW, OLD
from tests.cluster.test_rollout import cluster, kube, started, views, wait_phase  # noqa: F401 (fixture)
from tests.conftest import stop_process

OPERATOR_NS = "gpu-operator"
DP, DCGM, GFD, DRA = (oc.DEPLOY_PREFIX + c for c in ("device-plugin", "dcgm-exporter", "gpu-feature-discovery",
                                                      "dra-driver"))


# -- the bookkeeping, as functions --------------------------------------------------------------------------
def test_only_true_labels_are_paused_and_recorded():
    labels = {DP: "true", DCGM: "true", GFD: "false", DRA: "true", oc.DEPLOY_PREFIX + "driver": "true",
              oc.DEPLOY_PREFIX + "nvsm": "pre-installed", "other": "true"}
    lab, ann = oc.pause(labels, {}, oc.EARLY)
    assert lab == {DP: oc.PAUSED, DCGM: oc.PAUSED}            # not false, not the driver, not other values
    assert json.loads(ann[oc.A_PAUSED]) == sorted([DP, DCGM])
    labels.update(lab)
    assert oc.pause(labels, ann, oc.EARLY) == ({}, {})        # nothing left: no second write
    # the DRA kubelet plugin goes last, and joins the record
    lab2, ann2 = oc.pause(labels, ann, oc.LATE)
    assert lab2 == {DRA: oc.PAUSED} and json.loads(ann2[oc.A_PAUSED]) == sorted([DP, DCGM, DRA])


def test_restore_gives_back_exactly_what_was_paused_and_is_still_paused():
    labels = {DP: oc.PAUSED, DCGM: "false", GFD: oc.PAUSED, DRA: oc.PAUSED}
    ann = {oc.A_PAUSED: json.dumps([DP, DCGM, DRA])}
    lab, ann_patch, keys = oc.restore(labels, ann)
    # DCGM was set to false by an operator meanwhile: left; GFD was paused by someone else: not ours
    assert lab == {DP: "true", DRA: "true"} and keys == sorted([DP, DRA])
    assert ann_patch == {oc.A_PAUSED: None}
    assert oc.restore(labels, {}) == ({}, {}, [])
    # a record nobody can read: every component label still paused comes back, nothing else moves
    lab, ann_patch, _ = oc.restore(labels, {oc.A_PAUSED: "{not json"})
    assert lab == {DP: "true", GFD: "true", DRA: "true"} and ann_patch == {oc.A_PAUSED: None}
    # keys that are not component labels are never written back
    assert oc.recorded({oc.A_PAUSED: json.dumps(["kubernetes.io/hostname", DP, 7])}) == [DP]


def test_which_pods_leave_with_a_paused_label():
    keys = oc.leaving({DP: "true", DCGM: oc.PAUSED, GFD: "false"}, {oc.A_PAUSED: json.dumps([DCGM])})
    assert keys == {DP, DCGM}
    assert oc.leaving({DCGM: oc.PAUSED}, {}) == set()         # paused by someone else: its pods are not ours to wait for
    assert oc.selects({"nodeSelector": {DP: "true"}}, keys) == DP
    assert oc.selects({"nodeSelector": {GFD: "true"}}, keys) is None
    aff = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": DCGM, "operator": "In", "values": ["true"]}]}]}}}}
    assert oc.selects(aff, keys) == DCGM
    # a DaemonSet that also runs on paused nodes does not leave
    aff["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][0]["values"] = ["true", oc.PAUSED]
    assert oc.selects(aff, keys) is None


# -- on the real control plane ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def daemonset_controller(deployed):
    """The real DaemonSet controller, for this module's tests only (other tests play their own)."""
    log = open(deployed.dir / "kube-controller-manager-daemonset.log", "a")
    p = subprocess.Popen([str(deployed.bin / "kube-controller-manager"), "--kubeconfig", deployed.kubeconfig,
                          "--bind-address", "127.0.0.1", "--secure-port", "0", "--controllers", "daemonset",
                          "--use-service-account-credentials=false", "--leader-elect=false", "-v", "1"],
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    log.close()
    yield p
    stop_process(p)
    # deploy/'s own driverd DaemonSet got pods on the test nodes meanwhile (never bound: no scheduler)
    deployed.api("DELETE", "/api/v1/namespaces/driverd/pods",
                 {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})


class Binder:
    """kube-scheduler for the Operator's DaemonSet pods: binds each to the node its controller names
    (required node affinity on metadata.name) and starts its process on that simulated host."""

    def __init__(self, f) -> None:
        self.f, self.k = f, kube(f)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Binder:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                for p in self.k.list(pods_path(OPERATOR_NS)).get("items") or []:
                    self._place(p)
            except Exception:              # the apiserver busy: the next round
                pass
            self.stop.wait(0.2)

    def _place(self, p: dict) -> None:
        md, spec = p["metadata"], p.get("spec") or {}
        if md.get("deletionTimestamp"):
            return
        node = spec.get("nodeName")
        if not node:
            terms = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                     .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
            node = next((f["values"][0] for t in terms for f in t.get("matchFields") or []
                         if f.get("key") == "metadata.name"), None)
            if node not in self.f.nodes:
                return
            try:
                self.k.create(pods_path(OPERATOR_NS, md["name"]) + "/binding", {
                    "apiVersion": "v1", "kind": "Binding", "metadata": {"name": md["name"]},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node}})
            except KubeError as e:
                if e.status != 409:
                    raise
        if node in self.f.nodes:
            self.f._ensure_process(node, md["uid"], md["labels"]["app"][:15], "/dev/nvidiactl")


def operator(f, components=(("device-plugin", "nvidia-device-plugin-daemonset"),
                            ("dcgm-exporter", "nvidia-dcgm-exporter"),
                            ("gpu-feature-discovery", "gpu-feature-discovery"))) -> None:
    """The GPU Operator's DaemonSets as gpu-operator renders them: each selects its deploy label."""
    k = kube(f)
    for ns_path, obj in (("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                  "metadata": {"name": OPERATOR_NS}}),):
        try:
            k.create(ns_path, obj)
        except KubeError as e:
            if e.status != 409:
                raise
    for comp, app in components:
        k.create(f"/apis/apps/v1/namespaces/{OPERATOR_NS}/daemonsets", {
            "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": app, "namespace": OPERATOR_NS},
            "spec": {"selector": {"matchLabels": {"app": app}},
                     "template": {"metadata": {"labels": {"app": app}},
                                  "spec": {"nodeSelector": {oc.DEPLOY_PREFIX + comp: "true"},
                                           "automountServiceAccountToken": False,
                                           "terminationGracePeriodSeconds": 1,
                                           "containers": [{"name": comp, "image": f"{comp}:1"}]}}}})


def operator_pods(f, node: str) -> dict[str, str]:
    """app -> pod uid of the Operator's pods bound to `node` and not being deleted."""
    items = kube(f).list(pods_path(OPERATOR_NS), fields=f"spec.nodeName={node}").get("items") or []
    return {p["metadata"]["labels"]["app"]: p["metadata"]["uid"] for p in items
            if not p["metadata"].get("deletionTimestamp")}


def label_deploy(f, node: str, values: dict) -> None:
    kube(f).patch(node_path(node), {"metadata": {"labels": {oc.DEPLOY_PREFIX + k: v for k, v in values.items()}}})


class LabelHistory:
    """Every value the node's deploy labels took, from a watch of the Node."""

    def __init__(self, f, node: str) -> None:
        from driverd.cluster.informer import Informer
        self.seen: dict[str, list[str | None]] = {}
        self.changes: list[tuple[str, str | None]] = []          # in the order the watch delivered them
        self.informer = Informer(kube(f), node_path(), fields=f"metadata.name={node}", name="history",
                                 on_change=self._changed)

    def _changed(self, kind: str, node: dict) -> None:
        if kind == "SYNC":          # the end of a LIST, no object
            node = self.informer.get(node.get("metadata", {}).get("name", "")) or {}
            if not node:
                return
        labels = (node.get("metadata") or {}).get("labels") or {}
        for k in (DP, DCGM, GFD, DRA):
            vals = self.seen.setdefault(k, [])
            if not vals or vals[-1] != labels.get(k):
                vals.append(labels.get(k))
                self.changes.append((k, labels.get(k)))

    def __enter__(self) -> LabelHistory:
        self.informer.start()
        self.informer.synced.wait(30)
        return self

    def __exit__(self, *exc) -> None:
        self.informer.close()


def _labels(f, node: str) -> dict:
    return kube(f).get(node_path(node))["metadata"].get("labels") or {}


def _ann(f, node: str) -> dict:
    return kube(f).get(node_path(node))["metadata"].get("annotations") or {}


def _rollout(name: str, **spec) -> dict:
    return {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": name},
            "spec": {"driver": NEW, **spec}}


def _with_operator(cluster, n: int = 1, deploy: dict | None = None, daemonsets: bool = True):
    srv, make = cluster
    f = make(n)
    for node in f.nodes:
        label_deploy(f, node, deploy or {"device-plugin": "true", "dcgm-exporter": "true",
                                         "gpu-feature-discovery": "false"})
        kube(f).patch(node_path(node), {"spec": {"taints": None}})     # the node lifecycle controller's part
    if daemonsets:
        operator(f)
    return f


def test_operator_components_are_paused_during_the_upgrade_and_come_back(cluster, daemonset_controller):
    f = _with_operator(cluster, deploy={"device-plugin": "true", "dcgm-exporter": "true",
                                        "gpu-feature-discovery": "false", "dra-driver": "true"})
    operator(f, (("dra-driver", "nvidia-dra-driver-kubelet-plugin"),))
    node = "gpu-0000"
    with Binder(f):
        assert f.wait(lambda: set(operator_pods(f, node)) == {"nvidia-device-plugin-daemonset", "nvidia-dcgm-exporter",
                                                              "nvidia-dra-driver-kubelet-plugin"}, 60), \
            operator_pods(f, node)
        before = operator_pods(f, node)
        started(f)
        with LabelHistory(f, node) as h:
            kube(f).create(rollout_path(), _rollout("r"))
            # the device plugin and DCGM exporter hold /dev/nvidiactl: before, the preflight named them
            ro = wait_phase(f, "r", ("Completed", "Refused", "Failed"), timeout=120)
            assert ro["status"]["phase"] == "Completed", ro["status"]
            # back on the node: the DaemonSet controller made new pods once the labels were true again
            assert f.wait(lambda: set(operator_pods(f, node)) == set(before), 30), operator_pods(f, node)
            time.sleep(0.5)
        after = operator_pods(f, node)
    assert all(after[app] != before[app] for app in before), "the DaemonSet controller never removed its pods"
    assert h.seen[DP] == ["true", oc.PAUSED, "true"] and h.seen[DCGM] == ["true", oc.PAUSED, "true"], h.seen
    assert h.seen[GFD] == ["false"], h.seen                     # an operator's false is never touched
    # the DRA kubelet plugin is paused last, after the others and the GPU pods had gone
    assert h.seen[DRA] == ["true", oc.PAUSED, "true"], h.seen
    order = [k for k, val in h.changes if val == oc.PAUSED]
    assert order[-1] == DRA and set(order) == {DP, DCGM, DRA}, h.changes
    assert oc.A_PAUSED not in _ann(f, node)
    v = views(f)[node]
    assert v.state == m.DONE and v.driver == NEW, v.message
    evs = [e for e in kube(f).list("/api/v1/namespaces/default/events")["items"] if e["involvedObject"]["name"] == node]
    assert "PausedOperatorComponents" in [e["reason"] for e in evs]
    # they come back once the driver is validated, before the node is done: the device plugin must publish
    # the GPUs again before the cordon goes (issue 42)
    back = [e["message"] for e in evs if e["reason"] == "RestoredOperatorComponents"]
    assert any("GPU Operator components back: dcgm-exporter, device-plugin, dra-driver" in b for b in back), back


def test_a_component_that_does_not_leave_with_the_pause_is_named_by_the_preflight(cluster, daemonset_controller):
    """A DaemonSet edited to run on paused nodes too: its pod would stay and keep the GPU open, so the
    preflight names it (and only it: the DCGM exporter leaves with its label)."""
    f = _with_operator(cluster)
    node = "gpu-0000"
    k = kube(f)
    # the device plugin's DaemonSet is edited to run on paused nodes as well: its pod will stay
    k.patch(f"/apis/apps/v1/namespaces/{OPERATOR_NS}/daemonsets/nvidia-device-plugin-daemonset", {"spec": {
        "template": {"spec": {"nodeSelector": None, "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": DP, "operator": "In", "values": ["true", oc.PAUSED]}]}]}}}}}}})
    with Binder(f):
        assert f.wait(lambda: len(operator_pods(f, node)) == 2, 60), operator_pods(f, node)
        started(f)
        k.create(rollout_path(), _rollout("r", preflight="Exclude", drain={"timeoutSeconds": 4}))
        ro = wait_phase(f, "r", ("Failed", "Completed", "Refused"), timeout=120)
    v = views(f)[node]
    # it is a GPU user whose DaemonSet does not leave: the preflight would have named it; with
    # Exclude the node is out. Its twin that does leave (dcgm-exporter) did not block anything.
    assert ro["status"]["phase"] == "Completed" and ro["status"]["nodes"]["excluded"] == 1, ro["status"]
    reason = ro["status"]["preflightFailures"][0]["reason"]
    assert "nvidia-device-plugin-daemonset" in reason and "nvidia-dcgm-exporter" not in reason, reason
    assert v.state == m.IDLE and v.driver == OLD
    assert _labels(f, node)[DP] == "true" and oc.A_PAUSED not in _ann(f, node)


def test_pods_that_stay_after_the_pause_fail_the_node_within_the_drain_timeout(cluster, daemonset_controller):
    f = _with_operator(cluster)
    node = "gpu-0000"
    with Binder(f):
        assert f.wait(lambda: len(operator_pods(f, node)) == 2, 60), operator_pods(f, node)
        started(f)
        daemonset_controller.send_signal(19)            # SIGSTOP: the controller stops acting
        try:
            kube(f).create(rollout_path(), _rollout("r", drain={"timeoutSeconds": 3}))
            ro = wait_phase(f, "r", ("Failed", "Completed", "Paused"), timeout=120)
            v = views(f)[node]
            labels = _labels(f, node)
        finally:
            daemonset_controller.send_signal(18)        # SIGCONT
    assert v.state == m.FAILED and v.reason == "EvictionBlocked" and v.driver == OLD, (v.reason, v.message)
    assert f"its DaemonSet has not removed it yet ({DP}={oc.PAUSED})" in v.message, v.message
    assert "GPU Operator components back: dcgm-exporter, device-plugin" in v.message
    assert labels[DP] == "true" and labels[DCGM] == "true" and labels[GFD] == "false"
    assert oc.A_PAUSED not in _ann(f, node)
    assert ro["status"]["nodes"]["failed"] == 1


def test_a_daemon_killed_while_components_are_paused_restores_exactly_those(cluster, daemonset_controller):
    """The pause is recorded on the Node with it: the daemon dies while the node is evicting (a PDB
    holds its GPU pod), an operator sets one paused component to false meanwhile, and the daemon
    started again restores the other one when the upgrade ends — and leaves the operator's false."""
    f = _with_operator(cluster)
    node = "gpu-0000"
    f.pdb_never(node)
    with Binder(f):
        assert f.wait(lambda: len(operator_pods(f, node)) == 2, 60), operator_pods(f, node)
        started(f)
        kube(f).create(rollout_path(), _rollout("r", drain={"timeoutSeconds": 300}))
        assert f.wait(lambda: _labels(f, node).get(DP) == oc.PAUSED and not operator_pods(f, node), 60), \
            (_labels(f, node), operator_pods(f, node))
        assert views(f)[node].state == m.EVICTING
        f.kill_node(node)
        assert json.loads(_ann(f, node)[oc.A_PAUSED]) == sorted([DP, DCGM])
        label_deploy(f, node, {"dcgm-exporter": "false"})     # an operator turns DCGM off meanwhile
        f.set_pdb(node, 1)
        f.start_node(node)
        wait_phase(f, "r", ("Completed",), timeout=120)
        labels = _labels(f, node)
        assert labels[DP] == "true" and labels[DCGM] == "false" and labels[GFD] == "false", labels
        assert oc.A_PAUSED not in _ann(f, node)
        assert f.wait(lambda: set(operator_pods(f, node)) == {"nvidia-device-plugin-daemonset"}, 30)


def test_a_free_node_still_recording_a_pause_gets_its_components_back(cluster):
    """A record the upgrade's end did not clear (a node reset by hand mid-upgrade): the daemon restores
    what it names and nothing else."""
    f = _with_operator(cluster, deploy={"device-plugin": oc.PAUSED, "dcgm-exporter": oc.PAUSED}, daemonsets=False)
    node = "gpu-0000"
    kube(f).patch(node_path(node), {"metadata": {"annotations": {oc.A_PAUSED: json.dumps([DP])}}})
    started(f)
    assert f.wait(lambda: oc.A_PAUSED not in _ann(f, node), 30)
    labels = _labels(f, node)
    assert labels[DP] == "true" and labels[DCGM] == oc.PAUSED       # not driverd's: left as it is


# -- the drain opt-out ------------------------------------------------------------------------------------------
def _skip_pod(f, node: str, name: str, *, process: bool) -> str:
    """A GPU pod that opts out of the drain, with a controller (a ReplicaSet would recreate it)."""
    k = kube(f)
    rs = k.create(f"/apis/apps/v1/namespaces/{GPU_NS}/replicasets", {
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": name, "namespace": GPU_NS},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}}})
    uid = f.running_pod(GPU_NS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": GPU_NS, "labels": {"app": name, oc.SKIP_DRAIN: "true"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": name,
                                          "uid": rs["metadata"]["uid"], "controller": True}]},
        "spec": {"nodeName": node, "automountServiceAccountToken": False,
                 "containers": [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}})
    if process:
        f._ensure_process(node, uid, "infer", "/dev/nvidia0")
    return uid


def test_a_pod_opting_out_of_the_drain_that_holds_the_gpu_is_named_by_the_preflight(cluster):
    srv, make = cluster
    f = make(1)
    _skip_pod(f, "gpu-0000", "keep", process=True)
    started(f)
    kube(f).create(rollout_path(), _rollout("r"))
    ro = wait_phase(f, "r", ("Refused",))
    reason = ro["status"]["preflightFailures"][0]["reason"]
    assert f"pod {GPU_NS}/keep: opts out of the drain ({oc.SKIP_DRAIN}=true), so it is not evicted" in reason, reason
    assert views(f)["gpu-0000"].state == m.IDLE and not views(f)["gpu-0000"].unschedulable


def test_the_node_waits_for_a_pod_opting_out_of_the_drain_and_never_evicts_it(cluster):
    """A GPU pod labelled to opt out, not holding a device when the preflight looked: the node is
    drained of everything else and waits, saying why, until the pod ends (here: finishes), then upgrades;
    a second node's such pod never ends, and that node fails at the timeout with its driver untouched,
    even with spec.drain.force."""
    srv, make = cluster
    f = make(2)
    k = kube(f)
    uids = {n: _skip_pod(f, n, f"keep-{n}", process=False) for n in f.nodes}
    started(f)
    k.create(rollout_path(), _rollout("r", maxParallel=2, maxUnavailable=2,
                                      drain={"timeoutSeconds": 15, "force": True}))
    # both nodes drained of the training pods, and say what they wait for
    assert f.wait(lambda: all(v.state == m.EVICTING and v.reason == "WaitingForPods" for v in views(f).values()), 60), \
        {n: (v.state, v.reason, v.message) for n, v in views(f).items()}
    v0 = views(f)["gpu-0000"]
    assert f"{GPU_NS}/keep-gpu-0000 (requests nvidia.com/gpu); the driver is not unloaded while they run" in v0.message
    assert not [p for p in k.list(pods_path(GPU_NS))["items"] if p["metadata"]["name"].startswith("train-")]
    # gpu-0000's pod finishes (its kubelet reports it Succeeded): the node goes on
    k.patch(pods_path(GPU_NS, "keep-gpu-0000") + "/status", {"status": {"phase": "Succeeded"}}, kind="strategic")
    ro = wait_phase(f, "r", ("Failed", "Completed", "Paused"), timeout=120)
    vs = views(f)
    assert vs["gpu-0000"].state == m.DONE and vs["gpu-0000"].driver == NEW, (vs["gpu-0000"].reason, vs["gpu-0000"].message)
    assert vs["gpu-0001"].state == m.FAILED and vs["gpu-0001"].reason == "EvictionBlocked"
    assert vs["gpu-0001"].driver == OLD and not vs["gpu-0001"].unschedulable
    assert f"{GPU_NS}/keep-gpu-0001 (opts out of the drain ({oc.SKIP_DRAIN}=true) and requests nvidia.com/gpu: " \
           "waiting for it to end)" in vs["gpu-0001"].message, vs["gpu-0001"].message
    for n, uid in uids.items():
        p = k.get(pods_path(GPU_NS, f"keep-{n}"))
        assert p["metadata"]["uid"] == uid and not p["metadata"].get("deletionTimestamp"), n   # never evicted
    assert ro["status"]["nodes"]["failed"] == 1


def test_a_node_credential_pauses_only_true_operator_labels_of_its_own_node(cluster):
    """deploy/'s admission policy: driverd may move its own node's nvidia.com/gpu.deploy.* labels from
    true to paused-for-driver-upgrade and back, nothing else of them."""
    srv, make = cluster
    f = make(2)
    label_deploy(f, "gpu-0000", {"device-plugin": "true", "dcgm-exporter": "false"})
    label_deploy(f, "gpu-0001", {"device-plugin": "true"})
    own = Kube(Target(kubeconfig=f.node_kubeconfig("gpu-0000")))
    own.patch(node_path("gpu-0000"), {"metadata": {"labels": {DP: oc.PAUSED}}})
    own.patch(node_path("gpu-0000"), {"metadata": {"labels": {DP: "true"}}})
    for labels in ({DCGM: oc.PAUSED}, {DCGM: "true"}, {GFD: "true"}, {DP: None}, {DP: "false"},
                   {"nvidia.com/gpu.present": "false"}):
        with pytest.raises(KubeError) as e:
            own.patch(node_path("gpu-0000"), {"metadata": {"labels": labels}})
        assert e.value.status in (403, 422) and "nvidia.com/gpu.deploy" in e.value.api_message, labels
    with pytest.raises(KubeError) as e:
        own.patch(node_path("gpu-0001"), {"metadata": {"labels": {DP: oc.PAUSED}}})
    assert e.value.status in (403, 422)
    assert _labels(f, "gpu-0000")[DP] == "true" and _labels(f, "gpu-0001")[DP] == "true"


class SlowBinder(Binder):
    """Binder, binding each pod `delay_s` after it first saw it: a device plugin's pod that becomes Ready
    only after the node began validating, with nothing on the Node changing then."""

    def __init__(self, f, delay_s: float) -> None:
        super().__init__(f)
        self.delay_s, self.first_seen, self.bound = delay_s, {}, {}   # bound: pod uid -> the node's state then

    def _place(self, p: dict) -> None:
        seen = self.first_seen.setdefault(p["metadata"]["uid"], time.monotonic())
        if p.get("spec", {}).get("nodeName") or time.monotonic() - seen >= self.delay_s:
            if not p.get("spec", {}).get("nodeName"):
                self.bound[p["metadata"]["uid"]] = views(self.f)["gpu-0000"].state
            super()._place(p)


def _rollout_with_a_late_device_plugin(f, node: str, delay_s: float):
    """Rollout `r` over `node`, whose device plugin's new pod is bound `delay_s` after it is made: the Node's
    metadata at every version its watch saw (with "_seen_at", time.monotonic() then), the GPU Operator's
    pods before and after, the binder."""
    from driverd.cluster.informer import Informer
    seen: list[dict] = []
    history = Informer(kube(f), node_path(), fields=f"metadata.name={node}", name="history",
                       on_change=lambda k, o: seen.append({**o["metadata"], "_seen_at": time.monotonic()})
                       if o.get("metadata") else None)
    with SlowBinder(f, delay_s) as b:
        assert f.wait(lambda: "nvidia-device-plugin-daemonset" in operator_pods(f, node), 60), operator_pods(f, node)
        before = operator_pods(f, node)
        started(f)
        history.start()
        assert history.synced.wait(30)
        kube(f).create(rollout_path(), _rollout("r", validation={"timeoutSeconds": 300}))
        ro = wait_phase(f, "r", ("Completed", "Refused", "Failed"), timeout=120)
        history.close()
        assert ro["status"]["phase"] == "Completed", ro["status"]
        after = operator_pods(f, node)
    return seen, before, after, b


def _said(md: dict, key: str) -> str | None:
    return (md.get("annotations") or {}).get(key)


def test_a_validating_node_is_woken_by_its_daemonsets_pod_becoming_ready(cluster, daemonset_controller, monkeypatch):
    """Issue 47: `validating` waits for the DaemonSets' pods that left with the driver; one that becomes
    Ready after the node's last look (a Pod's change, nothing on the Node) wakes it through the node's
    pod watch. Here the periodic look is four minutes away, so only the watch can finish the rollout in time
    (before, it waited for that look: 5 s, one straggler in a 500-node rollout's makespan)."""
    from driverd.cluster.agent import finish
    monkeypatch.setattr(finish, "VALIDATE_POLL_S", 240.0)
    monkeypatch.setattr(finish, "SAY_GPUS_WAIT_S", 240.0)       # no look to say the wait either
    f = _with_operator(cluster, deploy={"device-plugin": "true", "dcgm-exporter": "false",
                                        "gpu-feature-discovery": "false"})
    seen, before, after, b = _rollout_with_a_late_device_plugin(f, "gpu-0000", 2.0)
    # which DaemonSets leave with the driver is read at the cordon, while their pods are all there (a fast
    # DaemonSet controller removes them before the drain's first look)
    at_cordon = next((_said(md, m.A_LEFT_WITH) for md in seen if _said(md, m.A_REASON) == "Cordoned"), None)
    assert m.left_with({m.A_LEFT_WITH: at_cordon}) == {"gpu-operator/nvidia-device-plugin-daemonset": DP}, seen
    new = after.get("nvidia-device-plugin-daemonset")
    assert new and new != before["nvidia-device-plugin-daemonset"], (before, after)
    assert b.bound.get(new) == m.VALIDATING, b.bound       # the node waited for it, validating


def test_a_wait_for_the_gpus_is_said_once_it_has_lasted(cluster, daemonset_controller):
    """Issue 47: `validating` says its wait for the node's GPUs (WaitingForGPUs: a Node patch and an Event
    at each change of what it waits for) once it has lasted finish.SAY_GPUS_WAIT_S, not at every sub-second
    change of a wait the device plugin ends within a second; a long one is said and names the DaemonSet.
    Here the device plugin's pod is bound 6 s late."""
    from driverd.cluster.agent import finish
    f = _with_operator(cluster, deploy={"device-plugin": "true", "dcgm-exporter": "false",
                                        "gpu-feature-discovery": "false"})
    seen, _, _, _ = _rollout_with_a_late_device_plugin(f, "gpu-0000", 6.0)
    validating = [md for md in seen if _said(md, m.A_STATE) == m.VALIDATING]
    waits = [md for md in validating if _said(md, m.A_REASON) == "WaitingForGPUs"]
    assert waits and "DaemonSet gpu-operator/nvidia-device-plugin-daemonset" in _said(waits[-1], m.A_MESSAGE), \
        [(_said(md, m.A_REASON), _said(md, m.A_MESSAGE)) for md in validating]
    # not before: the watch sees the wait's first record no sooner than the threshold after validating's
    # (a busy machine only delays the second; 0.5 s for the watch delivering the first one late)
    lasted = waits[0]["_seen_at"] - validating[0]["_seen_at"]
    assert lasted >= finish.SAY_GPUS_WAIT_S - 0.5, (lasted, [(_said(md, m.A_REASON), md["_seen_at"])
                                                             for md in validating])
