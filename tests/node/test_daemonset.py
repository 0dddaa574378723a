"""The driver container as Kubernetes runs it: driverd's Helm chart (deploy/helm/driverd, deploy/base's objects:
tests/test_helm_chart.py shows it renders what deploy/overlays/container-mode renders) installed with Helm on a
real node (tests/realnode.py: kubelet v1.34.4, containerd 1.6, runc), the image built by
images/build-image.sh imported into that node's containerd.

The chart's values set what a user's values would (the image, the driver, the repository and more
configuration: the simulated kernel); a Helm post-renderer (`kubectl kustomize`, as Helm's documentation
suggests for what values do not reach) changes what only this test machine needs, and nothing of how driverd
runs: imagePullPolicy Never (there is no registry), /host a sample host tree, and the host's network (the
test node has no pod network: its CNI is the loopback plugin alone). Everything else -- probes, the downward API, the ServiceAccount token the
kubelet projects, the ConfigMap mount, OnDelete, system-node-critical -- is deploy/'s, seen through the
real kubelet: pod status and conditions are the kubelet's, not a test's."""
from __future__ import annotations

import json
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest

from tests.conftest import stop_process
from tests.controlplane import wait_policies_configured
from tests.kubetools import condition_true

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(2400)]
IMAGE = "localhost/driverd:driver-test"
NS = "driverd"
SELECTOR = "app.kubernetes.io/name%3Ddriverd,app.kubernetes.io/component%3Dnode-daemon"
DRIVER = "535.261.03"
# The chart's config.toml carries the driver, the repository, the daemon's listen address, coordinate = false
# and JSON logs; the rest of what this node needs, as the chart's `config` value
CONFIG_EXTRA = """[runtime]
runtimes = ["containerd"]
restart = "systemd"
binary = "{binary}"

[modules]
kernel = "sim"
"""
# The coordinator: deploy/'s Deployment runs it on no GPU node, and this cluster's only node is one (its pod
# stays Pending); it runs beside the node as `driverd cluster coordinator` with that Deployment's identity (a
# token of the ServiceAccount driverd-coordinator bound to a pod of its own), as on a control-plane host.
COORDINATOR = "driverd-coordinator-0"


def post_renderer(where: Path, host: Path) -> Path:
    """A Helm post-renderer: the chart's objects through `kubectl kustomize` with this machine's patch."""
    where.mkdir(parents=True)
    ds = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "driverd", "namespace": NS},
          "spec": {"template": {"spec": {
              "hostNetwork": True,
              "containers": [{"name": "driverd", "imagePullPolicy": "Never"}],
              "volumes": [{"name": "host", "hostPath": {"path": str(host)}}]}}}}
    (where / "daemonset.yaml").write_text(json.dumps(ds))
    script = where / "post-render"
    script.write_text(f"""#!/bin/sh
set -e
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
cat > "$d/all.yaml"
cp {where}/daemonset.yaml "$d/daemonset.yaml"
printf 'resources: [all.yaml]\\npatches: [{{path: daemonset.yaml}}]\\n' > "$d/kustomization.yaml"
/usr/bin/kubectl kustomize "$d"
""")
    script.chmod(0o755)
    return script


def helm_install(cp, work: Path, host: Path, binary: str) -> str:
    """`helm install` of the chart on the node's control plane; the ConfigMap's config.toml it made."""
    import yaml

    from tests.test_helm_chart import CHART, helm
    values = work / "values.yaml"
    values.write_text(yaml.safe_dump({
        "image": {"repository": IMAGE.rsplit(":", 1)[0], "tag": IMAGE.rsplit(":", 1)[1]},
        "driver": {"version": DRIVER, "flavor": "open"},
        "repository": {"urls": ["file:///host/srv/driverd-repo"]},
        "config": CONFIG_EXTRA.replace("{binary}", binary)}))
    env = {"HOME": str(work), "KUBECONFIG": cp.kubeconfig, "PATH": "/usr/bin:/bin",
           "HELM_CACHE_HOME": str(work / "helm-cache"), "HELM_CONFIG_HOME": str(work / "helm-config"),
           "HELM_DATA_HOME": str(work / "helm-data")}
    r = helm("install", "driverd", str(CHART), "-n", NS, "--create-namespace", "-f", str(values),
             "--post-renderer", str(post_renderer(work / "post-render", host)), env=env)
    assert "STATUS: deployed" in r.stdout, r.stdout + r.stderr
    # the chart leaves the namespace to --create-namespace; the README's label for privileged pods
    cp.api("PATCH", f"/api/v1/namespaces/{NS}", {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "privileged"}}}, content_type="application/merge-patch+json")
    return cp.api("GET", f"/api/v1/namespaces/{NS}/configmaps/driverd-config")["data"]["config.toml"]


def gpus_allocatable(node) -> int:
    """The real node's nvidia.com/gpu allocatable as its kubelet last published it."""
    n = node.cp.api("GET", f"/api/v1/nodes/{node.name}")
    return int((n["status"].get("allocatable") or {}).get("nvidia.com/gpu") or 0)


