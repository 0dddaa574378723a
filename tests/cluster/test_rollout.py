"""Rolling upgrades end to end: node daemons (the real agent, coordinator, drain and node
transaction on simulated host trees) against the real Kubernetes control plane (kube-apiserver with
Node,RBAC authorization and deploy/'s admission policy, etcd, the disruption controller and garbage
collector), each daemon with its own node-bound token of deploy/'s ServiceAccount; driven and read
through `kubectl driverd` as an operator bound to deploy/'s driverd-operator ClusterRole (and the real
kubectl where it matters). One control plane per run: each test starts from an emptied one."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import pytest

from driverd.cluster import model as m
from driverd.cluster.kube import Kube, Target, lease_path, node_path, rollout_path
from driverd.sim.fleet import NEW, OLD, Fleet
from tests.conftest import driverd_env, REPO
from tests.controlplane import reset

KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"


@pytest.fixture
def cluster(deployed, tmp_path):
    reset(deployed)
    fleets = []

    def make(n, **kw):
        f = Fleet(tmp_path / "fleet", n, server=deployed, lease_s=kw.pop("lease_s", 3), **kw).build()
        f.operator_kubeconfig = deployed.operator_kubeconfig(str(tmp_path / "operator.kubeconfig"))
        fleets.append(f)
        return f
    yield deployed, make
    for f in fleets:
        f.stop()


def kube(f: Fleet) -> Kube:
    return Kube(Target(kubeconfig=f.kubeconfig))


def cli(f: Fleet, *argv) -> tuple[int, str, str]:
    env = dict(os.environ, PATH=f"{REPO}/.venv/bin:{os.environ['PATH']}")
    p = subprocess.run([f"{REPO}/.venv/bin/kubectl-driverd", *argv, "--kubeconfig",
                        getattr(f, "operator_kubeconfig", f.kubeconfig)],
                       capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout, p.stderr


def views(f: Fleet) -> dict[str, m.NodeView]:
    return {n["metadata"]["name"]: m.NodeView.from_node(n) for n in kube(f).list(node_path())["items"]}


def wait_phase(f: Fleet, name: str, phases, timeout=120) -> dict:
    k = kube(f)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ro = k.get(rollout_path(name))
        st = ro.get("status") or {}
        if st.get("phase") in phases and st.get("observedGeneration") == ro["metadata"]["generation"]:
            return ro
        time.sleep(0.2)
    raise AssertionError(f"rollout {name} never reached {phases}: {k.get(rollout_path(name)).get('status')}; nodes: "
                         + "; ".join(f"{n}: {v.state} {v.reason} {v.message}" for n, v in views(f).items()))


def started(f: Fleet) -> Fleet:
    f.start()
    assert f.wait(lambda: all(v.driver == OLD for v in views(f).values()), 60), "daemons did not label their nodes"
    return f


def test_rollout_completes_within_limits_and_says_so(cluster):
    srv, make = cluster
    f = started(make(4))
    k = kube(f)
    k.patch(node_path("gpu-0002"), {"spec": {"unschedulable": True}})      # an admin's cordon
    rc, out, err = cli(f, "rollout", "start", "--driver", NEW, "--max-parallel", "2", "--max-unavailable", "2")
    assert rc == 0, err
    assert "driverrollout.driverd.io/driver-550-127-05 created" in out
    ro = wait_phase(f, "driver-550-127-05", ("Completed",))
    assert ro["status"]["nodes"]["done"] == 4
    vs = views(f)
    assert {v.state for v in vs.values()} == {m.DONE}
    assert {v.driver for v in vs.values()} == {NEW}
    assert all(v.labels.get(m.L_READY) == "true" for v in vs.values())
    conds = {c["type"]: c for c in k.get(node_path("gpu-0001"))["status"]["conditions"]}
    assert conds["GPUDriverReady"]["status"] == "True" and conds["GPUDriverReady"]["reason"] == "DriverValidated"
    assert conds["Ready"]["status"] == "True"          # the kubelet's own condition is left alone
    # we never lift a cordon we did not place, and lift every one we did
    assert vs["gpu-0002"].unschedulable and "left cordoned" in vs["gpu-0002"].message
    assert [n for n, v in vs.items() if v.unschedulable] == ["gpu-0002"]
    # the GPU pods were evicted (their PDBs allowed it)
    assert not [p for p in k.list("/api/v1/namespaces/gpu-jobs/pods")["items"]]
    # every transition has an Event on its Node
    said = {e["reason"]: e["message"] for e in k.list("/api/v1/namespaces/default/events")["items"]
            if e["involvedObject"]["name"] == "gpu-0001"}
    assert {"Admitted", "Cordoned", "Unloading", "Validating", "Upgraded"} <= set(said), said
    # the cordon and the drain's start are one transition: its Event says both
    assert said["Cordoned"].endswith("; evicting the GPU pods through the Eviction API"), said
    # status, as a platform engineer reads it (the kubectl plugin through the real kubectl)
    env = dict(os.environ, PATH=f"{REPO}/.venv/bin:{os.environ['PATH']}", KUBECONFIG=f.operator_kubeconfig,
               HOME=str(f.work))
    p = subprocess.run([KUBECTL, "driverd", "rollout", "status", "-o", "json"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["phase"] == "Completed" and len(doc["nodes"]) == 4
    p = subprocess.run([KUBECTL, "get", "driverrollouts"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0 and "Completed" in p.stdout and NEW in p.stdout, p.stdout + p.stderr


def test_preflight_refuses_before_any_node_is_touched(cluster):
    srv, make = cluster
    f = make(3)
    # one node's repository has no package for the target: knowable before the rollout starts
    cfg = f.nodes["gpu-0001"].root / "etc/driverd/config.toml"
    cfg.write_text(cfg.read_text().replace(str(f.repo), str(f.work / "empty-repo")))
    (f.work / "empty-repo").mkdir()
    (f.work / "empty-repo/index.json").write_text('{"format": 1, "packages": []}')
    started(f)
    rc, out, err = cli(f, "rollout", "start", "--driver", NEW, "--name", "r1")
    assert rc == 0, err
    ro = wait_phase(f, "r1", ("Refused",))
    assert "gpu-0001" in ro["status"]["message"] and "no package 550.127.05/open" in ro["status"]["message"]
    assert all(v.state == m.IDLE and not v.unschedulable for v in views(f).values())
    rc, out, err = cli(f, "rollout", "status", "r1")
    assert rc == 3 and "preflight: gpu-0001" in out
    # excluding it lets the others go
    kube(f).patch(rollout_path("r1"), {"spec": {"preflight": "Exclude"}})
    wait_phase(f, "r1", ("Completed",))
    vs = views(f)
    assert vs["gpu-0001"].driver == OLD and vs["gpu-0000"].driver == NEW and vs["gpu-0002"].driver == NEW


def test_blocked_drain_and_failed_reload_end_defined_and_spend_the_budget(cluster):
    srv, make = cluster
    f = make(4)
    f.pdb_never("gpu-0000")
    f.reload_fails("gpu-0001")
    started(f)
    k = kube(f)
    k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "r"},
                              "spec": {"driver": NEW, "maxParallel": 2, "maxUnavailable": 2, "failureBudget": 0,
                                       "drain": {"timeoutSeconds": 2}}})
    ro = wait_phase(f, "r", ("Paused",))
    assert ro["status"]["reason"] == "FailureBudgetSpent"
    # both admitted nodes end failed (whichever fails first pauses the rollout)
    assert f.wait(lambda: {views(f)[n].state for n in ("gpu-0000", "gpu-0001")} == {m.FAILED}, 30)
    vs = views(f)
    assert vs["gpu-0000"].state == m.FAILED and vs["gpu-0000"].reason == "EvictionBlocked"
    assert "train-gpu-0000-0-pdb" in vs["gpu-0000"].message          # names the PodDisruptionBudget
    assert vs["gpu-0001"].state == m.FAILED and vs["gpu-0001"].reason == "RolledBack"
    assert vs["gpu-0001"].driver == OLD                                # rolled back to what ran before
    cond = {c["type"]: c for c in k.get(node_path("gpu-0001"))["status"]["conditions"]}["GPUDriverReady"]
    assert cond["status"] == "True" and cond["reason"] == "RolledBack" and OLD in cond["message"]
    assert not any(v.unschedulable for v in vs.values())              # uncordoned what we cordoned
    assert vs["gpu-0002"].state == m.IDLE and vs["gpu-0003"].state == m.IDLE   # paused: nobody else admitted
    # the operator fixes the PDB, retries that node and tolerates the one left failed
    f.set_pdb("gpu-0000", 1)
    k.patch(rollout_path("r"), {"spec": {"failureBudget": 1}})
    rc, out, err = cli(f, "node", "retry", "gpu-0000")
    assert rc == 0, err
    rc, out, err = cli(f, "node", "retry", "gpu-0002")
    assert rc == 2 and "has not failed" in err
    ro = wait_phase(f, "r", ("Failed",))
    vs = views(f)
    assert [v.state for v in vs.values()].count(m.DONE) == 3 and vs["gpu-0001"].state == m.FAILED


def test_daemon_killed_mid_drain_and_coordinator_death_are_survived(cluster):
    srv, make = cluster
    f = started(make(3, lease_s=2))
    k = kube(f)
    holder = lambda: (k.find("/apis/coordination.k8s.io/v1/namespaces/driverd/leases/driverd-rollout")
                      or {}).get("spec", {}).get("holderIdentity")
    assert f.wait(lambda: holder() is not None, 20)
    first = holder()
    assert first == Fleet.COORDINATOR                 # deploy/'s own identity, no node (issue 44)
    f.start_coordinator("driverd-coordinator-1")      # its standby replica
    f.kill_coordinator(first)   # the coordinator dies without releasing the Lease
    # a GPU pod whose eviction is refused for a while keeps the next node in `evicting`
    victim = "gpu-0000"
    f.set_pdb(f"{victim}", 0)
    k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "r"},
                              "spec": {"driver": NEW, "maxParallel": 1, "maxUnavailable": 1,
                                       "nodeSelector": {"matchExpressions": [
                                           {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [first]}]},
                                       "drain": {"timeoutSeconds": 60}}})
    assert f.wait(lambda: holder() == "driverd-coordinator-1", 30), "the standby did not take over the Lease"
    assert f.wait(lambda: views(f)[victim].state == m.EVICTING, 30)
    f.kill_node(victim)
    f.set_pdb(f"{victim}", 1)
    time.sleep(0.5)
    assert views(f)[victim].state == m.EVICTING      # nobody else moves a node whose daemon is gone
    f.start_node(victim)
    wait_phase(f, "r", ("Completed",), timeout=60)
    vs = views(f)
    assert vs[victim].state == m.DONE and vs[victim].driver == NEW and not vs[victim].unschedulable


def test_gpu_users_are_found_by_request_runtime_class_and_claim(cluster):
    from driverd.cluster.gpuusers import classify
    srv, make = cluster
    f = make(1)
    k = kube(f)
    assert k.get("/apis/node.k8s.io/v1/runtimeclasses/nvidia")["handler"] == "nvidia"     # deploy/'s
    pods = [
        {"metadata": {"name": "req", "namespace": "a", "uid": "1"},
         "spec": {"containers": [{"name": "c", "resources": {"requests": {"nvidia.com/mig-1g.10gb": "1"}}}]}},
        {"metadata": {"name": "rc", "namespace": "a", "uid": "2"}, "spec": {"runtimeClassName": "nvidia",
                                                                          "containers": [{"name": "c"}]}},
        {"metadata": {"name": "plain", "namespace": "a", "uid": "3"}, "spec": {"containers": [{"name": "c"}]}},
        {"metadata": {"name": "ds", "namespace": "a", "uid": "4", "ownerReferences": [{"kind": "DaemonSet"}]},
         "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}},
        {"metadata": {"name": "host", "namespace": "a", "uid": "5"}, "spec": {"containers": [{"name": "c"}]}},
        {"metadata": {"name": "done", "namespace": "a", "uid": "6"}, "status": {"phase": "Succeeded"},
         "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}},
    ]
    users = {u.name: u for u in classify(k, pods, {"5": "its process 42 (python) has /dev/nvidia0 open"})}
    assert set(users) == {"req", "rc", "ds", "host"}
    assert "nvidia.com/mig-1g.10gb" in users["req"].why
    assert "RuntimeClass nvidia" in users["rc"].why
    assert users["ds"].daemonset and not users["req"].daemonset
    assert "process 42" in users["host"].why


def test_kubectl_driverd_never_acts_on_the_local_host(tmp_path):
    p = subprocess.run([f"{REPO}/.venv/bin/kubectl-driverd", "apply"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "acts on the cluster" in p.stderr
    p = subprocess.run([f"{REPO}/.venv/bin/kubectl-driverd", "rollout", "start", "--driver", "latest",
                        "--kubeconfig", str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "not a driver version" in p.stderr
    p = subprocess.run([f"{REPO}/.venv/bin/kubectl-driverd", "nodes", "--kubeconfig", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and f"kubeconfig {tmp_path / 'none'} does not exist" in p.stderr and "\n" == p.stderr[-1:]
    assert p.stderr.count("\n") == 1


def test_bad_specs_are_refused_by_the_schema_or_reported_naming_the_field(cluster):
    srv, make = cluster
    f = started(make(2))
    rc, out, err = cli(f, "rollout", "start", "--driver", NEW, "--max-unavailable", "lots")
    assert rc == 2 and "maxUnavailable" in err and err.count("\n") == 1
    env = dict(os.environ, KUBECONFIG=f.kubeconfig, HOME=str(f.work))
    bad = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "bad"},
           "spec": {"driver": NEW, "maxParallel": 0}}
    p = subprocess.run([KUBECTL, "apply", "-f", "-"], input=json.dumps(bad), capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode != 0 and "spec.maxParallel" in p.stderr
    odd = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "odd"},
           "spec": {"driver": NEW, "nodeSelector": {"matchExpressions": [{"key": "pool", "operator": "In"}]}}}
    kube(f).create(rollout_path(), odd)
    ro = wait_phase(f, "odd", ("Invalid",))
    assert "spec.nodeSelector.matchExpressions" in ro["status"]["message"]
    assert all(v.state == m.IDLE for v in views(f).values())


def test_abort_gives_back_nodes_not_yet_unloading(cluster):
    srv, make = cluster
    f = make(2)
    f.pdb_never("gpu-0000")                 # keeps gpu-0000 in evicting
    started(f)
    k = kube(f)
    k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "r"},
                              "spec": {"driver": NEW, "maxParallel": 1, "drain": {"timeoutSeconds": 300}}})
    assert f.wait(lambda: views(f)["gpu-0000"].state == m.EVICTING, 30)
    assert views(f)["gpu-0000"].unschedulable
    rc, out, err = cli(f, "rollout", "abort", "r")
    assert rc == 0, err
    assert f.wait(lambda: views(f)["gpu-0000"].state == m.IDLE, 30)
    v = views(f)["gpu-0000"]
    assert v.reason == "Aborted" and not v.unschedulable and v.driver == OLD
    wait_phase(f, "r", ("Aborted",))
    time.sleep(1)
    assert views(f)["gpu-0001"].state == m.IDLE


def test_a_kernel_without_module_unload_hands_the_node_to_the_reboot_coordinator(cluster):
    srv, make = cluster
    f = make(1, module_unload=False)
    started(f)
    k = kube(f)
    k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                              "metadata": {"name": "r"}, "spec": {"driver": NEW}})
    assert f.wait(lambda: views(f)["gpu-0000"].state == m.REBOOT, 60)
    root = f.nodes["gpu-0000"].root
    assert (root / "var/run/reboot-required").exists() or (root / "run/reboot-required").exists()
    v = views(f)["gpu-0000"]
    assert "cannot unload" in v.message and "kured" in v.message and v.unschedulable
    assert OLD in (root / "proc/driver/nvidia/version").read_text()       # nothing unloaded
    time.sleep(1)
    assert views(f)["gpu-0000"].state == m.REBOOT                          # waits for the reboot
    f.reboot_node("gpu-0000")
    wait_phase(f, "r", ("Completed",), timeout=60)
    v = views(f)["gpu-0000"]
    assert v.state == m.DONE and v.driver == NEW and not v.unschedulable
    assert not (root / "var/run/reboot-required").exists() and not (root / "run/reboot-required").exists()


def test_cluster_agent_command_runs_the_node_side_until_sigterm(cluster):
    """`driverd cluster agent` (host mode without the daemon): the same node side as the daemon's
    cluster mode, against the kubeconfig given on the command line."""
    import signal
    srv, make = cluster
    f = make(1)
    env = driverd_env()
    p = subprocess.Popen([f"{REPO}/.venv/bin/driverd", "cluster", "agent", "--root", str(f.nodes["gpu-0000"].root),
                          "--node", "gpu-0000", "--kubeconfig", f.node_kubeconfig("gpu-0000")],
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert f.wait(lambda: views(f)["gpu-0000"].driver == OLD, 30)
        f.start_coordinator()             # deploy/'s coordinator (its own identity) admits the node
        kube(f).create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                        "metadata": {"name": "r"}, "spec": {"driver": NEW}})
        wait_phase(f, "r", ("Completed",), timeout=60)
        assert views(f)["gpu-0000"].driver == NEW
        p.send_signal(signal.SIGTERM)
        # communicate, not wait: its stderr is read while it ends (a full pipe would hold its last lines, and it)
        _, err = p.communicate(timeout=15)
        assert p.returncode == 0 and "cluster mode: node gpu-0000" in err, err[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
# -- what only the real apiserver and controllers decide ------------------------------------------------

def test_watches_survive_an_apiserver_restart_and_a_410_starts_over_with_a_list(cluster):
    """kube-apiserver restarts (its watch cache starts afresh) after etcd compacted its history: every
    watch breaks; a watch from a resourceVersion older than that gets 410 Gone (an ERROR event), and
    driverd's Informer — there from before the restart — lists again and carries on watching."""
    from driverd.cluster.informer import Informer
    from driverd.cluster.kube import KubeError
    srv, make = cluster
    f = make(2)
    k = kube(f)
    seen = []
    inf = Informer(Kube(Target(kubeconfig=f.kubeconfig), retry_for_s=120), node_path(),
                   on_change=lambda kind, o: seen.append(kind)).start()
    try:
        assert inf.synced.wait(30)
        old = k.list(node_path())["metadata"]["resourceVersion"]
        inf._rv = old                   # as after a long disconnection, resumed from a version soon gone
        for i in range(3):
            k.patch(node_path("gpu-0000"), {"metadata": {"labels": {"step": str(i)}}})
        srv.compact_etcd()
        srv.restart_apiserver()
        with pytest.raises(KubeError) as e:
            for _ in k.watch(node_path(), resource_version=old, timeout_s=5):
                pass
        assert e.value.status == 410 and e.value.reason in ("Expired", "Gone"), e.value
        k.patch(node_path("gpu-0001"), {"metadata": {"labels": {"pool": "b"}}})
        assert f.wait(lambda: (inf.get("gpu-0001")["metadata"].get("labels") or {}).get("pool") == "b", 60)
        assert (inf.get("gpu-0000")["metadata"].get("labels") or {}).get("step") == "2"
        # the first list, and the list after the 410 (counted once the change arrived: the informer's
        # reconnection backs off while the apiserver is down, and may list after our own 410 above)
        assert seen.count("SYNC") >= 2, seen
    finally:
        inf.close()


