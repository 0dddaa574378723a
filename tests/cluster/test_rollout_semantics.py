"""Rollouts on a busy fleet, as an operator expects them to behave: the preflight judges the host
after the drain, a rollout is one object at one spec generation, ended rollouts hold no node, every
eviction failure counts against the drain timeout, pods without a controller are not evicted
without force, NotReady nodes are named, deletion is an abort, the Lease survives clock skew.

Everything goes through the API, on the real control plane (the fixtures of test_rollout.py): the
two-PDB 500, the finalizer holding a pod Terminating, the PDBs' verdicts are kube-apiserver's and the
disruption controller's own."""
from __future__ import annotations

import json
import os
import time

from driverd.cluster import model as m
from driverd.cluster.kube import KubeError, lease_path, node_path, now_rfc3339, rollout_path
from driverd.sim.fleet import GPU_NS, NEW, OLD, PLUGIN, PLUGIN_NS
from tests.cluster.test_rollout import cli, cluster, kube, started, views, wait_phase  # noqa: F401 (fixture)

API = "driverd.io/v1alpha1"


def rollout(name: str, **spec) -> dict:
    return {"apiVersion": API, "kind": "DriverRollout", "metadata": {"name": name}, "spec": {"driver": NEW, **spec}}


def host_process(f, node: str, comm: str = "nvidia-smi", pid: int = 4242) -> int:
    """A process on the host, outside any pod, holding the GPU (what a node's admin may leave running)."""
    base = f.nodes[node].root / "proc" / str(pid)
    (base / "fd").mkdir(parents=True)
    (base / "comm").write_text(comm + "\n")
    (base / "cmdline").write_text(comm + "\0")
    (base / "cgroup").write_text("0::/user.slice/user-0.slice/session-3.scope\n")
    os.symlink("/dev/nvidia0", base / "fd" / "3")
    return pid


def gpu_holders(f, node: str) -> list[str]:
    """The processes of pods (cgroup under kubepods) that hold /dev/nvidia* on the node."""
    out = []
    for fd in (f.nodes[node].root / "proc").glob("*/fd/*"):
        proc = fd.parent.parent
        if os.readlink(fd).startswith("/dev/nvidia") and "kubepods" in (proc / "cgroup").read_text():
            out.append((proc / "comm").read_text().strip())
    return sorted(out)


# -- 1: the preflight judges the host as it will be after the drain -------------------------------------
def test_preflight_judges_the_host_after_the_drain(cluster):
    srv, make = cluster
    f = make(2, device_plugin=True)
    pid = host_process(f, "gpu-0001")
    started(f)
    assert f.wait(lambda: len(kube(f).list(f"/api/v1/namespaces/{PLUGIN_NS}/pods")["items"]) == 2, 30)
    # gpu-0000: a training pod's process and the device plugin's hold the GPU; both leave with the drain
    assert gpu_holders(f, "gpu-0000") == ["nvidia-device-p", "python"]
    k = kube(f)
    k.create(rollout_path(), rollout("r", maxParallel=2, maxUnavailable=2))
    ro = wait_phase(f, "r", ("Refused",))
    failures = {p["node"]: p["reason"] for p in ro["status"]["preflightFailures"]}
    assert set(failures) == {"gpu-0001"}, failures          # the busy node is not a blocker
    assert f"pid {pid} (nvidia-smi)" in failures["gpu-0001"]  # the host process is, and is named
    assert "python" not in failures["gpu-0001"] and "nvidia-device-p" not in failures["gpu-0001"]
    assert all(v.state == m.IDLE for v in views(f).values())
    # with the blocker left out, the busy node goes through: its pods leave, the plugin comes back
    k.patch(rollout_path("r"), {"spec": {"preflight": "Exclude"}})
    ro = wait_phase(f, "r", ("Completed",))
    vs = views(f)
    assert vs["gpu-0000"].driver == NEW and vs["gpu-0000"].state == m.DONE and vs["gpu-0001"].driver == OLD
    assert ro["status"]["nodes"]["excluded"] == 1
    assert f.wait(lambda: gpu_holders(f, "gpu-0000") == ["nvidia-device-p"], 20)   # the DaemonSet's new pod
    assert k.find(f"/api/v1/namespaces/{GPU_NS}/pods/train-gpu-0000-0") is None      # evicted
    assert k.find(f"/api/v1/namespaces/{GPU_NS}/pods/train-gpu-0001-0") is not None  # left alone


