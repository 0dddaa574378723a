"""Issue 42, the optional check: a rollout's validation workload pod (spec.validation.workloadPod). Once a node's
GPUs are schedulable again its daemon runs the pod on the node (runtimeClassName nvidia, one nvidia.com/gpu when
the node publishes it), and the node is `done` only when the pod Succeeded; Failed or a timeout fails the node
WorkloadPodFailed, through the ending every failure takes (uncordoned, the failure budget spent); the pod is
deleted either way.

The spec and the pod's words as pure functions; then the agent on the real control plane with simulated
kubelets (tests/cluster/test_rollout.py's fleet): the played kubelet reports the pod Running, and the test
ends it as a kubelet would (its status subresource). The real kubelet runs it in tests/node/test_daemonset.py;
what a node's token may create is tests/cluster/test_compromised_node.py."""
from __future__ import annotations

import threading
import time

import pytest

from driverd.cluster import model as m
from driverd.cluster import workloadpod as wlp
from driverd.cluster.kube import node_path, now_rfc3339, pods_path, rollout_path
from driverd.sim.fleet import NEW
from tests.cluster.test_rollout import _set_gpus, _set_slice, cluster, kube, started, views, wait_phase  # noqa: F401

NS = "driverd"


def _rollout(**validation) -> dict:
    return {"metadata": {"name": "r", "generation": 1}, "spec": {"driver": NEW, "validation": validation}}


# -- the spec ---------------------------------------------------------------------------------------------------

def test_the_workload_pod_field_is_read_and_bad_values_name_the_field():
    r = m.Rollout.from_object(_rollout(timeoutSeconds=60,
                                       workloadPod={"image": "cuda:12", "command": ["sh", "-c", "x"]}))
    assert r.workload_pod == m.WorkloadPod("cuda:12", ("sh", "-c", "x"), None)
    assert r.workload_timeout_s == 60                  # the validation timeout when the pod names none
    r = m.Rollout.from_object(_rollout(workloadPod={"image": "cuda:12", "timeoutSeconds": 30}))
    assert r.workload_timeout_s == 30 and r.workload_pod.command == ()
    assert m.Rollout.from_object(_rollout()).workload_pod is None
    for bad, field in (({}, "workloadPod.image"), ({"image": ""}, "workloadPod.image"),
                       ({"image": "a b"}, "workloadPod.image"),
                       ({"image": "x", "command": "ls"}, "workloadPod.command"),
                       ({"image": "x", "command": [1]}, "workloadPod.command"),
                       ({"image": "x", "timeoutSeconds": 0}, "workloadPod.timeoutSeconds"),
                       ({"image": "x", "timeoutSeconds": "5"}, "workloadPod.timeoutSeconds"),
                       (["x"], "workloadPod")):
        with pytest.raises(m.SpecError) as e:
            m.Rollout.from_object(_rollout(workloadPod=bad))
        assert e.value.field == f"validation.{field}", (bad, e.value)


