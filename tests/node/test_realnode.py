"""The real node itself (tests/realnode.py): the kubelet registers with the version
.ci/build-control-plane stamps, kube-scheduler binds a pod to it, the kubelet runs the pod through the
private containerd and reports it, and a deletion is graceful (the container gets SIGTERM and its grace
period). What the node leaves on the machine is checked when it stops (RealNode.stop)."""
from __future__ import annotations

import time
import urllib.error

import pytest

from tests.realnode import NODE_IP, PAUSE_IMAGE

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(600)]


def test_the_node_registers_and_runs_a_pod_that_stops_gracefully(real_node):
    cp = real_node.cp
    node = cp.api("GET", f"/api/v1/nodes/{real_node.name}")
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.34.4" and info["containerRuntimeVersion"].startswith("containerd://1.6")
    assert {"type": "InternalIP", "address": NODE_IP} in node["status"]["addresses"]
    cp.ensure("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "node-smoke"}})
    script = 'trap "echo got TERM; exit 0" TERM; echo started; while true; do sleep 0.1; done'
    cp.api("POST", "/api/v1/namespaces/node-smoke/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sleeper"},
        "spec": {"hostNetwork": True, "terminationGracePeriodSeconds": 20,
                 "containers": [{"name": "c", "image": PAUSE_IMAGE, "imagePullPolicy": "Never",
                                 "command": ["/bin/busybox", "sh", "-c", script]}]}})
    t0 = time.monotonic()
    while time.monotonic() - t0 < 60:
        p = cp.api("GET", "/api/v1/namespaces/node-smoke/pods/sleeper")
        if p["status"].get("phase") == "Running" and "started" in real_node.container_log("node-smoke", "sleeper", "c"):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"pod not Running: {p['status']}\n{real_node.log_tail('kubelet')}")
    assert p["spec"]["nodeName"] == real_node.name        # bound by kube-scheduler
    assert p["status"]["podIP"] == NODE_IP
    cp.api("DELETE", "/api/v1/namespaces/node-smoke/pods/sleeper")
    t1 = time.monotonic()
    log = ""
    while time.monotonic() - t1 < 30:
        log = real_node.container_log("node-smoke", "sleeper", "c") or log
        try:
            cp.api("GET", "/api/v1/namespaces/node-smoke/pods/sleeper")
        except urllib.error.HTTPError as e:
            assert e.code == 404
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the pod was not removed within 30 s")
    # the TERM trap ran: a graceful stop, not the SIGKILL at the end of the grace period
    assert "got TERM" in log and time.monotonic() - t1 < 15, log