def test_a_daemonset_that_does_not_follow_the_label_is_named_by_the_preflight(cluster):
    srv, make = cluster
    f = make(1, device_plugin=True)
    # the DaemonSet runs everywhere: its pod would stay on the node and keep the GPU open
    kube(f).patch(f"/apis/apps/v1/namespaces/{PLUGIN_NS}/daemonsets/{PLUGIN}",
                  {"spec": {"template": {"spec": {"nodeSelector": None}}}})
    started(f)
    assert f.wait(lambda: "nvidia-device-p" in gpu_holders(f, "gpu-0000"), 30)
    kube(f).create(rollout_path(), rollout("r"))
    ro = wait_phase(f, "r", ("Refused",))
    reason = ro["status"]["preflightFailures"][0]["reason"]
    assert f"pod {PLUGIN_NS}/{PLUGIN}-gpu-0000: DaemonSet {PLUGIN} does not select nodes by " \
           f"{m.L_READY}=true" in reason


# -- 2: a rollout is one object at one spec generation -----------------------------------------------------
def test_an_edited_driver_is_carried_out_and_a_recreated_rollout_is_a_new_one(cluster):
    srv, make = cluster
    f = started(make(2))
    k = kube(f)
    k.create(rollout_path(), rollout("r", maxParallel=2, maxUnavailable=2))
    wait_phase(f, "r", ("Completed",))
    assert {v.driver for v in views(f).values()} == {NEW}
    k.patch(rollout_path("r"), {"spec": {"driver": OLD}})        # changed target: generation 2
    ro = wait_phase(f, "r", ("Completed",))
    assert ro["metadata"]["generation"] == 2 and ro["status"]["nodes"]["done"] == 2
    assert {v.driver for v in views(f).values()} == {OLD}, ro["status"]
    assert f"run driver {OLD}" in ro["status"]["message"]
    # deleted and re-created under the same name: another rollout, carried out
    k.delete(rollout_path("r"))
    assert f.wait(lambda: k.find(rollout_path("r")) is None, 20), "the finalizer was never removed"
    k.create(rollout_path(), rollout("r", maxParallel=2, maxUnavailable=2))
    wait_phase(f, "r", ("Completed",))
    assert {v.driver for v in views(f).values()} == {NEW}


# -- 3: ended rollouts hold no node; the message names what blocks --------------------------------------------
def _stuck_evicting(cluster, name: str):
    """A 2-node fleet whose rollout `name` holds gpu-0000 in `evicting` (its PDB never allows it)."""
    srv, make = cluster
    f = make(2)
    f.pdb_never("gpu-0000")
    started(f)
    k = kube(f)
    k.create(rollout_path(), rollout(name, drain={"timeoutSeconds": 300}))
    assert f.wait(lambda: views(f)["gpu-0000"].state == m.EVICTING, 30)
    return srv, f, k


def test_an_aborted_rollout_holds_no_node(cluster):
    srv, f, k = _stuck_evicting(cluster, "r1")
    assert cli(f, "rollout", "abort", "r1")[0] == 0
    wait_phase(f, "r1", ("Aborted",))
    f.set_pdb("gpu-0000", 1)
    t0 = time.monotonic()
    k.create(rollout_path(), rollout("r2", maxParallel=2, maxUnavailable=2))
    wait_phase(f, "r2", ("Completed",), timeout=60)
    assert time.monotonic() - t0 < 60
    assert {v.driver for v in views(f).values()} == {NEW}