def test_the_status_subresource_keeps_spec_and_status_apart(cluster):
    """The CRD's status subresource: a status write through /status cannot change the spec, a write to
    the object ignores status; the node daemons write neither (RBAC), the coordinator (RBAC: the status,
    and a patch of the object for the finalizer, which deploy/'s admission policy holds to the finalizer)
    cannot touch the spec, and writes only holding the Lease."""
    srv, make = cluster
    f = make(1)
    k = kube(f)
    k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "s"},
                              "spec": {"driver": NEW, "paused": True}})
    k.patch(rollout_path("s"), {"status": {"phase": "Bogus"}, "spec": {"maxParallel": 3}})
    ro = k.get(rollout_path("s"))
    assert ro["spec"]["maxParallel"] == 3 and (ro.get("status") or {}).get("phase") != "Bogus"
    k.patch(rollout_path("s", status=True), {"status": {"phase": "Paused"}, "spec": {"maxParallel": 7}})
    ro = k.get(rollout_path("s"))
    assert ro["status"]["phase"] == "Paused" and ro["spec"]["maxParallel"] == 3
    from driverd.cluster.kube import KubeError
    from driverd.cluster.lease import Lease
    f.stop()                                 # no coordinator of the fleet's: this test speaks for it
    node = Kube(Target(kubeconfig=f.node_kubeconfig("gpu-0000")), retry_for_s=0)
    for call in (lambda: node.patch(rollout_path("s", status=True), {"status": {"message": "from the node"}}),
                 lambda: node.patch(rollout_path("s"), {"metadata": {"finalizers": ["driverd.io/rollout"]}})):
        with pytest.raises(KubeError) as e:      # a node writes no rollout (RBAC)
            call()
        assert e.value.status == 403 and "cannot patch" in str(e.value), e.value
    coord = Kube(Target(kubeconfig=f.coordinator_kubeconfig("driverd-coordinator-9")), retry_for_s=0)
    k.create(lease_path("driverd"), {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": {
        "name": "driverd-rollout", "namespace": "driverd"}, "spec": {"holderIdentity": "another-replica"}})
    time.sleep(0.5)
    with pytest.raises(KubeError) as e:      # a coordinator that does not hold the Lease writes no status
        coord.patch(rollout_path("s", status=True), {"status": {"message": "from the coordinator"}})
    assert e.value.status == 403 and "driverd-coordinator-scope" in str(e.value)
    k.delete(lease_path("driverd", "driverd-rollout"))
    assert f.wait(Lease(coord, "driverd", "driverd-coordinator-9", duration_s=3).try_acquire, 15, step=0.5)
    time.sleep(0.5)                          # the apiserver's admission informer sees the holder
    with pytest.raises(KubeError) as e:
        coord.patch(rollout_path("s"), {"spec": {"maxParallel": 9}})
    assert e.value.status == 403 and "driverd-node-scope" in str(e.value) and "not its spec" in str(e.value)
    coord.patch(rollout_path("s"), {"metadata": {"finalizers": ["driverd.io/rollout"]}})     # what it may do
    coord.patch(rollout_path("s"), {"metadata": {"finalizers": None}})
    coord.patch(rollout_path("s", status=True), {"status": {"message": "from the coordinator"}})
    assert k.get(rollout_path("s"))["status"]["message"] == "from the coordinator"



