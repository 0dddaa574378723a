"""`driverd daemon` in cluster mode never changes a working driver outside admission (issue 33): an
edit of the configuration's driver.version (the ConfigMap) leaves a node that has a driver on it, a
rebooted node loads back what it ran, and only a joining node — no driver, none ever converged to —
installs its desired driver directly. Real daemons against the real control plane, node-bound tokens,
deploy/'s admission policies."""
from __future__ import annotations

import json
import os
import time

from driverd.cluster import model as m
from driverd.cluster.kube import Kube, Target, node_path
from driverd.sim.fleet import NEW, OLD, Fleet
from tests.controlplane import reset
from tests.daemon.conftest import cluster_node, journal_runs, passes_later



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
        rec = json.loads((f.nodes["gpu-0100"].root / "var/lib/driverd/daemon/converged.json").read_text())
        assert rec["driver"]["version"] == NEW              # the one record of the converge
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


def add_settings(f: Fleet, node: str, toml: str) -> None:
    """The ConfigMap edited with more driver settings (a new inode, as the kubelet swaps the file)."""
    p = f.nodes[node].root / "etc/driverd/config.toml"
    tmp = p.with_suffix(".new")
    tmp.write_text(p.read_text() + toml)
    os.replace(tmp, p)


def gpu_processes(f: Fleet, node: str) -> list[str]:
    """The GPU processes on the node's host tree (the fleet's GPU pod's, while it runs)."""
    return sorted(c.parent.name for c in (f.nodes[node].root / "proc").glob("*/cgroup") if "kubepods" in c.read_text())


def test_a_configmap_edit_of_driver_settings_waits_for_a_rollout_and_the_rollout_applies_it(tmp_path, daemons,
                                                                                         deployed):
    """Issue 42: module parameters, the module set and the unload policy edited in the ConfigMap reload
    nothing and kill nothing on a node outside a rollout: the node stays ready and says what waits; a
    DriverRollout of the same driver applies them, drained."""
    from driverd.cluster.kube import rollout_path
    from tests.conftest import run_cli
    from tests.kmod.conftest import kernel_of
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    try:
        root = cluster_node(f, "gpu-0000", "config_check_s = 1\n")
        d = daemons(root)
        k = Kube(Target(kubeconfig=f.kubeconfig))
        wait(lambda: (k.get(node_path("gpu-0000"))["metadata"].get("labels") or {}).get(m.L_VERSION) == OLD, 30,
             lambda: d.log)
        d.wait_log(r"converged: driver", 30)
        runs, procs = len(journal_runs(root)), gpu_processes(f, "gpu-0000")
        assert procs, "the GPU pod's process is on the host"
        mark = len(d.lines)
        add_settings(f, "gpu-0000", '[modules]\nunload_policy = "terminate"\nload_drm = true\n'
                     '[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = "0"\n')
        d.wait_log(r"waits for a DriverRollout to apply: configuration: "
                   r"modules\.parameters\.nvidia\.NVreg_EnableGpuFirmware: \(unset\) -> \"0\"; "
                   r"modules\.load_drm: \(unset\) -> true; modules\.unload_policy: \"refuse\" -> \"terminate\"", 30,
                   start=mark)
        passes_later(d)
        passes_later(d)
        kern = kernel_of(root)
        assert kern.modules()["nvidia"].parameters.get("NVreg_EnableGpuFirmware") != "0", d.log
        assert "nvidia_drm" not in kern.loaded_names()
        assert len(journal_runs(root)) == runs, "the daemon ran a transaction outside a rollout"
        assert gpu_processes(f, "gpu-0000") == procs, "the GPU job was killed outside a rollout"
        assert d.get("/readyz")[0] == 200 and "not converged" not in "\n".join(d.lines[mark:]), d.log
        v = m.NodeView.from_node(k.get(node_path("gpu-0000")))
        assert v.state == m.IDLE and not v.unschedulable and "NVreg_EnableGpuFirmware" in v.waiting, v
        st = run_cli("status", "--root", str(root), "--json")
        w = __import__("json").loads(st.stdout)["wanted"]
        assert w["in_sync"] and any("NVreg_EnableGpuFirmware" in x for x in w["cluster"]["waiting"]), w
        text = run_cli("status", "--root", str(root)).stdout
        assert "waiting for a rollout: configuration: " in text and "in sync: the host runs what the cluster keeps" \
            in text, text

        # a rollout of the same driver carries the change: preflight says needed, the node is drained
        k.create(rollout_path(), {"apiVersion": "driverd.io/v1alpha1", "kind": "DriverRollout",
                                  "metadata": {"name": "settings"}, "spec": {"driver": OLD}})
        states: list[str] = []

        def done() -> bool:
            v = m.NodeView.from_node(k.get(node_path("gpu-0000")))
            if not states or states[-1] != v.state:
                states.append(v.state)
            return v.state == m.DONE
        wait(done, 120, lambda: (states, d.log[-3000:]))
        # drained: the transitions' Events (polling the Node can miss a state that lasts milliseconds)
        reasons = {e.get("reason") for e in k.list("/api/v1/namespaces/default/events")["items"]
                   if e["involvedObject"].get("name") == "gpu-0000"}
        assert {"Cordoned", "Unloading"} <= reasons, (reasons, states)     # "Unloading": no GPU pods left
        kern = kernel_of(root)
        assert kern.modules()["nvidia"].parameters.get("NVreg_EnableGpuFirmware") == "0"
        assert "nvidia_drm" in kern.loaded_names()
        assert len(journal_runs(root)) > runs
        wait(lambda: m.NodeView.from_node(k.get(node_path("gpu-0000"))).waiting == "", 30, lambda: d.log)
        mark = len(d.lines)
        passes_later(d)
        assert "waits for a DriverRollout" not in "\n".join(d.lines[mark:])
        rc, _ = d.stop()
        assert rc == 0
    finally:
        f.stop()