def test_a_live_rollout_holding_the_nodes_is_named():
    from driverd.cluster.admission import decide
    r = m.Rollout.from_object({"metadata": {"name": "r2", "generation": 1, "uid": "u2"}, "spec": {"driver": NEW}})
    n = m.NodeView.from_node({"metadata": {"name": "a"}, "spec": {},
                              "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    d = decide(r, [n], now=1000, started=0, held={"a": "rollout r1: Paused"})
    assert d.admit == [] and d.reason == "NodesHeld" and "a (rollout r1: Paused)" in d.message
    assert "did not answer" not in d.message


# -- 4 and 7: every eviction failure counts against the drain timeout; no controller, no eviction ---------------
def test_every_eviction_failure_ends_at_the_timeout_naming_the_pod_and_the_error(cluster):
    srv, make = cluster
    f = make(3)
    f.two_pdbs("gpu-0000")              # the Eviction API answers 500
    f.stuck_terminating("gpu-0001")     # evicted once, then Terminating for ever
    solo = f.no_controller("gpu-0002", process=False)  # nothing would recreate it (idle: the preflight passes)
    started(f)
    k = kube(f)
    before = {n: f.nodes[n].kube.requests for n in f.nodes}
    k.create(rollout_path(), rollout("r", maxParallel=3, maxUnavailable=3, failureBudget=3,
                                     drain={"timeoutSeconds": 4}))
    assert f.wait(lambda: all(v.state == m.FAILED for v in views(f).values()), 60), \
        {n: (v.state, v.message) for n, v in views(f).items()}
    vs = views(f)
    assert vs["gpu-0000"].reason == "EvictionBlocked"
    assert "gpu-jobs/train-gpu-0000-0 (eviction answered 500" in vs["gpu-0000"].message
    assert "more than one PodDisruptionBudget" in vs["gpu-0000"].message
    assert vs["gpu-0001"].reason == "EvictionBlocked" and "train-gpu-0001-0 (stuck Terminating" in vs["gpu-0001"].message
    assert vs["gpu-0002"].reason == "EvictionRefused" and f"{GPU_NS}/{solo}" in vs["gpu-0002"].message
    assert "no controller" in vs["gpu-0002"].message
    assert k.find(f"/api/v1/namespaces/{GPU_NS}/pods/{solo}") is not None     # not evicted
    assert not any(v.unschedulable for v in vs.values())
    # backoff: a handful of rounds in 4 s, not one every half second (nor the client's own retries)
    for n in ("gpu-0000", "gpu-0001"):
        # (+2 since issue 44: the admitted node reads its rollout and the Nodes fresh before it cordons)
        assert f.nodes[n].kube.requests - before[n] < 52, (n, f.nodes[n].kube.requests - before[n])


def test_force_deletes_a_pod_without_a_controller(cluster):
    srv, make = cluster
    f = make(1)
    solo = f.no_controller("gpu-0000")
    started(f)
    kube(f).create(rollout_path(), rollout("r", drain={"timeoutSeconds": 30, "force": True}))
    wait_phase(f, "r", ("Completed",))
    assert kube(f).find(f"/api/v1/namespaces/{GPU_NS}/pods/{solo}") is None
    assert views(f)["gpu-0000"].driver == NEW


# -- 5: a node NotReady for good is named and the rollout says why it stops -----------------------------------
def test_a_node_not_ready_for_good_is_named_and_pauses_the_rollout(cluster):
    srv, make = cluster
    f = started(make(3))
    f.set_ready("gpu-0002", False, since=time.time() - 120)
    k = kube(f)
    k.create(rollout_path(), rollout("r", maxUnavailable=1, notReadyTimeoutSeconds=30))
    ro = wait_phase(f, "r", ("Paused",))
    assert ro["status"]["reason"] == "NodesNotReady" and "gpu-0002" in ro["status"]["message"]
    assert [n["node"] for n in ro["status"]["notReadyNodes"]] == ["gpu-0002"]
    vs = views(f)
    assert vs["gpu-0000"].driver == NEW and vs["gpu-0001"].driver == NEW and vs["gpu-0002"].state == m.IDLE
    f.set_ready("gpu-0002", True)         # back: it is upgraded, and the rollout completes
    wait_phase(f, "r", ("Completed",))
    assert views(f)["gpu-0002"].driver == NEW


# -- 6: deleting a rollout is aborting it ---------------------------------------------------------------------
def test_deleting_a_rollout_mid_flight_gives_its_nodes_back(cluster):
    srv, f, k = _stuck_evicting(cluster, "r")
    assert m.FINALIZER in k.get(rollout_path("r"))["metadata"]["finalizers"]
    rc, out, err = cli(f, "rollout", "delete", "r")
    assert rc == 0, err
    assert f.wait(lambda: views(f)["gpu-0000"].state == m.IDLE, 30)
    v = views(f)["gpu-0000"]
    assert v.reason == "Aborted" and "deleted" in v.message and not v.unschedulable and v.driver == OLD
    assert f.wait(lambda: k.find(rollout_path("r")) is None, 20)
    time.sleep(1)
    assert views(f)["gpu-0001"].state == m.IDLE


# -- 8: Lease expiry by local observation ---------------------------------------------------------------------
def test_a_holder_with_a_skewed_clock_keeps_the_lease_while_it_renews(cluster):
    from driverd.cluster.lease import Lease
    srv, make = cluster
    f = make(1)
    k = kube(f)
    skew = 20.0          # the holder's clock is 20 s behind ours: its renewTime always looks stale

    def renew(rv=None):
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "driverd-rollout", "namespace": "driverd"},
                "spec": {"holderIdentity": "skewed", "leaseDurationSeconds": 2,
                         "renewTime": now_rfc3339(time.time() - skew).replace("Z", ".000000Z"),
                         "acquireTime": now_rfc3339(time.time() - skew).replace("Z", ".000000Z")}}
        if rv is None:
            return k.create(lease_path("driverd"), body)
        body["metadata"]["resourceVersion"] = rv
        return k.replace(lease_path("driverd", "driverd-rollout"), body)
    cur = renew()
    other = Lease(k, "driverd", "other", duration_s=2)
    for _ in range(6):                   # 3 s of renewals every 0.5 s: never taken
        assert not other.try_acquire()
        time.sleep(0.5)
        cur = renew(cur["metadata"]["resourceVersion"])
    assert not other.try_acquire()       # sees the last renewal now: its duration starts here
    time.sleep(2.3)                      # the holder stopped: after the duration on our clock, taken
    assert other.try_acquire()