def _one_node_rollout(cluster, fault=None, *, budgets: bool = False, **spec) -> tuple[Fleet, Kube]:
    """A one-node fleet (`fault(fleet, "gpu-0000")` applied before its daemon starts) and rollout `r`
    of NEW over it with `spec`; with `budgets`, once the GPU pod's PodDisruptionBudget allows the
    first eviction (right after an API server restart, the disruption controller may not have
    counted the pod yet: the Eviction API answers 429 and the drain waits for its next round)."""
    srv, make = cluster
    f = make(1)
    if fault is not None:
        fault(f, "gpu-0000")
    started(f)
    if budgets:
        assert f.wait_budgets(timeout=60), "the disruption controller never counted the GPU pod: " + "; ".join(
            f"{p['metadata']['name']}: {p.get('status')}"
            for p in f.admin.list("/apis/policy/v1/namespaces/gpu-jobs/poddisruptionbudgets").get("items") or [])
    k = kube(f)
    k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "r"},
                              "spec": {"driver": NEW, **spec}})
    return f, k


def _pod_of(f: Fleet, node: str) -> str:
    from driverd.cluster.kube import pods_path
    return pods_path(f.gpu_ns(node), f"train-{node}-0")


def test_a_node_an_earlier_driverd_left_cordoned_goes_on_to_its_drain(cluster, monkeypatch):
    """The cordon was a transition of its own (`cordoned`, now a legacy state): a node recorded in it by an
    earlier driverd, whose daemon was replaced in between, is drained and upgraded, not failed as an
    unknown state. Here the cordon records `cordoned` as that driverd did."""
    from driverd.cluster.agent.admission import NodeAdmission
    real = NodeAdmission._start_drain

    def as_before(self, node, r, reason, done, **kw):
        if reason == "Cordoned":
            return self._to(node, m.CORDONED, reason, done, **kw)
        return real(self, node, r, reason, done, **kw)
    monkeypatch.setattr(NodeAdmission, "_start_drain", as_before)
    f, k = _one_node_rollout(cluster)
    ro = wait_phase(f, "r", ("Completed", "Failed"), timeout=120)
    assert ro["status"]["phase"] == "Completed", ro["status"]
    said = {e["reason"]: e["message"] for e in k.list("/api/v1/namespaces/default/events")["items"]
            if e["involvedObject"]["name"] == "gpu-0000"}
    assert said.get("Cordoned") == f"cordoned for the upgrade to {NEW}", said       # recorded as before
    assert said.get("Evicting") == "evicting the GPU pods through the Eviction API", said     # then drained
    assert views(f)["gpu-0000"].state == m.DONE


