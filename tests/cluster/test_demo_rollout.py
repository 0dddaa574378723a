"""`driverd demo`'s rollout stage: skipped without an API server (driverd ships none), and run with
--kubeconfig on a real one — here the real control plane, as its admin."""
from __future__ import annotations

import re
import uuid

from tests.conftest import run_cli
from tests.controlplane import reset

NODES, ROLLOUTS, PODS = "/api/v1/nodes", "/apis/driverd.io/v1alpha1/driverrollouts", "/api/v1/namespaces/gpu-jobs/pods"
REPLICASETS = "/apis/apps/v1/namespaces/gpu-jobs/replicasets"
GPU_NODE = {"nvidia.com/gpu.present": "true", "feature.node.kubernetes.io/pci-10de.present": "true"}


def _bystander(control_plane, name: str) -> None:
    control_plane.api("POST", NODES, {"apiVersion": "v1", "kind": "Node",
                                      "metadata": {"name": name, "labels": dict(GPU_NODE)}})


def _node_view(n: dict) -> dict:
    """What the demo (its Fleet, its node agents, its rollout's coordinator) would change on a Node. Not
    all of it: the cluster's kube-controller-manager annotates and taints a Node no kubelet serves (its
    TTL and node lifecycle controllers), and that is no doing of the demo."""
    md, st = n["metadata"], n.get("status") or {}
    return {"uid": md["uid"], "labels": md.get("labels") or {},
            "annotations": {k: v for k, v in (md.get("annotations") or {}).items() if "driverd" in k},
            "unschedulable": (n.get("spec") or {}).get("unschedulable"),
            "status": {k: st.get(k) for k in ("nodeInfo", "capacity", "allocatable")}}


def _nodes(control_plane) -> dict[str, dict]:
    return {n["metadata"]["name"]: n for n in control_plane.api("GET", NODES)["items"]}


def _labelled(items: list[dict], run: str) -> list[dict]:
    return [o for o in items if (o["metadata"].get("labels") or {}).get("driverd.io/demo") == run]


def test_demo_rollout_stage_on_the_real_control_plane(deployed, tmp_path):
    """Issue 42: the demo's rollout selects the nodes it made (labelled driverd.io/demo=<run>, named for
    the run), never a node of the cluster it did not make, and removes only what it made at the end. A
    run kept with --keep followed by plain runs: each later run works, leaves the kept run's nodes,
    pods and rollout as they were, and never touches a bystander Node — one of them named gpu-0000, the
    name the demo's first node once had (it took that Node over, upgraded it and deleted it)."""
    control_plane = deployed
    reset(control_plane)
    for name in ("bystander", "gpu-0000"):
        _bystander(control_plane, name)
    before = {name: _node_view(n) for name, n in _nodes(control_plane).items()}
    kept_run, kept = None, {}
    for i, keep in enumerate((True, False, False)):
        r = run_cli("demo", "--workdir", str(tmp_path / "demo"), "--kubeconfig", control_plane.kubeconfig,
                    *(["--keep"] if keep else []), env={"HOME": str(tmp_path)})
        out = r.stdout + r.stderr
        assert r.returncode == 0, (i, out[-3000:])
        assert "a rolling upgrade across a simulated cluster of 4 GPU nodes" in out and control_plane.url in out
        run = re.search(r"labelled driverd\.io/demo=([0-9a-f]+)", out).group(1)
        assert f"driverrollout.driverd.io/demo-{run} created" in out
        assert "Completed" in out
        nodes = _nodes(control_plane)
        for name in before:       # the bystanders: never modified, never deleted
            assert name in nodes, (i, name, out[-2000:])
            assert _node_view(nodes[name]) == before[name], (i, name)
        mine = _labelled(list(nodes.values()), run)
        rollouts = {ro["metadata"]["name"]: ro for ro in control_plane.api("GET", ROLLOUTS)["items"]}
        pods = _labelled(control_plane.api("GET", PODS)["items"], run)
        workloads = _labelled(control_plane.api("GET", REPLICASETS)["items"], run)
        if keep:
            assert "demo: kept on the API server (--keep)" in out
            assert sorted(n["metadata"]["name"] for n in mine) == [f"demo-{run}-{j:04d}" for j in range(4)]
            assert sorted(n["metadata"]["labels"]["driverd.io/driver-version"] for n in mine) == ["550.127.05"] * 4
            # (its GPU pods were drained, and nothing schedules them again: their ReplicaSets stay)
            assert list(rollouts) == [f"demo-{run}"] and len(workloads) == 4
            kept_run = run
            kept = {n["metadata"]["name"]: _node_view(n) for n in mine}
            kept_rollout = (rollouts[f"demo-{run}"]["metadata"]["uid"], rollouts[f"demo-{run}"]["status"]["phase"])
            continue
        assert run != kept_run
        assert f"demo: removed what it made on the API server: 4 nodes (driverd.io/demo={run})" in out, out[-2000:]
        assert "could not remove" not in out, out[-2000:]
        assert mine == [] and pods == [] and workloads == [], (mine, pods, workloads)
        assert r.stdout.rstrip().splitlines()[-1].startswith("== done in")
        # the kept run's objects: there, and as that run left them
        assert {name: _node_view(nodes[name]) for name in kept if name in nodes} == kept, i
        assert list(rollouts) == [f"demo-{kept_run}"], rollouts
        ro = rollouts[f"demo-{kept_run}"]
        assert (ro["metadata"]["uid"], ro["status"]["phase"]) == kept_rollout
        assert len(_labelled(control_plane.api("GET", REPLICASETS)["items"], kept_run)) == 4


