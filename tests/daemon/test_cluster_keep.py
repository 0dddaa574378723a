"""`driverd daemon` in cluster mode never changes a working driver outside admission (issue 33): an
edit of the configuration's driver.version (the ConfigMap) leaves a node that has a driver on it, a
rebooted node loads back what it ran, and only a joining node — no driver, none ever converged to —
installs its desired driver directly. Real daemons against the real control plane, node-bound tokens,
deploy/'s admission policies."""
from __future__ import annotations

import os
import time

from driverd.cluster import model as m
from driverd.cluster.kube import Kube, Target, node_path
from driverd.sim.fleet import NEW, OLD, Fleet
from tests.controlplane import reset
from tests.daemon.conftest import cluster_node, passes_later



def set_version(f: Fleet, node: str, version: str) -> None:
    """The ConfigMap edited: the node's config file replaced (a new inode, as the kubelet swaps it)."""
    p = f.nodes[node].root / "etc/driverd/config.toml"
    text = p.read_text()
    old = text.split('version = "', 1)[1].split('"', 1)[0]
    tmp = p.with_suffix(".new")
    tmp.write_text(text.replace(f'version = "{old}"', f'version = "{version}"', 1))
    os.replace(tmp, p)


def loaded(f: Fleet, node: str) -> str:
    p = f.nodes[node].root / "proc/driver/nvidia/version"
    return p.read_text() if p.exists() else ""


def wait(pred, timeout: float, what) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, what() if callable(what) else what
        time.sleep(0.2)


def test_a_configmap_edit_does_not_reconverge_a_node_outside_a_rollout(tmp_path, daemons, deployed):
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    try:
        cluster_node(f, "gpu-0000", "config_check_s = 1\n")
        d = daemons(f.nodes["gpu-0000"].root)
        k = Kube(Target(kubeconfig=f.kubeconfig))
        wait(lambda: (k.get(node_path("gpu-0000"))["metadata"].get("labels") or {}).get(m.L_VERSION) == OLD, 30,
             lambda: d.log)
        mark = len(d.lines)
        set_version(f, "gpu-0000", NEW)
        d.wait_log(rf"keeps its driver {OLD}: the driver this node has \(configuration wants {NEW}", 30, start=mark)
        passes_later(d)
        assert OLD in loaded(f, "gpu-0000") and NEW not in loaded(f, "gpu-0000"), d.log
        v = m.NodeView.from_node(k.get(node_path("gpu-0000")))
        assert v.driver == OLD and v.state == m.IDLE and not v.unschedulable
        rc, _ = d.stop()
        assert rc == 0
    finally:
        f.stop()


def test_only_a_joining_node_installs_its_desired_driver_and_a_reboot_keeps_it(tmp_path, daemons, deployed):
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    try:
        f.join("gpu-0100", start=False)                   # a new machine: no driver, driverd never ran here
        assert loaded(f, "gpu-0100") == ""
        cluster_node(f, "gpu-0100", "config_check_s = 1\n")
        set_version(f, "gpu-0100", NEW)
        d = daemons(f.nodes["gpu-0100"].root)
        k = Kube(Target(kubeconfig=f.kubeconfig))
        wait(lambda: m.NodeView.from_node(k.get(node_path("gpu-0100"))).driver == NEW, 60, lambda: d.log)
        assert NEW in loaded(f, "gpu-0100")
        assert (f.nodes["gpu-0100"].root / "var/lib/driverd/node-driver.json").exists()
        labels = k.get(node_path("gpu-0100"))["metadata"]["labels"]
        assert labels.get(m.L_READY) == "true"
        rc, _ = d.stop()
        assert rc == 0
        # the machine reboots (nothing loaded) while its desired driver changed: it loads back what it ran
        from driverd.apply import lifecycle as lc
        from driverd.config import load
        from driverd.root import Root
        from driverd.runner import Runner
        r = Root(str(f.nodes["gpu-0100"].root))
        lc.make_context(r, Runner(), load(r, None, environ={}), "sim").kernel.reboot()
        assert loaded(f, "gpu-0100") == ""
        set_version(f, "gpu-0100", OLD)
        d = daemons(f.nodes["gpu-0100"].root)
        wait(lambda: NEW in loaded(f, "gpu-0100"), 60, lambda: d.log)
        d.wait_log(rf"keeps its driver {NEW}", 30)
        time.sleep(2)
        assert NEW in loaded(f, "gpu-0100") and OLD not in loaded(f, "gpu-0100"), d.log
        rc, _ = d.stop()
        assert rc == 0
    finally:
        f.stop()


def test_a_node_joining_a_pool_converges_to_the_pools_driver_before_it_is_ready(tmp_path, daemons, deployed):
    """A DriverPool wants NEW; the configuration (the ConfigMap) still says OLD. A machine that joins with
    the pool's label installs NEW — not OLD, and with no rollout needed — and is labelled ready on it."""
    from driverd.cluster import pools as pl
    from driverd.cluster.kube import pool_path, rollout_path
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    try:
        f.start()                                          # gpu-0000: in no pool, on OLD
        k = Kube(Target(kubeconfig=f.kubeconfig))
        k.create(pool_path(), {"apiVersion": pl.API_VERSION, "kind": pl.KIND, "metadata": {"name": "h100"},
                               "spec": {"driver": NEW, "nodeSelector": {"matchLabels": {"pool": "h100"}}}})
        f.join("gpu-0100", {"pool": "h100"}, start=False)
        cluster_node(f, "gpu-0100", "config_check_s = 1\n")                       # its configuration says OLD
        seen_ready: list[str] = []

        def on_new() -> bool:
            labels = k.get(node_path("gpu-0100"))["metadata"].get("labels") or {}
            if labels.get(m.L_READY) == "true":
                seen_ready.append(labels.get(m.L_VERSION, ""))
            return labels.get(m.L_VERSION) == NEW and labels.get(m.L_READY) == "true"
        d = daemons(f.nodes["gpu-0100"].root)
        wait(on_new, 60, lambda: d.log)
        assert NEW in loaded(f, "gpu-0100") and set(seen_ready) == {NEW}, seen_ready   # never ready on another
        assert f"node gpu-0100 installs {NEW} at once, joining: pool h100's driver" in d.log, d.log
        wait(lambda: ((k.get(pool_path("h100")).get("status") or {}).get("nodes") or {}).get("current") == 1, 30,
             lambda: k.get(pool_path("h100")).get("status"))
        assert k.list(rollout_path())["items"] == []        # a joining node needs no rollout
        assert m.NodeView.from_node(k.get(node_path("gpu-0000"))).driver == OLD     # in no pool: untouched
        rc, _ = d.stop()
        assert rc == 0
    finally:
        f.stop()
