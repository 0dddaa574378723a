"""A pod that starts between the preflight's pod list and its read of the host's GPU users (a
DaemonSet pod coming back) is not mistaken for a process outside any pod: the refused answer is
judged once more against a fresh list."""
from __future__ import annotations

from types import SimpleNamespace

from driverd.cluster import model as m
from driverd.cluster.agent import NodeAgent
from driverd.cluster.drain import DrainPlan
from driverd.cluster.gpuusers import PodUse

ROLLOUT = {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
           "metadata": {"name": "r", "uid": "u1", "generation": 1, "creationTimestamp": "2026-01-01T00:00:00Z"},
           "spec": {"driver": "550.127.05"}}


def _agent(plans: list[DrainPlan], preflight):
    """An agent whose host answers the preflight with `preflight` (the host's side: not under test)."""
    node = {"metadata": {"name": "n1", "annotations": {}, "labels": {}}, "status": {}}
    a = NodeAgent.__new__(NodeAgent)
    a.node, a.cfg, a.events, a.log = "n1", None, False, lambda msg: None
    a.host = SimpleNamespace(preflight=preflight)
    a.rollouts = SimpleNamespace(snapshot=lambda: [ROLLOUT])
    a.pools = SimpleNamespace(snapshot=lambda: [])          # no DriverPools
    a.nodes = SimpleNamespace(get=lambda name: node, put=lambda obj: None)
    a.patches = []
    a.kube = SimpleNamespace(patch=lambda path, body: a.patches.append(body) or node)
    a._drain_plan = lambda r: plans.pop(0) if len(plans) > 1 else plans[0]
    return a, node


def test_a_refused_preflight_is_judged_again_with_the_pods_listed_after_the_host_was_read():
    late = PodUse(namespace="gpu-operator", name="nvidia-device-plugin-n1", uid="plugin-uid", why="holds /dev/nvidiactl",
                  daemonset=True, mirror=False)
    calls = []

    def fake_preflight(cfg, key, driver, flavor, *, leaving=frozenset(), staying=None):
        calls.append(set(leaving))
        ok = "plugin-uid" in leaving      # the host shows the plugin's process holding /dev/nvidiactl
        return {"rollout": key, "ok": ok, "reasons": [] if ok else ["the GPU is in use by pid 7 (no pod)"]}
    a, node = _agent([DrainPlan(), DrainPlan(with_label=[late])], fake_preflight)
    a._preflight(m.NodeView.from_node(node))
    assert calls == [set(), {"plugin-uid"}]
    ann = a.patches[-1]["metadata"]["annotations"][m.A_PREFLIGHT]
    assert '"ok": true' in ann


def test_a_preflight_refused_for_a_real_reason_is_asked_once():
    calls = []

    def fake_preflight(cfg, key, driver, flavor, *, leaving=frozenset(), staying=None):
        calls.append(1)
        return {"rollout": key, "ok": False, "reasons": ["no package for the kernel"]}
    a, node = _agent([DrainPlan()], fake_preflight)
    a._preflight(m.NodeView.from_node(node))
    assert len(calls) == 1 and '"ok": false' in a.patches[-1]["metadata"]["annotations"][m.A_PREFLIGHT]