def wait_gpus(node, count: int, timeout: float = 90) -> None:
    """Until the kubelet publishes `count` nvidia.com/gpu allocatable. Its count lags a plugin's leaving by
    its status loop (up to 10 s): a test that waits for its own plugin's GPUs first waits for 0, so that it
    does not find the count of a plugin removed just before."""
    end = time.monotonic() + timeout
    while (n := gpus_allocatable(node)) != count:
        assert time.monotonic() < end, (f"nvidia.com/gpu allocatable {n}, never {count} within {timeout}s: "
                                        f"{node.log_tail('kubelet')}")
        time.sleep(0.3)


def remove_plugin(node, name: str) -> None:
    """A stand-in device plugin's DaemonSet deleted, its own pods gone (another test's plugin DaemonSet
    may stay in that namespace) and its GPUs gone from the node's allocatable. A plugin stopped by a drain
    mid-serving, or one whose replacement never served, leaves the socket it registered in the kubelet's
    fixed directory, which the real node checks is as it found it: removed here."""
    from tests.node import deviceplugin as dp
    cp = node.cp
    cp.api("DELETE", f"/apis/apps/v1/namespaces/{dp.NS}/daemonsets/{name}")
    end = time.monotonic() + 60
    while cp.api("GET", f"/api/v1/namespaces/{dp.NS}/pods?labelSelector=app%3D{name}")["items"]:
        assert time.monotonic() < end, f"the pods of {name} never left"
        time.sleep(0.5)
    for sock in Path("/var/lib/kubelet/device-plugins").glob("standin-*.sock"):
        sock.unlink(missing_ok=True)
    wait_gpus(node, 0, 60)


def _pods(cp) -> list[dict]:
    return cp.api("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector={SELECTOR}")["items"]


def _ready(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") == "Running" and condition_true(pod, "Ready")


def wait_pod_ready(node, not_uid: str | None = None, timeout: float = 300) -> tuple[dict, float]:
    """The DaemonSet's pod on the node Running and Ready as the kubelet reports it (other than the pod
    `not_uid`), and the seconds it took."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        for p in _pods(node.cp):
            last = p
            if p["metadata"]["uid"] != not_uid and not p["metadata"].get("deletionTimestamp") and _ready(p):
                return p, time.monotonic() - t0
        time.sleep(0.5)
    name = (last or {}).get("metadata", {}).get("name", "?")
    raise AssertionError(f"no Ready driverd pod after {timeout}s: {json.dumps((last or {}).get('status'))[:2000]}\n"
                         f"kubelet: {node.log_tail('kubelet', 2000)}\n"
                         f"log: {node.container_log(NS, name, 'driverd')[-3000:]}")


def _journal_runs(host: Path) -> int:
    d = host / "var/lib/driverd"
    return len(list((d / "journal.d").glob("*.json"))) + (1 if (d / "journal.json").exists() else 0)


def _journal_results(host: Path) -> list[dict]:
    """Every step result of driverd's journals in the host tree (what a run recorded it did)."""
    d = host / "var/lib/driverd"
    out: list[dict] = []

    def walk(o):
        if isinstance(o, dict):
            out.append(o)
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)
    for f in [*(d / "journal.d").glob("*.json"), d / "journal.json"]:
        if f.exists():
            walk(json.loads(f.read_text()))
    return out


@pytest.fixture(scope="module")
def on_node(real_node, driver_image, tmp_path_factory):
    """deploy/ applied to the real node, the driverd pod Ready there; yields (node, host tree, seconds)."""
    from driverd.sim.scenario import dgx_spec, make_host, make_packages
    node, cp = real_node, real_node.cp
    t = time.monotonic()
    node.import_image(driver_image, "driver-test", IMAGE)
    imported = time.monotonic() - t
    work = tmp_path_factory.mktemp("on-node")
    # The sample host is the node's own host tree: its etc/containerd/config.toml is the file the node's
    # containerd reads, its run/containerd/containerd.sock the socket the kubelet uses, and systemctl
    # there restarts that containerd (systemd is played, nothing else).
    host = make_host(node.host, dgx_spec(gpus=2, nvswitches=0, nouveau=False))
    node.write_containerd_config()
    node.play_systemd()
    make_packages(host / "srv/driverd-repo")
    # The handler's runtime: runc behind a wrapper that notes each call (NVIDIA's runtime is runc with a
    # hook; what is proven here is that containerd runs the handler driverd configured). A machine path:
    # containerd runs it, not the container.
    wrapper = node.dir / "nvidia-runtime"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {node.dir}/nvidia-runtime.calls\nexec {node.bins["runc"]} "$@"\n')
    wrapper.chmod(0o755)
    # mountPropagation: HostToContainer needs /host's source on a shared (or slave) mount, as / is on a
    # systemd host; this machine's / is private, so the sample tree becomes a shared mount of its own.
    subprocess.run(["mount", "--bind", str(host), str(host)], check=True)
    try:
        subprocess.run(["mount", "--make-rshared", str(host)], check=True)
        # the node carries the label node feature discovery gives a node with an NVIDIA PCI device
        cp.api("PATCH", f"/api/v1/nodes/{node.name}",
               {"metadata": {"labels": {"feature.node.kubernetes.io/pci-10de.present": "true"}}},
               content_type="application/merge-patch+json")
        config = helm_install(cp, work, host, str(wrapper))
        wait_policies_configured(cp)
        pod, took = wait_pod_ready(node)
        print(f"\ndriverd image imported in {imported:.1f}s; DaemonSet pod Ready {took:.1f}s after apply")
        from driverd.sim.fleet import spawn_coordinator
        coordinator, _ = spawn_coordinator(cp.coordinator_kubeconfig(COORDINATOR, work / "coordinator.kubeconfig"),
                                           COORDINATOR, work)
        try:
            yield node, host, pod, config
        finally:
            stop_process(coordinator)
    finally:
        subprocess.run(["umount", "-l", str(host)], capture_output=True)


