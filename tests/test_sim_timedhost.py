"""driverd.sim.timedhost: a simulated node's work is wall-clock time of the measured durations (the
sleeps it asks for, recorded here), never the host tree's file work, and the host answers the
cluster agent as driverd.cluster.nodehost.LocalHost does: the running driver, its GPU users, the
preflight, a transaction that rolls back or is refused while a GPU is in use."""
from __future__ import annotations

import pytest

from driverd.apply.preflight import driver_config
from driverd.config import load
from driverd.root import Root
from driverd.sim.fleet import CONFIG, NEW, OLD
from driverd.sim.timedhost import RELOAD_S, VALIDATE_S, NodeCosts, TimedHost


@pytest.fixture
def cfg(tmp_path):
    (tmp_path / "etc/driverd").mkdir(parents=True)
    (tmp_path / "etc/driverd/config.toml").write_text(CONFIG.format(version=OLD, repo=tmp_path / "repo"))
    return load(Root(str(tmp_path)), None, environ={})


def _host(slept: list, **costs) -> TimedHost:
    return TimedHost("gpu-0000", NodeCosts(**{"reload_s": 4.0, "validate_s": 1.5, "preflight_s": 0.25, **costs}),
                     loaded=(OLD, "open"), kernel="6.1.0-47-cloud-amd64", sleep=slept.append)


def test_the_defaults_are_the_measured_reload_and_workload_check():
    c = NodeCosts()
    assert (c.reload_s, c.validate_s, c.preflight_s) == (RELOAD_S, VALIDATE_S, 0.0) == (4.5, 2.46, 0.0)
    assert c.work_s == pytest.approx(6.96)


def test_a_transaction_costs_the_reload_and_the_check_and_changes_the_driver(cfg):
    slept: list = []
    h = _host(slept)
    res = h.transact(driver_config(cfg, NEW, "auto", source="test"))
    assert res.converged and res.loaded == {"version": NEW, "flavor": "open"}
    assert slept == [4.0, 1.5]
    assert h.loaded(cfg) == {"version": NEW, "flavor": "open"} and h.transactions == 1
    # the same driver again: nothing to do, nothing slept
    assert h.transact(driver_config(cfg, NEW, "open", source="test")).converged and slept == [4.0, 1.5]


def test_a_failing_load_rolls_back_to_the_previous_driver(cfg):
    slept: list = []
    h = _host(slept)
    h.fail_reload = True
    res = h.transact(driver_config(cfg, NEW, "auto", source="test"))
    assert res.state == "failed" and res.failure == "rolled-back" and "rolled back to " + OLD in res.reason
    assert slept == [4.0, 4.0, 1.5]               # the new load, the old one again, the check
    assert h.loaded(cfg) == {"version": OLD, "flavor": "open"}


def test_a_gpu_in_use_refuses_the_transaction_and_the_preflight(cfg):
    slept: list = []
    h = _host(slept)
    h.start_process("uid-1", "python", "/dev/nvidia0")
    assert h.gpu_users(cfg) == {"uid-1": "its process %d (python) has /dev/nvidia0 open" % h.processes["uid-1"][0]}
    res = h.transact(driver_config(cfg, NEW, "auto", source="test"))
    assert res.state == "blocked" and "/dev/nvidia0" in res.reason and slept == []
    assert h.loaded(cfg)["version"] == OLD
    # the preflight judges the host after the drain: a pod that leaves does not hold it back
    ok = h.preflight(cfg, "r/u/1", NEW, "auto", leaving={"uid-1"}, staying={})
    assert ok["ok"] and ok["needed"] and ok["flavor"] == "open" and ok["current"] == f"{OLD}/open"
    no = h.preflight(cfg, "r/u/1", NEW, "auto", leaving=set(), staying={"uid-1": "gpu/p: a static pod"})
    assert not no["ok"] and "gpu/p: a static pod" in no["reasons"][0]
    assert slept == [0.25, 0.25]
    h.end_process("uid-1")
    assert h.gpu_users(cfg) == {} and h.transact(driver_config(cfg, NEW, "auto", source="test")).converged


def test_a_node_running_the_target_needs_nothing(cfg):
    h = _host([], reload_s=0.0)
    assert h.preflight(cfg, "r/u/1", OLD, "open", leaving=set(), staying={})["needed"] is False


def test_a_reboot_unloads_the_driver_and_changes_the_boot_id(cfg):
    h = _host([])
    h.start_process("uid-1", "python", "/dev/nvidia0")
    before = h.boot_id(cfg)
    h.reboot()
    assert h.loaded(cfg) is None and h.gpu_users(cfg) == {} and h.boot_id(cfg) != before


def test_a_daemon_in_another_process_sees_the_played_kubelets_gpu_processes(tmp_path, cfg):
    """Fleet.spawn_group: the played kubelet's host shares its GPU processes through a file, the
    daemon's host (another process) reads them; the reader never writes the file."""
    path = str(tmp_path / "gpu-0001.processes.json")
    kubelet = TimedHost("gpu-0001", NodeCosts(0, 0, 0), loaded=(OLD, "open"), kernel="6.1.0-47-cloud-amd64")
    daemon = TimedHost("gpu-0001", NodeCosts(0, 0, 0), loaded=(OLD, "open"), kernel="6.1.0-47-cloud-amd64",
                       processes_file=path)
    assert daemon.gpu_users(cfg) == {}                  # nothing shared yet: no file
    kubelet.start_process("uid-a", "train", "/dev/nvidia0")
    kubelet.share(path)
    kubelet.start_process("uid-b", "nvidia-device-plugin", "/dev/nvidiactl")
    users = daemon.gpu_users(cfg)
    assert set(users) == {"uid-a", "uid-b"} and "/dev/nvidiactl" in users["uid-b"]
    daemon.reboot()                                     # the reader's own record: the file stays the kubelet's
    assert set(daemon.gpu_users(cfg)) == {"uid-a", "uid-b"}
    kubelet.end_process("uid-a")
    assert set(daemon.gpu_users(cfg)) == {"uid-b"} and daemon.pod_uids() == {"uid-b"}