# -- 9, 10: what the CLI and the parser refuse or warn about -----------------------------------------------------
def test_a_selector_matching_nothing_is_warned_about_and_fails_status(cluster):
    srv, make = cluster
    f = started(make(1))
    rc, out, err = cli(f, "rollout", "start", "--driver", NEW, "--name", "none", "-l", "pool=nothing")
    assert rc == 0 and "warning: no node matches 'pool=nothing'" in err
    wait_phase(f, "none", ("Completed",))
    rc, out, err = cli(f, "rollout", "status", "none")
    assert rc == 3 and "NoTargets" in out


def test_max_unavailable_and_driver_patterns_mean_what_the_schema_means(cluster):
    srv, make = cluster
    f = make(1)
    for bad in ("150%", "0%"):
        rc, out, err = cli(f, "rollout", "start", "--driver", NEW, "--max-unavailable", bad)
        assert rc == 2 and "spec.maxUnavailable" in err and bad in err, err
    started(f)
    k = kube(f)
    k.create(rollout_path(), rollout("pct", maxUnavailable="150%"))
    ro = wait_phase(f, "pct", ("Invalid",))
    assert "spec.maxUnavailable" in ro["status"]["message"]
    # a trailing newline: RE2's `$` (the API server's) does not match before it, and neither does ours
    try:
        k.create(rollout_path(), rollout("nl", driver="570.195.03\n"))
        created = True
    except KubeError as e:
        created = False
        assert e.status == 422 and "spec.driver" in e.api_message
    assert not created
    try:
        m.Rollout.from_object({"metadata": {"name": "x"}, "spec": {"driver": "570.195.03\n"}})
        raise AssertionError("accepted a driver with a trailing newline")
    except m.SpecError as e:
        assert e.field == "driver"