def test_the_pod_is_bound_to_the_node_through_the_nvidia_runtime_class_and_asks_a_gpu_only_where_published():
    wp = m.WorkloadPod("cuda:12", ("/vectorAdd",))
    name = wlp.pod_name("gpu-0000", "r/uid/1", 1, "2026-01-01T00:00:00Z")
    assert name != wlp.pod_name("gpu-0000", "r/uid/1", 2, "2026-01-01T00:00:00Z")     # a retry's pod is another
    assert name == wlp.pod_name("gpu-0000", "r/uid/1", 1, "2026-01-01T00:00:00Z")     # a restarted daemon's is its own
    pod = wlp.manifest(name, NS, "gpu-0000", "r", wp, gpu=True)
    spec, (c,) = pod["spec"], pod["spec"]["containers"]
    assert pod["metadata"]["labels"][wlp.LABEL] == "r" and pod["metadata"]["labels"][wlp.L_NODE] == "gpu-0000"
    assert (spec["nodeName"], spec["runtimeClassName"], spec["restartPolicy"]) == ("gpu-0000", "nvidia", "Never")
    assert {"key": "node.kubernetes.io/unschedulable", "operator": "Exists",
            "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["automountServiceAccountToken"] is False and "volumes" not in spec and "hostNetwork" not in spec
    assert c["resources"] == {"limits": {"nvidia.com/gpu": "1"}} and c["command"] == ["/vectorAdd"]
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # a DRA-only node publishes no nvidia.com/gpu: no limit (the runtime class alone)
    assert "resources" not in wlp.manifest(name, NS, "gpu-0000", "r", wp, gpu=False)["spec"]["containers"][0]
    assert wlp.publishes_gpus({"status": {"allocatable": {"nvidia.com/gpu": "2"}}})
    assert not wlp.publishes_gpus({"status": {"allocatable": {"nvidia.com/gpu": "0", "cpu": "4"}}})
    # names longer than a label value takes (rollouts and nodes may have 253 characters)
    long = "n" * 70 + ".example.com"
    v = wlp.label_value(long)
    assert len(v) <= 63 and v != wlp.label_value(long[:-1]) and wlp.label_value("r") == "r"
    assert len(wlp.pod_name(long, "r/u/1", 1, "t")) <= 63


def test_a_failed_pod_is_named_by_its_exit_code_and_the_bounded_tail_of_its_log():
    log = "\n".join(f"line {i}" for i in range(100)) + "\nCUDA error: no device\n"
    pod = {"status": {"phase": "Failed", "containerStatuses": [{"name": wlp.CONTAINER, "state": {"terminated": {
        "exitCode": 3, "reason": "Error", "message": log}}}]}}
    words = wlp.failure(pod)
    assert words.startswith("its container exited with code 3 (Error); last lines of its log: ")
    assert "CUDA error: no device" in words and "line 95" not in words and len(words) < 500
    # refused by the kubelet before it ran (the RuntimeClass's node selector, a GPU it cannot give)
    pod = {"status": {"phase": "Failed", "reason": "OutOfnvidia.com/gpu",
                      "message": "Node didn't have enough resource"}}
    assert wlp.failure(pod) == "the pod failed: OutOfnvidia.com/gpu: Node didn't have enough resource"
    pod = {"status": {"phase": "Pending", "containerStatuses": [{"name": wlp.CONTAINER, "state": {"waiting": {
        "reason": "ErrImagePull", "message": "pull access denied"}}}]}}
    assert wlp.pending(pod) == "phase Pending, container waiting: ErrImagePull: pull access denied"
    assert (wlp.finished(pod), wlp.finished({"status": {"phase": "Succeeded"}})) == (None, True)


# -- the agent, on the real control plane with simulated kubelets --------------------------------------------------

def _validation_pods(f) -> list[dict]:
    return kube(f).list(pods_path(NS), labels=wlp.LABEL).get("items") or []


def _end(f, pod: dict, exit_code: int) -> None:
    """What the kubelet reports when the pod's container ends."""
    now = now_rfc3339()
    f.admin.patch(pods_path(NS, pod["metadata"]["name"]) + "/status", {"status": {
        "phase": "Succeeded" if exit_code == 0 else "Failed",
        "containerStatuses": [{"name": wlp.CONTAINER, "image": pod["spec"]["containers"][0]["image"], "imageID": "",
                               "ready": False, "restartCount": 0,
                               "state": {"terminated": {
                                   "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                   "startedAt": now, "finishedAt": now,
                                   "message": "" if exit_code == 0 else "cudaErrorNoDevice\n"}}}]}},
        kind="strategic")


@pytest.mark.parametrize("case", ["succeeds", "exits-3", "times-out", "dra-only"])
def test_a_node_is_done_only_once_its_workload_pod_succeeded(cluster, case):
    _, make = cluster
    f = make(1)
    node = "gpu-0000"
    if case == "dra-only":
        _set_gpus(f, node, 0)
        _set_slice(f, node, 2, 1)
    else:
        _set_gpus(f, node, 2)
    started(f)
    seen: list[dict] = []
    stop = threading.Event()

    def kubelet() -> None:      # the pod's container runs and ends (or, timing out, never does)
        while not stop.is_set():
            for p in _validation_pods(f):
                if p["metadata"]["uid"] not in {s["metadata"]["uid"] for s in seen}:
                    seen.append(p)
                    if (p.get("status") or {}).get("phase") in (None, "Pending", "Running") and case != "times-out":
                        time.sleep(0.5)
                        _end(f, p, 3 if case == "exits-3" else 0)
            time.sleep(0.1)
    t = threading.Thread(target=kubelet, daemon=True)
    t.start()
    try:
        kube(f).create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                        "metadata": {"name": "r"}, "spec": {"driver": NEW, "validation": {
                                            "timeoutSeconds": 30, "workloadPod": {
                                                "image": "cuda-check:1", "command": ["/check"],
                                                **({"timeoutSeconds": 3} if case == "times-out" else {})}}}})
        ro = wait_phase(f, "r", ("Completed", "Failed", "Paused"), timeout=120)
    finally:
        stop.set()
        t.join(5)
    v = views(f)[node]
    assert len(seen) == 1, seen                       # one pod, on the node, as the agent made it
    pod = seen[0]
    assert pod["spec"]["nodeName"] == node and pod["spec"]["runtimeClassName"] == "nvidia"
    limits = (pod["spec"]["containers"][0].get("resources") or {}).get("limits") or {}
    assert limits == ({} if case == "dra-only" else {"nvidia.com/gpu": "1"}), limits
    # nothing is left behind, whatever the outcome (the played kubelet confirms the deletion)
    assert f.wait(lambda: not _validation_pods(f), 30), _validation_pods(f)
    ref = f"{NS}/{pod['metadata']['name']}"
    reasons = [e["reason"] for e in kube(f).list("/api/v1/namespaces/default/events")["items"]
               if e["involvedObject"]["name"] == node]
    assert "ValidatingWorkload" in reasons, reasons
    if case in ("succeeds", "dra-only"):
        assert ro["status"]["phase"] == "Completed" and v.state == m.DONE, (ro["status"], v)
        assert f"validation workload pod {ref} succeeded" in v.message, v.message
        assert not v.unschedulable
        return
    assert v.state == m.FAILED and v.reason == "WorkloadPodFailed", v
    assert ref in v.message and not v.unschedulable            # given back uncordoned, the pod named
    assert ro["status"]["phase"] != "Completed", ro["status"]      # the failure budget (0) is spent
    if case == "exits-3":
        assert "exited with code 3" in v.message and "cudaErrorNoDevice" in v.message, v.message
    else:
        assert "did not succeed within 3s" in v.message and "phase Running" in v.message, v.message
    assert "Upgraded" not in reasons and "WorkloadPodFailed" in reasons
    # the driver runs, validated on the host: the node keeps it, ready
    assert kube(f).get(node_path(node))["metadata"]["labels"].get(m.L_READY) == "true"


def test_rollout_start_builds_the_field_from_its_flags(capsys):
    """`kubectl driverd rollout start --validation-pod-image …` (a rollout, or a new pool's policy): the
    command split as a shell would; a command or timeout without an image is refused."""
    import json
    from driverd.cli import kubectl_main
    flags = ["--driver", NEW, "--validation-pod-image", "cuda-check:1", "--validation-pod-command",
             "/check --gpus 'all of them'", "--validation-pod-timeout", "90", "--dry-run", "-o", "json"]
    assert kubectl_main(["rollout", "start", *flags]) == 0
    spec = json.loads(capsys.readouterr().out)["spec"]
    want = {"workloadPod": {"image": "cuda-check:1", "command": ["/check", "--gpus", "all of them"],
                            "timeoutSeconds": 90}}
    assert spec["validation"] == want
    assert m.Rollout.from_object({"metadata": {"name": "r"}, "spec": spec}).workload_timeout_s == 90
    assert kubectl_main(["rollout", "start", "--pool", "a100", "--selector", "gpu=a100", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["validation"] == want
    assert kubectl_main(["rollout", "start", "--driver", NEW, "--validation-pod-timeout", "9", "--dry-run"]) == 2
    assert "--validation-pod-image" in capsys.readouterr().err