def test_daemonset_pod_runs_ready_under_the_kubelet_and_the_node_gets_driver_ready(on_node):
    node, host, pod, config = on_node
    cp = node.cp
    st = pod["status"]
    # the kubelet's own report: the container started, its readiness probe (/readyz) passed
    (cs,) = st["containerStatuses"]
    assert cs["ready"] and cs["started"] and "running" in cs["state"], cs
    assert cs["image"].endswith("driverd:driver-test") and pod["spec"]["nodeName"] == node.name
    assert st["hostIP"] == "198.51.100.35"
    # the driver the ConfigMap asks for is loaded in the (simulated) host, by a run recorded there
    assert DRIVER in (host / "proc/driver/nvidia/version").read_text()
    assert _journal_runs(host) >= 1
    # the Node as driverd's ServiceAccount (the token the kubelet projected, bound to this pod) set it
    n = cp.api("GET", f"/api/v1/nodes/{node.name}")
    end = time.monotonic() + 60
    while not any(c["type"] == "GPUDriverReady" and c["status"] == "True" for c in n["status"]["conditions"]) \
            and time.monotonic() < end:
        time.sleep(0.5)
        n = cp.api("GET", f"/api/v1/nodes/{node.name}")
    cond = {c["type"]: c for c in n["status"]["conditions"]}
    assert cond["GPUDriverReady"]["status"] == "True", cond.get("GPUDriverReady")
    assert cond["Ready"]["status"] == "True"          # the kubelet's own condition is still there
    assert n["metadata"]["labels"].get("driverd.io/driver-ready") == "true", n["metadata"]["labels"]
    log = node.container_log(NS, pod["metadata"]["name"], "driverd")
    assert "no fast path" in log, log[-3000:]       # a fresh host: the first start converges it


def test_driverd_configures_the_nodes_containerd_restarts_it_and_a_nvidia_pod_runs(on_node):
    import tomllib
    node, host, pod, config = on_node
    cp = node.cp
    # the handler in the file the node's containerd reads, everything of the node's own kept
    doc = tomllib.loads(node.config_toml.read_text())
    cri = doc["plugins"]["io.containerd.grpc.v1.cri"]
    runtimes = cri["containerd"]["runtimes"]
    wrapper = str(node.dir / "nvidia-runtime")
    assert runtimes["nvidia"]["options"]["BinaryName"] == wrapper, runtimes
    assert runtimes["nvidia"]["options"]["Root"] == runtimes["runc"]["options"]["Root"] == f"{node.dir}/containerd/runc"
    assert doc["grpc"]["address"] == node.sock and cri["restrict_oom_score_adj"] is True
    assert cri["containerd"]["default_runtime_name"] == "runc"
    # restarted the way runtime.restart = "systemd" says: try-restart through the host's systemctl, then
    # the socket the kubelet uses answered again (the run's journal says so)
    assert node.systemd_restarts >= 1 and node.containerd_starts >= 2 and not node.systemd_error
    reports = [r for r in _journal_results(host) if r.get("runtime") == "containerd" and "restart_detail" in r]
    assert any(r["restarted"] and "chroot /host systemctl try-restart --no-block containerd" in r["restart_detail"]
               and "/run/containerd/containerd.sock answered after" in r["restart_detail"] for r in reports), reports
    # the driver pod itself survived its runtime's restart (the shim keeps it), and is still Ready
    now = cp.api("GET", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}")
    assert _ready(now) and now["status"]["containerStatuses"][0]["restartCount"] == 0
    # a pod asking for RuntimeClass nvidia (deploy/'s) runs through the handler
    from tests.realnode import PAUSE_IMAGE
    cp.ensure("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "gpu-work"}})
    calls = node.dir / "nvidia-runtime.calls"
    before = calls.read_text() if calls.exists() else ""
    cp.api("POST", "/api/v1/namespaces/gpu-work/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu-user"},
        "spec": {"runtimeClassName": "nvidia", "hostNetwork": True, "terminationGracePeriodSeconds": 5,
                 "containers": [{"name": "work", "image": PAUSE_IMAGE, "imagePullPolicy": "Never",
                                 "command": ["/bin/busybox", "sleep", "3600"]}]}})
    end = time.monotonic() + 60
    p = {}
    while time.monotonic() < end:
        p = cp.api("GET", "/api/v1/namespaces/gpu-work/pods/gpu-user")
        if (p.get("status") or {}).get("phase") == "Running":
            break
        time.sleep(0.3)
    assert p["status"]["phase"] == "Running", p["status"]
    ran = calls.read_text()[len(before):]
    assert "create" in ran and "start" in ran, ran
    cp.api("DELETE", "/api/v1/namespaces/gpu-work/pods/gpu-user",
           {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0})


