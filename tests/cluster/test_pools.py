"""DriverPools on the real control plane (kube-apiserver with deploy/'s CRDs, RBAC and admission
policies; each node daemon with its own node-bound token; the operator bound to driverd-operator):
the resource's schema, what a node's credential may do with pools, a pool's driver change rolled
out by a DriverRollout the pool owns, and overlapping pools refused naming each other."""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error

from driverd.cluster import model as m
from driverd.cluster import pools as pl
from driverd.cluster.kube import Kube, KubeError, Target, lease_path, node_path, pool_path, rollout_path
from driverd.sim.fleet import Fleet, NEW, OLD
from tests.cluster.test_rollout import cli, cluster, kube, started, views, wait_phase  # noqa: F401 (fixture)
from tests.controlplane import OPERATOR_TOKEN, reset

KUBECTL = "/usr/bin/kubectl"


def pool(name: str, driver: str, selector: dict, **spec) -> dict:
    return {"apiVersion": pl.API_VERSION, "kind": pl.KIND, "metadata": {"name": name},
            "spec": {"driver": driver, "nodeSelector": {"matchLabels": selector}, **spec}}


def label(f, node: str, labels: dict) -> None:
    kube(f).patch(node_path(node), {"metadata": {"labels": labels}})


def wait_pool(f, name: str, pred, timeout: float = 60) -> dict:
    k = kube(f)
    end = time.monotonic() + timeout
    while True:
        obj = k.get(pool_path(name))
        st = obj.get("status") or {}
        if st.get("observedGeneration") == obj["metadata"]["generation"] and pred(st):
            return obj
        assert time.monotonic() < end, f"pool {name}: {json.dumps(st)[:2000]}; nodes: " + "; ".join(
            f"{n}: {v.driver} {v.state} {v.reason}" for n, v in views(f).items())
        time.sleep(0.3)


def cond(st: dict, kind: str) -> dict:
    return {c["type"]: c for c in st.get("conditions") or []}.get(kind) or {}


def owned_rollouts(f, name: str) -> list[dict]:
    items = kube(f).list(rollout_path(), labels=f"{pl.L_POOL}={name}")["items"]
    return sorted(items, key=pl.revision)