def test_the_drain_goes_on_when_the_pods_deletion_is_seen_not_at_the_next_poll(cluster, monkeypatch):
    """While a node evicts, its pods are watched: the pod held Terminating by a finalizer is let go,
    and the node goes on to unload at once, although the rounds now poll only once a minute."""
    from driverd.cluster import agent
    monkeypatch.setattr(agent, "EVICT_FIRST_S", 60.0)
    monkeypatch.setattr(agent, "EVICT_RETRY_S", 60.0)
    # the first eviction must be allowed: a 429 would make the drain wait out its 60 s round
    f, k = _one_node_rollout(cluster, Fleet.stuck_terminating, budgets=True, drain={"timeoutSeconds": 300})
    pod = _pod_of(f, "gpu-0000")
    assert f.wait(lambda: (k.find(pod) or {}).get("metadata", {}).get("deletionTimestamp"), 60), "never evicted"
    assert f.wait(lambda: views(f)["gpu-0000"].state == m.EVICTING, 10)
    time.sleep(1.0)             # the agent has looked again and is waiting out its 60 s
    assert views(f)["gpu-0000"].state == m.EVICTING
    f.admin.patch(pod, {"metadata": {"finalizers": []}})       # the pod goes
    assert f.wait(lambda: views(f)["gpu-0000"].state != m.EVICTING, 20), \
        "the node stayed evicting after its last pod was deleted: the drain waited for its next poll"
    wait_phase(f, "r", ("Completed",), timeout=60)


