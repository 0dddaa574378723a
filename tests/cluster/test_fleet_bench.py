"""bench/fleet.py on the real control plane (its own, started by the bench), CI-sized: its faults end in
defined, reported states, the observer's limits hold, nobody is left cordoned, the coordinator's own
process made every admission, and requests are counted by kube-apiserver across its restart.
Correctness only: the node work is shortened (timed hosts), nothing here judges speed."""
from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from tests.conftest import REPO


def _module():
    spec = importlib.util.spec_from_file_location("fleet_bench", REPO / "bench/fleet.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bench():
    from tests.controlplane import binaries
    binaries()                      # skips locally / fails in CI without the real control plane
    return _module()


ALL = "apiserver-restart,daemon-kill,pdb-never,node-notready,reload-fails,no-controller,two-pdbs,stuck-terminating"


def _args(tmp_path, **kw) -> argparse.Namespace:
    a = dict(apiserver="real", hosts="timed", reload_s=0.5, validate_s=0.2, preflight_s=0.0, seed=7, timeout=300,
             workdir=str(tmp_path), json=True, failure_budget=None, device_plugin=True)
    return argparse.Namespace(**(a | kw))


@pytest.mark.slow
def test_every_fault_ends_defined_with_nothing_left_cordoned(tmp_path):
    bench = _bench()
    # drain timeout 10 s: the faults that must end done (a daemon killed mid-drain, the API server restarted
    # while nodes drain) finish their drain late on a loaded machine; at 2 s one was failed in CI (issue 41)
    r = bench.run(_args(tmp_path, nodes=12, max_parallel=3, max_unavailable="25%", drain_timeout=10, faults=ALL))
    # no fault reaches past its node (an API server restart once left a pod Terminating on another)
    assert r["failed_without_fault"] == {}, r["failed_without_fault"]
    assert r["completed"] and r["phase"] == "Failed", (r["phase"], r["phase_reason"], r["fault_outcomes"])
    assert r["admissions_over_limit"] == 0 and r["limit_unavailable"] == 3
    assert r["left_cordoned_by_us"] == 0
    out = r["fault_outcomes"]
    assert out["pdb-never"]["state"] == "failed" and "EvictionBlocked" in out["pdb-never"]["reason"]
    assert out["reload-fails"]["state"] == "failed" and "RolledBack" in out["reload-fails"]["reason"]
    assert out["no-controller"]["state"] == "failed" and "no controller" in out["no-controller"]["reason"]
    assert out["two-pdbs"]["state"] == "failed" and "answered 500" in out["two-pdbs"]["reason"]
    assert out["stuck-terminating"]["state"] == "failed" and "stuck Terminating" in out["stuck-terminating"]["reason"]
    for f in ("apiserver-restart", "daemon-kill", "node-notready"):
        assert out[f]["state"] == "done", (f, out[f])
    assert r["final_states"] == {"done": 7, "failed": 5}
    # the coordinator ran in its own process and wrote the admissions; every one came from a Lease holder
    # (the API server's restart can outlast the Lease on a loaded machine: another daemon then takes it over
    # and admits the rest, which is the takeover working, not a fault)
    assert sum(r["admitted_by"].values()) == 12 and r["coordinator"] in r["admitted_by"], r["admitted_by"]
    assert r["cpu_s"]["coordinator"] > 0
    # the ideal comes from a one-node rollout of the same run, not from the big rollout's own times
    # (both rounded from the same time: one_node_s to 3 places, ideal_s to 2, so they agree to 0.01)
    assert r["one_node_s"] > 0 and abs(r["ideal_s"] - 4 * r["one_node_s"]) <= 0.011
    assert r["work_round_s"] >= 0.7 and r["node_work_s"] == 0.7
    # requests as kube-apiserver counted them, across its restart: its audit log has every request of
    # driverd's ServiceAccount; its own counter, summed over both lifetimes, holds those and the
    # harness's and controller-manager's (the counter of the new process alone starts from 0)
    assert r["apiserver"] == "real" and r["apiserver_restarts"] == 1
    assert r["api_requests_counted_by"] == "audit log" and 10 <= r["api_requests_per_node"] <= 60
    assert r["api_requests_per_node_metrics"] >= r["api_requests_per_node"]
    assert r["cpu_s"]["apiserver"] > 0 and r["cpu_s"]["etcd"] > 0


@pytest.mark.slow
def test_rollouts_one_after_the_other_on_one_fleet(tmp_path):
    """--max-parallel 2,1: the fleet goes to the new driver and back, each rollout measured on its own;
    the daemons run in two processes of their own (--node-processes 2)."""
    bench = _bench()
    res = bench.run(_args(tmp_path, nodes=3, max_parallel="2,1", max_unavailable="2", drain_timeout=5, faults="",
                          node_processes=2, timeline=str(tmp_path / "timeline.jsonl")))
    runs = res["runs"]
    assert [r["max_parallel"] for r in runs] == [2, 1] and runs[0]["target"] != runs[1]["target"]
    for r in runs:
        assert r["phase"] == "Completed" and r["final_states"] == {"done": 3}, r
        assert r["admissions_over_limit"] == 0 and r["left_cordoned_by_us"] == 0
        assert r["max_unavailable_seen"] <= r["effective_parallel"]
        assert r["admitted_by"] == {r["coordinator"]: 3}
        assert r["daemon_processes"] == 2
        # the GPU pods the first drain evicted came back (their controller's part): the second drains them too
        assert r["api_requests_by_kind"]["create pods/eviction"] == 1.0, r["api_requests_by_kind"]
        assert set(r["per_state_p90_s"]) == set(r["per_state_median_s"]), r
        assert r["machine"]["saturated_s"] >= 0 and r["machine"]["busy_cores_peak_1s"] > 0, r["machine"]
        # the two daemon processes were sampled too (their CPU, second by second)
        assert r["machine"]["daemon_processes_saturated_s"] >= 0 and \
            r["machine"]["daemon_process_busy_p90_1s"] is not None, r["machine"]
    # --timeline: each rollout's nodes, when each state was seen
    lines = [json.loads(x) for x in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert [x["max_parallel"] for x in lines] == [2, 1]
    assert all(set(t) >= {"admitted", "done"} and t["admitted"] < t["done"]
               for x in lines for t in x["nodes"].values()) and len(lines[0]["nodes"]) == 3, lines


def test_saturation_counts_the_seconds_the_machine_had_no_cpu_to_spare(monkeypatch):
    """The bench says when its makespan measures the machine: seconds with >= 90% of the cores busy."""
    mod = _module()
    busy = iter([0.0, 1.95, 2.9, 4.9, 6.85] + [6.85] * 1000)   # busy CPU seconds at each sample
    clock = iter([float(i) for i in range(1000)])
    monkeypatch.setattr(mod, "_busy_s", lambda: next(busy))
    monkeypatch.setattr(mod.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(mod.os, "cpu_count", lambda: 2)
    s = mod.Saturation(step=1.0)
    s.stop.wait = lambda t, n=iter([False] * 4 + [True]): next(n)        # four samples, then stop
    s._run()
    assert [round(x, 2) for x in s.samples] == [1.95, 0.95, 2.0, 1.95]
    out = s.summary()
    assert out["saturated_s"] == 3.0 and out["busy_cores_peak_1s"] == 2.0, out
    assert "daemon_processes_saturated_s" not in out         # no daemon processes: threads here


def test_a_daemon_process_at_a_whole_core_is_counted_and_the_bench_says_why(monkeypatch):
    """One interpreter runs Python on one core at a time: a process of node daemons at a whole core
    holds its daemons back while the machine has cores to spare, and the bench says so."""
    mod = _module()
    busy = iter([0.0, 3.0, 6.0, 9.0, 12.0] + [12.0] * 1000)      # 3 of 16 cores: the machine is not saturated
    clock = iter([float(i) for i in range(1000)])
    cpu = {11: iter([0.0, 0.5, 1.45, 2.45, 2.6]), 12: iter([0.0, 0.2, 0.4, 0.6, 0.8])}
    monkeypatch.setattr(mod, "_busy_s", lambda: next(busy))
    monkeypatch.setattr(mod.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(mod.os, "cpu_count", lambda: 16)
    s = mod.Saturation(step=1.0, pids=[11, 12], cpu_of=lambda pid: next(cpu[pid]))
    s.stop.wait = lambda t, n=iter([False] * 4 + [True]): next(n)
    s._run()
    assert [round(x, 2) for x in s.proc_samples] == [0.5, 0.95, 1.0, 0.2]
    out = s.summary()
    assert out["saturated_s"] == 0 and out["daemon_processes_saturated_s"] == 2.0, out
    assert out["daemon_process_busy_p90_1s"] == 0.95, out
    r = {"machine": {"rollout_wall_s": 4.0, **out}, "per_state_median_s": {"admitted": 5.3}, "daemon_processes": 2}
    (line,) = mod._why_slow(r)
    assert "a process of node daemons used a whole core for 2.0 s of 4.0 s" in line and "5.3 s" in line, line
    assert "more --node-processes (now 2)" in line, line
    r["machine"] |= {"saturated_s": 3.0}
    assert [x.split(" for ")[0] for x in mod._why_slow(r)] == ["the machine had no core to spare",
                                                              "a process of node daemons used a whole core"]
    r["machine"] |= {"saturated_s": 0}
    r["per_state_median_s"] = {}                     # no node reached `admitted`: the words leave the median out
    (line,) = mod._why_slow(r)
    assert "None" not in line and "median" not in line and "whole core for 2.0 s of 4.0 s: its daemons" in line, line
    r["machine"] |= {"saturated_s": 0.3, "daemon_processes_saturated_s": 0.3}     # under a tenth: nothing said
    assert mod._why_slow(r) == []


@pytest.mark.slow
def test_failures_beyond_the_budget_pause_the_rollout_and_the_bench_says_so(tmp_path):
    """On simulated host trees (--hosts files): the real node transaction in every node."""
    bench = _bench()
    r = bench.run(_args(tmp_path, hosts="files", nodes=3, max_parallel=1, max_unavailable="1", seed=1, drain_timeout=1,
                        timeout=120, faults="two-pdbs", failure_budget=0, device_plugin=False))
    assert r["phase"] == "Paused" and not r["completed"], r
    assert r["final_states"].get("failed") == 1 and r["left_cordoned_by_us"] == 0
    assert r["work_round_s"] is None and r["coordinator"] is None


def test_the_daemons_get_a_process_per_250_unless_told():
    """At 500 daemons a process, on 16 cores, they reacted to their admission 5.3 s late (docs/testing.md):
    the default keeps a process at 250 or fewer; what is asked is what runs (0: threads here)."""
    mod = _module()
    assert [mod.node_processes(None, n) for n in (3, 500, 1000, 1001, 2000)] == [4, 4, 4, 5, 8]
    assert mod.node_processes(2, 2000) == 2 and mod.node_processes(0, 2000) == 0