def test_the_pool_resource_schema(deployed, tmp_path):
    reset(deployed)
    op = lambda method, path, body=None: deployed.api(method, path, body, token=OPERATOR_TOKEN)  # noqa: E731
    coll = "/apis/driverd.io/v1alpha1/driverpools"
    for bad, field in ((pool("p", "570.195.03\n", {"a": "b"}), "spec.driver"),
                       ({"apiVersion": pl.API_VERSION, "kind": pl.KIND, "metadata": {"name": "p"},
                         "spec": {"driver": NEW}}, "spec.nodeSelector"),
                       (pool("p", NEW, {"a": "b"}, maxUnavailable="ten"), "spec.maxUnavailable"),
                       (pool("p", NEW, {"a": "b"}, flavor="closed"), "spec.flavor")):
        try:
            op("POST", coll, bad)
            raise AssertionError(f"accepted {bad['spec']}")
        except urllib.error.HTTPError as e:
            body = e.read().decode()
            assert e.code == 422 and field in body, (e.code, body)
    made = op("POST", coll, pool("p", NEW, {"a": "b"}, maxParallel=3))
    spec = made["spec"]                  # the rollout's defaults: one schema
    assert (spec["flavor"], spec["maxParallel"], spec["maxUnavailable"], spec["preflight"],
            spec["drain"]["timeoutSeconds"], spec["paused"]) == ("auto", 3, 1, "Refuse", 600, False)
    env = deployed.kubectl_env(tmp_path, deployed.operator_kubeconfig(tmp_path / "op.kubeconfig"))
    r = subprocess.run([KUBECTL, "get", "dpool"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.split()[:9] == ["NAME", "DRIVER", "FLAVOR", "NODES", "CURRENT", "BEHIND",
                                                          "ROLLOUT", "CONVERGED", "AGE"], r.stdout + r.stderr


def test_a_node_credential_cannot_change_pools_nor_make_rollouts_of_its_own(cluster):
    srv, make = cluster
    f = make(2)
    label(f, "gpu-0000", {"pool": "a"})
    label(f, "gpu-0001", {"pool": "a"})
    started(f)
    k = kube(f)
    k.create(pool_path(), pool("a", OLD, {"pool": "a"}))
    wait_pool(f, "a", lambda st: cond(st, "Converged").get("status") == "True")
    holder = k.get(lease_path("driverd", "driverd-rollout"))["spec"]["holderIdentity"]
    assert holder == Fleet.COORDINATOR          # the coordinator's own identity, no node (issue 44)
    as_node = {n: Kube(Target(kubeconfig=f.node_kubeconfig(n))) for n in f.nodes}
    as_node[holder] = Kube(Target(kubeconfig=f.coordinator_kubeconfig()))
    other = "driverd-coordinator-1"             # a replica that does not hold the Lease
    as_node[other] = Kube(Target(kubeconfig=f.coordinator_kubeconfig(other)))
    p = k.get(pool_path("a"))

    def refused(node, call, *words):
        try:
            call(as_node[node])
        except KubeError as e:
            assert e.status in (403, 422) and all(w in e.api_message for w in words), (e.status, e.api_message)
            return
        raise AssertionError(f"{node}'s token was allowed to {words}")
    # the spec is the operator's: no daemon may change it, holder or not (RBAC gives no verb for it)
    for n in as_node:
        refused(n, lambda c: c.patch(pool_path("a"), {"spec": {"driver": NEW}}), "forbidden")
    # the status is the coordinator's: never a node's, and only the holder's
    for n in f.nodes:
        refused(n, lambda c: c.patch(pool_path("a", status=True), {"status": {"driver": NEW}}), "forbidden")
    refused(other, lambda c: c.patch(pool_path("a", status=True), {"status": {"driver": NEW}}),
            "does not hold the Lease")
    # a rollout of its own making: only as a pool's revision, by the holder, with exactly the pool's spec
    own = pl.rollout_object(pl.Pool.from_object(p), 7)
    plain = {"apiVersion": pl.API_VERSION, "kind": "DriverRollout", "metadata": {"name": "mine"},
             "spec": {"driver": NEW}}
    for n in f.nodes:
        refused(n, lambda c: c.create(rollout_path(), own), "forbidden")
    refused(holder, lambda c: c.create(rollout_path(), plain), "only as a DriverPool's revision")
    refused(other, lambda c: c.create(rollout_path(), own), "does not hold the Lease")
    wrong = json.loads(json.dumps(own))
    wrong["spec"]["driver"] = NEW
    refused(holder, lambda c: c.create(rollout_path(), wrong), "only with exactly the pool's spec")
    lax = json.loads(json.dumps(own))
    lax["spec"]["maxParallel"] = 50
    refused(holder, lambda c: c.create(rollout_path(), lax), "only with exactly the pool's spec")
    skip_canary = json.loads(json.dumps(own))
    skip_canary["metadata"]["annotations"]["driverd.io/canary-approved"] = "true"
    refused(holder, lambda c: c.create(rollout_path(), skip_canary), "driverd.io/pool-revision")
    made = as_node[holder].create(rollout_path(), own)          # what the coordinator does: allowed
    assert pl.owner(made) == ("a", p["metadata"]["uid"])
    assert {v.driver for v in views(f).values()} == {OLD}


def test_changing_a_pools_driver_rolls_it_out_under_the_pools_policy(cluster):
    srv, make = cluster
    f = make(3)
    for n in f.nodes:
        label(f, n, {"pool": "a"})
    started(f)
    # the pool is created on the driver its nodes run: nothing moves
    rc, out, err = cli(f, "rollout", "start", "--pool", "a", "--selector", "pool=a", "--driver", OLD)
    assert rc == 0 and "driverpool.driverd.io/a created: driver" in out, err
    wait_pool(f, "a", lambda st: cond(st, "Converged").get("status") == "True" and st["nodes"]["current"] == 3)
    assert owned_rollouts(f, "a") == []
    # a rollout of its own over a pool's nodes would fight the pool: refused, naming the pool
    rc, out, err = cli(f, "rollout", "start", "--driver", NEW, "--selector", "pool=a")
    assert rc == 2 and "pool a: gpu-0000, gpu-0001, gpu-0002" in err and "--pool a" in err, err
    # the pool's driver changes: the coordinator starts revision 1 under the pool's policy
    rc, out, err = cli(f, "rollout", "start", "--pool", "a", "--driver", NEW, "--max-parallel", "2",
                       "--max-unavailable", "2")
    assert rc == 0 and f"driver {NEW} (was {OLD})" in out, err
    assert f.wait(lambda: len(owned_rollouts(f, "a")) == 1, 30), kube(f).get(pool_path("a")).get("status")
    ro = owned_rollouts(f, "a")[0]
    assert ro["metadata"]["name"] == "a-1" and ro["metadata"]["annotations"][pl.A_REVISION] == "1"
    assert ro["metadata"]["ownerReferences"][0]["kind"] == "DriverPool" and \
        ro["metadata"]["ownerReferences"][0]["uid"] == kube(f).get(pool_path("a"))["metadata"]["uid"]
    assert (ro["spec"]["driver"], ro["spec"]["maxParallel"], ro["spec"]["maxUnavailable"]) == (NEW, 2, 2)
    wait_phase(f, "a-1", ("Completed",), timeout=180)
    assert {v.driver for v in views(f).values()} == {NEW}
    st = wait_pool(f, "a", lambda st: st["rollout"] == "a-1" and st["nodes"]["current"] == 3)["status"]
    assert cond(st, "Converged")["status"] == "True" and st["driver"] == NEW
    rc, out, err = cli(f, "pools", "-o", "json")
    assert rc == 0, err
    doc = json.loads(out)["pools"][0]
    assert (doc["pool"], doc["driver"], doc["nodes"]["current"], doc["rollout"]) == ("a", NEW, 3, "a-1")
    # undo: the pool goes back to the driver before revision 1, rolled out as revision 2
    rc, out, err = cli(f, "rollout", "undo", "a-1")
    assert rc == 0 and f"driver back to {OLD}" in out, err
    assert kube(f).get(pool_path("a"))["spec"]["driver"] == OLD
    assert f.wait(lambda: [o["metadata"]["name"] for o in owned_rollouts(f, "a")] == ["a-1", "a-2"], 30)
    wait_phase(f, "a-2", ("Completed",), timeout=180)
    assert {v.driver for v in views(f).values()} == {OLD}
    rc, out, err = cli(f, "pool", "status", "a")
    assert rc == 0 and "3/3 on it" in out and "rollout a-2" in out, out + err


def test_a_pool_deleted_and_recreated_under_its_name_is_a_new_pool_and_rolls_out(cluster):
    """Issue 42: a re-created pool is a new pool (the coordinator keys it by uid), and its first revision
    does not meet the name of the old pool's revision the garbage collector may not have removed yet."""
    srv, make = cluster
    f = make(2)
    for n in f.nodes:
        label(f, n, {"pool": "a"})
    started(f)
    rc, out, err = cli(f, "rollout", "start", "--pool", "a", "--selector", "pool=a", "--driver", NEW)
    assert rc == 0, err
    assert f.wait(lambda: len(owned_rollouts(f, "a")) == 1, 30), kube(f).get(pool_path("a")).get("status")
    wait_phase(f, "a-1", ("Completed",), timeout=180)
    old_uid = kube(f).get(pool_path("a"))["metadata"]["uid"]
    kube(f).delete(pool_path("a"))
    rc, out, err = cli(f, "rollout", "start", "--pool", "a", "--selector", "pool=a", "--driver", OLD)
    assert rc == 0 and "driverpool.driverd.io/a created" in out, out + err
    new_uid = kube(f).get(pool_path("a"))["metadata"]["uid"]
    assert new_uid != old_uid

    def mine() -> list[dict]:
        return [o for o in owned_rollouts(f, "a") if o["metadata"]["ownerReferences"][0]["uid"] == new_uid]
    assert f.wait(lambda: len(mine()) == 1, 30), (kube(f).get(pool_path("a")).get("status"),
                                                 [o["metadata"]["name"] for o in owned_rollouts(f, "a")])
    name = mine()[0]["metadata"]["name"]
    assert name != "a-1" or not any(o["metadata"]["ownerReferences"][0]["uid"] == old_uid
                                    for o in owned_rollouts(f, "a")), name
    wait_phase(f, name, ("Completed",), timeout=180)
    assert {v.driver for v in views(f).values()} == {OLD}
    wait_pool(f, "a", lambda st: st["rollout"] == name and st["nodes"]["current"] == 2)


def test_overlapping_pools_are_refused_naming_both_and_their_nodes_left_alone(cluster):
    srv, make = cluster
    f = make(3)
    started(f)
    k = kube(f)
    # both pools first, selecting nothing yet, then the node both select, then the others: the coordinator
    # never sees pool a without pool z or a node of either pool before the overlap (pools created one after
    # the other over labelled nodes let a pass see pool a alone, which rightly rolled gpu-0000)
    k.create(pool_path(), pool("a", NEW, {"pool": "a"}))
    k.create(pool_path(), pool("z", NEW, {"zone": "z"}))
    label(f, "gpu-0001", {"pool": "a", "zone": "z"})            # selected by both pools
    label(f, "gpu-0000", {"pool": "a"})
    label(f, "gpu-0002", {"zone": "z"})
    for name, other in (("a", "z"), ("z", "a")):
        st = wait_pool(f, name, lambda st: cond(st, "Overlap").get("status") == "True")["status"]
        c = cond(st, "Overlap")
        assert c["reason"] == "ConflictingNodeSelector" and f"pool {other} also selects gpu-0001" in c["message"]
        why = {b["node"]: b["reason"] for b in st["behindNodes"]}
        assert why["gpu-0001"].startswith(f"also selected by pool {other}")
    time.sleep(3)                                               # the coordinator has had many passes
    assert k.list(rollout_path())["items"] == []                # neither pool starts a rollout
    assert {v.driver for v in views(f).values()} == {OLD} and all(v.state == m.IDLE for v in views(f).values())
    rc, out, err = cli(f, "pools")
    assert rc == 0 and "pool z also selects gpu-0001" in out and "pool a also selects gpu-0001" in out, out + err
    # the overlap resolved (the node leaves zone z): each pool rolls its own nodes
    k.patch(node_path("gpu-0001"), {"metadata": {"labels": {"zone": None}}})
    wait_pool(f, "a", lambda st: cond(st, "Overlap").get("status") == "False" and st["nodes"]["current"] == 2,
              timeout=180)
    wait_pool(f, "z", lambda st: st["nodes"]["current"] == 1, timeout=180)
    assert {v.driver for v in views(f).values()} == {NEW}
    assert sorted(o["metadata"]["name"] for o in k.list(rollout_path())["items"]) == ["a-1", "z-1"]


def test_a_pool_changed_back_mid_rollout_supersedes_its_revision_and_gives_the_nodes_back(cluster):
    srv, make = cluster
    f = make(2)
    for n in f.nodes:
        label(f, n, {"pool": "a"})
    f.pdb_never("gpu-0000")                 # holds the first node in evicting until the test is done
    started(f)
    k = kube(f)
    k.create(pool_path(), pool("a", NEW, {"pool": "a"}, drain={"timeoutSeconds": 120}))
    assert f.wait(lambda: views(f)["gpu-0000"].state == m.EVICTING, 60), views(f)
    assert views(f)["gpu-0000"].unschedulable
    # the operator changes their mind: the pool goes back to the driver its nodes run
    k.patch(pool_path("a"), {"spec": {"driver": OLD}})
    ro = wait_phase(f, "a-1", (pl.SUPERSEDED,), timeout=60)
    assert ro["status"]["reason"] == "PoolChanged" and f"now wants driver {OLD}" in ro["status"]["message"]
    assert f.wait(lambda: views(f)["gpu-0000"].state == m.IDLE, 60), views(f)
    v = views(f)["gpu-0000"]
    assert v.reason == pl.SUPERSEDED and not v.unschedulable and v.driver == OLD
    st = wait_pool(f, "a", lambda st: st["nodes"]["current"] == 2)["status"]
    assert cond(st, "Converged")["status"] == "True"
    time.sleep(2)
    assert [o["metadata"]["name"] for o in owned_rollouts(f, "a")] == ["a-1"]     # nothing to roll: no a-2
    assert {v.driver for v in views(f).values()} == {OLD}


def test_the_pool_example_and_dry_run_manifests_pass_the_real_crd_schema(deployed, tmp_path):
    """deploy/examples/driverpool.yaml and what `rollout start --pool … --dry-run=client -o yaml` prints
    (no cluster contacted): accepted by kube-apiserver under deploy/'s CRD, nothing pruned."""
    import yaml

    from tests.conftest import REPO
    example = (REPO / "deploy/examples/driverpool.yaml").read_text()
    p = pl.Pool.from_object(dict(yaml.safe_load(example), metadata={"name": "h100", "generation": 1}))
    assert (p.version, p.spec.max_unavailable, p.spec.canary) == ("570.195.03", "10%", 1)
    env = dict(os.environ, PATH=f"{REPO}/.venv/bin:{os.environ['PATH']}", KUBECONFIG="/nonexistent")
    dry = subprocess.run([f"{REPO}/.venv/bin/kubectl-driverd", "rollout", "start", "--pool", "h100", "--selector",
                          "gpu=h100", "--driver", NEW, "--max-parallel", "3", "--dry-run=client", "-o", "yaml"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert dry.returncode == 0, dry.stderr
    kenv = deployed.kubectl_env(tmp_path)
    for doc in (example, dry.stdout):
        out = subprocess.run([KUBECTL, "create", "--dry-run=server", "--validate=strict", "-o", "json", "-f", "-"],
                             input=doc, capture_output=True, text=True, env=kenv, timeout=60)
        assert out.returncode == 0, out.stderr
        assert kept(yaml.safe_load(doc)["spec"], json.loads(out.stdout)["spec"])     # nothing pruned


def kept(sent, stored) -> bool:
    """Everything sent is in what the server stored (which may add defaults, also in nested objects)."""
    if isinstance(sent, dict):
        return isinstance(stored, dict) and all(k in stored and kept(v, stored[k]) for k, v in sent.items())
    return sent == stored