def test_an_api_server_away_mid_drain_does_not_count_against_the_drain_timeout(cluster):
    """kube-apiserver is away for longer than spec.drain.timeoutSeconds while the node's pod is
    Terminating: nobody could see the pod leave (its kubelet could not confirm the deletion either).
    The drain's clock starts again when the daemon sees the node's pods again, so a pod that goes a few
    seconds after the restart does not fail the node. Counting the outage failed it at the daemon's
    first look after the restart."""
    srv, _ = cluster
    f, k = _one_node_rollout(cluster, Fleet.stuck_terminating, budgets=True, failureBudget=0,
                             drain={"timeoutSeconds": 8})
    pod = _pod_of(f, "gpu-0000")
    assert f.wait(lambda: (k.find(pod) or {}).get("metadata", {}).get("deletionTimestamp"), 60), "never evicted"
    t0 = time.monotonic()
    srv.restart_apiserver(down_s=8.0)
    assert time.monotonic() - t0 > 8
    time.sleep(5.0)                     # the pod's kubelet confirms a while after the API server is back
    assert views(f)["gpu-0000"].state == m.EVICTING, views(f)["gpu-0000"].message
    f.admin.patch(pod, {"metadata": {"finalizers": []}})
    ro = wait_phase(f, "r", ("Completed", "Paused", "Failed"), timeout=90)
    assert ro["status"]["phase"] == "Completed", views(f)["gpu-0000"].message