def test_pod_restart_takes_the_fast_path_with_a_service_named_driverd_in_the_namespace(on_node):
    node, host, pod, config = on_node
    cp = node.cp
    # Services whose names make the service-link variables DRIVERD_SERVICE_HOST, DRIVERD_PORT, ...
    # (in the environment driverd reads its configuration from, were service links on)
    for name in ("driverd", "driverd-metrics"):
        cp.ensure(f"/api/v1/namespaces/{NS}/services", {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"app.kubernetes.io/name": "driverd"},
                     "ports": [{"name": "metrics", "port": 9477, "targetPort": 9477}]}})
    runs = _journal_runs(host)
    version = (host / "proc/driver/nvidia/version").read_text()
    # OnDelete: deleting the pod is how a driver container restarts; the DaemonSet controller makes a
    # new one, the kubelet runs it (the old one terminated gracefully first)
    cp.api("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}")
    new, took = wait_pod_ready(node, not_uid=pod["metadata"]["uid"])
    print(f"\nrestarted pod Ready {took:.1f}s after the delete")
    log = node.container_log(NS, new["metadata"]["name"], "driverd")
    assert "fast path:" in log and "no fast path" not in log, log[-3000:]
    assert _journal_runs(host) == runs and (host / "proc/driver/nvidia/version").read_text() == version
    try:
        gone = cp.api("GET", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}")
        raise AssertionError(f"the old pod is still there: {gone['status']}")
    except urllib.error.HTTPError as e:
        assert e.code == 404


def _same_pod_log_until(node, pod: dict, text: str, timeout: float) -> str:
    end = time.monotonic() + timeout
    log = ""
    while time.monotonic() < end:
        log = node.container_log(NS, pod["metadata"]["name"], "driverd")
        if text in log:
            return log
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in the pod's log after {timeout}s: {log[-3000:]}")