def test_driver_commands_on_a_cluster_node_are_refused_unless_forced_with_a_reason(tmp_path, daemons, deployed):
    """Issue 42: `driverd apply/reload/rollback/install…` on a node whose driver the cluster owns would skip
    cordon, drain and admission (and the daemon would swap the driver back): refused in one line naming
    the rollout that does it; --force needs --reason, which is recorded as an Event on the Node."""
    from tests.conftest import run_cli
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed, gpu_processes=False).build()     # nothing holds the GPU
    try:
        root = cluster_node(f, "gpu-0000", "config_check_s = 1\n")
        set_version(f, "gpu-0000", NEW)                  # the configuration wants NEW; the node runs OLD
        before = loaded(f, "gpu-0000")
        for argv in (["apply"], ["reload"], ["rollback"], ["unload"], ["load"],
                     ["install", str(next(f.repo.glob(f"driverd-{NEW}-*.tar.zst")))], ["rollback-install"]):
            r = run_cli(*argv, "--root", str(root))
            assert r.returncode == 3, (argv, r.stdout, r.stderr)
            line = r.stderr.strip().splitlines()[-1]
            assert f"the cluster owns node gpu-0000's driver" in line and "cluster.kubeconfig is set" in line
            assert "kubectl driverd rollout start --driver VERSION --selector kubernetes.io/hostname=gpu-0000" in line
            assert "--force --reason" in line and r.stderr.count("\n") == 1, r.stderr
        assert loaded(f, "gpu-0000") == before
        r = run_cli("apply", "--root", str(root), "--force")
        assert r.returncode == 2 and "--force needs --reason" in r.stderr, r.stderr
        r = run_cli("apply", "--root", str(root), "--dry-run")         # a preview changes nothing: allowed
        assert r.returncode == 0, r.stderr
        r = run_cli("apply", "--root", str(root), "--force", "--reason", "ticket OPS-1: hotfix", "--json")
        assert r.returncode == 0, r.stderr
        out = __import__("json").loads(r.stdout)
        assert NEW in loaded(f, "gpu-0000")
        assert any("forced outside a DriverRollout on a cluster node: ticket OPS-1: hotfix" in w
                   for w in out["warnings"]), out["warnings"]
        k = Kube(Target(kubeconfig=f.kubeconfig))
        evs = [e for e in k.list("/api/v1/namespaces/default/events")["items"]
               if e["involvedObject"].get("name") == "gpu-0000" and e.get("reason") == "ManualDriverChange"]
        assert evs and "driverd apply --force outside a DriverRollout (done): ticket OPS-1: hotfix" in evs[0]["message"]
        assert evs[0]["involvedObject"]["uid"] == k.get(node_path("gpu-0000"))["metadata"]["uid"]
    finally:
        f.stop()