def test_a_coordinator_that_held_the_lease_takes_a_403_after_an_outage_as_passing(cluster, monkeypatch):
    """The coordinator loses its Lease while the API server is away, then the Lease answers 403 a few
    times (as from a kube-apiserver just restarted) before it answers again. An identity that has held
    the Lease may hold it: the coordinator takes it back and coordinates. It took the 403 for "this
    identity may not hold the Lease" and stopped coordinating, while its renewer took the Lease back and
    kept it: a 27-s outage left a rollout Progressing with its node done."""
    from driverd.cluster.kube import KubeError
    srv, make = cluster
    f = started(make(1))
    coord = f.coordinators[Fleet.COORDINATOR].coordinator
    assert f.wait(lambda: coord.coordinating, 30), "the coordinator never took the Lease"
    real_call, mode, forbidden = coord.kube._call, ["up"], []

    def call(method, path, **kw):
        if path.startswith(lease_path("driverd")) and mode[0] == "down":
            raise KubeError(500, "InternalError", "etcdserver: request timed out")
        if path.startswith(lease_path("driverd")) and mode[0] == "forbidden":
            forbidden.append(path)
            raise KubeError(403, "Forbidden", 'leases.coordination.k8s.io "driverd-rollout" is forbidden: User '
                            '"system:serviceaccount:driverd:driverd-coordinator" cannot get resource "leases"')
        return real_call(method, path, **kw)
    monkeypatch.setattr(coord.kube, "_call", call)
    mode[0] = "down"
    assert f.wait(lambda: not coord.coordinating, 60), "the coordinator never lost the Lease"
    mode[0] = "forbidden"
    assert f.wait(lambda: len(forbidden) >= 3, 60), forbidden
    mode[0] = "up"
    k = kube(f)
    k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "r"},
                              "spec": {"driver": NEW}})
    ro = wait_phase(f, "r", ("Completed", "Failed", "Paused"), timeout=90)
    assert ro["status"]["phase"] == "Completed", (ro["status"], views(f)["gpu-0000"].message)
    assert coord.coordinating           # it holds the Lease and its pass loop runs