def test_configmap_edit_is_reloaded_in_the_running_pod_and_a_template_change_replaces_nothing(on_node):
    node, host, _, config = on_node
    cp = node.cp
    (pod,) = [p for p in _pods(cp) if not p["metadata"].get("deletionTimestamp")]
    uid = pod["metadata"]["uid"]
    path = f"/api/v1/namespaces/{NS}/configmaps/driverd-config"
    # a broken edit: the kubelet swaps the mounted file, driverd keeps the configuration it runs and
    # stays Ready (its readiness is the host's, not the file's)
    cp.api("PATCH", path, {"data": {"config.toml": config + "[daemon\n"}}, content_type="application/merge-patch+json")
    t0 = time.monotonic()
    _same_pod_log_until(node, pod, "cannot be used", 120)
    broken = time.monotonic() - t0
    assert _ready(cp.api("GET", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}"))
    # the edit put right: re-read and reconciled, in the same pod (no restart)
    cp.api("PATCH", path, {"data": {"config.toml": config.replace("[daemon]\n", "[daemon]\ninterval_s = 600\n")}},
           content_type="application/merge-patch+json")
    t0 = time.monotonic()
    _same_pod_log_until(node, pod, "configuration re-read; reconciling", 120)
    print(f"\nConfigMap edits seen by the pod: broken after {broken:.1f}s, fixed after {time.monotonic() - t0:.1f}s")
    now = cp.api("GET", f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}")
    assert now["metadata"]["uid"] == uid and now["status"]["containerStatuses"][0]["restartCount"] == 0
    # OnDelete: a changed pod template is the DaemonSet's next generation, not a new pod on this node
    ds_path = f"/apis/apps/v1/namespaces/{NS}/daemonsets/driverd"
    gen = cp.api("PATCH", ds_path, {"spec": {"template": {"metadata": {"annotations": {"test/edited": "1"}}}}},
                 content_type="application/merge-patch+json")["metadata"]["generation"]
    end = time.monotonic() + 30
    ds = cp.api("GET", ds_path)
    while ds["status"].get("observedGeneration", 0) < gen and time.monotonic() < end:
        time.sleep(0.3)
        ds = cp.api("GET", ds_path)
    assert ds["status"]["observedGeneration"] >= gen, ds["status"]
    assert ds["status"].get("updatedNumberScheduled", 0) == 0, ds["status"]
    time.sleep(2)
    assert [p["metadata"]["uid"] for p in _pods(cp)] == [uid]


def test_a_rollout_on_the_real_node_evicts_real_pods_and_gives_the_node_back(on_node):
    """Issue 35's rollout with real pods: a GPU user (a ReplicaSet's pod with RuntimeClass nvidia) evicted
    and stopped by the kubelet within its grace period, the device-plugin-like DaemonSet pod leaving with
    the driver-ready label and coming back, the node uncordoned; the node's states followed from the
    kubelet's pod phases, not played ones."""
    from driverd.cluster import model as m
    from driverd.sim.fleet import NEW
    from tests.realnode import PAUSE_IMAGE
    node, host, _, _ = on_node
    cp = node.cp
    script = 'trap "echo got TERM; exit 0" TERM; echo started; while true; do sleep 0.1; done'
    gpu_spec = {"runtimeClassName": "nvidia", "hostNetwork": True, "terminationGracePeriodSeconds": 20,
                "containers": [{"name": "work", "image": PAUSE_IMAGE, "imagePullPolicy": "Never",
                                "command": ["/bin/busybox", "sh", "-c", script]}]}
    for ns in ("gpu-jobs", "gpu-operator"):
        cp.ensure("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    cp.api("POST", "/apis/apps/v1/namespaces/gpu-jobs/replicasets", {
        "apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "trainer"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "trainer"}},
                 "template": {"metadata": {"labels": {"app": "trainer"}}, "spec": gpu_spec}}})
    cp.api("POST", "/apis/apps/v1/namespaces/gpu-operator/daemonsets", {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "device-plugin"},
        "spec": {"selector": {"matchLabels": {"app": "device-plugin"}},
                 "template": {"metadata": {"labels": {"app": "device-plugin"}},
                              "spec": {**gpu_spec, "nodeSelector": {m.L_READY: "true"},
                                       "tolerations": [{"operator": "Exists"}]}}}})

    def running(ns: str, sel: str) -> list[dict]:
        return [p for p in cp.api("GET", f"/api/v1/namespaces/{ns}/pods?labelSelector={sel}")["items"]
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    end = time.monotonic() + 90
    while not (running("gpu-jobs", "app%3Dtrainer") and running("gpu-operator", "app%3Ddevice-plugin")):
        assert time.monotonic() < end, "the GPU pods did not run"
        time.sleep(0.3)
    (trainer,) = running("gpu-jobs", "app%3Dtrainer")
    (plugin,) = running("gpu-operator", "app%3Ddevice-plugin")

    cp.api("POST", "/apis/driverd.io/v1alpha1/driverrollouts", {
        "apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": "to-550"},
        "spec": {"driver": NEW}})
    t0 = time.monotonic()
    states: list[str] = []
    seen: list[tuple[str, bool, bool, bool, str]] = []      # (state, label, plugin pod, trainer pod, phase)
    trainer_log = ""
    phase = ""
    while time.monotonic() - t0 < 300:
        n = cp.api("GET", f"/api/v1/nodes/{node.name}")
        v = m.NodeView.from_node(n)
        if not states or states[-1] != v.state:
            states.append(v.state)
        ro = cp.api("GET", "/apis/driverd.io/v1alpha1/driverrollouts/to-550")
        phase = (ro.get("status") or {}).get("phase", "")
        old_there = any(p["metadata"]["uid"] == trainer["metadata"]["uid"]
                        for p in cp.api("GET", "/api/v1/namespaces/gpu-jobs/pods")["items"])
        seen.append((v.state, v.labels.get(m.L_READY) == "true", bool(running("gpu-operator", "app%3Ddevice-plugin")),
                     old_there, phase))
        trainer_log = node.container_log("gpu-jobs", trainer["metadata"]["name"], "work") or trainer_log
        if phase in ("Completed", "Failed") and v.state in (m.DONE, m.FAILED):
            break
        time.sleep(0.3)
    print(f"\nrollout on the real node: {phase} in {time.monotonic() - t0:.1f}s; states {states}")
    daemon_log = node.container_log(NS, _pods(cp)[0]["metadata"]["name"], "driverd")
    assert phase == "Completed", (states, seen[-3:], daemon_log[-3000:])
    assert NEW in (host / "proc/driver/nvidia/version").read_text()
    # the GPU user was evicted and its container stopped by the kubelet on SIGTERM (its trap ran)
    assert "got TERM" in trainer_log, trainer_log
    # the plugin pod left while the node had no driver-ready label, and came back with it
    assert any(not label and not plugin_up for _, label, plugin_up, _, _ in seen), seen
    end = time.monotonic() + 60
    while not running("gpu-operator", "app%3Ddevice-plugin") or not running("gpu-jobs", "app%3Dtrainer"):
        assert time.monotonic() < end, "the GPU pods did not come back"
        time.sleep(0.3)
    assert running("gpu-operator", "app%3Ddevice-plugin")[0]["metadata"]["uid"] != plugin["metadata"]["uid"]
    n = cp.api("GET", f"/api/v1/nodes/{node.name}")
    assert not n["spec"].get("unschedulable") and n["metadata"]["labels"].get(m.L_READY) == "true"
    assert m.DONE in states and len(states) >= 3, states
    # the coordinator's Lease, held in its own name (no GPU node's: issue 44), in driverd's namespace
    leases = cp.api("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases")["items"]
    assert [le["spec"].get("holderIdentity") for le in leases] == [COORDINATOR], leases