def test_demo_refuses_a_node_of_its_names_that_it_did_not_make(deployed, tmp_path, monkeypatch, capsys):
    """Should a Node of the run's names exist without the run's label (its names are unique to the run,
    so this takes somebody choosing them), the rollout stage refuses in one line naming the Node and the
    fix, makes nothing, and leaves that Node as it was."""
    from driverd.cli.demo import cluster_demo
    control_plane = deployed
    reset(control_plane)
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID("abc12300" + "0" * 24))
    _bystander(control_plane, "demo-abc123-0002")
    before = _node_view(_nodes(control_plane)["demo-abc123-0002"])
    rc = cluster_demo(tmp_path / "cluster", 9, control_plane.kubeconfig)
    out = capsys.readouterr().out
    assert rc == 1, out
    (line,) = [ln for ln in out.splitlines() if "refused" in ln]
    assert ("refused, Node demo-abc123-0002 already exists without this run's label driverd.io/demo=abc123" in line
            and "kubectl delete node demo-abc123-0002" in line), out
    nodes = _nodes(control_plane)
    assert list(nodes) == ["demo-abc123-0002"] and _node_view(nodes["demo-abc123-0002"]) == before
    assert _labelled(control_plane.api("GET", PODS)["items"], "abc123") == []


def test_demo_refuses_a_cluster_whose_driverd_is_at_work(deployed, tmp_path, capsys):
    """The demo's node daemons are coordinator candidates: holding the Lease they would carry out the
    cluster's own DriverRollouts and DriverPools on its real nodes. A cluster with a pool, an unfinished
    rollout or a coordinator holding the Lease is refused in one line naming them; nothing is made."""
    from driverd.cli.demo import cluster_demo
    control_plane = deployed
    reset(control_plane)
    _bystander(control_plane, "gpu-a")
    control_plane.api("POST", ROLLOUTS, {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                         "metadata": {"name": "prod-upgrade"}, "spec": {"driver": "550.127.05"}})
    control_plane.api("POST", "/apis/driverd.io/v1alpha1/driverpools", {
        "apiVersion": "driverd.io/v1alpha1", "kind": "DriverPool", "metadata": {"name": "h100"},
        "spec": {"driver": "550.127.05", "nodeSelector": {"matchLabels": {"pool": "h100"}}}})
    before = {name: _node_view(n) for name, n in _nodes(control_plane).items()}
    rc = cluster_demo(tmp_path / "cluster", 9, control_plane.kubeconfig)
    out = capsys.readouterr().out
    assert rc == 1, out
    (line,) = [ln for ln in out.splitlines() if "refused" in ln]
    assert "DriverRollout prod-upgrade in progress" in line and "DriverPool h100" in line, line
    assert "throwaway test cluster" in line
    assert {name: _node_view(n) for name, n in _nodes(control_plane).items()} == before
    assert control_plane.api("GET", PODS)["items"] == []


def test_demo_without_an_api_server_skips_the_rollout_stage_and_says_how(tmp_path):
    r = run_cli("demo", "--workdir", str(tmp_path / "demo"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "rolling upgrade across a simulated cluster: skipped" in r.stdout and "--kubeconfig" in r.stdout