# -- 11: the Admitted Event is on the Node (test_rollout's first test asserts it without help) -------------------

# -- 12: a node that failed after loading the new driver is pinned to what runs -------------------------------------
def test_a_node_that_fails_after_loading_the_new_driver_stays_on_it(cluster):
    from types import SimpleNamespace

    from driverd.daemon.cluster_mode import ClusterMode
    srv, make = cluster
    f = make(1)
    f.pdb_never("gpu-0000")              # holds the node in evicting until the test lets it go
    started(f)
    k = kube(f)
    k.create(rollout_path(), rollout("r", validation={"timeoutSeconds": 1}, drain={"timeoutSeconds": 60}))
    assert f.wait(lambda: views(f)["gpu-0000"].state == m.EVICTING, 30)
    f.set_ready("gpu-0000", False)       # the kubelet stops posting Ready: the new driver loads, no Ready
    f.set_pdb("gpu-0000", 1)
    assert f.wait(lambda: views(f)["gpu-0000"].state == m.FAILED, 30)
    node = k.get(node_path("gpu-0000"))
    v = m.NodeView.from_node(node)
    assert v.reason == "NodeNotReady" and v.driver == NEW
    ann = node["metadata"]["annotations"]
    assert ann[m.A_PINNED] == f"{NEW}/open" and ann[m.A_PREVIOUS] == f"{OLD}/open"
    # the daemon's own reconcile keeps what runs: no downgrade outside admission
    from driverd.cluster import desired as dz
    from driverd.root import Root
    cm = ClusterMode.__new__(ClusterMode)
    cm.node, cm.log, cm._said_behind, cm._said_waiting, cm._said = "gpu-0000", lambda msg: None, "", "", set()
    cm.agent = SimpleNamespace(nodes=SimpleNamespace(get=lambda name: node), set_waiting=lambda text: None)
    cm.desired = lambda cfg, node: dz.Desired(OLD, "open", "configuration")        # what the config would say
    cm.make_context = lambda cfg: SimpleNamespace(root=Root(str(f.nodes["gpu-0000"].root)))
    cfg = f.nodes["gpu-0000"].cfg
    assert cm.keep(cfg)[0]["driver.version"] == NEW


# -- 13: undo ----------------------------------------------------------------------------------------------------
def test_undo_takes_the_nodes_back_to_their_previous_driver(cluster):
    srv, make = cluster
    f = started(make(2))
    k = kube(f)
    k.create(rollout_path(), rollout("r", maxParallel=2, maxUnavailable=2,
                                     nodeSelector={"matchLabels": {"kubernetes.io/hostname": "gpu-0000"}}))
    wait_phase(f, "r", ("Completed",))
    rc, out, err = cli(f, "rollout", "undo", "r", "-o", "json")
    assert rc == 0, err
    made = json.loads(out)["created"]
    assert made == [{"rollout": f"r-undo-{OLD.replace('.', '-')}", "driver": f"{OLD}/open", "nodes": ["gpu-0000"]}]
    wait_phase(f, made[0]["rollout"], ("Completed",))
    assert {v.driver for v in views(f).values()} == {OLD}
    rc, out, err = cli(f, "rollout", "undo", "r")      # its node now belongs to the undo rollout
    assert rc == 2 and "nothing to undo" in err