def test_a_rollouts_workload_pod_runs_on_the_node_through_the_nvidia_runtime_before_it_is_done(on_node):
    """Issue 42's optional check on the real kubelet: spec.validation.workloadPod. Once the node's GPUs are
    schedulable again (the stand-in device plugin publishes 2 nvidia.com/gpu), the driver pod's daemon creates
    the pod with the node's own token: bound to the node, runtime class nvidia, one nvidia.com/gpu (the
    kubelet asks the plugin to allocate it), not on the host's network. A command exiting 0: the node is
    `done`; one exiting 3: it fails WorkloadPodFailed naming the exit code and the log's last line, given back
    uncordoned. The kubelet ran both through the handler driverd configured; the pod is gone either way."""
    from driverd.cluster import model as m
    from driverd.cluster import workloadpod as wlp
    from driverd.sim.fleet import NEW
    from tests.node import deviceplugin as dp
    node, host, _, _ = on_node
    cp = node.cp
    dp.image(node)
    cp.ensure("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": dp.NS}})
    dss = f"/apis/apps/v1/namespaces/{dp.NS}/daemonsets"
    ds = dp.daemonset("plugin-wl", host, args=["-devices", "2"], node_selector={m.L_READY: "true"})
    ds["spec"]["template"]["spec"]["runtimeClassName"] = "nvidia"       # a GPU user: it leaves with the driver
    wait_gpus(node, 0, 60)              # no earlier plugin's count taken for this one's
    cp.api("POST", dss, ds)
    calls = node.dir / "nvidia-runtime.calls"

    def validation_pods() -> list[dict]:
        return cp.api("GET", f"/api/v1/namespaces/{NS}/pods?labelSelector={wlp.LABEL}")["items"]

    def rollout(name: str, command: str) -> tuple[m.NodeView, list[dict], float]:
        driver = "535.261.03" if NEW in (host / "proc/driver/nvidia/version").read_text() else NEW
        cp.api("POST", "/apis/driverd.io/v1alpha1/driverrollouts", {
            "apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": name},
            "spec": {"driver": driver, "validation": {"timeoutSeconds": 120, "workloadPod": {
                "image": IMAGE, "command": ["sh", "-c", command], "timeoutSeconds": 60}}}})
        t0 = time.monotonic()
        seen: dict[str, dict] = {}
        while True:
            for p in validation_pods():
                seen[p["metadata"]["uid"]] = p
            v = m.NodeView.from_node(cp.api("GET", f"/api/v1/nodes/{node.name}"))
            if v.in_rollout_name(name) and v.state in (m.DONE, m.FAILED):
                return v, list(seen.values()), time.monotonic() - t0
            assert time.monotonic() - t0 < 300, (v, node.container_log(NS, _pods(cp)[0]["metadata"]["name"], "driverd"))
            time.sleep(0.3)

    wait_gpus(node, 2)
    try:
        before = calls.read_text() if calls.exists() else ""
        v, seen, took = rollout("workload-ok", "echo vectorAdd passed; exit 0")
        print(f"\nrollout with a workload pod exiting 0: {v.state} after {took:.1f}s: {v.message}")
        assert v.state == m.DONE, v
        assert len(seen) == 1, seen
        (pod,) = seen
        ref = f"{NS}/{pod['metadata']['name']}"
        assert f"validation workload pod {ref} succeeded" in v.message and not v.unschedulable, v
        spec = pod["spec"]
        assert (spec["nodeName"], spec["runtimeClassName"]) == (node.name, "nvidia") and not spec.get("hostNetwork")
        assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
        # the kubelet ran it: the handler's binary created its sandbox and container
        assert calls.read_text()[len(before):].count("create") >= 2, calls.read_text()[len(before):]

        v, seen, took = rollout("workload-exits-3", "echo cudaErrorNoDevice >&2; exit 3")
        print(f"rollout with a workload pod exiting 3: {v.state} after {took:.1f}s: {v.message}")
        assert v.state == m.FAILED and v.reason == "WorkloadPodFailed", v
        (pod,) = seen
        assert f"validation workload pod {NS}/{pod['metadata']['name']}" in v.message, v.message
        assert "exited with code 3" in v.message and "cudaErrorNoDevice" in v.message, v.message
        assert not v.unschedulable                    # given back, uncordoned, with the reason on the Node
        # nothing is left behind: the kubelet confirmed the deletions
        end = time.monotonic() + 60
        while validation_pods():
            assert time.monotonic() < end, validation_pods()
            time.sleep(0.3)
    finally:
        # the failed rollout is paused (its failure budget spent) and keeps its node from later rollouts: deleted,
        # as an operator would (its finalizer goes once the coordinator has seen it)
        for name in ("workload-ok", "workload-exits-3"):
            try:
                cp.api("DELETE", f"/apis/driverd.io/v1alpha1/driverrollouts/{name}")
            except urllib.error.HTTPError as e:
                assert e.code == 404, e
        end = time.monotonic() + 60
        while any(r["metadata"]["name"].startswith("workload-")
                  for r in cp.api("GET", "/apis/driverd.io/v1alpha1/driverrollouts")["items"]):
            assert time.monotonic() < end, "the rollouts were not deleted"
            time.sleep(0.3)
        remove_plugin(node, "plugin-wl")


