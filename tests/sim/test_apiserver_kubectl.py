"""The real kubectl against tests.apiserver: get (server-side tables, -w, selectors, -o), cordon/uncordon,
drain with PodDisruptionBudgets, apply of built-in and custom objects, label/annotate/patch."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from tests.sim.test_apiserver_crd import CRD

KUBECTL = "/usr/bin/kubectl"
pytestmark = [pytest.mark.real,
              pytest.mark.skipif(not (os.path.exists(KUBECTL) or shutil.which("kubectl")),
                                 reason="kubectl is not installed (/usr/bin/kubectl)")]


@pytest.fixture
def kubectl(srv, tmp_path):
    env = dict(os.environ, KUBECONFIG=str(tmp_path / "kubeconfig"), HOME=str(tmp_path))
    exe = KUBECTL if os.path.exists(KUBECTL) else shutil.which("kubectl")

    def run(*args, input=None, check=True, timeout=60):
        r = subprocess.run([exe, "--cache-dir", str(tmp_path / "cache"), *args], env=env, input=input,
                           capture_output=True, text=True, timeout=timeout, check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r
    run.env = env
    run.exe = exe
    return run


def _node(store, name, ready=True, roles=("worker",)):
    store.create("nodes", {"metadata": {"name": name, "labels": {f"node-role.kubernetes.io/{r}": "" for r in roles}},
                           "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                                      "nodeInfo": {"kubeletVersion": "v1.32.0"}}})


def _pod(store, name, labels, node="n1", owner=None):
    md = {"name": name, "namespace": "default", "labels": labels}
    if owner:
        md["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner["kind"], "name": owner["metadata"]["name"],
                                  "uid": owner["metadata"]["uid"], "controller": True}]
    store.create("pods", {"metadata": md, "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]},
                          "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}],
                                     "containerStatuses": [{"name": "c", "ready": True, "restartCount": 2,
                                                            "state": {"running": {}}}]}}, keep_status=True)


def _workload(store):
    """n1 with a DaemonSet pod and two ReplicaSet pods ("web"), as a real cluster would have them."""
    _node(store, "n1")
    ds = store.create("daemonsets", {"metadata": {"name": "ds", "namespace": "default"}, "spec": {
        "selector": {"matchLabels": {"a": "ds"}},
        "template": {"metadata": {"labels": {"a": "ds"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}})
    rs = store.create("replicasets", {"metadata": {"name": "web", "namespace": "default"}, "spec": {
        "replicas": 2, "selector": {"matchLabels": {"app": "web"}},
        "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}}}})
    _pod(store, "ds-n1", {"a": "ds"}, owner=ds)
    _pod(store, "web-1", {"app": "web"}, owner=rs)
    _pod(store, "web-2", {"app": "web"}, owner=rs)


def test_get_tables_cordon_uncordon(srv, kubectl):
    _node(srv.store, "n1")
    _node(srv.store, "n2", ready=False, roles=("control-plane", "worker"))
    out = kubectl("get", "nodes").stdout.splitlines()
    assert out[0].split() == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert out[1].split()[:3] == ["n1", "Ready", "worker"] and out[1].split()[-1] == "v1.32.0"
    assert out[2].split()[:3] == ["n2", "NotReady", "control-plane,worker"]
    assert kubectl("cordon", "n1").stdout.strip() == "node/n1 cordoned"
    assert kubectl("get", "node", "n1", "--no-headers").stdout.split()[1] == "Ready,SchedulingDisabled"
    assert srv.store.get("nodes", "n1")["spec"]["unschedulable"] is True
    assert kubectl("uncordon", "n1").stdout.strip() == "node/n1 uncordoned"
    assert "unschedulable" not in srv.store.get("nodes", "n1")["spec"]
    _pod(srv.store, "p", {"app": "x"})
    out = kubectl("get", "pods").stdout.splitlines()
    assert out[0].split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert out[1].split()[:4] == ["p", "1/1", "Running", "2"]


def test_drain_blocked_by_budget_times_out_with_kubernetes_message(srv, kubectl):
    _workload(srv.store)
    srv.store.create("poddisruptionbudgets", {"metadata": {"name": "web", "namespace": "default"},
                                              "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "web"}}}})
    t = time.monotonic()
    r = kubectl("drain", "n1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=2s", check=False)
    assert r.returncode != 0
    assert time.monotonic() - t < 30
    assert "Cannot evict pod as it would violate the pod's disruption budget." in r.stderr
    assert 'error when evicting pods/"web-1" -n "default"' in r.stderr and "global timeout reached: 2s" in r.stderr
    assert "ignoring DaemonSet-managed Pods: default/ds-n1" in r.stderr
    assert srv.store.get("nodes", "n1")["spec"]["unschedulable"] is True      # drain cordons first
    assert sorted(p["metadata"]["name"] for p in srv.store.list("pods")) == ["ds-n1", "web-1", "web-2"]
    evictions = srv.request_counts_by(lambda q: (q.method, q.subresource, q.code))
    assert evictions[("POST", "eviction", 429)] >= 2


def test_drain_allowed_by_budget(srv, kubectl):
    _workload(srv.store)
    srv.store.create("poddisruptionbudgets", {"metadata": {"name": "web", "namespace": "default"},
                                              "spec": {"maxUnavailable": 2, "selector": {"matchLabels": {"app": "web"}}}})
    r = kubectl("drain", "n1", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=20s")
    assert "evicting pod default/web-1" in r.stderr + r.stdout
    assert "node/n1 drained" in r.stdout
    assert [p["metadata"]["name"] for p in srv.store.list("pods")] == ["ds-n1"]
    lists = srv.request_counts_by(lambda q: (q.verb, q.resource, q.query.get("fieldSelector")))
    assert lists[("list", "pods", "spec.nodeName=n1")] >= 1


def test_apply_crd_custom_object_rejection_and_printer_columns(srv, kubectl, tmp_path):
    kubectl("apply", "-f", "-", input=json.dumps(CRD))
    cr = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "r1"},
          "spec": {"driver": "550.54.15", "maxParallel": 2}}
    assert kubectl("apply", "-f", "-", input=json.dumps(cr)).stdout.strip() == "driverrollout.driverd.io/r1 created"
    assert kubectl("apply", "-f", "-", input=json.dumps(cr)).stdout.strip() == "driverrollout.driverd.io/r1 unchanged"
    cr["spec"]["maxParallel"] = 3
    assert kubectl("apply", "-f", "-", input=json.dumps(cr)).stdout.strip() == "driverrollout.driverd.io/r1 configured"
    bad = dict(cr, metadata={"name": "bad"}, spec={"driver": "550.54.15", "maxParallel": 0})
    r = kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert r.returncode == 1
    assert ('The DriverRollout "bad" is invalid: spec.maxParallel: Invalid value: 0: spec.maxParallel in body '
            'should be greater than or equal to 1') in r.stderr
    typo = dict(cr, metadata={"name": "typo"}, spec={"driver": "550.54.15", "maxParalel": 2})
    r = kubectl("apply", "-f", "-", input=json.dumps(typo), check=False)
    assert r.returncode == 1 and 'strict decoding error: unknown field "spec.maxParalel"' in r.stderr
    kubectl("patch", "dr", "r1", "--subresource=status", "--type=merge",
            "-p", '{"status":{"conditions":[{"type":"Ready","status":"True"}]}}')
    out = kubectl("get", "dr").stdout.splitlines()
    assert out[0].split() == ["NAME", "DRIVER", "PARALLEL", "READY", "AGE"]
    assert out[1].split()[:4] == ["r1", "550.54.15", "3", "True"]
    got = json.loads(kubectl("get", "driverrollouts.driverd.io", "r1", "-o", "json").stdout)
    assert got["spec"]["flavor"] == "open" and got["metadata"]["generation"] == 2
    assert "kubectl.kubernetes.io/last-applied-configuration" in got["metadata"]["annotations"]


def test_apply_label_annotate_patch_selectors_output(srv, kubectl):
    deploy = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d1", "labels": {"app": "d1"}},
              "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "d1"}}, "template": {
                  "metadata": {"labels": {"app": "d1"}},
                  "spec": {"containers": [{"name": "c", "image": "nginx:1.25", "env": [{"name": "A", "value": "1"}]},
                                          {"name": "side", "image": "busybox:1.36"}]}}}}
    kubectl("apply", "-f", "-", input=json.dumps(deploy))
    deploy["spec"]["template"]["spec"]["containers"] = [deploy["spec"]["template"]["spec"]["containers"][0]]
    deploy["spec"]["template"]["spec"]["containers"][0]["image"] = "nginx:1.27"
    assert "configured" in kubectl("apply", "-f", "-", input=json.dumps(deploy)).stdout
    got = srv.store.get("deployments", "d1", "default")["spec"]["template"]["spec"]["containers"]
    assert [(c["name"], c["image"]) for c in got] == [("c", "nginx:1.27")]          # apply removed "side"
    kubectl("label", "deploy", "d1", "tier=gpu")
    kubectl("annotate", "deploy", "d1", "driverd.io/note=hello")
    kubectl("patch", "deploy", "d1", "-p",
            '{"spec":{"template":{"spec":{"containers":[{"name":"c","env":[{"name":"B","value":"2"}]}]}}}}')
    kubectl("patch", "deploy", "d1", "--type=json", "-p", '[{"op":"replace","path":"/spec/replicas","value":3}]')
    kubectl("patch", "deploy", "d1", "--type=merge", "-p", '{"metadata":{"labels":{"tier":null}}}')
    out = kubectl("get", "deploy", "d1", "-o",
                  "jsonpath={.spec.replicas} {.spec.template.spec.containers[0].env[*].name} "
                  "{.metadata.annotations.driverd\\.io/note} {.metadata.labels}").stdout
    assert out == '3 A B hello {"app":"d1"}'
    kubectl("create", "configmap", "c1", "--from-literal=k=v")       # a protobuf request body
    kubectl("label", "cm", "c1", "x=y")
    assert kubectl("get", "cm", "-l", "x=y", "-o", "name").stdout.strip() == "configmap/c1"
    assert kubectl("get", "cm", "-l", "x in (z)", "-o", "name", check=False).stdout.strip() == ""
    import yaml
    assert yaml.safe_load(kubectl("get", "cm", "c1", "-o", "yaml").stdout)["data"] == {"k": "v"}
    _node(srv.store, "n1")
    _pod(srv.store, "on-n1", {}, node="n1")
    _pod(srv.store, "on-n2", {}, node="n2")
    assert kubectl("get", "pods", "--field-selector", "spec.nodeName=n1", "-o", "name").stdout.strip() == "pod/on-n1"
    r = kubectl("get", "pods", "--field-selector", "spec.bogus=1", check=False)
    assert r.returncode == 1 and "field label not supported: spec.bogus" in r.stderr
    kubectl("delete", "cm", "c1")
    assert srv.store.list("configmaps", "default") == []


def test_get_watch_streams(srv, kubectl):
    _node(srv.store, "n1")
    p = subprocess.Popen([kubectl.exe, "--cache-dir", kubectl.env["HOME"] + "/cache", "get", "nodes", "-w"],
                         env=kubectl.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [p.stdout.readline(), p.stdout.readline()]
        srv.store.patch("nodes", "n1", {"spec": {"unschedulable": True}})
        lines.append(p.stdout.readline())
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=10)
    assert lines[0].split()[:2] == ["NAME", "STATUS"]
    assert lines[1].split()[:2] == ["n1", "Ready"]
    assert lines[2].split()[:2] == ["n1", "Ready,SchedulingDisabled"]