def test_a_drain_whose_pod_watch_is_refused_lists_the_pods_instead(cluster, monkeypatch):
    """A pod watch refused (RBAC without `watch` on pods): the drain reads the pods from the API each
    round, never from a cache the refused watch left behind."""
    from driverd.cluster.kube import KubeError
    real_watch = Kube.watch
    refused = []

    def watch(self, path, **kw):
        if path == "/api/v1/pods" and (kw.get("fields") or "").startswith("spec.nodeName="):
            refused.append(path)
            raise KubeError(403, "Forbidden", "pods is forbidden: cannot watch resource \"pods\"")
        return real_watch(self, path, **kw)
    monkeypatch.setattr(Kube, "watch", watch)
    f, k = _one_node_rollout(cluster, budgets=True, drain={"timeoutSeconds": 30})
    # a failed node pauses the rollout (failureBudget 0): said at once, with the node's words
    ro = wait_phase(f, "r", ("Completed", "Failed", "Paused"), timeout=90)
    assert ro["status"]["phase"] == "Completed", (ro["status"], views(f)["gpu-0000"].message)
    assert refused, "the drain never tried to watch its pods"
    assert views(f)["gpu-0000"].state == m.DONE


def test_a_cordon_that_meets_a_concurrent_change_keeps_its_pod_watch(cluster, monkeypatch):
    """The cordon reads the node's pods through the pod watch it opens while the node is still admitted;
    a cordon patch that meets a concurrent change of the Node (409) is tried again on the same watch: one
    list and one watch of the node's pods for the whole upgrade, not one more per conflict."""
    from driverd.cluster.informer import Informer
    from driverd.cluster.kube import KubeError
    real_patch, real_init = Kube.patch, Informer.__init__
    conflicts, pod_watches = [], []

    def patch(self, path, body, **kw):
        if path == node_path("gpu-0000") and (body.get("spec") or {}).get("unschedulable") and not conflicts:
            conflicts.append(path)
            raise KubeError(409, "Conflict", "Operation cannot be fulfilled on nodes \"gpu-0000\": the object has "
                            "been modified; please apply your changes to the latest version and try again")
        return real_patch(self, path, body, **kw)

    def init(self, kube, path, *a, **kw):
        if path == "/api/v1/pods" and (kw.get("fields") or "") == "spec.nodeName=gpu-0000":
            pod_watches.append(kw.get("name"))
        real_init(self, kube, path, *a, **kw)
    monkeypatch.setattr(Kube, "patch", patch)
    monkeypatch.setattr(Informer, "__init__", init)
    f, k = _one_node_rollout(cluster, budgets=True)
    ro = wait_phase(f, "r", ("Completed", "Failed", "Paused"), timeout=90)
    assert ro["status"]["phase"] == "Completed", (ro["status"], views(f)["gpu-0000"].message)
    assert conflicts, "the cordon never met the conflict"
    assert pod_watches == ["pods/gpu-0000"], pod_watches


def test_a_drain_whose_pod_watch_is_refused_still_times_out(cluster, monkeypatch):
    """With the pod watch refused (403) every round lists the pods, and the lists answer: the pods are
    seen all along, so the drain's clock runs and a PodDisruptionBudget that never allows the eviction
    fails the node at the timeout (only an API server that does not answer stops the clock)."""
    from driverd.cluster.kube import KubeError
    real_watch = Kube.watch

    def watch(self, path, **kw):
        if path == "/api/v1/pods" and (kw.get("fields") or "").startswith("spec.nodeName="):
            raise KubeError(403, "Forbidden", "pods is forbidden: cannot watch resource \"pods\"")
        return real_watch(self, path, **kw)
    monkeypatch.setattr(Kube, "watch", watch)
    f, k = _one_node_rollout(cluster, Fleet.pdb_never, failureBudget=0, drain={"timeoutSeconds": 3})
    wait_phase(f, "r", ("Paused",), timeout=90)
    v = views(f)["gpu-0000"]
    assert v.state == m.FAILED and v.reason == "EvictionBlocked" and "disruption budget" in v.message, v.message


@pytest.mark.parametrize("away", ["refused", "shutting-down"])
def test_a_drain_that_times_out_while_the_api_server_is_away_names_the_apis_last_answer(cluster, monkeypatch, away):
    """Two PodDisruptionBudgets make the Eviction API answer 500; then the API server is away for the
    evictions: unreachable (restarting), or answering 503 as it does while it shuts down. The node
    fails at the drain's timeout naming the 500, the API's words, not the outage of the last try."""
    from driverd.cluster.kube import KubeError, Unreachable
    real_create = Kube.create
    tries: list[str] = []

    def create(self, path, body, **kw):
        if path.endswith("/eviction"):
            tries.append(path)
            if len(tries) > 1 and away == "refused":
                raise Unreachable("cannot reach the Kubernetes API: connection refused")
            if len(tries) > 1:
                raise KubeError(503, "ServiceUnavailable", "apiserver is shutting down")
        return real_create(self, path, body, **kw)
    monkeypatch.setattr(Kube, "create", create)
    f, k = _one_node_rollout(cluster, Fleet.two_pdbs, budgets=True, failureBudget=0, drain={"timeoutSeconds": 2})
    wait_phase(f, "r", ("Paused",), timeout=90)
    v = views(f)["gpu-0000"]
    assert v.state == m.FAILED and v.reason == "EvictionBlocked", v.message
    assert "eviction answered 500" in v.message and "cannot reach" not in v.message, v.message
    assert "503" not in v.message and "shutting down" not in v.message, v.message
    assert len(tries) > 1 and not v.unschedulable