def test_a_node_is_done_only_once_the_kubelet_publishes_its_gpus_again(on_node):
    """Issue 42 on the real kubelet: a stand-in device plugin (tests/node/deviceplugin: the kubelet's
    device-plugin API) publishes nvidia.com/gpu; the kubelet, not the test, sets the Node's allocatable.
    A plugin whose DaemonSet selects driverd.io/driver-ready leaves with the driver and comes back: the
    node ends `done` with its 2 GPUs allocatable. A plugin whose replacement never registers (it hangs
    before registering, as one crash-looping on the new driver would): the kubelet drops the count to 0 and
    the node fails GPUsNotSchedulable, named, given back uncordoned."""
    from driverd.cluster import model as m
    from driverd.sim.fleet import NEW
    from tests.node import deviceplugin as dp
    node, host, _, _ = on_node
    cp = node.cp
    dp.image(node)
    cp.ensure("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": dp.NS}})
    dss = f"/apis/apps/v1/namespaces/{dp.NS}/daemonsets"
    low: list[int] = []

    def rollout(name: str, timeout_s: int) -> m.NodeView:
        driver = "535.261.03" if NEW in (host / "proc/driver/nvidia/version").read_text() else NEW
        cp.api("POST", "/apis/driverd.io/v1alpha1/driverrollouts", {
            "apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout", "metadata": {"name": name},
            "spec": {"driver": driver, "validation": {"timeoutSeconds": timeout_s}}})
        end = time.monotonic() + 300
        while True:
            v = m.NodeView.from_node(cp.api("GET", f"/api/v1/nodes/{node.name}"))
            low.append(gpus_allocatable(node))
            if v.in_rollout_name(name) and v.state in (m.DONE, m.FAILED):
                return v
            assert time.monotonic() < end, (v, node.container_log(NS, _pods(cp)[0]["metadata"]["name"], "driverd"))
            time.sleep(0.3)

    ds = dp.daemonset("plugin-back", host, args=["-devices", "2"], node_selector={m.L_READY: "true"})
    pod_spec = ds["spec"]["template"]["spec"]
    # As NVIDIA's plugin is (it holds the GPUs' device files), a GPU user: here through the NVIDIA RuntimeClass,
    # so the drain waits until its DaemonSet has taken it off the node (it leaves with the driver-ready label)
    # and the kubelet's count drops. Its replacement starts registering 15 s after the label is back (an init
    # container), longer than the kubelet's 10 s status loop: the node's count is 0 in between, and the node
    # may be `done` only once the new plugin has registered its GPUs (timing alone decided this before).
    pod_spec["runtimeClassName"] = "nvidia"
    pod_spec["initContainers"] = [{"name": "wait", "image": IMAGE, "imagePullPolicy": "Never",
                                   "command": ["sh", "-c", "sleep 15"]}]
    # the count of the plugin an earlier test removed is published up to 10 s late: read as this plugin's,
    # it let the rollout start before this plugin had registered (one full run: `done` 3 s after the
    # rollout's creation, and the count 0 after it)
    wait_gpus(node, 0, 60)
    cp.api("POST", dss, ds)
    wait_gpus(node, 2)
    v = rollout("gpus-come-back", 120)
    assert v.state == m.DONE, v
    assert 0 in low, "the plugin never left: nothing was proven"        # the kubelet's count dropped, then came back
    assert gpus_allocatable(node) == 2 and not v.unschedulable, (   # on failure: what driverd and the kubelet did
        gpus_allocatable(node), v, low[-20:],
        node.container_log(NS, _pods(cp)[0]["metadata"]["name"], "driverd")[-6000:], node.log_tail("kubelet", 6000))
    cp.api("DELETE", f"{dss}/plugin-back")
    wait_gpus(node, 0)

    # the plugin leaves with the driver as before, but its replacement never gets to register
    ds = dp.daemonset("plugin-gone", host, args=["-devices", "2"], node_selector={m.L_READY: "true"})
    pod_spec = ds["spec"]["template"]["spec"]
    pod_spec["runtimeClassName"] = "nvidia"
    target = "535.261.03" if NEW in (host / "proc/driver/nvidia/version").read_text() else NEW
    pod_spec["terminationGracePeriodSeconds"] = 1      # its sleeping init container goes at once when deleted
    pod_spec["initContainers"] = [{"name": "wait", "image": IMAGE, "imagePullPolicy": "Never",
                                   "volumeMounts": [{"name": "proc", "mountPath": "/host-proc", "readOnly": True}],
                                   "command": ["sh", "-c", f"if grep -q {target} /host-proc/driver/nvidia/version; "
                                               "then sleep 3600; fi"]}]
    cp.api("POST", dss, ds)
    wait_gpus(node, 2)
    v = rollout("gpus-stay-away", 20)
    assert v.state == m.FAILED and v.reason == "GPUsNotSchedulable", v
    assert "nvidia.com/gpu allocatable 0, was 2 before the upgrade" in v.message, v.message
    assert not v.unschedulable                         # given back, uncordoned, with the reason on the Node
    remove_plugin(node, "plugin-gone")



# What docs/reboots.md tells kured users to set (kept in one place for the test): the sentinel command of the
# driver container, and the example blocking pod selector.
KURED_BLOCKING = "gpu-job=training"
KURED_SENTINEL = ("/bin/sh -c 'exec nsenter --target \"$(pgrep -o -f \"driverd [c]ontainer-entrypoint --root /host\")\" "
                  "--mount -- /usr/local/bin/driverd reboot-ready --root /host --if-required --quiet'")