def test_status_on_a_cluster_node_shows_what_the_cluster_keeps_not_a_bypass(tmp_path, daemons, deployed):
    """Issue 42: the configuration says NEW, the daemon keeps OLD (it waits for a rollout): `driverd status`
    says the node is in sync with what the cluster keeps and what waits, and never sends the operator to
    `driverd apply`."""
    from tests.conftest import run_cli
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    try:
        root = cluster_node(f, "gpu-0000", "config_check_s = 1\n")
        d = daemons(root)
        d.wait_log(r"converged: driver", 30)
        mark = len(d.lines)
        set_version(f, "gpu-0000", NEW)
        d.wait_log(rf"waits for a DriverRollout to apply: driver {NEW}/open \(configuration\)", 30, start=mark)
        passes_later(d)
        text = run_cli("status", "--root", str(root)).stdout
        assert f"wanted     {OLD} (open) from the cluster (node gpu-0000: the driver this node has" in text, text
        assert f"waiting for a rollout: driver {NEW}/open (configuration)" in text, text
        assert "in sync" in text and "DIFFERS" not in text and "driverd apply" not in text, text
        rc, _ = d.stop()
        assert rc == 0
    finally:
        f.stop()


def test_a_settings_edit_on_a_pools_nodes_is_carried_by_the_pools_next_revision(tmp_path, daemons, deployed):
    """Issue 42: a pool's members cannot be taken by a hand-made rollout, so before, a ConfigMap edit of
    their settings waited forever. The pool starts its next revision for it: the node is drained and the
    setting applied under the pool's policy, once — the pool converges and no further revision starts."""
    from driverd.cluster import pools as pl
    from driverd.cluster.kube import pool_path, rollout_path
    from tests.kmod.conftest import kernel_of
    reset(deployed)
    f = Fleet(tmp_path / "fleet", 1, server=deployed).build()
    try:
        root = cluster_node(f, "gpu-0000", "config_check_s = 1\n")
        k = Kube(Target(kubeconfig=f.kubeconfig))
        k.patch(node_path("gpu-0000"), {"metadata": {"labels": {"pool": "h100"}}})
        k.create(pool_path(), {"apiVersion": pl.API_VERSION, "kind": pl.KIND, "metadata": {"name": "h100"},
                               "spec": {"driver": OLD, "nodeSelector": {"matchLabels": {"pool": "h100"}}}})
        d = daemons(root)
        d.wait_log(r"converged: driver", 30)
        wait(lambda: ((k.get(pool_path("h100")).get("status") or {}).get("nodes") or {}).get("current") == 1, 30,
             lambda: k.get(pool_path("h100")).get("status"))
        assert k.list(rollout_path())["items"] == []            # on the pool's driver: nothing to roll out
        mark = len(d.lines)
        add_settings(f, "gpu-0000", '[modules.parameters.nvidia]\nNVreg_EnableGpuFirmware = "0"\n')
        d.wait_log(r"waits for a DriverRollout to apply: configuration: ", 30, start=mark)

        def rollouts() -> list[dict]:
            return [o for o in k.list(rollout_path())["items"] if (o["metadata"].get("labels") or {}).get(pl.L_POOL)
                    == "h100"]
        wait(lambda: len(rollouts()) == 1, 60, lambda: (k.get(pool_path("h100")).get("status"), d.log[-2000:]))
        r = rollouts()[0]
        assert r["metadata"]["name"] == "h100-1" and r["spec"]["driver"] == OLD
        wait(lambda: m.NodeView.from_node(k.get(node_path("gpu-0000"))).state == m.DONE, 120,
             lambda: (m.NodeView.from_node(k.get(node_path("gpu-0000"))), d.log[-3000:]))
        reasons = {e.get("reason") for e in k.list("/api/v1/namespaces/default/events")["items"]
                   if e["involvedObject"].get("name") == "gpu-0000"}
        assert {"Cordoned", "Unloading"} <= reasons, reasons                # drained, as a driver change is
        assert kernel_of(root).modules()["nvidia"].parameters.get("NVreg_EnableGpuFirmware") == "0"
        wait(lambda: m.NodeView.from_node(k.get(node_path("gpu-0000"))).waiting == "", 30, lambda: d.log)
        wait(lambda: ((k.get(pool_path("h100")).get("status") or {}).get("nodes") or {}).get("behind") == 0, 30,
             lambda: k.get(pool_path("h100")).get("status"))
        time.sleep(3)
        assert [o["metadata"]["name"] for o in rollouts()] == ["h100-1"]      # once: no loop
        rc, _ = d.stop()
        assert rc == 0
    finally:
        f.stop()