def test_a_rollout_deleted_and_recreated_under_its_name_is_a_new_rollout(cluster, monkeypatch):
    """Issue 42: the coordinator kept its preflight clock by name and generation, so `driver-<version>`
    deleted and created again (generation 1 again) was refused at once: "its driverd did not answer the
    preflight within 120s". Everything about a rollout is keyed by its uid."""
    from driverd.cluster import admission
    monkeypatch.setattr(admission, "PREFLIGHT_DEADLINE_S", 6.0)
    f, k = _one_node_rollout(cluster)
    wait_phase(f, "r", ("Completed",), timeout=90)
    time.sleep(7)                     # the first object was seen longer ago than the preflight deadline
    k.delete(rollout_path("r"))
    assert f.wait(lambda: k.find(rollout_path("r")) is None, 30), "the rollout was never deleted"
    k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "r"},
                              "spec": {"driver": OLD}})
    ro = wait_phase(f, "r", ("Completed", "Failed"), timeout=90)
    assert ro["status"]["phase"] == "Completed", ro["status"]
    assert not ro["status"].get("preflightFailures"), ro["status"]
    assert views(f)["gpu-0000"].driver == OLD


def _set_gpus(f: Fleet, node: str, n: int) -> None:
    """What the device plugin makes the kubelet report: nvidia.com/gpu capacity and allocatable."""
    f.admin.patch(node_path(node) + "/status", {"status": {"capacity": {"nvidia.com/gpu": str(n)},
                                                           "allocatable": {"nvidia.com/gpu": str(n)}}},
                  kind="strategic")


SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def _set_slice(f: Fleet, node: str, devices: int, generation: int) -> None:
    """What the DRA kubelet plugin publishes for the node: one ResourceSlice of gpu.nvidia.com (none for 0)."""
    name = f"{node}-gpu.nvidia.com"
    try:
        f.admin.delete(f"{SLICES}/{name}")
    except Exception:
        pass
    if devices:
        f.admin.create(SLICES, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
                                "spec": {"driver": "gpu.nvidia.com", "nodeName": node,
                                         "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
                                         "devices": [{"name": f"gpu-{i}"} for i in range(devices)]}})


@pytest.mark.parametrize("plugin", ["device-plugin", "dra"])
@pytest.mark.parametrize("back", [True, False])
def test_a_node_is_done_only_once_its_gpus_can_be_scheduled_again(cluster, plugin, back):
    """Issue 42: the node's GPUs as the scheduler sees them (the device plugin's nvidia.com/gpu allocatable,
    or the DRA plugin's ResourceSlices) are counted at the cordon; the plugin leaves with the driver, and
    the node is `done` only once they are back; a plugin that does not come back fails the node, named,
    after spec.validation.timeoutSeconds (and spends the failure budget)."""
    import threading
    _, make = cluster
    f = make(1)
    node = "gpu-0000"
    if plugin == "dra":
        _set_gpus(f, node, 0)
        _set_slice(f, node, 2, 1)
    else:
        _set_gpus(f, node, 2)
    started(f)
    stop, seen = threading.Event(), []

    def played_plugin() -> None:          # gone from the cordon; back (or not) with the driver-ready label
        gone = False
        while not stop.is_set():
            # one read a round: the label that brings the plugin back is set in `validating`, and the node
            # is done only once the plugin is back, so the round that sees the label records validating
            # (two reads a round let a loaded machine see `unloading`, then the label, and never validating)
            v = views(f)[node]
            seen.append(v.state)
            if v.state in (m.CORDONED, m.EVICTING, m.UNLOADING) and not gone:
                gone = True
                _set_gpus(f, node, 0) if plugin == "device-plugin" else _set_slice(f, node, 0, 1)
            elif back and gone and v.labels.get(m.L_READY) == "true":    # its DaemonSet selects it
                _set_gpus(f, node, 2) if plugin == "device-plugin" else _set_slice(f, node, 2, 2)
                gone = False
            time.sleep(0.1)
    t = threading.Thread(target=played_plugin, daemon=True)
    t.start()
    try:
        k = kube(f)
        k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                  "metadata": {"name": "r"},
                                  "spec": {"driver": NEW, "validation": {"timeoutSeconds": 8}}})
        ro = wait_phase(f, "r", ("Completed", "Failed", "Paused"), timeout=120)
    finally:
        stop.set()
        t.join(5)
    v = views(f)[node]
    what = "nvidia.com/gpu allocatable" if plugin == "device-plugin" else \
        "gpu.nvidia.com devices in the node's ResourceSlices"
    if back:
        assert ro["status"]["phase"] == "Completed" and v.state == m.DONE, (ro["status"], v)
        assert m.VALIDATING in seen
    else:
        assert v.state == m.FAILED and v.reason == "GPUsNotSchedulable", v
        assert f"{what} 0, was 2 before the upgrade" in v.message, v.message
        assert ro["status"]["phase"] != "Completed", ro["status"]
        assert not v.unschedulable                      # given back: uncordoned, with the reason on it