def test_kureds_sentinel_loop_reboots_only_once_the_pods_daemon_has_prepared_the_new_kernel(on_node, tmp_path):
    """Issue 43: kured's loop played on the real node, its reboot replaced by a marker file. kured splits
    --reboot-sentinel-command like a shell and runs it in PID 1's mount namespace (nsenter -m/proc/1/ns/mnt --,
    pkg/checkers: exit 0 = reboot); this test already runs in that namespace (PID 1's namespace file cannot
    be opened from this machine's sandbox), so it runs the split command as is. A newer kernel without its
    package: every check exits 1 (kured: "not required"), no marker. Its package appears in the repository:
    the driver pod's daemon prepares it, the check exits 0 — but a GPU job matching the blocking pod selector
    docs/reboots.md suggests (gpu-job=training) still runs on the node, and kured holds the reboot while it
    does (cmd/kured: rebootBlocked after rebootRequired; pods not Succeeded, Failed or Unknown count). The
    job ends: the marker is written."""
    import shlex
    import threading

    from driverd.root import Root
    from driverd.sim.fakepkg import make_fake_package
    from driverd.sim.fleet import NEW
    from driverd.sim.hosttree import install_kernel
    from tests.conftest import run_cli
    node, host, pod, _ = on_node
    docs = (Path(__file__).resolve().parents[2] / "docs/reboots.md").read_text()
    assert f"--blocking-pod-selector={KURED_BLOCKING}" in docs        # what the docs tell, played here
    nxt = "6.1.0-50-cloud-amd64"
    install_kernel(host, nxt)
    sentinel = Root(str(host)).real("/var/run/reboot-required")
    sentinel.parent.mkdir(parents=True, exist_ok=True)
    sentinel.write_text("*** System restart required ***\n")
    marker = tmp_path / "rebooted"
    rcs: list[int] = []
    errs: list[str] = []
    stop = threading.Event()

    blocked: list[int] = []
    cp = node.cp

    def blocking_pods() -> int:
        """kured's PodBlockingChecker: the node's pods matching --blocking-pod-selector, still running."""
        pods = cp.api("GET", f"/api/v1/pods?labelSelector={KURED_BLOCKING}&fieldSelector=spec.nodeName%3D"
                             f"{node.name}")["items"]
        return sum((p.get("status") or {}).get("phase") not in ("Succeeded", "Failed", "Unknown") for p in pods)

    def kured() -> None:
        argv = shlex.split(KURED_SENTINEL)
        while not stop.is_set():
            r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            rcs.append(r.returncode)
            errs.append(r.stderr[-500:])
            if r.returncode == 0:
                n = blocking_pods()
                if n:
                    blocked.append(n)               # "Reboot blocked: n blocking pods": checked again next period
                else:
                    marker.write_text("reboot\n")      # kured's rebooter, played
                    return
            stop.wait(1.0)
    t = threading.Thread(target=kured, daemon=True)
    try:
        t.start()
        end = time.monotonic() + 30
        while len(rcs) < 8 and time.monotonic() < end:
            time.sleep(0.5)
        assert len(rcs) >= 8 and set(rcs) == {1} and not marker.exists(), (rcs, errs[-2:])
        # what the closed gate says, through the same way in
        why = subprocess.run(shlex.split(KURED_SENTINEL.replace(" --quiet", " --json")), capture_output=True,
                             text=True, timeout=120)
        doc = json.loads(why.stdout)
        assert why.returncode == 1 and doc["kernels"][0]["release"] == nxt and not doc["ready"], why.stdout
        assert doc["reboot_required"] is True
        # a training job the operator's blocking pod selector names runs on the node
        key, _, val = KURED_BLOCKING.partition("=")
        cp.api("POST", "/api/v1/namespaces/default/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train", "labels": {key: val}},
            "spec": {"nodeName": node.name, "restartPolicy": "Never", "terminationGracePeriodSeconds": 0,
                     "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "train", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sleep", "3600"]}]}})
        end = time.monotonic() + 90
        while blocking_pods() == 0:
            assert time.monotonic() < end, node.log_tail("kubelet")
            time.sleep(0.5)
        # its package appears (for whichever driver the node runs: the rollout test may have moved it to NEW)
        repo = host / "srv/driverd-repo"
        for v in (DRIVER, NEW):
            make_fake_package(repo, v, nxt)
        run_cli("repo", "index", str(repo), check=True)
        end = time.monotonic() + 600
        while len(blocked) < 3 and time.monotonic() < end:
            time.sleep(1)
        assert len(blocked) >= 3 and not marker.exists(), (rcs[-5:], blocked,
                                                           node.container_log(NS, pod["metadata"]["name"], "driverd")[-3000:])
        assert (host / f"lib/modules/{nxt}/updates/driverd/manifest.json").is_file()   # the gate is open
        cp.api("DELETE", "/api/v1/namespaces/default/pods/train?gracePeriodSeconds=0")  # the job ends
        end = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < end:
            time.sleep(1)
        assert marker.exists(), (rcs[-5:], blocked)
        first_open = rcs.index(0)
        assert set(rcs[:first_open]) == {1} and set(rcs[first_open:]) == {0}, rcs
    finally:
        stop.set()
        t.join(10)
        sentinel.unlink(missing_ok=True)
