"""`driverd daemon` in a cluster: the same process runs the node's rollout agent and the
coordinator election, upgrades the node when a DriverRollout admits it, and its own periodic
reconciles keep the driver the rollout left (the config file still names the old one)."""
from __future__ import annotations

import shutil
import signal
import time

from driverd.cluster import model as m
from driverd.cluster.kube import Kube, Target, node_path, rollout_path
from driverd.sim.fleet import NEW, OLD, Fleet
from tests.controlplane import reset
from tests.kubetools import conditions
from tests.daemon.conftest import cluster_node, passes_later


def test_daemon_takes_part_in_a_rollout_and_keeps_its_result(tmp_path, daemons, deployed):
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    try:
        root = cluster_node(f, "gpu-0000")        # the node-bound token of deploy/'s ServiceAccount
        d = daemons(root)
        d.wait_log(r"cluster mode: node gpu-0000", 30)
        k = Kube(Target(kubeconfig=f.kubeconfig))
        end = time.monotonic() + 30
        while (k.get(node_path("gpu-0000"))["metadata"].get("labels") or {}).get(m.L_VERSION) != OLD:
            assert time.monotonic() < end, d.log
            time.sleep(0.2)
        k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                  "metadata": {"name": "r"}, "spec": {"driver": NEW}})
        end = time.monotonic() + 60
        while m.NodeView.from_node(k.get(node_path("gpu-0000"))).state != m.DONE:
            assert time.monotonic() < end, d.log
            time.sleep(0.3)
        assert NEW in (root / "proc/driver/nvidia/version").read_text()
        # several reconcile passes later the config's OLD has not come back
        passes_later(d)
        assert NEW in (root / "proc/driver/nvidia/version").read_text()
        v = m.NodeView.from_node(k.get(node_path("gpu-0000")))
        assert v.driver == NEW and not v.unschedulable
        rc, took = d.stop()
        assert rc == 0
    finally:
        f.stop()


def test_cluster_mode_off_by_default_on_a_host(tmp_path, daemons, deployed):
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    try:
        d = daemons(f.nodes["gpu-0000"].root)
        d.wait_log(r"listening on", 30)
        time.sleep(1)
        assert "cluster mode" not in d.log
        d.signal(signal.SIGTERM)
    finally:
        f.stop()


def test_gpu_driver_ready_follows_the_workload_check(tmp_path, daemons, deployed):
    """A loaded driver whose user-space is another version is not GPUDriverReady (reason
    NotWorkloadReady, the driver-ready label gone); with the matching user-space it is."""
    from driverd.host import pci
    from driverd.root import Root
    from tests import cudastandin
    from driverd.cluster.agent import CONDITION
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    try:
        root = f.nodes["gpu-0000"].root
        gpus = [g.pci_address for g in pci.classify(Root(root), pci.scan(Root(root), []), [])[0]]
        cudastandin.install(root, OLD, gpus)
        shutil.copy(f.node_kubeconfig("gpu-0000"), root / "etc/driverd/kubeconfig")
        cfgp = root / "etc/driverd/config.toml"
        cfgp.write_text(cfgp.read_text() + '[cluster]\nkubeconfig = "/etc/driverd/kubeconfig"\nnode_name = "gpu-0000"\n'
                        '[daemon]\ninterval_s = 1\nretry_min_s = 1\nretry_max_s = 1\n[validation]\nworkload = "on"\n')
        d = daemons(root)
        k = Kube(Target(kubeconfig=f.kubeconfig))

        def condition() -> tuple[dict, dict]:
            node = k.get(node_path("gpu-0000"))
            conds = conditions(node)
            return conds.get(CONDITION) or {}, node["metadata"].get("labels") or {}

        end = time.monotonic() + 40
        while (condition()[0].get("reason"), condition()[0].get("status")) != ("DriverLoaded", "True") or \
                "workload-ready" not in condition()[0].get("message", ""):
            assert time.monotonic() < end, (condition(), d.log)
            time.sleep(0.3)
        assert condition()[1].get(m.L_READY) == "true"

        cudastandin.install(root, NEW, gpus)               # another version's libraries in front
        end = time.monotonic() + 40
        while condition()[0].get("reason") != "NotWorkloadReady":
            assert time.monotonic() < end, (condition(), d.log)
            time.sleep(0.3)
        cond, labels = condition()
        assert cond["status"] == "False" and f"user-space {NEW} does not match the loaded kernel driver {OLD}" in \
            cond["message"]
        assert m.L_READY not in labels
        rc, _ = d.stop()
        assert rc == 0
    finally:
        f.stop()


def test_a_kernel_installed_without_its_driver_package_is_a_warning_event_on_the_node(tmp_path, daemons, deployed):
    """Issue 43: the daemon's kernel watch in cluster mode: a newer kernel it cannot prepare is a Warning Event
    KernelUnprepared on the Node (accepted by deploy/'s admission policies), one prepared since a Normal Event
    KernelPrepared."""
    from driverd.sim.fakepkg import make_fake_package
    from driverd.sim.hosttree import install_kernel
    from tests.conftest import run_cli
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    nxt = "6.1.0-50-cloud-amd64"
    try:
        root = cluster_node(f, "gpu-0000")
        d = daemons(root)
        d.wait_log(r"cluster mode: node gpu-0000", 30)
        k = Kube(Target(kubeconfig=f.kubeconfig))

        def events(reason: str) -> list[dict]:
            return [e for e in k.list("/api/v1/namespaces/default/events")["items"]
                    if e["reason"] == reason and e["involvedObject"].get("name") == "gpu-0000"]

        install_kernel(root, nxt)
        end = time.monotonic() + 60
        while not events("KernelUnprepared"):
            assert time.monotonic() < end, d.log
            time.sleep(0.3)
        ev = events("KernelUnprepared")[0]
        assert ev["type"] == "Warning" and f"kernel {nxt} is installed without this node's driver package" in \
            ev["message"] and "fix: driverd prepare-kernel" in ev["message"], ev
        assert "cannot record an event" not in d.log, d.log
        make_fake_package(f.repo, OLD, nxt)                   # its package appears in the node's repository
        run_cli("repo", "index", str(f.repo), check=True)
        end = time.monotonic() + 60
        while not events("KernelPrepared"):
            assert time.monotonic() < end, d.log
            time.sleep(0.3)
        assert d.stop()[0] == 0
    finally:
        f.stop()
